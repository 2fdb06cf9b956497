//! `snug eval ppl`: perplexity over a text file, windowed as llama.cpp's
//! `llama-perplexity` does, and, for a compressed KV format, how far its
//! next-token distributions move from F16 KV on the same windows.
//!
//! The text is tokenized once (with BOS where the model adds one) and cut
//! into consecutive windows of `--ctx` tokens; each window starts a fresh
//! sequence with BOS (where the model adds one) in place of its first
//! token, and the predictions of
//! its second half (positions ctx/2 .. ctx-1, each with at least ctx/2
//! tokens of context) are scored. Perplexity is exp of the mean negative
//! log-likelihood over all scored positions. With `--kv` other than f16,
//! an F16 engine runs the same windows beside it and each scored position
//! adds KL(P_f16 ‖ P_kv) and whether the two top-1 tokens agree.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use snug_engine::{Engine, EngineOptions, SeqId};
use snug_kernels::kv::KvFormat;
use snug_model::{EncodeOptions, Tokenizer};

use crate::{open_model, progress, EvalPplArgs};
use snug_engine::StepRow;

/// `tq4`, or `q8/tq4` for keys and values in different formats.
pub fn kv_name(k: KvFormat, v: KvFormat) -> String {
    if k == v {
        k.name().to_string()
    } else {
        format!("{}/{}", k.name(), v.name())
    }
}

/// Log-softmax of `row` (f64 sums, fixed order).
fn log_softmax(row: &[f32], out: &mut Vec<f64>) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    out.clear();
    out.extend(row.iter().map(|&v| v as f64 - lse));
}

fn argmax(row: &[f32]) -> usize {
    snug_engine::sampling::argmax(row) as usize
}

/// Runs one window through `engine`, returning the logits of rows
/// `first..tokens.len() - 1` (row i predicts token i + 1).
fn window_logits(engine: &mut Engine, tokens: &[u32], first: usize, batch: usize) -> Result<Vec<f32>> {
    let vocab = engine.model.config.vocab;
    let seq: SeqId = engine.create_sequence();
    let mut out = Vec::with_capacity((tokens.len() - 1 - first) * vocab);
    let mut at = 0;
    while at < tokens.len() - 1 {
        let end = (at + batch).min(tokens.len() - 1);
        let rows: Vec<StepRow> = (at..end).map(|i| StepRow::new(seq, tokens[i], i >= first)).collect();
        let l = engine.step(&rows)?;
        out.extend_from_slice(l);
        at = end;
    }
    engine.free_sequence(seq);
    Ok(out)
}

pub fn cmd_eval_ppl(a: EvalPplArgs) -> Result<()> {
    let text =
        snug_core::durable::read_regular_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    if a.ctx < 4 || !a.ctx.is_multiple_of(2) {
        bail!("--ctx must be an even number of at least 4");
    }
    let file = open_model(&a.model)?;
    let model = crate::load_model(&file, &a.cache)?;
    let (kv, kv_v) = crate::run::kv_formats(&a.cache, &model)?;
    if a.ctx > model.config.context_length {
        bail!(
            "--ctx {} is over the model's context of {}",
            a.ctx,
            model.config.context_length
        );
    }
    let tok = Tokenizer::from_gguf(&file)?;
    // As llama-perplexity: the whole text with the model's BOS (if it adds
    // one), cut into windows whose first token becomes BOS.
    let ids = tok.encode(
        &text,
        EncodeOptions {
            add_special: true,
            parse_special: false,
        },
    );
    let mut windows = ids.len() / a.ctx;
    if let Some(m) = a.max_windows {
        windows = windows.min(m);
    }
    if windows == 0 {
        bail!("the text has {} tokens, fewer than one window of {}", ids.len(), a.ctx);
    }
    let threads = a.threads.unwrap_or_else(snug_kernels::pool::physical_cores);
    let page_tokens = crate::run::kv_page(&a.cache)?;
    let gpu = crate::gpu_for(&a.cache, &model)?;
    let options = |k, v| EngineOptions {
        gpu: gpu.clone(),
        threads,
        ctx: a.ctx,
        batch: a.batch.min(a.ctx),
        max_seqs: 1,
        kv_format: k,
        kv_format_v: Some(v),
        page_tokens,
        ..EngineOptions::default()
    };
    let mut tested = options(kv, kv_v);
    crate::run::add_key_basis(&mut tested, &model, &tok)?;
    let mut engine = Engine::try_new(&model, tested)?;
    let f16 = KvFormat::F16;
    let mut reference = match kv != f16 || kv_v != f16 {
        true => Some(Engine::try_new(&model, options(f16, f16))?),
        false => None,
    };
    let vocab = model.config.vocab;
    let first = a.ctx / 2;
    let (mut nll, mut nll_f16, mut kl, mut agree, mut scored) = (0f64, 0f64, 0f64, 0usize, 0usize);
    let (mut lp, mut lq) = (Vec::new(), Vec::new());
    let bar = progress::bar(windows as u64, "windows");
    let t0 = Instant::now();
    for w in 0..windows {
        let mut tokens = ids[w * a.ctx..(w + 1) * a.ctx].to_vec();
        if let (Some(b), true) = (tok.bos, tok.add_bos) {
            tokens[0] = b;
        }
        let logits = window_logits(&mut engine, &tokens, first, a.batch)?;
        let base = match &mut reference {
            Some(r) => Some(window_logits(r, &tokens, first, a.batch)?),
            None => None,
        };
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let next = tokens[first + j + 1] as usize;
            log_softmax(row, &mut lq);
            nll -= lq[next];
            if let Some(b) = &base {
                let brow = &b[j * vocab..(j + 1) * vocab];
                log_softmax(brow, &mut lp);
                nll_f16 -= lp[next];
                kl += lp.iter().zip(&lq).map(|(&p, &q)| p.exp() * (p - q)).sum::<f64>();
                agree += usize::from(argmax(brow) == argmax(row));
            }
            scored += 1;
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let ppl = (nll / scored as f64).exp();
    let (kl_mean, top1, ppl_f16) = if reference.is_some() {
        (
            kl / scored as f64,
            agree as f64 / scored as f64,
            (nll_f16 / scored as f64).exp(),
        )
    } else {
        (0.0, 1.0, ppl)
    };
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": a.model,
                "file": a.file,
                "kv": kv_name(kv, kv_v),
                "ctx": a.ctx,
                "windows": windows,
                "tokens": scored,
                "ppl": ppl,
                "ppl_f16": ppl_f16,
                "delta_ppl": ppl / ppl_f16 - 1.0,
                "kl_vs_f16": kl_mean,
                "top1_vs_f16": top1,
                "seconds": t0.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!(
            "kv {}: perplexity {ppl:.4} over {scored} tokens ({windows} windows of {}); vs f16 KV: perplexity {ppl_f16:.4} ({:+.2}%), KL {kl_mean:.6}, top-1 agreement {:.2}%",
            kv_name(kv, kv_v),
            a.ctx,
            100.0 * (ppl / ppl_f16 - 1.0),
            100.0 * top1
        );
    }
    Ok(())
}
