//! Decoder-only transformers over memory-mapped GGUF weights: one decoder
//! ([`forward`], on any [`crate::backend::Backend`]) and the architectures
//! it runs, each a [`Description`]. A [`Model`] is immutable after loading;
//! its one forward path takes a batch of rows (sequence, position, token)
//! and a view of the engine's KV pages, and serves prefill chunks, decode
//! steps and multi-token verification alike.

mod config;
pub mod describe;
mod forward;
pub mod profile;
pub mod trace;
mod weights;

pub use config::Config;
pub use describe::{Activation, Description};
pub use forward::{forward, BatchRow, Experts, Ffn, Head, KvView, Layer, Weights};
pub use weights::Model;

/// Why a model cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unsupported architecture {0:?} (supported: {1})")]
    UnsupportedArch(String, String),
    #[error("model file lacks {0}")]
    Missing(String),
    #[error("tensor {name}: {problem}")]
    BadTensor { name: String, problem: String },
    #[error("bad model: {0}")]
    Bad(String),
}
