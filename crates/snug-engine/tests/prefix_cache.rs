//! The prefix cache: a sequence that shares cached pages of its prompt
//! (from RAM, or from the disk tier in a fresh engine) generates exactly
//! what a cold engine generates, on F16, Q8 and TQ4 pages; eviction under
//! a tight budget keeps generation working; a damaged page file is a miss,
//! never used.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use std::path::PathBuf;

use snug_core::speculate::Mode;
use snug_engine::generate::{GenerateRequest, Generation};
use snug_engine::sampling::SamplingParams;
use snug_engine::session::ModelIdentity;
use snug_engine::StepRow;
use snug_engine::{Engine, EngineOptions};
use snug_kernels::kv::KvFormat;
use snug_model::testing::model_path;
use snug_model::{EncodeOptions, LoadOptions, ModelFiles, Tokenizer};

fn document() -> String {
    std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0")
        .map(|t| t.chars().take(1500).collect())
        .unwrap_or_else(|_| "The river runs past the mill and on to the sea; the mill turns. ".repeat(24))
}

fn options(kv: KvFormat, prefix: bool) -> EngineOptions {
    EngineOptions {
        threads: 2,
        ctx: 1024,
        batch: 64,
        page_tokens: 16,
        kv_format: kv,
        prefix_cache: prefix,
        ..Default::default()
    }
}

fn generate(engine: &mut Engine, tok: &Tokenizer, prompt: &[u32], params: &SamplingParams) -> Generation {
    let seq = engine.create_sequence();
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: 24,
        params: params.clone(),
        stop: Vec::new(),
        speculate: Mode::On,
        constraint: None,
    };
    let g = engine.generate(seq, tok, &req, |_| {}).unwrap();
    engine.free_sequence(seq);
    g
}

fn identity() -> ModelIdentity {
    ModelIdentity {
        model_sha256: "e".repeat(64),
        tokenizer_sha256: "f".repeat(64),
        model_name: "smollm2-135m".into(),
    }
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("snug-prefix-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

struct Setup {
    file: ModelFiles,
}

fn setup() -> Option<Setup> {
    Some(Setup {
        file: ModelFiles::open(&model_path("smollm2-135m")?, &LoadOptions::default()).unwrap(),
    })
}

/// Two prompts sharing the document, with different questions.
fn prompts(tok: &Tokenizer) -> (Vec<u32>, Vec<u32>) {
    let doc = document();
    let a = tok.encode(
        &format!("{doc}\n\nQuestion: who may use it?\nAnswer:"),
        EncodeOptions::default(),
    );
    let b = tok.encode(
        &format!("{doc}\n\nQuestion: what does it cost?\nAnswer:"),
        EncodeOptions::default(),
    );
    (a, b)
}

snug_model::test_backends! {
    batch_invariant: fn shared_pages_give_the_cold_output(backend) {
        let Some(s) = setup() else { return };
        let model = backend.load(&s.file).unwrap();
        let tok = Tokenizer::from_gguf(&s.file).unwrap();
        let (a, b) = prompts(&tok);
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
            seed: 3,
            ..Default::default()
        };
        for kv in [KvFormat::F16, KvFormat::Q8, KvFormat::Tq4] {
            let mut base = options(kv, true);
            if kv == KvFormat::Tq4 {
                let calib = tok.encode(snug_engine::calibrate::TEXT, EncodeOptions::default());
                base.key_basis = Some(snug_engine::calibrate::key_basis(&model, &calib, 2).unwrap());
            }
            for params in [SamplingParams::default(), sampled.clone()] {
                let what = format!("{} t={}", kv.name(), params.temperature);
                let mut cold = Engine::new(
                    &model,
                    EngineOptions {
                        prefix_cache: false,
                        ..base.clone()
                    },
                );
                let want = generate(&mut cold, &tok, &b, &params);
                assert_eq!(want.reused_tokens, 0);
                let mut warm = Engine::new(&model, base.clone());
                generate(&mut warm, &tok, &a, &params);
                let got = generate(&mut warm, &tok, &b, &params);
                let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
                // Whole shared pages, but for the first with lossy pages (it is
                // computed, for its exact twin).
                let first = if kv == KvFormat::F16 { 0 } else { 16 };
                assert_eq!(
                    got.reused_tokens,
                    common / 16 * 16 - first,
                    "{what}: whole shared pages reused"
                );
                assert!(got.reused_tokens >= 256, "{what}");
                assert_eq!(got.tokens, want.tokens, "{what}: tokens");
                assert_eq!(got.text, want.text, "{what}: text");
                let st = warm.prefix_stats().unwrap();
                assert_eq!((st.lookups, st.hits), (2, 1), "{what}");
                assert_eq!(st.reused_tokens as usize, got.reused_tokens);
            }
        }
    }
}

snug_model::test_backends! {
    batch_invariant: fn a_tight_budget_evicts_cached_pages_and_keeps_working(backend) {
        let Some(s) = setup() else { return };
        let model = backend.load(&s.file).unwrap();
        let tok = Tokenizer::from_gguf(&s.file).unwrap();
        let (a, _) = prompts(&tok);
        let page = snug_engine::kv_page_bytes(&model, &options(KvFormat::F16, true));
        // Room for one sequence of the prompt and its reply, not for two.
        let pages = (a.len() + 24).div_ceil(16) + 2;
        let o = EngineOptions {
            kv_budget: Some(pages * page),
            ..options(KvFormat::F16, true)
        };
        let mut e = Engine::new(&model, o);
        let first = generate(&mut e, &tok, &a, &SamplingParams::default());
        // Another prompt of the same length needs the cached pages back.
        let other: Vec<u32> = a.iter().rev().copied().collect();
        generate(&mut e, &tok, &other, &SamplingParams::default());
        let st = e.prefix_stats().unwrap();
        assert!(st.evictions > 0, "{st:?}");
        // The first prompt again: whatever is left is shared, the output is the same.
        let again = generate(&mut e, &tok, &a, &SamplingParams::default());
        assert_eq!(again.tokens, first.tokens);
    }
}

snug_model::test_backends! {
    batch_invariant: fn the_disk_tier_survives_the_engine_and_refuses_damaged_pages(backend) {
        let Some(s) = setup() else { return };
        let model = backend.load(&s.file).unwrap();
        let tok = Tokenizer::from_gguf(&s.file).unwrap();
        let (a, b) = prompts(&tok);
        let dir = temp("disk");
        let mut cold = Engine::new(&model, options(KvFormat::F16, false));
        let want = generate(&mut cold, &tok, &b, &SamplingParams::default());
        {
            let mut e = Engine::new(&model, options(KvFormat::F16, true));
            e.enable_prefix_disk(&dir, 1 << 30, &identity()).unwrap();
            generate(&mut e, &tok, &a, &SamplingParams::default());
            assert!(e.prefix_stats().unwrap().disk_writes as usize >= a.len() / 16);
        }
        // A new engine (as after a restart) reads the pages from disk.
        let mut e = Engine::new(&model, options(KvFormat::F16, true));
        e.enable_prefix_disk(&dir, 1 << 30, &identity()).unwrap();
        let got = generate(&mut e, &tok, &b, &SamplingParams::default());
        let st = e.prefix_stats().unwrap();
        assert!(st.disk_hits >= 16, "{st:?}");
        assert_eq!(got.tokens, want.tokens);
        // Another identity never sees these files.
        let mut other = identity();
        other.model_sha256 = "0".repeat(64);
        let mut e = Engine::new(&model, options(KvFormat::F16, true));
        e.enable_prefix_disk(&dir, 1 << 30, &other).unwrap();
        assert_eq!(generate(&mut e, &tok, &b, &SamplingParams::default()).reused_tokens, 0);
        // Damage the third page's file: pages up to it are shared, the rest
        // prefilled, the output unchanged, and the bad file deleted.
        let mut e = Engine::new(&model, options(KvFormat::F16, true));
        e.enable_prefix_disk(&dir, 1 << 30, &identity()).unwrap();
        let (disk_dir, _) = e.prefix_disk().unwrap();
        let third = snug_core::prefix::keys(&b, 16, 3)[2];
        let hex: String = third.iter().map(|x| format!("{x:02x}")).collect();
        let f = disk_dir.join(format!("{hex}.kvpage"));
        let mut bytes = std::fs::read(&f).unwrap();
        let n = bytes.len();
        bytes[n / 2] ^= 4;
        std::fs::write(&f, bytes).unwrap();
        let got = generate(&mut e, &tok, &b, &SamplingParams::default());
        assert_eq!(got.reused_tokens, 32);
        assert_eq!(got.tokens, want.tokens);
        assert!(
            !f.exists() || std::fs::read(&f).unwrap().len() == n,
            "the damaged file is deleted (or rewritten whole)"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

snug_model::test_backends! {
    batch_invariant: fn rolled_back_pages_never_enter_the_cache(backend) {
        let Some(s) = setup() else { return };
        let model = backend.load(&s.file).unwrap();
        let tok = Tokenizer::from_gguf(&s.file).unwrap();
        let (a, _) = prompts(&tok);
        let mut e = Engine::new(&model, options(KvFormat::F16, true));
        let seq = e.create_sequence();
        e.feed(seq, &a[..30]).unwrap();
        // A verify of 9 rows fills page 1 (positions 16..32) and starts page 2
        // with a draft that is then rejected.
        let rows: Vec<_> = a[30..39].iter().map(|&t| StepRow::new(seq, t, true)).collect();
        e.step(&rows).unwrap();
        e.truncate(seq, 31).unwrap();
        e.feed(seq, &[a[31]]).unwrap();
        // Page 0 entered at the verify; page 1 (filled by drafts, rolled back)
        // did not.
        assert_eq!(e.prefix_stats().unwrap().pages, 1);
        // Page 1 is now full of settled tokens (a[..32]): it enters at the
        // next step.
        e.feed(seq, &[7]).unwrap();
        assert_eq!(e.prefix_stats().unwrap().pages, 2);
        e.free_sequence(seq);
        assert_eq!(e.prefix_stats().unwrap().pages, 2);
    }
}
