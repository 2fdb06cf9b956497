//! Single-thread throughput of the dot kernels: GB/s of weights read and
//! GMAC/s for one activation row (decode) and for 64 (prefill), per type
//! and path, in tasks of 16 weight rows as the matrix product runs them;
//! then the panel kernel (packing included) for 64 and 512 rows.
//! `cargo run --release -p snug-kernels --example dotbench [TYPE...]`;
//! `K` and `ROWS` set the matrix, `ONLY=packed` runs only the packed
//! panels, `N=1,4` only those activation rows, `REPS=10` repeats each
//! measurement ten times as often, and `SIMD=avx2` (or `scalar`,
//! `avx512`) caps the kernels' level as `SNUG_SIMD` does for snug.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use std::time::Instant;

use snug_kernels::cpu::Simd;
use snug_kernels::dot::{act_format, dot_tile_with, quantize_row, BlockQ8};
use snug_kernels::panel::{activation_aux, aux_len, pack_matrix, packed_matrix_bytes, Panel, PanelRef};
use snug_kernels::GgmlType;

fn main() {
    let k: usize = std::env::var("K").ok().and_then(|v| v.parse().ok()).unwrap_or(2048);
    let rows: usize = std::env::var("ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    if let Some(level) = std::env::var("SIMD").ok().and_then(|v| Simd::parse(&v)) {
        snug_kernels::cpu::limit(level);
        snug_kernels::cpu::disable_amx();
    }
    // Every quantized type the panels take.
    let all: Vec<GgmlType> = GgmlType::ALL
        .into_iter()
        .filter(|&t| snug_kernels::panel::supports(t))
        .collect();
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    let scale: usize = std::env::var("REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let only = std::env::var("ONLY").unwrap_or_default();
    let ns: Option<Vec<usize>> = std::env::var("N")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect());
    let keep = |n: usize| ns.as_ref().is_none_or(|ns| ns.contains(&n));
    let types: Vec<GgmlType> = all
        .into_iter()
        .filter(|t| wanted.is_empty() || wanted.iter().any(|w| w.eq_ignore_ascii_case(t.name())))
        .collect();
    let x: Vec<f32> = (0..k * 64).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    for level in Simd::available()
        .into_iter()
        .filter(|&l| l <= snug_kernels::cpu::simd())
    {
        if !only.is_empty() && only != level.name() {
            continue;
        }
        for &ty in &types {
            let mut q = vec![BlockQ8::default(); 64 * k / 32];
            for (xr, qr) in x.chunks(k).zip(q.chunks_mut(k / 32)) {
                quantize_row(act_format(ty), xr, qr);
            }
            let acts: Vec<&[BlockQ8]> = q.chunks(k / 32).collect();
            let row_bytes = ty.bytes_for(k as u64).unwrap() as usize;
            let w: Vec<u8> = (0..row_bytes * rows).map(|i| (i * 31 % 251) as u8 & 0x3f).collect();
            let wrows: Vec<&[u8]> = w.chunks(row_bytes).collect();
            for n in [1usize, 2, 4, 8, 64].into_iter().filter(|&n| keep(n)) {
                let mut out = vec![0f32; 16 * n];
                let reps = if n == 1 {
                    (51200 / rows).max(2)
                } else {
                    (1024 / rows).max(1)
                };
                let t = Instant::now();
                for _ in 0..reps {
                    for task in wrows.chunks(16) {
                        dot_tile_with(level, ty, task, &acts[..n], &mut out[..task.len() * n]);
                    }
                }
                let s = t.elapsed().as_secs_f64();
                let gbs = (w.len() * reps) as f64 / s / 1e9;
                let gmacs = (k * rows * reps * n) as f64 / s / 1e9;
                println!(
                    "{:<12} {:<5} rows {n:2}: {gbs:6.2} GB/s weights, {gmacs:6.2} GMAC/s",
                    level.name(),
                    ty.name()
                );
            }
        }
    }
    for &ty in &types {
        if !snug_kernels::panel::available(ty) || !(only.is_empty() || only == "packed") {
            continue;
        }
        let nb = k / 32;
        let xs: Vec<f32> = (0..k * 512).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let mut q = vec![BlockQ8::default(); 512 * nb];
        let mut aux = vec![0i32; 512 * aux_len(ty, nb)];
        for ((xr, qr), ar) in xs.chunks(k).zip(q.chunks_mut(nb)).zip(aux.chunks_mut(aux_len(ty, nb))) {
            quantize_row(act_format(ty), xr, qr);
            activation_aux(ty, qr, ar);
        }
        let acts: Vec<&[BlockQ8]> = q.chunks(nb).collect();
        let auxs: Vec<&[i32]> = aux.chunks(aux_len(ty, nb)).collect();
        let row_bytes = ty.bytes_for(k as u64).unwrap() as usize;
        let w: Vec<u8> = (0..row_bytes * rows).map(|i| (i * 31 % 251) as u8 & 0x3f).collect();
        let wrows: Vec<&[u8]> = w.chunks(row_bytes).collect();
        // Packed once, as a model's matrices are at load.
        let mut packed = vec![0u8; packed_matrix_bytes(ty, rows, k)];
        pack_matrix(ty, &w, rows, k, &mut packed);
        for n in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 64].into_iter().filter(|&n| keep(n)) {
            let mut out = vec![0f32; 16 * n];
            let reps = scale
                * if n == 1 {
                    (51200 / rows).max(2)
                } else {
                    (16384 / rows / n.min(16)).max(2)
                };
            let t = Instant::now();
            for _ in 0..reps {
                for g in 0..rows.div_ceil(16) {
                    PanelRef::of_matrix(ty, k, &packed, g).dot(&acts[..n], &auxs[..n], &mut out);
                }
            }
            let s = t.elapsed().as_secs_f64();
            let gbs = (w.len() * reps) as f64 / s / 1e9;
            let gmacs = (k * rows * reps * n) as f64 / s / 1e9;
            println!(
                "{:<12} {:<5} rows {n:2}: {gbs:6.2} GB/s weights, {gmacs:6.2} GMAC/s",
                "packed",
                ty.name()
            );
        }
        let mut panel = Panel::new();
        for n in [2usize, 4, 8, 64, 512]
            .into_iter()
            .filter(|&n| only.is_empty() && keep(n))
        {
            let mut out = vec![0f32; 16 * n];
            let reps = (4096 / rows).max(1) * 64 / n.min(64) * 64 / n.max(64);
            let t = Instant::now();
            for _ in 0..reps.max(1) {
                for task in wrows.chunks(16) {
                    panel.pack(ty, task);
                    panel.dot(&acts[..n], &auxs[..n], &mut out[..task.len() * n]);
                }
            }
            let s = t.elapsed().as_secs_f64();
            let gmacs = (k * rows * reps.max(1) * n) as f64 / s / 1e9;
            println!("{:<12} {:<5} rows {n:3}: {gmacs:6.2} GMAC/s", "panel/call", ty.name());
        }
    }
}
