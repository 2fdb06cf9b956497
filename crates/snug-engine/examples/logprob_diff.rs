//! Teacher-forced comparison with llama.cpp's reference: feed the
//! reference tokens, and at each step compare snug's log-probabilities of
//! the reference top-5 with the reference's.
//! `cargo run --release -p snug-engine --example logprob_diff -- FIXTURE.json [alias]`
//!
//! `SNUG_NUMERICS=llama.cpp` runs the llama.cpp numerics; `SNUG_VERBOSE=1`
//! prints each step's top-2 margin error; `SNUG_SPLIT=K` feeds a prompt's
//! last `K` tokens as a second batch.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use snug_engine::{Engine, EngineOptions};
use snug_kernels::ggml::Numerics;
use snug_model::arch::Model;
use snug_model::{LoadOptions, ModelFiles};

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
    let sum: f64 = l.iter().map(|&v| (v as f64 - max).exp()).sum();
    l.iter().map(|&v| v as f64 - max - sum.ln()).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let fx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&args[1]).unwrap()).unwrap();
    for (alias, m) in fx["models"].as_object().unwrap() {
        if args.len() > 2 && &args[2] != alias {
            continue;
        }
        let path = snug_model::testing::model_path(alias).unwrap();
        let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let mut model_q = Model::load(&file).unwrap();
        if let Some(n) = std::env::var("SNUG_NUMERICS").ok().and_then(|v| Numerics::parse(&v)) {
            model_q.numerics = n;
        }
        let f32_mode = std::env::var("SNUG_F32_REFERENCE").is_ok();
        let arena = if f32_mode {
            model_q.dequantized_buffers()
        } else {
            Vec::new()
        };
        let model_f = f32_mode.then(|| model_q.with_f32_matrices(&arena));
        let model = model_f.as_ref().unwrap_or(&model_q);
        let mut engine = Engine::new(
            model,
            EngineOptions {
                ctx: 256,
                kv_format: if f32_mode {
                    snug_kernels::kv::KvFormat::F32
                } else {
                    snug_kernels::kv::KvFormat::F16
                },
                ..Default::default()
            },
        );
        let (mut worst, mut sum, mut n, mut misses) = (0f64, 0f64, 0usize, 0usize);
        // With SNUG_COMPARE_F32, also measure quantized vs f32 reference.
        let cmp = std::env::var("SNUG_COMPARE_F32").is_ok();
        let arena2 = if cmp { model_q.dequantized_buffers() } else { Vec::new() };
        let model_r = if cmp {
            model_q.with_f32_matrices(&arena2)
        } else {
            let mut m = Model::load(&file).unwrap();
            m.numerics = model_q.numerics;
            m
        };
        let mut ref_engine = Engine::new(
            &model_r,
            EngineOptions {
                ctx: 256,
                kv_format: snug_kernels::kv::KvFormat::F32,
                ..Default::default()
            },
        );
        let (mut rsum, mut rworst, mut rn) = (0f64, 0f64, 0usize);
        // The top-2 margin's error needs no normalisation, so it is free of
        // how the reference's probabilities were renormalised.
        let (mut msum, mut mn) = (0f64, 0usize);
        for case in m["cases"].as_array().unwrap() {
            let seq = engine.create_sequence();
            let prompt: Vec<u32> = case["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let ids: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let split: usize = std::env::var("SNUG_SPLIT")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let mut logits = if split > 0 && split < prompt.len() {
                let (a, b) = prompt.split_at(prompt.len() - split);
                engine.feed(seq, a).unwrap();
                engine.feed(seq, b).unwrap().to_vec()
            } else {
                engine.feed(seq, &prompt).unwrap().to_vec()
            };
            let rseq = ref_engine.create_sequence();
            let mut rlogits = if cmp {
                ref_engine.feed(rseq, &prompt).unwrap().to_vec()
            } else {
                Vec::new()
            };
            for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
                let lp = log_softmax(&logits);
                let top = step["top"].as_array().unwrap();
                if std::env::var("SNUG_VERBOSE").is_ok() {
                    let id0 = top[0]["id"].as_u64().unwrap() as usize;
                    let id1 = top[1]["id"].as_u64().unwrap() as usize;
                    let ours = lp[id0] - lp[id1];
                    let theirs = top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap();
                    print!("{:+.0e} ", ours - theirs);
                }
                if cmp {
                    let rlp = log_softmax(&rlogits);
                    if std::env::var("SNUG_VERBOSE").is_ok() {
                        let id0 = top[0]["id"].as_u64().unwrap() as usize;
                        let id1 = top[1]["id"].as_u64().unwrap() as usize;
                        print!(
                            "[f32 {:+.3}] ",
                            (rlp[id0] - rlp[id1])
                                - (top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap())
                        );
                    }
                    for t in top {
                        let id = t["id"].as_u64().unwrap() as usize;
                        let d = (lp[id] - rlp[id]).abs();
                        rworst = rworst.max(d);
                        rsum += d;
                        rn += 1;
                    }
                }
                for t in top {
                    let d = (lp[t["id"].as_u64().unwrap() as usize] - t["logprob"].as_f64().unwrap()).abs();
                    worst = worst.max(d);
                    sum += d;
                    n += 1;
                }
                let margin = top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap();
                let (id0, id1) = (
                    top[0]["id"].as_u64().unwrap() as usize,
                    top[1]["id"].as_u64().unwrap() as usize,
                );
                msum += ((lp[id0] - lp[id1]) - margin).abs();
                mn += 1;
                let ours = snug_engine::sampling::argmax(&logits);
                if margin > 0.5 && ours != top[0]["id"].as_u64().unwrap() as u32 {
                    misses += 1;
                    println!(
                        "  miss: {alias} {:?} step {i} margin {margin:.3}",
                        case["prompt"].as_str().unwrap()
                    );
                }
                if i + 1 < ids.len() {
                    logits = engine.feed(seq, &[ids[i]]).unwrap().to_vec();
                    if cmp {
                        rlogits = ref_engine.feed(rseq, &[ids[i]]).unwrap().to_vec();
                    }
                }
            }
            if std::env::var("SNUG_VERBOSE").is_ok() {
                println!();
            }
            engine.free_sequence(seq);
            ref_engine.free_sequence(rseq);
        }
        if cmp {
            println!(
                "{alias}: quantized vs f32 reference: mean {:.4} max {:.4}",
                rsum / rn as f64,
                rworst
            );
        }
        println!(
            "{alias}: top-5 logprob |diff| mean {:.4} max {:.4}; top-2 margin |diff| mean {:.4}; top-1 misses where margin > 0.5: {misses}",
            sum / n as f64,
            worst,
            msum / mn as f64
        );
    }
}
