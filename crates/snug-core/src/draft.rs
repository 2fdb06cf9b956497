//! Prompt-lookup drafting: guess the next tokens of a sequence by finding
//! the most recent earlier place where its last n tokens occurred, and
//! proposing what followed them there.
//!
//! The index maps every n-gram of the history (n from `min_n` to `max_n`)
//! to the position just after its most recent occurrence, and remembers,
//! for each entry, the occurrence it replaced (a hash chain, as in LZ77
//! matchers). Appending a token adds one entry per n; a lookup is one hash
//! probe per n; truncating the history (rollback) undoes exactly the entries
//! of the removed positions, restoring the older occurrences. Nothing ever
//! scans the history.
//!
//! An n-gram is only indexed once the token after it exists, so the lookup
//! of the history's own final n tokens finds an earlier occurrence, never
//! itself.

use std::collections::HashMap;

/// Longest n-gram the index can key (four 32-bit ids fit one `u128`).
pub const MAX_N: usize = 4;

/// How far [`PromptLookup::draft_match`] follows a longest-n match back,
/// comparing token by token: the length it reports is at most this.
pub const LONG_MATCH: usize = 16;

fn key(gram: &[u32]) -> u128 {
    gram.iter().fold(0u128, |k, &t| (k << 32) | t as u128)
}

/// The drafter's index over one sequence's tokens.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    min_n: usize,
    max_n: usize,
    tokens: Vec<u32>,
    /// Per n (index `n - min_n`): n-gram -> position after its latest
    /// occurrence.
    latest: Vec<HashMap<u128, u32>>,
    /// Per n: for the entry made when position `i` was appended, the value
    /// it replaced (`u32::MAX` for none). Indexed by `i`.
    replaced: Vec<Vec<u32>>,
}

impl PromptLookup {
    /// An empty index for n-grams of `min_n..=max_n` tokens.
    /// Heap bytes held (token history, n-gram maps, rollback log).
    pub fn bytes(&self) -> usize {
        let map = |m: &HashMap<u128, u32>| m.capacity() * (std::mem::size_of::<(u128, u32)>() + 1);
        self.tokens.capacity() * 4
            + self.latest.iter().map(map).sum::<usize>()
            + self.replaced.iter().map(|r| r.capacity() * 4).sum::<usize>()
    }

    pub fn new(min_n: usize, max_n: usize) -> PromptLookup {
        assert!(
            1 <= min_n && min_n <= max_n && max_n <= MAX_N,
            "n-gram sizes {min_n}..={max_n}"
        );
        let sizes = max_n - min_n + 1;
        PromptLookup {
            min_n,
            max_n,
            tokens: Vec::new(),
            latest: vec![HashMap::new(); sizes],
            replaced: vec![Vec::new(); sizes],
        }
    }

    /// Tokens indexed.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Appends one token: the n-grams that end just before it now have a
    /// known follower.
    pub fn push(&mut self, token: u32) {
        let i = self.tokens.len();
        for (slot, n) in (self.min_n..=self.max_n).enumerate() {
            let prev = if i >= n {
                let k = key(&self.tokens[i - n..i]);
                self.latest[slot].insert(k, i as u32).unwrap_or(u32::MAX)
            } else {
                u32::MAX
            };
            self.replaced[slot].push(prev);
        }
        self.tokens.push(token);
    }

    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// Appends whatever `history` has beyond what is indexed; `history`
    /// must start with the indexed tokens.
    pub fn sync(&mut self, history: &[u32]) {
        debug_assert_eq!(&history[..self.len().min(history.len())], &self.tokens[..]);
        if history.len() > self.len() {
            let from = self.len();
            self.extend(&history[from..]);
        }
    }

    /// Keeps the first `len` tokens, undoing the entries of the rest.
    pub fn truncate(&mut self, len: usize) {
        while self.tokens.len() > len {
            let i = self.tokens.len() - 1;
            for (slot, n) in (self.min_n..=self.max_n).enumerate() {
                let prev = self.replaced[slot].pop().expect("one entry per position");
                if i >= n {
                    let k = key(&self.tokens[i - n..i]);
                    if prev == u32::MAX {
                        self.latest[slot].remove(&k);
                    } else {
                        self.latest[slot].insert(k, prev);
                    }
                }
            }
            self.tokens.pop();
        }
    }

    /// Up to `k` tokens that followed the most recent earlier occurrence of
    /// the history's last n tokens, trying the longest n first. Empty when
    /// nothing matches.
    pub fn draft(&self, k: usize) -> &[u32] {
        self.draft_match(k).0
    }

    /// [`PromptLookup::draft`] and the length of the match that found it
    /// (0 when none): n for the n-gram found, and for a match of the
    /// longest n, how far the two places agree going back, up to
    /// [`LONG_MATCH`] tokens (at most `LONG_MATCH - n` comparisons, never a
    /// scan). Text being copied matches far back; a chance repeat rarely
    /// does, so the length predicts whether the draft will be accepted.
    pub fn draft_match(&self, k: usize) -> (&[u32], usize) {
        let len = self.tokens.len();
        if k == 0 {
            return (&[], 0);
        }
        for n in (self.min_n..=self.max_n).rev() {
            let slot = n - self.min_n;
            if len < n {
                continue;
            }
            if let Some(&at) = self.latest[slot].get(&key(&self.tokens[len - n..])) {
                let at = at as usize;
                let mut m = n;
                if n == self.max_n {
                    // tokens[at - m..at] == tokens[len - m..len]; at < len.
                    while m < LONG_MATCH && m < at && self.tokens[at - m - 1] == self.tokens[len - m - 1] {
                        m += 1;
                    }
                }
                return (&self.tokens[at..(at + k).min(len)], m);
            }
        }
        (&[], 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, by scanning: the latest earlier occurrence of the
    /// last n tokens (longest n first) and what followed it.
    fn draft_by_scan(h: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let len = h.len();
        for n in (min_n..=max_n).rev() {
            if len < n {
                continue;
            }
            let tail = &h[len - n..];
            // Occurrences h[s..s + n] with a follower (s + n < len).
            for s in (0..len.saturating_sub(n)).rev() {
                if &h[s..s + n] == tail {
                    let at = s + n;
                    return h[at..(at + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn proposes_what_followed_the_last_occurrence() {
        let mut d = PromptLookup::new(2, 4);
        // "a b c d x a b c" -> the earlier "a b c" was followed by "d x".
        d.extend(&[1, 2, 3, 4, 9, 1, 2, 3]);
        assert_eq!(d.draft(2), &[4, 9]);
        assert_eq!(d.draft(8), &[4, 9, 1, 2, 3]);
        // The latest occurrence wins: "... 1 2 7 ... 1 2 8 ... 1 2".
        let mut d = PromptLookup::new(2, 4);
        d.extend(&[1, 2, 7, 5, 1, 2, 8, 6, 1, 2]);
        assert_eq!(d.draft(1), &[8]);
        // No earlier occurrence: nothing.
        let mut d = PromptLookup::new(2, 4);
        d.extend(&[1, 2, 3, 4]);
        assert!(d.draft(4).is_empty());
        assert!(d.draft(0).is_empty());
    }

    #[test]
    fn longer_matches_are_preferred() {
        let mut d = PromptLookup::new(2, 3);
        // "5 1 2" -> 30 (longer, older); "1 2" -> 20 (shorter, newer).
        d.extend(&[5, 1, 2, 30, 0, 1, 2, 20, 0, 5, 1, 2]);
        assert_eq!(d.draft_match(1), (&[30][..], 3));
        d.push(7);
        assert_eq!(d.draft_match(1), (&[][..], 0));
    }

    #[test]
    fn a_longest_n_match_reports_how_far_back_it_agrees() {
        let mut d = PromptLookup::new(2, 4);
        // "9 1 2 3 4 5 | 0 1 2 3 4": the 4-gram agrees 4 back, then 9 != 0.
        d.extend(&[9, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]);
        assert_eq!(d.draft_match(1), (&[5][..], 4));
        // A copy of a longer run agrees as far back as LONG_MATCH.
        let text: Vec<u32> = (10..40).collect();
        let mut d = PromptLookup::new(2, 4);
        d.extend(&text);
        d.push(0);
        d.extend(&text[..10]);
        assert_eq!(d.draft_match(2), (&[20, 21][..], 10));
        d.extend(&text[10..20]);
        assert_eq!(d.draft_match(2), (&[30, 31][..], LONG_MATCH));
        // ... and no further back than the history goes.
        let mut d = PromptLookup::new(2, 4);
        d.extend(&[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]);
        assert_eq!(d.draft_match(1), (&[6][..], 5));
    }

    #[test]
    fn matches_the_scan_and_survives_rollback() {
        let mut rng = Rng(0x5eed);
        for round in 0..40 {
            let (min_n, max_n) = [(1, 1), (2, 4), (1, 3), (3, 4)][round % 4];
            let vocab = 3 + round as u64 % 5; // small vocabularies repeat a lot
            let mut d = PromptLookup::new(min_n, max_n);
            let mut h: Vec<u32> = Vec::new();
            for _ in 0..400 {
                if rng.next().is_multiple_of(5) && !h.is_empty() {
                    let keep = (rng.next() % (h.len() as u64 + 1)) as usize;
                    h.truncate(keep);
                    d.truncate(keep);
                } else {
                    let t = (rng.next() % vocab) as u32;
                    h.push(t);
                    d.push(t);
                }
                assert_eq!(d.tokens(), &h[..]);
                for k in [1, 3, 8] {
                    assert_eq!(d.draft(k), &draft_by_scan(&h, min_n, max_n, k)[..], "{h:?} k {k}");
                }
            }
        }
    }

    #[test]
    fn sync_appends_the_new_tail() {
        let mut d = PromptLookup::new(2, 2);
        d.sync(&[1, 2, 3]);
        d.sync(&[1, 2, 3, 1, 2]);
        assert_eq!(d.len(), 5);
        assert_eq!(d.draft(4), &[3, 1, 2]);
    }
}
