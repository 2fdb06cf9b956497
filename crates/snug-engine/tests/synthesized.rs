//! Every architecture snug describes, on a small synthesized model
//! (random weights and a real model's tokenizer,
//! `snug_model::testing::synth`): it loads, a row's logits are the same
//! bits whole, a row at a time and in uneven chunks, and where llama.cpp's
//! greedy reference for the same file is present (`tests/data/synth-llama-cpp.json`,
//! written by `scripts/make_synth_fixtures.py`), snug's tokens under
//! llama.cpp's numerics are llama.cpp's, and under its own they agree with
//! llama.cpp's wherever llama.cpp's top-2 margin is clear.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

mod common;
use common::{by_chunks, ids};

use std::path::PathBuf;

use snug_engine::sampling::argmax;
use snug_engine::{Engine, EngineOptions};
use snug_kernels::GgmlType;
use snug_model::gguf::Value;
use snug_model::testing::synth::{self, Shape, Spec};
use snug_model::testing::{model_path, TestBackend, LLAMA_CPP, NATIVE};
use snug_model::{LoadOptions, ModelFiles};

/// The blocks' scale: larger than a real model's, for sharp logits (and
/// so fewer near-ties).
const SCALE: f32 = 0.02;

/// llama.cpp top-2 margin (nats) above which the top-1 tokens must agree.
const CLEAR_MARGIN: f64 = 0.5;
/// The same for a mixture of experts.
const CLEAR_MARGIN_MOE: f64 = 1.0;

/// The files: (name, architecture, the real model whose tokenizer it
/// takes, shape, matrix type, head type). The same specs are written by
/// `scripts/make_synth_fixtures.py` (through `synth_gguf`) for llama.cpp.
/// The `llama-TYPE` files are `llama`'s shape in each further tensor type
/// (their minimums centred as `synth` centres them; the output head stays
/// Q8_0).
fn specs() -> Vec<(&'static str, &'static str, &'static str, Shape, GgmlType, GgmlType)> {
    let s = |dim, layers, heads, kv_heads, ff, head_dim| Shape {
        dim,
        layers,
        heads,
        kv_heads,
        ff,
        head_dim,
    };
    vec![
        (
            "llama",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        (
            "qwen2",
            "qwen2",
            "qwen2.5-coder-0.5b",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q4_0,
            GgmlType::Q8_0,
        ),
        // A head width (8 x 64) other than the model's width, as Qwen3's.
        (
            "qwen3",
            "qwen3",
            "qwen2.5-coder-0.5b",
            s(256, 2, 8, 2, 768, 64),
            GgmlType::Q5_0,
            GgmlType::Q8_0,
        ),
        (
            "gemma3",
            "gemma3",
            "gemma3-270m",
            s(256, 6, 4, 1, 512, 128),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        // Four layers, the last without RoPE.
        (
            "smollm3",
            "smollm3",
            "smollm2-135m",
            s(256, 4, 4, 2, 512, 64),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        (
            "granite",
            "granite",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        // `llama` with Llama 3.1's RoPE scaling (a `rope_freqs` tensor),
        // and with linear scaling: the same weights as `llama`.
        (
            "llama3",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        (
            "llama-linear",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        // Eight experts of 128, two a row.
        (
            "qwen3moe",
            "qwen3moe",
            "qwen2.5-coder-0.5b",
            s(256, 2, 8, 2, 512, 64),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        (
            "mixtral",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        // Fused query/key/value and gate/up matrices. (Not named "phi3":
        // llama.cpp then looks for Phi-3's own special tokens.)
        (
            "phi",
            "phi3",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        (
            "llama-q2_k",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q2K,
            GgmlType::Q8_0,
        ),
        (
            "llama-q3_k",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q3K,
            GgmlType::Q8_0,
        ),
        (
            "llama-q5_k",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::Q5K,
            GgmlType::Q8_0,
        ),
        (
            "llama-iq4_nl",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::IQ4NL,
            GgmlType::Q8_0,
        ),
        (
            "llama-iq4_xs",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::IQ4XS,
            GgmlType::Q8_0,
        ),
        (
            "llama-mxfp4",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::MXFP4,
            GgmlType::Q8_0,
        ),
        (
            "llama-f16",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::F16,
            GgmlType::Q8_0,
        ),
        (
            "llama-bf16",
            "llama",
            "smollm2-135m",
            s(256, 2, 4, 2, 512, 64),
            GgmlType::BF16,
            GgmlType::Q8_0,
        ),
    ]
}

/// The frequency divisors of spec `name` (larger than Llama 3.1's, which
/// change only the slowest pairs, so that they change the tokens).
fn rope_freqs(name: &str) -> Option<Vec<f32>> {
    (name == "llama3").then(|| vec![1.0, 1.5, 3.0, 8.0])
}

/// More metadata of spec `name`: Mixtral's layout (a `llama` file with
/// experts, each of the feed-forward width) has 4, 2 a token.
fn extra(name: &str) -> Vec<(String, Value)> {
    if name != "mixtral" {
        return Vec::new();
    }
    vec![
        ("llama.expert_count".into(), Value::U32(4)),
        ("llama.expert_used_count".into(), Value::U32(2)),
    ]
}

/// The linear RoPE scaling factor of spec `name`.
fn rope_linear(name: &str) -> Option<f32> {
    (name == "llama-linear").then_some(4.0)
}

/// A test's own folder of synthesized files, removed when it ends.
struct Folder(PathBuf);

impl Folder {
    fn new(test: &str) -> Folder {
        let dir = std::env::temp_dir().join(format!("snug-synth-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Folder(dir)
    }

    /// Writes spec `name` here (once).
    fn file(&self, name: &str) -> Option<PathBuf> {
        let (_, arch, like, shape, ty, head_ty) = specs().into_iter().find(|s| s.0 == name).unwrap();
        let like = model_path(like)?;
        let out = self.0.join(format!("{name}.gguf"));
        if !out.exists() {
            let like = snug_model::gguf::GgufFile::open(&like).unwrap();
            let spec = Spec {
                arch: arch.into(),
                shape,
                ty,
                head_ty,
                window: 8,
                scale: SCALE,
                name: format!("synthetic {name}"),
                tokenizer_only: false,
                rope_freqs: rope_freqs(name),
                rope_linear: rope_linear(name),
                extra: extra(name),
            };
            synth::write(&like.header, &spec, &out).unwrap();
        }
        Some(out)
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn engine<'m>(model: &'m snug_model::arch::Model<'m>) -> Engine<'m> {
    Engine::new(
        model,
        EngineOptions {
            threads: 2,
            ctx: 128,
            batch: 32,
            page_tokens: 16,
            ..Default::default()
        },
    )
}

/// Stand-in prompt tokens (any ids of the vocabulary do).
fn prompt(vocab: usize) -> Vec<u32> {
    (0..40).map(|i| ((i * 7919 + 13) % (vocab - 1) + 1) as u32).collect()
}

#[test]
fn every_architecture_loads_and_keeps_a_rows_bits_in_any_batch() {
    let folder = Folder::new("batches");
    for (name, arch, ..) in specs() {
        let Some(path) = folder.file(name) else { continue };
        let files = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let model = NATIVE.load(&files).unwrap();
        assert_eq!(model.config.arch.name, arch);
        let mut e = engine(&model);
        let ids = prompt(model.config.vocab);
        let whole = by_chunks(&mut e, &ids, 32);
        assert_eq!(whole, by_chunks(&mut e, &ids, 1), "{name}: a row at a time");
        assert_eq!(whole, by_chunks(&mut e, &ids, 7), "{name}: chunks of 7");
        // Not degenerate: the rows' logits differ from one another.
        assert!(whole.windows(2).any(|w| w[0] != w[1]), "{name}: every row alike");
    }
}

#[test]
fn rope_scaling_is_read_and_changes_the_result() {
    let folder = Folder::new("rope");
    let logits = |name: &str| {
        let path = folder.file(name)?;
        let files = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let model = NATIVE.load(&files).unwrap();
        let mut e = engine(&model);
        Some(by_chunks(&mut e, &prompt(model.config.vocab), 32))
    };
    let (Some(plain), Some(llama3), Some(linear)) = (logits("llama"), logits("llama3"), logits("llama-linear")) else {
        return;
    };
    // The same weights: only the rotation differs (the first position's
    // is the identity under any scaling).
    assert_ne!(plain, llama3, "rope_freqs ignored");
    assert_ne!(plain, linear, "linear scaling ignored");
    // And in llama.cpp, where its reference is present, the scaling
    // changes the greedy tokens (so its equality below means something).
    if let Some(fx) = reference() {
        let m = &fx["models"];
        if m.get("llama3").is_some() {
            assert_ne!(m["llama"]["ids"], m["llama3"]["ids"]);
            assert_ne!(m["llama"]["ids"], m["llama-linear"]["ids"]);
        }
    }
}

#[test]
fn a_rope_scaling_snug_does_not_run_is_refused_at_load() {
    let Some(like) = model_path("smollm2-135m") else { return };
    let like = snug_model::gguf::GgufFile::open(&like).unwrap();
    let folder = Folder::new("yarn");
    let out = folder.0.join("yarn.gguf");
    let (_, _, _, shape, ty, head_ty) = specs().into_iter().find(|s| s.0 == "llama").unwrap();
    let spec = Spec {
        arch: "llama".into(),
        shape,
        ty,
        head_ty,
        window: 8,
        scale: SCALE,
        name: "synthetic yarn".into(),
        tokenizer_only: false,
        rope_freqs: None,
        rope_linear: None,
        extra: vec![
            ("llama.rope.scaling.type".into(), Value::String("yarn".into())),
            ("llama.rope.scaling.factor".into(), Value::F32(4.0)),
        ],
    };
    synth::write(&like.header, &spec, &out).unwrap();
    let files = ModelFiles::open(&out, &LoadOptions::default()).unwrap();
    let err = NATIVE
        .load(&files)
        .err()
        .expect("a YaRN file must not load")
        .to_string();
    assert!(err.contains("\"yarn\"") && err.contains("not supported"), "{err}");
}

/// llama.cpp's greedy reference for the synthesized files, where present.
fn reference() -> Option<serde_json::Value> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/synth-llama-cpp.json"));
    Some(serde_json::from_str(&std::fs::read_to_string(p).ok()?).unwrap())
}

fn greedy_against_llama_cpp(backend: TestBackend) {
    let Some(fx) = reference() else { return };
    let folder = Folder::new(backend.name);
    for (name, ..) in specs() {
        let Some(case) = fx["models"].get(name) else { continue };
        let Some(path) = folder.file(name) else { continue };
        let files = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let model = backend.load(&files).unwrap();
        let mut e = engine(&model);
        let prompt = ids(&case["prompt_ids"]);
        let reference = ids(&case["ids"]);
        let seq = e.create_sequence();
        let mut top1 = argmax(e.feed(seq, &prompt).unwrap());
        let mut checked = 0;
        assert_eq!(
            case["steps"].as_array().unwrap().len(),
            reference.len(),
            "{name}: one step per token"
        );
        for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            // No margin where llama.cpp's server gave no probabilities
            // (a token ending inside a UTF-8 character).
            let margin = match step["top"].as_array() {
                Some(top) => top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap(),
                None => 0.0,
            };
            // A mixture of experts may take another expert where two
            // router scores nearly tie, a larger change than rounding makes.
            let clear = if name.contains("moe") || name == "mixtral" {
                CLEAR_MARGIN_MOE
            } else {
                CLEAR_MARGIN
            };
            if backend.name == "llama_cpp" || margin > clear {
                assert_eq!(
                    top1, reference[i],
                    "{name} ({}): step {i}, margin {margin:.3}",
                    backend.name
                );
                checked += 1;
            }
            // Teacher-forced along llama.cpp's tokens.
            top1 = argmax(e.feed(seq, &[reference[i]]).unwrap());
        }
        eprintln!(
            "{name} ({}): {checked} of {} steps checked",
            backend.name,
            reference.len()
        );
    }
}

#[test]
fn llama_cpp_numerics_give_llama_cpps_tokens() {
    greedy_against_llama_cpp(LLAMA_CPP);
}

#[test]
fn native_numerics_agree_with_llama_cpp_where_the_margin_is_clear() {
    greedy_against_llama_cpp(NATIVE);
}

/// KL(p || q) of two logit rows, in nats.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let lse = |x: &[f32]| {
        let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p), lse(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = a as f64 - lp;
            la.exp() * (la - (b as f64 - lq))
        })
        .sum()
}

/// snug's own numerics against its copy of llama.cpp's (whose tokens are
/// llama.cpp's, above), along llama.cpp's greedy tokens: per file, the
/// largest logit difference and the largest and median KL divergence over
/// the steps (printed; docs/MODEL_FILES.md keeps the figures). Both stay
/// small on dense files; a mixture of experts can take another expert
/// where two router scores nearly tie, and then differs more at that step.
#[test]
fn native_and_llama_cpp_numerics_differ_little() {
    let Some(fx) = reference() else { return };
    let folder = Folder::new("kl");
    for (name, ..) in specs() {
        let Some(case) = fx["models"].get(name) else { continue };
        let Some(path) = folder.file(name) else { continue };
        let files = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let (mn, mg) = (NATIVE.load(&files).unwrap(), LLAMA_CPP.load(&files).unwrap());
        let (mut en, mut eg) = (engine(&mn), engine(&mg));
        let (sn, sg) = (en.create_sequence(), eg.create_sequence());
        let prompt = ids(&case["prompt_ids"]);
        let mut a = en.feed(sn, &prompt).unwrap().to_vec();
        let mut b = eg.feed(sg, &prompt).unwrap().to_vec();
        let (mut max_abs, mut kls) = (0f32, Vec::new());
        for &t in &ids(&case["ids"]) {
            max_abs = a.iter().zip(&b).fold(max_abs, |m, (x, y)| m.max((x - y).abs()));
            kls.push(kl(&b, &a));
            a = en.feed(sn, &[t]).unwrap().to_vec();
            b = eg.feed(sg, &[t]).unwrap().to_vec();
        }
        kls.sort_by(f64::total_cmp);
        let (median, worst) = (kls[kls.len() / 2], kls[kls.len() - 1]);
        eprintln!("{name}: max |logit difference| {max_abs:.4}, KL median {median:.2e}, max {worst:.2e}");
        assert!(median < 0.1, "{name}: KL median {median}");
    }
}
