//! Laya decision checkpoints: a bidirectional ModernBERT-family encoder
//! (ModernBERT for `laya` and `laya-typed-decisions`, mmBERT for
//! `laya-multilingual`) with a typed decision head, read from the
//! directory the Laya SDK publishes:
//!
//! ```text
//! rl_agent_config.json      max_len, head_max_len, head_layers, act_costs, temperatures
//! model.safetensors         every weight (f16 as published; f32 and bf16 also read)
//! encoder/config.json       the encoder's shape, layer types and RoPE thetas
//! tokenizer/tokenizer.json  the tokenizer, with tokenizer_config.json naming
//!                           its [CLS], [SEP], [MASK] and [PAD] tokens
//! ```
//!
//! The forward takes rows (one per question: token ids, the positions of
//! the option markers, the question type) and returns each row's option
//! logits and action logits. f16 weights stay memory-mapped and are widened
//! inside the matrix products ([`snug_kernels::dense`]); everything is
//! computed in f32 like the reference. Each row is computed on its own (the
//! matrix products fix every output's operation order and attention never
//! crosses rows), so a row's logits are bitwise the same whatever else is
//! in the batch.
//!
//! The module's parts: the checkpoint's configuration files (`config.rs`),
//! its tensors, checked and bound at load (`tensors.rs`), and the encoder
//! with its decision head (`encoder.rs`).

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use serde_json::Value;
use snug_kernels::dense::{attend, dense_matmul, Dense, DenseData};
use snug_kernels::ops::gelu_erf;
use snug_kernels::pool::ThreadPool;

mod config;
mod encoder;
mod tensors;

pub(crate) use config::{get_usize, read_json};
pub use config::{AgentConfig, EncoderConfig, Specials};
pub(crate) use encoder::{attention, Norm};
pub use encoder::{LayaModel, Row, RowOutput, FORWARD_TOKENS};
pub(crate) use tensors::Tensors;

/// Why a checkpoint cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LayaError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("the tokenizer failed: {0}")]
    Tokenizer(String),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LayaError + '_ {
    move |source| LayaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn format_err(path: &Path, message: impl Into<String>) -> LayaError {
    LayaError::Format {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Whether `dir` looks like a Laya checkpoint (it has `rl_agent_config.json`).
pub fn is_checkpoint(dir: &Path) -> bool {
    dir.is_dir() && dir.join("rl_agent_config.json").is_file()
}
