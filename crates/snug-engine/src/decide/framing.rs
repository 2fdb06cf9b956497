//! How a state and its questions become tokens for one model.

use std::collections::BTreeMap;

use snug_model::template::{ChatTemplate, Message};
use snug_model::{EncodeOptions, Tokenizer};

use super::*;

/// How states and questions become tokens for one model: the chat
/// template's text before and after the user's message (or plain text
/// for a model without one), and the label tokens.
pub struct Framing {
    head: String,
    tail: String,
    add_bos: bool,
}

/// Marks where the user's message goes when the template is rendered.
const SLOT: &str = "\u{e000}SNUG-SLOT\u{e000}";

impl Framing {
    /// From the model's chat template (`None`: plain text).
    pub fn new(template: Option<&ChatTemplate>, tok: &Tokenizer) -> Result<Framing, DecideError> {
        let Some(t) = template.filter(|t| !t.is_fallback) else {
            return Ok(Framing {
                head: String::new(),
                tail: "\nAnswer:".into(),
                add_bos: true,
            });
        };
        let bos = tok.bos.and_then(|b| tok.token_text(b)).unwrap_or("").to_string();
        let eos = tok.eos.and_then(|e| tok.token_text(e)).unwrap_or("").to_string();
        let text = t
            .render(
                &[Message::new("user", SLOT)],
                true,
                &bos,
                &eos,
                BTreeMap::<String, String>::new(),
            )
            .map_err(|e| DecideError::Template(e.to_string()))?;
        let (head, tail) = text
            .split_once(SLOT)
            .ok_or_else(|| DecideError::Template("the template dropped the user's message".into()))?;
        Ok(Framing {
            add_bos: bos.is_empty() || !head.starts_with(&bos),
            head: head.to_string(),
            tail: tail.to_string(),
        })
    }

    /// The state's tokens: the template's head, then the state.
    pub fn state_tokens(&self, tok: &Tokenizer, state: &str) -> Vec<u32> {
        let mut ids = tok.encode(
            &self.head,
            EncodeOptions {
                add_special: self.add_bos,
                parse_special: true,
            },
        );
        ids.extend(tok.encode(
            &format!("{state}\n\n"),
            EncodeOptions {
                add_special: false,
                parse_special: false,
            },
        ));
        ids
    }

    /// A question's tokens (after the state), ending where the answer's
    /// first token goes.
    pub fn question_tokens(&self, tok: &Tokenizer, q: &Question) -> Vec<u32> {
        let mut ids = tok.encode(
            &question_text(q),
            EncodeOptions {
                add_special: false,
                parse_special: false,
            },
        );
        ids.extend(tok.encode(
            &self.tail,
            EncodeOptions {
                add_special: false,
                parse_special: true,
            },
        ));
        ids
    }
}

/// The label of option `i` of a question.
pub(super) fn label(kind: Kind, k: usize, i: usize) -> String {
    match kind {
        Kind::Noul => ["No", "Yes"][i].to_string(),
        Kind::Score if k <= 9 => (i + 1).to_string(),
        _ if k <= 26 => ((b'A' + i as u8) as char).to_string(),
        _ => (i + 1).to_string(),
    }
}

/// The question as the model reads it.
pub(super) fn question_text(q: &Question) -> String {
    use std::fmt::Write;
    let k = q.options.len();
    let mut s = format!("{}\n", q.instructions.trim());
    match q.kind {
        Kind::Choice => {
            s.push_str("Options:\n");
            for (i, (key, d)) in q.options.iter().enumerate() {
                let _ = match d {
                    Some(d) => writeln!(s, "{}. {key}: {d}", label(q.kind, k, i)),
                    None => writeln!(s, "{}. {key}", label(q.kind, k, i)),
                };
            }
            s.push_str(if k <= 26 {
                "Reply with one letter."
            } else {
                "Reply with one number."
            });
        }
        Kind::Score => {
            s.push_str("Scale:\n");
            for (i, (_, d)) in q.options.iter().enumerate() {
                let _ = writeln!(s, "{}. {}", label(q.kind, k, i), d.as_deref().unwrap_or(""));
            }
            s.push_str(if k <= 9 {
                "Reply with one number."
            } else {
                "Reply with one letter."
            });
        }
        Kind::Noul => {
            if let Some(d) = &q.options[1].1 {
                let _ = writeln!(s, "Yes means: {d}");
            }
            if let Some(d) = &q.options[0].1 {
                let _ = writeln!(s, "No means: {d}");
            }
            s.push_str("Reply Yes or No.");
        }
    }
    s
}

/// The spellings of a label that are scored: bare and after a space, as
/// token sequences. Where either is one token, only the one-token
/// spellings; otherwise both, scored by teacher forcing.
pub(super) fn label_variants(tok: &Tokenizer, label: &str) -> Vec<Vec<u32>> {
    let opts = EncodeOptions {
        add_special: false,
        parse_special: false,
    };
    let mut all: Vec<Vec<u32>> = [label.to_string(), format!(" {label}")]
        .iter()
        .map(|v| tok.encode(v, opts))
        .filter(|ids| !ids.is_empty())
        .collect();
    all.dedup();
    if all.iter().any(|v| v.len() == 1) {
        all.retain(|v| v.len() == 1);
    }
    all
}

/// The one-token spellings of a label (empty when it has none).
pub(super) fn label_tokens(tok: &Tokenizer, label: &str) -> Vec<u32> {
    label_variants(tok, label)
        .into_iter()
        .filter(|v| v.len() == 1)
        .map(|v| v[0])
        .collect()
}

/// The content-free state each question is also asked about.
pub const NEUTRAL_STATE: &str = "N/A";
