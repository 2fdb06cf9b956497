//! `snug run`: one prompt in, generated text out.

use std::io::Write;

use anyhow::{bail, Context, Result};
use snug_core::speculate::Mode;
use snug_core::Ledger;
use snug_engine::generate::{GenerateRequest, Generation, SpecStats};
use snug_engine::sampling::SamplingParams;
use snug_engine::session::{ModelIdentity, SessionFile};
use snug_engine::{Engine, EngineOptions};
use snug_kernels::kv::KvFormat;
use snug_model::arch::Model;
use snug_model::template::Message;
use snug_model::{EncodeOptions, Tokenizer};

use crate::{open_model_at, read_stdin, GenArgs, RunArgs};

/// The sampler settings: each flag given, else `base`'s (the defaults, or
/// a resumed session's).
pub fn sampling(g: &GenArgs, base: &SamplingParams) -> SamplingParams {
    SamplingParams {
        temperature: g.temperature.unwrap_or(base.temperature),
        top_k: g.top_k.unwrap_or(base.top_k),
        top_p: g.top_p.unwrap_or(base.top_p),
        min_p: g.min_p.unwrap_or(base.min_p),
        repeat_penalty: g.repeat_penalty.unwrap_or(base.repeat_penalty),
        presence_penalty: g.presence_penalty.unwrap_or(base.presence_penalty),
        penalty_last_n: base.penalty_last_n,
        seed: g.seed.unwrap_or(base.seed),
        logit_bias: base.logit_bias.clone(),
    }
}

pub fn speculate_mode(g: &GenArgs, model: &Model) -> Result<Mode> {
    let mode = Mode::parse(&g.speculate)
        .with_context(|| format!("unknown --speculate {:?} (on, off or auto)", g.speculate))?;
    Ok(speculation_for(mode, model))
}

/// Speculation as the model's numerics allow: under llama.cpp's, a
/// verify's rows would take other kernels than one-token steps (as in
/// llama.cpp), so the output could change; tokens are decoded one a
/// forward, as llama.cpp does.
pub fn speculation_for(mode: Mode, model: &Model) -> Mode {
    if model.numerics == snug_kernels::ggml::Numerics::Ggml && mode != Mode::Off {
        if mode == Mode::On {
            eprintln!(
                "note: --numerics llama.cpp decodes one token per forward, as llama.cpp does; speculation is off"
            );
        }
        return Mode::Off;
    }
    mode
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

/// The key and value formats from `--kv` (default f16) and its per-part
/// overrides, checked against the model's head size.
pub fn kv_formats(a: &crate::KvArgs, model: &Model) -> Result<(KvFormat, KvFormat)> {
    let (kv, k, v) = (a.kv.as_deref().unwrap_or("f16"), a.kv_k.as_deref(), a.kv_v.as_deref());
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
    let p = a.kv_page.unwrap_or(32);
    if !(1..=4096).contains(&p) {
        bail!("--kv-page must be 1 to 4096 positions");
    }
    Ok(p)
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

/// Engine options from the flags; with a session to resume, its KV layout
/// (flags that name another one are refused).
pub fn engine_options(
    g: &GenArgs,
    model: &Model,
    tok: &Tokenizer,
    resume: Option<(&SessionFile, &ModelIdentity)>,
) -> Result<EngineOptions> {
    let (kv_format, kv_format_v) = kv_formats(&g.cache, model)?;
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
    if o.ctx > model.config.context_length {
        eprintln!(
            "note: --ctx {} exceeds the model's context length {}; using {}",
            o.ctx, model.config.context_length, model.config.context_length
        );
    }
    o.prefix_cache = !g.no_prefix_cache;
    o.gpu = crate::gpu_for(&g.cache, model)?;
    if let Some((f, mid)) = resume {
        let id = &f.meta.identity;
        // Only the parts a flag names are compared.
        let (want_k, want_v) = (
            g.cache.kv_k.as_deref().or(g.cache.kv.as_deref()),
            g.cache.kv_v.as_deref().or(g.cache.kv.as_deref()),
        );
        if want_k.is_some_and(|_| kv_format.name() != id.kv_k) || want_v.is_some_and(|_| kv_format_v.name() != id.kv_v)
        {
            bail!(
                "{} holds {}/{} KV (keys/values); the --kv flags ask for {}/{} (leave them out to use the session's)",
                f.path.display(),
                id.kv_k,
                id.kv_v,
                want_k.map_or(id.kv_k.as_str(), |_| kv_format.name()),
                want_v.map_or(id.kv_v.as_str(), |_| kv_format_v.name()),
            );
        }
        if g.cache.kv_page.is_some_and(|p| p != id.page_tokens) {
            bail!(
                "{} holds {}-position KV pages; --kv-page asks for {} (leave it out to use the session's)",
                f.path.display(),
                id.page_tokens,
                o.page_tokens
            );
        }
        o = f.engine_options(model, mid, o)?;
    } else {
        add_key_basis(&mut o, model, tok)?;
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
    Ok(o)
}

/// Adds the prefix cache's disk tier when `--prefix-cache-dir` asks.
pub fn enable_prefix_disk(
    g: &GenArgs,
    engine: &mut Engine,
    identity: Option<&snug_engine::session::ModelIdentity>,
) -> Result<()> {
    let (Some(dir), Some(id)) = (&g.prefix_cache_dir, identity) else {
        return Ok(());
    };
    let cap = crate::parse_size(&g.prefix_cache_size)?;
    engine
        .enable_prefix_disk(dir, cap as u64, id)
        .with_context(|| format!("opening the prefix cache in {}", dir.display()))
}

/// One line of `--stats` about the prefix cache.
pub fn prefix_text(s: &snug_core::prefix::PrefixStats) -> String {
    format!(
        "prefix cache: {} of {} lookups hit, {} tokens reused; {} pages cached, {} evicted; disk: {} read, {} written{}",
        s.hits,
        s.lookups,
        s.reused_tokens,
        s.pages,
        s.evictions,
        s.disk_hits,
        s.disk_writes,
        if s.disk_errors > 0 { format!(", {} write errors", s.disk_errors) } else { String::new() }
    )
}

/// The prompt's tokens, through the chat template when asked.
pub fn prompt_tokens(tok: &Tokenizer, file: &snug_model::GgufFile, prompt: &str, chat: bool) -> Result<Vec<u32>> {
    if !chat {
        return Ok(tok.encode(prompt, EncodeOptions::default()));
    }
    chat_tokens(tok, file, &[Message::new("user", prompt)])
}

/// A conversation's tokens through the chat template, ready for the
/// assistant's turn.
pub fn chat_tokens(tok: &Tokenizer, file: &snug_model::GgufFile, messages: &[Message]) -> Result<Vec<u32>> {
    let template = crate::template_worker::for_model(file.get_str("tokenizer.chat_template"))?;
    let bos = tok.bos.and_then(|b| tok.token_text(b)).unwrap_or("");
    let eos = tok.eos.and_then(|e| tok.token_text(e)).unwrap_or("");
    let text = template.render(messages, true, bos, eos, minijinja_empty())?;
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

/// Where a run's conversation stands: the tokens so far and, for a chat,
/// the messages.
struct Resumed {
    seq: snug_engine::SeqId,
    tokens: Vec<u32>,
    params: SamplingParams,
    messages: Option<Vec<Message>>,
    restored: usize,
    restore_ms: f64,
}

/// The grammar the flags ask for, if any.
fn grammar_spec(a: &RunArgs) -> Result<Option<snug_engine::grammar::GrammarSpec>> {
    use snug_engine::grammar::GrammarSpec;
    let read = |p: &std::path::Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    let schema = |text: &str, from: &str| -> Result<GrammarSpec> {
        let v: serde_json::Value = serde_json::from_str(text).with_context(|| format!("{from} is not valid JSON"))?;
        Ok(GrammarSpec::JsonSchema(v))
    };
    let grammar = |text: String| {
        if text.contains("::=") {
            GrammarSpec::Gbnf(text)
        } else {
            GrammarSpec::Lark(text)
        }
    };
    Ok(if let Some(s) = &a.json_schema {
        Some(schema(s, "--json-schema")?)
    } else if let Some(p) = &a.json_schema_file {
        Some(schema(&read(p)?, &p.display().to_string())?)
    } else if let Some(g) = &a.grammar {
        Some(grammar(g.clone()))
    } else if let Some(p) = &a.grammar_file {
        Some(grammar(read(p)?))
    } else {
        a.regex.clone().map(GrammarSpec::Regex)
    })
}

pub fn cmd_run(a: RunArgs) -> Result<()> {
    let prompt = match a.prompt.as_deref() {
        Some("-") => Some(read_stdin()?),
        p => p.map(str::to_string),
    };
    let (path, file) = open_model_at(&a.model)?;
    let model = crate::load_model(&file, &a.gen.cache)?;
    let tok = Tokenizer::from_gguf(&file)?;
    // Restore time counts opening and checking the file, the model's
    // identity and reading the pages; not building the engine, which a
    // prefill needs as well.
    let opened = std::time::Instant::now();
    let resume = match &a.session {
        Some(p) if p.exists() => Some(SessionFile::open(p)?),
        _ => None,
    };
    let identity = if a.session.is_some() || a.save_session.is_some() || a.gen.prefix_cache_dir.is_some() {
        Some(crate::session::model_identity(&path, &file, &a.model)?)
    } else {
        None
    };
    let open_s = opened.elapsed().as_secs_f64();
    let opts = engine_options(&a.gen, &model, &tok, resume.as_ref().zip(identity.as_ref()))?;
    let mut engine = Engine::try_new(&model, opts)?;
    enable_prefix_disk(&a.gen, &mut engine, identity.as_ref())?;
    let mut state = match (&resume, &identity) {
        (Some(f), Some(id)) => {
            let t0 = std::time::Instant::now();
            let seq = engine.restore_session(f, id)?;
            let restore_ms = (t0.elapsed().as_secs_f64() + open_s) * 1e3;
            eprintln!(
                "restored {} tokens from {} in {:.1} ms ({} with KV, none prefilled)",
                f.meta.tokens,
                f.path.display(),
                restore_ms,
                f.meta.kv_tokens
            );
            Resumed {
                seq,
                tokens: f.tokens.clone(),
                params: f.meta.sampling.clone(),
                messages: f.meta.messages.clone(),
                restored: f.meta.kv_tokens,
                restore_ms,
            }
        }
        _ => Resumed {
            seq: engine.create_sequence(),
            tokens: Vec::new(),
            params: SamplingParams::default(),
            messages: None,
            restored: 0,
            restore_ms: 0.0,
        },
    };
    let seq = state.seq;
    let ids = match (&resume, prompt) {
        (None, None) => bail!(
            "no session file {} yet: give a prompt (-p) to start one",
            a.session.as_ref().map_or(String::new(), |p| p.display().to_string())
        ),
        (None, Some(p)) if a.chat || a.system.is_some() => {
            let mut msgs: Vec<Message> = a.system.iter().map(|s| Message::new("system", s)).collect();
            msgs.push(Message::new("user", &p));
            let ids = chat_tokens(&tok, &file, &msgs)?;
            state.messages = Some(msgs);
            ids
        }
        (None, Some(p)) => prompt_tokens(&tok, &file, &p, false)?,
        (Some(_), None) => state.tokens.clone(),
        (Some(_), Some(p)) => match &mut state.messages {
            Some(msgs) => {
                msgs.push(Message::new("user", &p));
                chat_tokens(&tok, &file, msgs)?
            }
            None => {
                let mut ids = state.tokens.clone();
                ids.extend(tok.encode(
                    &p,
                    EncodeOptions {
                        add_special: false,
                        parse_special: false,
                    },
                ));
                ids
            }
        },
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let speculate = speculate_mode(&a.gen, &model)?;
    let mut calibration =
        (speculate == Mode::Auto).then(|| crate::calibration::load(&path, engine.options.threads, &mut engine));
    let params = sampling(&a.gen, &state.params);
    let constraint = match grammar_spec(&a)? {
        Some(spec) => {
            let grammars = snug_engine::grammar::Grammars::new(&tok, model.config.vocab)?;
            Some(grammars.compile(&spec)?)
        }
        None => None,
    };
    let req = GenerateRequest {
        prompt: ids,
        max_tokens: a.gen.max_tokens,
        params: params.clone(),
        stop: a.gen.stop.clone(),
        speculate,
        constraint,
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
    let mut saved = None;
    if let (Some(target), Some(id)) = (a.save_session.as_ref().or(a.session.as_ref()), &identity) {
        if let Some(msgs) = &mut state.messages {
            match msgs.last_mut() {
                Some(m) if m.role == "assistant" && req.prompt.len() == state.tokens.len() => {
                    m.content.push_str(&g.text)
                }
                _ => msgs.push(Message::new("assistant", &g.text)),
            }
        }
        let tokens: Vec<u32> = req.prompt.iter().chain(&g.tokens).copied().collect();
        let t0 = std::time::Instant::now();
        let s = engine
            .save_session(seq, target, id, &tokens, &params, state.messages.as_deref())
            .with_context(|| format!("saving the session to {}", target.display()))?;
        let save_ms = t0.elapsed().as_secs_f64() * 1e3;
        if a.stats {
            eprintln!(
                "saved {} tokens to {} ({}) in {:.1} ms",
                tokens.len(),
                target.display(),
                crate::human_bytes(s.bytes),
                save_ms
            );
        }
        saved = Some((target.clone(), s.bytes, save_ms));
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
                "grammar_ms": g.stats.grammar_ms,
                "prefix_cache": engine.prefix_stats(),
            },
            "session": (a.session.is_some() || a.save_session.is_some()).then(|| serde_json::json!({
                "restored_tokens": state.restored,
                "restore_ms": state.restore_ms,
                "saved_to": saved.as_ref().map(|s| s.0.display().to_string()),
                "saved_bytes": saved.as_ref().map(|s| s.1),
                "save_ms": saved.as_ref().map(|s| s.2),
            })),
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
        if let Some(p) = engine.prefix_stats() {
            eprintln!("{}", prefix_text(&p));
        }
        eprint!("{}", ledger_text(&ledger, peak_rss));
    }
    append_metrics(&a.gen, &a.model, &g)?;
    Ok(())
}

/// The memory ledger of a run so far.
pub fn ledger(file: &snug_model::ModelFiles, engine: &Engine, speculation_bytes: usize) -> Ledger {
    let (kv_reserved, kv_used) = engine.kv_bytes();
    let (kv_exact, _) = engine.kv_exact_window_bytes();
    if let Some(weights) = engine.device_weights_bytes() {
        let device = snug_core::ledger::Device {
            weights: weights as u64,
            kv_reserved: kv_reserved as u64,
            kv_used: kv_used as u64,
            scratch: engine.scratch_bytes() as u64,
        };
        return Ledger::on_device(
            *crate::RUNTIME_RSS.get().unwrap_or(&0),
            file.mapped_bytes(),
            file.weights_resident_bytes().unwrap_or(0),
            crate::HEAP.peak() as u64,
            device,
        )
        .with_exact_and_speculation(0, speculation_bytes as u64);
    }
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
        "device": l.device.map(|d| serde_json::json!({
            "weights_bytes": d.weights,
            "kv_reserved_bytes": d.kv_reserved,
            "kv_used_bytes": d.kv_used,
            "scratch_bytes": d.scratch,
            "total_bytes": d.total(),
        })),
    })
}

/// The ledger as lines for `--stats` and `/stats`.
pub fn ledger_text(l: &Ledger, peak_rss: u64) -> String {
    let h = crate::human_bytes;
    let device = l.device.map_or(String::new(), |d| {
        format!(
            "device memory: weights {}; KV {} reserved, {} used; scratch {}; total {}\n",
            h(d.weights),
            h(d.kv_reserved),
            h(d.kv_used),
            h(d.scratch),
            h(d.total())
        )
    });
    device
        + &format!(
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
