//! Single-thread time of one decode row's attention over F16 pages (or
//! `KV=q8`, `KV=tq4`: coded pages, TQ4 keys in a key basis), per
//! (layer, KV head) group, at the head shapes of the four models and a
//! few depths: microseconds a call and GB/s of keys and values read.
//! With `COLD=1` each round of calls runs over 24 layers after reading a
//! 512 MiB buffer, so the keys and values come from memory, as they do
//! in a model whose weights stream through the caches between layers.
//! With `ROWS=n`, the time a row of a prefill chunk takes: `n` rows at the
//! positions before the depth, through `attend_rows` (over lossy pages,
//! up to 8 rows read each page together), per row.
//! `[SHAPE=qwen1.5b] [COLD=1] [KV=tq4] [ROWS=n] cargo run --release -p snug-kernels --example attnbench [DEPTH...]`

use std::time::Instant;

use snug_kernels::kv::{
    attend_group, attend_rows, AttnQuery, AttnRow, AttnScratch, KvFormat, KvShape, KvSlot, KvStorage,
};
use snug_kernels::kvbasis::KeyBasis;
use snug_kernels::ops::{Rope, RopeLayout};

fn main() {
    // `SNUG_SIMD=avx2|scalar` caps the kernels' level, as for `snug`.
    if let Some(level) = std::env::var("SNUG_SIMD")
        .ok()
        .and_then(|v| snug_kernels::cpu::Simd::parse(&v))
    {
        snug_kernels::cpu::limit(level);
    }
    let depths: Vec<usize> = {
        let d: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
        if d.is_empty() {
            vec![512, 2048, 8192]
        } else {
            d
        }
    };
    // (name, query heads per KV head, head size)
    let shapes = [
        ("smollm2 (3 x 64)", 3, 64),
        ("gemma3 (4 x 256)", 4, 256),
        ("qwen0.5b (7 x 64)", 7, 64),
        ("qwen1.5b (6 x 128)", 6, 128),
    ];
    let pt = 32;
    let cold = std::env::var("COLD").is_ok_and(|v| v == "1");
    let layers = if cold { 24 } else { 1 };
    let flush: Vec<u64> = if cold { vec![1; 64 << 20] } else { Vec::new() };
    let rows: usize = std::env::var("ROWS").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
    println!("| shape | depth | us a call | GB/s of K+V |");
    println!("| --- | ---: | ---: | ---: |");
    let only = std::env::var("SHAPE").ok();
    let format = std::env::var("KV")
        .ok()
        .and_then(|f| KvFormat::parse(&f))
        .unwrap_or(KvFormat::F16);
    for &(name, group, hd) in &shapes {
        if only.as_deref().is_some_and(|o| !name.starts_with(o)) {
            continue;
        }
        for &depth in &depths {
            let shape = KvShape {
                layers,
                kv_heads: 1,
                head_dim: hd,
                page_tokens: pt,
            };
            let n_pages = depth.div_ceil(pt);
            let mut kv = KvStorage::new(shape, format, n_pages);
            if format == KvFormat::Tq4 && std::env::var("NOBASIS").is_err() {
                let ropes = vec![Rope::new(RopeLayout::Halves, hd, 10000.0); layers];
                kv = kv.with_key_basis(std::sync::Arc::new(KeyBasis::identity(layers, 1, hd, ropes)));
            }
            // Pages in a scattered order, as a pool hands them out.
            let pages: Vec<u32> = (0..n_pages as u32).map(|i| (i * 7) % n_pages as u32).collect();
            let mut x = 0x9e37_79b9u32;
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 2000) as f32 / 1000.0 - 1.0
            };
            for p in 0..depth {
                let k: Vec<f32> = (0..hd).map(|_| rnd()).collect();
                let v: Vec<f32> = (0..hd).map(|_| rnd()).collect();
                let at = KvSlot {
                    page: pages[p / pt],
                    slot: p % pt,
                    pos: p,
                    twin: None,
                };
                for l in 0..layers {
                    kv.write(l, at, &k, &v);
                }
            }
            let q: Vec<f32> = (0..group * hd).map(|_| rnd() * 2.0).collect();
            let query = AttnQuery {
                pages: &pages,
                twins: &[],
                start: 0,
                end: depth,
            };
            let lossy = matches!(format, KvFormat::Q8 | KvFormat::Tq4);
            let block: usize = std::env::var("BLOCK").ok().and_then(|b| b.parse().ok()).unwrap_or(8);
            let mut scratch = AttnScratch::for_rows(if lossy { 0 } else { depth }, hd, group, pt, block);
            let mut out = vec![0f32; group * hd];
            let scale = 1.0 / (hd as f32).sqrt();
            attend_group(&kv, 0, 0, &query, &q, scale, &mut out, &mut scratch);
            if rows > 0 {
                let n = rows.min(depth);
                let qs: Vec<f32> = (0..n * group * hd).map(|_| rnd() * 2.0).collect();
                let mut outs = vec![0f32; n * group * hd];
                let mut times = Vec::new();
                for _ in 0..5 {
                    let t0 = Instant::now();
                    for l in 0..layers {
                        let mut block: Vec<AttnRow> = qs
                            .chunks(group * hd)
                            .zip(outs.chunks_mut(group * hd))
                            .enumerate()
                            .map(|(i, (q, out))| AttnRow {
                                query: AttnQuery {
                                    end: depth - n + i + 1,
                                    ..query
                                },
                                q,
                                out,
                            })
                            .collect();
                        attend_rows(&kv, l, 0, &mut block, scale, &mut scratch);
                    }
                    times.push(t0.elapsed().as_secs_f64() / (n * layers) as f64);
                }
                times.sort_by(f64::total_cmp);
                let t = times[2];
                let bytes = (2 * depth * format.vector_bytes(hd)) as f64;
                println!("| {name} | {depth} | {:.1} a row | {:.1} |", t * 1e6, bytes / t / 1e9);
                continue;
            }
            let reps = (std::env::var("WORK")
                .ok()
                .and_then(|w| w.parse().ok())
                .unwrap_or(4_000_000usize)
                / (depth * group * hd * layers))
                .max(3);
            let mut times = Vec::new();
            for _ in 0..5 {
                let mut t = 0f64;
                for _ in 0..reps {
                    if cold {
                        std::hint::black_box(flush.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
                    }
                    let t0 = Instant::now();
                    for l in 0..layers {
                        attend_group(&kv, l, 0, &query, &q, scale, &mut out, &mut scratch);
                    }
                    t += t0.elapsed().as_secs_f64();
                }
                times.push(t / (reps * layers) as f64);
            }
            times.sort_by(f64::total_cmp);
            let t = times[2];
            let bytes = (2 * depth * format.vector_bytes(hd)) as f64;
            println!("| {name} | {depth} | {:.1} | {:.1} |", t * 1e6, bytes / t / 1e9);
            std::hint::black_box(&out);
        }
    }
}
