//! A global allocator that counts live and peak heap bytes, for the memory
//! ledger. It forwards every call to the system allocator; the counts are
//! two relaxed atomic updates per allocation.
//!
//! Each allocation is counted at its footprint in a glibc-style allocator,
//! not its requested size: small blocks carry an 8-byte header and round up
//! to 16 bytes with a 32-byte minimum, and blocks from 128 KiB up are mapped
//! on their own, rounded to whole pages. A 262,144-token vocabulary is made
//! of hundreds of thousands of small strings, so the difference is several
//! megabytes.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counted. Install it in a binary with
/// `#[global_allocator] static A: CountingAlloc = CountingAlloc::new();`.
pub struct CountingAlloc {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl CountingAlloc {
    pub const fn new() -> CountingAlloc {
        CountingAlloc {
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }

    /// Bytes allocated and not yet freed.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// The most bytes live at once so far.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    fn added(&self, n: usize) {
        let n = footprint(n);
        let now = self.live.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn removed(&self, n: usize) {
        let n = footprint(n);
        self.live.fetch_sub(n, Ordering::Relaxed);
    }
}

/// Bytes an allocation of `size` takes from the system (see the module
/// notes).
pub fn footprint(size: usize) -> usize {
    const MMAP_THRESHOLD: usize = 128 * 1024;
    if size >= MMAP_THRESHOLD {
        (size + 16).next_multiple_of(4096)
    } else {
        ((size + 8 + 15) & !15).max(32)
    }
}

impl Default for CountingAlloc {
    fn default() -> Self {
        CountingAlloc::new()
    }
}

// SAFETY: every call is forwarded unchanged to `System`; the counters do not
// touch the memory.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            self.added(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            self.added(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        self.removed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            self.removed(layout.size());
            self.added(new_size);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_live_and_peak() {
        let a = CountingAlloc::new();
        unsafe {
            let l1 = Layout::from_size_align(1000, 8).unwrap();
            let p1 = a.alloc(l1);
            let l2 = Layout::from_size_align(500, 8).unwrap();
            let p2 = a.alloc_zeroed(l2);
            assert_eq!(a.live(), footprint(1000) + footprint(500));
            a.dealloc(p1, l1);
            assert_eq!(a.live(), footprint(500));
            let p2 = a.realloc(p2, l2, 300_000);
            assert_eq!(a.live(), footprint(300_000));
            assert_eq!(a.peak(), footprint(300_000));
            a.dealloc(p2, Layout::from_size_align(300_000, 8).unwrap());
            assert_eq!(a.live(), 0);
            assert_eq!(a.peak(), footprint(300_000));
        }
        assert_eq!(footprint(1), 32);
        assert_eq!(footprint(24), 32);
        assert_eq!(footprint(25), 48);
        assert_eq!(footprint(200_000), 200_704);
    }

    #[test]
    fn small_blocks_round_trip() {
        let a = CountingAlloc::new();
        unsafe {
            let l = Layout::from_size_align(8, 8).unwrap();
            let p = a.alloc(l);
            a.dealloc(p, l);
            assert_eq!(a.live(), 0);
        }
    }
}
