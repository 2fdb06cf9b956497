//! Helpers shared by the engine's integration tests.
#![allow(dead_code)] // each test binary uses some of them

use snug_engine::{Engine, StepRow};

/// The bits of each float.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Feeds `tokens` to a fresh sequence in chunks of `chunk` rows, every row
/// asking for logits; returns each row's logits as bits.
pub fn by_chunks(engine: &mut Engine, tokens: &[u32], chunk: usize) -> Vec<Vec<u32>> {
    let seq = engine.create_sequence();
    let vocab = engine.model.config.vocab;
    let mut out = Vec::new();
    for part in tokens.chunks(chunk) {
        let rows: Vec<StepRow> = part.iter().map(|&t| StepRow::new(seq, t, true)).collect();
        out.extend(engine.step(&rows).unwrap().chunks_exact(vocab).map(bits));
    }
    engine.free_sequence(seq);
    out
}

/// A JSON array of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
