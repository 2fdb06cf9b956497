//! Constrained decoding: a grammar decides, before each token is sampled,
//! which tokens may come next; every other token's logit becomes `-inf`.
//!
//! The grammar engine is `llguidance` (the one llama.cpp, vLLM and SGLang
//! use): it compiles JSON schemas, Lark grammars and regular expressions and
//! computes a token mask from the tokenizer's byte trie in well under a
//! millisecond. snug adds the pieces around it: the trie built from snug's
//! own vocabulary, a GBNF reader (llama.cpp's `grammar` field), a choice
//! list, and the bookkeeping that keeps the guarantees. A mask depends only
//! on the tokens the constraint has consumed, never on the batch or on
//! timing (the engine's limits are counted in work, not seconds), so a
//! constrained request decodes to the same bytes whatever it is batched
//! with, and speculation stays lossless: drafts are cut to the prefix the
//! grammar accepts, each verified row is sampled under the mask its
//! position would have had, and the state is rolled back past the rows a
//! plain step would not yet have consumed.

mod gbnf;

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use snug_model::tokenizer::{TokenKind, Tokenizer};
use toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

pub use gbnf::gbnf_to_lark;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object.
    JsonObject,
    /// JSON matching a JSON schema.
    JsonSchema(Value),
    /// llguidance's Lark dialect.
    Lark(String),
    /// llama.cpp's GBNF.
    Gbnf(String),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    #[error("invalid grammar: {0}")]
    Invalid(String),
    #[error("grammar engine failed: {0}")]
    Engine(String),
}

/// The tokenizer as the grammar engine sees it: each token's bytes, special
/// tokens marked with the trie's 0xFF prefix so that text never matches
/// them.
struct TokenBytes {
    trie: TokTrie,
}

impl TokenizerEnv for TokenBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Compiles grammars for one model's vocabulary. Building it walks the
/// whole vocabulary (tens of milliseconds); make one per model and share it.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl fmt::Debug for Grammars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// For `tok`'s vocabulary and logits of `vocab` entries (a model's
    /// output may be wider than its tokenizer; the extra ids are never
    /// allowed). The end-of-generation tokens end a grammar.
    pub fn new(tok: &Tokenizer, vocab: usize) -> Result<Grammars, GrammarError> {
        let mut words = vec![Vec::new(); vocab.max(tok.vocab_size())];
        for (id, word) in words.iter_mut().enumerate().take(tok.vocab_size()) {
            let id = id as u32;
            match tok.token_kind(id) {
                Some(TokenKind::Control | TokenKind::Unknown) => {
                    word.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    word.extend_from_slice(tok.token_text(id).unwrap_or_default().as_bytes());
                }
                _ => tok.piece_bytes(id, false, word),
            }
        }
        let eog: Vec<u32> = tok
            .eog_tokens()
            .iter()
            .copied()
            .filter(|&t| (t as usize) < words.len())
            .collect();
        let first = *eog
            .first()
            .ok_or_else(|| GrammarError::Engine("the tokenizer has no end-of-generation token".into()))?;
        let info = TokRxInfo::new(words.len() as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
        let env: toktrie::TokEnv = Arc::new(TokenBytes { trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Engine(e.to_string()))?;
        factory.quiet();
        Ok(Grammars {
            factory: Arc::new(factory),
        })
    }

    /// Compiles `spec` into a constraint ready to decode from its start.
    /// A grammar that does not compile is an `Invalid` error naming why.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let top = match spec {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(with_layout(json!({"type": "object"}))),
            GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_layout(schema.clone())),
            GrammarSpec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
            GrammarSpec::Gbnf(src) => TopLevelGrammar::from_lark(gbnf_to_lark(src).map_err(GrammarError::Invalid)?),
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Choice(options) => {
                if options.is_empty() {
                    return Err(GrammarError::Invalid("a choice needs at least one option".into()));
                }
                let alts: Vec<String> = options.iter().map(|o| Value::from(o.as_str()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
        };
        // The engine reports errors as values; a panic inside it on odd
        // input is still an error for this request, not the process's end.
        let parser = catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(top)))
            .map_err(|_| GrammarError::Invalid("the grammar engine could not read this grammar".into()))?
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Constraint {
            matcher: Box::new(matcher),
            spent: Duration::ZERO,
        })
    }
}

/// JSON on one line with a space after `,` and `:` (`{"a": 1, "b": [2, 3]}`),
/// unless the schema sets its own layout (`x-guidance`). Free whitespace
/// lets a small model wander into endless newlines.
fn with_layout(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    schema
}

/// One request's grammar state: which tokens it has consumed, and so which
/// may come next.
pub struct Constraint {
    matcher: Box<Matcher>,
    /// Time spent in the grammar engine (masks, checks, advancing).
    spent: Duration,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint {
            matcher: Box::new(self.matcher.deep_clone()),
            spent: self.spent,
        }
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

fn engine(e: impl fmt::Display) -> GrammarError {
    GrammarError::Engine(e.to_string())
}

impl Constraint {
    /// Runs `f` on the matcher, counting its time.
    fn timed<T>(&mut self, f: impl FnOnce(&mut Matcher) -> T) -> T {
        let t = Instant::now();
        let r = f(&mut self.matcher);
        self.spent += t.elapsed();
        r
    }

    /// The tokens allowed next (the end-of-generation tokens once the
    /// grammar is complete and nothing more may follow).
    pub fn allowed(&mut self) -> Result<SimpleVob, GrammarError> {
        self.timed(|m| m.compute_mask_or_eos()).map_err(engine)
    }

    /// Writes `logits` to `out` with every token the grammar forbids at
    /// `-inf`; returns whether any token is allowed.
    pub fn mask(&mut self, logits: &[f32], out: &mut Vec<f32>) -> Result<bool, GrammarError> {
        let allowed = self.allowed()?;
        let t = Instant::now();
        out.clear();
        out.resize(logits.len(), f32::NEG_INFINITY);
        let mut any = false;
        allowed.iter_set_entries(|i| {
            if let Some(&l) = logits.get(i) {
                out[i] = l;
                any = true;
            }
        });
        self.spent += t.elapsed();
        Ok(any)
    }

    /// Advances past `token`, which the grammar allows.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.timed(|m| m.consume_token(token)).map_err(engine)
    }

    /// Undoes the last `n` consumed tokens.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        if n == 0 {
            return Ok(());
        }
        self.timed(|m| m.rollback(n)).map_err(engine)
    }

    /// How many leading `tokens` the grammar would accept from here
    /// (without consuming them).
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        self.timed(|m| m.validate_tokens(tokens)).unwrap_or(0)
    }

    /// Whether the output so far is a complete sentence of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.timed(|m| m.is_accepting()).unwrap_or(false)
    }

    /// Time spent in the grammar engine so far.
    pub fn spent(&self) -> Duration {
        self.spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_quoted_as_json_strings() {
        let alts: Vec<String> = ["a\"b", "c\\d"].iter().map(|o| Value::from(*o).to_string()).collect();
        assert_eq!(alts, ["\"a\\\"b\"", "\"c\\\\d\""]);
    }

    #[test]
    fn a_schema_keeps_its_own_layout() {
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(with_layout(own.clone()), own);
        let plain = with_layout(json!({"type": "object"}));
        assert_eq!(plain["x-guidance"]["whitespace_flexible"], false);
    }
}
