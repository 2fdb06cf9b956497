//! Tokenizers built from GGUF metadata, with ids identical to llama.cpp's.
//!
//! Two vocabulary kinds cover the supported models: byte-level BPE
//! (`gpt2`: SmolLM2, Qwen2.5, Llama 3) and SentencePiece-style with scores
//! and byte fallback (`llama`: Gemma 3). Encoding first cuts special tokens
//! out of the text (longest first, the way llama.cpp partitions), then
//! tokenizes the plain fragments between them.
//!
//! Why not the `tokenizers` crate: its BPE needs a `tokenizer.json`, which
//! GGUF files do not carry, and its Unigram model is not the score-ordered
//! bigram merge llama.cpp runs for `llama` vocabularies. Bit-for-bit parity
//! with llama.cpp's ids (including its special-token partition order and
//! byte fallbacks) was simpler to guarantee with a few hundred lines that
//! follow llama.cpp's algorithm and are tested against its output.

mod bpe;
pub mod pretokenize;
mod spm;
mod stream;
mod symbols;

use std::collections::HashMap;

use crate::gguf::{Array, GgufHeader};
pub use pretokenize::PreTokenizer;
pub use stream::StreamDecoder;

/// A token id.
pub type TokenId = u32;

/// Why a tokenizer could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("the model has no tokenizer ({0} is missing)")]
    Missing(&'static str),
    #[error("unsupported tokenizer model {0:?} (supported: gpt2, llama)")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer {0:?} (supported: default, gpt-2, llama3, smollm, qwen2)")]
    UnsupportedPreTokenizer(String),
    #[error("bad tokenizer metadata: {0}")]
    BadMetadata(String),
}

/// The role a vocabulary entry plays (GGUF `tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    fn from_gguf(t: i64) -> TokenKind {
        match t {
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Normal,
        }
    }

    /// Tokens that are cut out of text before tokenizing it.
    fn is_special(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown)
    }
}

/// The vocabulary: texts, scores and kinds by id, and ids by text.
pub(crate) struct Vocab {
    texts: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<TokenKind>,
    ids: HashMap<String, TokenId>,
    unk: Option<TokenId>,
}

impl Vocab {
    pub(crate) fn id_of(&self, text: &str) -> Option<TokenId> {
        self.ids.get(text).copied()
    }

    pub(crate) fn score(&self, id: TokenId) -> f32 {
        self.scores[id as usize]
    }
}

enum Model {
    Bpe(Box<bpe::Bpe>),
    Spm(Box<spm::Spm>),
}

/// Which kind of vocabulary a tokenizer has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-level BPE (`gpt2`).
    Bpe,
    /// SentencePiece-style with scores (`llama`).
    Spm,
}

impl TokenizerKind {
    pub fn gguf_name(self) -> &'static str {
        match self {
            TokenizerKind::Bpe => "gpt2",
            TokenizerKind::Spm => "llama",
        }
    }
}

/// How [`Tokenizer::encode`] treats special tokens.
#[derive(Clone, Copy, Debug)]
pub struct EncodeOptions {
    /// Add BOS/EOS as the model's metadata says.
    pub add_special: bool,
    /// Recognise control tokens such as `<|im_start|>` written in the text.
    /// User-defined tokens are always recognised, as in llama.cpp.
    pub parse_special: bool,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            add_special: true,
            parse_special: true,
        }
    }
}

/// A tokenizer for one model.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    kind: TokenizerKind,
    pre: Option<PreTokenizer>,
    /// Special tokens, longest text first (the partition order).
    specials: Vec<TokenId>,
    pub bos: Option<TokenId>,
    pub eos: Option<TokenId>,
    pub eot: Option<TokenId>,
    pub pad: Option<TokenId>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// Tokens that end generation.
    eog: Vec<TokenId>,
}

/// Texts that llama.cpp recognises as end-of-turn when the file names no
/// EOT token; the first present becomes EOT and is made a control token.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle roles, their metadata keys and the texts llama.cpp
/// recognises for them when the key is absent (these become control tokens).
const FIM_TEXTS: &[(&str, &[&str])] = &[
    (
        "tokenizer.ggml.fim_pre_token_id",
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_suf_token_id",
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_mid_token_id",
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_pad_token_id",
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    ),
    (
        "tokenizer.ggml.fim_rep_token_id",
        &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
    ),
    ("tokenizer.ggml.fim_sep_token_id", &["<|file_sep|>"]),
];

/// Texts that end generation whatever the file says; llama.cpp also makes
/// them control tokens, which changes how text containing them is split.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Special-token roles recovered from metadata and from llama.cpp's
/// by-name conventions, applied to `kinds` the way llama.cpp applies them.
fn special_roles(
    h: &GgufHeader,
    texts: &[String],
    ids: &HashMap<String, TokenId>,
    kinds: &mut [TokenKind],
) -> Result<(Option<TokenId>, Vec<TokenId>), TokenizerError> {
    let n = texts.len();
    let find_first = |cands: &[&str]| cands.iter().filter_map(|t| ids.get(*t).copied()).min();
    let mut eot = token_id(h, "tokenizer.ggml.eot_token_id", n)?;
    if eot.is_none() {
        eot = find_first(EOT_TEXTS);
        if let Some(id) = eot {
            kinds[id as usize] = TokenKind::Control;
        }
    }
    let eom = token_id(h, "tokenizer.ggml.eom_token_id", n)?.or_else(|| ids.get("<|eom_id|>").copied());
    let mut fim = Vec::with_capacity(FIM_TEXTS.len());
    for (key, cands) in FIM_TEXTS {
        let mut id = token_id(h, key, n)?;
        if id.is_none() {
            id = find_first(cands);
            if let Some(i) = id {
                kinds[i as usize] = TokenKind::Control;
            }
        }
        fim.push(id);
    }
    // EOG: FIM pad, repo and separator, the named texts, then EOS/EOT/EOM.
    let mut eog: Vec<TokenId> = fim[3..].iter().flatten().copied().collect();
    for text in EOG_TEXTS {
        if let Some(&id) = ids.get(*text) {
            eog.push(id);
            kinds[id as usize] = TokenKind::Control;
        }
    }
    let eos = token_id(h, "tokenizer.ggml.eos_token_id", n)?;
    eog.extend(eos.into_iter().chain(eot).chain(eom));
    eog.sort_unstable();
    eog.dedup();
    let in_eog = |eog: &[TokenId], t: &str| eog.iter().any(|&i| texts[i as usize] == t);
    // Harmony-style vocabularies: "<|end|>" ends a message, not generation.
    let harmony = in_eog(&eog, "<|return|>") && in_eog(&eog, "<|call|>");
    let solar = in_eog(&eog, "<|calls|>") && in_eog(&eog, "<|flush|>");
    if (harmony || solar) && in_eog(&eog, "<|end|>") {
        if let Some(&id) = ids.get("<|end|>") {
            eog.retain(|&i| i != id);
            kinds[id as usize] = TokenKind::UserDefined;
        }
    }
    // Vocabularies where "</s>" is an ordinary word.
    if (in_eog(&eog, "<|tool_response>") || in_eog(&eog, "<|plamo:eos|>")) && in_eog(&eog, "</s>") {
        if let Some(&id) = ids.get("</s>") {
            eog.retain(|&i| i != id);
            kinds[id as usize] = TokenKind::Normal;
        }
    }
    Ok((eot, eog))
}

fn token_id(h: &GgufHeader, key: &str, n: usize) -> Result<Option<TokenId>, TokenizerError> {
    match h.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) if (id as usize) < n => Ok(Some(id as TokenId)),
            // Some converters write -1 (or u32::MAX) for "none".
            _ if matches!(v, crate::gguf::Value::I32(-1) | crate::gguf::Value::U32(u32::MAX)) => Ok(None),
            _ => Err(TokenizerError::BadMetadata(format!(
                "{key} = {v} is not a token id below {n}"
            ))),
        },
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys.
    pub fn from_gguf(h: &GgufHeader) -> Result<Tokenizer, TokenizerError> {
        let model_name = h
            .get_str("tokenizer.ggml.model")
            .ok_or(TokenizerError::Missing("tokenizer.ggml.model"))?;
        let kind = match model_name {
            "gpt2" => TokenizerKind::Bpe,
            "llama" => TokenizerKind::Spm,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let Some(Array::String(tokens)) = h.get_array("tokenizer.ggml.tokens") else {
            return Err(TokenizerError::Missing("tokenizer.ggml.tokens (array of strings)"));
        };
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(TokenizerError::BadMetadata(format!("vocabulary of {n} tokens")));
        }
        let scores: Vec<f32> = match h.get_array("tokenizer.ggml.scores") {
            None => vec![0.0; n],
            Some(Array::F32(s)) if s.len() >= n => s[..n].to_vec(),
            Some(Array::I32(s)) if s.len() >= n => s[..n].iter().map(|&x| x as f32).collect(),
            Some(_) => return Err(TokenizerError::BadMetadata("tokenizer.ggml.scores".into())),
        };
        let mut kinds: Vec<TokenKind> = match h.get_array("tokenizer.ggml.token_type") {
            None => vec![TokenKind::Normal; n],
            Some(Array::I32(t)) if t.len() >= n => t[..n].iter().map(|&x| TokenKind::from_gguf(x as i64)).collect(),
            Some(_) => return Err(TokenizerError::BadMetadata("tokenizer.ggml.token_type".into())),
        };
        let mut texts = Vec::with_capacity(n);
        let mut ids = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            let text = if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.clone()
            };
            ids.insert(text.clone(), i as TokenId);
            texts.push(text);
        }
        let bos = token_id(h, "tokenizer.ggml.bos_token_id", n)?;
        let eos = token_id(h, "tokenizer.ggml.eos_token_id", n)?;
        let pad = token_id(h, "tokenizer.ggml.padding_token_id", n)?;
        let unk = token_id(h, "tokenizer.ggml.unknown_token_id", n)?;
        let (eot, eog) = special_roles(h, &texts, &ids, &mut kinds)?;

        let vocab = Vocab {
            texts,
            scores,
            kinds,
            ids,
            unk,
        };
        let (model, pre, default_bos, default_prefix) = match kind {
            TokenizerKind::Bpe => {
                let pre = PreTokenizer::from_name(h.get_str("tokenizer.ggml.pre"))?;
                let Some(Array::String(merges)) = h.get_array("tokenizer.ggml.merges") else {
                    return Err(TokenizerError::Missing("tokenizer.ggml.merges"));
                };
                let bpe = bpe::Bpe::new(&vocab, merges, pre)?;
                (Model::Bpe(Box::new(bpe)), Some(pre), pre.default_add_bos(), false)
            }
            TokenizerKind::Spm => (Model::Spm(Box::new(spm::Spm::new(&vocab))), None, true, true),
        };
        let add_bos = h.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(default_bos);
        let add_eos = h.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(false);
        let add_space_prefix = match kind {
            TokenizerKind::Spm => h.get_bool("tokenizer.ggml.add_space_prefix").unwrap_or(default_prefix),
            TokenizerKind::Bpe => false,
        };
        if add_bos && bos.is_none() {
            return Err(TokenizerError::BadMetadata(
                "add_bos_token is set but there is no BOS token".into(),
            ));
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::BadMetadata(
                "add_eos_token is set but there is no EOS token".into(),
            ));
        }
        let mut specials: Vec<TokenId> = (0..n as TokenId)
            .filter(|&i| vocab.kinds[i as usize].is_special())
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(vocab.texts[i as usize].len()));
        Ok(Tokenizer {
            vocab,
            model,
            kind,
            pre,
            specials,
            bos,
            eos,
            eot,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            eog,
        })
    }

    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    pub fn pre_tokenizer(&self) -> Option<PreTokenizer> {
        self.pre
    }

    /// Number of vocabulary entries.
    pub fn vocab_size(&self) -> usize {
        self.vocab.texts.len()
    }

    /// The raw vocabulary text of `id`.
    pub fn token_text(&self, id: TokenId) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    pub fn token_kind(&self, id: TokenId) -> Option<TokenKind> {
        self.vocab.kinds.get(id as usize).copied()
    }

    /// The id whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<TokenId> {
        self.vocab.id_of(text)
    }

    /// Whether `id` ends generation (EOS, EOT, or a turn-end token).
    pub fn is_eog(&self, id: TokenId) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    pub fn eog_tokens(&self) -> &[TokenId] {
        &self.eog
    }

    /// Tokenizes `text`.
    pub fn encode(&self, text: &str, opts: EncodeOptions) -> Vec<TokenId> {
        let fragments = self.partition(text, opts.parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if opts.add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut prev_special = true;
        for f in fragments {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    match &self.model {
                        Model::Bpe(bpe) => bpe.encode(&self.vocab, t, &mut out),
                        Model::Spm(spm) => {
                            let mut s = String::with_capacity(t.len() + 3);
                            if self.add_space_prefix && prev_special {
                                s.push('▁');
                            }
                            for c in t.chars() {
                                s.push(if c == ' ' { '▁' } else { c });
                            }
                            spm.encode(&self.vocab, &s, &mut out);
                        }
                    }
                    prev_special = false;
                }
            }
        }
        if opts.add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Cuts special tokens out of `text`, one token text at a time, longest
    /// first, exactly as llama.cpp's `tokenizer_st_partition` does.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(text));
        for &id in &self.specials {
            let kind = self.vocab.kinds[id as usize];
            if !parse_special && matches!(kind, TokenKind::Control | TokenKind::Unknown) {
                continue;
            }
            let needle = self.vocab.texts[id as usize].as_str();
            if !frags
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Text(mut t) => {
                        while let Some(at) = t.find(needle) {
                            if at > 0 {
                                next.push(Fragment::Text(&t[..at]));
                            }
                            next.push(Fragment::Token(id));
                            t = &t[at + needle.len()..];
                        }
                        if !t.is_empty() {
                            next.push(Fragment::Text(t));
                        }
                    }
                    tok => next.push(tok),
                }
            }
            frags = next;
        }
        frags
    }

    /// The bytes token `id` stands for. Control and unknown tokens give their
    /// text only when `special` is set; unused tokens give nothing.
    pub fn piece_bytes(&self, id: TokenId, special: bool, out: &mut Vec<u8>) {
        let Some(text) = self.vocab.texts.get(id as usize) else {
            return;
        };
        match self.vocab.kinds[id as usize] {
            TokenKind::Control | TokenKind::Unknown => {
                if special {
                    out.extend_from_slice(text.as_bytes());
                }
            }
            TokenKind::UserDefined => out.extend_from_slice(text.as_bytes()),
            TokenKind::Unused => {}
            TokenKind::Byte => match &self.model {
                Model::Spm(_) => out.extend(spm::Spm::byte_of(text)),
                Model::Bpe(bpe) => bpe.decode_text(text, out),
            },
            TokenKind::Normal => match &self.model {
                Model::Bpe(bpe) => bpe.decode_text(text, out),
                Model::Spm(_) => {
                    for c in text.chars() {
                        if c == '▁' {
                            out.push(b' ');
                        } else {
                            out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                        }
                    }
                }
            },
        }
    }

    /// The text of token `id` alone (lossy where it is part of a character).
    pub fn piece(&self, id: TokenId, special: bool) -> String {
        let mut b = Vec::new();
        self.piece_bytes(id, special, &mut b);
        String::from_utf8_lossy(&b).into_owned()
    }

    /// Decodes a whole token sequence. With `special`, control tokens are
    /// written out as their text.
    pub fn decode(&self, ids: &[TokenId], special: bool) -> String {
        let mut b = Vec::new();
        for &id in ids {
            self.piece_bytes(id, special, &mut b);
        }
        if self.add_space_prefix && b.first() == Some(&b' ') {
            b.remove(0);
        }
        String::from_utf8_lossy(&b).into_owned()
    }
}

enum Fragment<'t> {
    Text(&'t str),
    Token(TokenId),
}
