//! Runs a GGUF model's decoder on the GPU beside the CPU and prints what
//! it finds, as JSON: the GPU's dequantizers against the CPU's, greedy
//! tokens and logits against the CPU backend, batch invariance on the GPU
//! (a prompt prefilled whole or a row at a time, two sequences decoded
//! together or alone: the same bits), and prefill and decode speed.
//!
//!     gpucheck MODEL.gguf [--prompt N] [--gen N] [--pp N] [--tg N] [--out FILE] [--define NAME=VALUE]...
//!         [--profile-decode N | --profile-prefill N [--tiles warp|staged]] [--no-graphs] [--no-overlap]
//!         [--kv FORMAT[/FORMAT]] [--source KERNELS.cu]
//!
//! `--kv q8` (or `f16/q8`, `tq4/q8`: keys/values) runs every check over
//! pages in those formats, each page with an F16 twin (the exact window),
//! TQ4 keys coded against a key basis made up for the check.
//!
//! (An example: it unwraps and exits on failure.)
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use snug_cuda::{CudaKv, CudaWeights, CudaWorkspace, Device, Tiles};
use snug_kernels::kv::{KvFormat, KvShape, KvStorage, KvStore};
use snug_kernels::kvbasis::KeyBasis;
use snug_kernels::GgmlType;
use snug_model::arch::{forward, BatchRow, Config, Head, KvView, Model, Weights};
use snug_model::backend::{Backend, Cpu, Native, WorkspaceSize};
use snug_model::packed::PackMode;
use snug_model::{EncodeOptions, LoadOptions, ModelFiles, Tokenizer};

const PT: usize = 32;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .map_or(default, |i| args[i + 1].parse().unwrap())
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of each sequence of `prompts` (pages `pages[s]`),
/// prompts prefilled in chunks of `chunk` rows (sequence after sequence),
/// then `gen` steps with every sequence's row in one batch. Returns, per
/// sequence, its tokens and the logits of each step (the prompt's last
/// row first).
#[allow(clippy::too_many_arguments)]
fn greedy<'w, B: Backend>(
    c: &Config,
    w: &Weights<B::Matrix<'w>, B::Vector<'w>>,
    ws: &mut B::Workspace,
    kv: &mut B::Kv,
    pages: &[Vec<u32>],
    prompts: &[Vec<u32>],
    chunk: usize,
    gen: usize,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let tables: Vec<&[u32]> = pages.iter().map(|p| p.as_slice()).collect();
    // A coded cache: every page's twin is the page of the same number.
    let twins: Vec<&[u32]> = if kv.is_lossy() { tables.clone() } else { Vec::new() };
    let mut out: Vec<(Vec<u32>, Vec<Vec<f32>>)> = vec![(Vec::new(), Vec::new()); prompts.len()];
    for (s, p) in prompts.iter().enumerate() {
        for (ci, part) in p.chunks(chunk).enumerate() {
            let rows: Vec<BatchRow> = part
                .iter()
                .enumerate()
                .map(|(i, &t)| BatchRow {
                    seq: s,
                    pos: ci * chunk + i,
                    token: t,
                    logits: ci * chunk + i + 1 == p.len(),
                })
                .collect();
            let mut logits = Vec::new();
            let mut view = KvView {
                storage: &mut *kv,
                pages: &tables,
                twins: &twins,
            };
            forward::<B>(c, w, &rows, &mut view, ws, Head::Logits, &mut logits);
            if !logits.is_empty() {
                out[s].0.push(argmax(&logits));
                out[s].1.push(logits);
            }
        }
    }
    for step in 0..gen {
        let rows: Vec<BatchRow> = prompts
            .iter()
            .enumerate()
            .map(|(s, p)| BatchRow {
                seq: s,
                pos: p.len() + step,
                token: *out[s].0.last().unwrap(),
                logits: true,
            })
            .collect();
        let mut logits = Vec::new();
        let mut view = KvView {
            storage: &mut *kv,
            pages: &tables,
            twins: &twins,
        };
        forward::<B>(c, w, &rows, &mut view, ws, Head::Logits, &mut logits);
        for (s, l) in logits.chunks(c.vocab).enumerate() {
            out[s].0.push(argmax(l));
            out[s].1.push(l.to_vec());
        }
    }
    out
}

/// A key basis for TQ4 keys with offsets and weights away from the
/// identity (the same for both elements of a rotary pair), so that coding
/// against it and scoring its offset are exercised.
fn test_basis(model: &Model) -> std::sync::Arc<KeyBasis> {
    let c = &model.config;
    let ropes = model.layer_ropes();
    let mut b = KeyBasis::identity(c.layers, c.kv_heads, c.head_dim, ropes.clone());
    for (l, rope) in ropes.iter().enumerate() {
        for h in 0..c.kv_heads {
            let o = (l * c.kv_heads + h) * c.head_dim;
            for d in 0..c.head_dim {
                b.offset[o + d] = 0.3 * ((o + 7 * d) as f32 * 0.37).sin();
            }
            for (j, &(a, bb, _)) in rope.pairs(c.head_dim).iter().enumerate() {
                let w = 0.6 + 0.1 * (j % 9) as f32;
                b.weight[o + a] = w;
                b.weight[o + bb] = w;
            }
        }
    }
    std::sync::Arc::new(b)
}

/// `--kv K[/V]`: the formats of keys and values (F16 without it).
fn kv_formats(args: &[String]) -> (KvFormat, KvFormat) {
    let Some(i) = args.iter().position(|a| a == "--kv") else {
        return (KvFormat::F16, KvFormat::F16);
    };
    let spec = &args[i + 1];
    let (k, v) = spec.split_once('/').unwrap_or((spec, spec));
    (KvFormat::parse(k).unwrap(), KvFormat::parse(v).unwrap())
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(&args[1]);
    let n_prompt = arg(&args, "--prompt", 48);
    let gen = arg(&args, "--gen", 32);
    let pp = arg(&args, "--pp", 512);
    let tg = arg(&args, "--tg", 128);
    let out_file = args.iter().position(|a| a == "--out").map(|i| args[i + 1].clone());
    let formats = kv_formats(&args);
    let lossy = [formats.0, formats.1]
        .iter()
        .any(|f| matches!(f, KvFormat::Q8 | KvFormat::Tq4));

    // `--cpu-only`: the CPU backend's own batch invariance on this file
    // (whole prompt, a row at a time, chunks of 7), no GPU needed.
    if args.iter().any(|a| a == "--cpu-only") {
        let files = ModelFiles::open(&path, &LoadOptions { pack: PackMode::Off }).unwrap();
        let model = Model::load(&files).unwrap();
        let c = model.config.clone();
        let tok = Tokenizer::from_gguf(&files.gguf.header).unwrap();
        let text = "The river flows through the old town, past the mill and the bridge, \
                    and on to the sea where the boats wait for the tide. ";
        let mut prompt = tok.encode(&text.repeat(64), EncodeOptions::default());
        prompt.truncate(n_prompt);
        let shape = KvShape {
            layers: c.layers,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            page_tokens: PT,
        };
        let ctx = n_prompt + gen + 8;
        let pages: Vec<Vec<u32>> = vec![(0..(ctx.div_ceil(PT) + 1) as u32).collect()];
        let size = WorkspaceSize {
            rows: 64,
            ctx,
            page_tokens: PT,
            threads: 2,
        };
        let n = ctx.div_ceil(PT) + 1;
        let mut kv = KvStorage::with_formats(shape, formats.0, formats.1, n)
            .with_twins(if lossy { n } else { 0 })
            .with_key_basis(test_basis(&model));
        let mut ws = <Cpu<Native> as Backend>::workspace(&c, size);
        let w = model.weights();
        let mut runs = Vec::new();
        for chunk in [64, 1, 7] {
            runs.push(greedy::<Cpu<Native>>(
                &c,
                w,
                &mut ws,
                &mut kv,
                &pages,
                &[prompt.clone()],
                chunk,
                gen,
            ));
        }
        println!(
            "cpu: row by row {}, chunks of 7 {}",
            same_bits(&runs[0][0].1, &runs[1][0].1),
            same_bits(&runs[0][0].1, &runs[2][0].1)
        );
        return;
    }
    // `--define NAME=VALUE` (repeatable): a tuning macro of kernels.cu.
    let defines: Vec<String> = args
        .iter()
        .enumerate()
        .filter(|(_, a)| *a == "--define")
        .filter_map(|(i, _)| args.get(i + 1).cloned())
        .collect();
    // `--source FILE`: a variant of kernels.cu instead of the built-in one.
    let source = match args.iter().position(|a| a == "--source").and_then(|i| args.get(i + 1)) {
        Some(f) => std::fs::read_to_string(f).unwrap_or_else(|e| {
            eprintln!("gpucheck: {f}: {e}");
            std::process::exit(1)
        }),
        None => snug_cuda::SOURCE.to_string(),
    };
    let dev = match Device::open_source(0, &source, &defines) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpucheck: {e}");
            std::process::exit(1);
        }
    };
    let (free, total) = dev.memory().unwrap();
    eprintln!(
        "device: {} (sm_{}{}), {free} of {total} bytes free",
        dev.name, dev.capability.0, dev.capability.1
    );
    let files = ModelFiles::open(&path, &LoadOptions { pack: PackMode::Off }).unwrap();
    let model = Model::load(&files).unwrap();
    let c = model.config.clone();
    let tok = Tokenizer::from_gguf(&files.gguf.header).unwrap();
    let text = "The river flows through the old town, past the mill and the bridge, \
                and on to the sea where the boats wait for the tide. ";
    let mut prompt = tok.encode(&text.repeat(64), EncodeOptions::default());
    prompt.truncate(n_prompt);
    let mut prompt2 = tok.encode(
        &"Write a function that adds two numbers. ".repeat(64),
        EncodeOptions::default(),
    );
    prompt2.truncate(n_prompt / 2 + 3);

    let t = Instant::now();
    let gw = CudaWeights::upload(&dev, model.weights()).unwrap();
    dev.synchronize().unwrap();
    let upload_s = t.elapsed().as_secs_f64();

    // `--profile-prefill N`: N prefills of the prompt, each timed alone
    // (`--tiles warp|staged`: the products' tiles on tensor cores).
    // `--profile-decode N`: a prefill of the prompt then N decode steps,
    // each timed alone. For a profiler to look at; nothing else runs.
    let profile_pp = arg(&args, "--profile-prefill", 0);
    let profile = arg(&args, "--profile-decode", 0);
    if profile_pp > 0 || profile > 0 {
        let shape = KvShape {
            layers: c.layers,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            page_tokens: PT,
        };
        let ctx = prompt.len() + profile + 8;
        let size = WorkspaceSize {
            rows: prompt.len().max(1),
            ctx,
            page_tokens: PT,
            threads: 1,
        };
        let n = ctx.div_ceil(PT) + 1;
        let mut kv = CudaKv::with_formats(
            &dev,
            shape,
            formats,
            n,
            if lossy { n } else { 0 },
            Some(test_basis(&model)),
        )
        .unwrap();
        let mut ws = CudaWorkspace::new(&dev, &c, size).unwrap();
        ws.set_graphs(!args.iter().any(|a| a == "--no-graphs"));
        ws.set_overlap(!args.iter().any(|a| a == "--no-overlap"));
        ws.set_tiles(
            match args.iter().position(|a| a == "--tiles").map(|i| args[i + 1].as_str()) {
                Some("warp") => Tiles::Warp,
                _ => Tiles::Staged,
            },
        );
        let pages: Vec<u32> = (0..(ctx.div_ceil(PT) + 1) as u32).collect();
        let tables: Vec<&[u32]> = vec![&pages];
        let twins: Vec<&[u32]> = if lossy { tables.clone() } else { Vec::new() };
        let rows: Vec<BatchRow> = prompt
            .iter()
            .enumerate()
            .map(|(i, &t)| BatchRow {
                seq: 0,
                pos: i,
                token: t,
                logits: i + 1 == prompt.len(),
            })
            .collect();
        if profile_pp > 0 {
            let mut ms = Vec::new();
            for _ in 0..profile_pp {
                let mut logits = Vec::new();
                let mut view = KvView {
                    storage: &mut kv,
                    pages: &tables,
                    twins: &twins,
                };
                dev.synchronize().unwrap();
                let t = Instant::now();
                forward::<snug_cuda::Cuda>(&c, &gw.weights, &rows, &mut view, &mut ws, Head::Logits, &mut logits);
                dev.synchronize().unwrap();
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            ws.check().unwrap();
            ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
            println!(
                "prefill of {}: median {:.3} ms, min {:.3} ms over {profile_pp} ({:.0} tok/s)",
                prompt.len(),
                ms[ms.len() / 2],
                ms[0],
                prompt.len() as f64 / ms[ms.len() / 2] * 1e3
            );
            return;
        }
        let mut logits = Vec::new();
        let mut view = KvView {
            storage: &mut kv,
            pages: &tables,
            twins: &twins,
        };
        forward::<snug_cuda::Cuda>(&c, &gw.weights, &rows, &mut view, &mut ws, Head::Logits, &mut logits);
        let mut next = argmax(&logits);
        let mut ms = Vec::new();
        for step in 0..profile {
            dev.synchronize().unwrap();
            let t = Instant::now();
            let rows = [BatchRow {
                seq: 0,
                pos: prompt.len() + step,
                token: next,
                logits: true,
            }];
            logits.clear();
            let mut view = KvView {
                storage: &mut kv,
                pages: &tables,
                twins: &twins,
            };
            forward::<snug_cuda::Cuda>(&c, &gw.weights, &rows, &mut view, &mut ws, Head::Logits, &mut logits);
            next = argmax(&logits);
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ws.check().unwrap();
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "decode step: median {:.3} ms, min {:.3} ms over {profile} steps",
            ms[ms.len() / 2],
            ms[0]
        );
        return;
    }

    // The GPU's dequantizers against the CPU's, on every matrix type.
    let mut deq = serde_json::Map::new();
    {
        let w = model.weights();
        let g = &gw.weights;
        let mut pairs = vec![(&w.embed, &g.embed), (&w.output, &g.output)];
        for (l, gl) in w.layers.iter().zip(&g.layers) {
            pairs.extend([(&l.wq, &gl.wq), (&l.wk, &gl.wk), (&l.wv, &gl.wv), (&l.wo, &gl.wo)]);
            pairs.extend(l.ffn.matrices().into_iter().zip(gl.ffn.matrices()));
        }
        for (cw, gm) in pairs {
            let name = cw.ty.name().to_string();
            if deq.contains_key(&name) {
                continue;
            }
            let rows: Vec<u32> = (0..cw.rows.min(64) as u32).collect();
            let got = dev.dequantize_rows(gm, &rows).unwrap();
            let mut want = vec![0f32; rows.len() * cw.cols];
            snug_kernels::dequantize(cw.ty, &cw.data[..rows.len() * cw.row_bytes()], &mut want).unwrap();
            let max = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let exact = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            deq.insert(
                name,
                serde_json::json!({"max_abs_diff": max, "bitwise_equal_share": exact as f64 / got.len() as f64}),
            );
        }
    }

    // Every type the kernels read, on random blocks with sane scales.
    let mut deq_types = serde_json::Map::new();
    let mut seed = 0x9e3779b97f4a7c15u64;
    for ty in snug_cuda::TYPES {
        let (rows, cols) = (8usize, 1024usize);
        let n = ty.bytes_for(cols as u64).unwrap() as usize * rows;
        let mut bytes: Vec<u8> = (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 33) as u8
            })
            .collect();
        let f16s: Vec<usize> = match ty {
            GgmlType::F16 => (0..cols * rows).map(|i| 2 * i).collect(),
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => vec![0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => vec![0, 2],
            GgmlType::Q6K => vec![208],
            GgmlType::Q2K => vec![80, 82],
            GgmlType::Q3K => vec![108],
            GgmlType::IQ4NL | GgmlType::IQ4XS => vec![0],
            _ => vec![],
        };
        let bs = ty.type_size();
        let per_block = if matches!(ty, GgmlType::F16) { usize::MAX } else { bs };
        for (i, b) in bytes.chunks_mut(per_block.min(n)).enumerate() {
            for &o in &f16s {
                if o + 1 < b.len() {
                    let v = half::f16::from_f32(0.01 + 0.001 * ((i + o) % 17) as f32);
                    b[o..o + 2].copy_from_slice(&v.to_bits().to_le_bytes());
                }
            }
        }
        if matches!(ty, GgmlType::F32) {
            for (i, c) in bytes.chunks_mut(4).enumerate() {
                c.copy_from_slice(&((i % 97) as f32 * 0.01 - 0.4).to_le_bytes());
            }
        }
        if matches!(ty, GgmlType::BF16) {
            for (i, c) in bytes.chunks_mut(2).enumerate() {
                let v = ((i % 89) as f32 * 0.01 - 0.4).to_bits() >> 16;
                c.copy_from_slice(&(v as u16).to_le_bytes());
            }
        }
        let w = snug_kernels::matmul::Weight {
            ty,
            rows,
            cols,
            data: &bytes,
            packed: None,
        };
        let (m, _held) = CudaWeights::matrix(&dev, &w).unwrap();
        let got = dev.dequantize_rows(&m, &(0..rows as u32).collect::<Vec<_>>()).unwrap();
        let mut want = vec![0f32; rows * cols];
        snug_kernels::dequantize(ty, &bytes, &mut want).unwrap();
        let max = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let exact = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        deq_types.insert(
            ty.name().to_string(),
            serde_json::json!({"max_abs_diff": max, "bitwise_equal_share": exact as f64 / got.len() as f64}),
        );
    }

    let ctx = (n_prompt + gen + 8).max(pp + tg + 8);
    let per_seq = ctx.div_ceil(PT) + 1;
    let shape = KvShape {
        layers: c.layers,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        page_tokens: PT,
    };
    let pages: Vec<Vec<u32>> = (0..2)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let rows_max = pp.max(n_prompt).max(64);
    let size = WorkspaceSize {
        rows: rows_max,
        ctx,
        page_tokens: PT,
        threads: std::thread::available_parallelism().map_or(4, |n| n.get()),
    };
    let n_twins = if lossy { 2 * per_seq } else { 0 };
    let mut gkv = CudaKv::with_formats(&dev, shape, formats, 2 * per_seq, n_twins, Some(test_basis(&model))).unwrap();
    let mut gws = CudaWorkspace::new(&dev, &c, size).unwrap();
    let gwt = &gw.weights;

    // The CPU reference (snug's own numerics).
    let mut ckv = KvStorage::with_formats(shape, formats.0, formats.1, 2 * per_seq)
        .with_twins(n_twins)
        .with_key_basis(test_basis(&model));
    let mut cws = <Cpu<Native> as Backend>::workspace(&c, size);
    let t = Instant::now();
    let cpu = greedy::<Cpu<Native>>(
        &c,
        model.weights(),
        &mut cws,
        &mut ckv,
        &pages[..1],
        &[prompt.clone()],
        64,
        gen,
    );
    let cpu_s = t.elapsed().as_secs_f64();

    // The prompt prefilled whole, then `gen` greedy steps.
    let whole = |gws: &mut CudaWorkspace, gkv: &mut CudaKv| {
        greedy::<snug_cuda::Cuda>(&c, gwt, gws, gkv, &pages[..1], &[prompt.clone()], rows_max, gen)
    };
    let gpu_whole = whole(&mut gws, &mut gkv);
    gws.check().unwrap();
    let gpu_rows = greedy::<snug_cuda::Cuda>(&c, gwt, &mut gws, &mut gkv, &pages[..1], &[prompt.clone()], 1, gen);
    let gpu_chunks = greedy::<snug_cuda::Cuda>(&c, gwt, &mut gws, &mut gkv, &pages[..1], &[prompt.clone()], 7, gen);
    let alone2 = greedy::<snug_cuda::Cuda>(&c, gwt, &mut gws, &mut gkv, &pages[1..], &[prompt2.clone()], 64, gen);
    // Both sequences decoded in one batch.
    let both = |gws: &mut CudaWorkspace, gkv: &mut CudaKv| {
        greedy::<snug_cuda::Cuda>(&c, gwt, gws, gkv, &pages, &[prompt.clone(), prompt2.clone()], 64, gen)
    };
    let together = both(&mut gws, &mut gkv);
    gws.check().unwrap();
    let same_as_together = |other: &[(Vec<u32>, Vec<Vec<f32>>)]| {
        same_bits(&together[0].1, &other[0].1) && same_bits(&together[1].1, &other[1].1)
    };
    // The same passes launched one by one instead of replayed as graphs.
    gws.set_graphs(false);
    let no_graphs = both(&mut gws, &mut gkv);
    gws.set_graphs(true);
    gws.check().unwrap();
    let graphs_same_bits = same_as_together(&no_graphs);
    // And with every kernel launched after the one before has finished.
    gws.set_overlap(false);
    let no_overlap = both(&mut gws, &mut gkv);
    gws.set_overlap(true);
    gws.check().unwrap();
    let overlap_same_bits = same_as_together(&no_overlap);

    let (ct, cl) = &cpu[0];
    let (gt, gl) = &gpu_whole[0];
    let agree = ct.iter().zip(gt).take_while(|(a, b)| a == b).count();
    let max_diff: Vec<f32> = cl
        .iter()
        .zip(gl)
        .take(agree.max(1))
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max))
        .collect();
    // Steps whose logits are bitwise the CPU's.
    let bitwise_steps = cl
        .iter()
        .zip(gl)
        .take_while(|(a, b)| a.len() == b.len() && a.iter().zip(b.iter()).all(|(x, y)| x.to_bits() == y.to_bits()))
        .count();
    // The first step whose logits differ, where any does.
    let first_diff = |a: &[Vec<f32>], b: &[Vec<f32>]| -> Option<usize> {
        a.iter()
            .zip(b)
            .position(|(x, y)| x.iter().zip(y.iter()).any(|(p, q)| p.to_bits() != q.to_bits()))
    };
    gws.set_tensor_cores(false);
    let gpu_whole_cuda_cores = whole(&mut gws, &mut gkv);
    gws.set_tensor_cores(true);
    gws.set_tiles(Tiles::Warp);
    let gpu_whole_warp_tiles = whole(&mut gws, &mut gkv);
    gws.set_tiles(Tiles::Staged);
    let diff_detail = serde_json::json!({
        "whole_warp_tiles_first_diff_step": first_diff(gl, &gpu_whole_warp_tiles[0].1),
        "rows_first_diff_step": first_diff(gl, &gpu_rows[0].1),
        "chunks_first_diff_step": first_diff(gl, &gpu_chunks[0].1),
        "whole_without_tensor_cores_first_diff_step": first_diff(gl, &gpu_whole_cuda_cores[0].1),
        "rows_vs_cpu_first_diff_step": first_diff(cl, &gpu_rows[0].1),
    });
    let invariant_rows = same_bits(gl, &gpu_rows[0].1);
    let invariant_chunks = same_bits(gl, &gpu_chunks[0].1);
    let invariant_batch = same_bits(gl, &together[0].1) && same_bits(&alone2[0].1, &together[1].1);

    // Speed: prefill of `pp` rows in one pass; `tg` decode steps of one row.
    let bench_prompt: Vec<u32> = (0..pp).map(|i| prompt[i % prompt.len()]).collect();
    let tables: Vec<&[u32]> = vec![&pages[0]];
    let twins: Vec<&[u32]> = if lossy { tables.clone() } else { Vec::new() };
    let mut pp_s = Vec::new();
    let mut tg_s = Vec::new();
    let mut tg_direct_s = Vec::new();
    let mut pp_cuda_cores_s = Vec::new();
    let mut pp_warp_tiles_s = Vec::new();
    for round in 0..9 {
        // Rounds take turns: decode steps as graphs and prefill on tensor
        // cores in staged tiles; one by one and without tensor cores; as
        // graphs and in a warp's tiles.
        let graphs = round % 3 != 1;
        let tiles = [Tiles::Staged, Tiles::Staged, Tiles::Warp][round % 3];
        gws.set_graphs(graphs);
        gws.set_tensor_cores(graphs);
        gws.set_tiles(tiles);
        let rows: Vec<BatchRow> = bench_prompt
            .iter()
            .enumerate()
            .map(|(i, &t)| BatchRow {
                seq: 0,
                pos: i,
                token: t,
                logits: i + 1 == pp,
            })
            .collect();
        let mut logits = Vec::new();
        dev.synchronize().unwrap();
        let t = Instant::now();
        let mut view = KvView {
            storage: &mut gkv,
            pages: &tables,
            twins: &twins,
        };
        forward::<snug_cuda::Cuda>(&c, gwt, &rows, &mut view, &mut gws, Head::Logits, &mut logits);
        dev.synchronize().unwrap();
        if !graphs {
            pp_cuda_cores_s.push(t.elapsed().as_secs_f64());
        } else if tiles == Tiles::Staged {
            pp_s.push(t.elapsed().as_secs_f64());
        } else {
            pp_warp_tiles_s.push(t.elapsed().as_secs_f64());
        }
        let mut next = argmax(&logits);
        let t = Instant::now();
        for step in 0..tg {
            let rows = [BatchRow {
                seq: 0,
                pos: pp + step,
                token: next,
                logits: true,
            }];
            logits.clear();
            let mut view = KvView {
                storage: &mut gkv,
                pages: &tables,
                twins: &twins,
            };
            forward::<snug_cuda::Cuda>(&c, gwt, &rows, &mut view, &mut gws, Head::Logits, &mut logits);
            next = argmax(&logits);
        }
        if graphs {
            tg_s.push(t.elapsed().as_secs_f64());
        } else {
            tg_direct_s.push(t.elapsed().as_secs_f64());
        }
    }
    gws.set_graphs(true);
    gws.set_tensor_cores(true);
    gws.set_tiles(Tiles::Staged);
    gws.check().unwrap();
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (pps, tgs, tgd) = (med(&mut pp_s), med(&mut tg_s), med(&mut tg_direct_s));
    let report = serde_json::json!({
        "model": path.file_name().map(|n| n.to_string_lossy().to_string()),
        "kv": format!("{}/{}", formats.0.name(), formats.1.name()),
        "device": dev.name,
        "capability": format!("sm_{}{}", dev.capability.0, dev.capability.1),
        "weights_bytes_on_device": gw.bytes,
        "workspace_bytes": gws.bytes(),
        "upload_s": upload_s,
        "dequantize_vs_cpu": deq,
        "dequantize_random_blocks_vs_cpu": deq_types,
        "prompt_tokens": prompt.len(),
        "generated": gen,
        "cpu_tokens": ct,
        "gpu_tokens": gt,
        "greedy_steps_equal_to_cpu": agree,
        "max_abs_logit_diff_per_step": max_diff,
        "logits_bitwise_equal_to_cpu_steps": bitwise_steps,
        "cpu_seconds": cpu_s,
        "batch_invariant_prefill_row_by_row": invariant_rows,
        "batch_invariant_prefill_chunks_of_7": invariant_chunks,
        "batch_invariant_two_sequences_together": invariant_batch,
        "pp": pp,
        "pp_tok_s": pp as f64 / pps,
        "tg": tg,
        "tg_tok_s": tg as f64 / tgs,
        "tg_tok_s_without_graphs": tg as f64 / tgd,
        "pp_tok_s_without_tensor_cores": pp as f64 / med(&mut pp_cuda_cores_s),
        "pp_tok_s_warp_tiles": pp as f64 / med(&mut pp_warp_tiles_s),
        "tiles_same_bits": same_bits(gl, &gpu_whole_warp_tiles[0].1),
        "graphs_same_bits_as_launches": graphs_same_bits,
        "overlapping_launches": dev.overlap,
        "overlap_same_bits_as_serial": overlap_same_bits,
        "graphs_captured": gws.graph_count(),
        "first_differences": diff_detail,
    });
    let s = serde_json::to_string_pretty(&report).unwrap();
    println!("{s}");
    if let Some(f) = out_file {
        std::fs::write(f, s).unwrap();
    }
}
