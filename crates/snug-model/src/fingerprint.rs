//! Fingerprints that say which model and tokenizer a saved KV cache
//! belongs to.
//!
//! The model's is the SHA-256 of the whole file (metadata and tensor
//! data). Hashing a 1 GB file takes about a second, so the digest is kept
//! in a small cache entry per file path, valid while the file's size and
//! modification time are unchanged.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::gguf::{Array, GgufHeader, Value};

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of the file at `path`, hex. With `cache`, a digest recorded for
/// the same path, size and modification time is reused, and a new one is
/// recorded (best effort: a cache that cannot be written only costs time).
pub fn file_sha256(path: &Path, cache: Option<&Path>) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let stamp = format!("{} {}", meta.len(), mtime);
    let entry: Option<PathBuf> = cache.map(|dir| {
        let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let name = hex(&Sha256::digest(key.to_string_lossy().as_bytes()));
        dir.join("fingerprints").join(&name[..32])
    });
    if let Some(e) = &entry {
        if let Ok(text) = std::fs::read_to_string(e) {
            if let Some((digest, rest)) = text.trim().split_once(' ') {
                if rest == stamp && digest.len() == 64 {
                    return Ok(digest.to_string());
                }
            }
        }
    }
    let digest = crate::pull::sha256_file(path)?;
    if let Some(e) = &entry {
        let record = || -> std::io::Result<()> {
            if let Some(dir) = e.parent() {
                std::fs::create_dir_all(dir)?;
            }
            snug_core::durable::write(e, format!("{digest} {stamp}\n").as_bytes())
        };
        let _ = record();
    }
    Ok(digest)
}

fn hash_array(h: &mut Sha256, a: &Array) {
    macro_rules! each {
        ($v:expr, $tag:expr) => {{
            h.update([$tag]);
            h.update((($v).len() as u64).to_le_bytes());
            for x in $v {
                h.update(x.to_le_bytes());
            }
        }};
    }
    match a {
        Array::U8(v) => each!(v, 0),
        Array::I8(v) => each!(v, 1),
        Array::U16(v) => each!(v, 2),
        Array::I16(v) => each!(v, 3),
        Array::U32(v) => each!(v, 4),
        Array::I32(v) => each!(v, 5),
        Array::F32(v) => each!(v, 6),
        Array::Bool(v) => {
            h.update([7]);
            h.update((v.len() as u64).to_le_bytes());
            h.update(v.iter().map(|&b| b as u8).collect::<Vec<u8>>());
        }
        Array::String(v) => {
            h.update([8]);
            h.update((v.len() as u64).to_le_bytes());
            for s in v {
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
        Array::Array(v) => {
            h.update([9]);
            h.update((v.len() as u64).to_le_bytes());
            for x in v {
                hash_array(h, x);
            }
        }
        Array::U64(v) => each!(v, 10),
        Array::I64(v) => each!(v, 11),
        Array::F64(v) => each!(v, 12),
    }
}

fn hash_value(h: &mut Sha256, v: &Value) {
    match v {
        Value::U8(x) => h.update([[0].as_slice(), &x.to_le_bytes()].concat()),
        Value::I8(x) => h.update([[1].as_slice(), &x.to_le_bytes()].concat()),
        Value::U16(x) => h.update([[2].as_slice(), &x.to_le_bytes()].concat()),
        Value::I16(x) => h.update([[3].as_slice(), &x.to_le_bytes()].concat()),
        Value::U32(x) => h.update([[4].as_slice(), &x.to_le_bytes()].concat()),
        Value::I32(x) => h.update([[5].as_slice(), &x.to_le_bytes()].concat()),
        Value::F32(x) => h.update([[6].as_slice(), &x.to_le_bytes()].concat()),
        Value::Bool(x) => h.update([7, *x as u8]),
        Value::String(s) => {
            h.update([8]);
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        Value::Array(a) => hash_array(h, a),
        Value::U64(x) => h.update([[10].as_slice(), &x.to_le_bytes()].concat()),
        Value::I64(x) => h.update([[11].as_slice(), &x.to_le_bytes()].concat()),
        Value::F64(x) => h.update([[12].as_slice(), &x.to_le_bytes()].concat()),
    }
}

/// SHA-256 of the tokenizer's metadata (every `tokenizer.*` key and its
/// value, in file order), hex.
pub fn tokenizer_sha256(header: &GgufHeader) -> String {
    let mut h = Sha256::new();
    for (k, v) in header.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
        h.update((k.len() as u64).to_le_bytes());
        h.update(k.as_bytes());
        hash_value(&mut h, v);
    }
    hex(&h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_digest_is_cached_until_the_file_changes() {
        let dir = std::env::temp_dir().join(format!("snug-fp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("model.gguf");
        std::fs::write(&f, b"abc").unwrap();
        let cache = dir.join("cache");
        let want = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(file_sha256(&f, Some(&cache)).unwrap(), want);
        // A recorded digest is used while size and time match...
        let entry = std::fs::read_dir(cache.join("fingerprints"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let text = std::fs::read_to_string(&entry).unwrap();
        std::fs::write(&entry, text.replacen(want, &"0".repeat(64), 1)).unwrap();
        assert_eq!(file_sha256(&f, Some(&cache)).unwrap(), "0".repeat(64));
        // ...and not once the file changed.
        std::fs::write(&f, b"abcd").unwrap();
        assert_eq!(
            file_sha256(&f, Some(&cache)).unwrap(),
            "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
