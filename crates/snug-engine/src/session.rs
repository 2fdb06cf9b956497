//! Sessions: one sequence's state in a file, so that another process can
//! go on decoding where this one stopped without prefilling anything.
//!
//! A session holds the tokens, the sampler settings (the random draws are
//! keyed by position, so the settings and the seed are the whole sampler
//! state), the key basis of TQ4 keys, and the KV of the valid prefix,
//! written straight from the pages: the first `len` positions of each page
//! a sequence uses, and its exact-window twins. Restoring reads those bytes
//! back into pages of the pool. Because every kernel is batch-invariant
//! and the restored pages hold the same bits, decoding after a restore
//! produces exactly what the uninterrupted process would have.
//!
//! The layout is in `docs/session-format.md`; in short (little-endian):
//!
//! ```text
//! 0   "SNUGSESS"  magic
//! 8   u32         version (1)
//! 12  u32         number of sections
//! 16  sections x  { tag [4], u32 0, u64 offset, u64 length, u32 crc32, u32 0 }
//! ..  u32         crc32 of everything before it
//! then each section at a 64-byte aligned offset:
//!     META  JSON: identity, token counts, sampler, chat messages, twins
//!     TOKN  u32 token ids (every token, also those not yet in the KV)
//!     BASI  f32 key-basis offsets then weights (TQ4 keys only)
//!     PAGE  the KV bytes of each page in order (see `KvStore::export_page`)
//!     TWIN  the KV bytes of each twin page, in `META.twins` order
//! ```
//!
//! Saving writes a temporary file next to the target, syncs it and renames
//! it over the target, so an interrupted save leaves the previous file as
//! it was. Opening checks the magic, the version, the header's checksum and
//! the file length; restoring checks the identity and every section's
//! checksum before the sequence is handed out.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use snug_core::twins::{Twins, NO_TWIN};
use snug_core::PageTable;
use snug_kernels::kvbasis::KeyBasis;
use snug_model::template::Message;

use crate::sampling::SamplingParams;
use crate::{Engine, EngineError, EngineOptions, SeqId, Sequence};
use snug_kernels::kv::{KvFormat, KvStore};

pub const MAGIC: &[u8; 8] = b"SNUGSESS";
pub const VERSION: u32 = 1;
/// Sections start at multiples of this.
const ALIGN: u64 = 64;
const TOC_ENTRY: usize = 32;
const MAX_SECTIONS: u32 = 16;
/// Most positions a page may hold (as `--kv-page` allows).
pub const MAX_PAGE_TOKENS: usize = 4096;

// The format is little-endian and pages are written as they lie in
// memory.
#[cfg(not(target_endian = "little"))]
compile_error!("session files are written from memory and are little-endian");

/// Why a session could not be saved or used.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{0}: not a snug session file (no session magic at its start)")]
    NotASession(String),
    #[error("{path}: session format version {found}; this snug reads version {VERSION}")]
    Version { path: String, found: u32 },
    #[error("{path}: truncated: {len} bytes, but its header describes {needed}")]
    Truncated { path: String, len: u64, needed: u64 },
    #[error("{path}: corrupt: the {section} checksum does not match (the file was altered or damaged)")]
    Checksum { path: String, section: String },
    #[error("{path}: malformed: {what}")]
    Malformed { path: String, what: String },
    #[error("{path}: saved with {what} {saved}, but this run has {here}")]
    Mismatch {
        path: String,
        what: &'static str,
        saved: String,
        here: String,
    },
    #[error("{path}: {source}")]
    Engine { path: String, source: EngineError },
}

/// What a session's KV was made by and for: restoring is refused unless
/// every field matches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// SHA-256 of the model file (metadata and tensor data).
    pub model_sha256: String,
    /// SHA-256 of the tokenizer's metadata.
    pub tokenizer_sha256: String,
    pub arch: String,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Key and value formats.
    pub kv_k: String,
    pub kv_v: String,
    pub page_tokens: usize,
    /// SHA-256 of the rotation signs of every (layer, KV head); empty for
    /// the unrotated formats.
    pub rotation_sha256: String,
    /// SHA-256 of the key basis (in the BASI section); empty without one.
    pub key_basis_sha256: String,
    /// The forward pass's arithmetic when not snug's own (`ggml`): its KV
    /// differs in the last bits. Empty (and absent from the file) for the
    /// native numerics.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub numerics: String,
}

/// A session's header (the META section).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SessionMeta {
    pub identity: Identity,
    /// The model as it was named when saving (for people; not checked).
    pub model_name: String,
    pub snug_version: String,
    /// Seconds since the Unix epoch.
    pub created_unix: u64,
    /// Tokens in TOKN.
    pub tokens: usize,
    /// The first `kv_tokens` of them have KV in the file; the rest (the
    /// last sampled token) are fed when generation goes on.
    pub kv_tokens: usize,
    pub sampling: SamplingParams,
    /// The conversation, when the tokens are a rendered chat.
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    /// Page indices whose exact-window twins are in TWIN, in order.
    pub twins: Vec<usize>,
}

/// What the caller knows about the model: the rest of the identity comes
/// from the engine.
#[derive(Clone, Debug)]
pub struct ModelIdentity {
    pub model_sha256: String,
    pub tokenizer_sha256: String,
    pub model_name: String,
}

/// What a save wrote.
#[derive(Clone, Debug)]
pub struct Saved {
    pub bytes: u64,
    pub kv_bytes: u64,
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn basis_bytes(b: &KeyBasis) -> Vec<u8> {
    b.offset.iter().chain(&b.weight).flat_map(|x| x.to_le_bytes()).collect()
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    tag: [u8; 4],
    offset: u64,
    len: u64,
    crc: u32,
}

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

fn header_len(n: usize) -> u64 {
    align((16 + n * TOC_ENTRY + 4) as u64)
}

fn encode_header(entries: &[Entry]) -> Vec<u8> {
    let mut h = Vec::with_capacity(header_len(entries.len()) as usize);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for e in entries {
        h.extend_from_slice(&e.tag);
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&e.offset.to_le_bytes());
        h.extend_from_slice(&e.len.to_le_bytes());
        h.extend_from_slice(&e.crc.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
    }
    let crc = crc32fast::hash(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    h.resize(header_len(entries.len()) as usize, 0);
    h
}

/// Writes sections one after another, each 64-byte aligned, keeping each
/// one's checksum.
struct SectionWriter<W: Write> {
    out: W,
    at: u64,
    entries: Vec<Entry>,
    crc: crc32fast::Hasher,
}

impl<W: Write> SectionWriter<W> {
    fn begin(&mut self, tag: &[u8; 4]) -> std::io::Result<()> {
        let pad = align(self.at) - self.at;
        self.out.write_all(&[0u8; ALIGN as usize][..pad as usize])?;
        self.at += pad;
        self.entries.push(Entry {
            tag: *tag,
            offset: self.at,
            len: 0,
            crc: 0,
        });
        self.crc = crc32fast::Hasher::new();
        Ok(())
    }

    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.out.write_all(bytes)?;
        self.crc.update(bytes);
        self.at += bytes.len() as u64;
        self.entries.last_mut().expect("a section begun").len += bytes.len() as u64;
        Ok(())
    }

    fn end(&mut self) {
        let crc = std::mem::take(&mut self.crc).finalize();
        self.entries.last_mut().expect("a section begun").crc = crc;
    }
}

impl Engine<'_> {
    /// The KV half of a session identity, with the model's half from the
    /// caller.
    pub fn session_identity(&self, m: &ModelIdentity) -> Identity {
        let signs = self.storage.rotation_signs();
        let rotation = if signs.is_empty() {
            String::new()
        } else {
            let mut h = Sha256::new();
            for s in signs {
                for w in s {
                    h.update(w.to_le_bytes());
                }
            }
            hex(&h.finalize())
        };
        let c = &self.model.config;
        Identity {
            model_sha256: m.model_sha256.clone(),
            tokenizer_sha256: m.tokenizer_sha256.clone(),
            arch: c.arch.name.to_string(),
            layers: c.layers,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            kv_k: self.storage.formats().0.name().to_string(),
            kv_v: self.storage.formats().1.name().to_string(),
            page_tokens: self.storage.shape().page_tokens,
            rotation_sha256: rotation,
            key_basis_sha256: self
                .storage
                .key_basis()
                .map(|b| hex(&Sha256::digest(basis_bytes(b))))
                .unwrap_or_default(),
            numerics: match self.model.numerics {
                snug_kernels::ggml::Numerics::Native => String::new(),
                n => n.name().to_string(),
            },
        }
    }

    /// Saves sequence `seq` to `path`: `tokens` (which start with the
    /// sequence's own and may hold one more, the last sampled token),
    /// the sampler settings and, for a chat, the messages. Atomic: the
    /// file at `path` is either the old one or the complete new one.
    pub fn save_session(
        &self,
        seq: SeqId,
        path: &Path,
        model: &ModelIdentity,
        tokens: &[u32],
        sampling: &SamplingParams,
        messages: Option<&[Message]>,
    ) -> Result<Saved, SessionError> {
        let p = path.display().to_string();
        let s = self.seq(seq).map_err(|source| SessionError::Engine {
            path: p.clone(),
            source,
        })?;
        let kv_tokens = s.tokens.len();
        if tokens.len() < kv_tokens || tokens[..kv_tokens] != s.tokens[..] {
            return Err(SessionError::Malformed {
                path: p,
                what: "the tokens to save do not start with the sequence's".into(),
            });
        }
        let pt = self.storage.shape().page_tokens;
        let twins: Vec<(usize, u32)> = s
            .twins
            .as_slice()
            .iter()
            .enumerate()
            .filter(|&(i, &t)| t != NO_TWIN && i * pt < kv_tokens)
            .map(|(i, &t)| (i, t))
            .collect();
        let meta = SessionMeta {
            identity: self.session_identity(model),
            model_name: model.model_name.clone(),
            snug_version: env!("CARGO_PKG_VERSION").to_string(),
            created_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            tokens: tokens.len(),
            kv_tokens,
            sampling: sampling.clone(),
            messages: messages.map(<[Message]>::to_vec),
            twins: twins.iter().map(|&(i, _)| i).collect(),
        };
        let json = serde_json::to_vec(&meta).expect("the header serializes");
        let basis = self.storage.key_basis().map(basis_bytes);
        let n_sections = 4 + usize::from(basis.is_some());
        snug_core::durable::remove_stale_temps(path);
        let write = |file: &mut File| -> std::io::Result<(u64, u64)> {
            let head = header_len(n_sections);
            file.write_all(&vec![0u8; head as usize])?;
            let mut w = SectionWriter {
                out: std::io::BufWriter::with_capacity(1 << 20, &mut *file),
                at: head,
                entries: Vec::new(),
                crc: crc32fast::Hasher::new(),
            };
            w.begin(b"META")?;
            w.put(&json)?;
            w.end();
            w.begin(b"TOKN")?;
            let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            w.put(&ids)?;
            w.end();
            if let Some(b) = &basis {
                w.begin(b"BASI")?;
                w.put(b)?;
                w.end();
            }
            w.begin(b"PAGE")?;
            let kv_start = w.at;
            for (i, &page) in s.table.pages().iter().enumerate() {
                let slots = kv_tokens.saturating_sub(i * pt).min(pt);
                self.storage.export_page(page, slots, false, |r| w.put(r))?;
            }
            w.end();
            w.begin(b"TWIN")?;
            for &(i, t) in &twins {
                let slots = kv_tokens.saturating_sub(i * pt).min(pt);
                self.storage.export_page(t, slots, true, |r| w.put(r))?;
            }
            w.end();
            let kv_bytes = w.at - kv_start;
            let total = w.at;
            let entries = std::mem::take(&mut w.entries);
            w.out.flush()?;
            drop(w);
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&encode_header(&entries))?;
            Ok((total, kv_bytes))
        };
        let (bytes, kv_bytes) =
            snug_core::durable::write_with(path, write).map_err(|source| SessionError::Io { path: p, source })?;
        Ok(Saved { bytes, kv_bytes })
    }

    /// Restores the session in `file` as a new sequence holding its first
    /// `kv_tokens` tokens, after checking that it was made for this model
    /// and this engine's KV layout and that every checksum matches.
    pub fn restore_session(&mut self, file: &SessionFile, model: &ModelIdentity) -> Result<SeqId, SessionError> {
        let m = &file.meta;
        file.check_identity(&self.session_identity(model))?;
        let p = file.path.display().to_string();
        let engine_err = |source| SessionError::Engine {
            path: p.clone(),
            source,
        };
        let n = m.kv_tokens;
        if n > file.tokens.len() || m.tokens != file.tokens.len() {
            return Err(file.malformed("the token counts disagree with the TOKN section"));
        }
        let vocab = self.model.config.vocab;
        if let Some(&t) = file.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(file.malformed(&format!("token id {t} is outside the vocabulary of {vocab}")));
        }
        if n > self.options.ctx {
            return Err(engine_err(EngineError::ContextFull {
                len: 0,
                adding: n,
                limit: self.options.ctx,
            }));
        }
        let pt = self.storage.shape().page_tokens;
        let pages = n.div_ceil(pt);
        if m.twins.iter().any(|&i| i >= pages) {
            return Err(file.malformed("a twin lies beyond the saved positions"));
        }
        let mut sorted = m.twins.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != m.twins.len() {
            return Err(file.malformed("a page is listed twice among the twins"));
        }
        // Lossy pages are read next to their exact window, which always
        // holds page 0; exact pages have none.
        let lossy = self.storage.is_lossy();
        if lossy && n > 0 && sorted.first() != Some(&0) || !lossy && !sorted.is_empty() {
            return Err(file.malformed("the exact-window twins do not fit the KV format"));
        }
        if let Some(c) = &mut self.prefix {
            let need = PageTable::new().pages_needed(&self.pages, n);
            c.evict(&mut self.pages, need, |_, _| {});
        }
        let mut table = PageTable::new();
        table.append(&mut self.pages, n).map_err(|e| engine_err(e.into()))?;
        let (twins, given) = match Twins::restore(&mut self.twin_pool, &m.twins) {
            Ok(t) => t,
            Err(e) => {
                table.release(&mut self.pages);
                return Err(engine_err(e.into()));
            }
        };
        let id = self.create_sequence();
        self.seqs[id.0] = Some(Sequence {
            table,
            tokens: file.tokens[..n].to_vec(),
            twins,
            // Pages from a file (and what grows from them) are trusted for
            // this sequence only, never shared through the prefix cache.
            keys: Vec::new(),
            shareable: false,
        });
        let filled = self.fill_from(file, id, &given);
        if filled.is_err() {
            self.free_sequence(id);
        }
        filled.map(|()| id)
    }

    /// Reads the PAGE and TWIN sections into sequence `id`'s pages and
    /// `twins`, checking their sizes and checksums.
    fn fill_from(&mut self, file: &SessionFile, id: SeqId, twins: &[u32]) -> Result<(), SessionError> {
        let m = &file.meta;
        let pt = self.storage.shape().page_tokens;
        let slots = |i: usize| (m.kv_tokens - i * pt).min(pt);
        let pages: Vec<(u32, usize)> = self
            .seq(id)
            .expect("just made")
            .table
            .pages()
            .iter()
            .enumerate()
            .map(|(i, &p)| (p, slots(i)))
            .collect();
        let twins: Vec<(u32, usize)> = m.twins.iter().zip(twins).map(|(&i, &t)| (t, slots(i))).collect();
        let io = |source| SessionError::Io {
            path: file.path.display().to_string(),
            source,
        };
        for (name, list, twin) in [("PAGE", pages, false), ("TWIN", twins, true)] {
            let e = file.section(name)?;
            let want: u64 = list
                .iter()
                .map(|&(_, n)| self.storage.stored_bytes(n, twin) as u64)
                .sum();
            if e.len != want {
                return Err(file.malformed(&format!(
                    "the {name} section holds {} bytes, its positions need {want}",
                    e.len
                )));
            }
            let mut crc = crc32fast::Hasher::new();
            let mut at = e.offset;
            for (page, n) in list {
                self.storage
                    .import_page(page, n, twin, |run| {
                        file.file.read_exact_at(run, at)?;
                        crc.update(run);
                        at += run.len() as u64;
                        Ok::<(), std::io::Error>(())
                    })
                    .map_err(io)?;
            }
            if crc.finalize() != e.crc {
                return Err(SessionError::Checksum {
                    path: file.path.display().to_string(),
                    section: format!("{name} section's"),
                });
            }
        }
        Ok(())
    }
}

/// An opened session file: header, META and TOKN read and checked; the KV
/// sections are read (and checked) by [`Engine::restore_session`].
pub struct SessionFile {
    pub path: PathBuf,
    pub meta: SessionMeta,
    /// Every saved token.
    pub tokens: Vec<u32>,
    /// The key basis saved with TQ4 keys: `(offset, weight)`.
    pub basis: Option<(Vec<f32>, Vec<f32>)>,
    /// Bytes of the file.
    pub bytes: u64,
    entries: Vec<Entry>,
    file: File,
}

impl SessionFile {
    /// Opens `path` and checks what can be checked without a model: magic,
    /// version, the header's checksum, the length, and the META, TOKN and
    /// BASI sections' checksums and contents.
    pub fn open(path: &Path) -> Result<SessionFile, SessionError> {
        let p = path.display().to_string();
        let io = |source| SessionError::Io {
            path: p.clone(),
            source,
        };
        let file = snug_core::durable::open_regular(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut fixed = [0u8; 16];
        if len < 16 {
            let mut head = vec![0u8; len as usize];
            file.read_exact_at(&mut head, 0).map_err(io)?;
            if !MAGIC.starts_with(&head[..head.len().min(8)]) || head.is_empty() {
                return Err(SessionError::NotASession(p));
            }
            return Err(SessionError::Truncated {
                path: p,
                len,
                needed: 16,
            });
        }
        file.read_exact_at(&mut fixed, 0).map_err(io)?;
        if &fixed[..8] != MAGIC {
            return Err(SessionError::NotASession(p));
        }
        let version = u32::from_le_bytes(fixed[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(SessionError::Version {
                path: p,
                found: version,
            });
        }
        let n = u32::from_le_bytes(fixed[12..16].try_into().expect("4 bytes"));
        if n > MAX_SECTIONS {
            return Err(SessionError::Checksum {
                path: p,
                section: "header".into(),
            });
        }
        let hl = 16 + n as usize * TOC_ENTRY + 4;
        if len < hl as u64 {
            return Err(SessionError::Truncated {
                path: p,
                len,
                needed: hl as u64,
            });
        }
        let mut head = vec![0u8; hl];
        file.read_exact_at(&mut head, 0).map_err(io)?;
        let crc = u32::from_le_bytes(head[hl - 4..].try_into().expect("4 bytes"));
        if crc32fast::hash(&head[..hl - 4]) != crc {
            return Err(SessionError::Checksum {
                path: p,
                section: "header".into(),
            });
        }
        let entries: Vec<Entry> = head[16..hl - 4]
            .chunks_exact(TOC_ENTRY)
            .map(|e| Entry {
                tag: e[0..4].try_into().expect("4 bytes"),
                offset: u64::from_le_bytes(e[8..16].try_into().expect("8 bytes")),
                len: u64::from_le_bytes(e[16..24].try_into().expect("8 bytes")),
                crc: u32::from_le_bytes(e[24..28].try_into().expect("4 bytes")),
            })
            .collect();
        let needed = entries
            .iter()
            .map(|e| e.offset.saturating_add(e.len))
            .max()
            .unwrap_or(0);
        if needed > len {
            return Err(SessionError::Truncated { path: p, len, needed });
        }
        let mut f = SessionFile {
            path: path.to_path_buf(),
            meta: SessionMeta::default(),
            tokens: Vec::new(),
            basis: None,
            bytes: len,
            entries,
            file,
        };
        let json = f.read_section("META")?;
        f.meta = serde_json::from_slice(&json).map_err(|e| f.malformed(&format!("META: {e}")))?;
        let ids = f.read_section("TOKN")?;
        f.tokens = ids
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let m = &f.meta;
        if f.tokens.len() != m.tokens || m.kv_tokens > m.tokens || ids.len() % 4 != 0 {
            return Err(f.malformed("the token counts disagree with the TOKN section"));
        }
        if f.entries.iter().any(|e| &e.tag == b"BASI") {
            let b = f.read_section("BASI")?;
            let per = m
                .identity
                .layers
                .checked_mul(m.identity.kv_heads)
                .and_then(|x| x.checked_mul(m.identity.head_dim))
                .filter(|&x| x.checked_mul(8) == Some(b.len()));
            let Some(per) = per else {
                return Err(f.malformed("the key basis has the wrong size"));
            };
            let x: Vec<f32> = b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            if hex(&Sha256::digest(&b)) != m.identity.key_basis_sha256 {
                return Err(f.malformed("the key basis does not match its recorded hash"));
            }
            f.basis = Some((x[..per].to_vec(), x[per..].to_vec()));
        }
        Ok(f)
    }

    /// `base` with the KV layout the session was saved in: key and value
    /// formats, page size and the saved key basis (so restoring needs no
    /// calibration).
    ///
    /// The session must have been made with this model and tokenizer (the
    /// rest of the identity is checked by [`Engine::restore_session`]),
    /// and its layout must be one this model can have.
    pub fn engine_options(
        &self,
        model: &snug_model::arch::Model,
        identity: &ModelIdentity,
        base: EngineOptions,
    ) -> Result<EngineOptions, SessionError> {
        let id = &self.meta.identity;
        let c = &model.config;
        let here = Identity {
            model_sha256: identity.model_sha256.clone(),
            tokenizer_sha256: identity.tokenizer_sha256.clone(),
            arch: c.arch.name.to_string(),
            layers: c.layers,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            ..id.clone()
        };
        self.check_identity(&here)?;
        let format = |name: &str| match KvFormat::parse(name) {
            Some(f) if f.supports_head_dim(c.head_dim) => Ok(f),
            _ => Err(self.malformed(&format!("KV format {name:?} for head size {}", c.head_dim))),
        };
        if !(1..=MAX_PAGE_TOKENS).contains(&id.page_tokens) {
            return Err(self.malformed(&format!("{} positions a page", id.page_tokens)));
        }
        let mut o = base;
        o.kv_format = format(&id.kv_k)?;
        o.kv_format_v = Some(format(&id.kv_v)?);
        o.page_tokens = id.page_tokens;
        o.key_basis = self.basis.as_ref().and_then(|(offset, weight)| {
            let c = &model.config;
            (id.layers == c.layers && id.kv_heads == c.kv_heads && id.head_dim == c.head_dim).then(|| {
                let mut b = KeyBasis::identity(c.layers, c.kv_heads, c.head_dim, model.layer_ropes());
                b.offset.clone_from(offset);
                b.weight.clone_from(weight);
                std::sync::Arc::new(b)
            })
        });
        Ok(o)
    }

    fn malformed(&self, what: &str) -> SessionError {
        SessionError::Malformed {
            path: self.path.display().to_string(),
            what: what.to_string(),
        }
    }

    fn section(&self, tag: &str) -> Result<Entry, SessionError> {
        self.entries
            .iter()
            .find(|e| e.tag == tag.as_bytes())
            .copied()
            .ok_or_else(|| self.malformed(&format!("no {tag} section")))
    }

    /// A small section's bytes, checked against its checksum.
    fn read_section(&self, tag: &str) -> Result<Vec<u8>, SessionError> {
        let e = self.section(tag)?;
        if e.len > 1 << 32 {
            return Err(self.malformed(&format!("the {tag} section claims {} bytes", e.len)));
        }
        let mut b = vec![0u8; e.len as usize];
        self.file
            .read_exact_at(&mut b, e.offset)
            .map_err(|source| SessionError::Io {
                path: self.path.display().to_string(),
                source,
            })?;
        if crc32fast::hash(&b) != e.crc {
            return Err(SessionError::Checksum {
                path: self.path.display().to_string(),
                section: format!("{tag} section's"),
            });
        }
        Ok(b)
    }

    /// Checks every section's checksum (the KV ones too), reading the
    /// whole file.
    pub fn verify(&self) -> Result<(), SessionError> {
        for e in &self.entries {
            let mut crc = crc32fast::Hasher::new();
            let mut buf = vec![0u8; 1 << 20];
            let mut at = e.offset;
            let end = e.offset + e.len;
            while at < end {
                let n = ((end - at) as usize).min(buf.len());
                self.file
                    .read_exact_at(&mut buf[..n], at)
                    .map_err(|source| SessionError::Io {
                        path: self.path.display().to_string(),
                        source,
                    })?;
                crc.update(&buf[..n]);
                at += n as u64;
            }
            if crc.finalize() != e.crc {
                return Err(SessionError::Checksum {
                    path: self.path.display().to_string(),
                    section: format!("{} section's", String::from_utf8_lossy(&e.tag)),
                });
            }
        }
        Ok(())
    }

    /// The sections: tag, offset, bytes.
    pub fn sections(&self) -> Vec<(String, u64, u64)> {
        self.entries
            .iter()
            .map(|e| (String::from_utf8_lossy(&e.tag).into_owned(), e.offset, e.len))
            .collect()
    }

    /// Refuses the session unless it was made for `here`, saying which
    /// part differs.
    pub fn check_identity(&self, here: &Identity) -> Result<(), SessionError> {
        let s = &self.meta.identity;
        let short = |x: &str| x.chars().take(12).collect::<String>();
        let differ = |what: &'static str, saved: String, here: String| SessionError::Mismatch {
            path: self.path.display().to_string(),
            what,
            saved,
            here,
        };
        if s.model_sha256 != here.model_sha256 {
            return Err(differ(
                "model",
                format!("{} (sha256 {})", self.meta.model_name, short(&s.model_sha256)),
                format!("sha256 {}", short(&here.model_sha256)),
            ));
        }
        if s.tokenizer_sha256 != here.tokenizer_sha256 {
            return Err(differ(
                "tokenizer",
                short(&s.tokenizer_sha256),
                short(&here.tokenizer_sha256),
            ));
        }
        if (&s.arch, s.layers, s.kv_heads, s.head_dim) != (&here.arch, here.layers, here.kv_heads, here.head_dim) {
            return Err(differ(
                "KV shape",
                format!("{} {}x{}x{}", s.arch, s.layers, s.kv_heads, s.head_dim),
                format!("{} {}x{}x{}", here.arch, here.layers, here.kv_heads, here.head_dim),
            ));
        }
        if (&s.kv_k, &s.kv_v) != (&here.kv_k, &here.kv_v) {
            return Err(differ(
                "KV format (keys/values)",
                format!("{}/{}", s.kv_k, s.kv_v),
                format!("{}/{}", here.kv_k, here.kv_v),
            ));
        }
        if s.page_tokens != here.page_tokens {
            return Err(differ(
                "KV page size",
                s.page_tokens.to_string(),
                here.page_tokens.to_string(),
            ));
        }
        if s.rotation_sha256 != here.rotation_sha256 {
            return Err(differ(
                "KV rotation",
                short(&s.rotation_sha256),
                short(&here.rotation_sha256),
            ));
        }
        if s.key_basis_sha256 != here.key_basis_sha256 {
            return Err(differ(
                "TQ4 key basis",
                short(&s.key_basis_sha256),
                short(&here.key_basis_sha256),
            ));
        }
        if s.numerics != here.numerics {
            let name = |n: &str| {
                if n.is_empty() {
                    "native".to_string()
                } else {
                    n.to_string()
                }
            };
            return Err(differ("numerics", name(&s.numerics), name(&here.numerics)));
        }
        Ok(())
    }
}
