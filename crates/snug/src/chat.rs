//! `snug chat`: a multi-turn conversation that keeps the KV cache between
//! turns. Each turn renders the whole conversation with the chat template,
//! and only the tokens after the longest prefix already in the cache are
//! prefilled; the count is printed. With `--session NAME` the conversation
//! and its KV are saved after every turn and resumed at the next start.

use std::io::{BufRead, Write};

use anyhow::{Context, Result};
use snug_engine::generate::GenerateRequest;
use snug_engine::sampling::SamplingParams;
use snug_engine::session::SessionFile;
use snug_engine::Engine;
use snug_model::template::Message;
use snug_model::{EncodeOptions, Tokenizer};

use crate::run::{engine_options, sampling};
use crate::{open_model_at, ChatArgs};

const HELP: &str = "commands: /reset (forget the conversation), /stats (cache and speed), /quit";

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
    let mut engine = Engine::new(&model, opts);
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
    let params = sampling(&a.gen, &params_base);
    // Saves the conversation after a turn (or a reset), if it has a file.
    let save = |engine: &Engine, seq, tokens: &[u32], messages: &[Message]| -> Result<()> {
        if let (Some(p), Some(id)) = (&session, &identity) {
            engine
                .save_session(seq, p, id, tokens, &params, Some(messages))
                .with_context(|| format!("saving the session to {}", p.display()))?;
        }
        Ok(())
    };
    let mut last_stats = None;
    // The drafter's index at its largest over the turns so far.
    let mut spec_bytes = 0;
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    eprintln!("{HELP}");
    loop {
        write!(stdout, "> ")?;
        stdout.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).context("reading standard input")? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                engine.free_sequence(seq);
                seq = engine.create_sequence();
                messages.retain(|m| m.role == "system");
                save(&engine, seq, &[], &messages)?;
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
            cmd if cmd.starts_with('/') => {
                eprintln!("unknown command {cmd:?}; {HELP}");
                continue;
            }
            _ => {}
        }
        messages.push(Message::new("user", line));
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
            max_tokens: a.gen.max_tokens,
            params: params.clone(),
            stop: a.gen.stop.clone(),
            speculate,
        };
        if a.no_cache_reuse {
            engine.truncate(seq, 0)?;
        }
        let g = match engine.generate(seq, &tok, &req, |t| {
            print!("{t}");
            let _ = std::io::stdout().flush();
        }) {
            Ok(g) => g,
            Err(e) => {
                // The turn is dropped; the conversation so far stays.
                messages.pop();
                eprintln!("\nerror: {e}");
                continue;
            }
        };
        println!();
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
        let tokens: Vec<u32> = req.prompt.iter().chain(&g.tokens).copied().collect();
        save(&engine, seq, &tokens, &messages)?;
    }
    Ok(())
}
