//! A persistent thread pool for data-parallel kernels.
//!
//! `run(n_tasks, f)` calls `f(task)` for every task in `0..n_tasks`. Threads
//! claim contiguous runs of tasks from a shared counter, large runs first
//! and smaller ones as the job drains (guided self-scheduling), so a thread
//! that starts late or runs slower does not hold the others up. Which
//! thread runs a task never changes a result: tasks write disjoint outputs
//! and each output's arithmetic is fixed by the kernel. Workers spin
//! briefly between jobs, since a forward pass issues hundreds of short jobs
//! a token, then sleep on a condition variable.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = *const (dyn Fn(usize, usize) + Sync);

struct Shared {
    /// Bumped once per job, after `job` and `n_tasks` are written.
    generation: AtomicUsize,
    job: UnsafeCell<Option<Job>>,
    n_tasks: AtomicUsize,
    /// The next unclaimed task of the current job.
    next: AtomicUsize,
    /// The last generation each worker finished.
    done: Vec<AtomicUsize>,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
    threads: usize,
}

// SAFETY: `job` is written only by the thread inside `run`, before the
// generation is published, and read by workers only after they observe that
// generation; `run` does not return until every worker has finished it.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A fixed set of worker threads.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises `run` calls made from several threads.
    run_lock: Mutex<()>,
}

/// How long an idle worker spins before sleeping.
const SPIN: Duration = Duration::from_millis(5);

/// Checks the caller of `run` spins on its workers before it yields its
/// core at each further check (tens of microseconds: longer than a worker
/// running on its own core takes to finish its last task). A yield with
/// nothing else to run returns at once, so on an idle machine the wait
/// ends as soon as spinning would end it.
const YIELD_AFTER: u32 = 256;

impl ThreadPool {
    /// A pool of `threads` threads in all (the caller counts as one).
    pub fn new(threads: usize) -> ThreadPool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            done: (0..threads).map(|_| AtomicUsize::new(0)).collect(),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            threads,
        });
        let workers = (1..threads)
            .map(|t| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("snug-worker-{t}"))
                    .spawn(move || worker(&s, t))
                    .expect("spawn worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            run_lock: Mutex::new(()),
        }
    }

    pub fn threads(&self) -> usize {
        self.shared.threads
    }

    /// Calls `f(task)` for each task in `0..n_tasks` across the pool and
    /// returns when all have run.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        self.run_with_thread(n_tasks, &|task, _| f(task));
    }

    /// Like [`ThreadPool::run`], also passing the index (`0..threads()`) of
    /// the thread running each task, for per-thread scratch.
    pub fn run_with_thread(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let s = &*self.shared;
        if s.threads == 1 || n_tasks <= 1 {
            (0..n_tasks).for_each(|t| f(t, 0));
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: erase the lifetime; `f` outlives this call, and workers
        // stop using it before this call returns (see `Shared`).
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), Job>(f) };
        unsafe { *s.job.get() = Some(job) };
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        let gen = s.generation.fetch_add(1, Ordering::Release) + 1;
        if s.sleepers.load(Ordering::Acquire) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        while let Some(tasks) = claim(s, n_tasks) {
            for task in tasks {
                f(task, 0);
            }
        }
        // Wait for every worker to finish the job. A worker may be off its
        // core (another process took it) and hold claimed tasks, or not
        // have seen the job yet: after a short spin, give the core away
        // at each check, so the thread waited for can run on it.
        let mut spins = 0u32;
        for t in 1..s.threads {
            while s.done[t].load(Ordering::Acquire) != gen {
                if spins < YIELD_AFTER {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

/// Claims the next run of tasks of the current job: a share of what is left
/// (half of an even split), at least one task.
fn claim(s: &Shared, n: usize) -> Option<std::ops::Range<usize>> {
    let mut cur = s.next.load(Ordering::Relaxed);
    loop {
        if cur >= n {
            return None;
        }
        let take = ((n - cur) / (2 * s.threads)).max(1);
        match s
            .next
            .compare_exchange_weak(cur, cur + take, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => return Some(cur..cur + take),
            Err(now) => cur = now,
        }
    }
}

fn worker(s: &Shared, t: usize) {
    let mut seen = 0usize;
    loop {
        // Wait for a new generation: spin, then sleep.
        let started = Instant::now();
        let mut spins = 0u32;
        let gen = loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                break g;
            }
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            spins = spins.wrapping_add(1);
            // Reading the clock is not free: look at it now and then, and
            // then also let any other thread waiting for this core run.
            if !spins.is_multiple_of(4096) {
                std::hint::spin_loop();
                continue;
            }
            if started.elapsed() < SPIN {
                std::thread::yield_now();
                continue;
            }
            let guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::AcqRel);
            let g = s.generation.load(Ordering::Acquire);
            if g == seen && !s.stop.load(Ordering::Acquire) {
                let _unused = s.wake.wait_timeout(guard, Duration::from_millis(100));
            }
            s.sleepers.fetch_sub(1, Ordering::AcqRel);
        };
        seen = gen;
        // SAFETY: published before `generation` (Release/Acquire).
        let job = unsafe { *s.job.get() };
        let n = s.n_tasks.load(Ordering::Relaxed);
        if let Some(job) = job {
            let f = unsafe { &*job };
            while let Some(tasks) = claim(s, n) {
                for task in tasks {
                    f(task, t);
                }
            }
        }
        s.done[t].store(gen, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The number of physical cores, the default thread count.
pub fn physical_cores() -> usize {
    // Count distinct (package, core) pairs where Linux exposes them.
    let mut cores = std::collections::HashSet::new();
    if let Ok(entries) = std::fs::read_dir("/sys/devices/system/cpu") {
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if !name.starts_with("cpu") || !name[3..].chars().all(|c| c.is_ascii_digit()) || name.len() == 3 {
                continue;
            }
            let topo = e.path().join("topology");
            let core = std::fs::read_to_string(topo.join("core_id")).ok();
            let pkg = std::fs::read_to_string(topo.join("physical_package_id")).ok();
            if let (Some(c), Some(p)) = (core, pkg) {
                cores.insert((p.trim().to_string(), c.trim().to_string()));
            }
        }
    }
    if cores.is_empty() {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        cores.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        let pool = ThreadPool::new(3);
        for n in [0, 1, 2, 5, 100] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n = {n}");
        }
    }

    #[test]
    fn many_short_jobs_and_sleeping_workers() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for round in 0..2000 {
            pool.run(4, &|i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
            if round == 1000 {
                std::thread::sleep(Duration::from_millis(20)); // workers go to sleep
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 6);
    }

    #[test]
    fn more_threads_than_cores_and_a_busy_thread_beside_them() {
        // Workers that cannot all be on a core at once (and a thread
        // spinning beside them) still run every task of every job once:
        // the caller waits by yielding, not only by spinning.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let stop = Arc::new(AtomicBool::new(false));
        let busy = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        let pool = ThreadPool::new(4 * cores);
        let total = AtomicUsize::new(0);
        for _ in 0..300 {
            pool.run(64, &|i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
        }
        stop.store(true, Ordering::Relaxed);
        busy.join().unwrap();
        assert_eq!(total.load(Ordering::Relaxed), 300 * (63 * 64 / 2));
    }
}

/// A raw pointer that tasks on the pool may share: each task writes only
/// the elements it was given (disjoint ranges of one output), which the
/// code that makes the tasks states where it builds the slices.
#[derive(Clone, Copy)]
pub struct SendPtr<T>(pub *mut T);

// SAFETY: the pointer is only turned into slices over ranges no other task
// touches while the pool runs (see above).
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}
