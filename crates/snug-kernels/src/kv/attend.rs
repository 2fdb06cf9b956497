//! Attention entry points over the storage: the queries' inputs and
//! scratch, the dispatch to the fused F16 kernels (`x86`, `x86_f16_512`)
//! and the lossy one (`coded`), the decoded reference, and llama.cpp's
//! arithmetic.

use super::*;

/// Softmax of one head's scores in place ([`crate::ops::softmax_fixed`]:
/// the same bits on every path, in an order fixed by the row's length).
pub(super) fn softmax_row(row: &mut [f32]) {
    crate::ops::softmax_fixed(row)
}

/// One query row's attention inputs.
#[derive(Clone, Copy, Debug)]
pub struct AttnQuery<'a> {
    /// The sequence's pages, in position order.
    pub pages: &'a [u32],
    /// The twin of each page ([`NO_TWIN`] where none); empty when the
    /// cache keeps no exact window.
    pub twins: &'a [u32],
    /// Keys at positions `start..end` are attended to.
    pub start: usize,
    pub end: usize,
}

impl AttnQuery<'_> {
    /// The twin that page `index` of the sequence is read from, for this
    /// query (at position `end - 1`): page 0 and the query's own page, when
    /// the cache keeps an exact window.
    #[inline]
    pub fn exact(&self, index: usize, page_tokens: usize) -> Option<u32> {
        if self.twins.is_empty() {
            return None;
        }
        if snug_core::twins::reads_exact(index, self.end, page_tokens) {
            let t = self.twins[index];
            assert!(t != NO_TWIN, "page {index} of the exact window has no twin");
            Some(t)
        } else {
            None
        }
    }
}

/// One row of [`attend_rows`]: its positions, its query heads (those that
/// share the KV head) and where their result goes (same shape).
pub struct AttnRow<'a> {
    pub query: AttnQuery<'a>,
    pub q: &'a [f32],
    pub out: &'a mut [f32],
}

/// Scratch for one thread's attention: scores of a group of query heads
/// over the context, one key or value vector, and (TQ4) the group's
/// rotated queries; over lossy pages, the running state of up to `rows`
/// rows and one page decoded.
pub struct AttnScratch {
    pub scores: Vec<f32>,
    pub kv: Vec<f32>,
    pub rotated: Vec<f32>,
    /// Rotated-domain value sums of the group.
    pub acc: Vec<f32>,
    /// The key offset's per-pair terms of the group, and their shift to a
    /// page.
    pub xy: Vec<f32>,
    pub shifted: Vec<f32>,
    /// The key offset's unrotated part, per head.
    pub c0: Vec<f32>,
    /// Running maximum and sum of exponentials per head (attention over
    /// lossy pages, page by page).
    pub run: Vec<f32>,
    /// The key offset's part of one page's scores, per head.
    pub offsets: Vec<f32>,
    /// One page's keys, then its values, decoded (several rows at once).
    pub decoded: Vec<f32>,
    /// Over F16 pages, a tile of keys, then of values, converted to f32
    /// once for a block of rows (empty where rows go one by one).
    pub tile: Vec<f32>,
    /// Rows [`attend_rows`] takes through the pages together.
    pub rows: usize,
}

impl AttnScratch {
    /// For up to `group` query heads per KV head and contexts up to `ctx`
    /// positions over F16 or F32 pages. Attention over lossy pages (Q8,
    /// TQ4) goes page by page and needs only `page_tokens` scores a head,
    /// whatever the context: pass `ctx = 0` for a cache in those formats.
    pub fn new(ctx: usize, head_dim: usize, group: usize, page_tokens: usize) -> AttnScratch {
        AttnScratch::for_rows(ctx, head_dim, group, page_tokens, 1)
    }

    /// [`AttnScratch::new`], with room for [`attend_rows`] to take `rows`
    /// rows together: over lossy pages each page is decoded once for all
    /// of them; over F16 pages (`ctx > 0`) each tile of keys and values is
    /// converted to f32 once, and every row's scores are kept (`rows`
    /// times the scores of one, at most [`BLOCK_SCORES`] or one row's).
    pub fn for_rows(ctx: usize, head_dim: usize, group: usize, page_tokens: usize, rows: usize) -> AttnScratch {
        let (g, rows) = (group.clamp(1, 8), rows.max(1));
        let one = ctx.max(page_tokens) * group.max(1);
        // Over F16 pages, room for `rows` rows' scores, up to
        // BLOCK_SCORES (a block at a long context takes fewer rows).
        let room = if ctx > 0 {
            (one * rows).min(one.max(BLOCK_SCORES))
        } else {
            one
        };
        AttnScratch {
            scores: crate::vec::committed(0.0, room),
            kv: crate::vec::committed(0.0, head_dim),
            rotated: crate::vec::committed(0.0, head_dim * group.max(1).max(rows * g)),
            acc: crate::vec::committed(0.0, head_dim * rows * g),
            xy: crate::vec::committed(0.0, head_dim * rows * g),
            shifted: crate::vec::committed(0.0, head_dim * g),
            c0: crate::vec::committed(0.0, rows * g),
            run: crate::vec::committed(0.0, 2 * rows * g),
            offsets: crate::vec::committed(0.0, page_tokens * g),
            decoded: crate::vec::committed(0.0, 2 * page_tokens * head_dim),
            tile: crate::vec::committed(0.0, if ctx > 0 && rows > 1 { F16_TILE.max(head_dim) } else { 0 }),
            rows,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        [
            &self.scores,
            &self.kv,
            &self.rotated,
            &self.acc,
            &self.xy,
            &self.shifted,
            &self.c0,
            &self.run,
            &self.offsets,
            &self.decoded,
            &self.tile,
        ]
        .iter()
        .map(|v| v.capacity() * 4)
        .sum()
    }
}

/// Attention of the `q.len() / head_dim` query heads that share KV head
/// `kv_head` of `layer`, over positions `query.start..query.end`, written to
/// `out` (same shape as `q`). Each key and value is read once for the whole
/// group. Per head: scores are `scale * q·k` (fixed-order dot), softmaxed in
/// f32, and values are accumulated in position order with fused
/// multiply-adds; the order of every operation is fixed by the position
/// range alone, so a head's result does not depend on batching.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    #[cfg(target_arch = "x86_64")]
    if let (Data::F16(dk), Data::F16(dv), true) = (
        &kv.k,
        &kv.v,
        crate::cpu::simd() >= crate::cpu::Simd::Avx2 && q.len() / kv.shape.head_dim <= 8,
    ) {
        let n = query.end - query.start;
        let scores = &mut scratch.scores[..q.len() / kv.shape.head_dim * n];
        if crate::cpu::simd() >= crate::cpu::Simd::Avx512Vnni {
            // SAFETY: AVX-512 F/BW, AVX2, FMA and F16C are present.
            unsafe { x86_f16_512::attend_group_f16(dk, dv, kv, layer, kv_head, query, q, scale, out, scores) };
        } else {
            // SAFETY: AVX2, FMA and F16C are present (checked by `simd`).
            unsafe { x86::attend_group_f16(dk, dv, kv, layer, kv_head, query, q, scale, out, scores) };
        }
        return;
    }
    if coded::takes(kv) {
        let mut rows = [AttnRow { query: *query, q, out }];
        return coded::attend(crate::cpu::simd(), kv, layer, kv_head, &mut rows, scale, scratch);
    }
    attend_group_generic(kv, layer, kv_head, query, q, scale, out, scratch)
}

/// Scores (f32) a scratch keeps at most for a block of rows over F16
/// pages (1 MiB), unless one row at its longest context needs more.
pub const BLOCK_SCORES: usize = 1 << 18;

/// Elements of keys, then of values, that rows taken together over F16
/// pages convert to f32 at a time: 16 KiB, which stay in the first-level
/// cache while every row of the block reads them (64 positions of a
/// 64-element head, 16 of a 256-element one).
pub(super) const F16_TILE: usize = 4096;

/// [`attend_group`] for each of `rows`, every row's result the same bits
/// as alone. Consecutive rows of one sequence (up to the scratch's
/// [`AttnScratch::rows`]) go through the pages together: over lossy pages
/// each page's codes are decoded once for all of them; over F16 pages
/// (AVX2 or AVX-512) each tile of keys and values is converted to f32
/// once, which takes the conversions (about 40% of a row's vector work
/// alone) off all but the first row.
pub fn attend_rows(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    rows: &mut [AttnRow],
    scale: f32,
    scratch: &mut AttnScratch,
) {
    if !coded::takes(kv) {
        #[cfg(target_arch = "x86_64")]
        if let (Data::F16(dk), Data::F16(dv), true) = (
            &kv.k,
            &kv.v,
            crate::cpu::simd() >= crate::cpu::Simd::Avx2 && !scratch.tile.is_empty(),
        ) {
            return f16_blocks(crate::cpu::simd(), dk, dv, kv, layer, kv_head, rows, scale, scratch);
        }
        for r in rows.iter_mut() {
            attend_group(kv, layer, kv_head, &r.query, r.q, scale, r.out, scratch);
        }
        return;
    }
    let mut rest = rows;
    while !rest.is_empty() {
        let pages = rest[0].query.pages;
        let n = rest
            .iter()
            .take(scratch.rows)
            .take_while(|r| std::ptr::eq(r.query.pages, pages))
            .count();
        let (block, tail) = rest.split_at_mut(n);
        coded::attend(crate::cpu::simd(), kv, layer, kv_head, block, scale, scratch);
        rest = tail;
    }
}

/// [`attend_rows`] over F16 pages with AVX2 or AVX-512: blocks of consecutive
/// rows of one sequence, with as many query heads each (at most 8) and
/// every row's scores in the scratch, go together; any other row alone.
/// `level` (at least AVX2, and one this CPU runs) picks the kernels of the
/// blocks.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) fn f16_blocks(
    level: crate::cpu::Simd,
    dk: &[u16],
    dv: &[u16],
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    rows: &mut [AttnRow],
    scale: f32,
    scratch: &mut AttnScratch,
) {
    let hd = kv.shape.head_dim;
    let mut rest = rows;
    while !rest.is_empty() {
        let (pages, width) = (rest[0].query.pages, rest[0].q.len());
        // The block: each row's scores placed after the one before's.
        let (mut offs, mut need, mut n) = ([0usize; 16], 0, 0);
        for r in rest.iter().take(scratch.rows.min(16)) {
            let size = width / hd * (r.query.end - r.query.start);
            let fits = std::ptr::eq(r.query.pages, pages)
                && r.q.len() == width
                && width / hd <= 8
                && need + size <= scratch.scores.len();
            if !fits {
                break;
            }
            (offs[n], need, n) = (need, need + size, n + 1);
        }
        let (block, tail) = rest.split_at_mut(n.max(1));
        if n >= 2 {
            let AttnScratch { scores, tile, .. } = scratch;
            let offs = &offs[..n];
            assert!(level >= crate::cpu::Simd::Avx2 && level <= crate::cpu::Simd::detect());
            // SAFETY: the CPU runs `level` (asserted): AVX2, FMA and F16C,
            // and AVX-512 F/BW at the higher level; every row's scores fit
            // (`need`), the tile holds F16_TILE elements and at least one
            // head.
            unsafe {
                if level >= crate::cpu::Simd::Avx512Vnni {
                    x86_f16_512::attend_rows_f16(dk, dv, kv, layer, kv_head, block, offs, scale, scores, tile)
                } else {
                    x86::attend_rows_f16(dk, dv, kv, layer, kv_head, block, offs, scale, scores, tile)
                }
            }
        } else {
            let r = &mut block[0];
            attend_group(kv, layer, kv_head, &r.query, r.q, scale, r.out, scratch);
        }
        rest = tail;
    }
}

/// [`attend_group`] through `read` (every vector decoded back to its own
/// domain), `dot_f32` and `axpy`, with the whole row of scores softmaxed
/// at once: the reference the fused F16 path (bitwise) and the lossy
/// paths (to rounding) are tested against.
#[allow(clippy::too_many_arguments)]
pub fn attend_group_generic(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    attend_group_decoded(kv, layer, kv_head, query, q, scale, out, scratch)
}

/// [`attend_group`] with the arithmetic of llama.cpp's flash attention for
/// one query row ([`crate::ggml`]): over F16 keys, each query head rounded
/// to f16 and its scores summed as [`crate::ggml::dot_f16`] sums them, then
/// times `scale`; an online softmax over the positions in order, the value
/// sum kept in f16 (F32 values: in f32); the sum divided out at the end.
/// Lossy formats are read decoded, as F32 pages are.
#[allow(clippy::too_many_arguments)]
pub fn attend_group_ggml(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd() >= crate::cpu::Simd::Avx2 {
        // SAFETY: AVX2 and FMA detected (`simd`).
        return unsafe { attend_group_ggml_fma(kv, layer, kv_head, query, q, scale, out, scratch) };
    }
    attend_group_ggml_body(kv, layer, kv_head, query, q, scale, out, scratch)
}

/// [`attend_group_ggml`] compiled with FMA instructions (same results,
/// without a library call per fused multiply-add).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_group_ggml_fma(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    attend_group_ggml_body(kv, layer, kv_head, query, q, scale, out, scratch)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_group_ggml_body(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    use crate::ggml::{dot_f16, round_f16, OnlineHead};
    let pt = kv.shape.page_tokens;
    let hd = kv.shape.head_dim;
    let group = q.len() / hd;
    let f16_k = matches!(kv.format, KvFormat::F16);
    let f16_v = matches!(kv.format_v, KvFormat::F16);
    let read = |is_v: bool, p: usize, buf: &mut [f32]| {
        let (index, slot) = (p / pt, p % pt);
        match query.exact(index, pt) {
            Some(t) => kv.read_twin(t, layer, is_v, kv_head, slot, buf),
            None => kv.read(query.pages[index], layer, is_v, kv_head, slot, p, buf),
        }
    };
    let AttnScratch {
        kv: kbuf,
        rotated: qh,
        acc,
        shifted: vbuf,
        run,
        ..
    } = scratch;
    let (qh, acc, vbuf) = (&mut qh[..group * hd], &mut acc[..group * hd], &mut vbuf[..hd]);
    let (maxes, sums) = run[..2 * group].split_at_mut(group);
    for (d, &x) in qh.iter_mut().zip(q) {
        *d = if f16_k { round_f16(x) } else { x };
    }
    acc.fill(0.0);
    maxes.fill(f32::NEG_INFINITY);
    sums.fill(0.0);
    for p in query.start..query.end {
        read(false, p, kbuf);
        read(true, p, vbuf);
        for g in 0..group {
            let s = dot_f16(kbuf, &qh[g * hd..(g + 1) * hd]) * scale;
            let mut head = OnlineHead {
                acc: &mut acc[g * hd..(g + 1) * hd],
                max: maxes[g],
                sum: sums[g],
                f16: f16_v,
            };
            head.push(s, vbuf);
            (maxes[g], sums[g]) = (head.max, head.sum);
        }
    }
    for g in 0..group {
        let head = OnlineHead {
            acc: &mut acc[g * hd..(g + 1) * hd],
            max: maxes[g],
            sum: sums[g],
            f16: f16_v,
        };
        head.finish(&mut out[g * hd..(g + 1) * hd]);
    }
}

/// Scores in position order, softmax, values summed in position order,
/// every vector decoded back to its own domain first (pages of the exact
/// window read from their twins): the reference.
#[allow(clippy::too_many_arguments)]
fn attend_group_decoded(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let pt = kv.shape.page_tokens;
    let hd = kv.shape.head_dim;
    let group = q.len() / hd;
    let n = query.end - query.start;
    let read = |is_v: bool, p: usize, buf: &mut [f32]| {
        let (index, slot) = (p / pt, p % pt);
        match query.exact(index, pt) {
            Some(t) => kv.read_twin(t, layer, is_v, kv_head, slot, buf),
            None => kv.read(query.pages[index], layer, is_v, kv_head, slot, p, buf),
        }
    };
    let AttnScratch { scores, kv: kbuf, .. } = scratch;
    let scores = &mut scores[..group * n];
    for (i, p) in (query.start..query.end).enumerate() {
        read(false, p, kbuf);
        for g in 0..group {
            scores[g * n + i] = crate::dot::dot_f32(&q[g * hd..(g + 1) * hd], kbuf) * scale;
        }
    }
    for g in 0..group {
        softmax_row(&mut scores[g * n..(g + 1) * n]);
    }
    out.fill(0.0);
    for (i, p) in (query.start..query.end).enumerate() {
        read(true, p, kbuf);
        for g in 0..group {
            crate::vec::axpy(&mut out[g * hd..(g + 1) * hd], scores[g * n + i], kbuf);
        }
    }
}
