//! The sentence-embedding encoder against its reference: all-MiniLM-L6-v2
//! as the sentence-transformers library computes it
//! (`tests/data/minilm-reference.json`, written by
//! `scripts/sentence-reference.py` from `tests/data/sentences.txt`).
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use std::path::Path;

use serde_json::Value;
use snug_model::sentence::{Pooling, SentenceModel};
use snug_model::testing::model_path;

fn reference() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/minilm-reference.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn minilm_matches_sentence_transformers() {
    let Some(dir) = model_path("all-minilm-l6-v2") else {
        return;
    };
    let m = SentenceModel::open(&dir, 2).unwrap();
    assert_eq!(
        (m.dim(), m.max_tokens, m.pooling, m.normalize),
        (384, 256, Pooling::Mean, true)
    );
    let r = reference();
    let texts: Vec<&str> = r["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let ids: Vec<Vec<u32>> = texts.iter().map(|t| m.tokenize(t).unwrap()).collect();
    for (i, (got, want)) in ids.iter().zip(r["token_ids"].as_array().unwrap()).enumerate() {
        let want: Vec<u32> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(got, &want, "tokens of text {i}");
    }
    let vectors = m.embed(&ids).unwrap();
    let mut worst_cos = 1.0f64;
    let mut worst_abs = 0.0f32;
    for (i, (v, want)) in vectors.iter().zip(r["embeddings"].as_array().unwrap()).enumerate() {
        let want = floats(want);
        assert_eq!(v.len(), want.len());
        let dot: f64 = v.iter().zip(&want).map(|(&a, &b)| a as f64 * b as f64).sum();
        let na: f64 = v.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = want.iter().map(|&b| (b as f64).powi(2)).sum::<f64>().sqrt();
        let cos = dot / (na * nb);
        let abs = v.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(
            cos > 0.999_999 && abs < 1e-5,
            "text {i}: cosine {cos}, largest difference {abs}"
        );
        worst_cos = worst_cos.min(cos);
        worst_abs = worst_abs.max(abs);
    }
    eprintln!(
        "{} texts: lowest cosine {worst_cos:.9}, largest element difference {worst_abs:.2e}",
        vectors.len()
    );
}

#[test]
fn a_text_embeds_to_the_same_bits_alone_together_and_on_one_thread() {
    let Some(dir) = model_path("all-minilm-l6-v2") else {
        return;
    };
    let two = SentenceModel::open(&dir, 2).unwrap();
    let one = SentenceModel::open(&dir, 1).unwrap();
    let r = reference();
    let ids: Vec<Vec<u32>> = r["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| two.tokenize(t.as_str().unwrap()).unwrap())
        .collect();
    let together = two.embed(&ids).unwrap();
    let reversed: Vec<Vec<u32>> = ids.iter().rev().cloned().collect();
    let backwards = one.embed(&reversed).unwrap();
    for (i, t) in ids.iter().enumerate() {
        let alone = one.embed(std::slice::from_ref(t)).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&alone[0]), bits(&together[i]), "text {i}");
        assert_eq!(bits(&alone[0]), bits(&backwards[ids.len() - 1 - i]), "text {i}");
    }
}

#[test]
fn inputs_over_the_limit_or_empty_are_refused() {
    let Some(dir) = model_path("all-minilm-l6-v2") else {
        return;
    };
    let m = SentenceModel::open(&dir, 1).unwrap();
    let long = m.tokenize(&"word ".repeat(300)).unwrap();
    assert!(long.len() > m.max_tokens);
    let e = m.embed(&[long]).unwrap_err().to_string();
    assert!(e.contains("takes 1 to 256"), "{e}");
    assert!(m.embed(&[Vec::new()]).is_err());
    assert!(m
        .embed(&[vec![101, 40_000, 102]])
        .unwrap_err()
        .to_string()
        .contains("vocabulary"));
}

#[test]
fn a_directory_that_is_not_a_bert_checkpoint_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("snug-sentence-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "xlm-roberta", "hidden_size": 8}"#,
    )
    .unwrap();
    std::fs::write(dir.join("modules.json"), "[]").unwrap();
    std::fs::write(dir.join("model.safetensors"), b"").unwrap();
    let e = SentenceModel::open(&dir, 1).err().unwrap().to_string();
    assert!(e.contains("xlm-roberta") && e.contains("not supported"), "{e}");
    std::fs::write(dir.join("config.json"), "{not json").unwrap();
    let e = SentenceModel::open(&dir, 1).err().unwrap().to_string();
    assert!(e.contains("not valid JSON"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
