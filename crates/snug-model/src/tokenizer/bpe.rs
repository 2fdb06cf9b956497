//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`).
//!
//! A word from the pre-tokenizer is byte-encoded (GPT-2's byte-to-character
//! map), split into characters, and the adjacent pair with the lowest merge
//! rank is merged until no pair has a rank; ties go to the leftmost pair.
//! Symbols that are not vocabulary entries at the end fall back to one token
//! per byte. This is llama.cpp's `llm_tokenizer_bpe_session`, step for step.

use std::collections::{BinaryHeap, HashMap};

use super::pretokenize::{byte_to_char_table, PreTokenizer, Splitter};
use super::symbols::Symbols;
use super::{TokenId, TokenizerError, Vocab};

pub(super) struct Bpe {
    splitter: Splitter,
    ignore_merges: bool,
    /// Merge rank by the token ids of its two sides. Every merge of a
    /// well-formed vocabulary joins two entries; the rare merge whose side is
    /// not an entry goes to `ranks_by_text`.
    ranks: HashMap<(TokenId, TokenId), u32>,
    ranks_by_text: HashMap<(String, String), u32>,
    byte_char: [char; 256],
    /// Token of each byte's character, for the per-byte fallback.
    byte_token: [Option<TokenId>; 256],
    char_byte: HashMap<char, u8>,
}

impl Bpe {
    pub(super) fn new(vocab: &Vocab, merges: &[String], pre: PreTokenizer) -> Result<Bpe, TokenizerError> {
        let mut ranks = HashMap::with_capacity(merges.len());
        let mut ranks_by_text = HashMap::new();
        for (rank, m) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte.
            let Some(pos) = m.as_bytes().iter().skip(1).position(|&b| b == b' ').map(|p| p + 1) else {
                return Err(TokenizerError::BadMetadata(format!(
                    "merge {rank} {m:?} has no separator"
                )));
            };
            let (left, right) = (&m[..pos], &m[pos + 1..]);
            let rank = rank as u32;
            match (vocab.id_of(left), vocab.id_of(right)) {
                (Some(l), Some(r)) => {
                    ranks.entry((l, r)).or_insert(rank);
                }
                _ => {
                    ranks_by_text
                        .entry((left.to_string(), right.to_string()))
                        .or_insert(rank);
                }
            }
        }
        let byte_char = byte_to_char_table();
        let mut byte_token = [None; 256];
        let mut char_byte = HashMap::with_capacity(256);
        for (b, c) in byte_char.iter().enumerate() {
            byte_token[b] = vocab.id_of(c.encode_utf8(&mut [0; 4]));
            char_byte.insert(*c, b as u8);
        }
        Ok(Bpe {
            splitter: Splitter::new(pre),
            ignore_merges: pre.ignore_merges(),
            ranks,
            ranks_by_text,
            byte_char,
            byte_token,
            char_byte,
        })
    }

    fn rank(&self, vocab: &Vocab, left: &str, right: &str) -> Option<u32> {
        if let (Some(l), Some(r)) = (vocab.id_of(left), vocab.id_of(right)) {
            if let Some(&rank) = self.ranks.get(&(l, r)) {
                return Some(rank);
            }
        }
        if self.ranks_by_text.is_empty() {
            return None;
        }
        self.ranks_by_text.get(&(left.to_string(), right.to_string())).copied()
    }

    /// Tokenizes one fragment of raw text (no special tokens inside).
    pub(super) fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<TokenId>) {
        let mut word = String::new();
        for raw in self.splitter.split(text) {
            word.clear();
            word.extend(raw.bytes().map(|b| self.byte_char[b as usize]));
            self.encode_word(vocab, &word, out);
        }
    }

    fn encode_word(&self, vocab: &Vocab, word: &str, out: &mut Vec<TokenId>) {
        if self.ignore_merges {
            if let Some(id) = vocab.id_of(word) {
                out.push(id);
                return;
            }
        }
        let mut syms = Symbols::new(word);
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<Pair>, syms: &Symbols, l: usize, r: usize| {
            if let Some(rank) = self.rank(vocab, syms.text(word, l), syms.text(word, r)) {
                heap.push(Pair {
                    rank,
                    left: l,
                    right: r,
                    len: syms.sym[l].len + syms.sym[r].len,
                });
            }
        };
        for i in 1..syms.len() {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some(p) = heap.pop() {
            let (l, r) = (&syms.sym[p.left], &syms.sym[p.right]);
            // Stale: one side already merged away, or the pair changed.
            if l.len == 0 || r.len == 0 || l.len + r.len != p.len {
                continue;
            }
            let (prev, next) = syms.merge(p.left, p.right);
            if let Some(pl) = prev {
                push(&mut heap, &syms, pl, p.left);
            }
            if let Some(nn) = next {
                push(&mut heap, &syms, p.left, nn);
            }
        }
        for i in syms.live() {
            let piece = syms.text(word, i);
            match vocab.id_of(piece) {
                Some(id) => out.push(id),
                None => {
                    // Per-byte fallback: each character of the piece is one
                    // byte's character; bytes without a token are dropped, as
                    // llama.cpp does.
                    for c in piece.chars() {
                        if let Some(id) = self.char_byte.get(&c).and_then(|&b| self.byte_token[b as usize]) {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }

    /// The bytes a normal token's text stands for.
    pub(super) fn decode_text(&self, text: &str, out: &mut Vec<u8>) {
        for c in text.chars() {
            match self.char_byte.get(&c) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
    }
}

/// A candidate merge; the heap pops the lowest rank, then the leftmost.
#[derive(PartialEq, Eq)]
struct Pair {
    rank: u32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Pair {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.rank.cmp(&self.rank).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
