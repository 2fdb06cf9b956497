//! snug's model layer: everything read from a model file before any compute
//! runs. GGUF parsing ([`gguf`]), tokenizers built from its metadata
//! ([`tokenizer`]), chat templates ([`template`]), model facts for `snug
//! info` ([`info`]), and the catalog of known models with the pull that
//! fetches them ([`catalog`], [`pull`]), pulls from Hugging Face and URLs
//! ([`remote`]), Laya decision checkpoints with
//! their encoder ([`laya`]), and sentence-embedding checkpoints
//! ([`sentence`]).

pub mod arch;
pub mod backend;
pub mod catalog;
pub mod files;
pub mod fingerprint;
pub mod gguf;
pub mod info;
pub mod laya;
mod mapping;
pub mod packed;
pub mod pull;
pub mod remote;
pub mod sentence;
pub mod template;
pub mod template_child;
pub mod testing;
pub mod tokenizer;

pub use files::{LoadOptions, ModelFiles};
pub use gguf::{GgufError, GgufFile, GgufHeader};
pub use tokenizer::{EncodeOptions, Tokenizer};
