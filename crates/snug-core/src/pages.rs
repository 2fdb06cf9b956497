//! A pool of fixed-size KV pages under a budget, and per-sequence page
//! tables over it.
//!
//! A page holds `page_tokens` consecutive positions of one sequence (for
//! every layer). A page table lists a sequence's pages in position order.
//! Pages are reference-counted so that a fork shares them: full pages are
//! never written again and stay shared; the one page a table is still
//! writing into is copied first if another table shares it (copy-on-write).
//! Rolling back (speculation rejects, chat edits) is a truncate of the
//! table, releasing whole pages beyond the new length.
//!
//! ```text
//! table A: [p0][p1][p2 .. ]      len 2.5 pages
//! fork B : [p0][p1][p2 .. ]      p0..p2 refcount 2
//! B.append: p2 shared and partial -> copy p2 to p3, B = [p0][p1][p3 .. ]
//! ```

/// Index of a page in the pool.
pub type PageId = u32;

/// Why a page operation was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PagesError {
    #[error("KV cache full: {needed} more pages needed, {free} free of {total}")]
    OutOfPages { needed: usize, free: usize, total: usize },
    #[error("KV exact window full: {needed} more twin pages needed, {free} free of {total}")]
    OutOfTwins { needed: usize, free: usize, total: usize },
}

/// The pool: reference counts and a free list.
#[derive(Debug)]
pub struct PagePool {
    page_tokens: usize,
    refcount: Vec<u32>,
    free: Vec<PageId>,
}

impl PagePool {
    /// `n_pages` pages of `page_tokens` positions each.
    pub fn new(n_pages: usize, page_tokens: usize) -> PagePool {
        assert!(page_tokens > 0, "pages hold at least one position");
        PagePool {
            page_tokens,
            refcount: vec![0; n_pages],
            // Pop from the end: page 0 is handed out first.
            free: (0..n_pages as PageId).rev().collect(),
        }
    }

    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }

    pub fn total_pages(&self) -> usize {
        self.refcount.len()
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    pub fn used_pages(&self) -> usize {
        self.total_pages() - self.free_pages()
    }

    pub fn refcount(&self, p: PageId) -> u32 {
        self.refcount[p as usize]
    }

    /// Takes a free page (reference count 1), if any.
    pub fn alloc(&mut self) -> Option<PageId> {
        let p = self.free.pop()?;
        self.refcount[p as usize] = 1;
        Some(p)
    }

    /// Takes one more reference on page `p` (a cache or a table sharing it).
    pub fn retain(&mut self, p: PageId) {
        self.refcount[p as usize] += 1;
    }

    /// Drops one reference on page `p`; the last one frees it.
    pub fn release(&mut self, p: PageId) {
        let rc = &mut self.refcount[p as usize];
        debug_assert!(*rc > 0, "release of a free page");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(p);
        }
    }
}

/// A copy the storage must perform before writing: page `from` to `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    pub from: PageId,
    pub to: PageId,
}

/// One sequence's pages, in position order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PageTable {
    pages: Vec<PageId>,
    len: usize,
}

impl PageTable {
    pub fn new() -> PageTable {
        PageTable::default()
    }

    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// The page and slot holding position `pos`.
    pub fn slot(&self, pos: usize, page_tokens: usize) -> (PageId, usize) {
        (self.pages[pos / page_tokens], pos % page_tokens)
    }

    /// Pages that appending `n` positions would take from the pool
    /// (new pages plus a copy of a shared page being written into).
    pub fn pages_needed(&self, pool: &PagePool, n: usize) -> usize {
        let pt = pool.page_tokens;
        let have = self.pages.len();
        let want = (self.len + n).div_ceil(pt);
        let cow = usize::from(n > 0 && !self.len.is_multiple_of(pt) && pool.refcount(self.pages[self.len / pt]) > 1);
        want.saturating_sub(have) + cow
    }

    /// Whether `n` more positions fit.
    pub fn can_append(&self, pool: &PagePool, n: usize) -> bool {
        self.pages_needed(pool, n) <= pool.free_pages()
    }

    /// Makes room for `n` more positions and counts them as stored. Returns
    /// the copies the storage must make first (at most one). On error
    /// nothing changes.
    pub fn append(&mut self, pool: &mut PagePool, n: usize) -> Result<Option<PageCopy>, PagesError> {
        let needed = self.pages_needed(pool, n);
        if needed > pool.free_pages() {
            return Err(PagesError::OutOfPages {
                needed,
                free: pool.free_pages(),
                total: pool.total_pages(),
            });
        }
        let pt = pool.page_tokens;
        let mut copy = None;
        if n > 0 && !self.len.is_multiple_of(pt) {
            let i = self.len / pt;
            let shared = self.pages[i];
            if pool.refcount(shared) > 1 {
                let fresh = pool.alloc().expect("counted in pages_needed");
                pool.release(shared);
                self.pages[i] = fresh;
                copy = Some(PageCopy {
                    from: shared,
                    to: fresh,
                });
            }
        }
        let want = (self.len + n).div_ceil(pt);
        while self.pages.len() < want {
            self.pages.push(pool.alloc().expect("counted in pages_needed"));
        }
        self.len += n;
        Ok(copy)
    }

    /// Drops positions from `new_len` on (no-op if already shorter).
    pub fn truncate(&mut self, pool: &mut PagePool, new_len: usize) {
        if new_len >= self.len {
            return;
        }
        let keep = new_len.div_ceil(pool.page_tokens);
        for p in self.pages.drain(keep..) {
            pool.release(p);
        }
        self.len = new_len;
    }

    /// Appends a whole page of positions that is already written (shared
    /// from a cache; retained for this table by the caller). The table
    /// must end on a page boundary.
    pub fn push_full(&mut self, page: PageId, page_tokens: usize) {
        assert!(
            self.len.is_multiple_of(page_tokens),
            "a full page goes after a full page"
        );
        self.pages.push(page);
        self.len += page_tokens;
    }

    /// A new table sharing every page of this one.
    pub fn fork(&self, pool: &mut PagePool) -> PageTable {
        for &p in &self.pages {
            pool.retain(p);
        }
        self.clone()
    }

    /// Returns every page to the pool.
    pub fn release(&mut self, pool: &mut PagePool) {
        self.truncate(pool, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_truncate_and_budget() {
        let mut pool = PagePool::new(4, 16);
        let mut t = PageTable::new();
        assert_eq!(t.append(&mut pool, 20), Ok(None));
        assert_eq!((t.len(), t.pages().len(), pool.free_pages()), (20, 2, 2));
        assert_eq!(t.slot(17, 16), (t.pages()[1], 1));
        assert!(t.can_append(&pool, 44));
        assert!(!t.can_append(&pool, 45));
        assert_eq!(
            t.append(&mut pool, 45),
            Err(PagesError::OutOfPages {
                needed: 3,
                free: 2,
                total: 4
            })
        );
        assert_eq!(t.len(), 20, "a refused append changes nothing");
        t.truncate(&mut pool, 16);
        assert_eq!((t.len(), t.pages().len(), pool.free_pages()), (16, 1, 3));
        t.truncate(&mut pool, 3);
        assert_eq!(t.pages().len(), 1);
        t.release(&mut pool);
        assert_eq!(pool.free_pages(), 4);
    }

    #[test]
    fn fork_shares_and_copies_on_write() {
        let mut pool = PagePool::new(8, 4);
        let mut a = PageTable::new();
        a.append(&mut pool, 6).unwrap();
        let mut b = a.fork(&mut pool);
        assert_eq!(pool.used_pages(), 2);
        assert_eq!(pool.refcount(a.pages()[0]), 2);
        // b writes into the shared, partial second page: copied first.
        assert_eq!(b.pages_needed(&pool, 1), 1);
        let copy = b.append(&mut pool, 1).unwrap().expect("copy-on-write");
        assert_eq!(copy.from, a.pages()[1]);
        assert_eq!(b.pages()[1], copy.to);
        assert_eq!(b.pages()[0], a.pages()[0], "full pages stay shared");
        // a now owns its page alone: no copy.
        assert_eq!(a.append(&mut pool, 1).unwrap(), None);
        a.release(&mut pool);
        b.release(&mut pool);
        assert_eq!(pool.free_pages(), 8);
    }

    #[test]
    fn fork_at_a_page_boundary_needs_no_copy() {
        let mut pool = PagePool::new(4, 4);
        let mut a = PageTable::new();
        a.append(&mut pool, 4).unwrap();
        let mut b = a.fork(&mut pool);
        assert_eq!(b.append(&mut pool, 2).unwrap(), None);
        assert_eq!(pool.used_pages(), 2);
    }
}
