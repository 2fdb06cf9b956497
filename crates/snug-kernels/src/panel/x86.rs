use std::arch::x86_64::*;

use super::{
    level_table, unit_bytes, IQ4XS_D, IQ4XS_QS, IQ4XS_SC, Q2K_D, Q2K_DMIN, Q2K_QS, Q2K_SC, Q3K_D, Q3K_HM, Q3K_QS,
    Q3K_SC, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_QS, Q4K_SC, Q5K_QH, Q6K_D, Q6K_HALF, Q6K_SC,
};
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
pub(super) unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

/// Sixteen E8M0 exponents at `p` as the f32 halves of their scales
/// ([`crate::quant::e8m0_half`]): `2^(e - 128)`, the two smallest as
/// subnormals.
#[inline(always)]
unsafe fn e8m0x16(p: *const u8) -> __m512 {
    let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
    let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
    let small = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
    let m = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(m, normal, small))
}

/// A level table in every 128-bit lane, for `vpshufb`.
#[inline(always)]
unsafe fn table(t: [u8; 16]) -> __m512i {
    _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr() as *const __m128i))
}

/// Every byte's bit `from` moved to bit `to` (other bits left for the
/// caller to mask). 16-bit shifts by at most 7 keep a byte's bits in
/// that byte at the positions read.
#[inline(always)]
unsafe fn move_bit(v: __m512i, from: usize, to: usize) -> __m512i {
    if from < to {
        _mm512_sll_epi16(v, _mm_cvtsi32_si128((to - from) as i32))
    } else {
        _mm512_srl_epi16(v, _mm_cvtsi32_si128((from - to) as i32))
    }
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
pub(super) struct Tree<const R: usize> {
    pending: [__m512; R],
    low: [__m512; R],
    high: [__m512; R],
}

impl<const R: usize> Tree<R> {
    #[inline(always)]
    pub(super) unsafe fn new() -> Self {
        Tree {
            pending: [_mm512_setzero_ps(); R],
            low: [_mm512_setzero_ps(); R],
            high: [_mm512_setzero_ps(); R],
        }
    }

    /// Takes class `c`'s accumulators (classes in order 0..8).
    #[inline(always)]
    pub(super) unsafe fn push(&mut self, c: usize, acc: &[__m512; R]) {
        self.push_rows(c, acc, R);
    }

    /// As [`Tree::push`] for the first `rows` rows only (the others are
    /// neither read nor written).
    #[inline(always)]
    pub(super) unsafe fn push_rows(&mut self, c: usize, acc: &[__m512; R], rows: usize) {
        for r in 0..rows.min(R) {
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
        self.store_rows(out, R);
    }

    /// As [`Tree::store`], the first `rows` rows only.
    #[inline(always)]
    pub(super) unsafe fn store_rows(&self, out: Out, rows: usize) {
        for r in 0..rows.min(R) {
            _mm512_mask_storeu_ps(out.ptr.add(r * out.stride), out.mask, self.low[r]);
        }
    }
}

/// Per-32-block kinds.
const Q4: u8 = 0;
const Q5: u8 = 1;
const Q8: u8 = 2;
/// Nibbles through a level table (IQ4_NL, MXFP4).
const NL: u8 = 3;

/// The 8 level vectors of the per-32-block unit at `q`: vector t holds
/// elements 4t..4t+4 of the block of each of the 16 rows, unsigned.
#[inline(always)]
unsafe fn unpack_block<const KIND: u8>(q: *const u8, lut: __m512i) -> [__m512i; 8] {
    let m0f = _mm512_set1_epi8(0x0f);
    let m10 = _mm512_set1_epi8(0x10);
    let mut w = [_mm512_setzero_si512(); 8];
    if KIND == Q8 {
        for t in 0..8 {
            w[t] = load(q.add(t * 64));
        }
    } else if KIND == NL {
        for t in 0..4 {
            let (lo, hi) = nibbles(load(q.add(t * 64)), m0f);
            w[t] = _mm512_shuffle_epi8(lut, lo);
            w[t + 4] = _mm512_shuffle_epi8(lut, hi);
        }
    } else {
        for t in 0..4 {
            (w[t], w[t + 4]) = nibbles(load(q.add(t * 64)), m0f);
        }
        if KIND == Q5 {
            // Element 4t + j's bit sits at bit 2t of byte j, element
            // 16 + 4t + j's at bit 2t + 1: move each to bit 4.
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
    w
}

/// Per-32-block types: accumulator class `c` takes blocks c, c+8, ...
/// `KIND`: nibbles (Q4), nibbles and high bits (Q5), bytes (Q8) or
/// nibbles looked up in `lut` (NL); `MIN`: a per-block minimum (Q4_1,
/// Q5_1); `OFF`: a level offset taken out through `aux`; `E8`: the scale
/// is an E8M0 exponent byte (MXFP4), not an f16.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dot_blocks<const KIND: u8, const MIN: bool, const OFF: bool, const E8: bool, const R: usize>(
    mut p: *const u8,
    ub: usize,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    lut: __m512i,
    out: Out,
) {
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
            let w = unpack_block::<KIND>(q, lut);
            let dw = if E8 { e8m0x16(q.add(d_at)) } else { f16x16(q.add(d_at)) };
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

/// A super-block's float step for each activation row r, in the
/// reference's order: `acc += isum * (d * da)`, then, with minimums,
/// `acc += -(dmin * da) * msum` (`da`: the row's activation scale).
#[inline(always)]
pub(super) unsafe fn super_block_step<const R: usize>(
    acc: &mut [__m512; R],
    acts: &[&[BlockQ8]],
    sb: usize,
    d: __m512,
    isum: &[__m512i; R],
    min: Option<(__m512, &[__m512i; R])>,
) {
    for r in 0..R {
        let da = _mm512_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, da), acc[r]);
        if let Some((dmin, msum)) = min {
            let neg = _mm512_set1_epi32(i32::MIN);
            let cm = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, da)), neg));
            acc[r] = _mm512_fmadd_ps(cm, _mm512_cvtepi32_ps(msum[r]), acc[r]);
        }
    }
}

/// Block `j`'s level vectors of a Q4_K or Q5_K (`FIVE`) unit at `q`.
/// Q4_K's odd blocks are high nibbles left in place (16 times their
/// level; see [`block_isum`]).
#[inline(always)]
pub(super) unsafe fn unpack_q4k<const FIVE: bool>(q: *const u8, j: usize) -> [__m512i; 8] {
    let m0f = _mm512_set1_epi8(0x0f);
    let mf0 = _mm512_set1_epi8(0xf0_u8 as i8);
    let m10 = _mm512_set1_epi8(0x10);
    let (pair, h) = (j / 2, j % 2);
    let mut w = [_mm512_setzero_si512(); 8];
    for t in 0..8 {
        let v = load(q.add(Q4K_QS + (pair * 8 + t) * 64));
        w[t] = if FIVE {
            // Q5_K: the nibble at bits 0..4 and bit j of the `qh` byte
            // at bit 4.
            let lo = if h == 0 { v } else { _mm512_srli_epi16::<4>(v) };
            let hb = move_bit(load(q.add(Q5K_QH + t * 64)), j, 4);
            or_and(_mm512_and_si512(lo, m0f), hb, m10)
        } else {
            _mm512_and_si512(v, if h == 0 { m0f } else { mf0 })
        };
    }
    w
}

/// Q4_K, and Q5_K (`FIVE`: a high bit per element): accumulator class
/// `c` takes super-blocks c, c+8, ...
#[inline(always)]
unsafe fn dot_q4k<const R: usize, const FIVE: bool>(
    mut p: *const u8,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    out: Out,
) {
    let ub = unit_bytes(if FIVE { GgmlType::Q5K } else { GgmlType::Q4K });
    let n_sb = n_blocks / 8;
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
                    let j = 2 * pair + h;
                    let w = unpack_q4k::<FIVE>(q, j);
                    let s = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(Q4K_SC + 16 * j) as *const __m128i));
                    if h == 0 || FIVE {
                        block_isum::<R, false, false>(&w, acts, sb * 8 + j, [[0; 2]; R], s, zero, &mut isum);
                    } else {
                        block_isum::<R, false, true>(&w, acts, sb * 8 + j, [[0; 2]; R], s, zero, &mut isum);
                    }
                }
            }
            let mut mv = [zero; 4];
            for k in 0..4 {
                mv[k] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(q.add(Q4K_MINS + 32 * k) as *const __m256i));
            }
            let mut msum = [zero; R];
            for r in 0..R {
                let x = aux.get_unchecked(r);
                for k in 0..4 {
                    msum[r] = _mm512_dpwssd_epi32(msum[r], mv[k], _mm512_set1_epi32(*x.get_unchecked(sb * 4 + k)));
                }
            }
            let (d, dmin) = (f16x16(q.add(Q4K_D)), f16x16(q.add(Q4K_DMIN)));
            super_block_step(&mut acc, acts, sb, d, &isum, Some((dmin, &msum)));
            sb += 8;
        }
        tree.push(c, &acc);
    }
    tree.store(out);
}

/// Block 4 half + k's level vectors of a Q6_K unit at `q`: low (k < 2) or
/// high nibbles of `ql` words 0..8 (k even) or 8..16 (k odd) of the half,
/// and bits 2k, 2k + 1 of its `qh` bytes at bits 4, 5.
#[inline(always)]
pub(super) unsafe fn unpack_q6k(q: *const u8, half: usize, k: usize) -> [__m512i; 8] {
    let m0f = _mm512_set1_epi8(0x0f);
    let m30 = _mm512_set1_epi8(0x30);
    let hq = q.add(Q6K_HALF + 1536 * half + 512);
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
    w
}

/// Block j's level vectors of a Q3_K (`THREE`) or Q2_K unit at `q`: bits
/// 2(j % 4).. of `qs` words 8(j / 4).., and for Q3_K bit j of the
/// `hmask` bytes as 4.
#[inline(always)]
pub(super) unsafe fn unpack_q23k<const THREE: bool>(q: *const u8, j: usize) -> [__m512i; 8] {
    let m03 = _mm512_set1_epi8(0x03);
    let m04 = _mm512_set1_epi8(0x04);
    let qs_at = if THREE { Q3K_QS } else { Q2K_QS };
    let (half, k) = (j / 4, j % 4);
    let mut w = [_mm512_setzero_si512(); 8];
    for t in 0..8 {
        let l = load(q.add(qs_at + (8 * half + t) * 64));
        let lo = _mm512_and_si512(_mm512_srl_epi16(l, _mm_cvtsi32_si128(2 * k as i32)), m03);
        w[t] = if THREE {
            or_and(lo, move_bit(load(q.add(Q3K_HM + t * 64)), j, 2), m04)
        } else {
            lo
        };
    }
    w
}

/// Q2_K's scales and minimums of block j, per lane (groups 2j and 2j + 1).
#[inline(always)]
unsafe fn q2k_scales(q: *const u8, j: usize) -> (__m512i, __m512i, __m512i) {
    let m0f = _mm512_set1_epi32(0x0f);
    let m0f16 = _mm512_set1_epi16(0x0f);
    // Per lane the bytes of groups 2j and 2j + 1 as 16-bit halves: scales
    // in the low nibbles, minimums high.
    let raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(q.add(Q2K_SC + 32 * j) as *const __m256i));
    (
        _mm512_and_si512(raw, m0f),
        _mm512_and_si512(_mm512_srli_epi32::<16>(raw), m0f),
        _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m0f16),
    )
}

/// Signed byte scales, 16 lanes, at `p`.
#[inline(always)]
pub(super) unsafe fn i8x16(p: *const u8) -> __m512i {
    _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))
}

/// The K-quants with no minimum or with Q2_K's per 16 elements: Q6_K, Q3_K,
/// Q2_K and IQ4_XS (`KIND`). Accumulator class `c` takes super-blocks c,
/// c+8, ... Each block's levels are summed with one signed scale per 16
/// elements (Q6_K and Q3_K, their level offsets of 32 and 4 taken out
/// through `aux`; Q2_K with its minimums from its 16-element activation
/// sums) or per 32 (IQ4_XS, its table offset of 128 through `aux`).
#[inline(always)]
unsafe fn dot_k<const R: usize, const KIND: u8>(
    mut p: *const u8,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    out: Out,
) {
    let ty = match KIND {
        K6 => GgmlType::Q6K,
        K3 => GgmlType::Q3K,
        K2 => GgmlType::Q2K,
        _ => GgmlType::IQ4XS,
    };
    let ub = unit_bytes(ty);
    let n_sb = n_blocks / 8;
    let lut = if KIND == KXS {
        table(level_table(ty))
    } else {
        _mm512_setzero_si512()
    };
    let zero = _mm512_setzero_si512();
    // Q6_K's blocks 0 and 2 of a half share their `ql` words, as do 1 and
    // 3: taken one after the other (the sum is of integers, in any order).
    let order: [usize; 8] = if KIND == K6 {
        [0, 2, 1, 3, 4, 6, 5, 7]
    } else {
        [0, 1, 2, 3, 4, 5, 6, 7]
    };
    let mut tree = Tree::<R>::new();
    for c in 0..8 {
        let mut acc = [_mm512_setzero_ps(); R];
        let mut sb = c;
        while sb < n_sb {
            let q = p;
            p = p.add(ub);
            let mut isum = [zero; R];
            let mut msum = [zero; R];
            for j in order {
                prefetch_part(q, ub, j, 8, out.prefetch);
                let w = match KIND {
                    K6 => unpack_q6k(q, j / 4, j % 4),
                    K3 => unpack_q23k::<true>(q, j),
                    K2 => unpack_q23k::<false>(q, j),
                    _ => unpack_block::<NL>(q.add(IQ4XS_QS + 256 * j), lut),
                };
                let blk = sb * 8 + j;
                let (s0, s1, mins) = match KIND {
                    K6 => (i8x16(q.add(Q6K_SC + 32 * j)), i8x16(q.add(Q6K_SC + 32 * j + 16)), zero),
                    K3 => (i8x16(q.add(Q3K_SC + 32 * j)), i8x16(q.add(Q3K_SC + 32 * j + 16)), zero),
                    K2 => q2k_scales(q, j),
                    _ => (i8x16(q.add(IQ4XS_SC + 16 * j)), zero, zero),
                };
                let mut start = [[0i32; 2]; R];
                for r in 0..R {
                    let x = aux.get_unchecked(r);
                    match KIND {
                        K6 | K3 => start[r] = [*x.get_unchecked(2 * blk), *x.get_unchecked(2 * blk + 1)],
                        K2 => {
                            let pair = _mm512_set1_epi32(*x.get_unchecked(2 * n_blocks + blk));
                            msum[r] = _mm512_dpwssd_epi32(msum[r], mins, pair);
                        }
                        _ => start[r][0] = *x.get_unchecked(blk),
                    }
                }
                if KIND == KXS {
                    block_isum::<R, false, false>(&w, acts, blk, start, s0, s1, &mut isum);
                } else {
                    block_isum::<R, true, false>(&w, acts, blk, start, s0, s1, &mut isum);
                }
            }
            let d_at = match KIND {
                K6 => Q6K_D,
                K3 => Q3K_D,
                K2 => Q2K_D,
                _ => IQ4XS_D,
            };
            let min = (KIND == K2).then(|| (f16x16(q.add(Q2K_DMIN)), &msum));
            super_block_step(&mut acc, acts, sb, f16x16(q.add(d_at)), &isum, min);
            sb += 8;
        }
        tree.push(c, &acc);
    }
    tree.store(out);
}

/// [`dot_k`]'s kinds.
const K6: u8 = 0;
const K3: u8 = 1;
const K2: u8 = 2;
const KXS: u8 = 3;

#[inline(always)]
pub(super) unsafe fn dot_r<const R: usize>(
    p: *const u8,
    ty: GgmlType,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    out: Out,
) {
    let ub = unit_bytes(ty);
    let z = _mm512_setzero_si512();
    match ty {
        GgmlType::Q4_0 => dot_blocks::<Q4, false, true, false, R>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::Q4_1 => dot_blocks::<Q4, true, false, false, R>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::Q5_0 => dot_blocks::<Q5, false, true, false, R>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::Q5_1 => dot_blocks::<Q5, true, false, false, R>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::Q8_0 => dot_blocks::<Q8, false, true, false, R>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::IQ4NL => {
            let lut = table(level_table(ty));
            dot_blocks::<NL, false, true, false, R>(p, ub, n_blocks, acts, aux, lut, out)
        }
        GgmlType::MXFP4 => {
            let lut = table(level_table(ty));
            dot_blocks::<NL, false, true, true, R>(p, ub, n_blocks, acts, aux, lut, out)
        }
        GgmlType::Q4K => dot_q4k::<R, false>(p, n_blocks, acts, aux, out),
        GgmlType::Q5K => dot_q4k::<R, true>(p, n_blocks, acts, aux, out),
        GgmlType::Q6K => dot_k::<R, K6>(p, n_blocks, acts, aux, out),
        GgmlType::Q3K => dot_k::<R, K3>(p, n_blocks, acts, aux, out),
        GgmlType::Q2K => dot_k::<R, K2>(p, n_blocks, acts, aux, out),
        GgmlType::IQ4XS => dot_k::<R, KXS>(p, n_blocks, acts, aux, out),
        _ => unreachable!(),
    }
}

/// Up to [`TILE_ROWS`] activation rows against one panel at `p`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot(p: *const u8, ty: GgmlType, n_blocks: usize, acts: &[&[BlockQ8]], aux: &[&[i32]], out: Out) {
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
