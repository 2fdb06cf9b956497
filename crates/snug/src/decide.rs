//! `snug decide`: closed questions about a state text, answered with
//! probabilities (Laya's `/v1/systemone` shapes), and `snug decide
//! calibrate`, which fits the temperatures from labeled examples.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use snug_engine::decide::{self, Example, Framing, Kind, MinConfidence, Question, Temperatures};
use snug_engine::laya::LayaAgent;
use snug_engine::{Engine, EngineOptions};
use snug_model::arch::Model;
use snug_model::{ModelFiles, Tokenizer};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct DecideArgs {
    #[command(subcommand)]
    command: Option<DecideCommand>,
    /// A model alias, hf: name or URL (pulled if needed), or a path to a GGUF file.
    #[arg(default_value = snug_model::catalog::DEFAULT_ALIAS)]
    model: String,
    /// The state text. Without it, the request (a JSON object with
    /// `state`, `questions` and optionally `min_confidence`) is read from
    /// standard input.
    #[arg(long)]
    state: Option<String>,
    /// A question as NAME:TYPE:INSTRUCTIONS[:OPTIONS], TYPE one of choice,
    /// score, noul; OPTIONS comma-separated (choice labels, or score
    /// levels from the lowest). Repeatable.
    #[arg(long = "question", short = 'q')]
    questions: Vec<String>,
    /// Mark answers whose top probability is below this as abstentions.
    #[arg(long)]
    min_confidence: Option<f64>,
    /// Temperatures from this file instead of the model's calibration file
    /// (`snug decide calibrate` writes it beside the model).
    #[arg(long, value_name = "FILE")]
    calibration: Option<PathBuf>,
    /// Print the response object.
    #[arg(long)]
    json: bool,
    /// Threads (default: the number of physical cores).
    #[arg(short = 't', long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Context length (default: the model's, at most 4096).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    #[command(flatten)]
    cache: crate::KvArgs,
}

#[derive(Subcommand)]
enum DecideCommand {
    /// Fit the temperatures per question type and option count from
    /// labeled examples, and save them beside the model.
    Calibrate(CalibrateArgs),
    /// Accuracy, expected calibration error and NLL on labeled examples.
    Eval(EvalArgs),
}

/// Labeled examples to read.
#[derive(Args)]
struct LabeledArgs {
    /// A model alias or a path to a GGUF file.
    model: String,
    /// JSON lines: `{"state": ..., "questions": {...}, "labels": {NAME:
    /// choice key | score level index | true/false}}`.
    file: PathBuf,
    /// Use only half of the lines, by pairs of lines: `even` takes lines
    /// 1-2, 5-6, 9-10, ...; `odd` takes lines 3-4, 7-8, ... (so that a
    /// set written as label pairs splits into two balanced halves).
    #[arg(long, value_parser = ["even", "odd"])]
    half: Option<String>,
    /// Threads (default: the number of physical cores).
    #[arg(short = 't', long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
}

#[derive(Args)]
struct CalibrateArgs {
    #[command(flatten)]
    input: LabeledArgs,
    /// Where to write the temperatures [default: beside the model,
    /// MODEL.decide.json].
    #[arg(long, short = 'o')]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    input: LabeledArgs,
    /// Temperatures from this file [default: the model's calibration
    /// file if there is one, else 1.0].
    #[arg(long, value_name = "FILE")]
    calibration: Option<PathBuf>,
    /// Temperatures 1.0 everywhere, whatever files exist.
    #[arg(long, conflicts_with = "calibration")]
    uncalibrated: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Where a model's temperatures live: beside it, `NAME.decide.json`.
pub fn calibration_path(model: &Path) -> PathBuf {
    model.with_extension("decide.json")
}

/// The temperatures for a model: `explicit`, else the file beside the
/// model, else 1.0 everywhere.
pub fn load_temperatures(model: &Path, explicit: Option<&Path>) -> Result<Temperatures> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let p = calibration_path(model);
            if !p.exists() {
                return Ok(Temperatures::default());
            }
            p
        }
    };
    let text = snug_core::durable::read_regular_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let t: Temperatures =
        serde_json::from_str(&text).with_context(|| format!("{}: not a temperatures file", path.display()))?;
    Ok(t.clamped())
}

/// A Laya checkpoint directory's agent, with temperatures from
/// `explicit`, else from the file beside the directory (`DIR.decide.json`,
/// written by `snug decide calibrate`), else the checkpoint's own. Laya's
/// own calibration files (`temperature`, `temperature_by_options`) read
/// the same way.
pub fn laya_agent(dir: &Path, threads: Option<usize>, explicit: Option<&Path>) -> Result<LayaAgent> {
    let threads = threads.unwrap_or_else(snug_kernels::pool::physical_cores);
    let mut agent = LayaAgent::open(dir, threads).with_context(|| format!("{}", dir.display()))?;
    if explicit.is_some() || calibration_path(dir).exists() {
        agent.temperatures = load_temperatures(dir, explicit)?;
    }
    Ok(agent)
}

/// Where a model's calibration file goes: beside a GGUF file (pulled if
/// an alias) or a Laya checkpoint directory.
fn model_location(name: &str) -> Result<PathBuf> {
    if snug_model::laya::is_checkpoint(Path::new(name)) {
        return Ok(PathBuf::from(name));
    }
    Ok(crate::open_model_at(name)?.0)
}

/// The state as the model reads it: text as is, anything else as JSON.
pub fn state_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn parse_flag_question(spec: &str) -> Result<(String, Value)> {
    let parts: Vec<&str> = spec.splitn(4, ':').collect();
    let [name, kind, instructions, ref rest @ ..] = parts[..] else {
        bail!("--question {spec:?}: use NAME:TYPE:INSTRUCTIONS[:OPTIONS]");
    };
    let options: Vec<&str> = rest
        .first()
        .map(|o| o.split(',').map(str::trim).filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    let mut q = json!({"type": kind, "instructions": instructions});
    if !options.is_empty() {
        q["criteria"] = json!(options);
    }
    Ok((name.to_string(), q))
}

struct Loaded {
    path: PathBuf,
    file: ModelFiles,
}

fn engine_options(
    model: &Model,
    tok: &Tokenizer,
    threads: Option<usize>,
    ctx: Option<usize>,
    cache: &crate::KvArgs,
    questions: usize,
) -> Result<EngineOptions> {
    let (kv_format, kv_format_v) = crate::run::kv_formats(cache, model)?;
    let mut o = EngineOptions {
        kv_format,
        kv_format_v: Some(kv_format_v),
        page_tokens: crate::run::kv_page(cache)?,
        ctx: ctx.unwrap_or(model.config.context_length.min(4096)),
        // The state and a branch per question.
        max_seqs: questions + 1,
        batch: 512,
        prefix_cache: false,
        ..EngineOptions::default()
    };
    if let Some(t) = threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        o.threads = t;
    }
    crate::run::add_key_basis(&mut o, model, tok)?;
    o.gpu = crate::gpu_for(cache, model)?;
    Ok(o)
}

pub fn cmd_decide(a: DecideArgs) -> Result<()> {
    match a.command {
        Some(DecideCommand::Calibrate(c)) => return cmd_calibrate(c),
        Some(DecideCommand::Eval(e)) => return cmd_eval(e),
        None => {}
    }
    let request: Value = match &a.state {
        Some(s) => {
            if a.questions.is_empty() {
                bail!("give at least one --question NAME:TYPE:INSTRUCTIONS[:OPTIONS]");
            }
            let mut qs = serde_json::Map::new();
            for spec in &a.questions {
                let (name, q) = parse_flag_question(spec)?;
                qs.insert(name, q);
            }
            json!({"state": s, "questions": qs})
        }
        None => {
            if !a.questions.is_empty() {
                bail!("--question needs --state (or send the whole request on standard input)");
            }
            let text = crate::read_stdin()?;
            serde_json::from_str(&text).context("standard input is not a JSON request object")?
        }
    };
    if snug_model::laya::is_checkpoint(Path::new(&a.model)) {
        return decide_laya(&a, request);
    }
    let state = request
        .get("state")
        .filter(|s| !s.is_null())
        .map(state_text)
        .context("the request has no 'state'")?;
    let questions = decide::parse_questions(request.get("questions").unwrap_or(&Value::Null))?;
    let min = match (a.min_confidence, request.get("min_confidence")) {
        (Some(m), _) => Some(MinConfidence::parse(&json!(m))?),
        (None, Some(v)) if !v.is_null() => Some(MinConfidence::parse(v)?),
        _ => None,
    };
    let (path, file) = crate::open_model_at(&a.model)?;
    let l = Loaded { path, file };
    let model = crate::load_model(&l.file, &a.cache)?;
    let tok = Tokenizer::from_gguf(&l.file)?;
    let temps = load_temperatures(&l.path, a.calibration.as_deref())?;
    let template = crate::template_worker::for_model(l.file.get_str("tokenizer.chat_template"))?;
    let framing = Framing::new(Some(&template), &tok)?;
    let opts = engine_options(&model, &tok, a.threads, a.ctx, &a.cache, questions.len())?;
    let mut engine = Engine::try_new(&model, opts)?;
    let t0 = std::time::Instant::now();
    let (scored, usage) = engine.decide(&tok, &framing, &state, &questions, &temps)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let resp = decide::response_json(&a.model, &scored, &usage, min.as_ref());
    if a.json {
        println!("{}", serde_json::to_string_pretty(&resp)?);
        return Ok(());
    }
    print!("{}", pretty(&scored, &resp, std::io::stdout().is_terminal()));
    eprintln!(
        "[{} questions, {} state tokens, {} input tokens in one batch, {ms:.0} ms]",
        scored.len(),
        usage.state_tokens,
        usage.input_tokens
    );
    Ok(())
}

/// `snug decide` on a Laya checkpoint directory: the native encoder.
fn decide_laya(a: &DecideArgs, mut request: Value) -> Result<()> {
    if let Some(m) = a.min_confidence {
        request["min_confidence"] = json!(m);
    }
    let req = snug_engine::laya::parse_request(&request)?;
    let agent = laya_agent(Path::new(&a.model), a.threads, a.calibration.as_deref())?;
    let t0 = std::time::Instant::now();
    let (resp, answers) = agent.answer(&req)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&resp)?);
        return Ok(());
    }
    let scored: Vec<decide::Scored> = answers
        .into_iter()
        .map(|x| decide::Scored {
            question: x.question,
            raw: x.logits.clone(),
            logprobs: x.logits,
            temperature: x.temperature,
            probabilities: x.probabilities,
        })
        .collect();
    print!("{}", pretty(&scored, &resp, std::io::stdout().is_terminal()));
    let usage = &resp["usage"];
    let truncated = if usage["truncated"] == true {
        format!(", {} state tokens cut", usage["state_tokens_dropped"])
    } else {
        String::new()
    };
    eprintln!(
        "[{} questions, {} state tokens{truncated}, {} input tokens in one batch, {ms:.0} ms]",
        scored.len(),
        usage["state_tokens"],
        usage["input_tokens"]
    );
    Ok(())
}

/// Answers with a probability bar per option.
fn pretty(scored: &[decide::Scored], resp: &Value, color: bool) -> String {
    use std::fmt::Write;
    const WIDTH: usize = 24;
    let mut out = String::new();
    for s in scored {
        let q = &s.question;
        let a = &resp["answers"][&q.name];
        let head = match q.kind {
            Kind::Choice => a["choice"].as_str().unwrap_or("").to_string(),
            Kind::Score => format!("{:.2} (expected level)", a["score"].as_f64().unwrap_or(0.0)),
            Kind::Noul => format!("P(true) = {:.3}", a["noul"].as_f64().unwrap_or(0.0)),
        };
        let abst = if a["low_confidence"] == true {
            "  [below min_confidence]"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "{} ({}): {head}   confidence {:.2}{abst}",
            q.name,
            q.kind.name(),
            a["confidence"].as_f64().unwrap_or(0.0)
        );
        let keyw = q
            .options
            .iter()
            .map(|(k, d)| display_key(q.kind, k, d.as_deref()).chars().count())
            .max()
            .unwrap_or(0)
            .min(32);
        for ((k, d), &p) in q.options.iter().zip(&s.probabilities) {
            let fill = ((p as f64) * WIDTH as f64).round() as usize;
            let bar = format!("{}{}", "█".repeat(fill), "░".repeat(WIDTH - fill.min(WIDTH)));
            let bar = if color { format!("\x1b[36m{bar}\x1b[0m") } else { bar };
            let key: String = display_key(q.kind, k, d.as_deref()).chars().take(32).collect();
            let _ = writeln!(out, "  {key:<keyw$}  {bar} {p:.3}");
        }
    }
    out
}

fn display_key(kind: Kind, key: &str, desc: Option<&str>) -> String {
    match kind {
        Kind::Score => format!("{key}: {}", desc.unwrap_or("")),
        _ => key.to_string(),
    }
}

/// The index of a question's right answer in a labeled example.
fn truth(q: &Question, label: &Value) -> Result<usize> {
    let found = match (q.kind, label) {
        (Kind::Noul, Value::Bool(b)) => Some(usize::from(*b)),
        (Kind::Noul, Value::String(s)) => match s.to_ascii_lowercase().as_str() {
            "true" | "yes" => Some(1),
            "false" | "no" => Some(0),
            _ => None,
        },
        (Kind::Score, Value::Number(n)) => n.as_u64().map(|i| i as usize).filter(|&i| i < q.options.len()),
        (_, Value::String(s)) => q.options.iter().position(|(k, d)| k == s || d.as_deref() == Some(s)),
        (_, Value::Number(n)) => q.options.iter().position(|(k, _)| *k == n.to_string()),
        _ => None,
    };
    found.with_context(|| format!("label {label} is not an option of question {:?}", q.name))
}

/// One scored question of a labeled example.
struct Labeled {
    example: Example,
    /// Probabilities at the temperatures given.
    probabilities: Vec<f32>,
}

/// Scores every question of every (selected) line of a labeled file.
fn score_file(input: &LabeledArgs, temps: Option<&Temperatures>) -> Result<(PathBuf, Vec<Labeled>)> {
    let text = snug_core::durable::read_regular_string(&input.file)
        .with_context(|| format!("reading {}", input.file.display()))?;
    let mut items = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let keep = match input.half.as_deref() {
            Some("even") => (n / 2) % 2 == 0,
            Some(_) => (n / 2) % 2 == 1,
            None => true,
        };
        if !keep {
            continue;
        }
        let v: Value = serde_json::from_str(line).with_context(|| format!("line {}: not JSON", n + 1))?;
        let state = v
            .get("state")
            .map(state_text)
            .with_context(|| format!("line {}: no state", n + 1))?;
        let qs = decide::parse_questions(v.get("questions").unwrap_or(&Value::Null))
            .with_context(|| format!("line {}", n + 1))?;
        let labels = v.get("labels").with_context(|| format!("line {}: no labels", n + 1))?;
        let mut truths = Vec::new();
        for q in &qs {
            let l = labels
                .get(&q.name)
                .with_context(|| format!("line {}: no label for {:?}", n + 1, q.name))?;
            truths.push(truth(q, l).with_context(|| format!("line {}", n + 1))?);
        }
        items.push((state, qs, truths, v));
    }
    if items.is_empty() {
        bail!("{}: no examples", input.file.display());
    }
    let default = Temperatures::default();
    let temps = temps.unwrap_or(&default);
    if snug_model::laya::is_checkpoint(Path::new(&input.model)) {
        let dir = PathBuf::from(&input.model);
        let mut agent = laya_agent(&dir, input.threads, None)?;
        agent.temperatures = temps.clone();
        let bar = crate::progress::bar(items.len() as u64, "scoring");
        let mut out = Vec::new();
        for (_, _, truths, v) in &items {
            let req = snug_engine::laya::parse_request(v)?;
            let (_, answers) = agent.answer(&req)?;
            for (a, &t) in answers.iter().zip(truths) {
                out.push(Labeled {
                    example: Example {
                        kind: a.question.kind,
                        logprobs: a.logits.clone(),
                        truth: t,
                    },
                    probabilities: a.probabilities.clone(),
                });
            }
            bar.inc(1);
        }
        bar.finish_and_clear();
        return Ok((dir, out));
    }
    let (path, file) = crate::open_model_at(&input.model)?;
    let model = crate::load_model(&file, &crate::KvArgs::default())?;
    let tok = Tokenizer::from_gguf(&file)?;
    let template = crate::template_worker::for_model(file.get_str("tokenizer.chat_template"))?;
    let framing = Framing::new(Some(&template), &tok)?;
    let most = items.iter().map(|i| i.1.len()).max().unwrap_or(1);
    let opts = engine_options(&model, &tok, input.threads, None, &crate::KvArgs::default(), most)?;
    let mut engine = Engine::try_new(&model, opts)?;
    let bar = crate::progress::bar(items.len() as u64, "scoring");
    let mut out = Vec::new();
    for (state, qs, truths, _) in &items {
        let (scored, _) = engine.decide(&tok, &framing, state, qs, temps)?;
        for (s, &t) in scored.iter().zip(truths) {
            out.push(Labeled {
                example: Example {
                    kind: s.question.kind,
                    logprobs: s.logprobs.clone(),
                    truth: t,
                },
                probabilities: s.probabilities.clone(),
            });
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((path, out))
}

/// Accuracy, expected calibration error (10 equal bins of the top
/// probability) and mean NLL of scored examples.
fn quality(xs: &[&Labeled]) -> (f64, f64, f64) {
    let n = xs.len().max(1) as f64;
    let mut bins = [(0usize, 0.0f64, 0.0f64); 10];
    let (mut right, mut nll) = (0usize, 0.0f64);
    for x in xs {
        let p = &x.probabilities;
        let best = decide::argmax(p);
        let ok = best == x.example.truth;
        right += usize::from(ok);
        nll -= (p[x.example.truth].max(1e-30) as f64).ln();
        let conf = p[best] as f64;
        let b = ((conf * 10.0) as usize).min(9);
        bins[b].0 += 1;
        bins[b].1 += conf;
        bins[b].2 += f64::from(u8::from(ok));
    }
    let ece = bins
        .iter()
        .filter(|b| b.0 > 0)
        .map(|b| (b.1 - b.2).abs() / n)
        .sum::<f64>();
    (right as f64 / n, ece, nll / n)
}

fn cmd_eval(e: EvalArgs) -> Result<()> {
    let path = model_location(&e.input.model)?;
    let temps = if e.uncalibrated {
        Temperatures::default()
    } else if snug_model::laya::is_checkpoint(&path) {
        laya_agent(&path, Some(1), e.calibration.as_deref())?.temperatures
    } else {
        load_temperatures(&path, e.calibration.as_deref())?
    };
    let (_, scored) = score_file(&e.input, Some(&temps))?;
    let mut by_type = serde_json::Map::new();
    let mut lines = Vec::new();
    for kind in [Kind::Choice, Kind::Score, Kind::Noul] {
        let xs: Vec<&Labeled> = scored.iter().filter(|x| x.example.kind == kind).collect();
        if xs.is_empty() {
            continue;
        }
        let (acc, ece, nll) = quality(&xs);
        by_type.insert(
            kind.name().into(),
            json!({"questions": xs.len(), "accuracy": acc, "ece": ece, "nll": nll}),
        );
        lines.push(format!(
            "{:<6} {:>4} questions  accuracy {:.1}%  ECE {:.4}  NLL {:.4}",
            kind.name(),
            xs.len(),
            acc * 100.0,
            ece,
            nll
        ));
    }
    let all: Vec<&Labeled> = scored.iter().collect();
    let (acc, ece, nll) = quality(&all);
    if e.json {
        println!(
            "{}",
            json!({"questions": all.len(), "accuracy": acc, "ece": ece, "nll": nll, "by_type": by_type,
                   "temperatures": temps})
        );
    } else {
        for l in lines {
            println!("{l}");
        }
        println!(
            "all    {:>4} questions  accuracy {:.1}%  ECE {:.4}  NLL {:.4}",
            all.len(),
            acc * 100.0,
            ece,
            nll
        );
    }
    Ok(())
}

fn cmd_calibrate(c: CalibrateArgs) -> Result<()> {
    let (path, scored) = score_file(&c.input, None)?;
    let examples: Vec<Example> = scored.iter().map(|x| x.example.clone()).collect();
    let correct = scored
        .iter()
        .filter(|x| decide::argmax(&x.probabilities) == x.example.truth)
        .count();
    let temps = decide::calibrate(&examples, 10, 30);
    let refs: Vec<&Example> = examples.iter().collect();
    let before = decide::nll(&refs, 1.0);
    let after = examples
        .iter()
        .map(|e| decide::nll(&[e], temps.get(e.kind, e.logprobs.len())))
        .sum::<f64>()
        / examples.len() as f64;
    let out = c.out.unwrap_or_else(|| calibration_path(&path));
    let body = json!({
        "version": 1,
        "temperature": temps.temperature,
        "temperature_by_options": temps.temperature_by_options,
        "examples": examples.len(),
        "accuracy": correct as f64 / examples.len() as f64,
        "nll_at_1": before,
        "nll_fitted": after,
    });
    snug_model::pull::write_atomic(&out, format!("{}\n", serde_json::to_string_pretty(&body)?).as_bytes())
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "{} examples, accuracy {:.1}%; mean NLL {before:.4} at temperature 1, {after:.4} fitted",
        examples.len(),
        100.0 * correct as f64 / examples.len() as f64
    );
    println!("{}", out.display());
    Ok(())
}
