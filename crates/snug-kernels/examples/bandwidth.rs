//! Memory read bandwidth with N threads (default 2): each thread sums its
//! half of a 1 GiB buffer, repeated; prints the median GB/s of 5 runs.
//! `cargo run --release -p snug-kernels --example bandwidth -- [threads]`

use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    let words = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut rates = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(words.div_ceil(threads))
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).fold(0, u64::wrapping_add)
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(total);
        rates.push((words * 8) as f64 / secs / 1e9);
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "read bandwidth, {threads} threads: {:.1} GB/s (median of 5; runs {:?})",
        rates[2],
        rates.iter().map(|r| (r * 10.0).round() / 10.0).collect::<Vec<_>>()
    );
}
