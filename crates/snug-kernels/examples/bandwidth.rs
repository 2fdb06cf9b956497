//! Memory read bandwidth with N threads (default 2): each thread sums its
//! share of a 1 GiB buffer, repeated; prints the median GB/s of 5 runs for
//! a plain loop and, where the CPU has AVX-512, for 512-bit loads into
//! eight independent sums (more reads in flight), and the best of them.
//! `cargo run --release -p snug-kernels --example bandwidth -- [threads]`
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use std::time::Instant;

fn sum_plain(c: &[u64]) -> u64 {
    c.iter().fold(0u64, |a, &x| a.wrapping_add(x))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_wide(c: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 8];
    let chunks = c.len() / 64;
    let p = c.as_ptr() as *const __m512i;
    for i in 0..chunks {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm512_add_epi64(*a, _mm512_loadu_si512(p.add(8 * i + k)));
        }
    }
    let mut total = 0u64;
    for a in acc {
        total = total.wrapping_add(_mm512_reduce_add_epi64(a) as u64);
    }
    total.wrapping_add(sum_plain(&c[chunks * 64..]))
}

fn measure(buf: &[u64], threads: usize, f: fn(&[u64]) -> u64) -> (f64, Vec<f64>) {
    let mut rates = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(buf.len().div_ceil(threads))
                .map(|c| s.spawn(move || f(c)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).fold(0, u64::wrapping_add)
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(total);
        rates.push(std::mem::size_of_val(buf) as f64 / secs / 1e9);
    }
    rates.sort_by(f64::total_cmp);
    (rates[2], rates)
}

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    let words = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    type Sum = fn(&[u64]) -> u64;
    let mut kinds: Vec<(&str, Sum)> = vec![("plain loop", sum_plain)];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was detected above.
        kinds.push(("512-bit loads, 8 sums", |c| unsafe { sum_wide(c) }));
    }
    let mut best = 0f64;
    for (name, f) in kinds {
        let (median, rates) = measure(&buf, threads, f);
        best = best.max(median);
        println!(
            "read bandwidth, {threads} threads, {name}: {median:.1} GB/s (median of 5; runs {:?})",
            rates.iter().map(|r| (r * 10.0).round() / 10.0).collect::<Vec<_>>()
        );
    }
    println!("read bandwidth, {threads} threads: {best:.1} GB/s (best median)");
}
