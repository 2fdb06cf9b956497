//! SentencePiece-style vocabularies with scores (`tokenizer.ggml.model =
//! "llama"`), as llama.cpp tokenizes them.
//!
//! Spaces become `▁`, the text is split into characters, and the adjacent
//! pair whose concatenation is the highest-scoring vocabulary entry is merged
//! until no pair forms an entry (ties go to the leftmost pair). A final
//! symbol that is no entry is re-split along the merges that built it, and
//! what still is no entry falls back to `<0xXX>` byte tokens.
//!
//! llama.cpp remembers "how was this text built" in a map keyed by the
//! text, where a later pair with the same text overwrites an earlier one;
//! the re-split follows that map. snug keeps the same map so ids agree even
//! in that corner.

use std::collections::{BinaryHeap, HashMap};

use super::symbols::Symbols;
use super::{TokenId, Vocab};

pub(super) struct Spm {
    byte_token: [Option<TokenId>; 256],
}

impl Spm {
    pub(super) fn new(vocab: &Vocab) -> Spm {
        let mut byte_token = [None; 256];
        for (b, slot) in byte_token.iter_mut().enumerate() {
            *slot = vocab
                .id_of(&format!("<0x{b:02X}>"))
                .or_else(|| std::str::from_utf8(&[b as u8]).ok().and_then(|s| vocab.id_of(s)));
        }
        Spm { byte_token }
    }

    /// Tokenizes one fragment whose spaces are already escaped to `▁`.
    pub(super) fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<TokenId>) {
        if text.is_empty() {
            return;
        }
        let mut syms = Symbols::new(text);
        let mut heap = BinaryHeap::new();
        let mut rev_merge: HashMap<&str, (usize, usize)> = HashMap::new();
        for i in 1..syms.len() {
            try_add(vocab, text, &mut heap, &mut rev_merge, &syms, i - 1, i);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (&syms.sym[b.left], &syms.sym[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            let (prev, next) = syms.merge(b.left, b.right);
            if let Some(pl) = prev {
                try_add(vocab, text, &mut heap, &mut rev_merge, &syms, pl, b.left);
            }
            if let Some(nn) = next {
                try_add(vocab, text, &mut heap, &mut rev_merge, &syms, b.left, nn);
            }
        }
        for i in syms.live() {
            self.resegment(vocab, text, &syms, &rev_merge, i, out, 0);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn resegment(
        &self,
        vocab: &Vocab,
        text: &str,
        syms: &Symbols,
        rev_merge: &HashMap<&str, (usize, usize)>,
        at: usize,
        out: &mut Vec<TokenId>,
        depth: usize,
    ) {
        let piece = syms.text(text, at);
        if let Some(id) = vocab.id_of(piece) {
            out.push(id);
            return;
        }
        // `depth` bounds the recursion: the map can only point at shorter
        // pieces, so it never exceeds the piece's character count.
        match rev_merge.get(piece) {
            Some(&(l, r)) if depth < text.len() => {
                self.resegment(vocab, text, syms, rev_merge, l, out, depth + 1);
                self.resegment(vocab, text, syms, rev_merge, r, out, depth + 1);
            }
            _ => {
                for b in piece.bytes() {
                    if let Some(id) = self.byte_token[b as usize].or(vocab.unk) {
                        out.push(id);
                    }
                }
            }
        }
    }

    /// The byte a `<0xXX>` token stands for.
    pub(super) fn byte_of(text: &str) -> Option<u8> {
        let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
        if hex.len() != 2 {
            return None;
        }
        u8::from_str_radix(hex, 16).ok()
    }
}

/// Queues the pair (l, r) if its text is a vocabulary entry.
fn try_add<'t>(
    vocab: &Vocab,
    text: &'t str,
    heap: &mut BinaryHeap<Bigram>,
    rev_merge: &mut HashMap<&'t str, (usize, usize)>,
    syms: &Symbols,
    l: usize,
    r: usize,
) {
    let start = syms.sym[l].start;
    let len = syms.sym[l].len + syms.sym[r].len;
    let piece = &text[start..start + len];
    if let Some(id) = vocab.id_of(piece) {
        heap.push(Bigram {
            score: vocab.score(id),
            left: l,
            right: r,
            len,
        });
        rev_merge.insert(piece, (l, r));
    }
}

/// A candidate merge; the heap pops the highest score, then the leftmost.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
