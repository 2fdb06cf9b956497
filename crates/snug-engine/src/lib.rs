//! snug's engine: it owns all per-sequence state (page tables, tokens) and
//! the KV storage, and drives the model's one forward path. A step reads as
//! a sentence: make room in the page tables (plain bookkeeping), run the
//! forward over the rows, keep the logits.

pub mod calibrate;
pub mod decide;
pub mod device;
pub mod generate;
pub mod grammar;
pub mod laya;
pub mod prefix_disk;
pub mod sampling;
pub mod session;

use std::sync::Arc;

use snug_core::prefix::{self, Key, PrefixCache, PrefixStats};
use snug_core::twins::{TwinPool, Twins, KEEP};
use snug_core::{PagePool, PageTable, PagesError};
use snug_kernels::kv::{KvFormat, KvShape, KvStorage, KvStore};
use snug_kernels::kvbasis::KeyBasis;
use snug_model::arch::{BatchRow, Head, KvView, Model};
use snug_model::backend::WorkspaceSize;

/// A sequence's handle, from [`Engine::create_sequence`]. Handles are
/// reused after [`Engine::free_sequence`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(usize);

impl SeqId {
    /// The handle's slot in the engine's table of sequences.
    pub fn index(self) -> usize {
        self.0
    }
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One row of [`Engine::step`]: `token` appended to sequence `seq`, and
/// whether the row's logits are wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRow {
    pub seq: SeqId,
    pub token: u32,
    pub logits: bool,
}

/// The KV pool's pages ([`Engine::kv_pages`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPages {
    /// In the pool.
    pub total: usize,
    /// Held by sequences or the prefix cache.
    pub used: usize,
    /// Held by the prefix cache alone (evictable).
    pub idle: usize,
}

impl StepRow {
    pub fn new(seq: SeqId, token: u32, logits: bool) -> StepRow {
        StepRow { seq, token, logits }
    }
}

/// Why the engine refused a step.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EngineError {
    #[error("context full: {len} positions + {adding} new exceed the limit of {limit}")]
    ContextFull { len: usize, adding: usize, limit: usize },
    #[error(transparent)]
    Pages(#[from] PagesError),
    #[error("no sequence {0}")]
    NoSequence(SeqId),
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(transparent)]
    Grammar(#[from] crate::grammar::GrammarError),
    #[error("GPU: {0}")]
    Device(String),
}

/// The mean of `n` hidden states (summed in order, in f64), scaled to
/// unit length.
fn pool<'a>(rows: impl Iterator<Item = &'a [f32]>, n: usize, dim: usize) -> Vec<f32> {
    let mut sum = vec![0f64; dim];
    for row in rows {
        for (s, &h) in sum.iter_mut().zip(row) {
            *s += h as f64;
        }
    }
    let n = n as f64;
    let norm = sum.iter().map(|s| (s / n) * (s / n)).sum::<f64>().sqrt();
    sum.iter().map(|s| (s / n / norm.max(1e-12)) as f32).collect()
}

/// Bytes of one KV page (every layer's keys and values for
/// `options.page_tokens` positions) for `model` in the options' formats.
pub fn kv_page_bytes(model: &Model, options: &EngineOptions) -> usize {
    let c = &model.config;
    let fv = options.kv_format_v.unwrap_or(options.kv_format);
    c.layers
        * c.kv_heads
        * options.page_tokens.max(1)
        * (options.kv_format.vector_bytes(c.head_dim) + fv.vector_bytes(c.head_dim))
}

/// How the engine is sized.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub threads: usize,
    /// Most positions one sequence may hold.
    pub ctx: usize,
    /// Format of the keys, and of the values unless `kv_format_v` says.
    pub kv_format: KvFormat,
    pub kv_format_v: Option<KvFormat>,
    pub page_tokens: usize,
    /// Most rows in one forward pass (the prefill chunk).
    pub batch: usize,
    /// Sequences the KV pool is sized for (each up to `ctx`).
    pub max_seqs: usize,
    /// Bytes the KV page pool may take. When `max_seqs` contexts of `ctx`
    /// would need more, the pool is this size and `ctx` shrinks to what
    /// each sequence can hold in it. The exact window's twin pages come
    /// out of it first.
    pub kv_budget: Option<usize>,
    /// What TQ4 keys are coded relative to (see
    /// [`snug_kernels::kvbasis`]; [`calibrate::key_basis`] makes one).
    /// Without it TQ4 keys are coded as they are.
    pub key_basis: Option<Arc<KeyBasis>>,
    /// Keep full pages in a prefix cache, keyed by their tokens, for new
    /// sequences that start the same way (see [`snug_core::prefix`]).
    pub prefix_cache: bool,
    /// Run the forward passes on a GPU, with these weights (uploaded by
    /// the caller after opening the device); KV pages are then in device
    /// memory. See docs/CUDA.md.
    pub gpu: Option<device::Gpu>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: snug_kernels::pool::physical_cores(),
            ctx: 4096,
            kv_format: KvFormat::F16,
            kv_format_v: None,
            page_tokens: 32,
            batch: 64,
            max_seqs: 1,
            kv_budget: None,
            key_basis: None,
            prefix_cache: true,
            gpu: None,
        }
    }
}

struct Sequence {
    table: PageTable,
    tokens: Vec<u32>,
    twins: Twins,
    /// Prefix keys of its full pages, as far as they are registered.
    keys: Vec<Key>,
    /// Whether its pages may enter the prefix cache: not when they grew
    /// from pages read from a session file.
    shareable: bool,
}

/// Twin pages an engine keeps for its exact window (lossy formats only):
/// page 0 and the newest [`KEEP`] pages of every sequence, plus the pages
/// one prefill chunk spans.
fn twin_pages(options: &EngineOptions) -> usize {
    let pt = options.page_tokens.max(1);
    options.max_seqs.max(1) * (KEEP + 2) + options.batch.max(1).div_ceil(pt) + 1
}

fn is_lossy(options: &EngineOptions) -> bool {
    let v = options.kv_format_v.unwrap_or(options.kv_format);
    [options.kv_format, v]
        .iter()
        .any(|f| matches!(f, KvFormat::Q8 | KvFormat::Tq4))
}

/// Positions a KV budget of `budget` bytes holds in `options`' formats
/// (after the exact window's twins, in whole pages), whatever the context
/// limit.
pub fn kv_budget_tokens(model: &Model, options: &EngineOptions, budget: usize) -> usize {
    let pages = budget.saturating_sub(kv_twin_bytes(model, options)) / kv_page_bytes(model, options).max(1);
    pages * options.page_tokens.max(1)
}

/// Bytes of the exact window's twin pages (F16, every layer) for `model`.
pub fn kv_twin_bytes(model: &Model, options: &EngineOptions) -> usize {
    if !is_lossy(options) {
        return 0;
    }
    let c = &model.config;
    twin_pages(options)
        * c.layers
        * c.kv_heads
        * options.page_tokens.max(1)
        * 2
        * KvFormat::F16.vector_bytes(c.head_dim)
}

/// The engine over one model.
pub struct Engine<'m> {
    pub model: &'m Model<'m>,
    pub options: EngineOptions,
    pages: PagePool,
    twin_pool: TwinPool,
    storage: device::Kv,
    scratch: device::Scratch,
    logits: Vec<f32>,
    seqs: Vec<Option<Sequence>>,
    /// Measured seconds per forward by row count, for speculation.
    spec_costs: Option<Vec<(usize, f64)>>,
    prefix: Option<PrefixCache>,
    disk: Option<prefix_disk::DiskTier>,
    /// Rows run through the forward pass so far.
    rows_computed: u64,
    /// The context a sequence may have as asked for (and as the model
    /// allows), before the KV budget shrank `options.ctx` to what fits.
    context_limit: usize,
    /// Label scores of decision questions on a content-free state, by
    /// the tokens of that state and question (see [`decide`]).
    decide_priors: std::collections::HashMap<Vec<u32>, Vec<f32>>,
}

impl<'m> Engine<'m> {
    /// An engine on the CPU, or on the GPU `options.gpu` names.
    ///
    /// # Panics
    /// Where `options.gpu` is set and the device cannot hold the KV pages
    /// or buffers: use [`Engine::try_new`] there.
    pub fn new(model: &'m Model<'m>, options: EngineOptions) -> Engine<'m> {
        Engine::try_new(model, options).expect("an engine on the CPU is always made")
    }

    /// [`Engine::new`], with a GPU that cannot hold the engine's KV pages
    /// or buffers (or a KV format it does not run) an error.
    pub fn try_new(model: &'m Model<'m>, mut options: EngineOptions) -> Result<Engine<'m>, EngineError> {
        let c = &model.config;
        options.ctx = options.ctx.clamp(1, c.context_length.max(1));
        let context_limit = options.ctx;
        options.batch = options.batch.max(1);
        options.threads = options.threads.max(1);
        let shape = KvShape {
            layers: c.layers,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            page_tokens: options.page_tokens.max(1),
        };
        let seqs = options.max_seqs.max(1);
        let mut n_pages = seqs * options.ctx.div_ceil(shape.page_tokens);
        if let Some(budget) = options.kv_budget {
            let budget = budget.saturating_sub(kv_twin_bytes(model, &options));
            let fit = (budget / kv_page_bytes(model, &options).max(1)).max(seqs);
            if fit < n_pages {
                n_pages = fit;
                // One sequence may grow to the whole pool; sharing it
                // between several is admission's work (the scheduler).
                options.ctx = options.ctx.min(n_pages * shape.page_tokens);
            }
        }
        let twins = if is_lossy(&options) { twin_pages(&options) } else { 0 };
        let formats = (options.kv_format, options.kv_format_v.unwrap_or(options.kv_format));
        let size = WorkspaceSize {
            rows: options.batch,
            // Lossy pages on the CPU are read page by page; the GPU's
            // kernels keep a row's scores for its whole context.
            ctx: if is_lossy(&options) && options.gpu.is_none() {
                0
            } else {
                options.ctx
            },
            page_tokens: shape.page_tokens,
            threads: options.threads,
        };
        let (storage, scratch) = if options.gpu.is_some() {
            let kv = device::gpu_kv(shape, formats, n_pages, twins, options.key_basis.clone())
                .map_err(EngineError::Device)?;
            let dev = snug_cuda::Device::current().ok_or(EngineError::Device("no CUDA device is open".into()))?;
            let ws = snug_cuda::CudaWorkspace::new(&dev, c, size).map_err(|e| EngineError::Device(e.to_string()))?;
            (device::Kv::Cuda(kv), device::Scratch::Cuda(ws))
        } else {
            let mut storage = KvStorage::with_formats(shape, formats.0, formats.1, n_pages).with_twins(twins);
            if let Some(b) = &options.key_basis {
                storage = storage.with_key_basis(b.clone());
            }
            (device::Kv::Cpu(storage), device::Scratch::Cpu(model.workspace(size)))
        };
        Ok(Engine {
            model,
            pages: PagePool::new(n_pages, shape.page_tokens),
            twin_pool: TwinPool::new(twins),
            storage,
            scratch,
            logits: Vec::new(),
            seqs: Vec::new(),
            spec_costs: None,
            prefix: options.prefix_cache.then(PrefixCache::new),
            disk: None,
            rows_computed: 0,
            context_limit,
            decide_priors: std::collections::HashMap::new(),
            options,
        })
    }

    /// The context asked for (within the model's), which
    /// `options.ctx` is at most: where they differ, the KV budget is the
    /// limit, not the context.
    pub fn context_limit(&self) -> usize {
        self.context_limit
    }

    /// A new, empty sequence.
    pub fn create_sequence(&mut self) -> SeqId {
        let s = Sequence {
            table: PageTable::new(),
            tokens: Vec::new(),
            twins: Twins::new(),
            keys: Vec::new(),
            shareable: true,
        };
        match self.seqs.iter().position(Option::is_none) {
            Some(i) => {
                self.seqs[i] = Some(s);
                SeqId(i)
            }
            None => {
                self.seqs.push(Some(s));
                SeqId(self.seqs.len() - 1)
            }
        }
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence, EngineError> {
        self.seqs
            .get(id.0)
            .and_then(Option::as_ref)
            .ok_or(EngineError::NoSequence(id))
    }

    /// The tokens a sequence holds.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32], EngineError> {
        Ok(&self.seq(id)?.tokens)
    }

    /// Whether `n` more positions fit the sequence: within the context
    /// limit, with enough free pages.
    pub fn has_room(&self, id: SeqId, n: usize) -> Result<bool, EngineError> {
        let s = self.seq(id)?;
        let idle = self.prefix.as_ref().map_or(0, |c| c.idle_pages(&self.pages));
        Ok(s.tokens.len() + n <= self.options.ctx
            && s.table.pages_needed(&self.pages, n) <= self.pages.free_pages() + idle)
    }

    /// Drops a sequence and returns its pages.
    pub fn free_sequence(&mut self, id: SeqId) {
        self.register_pages(id);
        if let Some(Some(mut s)) = self.seqs.get_mut(id.0).map(Option::take) {
            if let Some(c) = &mut self.prefix {
                c.touch_chain(&s.keys);
            }
            s.table.release(&mut self.pages);
            s.twins.release(&mut self.twin_pool);
        }
    }

    /// Keeps the first `len` positions of a sequence (rollback). With an
    /// exact window, a truncation deep enough that the last, partly filled
    /// page lost its twin recomputes that page's positions (fewer than a
    /// page), which rebuilds the twin bit for bit.
    pub fn truncate(&mut self, id: SeqId, len: usize) -> Result<(), EngineError> {
        let pt = self.storage.shape().page_tokens;
        let s = self
            .seqs
            .get_mut(id.0)
            .and_then(Option::as_mut)
            .ok_or(EngineError::NoSequence(id))?;
        let len = len.min(s.tokens.len());
        s.table.truncate(&mut self.pages, len);
        let lost = if self.storage.is_lossy() {
            s.twins.truncate(&mut self.twin_pool, len, pt)
        } else {
            None
        };
        let redo = match lost {
            Some(page) => {
                let start = page * pt;
                let redo = s.tokens[start..len].to_vec();
                s.table.truncate(&mut self.pages, start);
                s.tokens.truncate(start);
                s.twins.truncate(&mut self.twin_pool, start, pt);
                redo
            }
            None => {
                s.tokens.truncate(len);
                Vec::new()
            }
        };
        s.keys.truncate(s.tokens.len() / pt);
        if !redo.is_empty() {
            let rows: Vec<StepRow> = redo.iter().map(|&t| StepRow::new(id, t, false)).collect();
            self.step(&rows)?;
        }
        Ok(())
    }

    /// A new sequence sharing every position of `id` (copy-on-write).
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId, EngineError> {
        let s = self.seq(id)?;
        let tokens = s.tokens.clone();
        let table = s.table.clone();
        let parent_twins = s.twins.clone();
        let keys = s.keys.clone();
        let shareable = s.shareable;
        let (twins, copies) = parent_twins.fork(&mut self.twin_pool)?;
        for (from, to) in copies {
            self.storage.copy_twin(from, to);
        }
        let table = table.fork(&mut self.pages);
        let new = self.create_sequence();
        self.seqs[new.0] = Some(Sequence {
            table,
            tokens,
            twins,
            keys,
            shareable,
        });
        Ok(new)
    }

    /// The KV pool's pages.
    pub fn kv_pages(&self) -> KvPages {
        KvPages {
            total: self.pages.total_pages(),
            used: self.pages.used_pages(),
            idle: self.prefix.as_ref().map_or(0, |c| c.idle_pages(&self.pages)),
        }
    }

    /// Bytes of KV storage, total and in use (pages only; the exact
    /// window is [`Engine::kv_exact_window_bytes`]).
    pub fn kv_bytes(&self) -> (usize, usize) {
        let per = self.storage.page_bytes();
        (self.storage.bytes(), self.pages.used_pages() * per)
    }

    /// Positions the KV page pool holds in all (every page, every
    /// sequence).
    pub fn kv_capacity_tokens(&self) -> usize {
        self.pages.total_pages() * self.storage.shape().page_tokens
    }

    /// Bytes of the exact window: twin pages (total and in use) plus the
    /// key basis and its tables.
    pub fn kv_exact_window_bytes(&self) -> (usize, usize) {
        let total = self.storage.exact_window_bytes();
        let free = self.twin_pool.free() * self.storage.twin_page_bytes();
        (total, total - free)
    }

    /// Rows the forward pass has computed since the engine was made
    /// (prefill, decode, verify and recomputed rows alike).
    pub fn rows_computed(&self) -> u64 {
        self.rows_computed
    }

    /// Bytes of forward scratch.
    pub fn scratch_bytes(&self) -> usize {
        self.scratch.bytes()
    }

    /// Bytes of weights in device memory, where the forward passes run on
    /// a GPU (whose KV pages and scratch are then device memory too).
    pub fn device_weights_bytes(&self) -> Option<usize> {
        self.options.gpu.as_ref().map(|g| g.0.bytes)
    }

    /// Runs one forward pass over `rows`: each token is appended to its
    /// sequence. Returns the logits of the rows
    /// that want them, in order (`vocab` floats each).
    pub fn step(&mut self, rows: &[StepRow]) -> Result<&[f32], EngineError> {
        self.step_to(rows, Head::Logits)
    }

    /// The logits of the last [`Engine::step`], taken out of the engine's
    /// buffer (no copy: a verify's or a batch's rows of logits are
    /// megabytes) so that they can be read while the engine is used. Give
    /// the buffer back with [`Engine::give_back_logits`] for the next step
    /// to reuse; a step without it allocates one.
    pub fn take_logits(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.logits)
    }

    /// Returns a buffer [`Engine::take_logits`] took (its contents are
    /// stale once the next step runs).
    pub fn give_back_logits(&mut self, logits: Vec<f32>) {
        self.logits = logits;
    }

    /// [`Engine::step`], handing back what `head` asks for of the rows that
    /// want output (logits, or the normed last hidden states).
    fn step_to(&mut self, rows: &[StepRow], head: Head) -> Result<&[f32], EngineError> {
        let vocab = self.model.config.vocab;
        for &StepRow {
            seq: id, token: tok, ..
        } in rows
        {
            self.seq(id)?;
            if tok as usize >= vocab {
                return Err(EngineError::BadToken(tok));
            }
        }
        // Pages that filled in earlier steps and were not rolled back
        // since (a rejected draft's are gone by now) enter the prefix cache.
        for &StepRow { seq: id, .. } in rows {
            self.register_pages(id);
        }
        // Plan: how many positions each sequence gains, and does it fit.
        let mut gains: Vec<(SeqId, usize)> = Vec::new();
        for &StepRow { seq: id, .. } in rows {
            match gains.iter_mut().find(|g| g.0 == id) {
                Some(g) => g.1 += 1,
                None => gains.push((id, 1)),
            }
        }
        let mut needed = 0;
        for &(id, n) in &gains {
            let s = self.seq(id)?;
            if s.tokens.len() + n > self.options.ctx {
                return Err(EngineError::ContextFull {
                    len: s.tokens.len(),
                    adding: n,
                    limit: self.options.ctx,
                });
            }
            needed += s.table.pages_needed(&self.pages, n);
        }
        if needed > self.pages.free_pages() {
            if let Some(c) = &mut self.prefix {
                c.evict(&mut self.pages, needed, |_, _| {});
            }
        }
        if needed > self.pages.free_pages() {
            return Err(EngineError::Pages(PagesError::OutOfPages {
                needed,
                free: self.pages.free_pages(),
                total: self.pages.total_pages(),
            }));
        }
        let pt = self.storage.shape().page_tokens;
        let lossy = self.storage.is_lossy();
        if lossy {
            // Twins are handed out chunk by chunk and the ones a chunk no
            // longer needs returned after it, so the most held at once is
            // what the first chunk of each sequence takes.
            let twins: usize = gains
                .iter()
                .map(|&(id, n)| {
                    let s = self.seqs[id.0].as_ref().expect("checked above");
                    let lo = s.tokens.len();
                    s.twins.needed(lo, lo + n.min(self.options.batch) - 1, pt)
                })
                .sum();
            if twins > self.twin_pool.free() {
                return Err(EngineError::Pages(PagesError::OutOfTwins {
                    needed: twins,
                    free: self.twin_pool.free(),
                    total: self.twin_pool.total(),
                }));
            }
        }
        // Apply: grow the tables, copying shared pages first.
        let mut batch_rows = Vec::with_capacity(rows.len());
        let mut seq_index: Vec<SeqId> = Vec::new();
        for &(id, n) in &gains {
            let s = self.seqs[id.0].as_mut().expect("checked above");
            if let Some(copy) = s.table.append(&mut self.pages, n)? {
                self.storage.copy_page(copy.from, copy.to);
            }
            seq_index.push(id);
        }
        for &StepRow {
            seq: id,
            token: tok,
            logits: want,
        } in rows
        {
            let s = self.seqs[id.0].as_mut().expect("checked above");
            let pos = s.tokens.len();
            s.tokens.push(tok);
            batch_rows.push(BatchRow {
                seq: seq_index.iter().position(|&x| x == id).expect("listed"),
                pos,
                token: tok,
                logits: want,
            });
        }
        self.logits.clear();
        for chunk in batch_rows.chunks(self.options.batch) {
            // Each sequence's rows in this chunk, in position order.
            let spans: Vec<Option<(usize, usize)>> = (0..seq_index.len())
                .map(|si| {
                    let mut pos = chunk.iter().filter(|r| r.seq == si).map(|r| r.pos);
                    let lo = pos.next()?;
                    Some((lo, pos.next_back().unwrap_or(lo)))
                })
                .collect();
            if lossy {
                for (si, span) in spans.iter().enumerate() {
                    if let Some((lo, hi)) = *span {
                        let s = self.seqs[seq_index[si].0].as_mut().expect("checked above");
                        let stale = s.twins.prepare(&mut self.twin_pool, lo, hi, pt)?;
                        assert!(stale.is_empty(), "a page read exactly lost its twin");
                    }
                }
            }
            let seqs: Vec<&Sequence> = seq_index
                .iter()
                .map(|&id| self.seqs[id.0].as_ref().expect("checked"))
                .collect();
            let tables: Vec<&[u32]> = seqs.iter().map(|s| s.table.pages()).collect();
            let twins: Vec<&[u32]> = seqs
                .iter()
                .map(|s| if lossy { s.twins.as_slice() } else { &[] })
                .collect();
            match (&mut self.storage, &mut self.scratch) {
                (device::Kv::Cpu(storage), device::Scratch::Cpu(ws)) => {
                    let mut view = KvView {
                        storage,
                        pages: &tables,
                        twins: &twins,
                    };
                    self.model.forward_to(chunk, &mut view, ws, head, &mut self.logits);
                }
                (device::Kv::Cuda(storage), device::Scratch::Cuda(ws)) => {
                    let gpu = self.options.gpu.as_ref().expect("a GPU engine has its weights");
                    let mut view = KvView {
                        storage,
                        pages: &tables,
                        twins: &twins,
                    };
                    let c = &self.model.config;
                    snug_model::arch::forward::<snug_cuda::Cuda>(
                        c,
                        &gpu.0.weights,
                        chunk,
                        &mut view,
                        ws,
                        head,
                        &mut self.logits,
                    );
                    ws.check().map_err(|e| EngineError::Device(e.to_string()))?;
                }
                _ => unreachable!("an engine's pages and buffers are on one device"),
            }
            if lossy {
                for (si, span) in spans.iter().enumerate() {
                    if let Some((_, hi)) = *span {
                        let s = self.seqs[seq_index[si].0].as_mut().expect("checked above");
                        s.twins.settle(&mut self.twin_pool, hi + 1, pt);
                    }
                }
            }
        }
        self.rows_computed += rows.len() as u64;
        Ok(&self.logits)
    }

    /// Enters the sequence's full pages not yet there in the prefix cache
    /// (and its disk tier). Called when their tokens are settled: before
    /// the sequence's next step, at the end of a generation, when it is
    /// freed.
    fn register_pages(&mut self, id: SeqId) {
        let Some(cache) = &mut self.prefix else { return };
        let pt = self.storage.shape().page_tokens;
        let Some(Some(s)) = self.seqs.get_mut(id.0) else { return };
        if !s.shareable {
            return;
        }
        while s.keys.len() < s.tokens.len() / pt {
            let i = s.keys.len();
            let parent = if i == 0 { prefix::ROOT } else { s.keys[i - 1] };
            let key = prefix::chain(&parent, &s.tokens[i * pt..(i + 1) * pt]);
            let page = s.table.pages()[i];
            cache.insert_page(&mut self.pages, &parent, key, &s.tokens[i * pt..(i + 1) * pt], page);
            if let Some(d) = &mut self.disk {
                match d.write(&key, &self.storage, page) {
                    Ok(true) => cache.stats.disk_writes += 1,
                    Ok(false) => {}
                    Err(_) => cache.stats.disk_errors += 1,
                }
            }
            s.keys.push(key);
        }
    }

    /// Starts an empty sequence with the longest run of `prompt`'s full
    /// pages that the prefix cache holds (in RAM, or in its disk tier),
    /// shared instead of prefilled; at least the prompt's last token is
    /// left to feed. With lossy pages the first page is computed rather
    /// than shared, which rebuilds its exact twin (a shared page's bytes
    /// are the same either way). Returns the positions the sequence holds.
    pub fn share_prefix(&mut self, id: SeqId, prompt: &[u32]) -> Result<usize, EngineError> {
        let pt = self.storage.shape().page_tokens;
        if !self.seq(id)?.tokens.is_empty() || prompt.len() > self.options.ctx {
            return Ok(self.seq(id)?.tokens.len());
        }
        let Some(cache) = &mut self.prefix else { return Ok(0) };
        cache.stats.lookups += 1;
        let keys = prefix::keys(prompt, pt, prompt.len().saturating_sub(1) / pt);
        let disk = &self.disk;
        let available = keys
            .iter()
            .take_while(|k| cache.contains(k) || disk.as_ref().is_some_and(|d| d.contains(k)))
            .count();
        let lossy = self.storage.is_lossy();
        let first = usize::from(lossy);
        if available <= first {
            return Ok(0);
        }
        if lossy {
            self.feed(id, &prompt[..pt])?;
        }
        let cache = self.prefix.as_mut().expect("checked above");
        let s = self.seqs[id.0].as_mut().expect("checked above");
        let mut shared = 0;
        for (j, key) in keys.iter().enumerate().take(available).skip(first) {
            let page = match cache.get(key) {
                Some(p) => {
                    self.pages.retain(p);
                    p
                }
                None => {
                    if self.pages.free_pages() == 0 {
                        cache.evict(&mut self.pages, 1, |_, _| {});
                    }
                    let Some(d) = self.disk.as_mut() else { break };
                    let Some(p) = self.pages.alloc() else { break };
                    if !d.read(key, &mut self.storage, p) {
                        self.pages.release(p);
                        break;
                    }
                    let parent = if j == 0 { prefix::ROOT } else { keys[j - 1] };
                    cache.insert_page(&mut self.pages, &parent, *key, &prompt[j * pt..(j + 1) * pt], p);
                    cache.stats.disk_hits += 1;
                    p
                }
            };
            s.table.push_full(page, pt);
            s.tokens.extend_from_slice(&prompt[j * pt..(j + 1) * pt]);
            s.keys.push(*key);
            shared += 1;
        }
        if lossy {
            s.twins.settle(&mut self.twin_pool, s.tokens.len(), pt);
        }
        if shared > 0 {
            cache.stats.hits += 1;
            cache.stats.reused_tokens += (shared * pt) as u64;
        }
        Ok(s.tokens.len())
    }

    /// Adds a disk tier to the prefix cache: page files under
    /// `root/<identity>`, at most `cap` bytes, where `<identity>` hashes
    /// the model and KV layout (see [`session::Identity`]).
    pub fn enable_prefix_disk(
        &mut self,
        root: &std::path::Path,
        cap: u64,
        model: &session::ModelIdentity,
    ) -> std::io::Result<()> {
        use sha2::Digest;
        let id = serde_json::to_vec(&self.session_identity(model)).expect("the identity serializes");
        let name: String = sha2::Sha256::digest(&id)[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.disk = Some(prefix_disk::DiskTier::open(root, &name, cap)?);
        Ok(())
    }

    /// Starts logging what enters and leaves the prefix cache (see
    /// [`prefix::CacheEvent`]); a no-op when the cache is off.
    pub fn record_cache_events(&mut self) {
        if let Some(c) = &mut self.prefix {
            c.record_events();
        }
    }

    /// The prefix cache's events since the last call, oldest first.
    pub fn take_cache_events(&mut self) -> Vec<prefix::CacheEvent> {
        self.prefix.as_mut().map(PrefixCache::take_events).unwrap_or_default()
    }

    /// What the prefix cache did so far (`None` when it is off).
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix.as_ref().map(|c| c.stats)
    }

    /// The disk tier's folder and bytes, if there is one.
    pub fn prefix_disk(&self) -> Option<(&std::path::Path, u64)> {
        self.disk.as_ref().map(|d| (d.dir(), d.bytes()))
    }

    /// Seconds per forward of 1, 2, 3, 5, 9, 13 and 17 rows (a decode
    /// step, and verifies of 1, 2, 4, 8, 12 and 16 draft tokens) on this
    /// machine, measured
    /// once per engine by appending rows of `token` to `seq` and rolling
    /// them back: two passes over the row counts, the faster of each
    /// count's two times kept (a first forward can be slowed by cold
    /// caches, and the machine by other work). Empty when the sequence has
    /// no room for the measurement. The policy charges a row count between
    /// two measured ones the larger one's cost, so the short verifies are
    /// measured: where a step is bound by reading the weights, a verify of
    /// one or two tokens costs little more than a decode step, and `auto`
    /// can only find that out by measuring it.
    pub fn speculation_costs(&mut self, seq: SeqId, token: u32) -> Result<Vec<(usize, f64)>, EngineError> {
        if let Some(c) = &self.spec_costs {
            return Ok(c.clone());
        }
        let held = self.tokens(seq)?.len();
        let most = snug_core::speculate::MAX_DRAFT + 1;
        if held + most > self.options.ctx {
            return Ok(Vec::new());
        }
        let counts = [1, 2, 3, 5, 9, 13, most];
        let mut best = counts.map(|_| f64::INFINITY);
        for _pass in 0..2 {
            for (i, &rows) in counts.iter().enumerate() {
                let t = std::time::Instant::now();
                let r = self.step(&vec![StepRow::new(seq, token, true); rows]).map(|_| ());
                let secs = t.elapsed().as_secs_f64();
                self.truncate(seq, held)?;
                match r {
                    Ok(()) => best[i] = best[i].min(secs),
                    Err(EngineError::Pages(_)) => return Ok(Vec::new()),
                    Err(e) => return Err(e),
                }
            }
        }
        let costs: Vec<(usize, f64)> = counts.into_iter().zip(best).collect();
        self.spec_costs = Some(costs.clone());
        Ok(costs)
    }

    /// Forward costs measured earlier on this machine for this model and
    /// thread count (as [`Engine::speculation_costs`] returns them), to use
    /// instead of measuring. Entries outside 1..=17 rows or not positive are
    /// dropped; fewer than two leave the engine to measure.
    pub fn set_speculation_costs(&mut self, costs: &[(usize, f64)]) {
        let ok: Vec<(usize, f64)> = costs
            .iter()
            .copied()
            .filter(|&(r, s)| (1..=snug_core::speculate::MAX_DRAFT + 1).contains(&r) && s.is_finite() && s > 0.0)
            .collect();
        if ok.len() >= 2 {
            self.spec_costs = Some(ok);
        }
    }

    /// The forward costs this engine measured or was given, if any.
    pub fn known_speculation_costs(&self) -> Option<&[(usize, f64)]> {
        self.spec_costs.as_deref()
    }

    /// An embedding of `tokens`: the mean of their last hidden states
    /// (after the output norm), scaled to unit length. The tokens run
    /// through a sequence of their own in prefill chunks, which is freed
    /// after; each row's state does not depend on the chunking (batch
    /// invariance) and the sum runs in position order, so the vector is
    /// the same bits however the work is split.
    pub fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let dim = self.model.config.dim;
        let id = self.create_sequence();
        let mut hidden = Vec::with_capacity(tokens.len() * dim);
        let mut run = || -> Result<(), EngineError> {
            for chunk in tokens.chunks(self.options.batch.max(1)) {
                let rows: Vec<StepRow> = chunk.iter().map(|&t| StepRow::new(id, t, true)).collect();
                hidden.extend_from_slice(self.step_to(&rows, Head::Hidden)?);
            }
            Ok(())
        };
        let r = run();
        self.free_sequence(id);
        r?;
        Ok(pool(hidden.chunks_exact(dim), tokens.len(), dim))
    }

    /// Embeddings of several inputs ([`Engine::embed`] each), with short
    /// inputs' rows run together, up to `options.batch` rows a forward:
    /// each row's state is what it would be alone (batch invariance), so
    /// the vectors are the same bits as one input at a time.
    pub fn embed_batch(&mut self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let batch = self.options.batch.max(1);
        let dim = self.model.config.dim;
        let mut out = Vec::with_capacity(inputs.len());
        let mut i = 0;
        while i < inputs.len() {
            let mut j = i + 1;
            let mut rows = inputs[i].len();
            while j < inputs.len() && rows + inputs[j].len() <= batch {
                rows += inputs[j].len();
                j += 1;
            }
            let group = &inputs[i..j];
            i = j;
            if group.len() == 1 || group.iter().any(Vec::is_empty) {
                for t in group {
                    out.push(self.embed(t)?);
                }
                continue;
            }
            let seqs: Vec<SeqId> = group.iter().map(|_| self.create_sequence()).collect();
            let step: Vec<StepRow> = group
                .iter()
                .zip(&seqs)
                .flat_map(|(t, &id)| t.iter().map(move |&tok| StepRow::new(id, tok, true)))
                .collect();
            let hidden = self.step_to(&step, Head::Hidden).map(<[f32]>::to_vec);
            for &id in &seqs {
                self.free_sequence(id);
            }
            let hidden = match hidden {
                Ok(h) => h,
                // No room for the group at once: one input at a time.
                Err(EngineError::Pages(_)) => {
                    for t in group {
                        out.push(self.embed(t)?);
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut rows = hidden.chunks_exact(dim);
            for t in group {
                out.push(pool(rows.by_ref().take(t.len()), t.len(), dim));
            }
        }
        Ok(out)
    }

    /// Appends `tokens` to a sequence in prefill chunks; returns the logits
    /// after the last one.
    pub fn feed(&mut self, id: SeqId, tokens: &[u32]) -> Result<&[f32], EngineError> {
        let mut start = 0;
        for end in self.feed_breaks(tokens.len()) {
            let rows: Vec<StepRow> = tokens[start..end].iter().map(|&t| StepRow::new(id, t, false)).collect();
            self.step(&rows)?;
            start = end;
        }
        let rows: Vec<StepRow> = tokens[start..]
            .iter()
            .enumerate()
            .map(|(i, &t)| StepRow::new(id, t, start + i + 1 == tokens.len()))
            .collect();
        self.step(&rows)
    }

    /// Where [`Engine::feed`] ends a forward early. Under the ggml numerics
    /// on a model with a sliding window, llama.cpp's server ends its prompt
    /// batches 516 and 4 tokens before the end (to keep state checkpoints),
    /// and since its products' last bits depend on the batch
    /// ([`snug_kernels::ggml::Kernel`]), so does snug then. Otherwise none:
    /// a row's result does not depend on the batch.
    fn feed_breaks(&self, n: usize) -> Vec<usize> {
        let ggml = self.model.numerics == snug_kernels::ggml::Numerics::Ggml;
        if !ggml || self.model.config.sliding_window.is_none() {
            return Vec::new();
        }
        [516, 4].iter().filter(|&&k| n > k).map(|&k| n - k).collect()
    }
}
