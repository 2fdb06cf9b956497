//! `snug run`: one prompt in, generated text out.

use std::io::Write;

use anyhow::{bail, Context, Result};
use snug_core::speculate::Mode;
use snug_core::Ledger;
use snug_engine::generate::{GenerateRequest, Generation, SpecStats};
use snug_engine::sampling::SamplingParams;
use snug_engine::{Engine, EngineOptions};
use snug_kernels::kv::KvFormat;
use snug_model::arch::Model;
use snug_model::template::{ChatTemplate, Message};
use snug_model::{EncodeOptions, Tokenizer};

use crate::{open_model_at, read_stdin, GenArgs, RunArgs};

pub fn sampling(g: &GenArgs) -> SamplingParams {
    SamplingParams {
        temperature: g.temperature,
        top_k: g.top_k,
        top_p: g.top_p,
        min_p: g.min_p,
        repeat_penalty: g.repeat_penalty,
        presence_penalty: g.presence_penalty,
        penalty_last_n: 64,
        seed: g.seed,
    }
}

pub fn speculate_mode(g: &GenArgs) -> Result<Mode> {
    Mode::parse(&g.speculate).with_context(|| format!("unknown --speculate {:?} (on, off or auto)", g.speculate))
}

/// One line of `--stats` about speculation.
pub fn speculation_text(s: &SpecStats) -> String {
    format!(
        "speculation {}: {} rounds, {} drafted, {} accepted ({:.0}%), {:.2} accepted a round, {} plain steps; verify {:.0} ms, decode {:.0} ms",
        s.mode,
        s.rounds,
        s.drafted,
        s.accepted,
        s.acceptance_rate * 100.0,
        s.mean_accepted,
        s.fallbacks,
        s.verify_ms,
        s.decode_ms
    )
}

/// Appends one request's line to the metrics file, if one was asked for.
pub fn append_metrics(g: &GenArgs, model: &str, gen: &Generation) -> Result<()> {
    let Some(path) = &g.metrics_file else {
        return Ok(());
    };
    let line = serde_json::json!({
        "model": model,
        "prompt_tokens": gen.prompt_tokens,
        "reused_tokens": gen.reused_tokens,
        "output_tokens": gen.tokens.len(),
        "finish_reason": gen.finish_reason.as_str(),
        "ttft_ms": gen.stats.ttft_ms,
        "prefill_tok_s": gen.stats.prefill_tok_s,
        "decode_tok_s": gen.stats.decode_tok_s,
        "speculation": gen.stats.speculation,
    });
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening the metrics file {}", path.display()))?;
    // One write per line, so concurrent writers do not interleave lines.
    f.write_all(format!("{line}\n").as_bytes())
        .with_context(|| format!("writing the metrics file {}", path.display()))?;
    Ok(())
}

/// The key and value formats from `--kv` and its per-part overrides,
/// checked against the model's head size.
pub fn kv_formats(kv: &str, k: Option<&str>, v: Option<&str>, model: &Model) -> Result<(KvFormat, KvFormat)> {
    let parse = |name: &str| match KvFormat::parse(name) {
        Some(f) if f.supports_head_dim(model.config.head_dim) => Ok(f),
        Some(f) => bail!(
            "KV format {} cannot store this model's head size {}",
            f.name(),
            model.config.head_dim
        ),
        None => bail!("unknown KV format {name:?} (f16, f32, q8 or tq4)"),
    };
    Ok((parse(k.unwrap_or(kv))?, parse(v.unwrap_or(kv))?))
}

/// `--kv-page`, checked.
pub fn kv_page(a: &crate::KvArgs) -> Result<usize> {
    if !(1..=4096).contains(&a.kv_page) {
        bail!("--kv-page must be 1 to 4096 positions");
    }
    Ok(a.kv_page)
}

/// Gives TQ4 keys their key basis: one prefill of the calibration text
/// (see `snug_engine::calibrate`).
pub fn add_key_basis(o: &mut EngineOptions, model: &Model, tok: &Tokenizer) -> Result<()> {
    if o.kv_format != KvFormat::Tq4 {
        return Ok(());
    }
    let ids = tok.encode(
        snug_engine::calibrate::TEXT,
        EncodeOptions {
            add_special: true,
            parse_special: false,
        },
    );
    o.key_basis =
        Some(snug_engine::calibrate::key_basis(model, &ids, o.threads).context("calibrating the TQ4 key basis")?);
    Ok(())
}

pub fn engine_options(g: &GenArgs, model: &Model, tok: &Tokenizer) -> Result<EngineOptions> {
    let (kv_format, kv_format_v) = kv_formats(&g.cache.kv, g.cache.kv_k.as_deref(), g.cache.kv_v.as_deref(), model)?;
    let mut o = EngineOptions {
        kv_format,
        kv_format_v: Some(kv_format_v),
        page_tokens: kv_page(&g.cache)?,
        ..EngineOptions::default()
    };
    if let Some(t) = g.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        o.threads = t;
    }
    o.ctx = g.ctx.unwrap_or(model.config.context_length.min(4096));
    if o.ctx == 0 {
        bail!("--ctx must be at least 1");
    }
    if let Some(b) = &g.kv_budget {
        let budget = crate::parse_size(b)?;
        let page = snug_engine::kv_page_bytes(model, &o);
        if budget < page {
            bail!(
                "--kv-budget {b} is smaller than one KV page ({} for {} positions in these formats)",
                crate::human_bytes(page as u64),
                o.page_tokens
            );
        }
        o.kv_budget = Some(budget);
    }
    if o.ctx > model.config.context_length {
        eprintln!(
            "note: --ctx {} exceeds the model's context length {}; using {}",
            o.ctx, model.config.context_length, model.config.context_length
        );
    }
    add_key_basis(&mut o, model, tok)?;
    Ok(o)
}

/// The prompt's tokens, through the chat template when asked.
pub fn prompt_tokens(tok: &Tokenizer, file: &snug_model::GgufFile, prompt: &str, chat: bool) -> Result<Vec<u32>> {
    if !chat {
        return Ok(tok.encode(prompt, EncodeOptions::default()));
    }
    let template = ChatTemplate::for_model(file.get_str("tokenizer.chat_template"))?;
    let bos = tok.bos.and_then(|b| tok.token_text(b)).unwrap_or("");
    let eos = tok.eos.and_then(|e| tok.token_text(e)).unwrap_or("");
    let text = template.render(&[Message::new("user", prompt)], true, bos, eos, minijinja_empty())?;
    // The template writes BOS itself where the model wants it.
    Ok(tok.encode(
        &text,
        EncodeOptions {
            add_special: !text.starts_with(bos) || bos.is_empty(),
            parse_special: true,
        },
    ))
}

fn minijinja_empty() -> std::collections::BTreeMap<String, String> {
    std::collections::BTreeMap::new()
}

pub fn cmd_run(a: RunArgs) -> Result<()> {
    let prompt = if a.prompt == "-" {
        read_stdin()?
    } else {
        a.prompt.clone()
    };
    let (path, file) = open_model_at(&a.model)?;
    let model = Model::load(&file)?;
    let tok = Tokenizer::from_gguf(&file)?;
    let opts = engine_options(&a.gen, &model, &tok)?;
    let ids = prompt_tokens(&tok, &file, &prompt, a.chat)?;
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let mut engine = Engine::new(&model, opts);
    let seq = engine.create_sequence();
    let speculate = speculate_mode(&a.gen)?;
    let mut calibration =
        (speculate == Mode::Auto).then(|| crate::calibration::load(&path, engine.options.threads, &mut engine));
    let req = GenerateRequest {
        prompt: ids,
        max_tokens: a.gen.max_tokens,
        params: sampling(&a.gen),
        stop: a.gen.stop.clone(),
        speculate,
    };
    let stream = !a.json;
    let mut stdout = std::io::stdout().lock();
    let g = engine
        .generate(seq, &tok, &req, |t| {
            if stream {
                let _ = stdout.write_all(t.as_bytes());
                let _ = stdout.flush();
            }
        })
        .context("generation failed")?;
    if stream {
        let _ = writeln!(stdout);
    }
    if let Some(c) = &mut calibration {
        crate::calibration::save(c, &engine);
    }
    if g.context_full {
        eprintln!("note: stopped at the context limit of {} tokens", engine.options.ctx);
    }
    let ledger = ledger(&file, &engine, g.stats.speculation.state_bytes);
    let peak_rss = peak_rss_bytes();
    if a.json {
        let v = serde_json::json!({
            "text": g.text,
            "token_ids": g.tokens,
            "prompt_tokens": g.prompt_tokens,
            "finish_reason": g.finish_reason.as_str(),
            "stats": {
                "ttft_ms": g.stats.ttft_ms,
                "prefill_tok_s": g.stats.prefill_tok_s,
                "decode_tok_s": g.stats.decode_tok_s,
                "prefill_tokens": g.stats.prefill_tokens,
                "decode_tokens": g.stats.decode_tokens,
                "peak_rss_bytes": peak_rss,
                "ctx": engine.options.ctx,
                "kv_capacity_tokens": engine.kv_capacity_tokens(),
                "kv_budget_tokens": engine.options.kv_budget.map(|b| snug_engine::kv_budget_tokens(&model, &engine.options, b)),
                "ledger": ledger_json(&ledger, peak_rss),
                "speculation": g.stats.speculation,
            },
        });
        writeln!(stdout, "{v}")?;
    }
    if a.stats {
        eprintln!(
            "prompt {} tokens, prefill {:.1} tok/s, ttft {:.0} ms; generated {} tokens, decode {:.1} tok/s; finish {}",
            g.prompt_tokens,
            g.stats.prefill_tok_s,
            g.stats.ttft_ms,
            g.tokens.len(),
            g.stats.decode_tok_s,
            g.finish_reason.as_str()
        );
        eprintln!("{}", speculation_text(&g.stats.speculation));
        eprint!("{}", ledger_text(&ledger, peak_rss));
    }
    append_metrics(&a.gen, &a.model, &g)?;
    Ok(())
}

/// The memory ledger of a run so far.
pub fn ledger(file: &snug_model::GgufFile, engine: &Engine, speculation_bytes: usize) -> Ledger {
    let (kv_reserved, kv_used) = engine.kv_bytes();
    let (kv_exact, _) = engine.kv_exact_window_bytes();
    Ledger::from_heap_peak(
        *crate::RUNTIME_RSS.get().unwrap_or(&0),
        file.mapped_bytes(),
        file.weights_resident_bytes().unwrap_or(0),
        kv_reserved as u64,
        kv_used as u64,
        engine.scratch_bytes() as u64,
        crate::HEAP.peak() as u64,
    )
    .with_exact_and_speculation(kv_exact as u64, speculation_bytes as u64)
}

/// The ledger's `--json` object (field names are part of the output
/// contract).
pub fn ledger_json(l: &Ledger, peak_rss: u64) -> serde_json::Value {
    serde_json::json!({
        "runtime_bytes": l.runtime,
        "weights_mapped_bytes": l.weights_mapped,
        "weights_resident_bytes": l.weights_resident,
        "kv_reserved_bytes": l.kv_reserved,
        "kv_used_bytes": l.kv_used,
        "kv_exact_window_bytes": l.kv_exact,
        "speculation_state_bytes": l.speculation,
        "scratch_bytes": l.scratch,
        "heap_other_bytes": l.heap_other,
        "total_bytes": l.total(),
        "ratio_to_peak_rss": l.ratio_to(peak_rss),
    })
}

/// The ledger as lines for `--stats` and `/stats`.
pub fn ledger_text(l: &Ledger, peak_rss: u64) -> String {
    let h = crate::human_bytes;
    format!(
        "memory: weights {} resident of {} mapped; KV {} reserved, {} used, exact window {}; speculation state {}; scratch {}; other heap {}; runtime {}\n\
         memory: ledger total {}, measured peak RSS {} ({:+.1}%)\n",
        h(l.weights_resident),
        h(l.weights_mapped),
        h(l.kv_reserved),
        h(l.kv_used),
        h(l.kv_exact),
        h(l.speculation),
        h(l.scratch),
        h(l.heap_other),
        h(l.runtime),
        h(l.total()),
        h(peak_rss),
        (l.ratio_to(peak_rss) - 1.0) * 100.0
    )
}

/// Peak resident set size of this process (Linux `VmHWM`), 0 if unknown.
pub fn peak_rss_bytes() -> u64 {
    rss_bytes("VmHWM:")
}

/// A size field of `/proc/self/status` in bytes, 0 if unknown.
pub fn rss_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
