//! An answer interrupted between two decode steps (Ctrl-C in `snug chat`)
//! keeps what it emitted, and the sequence goes on from there exactly as
//! the uninterrupted run does.
#![allow(clippy::unwrap_used)] // a test: a failure may panic

use std::cell::Cell;

use snug_core::speculate::Mode;
use snug_engine::generate::{FinishReason, GenerateRequest};
use snug_engine::sampling::SamplingParams;
use snug_engine::{Engine, EngineOptions};
use snug_model::testing::model_path;
use snug_model::{EncodeOptions, LoadOptions, ModelFiles, Tokenizer};

snug_model::test_backends! {
    fn an_interrupted_answer_is_a_prefix_and_the_sequence_goes_on(backend) {
        let Some(path) = model_path("smollm2-135m") else { return };
        let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let model = backend.load(&file).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let options = EngineOptions { threads: 2, ctx: 256, batch: 32, page_tokens: 16, ..Default::default() };
        let prompt = tok.encode("The old clockmaker opened his shop at dawn and", EncodeOptions::default());
        for speculate in [Mode::Off, Mode::On] {
            let req = |prompt: Vec<u32>, n| GenerateRequest {
                prompt,
                max_tokens: n,
                params: SamplingParams::default(),
                stop: Vec::new(),
                speculate,
                constraint: None,
            };
            let mut e = Engine::new(&model, options.clone());
            let s = e.create_sequence();
            let full = e.generate(s, &tok, &req(prompt.clone(), 24), |_| {}).unwrap();
            assert_eq!(full.tokens.len(), 24);

            let mut e = Engine::new(&model, options.clone());
            let s = e.create_sequence();
            let asked = Cell::new(0);
            let mut shown = String::new();
            let cut = e
                .generate_until(s, &tok, &req(prompt.clone(), 24), |t| shown.push_str(t), &|| {
                    asked.set(asked.get() + 1);
                    asked.get() > 6
                })
                .unwrap();
            assert_eq!(cut.finish_reason, FinishReason::Length);
            let k = cut.tokens.len();
            assert!(k > 0 && k < 24, "{speculate:?}: {k} tokens");
            assert_eq!(cut.tokens[..], full.tokens[..k], "{speculate:?}");
            assert_eq!(shown, cut.text);
            // The next turn holds the interrupted tokens and goes on as
            // the uninterrupted run did.
            let mut next: Vec<u32> = prompt.clone();
            next.extend(&cut.tokens);
            let rest = e.generate(s, &tok, &req(next, 24 - k), |_| {}).unwrap();
            assert_eq!(rest.tokens[..], full.tokens[k..], "{speculate:?}");
        }
    }
}
