//! AVX2 and AVX-512 VNNI versions of the block loop. Each computes the
//! same integer lanes as `unpack` + `accumulate` and the same float
//! operations in the same order.

use std::arch::x86_64::*;

use super::{Acc, Acc8, BlockQ8};
use crate::quant::{e8m0_half, iq4xs_scale, q3k_scales, GgmlType, IQ4_LEVELS, MXFP4_LEVELS};

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
    /// K-quants whose scales and minimums are Q4_K's packed 6-bit ones.
    const K4_SCALES: bool = false;
    unsafe fn levels(b: *const u8, j: usize) -> __m256i;
    /// A 32-element block's scale.
    #[inline(always)]
    unsafe fn scale(b: *const u8) -> f32 {
        h2f(b.add(Self::D_AT))
    }
    /// The scales of eight consecutive blocks `ts` bytes apart.
    #[inline(always)]
    unsafe fn scales8(base: *const u8, ts: usize) -> __m256 {
        f16x8(|i| base.add(i * ts + Self::D_AT))
    }
    /// The other K-quants: the scale of each group of 16 elements of a
    /// super-block, and its minimum (zeros for types without one).
    #[inline(always)]
    unsafe fn group_scales(_b: *const u8) -> ([i16; 16], [i16; 16]) {
        ([0; 16], [0; 16])
    }
}

/// 16 four-bit codes (packed as [`nibbles_16`] unpacks them) looked up in
/// a table of 16 signed levels.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn lookup_16(p: *const u8, table: &[i8; 16]) -> __m256i {
    let t = _mm_loadu_si128(table.as_ptr() as *const __m128i);
    _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles_16(p))
}

pub(crate) struct Q4_0;
pub(crate) struct Q4_1;
pub(crate) struct Q5_0;
pub(crate) struct Q5_1;
pub(crate) struct Q8_0;
pub(crate) struct Q4K;
pub(crate) struct Q5K;
pub(crate) struct Q6K;
pub(crate) struct Q2K;
pub(crate) struct Q3K;
pub(crate) struct IQ4NL;
pub(crate) struct IQ4XS;
pub(crate) struct MXFP4;

impl Unpack for IQ4NL {
    const HAS_MIN: bool = false;
    const D_AT: usize = 0;
    #[inline(always)]
    unsafe fn levels(b: *const u8, _: usize) -> __m256i {
        lookup_16(b.add(2), &IQ4_LEVELS)
    }
}

impl Unpack for MXFP4 {
    const HAS_MIN: bool = false;
    const D_AT: usize = 0;
    #[inline(always)]
    unsafe fn levels(b: *const u8, _: usize) -> __m256i {
        lookup_16(b.add(1), &MXFP4_LEVELS)
    }
    #[inline(always)]
    unsafe fn scale(b: *const u8) -> f32 {
        e8m0_half(*b)
    }
    #[inline(always)]
    unsafe fn scales8(base: *const u8, ts: usize) -> __m256 {
        f32x8(|i| e8m0_half(*base.add(i * ts)))
    }
}

impl Unpack for Q2K {
    const HAS_MIN: bool = true;
    const D_AT: usize = 80;
    const M_AT: usize = 82;
    #[inline(always)]
    unsafe fn levels(b: *const u8, j: usize) -> __m256i {
        let q = _mm256_loadu_si256(b.add(16 + 32 * (j / 4)) as *const __m256i);
        let q = _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (j % 4) as i32));
        _mm256_and_si256(q, _mm256_set1_epi8(3))
    }
    #[inline(always)]
    unsafe fn group_scales(b: *const u8) -> ([i16; 16], [i16; 16]) {
        (
            std::array::from_fn(|g| (*b.add(g) & 15) as i16),
            std::array::from_fn(|g| (*b.add(g) >> 4) as i16),
        )
    }
}

impl Unpack for Q3K {
    const HAS_MIN: bool = false;
    const D_AT: usize = 108;
    #[inline(always)]
    unsafe fn levels(b: *const u8, j: usize) -> __m256i {
        let q = _mm256_loadu_si256(b.add(32 + 32 * (j / 4)) as *const __m256i);
        let q = _mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (j % 4) as i32));
        let low = _mm256_and_si256(q, _mm256_set1_epi8(3));
        // Bit j of each hmask byte, moved to bit 2: 4 where set.
        let hm = _mm256_loadu_si256(b as *const __m256i);
        let bit = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(j as i32)), _mm256_set1_epi8(1));
        _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(bit, 2)), _mm256_set1_epi8(4))
    }
    #[inline(always)]
    unsafe fn group_scales(b: *const u8) -> ([i16; 16], [i16; 16]) {
        let s = q3k_scales(std::slice::from_raw_parts(b.add(96), 12));
        (std::array::from_fn(|g| s[g] as i16), [0; 16])
    }
}

impl Unpack for IQ4XS {
    const HAS_MIN: bool = false;
    const D_AT: usize = 0;
    #[inline(always)]
    unsafe fn levels(b: *const u8, j: usize) -> __m256i {
        lookup_16(b.add(8 + 16 * j), &IQ4_LEVELS)
    }
    #[inline(always)]
    unsafe fn group_scales(b: *const u8) -> ([i16; 16], [i16; 16]) {
        let blk = std::slice::from_raw_parts(b, 8);
        (std::array::from_fn(|g| iq4xs_scale(blk, g / 2) as i16), [0; 16])
    }
}

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
    const K4_SCALES: bool = true;
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
    const K4_SCALES: bool = true;
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
    unsafe fn group_scales(b: *const u8) -> ([i16; 16], [i16; 16]) {
        (std::array::from_fn(|g| *b.add(192 + g) as i8 as i16), [0; 16])
    }
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
            let dw = U::scales8(base, ts);
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
            let dw = U::scale(blk);
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
    // Types with a minimum have non-negative levels; the others signed.
    let signed = !U::HAS_MIN;
    let blk: [*const u8; W] = std::array::from_fn(|w| rows[w].add(sb * ts));
    let mut sm = [_mm256_setzero_si256(); W];
    let mut gs = [([0i16; 16], [0i16; 16]); W];
    for w in 0..W {
        if U::K4_SCALES {
            sm[w] = scales_mins_k4(blk[w]);
        } else {
            gs[w] = U::group_scales(blk[w]);
        }
    }
    let ones = _mm256_set1_epi8(1);
    for j in 0..8 {
        let mut av = [_mm256_setzero_si256(); R];
        for r in 0..R {
            let ab = acts[r].get_unchecked(sb * 8 + j);
            av[r] = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
        }
        for w in 0..W {
            let wv = U::levels(blk[w], j);
            let ax = if signed { _mm256_sign_epi8(wv, wv) } else { wv };
            // The scales of groups 2j and 2j + 1 in the 16-bit lanes of
            // the low and the high half.
            let pair = |v: &[i16; 16]| _mm256_set_m128i(_mm_set1_epi16(v[2 * j + 1]), _mm_set1_epi16(v[2 * j]));
            let scv = if U::K4_SCALES {
                // Broadcast 16-bit lane j of the scales.
                let idx = _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16);
                _mm256_shuffle_epi8(_mm256_permute2x128_si256(sm[w], sm[w], 0), idx)
            } else {
                pair(&gs[w].0)
            };
            // Group minimums (Q2_K): times the activations' sums per 16.
            let mnv = if U::HAS_MIN && !U::K4_SCALES {
                pair(&gs[w].1)
            } else {
                _mm256_setzero_si256()
            };
            for r in 0..R {
                let sy = if signed { _mm256_sign_epi8(av[r], wv) } else { av[r] };
                let p16 = _mm256_maddubs_epi16(ax, sy);
                lanes[w][r] = if VNNI {
                    _mm256_dpwssd_epi32(lanes[w][r], p16, scv)
                } else {
                    _mm256_add_epi32(lanes[w][r], _mm256_madd_epi16(p16, scv))
                };
                if U::HAS_MIN && !U::K4_SCALES {
                    let s16 = _mm256_maddubs_epi16(ones, av[r]);
                    mins[w][r] = _mm256_add_epi32(mins[w][r], _mm256_madd_epi16(s16, mnv));
                }
            }
        }
    }
    if U::HAS_MIN && U::K4_SCALES {
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
        GgmlType::Q2K => k_tile::<Q2K, VNNI, W, R>(ty, rows, row_bytes, acts, out),
        GgmlType::Q3K => k_tile::<Q3K, VNNI, W, R>(ty, rows, row_bytes, acts, out),
        GgmlType::IQ4XS => k_tile::<IQ4XS, VNNI, W, R>(ty, rows, row_bytes, acts, out),
        GgmlType::IQ4NL => block_tile::<IQ4NL, VNNI, W, R>(ty, rows, row_bytes, acts, out),
        GgmlType::MXFP4 => block_tile::<MXFP4, VNNI, W, R>(ty, rows, row_bytes, acts, out),
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
