//! Embeddings from a decoder's pooled hidden states, on the real models:
//! unit length, the same bits however the prefill is chunked and whatever
//! inputs share a forward, and closer for texts that mean the same.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use snug_engine::{Engine, EngineOptions};
use snug_model::testing::{model_path, MODELS};
use snug_model::{EncodeOptions, LoadOptions, ModelFiles, Tokenizer};

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn embeddings_are_unit_vectors_independent_of_chunking_and_meaningful() {
    for alias in MODELS {
        let Some(path) = model_path(alias) else { continue };
        let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let model = snug_model::arch::Model::load(&file).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let enc = |t: &str| tok.encode(t, EncodeOptions::default());
        let texts = [
            "The cat sat on the mat by the window.",
            "A cat is sitting on a mat near a window.",
            "Stock markets fell sharply after the interest rate decision.",
        ];
        let mut wide = Engine::new(
            &model,
            EngineOptions {
                threads: 2,
                ctx: 512,
                batch: 64,
                ..Default::default()
            },
        );
        let mut narrow = Engine::new(
            &model,
            EngineOptions {
                threads: 2,
                ctx: 512,
                batch: 5,
                ..Default::default()
            },
        );
        let vs: Vec<Vec<f32>> = texts.iter().map(|t| wide.embed(&enc(t)).unwrap()).collect();
        for (t, v) in texts.iter().zip(&vs) {
            assert_eq!(v.len(), model.config.dim);
            let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-4, "{alias}: norm {norm}");
            // Five rows a forward instead of all at once, after other work.
            let again = narrow.embed(&enc(t)).unwrap();
            assert!(
                v.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{alias}: chunking changed the embedding of {t:?}"
            );
        }
        // All three in one forward: the same bits again.
        let inputs: Vec<Vec<u32>> = texts.iter().map(|t| enc(t)).collect();
        let together = wide.embed_batch(&inputs).unwrap();
        for (a, b) in together.iter().zip(&vs) {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{alias}: batching changed an embedding"
            );
        }
        let same = cosine(&vs[0], &vs[1]);
        let other = cosine(&vs[0], &vs[2]);
        eprintln!("{alias}: paraphrase {same:.3}, unrelated {other:.3}");
        assert!(same > other, "{alias}: paraphrase {same} <= unrelated {other}");
    }
}
