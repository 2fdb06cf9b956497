//! snug's compute layer: tensor element types and the kernels that read
//! them. Nothing here knows about sequences, pages or requests; the engine
//! hands kernels plain slices.
//!
//! Today this crate holds the GGML block layouts and their scalar
//! dequantizers ([`quant`]), the bit-exact reference every faster kernel is
//! tested against.

pub mod quant;

pub use quant::{dequantize, DequantError, GgmlType, QK_K};
