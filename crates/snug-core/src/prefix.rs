//! The prefix cache's bookkeeping: which pool pages hold the KV of which
//! token prefixes, so a new sequence starting with the same tokens shares
//! them instead of prefilling.
//!
//! A full page is keyed by a hash chain: the SHA-256 of its parent's key
//! and its own tokens, so a key names the whole prefix up to the page's
//! end (a page's KV depends on every token before it). A cryptographic
//! hash makes a collision, which would hand one prompt another's KV,
//! impractical to produce on purpose.
//!
//! The cache holds one reference on each page it knows. A page that no
//! sequence uses any more stays cached until the pool needs it; then the
//! least recently used such pages are evicted (a sequence's pages are
//! touched from its last to its first, so a chain's tail goes before its
//! head, which keeps what remains reachable). All of this lives inside the
//! pool, so inside the KV budget.
//!
//! ```text
//! key(page i) = sha256(key(page i-1) || tokens of page i)    key(-1) = 0
//! seq A: [p3 k0][p7 k1][p2 k2][p5 ..]   cache: k0->p3 k1->p7 k2->p2
//! seq B with the same first 96 tokens: table [p3][p7][p2] shared, then its own
//! ```
//!
//! When asked ([`PrefixCache::record_events`]), the cache also keeps a log
//! of what entered and left it, for a listener outside the process (a
//! router that sends each request where its prefix is cached). The keys
//! depend on the tokens alone, so two processes serving one model name the
//! same prefix alike.

use std::collections::{BTreeSet, HashMap};

use sha2::{Digest as _, Sha256};

use crate::pages::{PageId, PagePool};

/// A page's key: the hash of its tokens and every token before them.
pub type Key = [u8; 32];

/// The key before the first page.
pub const ROOT: Key = [0; 32];

/// The key of a page of `tokens` following the page keyed `parent`.
pub fn chain(parent: &Key, tokens: &[u32]) -> Key {
    let mut h = Sha256::new();
    h.update(parent);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The keys of the full pages of `tokens`, at most `max` of them.
pub fn keys(tokens: &[u32], page_tokens: usize, max: usize) -> Vec<Key> {
    let mut out = Vec::new();
    let mut k = ROOT;
    for page in tokens.chunks_exact(page_tokens).take(max) {
        k = chain(&k, page);
        out.push(k);
    }
    out
}

/// What the cache did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefixStats {
    /// Sequences that asked.
    pub lookups: u64,
    /// Of them, those that found at least one page.
    pub hits: u64,
    /// Positions shared instead of prefilled.
    pub reused_tokens: u64,
    /// Pages found on disk and read in.
    pub disk_hits: u64,
    /// Pages written to disk.
    pub disk_writes: u64,
    /// Pages given back to the pool.
    pub evictions: u64,
    /// Disk tier writes that failed (the page stays in RAM only).
    pub disk_errors: u64,
    /// Pages cached now.
    pub pages: u64,
}

/// A change to the set of cached pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// Pages of one chain entered the cache: `keys[0]` follows `parent`
    /// (`None`: the prompt's first page), each later key the one before,
    /// and `tokens` holds their tokens, a page's worth per key.
    Stored {
        parent: Option<Key>,
        keys: Vec<Key>,
        tokens: Vec<u32>,
    },
    /// Pages left the cache.
    Removed { keys: Vec<Key> },
    /// Every page left the cache.
    Cleared,
}

struct Entry {
    page: PageId,
    used: u64,
}

/// The RAM tier: keys to pool pages, with least-recently-used order.
#[derive(Default)]
pub struct PrefixCache {
    map: HashMap<Key, Entry>,
    /// (last use, key), oldest first.
    order: BTreeSet<(u64, Key)>,
    tick: u64,
    pub stats: PrefixStats,
    /// What changed since the log was last taken, when recording.
    events: Option<Vec<CacheEvent>>,
}

impl PrefixCache {
    pub fn new() -> PrefixCache {
        PrefixCache::default()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The page cached for `key`, marked used.
    pub fn get(&mut self, key: &Key) -> Option<PageId> {
        let e = self.map.get_mut(key)?;
        self.order.remove(&(e.used, *key));
        self.tick += 1;
        e.used = self.tick;
        self.order.insert((e.used, *key));
        Some(e.page)
    }

    /// Starts keeping the log of [`CacheEvent`]s (empty now).
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events since the last call, oldest first (none when not
    /// recording).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// [`PrefixCache::insert`] for a page of `tokens` whose prefix before
    /// them is keyed `parent`, logging the page when recording. A page
    /// following the one the last event stored joins that event.
    pub fn insert_page(&mut self, pool: &mut PagePool, parent: &Key, key: Key, tokens: &[u32], page: PageId) -> bool {
        if !self.insert(pool, key, page) {
            return false;
        }
        if let Some(log) = &mut self.events {
            match log.last_mut() {
                Some(CacheEvent::Stored { keys, tokens: t, .. }) if keys.last() == Some(parent) => {
                    keys.push(key);
                    t.extend_from_slice(tokens);
                }
                _ => log.push(CacheEvent::Stored {
                    parent: (*parent != ROOT).then_some(*parent),
                    keys: vec![key],
                    tokens: tokens.to_vec(),
                }),
            }
        }
        true
    }

    fn log_removed(&mut self, key: Key) {
        if let Some(log) = &mut self.events {
            match log.last_mut() {
                Some(CacheEvent::Removed { keys }) => keys.push(key),
                _ => log.push(CacheEvent::Removed { keys: vec![key] }),
            }
        }
    }

    /// Whether `key` is cached.
    pub fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
    }

    /// Records that `page` holds the prefix `key` (taking a reference on
    /// it). Returns false, changing nothing, if the key is cached already.
    pub fn insert(&mut self, pool: &mut PagePool, key: Key, page: PageId) -> bool {
        if self.map.contains_key(&key) {
            return false;
        }
        pool.retain(page);
        self.tick += 1;
        self.map.insert(key, Entry { page, used: self.tick });
        self.order.insert((self.tick, key));
        self.stats.pages = self.map.len() as u64;
        true
    }

    /// Marks the keys used, the last first (so a chain's head ends up the
    /// most recently used).
    pub fn touch_chain(&mut self, keys: &[Key]) {
        for k in keys.iter().rev() {
            self.get(k);
        }
    }

    /// The pages shared for the longest cached run of `keys` from the
    /// first, each with one more reference taken for the caller.
    pub fn share(&mut self, pool: &mut PagePool, keys: &[Key]) -> Vec<PageId> {
        let mut pages = Vec::new();
        for k in keys {
            match self.get(k) {
                Some(p) => {
                    pool.retain(p);
                    pages.push(p);
                }
                None => break,
            }
        }
        pages
    }

    /// Evicts least recently used pages that no sequence holds until `n`
    /// pages are free in the pool or none is left to evict; `before` sees
    /// each (key, page) while its bytes are still there. Returns how many
    /// were evicted.
    pub fn evict(&mut self, pool: &mut PagePool, n: usize, mut before: impl FnMut(&Key, PageId)) -> usize {
        let mut evicted = 0;
        while pool.free_pages() < n {
            let Some(&(used, key)) = self.order.iter().find(|(_, k)| pool.refcount(self.map[k].page) == 1) else {
                break;
            };
            self.order.remove(&(used, key));
            let e = self.map.remove(&key).expect("ordered keys are mapped");
            before(&key, e.page);
            pool.release(e.page);
            self.log_removed(key);
            evicted += 1;
        }
        self.stats.evictions += evicted as u64;
        self.stats.pages = self.map.len() as u64;
        evicted
    }

    /// Pages only the cache holds (evictable now).
    pub fn idle_pages(&self, pool: &PagePool) -> usize {
        self.map.values().filter(|e| pool.refcount(e.page) == 1).count()
    }

    /// Drops every entry, returning the pages.
    pub fn clear(&mut self, pool: &mut PagePool) {
        for (_, e) in self.map.drain() {
            pool.release(e.page);
        }
        self.order.clear();
        self.stats.pages = 0;
        if let Some(log) = &mut self.events {
            log.clear();
            log.push(CacheEvent::Cleared);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pages::PageTable;

    #[test]
    fn keys_name_the_whole_prefix() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[3] = 99;
        let (ka, kb) = (keys(&a, 16, 9), keys(&b, 16, 9));
        assert_eq!(ka.len(), 2, "only full pages");
        // A change in the first page changes every later key.
        assert!(ka.iter().zip(&kb).all(|(x, y)| x != y));
        assert_eq!(keys(&a[..32], 16, 1), ka[..1]);
        assert_eq!(ka[1], chain(&ka[0], &a[16..32]));
    }

    #[test]
    fn a_second_sequence_shares_the_cached_pages() {
        let mut pool = PagePool::new(8, 16);
        let mut cache = PrefixCache::new();
        let tokens: Vec<u32> = (0..50).collect();
        let mut a = PageTable::new();
        a.append(&mut pool, 50).unwrap();
        let k = keys(&tokens, 16, usize::MAX);
        for (key, &p) in k.iter().zip(a.pages()) {
            assert!(cache.insert(&mut pool, *key, p));
        }
        assert!(!cache.insert(&mut pool, k[0], a.pages()[0]), "a key is cached once");
        let shared = cache.share(&mut pool, &k);
        assert_eq!(shared, a.pages()[..3]);
        // Held by a, by the cache and by the new sequence.
        assert_eq!(pool.refcount(shared[0]), 3);
        // Nothing is evictable while sequences hold the pages.
        assert_eq!(cache.evict(&mut pool, 8, |_, _| {}), 0);
        a.release(&mut pool);
        for &p in &shared {
            pool.release(p);
        }
        assert_eq!(pool.free_pages(), 8 - 3, "the cache keeps them");
        assert_eq!(cache.idle_pages(&pool), 3);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_tail_first() {
        let mut pool = PagePool::new(4, 16);
        let mut cache = PrefixCache::new();
        let tokens: Vec<u32> = (0..48).collect();
        let mut t = PageTable::new();
        t.append(&mut pool, 48).unwrap();
        let k = keys(&tokens, 16, usize::MAX);
        for (key, &p) in k.iter().zip(t.pages()) {
            cache.insert(&mut pool, *key, p);
        }
        cache.touch_chain(&k);
        let pages = t.pages().to_vec();
        t.release(&mut pool);
        assert_eq!(pool.free_pages(), 1);
        let mut seen = Vec::new();
        assert_eq!(cache.evict(&mut pool, 2, |key, p| seen.push((*key, p))), 1);
        assert_eq!(seen, vec![(k[2], pages[2])], "the tail goes first");
        assert_eq!(cache.share(&mut pool, &k), pages[..2], "the head is still reachable");
        assert_eq!(cache.stats.evictions, 1);
        cache.clear(&mut pool);
        assert_eq!(pool.free_pages(), 2, "two shared pages still held by the caller");
    }

    #[test]
    fn the_log_tells_chains_stored_pages_removed_and_a_clear() {
        let mut pool = PagePool::new(4, 4);
        let mut cache = PrefixCache::new();
        let tokens: Vec<u32> = (0..12).collect();
        let k = keys(&tokens, 4, usize::MAX);
        let mut t = PageTable::new();
        t.append(&mut pool, 12).unwrap();
        let pages = t.pages().to_vec();
        // Nothing is logged before recording starts.
        cache.insert_page(&mut pool, &ROOT, k[0], &tokens[..4], pages[0]);
        assert!(cache.take_events().is_empty());
        cache.record_events();
        cache.insert_page(&mut pool, &k[0], k[1], &tokens[4..8], pages[1]);
        cache.insert_page(&mut pool, &k[1], k[2], &tokens[8..12], pages[2]);
        assert!(
            !cache.insert_page(&mut pool, &k[1], k[2], &tokens[8..12], pages[2]),
            "cached once"
        );
        assert_eq!(
            cache.take_events(),
            vec![CacheEvent::Stored {
                parent: Some(k[0]),
                keys: vec![k[1], k[2]],
                tokens: tokens[4..].to_vec(),
            }],
            "a chain's pages are one event"
        );
        assert!(cache.take_events().is_empty(), "taken once");
        // A chain from the root names no parent.
        let other: Vec<u32> = (100..104).collect();
        let ko = keys(&other, 4, 1)[0];
        let po = pool.alloc().unwrap();
        cache.insert_page(&mut pool, &ROOT, ko, &other, po);
        pool.release(po);
        cache.touch_chain(&k);
        t.release(&mut pool);
        assert_eq!(cache.evict(&mut pool, 1, |_, _| {}), 1);
        let ev = cache.take_events();
        assert_eq!(
            ev[0],
            CacheEvent::Stored {
                parent: None,
                keys: vec![ko],
                tokens: other.clone()
            }
        );
        assert_eq!(
            ev[1],
            CacheEvent::Removed { keys: vec![ko] },
            "the least recently used goes"
        );
        cache.clear(&mut pool);
        assert_eq!(cache.take_events(), vec![CacheEvent::Cleared]);
    }
}
