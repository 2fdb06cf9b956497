//! The key basis of TQ4 keys, measured on a fixed text.
//!
//! One prefill of [`TEXT`] (about 300 tokens of prose, a list, dialogue
//! and code) through an F16 engine, with the forward's probe summing every
//! layer's pre-RoPE keys and its queries (position 0 left out: the first
//! token's key is unlike the others, and it is kept exact anyway). From
//! those sums [`KeyBasis::from_stats`] takes each (layer, KV head)'s mean
//! key as its offset and weighs each rotary pair by its query-to-key
//! energy. The text is fixed and the forward deterministic, so every run
//! of a model gets the same basis, bit for bit.

use std::sync::Arc;

use snug_kernels::kv::KvFormat;
use snug_kernels::kvbasis::{KeyBasis, KeyStats};
use snug_model::arch::Model;

use crate::{Engine, EngineError, EngineOptions};

/// The calibration text (written for this purpose; any varied text of a
/// few hundred tokens gives nearly the same basis).
pub const TEXT: &str = include_str!("calibration.txt");

/// The key basis of `model` from `tokens` (the tokenized [`TEXT`], with
/// the model's BOS where it adds one), run on `threads` threads.
pub fn key_basis(model: &Model, tokens: &[u32], threads: usize) -> Result<Arc<KeyBasis>, EngineError> {
    if tokens.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    let c = &model.config;
    let n = tokens.len().min(c.context_length);
    let mut engine = Engine::new(
        model,
        EngineOptions {
            threads,
            ctx: n,
            batch: n.min(512),
            kv_format: KvFormat::F16,
            kv_format_v: None,
            max_seqs: 1,
            ..EngineOptions::default()
        },
    );
    let crate::device::Scratch::Cpu(ws) = &mut engine.scratch else {
        unreachable!("made on the CPU above")
    };
    ws.probe = Some(KeyStats::new(c.layers, c.kv_heads, c.head_dim, c.heads / c.kv_heads));
    let seq = engine.create_sequence();
    engine.feed(seq, &tokens[..n])?;
    let crate::device::Scratch::Cpu(ws) = &mut engine.scratch else {
        unreachable!("made on the CPU above")
    };
    let stats = ws.probe.take().expect("set above");
    Ok(Arc::new(KeyBasis::from_stats(&stats, model.layer_ropes())))
}
