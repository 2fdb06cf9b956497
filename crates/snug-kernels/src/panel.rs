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
//! rows; with AVX2 alone (`panel/avx2.rs`) one holds eight, and the kernel
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
//! | Q5_K | as Q4_K, then `qh` words 0..8 |
//! | Q6_K | scales `[16][16]` i8; `d` 16 x f16; per half: `ql` words 0..8, `qh` words 0..8, `ql` words 8..16 |
//! | Q3_K | scales `[16][16]` i8 (less 32); `d`; `qs` words 0..16; `hmask` words 0..8 |
//! | Q2_K | `d`, `dmin`; the scale-and-minimum bytes `[8][16][2]`; `qs` words 0..16 |
//! | IQ4_NL | as Q4_0 (the kernel looks each nibble up in the level table) |
//! | MXFP4 | `qs` words 0..4; the E8M0 exponents, 16 bytes |
//! | IQ4_XS | `d`; scales `[8][16]` i8 (less 32); `qs` words 0..32 (block j: words 4j..4j+4) |
//!
//! The types with a level table (IQ4_NL, IQ4_XS, MXFP4) store the
//! nibbles; one `vpshufb` turns 64 of them into their levels plus an
//! offset (128, or 12 for MXFP4) that makes them unsigned. Q3_K's levels
//! are made unsigned with 4 added; every offset is taken back out exactly
//! through the activation sums ([`activation_aux`]). The AVX2 kernel
//! looks the level-table types up as signed levels instead and moves
//! their sign to the activation (`vpmaddubsw` would saturate on levels
//! of up to 241); the integers are the same.

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
    match simd() {
        Simd::Avx512Vnni | Simd::Avx2 => supports(ty),
        Simd::Scalar => false,
    }
}

/// The weight types panels handle (with AVX-512 VNNI or AVX2).
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::IQ4NL
            | GgmlType::IQ4XS
            | GgmlType::MXFP4
    )
}

/// Bytes of one packed unit: a 32-element block, or a K-quant's
/// 256-element super-block.
const fn unit_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 | GgmlType::IQ4NL => 256 + 32,
        GgmlType::MXFP4 => 256 + 16,
        GgmlType::Q4_1 => 256 + 64,
        GgmlType::Q5_0 => 256 + 64 + 32,
        GgmlType::Q5_1 => 256 + 64 + 64,
        GgmlType::Q8_0 => 512 + 32,
        GgmlType::Q4K => Q4K_QS + 2048,
        GgmlType::Q5K => Q5K_QH + 512,
        GgmlType::Q6K => Q6K_HALF + 2 * 1536,
        GgmlType::Q3K => Q3K_HM + 512,
        GgmlType::Q2K => Q2K_QS + 1024,
        GgmlType::IQ4XS => IQ4XS_QS + 2048,
        _ => 0,
    }
}

// Offsets inside each K-quant's packed super-block. The scales come
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
/// Q5_K: Q4_K's layout, then the high bits.
const Q5K_QH: usize = Q4K_QS + 2048;
const Q3K_SC: usize = 0;
const Q3K_D: usize = 256;
const Q3K_QS: usize = 288;
const Q3K_HM: usize = Q3K_QS + 1024;
const Q2K_D: usize = 0;
const Q2K_DMIN: usize = 32;
/// Q2_K: the raw scale bytes (scale in the low nibble, minimum in the
/// high), block j's two at `32 j + 2 lane`.
const Q2K_SC: usize = 64;
const Q2K_QS: usize = 320;
const IQ4XS_D: usize = 0;
const IQ4XS_SC: usize = 32;
const IQ4XS_QS: usize = 160;

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
        GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS => 128,
        GgmlType::MXFP4 => 12,
        _ => 0,
    }
}

/// The level table of IQ4_NL, IQ4_XS or MXFP4 as the kernels look it up:
/// each level plus [`level_offset`], as an unsigned byte.
fn level_table(ty: GgmlType) -> [u8; 16] {
    let levels = match ty {
        GgmlType::MXFP4 => &crate::quant::MXFP4_LEVELS,
        _ => &crate::quant::IQ4_LEVELS,
    };
    std::array::from_fn(|i| (levels[i] as i32 + level_offset(ty)) as u8)
}

/// 32-bit values per activation row that panels read beside the row's
/// blocks ([`activation_aux`]), for rows of `n_blocks` 32-element blocks.
pub fn aux_len(ty: GgmlType, n_blocks: usize) -> usize {
    match ty {
        // Per 16 elements: -32 (Q6_K), -4 (Q3_K) or 0 (Q2_K) times their
        // activation sum; then per block its two 16-element sums as 16-bit
        // halves (for Q2_K's minimums and the AVX2 kernel).
        GgmlType::Q6K | GgmlType::Q3K | GgmlType::Q2K => n_blocks * 3,
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
        GgmlType::Q6K | GgmlType::Q3K | GgmlType::Q2K => {
            let off = match ty {
                GgmlType::Q6K => 32,
                GgmlType::Q3K => 4,
                _ => 0,
            };
            let (starts, pairs) = out.split_at_mut(2 * act.len());
            for ((b, o), pair) in act.iter().zip(starts.chunks_exact_mut(2)).zip(pairs.iter_mut()) {
                let s: [i32; 2] = std::array::from_fn(|h| b.qs[16 * h..16 * h + 16].iter().map(|&q| q as i32).sum());
                o[0] = -off * s[0];
                o[1] = -off * s[1];
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
    // Two bytes (an f16, or a pair of scale bytes) of one lane.
    let copy2 = |o: &mut [u8], at: usize, lane: usize, w: &[u8]| {
        o[at + 2 * lane..at + 2 * lane + 2].copy_from_slice(w);
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
                    copy2(o, p, lane, &b[0..2]);
                    if min {
                        copy2(o, p + 32, lane, &b[2..4]);
                    }
                }
                GgmlType::IQ4NL | GgmlType::MXFP4 => {
                    // GGUF block: d (f16) or e (E8M0), qs.
                    let qs_at = if ty == GgmlType::IQ4NL { 2 } else { 1 };
                    for t in 0..4 {
                        copy(o, 64 * t, lane, &b[qs_at + 4 * t..qs_at + 4 * t + 4]);
                    }
                    if ty == GgmlType::IQ4NL {
                        copy2(o, 256, lane, &b[0..2]);
                    } else {
                        o[256 + lane] = b[0];
                    }
                }
                GgmlType::Q8_0 => {
                    for t in 0..8 {
                        let at = 2 + 4 * t;
                        let w = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) ^ 0x8080_8080;
                        copy(o, 64 * t, lane, &w.to_le_bytes());
                    }
                    copy2(o, 512, lane, &b[0..2]);
                }
                GgmlType::Q4K | GgmlType::Q5K => {
                    // GGUF block: d, dmin, scales (12), [qh (32)], qs.
                    let qs_at = if ty == GgmlType::Q4K { 16 } else { 48 };
                    for t in 0..32 {
                        copy(o, Q4K_QS + 64 * t, lane, &b[qs_at + 4 * t..qs_at + 4 + 4 * t]);
                    }
                    if ty == GgmlType::Q5K {
                        for t in 0..8 {
                            copy(o, Q5K_QH + 64 * t, lane, &b[16 + 4 * t..20 + 4 * t]);
                        }
                    }
                    copy2(o, Q4K_D, lane, &b[0..2]);
                    copy2(o, Q4K_DMIN, lane, &b[2..4]);
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
                    copy2(o, Q6K_D, lane, &b[208..210]);
                }
                GgmlType::Q3K => {
                    // GGUF block: hmask (32), qs (64), scales (12), d.
                    for t in 0..16 {
                        copy(o, Q3K_QS + 64 * t, lane, &b[32 + 4 * t..36 + 4 * t]);
                    }
                    for t in 0..8 {
                        copy(o, Q3K_HM + 64 * t, lane, &b[4 * t..4 * t + 4]);
                    }
                    for (g, s) in crate::quant::q3k_scales(&b[96..108]).into_iter().enumerate() {
                        o[Q3K_SC + 16 * g + lane] = s as u8;
                    }
                    copy2(o, Q3K_D, lane, &b[108..110]);
                }
                GgmlType::Q2K => {
                    // GGUF block: scales (16), qs (64), d, dmin.
                    for t in 0..16 {
                        copy(o, Q2K_QS + 64 * t, lane, &b[16 + 4 * t..20 + 4 * t]);
                    }
                    for j in 0..8 {
                        copy2(o, Q2K_SC + 32 * j, lane, &b[2 * j..2 * j + 2]);
                    }
                    copy2(o, Q2K_D, lane, &b[80..82]);
                    copy2(o, Q2K_DMIN, lane, &b[82..84]);
                }
                GgmlType::IQ4XS => {
                    // GGUF block: d, scales_h (2), scales_l (4), qs (128).
                    for t in 0..32 {
                        copy(o, IQ4XS_QS + 64 * t, lane, &b[8 + 4 * t..12 + 4 * t]);
                    }
                    for j in 0..8 {
                        o[IQ4XS_SC + 16 * j + lane] = crate::quant::iq4xs_scale(b, j) as u8;
                    }
                    copy2(o, IQ4XS_D, lane, &b[0..2]);
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

    /// Checks the shapes a kernel call relies on; the mask of `lanes`.
    fn check(&self, acts: &[&[BlockQ8]], aux: &[&[i32]], lanes: usize) -> u16 {
        assert_eq!(acts.len(), aux.len(), "panel: one aux per activation row");
        assert!(
            acts.iter().all(|a| a.len() == self.n_blocks),
            "panel: activation length"
        );
        let al = aux_len(self.ty, self.n_blocks);
        assert!(aux.iter().all(|a| a.len() == al), "panel: aux length");
        self.lane_mask(lanes)
    }

    /// Checks the panel's length and `lanes` (1 to 16), and gives the mask
    /// of the lanes to store.
    fn lane_mask(&self, lanes: usize) -> u16 {
        assert!((1..=PANEL_ROWS).contains(&lanes), "panel: 1 to 16 lanes");
        assert_eq!(
            self.data.len(),
            panel_bytes(self.ty, self.n_blocks * 32),
            "panel: length"
        );
        if lanes == PANEL_ROWS {
            u16::MAX
        } else {
            (1u16 << lanes) - 1
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
        let mask = self.check(acts, aux, lanes);
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

/// Activation rows one AMX call takes against a panel, at most
/// ([`PanelRef::amx_dot_into`]).
pub const AMX_ROWS: usize = 128;

/// Whether products with weights of type `ty` can run on AMX tiles here
/// ([`crate::cpu::amx`]; Q4_K, Q5_K, Q6_K and Q3_K, from packed panels).
pub fn amx_available(ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::Q3K) && crate::cpu::amx()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        false
    }
}

/// Writes activation row `r`'s bytes (its blocks, quantized for Q4_K)
/// into `bytes`, the rows' buffer for [`PanelRef::amx_dot_into`]
/// (`rows.next_multiple_of(32) * cols` long), where the tiles read them.
pub fn amx_place_row(blocks: &[BlockQ8], r: usize, bytes: &mut [i8]) {
    // SAFETY: the range written is checked.
    unsafe { amx_place_row_raw(blocks, r, bytes.as_mut_ptr(), bytes.len()) }
}

/// As [`amx_place_row`] into a buffer several threads fill (each its own
/// rows).
///
/// # Safety
///
/// `bytes` is valid for `len` bytes, and no other thread writes row `r`'s
/// bytes.
pub unsafe fn amx_place_row_raw(blocks: &[BlockQ8], r: usize, bytes: *mut i8, len: usize) {
    assert!(blocks.len().is_multiple_of(8), "panel: whole super-blocks");
    assert!(len >= (r / 32 + 1) * 32 * blocks.len() * 32, "panel: activation bytes");
    #[cfg(target_arch = "x86_64")]
    amx::place_row(blocks, r, bytes);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

impl PanelRef<'_> {
    /// As [`PanelRef::dot_into`] for up to [`AMX_ROWS`] activation rows, on
    /// AMX tiles (same bits). `acts` and `aux`: the rows' blocks and aux
    /// values, row after row (`rows` of each; no slice per row to build
    /// for every task). `bytes`: the rows' activation bytes as
    /// [`amx_place_row`] lays them out, rows up to the next multiple of
    /// 32 (those past `rows` are read and ignored).
    ///
    /// # Safety
    ///
    /// As [`PanelRef::dot_into`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn amx_dot_into(
        &self,
        bytes: &[i8],
        acts: &[BlockQ8],
        aux: &[i32],
        rows: usize,
        lanes: usize,
        out: *mut f32,
        out_stride: usize,
    ) {
        let ty = self.ty;
        assert!(amx_available(ty), "panels: no AMX for {ty}");
        assert!((1..=AMX_ROWS).contains(&rows), "panel: 1 to {AMX_ROWS} rows");
        assert!(
            bytes.len() >= rows.next_multiple_of(32) * self.n_blocks * 32,
            "panel: activation bytes"
        );
        assert_eq!(acts.len(), rows * self.n_blocks, "panel: activation length");
        assert_eq!(aux.len(), rows * aux_len(ty, self.n_blocks), "panel: aux length");
        let mask = self.lane_mask(lanes);
        #[cfg(target_arch = "x86_64")]
        {
            let o = x86::Out {
                ptr: out,
                stride: out_stride,
                mask,
                prefetch: false,
            };
            // SAFETY: checked above; the caller vouches for the output.
            let (p, nb, a) = (self.data.as_ptr(), self.n_blocks, bytes.as_ptr());
            match ty {
                GgmlType::Q4K => amx::dot::<{ amx::Q4K }>(p, nb, a, acts, aux, rows, o),
                GgmlType::Q5K => amx::dot::<{ amx::Q5K }>(p, nb, a, acts, aux, rows, o),
                GgmlType::Q6K => amx::dot::<{ amx::Q6K }>(p, nb, a, acts, aux, rows, o),
                _ => amx::dot::<{ amx::Q3K }>(p, nb, a, acts, aux, rows, o),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (bytes, acts, aux, mask, out, out_stride);
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
mod avx2;

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // lane- and row-indexed register arrays
mod x86;

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // row-indexed register arrays
mod amx;

#[cfg(test)]
mod tests;
