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
use crate::quant::{e8m0_half, iq4xs_scale, q3k_scales, scale_min_k4, GgmlType, IQ4_LEVELS, MXFP4_LEVELS};

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
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::IQ4XS => {
            ActFormat::Q8K
        }
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
        GgmlType::IQ4NL | GgmlType::MXFP4 => {
            let (levels, at, scale) = if ty == GgmlType::IQ4NL {
                (&IQ4_LEVELS, 2, f16_at(b, 0))
            } else {
                (&MXFP4_LEVELS, 1, e8m0_half(b[0]))
            };
            for i in 0..16 {
                w[i] = levels[(b[at + i] & 15) as usize];
                w[i + 16] = levels[(b[at + i] >> 4) as usize];
            }
            (scale, None)
        }
        GgmlType::Q2K | GgmlType::Q3K => {
            // Block j is bits 2(j % 4).. of 32 bytes of `qs` (half j / 4);
            // Q3_K takes 4 off where bit j of `hmask` is clear.
            let (h, k) = (j / 4, j % 4);
            let qs_at = if ty == GgmlType::Q2K { 16 } else { 32 };
            for l in 0..32 {
                let low = ((b[qs_at + 32 * h + l] >> (2 * k)) & 3) as i8;
                w[l] = if ty == GgmlType::Q2K || b[l] & (1 << j) != 0 {
                    low
                } else {
                    low - 4
                };
            }
            (0.0, None)
        }
        GgmlType::IQ4XS => {
            let qs = &b[8 + 16 * j..8 + 16 * j + 16];
            for i in 0..16 {
                w[i] = IQ4_LEVELS[(qs[i] & 15) as usize];
                w[i + 16] = IQ4_LEVELS[(qs[i] >> 4) as usize];
            }
            (0.0, None)
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

/// Integer scales of one K-quant super-block: the scale and the minimum
/// (0 for types without one) of each of its 16 groups of 16 elements, and
/// the float factors.
pub(crate) struct KScales {
    pub(crate) sc: [i32; 16],
    pub(crate) min: [i32; 16],
    pub(crate) d: f32,
    pub(crate) dmin: f32,
}

pub(crate) fn k_scales(ty: GgmlType, b: &[u8]) -> KScales {
    let mut ks = KScales {
        sc: [0; 16],
        min: [0; 16],
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
                ks.min[2 * j] = m as i32;
                ks.min[2 * j + 1] = m as i32;
            }
        }
        GgmlType::Q2K => {
            ks.d = f16_at(b, 80);
            ks.dmin = f16_at(b, 82);
            for (g, &v) in b[..16].iter().enumerate() {
                ks.sc[g] = (v & 15) as i32;
                ks.min[g] = (v >> 4) as i32;
            }
        }
        GgmlType::Q3K => {
            ks.d = f16_at(b, 108);
            for (sc, s) in ks.sc.iter_mut().zip(q3k_scales(&b[96..108])) {
                *sc = s as i32;
            }
        }
        GgmlType::IQ4XS => {
            ks.d = f16_at(b, 0);
            for j in 0..8 {
                let s = iq4xs_scale(b, j) as i32;
                ks.sc[2 * j] = s;
                ks.sc[2 * j + 1] = s;
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
    let has_min = has_k_min(ty);
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
                        let s: i32 = ab.qs[16 * h..16 * h + 16].iter().map(|&q| q as i32).sum();
                        minsum += ks.min[2 * j + h] * s;
                    }
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
    matches!(
        ty,
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::IQ4XS
    )
}

/// Whether a K-quant type subtracts a minimum (its levels are then
/// non-negative; the others' are signed).
fn has_k_min(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q2K | GgmlType::Q4K | GgmlType::Q5K)
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
pub(crate) mod x86;

/// Test data shared by the kernels' tests.
#[cfg(test)]
pub(crate) mod test_support;

#[cfg(test)]
mod tests;
