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

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use snug_model::template::{ChatTemplate, Message};
use snug_model::{EncodeOptions, Tokenizer};

use crate::StepRow;
use crate::{Engine, EngineError, SeqId};

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
    /// A question's options do not fit the encoder's token budget (HTTP 422).
    #[error("{0}")]
    Capacity(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the chat template failed: {0}")]
    Template(String),
}

fn render(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Reads the `questions` object of a request: a map from name to
/// `{type, instructions, criteria}`. `criteria` is, for choice, a map from
/// key to description (or null) or a list of keys; for score, a list of
/// level descriptions; for noul, optionally `{"true": ..., "false": ...}`.
/// `options` (choice) and `levels` (score) are read as `criteria` too.
pub fn parse_questions(v: &Value) -> Result<Vec<Question>, DecideError> {
    let bad = |m: String| DecideError::Invalid(m);
    let obj = v
        .as_object()
        .ok_or_else(|| bad("'questions' must be an object from question name to question".into()))?;
    if obj.len() > MAX_QUESTIONS {
        return Err(bad(format!("too many questions ({} > {MAX_QUESTIONS})", obj.len())));
    }
    let mut out = Vec::with_capacity(obj.len());
    for (name, q) in obj {
        let q = q
            .as_object()
            .ok_or_else(|| bad(format!("question {name:?} must be an object")))?;
        let kind = match q.get("type").and_then(Value::as_str) {
            Some("choice") => Kind::Choice,
            Some("score") => Kind::Score,
            Some("noul") => Kind::Noul,
            other => {
                return Err(bad(format!(
                    "question {name:?}: unknown type {}; use one of choice, score, noul",
                    other.map_or("(none)".to_string(), |t| format!("{t:?}"))
                )))
            }
        };
        let instructions = match q.get("instructions") {
            Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
            Some(v) if !v.is_null() && !v.is_string() => render(v),
            _ => {
                return Err(bad(format!(
                    "question {name:?}: no 'instructions'; add the text the model should answer"
                )))
            }
        };
        let criteria = q
            .get("criteria")
            .or_else(|| q.get("options"))
            .or_else(|| q.get("levels"))
            .filter(|c| !c.is_null());
        let options: Vec<(String, Option<String>)> = match kind {
            Kind::Choice => match criteria {
                Some(Value::Object(m)) => m
                    .iter()
                    .map(|(k, d)| (k.clone(), (!d.is_null()).then(|| render(d)).filter(|d| !d.is_empty())))
                    .collect(),
                Some(Value::Array(a)) => {
                    let mut keys = Vec::new();
                    for k in a {
                        if k.is_null() || k.is_array() || k.is_object() {
                            return Err(bad(format!("question {name:?}: choice labels must be strings or numbers")));
                        }
                        keys.push((render(k), None));
                    }
                    keys
                }
                _ => {
                    return Err(bad(format!(
                        "question {name:?}: a choice question takes 'criteria' as a map of label -> description, or a list of labels"
                    )))
                }
            },
            Kind::Score => match criteria {
                Some(Value::Array(a)) if !a.is_empty() => {
                    let mut levels = Vec::new();
                    for (i, d) in a.iter().enumerate() {
                        if d.is_null() {
                            return Err(bad(format!(
                                "score question {name:?} has a null level at index {i}; give every level a description"
                            )));
                        }
                        levels.push((i.to_string(), Some(render(d))));
                    }
                    levels
                }
                _ => {
                    return Err(bad(format!(
                        "question {name:?}: a score question takes 'criteria' as a list of level descriptions, index 0 first"
                    )))
                }
            },
            Kind::Noul => {
                let mut t = None;
                let mut f = None;
                match criteria {
                    None => {}
                    Some(Value::Object(m)) => {
                        for (k, d) in m {
                            let d = (!d.is_null()).then(|| render(d));
                            match k.to_ascii_lowercase().as_str() {
                                "true" => t = d,
                                "false" => f = d,
                                _ => {
                                    return Err(bad(format!(
                                        "question {name:?}: noul criteria take only 'true' and 'false'"
                                    )))
                                }
                            }
                        }
                    }
                    Some(_) => {
                        return Err(bad(format!(
                            "question {name:?}: noul criteria must be an object with 'true' and 'false'"
                        )))
                    }
                }
                vec![("false".into(), f), ("true".into(), t)]
            }
        };
        if options.is_empty() {
            return Err(bad(format!("question {name:?} has no options")));
        }
        let most = if kind == Kind::Score { MAX_LEVELS } else { MAX_OPTIONS };
        if options.len() > most {
            return Err(bad(format!(
                "question {name:?} has {} options; at most {most} are supported",
                options.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some((k, _)) = options.iter().find(|(k, _)| !seen.insert(k.clone())) {
            return Err(bad(format!("question {name:?}: the label {k:?} appears twice")));
        }
        out.push(Question {
            name: name.clone(),
            kind,
            instructions,
            options,
        });
    }
    Ok(out)
}

/// Temperatures by question type and option-count bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Temperatures {
    /// Per type: choice, score, noul.
    pub temperature: [f32; 3],
    /// Per bucket (`choice:2`, `choice:3-5`, `choice:6-10`, `choice:11+`,
    /// and so for score and noul), over the type's value.
    #[serde(default)]
    pub temperature_by_options: BTreeMap<String, f32>,
}

impl Default for Temperatures {
    fn default() -> Self {
        Temperatures {
            temperature: [1.0; 3],
            temperature_by_options: BTreeMap::new(),
        }
    }
}

/// Temperatures are kept in [0.5, 5]; anything not a finite number is 1.
pub fn clamp_temperature(t: f32) -> f32 {
    if t.is_finite() {
        t.clamp(0.5, 5.0)
    } else {
        1.0
    }
}

/// The bucket of a question of `kind` with `k` options.
pub fn bucket(kind: Kind, k: usize) -> String {
    let size = match k {
        0..=2 => "2",
        3..=5 => "3-5",
        6..=10 => "6-10",
        _ => "11+",
    };
    format!("{}:{size}", kind.name())
}

impl Temperatures {
    pub fn get(&self, kind: Kind, k: usize) -> f32 {
        clamp_temperature(
            *self
                .temperature_by_options
                .get(&bucket(kind, k))
                .unwrap_or(&self.temperature[kind.index()]),
        )
    }

    /// All values clamped.
    pub fn clamped(mut self) -> Temperatures {
        for t in &mut self.temperature {
            *t = clamp_temperature(*t);
        }
        for t in self.temperature_by_options.values_mut() {
            *t = clamp_temperature(*t);
        }
        self
    }
}

/// How states and questions become tokens for one model: the chat
/// template's text before and after the user's message (or plain text
/// for a model without one), and the label tokens.
pub struct Framing {
    head: String,
    tail: String,
    add_bos: bool,
}

/// Marks where the user's message goes when the template is rendered.
const SLOT: &str = "\u{e000}SNUG-SLOT\u{e000}";

impl Framing {
    /// From the model's chat template (`None`: plain text).
    pub fn new(template: Option<&ChatTemplate>, tok: &Tokenizer) -> Result<Framing, DecideError> {
        let Some(t) = template.filter(|t| !t.is_fallback) else {
            return Ok(Framing {
                head: String::new(),
                tail: "\nAnswer:".into(),
                add_bos: true,
            });
        };
        let bos = tok.bos.and_then(|b| tok.token_text(b)).unwrap_or("").to_string();
        let eos = tok.eos.and_then(|e| tok.token_text(e)).unwrap_or("").to_string();
        let text = t
            .render(
                &[Message::new("user", SLOT)],
                true,
                &bos,
                &eos,
                BTreeMap::<String, String>::new(),
            )
            .map_err(|e| DecideError::Template(e.to_string()))?;
        let (head, tail) = text
            .split_once(SLOT)
            .ok_or_else(|| DecideError::Template("the template dropped the user's message".into()))?;
        Ok(Framing {
            add_bos: bos.is_empty() || !head.starts_with(&bos),
            head: head.to_string(),
            tail: tail.to_string(),
        })
    }

    /// The state's tokens: the template's head, then the state.
    pub fn state_tokens(&self, tok: &Tokenizer, state: &str) -> Vec<u32> {
        let mut ids = tok.encode(
            &self.head,
            EncodeOptions {
                add_special: self.add_bos,
                parse_special: true,
            },
        );
        ids.extend(tok.encode(
            &format!("{state}\n\n"),
            EncodeOptions {
                add_special: false,
                parse_special: false,
            },
        ));
        ids
    }

    /// A question's tokens (after the state), ending where the answer's
    /// first token goes.
    pub fn question_tokens(&self, tok: &Tokenizer, q: &Question) -> Vec<u32> {
        let mut ids = tok.encode(
            &question_text(q),
            EncodeOptions {
                add_special: false,
                parse_special: false,
            },
        );
        ids.extend(tok.encode(
            &self.tail,
            EncodeOptions {
                add_special: false,
                parse_special: true,
            },
        ));
        ids
    }
}

/// The label of option `i` of a question.
fn label(kind: Kind, k: usize, i: usize) -> String {
    match kind {
        Kind::Noul => ["No", "Yes"][i].to_string(),
        Kind::Score if k <= 9 => (i + 1).to_string(),
        _ if k <= 26 => ((b'A' + i as u8) as char).to_string(),
        _ => (i + 1).to_string(),
    }
}

/// The question as the model reads it.
fn question_text(q: &Question) -> String {
    use std::fmt::Write;
    let k = q.options.len();
    let mut s = format!("{}\n", q.instructions.trim());
    match q.kind {
        Kind::Choice => {
            s.push_str("Options:\n");
            for (i, (key, d)) in q.options.iter().enumerate() {
                let _ = match d {
                    Some(d) => writeln!(s, "{}. {key}: {d}", label(q.kind, k, i)),
                    None => writeln!(s, "{}. {key}", label(q.kind, k, i)),
                };
            }
            s.push_str(if k <= 26 {
                "Reply with one letter."
            } else {
                "Reply with one number."
            });
        }
        Kind::Score => {
            s.push_str("Scale:\n");
            for (i, (_, d)) in q.options.iter().enumerate() {
                let _ = writeln!(s, "{}. {}", label(q.kind, k, i), d.as_deref().unwrap_or(""));
            }
            s.push_str(if k <= 9 {
                "Reply with one number."
            } else {
                "Reply with one letter."
            });
        }
        Kind::Noul => {
            if let Some(d) = &q.options[1].1 {
                let _ = writeln!(s, "Yes means: {d}");
            }
            if let Some(d) = &q.options[0].1 {
                let _ = writeln!(s, "No means: {d}");
            }
            s.push_str("Reply Yes or No.");
        }
    }
    s
}

/// The spellings of a label that are scored: bare and after a space, as
/// token sequences. Where either is one token, only the one-token
/// spellings; otherwise both, scored by teacher forcing.
fn label_variants(tok: &Tokenizer, label: &str) -> Vec<Vec<u32>> {
    let opts = EncodeOptions {
        add_special: false,
        parse_special: false,
    };
    let mut all: Vec<Vec<u32>> = [label.to_string(), format!(" {label}")]
        .iter()
        .map(|v| tok.encode(v, opts))
        .filter(|ids| !ids.is_empty())
        .collect();
    all.dedup();
    if all.iter().any(|v| v.len() == 1) {
        all.retain(|v| v.len() == 1);
    }
    all
}

/// The one-token spellings of a label (empty when it has none).
fn label_tokens(tok: &Tokenizer, label: &str) -> Vec<u32> {
    label_variants(tok, label)
        .into_iter()
        .filter(|v| v.len() == 1)
        .map(|v| v[0])
        .collect()
}

/// The content-free state each question is also asked about.
pub const NEUTRAL_STATE: &str = "N/A";

/// One question's result before it is written out.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub question: Question,
    /// Log-probability of each option's label after the state.
    pub raw: Vec<f32>,
    /// `raw` less the label's log-probability after the content-free
    /// state: the scores the temperature divides.
    pub logprobs: Vec<f32>,
    pub temperature: f32,
    pub probabilities: Vec<f32>,
}

/// The softmax of `z / t`.
pub fn softmax_t(z: &[f32], t: f32) -> Vec<f32> {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = z.iter().map(|&x| (((x - m) / t) as f64).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|&x| (x / s) as f32).collect()
}

/// Log-softmax value of one token in a row of logits, in f64.
fn ln_p(row: &[f32], id: u32) -> f64 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m as f64 + row.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln();
    row[id as usize] as f64 - lse
}

/// Log-softmax value of `ids` (summed in probability) in a row of logits.
fn logprob_of(row: &[f32], ids: &[u32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m as f64 + row.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln();
    let p: f64 = ids.iter().map(|&i| ((row[i as usize] as f64) - lse).exp()).sum();
    p.max(1e-30).ln() as f32
}

/// The log-probability of each of `q`'s option labels in one row of
/// logits (the row after the question's last token).
pub fn score_row(tok: &Tokenizer, q: &Question, row: &[f32]) -> Vec<f32> {
    let k = q.options.len();
    (0..k)
        .map(|i| logprob_of(row, &label_tokens(tok, &label(q.kind, k, i))))
        .collect()
}

/// What a decision request used.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecideUsage {
    /// State tokens plus every question's tokens.
    pub input_tokens: usize,
    pub state_tokens: usize,
    /// State tokens taken from the prefix cache.
    pub cached_tokens: usize,
}

impl Engine<'_> {
    /// Answers `questions` about `state` (see the module's notes). Each
    /// question is a branch of the state's sequence; all branches run in
    /// one forward pass.
    pub fn decide(
        &mut self,
        tok: &Tokenizer,
        framing: &Framing,
        state: &str,
        questions: &[Question],
        temps: &Temperatures,
    ) -> Result<(Vec<Scored>, DecideUsage), DecideError> {
        let state_ids = framing.state_tokens(tok, state);
        let branches: Vec<Vec<u32>> = questions.iter().map(|q| framing.question_tokens(tok, q)).collect();
        let limit = self.options.ctx;
        for (q, b) in questions.iter().zip(&branches) {
            if state_ids.len() + b.len() > limit {
                return Err(DecideError::TooLong {
                    question: q.name.clone(),
                    state: state_ids.len(),
                    question_tokens: b.len(),
                    needed: state_ids.len() + b.len(),
                    limit,
                });
            }
        }
        // Per question, per option: the label's spellings.
        let labels: Vec<Vec<Vec<Vec<u32>>>> = questions
            .iter()
            .map(|q| {
                let k = q.options.len();
                (0..k).map(|i| label_variants(tok, &label(q.kind, k, i))).collect()
            })
            .collect();
        if let Some((q, _)) = questions.iter().zip(&labels).find(|(_, l)| l.iter().any(Vec::is_empty)) {
            return Err(DecideError::Invalid(format!(
                "question {:?}: an option label has no tokens in this model's vocabulary",
                q.name
            )));
        }
        let mut usage = DecideUsage {
            input_tokens: state_ids.len() + branches.iter().map(Vec::len).sum::<usize>(),
            state_tokens: state_ids.len(),
            cached_tokens: 0,
        };
        if questions.is_empty() {
            return Ok((Vec::new(), usage));
        }
        // Questions whose content-free prior is not known yet.
        let neutral = framing.state_tokens(tok, NEUTRAL_STATE);
        let prior_key = |b: &Vec<u32>| -> Vec<u32> { neutral.iter().chain(b).copied().collect() };
        let mut missing: Vec<usize> = Vec::new();
        for (i, b) in branches.iter().enumerate() {
            let k = prior_key(b);
            if !self.decide_priors.contains_key(&k) && !missing.iter().any(|&j| prior_key(&branches[j]) == k) {
                missing.push(i);
            }
        }
        let seq = self.create_sequence();
        let prior_seq = if missing.is_empty() {
            None
        } else {
            Some(self.create_sequence())
        };
        let mut seqs: Vec<SeqId> = Vec::new();
        // (branch, option, spelling, first row in the second forward)
        let mut conts: Vec<(usize, usize, usize, usize)> = Vec::new();
        let result = (|| -> Result<(Vec<f32>, Vec<f32>), DecideError> {
            usage.cached_tokens = self.share_prefix(seq, &state_ids)?;
            let held = self.tokens(seq)?.len();
            let mut rest: Vec<StepRow> = state_ids[held..].iter().map(|&t| StepRow::new(seq, t, false)).collect();
            if let Some(p) = prior_seq {
                rest.extend(neutral.iter().map(|&t| StepRow::new(p, t, false)));
            }
            if !rest.is_empty() {
                self.step(&rest)?;
            }
            for _ in questions {
                seqs.push(self.fork(seq)?);
            }
            if let Some(p) = prior_seq {
                for _ in &missing {
                    seqs.push(self.fork(p)?);
                }
            }
            let mut rows = Vec::with_capacity(usage.input_tokens);
            let order: Vec<usize> = (0..questions.len()).chain(missing.iter().copied()).collect();
            for (&s, &i) in seqs.iter().zip(&order) {
                let b = &branches[i];
                rows.extend(b.iter().enumerate().map(|(j, &t)| StepRow::new(s, t, j + 1 == b.len())));
            }
            let first = self.step(&rows)?.to_vec();
            // Labels of several tokens: each spelling's tokens but the last
            // are fed to a fork of its branch, in one more forward, for the
            // probabilities of the tokens after the first.
            let mut more = Vec::new();
            for (j, &i) in order.iter().enumerate() {
                for (o, variants) in labels[i].iter().enumerate() {
                    for (v, ids) in variants.iter().enumerate().filter(|(_, ids)| ids.len() > 1) {
                        let c = self.fork(seqs[j])?;
                        seqs.push(c);
                        conts.push((j, o, v, more.len()));
                        more.extend(ids[..ids.len() - 1].iter().map(|&t| StepRow::new(c, t, true)));
                    }
                }
            }
            let second = if more.is_empty() {
                Vec::new()
            } else {
                self.step(&more)?.to_vec()
            };
            Ok((first, second))
        })();
        for &s in &seqs {
            self.free_sequence(s);
        }
        if let Some(p) = prior_seq {
            self.free_sequence(p);
        }
        self.free_sequence(seq);
        let (logits, second) = result?;
        let vocab = self.model.config.vocab;
        // A branch's label scores: one-token spellings from its last row;
        // longer ones chained through the second forward's rows.
        let scores = |j: usize, i: usize| -> Vec<f32> {
            let row = &logits[j * vocab..(j + 1) * vocab];
            labels[i]
                .iter()
                .enumerate()
                .map(|(o, variants)| {
                    if variants.iter().all(|v| v.len() == 1) {
                        let ids: Vec<u32> = variants.iter().map(|v| v[0]).collect();
                        return logprob_of(row, &ids);
                    }
                    let p: f64 = variants
                        .iter()
                        .enumerate()
                        .map(|(v, ids)| {
                            let mut lp = ln_p(row, ids[0]);
                            if let Some(&(_, _, _, at)) = conts.iter().find(|c| c.0 == j && c.1 == o && c.2 == v) {
                                for (m, &t) in ids[1..].iter().enumerate() {
                                    let r = &second[(at + m) * vocab..(at + m + 1) * vocab];
                                    lp += ln_p(r, t);
                                }
                            }
                            lp.exp()
                        })
                        .sum();
                    p.max(1e-30).ln() as f32
                })
                .collect()
        };
        for (n, &i) in missing.iter().enumerate() {
            let prior = scores(questions.len() + n, i);
            self.decide_priors.insert(prior_key(&branches[i]), prior);
        }
        let scored = questions
            .iter()
            .zip(&branches)
            .enumerate()
            .map(|(i, (q, b))| {
                let raw = scores(i, i);
                let prior = &self.decide_priors[&prior_key(b)];
                let logprobs: Vec<f32> = raw.iter().zip(prior).map(|(r, p)| r - p).collect();
                let t = temps.get(q.kind, q.options.len());
                Scored {
                    question: q.clone(),
                    probabilities: softmax_t(&logprobs, t),
                    raw,
                    logprobs,
                    temperature: t,
                }
            })
            .collect();
        Ok((scored, usage))
    }
}

/// Laya's confidence: 1 - H(p)/ln k (choice, score); max(p, 1-p) for noul.
pub fn confidence(kind: Kind, p: &[f32]) -> f64 {
    let k = p.len();
    if kind == Kind::Noul {
        let t = p[1] as f64;
        return t.max(1.0 - t);
    }
    if k < 2 {
        return 1.0;
    }
    let h: f64 = p
        .iter()
        .map(|&x| {
            let x = (x as f64).clamp(1e-12, 1.0);
            -x * x.ln()
        })
        .sum();
    (1.0 - h / (k as f64).ln()).clamp(0.0, 1.0)
}

/// Jev's confidence, as Laya adds it for choice and score answers:
/// choice, (max p - 1/n) / (1 - 1/n); score, 1 - (the mean distance of the
/// distribution from its mode) / (that of a uniform one from the middle),
/// at least 0. One option: 1.
pub fn jev_confidence(kind: Kind, p: &[f32]) -> f64 {
    let n = p.len();
    let sum: f64 = p.iter().map(|&x| x as f64).sum();
    if n <= 1 || sum <= 0.0 {
        return 1.0;
    }
    let p: Vec<f64> = p.iter().map(|&x| x as f64 / sum).collect();
    let nf = n as f64;
    match kind {
        Kind::Score => {
            let mode = p.iter().enumerate().fold(0, |b, (i, &x)| if x > p[b] { i } else { b });
            let spread: f64 = p
                .iter()
                .enumerate()
                .map(|(i, &x)| x * (i as f64 - mode as f64).abs())
                .sum();
            let d: f64 = (0..n).map(|i| (i as f64 - (nf - 1.0) / 2.0).abs()).sum::<f64>() / nf;
            (1.0 - spread / d).max(0.0)
        }
        _ => {
            let top = p.iter().copied().fold(0.0, f64::max);
            (top - 1.0 / nf) / (1.0 - 1.0 / nf)
        }
    }
}

/// The index of the first of the highest probabilities.
pub fn argmax(p: &[f32]) -> usize {
    p.iter().enumerate().fold(0, |b, (i, &x)| if x > p[b] { i } else { b })
}

/// Rounded to 4 decimals, as Laya writes every number.
pub fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// `min_confidence`: one threshold, or one per bucket with a default.
#[derive(Clone, Debug, PartialEq)]
pub enum MinConfidence {
    All(f64),
    ByBucket(BTreeMap<String, f64>),
}

impl MinConfidence {
    pub fn parse(v: &Value) -> Result<MinConfidence, DecideError> {
        let bad = |m: String| DecideError::Invalid(m);
        let num = |x: &Value| {
            x.as_f64()
                .filter(|f| (0.0..=1.0).contains(f) && !x.is_boolean())
                .ok_or_else(|| bad(format!("min_confidence must be a number in [0.0, 1.0], got {x}")))
        };
        match v {
            Value::Object(m) if !m.is_empty() => {
                let mut out = BTreeMap::new();
                for (k, x) in m {
                    let ok = k == "default"
                        || k.split_once(':').is_some_and(|(t, s)| {
                            ["choice", "score", "noul"].contains(&t) && ["2", "3-5", "6-10", "11+"].contains(&s)
                        });
                    if !ok {
                        return Err(bad(format!(
                            "min_confidence map keys must be a bucket like 'choice:3-5' or 'default', got {k:?}"
                        )));
                    }
                    out.insert(k.clone(), num(x)?);
                }
                Ok(MinConfidence::ByBucket(out))
            }
            Value::Object(_) => Err(bad("a min_confidence map must not be empty".into())),
            x => Ok(MinConfidence::All(num(x)?)),
        }
    }

    /// The threshold for an answer of `kind` with `k` options.
    pub fn threshold(&self, kind: Kind, k: usize) -> f64 {
        match self {
            MinConfidence::All(t) => *t,
            MinConfidence::ByBucket(m) => m
                .get(&bucket(kind, k))
                .or_else(|| m.get("default"))
                .copied()
                .unwrap_or(0.0),
        }
    }
}

/// One answer as Laya writes it.
pub fn answer_json(s: &Scored, min: Option<&MinConfidence>) -> Value {
    let q = &s.question;
    let p = &s.probabilities;
    let k = p.len();
    let r = |x: f32| round4(x as f64);
    let top = p.iter().copied().fold(0.0f32, f32::max) as f64;
    let mut a = Map::new();
    a.insert("type".into(), json!(q.kind.name()));
    let probs: Map<String, Value> = q
        .options
        .iter()
        .zip(p)
        .map(|((key, _), &x)| (key.clone(), json!(r(x))))
        .collect();
    match q.kind {
        Kind::Choice => {
            a.insert("choice".into(), json!(q.options[argmax(p)].0));
            a.insert("probabilities".into(), Value::Object(probs));
        }
        Kind::Score => {
            score_fields(q, p, &mut a);
            a.insert("probabilities".into(), Value::Object(probs));
        }
        Kind::Noul => {
            a.insert("noul".into(), json!(r(p[1])));
            a.insert("probabilities".into(), json!({"false": r(p[0]), "true": r(p[1])}));
        }
    }
    a.insert("confidence".into(), json!(round4(confidence(q.kind, p))));
    a.insert("answer_confidence".into(), json!(round4(top.clamp(0.0, 1.0))));
    if q.kind != Kind::Noul {
        a.insert("x_jev_confidence".into(), json!(round4(jev_confidence(q.kind, p))));
    }
    a.insert("temperature".into(), json!(round4(s.temperature as f64)));
    if let Some(m) = min {
        gate(&mut a, m, q.kind, k, top);
    }
    Value::Object(a)
}

/// A score answer's `score` (the expected level) and `legend`.
pub fn score_fields(q: &Question, p: &[f32], a: &mut Map<String, Value>) {
    let expected: f64 = p.iter().enumerate().map(|(i, &x)| i as f64 * x as f64).sum();
    a.insert("score".into(), json!(round4(expected)));
    let legend: Map<String, Value> = q
        .options
        .iter()
        .map(|(key, d)| (key.clone(), json!(d.clone().unwrap_or_default())))
        .collect();
    a.insert("legend".into(), Value::Object(legend));
}

/// The `min_confidence` gate on one answer: `abstention` (`passed` or
/// `abstained`, comparing `conf` with the threshold of the answer's
/// bucket), `abstention_threshold`, and `low_confidence` when abstained.
pub fn gate(a: &mut Map<String, Value>, m: &MinConfidence, kind: Kind, k: usize, conf: f64) {
    let t = m.threshold(kind, k);
    let passed = conf >= t;
    a.insert("abstention".into(), json!(if passed { "passed" } else { "abstained" }));
    a.insert("abstention_threshold".into(), json!(t));
    if !passed {
        a.insert("low_confidence".into(), json!(true));
    }
}

/// The whole response: `model`, `answers` (in the request's order),
/// `usage`.
pub fn response_json(model: &str, scored: &[Scored], usage: &DecideUsage, min: Option<&MinConfidence>) -> Value {
    let answers: Map<String, Value> = scored
        .iter()
        .map(|s| (s.question.name.clone(), answer_json(s, min)))
        .collect();
    json!({
        "model": model,
        "answers": answers,
        "usage": {
            "input_tokens": usage.input_tokens,
            "output_tokens": 0,
            "state_tokens": usage.state_tokens,
            "cached_tokens": usage.cached_tokens,
        },
    })
}

/// A labeled example for calibration: raw label log-probabilities and the
/// index of the right option.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub kind: Kind,
    pub logprobs: Vec<f32>,
    pub truth: usize,
}

/// Mean negative log-likelihood of the examples at temperature `t`.
pub fn nll(examples: &[&Example], t: f32) -> f64 {
    let n = examples.len().max(1) as f64;
    examples
        .iter()
        .map(|e| -(softmax_t(&e.logprobs, t)[e.truth].max(1e-30) as f64).ln())
        .sum::<f64>()
        / n
}

/// The temperature in [0.5, 5] that minimizes [`nll`] (golden-section
/// search on log t; the NLL of a softmax in 1/t is convex, so unimodal).
pub fn fit_temperature(examples: &[&Example]) -> f32 {
    let (mut lo, mut hi) = (0.5f64.ln(), 5.0f64.ln());
    let g = (5f64.sqrt() - 1.0) / 2.0;
    let f = |x: f64| nll(examples, x.exp() as f32);
    let (mut a, mut b) = (hi - g * (hi - lo), lo + g * (hi - lo));
    let (mut fa, mut fb) = (f(a), f(b));
    for _ in 0..60 {
        if fa < fb {
            hi = b;
            b = a;
            fb = fa;
            a = hi - g * (hi - lo);
            fa = f(a);
        } else {
            lo = a;
            a = b;
            fa = fb;
            b = lo + g * (hi - lo);
            fb = f(b);
        }
    }
    clamp_temperature(((lo + hi) / 2.0).exp() as f32)
}

/// Fits temperatures: one per type (from at least `min_type` examples of
/// it) and one per bucket (from at least `min_bucket`); the rest stay 1.
pub fn calibrate(examples: &[Example], min_type: usize, min_bucket: usize) -> Temperatures {
    let mut t = Temperatures::default();
    for kind in [Kind::Choice, Kind::Score, Kind::Noul] {
        let of: Vec<&Example> = examples.iter().filter(|e| e.kind == kind).collect();
        if of.len() >= min_type.max(1) {
            t.temperature[kind.index()] = fit_temperature(&of);
        }
        let mut buckets: BTreeMap<String, Vec<&Example>> = BTreeMap::new();
        for e in of {
            buckets.entry(bucket(kind, e.logprobs.len())).or_default().push(e);
        }
        for (b, es) in buckets {
            if es.len() >= min_bucket.max(1) {
                t.temperature_by_options.insert(b, fit_temperature(&es));
            }
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn questions_parse_in_laya_shapes() {
        let q = parse_questions(&json!({
            "route": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": null}},
            "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["not", "somewhat", "very"]},
            "refund": {"type": "noul", "instructions": "Is it a refund request?"},
            "lang": {"type": "choice", "instructions": "Language?", "options": ["en", "de"]},
        }))
        .unwrap();
        assert_eq!(
            q[0].options,
            vec![("billing".into(), Some("money".into())), ("tech".into(), None)]
        );
        assert_eq!(q[1].options[2], ("2".into(), Some("very".into())));
        assert_eq!(q[2].options, vec![("false".into(), None), ("true".into(), None)]);
        assert_eq!(q[3].options.len(), 2);
        for (bad, needle) in [
            (json!({"a": {"type": "vote", "instructions": "x"}}), "unknown type"),
            (json!({"a": {"type": "noul"}}), "instructions"),
            (
                json!({"a": {"type": "score", "instructions": "x", "criteria": ["a", null]}}),
                "null level",
            ),
            (
                json!({"a": {"type": "choice", "instructions": "x", "criteria": ["a", "a"]}}),
                "twice",
            ),
            (json!({"a": {"type": "choice", "instructions": "x"}}), "criteria"),
            (json!([1]), "object"),
        ] {
            let e = parse_questions(&bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn confidence_and_buckets_follow_laya() {
        assert_eq!(bucket(Kind::Choice, 2), "choice:2");
        assert_eq!(bucket(Kind::Score, 5), "score:3-5");
        assert_eq!(bucket(Kind::Choice, 11), "choice:11+");
        assert!((confidence(Kind::Choice, &[0.5, 0.5]) - 0.0).abs() < 1e-9);
        assert!((confidence(Kind::Choice, &[1.0, 0.0]) - 1.0).abs() < 1e-6);
        assert!((confidence(Kind::Noul, &[0.2, 0.8]) - 0.8).abs() < 1e-6);
        assert!((jev_confidence(Kind::Choice, &[0.5, 0.5])).abs() < 1e-9);
        assert!((jev_confidence(Kind::Choice, &[1.0, 0.0, 0.0]) - 1.0).abs() < 1e-9);
        assert!((jev_confidence(Kind::Score, &[0.0, 1.0, 0.0]) - 1.0).abs() < 1e-9);
        // Uniform over three levels: mean distance from the mode (0) is
        // 1, from the middle 2/3: clamped to 0.
        assert_eq!(jev_confidence(Kind::Score, &[1.0 / 3.0; 3]), 0.0);
        assert_eq!(clamp_temperature(0.1), 0.5);
        assert_eq!(clamp_temperature(f32::NAN), 1.0);
        let t = Temperatures {
            temperature: [2.0, 1.0, 1.0],
            temperature_by_options: [("choice:2".to_string(), 3.0)].into(),
        };
        assert_eq!(t.get(Kind::Choice, 2), 3.0);
        assert_eq!(t.get(Kind::Choice, 4), 2.0);
    }

    #[test]
    fn min_confidence_marks_answers_without_changing_them() {
        let s = Scored {
            question: Question {
                name: "q".into(),
                kind: Kind::Choice,
                instructions: "x".into(),
                options: vec![("a".into(), None), ("b".into(), None)],
            },
            raw: vec![-0.5, -1.0],
            logprobs: vec![-0.5, -1.0],
            temperature: 1.0,
            probabilities: vec![0.6, 0.4],
        };
        let plain = answer_json(&s, None);
        assert_eq!(plain["choice"], "a");
        assert!(plain.get("abstention").is_none());
        let gated = answer_json(&s, Some(&MinConfidence::parse(&json!(0.7)).unwrap()));
        assert_eq!(gated["abstention"], "abstained");
        assert_eq!(gated["low_confidence"], true);
        assert_eq!(gated["choice"], "a");
        let by = MinConfidence::parse(&json!({"choice:2": 0.5, "default": 0.9})).unwrap();
        assert_eq!(answer_json(&s, Some(&by))["abstention"], "passed");
        assert!(MinConfidence::parse(&json!(1.5)).is_err());
        assert!(MinConfidence::parse(&json!({"x": 0.5})).is_err());
    }

    #[test]
    fn calibration_finds_the_temperature_that_generated_the_labels() {
        // Logits whose true distribution is softmax(z / 2): labels drawn
        // from it deterministically in proportion.
        let mut ex = Vec::new();
        for i in 0..400 {
            let z = vec![(i % 7) as f32 * 0.5, 0.0, -((i % 5) as f32) * 0.4];
            let p = softmax_t(&z, 2.0);
            let u = ((i * 7919) % 1000) as f32 / 1000.0;
            let truth = if u < p[0] {
                0
            } else if u < p[0] + p[1] {
                1
            } else {
                2
            };
            ex.push(Example {
                kind: Kind::Choice,
                logprobs: z,
                truth,
            });
        }
        let t = calibrate(&ex, 10, 10);
        assert!((t.temperature[0] - 2.0).abs() < 0.4, "{t:?}");
        assert!(t.temperature_by_options.contains_key("choice:3-5"));
        assert_eq!(t.temperature[1], 1.0, "no score examples: default");
        let refs: Vec<&Example> = ex.iter().collect();
        assert!(nll(&refs, t.temperature[0]) <= nll(&refs, 1.0));
    }
}
