//! Dot products of quantized weight rows with quantized activation rows:
//! the inner loop of every matrix multiplication.
//!
//! Activations are quantized to int8 per 32 elements ([`BlockQ8`]) the way
//! ggml quantizes them for each weight type ([`ActFormat`]: its `q8_0`,
//! `q8_1` and `q8_K` formats, same scales and rounding), so the integer part
//! of every block equals llama.cpp's exactly and results track it closely.
//! Every weight type is unpacked per 32 elements to its true signed integer
//! levels. Each 32-element block `b` of a row yields one exact integer
//! `isum_b = sum of w*a`; the float part follows one fixed order that every
//! path (scalar, AVX2, AVX-512 VNNI, the row-interleaved panels of
//! [`crate::panel`]) performs identically:
//!
//! ```text
//!   acc[b % 8] = fma(isum_b as f32, d_w * d_a, acc[b % 8])
//!   acc[b % 8] = fma(m_w, s_a, acc[b % 8])          (types with a minimum)
//! result = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
//! ```
//!
//! K-quant types (256-element super-blocks, whose activations share one
//! `q8_K` scale) keep the integers longer, as ggml does: super-block `sb`
//! yields `isum = sum over its 16-element groups g of scale_g * (sum of w*a
//! over g)` and `minsum = sum over its blocks j of min_j * sum(a_j)`, both
//! exact; then `acc[sb % 8] = fma(isum as f32, d * d_a, ...)` and, for types
//! with a minimum, `fma(-(dmin * d_a), minsum as f32, ...)`.
//!
//! One integer per block and eight accumulators indexed by block number is
//! what lets a kernel put sixteen weight rows in the lanes of one vector
//! (the panels that prefill uses) and still produce a row-at-a-time
//! kernel's bits.
//!
//! The scalar code is the reference and performs exactly these operations;
//! the SIMD paths compute the same lanes with vector instructions, so their
//! results are bitwise equal to it (tested). A row's result depends only on
//! its own weights and activations, never on how many rows are computed
//! together: this is what makes batched forwards batch-invariant.

use half::f16;

use crate::cpu::{simd, Simd};
use crate::quant::{scale_min_k4, GgmlType};

/// Elements per activation block.
pub const QK8: usize = 32;

/// 32 activations quantized to int8: `x ≈ d * qs`. `s` is `d * sum(qs)`
/// (rounded to f16 in the `q8_1` format), used by weight types with a
/// minimum.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(16))]
pub struct BlockQ8 {
    pub qs: [i8; QK8],
    pub d: f32,
    pub s: f32,
    /// `sum(qs)`.
    pub sum: i32,
}

impl Default for BlockQ8 {
    fn default() -> Self {
        BlockQ8 {
            qs: [0; QK8],
            d: 0.0,
            s: 0.0,
            sum: 0,
        }
    }
}

/// How activations are quantized for a weight type (ggml's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    /// Per 32: `d = f16(amax / 127)`, `q = round_even(x * 127 / amax)`.
    Q8_0,
    /// As `Q8_0`, plus `s = f16(amax / 127 * sum(q))`.
    Q8_1,
    /// Per 256: `d = 1 / iscale` with `iscale = -127 / x_max` (the element of
    /// largest magnitude, signed), `q = min(127, round_even(iscale * x))`.
    Q8K,
}

/// The activation format ggml pairs with weight type `ty`.
pub fn act_format(ty: GgmlType) -> ActFormat {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => ActFormat::Q8_1,
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => ActFormat::Q8K,
        _ => ActFormat::Q8_0,
    }
}

fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Quantizes `x` (a multiple of 32 long; of 256 for `Q8K`) into `out`.
pub fn quantize_row(format: ActFormat, x: &[f32], out: &mut [BlockQ8]) {
    match simd() {
        // SAFETY: AVX-512 F/BW/VL and the AVX2 set are present (`simd`).
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512Vnni => unsafe { quant512::quantize_row(format, x, out) },
        // The same code compiled with SSE4.1 and F16C rounds and converts
        // with single instructions instead of library calls; same results.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { quantize_row_x86(format, x, out) },
        _ => quantize_row_body(format, x, out),
    }
}

/// A q8_0 / q8_1 block's scale (`amax / 127`, as f16), level sum and, for
/// q8_1, the f16 product of the two; every quantization path ends with it.
#[inline(always)]
fn set_q8_header(ob: &mut BlockQ8, format: ActFormat, d: f32, sum: i32) {
    ob.d = f16_round(d);
    ob.sum = sum;
    ob.s = if format == ActFormat::Q8_1 {
        f16_round(d * sum as f32)
    } else {
        0.0
    };
}

/// [`quantize_row`]'s scalar reference (what every path must equal).
pub fn quantize_row_scalar(format: ActFormat, x: &[f32], out: &mut [BlockQ8]) {
    quantize_row_body(format, x, out)
}

/// Activation quantization with 512-bit vectors: 16 elements an
/// instruction for the largest magnitude, the scaled rounding (to nearest,
/// ties to even, as `round_ties_even`), the saturation and the block sums.
/// Where the scalar code's float-to-integer cast has semantics a vector
/// conversion lacks (NaN to 0, infinity saturating), the values are
/// clamped and masked first, so every block is bitwise the reference's.
#[cfg(target_arch = "x86_64")]
mod quant512 {
    use super::{set_q8_header, ActFormat, BlockQ8, QK8};
    use std::arch::x86_64::*;

    /// `round_even(y)` clamped to `-128..=127`, NaN to 0, as i32 lanes.
    #[inline(always)]
    unsafe fn levels(y: __m512) -> __m512i {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y, y);
        // `max` returns its second operand when the first is NaN; those
        // lanes are zeroed after.
        let c = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-128.0)), _mm512_set1_ps(127.0));
        let r = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(c);
        _mm512_maskz_mov_epi32(!nan, r)
    }

    /// Stores two vectors of levels as the block's 32 bytes; returns their sum.
    #[inline(always)]
    unsafe fn store(ob: &mut BlockQ8, a: __m512i, b: __m512i) -> i32 {
        let p = ob.qs.as_mut_ptr() as *mut __m128i;
        _mm_storeu_si128(p, _mm512_cvtepi32_epi8(a));
        _mm_storeu_si128(p.add(1), _mm512_cvtepi32_epi8(b));
        _mm512_reduce_add_epi32(_mm512_add_epi32(a, b))
    }

    /// `max(|x|)` over `xs`, NaN ignored (as the scalar fold's `f32::max`).
    #[inline(always)]
    unsafe fn amax(xs: &[f32]) -> f32 {
        let mut m = _mm512_setzero_ps();
        for c in xs.chunks_exact(16) {
            // `max` returns its second operand (the running maximum) for
            // a NaN first operand.
            m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(c.as_ptr())), m);
        }
        _mm512_reduce_max_ps(m)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn quantize_row(format: ActFormat, x: &[f32], out: &mut [BlockQ8]) {
        assert_eq!(x.len(), out.len() * QK8, "quantize_row: length");
        match format {
            ActFormat::Q8_0 | ActFormat::Q8_1 => {
                for (xb, ob) in x.chunks_exact(QK8).zip(out.iter_mut()) {
                    let amax = amax(xb);
                    let d = amax / 127.0;
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    let v = _mm512_set1_ps(id);
                    let a = levels(_mm512_mul_ps(_mm512_loadu_ps(xb.as_ptr()), v));
                    let b = levels(_mm512_mul_ps(_mm512_loadu_ps(xb.as_ptr().add(16)), v));
                    let sum = store(ob, a, b);
                    set_q8_header(ob, format, d, sum);
                }
            }
            ActFormat::Q8K => {
                assert_eq!(x.len() % 256, 0, "q8_K rows are whole 256-element blocks");
                for (xs, os) in x.chunks_exact(256).zip(out.chunks_exact_mut(8)) {
                    let amax = amax(xs);
                    if amax == 0.0 || amax.is_nan() {
                        // The scalar code found no element above 0.
                        os.iter_mut().for_each(|b| *b = BlockQ8::default());
                        continue;
                    }
                    // The first element of that magnitude, with its sign.
                    let t = _mm512_set1_ps(amax);
                    let mut max = 0.0;
                    for (i, c) in xs.chunks_exact(16).enumerate() {
                        let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(_mm512_loadu_ps(c.as_ptr())), t);
                        if hit != 0 {
                            max = xs[16 * i + hit.trailing_zeros() as usize];
                            break;
                        }
                    }
                    let iscale = -127.0 / max;
                    let d = 1.0 / iscale;
                    let v = _mm512_set1_ps(iscale);
                    for (xb, ob) in xs.chunks_exact(QK8).zip(os.iter_mut()) {
                        let a = levels(_mm512_mul_ps(v, _mm512_loadu_ps(xb.as_ptr())));
                        let b = levels(_mm512_mul_ps(v, _mm512_loadu_ps(xb.as_ptr().add(16))));
                        let sum = store(ob, a, b);
                        ob.d = d;
                        ob.s = d * sum as f32;
                        ob.sum = sum;
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.1,avx2,f16c,fma")]
unsafe fn quantize_row_x86(format: ActFormat, x: &[f32], out: &mut [BlockQ8]) {
    quantize_row_body(format, x, out)
}

#[inline(always)]
fn quantize_row_body(format: ActFormat, x: &[f32], out: &mut [BlockQ8]) {
    assert_eq!(x.len(), out.len() * QK8, "quantize_row: length");
    match format {
        ActFormat::Q8_0 | ActFormat::Q8_1 => {
            for (xb, ob) in x.chunks_exact(QK8).zip(out.iter_mut()) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                let mut sum = 0i32;
                for (q, v) in ob.qs.iter_mut().zip(xb) {
                    // Saturate as ggml's integer packing does (only reachable
                    // when 127 / amax overflows, for near-zero blocks).
                    let r = ((v * id).round_ties_even() as i32).clamp(-128, 127);
                    *q = r as i8;
                    sum += r;
                }
                set_q8_header(ob, format, d, sum);
            }
        }
        ActFormat::Q8K => {
            assert_eq!(x.len() % 256, 0, "q8_K rows are whole 256-element blocks");
            for (xs, os) in x.chunks_exact(256).zip(out.chunks_exact_mut(8)) {
                let (mut max, mut amax) = (0f32, 0f32);
                for &v in xs {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                if amax == 0.0 {
                    os.iter_mut().for_each(|b| *b = BlockQ8::default());
                    continue;
                }
                let iscale = -127.0 / max;
                let d = 1.0 / iscale;
                for (xb, ob) in xs.chunks_exact(QK8).zip(os.iter_mut()) {
                    let mut sum = 0i32;
                    for (q, v) in ob.qs.iter_mut().zip(xb) {
                        let r = ((iscale * v).round_ties_even() as i32).clamp(-128, 127);
                        *q = r as i8;
                        sum += r;
                    }
                    ob.d = d;
                    ob.s = d * sum as f32;
                    ob.sum = sum;
                }
            }
        }
    }
}

/// Quantizes `x` in the `Q8_0` format (kept for tests and tools).
pub fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8]) {
    quantize_row(ActFormat::Q8_0, x, out)
}

/// The weight types [`dot_rows`] accepts (with [`BlockQ8`] activations).
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
    )
}

/// The 16 float accumulators of one (weight row, activation row) pair.
#[derive(Clone, Copy)]
struct Acc([[f32; 8]; 2]);

impl Acc {
    fn new() -> Acc {
        Acc([[0.0; 8]; 2])
    }

    /// The 16 lanes folded by [`crate::ops::fold16`].
    fn finish(&self) -> f32 {
        let lanes: [f32; 16] = std::array::from_fn(|k| self.0[k / 8][k % 8]);
        crate::ops::fold16(&lanes)
    }
}

/// The eight float accumulators of one (weight row, activation row) pair of
/// a quantized dot product: block (or super-block) `b` goes to `acc[b % 8]`.
#[derive(Clone, Copy)]
pub(crate) struct Acc8(pub(crate) [f32; 8]);

impl Acc8 {
    pub(crate) fn new() -> Acc8 {
        Acc8([0.0; 8])
    }

    /// The canonical final sum.
    pub(crate) fn finish(&self) -> f32 {
        let a = &self.0;
        ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
    }
}

/// One unpacked weight block: true integer levels, the scale (to be
/// multiplied by the activation scale), and an optional minimum. K-quant
/// blocks carry only their levels (their scales are integers, see
/// [`k_scales`]).
pub(crate) struct WBlock {
    pub(crate) w: [i8; QK8],
    pub(crate) scale: f32,
    pub(crate) min: Option<f32>,
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Unpacks activation-block `j` of weight block `b` (scalar reference).
#[inline(always)]
pub(crate) fn unpack(ty: GgmlType, b: &[u8], j: usize) -> WBlock {
    let mut w = [0i8; QK8];
    let (scale, min) = match ty {
        GgmlType::Q4_0 => {
            for i in 0..16 {
                w[i] = (b[2 + i] & 15) as i8 - 8;
                w[i + 16] = (b[2 + i] >> 4) as i8 - 8;
            }
            (f16_at(b, 0), None)
        }
        GgmlType::Q4_1 => {
            for i in 0..16 {
                w[i] = (b[4 + i] & 15) as i8;
                w[i + 16] = (b[4 + i] >> 4) as i8;
            }
            (f16_at(b, 0), Some(f16_at(b, 2)))
        }
        GgmlType::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for i in 0..16 {
                w[i] = ((b[6 + i] & 15) | (((qh >> i) & 1) << 4) as u8) as i8 - 16;
                w[i + 16] = ((b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4) as u8) as i8 - 16;
            }
            (f16_at(b, 0), None)
        }
        GgmlType::Q5_1 => {
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for i in 0..16 {
                w[i] = ((b[8 + i] & 15) | (((qh >> i) & 1) << 4) as u8) as i8;
                w[i + 16] = ((b[8 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4) as u8) as i8;
            }
            (f16_at(b, 0), Some(f16_at(b, 2)))
        }
        GgmlType::Q8_0 => {
            for i in 0..32 {
                w[i] = b[2 + i] as i8;
            }
            (f16_at(b, 0), None)
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let qs_at = if ty == GgmlType::Q4K { 16 } else { 48 };
            let q = &b[qs_at + (j / 2) * 32..qs_at + (j / 2) * 32 + 32];
            for i in 0..32 {
                let nib = if j.is_multiple_of(2) { q[i] & 15 } else { q[i] >> 4 };
                let high = if ty == GgmlType::Q5K {
                    ((b[16 + i] >> j) & 1) << 4
                } else {
                    0
                };
                w[i] = (nib | high) as i8;
            }
            (0.0, None)
        }
        GgmlType::Q6K => {
            let (h, k) = (j / 4, j % 4);
            let ql = &b[h * 64..h * 64 + 64];
            let qh = &b[128 + h * 32..128 + h * 32 + 32];
            for l in 0..32 {
                let lo = match k {
                    0 => ql[l] & 15,
                    1 => ql[l + 32] & 15,
                    2 => ql[l] >> 4,
                    _ => ql[l + 32] >> 4,
                };
                let hi = (qh[l] >> (2 * k)) & 3;
                w[l] = (lo | (hi << 4)) as i8 - 32;
            }
            (0.0, None)
        }
        _ => unreachable!("dot: unsupported type {ty}"),
    };
    WBlock { w, scale, min }
}

/// Activation blocks per weight block.
fn blocks_per_weight_block(ty: GgmlType) -> usize {
    ty.block_size() / QK8
}

/// Adds one block's contribution to `acc` (scalar reference).
#[inline]
fn accumulate(acc: &mut Acc8, b: usize, wb: &WBlock, a: &BlockQ8) {
    let isum: i32 = wb.w.iter().zip(&a.qs).map(|(&w, &q)| w as i32 * q as i32).sum();
    let lane = &mut acc.0[b % 8];
    *lane = (isum as f32).mul_add(wb.scale * a.d, *lane);
    if let Some(min) = wb.min {
        *lane = min.mul_add(a.s, *lane);
    }
}

/// Integer scales of one K-quant super-block: the scale of each of its 16
/// groups of 16 elements, the minimum of each block of 32 (0 for types
/// without one), and the float factors.
pub(crate) struct KScales {
    pub(crate) sc: [i32; 16],
    pub(crate) min: [i32; 8],
    pub(crate) d: f32,
    pub(crate) dmin: f32,
}

pub(crate) fn k_scales(ty: GgmlType, b: &[u8]) -> KScales {
    let mut ks = KScales {
        sc: [0; 16],
        min: [0; 8],
        d: 0.0,
        dmin: 0.0,
    };
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            ks.d = f16_at(b, 0);
            ks.dmin = f16_at(b, 2);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &b[4..16]);
                ks.sc[2 * j] = sc as i32;
                ks.sc[2 * j + 1] = sc as i32;
                ks.min[j] = m as i32;
            }
        }
        GgmlType::Q6K => {
            ks.d = f16_at(b, 208);
            for (g, sc) in ks.sc.iter_mut().enumerate() {
                *sc = b[192 + g] as i8 as i32;
            }
        }
        _ => unreachable!("k_scales: {ty}"),
    }
    ks
}

/// The integer levels of block `j` of a K-quant super-block, without scales.
#[inline]
pub(crate) fn k_weights(ty: GgmlType, b: &[u8], j: usize) -> [i8; QK8] {
    unpack(ty, b, j).w
}

fn dot_rows_scalar_k(ty: GgmlType, w: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
    let ts = ty.type_size();
    let has_min = ty != GgmlType::Q6K;
    for (acts, out) in acts.chunks(ROW_TILE).zip(out.chunks_mut(ROW_TILE)) {
        let mut accs = [Acc8::new(); ROW_TILE];
        for (sb, wblock) in w.chunks_exact(ts).enumerate() {
            let ks = k_scales(ty, wblock);
            let ws: [[i8; QK8]; 8] = std::array::from_fn(|j| k_weights(ty, wblock, j));
            for (acc, a) in accs.iter_mut().zip(acts) {
                let mut isum = 0i32;
                let mut minsum = 0i32;
                for j in 0..8 {
                    let ab = &a[sb * 8 + j];
                    for h in 0..2 {
                        let p: i32 = (16 * h..16 * h + 16).map(|i| ws[j][i] as i32 * ab.qs[i] as i32).sum();
                        isum += ks.sc[2 * j + h] * p;
                    }
                    minsum += ks.min[j] * ab.sum;
                }
                let da = a[sb * 8].d;
                let lane = &mut acc.0[sb % 8];
                *lane = (isum as f32).mul_add(ks.d * da, *lane);
                if has_min {
                    *lane = (-(ks.dmin * da)).mul_add(minsum as f32, *lane);
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&accs) {
            *o = acc.finish();
        }
    }
}

fn is_k(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
}

/// Activation rows processed together per pass over a weight row.
const ROW_TILE: usize = 4;

fn dot_rows_scalar(ty: GgmlType, w: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
    let per = blocks_per_weight_block(ty);
    let ts = ty.type_size();
    for (acts, out) in acts.chunks(ROW_TILE).zip(out.chunks_mut(ROW_TILE)) {
        let mut accs = [Acc8::new(); ROW_TILE];
        for (wi, wblock) in w.chunks_exact(ts).enumerate() {
            for j in 0..per {
                let b = wi * per + j;
                let wb = unpack(ty, wblock, j);
                for (acc, a) in accs.iter_mut().zip(acts) {
                    accumulate(acc, b, &wb, &a[b]);
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&accs) {
            *o = acc.finish();
        }
    }
}

/// Dot products of one weight row `w` (of type `ty`) with each activation
/// row in `acts`, written to `out` (one value per activation row).
pub fn dot_rows(ty: GgmlType, w: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
    dot_rows_with(simd(), ty, w, acts, out)
}

/// [`dot_rows`] on a chosen path (for tests and benchmarks).
pub fn dot_rows_with(level: Simd, ty: GgmlType, w: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
    dot_tile_with(level, ty, &[w], acts, out)
}

/// Dot products of every weight row in `wrows` (all of type `ty` and one
/// length) with every activation row in `acts`: `out[w * acts.len() + r]`.
/// Each result is exactly [`dot_rows`]'s for that pair; computing a tile of
/// weight rows against a tile of activation rows only shares loads.
pub fn dot_tile(ty: GgmlType, wrows: &[&[u8]], acts: &[&[BlockQ8]], out: &mut [f32]) {
    dot_tile_with(simd(), ty, wrows, acts, out)
}

/// [`dot_tile`] on a chosen path (for tests and benchmarks).
pub fn dot_tile_with(level: Simd, ty: GgmlType, wrows: &[&[u8]], acts: &[&[BlockQ8]], out: &mut [f32]) {
    assert!(supports(ty), "dot: unsupported type {ty}");
    assert_eq!(wrows.len() * acts.len(), out.len(), "dot: one output per pair of rows");
    if wrows.is_empty() || acts.is_empty() {
        return;
    }
    let row_bytes = wrows[0].len();
    assert_eq!(row_bytes % ty.type_size(), 0, "dot: whole weight blocks");
    assert!(
        wrows.iter().all(|w| w.len() == row_bytes),
        "dot: weight rows of one length"
    );
    let n_act_blocks = row_bytes / ty.type_size() * blocks_per_weight_block(ty);
    assert!(acts.iter().all(|a| a.len() == n_act_blocks), "dot: activation length");
    match level {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx512Vnni => {
            // SAFETY: `level` never exceeds what `Simd::detect` found; shapes
            // checked above.
            unsafe { x86::dot_tile(level == Simd::Avx512Vnni, ty, wrows, acts, out) }
        }
        _ => {
            let n_r = acts.len();
            for (w, out) in wrows.iter().zip(out.chunks_mut(n_r)) {
                if is_k(ty) {
                    dot_rows_scalar_k(ty, w, acts, out)
                } else {
                    dot_rows_scalar(ty, w, acts, out)
                }
            }
        }
    }
}

/// Dot product of an f32 weight row with an f32 activation row in a fixed
/// order: element i goes to lane i % 16, lanes are summed as in [`BlockQ8`]
/// dots. The length must be a multiple of 16.
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    assert_eq!(w.len() % 16, 0, "dot_f32: length must be a multiple of 16");
    match simd() {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx512Vnni => unsafe { x86::dot_f32(w, x) },
        _ => dot_f32_scalar(w, x),
    }
}

pub fn dot_f32_scalar(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = Acc::new();
    for (wc, xc) in w.chunks_exact(16).zip(x.chunks_exact(16)) {
        for k in 0..16 {
            let lane = &mut acc.0[k / 8][k % 8];
            *lane = wc[k].mul_add(xc[k], *lane);
        }
    }
    acc.finish()
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // row-indexed parallel arrays of registers
pub(crate) mod x86 {
    //! AVX2 and AVX-512 VNNI versions of the block loop. Each computes the
    //! same integer lanes as `unpack` + `accumulate` and the same float
    //! operations in the same order.

    use std::arch::x86_64::*;

    use super::{Acc, Acc8, BlockQ8};
    use crate::quant::GgmlType;

    /// 16 packed nibbles as 32 bytes: low nibbles then high nibbles.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles_16(p: *const u8) -> __m256i {
        let x = _mm_loadu_si128(p as *const __m128i);
        let m = _mm_set1_epi8(15);
        let lo = _mm_and_si128(x, m);
        let hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
        _mm256_set_m128i(hi, lo)
    }

    /// Bit i of `bits` as byte i: 0x10 where set, 0 elsewhere.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bits_to_0x10(bits: u32) -> __m256i {
        let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
        let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
        let v = _mm256_or_si256(v, mask);
        let set = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    /// One weight type's unpacking: the levels of activation-block `j` of a
    /// weight block as bytes (signed for the types without a minimum,
    /// non-negative for the others), and where the block keeps its f16
    /// scale and minimum.
    pub(crate) trait Unpack {
        const HAS_MIN: bool;
        /// Byte offset of the f16 scale `d` in a weight block.
        const D_AT: usize;
        /// Byte offset of the f16 minimum (`m`, or `dmin` for K-quants).
        const M_AT: usize = 2;
        unsafe fn levels(b: *const u8, j: usize) -> __m256i;
    }

    pub(crate) struct Q4_0;
    pub(crate) struct Q4_1;
    pub(crate) struct Q5_0;
    pub(crate) struct Q5_1;
    pub(crate) struct Q8_0;
    pub(crate) struct Q4K;
    pub(crate) struct Q5K;
    pub(crate) struct Q6K;

    impl Unpack for Q4_0 {
        const HAS_MIN: bool = false;
        const D_AT: usize = 0;
        #[inline(always)]
        unsafe fn levels(b: *const u8, _: usize) -> __m256i {
            _mm256_sub_epi8(nibbles_16(b.add(2)), _mm256_set1_epi8(8))
        }
    }

    impl Unpack for Q4_1 {
        const HAS_MIN: bool = true;
        const D_AT: usize = 0;
        #[inline(always)]
        unsafe fn levels(b: *const u8, _: usize) -> __m256i {
            nibbles_16(b.add(4))
        }
    }

    impl Unpack for Q5_0 {
        const HAS_MIN: bool = false;
        const D_AT: usize = 0;
        #[inline(always)]
        unsafe fn levels(b: *const u8, _: usize) -> __m256i {
            let qh = (b.add(2) as *const u32).read_unaligned();
            let w = _mm256_or_si256(nibbles_16(b.add(6)), bits_to_0x10(qh));
            _mm256_sub_epi8(w, _mm256_set1_epi8(16))
        }
    }

    impl Unpack for Q5_1 {
        const HAS_MIN: bool = true;
        const D_AT: usize = 0;
        #[inline(always)]
        unsafe fn levels(b: *const u8, _: usize) -> __m256i {
            let qh = (b.add(4) as *const u32).read_unaligned();
            _mm256_or_si256(nibbles_16(b.add(8)), bits_to_0x10(qh))
        }
    }

    impl Unpack for Q8_0 {
        const HAS_MIN: bool = false;
        const D_AT: usize = 0;
        #[inline(always)]
        unsafe fn levels(b: *const u8, _: usize) -> __m256i {
            _mm256_loadu_si256(b.add(2) as *const __m256i)
        }
    }

    impl Unpack for Q4K {
        const HAS_MIN: bool = true;
        const D_AT: usize = 0;
        #[inline(always)]
        unsafe fn levels(b: *const u8, j: usize) -> __m256i {
            let q = _mm256_loadu_si256(b.add(16 + (j / 2) * 32) as *const __m256i);
            let q = if j.is_multiple_of(2) {
                q
            } else {
                _mm256_srli_epi16(q, 4)
            };
            _mm256_and_si256(q, _mm256_set1_epi8(15))
        }
    }

    impl Unpack for Q5K {
        const HAS_MIN: bool = true;
        const D_AT: usize = 0;
        #[inline(always)]
        unsafe fn levels(b: *const u8, j: usize) -> __m256i {
            let q = _mm256_loadu_si256(b.add(48 + (j / 2) * 32) as *const __m256i);
            let q = if j.is_multiple_of(2) {
                q
            } else {
                _mm256_srli_epi16(q, 4)
            };
            let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
            let bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j as i32)), _mm256_set1_epi8(1));
            _mm256_or_si256(_mm256_and_si256(q, _mm256_set1_epi8(15)), _mm256_slli_epi16(bit, 4))
        }
    }

    impl Unpack for Q6K {
        const HAS_MIN: bool = false;
        const D_AT: usize = 208;
        #[inline(always)]
        unsafe fn levels(b: *const u8, j: usize) -> __m256i {
            let (h, k) = (j / 4, j % 4);
            let ql = _mm256_loadu_si256(b.add(h * 64 + (k % 2) * 32) as *const __m256i);
            let ql = if k >= 2 { _mm256_srli_epi16(ql, 4) } else { ql };
            let lo = _mm256_and_si256(ql, _mm256_set1_epi8(15));
            let qh = _mm256_loadu_si256(b.add(128 + h * 32) as *const __m256i);
            let hi = _mm256_and_si256(
                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)),
                _mm256_set1_epi8(3),
            );
            _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32))
        }
    }

    /// The weight rows of a tile, as pointers to their first byte.
    type Rows<const W: usize> = [*const u8; W];

    /// The f16 at `p` as f32 bits in a 16-bit lane (for `cvtph`).
    #[inline(always)]
    unsafe fn h16(p: *const u8) -> i16 {
        (p as *const i16).read_unaligned()
    }

    /// Eight f16 values (lane i from `at(i)`) as f32.
    #[inline(always)]
    unsafe fn f16x8(at: impl Fn(usize) -> *const u8) -> __m256 {
        let v = |i: usize| h16(at(i));
        _mm256_cvtph_ps(_mm_set_epi16(v(7), v(6), v(5), v(4), v(3), v(2), v(1), v(0)))
    }

    /// Eight f32 values (lane i is `f(i)`).
    #[inline(always)]
    unsafe fn f32x8(f: impl Fn(usize) -> f32) -> __m256 {
        _mm256_set_ps(f(7), f(6), f(5), f(4), f(3), f(2), f(1), f(0))
    }

    /// Pairwise step of the reduction of eight blocks' lane vectors.
    #[inline(always)]
    unsafe fn hadd(a: __m256i, b: __m256i) -> __m256i {
        _mm256_hadd_epi32(a, b)
    }

    /// The last step: from `q0` (blocks 0..4, halves apart) and `q1` (blocks
    /// 4..8) to one vector whose lane j is the exact sum of block j's lanes.
    #[inline(always)]
    unsafe fn hfinish(q0: __m256i, q1: __m256i) -> __m256i {
        _mm256_add_epi32(
            _mm256_permute2x128_si256(q0, q1, 0x20),
            _mm256_permute2x128_si256(q0, q1, 0x31),
        )
    }

    /// The integer lanes of block `b` for `W` weight rows and `R`
    /// activation rows (lane k: elements 4k..4k+3).
    #[inline(always)]
    unsafe fn block_lanes<U: Unpack, const VNNI: bool, const W: usize, const R: usize>(
        rows: &Rows<W>,
        ts: usize,
        b: usize,
        acts: &[&[BlockQ8]; R],
    ) -> [[__m256i; R]; W] {
        let mut out = [[_mm256_setzero_si256(); R]; W];
        let mut av = [_mm256_setzero_si256(); R];
        for r in 0..R {
            av[r] = _mm256_loadu_si256(acts[r].get_unchecked(b).qs.as_ptr() as *const __m256i);
        }
        for w in 0..W {
            let wv = U::levels(rows[w].add(b * ts), 0);
            // Types with a minimum have non-negative levels and need no
            // sign transfer.
            let ax = if U::HAS_MIN { wv } else { _mm256_sign_epi8(wv, wv) };
            for r in 0..R {
                let sy = if U::HAS_MIN { av[r] } else { _mm256_sign_epi8(av[r], wv) };
                out[w][r] = if VNNI {
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
                };
            }
        }
        out
    }

    /// `W` weight rows of a 32-element block type against `R` activation
    /// rows, eight blocks at a time: their lane vectors are reduced to one
    /// vector of eight exact block sums, whose lane j is block `8g + j`,
    /// the accumulator the reference uses.
    #[inline(always)]
    unsafe fn block_tile<U: Unpack, const VNNI: bool, const W: usize, const R: usize>(
        ty: GgmlType,
        rows: &Rows<W>,
        row_bytes: usize,
        acts: &[&[BlockQ8]; R],
        out: &mut [f32],
    ) {
        let ts = ty.type_size();
        let nb = row_bytes / ts;
        let mut acc = [[_mm256_setzero_ps(); R]; W];
        let mut g = 0;
        while g + 8 <= nb {
            let mut q = [[[_mm256_setzero_si256(); 2]; R]; W];
            for half in 0..2 {
                let mut h = [[[_mm256_setzero_si256(); 2]; R]; W];
                for p in 0..2 {
                    let b = g + half * 4 + p * 2;
                    let v0 = block_lanes::<U, VNNI, W, R>(rows, ts, b, acts);
                    let v1 = block_lanes::<U, VNNI, W, R>(rows, ts, b + 1, acts);
                    for w in 0..W {
                        for r in 0..R {
                            h[w][r][p] = hadd(v0[w][r], v1[w][r]);
                        }
                    }
                }
                for w in 0..W {
                    for r in 0..R {
                        q[w][r][half] = hadd(h[w][r][0], h[w][r][1]);
                    }
                }
            }
            let mut da = [_mm256_setzero_ps(); R];
            let mut sa = [_mm256_setzero_ps(); R];
            for r in 0..R {
                let a = acts[r].as_ptr().add(g);
                da[r] = f32x8(|i| (*a.add(i)).d);
                if U::HAS_MIN {
                    sa[r] = f32x8(|i| (*a.add(i)).s);
                }
            }
            for w in 0..W {
                let base = rows[w].add(g * ts);
                let dw = f16x8(|i| base.add(i * ts + U::D_AT));
                let mw = if U::HAS_MIN {
                    f16x8(|i| base.add(i * ts + U::M_AT))
                } else {
                    _mm256_setzero_ps()
                };
                for r in 0..R {
                    let isum = hfinish(q[w][r][0], q[w][r][1]);
                    acc[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, da[r]), acc[w][r]);
                    if U::HAS_MIN {
                        acc[w][r] = _mm256_fmadd_ps(mw, sa[r], acc[w][r]);
                    }
                }
            }
            g += 8;
        }
        // The last blocks (fewer than eight) one by one, into their lanes.
        let mut sums = [[Acc8::new(); R]; W];
        for w in 0..W {
            for r in 0..R {
                _mm256_storeu_ps(sums[w][r].0.as_mut_ptr(), acc[w][r]);
            }
        }
        for b in g..nb {
            let lanes = block_lanes::<U, VNNI, W, R>(rows, ts, b, acts);
            for w in 0..W {
                let blk = rows[w].add(b * ts);
                let dw = h2f(blk.add(U::D_AT));
                for r in 0..R {
                    let a = acts[r].get_unchecked(b);
                    let lane = sums[w][r].0.get_unchecked_mut(b % 8);
                    *lane = fma1(hsum_i32(lanes[w][r]) as f32, dw * a.d, *lane);
                    if U::HAS_MIN {
                        *lane = fma1(h2f(blk.add(U::M_AT)), a.s, *lane);
                    }
                }
            }
        }
        for w in 0..W {
            for r in 0..R {
                *out.get_unchecked_mut(w * R + r) = sums[w][r].finish();
            }
        }
    }

    /// An f16 in memory as f32.
    #[inline(always)]
    unsafe fn h2f(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h16(p) as u16 as i32)))
    }

    /// The eight 6-bit scales and minimums of a Q4_K / Q5_K super-block
    /// (`scale_min_k4` for every block at once): scales in 16-bit lanes
    /// 0..8 of the result, minimums in lanes 8..16.
    #[inline(always)]
    pub(crate) unsafe fn scales_mins_k4(b: *const u8) -> __m256i {
        const M1: u32 = 0x3f3f_3f3f;
        const M2: u32 = 0x0f0f_0f0f;
        const M3: u32 = 0x0303_0303;
        let p = b.add(4);
        let u0 = (p as *const u32).read_unaligned();
        let u1 = (p.add(4) as *const u32).read_unaligned();
        let u2 = (p.add(8) as *const u32).read_unaligned();
        let sc_lo = u0 & M1;
        let sc_hi = (u2 & M2) | (((u0 >> 6) & M3) << 4);
        let m_lo = u1 & M1;
        let m_hi = ((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4);
        _mm256_cvtepu8_epi16(_mm_set_epi32(m_hi as i32, m_lo as i32, sc_hi as i32, sc_lo as i32))
    }

    /// The integer lanes of super-block `sb` for `W` weight rows against
    /// `R` activation rows, and the lanes of their minimum sums (zero for types
    /// without a minimum).
    ///
    /// Per block, the byte products are summed in pairs to 16 bits
    /// (`maddubs`, which cannot saturate: weights are at most 32 in
    /// magnitude), then multiplied by the group's scale and summed in pairs
    /// to 32 bits (`vpdpwssd` or `madd`). Integer sums do not depend on
    /// their order, so the lanes add up to exactly the reference's `isum`.
    #[inline(always)]
    unsafe fn k_lanes<U: Unpack, const VNNI: bool, const W: usize, const R: usize>(
        rows: &Rows<W>,
        ts: usize,
        sb: usize,
        acts: &[&[BlockQ8]; R],
    ) -> ([[__m256i; R]; W], [[__m256i; R]; W]) {
        let mut lanes = [[_mm256_setzero_si256(); R]; W];
        let mut mins = [[_mm256_setzero_si256(); R]; W];
        // Q4_K and Q5_K levels are non-negative; Q6_K's are signed.
        let signed = !U::HAS_MIN;
        let blk: [*const u8; W] = std::array::from_fn(|w| rows[w].add(sb * ts));
        let mut sm = [_mm256_setzero_si256(); W];
        if !signed {
            for w in 0..W {
                sm[w] = scales_mins_k4(blk[w]);
            }
        }
        for j in 0..8 {
            let mut av = [_mm256_setzero_si256(); R];
            for r in 0..R {
                let ab = acts[r].get_unchecked(sb * 8 + j);
                av[r] = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            }
            for w in 0..W {
                let wv = U::levels(blk[w], j);
                let ax = if signed { _mm256_sign_epi8(wv, wv) } else { wv };
                let scv = if signed {
                    let a = *blk[w].add(192 + 2 * j) as i8 as i16;
                    let c = *blk[w].add(192 + 2 * j + 1) as i8 as i16;
                    _mm256_set_m128i(_mm_set1_epi16(c), _mm_set1_epi16(a))
                } else {
                    // Broadcast 16-bit lane j of the scales.
                    let idx = _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16);
                    _mm256_shuffle_epi8(_mm256_permute2x128_si256(sm[w], sm[w], 0), idx)
                };
                for r in 0..R {
                    let sy = if signed { _mm256_sign_epi8(av[r], wv) } else { av[r] };
                    let p16 = _mm256_maddubs_epi16(ax, sy);
                    lanes[w][r] = if VNNI {
                        _mm256_dpwssd_epi32(lanes[w][r], p16, scv)
                    } else {
                        _mm256_add_epi32(lanes[w][r], _mm256_madd_epi16(p16, scv))
                    };
                }
            }
        }
        if U::HAS_MIN {
            for r in 0..R {
                let blocks = acts[r].get_unchecked(sb * 8..sb * 8 + 8);
                // The eight block sums as 16-bit lanes (each |sum| <= 32 * 128).
                let sums = _mm_set_epi16(
                    blocks[7].sum as i16,
                    blocks[6].sum as i16,
                    blocks[5].sum as i16,
                    blocks[4].sum as i16,
                    blocks[3].sum as i16,
                    blocks[2].sum as i16,
                    blocks[1].sum as i16,
                    blocks[0].sum as i16,
                );
                for w in 0..W {
                    let m = _mm256_extracti128_si256(sm[w], 1);
                    mins[w][r] = _mm256_castsi128_si256(_mm_madd_epi16(m, sums));
                    // The upper half of a cast is undefined; clear it.
                    mins[w][r] = _mm256_inserti128_si256(mins[w][r], _mm_setzero_si128(), 1);
                }
            }
        }
        (lanes, mins)
    }

    /// Horizontal sum of eight 32-bit integers (exact).
    #[inline(always)]
    pub(crate) unsafe fn hsum_i32(v: __m256i) -> i32 {
        let x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0b01_00_11_10));
        let x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0b10_11_00_01));
        _mm_cvtsi128_si32(x)
    }

    /// `fma(a, b, c)` on scalars, as one instruction.
    #[inline(always)]
    unsafe fn fma1(a: f32, b: f32, c: f32) -> f32 {
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
    }

    /// `W` weight rows of a K-quant type against `R` activation rows. A
    /// super-block's lanes are summed to its one integer at once (a
    /// super-block is long enough that this costs little) and added to
    /// accumulator `sb % 8` as scalars.
    #[inline(always)]
    unsafe fn k_tile<U: Unpack, const VNNI: bool, const W: usize, const R: usize>(
        ty: GgmlType,
        rows: &Rows<W>,
        row_bytes: usize,
        acts: &[&[BlockQ8]; R],
        out: &mut [f32],
    ) {
        let ts = ty.type_size();
        let nsb = row_bytes / ts;
        let mut acc = [[Acc8::new(); R]; W];
        for sb in 0..nsb {
            let (lanes, mins) = k_lanes::<U, VNNI, W, R>(rows, ts, sb, acts);
            for w in 0..W {
                let blk = rows[w].add(sb * ts);
                let d = h2f(blk.add(U::D_AT));
                let dmin = h2f(blk.add(U::M_AT));
                for r in 0..R {
                    let da = acts[r].get_unchecked(sb * 8).d;
                    let lane = acc[w][r].0.get_unchecked_mut(sb % 8);
                    *lane = fma1(hsum_i32(lanes[w][r]) as f32, d * da, *lane);
                    if U::HAS_MIN {
                        *lane = fma1(-(dmin * da), hsum_i32(mins[w][r]) as f32, *lane);
                    }
                }
            }
        }
        for w in 0..W {
            for r in 0..R {
                *out.get_unchecked_mut(w * R + r) = acc[w][r].finish();
            }
        }
    }

    /// Two activation blocks (64 bytes, not adjacent in memory) as one
    /// 512-bit vector.
    #[inline(always)]
    unsafe fn act64(a: &[BlockQ8], b: usize) -> __m512i {
        let lo = _mm256_loadu_si256(a.get_unchecked(b).qs.as_ptr() as *const __m256i);
        let hi = _mm256_loadu_si256(a.get_unchecked(b + 1).qs.as_ptr() as *const __m256i);
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    }

    /// Q6_K against one activation row with 512-bit vectors: 64 elements
    /// (two blocks) per step, signs moved to the activations with a mask.
    /// Same integers and float operations as [`k_tile`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6k_row(row: *const u8, nsb: usize, act: &[BlockQ8]) -> f32 {
        const TS: usize = 210;
        let m4 = _mm512_set1_epi8(15);
        let m2 = _mm512_set1_epi8(3);
        let c32 = _mm512_set1_epi8(32);
        // Per pair p (blocks 2p, 2p + 1; k = 2 * (p % 2)): the high bits sit
        // at shift 2k for the even block and 2k + 2 for the odd one.
        // (Loops, not closures: a closure does not inherit the target
        // features, and its intrinsics would become calls.)
        let mut hshift = [_mm512_setzero_si512(); 2];
        for odd in 0..2 {
            let k = 2 * odd as i16;
            hshift[odd] = _mm512_inserti64x4(_mm512_set1_epi16(2 * k), _mm256_set1_epi16(2 * k + 2), 1);
        }
        // Per pair p, the 16-bit lane indices of scales 4p..4p + 4, eight
        // lanes each (a 16-bit lane of `maddubs` covers two elements).
        let mut idx = [_mm512_setzero_si512(); 4];
        for p in 0..4 {
            let g = 4 * p as i16;
            let lo = _mm256_blend_epi32(_mm256_set1_epi16(g), _mm256_set1_epi16(g + 1), 0xf0);
            let hi = _mm256_blend_epi32(_mm256_set1_epi16(g + 2), _mm256_set1_epi16(g + 3), 0xf0);
            idx[p] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        let mut acc = Acc8::new();
        for sb in 0..nsb {
            let blk = row.add(sb * TS);
            let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i)));
            let mut isum = _mm512_setzero_si512();
            for p in 0..4 {
                let h = p / 2;
                let ql = _mm512_loadu_si512(blk.add(h * 64) as *const __m512i);
                let ql = if p % 2 == 1 { _mm512_srli_epi16(ql, 4) } else { ql };
                let lo = _mm512_and_si512(ql, m4);
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(128 + h * 32) as *const __m256i));
                let hi = _mm512_and_si512(_mm512_srlv_epi16(qh, hshift[p % 2]), m2);
                let w = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)), c32);
                let a = act64(act, sb * 8 + 2 * p);
                let neg = _mm512_movepi8_mask(w);
                let sy = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
                let p16 = _mm512_maddubs_epi16(_mm512_abs_epi8(w), sy);
                isum = _mm512_dpwssd_epi32(isum, p16, _mm512_permutexvar_epi16(idx[p], sc));
            }
            let da = act.get_unchecked(sb * 8).d;
            let lane = acc.0.get_unchecked_mut(sb % 8);
            *lane = fma1(_mm512_reduce_add_epi32(isum) as f32, h2f(blk.add(208)) * da, *lane);
        }
        acc.finish()
    }

    /// One tile of a given type.
    #[inline(always)]
    unsafe fn tile<const VNNI: bool, const W: usize, const R: usize>(
        ty: GgmlType,
        rows: &Rows<W>,
        row_bytes: usize,
        acts: &[&[BlockQ8]; R],
        out: &mut [f32],
    ) {
        match ty {
            GgmlType::Q4_0 => block_tile::<Q4_0, VNNI, W, R>(ty, rows, row_bytes, acts, out),
            GgmlType::Q4_1 => block_tile::<Q4_1, VNNI, W, R>(ty, rows, row_bytes, acts, out),
            GgmlType::Q5_0 => block_tile::<Q5_0, VNNI, W, R>(ty, rows, row_bytes, acts, out),
            GgmlType::Q5_1 => block_tile::<Q5_1, VNNI, W, R>(ty, rows, row_bytes, acts, out),
            GgmlType::Q8_0 => block_tile::<Q8_0, VNNI, W, R>(ty, rows, row_bytes, acts, out),
            GgmlType::Q4K => k_tile::<Q4K, VNNI, W, R>(ty, rows, row_bytes, acts, out),
            GgmlType::Q5K => k_tile::<Q5K, VNNI, W, R>(ty, rows, row_bytes, acts, out),
            GgmlType::Q6K => k_tile::<Q6K, VNNI, W, R>(ty, rows, row_bytes, acts, out),
            _ => unreachable!(),
        }
    }

    /// Weight rows per tile for one activation row, and for four. The tile
    /// kernels take any number; one is what measured fastest on the
    /// development machine: against one activation row, reading 2 or 4
    /// weight rows in step was 2-3x slower from DRAM (interleaved streams
    /// defeat the hardware prefetchers; software prefetch recovered only
    /// part), and against four rows a second weight row did not help (the
    /// kernel is bound by its multiply instructions, not its loads).
    const W_ONE: usize = 1;
    const W_FOUR: usize = 1;

    /// All tiles of `wrows x acts`: activation rows in fours, then a pair,
    /// then one; weight rows in groups of `W_ONE` against one activation
    /// row, of `W_FOUR` against four, one by one otherwise.
    /// `out[w * acts.len() + r]`.
    #[inline(always)]
    unsafe fn tiles<const VNNI: bool>(ty: GgmlType, wrows: &[&[u8]], acts: &[&[BlockQ8]], out: &mut [f32]) {
        let row_bytes = wrows[0].len();
        let n_r = acts.len();
        let mut r0 = 0;
        while r0 < n_r {
            let rt = match n_r - r0 {
                1 => 1,
                2 | 3 => 2,
                _ => 4,
            };
            let mut tmp = [0f32; 16];
            let mut w0 = 0;
            while w0 < wrows.len() {
                let left = wrows.len() - w0;
                let wt;
                match rt {
                    4 => {
                        let a: &[&[BlockQ8]; 4] = &std::array::from_fn(|i| acts[r0 + i]);
                        if left >= W_FOUR {
                            let rows: Rows<W_FOUR> = std::array::from_fn(|i| wrows[w0 + i].as_ptr());
                            tile::<VNNI, W_FOUR, 4>(ty, &rows, row_bytes, a, &mut tmp);
                            wt = W_FOUR;
                        } else {
                            tile::<VNNI, 1, 4>(ty, &[wrows[w0].as_ptr()], row_bytes, a, &mut tmp);
                            wt = 1;
                        }
                    }
                    2 => {
                        let a: &[&[BlockQ8]; 2] = &std::array::from_fn(|i| acts[r0 + i]);
                        tile::<VNNI, 1, 2>(ty, &[wrows[w0].as_ptr()], row_bytes, a, &mut tmp);
                        wt = 1;
                    }
                    _ if VNNI && ty == GgmlType::Q6K => {
                        tmp[0] = q6k_row(wrows[w0].as_ptr(), row_bytes / ty.type_size(), acts[r0]);
                        wt = 1;
                    }
                    _ => {
                        let a: &[&[BlockQ8]; 1] = &[acts[r0]];
                        if left >= W_ONE {
                            let rows: Rows<W_ONE> = std::array::from_fn(|i| wrows[w0 + i].as_ptr());
                            tile::<VNNI, W_ONE, 1>(ty, &rows, row_bytes, a, &mut tmp);
                            wt = W_ONE;
                        } else {
                            tile::<VNNI, 1, 1>(ty, &[wrows[w0].as_ptr()], row_bytes, a, &mut tmp);
                            wt = 1;
                        }
                    }
                }
                for w in 0..wt {
                    for r in 0..rt {
                        *out.get_unchecked_mut((w0 + w) * n_r + r0 + r) = tmp[w * rt + r];
                    }
                }
                w0 += wt;
            }
            r0 += rt;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tiles_avx2(ty: GgmlType, wrows: &[&[u8]], acts: &[&[BlockQ8]], out: &mut [f32]) {
        tiles::<false>(ty, wrows, acts, out)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tiles_vnni(ty: GgmlType, wrows: &[&[u8]], acts: &[&[BlockQ8]], out: &mut [f32]) {
        tiles::<true>(ty, wrows, acts, out)
    }

    /// Every weight row in `wrows` against every activation row in `acts`.
    pub(super) unsafe fn dot_tile(vnni: bool, ty: GgmlType, wrows: &[&[u8]], acts: &[&[BlockQ8]], out: &mut [f32]) {
        if vnni {
            tiles_vnni(ty, wrows, acts, out)
        } else {
            tiles_avx2(ty, wrows, acts, out)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        for (wc, xc) in w.chunks_exact(16).zip(x.chunks_exact(16)) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wc.as_ptr()), _mm256_loadu_ps(xc.as_ptr()), a0);
            a1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(wc.as_ptr().add(8)),
                _mm256_loadu_ps(xc.as_ptr().add(8)),
                a1,
            );
        }
        let mut acc = Acc::new();
        _mm256_storeu_ps(acc.0[0].as_mut_ptr(), a0);
        _mm256_storeu_ps(acc.0[1].as_mut_ptr(), a1);
        acc.finish()
    }
}

/// Test data shared by the kernels' tests.
#[cfg(test)]
pub(crate) mod test_support {
    use half::f16;

    use crate::quant::GgmlType;

    /// A deterministic generator for test data.
    pub(crate) struct Rng(pub(crate) u64);
    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        pub(crate) fn f32(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// Every quantized weight type the kernels take.
    pub(crate) const TYPES: [GgmlType; 8] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// Random weight blocks with sane f16 scales.
    pub(crate) fn weights(ty: GgmlType, n_elems: usize, rng: &mut Rng) -> Vec<u8> {
        let mut w: Vec<u8> = (0..ty.bytes_for(n_elems as u64).unwrap())
            .map(|_| rng.next() as u8)
            .collect();
        let ts = ty.type_size();
        let scale_at: &[usize] = match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[],
        };
        for blk in w.chunks_exact_mut(ts) {
            for &at in scale_at {
                let v = f16::from_f32(rng.f32() * 0.05);
                blk[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        w
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{weights, Rng, TYPES};
    use super::*;

    /// The scalar reference for `ty`.
    fn reference(ty: GgmlType, w: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
        if is_k(ty) {
            dot_rows_scalar_k(ty, w, acts, out)
        } else {
            dot_rows_scalar(ty, w, acts, out)
        }
    }

    fn acts(ty: GgmlType, n_elems: usize, rng: &mut Rng, scale: f32) -> Vec<BlockQ8> {
        let x: Vec<f32> = (0..n_elems).map(|_| rng.f32() * scale).collect();
        let mut q = vec![BlockQ8::default(); n_elems / QK8];
        quantize_row(act_format(ty), &x, &mut q);
        q
    }

    #[test]
    fn vector_quantization_equals_the_scalar_reference_bitwise() {
        let mut rng = Rng(11);
        for format in [ActFormat::Q8_0, ActFormat::Q8_1, ActFormat::Q8K] {
            for case in 0..64 {
                let mut x: Vec<f32> = (0..1024).map(|_| rng.f32() * 3.0).collect();
                match case % 8 {
                    // Exact halves after scaling: ties go to even.
                    1 => x.iter_mut().for_each(|v| *v = (*v * 8.0).round() / 8.0 + 1.0 / 254.0),
                    // Zero blocks and blocks with one non-zero element.
                    2 => x[..256]
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, v)| *v = if i == 77 { -0.5 } else { 0.0 }),
                    // Values too small for 127 / amax to be finite.
                    3 => x[256..512].iter_mut().for_each(|v| *v *= 1e-38),
                    // The largest magnitude twice, with both signs.
                    4 => {
                        x[3] = 9.0;
                        x[40] = -9.0;
                        x[300] = -9.0;
                        x[301] = 9.0;
                    }
                    // NaN and infinities.
                    5 => {
                        x[5] = f32::NAN;
                        x[600] = f32::INFINITY;
                        x[900] = f32::NEG_INFINITY;
                    }
                    _ => {}
                }
                let mut a = vec![BlockQ8::default(); x.len() / QK8];
                let mut b = a.clone();
                quantize_row(format, &x, &mut a);
                quantize_row_scalar(format, &x, &mut b);
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    assert_eq!(p.qs, q.qs, "{format:?} case {case} block {i}");
                    assert_eq!(p.sum, q.sum, "{format:?} case {case} block {i}");
                    assert_eq!(p.d.to_bits(), q.d.to_bits(), "{format:?} case {case} block {i}");
                    assert_eq!(p.s.to_bits(), q.s.to_bits(), "{format:?} case {case} block {i}");
                }
            }
        }
    }

    #[test]
    fn scalar_dot_matches_dequantized_float_dot() {
        let mut rng = Rng(7);
        for ty in TYPES {
            let n = 512;
            let w = weights(ty, n, &mut rng);
            let a = acts(ty, n, &mut rng, 3.0);
            let mut out = [0f32];
            reference(ty, &w, &[&a], &mut out);
            let mut wf = vec![0f32; n];
            crate::dequantize(ty, &w, &mut wf).unwrap();
            let af: Vec<f32> = a
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
                .collect();
            let want: f64 = wf.iter().zip(&af).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mag: f64 = wf.iter().zip(&af).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
            // Q8_1's s is rounded to f16, so the min term carries that error.
            let tol = if act_format(ty) == ActFormat::Q8_1 { 2e-3 } else { 1e-5 };
            assert!(
                ((out[0] as f64) - want).abs() <= tol * mag + 1e-6,
                "{ty}: {} vs {want}",
                out[0]
            );
        }
    }

    #[test]
    fn every_simd_path_is_bitwise_equal_to_scalar() {
        let mut rng = Rng(99);
        for level in Simd::available() {
            for ty in TYPES {
                for rows in [1, 3, 4] {
                    let n = 1024;
                    let w = weights(ty, n, &mut rng);
                    let a: Vec<Vec<BlockQ8>> = (0..rows)
                        .map(|r| acts(ty, n, &mut rng, 1.0 + r as f32 * 10.0))
                        .collect();
                    let refs: Vec<&[BlockQ8]> = a.iter().map(|v| v.as_slice()).collect();
                    let mut want = vec![0f32; rows];
                    reference(ty, &w, &refs, &mut want);
                    let mut got = vec![0f32; rows];
                    dot_rows_with(level, ty, &w, &refs, &mut got);
                    for r in 0..rows {
                        assert_eq!(got[r].to_bits(), want[r].to_bits(), "{level:?} {ty} row {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn tiles_of_weight_rows_equal_single_rows() {
        let mut rng = Rng(1234);
        for level in Simd::available() {
            for ty in TYPES {
                // An odd and an even number of super-blocks / blocks.
                for n in [768, 1024] {
                    let n_w = 7;
                    let n_r = 9;
                    let ws: Vec<Vec<u8>> = (0..n_w).map(|_| weights(ty, n, &mut rng)).collect();
                    let a: Vec<Vec<BlockQ8>> = (0..n_r).map(|r| acts(ty, n, &mut rng, 0.5 + r as f32 * 3.0)).collect();
                    let refs: Vec<&[BlockQ8]> = a.iter().map(|v| v.as_slice()).collect();
                    let wrefs: Vec<&[u8]> = ws.iter().map(|v| v.as_slice()).collect();
                    for (nw, nr) in [(n_w, n_r), (4, 1), (2, 4), (5, 4), (3, 2), (1, 9)] {
                        let mut got = vec![0f32; nw * nr];
                        dot_tile_with(level, ty, &wrefs[..nw], &refs[..nr], &mut got);
                        for w in 0..nw {
                            let mut want = vec![0f32; nr];
                            reference(ty, &ws[w], &refs[..nr], &mut want);
                            for r in 0..nr {
                                assert_eq!(
                                    got[w * nr + r].to_bits(),
                                    want[r].to_bits(),
                                    "{level:?} {ty} n {n} tile {nw}x{nr} at ({w}, {r})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let mut rng = Rng(5);
        for ty in TYPES {
            let n = 512;
            let w = weights(ty, n, &mut rng);
            let a: Vec<Vec<BlockQ8>> = (0..5).map(|_| acts(ty, n, &mut rng, 2.0)).collect();
            let refs: Vec<&[BlockQ8]> = a.iter().map(|v| v.as_slice()).collect();
            let mut all = vec![0f32; 5];
            dot_rows(ty, &w, &refs, &mut all);
            for r in 0..5 {
                let mut one = [0f32];
                dot_rows(ty, &w, &refs[r..r + 1], &mut one);
                assert_eq!(one[0].to_bits(), all[r].to_bits(), "{ty} row {r}");
            }
        }
    }

    #[test]
    fn adversarial_activations() {
        // All-zero, all-equal, tiny (subnormal-scale) and large activations
        // (q8_1 keeps `s` in f16, so 32 * |x| must stay below 65504).
        let mut rng = Rng(3);
        for ty in TYPES {
            let n = 256;
            let w = weights(ty, n, &mut rng);
            for x in [vec![0f32; n], vec![1.5f32; n], vec![1e-38f32; n], vec![2e3f32; n]] {
                let mut q = vec![BlockQ8::default(); n / QK8];
                quantize_row(act_format(ty), &x, &mut q);
                let mut want = [0f32];
                reference(ty, &w, &[&q], &mut want);
                assert!(want[0].is_finite(), "{ty}");
                for level in Simd::available() {
                    let mut got = [0f32];
                    dot_rows_with(level, ty, &w, &[&q], &mut got);
                    assert_eq!(got[0].to_bits(), want[0].to_bits(), "{level:?} {ty}");
                }
            }
        }
    }

    #[test]
    fn activation_quantization_matches_ggml_rules() {
        // q8_0: d is amax/127 rounded to f16; q rounds x*127/amax to even.
        let mut x = vec![0f32; 32];
        x[0] = 2.54;
        x[1] = -1.27;
        x[2] = 0.01; // 0.01 * 127 / 2.54 = 0.5: ties to even, 0
        let mut q = [BlockQ8::default()];
        quantize_row(ActFormat::Q8_0, &x, &mut q);
        assert_eq!(&q[0].qs[..3], &[127, -64, 0]);
        assert_eq!(q[0].d, f16::from_f32(2.54 / 127.0).to_f32());
        // q8_K: the sign of the scale follows the largest-magnitude element.
        let mut x = vec![0.5f32; 256];
        x[7] = 4.0;
        let mut q = vec![BlockQ8::default(); 8];
        quantize_row(ActFormat::Q8K, &x, &mut q);
        assert_eq!(q[0].qs[7], -127);
        assert!(q[0].d < 0.0 && q.iter().all(|b| b.d == q[0].d));
    }

    #[test]
    fn f32_dot_paths_agree() {
        let mut rng = Rng(11);
        let w: Vec<f32> = (0..160).map(|_| rng.f32()).collect();
        let x: Vec<f32> = (0..160).map(|_| rng.f32()).collect();
        assert_eq!(dot_f32(&w, &x).to_bits(), dot_f32_scalar(&w, &x).to_bits());
    }
}
