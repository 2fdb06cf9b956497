//! Incremental detokenization for streaming: a token may end in the middle
//! of a UTF-8 character (byte-level BPE and byte-fallback tokens do), so
//! bytes are held back until they complete a character and only whole
//! characters are ever emitted.

use super::{TokenId, Tokenizer};

/// Turns a stream of token ids into a stream of complete UTF-8 text.
#[derive(Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    /// Whether control tokens are written out as text.
    pub special: bool,
    emitted_any: bool,
}

impl StreamDecoder {
    pub fn new(special: bool) -> StreamDecoder {
        StreamDecoder {
            pending: Vec::new(),
            special,
            emitted_any: false,
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: TokenId) -> String {
        tok.piece_bytes(id, self.special, &mut self.pending);
        if !self.emitted_any && tok.add_space_prefix && self.pending.first() == Some(&b' ') {
            self.pending.remove(0);
        }
        let out = self.take_complete();
        if !out.is_empty() {
            self.emitted_any = true;
        }
        out
    }

    /// Whatever is still held back, with incomplete characters replaced by
    /// U+FFFD. Call at the end of a stream.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    /// Bytes held back because they do not yet form a whole character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).expect("checked prefix"));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        // Bytes that can never become valid: replace them.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }
}
