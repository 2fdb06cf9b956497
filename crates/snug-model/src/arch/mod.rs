//! Decoder-only transformers (llama, qwen2, gemma3) over memory-mapped GGUF
//! weights. A [`Model`] is immutable after loading; its one forward path
//! takes a batch of rows (sequence, position, token) and a view of the
//! engine's KV pages, and serves prefill chunks, decode steps and
//! multi-token verification alike.

mod config;
mod forward;
pub mod trace;
mod weights;

pub use config::{Arch, Config};
pub use forward::{BatchRow, ForwardScratch, KvView};
pub use weights::Model;

/// Why a model cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unsupported architecture {0:?} (supported: llama, qwen2, gemma3)")]
    UnsupportedArch(String),
    #[error("model file lacks {0}")]
    Missing(String),
    #[error("tensor {name}: {problem}")]
    BadTensor { name: String, problem: String },
    #[error("bad model: {0}")]
    Bad(String),
}
