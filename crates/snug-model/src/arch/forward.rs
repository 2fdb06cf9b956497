//! The one forward path: a batch of rows through every layer, reading and
//! writing KV through the engine's page lists.
//!
//! Each row is (sequence, position, token). A row's keys and values are
//! written to its sequence's page at its position before attention runs, so
//! a prefill chunk attends causally within itself, and a verify batch of k
//! draft tokens sees each earlier draft. Every kernel computes a row from
//! that row alone in a fixed order; the bits of a row's logits and KV
//! therefore do not depend on the batch.

use snug_kernels::ggml::{self, Numerics};
use snug_kernels::kv::{attend_group_ggml, attend_rows, AttnQuery, AttnRow, AttnScratch, KvSlot, KvStorage, NO_TWIN};
use snug_kernels::kvbasis::KeyStats;
use snug_kernels::matmul::{matmul, matmul_ggml, MatmulScratch, Weight};
use snug_kernels::ops::{add, gelu_mul, rms_norm, silu_mul, Rope};
use snug_kernels::pool::ThreadPool;
use snug_kernels::vec::committed;

use super::config::Arch;
use super::weights::Model;

/// One row of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRow {
    /// Index of the row's sequence in [`KvView::pages`].
    pub seq: usize,
    /// Position of the token in its sequence.
    pub pos: usize,
    pub token: u32,
    /// Whether logits are wanted for this row.
    pub logits: bool,
}

/// The engine's KV storage and, per sequence of the batch, its pages. Every
/// row's position must already have a page.
pub struct KvView<'a> {
    pub storage: &'a mut KvStorage,
    pub pages: &'a [&'a [u32]],
    /// Per sequence, each page's twin ([`snug_kernels::kv::NO_TWIN`] where
    /// none); empty slices when the cache keeps no exact window.
    pub twins: &'a [&'a [u32]],
}

/// Buffers for a forward pass, sized once for the largest batch.
pub struct ForwardScratch {
    max_rows: usize,
    x: Vec<f32>,    // [row][dim] residual stream
    h: Vec<f32>,    // [row][dim] normalized input of a sublayer
    q: Vec<f32>,    // [row][heads * head_dim]
    k: Vec<f32>,    // [row][kv_heads * head_dim]
    v: Vec<f32>,    // [row][kv_heads * head_dim]
    attn: Vec<f32>, // [row][heads * head_dim]
    o: Vec<f32>,    // [row][dim]
    gate: Vec<f32>, // [row][ff]
    up: Vec<f32>,   // [row][ff]
    sel: Vec<f32>,  // [logit row][dim]
    attn_threads: Vec<std::sync::Mutex<AttnScratch>>,
    mm: MatmulScratch,
    ropes: Vec<Rope>, // [global, local]
    /// Sums of pre-RoPE keys and of queries, gathered while set (the key
    /// basis' calibration); position 0 is left out.
    pub probe: Option<KeyStats>,
}

impl ForwardScratch {
    /// Scratch for batches of up to `max_rows` rows over contexts of up to
    /// `max_ctx` positions, on `threads` threads, with KV pages of
    /// `page_tokens` positions. Attention over lossy KV pages needs no
    /// scratch per position: pass `max_ctx = 0` for those.
    pub fn new(model: &Model, max_rows: usize, max_ctx: usize, threads: usize, page_tokens: usize) -> ForwardScratch {
        let c = &model.config;
        let qd = c.heads * c.head_dim;
        let kvd = c.kv_heads * c.head_dim;
        ForwardScratch {
            max_rows,
            x: committed(0.0, max_rows * c.dim),
            h: committed(0.0, max_rows * c.dim),
            q: committed(0.0, max_rows * qd),
            k: committed(0.0, max_rows * kvd),
            v: committed(0.0, max_rows * kvd),
            attn: committed(0.0, max_rows * qd),
            o: committed(0.0, max_rows * c.dim),
            gate: committed(0.0, max_rows * c.ff),
            up: committed(0.0, max_rows * c.ff),
            sel: committed(0.0, max_rows * c.dim),
            attn_threads: (0..threads.max(1))
                .map(|_| {
                    // Lossy pages (no scratch per position) are read by
                    // blocks of rows, each page decoded once for the block.
                    let rows = if max_ctx == 0 { ATTN_ROWS } else { 1 };
                    let group = c.heads / c.kv_heads;
                    std::sync::Mutex::new(AttnScratch::for_rows(max_ctx, c.head_dim, group, page_tokens, rows))
                })
                .collect(),
            mm: MatmulScratch::with_capacity(max_rows, c.ff.max(c.dim).max(qd)),
            ropes: vec![
                Rope::new(c.rope_layout, c.rope_dim, c.rope_base),
                Rope::new(c.rope_layout, c.rope_dim, c.rope_base_local),
            ],
            probe: None,
        }
    }

    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let f = |v: &Vec<f32>| v.capacity() * 4;
        let attn: usize = self
            .attn_threads
            .iter()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).bytes())
            .sum();
        f(&self.x)
            + f(&self.h)
            + f(&self.q)
            + f(&self.k)
            + f(&self.v)
            + f(&self.attn)
            + f(&self.o)
            + f(&self.gate)
            + f(&self.up)
            + f(&self.sel)
            + attn
            + self.mm.bytes()
    }
}

use super::trace::trace;

use snug_kernels::pool::SendPtr;

/// Runs the element-wise `f` over matching chunks of `a` and `b`, on the
/// pool when they are long enough to pay for the hand-off (prefill). The
/// chunking cannot change a value: each element is computed alone.
fn par_zip(pool: &ThreadPool, a: &mut [f32], b: &[f32], f: fn(&mut [f32], &[f32])) {
    const CHUNK: usize = 16 * 1024;
    if a.len() <= CHUNK {
        return f(a, b);
    }
    let len = a.len();
    let ap = SendPtr(a.as_mut_ptr());
    pool.run(len.div_ceil(CHUNK), &|t| {
        let ap = &ap;
        let (s, e) = (t * CHUNK, ((t + 1) * CHUNK).min(len));
        // SAFETY: tasks take disjoint chunks of `a`, which outlives the run.
        let chunk = unsafe { std::slice::from_raw_parts_mut(ap.0.add(s), e - s) };
        f(chunk, &b[s..e]);
    });
}

fn mm(pool: &ThreadPool, w: &Weight, x: &[f32], n: usize, out: &mut [f32], s: &mut MatmulScratch, numerics: Numerics) {
    match numerics {
        Numerics::Native => matmul(pool, w, &x[..n * w.cols], n, &mut out[..n * w.rows], s),
        Numerics::Ggml => matmul_ggml(pool, w, &x[..n * w.cols], n, &mut out[..n * w.rows], s),
    }
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            add(row, b);
        }
    }
}

impl Model<'_> {
    /// RMS normalization of `x`'s rows (of `w.len()`) in the model's
    /// numerics.
    fn rms_norm(&self, x: &mut [f32], w: &[f32]) {
        match self.numerics {
            Numerics::Native => rms_norm(x, w, self.config.rms_eps),
            Numerics::Ggml => ggml::rms_norm(x, w, self.config.rms_eps),
        }
    }

    /// Whether queries are scaled before attention rather than scores in it
    /// (llama.cpp's Gemma 3 graph; only the ggml numerics follow it).
    fn ggml_prescales_queries(&self) -> bool {
        self.numerics == Numerics::Ggml && self.config.arch == Arch::Gemma3
    }

    /// Each layer's rotary embedding (Gemma 3's local layers have their
    /// own base).
    pub fn layer_ropes(&self) -> Vec<Rope> {
        let c = &self.config;
        (0..c.layers)
            .map(|l| {
                let base = if c.is_local(l) { c.rope_base_local } else { c.rope_base };
                Rope::new(c.rope_layout, c.rope_dim, base)
            })
            .collect()
    }

    /// Runs `rows` through the model, writing each row's keys and values
    /// into `kv`, and appends the logits of the rows that ask for them, in
    /// order, to `logits` (`vocab` floats each).
    pub fn forward(
        &self,
        rows: &[BatchRow],
        kv: &mut KvView,
        s: &mut ForwardScratch,
        pool: &ThreadPool,
        logits: &mut Vec<f32>,
    ) {
        let c = &self.config;
        let n = rows.len();
        assert!(
            n <= s.max_rows,
            "batch of {n} rows over the scratch size {}",
            s.max_rows
        );
        let (dim, hd) = (c.dim, c.head_dim);
        let qd = c.heads * hd;
        let kvd = c.kv_heads * hd;

        for (r, row) in rows.iter().enumerate() {
            let x = &mut s.x[r * dim..(r + 1) * dim];
            match self.numerics {
                Numerics::Native => self.embed.row_f32(row.token as usize, x),
                Numerics::Ggml => ggml::dequantize_row(self.embed.ty, self.embed.row(row.token as usize), x)
                    .expect("supported type checked at load"),
            }
            if c.embed_scale != 1.0 {
                x.iter_mut().for_each(|v| *v *= c.embed_scale);
            }
        }

        let nl = c.layers;
        let mut compacted = false;
        trace("inp_embd", 0, nl, &s.x[..n * dim]);
        for (l, layer) in self.layers.iter().enumerate() {
            // Attention block.
            s.h[..n * dim].copy_from_slice(&s.x[..n * dim]);
            self.rms_norm(&mut s.h[..n * dim], layer.attn_norm);
            trace("attn_norm", l, nl, &s.h[..n * dim]);
            mm(pool, &layer.wq, &s.h, n, &mut s.q, &mut s.mm, self.numerics);
            mm(pool, &layer.wk, &s.h, n, &mut s.k, &mut s.mm, self.numerics);
            mm(pool, &layer.wv, &s.h, n, &mut s.v, &mut s.mm, self.numerics);
            trace("Qcur_mm", l, nl, &s.q[..n * qd]);
            trace("Kcur_mm", l, nl, &s.k[..n * kvd]);
            trace("Vcur", l, nl, &s.v[..n * kvd]);
            add_bias(&mut s.q[..n * qd], layer.bq);
            add_bias(&mut s.k[..n * kvd], layer.bk);
            add_bias(&mut s.v[..n * kvd], layer.bv);
            if let Some(qn) = layer.q_norm {
                self.rms_norm(&mut s.q[..n * qd], qn);
            }
            if let Some(kn) = layer.k_norm {
                self.rms_norm(&mut s.k[..n * kvd], kn);
            }
            if let Some(probe) = &mut s.probe {
                for (r, row) in rows.iter().enumerate() {
                    if row.pos > 0 {
                        probe.add_keys(l, &s.k[r * kvd..(r + 1) * kvd]);
                    }
                }
            }
            let rope = &s.ropes[usize::from(c.is_local(l))];
            for (r, row) in rows.iter().enumerate() {
                let apply = match self.numerics {
                    Numerics::Native => Rope::apply,
                    Numerics::Ggml => Rope::apply_ggml,
                };
                for head in s.q[r * qd..(r + 1) * qd].chunks_exact_mut(hd) {
                    apply(rope, head, row.pos);
                }
                for head in s.k[r * kvd..(r + 1) * kvd].chunks_exact_mut(hd) {
                    apply(rope, head, row.pos);
                }
                if let (Some(probe), true) = (&mut s.probe, row.pos > 0) {
                    probe.add_queries(l, &s.q[r * qd..(r + 1) * qd]);
                }
                let pt = kv.storage.shape.page_tokens;
                let index = row.pos / pt;
                let twin = kv
                    .twins
                    .get(row.seq)
                    .and_then(|t| t.get(index))
                    .copied()
                    .filter(|&t| t != NO_TWIN);
                let at = KvSlot {
                    page: kv.pages[row.seq][index],
                    slot: row.pos % pt,
                    pos: row.pos,
                    twin,
                };
                kv.storage
                    .write(l, at, &s.k[r * kvd..(r + 1) * kvd], &s.v[r * kvd..(r + 1) * kvd]);
            }
            trace("Qcur_rope", l, nl, &s.q[..n * qd]);
            trace("Kcur_rope", l, nl, &s.k[..n * kvd]);
            if self.ggml_prescales_queries() {
                // llama.cpp scales Gemma 3's queries before its attention
                // rounds them to f16, and attends with a scale of 1.
                s.q[..n * qd].iter_mut().for_each(|v| *v *= c.attn_scale);
            }
            self.attention(l, rows, kv, s, pool);
            trace("kqv_out", l, nl, &s.attn[..n * qd]);
            mm(pool, &layer.wo, &s.attn, n, &mut s.o, &mut s.mm, self.numerics);
            trace("attn_out", l, nl, &s.o[..n * dim]);
            if let Some(pn) = layer.post_attn_norm {
                self.rms_norm(&mut s.o[..n * dim], pn);
            }
            add(&mut s.x[..n * dim], &s.o[..n * dim]);

            // llama.cpp runs its last layer's feed-forward block on the
            // rows it returns logits for only, so its matrix products see
            // that batch; the ggml numerics do the same (no other row's
            // state after the last layer is used).
            let mut n = n;
            if l + 1 == nl && self.numerics == Numerics::Ggml {
                let mut m = 0;
                for r in (0..n).filter(|&r| rows[r].logits) {
                    s.x.copy_within(r * dim..(r + 1) * dim, m * dim);
                    m += 1;
                }
                n = m;
                compacted = true;
            }

            // Feed-forward block.
            s.h[..n * dim].copy_from_slice(&s.x[..n * dim]);
            self.rms_norm(&mut s.h[..n * dim], layer.ffn_norm);
            trace("ffn_inp", l, nl, &s.x[..n * dim]);
            trace("ffn_norm", l, nl, &s.h[..n * dim]);
            mm(pool, &layer.w_gate, &s.h, n, &mut s.gate, &mut s.mm, self.numerics);
            mm(pool, &layer.w_up, &s.h, n, &mut s.up, &mut s.mm, self.numerics);
            trace("ffn_gate", l, nl, &s.gate[..n * c.ff]);
            trace("ffn_up", l, nl, &s.up[..n * c.ff]);
            match (c.arch, self.numerics) {
                (Arch::Gemma3, Numerics::Ggml) => {
                    par_zip(pool, &mut s.gate[..n * c.ff], &s.up[..n * c.ff], ggml::gelu_mul)
                }
                (Arch::Gemma3, Numerics::Native) => par_zip(pool, &mut s.gate[..n * c.ff], &s.up[..n * c.ff], gelu_mul),
                (Arch::Llama | Arch::Qwen2, Numerics::Native) => {
                    par_zip(pool, &mut s.gate[..n * c.ff], &s.up[..n * c.ff], silu_mul)
                }
                // Chunks of whole groups of 16 keep ggml's split of each
                // row into vector groups and a tail.
                (Arch::Llama | Arch::Qwen2, Numerics::Ggml) if c.ff.is_multiple_of(16) => {
                    par_zip(pool, &mut s.gate[..n * c.ff], &s.up[..n * c.ff], |g, u| {
                        ggml::silu_mul(g, u, 16)
                    })
                }
                (Arch::Llama | Arch::Qwen2, Numerics::Ggml) => {
                    ggml::silu_mul(&mut s.gate[..n * c.ff], &s.up[..n * c.ff], c.ff)
                }
            }
            trace("ffn_act", l, nl, &s.gate[..n * c.ff]);
            mm(pool, &layer.w_down, &s.gate, n, &mut s.o, &mut s.mm, self.numerics);
            trace("ffn_out", l, nl, &s.o[..n * dim]);
            if let Some(pn) = layer.post_ffn_norm {
                self.rms_norm(&mut s.o[..n * dim], pn);
            }
            add(&mut s.x[..n * dim], &s.o[..n * dim]);
            trace("l_out", l, nl, &s.x[..n * dim]);
        }

        // Logits for the rows that want them.
        let mut m = 0;
        for r in (0..n).filter(|&r| rows[r].logits) {
            let from = if compacted { m } else { r };
            s.sel[m * dim..(m + 1) * dim].copy_from_slice(&s.x[from * dim..(from + 1) * dim]);
            m += 1;
        }
        self.rms_norm(&mut s.sel[..m * dim], self.output_norm);
        let start = logits.len();
        logits.resize(start + m * c.vocab, 0.0);
        if m > 0 {
            mm(
                pool,
                &self.output,
                &s.sel[..m * dim],
                m,
                &mut logits[start..],
                &mut s.mm,
                self.numerics,
            );
        }
        trace("result_norm", usize::MAX, nl, &s.sel[..m * dim]);
        trace("result_output", usize::MAX, nl, &logits[start..]);
    }

    /// Attention for every (row, head), spread over the pool.
    fn attention(&self, layer: usize, rows: &[BatchRow], kv: &KvView, s: &mut ForwardScratch, pool: &ThreadPool) {
        let c = &self.config;
        let hd = c.head_dim;
        let qd = c.heads * hd;
        let group = c.heads / c.kv_heads;
        let out = SendPtr(s.attn.as_mut_ptr());
        let q = &s.q;
        let storage: &KvStorage = kv.storage;
        let threads = &s.attn_threads;
        let numerics = self.numerics;
        let scale = if self.ggml_prescales_queries() {
            1.0
        } else {
            c.attn_scale
        };
        // A task is a part of the query heads of one KV head, over a
        // block of consecutive rows of one sequence (read together over
        // lossy pages: each page decoded once for the block; a row's
        // arithmetic is the same alone). Few blocks (decode) give too few
        // groups to keep every thread busy, so groups are split into parts
        // then; a head's arithmetic does not depend on which heads share
        // its pass over the keys and values.
        let mut blocks: Vec<std::ops::Range<usize>> = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            match blocks.last_mut() {
                Some(b) if b.len() < ATTN_ROWS && rows[b.start].seq == row.seq => b.end = r + 1,
                _ => blocks.push(r..r + 1),
            }
        }
        let parts = attention_parts(blocks.len() * c.kv_heads, group, pool.threads());
        let per_part = group.div_ceil(parts);
        pool.run_with_thread(blocks.len() * c.kv_heads * parts, &|task, thread| {
            let out = &out;
            let (bg, part) = (task / parts, task % parts);
            let (b, g) = (bg / c.kv_heads, bg % c.kv_heads);
            let heads = part * per_part..((part + 1) * per_part).min(group);
            if heads.is_empty() {
                return;
            }
            let mut scratch = threads[thread].lock().unwrap_or_else(|e| e.into_inner());
            let (from, n) = (blocks[b].start, blocks[b].len());
            let mut block: [AttnRow; ATTN_ROWS] = std::array::from_fn(|i| {
                let Some(&row) = rows.get(from + i).filter(|_| i < n) else {
                    let query = AttnQuery {
                        pages: &[],
                        twins: &[],
                        start: 0,
                        end: 0,
                    };
                    return AttnRow {
                        query,
                        q: &[],
                        out: Default::default(),
                    };
                };
                let query = AttnQuery {
                    pages: kv.pages[row.seq],
                    twins: kv.twins.get(row.seq).copied().unwrap_or(&[]),
                    start: c.window_start(layer, row.pos),
                    end: row.pos + 1,
                };
                let first = (from + i) * qd + (g * group + heads.start) * hd;
                let span = first..first + heads.len() * hd;
                // SAFETY: each (row, query head) slice of the output is
                // written by exactly one task.
                let out = unsafe { std::slice::from_raw_parts_mut(out.0.add(span.start), span.len()) };
                AttnRow {
                    query,
                    q: &q[span],
                    out,
                }
            });
            let block = &mut block[..n];
            match numerics {
                Numerics::Native => attend_rows(storage, layer, g, block, scale, &mut scratch),
                Numerics::Ggml => {
                    for j in block.iter_mut() {
                        attend_group_ggml(storage, layer, g, &j.query, j.q, scale, j.out, &mut scratch);
                    }
                }
            }
        });
    }
}

/// Rows a thread takes through the pages of a lossy KV cache together.
/// Each page's codes are decoded once for the block, so a longer block
/// saves more decoding and holds more rows' state.
const ATTN_ROWS: usize = 8;

/// Into how many parts each (row, KV head) group of `group` query heads is
/// split so that `groups` groups leave no thread of `threads` idle. Only
/// then: a part re-reads the group's keys and values, which costs more
/// than an uneven share (measured: splitting SmolLM2's three groups for two
/// threads was 15% slower at depth 2048; splitting Gemma 3's single group
/// was 7% faster).
fn attention_parts(groups: usize, group: usize, threads: usize) -> usize {
    if groups >= threads {
        return 1;
    }
    threads.div_ceil(groups.max(1)).clamp(1, group.max(1))
}
