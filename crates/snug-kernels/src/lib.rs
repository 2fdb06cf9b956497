//! snug's compute layer: tensor element types and the kernels that read
//! them. Nothing here knows about sequences, pages or requests; the engine
//! hands kernels plain slices.
//!
//! - [`quant`]: GGML block layouts and scalar dequantizers, bit-exact
//!   against ggml.
//! - [`dot`]: quantized dot products with a scalar reference and AVX2 /
//!   AVX-512 VNNI paths that are bitwise equal to it.
//! - [`matmul`]: batched matrix multiplication over [`pool`]'s threads.
//! - [`dense`]: f16 / f32 weight matrices times f32 activations, for
//!   encoder checkpoints held to a float32 reference.
//! - [`panel`]: row-interleaved weight panels, the matrix-product kernel
//!   for one activation row (decode) and for many.
//! - [`kv`]: KV page storage and attention through page lists.
//! - [`ops`]: normalization, rotary embedding, activations, softmax.
//! - [`ggml`]: the same row-wise operations with llama.cpp's roundings,
//!   for runs that must reproduce its tokens.
//! - [`cpu`]: which SIMD path runs.

pub mod cpu;
pub mod dense;
pub mod dot;
pub mod ggml;
pub mod kv;
pub mod kvbasis;
pub mod matmul;
pub mod ops;
pub mod panel;
pub mod pool;
pub mod quant;
pub mod tq4;
pub mod vec;

pub use quant::{dequantize, DequantError, GgmlType, QK_K};
