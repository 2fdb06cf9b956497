//! Any file given as a saved session is opened, checked and restored into
//! an engine of the small model, or refused with an error: never a panic,
//! a hang, or pages left taken.
//!
//! Checksums would stop almost every input at the header, so when the
//! first input byte is odd the target first makes the header's and every
//! in-range section's CRC-32 right: the fuzzer then reaches the META,
//! TOKN, BASI and KV sections' own checks. Needs `smollm2-135m` pulled
//! (or `SNUG_TEST_MODELS`).

#![no_main]

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use snug_engine::session::{ModelIdentity, SessionFile, MAGIC, VERSION};
use snug_engine::{Engine, EngineOptions};
use snug_model::arch::Model;
use snug_model::{LoadOptions, ModelFiles};

const TOC_ENTRY: usize = 32;

fn fix_checksums(b: &mut [u8]) {
    if b.len() < 20 {
        return;
    }
    b[..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    let n = u32::from_le_bytes(b[12..16].try_into().unwrap()) % 17;
    b[12..16].copy_from_slice(&n.to_le_bytes());
    let hl = 16 + n as usize * TOC_ENTRY + 4;
    if b.len() < hl {
        return;
    }
    for i in 0..n as usize {
        let e = 16 + i * TOC_ENTRY;
        let off = u64::from_le_bytes(b[e + 8..e + 16].try_into().unwrap());
        let len = u64::from_le_bytes(b[e + 16..e + 24].try_into().unwrap());
        if let Some(end) = off.checked_add(len).filter(|&end| end <= b.len() as u64) {
            let crc = crc32fast::hash(&b[off as usize..end as usize]);
            b[e + 24..e + 28].copy_from_slice(&crc.to_le_bytes());
        }
    }
    let crc = crc32fast::hash(&b[..hl - 4]);
    b[hl - 4..hl].copy_from_slice(&crc.to_le_bytes());
}

struct World {
    model: &'static Model<'static>,
    /// Engines by KV layout (formats, page size, key basis).
    engines: HashMap<String, Engine<'static>>,
    path: std::path::PathBuf,
}

fn world() -> &'static Mutex<World> {
    static W: OnceLock<Mutex<World>> = OnceLock::new();
    W.get_or_init(|| {
        let path = snug_model::testing::model_path("smollm2-135m").expect("smollm2-135m is pulled");
        let files: &'static ModelFiles = Box::leak(Box::new(ModelFiles::open(&path, &LoadOptions::default()).unwrap()));
        let model: &'static Model<'static> = Box::leak(Box::new(Model::load(files).unwrap()));
        let dir = std::path::Path::new("/dev/shm").join(format!("snug-fuzz-session-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Mutex::new(World {
            model,
            engines: HashMap::new(),
            path: dir.join("input.snug"),
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flag, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if flag & 1 == 1 {
        fix_checksums(&mut bytes);
    }
    let mut w = world().lock().unwrap();
    std::fs::write(&w.path, &bytes).unwrap();
    let Ok(file) = SessionFile::open(&w.path) else { return };
    let _ = file.verify();
    let _ = file.sections();
    // The identity the file claims, so that the fuzzer gets past it.
    let id = &file.meta.identity;
    let identity = ModelIdentity {
        model_sha256: id.model_sha256.clone(),
        tokenizer_sha256: id.tokenizer_sha256.clone(),
        model_name: "smollm2-135m".into(),
    };
    let base = EngineOptions {
        threads: 1,
        ctx: 256,
        batch: 16,
        ..Default::default()
    };
    let model = w.model;
    let Ok(options) = file.engine_options(model, &identity, base) else {
        return;
    };
    let key = format!("{}/{}/{}/{}", id.kv_k, id.kv_v, id.page_tokens, id.key_basis_sha256);
    if w.engines.len() >= 8 && !w.engines.contains_key(&key) {
        w.engines.clear();
    }
    let engine = w.engines.entry(key).or_insert_with(|| Engine::new(model, options));
    let before = engine.kv_bytes();
    match engine.restore_session(&file, &identity) {
        Ok(seq) => engine.free_sequence(seq),
        Err(_) => assert_eq!(engine.kv_bytes(), before, "a refused session left pages taken"),
    }
    assert_eq!(engine.kv_bytes(), before, "pages leaked");
});
