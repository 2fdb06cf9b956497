//! Pre-tokenization for byte-level BPE: the regex splits that cut text into
//! words before merges run, and the GPT-2 byte-to-character map.
//!
//! A pre-tokenizer is a list of regexes applied in turn: each one re-splits
//! every piece the previous one produced into its matches and the text
//! between them (both kept). A lookahead at a piece's end therefore sees the
//! end of the piece, not the following text. The lists and this semantics
//! are those of llama.cpp (`llm_tokenizer_bpe`, `unicode_regex_split`), which
//! is what makes token ids agree with it.

use fancy_regex::Regex;

use super::TokenizerError;

/// The regex lists of the pre-tokenizers snug supports, by `tokenizer.ggml.pre`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `default`: llama.cpp's fallback list.
    Default,
    /// `gpt-2` and relatives.
    Gpt2,
    /// `llama3`, `llama-bpe`, `llama-v3`.
    Llama3,
    /// `smollm`, `starcoder`, `refact`, `command-r`, `codeshell`: digits
    /// isolated, then GPT-2's regex.
    Smollm,
    /// `qwen2`, `deepseek-r1-qwen`, `stablelm2`: single digits, no space
    /// prefix on letters.
    Qwen2,
}

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl PreTokenizer {
    /// The pre-tokenizer named by `tokenizer.ggml.pre` (absent means `default`).
    pub fn from_name(name: Option<&str>) -> Result<PreTokenizer, TokenizerError> {
        Ok(match name.unwrap_or("default") {
            "default" => PreTokenizer::Default,
            "gpt-2" | "gpt2" | "phi-2" => PreTokenizer::Gpt2,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => PreTokenizer::Llama3,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" => PreTokenizer::Smollm,
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" => PreTokenizer::Qwen2,
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        })
    }

    fn patterns(self) -> &'static [&'static str] {
        match self {
            PreTokenizer::Default => &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
            PreTokenizer::Gpt2 => &[GPT2],
            PreTokenizer::Llama3 => &[LLAMA3],
            PreTokenizer::Smollm => &[r"\p{N}", GPT2],
            PreTokenizer::Qwen2 => &[QWEN2],
        }
    }

    /// Whether llama.cpp tokenizes a word that is itself a vocabulary entry
    /// as that entry, skipping merges.
    pub fn ignore_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Whether a BOS token is added when the file does not say.
    pub fn default_add_bos(self) -> bool {
        self == PreTokenizer::Llama3
    }
}

/// Character classes as llama.cpp's Unicode tables (version 15.1) have them.
/// Characters assigned in later versions are neither letters nor numbers
/// there, so `\p{L}`, `\p{N}` and `\p{P}` are narrowed to the 15.1 assignments.
const UNICODE_CLASSES: [(&str, &str); 3] = [
    (r"\p{L}", r"[\p{L}&&\p{Age:15.1}]"),
    (r"\p{N}", r"[\p{N}&&\p{Age:15.1}]"),
    (r"\p{P}", r"[\p{P}&&\p{Age:15.1}]"),
];

/// A compiled pre-tokenizer.
pub struct Splitter {
    regexes: Vec<Regex>,
}

impl Splitter {
    pub fn new(pre: PreTokenizer) -> Splitter {
        let regexes = pre
            .patterns()
            .iter()
            .map(|p| {
                let p = UNICODE_CLASSES
                    .iter()
                    .fold(p.to_string(), |p, (from, to)| p.replace(from, to));
                Regex::new(&p).expect("built-in pre-tokenizer regexes compile")
            })
            .collect();
        Splitter { regexes }
    }

    /// Splits `text` into words (as byte ranges of `text`).
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut pieces = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                let mut last = 0;
                for m in re.find_iter(piece) {
                    // A match error is a backtracking limit; the patterns here
                    // are linear, so treat the rest of the piece as unmatched.
                    let Ok(m) = m else { break };
                    if m.start() > last {
                        next.push(&piece[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    last = m.end();
                }
                if last < piece.len() {
                    next.push(&piece[last..]);
                }
            }
            pieces = next;
        }
        pieces
    }
}

/// GPT-2's reversible map from bytes to printable characters: printable
/// Latin-1 bytes map to themselves, the rest to U+0100 onwards in order.
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        table[b as usize] = char::from_u32(c).expect("table stays below U+0200");
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm_isolates_digits_before_gpt2_split() {
        let s = Splitter::new(PreTokenizer::Smollm);
        assert_eq!(s.split("ab 42cd"), vec!["ab", " ", "4", "2", "cd"]);
    }

    #[test]
    fn trailing_whitespace_run_keeps_last_space_for_next_word() {
        let s = Splitter::new(PreTokenizer::Gpt2);
        assert_eq!(s.split("a   b"), vec!["a", "  ", " b"]);
    }

    #[test]
    fn qwen2_splits_digits_one_by_one() {
        let s = Splitter::new(PreTokenizer::Qwen2);
        assert_eq!(s.split("x 123"), vec!["x", " ", "1", "2", "3"]);
        assert_eq!(s.split("I'LL go"), vec!["I", "'LL", " go"]);
    }

    #[test]
    fn characters_newer_than_unicode_15_1_are_not_letters() {
        // U+1C89 (Unicode 16.0) is punctuation-like to llama.cpp.
        let s = Splitter::new(PreTokenizer::Qwen2);
        assert_eq!(s.split("\u{1C89}'l"), vec!["\u{1C89}'", "l"]);
        assert_eq!(s.split("é'l"), vec!["é", "'l"]);
    }

    #[test]
    fn byte_table_is_a_bijection() {
        let t = byte_to_char_table();
        let mut seen = std::collections::HashSet::new();
        assert!(t.iter().all(|c| seen.insert(*c)));
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'A' as usize], 'A');
    }
}
