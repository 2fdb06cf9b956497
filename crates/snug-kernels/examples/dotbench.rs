//! Single-thread throughput of the dot kernels: GB/s of weights read for one
//! activation row (decode) and for four (prefill tile), per type and path.
//! `cargo run --release -p snug-kernels --example dotbench`

use std::time::Instant;

use snug_kernels::cpu::Simd;
use snug_kernels::dot::{act_format, dot_rows_with, quantize_row, BlockQ8};
use snug_kernels::GgmlType;

fn main() {
    let k = 4096;
    let rows = 512;
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
    ];
    let x: Vec<f32> = (0..k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    for level in Simd::available() {
        for ty in types {
            let mut q = vec![BlockQ8::default(); k / 32];
            quantize_row(act_format(ty), &x, &mut q);
            let acts: Vec<&[BlockQ8]> = vec![&q; 4];
            let row_bytes = ty.bytes_for(k as u64).unwrap() as usize;
            let w: Vec<u8> = (0..row_bytes * rows).map(|i| (i * 31 % 251) as u8 & 0x3f).collect();
            for n in [1usize, 4] {
                let mut out = vec![0f32; n];
                let reps = 20;
                let t = Instant::now();
                for _ in 0..reps {
                    for r in 0..rows {
                        dot_rows_with(level, ty, &w[r * row_bytes..(r + 1) * row_bytes], &acts[..n], &mut out);
                    }
                }
                let s = t.elapsed().as_secs_f64();
                let gbs = (w.len() * reps) as f64 / s / 1e9;
                let gmacs = (k * rows * reps * n) as f64 / s / 1e9;
                println!(
                    "{:<12} {:<5} rows {n}: {gbs:6.2} GB/s weights, {gmacs:6.2} GMAC/s",
                    level.name(),
                    ty.name()
                );
            }
        }
    }
}
