//! Greedy decoding against llama.cpp's reference (`../shared/fixtures/greedy`):
//! teacher-forced along llama.cpp's own tokens, snug's top-1 token must equal
//! llama.cpp's wherever llama.cpp's top-2 log-probability margin is clear.
//!
//! Both runtimes quantize activations to 8 bits (snug in ggml's formats), but
//! they differ in attention precision (llama.cpp's CPU flash attention
//! accumulates values in f16) and in summation order, and these small models
//! amplify such differences: measured against an all-f32 reference, each
//! runtime's log-probabilities move by about 0.05–0.1 nats on average, so
//! at near-ties either token is a legitimate greedy choice. The threshold is
//! a named constant; the one position past it where snug chooses otherwise
//! is listed with the reason (`EXPLAINED`), and `bench/greedy.py` measures
//! how often llama.cpp's own settings agree with each other (docs/BENCHMARKS.md).
//!
//! Under the llama.cpp numerics (`--numerics llama.cpp`), snug computes as
//! llama.cpp's x86 build does, and its greedy tokens and log-probabilities
//! must equal the fixture's outright.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

mod common;
use common::ids;

use snug_engine::sampling::argmax;
use snug_engine::{Engine, EngineOptions};
use snug_kernels::ggml::Numerics;
use snug_model::arch::Model;
use snug_model::testing::{fixtures_dir, model_path, MODELS};
use snug_model::{LoadOptions, ModelFiles};

/// llama.cpp top-2 margin (nats) above which the top-1 tokens must agree.
const CLEAR_MARGIN: f64 = 0.5;

/// Positions past `CLEAR_MARGIN` where snug's top-1 differs, each with why
/// that is not an error: (model, prompt, step).
///
/// - Qwen2.5 0.5B, "Water boils at", step 13 (margin 0.656): llama.cpp itself,
///   same build, with its weight repacking off (`--no-repack`, which only
///   changes the order of its float sums), chooses snug's token there.
const EXPLAINED: &[(&str, &str, usize)] = &[("qwen2.5-coder-0.5b", "Water boils at", 13)];

/// The shared llama.cpp reference, where the fixtures are present.
fn fixture() -> Option<serde_json::Value> {
    let dir = fixtures_dir(&std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")))?;
    Some(serde_json::from_str(&std::fs::read_to_string(dir.join("greedy/llama.cpp.json")).unwrap()).unwrap())
}

fn engine<'m>(model: &'m Model<'m>) -> Engine<'m> {
    Engine::new(
        model,
        EngineOptions {
            threads: 2,
            ctx: 256,
            ..Default::default()
        },
    )
}

snug_model::test_backends! {
    fn top1_agrees_with_llama_cpp_where_the_margin_is_clear(backend) {
        let Some(fx) = fixture() else { return };
        for alias in MODELS {
            let Some(path) = model_path(alias) else { continue };
            let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
            let model = backend.load(&file).unwrap();
            let mut engine = engine(&model);
            let (mut checked, mut misses) = (0, Vec::new());
            for case in fx["models"][alias]["cases"].as_array().unwrap() {
                let seq = engine.create_sequence();
                let prompt = ids(&case["prompt_ids"]);
                let reference = ids(&case["ids"]);
                let mut top1 = argmax(engine.feed(seq, &prompt).unwrap());
                for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
                    let top = step["top"].as_array().unwrap();
                    let margin = top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap();
                    if margin > CLEAR_MARGIN {
                        checked += 1;
                        let prompt = case["prompt"].as_str().unwrap();
                        let explained = EXPLAINED.contains(&(alias, prompt, i));
                        if top1 != top[0]["id"].as_u64().unwrap() as u32 && !explained {
                            misses.push(format!("{prompt:?} step {i} (margin {margin:.2})"));
                        }
                    }
                    if i + 1 < reference.len() {
                        top1 = argmax(engine.feed(seq, &[reference[i]]).unwrap());
                    }
                }
                engine.free_sequence(seq);
            }
            assert!(checked > 100, "{alias}: only {checked} clear positions");
            assert!(misses.is_empty(), "{alias}: top-1 differs from llama.cpp at {misses:?}");
        }
    }
}

/// `log p(a) - log p(b)` from logits.
fn margin_of(logits: &[f32], a: u32, b: u32) -> f64 {
    logits[a as usize] as f64 - logits[b as usize] as f64
}

#[test]
fn llama_cpp_numerics_reproduce_its_greedy_tokens_and_margins() {
    let Some(fx) = fixture() else { return };
    for alias in MODELS {
        let Some(path) = model_path(alias) else { continue };
        let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let mut model = Model::load(&file).unwrap();
        model.numerics = Numerics::Ggml;
        let mut engine = engine(&model);
        let mut worst = 0f64;
        for case in fx["models"][alias]["cases"].as_array().unwrap().iter() {
            let prompt_text = case["prompt"].as_str().unwrap();
            let seq = engine.create_sequence();
            let reference = ids(&case["ids"]);
            let mut logits = engine.feed(seq, &ids(&case["prompt_ids"])).unwrap().to_vec();
            for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
                let top = step["top"].as_array().unwrap();
                let id = |k: usize| top[k]["id"].as_u64().unwrap() as u32;
                let theirs = top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap();
                worst = worst.max((margin_of(&logits, id(0), id(1)) - theirs).abs());
                let token = argmax(&logits);
                assert_eq!(
                    token, reference[i],
                    "{alias}: {prompt_text:?} parts from llama.cpp at step {i}"
                );
                logits = engine.feed(seq, &[token]).unwrap().to_vec();
            }
            engine.free_sequence(seq);
        }
        // The fixture's log-probabilities are f32 values: equal logits
        // leave only their rounding.
        assert!(
            worst < 1e-5,
            "{alias}: top-2 margins differ from llama.cpp's by up to {worst:e}"
        );
    }
}
