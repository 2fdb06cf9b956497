//! The doubly linked list of text pieces that BPE and SentencePiece merges
//! both work on: each symbol is a byte range of the text; merging joins a
//! symbol into its left neighbour and unlinks it.

pub(super) struct Symbol {
    pub start: usize,
    /// Bytes; 0 once merged into its left neighbour.
    pub len: usize,
    pub prev: Option<usize>,
    pub next: Option<usize>,
}

/// Symbols over one piece of text, one per character to begin with.
pub(super) struct Symbols {
    pub sym: Vec<Symbol>,
}

impl Symbols {
    pub fn new(text: &str) -> Symbols {
        let n = text.chars().count();
        let sym = text
            .char_indices()
            .enumerate()
            .map(|(i, (start, c))| Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (i + 1 < n).then_some(i + 1),
            })
            .collect();
        Symbols { sym }
    }

    pub fn len(&self) -> usize {
        self.sym.len()
    }

    /// The text of symbol `i` within `text`.
    pub fn text<'t>(&self, text: &'t str, i: usize) -> &'t str {
        let s = &self.sym[i];
        &text[s.start..s.start + s.len]
    }

    /// Merges `right` into `left` (its left neighbour); returns the new
    /// neighbours (left's prev, left's next) to queue pairs with.
    pub fn merge(&mut self, left: usize, right: usize) -> (Option<usize>, Option<usize>) {
        let right_next = self.sym[right].next;
        self.sym[left].len += self.sym[right].len;
        self.sym[right].len = 0;
        self.sym[left].next = right_next;
        if let Some(nn) = right_next {
            self.sym[nn].prev = Some(left);
        }
        (self.sym[left].prev, right_next)
    }

    /// Indices of the live symbols, left to right.
    pub fn live(&self) -> impl Iterator<Item = usize> + '_ {
        let first = (!self.sym.is_empty()).then_some(0);
        std::iter::successors(first, |&i| self.sym[i].next)
    }
}
