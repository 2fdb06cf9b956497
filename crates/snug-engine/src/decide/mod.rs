//! Typed decisions on a causal model: a state text and named closed
//! questions (choice, score, yes/no), answered with probabilities instead
//! of generated text, in Laya's `/v1/systemone` request and response
//! shapes.
//!
//! **How.** The state is prefilled once into a sequence (sharing whatever
//! the prefix cache holds). Every question is a branch: a copy-on-write
//! fork of the state's sequence, to which the question's text is appended;
//! all branches run as one batched forward, each branch's rows attending
//! to the shared state pages and to its own tokens only. The next-token
//! distribution at each branch's last row scores the options by the
//! log-probability of their labels (a letter per choice option, a digit or
//! letter per score level, Yes/No; numbers past 26 options), each label
//! counted with and without a leading space; a label of several tokens is
//! teacher-forced through forks of its branch in one more forward. A model's label scores carry a bias of their own
//! (towards the first letter, or towards "No") whatever the state says,
//! so each question is also asked about a content-free state ("N/A") and
//! its label scores there are subtracted (contextual calibration, Zhao et
//! al. 2021); those priors are kept per question text, so a question
//! asked again costs no extra rows. Probabilities are a softmax of the
//! corrected scores divided by a temperature per question type and
//! option-count bucket ([`Temperatures`], clamped to [0.5, 5]; 1.0 until
//! calibrated).
//!
//! Batch invariance makes every answer the same whether its question is
//! asked alone or with others.

//!
//! The module's parts: the request's shapes on the wire (`wire.rs`), how
//! a state and its questions become tokens (`framing.rs`), scoring them
//! on the engine (`score.rs`), and fitting the temperatures (`fit.rs`).

use serde::{Deserialize, Serialize};

use crate::EngineError;

mod fit;
mod framing;
mod score;
mod wire;

pub use fit::*;
pub use framing::*;
pub use score::*;
pub use wire::*;

/// The three question types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Choice,
    Score,
    Noul,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Choice => "choice",
            Kind::Score => "score",
            Kind::Noul => "noul",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Most options a choice question may have (as Laya).
pub const MAX_OPTIONS: usize = 100;
/// Most levels a score question may have (as Laya).
pub const MAX_LEVELS: usize = 32;
/// Most questions in one request.
pub const MAX_QUESTIONS: usize = 64;

/// A question, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Question {
    pub name: String,
    pub kind: Kind,
    pub instructions: String,
    /// Options in order: (key, description). For score, the key is the
    /// level's index; for noul, `false` then `true`.
    pub options: Vec<(String, Option<String>)>,
}

/// Why a request cannot be answered.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The request is malformed (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// The state and a question do not fit the context (HTTP 422).
    #[error(
        "question {question:?}: the state ({state} tokens) and the question ({question_tokens} tokens) need {needed} positions; the context holds {limit}"
    )]
    TooLong {
        question: String,
        state: usize,
        question_tokens: usize,
        needed: usize,
        limit: usize,
    },
    /// The state and a question fit the context but not the KV memory
    /// budget the engine was given (HTTP 503, as a generation that never
    /// fits).
    #[error(
        "question {question:?}: the state and the question need {needed} positions; the KV memory budget holds {fits}"
    )]
    OverBudget {
        question: String,
        needed: usize,
        fits: usize,
    },
    /// A question's options do not fit the encoder's token budget (HTTP 422).
    #[error("{0}")]
    Capacity(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the chat template failed: {0}")]
    Template(String),
}

#[cfg(test)]
mod tests;
