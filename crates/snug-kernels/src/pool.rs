//! A persistent thread pool for data-parallel kernels.
//!
//! `run(n_tasks, f)` calls `f(task)` for every task in `0..n_tasks`. Each
//! thread owns an even, contiguous share of a job's tasks and takes them
//! one by one from a slot on a cache line of its own; a thread whose share
//! is done steals the back half of what is left of another's, so a thread
//! that starts late or runs slower (or is off its core) does not hold the
//! others up. Which thread runs a task never changes a result: tasks write
//! disjoint outputs and each output's arithmetic is fixed by the kernel.
//! Workers spin briefly between jobs, since a forward pass issues hundreds
//! of short jobs a token, then sleep on a condition variable.
//!
//! Why not one shared counter: with 16 threads a job of a few hundred
//! short tasks turned into as many compare-and-swaps on one cache line,
//! which every core then fetches in turn; a decode step of a small model
//! issues about 150 such jobs. Slots of their own keep a thread's claims on
//! its own line, and lines are crossed only to steal.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = *const (dyn Fn(usize, usize) + Sync);

/// A value on cache lines of its own (two: the adjacent-line prefetcher
/// fetches pairs).
#[repr(align(128))]
struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// What the caller of `run` publishes before bumping the generation.
struct Posted {
    job: UnsafeCell<Option<Job>>,
    n_tasks: AtomicUsize,
}

struct Shared {
    /// Bumped once per job, after `posted` is written.
    generation: Line<AtomicUsize>,
    posted: Line<Posted>,
    /// Each thread's share of the current job: [`slot`] packs the job's
    /// tag, the next task and the end.
    slots: Vec<Line<AtomicU64>>,
    /// The last generation each worker finished.
    done: Vec<Line<AtomicUsize>>,
    sleepers: Line<AtomicUsize>,
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

/// A slot: the generation's low 16 bits, then the next task and the end of
/// the share (24 bits each). Jobs of more tasks than 24 bits hold are run
/// in runs of tasks (see [`ThreadPool::run_with_thread`]).
const TASK_BITS: u32 = 24;
const TASK_MASK: u64 = (1 << TASK_BITS) - 1;

fn slot(tag: usize, next: usize, end: usize) -> u64 {
    ((tag as u64 & 0xFFFF) << (2 * TASK_BITS)) | ((next as u64) << TASK_BITS) | end as u64
}

fn unslot(v: u64) -> (usize, usize, usize) {
    (
        (v >> (2 * TASK_BITS)) as usize,
        ((v >> TASK_BITS) & TASK_MASK) as usize,
        (v & TASK_MASK) as usize,
    )
}

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
            generation: Line(AtomicUsize::new(0)),
            posted: Line(Posted {
                job: UnsafeCell::new(None),
                n_tasks: AtomicUsize::new(0),
            }),
            slots: (0..threads).map(|_| Line(AtomicU64::new(slot(0, 0, 0)))).collect(),
            done: (0..threads).map(|_| Line(AtomicUsize::new(0))).collect(),
            sleepers: Line(AtomicUsize::new(0)),
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
        if n_tasks > TASK_MASK as usize {
            // More tasks than a slot counts: runs of consecutive tasks.
            let per = n_tasks.div_ceil(TASK_MASK as usize);
            let runs = n_tasks.div_ceil(per);
            return self.run_with_thread(runs, &|r, t| {
                (r * per..((r + 1) * per).min(n_tasks)).for_each(|i| f(i, t));
            });
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: erase the lifetime; `f` outlives this call, and workers
        // stop using it before this call returns (see `Shared`).
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), Job>(f) };
        unsafe { *s.posted.job.get() = Some(job) };
        s.posted.n_tasks.store(n_tasks, Ordering::Relaxed);
        let gen = s.generation.fetch_add(1, Ordering::Release) + 1;
        if s.sleepers.load(Ordering::Acquire) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        run_share(s, gen, n_tasks, 0, &|task| f(task, 0));
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

/// Thread `t`'s even share of `n` tasks.
fn share(n: usize, threads: usize, t: usize) -> (usize, usize) {
    (n * t / threads, n * (t + 1) / threads)
}

/// Thread `t`'s slot as the job `gen` starts it, if it still holds an
/// earlier job's: its share, untouched. Returns the slot's value.
fn start_slot(s: &Shared, gen: usize, n: usize, t: usize) -> u64 {
    let cur = s.slots[t].load(Ordering::Relaxed);
    if unslot(cur).0 == gen & 0xFFFF {
        return cur;
    }
    let (a, b) = share(n, s.threads, t);
    let fresh = slot(gen, a, b);
    match s.slots[t].compare_exchange(cur, fresh, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => fresh,
        // Another thread started it (for this job) or took from it.
        Err(now) => now,
    }
}

/// Runs thread `t`'s tasks of job `gen`: its own share, one task at a
/// time from the front; then, while any is left, the back half of what is
/// left of another's share, moved into its own slot and taken the same
/// way (so a thread taken off its core mid-job holds up one task at most).
fn run_share(s: &Shared, gen: usize, n: usize, t: usize, f: &dyn Fn(usize)) {
    let mut cur = start_slot(s, gen, n, t);
    loop {
        let (tag, next, end) = unslot(cur);
        if next < end {
            match s.slots[t].compare_exchange_weak(cur, slot(tag, next + 1, end), Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    f(next);
                    cur = s.slots[t].load(Ordering::Relaxed);
                }
                Err(now) => cur = now,
            }
            continue;
        }
        match steal(s, gen, n, t) {
            // Only this thread writes its slot while it is empty: thieves
            // skip empty slots.
            Some(v) => {
                s.slots[t].store(v, Ordering::Relaxed);
                cur = v;
            }
            None => return,
        }
    }
}

/// Takes the back half of what is left of another thread's share, from
/// the thread after `t` on; the slot value for it, or `None` when every
/// share is empty.
fn steal(s: &Shared, gen: usize, n: usize, t: usize) -> Option<u64> {
    for k in 1..s.threads {
        let v = (t + k) % s.threads;
        let mut cur = start_slot(s, gen, n, v);
        loop {
            let (tag, next, end) = unslot(cur);
            if next >= end {
                break;
            }
            let take = (end - next).div_ceil(2);
            match s.slots[v].compare_exchange_weak(
                cur,
                slot(tag, next, end - take),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(slot(tag, end - take, end)),
                Err(now) => cur = now,
            }
        }
    }
    None
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
        let job = unsafe { *s.posted.job.get() };
        let n = s.posted.n_tasks.load(Ordering::Relaxed);
        if let Some(job) = job {
            let f = unsafe { &*job };
            run_share(s, gen, n, t, &|task| f(task, t));
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
    fn a_slot_packs_its_tag_and_range() {
        let max = TASK_MASK as usize;
        for (tag, next, end) in [(0, 0, 0), (7, 3, 9), (0xFFFF, max, max), (0x1_0002, 1, 2)] {
            assert_eq!(unslot(slot(tag, next, end)), (tag & 0xFFFF, next, end));
        }
        // Shares cover the tasks once, in order.
        for (n, threads) in [(1, 4), (7, 3), (100, 16), (64, 2)] {
            let mut at = 0;
            for t in 0..threads {
                let (a, b) = share(n, threads, t);
                assert_eq!(a, at);
                at = b;
            }
            assert_eq!(at, n);
        }
    }

    #[test]
    fn a_slow_share_is_taken_by_the_others() {
        // Task 0, the first of the caller's share, stops for a while: the
        // rest of that share runs on the workers meanwhile. (Tried a few
        // times: a caller taken off its core before its first task can
        // leave the whole share to one thief.)
        let pool = ThreadPool::new(4);
        let mut taken = false;
        for _ in 0..20 {
            let hits: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            let by: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(usize::MAX)).collect();
            pool.run_with_thread(64, &|i, t| {
                if i == 0 {
                    std::thread::sleep(Duration::from_millis(20));
                }
                hits[i].fetch_add(1, Ordering::Relaxed);
                by[i].store(t, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            let slow = by[0].load(Ordering::Relaxed);
            if (1..16).any(|i| by[i].load(Ordering::Relaxed) != slow) {
                taken = true;
                break;
            }
        }
        assert!(taken, "no task of the slow share was taken by another thread");
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
