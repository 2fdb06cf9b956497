//! Sessions: a sequence saved to a file and restored into a fresh engine
//! goes on exactly as the uninterrupted engine does (greedy and seeded
//! sampling, F16, Q8 and TQ4 pages), and every kind of bad file is refused
//! with its own error before any of it is used.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use std::path::{Path, PathBuf};

use snug_core::speculate::Mode;
use snug_engine::generate::GenerateRequest;
use snug_engine::sampling::SamplingParams;
use snug_engine::session::{ModelIdentity, SessionError, SessionFile};
use snug_engine::{Engine, EngineOptions, SeqId};
use snug_kernels::kv::KvFormat;
use snug_model::arch::Model;
use snug_model::testing::model_path;
use snug_model::{EncodeOptions, LoadOptions, ModelFiles, Tokenizer};

const PROMPT: &str = "The lighthouse keeper wrote in his log every night. On the first night he wrote:";

fn options(kv: KvFormat) -> EngineOptions {
    EngineOptions {
        threads: 2,
        ctx: 512,
        batch: 32,
        page_tokens: 16,
        kv_format: kv,
        ..Default::default()
    }
}

fn identity() -> ModelIdentity {
    ModelIdentity {
        model_sha256: "a".repeat(64),
        tokenizer_sha256: "b".repeat(64),
        model_name: "smollm2-135m".into(),
    }
}

fn generate(
    engine: &mut Engine,
    seq: SeqId,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
    n: usize,
) -> Vec<u32> {
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: n,
        params: params.clone(),
        stop: Vec::new(),
        speculate: Mode::On,
        constraint: None,
    };
    engine.generate(seq, tok, &req, |_| {}).unwrap().tokens
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("snug-session-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

struct Fixture {
    file: ModelFiles,
    path: PathBuf,
}

fn smollm2() -> Option<Fixture> {
    let path = model_path("smollm2-135m")?;
    Some(Fixture {
        file: ModelFiles::open(&path, &LoadOptions::default()).unwrap(),
        path,
    })
}

snug_model::test_backends! {
    fn a_restored_session_goes_on_as_the_uninterrupted_run(backend) {
        let Some(fx) = smollm2() else { return };
        let model = backend.load(&fx.file).unwrap();
        let tok = Tokenizer::from_gguf(&fx.file).unwrap();
        let prompt = tok.encode(PROMPT, EncodeOptions::default());
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
            repeat_penalty: 1.1,
            seed: 11,
            ..Default::default()
        };
        for kv in [KvFormat::F16, KvFormat::Q8, KvFormat::Tq4] {
            let mut base = options(kv);
            if kv == KvFormat::Tq4 {
                let calib = tok.encode(snug_engine::calibrate::TEXT, EncodeOptions::default());
                base.key_basis = Some(snug_engine::calibrate::key_basis(&model, &calib, 2).unwrap());
            }
            for (name, params) in [("greedy", SamplingParams::default()), ("sampled", sampled.clone())] {
                let what = format!("{} {name}", kv.name());
                // Uninterrupted: 40 tokens.
                let mut a = Engine::new(&model, base.clone());
                let s = a.create_sequence();
                let whole = generate(&mut a, s, &tok, &prompt, &params, 40);
                // Interrupted after 23 (the sequence ends inside a page), saved.
                let mut b = Engine::new(&model, base.clone());
                let s = b.create_sequence();
                let first = generate(&mut b, s, &tok, &prompt, &params, 23);
                assert_eq!(first[..], whole[..23], "{what}");
                let all: Vec<u32> = prompt.iter().chain(&first).copied().collect();
                let file = temp(&format!("{}-{name}.snug", kv.name()));
                let saved = b.save_session(s, &file, &identity(), &all, &params, None).unwrap();
                assert!(saved.kv_bytes > 0);
                drop(b);
                // A fresh engine built from the file alone.
                let f = SessionFile::open(&file).unwrap();
                assert_eq!(f.tokens, all);
                assert_eq!(f.meta.sampling, params);
                let opts = f.engine_options(&model, &identity(), options(KvFormat::F16)).unwrap();
                let mut c = Engine::new(&model, opts);
                let free = c.kv_bytes();
                let r = c.restore_session(&f, &identity()).unwrap();
                assert!(c.kv_bytes().1 > free.1);
                assert_eq!(c.rows_computed(), 0, "{what}: nothing recomputed");
                assert_eq!(c.tokens(r).unwrap(), &all[..f.meta.kv_tokens], "{what}");
                let rest = generate(&mut c, r, &tok, &all, &f.meta.sampling, 17);
                assert_eq!(rest[..], whole[23..], "{what}: continuation after restore");
                // The one token not yet in the KV, then one row per new token
                // (drafts aside): the restored positions are not recomputed.
                assert!(c.rows_computed() < 40, "{what}: {} rows", c.rows_computed());
            }
        }
    }
}

/// Saves a session of the model's first tokens; returns its path.
fn saved(model: &Model, tok: &Tokenizer, name: &str, kv: KvFormat) -> PathBuf {
    let mut e = Engine::new(model, options(kv));
    let s = e.create_sequence();
    let prompt = tok.encode(PROMPT, EncodeOptions::default());
    let out = generate(&mut e, s, tok, &prompt, &SamplingParams::default(), 5);
    let all: Vec<u32> = prompt.iter().chain(&out).copied().collect();
    let path = temp(name);
    e.save_session(s, &path, &identity(), &all, &SamplingParams::default(), None)
        .unwrap();
    path
}

fn patched(from: &Path, name: &str, f: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut b = std::fs::read(from).unwrap();
    f(&mut b);
    let to = temp(name);
    std::fs::write(&to, b).unwrap();
    to
}

/// Opens and restores `path` into `engine`, which must be left as it was.
fn restore(engine: &mut Engine, path: &Path, id: &ModelIdentity) -> Result<SeqId, SessionError> {
    let before = engine.kv_bytes();
    let r = SessionFile::open(path).and_then(|f| engine.restore_session(&f, id));
    if r.is_err() {
        assert_eq!(engine.kv_bytes(), before, "a refused session leaves no pages taken");
    }
    r
}

snug_model::test_backends! {
    fn bad_session_files_are_refused_each_with_its_own_error(backend) {
        let Some(fx) = smollm2() else { return };
        let _ = &fx.path;
        let model = backend.load(&fx.file).unwrap();
        let tok = Tokenizer::from_gguf(&fx.file).unwrap();
        let good = saved(&model, &tok, "good.snug", KvFormat::F16);
        let mut e = Engine::new(&model, options(KvFormat::F16));
        let ok = restore(&mut e, &good, &identity()).unwrap();
        e.free_sequence(ok);
        let len = std::fs::metadata(&good).unwrap().len() as usize;
        let f = SessionFile::open(&good).unwrap();
        let sections = f.sections();
        let page_at = sections.iter().find(|s| s.0 == "PAGE").unwrap().1 as usize;
        let meta_at = sections.iter().find(|s| s.0 == "META").unwrap().1 as usize;

        let cut = patched(&good, "cut.snug", |b| b.truncate(len - 100));
        assert!(matches!(
            restore(&mut e, &cut, &identity()),
            Err(SessionError::Truncated { .. })
        ));
        let empty = patched(&good, "empty.snug", |b| b.clear());
        assert!(matches!(
            restore(&mut e, &empty, &identity()),
            Err(SessionError::NotASession(_))
        ));
        let other = patched(&good, "other.snug", |b| b[..4].copy_from_slice(b"GGUF"));
        assert!(matches!(
            restore(&mut e, &other, &identity()),
            Err(SessionError::NotASession(_))
        ));
        let version = patched(&good, "version.snug", |b| b[8] = 9);
        assert!(matches!(
            restore(&mut e, &version, &identity()),
            Err(SessionError::Version { found: 9, .. })
        ));
        // A bit flipped in the header, in META, deep in the KV pages.
        for (name, at, section) in [
            ("flip-head.snug", 20, "header"),
            ("flip-meta.snug", meta_at + 3, "META"),
            ("flip-page.snug", page_at + (len - page_at) / 2, "PAGE"),
        ] {
            let p = patched(&good, name, |b| b[at] ^= 0x10);
            match restore(&mut e, &p, &identity()) {
                Err(SessionError::Checksum { section: s, .. }) => assert!(s.starts_with(section), "{name}: {s}"),
                other => panic!("{name}: {other:?}"),
            }
        }
        // Another model, another tokenizer, another KV format.
        let mut wrong = identity();
        wrong.model_sha256 = "c".repeat(64);
        match restore(&mut e, &good, &wrong) {
            Err(e @ SessionError::Mismatch { what: "model", .. }) => assert!(e.to_string().contains("smollm2-135m")),
            other => panic!("{other:?}"),
        }
        let mut wrong = identity();
        wrong.tokenizer_sha256 = "d".repeat(64);
        assert!(matches!(
            restore(&mut e, &good, &wrong),
            Err(SessionError::Mismatch { what: "tokenizer", .. })
        ));
        let mut q8 = Engine::new(&model, options(KvFormat::Q8));
        assert!(matches!(
            restore(&mut q8, &good, &identity()),
            Err(SessionError::Mismatch {
                what: "KV format (keys/values)",
                ..
            })
        ));
        // A session file claiming a format this model cannot hold, or a page
        // size out of range, is refused before any engine is built.
        let f = SessionFile::open(&good).unwrap();
        let mut bad = SessionFile::open(&good).unwrap();
        bad.meta.identity.page_tokens = 1 << 40;
        assert!(matches!(
            bad.engine_options(&model, &identity(), options(KvFormat::F16)),
            Err(SessionError::Malformed { .. })
        ));
        let mut bad = SessionFile::open(&good).unwrap();
        bad.meta.identity.kv_k = "tq5".into();
        assert!(matches!(
            bad.engine_options(&model, &identity(), options(KvFormat::F16)),
            Err(SessionError::Malformed { .. })
        ));
        let mut wrong = identity();
        wrong.model_sha256 = "c".repeat(64);
        assert!(matches!(
            f.engine_options(&model, &wrong, options(KvFormat::F16)),
            Err(SessionError::Mismatch { what: "model", .. })
        ));
        // Token ids outside the vocabulary.
        let mut bad = SessionFile::open(&good).unwrap();
        bad.tokens[0] = 1 << 30;
        assert!(matches!(
            e.restore_session(&bad, &identity()),
            Err(SessionError::Malformed { .. })
        ));
        // The good file still restores.
        assert!(restore(&mut e, &good, &identity()).is_ok());
    }
}

snug_model::test_backends! {
    fn a_lossy_session_without_its_first_twin_is_refused(backend) {
        let Some(fx) = smollm2() else { return };
        let model = backend.load(&fx.file).unwrap();
        let tok = Tokenizer::from_gguf(&fx.file).unwrap();
        let good = saved(&model, &tok, "q8.snug", KvFormat::Q8);
        let mut e = Engine::new(&model, options(KvFormat::Q8));
        let mut f = SessionFile::open(&good).unwrap();
        assert!(f.meta.twins.contains(&0));
        f.meta.twins.retain(|&i| i != 0);
        assert!(matches!(
            e.restore_session(&f, &identity()),
            Err(SessionError::Malformed { .. })
        ));
        let mut f = SessionFile::open(&good).unwrap();
        f.meta.twins.push(f.meta.twins[0]);
        assert!(matches!(
            e.restore_session(&f, &identity()),
            Err(SessionError::Malformed { .. })
        ));
        assert_eq!(e.kv_bytes().1, 0, "nothing taken");
    }
}

snug_model::test_backends! {
    fn a_failed_save_leaves_the_previous_file_whole(backend) {
        let Some(fx) = smollm2() else { return };
        let model = backend.load(&fx.file).unwrap();
        let tok = Tokenizer::from_gguf(&fx.file).unwrap();
        let path = saved(&model, &tok, "kept.snug", KvFormat::F16);
        let before = std::fs::read(&path).unwrap();
        // A save whose tokens do not match the sequence is refused before
        // anything is written.
        let mut e = Engine::new(&model, options(KvFormat::F16));
        let s = e.create_sequence();
        e.feed(s, &[1, 2, 3]).unwrap();
        assert!(e
            .save_session(s, &path, &identity(), &[9, 9, 9], &SamplingParams::default(), None)
            .is_err());
        // A save into a directory that does not exist fails without touching
        // anything else.
        assert!(e
            .save_session(
                s,
                &temp("missing/x.snug"),
                &identity(),
                &[1, 2, 3],
                &SamplingParams::default(),
                None
            )
            .is_err());
        assert_eq!(std::fs::read(&path).unwrap(), before);
        assert!(SessionFile::open(&path).is_ok());
        let leftovers = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".tmp"))
            .count();
        assert_eq!(leftovers, 0);
    }
}

snug_model::test_backends! {
    fn a_rollback_recomputes_only_a_partial_page_that_lost_its_twin(backend) {
        let Some(fx) = smollm2() else { return };
        let model = backend.load(&fx.file).unwrap();
        let tok = Tokenizer::from_gguf(&fx.file).unwrap();
        let ids = tok.encode(PROMPT, EncodeOptions::default());
        let ids: Vec<u32> = ids.iter().cycle().take(70).copied().collect();
        for kv in [KvFormat::F16, KvFormat::Q8] {
            let mut e = Engine::new(&model, options(kv));
            let s = e.create_sequence();
            e.feed(s, &ids).unwrap();
            let rows = e.rows_computed();
            // Within the newest pages (16-position pages): nothing to redo.
            e.truncate(s, 61).unwrap();
            assert_eq!(e.rows_computed(), rows, "{}", kv.name());
            // Deep: F16 keeps every page exact; Q8's page 2 lost its twin and
            // its 5 positions are recomputed.
            e.truncate(s, 37).unwrap();
            let redo = if kv == KvFormat::F16 { 0 } else { 37 - 32 };
            assert_eq!(e.rows_computed(), rows + redo, "{}", kv.name());
            assert_eq!(e.tokens(s).unwrap(), &ids[..37]);
        }
    }
}
