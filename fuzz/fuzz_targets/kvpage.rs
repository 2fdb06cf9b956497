//! Any file found in the prefix cache's folder under a page's name is
//! read into a page or refused (and deleted): never a panic. A page read
//! back is exactly the bytes the file held after its header.
//!
//! The first byte picks the key and value formats; when it is odd the
//! target writes a right header (magic, version, length, CRC-32) before
//! the rest, so the fuzzer reaches the import of every format.

#![no_main]

use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use snug_engine::prefix_disk::DiskTier;
use snug_kernels::kv::{KvFormat, KvShape, KvStorage, KvStore};

const SHAPE: KvShape = KvShape {
    layers: 2,
    kv_heads: 2,
    head_dim: 64,
    page_tokens: 4,
};

struct World {
    tier: DiskTier,
    stores: Vec<KvStorage>,
}

fn world() -> &'static Mutex<World> {
    static W: OnceLock<Mutex<World>> = OnceLock::new();
    W.get_or_init(|| {
        let root = std::path::Path::new("/dev/shm").join(format!("snug-fuzz-kvpage-{}", std::process::id()));
        let tier = DiskTier::open(&root, "fuzz", 1 << 30).unwrap();
        let formats = [KvFormat::F16, KvFormat::F32, KvFormat::Q8, KvFormat::Tq4];
        let mut stores = Vec::new();
        for k in formats {
            for v in formats {
                stores.push(KvStorage::with_formats(SHAPE, k, v, 2));
            }
        }
        Mutex::new(World { tier, stores })
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flag, rest)) = data.split_first() else {
        return;
    };
    let mut w = world().lock().unwrap();
    let w = &mut *w;
    let which = (flag >> 1) as usize % w.stores.len();
    let store = &mut w.stores[which];
    let key = [7u8; 32];
    let path = w.tier.dir().join(format!("{}.kvpage", "07".repeat(32)));
    let mut file = Vec::with_capacity(24 + rest.len());
    let body: &[u8] = if flag & 1 == 1 {
        file.extend_from_slice(b"SNUGPAGE");
        file.extend_from_slice(&1u32.to_le_bytes());
        file.extend_from_slice(&crc32fast::hash(rest).to_le_bytes());
        file.extend_from_slice(&(rest.len() as u64).to_le_bytes());
        rest
    } else {
        rest.get(24..).unwrap_or(&[])
    };
    file.extend_from_slice(rest);
    std::fs::write(&path, &file).unwrap();
    let pt = store.shape().page_tokens;
    if w.tier.read(&key, store, 1) {
        let mut back = Vec::new();
        store
            .export_page::<()>(1, pt, false, |r| {
                back.extend_from_slice(r);
                Ok(())
            })
            .unwrap();
        assert_eq!(back, body, "a page read back differs from its file");
    } else {
        assert!(!path.exists(), "a refused page file was kept");
    }
});
