//! Session files from the command line: the model's identity, where named
//! chat sessions live, and `snug session info`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use snug_engine::session::{ModelIdentity, SessionFile};
use snug_model::GgufFile;

use crate::{SessionInfoArgs, SessionListArgs};

/// The model half of a session identity: the file's SHA-256 (cached per
/// path, size and time under the cache folder) and the tokenizer's.
pub fn model_identity(path: &Path, file: &GgufFile, name: &str) -> Result<ModelIdentity> {
    let cache = crate::env::get().cache.clone();
    Ok(ModelIdentity {
        model_sha256: snug_model::fingerprint::file_sha256(path, Some(&cache))
            .with_context(|| format!("fingerprinting {}", path.display()))?,
        tokenizer_sha256: snug_model::fingerprint::tokenizer_sha256(&file.header),
        model_name: name.to_string(),
    })
}

/// A chat session's file: a path as given when it looks like one (holds
/// a `/` or ends in `.snug`), else `NAME.snug` in the cache's sessions
/// folder.
pub fn chat_session_path(name: &str) -> Result<PathBuf> {
    if name.contains('/') || name.ends_with(".snug") {
        return Ok(PathBuf::from(name));
    }
    if name.is_empty() || name.starts_with('.') {
        anyhow::bail!("session name {name:?}: use letters, digits, '-' or '_'");
    }
    let dir = crate::env::get().cache.clone().join("sessions");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir.join(format!("{name}.snug")))
}

pub fn cmd_info(a: SessionInfoArgs) -> Result<()> {
    let f = SessionFile::open(&a.file)?;
    f.verify()?;
    let m = &f.meta;
    let id = &m.identity;
    if a.json {
        let v = serde_json::json!({
            "file": a.file.display().to_string(),
            "bytes": f.bytes,
            "version": snug_engine::session::VERSION,
            "checksums": "ok",
            "meta": m,
            "sections": f.sections().iter().map(|(t, o, n)| serde_json::json!({"tag": t, "offset": o, "bytes": n})).collect::<Vec<_>>(),
        });
        println!("{v}");
        return Ok(());
    }
    let h = crate::human_bytes;
    println!(
        "session    {} ({}, format version {}, checksums ok)",
        a.file.display(),
        h(f.bytes),
        snug_engine::session::VERSION
    );
    println!(
        "model      {} (sha256 {}), {} {} layers x {} KV heads x {}",
        m.model_name, id.model_sha256, id.arch, id.layers, id.kv_heads, id.head_dim
    );
    println!("tokenizer  sha256 {}", id.tokenizer_sha256);
    println!(
        "KV         keys {}, values {}, {} positions a page{}{}",
        id.kv_k,
        id.kv_v,
        id.page_tokens,
        if id.rotation_sha256.is_empty() {
            String::new()
        } else {
            format!(", rotation {}", id.rotation_sha256.chars().take(16).collect::<String>())
        },
        if id.key_basis_sha256.is_empty() {
            String::new()
        } else {
            format!(
                ", key basis {}",
                id.key_basis_sha256.chars().take(16).collect::<String>()
            )
        },
    );
    println!(
        "tokens     {} ({} with KV, {} exact-window pages)",
        m.tokens,
        m.kv_tokens,
        m.twins.len()
    );
    let s = &m.sampling;
    println!(
        "sampler    temperature {}, top-k {}, top-p {}, min-p {}, repeat penalty {}, presence penalty {}, seed {}",
        s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.presence_penalty, s.seed
    );
    if let Some(msgs) = &m.messages {
        println!("chat       {} messages", msgs.len());
    }
    println!("saved by   snug {} at unix time {}", m.snug_version, m.created_unix);
    for (t, o, n) in f.sections() {
        println!("section    {t} at {o}, {}", h(n));
    }
    Ok(())
}

/// `snug session list`: each `NAME.snug` in the cache's sessions folder,
/// with what its header says (a damaged file is listed with why).
pub fn cmd_list(a: SessionListArgs) -> Result<()> {
    let dir = crate::env::get().cache.clone().join("sessions");
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(rd) => rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "snug"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    files.sort();
    if files.is_empty() && !a.json {
        eprintln!("no sessions in {}", dir.display());
    }
    for path in files {
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        match SessionFile::open(&path) {
            Ok(f) => {
                let m = &f.meta;
                let messages = m.messages.as_ref().map_or(0, Vec::len);
                if a.json {
                    let v = serde_json::json!({
                        "name": name,
                        "file": path.display().to_string(),
                        "bytes": f.bytes,
                        "model": m.model_name,
                        "tokens": m.tokens,
                        "messages": messages,
                        "kv": format!("{}/{}", m.identity.kv_k, m.identity.kv_v),
                        "created_unix": m.created_unix,
                    });
                    println!("{v}");
                } else {
                    println!(
                        "{name}\t{}\t{} tokens\t{messages} messages\tKV {}/{}\t{}",
                        m.model_name,
                        m.tokens,
                        m.identity.kv_k,
                        m.identity.kv_v,
                        crate::human_bytes(f.bytes)
                    );
                }
            }
            Err(e) => {
                if a.json {
                    println!(
                        "{}",
                        serde_json::json!({"name": name, "file": path.display().to_string(), "error": e.to_string()})
                    );
                } else {
                    println!("{name}\tdamaged: {e}");
                }
            }
        }
    }
    Ok(())
}
