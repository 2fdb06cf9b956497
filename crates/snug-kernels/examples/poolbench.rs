//! What one job of the thread pool costs beyond its tasks: many jobs of
//! `TASKS` short tasks (each a few hundred nanoseconds of arithmetic) on
//! `THREADS` threads, median microseconds per job over rounds. The
//! forward pass issues about 150 such jobs per decode step of a small
//! model, so at many threads this cost is a share of the step.
//!
//!     poolbench THREADS [TASKS] [WORK]
use snug_kernels::pool::ThreadPool;
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let threads = args.first().copied().unwrap_or(2);
    let tasks = args.get(1).copied().unwrap_or(8 * threads);
    let work = args.get(2).copied().unwrap_or(200);
    let pool = ThreadPool::new(threads);
    let sink: Vec<std::sync::atomic::AtomicU64> = (0..tasks).map(|_| 0.into()).collect();
    let job = |i: usize| {
        let mut x = i as u64 | 1;
        for _ in 0..work {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
        sink[i].store(black_box(x), std::sync::atomic::Ordering::Relaxed);
    };
    // The tasks alone, on one thread, for the baseline.
    let t = Instant::now();
    for _ in 0..200 {
        (0..tasks).for_each(job);
    }
    let serial = t.elapsed().as_secs_f64() * 1e6 / 200.0;
    let mut per_job = Vec::new();
    for _ in 0..15 {
        let jobs = 2000;
        let t = Instant::now();
        for _ in 0..jobs {
            pool.run(tasks, &job);
        }
        per_job.push(t.elapsed().as_secs_f64() * 1e6 / jobs as f64);
    }
    per_job.sort_by(|a, b| a.total_cmp(b));
    println!(
        "threads {threads}, tasks {tasks}, work {work}: {:.2} us a job (median of 15; the tasks on one thread: {:.2} us, over threads: {:.2} us)",
        per_job[7],
        serial,
        serial / threads as f64
    );
}
