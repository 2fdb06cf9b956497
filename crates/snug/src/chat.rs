//! `snug chat`: a multi-turn conversation that keeps the KV cache between
//! turns. Each turn renders the whole conversation with the chat template,
//! and only the tokens after the longest prefix already in the cache are
//! prefilled; the count is printed. With `--session NAME` the conversation
//! and its KV are saved after every turn and resumed at the next start.

use std::io::Write;

use anyhow::{Context, Result};
use snug_engine::generate::GenerateRequest;
use snug_engine::sampling::SamplingParams;
use snug_engine::session::{ModelIdentity, SessionFile};
use snug_engine::Engine;
use snug_model::template::Message;
use snug_model::{EncodeOptions, Tokenizer};

use crate::line_input::{Input, Line};
use crate::run::{engine_options, sampling};
use crate::{open_model_at, ChatArgs};

const HELP: &str = "/help for commands; Ctrl-C stops an answer, Ctrl-D or /quit leaves";

const COMMANDS: &str = "\
/set                 show the sampling settings
/set NAME VALUE      change one: temperature, top_k, top_p, min_p, repeat_penalty,
                     presence_penalty, seed, max_tokens, or system (the system message)
/save NAME|PATH      save the conversation and its KV (a name goes in the cache's sessions folder)
/load NAME|PATH      go on from a saved conversation
/reset               forget the conversation (the system message stays)
/stats               cache, speed and memory
/quit                leave (also Ctrl-D, or Ctrl-C twice at the prompt)
A line ending in \\ goes on to the next; \"\"\" opens a block the next \"\"\" closes.";

pub fn cmd_chat(a: ChatArgs) -> Result<()> {
    let (path, file) = open_model_at(&a.model)?;
    let model = crate::load_model(&file, &a.gen.cache)?;
    let tok = Tokenizer::from_gguf(&file)?;
    let template = crate::template_worker::for_model(file.get_str("tokenizer.chat_template"))?;
    if template.is_fallback {
        eprintln!("note: the model has no chat template; using the plain `role: content` format");
    }
    let bos = tok.bos.and_then(|b| tok.token_text(b)).unwrap_or("").to_string();
    let eos = tok.eos.and_then(|e| tok.token_text(e)).unwrap_or("").to_string();
    let session = a
        .session
        .as_deref()
        .map(crate::session::chat_session_path)
        .transpose()?;
    let resume = match &session {
        Some(p) if p.exists() => Some(SessionFile::open(p)?),
        _ => None,
    };
    let identity = match (&session, &a.gen.prefix_cache_dir) {
        (None, None) => None,
        _ => Some(crate::session::model_identity(&path, &file, &a.model)?),
    };
    let mut opts = engine_options(&a.gen, &model, &tok, resume.as_ref().zip(identity.as_ref()))?;
    // Measuring without reuse means without the prefix cache's too.
    opts.prefix_cache &= !a.no_cache_reuse;
    let mut engine = Engine::try_new(&model, opts)?;
    crate::run::enable_prefix_disk(&a.gen, &mut engine, identity.as_ref())?;
    let speculate = crate::run::speculate_mode(&a.gen, &model)?;
    let mut calibration = (speculate == snug_core::speculate::Mode::Auto)
        .then(|| crate::calibration::load(&path, engine.options.threads, &mut engine));
    let mut messages: Vec<Message> = Vec::new();
    let mut params_base = SamplingParams::default();
    let mut seq = match (&resume, &identity) {
        (Some(f), Some(id)) => {
            let t0 = std::time::Instant::now();
            let seq = engine.restore_session(f, id)?;
            messages = f.meta.messages.clone().unwrap_or_default();
            params_base = f.meta.sampling.clone();
            eprintln!(
                "[resumed {}: {} messages, {} tokens restored in {:.1} ms, none prefilled]",
                f.path.display(),
                messages.len(),
                f.meta.kv_tokens,
                t0.elapsed().as_secs_f64() * 1e3
            );
            if a.system.is_some() && !messages.is_empty() {
                eprintln!("note: --system is ignored: the resumed conversation has its own start");
            }
            seq
        }
        _ => engine.create_sequence(),
    };
    if messages.is_empty() {
        if let Some(sys) = &a.system {
            messages.push(Message::new("system", sys));
        }
    }
    let mut params = sampling(&a.gen, &params_base);
    let mut max_tokens = a.gen.max_tokens;
    let mut identity = identity;
    // Saves the conversation after a turn (or a reset), if it has a file.
    let save = |engine: &Engine,
                seq,
                tokens: &[u32],
                messages: &[Message],
                params: &SamplingParams,
                identity: &Option<ModelIdentity>|
     -> Result<()> {
        if let (Some(p), Some(id)) = (&session, identity) {
            engine
                .save_session(seq, p, id, tokens, params, Some(messages))
                .with_context(|| format!("saving the session to {}", p.display()))?;
        }
        Ok(())
    };
    let mut last_stats = None;
    // The drafter's index at its largest over the turns so far.
    let mut spec_bytes = 0;
    // Every token of the conversation so far (what a save writes).
    let mut tokens: Vec<u32> = resume.as_ref().map(|f| f.tokens.clone()).unwrap_or_default();
    crate::line_input::catch_interrupts();
    let mut input = Input::new(Some(crate::env::get().cache.join("chat_history")));
    let mut ctrl_c_at_prompt = false;
    eprintln!("{HELP}");
    loop {
        let line = match input.read("> ")? {
            Line::End => break,
            Line::Interrupted => {
                if ctrl_c_at_prompt {
                    break;
                }
                ctrl_c_at_prompt = true;
                eprintln!("[Ctrl-C again, Ctrl-D or /quit to leave]");
                continue;
            }
            Line::Text(t) => {
                ctrl_c_at_prompt = false;
                t
            }
        };
        let mut words = line.trim().splitn(2, char::is_whitespace);
        let command = words.next().unwrap_or("");
        let arg = words.next().unwrap_or("").trim();
        match command {
            "" => continue,
            "/quit" | "/exit" | "/bye" => break,
            "/help" | "/?" => {
                eprintln!("{COMMANDS}");
                continue;
            }
            "/reset" | "/clear" => {
                engine.free_sequence(seq);
                seq = engine.create_sequence();
                messages.retain(|m| m.role == "system");
                tokens.clear();
                save(&engine, seq, &[], &messages, &params, &identity)?;
                eprintln!("[conversation reset]");
                continue;
            }
            "/stats" => {
                let (total, used) = engine.kv_bytes();
                eprintln!(
                    "[cache: {} tokens, KV {} used of {} reserved]",
                    engine.tokens(seq)?.len(),
                    crate::human_bytes(used as u64),
                    crate::human_bytes(total as u64)
                );
                if let Some(s) = &last_stats {
                    eprintln!("[last turn: {s}]");
                }
                if let Some(p) = engine.prefix_stats() {
                    eprintln!("[{}]", crate::run::prefix_text(&p));
                }
                let ledger = crate::run::ledger(&file, &engine, spec_bytes);
                eprint!("{}", crate::run::ledger_text(&ledger, crate::run::peak_rss_bytes()));
                continue;
            }
            "/set" => {
                match set(arg, &mut params, &mut max_tokens, &mut messages) {
                    Ok(done) => eprintln!("[{done}]"),
                    Err(e) => eprintln!("error: {e:#}"),
                }
                continue;
            }
            "/save" | "/load" => {
                let done = (|| -> Result<String> {
                    if arg.is_empty() {
                        anyhow::bail!("{command} needs a session name or a path");
                    }
                    let p = crate::session::chat_session_path(arg)?;
                    if identity.is_none() {
                        identity = Some(crate::session::model_identity(&path, &file, &a.model)?);
                    }
                    let id = identity.as_ref().expect("set above");
                    if command == "/save" {
                        engine.save_session(seq, &p, id, &tokens, &params, Some(&messages))?;
                        return Ok(format!("saved {} messages to {}", messages.len(), p.display()));
                    }
                    let f = SessionFile::open(&p)?;
                    let Some(saved) = f.meta.messages.clone() else {
                        anyhow::bail!("{} holds a `snug run` session, not a chat", p.display());
                    };
                    let restored = engine.restore_session(&f, id).with_context(|| {
                        format!(
                            "{} (a session saved with another KV layout loads with `snug chat --session`)",
                            p.display()
                        )
                    })?;
                    engine.free_sequence(seq);
                    seq = restored;
                    messages = saved;
                    params = f.meta.sampling.clone();
                    tokens = f.tokens.clone();
                    Ok(format!("loaded {} messages from {}", messages.len(), p.display()))
                })();
                match done {
                    Ok(m) => eprintln!("[{m}]"),
                    Err(e) => eprintln!("error: {e:#}"),
                }
                continue;
            }
            cmd if cmd.starts_with('/') => {
                eprintln!("unknown command {cmd:?}; {HELP}");
                continue;
            }
            _ => {}
        }
        messages.push(Message::new("user", &line));
        let text = template.render(
            &messages,
            true,
            &bos,
            &eos,
            std::collections::BTreeMap::<String, String>::new(),
        )?;
        let prompt = tok.encode(
            &text,
            EncodeOptions {
                add_special: bos.is_empty() || !text.starts_with(&bos),
                parse_special: true,
            },
        );
        let req = GenerateRequest {
            prompt,
            max_tokens,
            params: params.clone(),
            stop: a.gen.stop.clone(),
            speculate,
            constraint: None,
        };
        if a.no_cache_reuse {
            engine.truncate(seq, 0)?;
        }
        crate::line_input::clear_interrupt();
        let cut = std::cell::Cell::new(false);
        let stop = || {
            if crate::line_input::take_interrupt() {
                cut.set(true);
            }
            cut.get()
        };
        let g = match engine.generate_until(
            seq,
            &tok,
            &req,
            |t| {
                print!("{t}");
                let _ = std::io::stdout().flush();
            },
            &stop,
        ) {
            Ok(g) => g,
            Err(e) => {
                // The turn is dropped; the conversation so far stays.
                messages.pop();
                eprintln!("\nerror: {e}");
                continue;
            }
        };
        println!();
        if cut.get() {
            eprintln!("[interrupted: the answer so far stays in the conversation]");
        }
        if let Some(c) = &mut calibration {
            crate::calibration::save(c, &engine);
        }
        eprintln!(
            "[{} prompt tokens, {} reused from the cache, {} prefilled; {} generated at {:.1} tok/s{}]",
            g.prompt_tokens,
            g.reused_tokens,
            g.prompt_tokens - g.reused_tokens,
            g.tokens.len(),
            g.stats.decode_tok_s,
            if g.context_full { "; context full" } else { "" }
        );
        spec_bytes = spec_bytes.max(g.stats.speculation.state_bytes);
        last_stats = Some(format!(
            "prefill {:.1} tok/s, decode {:.1} tok/s, ttft {:.0} ms; {}",
            g.stats.prefill_tok_s,
            g.stats.decode_tok_s,
            g.stats.ttft_ms,
            crate::run::speculation_text(&g.stats.speculation)
        ));
        crate::run::append_metrics(&a.gen, &a.model, &g)?;
        messages.push(Message::new("assistant", &g.text));
        tokens = req.prompt.iter().chain(&g.tokens).copied().collect();
        save(&engine, seq, &tokens, &messages, &params, &identity)?;
    }
    Ok(())
}

/// `/set NAME VALUE` (or `/set` alone: the settings).
fn set(arg: &str, p: &mut SamplingParams, max_tokens: &mut usize, messages: &mut Vec<Message>) -> Result<String> {
    let mut words = arg.splitn(2, char::is_whitespace);
    let name = words.next().unwrap_or("");
    let value = words.next().unwrap_or("").trim();
    if name.is_empty() {
        return Ok(format!(
            "temperature {} top_k {} top_p {} min_p {} repeat_penalty {} presence_penalty {} seed {} max_tokens {}",
            p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.presence_penalty, p.seed, max_tokens
        ));
    }
    let num = |lo: f32, hi: f32| -> Result<f32> {
        let v: f32 = value
            .parse()
            .with_context(|| format!("{name} takes a number, not {value:?}"))?;
        anyhow::ensure!((lo..=hi).contains(&v), "{name} must be in [{lo}, {hi}]");
        Ok(v)
    };
    match name {
        "temperature" | "temp" => p.temperature = num(0.0, 5.0)?,
        "top_k" => {
            p.top_k = value
                .parse()
                .with_context(|| format!("top_k takes a count, not {value:?}"))?
        }
        "top_p" => p.top_p = num(0.0, 1.0)?,
        "min_p" => p.min_p = num(0.0, 1.0)?,
        "repeat_penalty" => p.repeat_penalty = num(0.0, 10.0)?,
        "presence_penalty" => p.presence_penalty = num(-2.0, 2.0)?,
        "seed" => {
            p.seed = value
                .parse()
                .with_context(|| format!("seed takes a number, not {value:?}"))?
        }
        "max_tokens" => {
            let n: usize = value
                .parse()
                .with_context(|| format!("max_tokens takes a count, not {value:?}"))?;
            anyhow::ensure!(n > 0, "max_tokens must be at least 1");
            *max_tokens = n;
        }
        "system" => {
            messages.retain(|m| m.role != "system");
            if !value.is_empty() {
                messages.insert(0, Message::new("system", value));
            }
            return Ok(if value.is_empty() {
                "system message removed".into()
            } else {
                "system message set".into()
            });
        }
        other => anyhow::bail!("unknown setting {other:?}; /help lists them"),
    }
    Ok(format!("{name} = {value}"))
}
