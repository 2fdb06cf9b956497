//! Matrix multiplication `out[r][o] = sum_k w[o][k] * x[r][k]` for a weight
//! matrix in any supported GGML type and a batch of f32 activation rows.
//!
//! Activations are quantized once per call, in the format ggml pairs with
//! the weight type ([`act_format`]); threads take 16 output features at a
//! time. With a few activation rows each output is one [`dot_rows`] result
//! (the weights stream from memory once); with more, the task packs its 16
//! weight rows into a [`Panel`] and runs every activation row against it.
//! Both compute exactly the reference's operations in its order, which
//! depends only on the output's own row, so a row's outputs are bitwise the
//! same whatever the batch width, the row's place in it, the kernel chosen,
//! or the thread count.

use std::cell::RefCell;

use crate::dot::{act_format, dot_f32, dot_tile, quantize_row, supports, BlockQ8, QK8};
use crate::panel::{self, activation_aux, aux_len, Panel, PanelRef};
use crate::pool::ThreadPool;
use crate::quant::{dequantize, GgmlType};

/// A weight matrix borrowed from a mapped file: `rows` rows of `cols`
/// elements, row-major, each row a whole number of blocks.
#[derive(Clone, Copy, Debug)]
pub struct Weight<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// The same rows packed into panels ([`crate::panel::pack_matrix`]),
    /// where the model packed them.
    pub packed: Option<&'a [u8]>,
}

impl<'a> Weight<'a> {
    pub fn row_bytes(&self) -> usize {
        self.ty.bytes_for(self.cols as u64).expect("validated at load") as usize
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Row `r` as f32 (for embedding lookups).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        dequantize(self.ty, self.row(r), out).expect("supported type checked at load");
    }
}

/// Whether [`matmul`] handles weights of type `ty`.
pub fn matmul_supports(ty: GgmlType) -> bool {
    supports(ty) || is_float(ty)
}

/// Float matrices, multiplied in f32 ([`dot_f32`]'s order; rows must be a
/// multiple of 16 long).
pub fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Per-call scratch for quantized activations; sized once by the caller.
#[derive(Default)]
pub struct MatmulScratch {
    q8: Vec<BlockQ8>,
    /// Per activation row, the values panels read beside its blocks.
    aux: Vec<i32>,
    /// The activation rows' bytes, row after row, where AMX tiles read
    /// them ([`panel::amx_available`]); rows up to a multiple of 32.
    bytes: Vec<i8>,
}

impl MatmulScratch {
    /// Scratch for up to `rows` activation rows of up to `cols` elements.
    pub fn with_capacity(rows: usize, cols: usize) -> MatmulScratch {
        MatmulScratch {
            q8: crate::vec::committed(BlockQ8::default(), rows * cols.div_ceil(QK8)),
            aux: crate::vec::committed(0, rows * aux_len(GgmlType::Q6K, cols.div_ceil(QK8))),
            bytes: if rows >= AMX_MIN_ROWS && panel::amx_available(GgmlType::Q4K) {
                crate::vec::committed(0, rows.next_multiple_of(32) * cols)
            } else {
                Vec::new()
            },
        }
    }

    pub fn bytes(&self) -> usize {
        self.q8.capacity() * std::mem::size_of::<BlockQ8>() + self.aux.capacity() * 4 + self.bytes.capacity()
    }
}

use crate::pool::SendPtr;

/// Task `t`'s panel of a product with panels packed at load (`pk`: `n`
/// outputs of `k` inputs), with the blocks and aux values an activation
/// row has, the task's first output and its number of outputs.
fn task_panel(ty: GgmlType, k: usize, n: usize, pk: &[u8], t: usize) -> (usize, usize, usize, usize, PanelRef<'_>) {
    let o0 = t * FEATURES_PER_TASK;
    let panel = PanelRef::of_matrix(ty, k, pk, t);
    (
        k / QK8,
        aux_len(ty, k / QK8),
        o0,
        (n - o0).min(FEATURES_PER_TASK),
        panel,
    )
}

/// Task `t` of a product with panels packed at load (`pk`: `n` outputs of
/// `k` inputs): its 16 outputs for every activation row, the rows handed
/// to the kernel in tiles (`panel::tiles`).
///
/// # Safety
///
/// `out` holds `n_rows * n` floats; no other task writes outputs
/// `16 t..16 (t + 1)` of any row while this one runs.
#[allow(clippy::too_many_arguments)]
unsafe fn packed_task(
    ty: GgmlType,
    k: usize,
    n: usize,
    pk: &[u8],
    t: usize,
    n_rows: usize,
    q8: &[BlockQ8],
    aux: &[i32],
    out: *mut f32,
) {
    let (nb, al, o0, lanes, panel) = task_panel(ty, k, n, pk, t);
    for (r0, m) in panel::tiles(n_rows) {
        let acts: [&[BlockQ8]; panel::TILE_ROWS] = std::array::from_fn(|i| {
            let r = r0 + i.min(m - 1);
            &q8[r * nb..(r + 1) * nb]
        });
        let auxs: [&[i32]; panel::TILE_ROWS] = std::array::from_fn(|i| {
            let r = r0 + i.min(m - 1);
            &aux[r * al..(r + 1) * al]
        });
        // SAFETY: rows r0..r0 + m, outputs o0..o0 + lanes of `out`, which
        // the caller gives this task alone.
        unsafe { panel.dot_into(&acts[..m], &auxs[..m], lanes, out.add(r0 * n + o0), n, r0 == 0) };
    }
}

/// Activation rows an AMX task takes: as many as keep their bytes within
/// half of a core's L2 for the whole task, in whole groups of 32.
fn amx_block_rows(k: usize) -> usize {
    (AMX_BLOCK_BYTES / k).clamp(32, panel::AMX_ROWS) / 32 * 32
}

/// An AMX task: panel `t` of a product with packed panels (`pk`: `n`
/// outputs of `k` inputs) against activation rows `r0..r0 + m`, whose
/// bytes, blocks and aux values `bytes`, `q8` and `aux` hold (all rows').
///
/// # Safety
///
/// `out` holds `(r0 + m) * n` floats at least; no other task writes
/// outputs `16 t..16 (t + 1)` of rows `r0..r0 + m` while this one runs.
#[allow(clippy::too_many_arguments)]
unsafe fn amx_task(
    ty: GgmlType,
    k: usize,
    n: usize,
    pk: &[u8],
    t: usize,
    r0: usize,
    m: usize,
    bytes: &[i8],
    q8: &[BlockQ8],
    aux: &[i32],
    out: *mut f32,
) {
    let (nb, al, o0, lanes, panel) = task_panel(ty, k, n, pk, t);
    // SAFETY: rows r0..r0 + m, outputs o0..o0 + lanes of `out`, this
    // task's alone (the caller's promise).
    unsafe {
        panel.amx_dot_into(
            &bytes[r0 * k..],
            &q8[r0 * nb..(r0 + m) * nb],
            &aux[r0 * al..(r0 + m) * al],
            m,
            lanes,
            out.add(r0 * n + o0),
            n,
        )
    };
}

/// A feed-forward block's gate and up products and its activation in
/// one job: `up_out` = `x` times `wu` transposed, and `gate_out` =
/// `act(x times wg transposed, up_out)` (`act`: `ops::silu_mul` or
/// `ops::gelu_mul`, which take `gate` in place). A task multiplies one
/// panel of each matrix, the same 16 outputs, and applies `act` to them
/// while they are in its cache, where the products and then a pass of
/// the activation over every row would write both matrices' outputs out
/// to memory and read them back. The bits are those of [`matmul_many`]
/// and then `act` over whole rows: the activation is elementwise, and
/// `act` gives an element the same bits wherever a slice puts it (its
/// vector body and its scalar tail compute the same function, tested).
///
/// Runs only where both matrices are packed panels of one type and
/// shape; returns false, having done nothing, otherwise.
#[allow(clippy::too_many_arguments)]
pub fn matmul_gated(
    pool: &ThreadPool,
    wg: &Weight,
    wu: &Weight,
    x: &[f32],
    n_rows: usize,
    gate_out: &mut [f32],
    up_out: &mut [f32],
    act: fn(&mut [f32], &[f32]),
    scratch: &mut MatmulScratch,
) -> bool {
    let (ty, k, n) = (wg.ty, wg.cols, wg.rows);
    let (Some(pg), Some(pu)) = (wg.packed, wu.packed) else {
        return false;
    };
    if wu.ty != ty || wu.cols != k || wu.rows != n || is_float(ty) || !supports(ty) || !panel::available(ty) {
        return false;
    }
    assert_eq!(x.len(), n_rows * k, "matmul: input shape");
    assert_eq!(gate_out.len(), n_rows * n, "matmul: output shape");
    assert_eq!(up_out.len(), n_rows * n, "matmul: output shape");
    let (nb, al) = (k / QK8, aux_len(ty, k / QK8));
    let amx = n_rows >= AMX_MIN_ROWS && panel::amx_available(ty);
    quantize_acts(pool, ty, x, n_rows, k, scratch, true, amx);
    let q8 = &scratch.q8[..n_rows * nb];
    let aux = &scratch.aux[..n_rows * al];
    let (gp, up) = (SendPtr(gate_out.as_mut_ptr()), SendPtr(up_out.as_mut_ptr()));
    let tasks = n.div_ceil(FEATURES_PER_TASK);
    // The activation of rows `r0..r1`, outputs of panel `t`.
    let activate = |t: usize, r0: usize, r1: usize| {
        let (gp, up) = (&gp, &up);
        let o0 = t * FEATURES_PER_TASK;
        let lanes = (n - o0).min(FEATURES_PER_TASK);
        for r in r0..r1 {
            // SAFETY: these outputs are the calling task's alone, and
            // both buffers hold n_rows x n floats.
            let (g, u) = unsafe {
                (
                    std::slice::from_raw_parts_mut(gp.0.add(r * n + o0), lanes),
                    std::slice::from_raw_parts(up.0.add(r * n + o0), lanes),
                )
            };
            act(g, u);
        }
    };
    if amx {
        let block = amx_block_rows(k);
        let n_blocks_rows = n_rows.div_ceil(block);
        let bytes = &scratch.bytes[..n_rows.next_multiple_of(32) * k];
        pool.run(n_blocks_rows * tasks, &|task| {
            let (gp, up) = (&gp, &up);
            let (r0, t) = (task / tasks * block, task % tasks);
            let m = (n_rows - r0).min(block);
            // SAFETY: each (r, o) of either output is written by exactly
            // one task.
            unsafe {
                amx_task(ty, k, n, pg, t, r0, m, bytes, q8, aux, gp.0);
                amx_task(ty, k, n, pu, t, r0, m, bytes, q8, aux, up.0);
            }
            activate(t, r0, r0 + m);
        });
    } else {
        pool.run(tasks, &|t| {
            let (gp, up) = (&gp, &up);
            // SAFETY: each task writes its own outputs of either buffer.
            unsafe {
                packed_task(ty, k, n, pg, t, n_rows, q8, aux, gp.0);
                packed_task(ty, k, n, pu, t, n_rows, q8, aux, up.0);
            }
            activate(t, 0, n_rows);
        });
    }
    true
}

/// The most products [`matmul_many`] runs as one job (more run one at a
/// time).
const MANY_MAX: usize = 4;

/// Several products of one input, `outs[i]` (`n_rows x ws[i].rows`) = `x`
/// times `ws[i]` transposed, each with the bits `matmul` gives it: a
/// layer's query, key and value projections, or its gate and up. Where
/// the weights share one type and width and are packed at load (and the
/// rows do not take the AMX tiles), the input is quantized once and all
/// the products' tasks go to the pool in one hand-off, where one call each
/// would quantize it three times and wait for the pool three times;
/// otherwise one `matmul` each.
pub fn matmul_many(
    pool: &ThreadPool,
    ws: &[&Weight],
    x: &[f32],
    n_rows: usize,
    outs: &mut [&mut [f32]],
    scratch: &mut MatmulScratch,
) {
    assert_eq!(ws.len(), outs.len(), "matmul_many: one output per weight");
    let Some(first) = ws.first() else { return };
    let (ty, k) = (first.ty, first.cols);
    let fused = (2..=MANY_MAX).contains(&ws.len())
        && !is_float(ty)
        && supports(ty)
        && panel::available(ty)
        && !(n_rows >= AMX_MIN_ROWS && panel::amx_available(ty))
        && ws.iter().all(|w| w.ty == ty && w.cols == k && w.packed.is_some());
    if !fused {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            matmul(pool, w, x, n_rows, out, scratch);
        }
        return;
    }
    assert_eq!(x.len(), n_rows * k, "matmul: input shape");
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(out.len(), n_rows * w.rows, "matmul: output shape");
    }
    let (nb, al) = (k / QK8, aux_len(ty, k / QK8));
    quantize_acts(pool, ty, x, n_rows, k, scratch, true, false);
    let (q8, aux) = (&scratch.q8[..n_rows * nb], &scratch.aux[..n_rows * al]);
    // Each product's first task, and where its outputs go.
    // (Fixed arrays: this runs for every layer of every pass.)
    let mut first_task = [usize::MAX; MANY_MAX + 1];
    let mut ptrs: [SendPtr<f32>; MANY_MAX] = std::array::from_fn(|_| SendPtr(std::ptr::null_mut()));
    let mut total = 0;
    for (i, (w, o)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        first_task[i] = total;
        ptrs[i] = SendPtr(o.as_mut_ptr());
        total += w.rows.div_ceil(FEATURES_PER_TASK);
    }
    first_task[ws.len()] = total;
    let first_task = &first_task[..=ws.len()];
    pool.run(total, &|task| {
        let i = first_task.partition_point(|&f| f <= task) - 1;
        let w = ws[i];
        let pk = w.packed.unwrap_or_default();
        // SAFETY: task `task` is task `task - first_task[i]` of product i
        // alone, whose output holds n_rows x w.rows floats.
        unsafe { packed_task(ty, k, w.rows, pk, task - first_task[i], n_rows, q8, aux, ptrs[i].0) }
    });
}

/// Quantizes the `n_rows` activation rows of `x` (`k` wide) for weights of
/// type `ty` into `scratch` (grown here where it is short): their blocks, with
/// `use_panel` the aux values panels read, with `amx` their bytes where
/// the tiles read them.
#[allow(clippy::too_many_arguments)]
fn quantize_acts(
    pool: &ThreadPool,
    ty: GgmlType,
    x: &[f32],
    n_rows: usize,
    k: usize,
    scratch: &mut MatmulScratch,
    use_panel: bool,
    amx: bool,
) {
    let nb = k / QK8;
    let al = if use_panel { aux_len(ty, nb) } else { 0 };
    if scratch.q8.len() < n_rows * nb {
        scratch.q8.resize(n_rows * nb, BlockQ8::default());
    }
    if scratch.aux.len() < n_rows * al {
        scratch.aux.resize(n_rows * al, 0);
    }
    if amx && scratch.bytes.len() < n_rows.next_multiple_of(32) * k {
        scratch.bytes.resize(n_rows.next_multiple_of(32) * k, 0);
    }
    let format = act_format(ty);
    if n_rows <= SERIAL_QUANTIZE_ROWS {
        // A few rows quantize faster than a hand-off to the pool.
        for (r, xr) in x.chunks_exact(k).enumerate() {
            let qr = &mut scratch.q8[r * nb..(r + 1) * nb];
            quantize_row(format, xr, qr);
            if use_panel {
                activation_aux(ty, qr, &mut scratch.aux[r * al..(r + 1) * al]);
            }
        }
    } else {
        let bytes_len = scratch.bytes.len();
        let q8_ptr = SendBlocks(
            scratch.q8.as_mut_ptr(),
            scratch.aux.as_mut_ptr(),
            scratch.bytes.as_mut_ptr(),
        );
        pool.run(n_rows, &|r| {
            let qp = &q8_ptr;
            // SAFETY: each row's blocks and aux values are written by
            // exactly one task.
            let blocks = unsafe { std::slice::from_raw_parts_mut(qp.0.add(r * nb), nb) };
            quantize_row(format, &x[r * k..(r + 1) * k], blocks);
            if use_panel {
                let aux = unsafe { std::slice::from_raw_parts_mut(qp.1.add(r * al), al) };
                activation_aux(ty, blocks, aux);
            }
            if amx {
                // SAFETY: each row's bytes are written by exactly one task.
                unsafe { panel::amx_place_row_raw(blocks, r, qp.2, bytes_len) };
            }
        });
    }
}

struct SendBlocks(*mut BlockQ8, *mut i32, *mut i8);
// SAFETY: tasks write disjoint blocks (see where the tasks are made).
unsafe impl Sync for SendBlocks {}

/// Output features handed to a thread at a time.
const FEATURES_PER_TASK: usize = 16;
/// Up to this many activation rows are quantized on the calling thread.
const SERIAL_QUANTIZE_ROWS: usize = 4;

/// Activation rows a task takes per pass over its weight rows (the kernel
/// tiles them further).
const ROWS_PER_PASS: usize = 64;

/// From this many activation rows on, tasks pack their weight rows into a
/// panel. Packing costs about as much as two rows of row-at-a-time
/// products (the `dotbench` example: at 2 rows the two run at about the
/// same speed, at 4 rows panels are 1.3-1.7x faster, at 64 rows 3-4x; on
/// the real models 4- and 8-row forwards were faster with panels).
pub const PANEL_MIN_ROWS: usize = 3;

/// From this many activation rows on, products with packed K-quant panels
/// run on AMX tiles where the CPU has them ([`panel::amx_available`]).
/// A task expands its panel's levels a super-block at a time, which
/// pays off over many rows; a tile product costs the same for 1
/// and 16 rows.
pub const AMX_MIN_ROWS: usize = 16;

/// The activation bytes one AMX task takes at most (rows of them, 32 to
/// 128): half of a 2 MiB L2.
const AMX_BLOCK_BYTES: usize = 1 << 20;

thread_local! {
    /// The activations rounded to f16 or bf16 (llama.cpp's numerics).
    static ACTS_ROUNDED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Each thread's f32 copy of an F16 or BF16 weight row.
    static ROW_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Each thread's panel, reused across calls (it grows to the longest
    /// weight row it has packed).
    static PANEL: RefCell<Panel> = RefCell::new(Panel::new());

}

/// `out` (`n_rows x w.rows`) = `x` (`n_rows x w.cols`) times `w` transposed.
pub fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], n_rows: usize, out: &mut [f32], scratch: &mut MatmulScratch) {
    let (k, n) = (w.cols, w.rows);
    assert_eq!(x.len(), n_rows * k, "matmul: input shape");
    assert_eq!(out.len(), n_rows * n, "matmul: output shape");
    let out_ptr = SendPtr(out.as_mut_ptr());
    let tasks = n.div_ceil(FEATURES_PER_TASK);
    if is_float(w.ty) {
        // F16 and BF16 rows widen to f32 exactly, once per call and row.
        let wf: Option<&[f32]> = (w.ty == GgmlType::F32).then(|| bytemuck_f32(w.data));
        pool.run(tasks, &|t| {
            let op = &out_ptr;
            ROW_F32.with(|buf| {
                let mut buf = buf.borrow_mut();
                for o in t * FEATURES_PER_TASK..((t + 1) * FEATURES_PER_TASK).min(n) {
                    let wr: &[f32] = match wf {
                        Some(wf) => &wf[o * k..(o + 1) * k],
                        None => {
                            buf.resize(k, 0.0);
                            w.row_f32(o, &mut buf[..k]);
                            &buf[..k]
                        }
                    };
                    for r in 0..n_rows {
                        let v = dot_f32(wr, &x[r * k..(r + 1) * k]);
                        // SAFETY: each (r, o) is written by exactly one task.
                        unsafe { *op.0.add(r * n + o) = v };
                    }
                }
            });
        });
        return;
    }
    assert!(supports(w.ty), "matmul: unsupported weight type {}", w.ty);
    let nb = k / QK8;
    // Packed panels serve every product; otherwise tasks pack their rows
    // from a few activation rows on.
    let packed = w.packed.filter(|_| panel::available(w.ty));
    let use_panel = packed.is_some() || (n_rows >= PANEL_MIN_ROWS && panel::available(w.ty));
    let al = if use_panel { aux_len(w.ty, nb) } else { 0 };
    let ty = w.ty;
    let amx = packed.is_some() && n_rows >= AMX_MIN_ROWS && panel::amx_available(ty);
    quantize_acts(pool, ty, x, n_rows, k, scratch, use_panel, amx);
    let q8 = &scratch.q8[..n_rows * nb];
    let aux = &scratch.aux[..n_rows * al];
    if let (true, Some(pk)) = (amx, packed) {
        // Tasks: blocks of activation rows (as many as keep their bytes
        // within half of a core's L2 for the whole task) times panels,
        // block by block, so that each thread's claims keep to a block.
        let block = amx_block_rows(k);
        let n_blocks_rows = n_rows.div_ceil(block);
        let bytes = &scratch.bytes[..n_rows.next_multiple_of(32) * k];
        pool.run(n_blocks_rows * tasks, &|task| {
            let op = &out_ptr;
            let (r0, t) = (task / tasks * block, task % tasks);
            // SAFETY: each (r, o) is written by exactly one task.
            unsafe { amx_task(ty, k, n, pk, t, r0, (n_rows - r0).min(block), bytes, q8, aux, op.0) };
        });
        return;
    }
    if let Some(pk) = packed {
        // Panels packed at load: no per-task set-up beyond the panel's
        // place, the activation rows handed over in tiles (`panel::tiles`).
        pool.run(tasks, &|t| {
            let op = &out_ptr;
            // SAFETY: each task writes its own outputs of `out`.
            unsafe { packed_task(ty, k, n, pk, t, n_rows, q8, aux, op.0) }
        });
        return;
    }
    pool.run(tasks, &|t| {
        let op = &out_ptr;
        let o0 = t * FEATURES_PER_TASK;
        let o1 = (o0 + FEATURES_PER_TASK).min(n);
        let wrows: [&[u8]; FEATURES_PER_TASK] = std::array::from_fn(|i| w.row((o0 + i).min(o1 - 1)));
        let wrows = &wrows[..o1 - o0];
        // Results of the row kernel before they are scattered; a full pass's
        // worth only where one is needed (zeroing it costs, in decode).
        let mut small = [0f32; FEATURES_PER_TASK * 4];
        let mut big = if !use_panel && n_rows > 4 {
            Some([0f32; FEATURES_PER_TASK * ROWS_PER_PASS])
        } else {
            None
        };
        PANEL.with(|p| {
            let mut own = p.borrow_mut();
            let panel = if use_panel {
                own.pack(ty, wrows);
                Some(own.as_ref())
            } else {
                None
            };
            for r0 in (0..n_rows).step_by(ROWS_PER_PASS) {
                let m = ROWS_PER_PASS.min(n_rows - r0);
                let acts: [&[BlockQ8]; ROWS_PER_PASS] = std::array::from_fn(|i| {
                    let r = (r0 + i).min(n_rows - 1);
                    &q8[r * nb..(r + 1) * nb]
                });
                if let Some(panel) = panel {
                    let auxs: [&[i32]; ROWS_PER_PASS] = std::array::from_fn(|i| {
                        let r = (r0 + i).min(n_rows - 1);
                        &aux[r * al..(r + 1) * al]
                    });
                    panel.dot_with(&acts[..m], &auxs[..m], o1 - o0, |r, vals| {
                        // SAFETY: each (r, o) is written by exactly one task.
                        let dst = unsafe { std::slice::from_raw_parts_mut(op.0.add((r0 + r) * n + o0), vals.len()) };
                        dst.copy_from_slice(vals);
                    });
                    continue;
                }
                let tile: &mut [f32] = match &mut big {
                    Some(b) => b,
                    None => &mut small,
                };
                let out_tile = &mut tile[..wrows.len() * m];
                dot_tile(ty, wrows, &acts[..m], out_tile);
                for (i, o) in (o0..o1).enumerate() {
                    for r in 0..m {
                        // SAFETY: each (r, o) is written by exactly one task.
                        unsafe { *op.0.add((r0 + r) * n + o) = out_tile[i * m + r] };
                    }
                }
            }
        });
    });
}

/// [`matmul`] with each product summed in the float order of llama.cpp's
/// x86 kernel for the weight type ([`crate::ggml::dot_quant`]), for
/// [`crate::ggml::Numerics::Ggml`]. Activations are quantized exactly as
/// for [`matmul`]; types without a ggml order here take [`matmul`]. As in
/// llama.cpp, a K-quant row's last bits depend on its batch
/// ([`crate::ggml::Kernel::for_row`]).
pub fn matmul_ggml(
    pool: &ThreadPool,
    w: &Weight,
    x: &[f32],
    n_rows: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    if is_float(w.ty) {
        return matmul_ggml_float(pool, w, x, n_rows, out);
    }
    if !crate::ggml::dot_supports(w.ty) {
        return matmul(pool, w, x, n_rows, out, scratch);
    }
    let (k, n) = (w.cols, w.rows);
    assert_eq!(x.len(), n_rows * k, "matmul: input shape");
    assert_eq!(out.len(), n_rows * n, "matmul: output shape");
    let nb = k / QK8;
    if scratch.q8.len() < n_rows * nb {
        scratch.q8.resize(n_rows * nb, BlockQ8::default());
    }
    let format = act_format(w.ty);
    for (r, xr) in x.chunks_exact(k).enumerate() {
        quantize_row(format, xr, &mut scratch.q8[r * nb..(r + 1) * nb]);
    }
    let q8 = &scratch.q8[..n_rows * nb];
    let out_ptr = SendPtr(out.as_mut_ptr());
    let ty = w.ty;
    pool.run(n.div_ceil(FEATURES_PER_TASK), &|t| {
        let op = &out_ptr;
        for o in t * FEATURES_PER_TASK..((t + 1) * FEATURES_PER_TASK).min(n) {
            let wr = w.row(o);
            for r in 0..n_rows {
                let kernel = crate::ggml::Kernel::for_row(ty, r, n_rows);
                let v = crate::ggml::dot_quant(ty, wr, &q8[r * nb..(r + 1) * nb], kernel);
                // SAFETY: each (r, o) is written by exactly one task.
                unsafe { *op.0.add(r * n + o) = v };
            }
        }
    });
}

/// F32, F16 and BF16 matrices as llama.cpp multiplies them: the
/// activations rounded to the weights' type, then `vec_dot_f32` /
/// `vec_dot_f16` / `vec_dot_bf16` for one row, llamafile's `tinyBLAS` for
/// two or more (where its shapes allow: output rows a multiple of 4, rows
/// a multiple of its vector).
fn matmul_ggml_float(pool: &ThreadPool, w: &Weight, x: &[f32], n_rows: usize, out: &mut [f32]) {
    use crate::ggml;
    let (k, n) = (w.cols, w.rows);
    assert_eq!(x.len(), n_rows * k, "matmul: input shape");
    assert_eq!(out.len(), n_rows * n, "matmul: output shape");
    let ty = w.ty;
    let vector = if ty == GgmlType::BF16 { 32 } else { 16 };
    let tinyblas = n_rows >= 2 && n.is_multiple_of(4) && k.is_multiple_of(vector);
    ACTS_ROUNDED.with(|xr| {
        let mut xr = xr.borrow_mut();
        xr.clear();
        xr.extend(x.iter().map(|&v| match ty {
            GgmlType::F16 => ggml::round_f16(v),
            GgmlType::BF16 => ggml::round_bf16(v),
            _ => v,
        }));
        let xr = &xr[..];
        let out_ptr = SendPtr(out.as_mut_ptr());
        pool.run(n.div_ceil(FEATURES_PER_TASK), &|t| {
            let op = &out_ptr;
            ROW_F32.with(|buf| {
                let mut buf = buf.borrow_mut();
                buf.resize(k, 0.0);
                for o in t * FEATURES_PER_TASK..((t + 1) * FEATURES_PER_TASK).min(n) {
                    w.row_f32(o, &mut buf[..k]);
                    // (An f32 row is copied too: these are small matrices.)
                    for r in 0..n_rows {
                        let (wr, a) = (&buf[..k], &xr[r * k..(r + 1) * k]);
                        // (f32 and f16 rows sum alike once widened.)
                        let v = match (ty, tinyblas) {
                            (GgmlType::BF16, false) => ggml::dot_bf16(wr, a),
                            (GgmlType::BF16, true) => ggml::dot_bf16_tinyblas(wr, a),
                            (GgmlType::F16, false) => ggml::dot_f16(wr, a),
                            (_, false) => ggml::dot_f32(wr, a),
                            (_, true) => ggml::dot_f16_tinyblas(wr, a),
                        };
                        // SAFETY: each (r, o) is written by exactly one task.
                        unsafe { *op.0.add(r * n + o) = v };
                    }
                }
            });
        });
    });
}

/// Views little-endian f32 bytes as f32s (the map is 32-byte aligned and
/// GGUF tensor offsets are aligned, so f32 data is 4-byte aligned).
fn bytemuck_f32(b: &[u8]) -> &[f32] {
    assert_eq!(b.as_ptr() as usize % 4, 0, "f32 tensor data must be 4-byte aligned");
    // SAFETY: alignment checked; every bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len() / 4) }
}

/// An f32 tensor's data as f32s.
pub fn f32_data(b: &[u8]) -> &[f32] {
    bytemuck_f32(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_batch_and_thread_invariant() {
        // 17 rows take the panel kernel where the CPU has one; each row
        // alone takes the row-at-a-time kernel; a packed matrix takes the
        // panels for both: the bits must not change.
        let k = 512;
        let n = 37;
        let rows = 17;
        for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K] {
            let (data, pk) = test_matrix(ty, n, k, 0);
            let w = Weight {
                ty,
                rows: n,
                cols: k,
                data: &data,
                packed: None,
            };
            let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let mut all = vec![0f32; rows * n];
            let p2 = ThreadPool::new(2);
            let p1 = ThreadPool::new(1);
            matmul(&p2, &w, &x, rows, &mut all, &mut MatmulScratch::default());
            // The same matrix packed into panels, as a model packs it at
            // load: every row count runs on the panels.
            let wp = Weight { packed: Some(&pk), ..w };
            let mut all_packed = vec![0f32; rows * n];
            matmul(&p2, &wp, &x, rows, &mut all_packed, &mut MatmulScratch::default());
            // The same products three at a time (one input, as a layer's
            // query, key and value): the same bits, on one row and many.
            // (The middle one with the first 21 rows only.)
            let n2 = 21;
            let rb = ty.bytes_for(k as u64).unwrap() as usize;
            let mut pk2 = vec![0u8; panel::packed_matrix_bytes(ty, n2, k)];
            panel::pack_matrix(ty, &data[..n2 * rb], n2, k, &mut pk2);
            let w2 = Weight {
                rows: n2,
                data: &data[..n2 * rb],
                packed: Some(&pk2),
                ..wp
            };
            for m in [1, rows] {
                let mut outs = [vec![0f32; m * n], vec![0f32; m * n2], vec![0f32; m * n]];
                let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                matmul_many(
                    &p2,
                    &[&wp, &w2, &wp],
                    &x[..m * k],
                    m,
                    &mut refs,
                    &mut MatmulScratch::default(),
                );
                for (o, w) in outs.iter().zip([&wp, &w2, &wp]) {
                    let mut want = vec![0f32; m * w.rows];
                    matmul(&p2, w, &x[..m * k], m, &mut want, &mut MatmulScratch::default());
                    assert!(
                        o.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty} three at once, {m} rows"
                    );
                }
            }
            for r in 0..rows {
                let mut one = vec![0f32; n];
                matmul(
                    &p1,
                    &w,
                    &x[r * k..(r + 1) * k],
                    1,
                    &mut one,
                    &mut MatmulScratch::default(),
                );
                let mut one_packed = vec![0f32; n];
                matmul(
                    &p2,
                    &wp,
                    &x[r * k..(r + 1) * k],
                    1,
                    &mut one_packed,
                    &mut MatmulScratch::default(),
                );
                for o in 0..n {
                    let want = one[o].to_bits();
                    assert_eq!(want, all[r * n + o].to_bits(), "{ty} row {r} out {o}");
                    assert_eq!(want, all_packed[r * n + o].to_bits(), "{ty} packed, row {r} out {o}");
                    assert_eq!(want, one_packed[o].to_bits(), "{ty} packed alone, row {r} out {o}");
                }
            }
        }
    }

    /// A matrix of `n` random-looking rows of type `ty`, `k` wide, with
    /// sane scales (`seed` varies the levels), and its packed panels.
    fn test_matrix(ty: GgmlType, n: usize, k: usize, seed: usize) -> (Vec<u8>, Vec<u8>) {
        let mut data = vec![0u8; n * ty.bytes_for(k as u64).unwrap() as usize];
        for (i, b) in data.iter_mut().enumerate() {
            *b = ((i + seed) * 131 % 251) as u8;
        }
        let scale_at: &[usize] = match ty {
            GgmlType::Q8_0 | GgmlType::Q5_0 => &[0],
            GgmlType::Q6K => &[208],
            _ => &[0, 2],
        };
        for blk in data.chunks_exact_mut(ty.type_size()) {
            for &a in scale_at {
                blk[a] = 0x00;
                blk[a + 1] = 0x2c; // f16 0.0625
            }
        }
        let mut pk = vec![0u8; panel::packed_matrix_bytes(ty, n, k)];
        panel::pack_matrix(ty, &data, n, k, &mut pk);
        (data, pk)
    }

    #[test]
    fn gate_and_up_with_their_activation_in_one_job_keep_the_bits() {
        // The fused job against the two products and then the activation
        // over whole rows: one row (decode), a few (panels), and 17 and 40
        // (the AMX tiles, where the CPU has them, for the K-quants); 37
        // outputs, so the last panel is partial.
        let (k, n) = (512, 37);
        let pool = ThreadPool::new(2);
        type Act = fn(&mut [f32], &[f32]);
        let acts: [(Act, &str); 2] = [(crate::ops::silu_mul, "silu"), (crate::ops::gelu_mul, "gelu")];
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            let (dg, pg) = test_matrix(ty, n, k, 0);
            let (du, pu) = test_matrix(ty, n, k, 7);
            let wg = Weight {
                ty,
                rows: n,
                cols: k,
                data: &dg,
                packed: Some(&pg),
            };
            let wu = Weight {
                data: &du,
                packed: Some(&pu),
                ..wg
            };
            for m in [1, 3, 17, 40] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                for (act, name) in acts {
                    let (mut g0, mut u0) = (vec![0f32; m * n], vec![0f32; m * n]);
                    matmul_many(
                        &pool,
                        &[&wg, &wu],
                        &x,
                        m,
                        &mut [&mut g0, &mut u0],
                        &mut MatmulScratch::default(),
                    );
                    act(&mut g0, &u0);
                    let (mut g1, mut u1) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                    let ran = matmul_gated(
                        &pool,
                        &wg,
                        &wu,
                        &x,
                        m,
                        &mut g1,
                        &mut u1,
                        act,
                        &mut MatmulScratch::default(),
                    );
                    assert!(ran, "{ty}: packed panels of one type run fused");
                    assert!(
                        g1.iter().zip(&g0).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty} {name}, {m} rows: gate"
                    );
                    assert!(
                        u1.iter().zip(&u0).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty} {name}, {m} rows: up"
                    );
                }
            }
            // Unpacked weights are left to the caller, outputs untouched.
            let bare = Weight { packed: None, ..wg };
            let mut g = vec![1.5f32; n];
            let mut u = vec![2.5f32; n];
            let x = vec![0.5f32; k];
            let ran = matmul_gated(
                &pool,
                &bare,
                &wu,
                &x,
                1,
                &mut g,
                &mut u,
                acts[0].0,
                &mut MatmulScratch::default(),
            );
            assert!(
                !ran && g.iter().all(|&v| v == 1.5) && u.iter().all(|&v| v == 2.5),
                "{ty}"
            );
        }
    }
}
