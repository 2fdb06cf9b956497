//! Whole matrix products of packed K-quant weights against many activation
//! rows, the way prefill runs them (`matmul` with packed panels; AMX tiles
//! where the CPU has them, else the vector kernels; `SIMD=avx512` caps
//! them as `SNUG_SIMD` does): GMAC/s and the tile products' share of the
//! AMX unit's peak. `cargo run --release -p snug-kernels --example
//! amxbench`; `TYPE` (q4_k), `K` (1536), `N` (1536 weight rows), `ROWS`
//! (512), `THREADS` (1), `REPS` (5) set the product.
#![allow(clippy::unwrap_used)] // a tool: a failure may panic

use std::time::Instant;

use snug_kernels::matmul::{matmul, MatmulScratch, Weight};
use snug_kernels::panel::{pack_matrix, packed_matrix_bytes};
use snug_kernels::pool::ThreadPool;
use snug_kernels::GgmlType;

fn var(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let (k, n, rows) = (var("K", 1536), var("N", 1536), var("ROWS", 512));
    let (threads, reps) = (var("THREADS", 1), var("REPS", 5));
    if let Some(level) = std::env::var("SIMD")
        .ok()
        .and_then(|v| snug_kernels::cpu::Simd::parse(&v))
    {
        snug_kernels::cpu::limit(level);
        snug_kernels::cpu::disable_amx();
    }
    let ty_name = std::env::var("TYPE").unwrap_or_else(|_| "q4_k".into());
    let ty = GgmlType::ALL
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(&ty_name))
        .unwrap();
    let row_bytes = ty.bytes_for(k as u64).unwrap() as usize;
    // Levels of every value; scales kept small so the f16 fields are sane.
    let w: Vec<u8> = (0..row_bytes * n).map(|i| (i * 31 % 251) as u8 & 0x3f).collect();
    let mut packed = vec![0u8; packed_matrix_bytes(ty, n, k)];
    pack_matrix(ty, &w, n, k, &mut packed);
    let weight = Weight {
        ty,
        rows: n,
        cols: k,
        data: &w,
        packed: Some(&packed),
    };
    let x: Vec<f32> = (0..k * rows)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut out = vec![0f32; rows * n];
    let mut scratch = MatmulScratch::with_capacity(rows, k);
    let pool = ThreadPool::new(threads);
    matmul(&pool, &weight, &x, rows, &mut out, &mut scratch);
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        matmul(&pool, &weight, &x, rows, &mut out, &mut scratch);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let gmacs = (k * n * rows) as f64 / best / 1e9;
    println!(
        "{} k {k} n {n} rows {rows} threads {threads}: {:.3} ms, {gmacs:.1} GMAC/s ({:.1} GMAC/s a thread)",
        ty.name(),
        best * 1e3,
        gmacs / threads as f64
    );
}
