//! Which pages of a sequence keep an exact twin.
//!
//! With a lossy KV format the storage keeps F16 *twins* of a few pages per
//! sequence, and a query at position `p` reads page 0 and its own page (the
//! one holding `p`) from them (see `snug_kernels::kv`). This module is the
//! bookkeeping: a pool of twin ids, and per sequence the twin of each page
//! index.
//!
//! - Before a forward, page 0 and every page a row of it writes get a twin.
//! - After it, page 0 and the newest [`KEEP`] pages keep their twins, so
//!   that rolling back up to `page_tokens` positions (a rejected
//!   speculative draft) still finds the twin its next row reads.
//! - A deeper truncation can leave the partly filled last page without its
//!   twin; [`Twins::truncate`] then says that the positions from that
//!   page's start must be recomputed. That is at most `page_tokens - 1`
//!   positions, and it reproduces the twin bit for bit: those rows read
//!   page 0 and their own page exactly, and every other page coded, as
//!   they did the first time.
//!
//! ```text
//! pages:  [0][1][2][3][4][5]     len in page 5
//! twins:  [t][ ][ ][ ][t][t]     page 0 + the newest two
//! query at a position in page 5 reads 0 and 5 from twins; 1..4 coded
//! ```

use crate::pages::PagesError;

/// Marks a page index without a twin.
pub const NO_TWIN: u32 = u32::MAX;

/// The exact window's rule: whether a query at position `end - 1` reads
/// page `index` of its sequence from the page's twin (page 0 and the
/// query's own page) rather than coded. Attention (`snug_kernels::kv`)
/// reads by it, and the twins kept here are the ones it needs.
#[inline]
pub fn reads_exact(index: usize, end: usize, page_tokens: usize) -> bool {
    index == 0 || index == (end - 1) / page_tokens
}

/// The newest pages of a sequence that keep their twins after a step.
pub const KEEP: usize = 2;

/// The free twin ids.
#[derive(Debug)]
pub struct TwinPool {
    total: usize,
    free: Vec<u32>,
}

impl TwinPool {
    pub fn new(n: usize) -> TwinPool {
        TwinPool {
            total: n,
            free: (0..n as u32).rev().collect(),
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    fn take(&mut self, needed: usize) -> Result<u32, PagesError> {
        self.free.pop().ok_or(PagesError::OutOfTwins {
            needed,
            free: 0,
            total: self.total,
        })
    }

    fn put(&mut self, t: u32) {
        debug_assert!(!self.free.contains(&t), "twin {t} returned twice");
        self.free.push(t);
    }
}

/// One sequence's twins, by page index.
#[derive(Clone, Debug, Default)]
pub struct Twins {
    of: Vec<u32>,
}

impl Twins {
    pub fn new() -> Twins {
        Twins::default()
    }

    /// The twin of each page index ([`NO_TWIN`] where none).
    pub fn as_slice(&self) -> &[u32] {
        &self.of
    }

    /// Page indices that hold a twin.
    pub fn count(&self) -> usize {
        self.of.iter().filter(|&&t| t != NO_TWIN).count()
    }

    /// Gives a twin to every page that rows at positions `lo..=hi` read
    /// exactly or write (page 0, and `page(lo) ..= page(hi)`). Returns
    /// the twins handed out for pages that already held positions before
    /// `lo` without one: the caller must fill them (cannot happen after
    /// [`Twins::settle`] and [`Twins::truncate`], which keep the pages a
    /// next row reads).
    pub fn prepare(
        &mut self,
        pool: &mut TwinPool,
        lo: usize,
        hi: usize,
        page_tokens: usize,
    ) -> Result<Vec<usize>, PagesError> {
        let (first, last) = (lo / page_tokens, hi / page_tokens);
        if self.of.len() <= last {
            self.of.resize(last + 1, NO_TWIN);
        }
        let wanted: Vec<usize> = std::iter::once(0)
            .chain(first.max(1)..=last)
            .filter(|&i| self.of[i] == NO_TWIN)
            .collect();
        if wanted.len() > pool.free() {
            return Err(PagesError::OutOfTwins {
                needed: wanted.len(),
                free: pool.free(),
                total: pool.total(),
            });
        }
        let mut stale = Vec::new();
        for &i in &wanted {
            self.of[i] = pool.take(wanted.len())?;
            if i * page_tokens < lo {
                stale.push(i);
            }
        }
        Ok(stale)
    }

    /// After a forward left the sequence `len` positions long: returns the
    /// twins of pages no later row reads, keeping page 0 and the newest
    /// [`KEEP`] pages (the newest for the next row, the one before for a
    /// rollback across a page boundary).
    pub fn settle(&mut self, pool: &mut TwinPool, len: usize, page_tokens: usize) {
        if len == 0 {
            return;
        }
        let newest = (len - 1) / page_tokens;
        for i in 1..self.of.len() {
            if i + KEEP <= newest && self.of[i] != NO_TWIN {
                pool.put(self.of[i]);
                self.of[i] = NO_TWIN;
            }
        }
    }

    /// Twins the rows at `lo..=hi` need that are not there yet.
    pub fn needed(&self, lo: usize, hi: usize, page_tokens: usize) -> usize {
        std::iter::once(0)
            .chain((lo / page_tokens).max(1)..=hi / page_tokens)
            .filter(|&i| self.of.get(i).is_none_or(|&t| t == NO_TWIN))
            .count()
    }

    /// After the sequence was truncated to `len` positions: returns the
    /// twins of pages beyond it, and, if the page the next row (at position
    /// `len`) writes already holds positions but has no twin, its index:
    /// the positions from its start to `len` must be recomputed.
    pub fn truncate(&mut self, pool: &mut TwinPool, len: usize, page_tokens: usize) -> Option<usize> {
        let keep = len.div_ceil(page_tokens);
        for t in self.of.drain(keep.min(self.of.len())..) {
            if t != NO_TWIN {
                pool.put(t);
            }
        }
        let own = len / page_tokens;
        (!len.is_multiple_of(page_tokens) && self.of.get(own).is_none_or(|&t| t == NO_TWIN)).then_some(own)
    }

    /// A copy for a forked sequence: new twins for the same pages, and the
    /// (from, to) twin copies the storage must make.
    pub fn fork(&self, pool: &mut TwinPool) -> Result<(Twins, Vec<(u32, u32)>), PagesError> {
        let n = self.count();
        if n > pool.free() {
            return Err(PagesError::OutOfTwins {
                needed: n,
                free: pool.free(),
                total: pool.total(),
            });
        }
        let mut copies = Vec::with_capacity(n);
        let of = self
            .of
            .iter()
            .map(|&t| {
                if t == NO_TWIN {
                    return NO_TWIN;
                }
                let new = pool.free.pop().expect("counted above");
                copies.push((t, new));
                new
            })
            .collect();
        Ok((Twins { of }, copies))
    }

    /// A sequence's twins as they were saved: a twin for each page index
    /// in `indices` (a restored session's page 0 and newest pages), taken
    /// from `pool`; returns them in the order of `indices`.
    pub fn restore(pool: &mut TwinPool, indices: &[usize]) -> Result<(Twins, Vec<u32>), PagesError> {
        if indices.len() > pool.free() {
            return Err(PagesError::OutOfTwins {
                needed: indices.len(),
                free: pool.free(),
                total: pool.total(),
            });
        }
        let mut t = Twins::new();
        let mut given = Vec::with_capacity(indices.len());
        for &i in indices {
            if t.of.len() <= i {
                t.of.resize(i + 1, NO_TWIN);
            }
            if t.of[i] == NO_TWIN {
                t.of[i] = pool.free.pop().expect("counted above");
            }
            given.push(t.of[i]);
        }
        Ok((t, given))
    }

    /// Returns every twin.
    pub fn release(&mut self, pool: &mut TwinPool) {
        for t in self.of.drain(..) {
            if t != NO_TWIN {
                pool.put(t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PT: usize = 16;

    fn twinned(t: &Twins) -> Vec<usize> {
        (0..t.as_slice().len())
            .filter(|&i| t.as_slice()[i] != NO_TWIN)
            .collect()
    }

    #[test]
    fn restored_twins_sit_at_the_saved_pages() {
        let mut pool = TwinPool::new(4);
        let (mut t, given) = Twins::restore(&mut pool, &[0, 5, 6]).unwrap();
        assert_eq!(twinned(&t), vec![0, 5, 6]);
        assert_eq!(given, [0, 5, 6].map(|i| t.as_slice()[i]));
        assert_eq!(pool.free(), 1);
        assert!(matches!(
            Twins::restore(&mut pool, &[0, 1]),
            Err(PagesError::OutOfTwins { needed: 2, free: 1, .. })
        ));
        // The next row at 100 (page 6) needs nothing more.
        assert_eq!(t.needed(100, 100, PT), 0);
        t.release(&mut pool);
        assert_eq!(pool.free(), 4);
    }

    #[test]
    fn a_prefill_then_decode_keeps_page_zero_and_the_newest_pages() {
        let mut pool = TwinPool::new(16);
        let mut t = Twins::new();
        // Prefill of 100 positions: pages 0..=6, all twinned for the pass.
        assert_eq!(t.needed(0, 99, PT), 7);
        assert!(t.prepare(&mut pool, 0, 99, PT).unwrap().is_empty());
        assert_eq!(twinned(&t), (0..=6).collect::<Vec<_>>());
        t.settle(&mut pool, 100, PT);
        assert_eq!(twinned(&t), vec![0, 5, 6]);
        // Decode into page 7 and beyond.
        for pos in 100..140 {
            assert!(t.needed(pos, pos, PT) <= 1);
            assert!(t.prepare(&mut pool, pos, pos, PT).unwrap().is_empty());
            t.settle(&mut pool, pos + 1, PT);
        }
        assert_eq!(twinned(&t), vec![0, 7, 8]);
        assert_eq!(pool.free(), 16 - 3);
        t.release(&mut pool);
        assert_eq!(pool.free(), 16);
    }

    #[test]
    fn rolling_back_a_draft_keeps_what_the_next_row_reads() {
        let mut pool = TwinPool::new(16);
        let mut t = Twins::new();
        t.prepare(&mut pool, 0, 62, PT).unwrap();
        t.settle(&mut pool, 63, PT);
        // Verify 9 rows across a page boundary, then reject all of them.
        t.prepare(&mut pool, 63, 71, PT).unwrap();
        t.settle(&mut pool, 72, PT);
        assert_eq!(t.truncate(&mut pool, 63, PT), None);
        // The next row at 63 (page 3) reads pages 0 and 3.
        assert!(t.prepare(&mut pool, 63, 63, PT).unwrap().is_empty());
        assert_eq!(twinned(&t), vec![0, 3]);
    }

    #[test]
    fn a_deep_truncation_asks_for_a_recompute_of_the_partial_page() {
        let mut pool = TwinPool::new(16);
        let mut t = Twins::new();
        t.prepare(&mut pool, 0, 159, PT).unwrap();
        t.settle(&mut pool, 160, PT);
        assert_eq!(twinned(&t), vec![0, 8, 9]);
        // Back to 40 (page 2, partly filled, without a twin).
        assert_eq!(t.truncate(&mut pool, 40, PT), Some(2));
        assert_eq!(pool.free(), 16 - 1);
        // Back to a page boundary: the next row starts a new page.
        let mut u = Twins::new();
        u.prepare(&mut pool, 0, 40, PT).unwrap();
        assert_eq!(u.truncate(&mut pool, 32, PT), None);
        assert_eq!(twinned(&u), vec![0, 1]);
    }

    #[test]
    fn forks_get_their_own_copies_and_an_empty_pool_is_an_error() {
        let mut pool = TwinPool::new(6);
        let mut t = Twins::new();
        t.prepare(&mut pool, 0, 20, PT).unwrap();
        let (f, copies) = t.fork(&mut pool).unwrap();
        assert_eq!(copies.len(), 2);
        assert_eq!(twinned(&f), twinned(&t));
        assert!(f.as_slice().iter().zip(t.as_slice()).all(|(a, b)| a != b));
        let mut g = Twins::new();
        assert!(matches!(
            g.prepare(&mut pool, 0, 100, PT),
            Err(PagesError::OutOfTwins { needed: 7, free: 2, .. })
        ));
    }
}
