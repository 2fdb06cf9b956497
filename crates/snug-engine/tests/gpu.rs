//! The engine on a CUDA GPU keeps the CPU engine's promises: a row's
//! logits are the same bits however the prompt is chunked and whatever
//! shares its batch, and speculation never changes the output (greedy and
//! seeded sampling), and every logit is the CPU engine's, bit for bit:
//! with F16, Q8 and TQ4 pages.
//! Runs where a GPU is present (`Device::open` succeeds) and is skipped,
//! saying why, elsewhere.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

mod common;
use common::{bits, by_chunks};

use std::sync::Arc;

use snug_core::speculate::Mode;
use snug_engine::device::Gpu;
use snug_engine::generate::GenerateRequest;
use snug_engine::sampling::SamplingParams;
use snug_engine::StepRow;
use snug_engine::{Engine, EngineOptions};
use snug_kernels::kv::KvFormat;
use snug_kernels::kvbasis::KeyBasis;
use snug_model::testing::{model_path, MODELS};
use snug_model::{EncodeOptions, LoadOptions, ModelFiles, Tokenizer};

const PROMPT: &str = "Orders:\n- id 1041, Anna Berg, 3 chairs, Oslo\n- id 1042, Tomas Lind, 1 table, Bergen\n\
- id 1043, Mia Holm, 6 lamps, Oslo\n\nNames and cities:\n- Anna Berg, Oslo\n-";

/// The engine's options, pages in `kv` (TQ4 keys coded against `basis`).
fn options(gpu: Option<Gpu>, kv: KvFormat, basis: Option<Arc<KeyBasis>>) -> EngineOptions {
    EngineOptions {
        threads: 4,
        ctx: 512,
        batch: 64,
        max_seqs: 4,
        page_tokens: 16,
        gpu,
        kv_format: kv,
        key_basis: basis,
        ..Default::default()
    }
}

#[test]
fn the_gpu_engine_is_batch_invariant_and_speculation_changes_nothing() {
    let dev = match snug_cuda::Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: no GPU here ({e})");
            return;
        }
    };
    eprintln!("GPU: {} (sm_{}{})", dev.name, dev.capability.0, dev.capability.1);
    for alias in MODELS {
        let Some(path) = model_path(alias) else { continue };
        let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let model = snug_model::arch::Model::load(&file).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let gpu = Gpu(Arc::new(snug_cuda::CudaWeights::upload(&dev, model.weights()).unwrap()));
        let ids = tok.encode(PROMPT, EncodeOptions::default());
        let calibration = tok.encode(snug_engine::calibrate::TEXT, EncodeOptions::default());
        let basis = snug_engine::calibrate::key_basis(&model, &calibration, 4).unwrap();
        // Pages in each format (the prompt spans four pages of 16: coded
        // pages between the exact window's).
        for kv in [KvFormat::F16, KvFormat::Q8, KvFormat::Tq4] {
            let alias = format!("{alias} {}", kv.name());
            let opts = |gpu| options(gpu, kv, (kv == KvFormat::Tq4).then(|| basis.clone()));
            let mut engine = Engine::try_new(&model, opts(Some(gpu.clone()))).unwrap();

            // One chunk, uneven chunks, a token at a time.
            let whole = by_chunks(&mut engine, &ids, 64);
            assert_eq!(whole, by_chunks(&mut engine, &ids, 7), "{alias}: chunks of 7");
            assert_eq!(whole, by_chunks(&mut engine, &ids, 1), "{alias}: a token at a time");

            // Beside another sequence in every step.
            let a = engine.create_sequence();
            let b = engine.create_sequence();
            let other: Vec<u32> = ids.iter().rev().copied().collect();
            let vocab = model.config.vocab;
            let mut paired = Vec::new();
            for (x, y) in ids.iter().zip(&other) {
                let l = engine
                    .step(&[StepRow::new(b, *y, true), StepRow::new(a, *x, true)])
                    .unwrap();
                paired.push(bits(&l[vocab..2 * vocab]));
            }
            assert_eq!(whole, paired, "{alias}: beside another sequence");
            engine.free_sequence(a);
            engine.free_sequence(b);

            // Speculation on and off, greedy and seeded.
            let seq = engine.create_sequence();
            let mut drafted = 0;
            for params in [
                SamplingParams {
                    temperature: 0.0,
                    ..Default::default()
                },
                SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    seed: 7,
                    ..Default::default()
                },
            ] {
                let mut run = |mode| {
                    let req = GenerateRequest {
                        prompt: ids.clone(),
                        max_tokens: 40,
                        params: params.clone(),
                        stop: Vec::new(),
                        speculate: mode,
                        constraint: None,
                    };
                    engine.generate(seq, &tok, &req, |_| {}).unwrap()
                };
                let off = run(Mode::Off);
                let on = run(Mode::On);
                assert_eq!(off.tokens, on.tokens, "{alias}: speculation on and off");
                drafted += on.stats.speculation.drafted;
            }
            engine.free_sequence(seq);

            // The CPU engine's logits, bit for bit, and so its greedy tokens.
            let mut cpu = Engine::new(&model, opts(None));
            assert_eq!(whole, by_chunks(&mut cpu, &ids, 64), "{alias}: the CPU's logits");
            let greedy = |engine: &mut Engine| {
                let s = engine.create_sequence();
                let req = GenerateRequest {
                    prompt: ids.clone(),
                    max_tokens: 32,
                    params: SamplingParams {
                        temperature: 0.0,
                        ..Default::default()
                    },
                    stop: Vec::new(),
                    speculate: Mode::Off,
                    constraint: None,
                };
                let g = engine.generate(s, &tok, &req, |_| {}).unwrap();
                engine.free_sequence(s);
                g.tokens
            };
            let on_gpu = greedy(&mut engine);
            assert_eq!(on_gpu, greedy(&mut cpu), "{alias}: greedy tokens on the CPU");
            eprintln!(
            "{alias}: batch-invariant, speculation identical ({drafted} drafted), logits and {} greedy tokens the CPU's",
            on_gpu.len()
        );
        }
    }
}
