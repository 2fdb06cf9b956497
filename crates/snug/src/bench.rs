//! `snug bench`: prefill and decode throughput, measured like llama-bench
//! (ppN: prefill N tokens into an empty context; tgN: generate N tokens one
//! at a time; either optionally after a prefilled depth, which is
//! prefilled once and forked for each repetition), with repetitions and
//! medians.

use std::time::Instant;

use anyhow::{bail, Result};
use snug_engine::{Engine, EngineOptions, StepRow};
use snug_kernels::cpu::kernels_name;
use snug_model::arch::profile::{self, Op};

use crate::{open_model, BenchArgs};

struct Row {
    test: String,
    kv: String,
    depth: usize,
    samples: Vec<f64>, // tokens per second
    /// With `--profile`: where the measured repetitions' time went.
    profile: Option<Profile>,
}

/// The forward passes' time by operation over a test's measured
/// repetitions (not the warm-up), and the whole time they took.
#[derive(Default)]
struct Profile {
    nanos: [u64; Op::ALL.len()],
    passes: u64,
    secs: f64,
    tokens: usize,
}

impl Profile {
    /// Clears the passes' totals before a measured run (with `--profile`).
    fn start(on: bool) {
        if on {
            profile::reset();
        }
    }

    /// Adds what the passes since [`Profile::start`] took, in a run of
    /// `secs` over `tokens` tokens.
    fn absorb(this: &mut Option<Profile>, secs: f64, tokens: usize) {
        let Some(p) = this else { return };
        let (t, passes) = profile::take();
        for (a, b) in p.nanos.iter_mut().zip(t) {
            *a += b;
        }
        p.passes += passes;
        p.secs += secs;
        p.tokens += tokens;
    }

    /// Microseconds a token per kind, then what lay outside the passes
    /// (sampling, the engine's bookkeeping).
    fn per_token(&self) -> Vec<(&'static str, f64)> {
        let per = |ns: f64| ns / 1e3 / self.tokens.max(1) as f64;
        let mut v: Vec<(&'static str, f64)> = Op::ALL
            .iter()
            .zip(self.nanos)
            .filter(|(_, ns)| *ns > 0)
            .map(|(op, ns)| (op.name(), per(ns as f64)))
            .collect();
        let inside: u64 = self.nanos.iter().sum();
        v.push(("outside passes", per((self.secs * 1e9 - inside as f64).max(0.0))));
        v
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn stddev(v: &[f64]) -> f64 {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len().max(2).saturating_sub(1) as f64).sqrt()
}

/// Deterministic stand-in tokens (the cost of a token does not depend on
/// which token it is).
fn tokens(n: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 17) % (vocab - 1) + 1) as u32)
        .collect()
}

fn parse_list(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| anyhow::anyhow!("not a number: {x:?}"))
        })
        .collect()
}

/// Runs the prefill tests `pp` and decode tests `tg` at each depth on
/// `engine`, appending a row per test.
#[allow(clippy::too_many_arguments)]
fn measure(
    engine: &mut Engine,
    kv_name: &str,
    depths: &[usize],
    pp: &[usize],
    tg: &[usize],
    reps: usize,
    vocab: usize,
    on: bool,
    rows: &mut Vec<Row>,
) -> Result<()> {
    for &d in depths {
        // Every test at a depth runs in a fork of one prefilled context
        // (copy-on-write pages), which it drops afterwards.
        let base = engine.create_sequence();
        if d > 0 && !(pp.is_empty() && tg.is_empty()) {
            engine.feed(base, &tokens(d, vocab, 1))?;
        }
        for &n in pp {
            let mut samples = Vec::new();
            let mut prof = on.then(Profile::default);
            for rep in 0..=reps {
                let s = engine.fork(base)?;
                Profile::start(on);
                let t = Instant::now();
                engine.feed(s, &tokens(n, vocab, 2))?;
                let secs = t.elapsed().as_secs_f64();
                engine.free_sequence(s);
                if rep > 0 {
                    samples.push(n as f64 / secs); // rep 0 is a warm-up
                    Profile::absorb(&mut prof, secs, n);
                }
            }
            rows.push(Row {
                test: format!("pp{n}"),
                kv: kv_name.to_string(),
                depth: d,
                samples,
                profile: prof,
            });
        }
        for &n in tg {
            let mut samples = Vec::new();
            let mut prof = on.then(Profile::default);
            for rep in 0..=reps {
                let s = engine.fork(base)?;
                let toks = tokens(n, vocab, 3);
                Profile::start(on);
                let t = Instant::now();
                for &tok in &toks {
                    engine.feed(s, &[tok])?;
                }
                let secs = t.elapsed().as_secs_f64();
                engine.free_sequence(s);
                if rep > 0 {
                    samples.push(n as f64 / secs);
                    Profile::absorb(&mut prof, secs, n);
                }
            }
            rows.push(Row {
                test: format!("tg{n}"),
                kv: kv_name.to_string(),
                depth: d,
                samples,
                profile: prof,
            });
        }
        engine.free_sequence(base);
    }
    Ok(())
}

/// `n` sequences decoding together: each prefilled with `pp` tokens (one
/// forward pass per sequence), then `tg` steps of one pass over a row of
/// every sequence. Aggregate tokens per second.
#[allow(clippy::too_many_arguments)]
fn measure_parallel(
    engine: &mut Engine,
    kv_name: &str,
    n: usize,
    (pp, tg): (usize, usize),
    reps: usize,
    vocab: usize,
    on: bool,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let (mut pps, mut tgs) = (Vec::new(), Vec::new());
    let (mut pp_prof, mut tg_prof) = (on.then(Profile::default), on.then(Profile::default));
    for rep in 0..=reps {
        let seqs: Vec<_> = (0..n).map(|_| engine.create_sequence()).collect();
        Profile::start(on);
        let t = Instant::now();
        for (i, &s) in seqs.iter().enumerate() {
            engine.feed(s, &tokens(pp, vocab, 10 + i))?;
        }
        let pp_secs = t.elapsed().as_secs_f64();
        if rep > 0 {
            Profile::absorb(&mut pp_prof, pp_secs, n * pp);
        }
        Profile::start(on);
        let t = Instant::now();
        for step in 0..tg {
            let batch: Vec<StepRow> = seqs
                .iter()
                .enumerate()
                .map(|(i, &s)| StepRow::new(s, tokens(1, vocab, 1000 + step * n + i)[0], true))
                .collect();
            engine.step(&batch)?;
        }
        let tg_secs = t.elapsed().as_secs_f64();
        if rep > 0 {
            Profile::absorb(&mut tg_prof, tg_secs, n * tg);
        }
        for s in seqs {
            engine.free_sequence(s);
        }
        if rep > 0 {
            pps.push((n * pp) as f64 / pp_secs);
            tgs.push((n * tg) as f64 / tg_secs);
        }
    }
    for (test, samples, profile) in [
        (format!("pp{pp} x{n}"), pps, pp_prof),
        (format!("tg{tg} x{n}"), tgs, tg_prof),
    ] {
        rows.push(Row {
            test,
            kv: kv_name.to_string(),
            depth: 0,
            samples,
            profile,
        });
    }
    Ok(())
}

pub fn cmd_bench(a: BenchArgs) -> Result<()> {
    // Zero-length tests are skipped, as llama-bench does with `-p 0`.
    let pp: Vec<usize> = parse_list(&a.prompt)?.into_iter().filter(|&n| n > 0).collect();
    let tg: Vec<usize> = parse_list(&a.gen)?.into_iter().filter(|&n| n > 0).collect();
    let depths = parse_list(&a.depth)?;
    if a.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let file = open_model(&a.model)?;
    let model = crate::load_model(&file, &a.cache)?;
    let vocab = model.config.vocab;
    let parallel = match &a.parallel {
        Some(p) => parse_list(p)?.into_iter().filter(|&n| n > 0).collect(),
        None => Vec::new(),
    };
    let max_par = parallel.iter().copied().max().unwrap_or(0);
    let par_shape = (pp.first().copied().unwrap_or(0), tg.first().copied().unwrap_or(0));
    let max_need = pp.iter().chain(tg.iter()).copied().max().unwrap_or(0) + depths.iter().copied().max().unwrap_or(0);
    if max_need > model.config.context_length {
        bail!(
            "a test needs {max_need} positions; the model's context is {}",
            model.config.context_length
        );
    }
    let threads = a.threads.unwrap_or_else(snug_kernels::pool::physical_cores);
    // `--kv f16,q8,tq4`: each format in turn, on an engine of its own.
    let formats: Vec<Option<String>> = match &a.cache.kv {
        Some(list) => list.split(',').map(|f| Some(f.trim().to_string())).collect(),
        None => vec![None],
    };
    let gpu = crate::gpu_for(&a.cache, &model)?;
    if a.profile && gpu.is_some() {
        bail!("--profile times the CPU's operations; a GPU's run asynchronously (gpucheck --profile-prefill times its kernels)");
    }
    profile::enable(a.profile);
    let mut rows: Vec<Row> = Vec::new();
    for format in formats {
        let cache = crate::KvArgs {
            kv: format,
            ..a.cache.clone()
        };
        let (kv, kv_v) = crate::run::kv_formats(&cache, &model)?;
        let mut options = EngineOptions {
            threads,
            // With `--parallel`, every sequence's positions share the pool.
            ctx: max_need.max(1).max(max_par * (par_shape.0 + par_shape.1)),
            batch: a.batch.max(max_par),
            // A base context and one fork of it, or the parallel ones.
            max_seqs: max_par.max(2),
            kv_format: kv,
            kv_format_v: Some(kv_v),
            page_tokens: crate::run::kv_page(&cache)?,
            ..Default::default()
        };
        crate::run::add_key_basis(&mut options, &model, &snug_model::Tokenizer::from_gguf(&file)?)?;
        let kv_name = crate::eval::kv_name(kv, kv_v);
        options.gpu = gpu.clone();
        let mut engine = Engine::try_new(&model, options)?;
        if parallel.is_empty() {
            measure(
                &mut engine,
                &kv_name,
                &depths,
                &pp,
                &tg,
                a.reps,
                vocab,
                a.profile,
                &mut rows,
            )?;
        }
        for &n in &parallel {
            measure_parallel(&mut engine, &kv_name, n, par_shape, a.reps, vocab, a.profile, &mut rows)?;
        }
    }
    let name = file.get_str("general.name").unwrap_or("model").to_string();
    if a.output == "json" {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let mut v = serde_json::json!({
                    "model": name, "test": r.test, "depth": r.depth, "threads": threads, "kv": r.kv,
                    "simd": kernels_name(), "tok_s_median": median(&r.samples),
                    "tok_s_stddev": stddev(&r.samples), "samples": r.samples,
                });
                if let Some(p) = &r.profile {
                    let us: serde_json::Map<String, serde_json::Value> = p
                        .per_token()
                        .into_iter()
                        .map(|(k, us)| (k.to_string(), us.into()))
                        .collect();
                    v["profile_us_per_token"] = us.into();
                    v["profile_passes"] = p.passes.into();
                }
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("| model | threads | simd | kv | test | t/s (median of {}) |", a.reps);
    println!("| --- | ---: | --- | --- | ---: | ---: |");
    for r in &rows {
        let test = if r.depth > 0 {
            format!("{} @ d{}", r.test, r.depth)
        } else {
            r.test.clone()
        };
        println!(
            "| {name} | {threads} | {} | {} | {test} | {:.2} ± {:.2} |",
            kernels_name(),
            r.kv,
            median(&r.samples),
            stddev(&r.samples)
        );
    }
    for r in &rows {
        let Some(p) = &r.profile else { continue };
        let total: f64 = p.per_token().iter().map(|(_, us)| us).sum();
        let at = if r.depth > 0 {
            format!(" @ d{}", r.depth)
        } else {
            String::new()
        };
        let passes = if p.passes == 1 {
            "1 pass".to_string()
        } else {
            format!("{} passes", p.passes)
        };
        println!("\n{}{at} ({passes}): µs a token by operation", r.test);
        println!("| operation | µs a token | share |");
        println!("| --- | ---: | ---: |");
        for (op, us) in p.per_token() {
            println!("| {op} | {us:.2} | {:.1}% |", 100.0 * us / total.max(1e-9));
        }
    }
    Ok(())
}
