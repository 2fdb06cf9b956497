//! Row-interleaved weight panels: the matrix-product kernel layout.
//!
//! A panel holds 16 weight rows with their quantized words interleaved:
//! one 512-bit vector carries the same 32-bit word of each of the 16 rows,
//! row i in lane i. The words are the GGUF block's own bytes (nibbles stay
//! packed), so a panel is as large as the rows it holds (Q4_K: 2.8% more,
//! for its scales unpacked to bytes), and a decode step reads no more
//! bytes from it than from the file. The kernel unpacks a word vector into
//! the unsigned levels of 4 elements of 16 rows with one or two logic
//! operations; one `vpdpbusd` against an activation's 4 bytes, broadcast to
//! every lane, then does 64 multiply-adds for 16 rows at once, where the
//! row-at-a-time kernels of [`crate::dot`] need a multiply and a widening
//! add per 32 products of one row.
//!
//! Panels serve two ways. A model packs its matrices once at load
//! ([`pack_matrix`]), and every product, a decode step's one row included,
//! runs on them; and [`Panel`] packs 16 rows per call, for matrices that
//! were not packed.
//!
//! The arithmetic is exactly the reference's (see [`crate::dot`]): each
//! lane computes its row's integer `isum` per block (a level offset is
//! taken back out with the activation block's sum, exactly), then performs
//! the same float operations in the same order, accumulators by block
//! number modulo 8. So a row's result is bitwise the row-at-a-time
//! kernels' result (tested), and the choice of kernel changes no bits.
//!
//! Panels need AVX2 at least. With AVX-512 VNNI a vector holds all sixteen
//! rows; with AVX2 alone (`panel_avx2.rs`) one holds eight, and the kernel
//! walks a panel's two halves in turn, with the same integers and float
//! operations. Without AVX2 [`available`] is false and the matrix product
//! uses the row-at-a-time kernels.
//!
//! Layout of one panel, per 32-element block (per 256-element super-block
//! for K-quants), lanes = rows, "word t" = bytes 4t..4t+4 of the field:
//!
//! | type | per block / super-block |
//! | --- | --- |
//! | Q4_0, Q4_1 | `qs` words 0..4 (64 B each); `d` 16 x f16; Q4_1: `m` 16 x f16 |
//! | Q5_0, Q5_1 | as Q4, plus after `qs` one vector of high bits, rearranged (see [`q5_high_bits`]) |
//! | Q8_0 | `qs` words 0..8, each byte XOR 0x80 (unsigned); `d` |
//! | Q4_K | `d`, `dmin` 16 x f16 each; scales `[8][16]` u8; minimums `[4][16][2]` u8; `qs` words 0..32 |
//! | Q6_K | scales `[16][16]` i8; `d` 16 x f16; per half: `ql` words 0..8, `qh` words 0..8, `ql` words 8..16 |

use crate::cpu::{simd, Simd};
use crate::dot::BlockQ8;
use crate::quant::GgmlType;

/// Weight rows per panel (the lanes of a 512-bit vector of 32-bit sums).
pub const PANEL_ROWS: usize = 16;

/// The most activation rows one kernel call takes against a panel: each
/// unpacked weight vector serves this many rows before the next is made.
pub const TILE_ROWS: usize = 8;

/// `n` activation rows split into tiles of at most [`TILE_ROWS`], as even
/// as possible (9 rows: 5 and 4, not 8 and 1, whose one-row tile would
/// unpack the weights for a single row): `(first row, rows)` each. A row's
/// arithmetic is the same in a tile of any size, so the split changes no
/// bits.
pub fn tiles(n: usize) -> impl Iterator<Item = (usize, usize)> {
    let k = n.div_ceil(TILE_ROWS);
    let (base, extra) = (n.checked_div(k).unwrap_or(0), n.checked_rem(k).unwrap_or(0));
    (0..k).scan(0, move |r0, t| {
        let rt = base + usize::from(t < extra);
        let at = *r0;
        *r0 += rt;
        Some((at, rt))
    })
}

/// Whether panels run on this machine for weight type `ty`.
pub fn available(ty: GgmlType) -> bool {
    matches!(simd(), Simd::Avx2 | Simd::Avx512Vnni) && supports(ty)
}

/// The weight types panels handle. (Q5_K, which none of the supported
/// model files use, runs on the row-at-a-time kernels.)
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q4K
            | GgmlType::Q6K
    )
}

/// Bytes of one packed unit: a 32-element block, or a K-quant's
/// 256-element super-block.
const fn unit_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 => 256 + 32,
        GgmlType::Q4_1 => 256 + 64,
        GgmlType::Q5_0 => 256 + 64 + 32,
        GgmlType::Q5_1 => 256 + 64 + 64,
        GgmlType::Q8_0 => 512 + 32,
        GgmlType::Q4K => Q4K_QS + 2048,
        GgmlType::Q6K => Q6K_HALF + 2 * 1536,
        _ => 0,
    }
}

// Offsets inside a Q4_K and a Q6_K packed super-block. The scales come
// first and the levels in the order the kernel first touches them, so that
// a panel is read front to back.
const Q4K_D: usize = 0;
const Q4K_DMIN: usize = 32;
const Q4K_SC: usize = 64;
const Q4K_MINS: usize = 192;
const Q4K_QS: usize = 320;
const Q6K_SC: usize = 0;
const Q6K_D: usize = 256;
/// Q6_K: each 128-element half holds `ql` words 0..8, then the half's `qh`
/// words, then `ql` words 8..16 (1536 bytes).
const Q6K_HALF: usize = 288;

/// Bytes of one panel of 16 rows of `cols` elements.
pub fn panel_bytes(ty: GgmlType, cols: usize) -> usize {
    assert!(supports(ty), "panels: unsupported type {ty}");
    let units = cols / ty.block_size();
    units * unit_bytes(ty)
}

/// Bytes of a whole matrix of `rows` x `cols` packed by [`pack_matrix`].
pub fn packed_matrix_bytes(ty: GgmlType, rows: usize, cols: usize) -> usize {
    rows.div_ceil(PANEL_ROWS) * panel_bytes(ty, cols)
}

/// The offset added to a per-32-block type's levels to make them unsigned.
fn level_offset(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        GgmlType::Q8_0 => 128,
        _ => 0,
    }
}

/// 32-bit values per activation row that panels read beside the row's
/// blocks ([`activation_aux`]), for rows of `n_blocks` 32-element blocks.
pub fn aux_len(ty: GgmlType, n_blocks: usize) -> usize {
    match ty {
        // Per 16 elements: -32 times their activation sum; then per block
        // its two 16-element sums as 16-bit halves (for the AVX2 kernel).
        GgmlType::Q6K => n_blocks * 3,
        // Per pair of blocks: their two activation sums as 16-bit halves.
        GgmlType::Q4K | GgmlType::Q5K => n_blocks / 2,
        // Per block: -offset times its activation sum.
        _ => n_blocks,
    }
}

/// The per-row values that take a panel's level offset back out (or, for
/// Q4_K, feed its minimums), from one quantized activation row.
pub fn activation_aux(ty: GgmlType, act: &[BlockQ8], out: &mut [i32]) {
    assert_eq!(out.len(), aux_len(ty, act.len()), "activation_aux: length");
    match ty {
        GgmlType::Q6K => {
            let (starts, pairs) = out.split_at_mut(2 * act.len());
            for ((b, o), pair) in act.iter().zip(starts.chunks_exact_mut(2)).zip(pairs.iter_mut()) {
                let s: [i32; 2] = std::array::from_fn(|h| b.qs[16 * h..16 * h + 16].iter().map(|&q| q as i32).sum());
                o[0] = -32 * s[0];
                o[1] = -32 * s[1];
                *pair = ((s[0] as u16 as u32) | ((s[1] as u16 as u32) << 16)) as i32;
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            for (p, o) in act.chunks_exact(2).zip(out.iter_mut()) {
                *o = ((p[0].sum as u16 as u32) | ((p[1].sum as u16 as u32) << 16)) as i32;
            }
        }
        _ => {
            let off = level_offset(ty);
            for (b, o) in act.iter().zip(out.iter_mut()) {
                *o = -off * b.sum;
            }
        }
    }
}

/// Q5_0 / Q5_1 high bits (bit j = element j) rearranged so that one
/// shift and a mask put each element's bit at bit 4 of its byte in the
/// kernel's vectors: byte j holds, at bit 2t, element 4t + j's bit and,
/// at bit 2t + 1, element 16 + 4t + j's (t = 0..4).
pub fn q5_high_bits(h: u32) -> u32 {
    let mut out = 0u32;
    for j in 0..4 {
        for t in 0..4 {
            out |= ((h >> (4 * t + j)) & 1) << (8 * j + 2 * t);
            out |= ((h >> (16 + 4 * t + j)) & 1) << (8 * j + 2 * t + 1);
        }
    }
    out
}

/// Where unit `u` of `units` sits in a panel: units are stored in the
/// order the kernel visits them, accumulator class by class (units c,
/// c + 8, c + 16, ... for class c), so that it reads a panel front to back
/// and the hardware prefetcher sees one stream.
fn unit_slot(u: usize, units: usize) -> usize {
    let c = u % 8;
    // Units in classes before c: class c' holds ceil((units - c') / 8).
    let before: usize = (0..c).map(|k| (units - k.min(units)).div_ceil(8)).sum();
    before + u / 8
}

/// Packs `rows` (1 to 16 rows of type `ty`, one length, a whole number of
/// blocks) into one panel at `out` (`panel_bytes` long). Lanes past the
/// last row repeat it.
pub fn pack_panel(ty: GgmlType, rows: &[&[u8]], out: &mut [u8]) {
    assert!(supports(ty), "panels: unsupported type {ty}");
    assert!(!rows.is_empty() && rows.len() <= PANEL_ROWS, "panels: 1 to 16 rows");
    let row_bytes = rows[0].len();
    assert!(rows.iter().all(|r| r.len() == row_bytes), "panels: rows of one length");
    let ts = ty.type_size();
    assert_eq!(row_bytes % ts, 0, "panels: whole weight blocks");
    let units = row_bytes / ts;
    let ub = unit_bytes(ty);
    assert_eq!(out.len(), units * ub, "panels: output length");
    let copy = |o: &mut [u8], at: usize, lane: usize, w: &[u8]| {
        o[at + 4 * lane..at + 4 * lane + 4].copy_from_slice(w);
    };
    for u in 0..units {
        let slot = unit_slot(u, units);
        let o = &mut out[slot * ub..(slot + 1) * ub];
        for lane in 0..PANEL_ROWS {
            let b = &rows[lane.min(rows.len() - 1)][u * ts..(u + 1) * ts];
            match ty {
                GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
                    // GGUF block: d, [m], [qh], qs.
                    let min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
                    let five = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1);
                    let qh_at = if min { 4 } else { 2 };
                    let qs_at = qh_at + if five { 4 } else { 0 };
                    for t in 0..4 {
                        copy(o, 64 * t, lane, &b[qs_at + 4 * t..qs_at + 4 * t + 4]);
                    }
                    let mut p = 256;
                    if five {
                        let h = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
                        copy(o, p, lane, &q5_high_bits(h).to_le_bytes());
                        p += 64;
                    }
                    o[p + 2 * lane..p + 2 * lane + 2].copy_from_slice(&b[0..2]);
                    if min {
                        o[p + 32 + 2 * lane..p + 32 + 2 * lane + 2].copy_from_slice(&b[2..4]);
                    }
                }
                GgmlType::Q8_0 => {
                    for t in 0..8 {
                        let at = 2 + 4 * t;
                        let w = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) ^ 0x8080_8080;
                        copy(o, 64 * t, lane, &w.to_le_bytes());
                    }
                    o[512 + 2 * lane..512 + 2 * lane + 2].copy_from_slice(&b[0..2]);
                }
                GgmlType::Q4K => {
                    for t in 0..32 {
                        copy(o, Q4K_QS + 64 * t, lane, &b[16 + 4 * t..20 + 4 * t]);
                    }
                    o[Q4K_D + 2 * lane..Q4K_D + 2 * lane + 2].copy_from_slice(&b[0..2]);
                    o[Q4K_DMIN + 2 * lane..Q4K_DMIN + 2 * lane + 2].copy_from_slice(&b[2..4]);
                    for j in 0..8 {
                        let (sc, m) = crate::quant::scale_min_k4(j, &b[4..16]);
                        o[Q4K_SC + 16 * j + lane] = sc;
                        o[Q4K_MINS + 32 * (j / 2) + 2 * lane + j % 2] = m;
                    }
                }
                GgmlType::Q6K => {
                    for t in 0..32 {
                        let (half, w) = (t / 16, t % 16);
                        let at = Q6K_HALF + 1536 * half + if w < 8 { 64 * w } else { 1024 + 64 * (w - 8) };
                        copy(o, at, lane, &b[4 * t..4 * t + 4]);
                    }
                    for t in 0..16 {
                        let at = Q6K_HALF + 1536 * (t / 8) + 512 + 64 * (t % 8);
                        copy(o, at, lane, &b[128 + 4 * t..132 + 4 * t]);
                    }
                    for g in 0..16 {
                        o[Q6K_SC + 16 * g + lane] = b[192 + g];
                    }
                    o[Q6K_D + 2 * lane..Q6K_D + 2 * lane + 2].copy_from_slice(&b[208..210]);
                }
                _ => unreachable!(),
            }
        }
    }
}

/// Packs a whole `rows` x `cols` matrix (`data`, row-major GGUF rows) into
/// consecutive panels at `out` ([`packed_matrix_bytes`] long); the last
/// panel repeats the last row in its spare lanes.
pub fn pack_matrix(ty: GgmlType, data: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    let rb = ty.bytes_for(cols as u64).expect("whole blocks") as usize;
    assert_eq!(data.len(), rows * rb, "pack_matrix: data length");
    let pb = panel_bytes(ty, cols);
    assert_eq!(out.len(), rows.div_ceil(PANEL_ROWS) * pb, "pack_matrix: output length");
    for (g, o) in out.chunks_exact_mut(pb).enumerate() {
        let r0 = g * PANEL_ROWS;
        let r1 = (r0 + PANEL_ROWS).min(rows);
        let rs: Vec<&[u8]> = (r0..r1).map(|r| &data[r * rb..(r + 1) * rb]).collect();
        pack_panel(ty, &rs, o);
    }
}

/// A packed panel, borrowed: from a packed matrix or a [`Panel`].
#[derive(Clone, Copy)]
pub struct PanelRef<'a> {
    ty: GgmlType,
    /// 32-element blocks per row.
    n_blocks: usize,
    data: &'a [u8],
}

impl<'a> PanelRef<'a> {
    /// Panel `g` of a matrix packed by [`pack_matrix`].
    pub fn of_matrix(ty: GgmlType, cols: usize, packed: &'a [u8], g: usize) -> PanelRef<'a> {
        let pb = panel_bytes(ty, cols);
        PanelRef {
            ty,
            n_blocks: cols / 32,
            data: &packed[g * pb..(g + 1) * pb],
        }
    }

    /// Dot products of the panel's rows with each activation row in `acts`
    /// (`aux` holds each row's [`activation_aux`]): `out[lane * acts.len() +
    /// r]` for the first `out.len() / acts.len()` lanes.
    pub fn dot(&self, acts: &[&[BlockQ8]], aux: &[&[i32]], out: &mut [f32]) {
        assert!(
            !acts.is_empty() && out.len().is_multiple_of(acts.len()),
            "panel: output shape"
        );
        let lanes = out.len() / acts.len();
        let n = acts.len();
        self.dot_with(acts, aux, lanes, |r, vals| {
            for (lane, &v) in vals.iter().enumerate() {
                out[lane * n + r] = v;
            }
        });
    }

    /// As [`PanelRef::dot`], handing each activation row's results (its
    /// first `lanes` lanes) to `put(r, values)`.
    pub fn dot_with(&self, acts: &[&[BlockQ8]], aux: &[&[i32]], lanes: usize, mut put: impl FnMut(usize, &[f32])) {
        let mut tile = [[0f32; PANEL_ROWS]; TILE_ROWS];
        for (r0, rt) in tiles(acts.len()) {
            // SAFETY: the tile holds `TILE_ROWS` rows of 16 lanes.
            unsafe {
                self.dot_into(
                    &acts[r0..r0 + rt],
                    &aux[r0..r0 + rt],
                    lanes,
                    tile.as_mut_ptr() as *mut f32,
                    PANEL_ROWS,
                    r0 == 0,
                )
            };
            for (r, vals) in tile.iter().enumerate().take(rt) {
                put(r0 + r, &vals[..lanes]);
            }
        }
    }

    /// As [`PanelRef::dot`], storing activation row r's first `lanes`
    /// results at `out + r * stride` (the matrix product writes straight
    /// into its output this way).
    ///
    /// `first`: whether this is the first call over this panel (of
    /// several for many activation rows); only the first prefetches the
    /// panel's bytes ahead of the kernel, later ones find them in cache.
    ///
    /// # Safety
    ///
    /// `out + r * stride .. + lanes` must be valid for writes for every
    /// activation row r.
    pub unsafe fn dot_into(
        &self,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        lanes: usize,
        out: *mut f32,
        stride: usize,
        first: bool,
    ) {
        let ty = self.ty;
        assert!(available(ty), "panels: unsupported type {ty} or CPU");
        assert_eq!(acts.len(), aux.len(), "panel: one aux per activation row");
        assert!((1..=PANEL_ROWS).contains(&lanes), "panel: 1 to 16 lanes");
        assert_eq!(self.data.len(), panel_bytes(ty, self.n_blocks * 32), "panel: length");
        assert!(
            acts.iter().all(|a| a.len() == self.n_blocks),
            "panel: activation length"
        );
        let al = aux_len(ty, self.n_blocks);
        assert!(aux.iter().all(|a| a.len() == al), "panel: aux length");
        let mask = if lanes == PANEL_ROWS {
            u16::MAX
        } else {
            (1u16 << lanes) - 1
        };
        for (r0, rt) in tiles(acts.len()) {
            // SAFETY: `available` checked the CPU; shapes checked above; the
            // caller vouches for the output.
            #[cfg(target_arch = "x86_64")]
            {
                let o = x86::Out {
                    ptr: out.add(r0 * stride),
                    stride,
                    mask,
                    prefetch: first && r0 == 0,
                };
                let (a, x) = (&acts[r0..r0 + rt], &aux[r0..r0 + rt]);
                if simd() == Simd::Avx512Vnni {
                    x86::dot(self.data.as_ptr(), ty, self.n_blocks, a, x, o);
                } else {
                    avx2::dot(self.data.as_ptr(), ty, self.n_blocks, a, x, o);
                }
            }
        }
    }
}

/// Sixteen weight rows packed per call, for matrices that were not packed
/// at load. The buffer grows to the longest row seen and is reused.
#[derive(Default)]
pub struct Panel {
    ty: Option<GgmlType>,
    n_blocks: usize,
    data: Vec<u8>,
}

impl Panel {
    pub fn new() -> Panel {
        Panel::default()
    }

    /// Bytes held by the panel's buffer.
    pub fn bytes(&self) -> usize {
        self.data.capacity()
    }

    /// Packs `rows` (1 to 16 weight rows of type `ty`, one length). Lanes
    /// past the last row repeat it.
    pub fn pack(&mut self, ty: GgmlType, rows: &[&[u8]]) {
        assert!(available(ty), "panels: unsupported type {ty} or CPU");
        let cols = rows[0].len() / ty.type_size() * ty.block_size();
        let pb = panel_bytes(ty, cols);
        if self.data.len() < pb {
            self.data.resize(pb, 0);
        }
        pack_panel(ty, rows, &mut self.data[..pb]);
        self.ty = Some(ty);
        self.n_blocks = cols / 32;
    }

    /// The packed rows.
    pub fn as_ref(&self) -> PanelRef<'_> {
        let ty = self.ty.expect("panel: packed");
        PanelRef {
            ty,
            n_blocks: self.n_blocks,
            data: &self.data[..panel_bytes(ty, self.n_blocks * 32)],
        }
    }

    /// [`PanelRef::dot`] on the packed rows.
    pub fn dot(&self, acts: &[&[BlockQ8]], aux: &[&[i32]], out: &mut [f32]) {
        self.as_ref().dot(acts, aux, out)
    }

    /// [`PanelRef::dot_with`] on the packed rows.
    pub fn dot_with(&self, acts: &[&[BlockQ8]], aux: &[&[i32]], lanes: usize, put: impl FnMut(usize, &[f32])) {
        self.as_ref().dot_with(acts, aux, lanes, put)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // lane- and row-indexed register arrays
#[path = "panel_avx2.rs"]
mod avx2;

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // lane- and row-indexed register arrays
mod x86 {
    use std::arch::x86_64::*;

    use super::{unit_bytes, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_QS, Q4K_SC, Q6K_D, Q6K_HALF, Q6K_SC};
    use crate::dot::BlockQ8;
    use crate::quant::GgmlType;

    /// Where a kernel stores its results: activation row r's lanes (those
    /// set in `mask`) at `ptr + r * stride`.
    #[derive(Clone, Copy)]
    pub(super) struct Out {
        pub ptr: *mut f32,
        pub stride: usize,
        pub mask: u16,
        /// Whether to prefetch the panel ahead of the kernel (the first
        /// tile over it).
        pub prefetch: bool,
    }

    /// How far ahead of the unit being read the first tile over a panel
    /// prefetches it, in bytes, into L2. The hardware's prefetchers stop at
    /// every 4 KiB page: without this, one core read 9-19 GB/s of Q6_K and
    /// Q4_K weights from DRAM with one activation row where a plain read
    /// streams 25-33, and with 2 KiB into L1 about 24; with 4-8 rows, Q6_K
    /// went from 45-64 to 74-89 GMAC/s and Q4_K from 73-83 to 76-114 (the
    /// `dotbench` example with `ROWS=262144`, Zen 5). On a Zen 4 VM whose
    /// DRAM answers more slowly, 2 KiB into L1 was too short: 8 KiB into
    /// L2 took Qwen2.5 1.5B's two-thread decode from 17.0 to 26.7 tokens a
    /// second (SmolLM2 191 to 251, Gemma 3 81 to 103, Qwen2.5 0.5B 58 to
    /// 64), prefill unchanged within noise; 16-64 KiB, or L1 as the
    /// target, did no better. Later tiles find the panel in L1 or L2 and
    /// do not prefetch.
    const PREFETCH_AHEAD: usize = 8192;

    /// Prefetches the `bytes` that lie [`PREFETCH_AHEAD`] past `q`, when
    /// `on`. (A prefetch past the end of the mapping is harmless: it never
    /// faults.)
    #[inline(always)]
    pub(super) unsafe fn prefetch(q: *const u8, bytes: usize, on: bool) {
        if !on {
            return;
        }
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(PREFETCH_AHEAD + o) as *const i8);
            o += 64;
        }
    }

    /// Part `i` of `n` of the `bytes`-long unit at `q`, prefetched as
    /// [`prefetch`] does. The K-quant kernels spread a unit's prefetches
    /// over its blocks: one burst of 36 (Q4_K) or 53 (Q6_K) lines a unit
    /// left one core reading 15-18 and 12-15 GB/s from DRAM; spread over 4
    /// and 8 steps, 20-21 and 22-24, where a plain read streams 24-27
    /// (`dotbench`, `ROWS=262144 K=1536`, Zen 4 VM).
    #[inline(always)]
    pub(super) unsafe fn prefetch_part(q: *const u8, bytes: usize, i: usize, n: usize, on: bool) {
        let start = (bytes * i / n) & !63;
        let end = (bytes * (i + 1) / n + 63) & !63;
        prefetch(q.wrapping_add(start), end - start, on);
    }

    /// The activation's 4 bytes at element `4t` of block `a`, in every lane.
    #[inline(always)]
    unsafe fn act4(a: &BlockQ8, t: usize) -> __m512i {
        _mm512_set1_epi32((a.qs.as_ptr().add(4 * t) as *const i32).read_unaligned())
    }

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        _mm512_loadu_si512(p as *const __m512i)
    }

    /// Sixteen f16 values at `p` as f32.
    #[inline(always)]
    unsafe fn f16x16(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }

    /// `a | (b & c)`.
    #[inline(always)]
    unsafe fn or_and(a: __m512i, b: __m512i, c: __m512i) -> __m512i {
        _mm512_ternarylogic_epi32::<0xF8>(a, b, c)
    }

    /// Low and high nibbles of every byte.
    #[inline(always)]
    unsafe fn nibbles(v: __m512i, m0f: __m512i) -> (__m512i, __m512i) {
        (
            _mm512_and_si512(v, m0f),
            _mm512_and_si512(_mm512_srli_epi16::<4>(v), m0f),
        )
    }

    /// The canonical sum of a lane's eight accumulators,
    /// `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`, for 16 lanes and
    /// `R` activation rows, built as the classes finish (a few registers
    /// instead of an array of all eight).
    struct Tree<const R: usize> {
        pending: [__m512; R],
        low: [__m512; R],
        high: [__m512; R],
    }

    impl<const R: usize> Tree<R> {
        #[inline(always)]
        unsafe fn new() -> Self {
            Tree {
                pending: [_mm512_setzero_ps(); R],
                low: [_mm512_setzero_ps(); R],
                high: [_mm512_setzero_ps(); R],
            }
        }

        /// Takes class `c`'s accumulators (classes in order 0..8).
        #[inline(always)]
        unsafe fn push(&mut self, c: usize, acc: &[__m512; R]) {
            for r in 0..R {
                match c {
                    0 | 2 | 4 | 6 => self.pending[r] = acc[r],
                    1 => self.low[r] = _mm512_add_ps(self.pending[r], acc[r]),
                    3 => self.low[r] = _mm512_add_ps(self.low[r], _mm512_add_ps(self.pending[r], acc[r])),
                    5 => self.high[r] = _mm512_add_ps(self.pending[r], acc[r]),
                    _ => {
                        let h = _mm512_add_ps(self.high[r], _mm512_add_ps(self.pending[r], acc[r]));
                        self.low[r] = _mm512_add_ps(self.low[r], h);
                    }
                }
            }
        }

        /// Stores the sums (after class 7): row r's first lanes at
        /// `out.ptr + r * out.stride`.
        #[inline(always)]
        unsafe fn store(&self, out: Out) {
            for r in 0..R {
                _mm512_mask_storeu_ps(out.ptr.add(r * out.stride), out.mask, self.low[r]);
            }
        }
    }

    /// Per-32-block kinds.
    const Q4: u8 = 0;
    const Q5: u8 = 1;
    const Q8: u8 = 2;

    /// Per-32-block types: accumulator class `c` takes blocks c, c+8, ...
    /// `KIND`: nibbles (Q4), nibbles and high bits (Q5) or bytes (Q8);
    /// `MIN`: a per-block minimum (Q4_1, Q5_1); `OFF`: a level offset taken
    /// out through `aux`.
    #[inline(always)]
    unsafe fn dot_blocks<const KIND: u8, const MIN: bool, const OFF: bool, const R: usize>(
        mut p: *const u8,
        ub: usize,
        n_blocks: usize,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: Out,
    ) {
        let m0f = _mm512_set1_epi8(0x0f);
        let m10 = _mm512_set1_epi8(0x10);
        // Bytes of levels (and high bits) before the scales.
        let d_at = match KIND {
            Q8 => 512,
            Q5 => 320,
            _ => 256,
        };
        let mut tree = Tree::<R>::new();
        for c in 0..8 {
            let mut acc = [_mm512_setzero_ps(); R];
            let mut b = c;
            while b < n_blocks {
                let q = p;
                prefetch(q, ub, out.prefetch);
                p = p.add(ub);
                let mut w = [_mm512_setzero_si512(); 8];
                if KIND == Q8 {
                    for t in 0..8 {
                        w[t] = load(q.add(t * 64));
                    }
                } else {
                    for t in 0..4 {
                        (w[t], w[t + 4]) = nibbles(load(q.add(t * 64)), m0f);
                    }
                    if KIND == Q5 {
                        // Element 4t + j's bit sits at bit 2t of byte j,
                        // element 16 + 4t + j's at bit 2t + 1: move each to
                        // bit 4.
                        let h = load(q.add(256));
                        w[0] = or_and(w[0], _mm512_slli_epi16::<4>(h), m10);
                        w[1] = or_and(w[1], _mm512_slli_epi16::<2>(h), m10);
                        w[2] = or_and(w[2], h, m10);
                        w[3] = or_and(w[3], _mm512_srli_epi16::<2>(h), m10);
                        w[4] = or_and(w[4], _mm512_slli_epi16::<3>(h), m10);
                        w[5] = or_and(w[5], _mm512_slli_epi16::<1>(h), m10);
                        w[6] = or_and(w[6], _mm512_srli_epi16::<1>(h), m10);
                        w[7] = or_and(w[7], _mm512_srli_epi16::<3>(h), m10);
                    }
                }
                let dw = f16x16(q.add(d_at));
                let mw = if MIN {
                    f16x16(q.add(d_at + 32))
                } else {
                    _mm512_setzero_ps()
                };
                for r in 0..R {
                    let a = acts.get_unchecked(r).get_unchecked(b);
                    let mut i = if OFF {
                        _mm512_set1_epi32(*aux.get_unchecked(r).get_unchecked(b))
                    } else {
                        _mm512_setzero_si512()
                    };
                    for t in 0..8 {
                        i = _mm512_dpbusd_epi32(i, w[t], act4(a, t));
                    }
                    let s = _mm512_mul_ps(dw, _mm512_set1_ps(a.d));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), s, acc[r]);
                    if MIN {
                        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s), acc[r]);
                    }
                }
                b += 8;
            }
            tree.push(c, &acc);
        }
        tree.store(out);
    }

    /// One 32-element block's integer sum for each activation row:
    /// `isum[r] += (sum of 8 vpdpbusd) * s`, or with two scales for the
    /// block's halves (`s1`, Q6_K) and a starting value per half. `HI`:
    /// the weights are high nibbles left in place (16 times their level),
    /// so the block's sum is divided by 16 (exactly: every product is a
    /// multiple of 16) before its scale.
    #[inline(always)]
    unsafe fn block_isum<const R: usize, const TWO: bool, const HI: bool>(
        w: &[__m512i; 8],
        acts: &[&[BlockQ8]],
        blk: usize,
        start: [[i32; 2]; R],
        s0: __m512i,
        s1: __m512i,
        isum: &mut [__m512i; R],
    ) {
        for r in 0..R {
            let a = acts.get_unchecked(r).get_unchecked(blk);
            let mut i0 = _mm512_set1_epi32(start[r][0]);
            let mut i1 = _mm512_set1_epi32(start[r][1]);
            for t in 0..4 {
                i0 = _mm512_dpbusd_epi32(i0, w[t], act4(a, t));
                i1 = _mm512_dpbusd_epi32(i1, w[t + 4], act4(a, t + 4));
            }
            let v = if TWO {
                _mm512_add_epi32(_mm512_mullo_epi32(i0, s0), _mm512_mullo_epi32(i1, s1))
            } else if HI {
                _mm512_mullo_epi32(_mm512_srai_epi32::<4>(_mm512_add_epi32(i0, i1)), s0)
            } else {
                _mm512_mullo_epi32(_mm512_add_epi32(i0, i1), s0)
            };
            isum[r] = _mm512_add_epi32(isum[r], v);
        }
    }

    /// Q4_K: accumulator class `c` takes super-blocks c, c+8, ...
    #[inline(always)]
    unsafe fn dot_q4k<const R: usize>(
        mut p: *const u8,
        n_blocks: usize,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: Out,
    ) {
        let ub = unit_bytes(GgmlType::Q4K);
        let n_sb = n_blocks / 8;
        let neg = _mm512_set1_epi32(i32::MIN);
        let m0f = _mm512_set1_epi8(0x0f);
        let mf0 = _mm512_set1_epi8(0xf0_u8 as i8);
        let zero = _mm512_setzero_si512();
        let mut tree = Tree::<R>::new();
        for c in 0..8 {
            let mut acc = [_mm512_setzero_ps(); R];
            let mut sb = c;
            while sb < n_sb {
                let q = p;
                p = p.add(ub);
                let mut isum = [_mm512_setzero_si512(); R];
                for pair in 0..4 {
                    prefetch_part(q, ub, pair, 4, out.prefetch);
                    // Low nibbles: block 2 * pair; high: block 2 * pair + 1,
                    // masked in place (one operation a word, not a shift
                    // and a mask) and scaled back by the block's sum. Each
                    // half loads the words again (from L1) rather than keep
                    // sixteen vectors live beside a tile's sums.
                    for h in 0..2 {
                        let mut w = [zero; 8];
                        for t in 0..8 {
                            let v = load(q.add(Q4K_QS + (pair * 8 + t) * 64));
                            w[t] = _mm512_and_si512(v, if h == 0 { m0f } else { mf0 });
                        }
                        let j = 2 * pair + h;
                        let s = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(Q4K_SC + 16 * j) as *const __m128i));
                        if h == 0 {
                            block_isum::<R, false, false>(&w, acts, sb * 8 + j, [[0; 2]; R], s, zero, &mut isum);
                        } else {
                            block_isum::<R, false, true>(&w, acts, sb * 8 + j, [[0; 2]; R], s, zero, &mut isum);
                        }
                    }
                }
                let d = f16x16(q.add(Q4K_D));
                for r in 0..R {
                    let da = _mm512_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, da), acc[r]);
                }
                let dmin = f16x16(q.add(Q4K_DMIN));
                let mut mv = [zero; 4];
                for k in 0..4 {
                    mv[k] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(q.add(Q4K_MINS + 32 * k) as *const __m256i));
                }
                for r in 0..R {
                    let x = aux.get_unchecked(r);
                    let mut msum = zero;
                    for k in 0..4 {
                        msum = _mm512_dpwssd_epi32(msum, mv[k], _mm512_set1_epi32(*x.get_unchecked(sb * 4 + k)));
                    }
                    let da = _mm512_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
                    let cm = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, da)), neg));
                    acc[r] = _mm512_fmadd_ps(cm, _mm512_cvtepi32_ps(msum), acc[r]);
                }
                sb += 8;
            }
            tree.push(c, &acc);
        }
        tree.store(out);
    }

    /// Q6_K: accumulator class `c` takes super-blocks c, c+8, ... Levels
    /// are offset by 32 (taken out through `aux`, per 16 elements), scales
    /// are signed bytes per 16 elements, no minimum.
    #[inline(always)]
    unsafe fn dot_q6k<const R: usize>(
        mut p: *const u8,
        n_blocks: usize,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: Out,
    ) {
        let ub = unit_bytes(GgmlType::Q6K);
        let n_sb = n_blocks / 8;
        let m0f = _mm512_set1_epi8(0x0f);
        let m30 = _mm512_set1_epi8(0x30);
        let mut tree = Tree::<R>::new();
        for c in 0..8 {
            let mut acc = [_mm512_setzero_ps(); R];
            let mut sb = c;
            while sb < n_sb {
                let q = p;
                p = p.add(ub);
                let mut isum = [_mm512_setzero_si512(); R];
                for half in 0..2 {
                    let hq = q.add(Q6K_HALF + 1536 * half + 512);
                    // Blocks 0 and 2 share their `ql` words, as do 1 and 3.
                    for k in [0, 2, 1, 3] {
                        prefetch_part(q, ub, 4 * half + k, 8, out.prefetch);
                        // Block 4 * half + k: low (k < 2) or high nibbles of
                        // `ql` words 0..8 (k even) or 8..16 (k odd), and
                        // bits 2k, 2k + 1 of the `qh` bytes.
                        let lq = q.add(Q6K_HALF + 1536 * half + (k & 1) * 1024);
                        let mut w = [_mm512_setzero_si512(); 8];
                        for t in 0..8 {
                            let l = load(lq.add(t * 64));
                            let h = load(hq.add(t * 64));
                            let lo = if k < 2 {
                                _mm512_and_si512(l, m0f)
                            } else {
                                _mm512_and_si512(_mm512_srli_epi16::<4>(l), m0f)
                            };
                            let hs = match k {
                                0 => _mm512_slli_epi16::<4>(h),
                                1 => _mm512_slli_epi16::<2>(h),
                                2 => h,
                                _ => _mm512_srli_epi16::<2>(h),
                            };
                            w[t] = or_and(lo, hs, m30);
                        }
                        let blk = sb * 8 + 4 * half + k;
                        let g = 2 * (4 * half + k);
                        let s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(Q6K_SC + 16 * g) as *const __m128i));
                        let s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(Q6K_SC + 16 * (g + 1)) as *const __m128i));
                        let mut start = [[0i32; 2]; R];
                        for r in 0..R {
                            let x = aux.get_unchecked(r);
                            start[r] = [*x.get_unchecked(2 * blk), *x.get_unchecked(2 * blk + 1)];
                        }
                        block_isum::<R, true, false>(&w, acts, blk, start, s0, s1, &mut isum);
                    }
                }
                let d = f16x16(q.add(Q6K_D));
                for r in 0..R {
                    let da = _mm512_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, da), acc[r]);
                }
                sb += 8;
            }
            tree.push(c, &acc);
        }
        tree.store(out);
    }

    #[inline(always)]
    unsafe fn dot_r<const R: usize>(
        p: *const u8,
        ty: GgmlType,
        n_blocks: usize,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: Out,
    ) {
        let ub = unit_bytes(ty);
        match ty {
            GgmlType::Q4_0 => dot_blocks::<Q4, false, true, R>(p, ub, n_blocks, acts, aux, out),
            GgmlType::Q4_1 => dot_blocks::<Q4, true, false, R>(p, ub, n_blocks, acts, aux, out),
            GgmlType::Q5_0 => dot_blocks::<Q5, false, true, R>(p, ub, n_blocks, acts, aux, out),
            GgmlType::Q5_1 => dot_blocks::<Q5, true, false, R>(p, ub, n_blocks, acts, aux, out),
            GgmlType::Q8_0 => dot_blocks::<Q8, false, true, R>(p, ub, n_blocks, acts, aux, out),
            GgmlType::Q4K => dot_q4k::<R>(p, n_blocks, acts, aux, out),
            GgmlType::Q6K => dot_q6k::<R>(p, n_blocks, acts, aux, out),
            _ => unreachable!(),
        }
    }

    /// Up to [`TILE_ROWS`] activation rows against one panel at `p`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dot(
        p: *const u8,
        ty: GgmlType,
        n_blocks: usize,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: Out,
    ) {
        match acts.len() {
            1 => dot_r::<1>(p, ty, n_blocks, acts, aux, out),
            2 => dot_r::<2>(p, ty, n_blocks, acts, aux, out),
            3 => dot_r::<3>(p, ty, n_blocks, acts, aux, out),
            4 => dot_r::<4>(p, ty, n_blocks, acts, aux, out),
            5 => dot_r::<5>(p, ty, n_blocks, acts, aux, out),
            6 => dot_r::<6>(p, ty, n_blocks, acts, aux, out),
            7 => dot_r::<7>(p, ty, n_blocks, acts, aux, out),
            _ => dot_r::<8>(p, ty, n_blocks, acts, aux, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_support::{weights, Rng, TYPES};
    use crate::dot::{act_format, dot_rows_with, quantize_row, QK8};

    #[test]
    fn tiles_cover_the_rows_evenly() {
        for n in 0..100 {
            let t: Vec<(usize, usize)> = tiles(n).collect();
            assert_eq!(t.len(), n.div_ceil(TILE_ROWS), "{n}");
            let mut next = 0;
            for &(r0, rt) in &t {
                assert_eq!(r0, next, "{n}: tiles are contiguous");
                assert!((1..=TILE_ROWS).contains(&rt), "{n}: tile of {rt}");
                next += rt;
            }
            assert_eq!(next, n);
            let (lo, hi) = (t.iter().map(|x| x.1).min(), t.iter().map(|x| x.1).max());
            assert!(hi.unwrap_or(0) - lo.unwrap_or(0) <= 1, "{n}: {t:?}");
        }
    }

    #[test]
    fn panels_equal_the_scalar_reference_bitwise() {
        if !available(GgmlType::Q8_0) {
            eprintln!("no AVX2 here: panels are not used");
            return;
        }
        let mut rng = Rng(42);
        for ty in TYPES.into_iter().filter(|&t| supports(t)) {
            // Fewer than 8, exactly 8, and more than 8 blocks or super-blocks
            // (accumulator classes with no, one and two blocks).
            for n in [768, 2048, 2304, 4608] {
                let nb = n / QK8;
                for n_w in [16, 5, 1] {
                    let ws: Vec<Vec<u8>> = (0..n_w).map(|_| weights(ty, n, &mut rng)).collect();
                    let wrefs: Vec<&[u8]> = ws.iter().map(|v| v.as_slice()).collect();
                    let n_r = 17;
                    let acts: Vec<Vec<BlockQ8>> = (0..n_r)
                        .map(|r| {
                            let x: Vec<f32> = (0..n).map(|_| rng.f32() * (0.5 + r as f32)).collect();
                            let mut q = vec![BlockQ8::default(); nb];
                            quantize_row(act_format(ty), &x, &mut q);
                            q
                        })
                        .collect();
                    let aux: Vec<Vec<i32>> = acts
                        .iter()
                        .map(|a| {
                            let mut v = vec![0; aux_len(ty, nb)];
                            activation_aux(ty, a, &mut v);
                            v
                        })
                        .collect();
                    let arefs: Vec<&[BlockQ8]> = acts.iter().map(|v| v.as_slice()).collect();
                    let xrefs: Vec<&[i32]> = aux.iter().map(|v| v.as_slice()).collect();
                    let mut panel = Panel::new();
                    panel.pack(ty, &wrefs);
                    // The same rows as one panel of a packed matrix.
                    let flat: Vec<u8> = ws.concat();
                    let mut packed = vec![0u8; packed_matrix_bytes(ty, n_w, n)];
                    pack_matrix(ty, &flat, n_w, n, &mut packed);
                    assert_eq!(&packed[..], panel.as_ref().data, "{ty}: matrix and panel packing");
                    // Every tile size, and splits into two and three tiles.
                    for rows in [n_r, 9, 8, 7, 6, 5, 4, 3, 2, 1] {
                        let mut got = vec![0f32; n_w * rows];
                        panel.dot(&arefs[..rows], &xrefs[..rows], &mut got);
                        for w in 0..n_w {
                            let mut want = vec![0f32; rows];
                            dot_rows_with(Simd::Scalar, ty, &ws[w], &arefs[..rows], &mut want);
                            for r in 0..rows {
                                assert_eq!(
                                    got[w * rows + r].to_bits(),
                                    want[r].to_bits(),
                                    "{ty} n {n} rows {n_w}x{rows} at ({w}, {r}): {} vs {}",
                                    got[w * rows + r],
                                    want[r]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
