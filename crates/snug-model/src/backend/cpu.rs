//! The CPU backends: host buffers, a thread pool, KV pages in host memory,
//! and weights read in place from the mapped model file. [`Native`] and
//! [`LlamaCpp`] share all of that and differ in their arithmetic only
//! ([`CpuArithmetic`]).

use std::marker::PhantomData;
use std::sync::Mutex;

use snug_kernels::ggml;
use snug_kernels::kv::{attend_group_ggml, attend_rows, AttnQuery, AttnRow, AttnScratch, KvSlot, KvStorage};
use snug_kernels::kvbasis::KeyStats;
use snug_kernels::matmul::{matmul, matmul_ggml, matmul_many, MatmulScratch, Weight};
use snug_kernels::ops::{self, Rope};
use snug_kernels::pool::{SendPtr, ThreadPool};
use snug_kernels::vec::committed;

use super::{Backend, Buf, WorkspaceSize};
use crate::arch::{trace::trace, Activation, BatchRow, Config, Experts, Head, KvView};

/// Rows a thread takes through the pages together: over a lossy KV cache
/// each page's codes are decoded once for the block, over F16 pages each
/// tile of keys and values is converted to f32 once, so a longer block
/// saves more and holds more rows' state.
pub const ATTN_ROWS: usize = 8;

/// The buffers, threads and scratch of one engine's forward passes on the
/// CPU, sized once for the largest batch.
pub struct CpuWorkspace {
    max_rows: usize,
    /// Floats of a head, of a row's queries and of its keys.
    head_dim: usize,
    qd: usize,
    kvd: usize,
    /// One buffer per [`Buf`], in [`Buf::ALL`]'s order.
    bufs: [Vec<f32>; 10],
    attn_threads: Vec<Mutex<AttnScratch>>,
    mm: MatmulScratch,
    ropes: [Rope; 2], // [global, local]
    /// Per rotation, each row's pairs' (sine, cosine) at its position:
    /// computed at the first layer of a pass that rotates by it
    /// (`rope_fresh`), then shared by every head and layer.
    rope_sc: [Vec<(f32, f32)>; 2],
    rope_fresh: [bool; 2],
    pool: ThreadPool,
    moe: MoeScratch,
    /// Sums of pre-RoPE keys and of queries, gathered while set (the key
    /// basis' calibration); position 0 is left out.
    pub probe: Option<KeyStats>,
}

impl CpuWorkspace {
    fn new(c: &Config, size: WorkspaceSize) -> CpuWorkspace {
        let rows = size.rows;
        let qd = c.heads * c.head_dim;
        let threads = size.threads.max(1);
        CpuWorkspace {
            max_rows: rows,
            head_dim: c.head_dim,
            qd,
            kvd: c.kv_heads * c.head_dim,
            bufs: Buf::ALL.map(|b| committed(0.0, rows * b.width(c))),
            attn_threads: (0..threads)
                .map(|_| {
                    // Rows are read by blocks: over lossy pages each page
                    // is decoded once for the block; over F16 pages each
                    // tile is converted once, and the block keeps every
                    // row's scores (as many rows as fit).
                    let (group, block) = (c.heads / c.kv_heads, ATTN_ROWS);
                    Mutex::new(AttnScratch::for_rows(
                        size.ctx,
                        c.head_dim,
                        group,
                        size.page_tokens,
                        block,
                    ))
                })
                .collect(),
            mm: MatmulScratch::with_capacity(rows, c.ff.max(c.ff_expert).max(c.dim).max(qd)),
            ropes: [c.rope(false), c.rope(true)],
            rope_sc: [false, true].map(|local| vec![(0.0, 0.0); rows * c.rope(local).pair_count()]),
            rope_fresh: [false; 2],
            pool: ThreadPool::new(threads),
            moe: MoeScratch::new(c, rows),
            probe: None,
        }
    }

    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let attn: usize = self
            .attn_threads
            .iter()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).bytes())
            .sum();
        let rope: usize = self.rope_sc.iter().map(|v| v.capacity() * 8).sum();
        self.bufs.iter().map(|v| v.capacity() * 4).sum::<usize>() + attn + self.mm.bytes() + self.moe.bytes() + rope
    }

    fn buf(&mut self, b: Buf) -> &mut [f32] {
        &mut self.bufs[b as usize]
    }

    /// Buffer `from` to read and buffer `to` (another) to write.
    fn pair(&mut self, from: Buf, to: Buf) -> (&[f32], &mut [f32]) {
        let (i, j) = (from as usize, to as usize);
        assert_ne!(i, j, "a buffer read and written at once");
        if i < j {
            let (a, b) = self.bufs.split_at_mut(j);
            (&a[i], &mut b[0])
        } else {
            let (a, b) = self.bufs.split_at_mut(i);
            (&b[0], &mut a[j])
        }
    }
}

/// Scratch of a mixture-of-experts block, sized for the largest batch
/// (empty for a model of dense blocks).
struct MoeScratch {
    /// Router scores, `rows x experts`, and one row's probabilities.
    logits: Vec<f32>,
    probs: Vec<f32>,
    /// Each row's experts and weights, `rows x used`.
    sel: Vec<usize>,
    weight: Vec<f32>,
    /// The rows one expert takes (row, rank), their inputs and outputs.
    rows: Vec<(usize, usize)>,
    input: Vec<f32>,
    down: Vec<f32>,
    /// Every row's expert outputs, `rows x used x dim`.
    out: Vec<f32>,
}

impl MoeScratch {
    fn new(c: &Config, rows: usize) -> MoeScratch {
        let (ne, k) = if c.experts > 0 {
            (c.experts, c.experts_used)
        } else {
            (0, 0)
        };
        let dim = if ne > 0 { c.dim } else { 0 };
        MoeScratch {
            logits: committed(0.0, rows * ne),
            probs: committed(0.0, ne),
            sel: committed(0, rows * k),
            weight: committed(0.0, rows * k),
            rows: Vec::with_capacity(if ne > 0 { rows } else { 0 }),
            input: committed(0.0, rows * dim),
            down: committed(0.0, rows * dim),
            out: committed(0.0, rows * k * dim),
        }
    }

    fn bytes(&self) -> usize {
        (self.logits.capacity()
            + self.probs.capacity()
            + self.weight.capacity()
            + self.input.capacity()
            + self.down.capacity()
            + self.out.capacity())
            * 4
            + self.sel.capacity() * std::mem::size_of::<usize>()
            + self.rows.capacity() * std::mem::size_of::<(usize, usize)>()
    }
}

/// Where the two CPU backends' arithmetic differs.
pub trait CpuArithmetic: Sync + Send + 'static {
    /// See [`Backend::LLAMA_CPP_GRAPH`].
    const LLAMA_CPP_GRAPH: bool;
    /// Row `token` of the embedding table as f32.
    fn embed_row(table: &Weight, token: usize, out: &mut [f32]);
    /// RMS norm of each row of `w`'s length in `x`.
    fn rms_norm(x: &mut [f32], w: &[f32], eps: f32);
    /// `out[r] = w * x[r]` for `n` rows.
    fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], n: usize, out: &mut [f32], s: &mut MatmulScratch);
    /// [`CpuArithmetic::matmul`] for several weights of one input.
    fn matmul_many(
        pool: &ThreadPool,
        ws: &[&Weight],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
        s: &mut MatmulScratch,
    ) {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            Self::matmul(pool, w, x, n, out, s);
        }
    }
    /// Each rotated pair's (sine, cosine) at `pos`.
    fn rope_angles(rope: &Rope, pos: usize, sc: &mut [(f32, f32)]);
    /// Rotates one head by the angles of [`CpuArithmetic::rope_angles`].
    fn rope_rotate(rope: &Rope, head: &mut [f32], sc: &[(f32, f32)]);
    /// Attention of a block of consecutive rows of one sequence, for the
    /// query heads of one KV head.
    fn attend(kv: &KvStorage, layer: usize, kv_head: usize, rows: &mut [AttnRow], scale: f32, s: &mut AttnScratch);
    /// `gate = act(gate) * up`, rows of `width`.
    fn gated(pool: &ThreadPool, act: Activation, gate: &mut [f32], up: &[f32], width: usize);
    /// The gate and up products of `x` and then [`CpuArithmetic::gated`]
    /// in one job, with the bits of the three steps; false, having done
    /// nothing, where this arithmetic or these weights do not allow it.
    #[allow(clippy::too_many_arguments)]
    fn gate_up(
        _pool: &ThreadPool,
        _act: Activation,
        _wg: &Weight,
        _wu: &Weight,
        _x: &[f32],
        _n: usize,
        _gate: &mut [f32],
        _up: &mut [f32],
        _s: &mut MatmulScratch,
    ) -> bool {
        false
    }
    /// A row's `sel.len()` experts from its router `logits`, best first,
    /// and their weights (`probs`: scratch as long as `logits`).
    fn route(logits: &[f32], probs: &mut [f32], sel: &mut [usize], weights: &mut [f32]);
}

/// snug's own arithmetic: every kernel fixes a row's reduction order, and
/// KV is read in its stored format.
pub struct Native;

/// llama.cpp's arithmetic, f16 roundings and graph included, for output
/// equal to llama.cpp's token for token.
pub struct LlamaCpp;

impl CpuArithmetic for Native {
    const LLAMA_CPP_GRAPH: bool = false;

    fn embed_row(table: &Weight, token: usize, out: &mut [f32]) {
        table.row_f32(token, out)
    }

    fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
        ops::rms_norm(x, w, eps)
    }

    fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], n: usize, out: &mut [f32], s: &mut MatmulScratch) {
        matmul(pool, w, &x[..n * w.cols], n, &mut out[..n * w.rows], s)
    }

    fn matmul_many(
        pool: &ThreadPool,
        ws: &[&Weight],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
        s: &mut MatmulScratch,
    ) {
        // Products of one input: one width.
        let k = ws.first().map_or(0, |w| w.cols);
        for (o, w) in outs.iter_mut().zip(ws) {
            *o = &mut std::mem::take(o)[..n * w.rows];
        }
        matmul_many(pool, ws, &x[..n * k], n, outs, s)
    }

    fn rope_angles(rope: &Rope, pos: usize, sc: &mut [(f32, f32)]) {
        rope.angles(pos, sc)
    }

    fn rope_rotate(rope: &Rope, head: &mut [f32], sc: &[(f32, f32)]) {
        rope.rotate(head, sc)
    }

    fn attend(kv: &KvStorage, layer: usize, kv_head: usize, rows: &mut [AttnRow], scale: f32, s: &mut AttnScratch) {
        attend_rows(kv, layer, kv_head, rows, scale, s)
    }

    fn gated(pool: &ThreadPool, act: Activation, gate: &mut [f32], up: &[f32], _width: usize) {
        par_zip(pool, gate, up, native_act(act))
    }

    fn gate_up(
        pool: &ThreadPool,
        act: Activation,
        wg: &Weight,
        wu: &Weight,
        x: &[f32],
        n: usize,
        gate: &mut [f32],
        up: &mut [f32],
        s: &mut MatmulScratch,
    ) -> bool {
        snug_kernels::matmul::matmul_gated(pool, wg, wu, x, n, gate, up, native_act(act), s)
    }

    fn route(logits: &[f32], probs: &mut [f32], sel: &mut [usize], weights: &mut [f32]) {
        ops::route_experts(logits, probs, sel, weights)
    }
}

/// snug's own activation, as the gated product in place.
fn native_act(act: Activation) -> fn(&mut [f32], &[f32]) {
    match act {
        Activation::Silu => ops::silu_mul,
        Activation::Gelu => ops::gelu_mul,
    }
}

impl CpuArithmetic for LlamaCpp {
    const LLAMA_CPP_GRAPH: bool = true;

    fn embed_row(table: &Weight, token: usize, out: &mut [f32]) {
        ggml::dequantize_row(table.ty, table.row(token), out).expect("supported type checked at load")
    }

    fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
        ggml::rms_norm(x, w, eps)
    }

    fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], n: usize, out: &mut [f32], s: &mut MatmulScratch) {
        matmul_ggml(pool, w, &x[..n * w.cols], n, &mut out[..n * w.rows], s)
    }

    fn rope_angles(rope: &Rope, pos: usize, sc: &mut [(f32, f32)]) {
        rope.angles_ggml(pos, sc)
    }

    fn rope_rotate(rope: &Rope, head: &mut [f32], sc: &[(f32, f32)]) {
        rope.rotate_ggml(head, sc)
    }

    fn attend(kv: &KvStorage, layer: usize, kv_head: usize, rows: &mut [AttnRow], scale: f32, s: &mut AttnScratch) {
        for r in rows.iter_mut() {
            attend_group_ggml(kv, layer, kv_head, &r.query, r.q, scale, r.out, s);
        }
    }

    fn gated(pool: &ThreadPool, act: Activation, gate: &mut [f32], up: &[f32], width: usize) {
        match act {
            Activation::Gelu => par_zip(pool, gate, up, ggml::gelu_mul),
            // Chunks of whole groups of 16 keep ggml's split of each row
            // into vector groups and a tail.
            Activation::Silu if width.is_multiple_of(16) => par_zip(pool, gate, up, |g, u| ggml::silu_mul(g, u, 16)),
            Activation::Silu => ggml::silu_mul(gate, up, width),
        }
    }

    fn route(logits: &[f32], probs: &mut [f32], sel: &mut [usize], weights: &mut [f32]) {
        ggml::route_experts(logits, probs, sel, weights)
    }
}

/// A CPU backend of arithmetic `A`.
pub struct Cpu<A>(PhantomData<A>);

impl<A: CpuArithmetic> Backend for Cpu<A> {
    type Matrix<'w> = Weight<'w>;
    type Vector<'w> = &'w [f32];
    type Workspace = CpuWorkspace;
    type Kv = KvStorage;

    const LLAMA_CPP_GRAPH: bool = A::LLAMA_CPP_GRAPH;

    fn workspace(c: &Config, size: WorkspaceSize) -> CpuWorkspace {
        CpuWorkspace::new(c, size)
    }

    fn max_rows(ws: &CpuWorkspace) -> usize {
        ws.max_rows
    }

    fn begin(ws: &mut CpuWorkspace, _rows: &[BatchRow], _head: Head, _kv: &KvView<KvStorage>) {
        // A new pass' rows: their angles are computed again.
        ws.rope_fresh = [false; 2];
    }

    fn embed(ws: &mut CpuWorkspace, table: &Weight<'_>, rows: &[BatchRow]) {
        let dim = table.cols;
        let x = ws.buf(Buf::X);
        for (r, row) in rows.iter().enumerate() {
            A::embed_row(table, row.token as usize, &mut x[r * dim..(r + 1) * dim]);
        }
    }

    fn scale(ws: &mut CpuWorkspace, buf: Buf, len: usize, by: f32) {
        ws.buf(buf)[..len].iter_mut().for_each(|v| *v *= by);
    }

    fn copy(ws: &mut CpuWorkspace, from: Buf, to: Buf, len: usize) {
        let (a, b) = ws.pair(from, to);
        b[..len].copy_from_slice(&a[..len]);
    }

    fn rms_norm(ws: &mut CpuWorkspace, buf: Buf, len: usize, w: &&[f32], eps: f32) {
        let width = w.len();
        let x = SendPtr(ws.bufs[buf as usize][..len].as_mut_ptr());
        par_rows(&ws.pool, len / width, width, &|r| {
            // SAFETY: the ranges of rows are disjoint and within `len`.
            let x = unsafe { rows_mut(&x, r, width) };
            A::rms_norm(x, w, eps)
        });
    }

    fn add_norm(ws: &mut CpuWorkspace, x: Buf, add: Option<Buf>, to: Buf, len: usize, w: &&[f32], eps: f32) {
        // `x += add; to = x; rms_norm(to)`, as the trait's default runs
        // them, a range of rows at a time.
        let width = w.len();
        assert!(
            x != to && add != Some(x) && add != Some(to),
            "a buffer read and written at once"
        );
        let xp = SendPtr(ws.bufs[x as usize][..len].as_mut_ptr());
        let tp = SendPtr(ws.bufs[to as usize][..len].as_mut_ptr());
        let ap = add.map(|a| SendPtr(ws.bufs[a as usize][..len].as_mut_ptr()));
        par_rows(&ws.pool, len / width, width, &|r| {
            // SAFETY: the three buffers are distinct (asserted above); the
            // ranges of rows are disjoint and within `len`; `add` is read only.
            let (x, to) = unsafe { (rows_mut(&xp, r.clone(), width), rows_mut(&tp, r.clone(), width)) };
            if let Some(a) = &ap {
                // SAFETY: as above.
                ops::add(x, unsafe { rows_mut(a, r, width) });
            }
            to.copy_from_slice(x);
            A::rms_norm(to, w, eps)
        });
    }

    fn matmul(ws: &mut CpuWorkspace, w: &Weight, from: Buf, to: Buf, rows: usize) {
        let (i, j) = (from as usize, to as usize);
        assert_ne!(i, j, "a buffer read and written at once");
        let (x, out) = split2(&mut ws.bufs, i, j);
        A::matmul(&ws.pool, w, x, rows, out, &mut ws.mm)
    }

    fn matmul_many(ws: &mut CpuWorkspace, mats: &[&Weight], from: Buf, to: &[Buf], rows: usize) {
        let i = from as usize;
        assert!(
            to.iter()
                .enumerate()
                .all(|(a, &t)| t as usize != i && !to[..a].contains(&t)),
            "buffers read and written at once"
        );
        let (x_ptr, x_len) = (ws.bufs[i].as_ptr(), ws.bufs[i].len());
        // At most one output per buffer (distinct, checked above); no
        // allocation, as this runs for every layer of every pass.
        let mut outs: [&mut [f32]; 10] = Default::default();
        let base = ws.bufs.as_mut_ptr();
        for (o, &t) in outs.iter_mut().zip(to) {
            // SAFETY: the buffers in `to` are distinct and not `from`
            // (checked above), so these borrows do not overlap.
            *o = unsafe { (*base.add(t as usize)).as_mut_slice() };
        }
        // SAFETY: `from` is none of the buffers written.
        let x = unsafe { std::slice::from_raw_parts(x_ptr, x_len) };
        A::matmul_many(&ws.pool, mats, x, rows, &mut outs[..to.len()], &mut ws.mm)
    }

    fn add_bias(ws: &mut CpuWorkspace, buf: Buf, rows: usize, bias: &&[f32]) {
        let b: &[f32] = bias;
        let x = SendPtr(ws.bufs[buf as usize][..rows * b.len()].as_mut_ptr());
        par_rows(&ws.pool, rows, b.len(), &|r| {
            // SAFETY: the ranges of rows are disjoint and within the buffer.
            for row in unsafe { rows_mut(&x, r, b.len()) }.chunks_exact_mut(b.len()) {
                ops::add(row, b);
            }
        });
    }

    fn add(ws: &mut CpuWorkspace, to: Buf, from: Buf, len: usize) {
        let (x, out) = ws.pair(from, to);
        ops::add(&mut out[..len], &x[..len]);
    }

    fn rope_write_kv(
        ws: &mut CpuWorkspace,
        layer: usize,
        rows: &[BatchRow],
        rope: Option<bool>,
        slots: &[KvSlot],
        kv: &mut KvStorage,
    ) {
        let (hd, qd, kvd) = (ws.head_dim, ws.qd, ws.kvd);
        let n = rows.len();
        // The rows' angles, once a pass for each rotation.
        let which = rope.map(usize::from);
        if let Some(i) = which.filter(|&i| !ws.rope_fresh[i]) {
            let (r, pc) = (&ws.ropes[i], ws.ropes[i].pair_count());
            for (sc, row) in ws.rope_sc[i].chunks_exact_mut(pc).zip(rows) {
                A::rope_angles(r, row.pos, sc);
            }
            ws.rope_fresh[i] = true;
        }
        let [_, _, q, k, v, ..] = &mut ws.bufs;
        if let Some(probe) = &mut ws.probe {
            // The key basis' calibration: keys before their rotation and
            // queries after, row by row.
            for (r, row) in rows.iter().enumerate() {
                if row.pos > 0 {
                    probe.add_keys(layer, &k[r * kvd..(r + 1) * kvd]);
                }
            }
            for (r, row) in rows.iter().enumerate() {
                if let Some(i) = which {
                    let (rope, pc) = (&ws.ropes[i], ws.ropes[i].pair_count());
                    let sc = &ws.rope_sc[i][r * pc..(r + 1) * pc];
                    for head in q[r * qd..(r + 1) * qd].chunks_exact_mut(hd) {
                        A::rope_rotate(rope, head, sc);
                    }
                    for head in k[r * kvd..(r + 1) * kvd].chunks_exact_mut(hd) {
                        A::rope_rotate(rope, head, sc);
                    }
                }
                if row.pos > 0 {
                    probe.add_queries(layer, &q[r * qd..(r + 1) * qd]);
                }
            }
        } else if let Some(i) = which {
            let (rope, pc, sc) = (&ws.ropes[i], ws.ropes[i].pair_count(), &ws.rope_sc[i]);
            let (qp, kp) = (SendPtr(q[..n * qd].as_mut_ptr()), SendPtr(k[..n * kvd].as_mut_ptr()));
            par_rows(&ws.pool, n, qd + kvd, &|range| {
                // SAFETY: the ranges of rows are disjoint and within the
                // batch's rows of both buffers.
                let (q, k) = unsafe { (rows_mut(&qp, range.clone(), qd), rows_mut(&kp, range.clone(), kvd)) };
                for (j, r) in range.enumerate() {
                    let sc = &sc[r * pc..(r + 1) * pc];
                    for head in q[j * qd..(j + 1) * qd].chunks_exact_mut(hd) {
                        A::rope_rotate(rope, head, sc);
                    }
                    for head in k[j * kvd..(j + 1) * kvd].chunks_exact_mut(hd) {
                        A::rope_rotate(rope, head, sc);
                    }
                }
            });
        }
        kv.write_rows(layer, slots, &k[..n * kvd], &v[..n * kvd], &ws.pool);
    }

    fn attention(
        ws: &mut CpuWorkspace,
        c: &Config,
        layer: usize,
        rows: &[BatchRow],
        kv: &KvView<KvStorage>,
        scale: f32,
    ) {
        attention::<A>(ws, c, layer, rows, kv, scale)
    }

    fn gated(ws: &mut CpuWorkspace, act: Activation, rows: usize, width: usize) {
        let len = rows * width;
        let (i, j) = (Buf::Up as usize, Buf::Gate as usize);
        let (up, gate) = split2(&mut ws.bufs, i, j);
        A::gated(&ws.pool, act, &mut gate[..len], &up[..len], width)
    }

    fn gate_up(
        ws: &mut CpuWorkspace,
        gate: &Weight,
        up: &Weight,
        from: Buf,
        rows: usize,
        width: usize,
        act: Activation,
    ) {
        let (i, g, u) = (from as usize, Buf::Gate as usize, Buf::Up as usize);
        assert!(i != g && i != u, "a buffer read and written at once");
        let base = ws.bufs.as_mut_ptr();
        // SAFETY: the three buffers are distinct (Gate and Up are two
        // buffers; `from` is neither, checked above).
        let (x, go, uo) = unsafe {
            (
                (*base.add(i)).as_slice(),
                &mut (*base.add(g)).as_mut_slice()[..rows * width],
                &mut (*base.add(u)).as_mut_slice()[..rows * width],
            )
        };
        let x = &x[..rows * gate.cols];
        if !A::gate_up(&ws.pool, act, gate, up, x, rows, go, uo, &mut ws.mm) {
            Self::matmul_many(ws, &[gate, up], from, &[Buf::Gate, Buf::Up], rows);
            Self::gated(ws, act, rows, width);
        }
    }

    fn experts(ws: &mut CpuWorkspace, e: &Experts<Weight<'_>>, c: &Config, n: usize) {
        let (dim, ne, k, fe) = (c.dim, c.experts, e.used, c.ff_expert);
        let CpuWorkspace {
            bufs, pool, mm, moe, ..
        } = ws;
        let m = &mut *moe;
        // Router scores, then each row's experts and weights.
        A::matmul(pool, &e.router, &bufs[Buf::H as usize], n, &mut m.logits[..n * ne], mm);
        for r in 0..n {
            A::route(
                &m.logits[r * ne..(r + 1) * ne],
                &mut m.probs,
                &mut m.sel[r * k..(r + 1) * k],
                &mut m.weight[r * k..(r + 1) * k],
            );
        }
        // Each expert on the rows that chose it (a product's rows are
        // independent, so a row's bits do not depend on who else chose it).
        for x in 0..ne {
            m.rows.clear();
            for r in 0..n {
                if let Some(j) = m.sel[r * k..(r + 1) * k].iter().position(|&s| s == x) {
                    m.rows.push((r, j));
                }
            }
            let rows = m.rows.len();
            if rows == 0 {
                continue;
            }
            let h = &bufs[Buf::H as usize];
            for (i, &(r, _)) in m.rows.iter().enumerate() {
                m.input[i * dim..(i + 1) * dim].copy_from_slice(&h[r * dim..(r + 1) * dim]);
            }
            let input = &m.input[..rows * dim];
            for (w, to) in [(&e.gate[x], Buf::Gate), (&e.up[x], Buf::Up)] {
                A::matmul(pool, w, input, rows, &mut bufs[to as usize][..rows * fe], mm);
            }
            let (up, gate) = split2(bufs, Buf::Up as usize, Buf::Gate as usize);
            A::gated(pool, c.arch.activation, &mut gate[..rows * fe], &up[..rows * fe], fe);
            A::matmul(
                pool,
                &e.down[x],
                &gate[..rows * fe],
                rows,
                &mut m.down[..rows * dim],
                mm,
            );
            for (i, &(r, j)) in m.rows.iter().enumerate() {
                let at = (r * k + j) * dim;
                m.out[at..at + dim].copy_from_slice(&m.down[i * dim..(i + 1) * dim]);
            }
        }
        // The weighted sum, in the order of the row's experts: each
        // product rounded, then added.
        let o = &mut bufs[Buf::O as usize][..n * dim];
        for r in 0..n {
            let w = &m.weight[r * k..(r + 1) * k];
            for (d, o) in o[r * dim..(r + 1) * dim].iter_mut().enumerate() {
                let mut acc = w[0] * m.out[r * k * dim + d];
                for (j, &wj) in w.iter().enumerate().skip(1) {
                    acc += wj * m.out[(r * k + j) * dim + d];
                }
                *o = acc;
            }
        }
    }

    fn gather_rows(ws: &mut CpuWorkspace, from: Buf, to: Buf, width: usize, which: &[usize]) {
        if from == to {
            let x = ws.buf(from);
            for (m, &r) in which.iter().enumerate() {
                x.copy_within(r * width..(r + 1) * width, m * width);
            }
            return;
        }
        let (a, b) = ws.pair(from, to);
        for (m, &r) in which.iter().enumerate() {
            b[m * width..(m + 1) * width].copy_from_slice(&a[r * width..(r + 1) * width]);
        }
    }

    fn logits(ws: &mut CpuWorkspace, head: &Weight, from: Buf, rows: usize, out: &mut [f32]) {
        if rows == 0 {
            return;
        }
        let x = &ws.bufs[from as usize][..rows * head.cols];
        A::matmul(&ws.pool, head, x, rows, out, &mut ws.mm)
    }

    fn read(ws: &mut CpuWorkspace, buf: Buf, out: &mut [f32]) {
        out.copy_from_slice(&ws.bufs[buf as usize][..out.len()]);
    }

    fn trace(ws: &mut CpuWorkspace, name: &str, layer: usize, layers: usize, buf: Buf, len: usize) {
        trace(name, layer, layers, &ws.bufs[buf as usize][..len]);
    }
}

/// Buffer `i` to read and buffer `j` (another) to write.
fn split2(bufs: &mut [Vec<f32>; 10], i: usize, j: usize) -> (&[f32], &mut [f32]) {
    let (a, b) = super::read_and_write(bufs, i, j);
    (a, b)
}

/// Runs `f` on ranges of `rows` rows (`width` floats each) that split them,
/// on the pool when the rows hold enough floats together to pay for the
/// hand-offs (prefill), else on the caller at once (a decode step). `f`
/// must compute each row alone, so that the split cannot change a value.
fn par_rows(pool: &ThreadPool, rows: usize, width: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    const CHUNK: usize = 16 * 1024;
    let per = (CHUNK / width.max(1)).max(1);
    if rows <= per || pool.threads() == 1 {
        return f(0..rows);
    }
    pool.run(rows.div_ceil(per), &|t| f(t * per..((t + 1) * per).min(rows)));
}

/// Rows `r` (of `width` floats) of the buffer at `p`.
///
/// # Safety
/// The rows must lie within the buffer, and no other slice over them may be
/// in use while this one is.
unsafe fn rows_mut<'a>(p: &SendPtr<f32>, r: std::ops::Range<usize>, width: usize) -> &'a mut [f32] {
    // SAFETY: as the caller promises.
    unsafe { std::slice::from_raw_parts_mut(p.0.add(r.start * width), r.len() * width) }
}

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

/// Attention for every (row, head), spread over the pool.
fn attention<A: CpuArithmetic>(
    ws: &mut CpuWorkspace,
    c: &Config,
    layer: usize,
    rows: &[BatchRow],
    kv: &KvView<KvStorage>,
    scale: f32,
) {
    let hd = c.head_dim;
    let qd = c.heads * hd;
    let group = c.heads / c.kv_heads;
    let (i, j) = (Buf::Q as usize, Buf::Attn as usize);
    let (q, attn) = split2(&mut ws.bufs, i, j);
    let out = SendPtr(attn.as_mut_ptr());
    let storage: &KvStorage = kv.storage;
    let threads = &ws.attn_threads;
    let pool = &ws.pool;
    // A task is a part of the query heads of one KV head, over a block of
    // consecutive rows of one sequence (read together over lossy pages:
    // each page decoded once for the block; a row's arithmetic is the
    // same alone). Few blocks (decode) give too few groups to keep every
    // thread busy, so groups are split into parts then; a head's
    // arithmetic does not depend on which heads share its pass over the
    // keys and values.
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
        A::attend(storage, layer, g, &mut block[..n], scale, &mut scratch);
    });
}

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
