//! The panel kernels on AVX2 (no AVX-512): the same packed panels, the same
//! integers and float operations as the AVX-512 kernels, for CPUs that
//! have only 256-bit vectors (Zen 2 and 3, most laptop cores).
//!
//! A 256-bit vector holds eight of a panel's sixteen rows, so a panel is
//! walked as two halves. With two to four activation rows, for each
//! accumulator class, lanes 0..8 over the class's units, then lanes 8..16
//! over the same units (by then in L1 or L2): the sums and accumulators of
//! four rows fill the sixteen registers. With one row (decode) both halves
//! of a unit are done before the next, so every cache line is read whole
//! once (`dotbench`, weights from DRAM: 1.0-1.5x the speed of two passes).
//! Without `vpdpbusd`, a word of four byte products per lane is
//! `vpmaddubsw` (two 16-bit sums of two products) and the 16-bit sums of
//! several words are added before one `vpmaddwd` widens them to 32 bits
//! (multiplying by the group's integer scale where there is one). The
//! 16-bit sums never overflow: the kernel adds only as many as the
//! largest level allows (eight words of 4-bit levels, four of 5-bit, two
//! of 6-bit; 8-bit levels move their sign to the activation and widen each
//! word alone). Integer sums are exact in any order, so every lane's
//! `isum` is the reference's, and the float operations that follow are
//! the same as the AVX-512 kernel's, lane for lane.
//!
//! Q5_K's 5-bit levels take two 16-bit sums of four words per block;
//! Q2_K's and Q3_K's (at most 7, Q3_K's offset by 4 as in the AVX-512
//! kernel) a sum per 16-element group, widened times the group's scale.
//! The level-table types (IQ4_NL, IQ4_XS, MXFP4) are looked up as signed
//! levels and multiplied as Q8_0's are, with the sign moved to the
//! activation and each word widened alone, so they need no offset.
//!
//! K-quant blocks that share words are done together, so that each word is
//! loaded and split once: Q4_K's blocks 2j and 2j + 1 are the low and high
//! nibbles of the same words, and Q6_K's blocks k and k + 2 of a half
//! share their low-bits words (low and high nibbles) and high-bits words.
//! Loading each block's words apart, with the nibble picked per word, ran
//! at 0.35-0.5x the speed with one activation row (`dotbench`, weights in
//! L2).

use std::arch::x86_64::*;

use super::x86::{prefetch, prefetch_part, Out};
use super::{
    unit_bytes, IQ4XS_D, IQ4XS_QS, IQ4XS_SC, Q2K_D, Q2K_DMIN, Q2K_QS, Q2K_SC, Q3K_D, Q3K_HM, Q3K_QS, Q3K_SC, Q4K_D,
    Q4K_DMIN, Q4K_MINS, Q4K_QS, Q4K_SC, Q5K_QH, Q6K_D, Q6K_HALF, Q6K_SC,
};
use crate::dot::BlockQ8;
use crate::quant::GgmlType;

/// Rows of a 256-bit vector, and the most activation rows per kernel call
/// (with more, the sums and accumulators of a call no longer fit in the
/// sixteen registers: 8 rows ran at 0.5-0.9x the speed of 4 + 4 in
/// `dotbench`).
const LANES: usize = 8;
const MAX_ROWS: usize = 4;

/// The activation's 4 bytes at element `4t` of block `a`, in every lane.
#[inline(always)]
unsafe fn act4(a: &BlockQ8, t: usize) -> __m256i {
    _mm256_set1_epi32((a.qs.as_ptr().add(4 * t) as *const i32).read_unaligned())
}

#[inline(always)]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// Eight f16 values at `p` as f32.
#[inline(always)]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Eight bytes at `p`, each widened to a 32-bit lane and repeated in both
/// of its 16-bit halves (a `vpmaddwd` operand that scales a pair of 16-bit
/// sums by the lane's byte); `signed` bytes or unsigned.
#[inline(always)]
unsafe fn scale_pairs(p: *const u8, signed: bool) -> __m256i {
    let b = _mm_loadl_epi64(p as *const __m128i);
    let s = if signed {
        _mm256_cvtepi8_epi32(b)
    } else {
        _mm256_cvtepu8_epi32(b)
    };
    _mm256_or_si256(
        _mm256_and_si256(s, _mm256_set1_epi32(0xffff)),
        _mm256_slli_epi32::<16>(s),
    )
}

/// The canonical sum of a lane's eight accumulators (as in the AVX-512
/// kernel), for eight lanes and `R` activation rows.
struct Tree<const R: usize> {
    pending: [__m256; R],
    low: [__m256; R],
    high: [__m256; R],
}

impl<const R: usize> Tree<R> {
    #[inline(always)]
    unsafe fn new() -> Self {
        Tree {
            pending: [_mm256_setzero_ps(); R],
            low: [_mm256_setzero_ps(); R],
            high: [_mm256_setzero_ps(); R],
        }
    }

    /// Takes class `c`'s accumulators (classes in order 0..8).
    #[inline(always)]
    unsafe fn push(&mut self, c: usize, acc: &[__m256; R]) {
        for r in 0..R {
            match c {
                0 | 2 | 4 | 6 => self.pending[r] = acc[r],
                1 => self.low[r] = _mm256_add_ps(self.pending[r], acc[r]),
                3 => self.low[r] = _mm256_add_ps(self.low[r], _mm256_add_ps(self.pending[r], acc[r])),
                5 => self.high[r] = _mm256_add_ps(self.pending[r], acc[r]),
                _ => {
                    let h = _mm256_add_ps(self.high[r], _mm256_add_ps(self.pending[r], acc[r]));
                    self.low[r] = _mm256_add_ps(self.low[r], h);
                }
            }
        }
    }

    /// Stores half `h`'s sums (after class 7): row r's lanes 8h.. that
    /// `out.mask` selects, at `out.ptr + r * out.stride + 8h`.
    #[inline(always)]
    unsafe fn store(&self, out: Out, h: usize) {
        let bits = (out.mask >> (LANES * h)) as u8;
        if bits == 0 {
            return;
        }
        for r in 0..R {
            let dst = out.ptr.add(r * out.stride + LANES * h);
            if bits == u8::MAX {
                _mm256_storeu_ps(dst, self.low[r]);
            } else {
                let mut v = [0f32; LANES];
                _mm256_storeu_ps(v.as_mut_ptr(), self.low[r]);
                for (l, &x) in v.iter().enumerate() {
                    if bits >> l & 1 == 1 {
                        *dst.add(l) = x;
                    }
                }
            }
        }
    }
}

/// Per-32-block kinds.
const Q4: u8 = 0;
const Q5: u8 = 1;
const Q8: u8 = 2;
/// Nibbles looked up in a table of signed levels (IQ4_NL, MXFP4).
const NL: u8 = 3;

/// Eight E8M0 exponents at `p` as the f32 halves of their scales, as the
/// AVX-512 kernel's `e8m0x16`.
#[inline(always)]
unsafe fn e8m0x8(p: *const u8) -> __m256 {
    let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let small = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, is_small))
}

/// A type's 16 levels as signed bytes in both 128-bit lanes, for
/// `vpshufb`.
#[inline(always)]
unsafe fn signed_table(ty: GgmlType) -> __m256i {
    let levels = if ty == GgmlType::MXFP4 {
        &crate::quant::MXFP4_LEVELS
    } else {
        &crate::quant::IQ4_LEVELS
    };
    _mm256_broadcastsi128_si256(_mm_loadu_si128(levels.as_ptr() as *const __m128i))
}

/// One word of signed levels `w` against the activation bytes `x`, as
/// 32-bit sums per lane: the sign moves to the activation so that
/// `vpmaddubsw` takes the levels' magnitudes (at most 127, so a 16-bit
/// lane's two products cannot saturate), and each word is widened alone.
#[inline(always)]
unsafe fn signed_word(w: __m256i, x: __m256i) -> __m256i {
    let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
}

/// Units in accumulator class `c` of `n` units (units c, c + 8, ...).
#[inline(always)]
fn class_units(n: usize, c: usize) -> usize {
    n.saturating_sub(c).div_ceil(8)
}

/// The walk every kernel here takes over a panel of `n` units (blocks or
/// super-blocks) of `ub` bytes: accumulator class `c` takes units c,
/// c + 8, ... (stored class by class), each pass over a class's units does
/// `NH` of the panel's two halves, and `unit(q, u, h, first, acc)` adds
/// unit `u` (at `q`) of half `h` into each activation row's accumulators
/// (`first`: the unit's first visit, which prefetches ahead). The classes'
/// sums are folded as they finish and stored.
#[inline(always)]
unsafe fn walk<const R: usize, const NH: usize>(
    mut p: *const u8,
    n: usize,
    ub: usize,
    out: Out,
    mut unit: impl FnMut(*const u8, usize, usize, bool, &mut [__m256; R]),
) {
    let mut trees = [Tree::<R>::new(), Tree::<R>::new()];
    for c in 0..8 {
        let units = class_units(n, c);
        for pass in 0..2 / NH {
            let mut accs = [[_mm256_setzero_ps(); R]; NH];
            let mut q = p;
            for k in 0..units {
                for (hh, acc) in accs.iter_mut().enumerate() {
                    unit(q, c + 8 * k, pass * NH + hh, out.prefetch && pass == 0 && hh == 0, acc);
                }
                q = q.add(ub);
            }
            for (hh, acc) in accs.iter().enumerate() {
                trees[pass * NH + hh].push(c, acc);
            }
        }
        p = p.add(units * ub);
    }
    trees[0].store(out, 0);
    trees[1].store(out, 1);
}

/// Per-32-block types (see the AVX-512 kernel): accumulator class `c`
/// takes blocks c, c + 8, ...; `KIND`, `MIN` and `OFF` as there. Q8_0's
/// levels are made signed again (the panel stores them offset by 128) and
/// multiplied with the sign moved to the activation, so it runs without
/// `OFF`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dot_blocks<
    const KIND: u8,
    const MIN: bool,
    const OFF: bool,
    const E8: bool,
    const R: usize,
    const NH: usize,
>(
    p: *const u8,
    ub: usize,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    lut: __m256i,
    out: Out,
) {
    let m0f = _mm256_set1_epi8(0x0f);
    let m10 = _mm256_set1_epi8(0x10);
    let m80 = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    let d_at = match KIND {
        Q8 => 512,
        Q5 => 320,
        _ => 256,
    };
    walk::<R, NH>(p, n_blocks, ub, out, |q, b, h, first, acc| {
        prefetch(q, ub, first);
        let hb = 32 * h;
        let mut i = [zero; R];
        if KIND == NL {
            // Signed levels from the table: no offset to take
            // out (unlike the AVX-512 kernel's unsigned ones).
            for t in 0..4 {
                let v = load(q.add(t * 64 + hb));
                let lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m0f));
                let hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f));
                for r in 0..R {
                    let a = acts.get_unchecked(r).get_unchecked(b);
                    let x = _mm256_add_epi32(signed_word(lo, act4(a, t)), signed_word(hi, act4(a, t + 4)));
                    i[r] = _mm256_add_epi32(i[r], x);
                }
            }
        } else if KIND == Q8 {
            for t in 0..8 {
                let w = _mm256_xor_si256(load(q.add(t * 64 + hb)), m80);
                let aw = _mm256_sign_epi8(w, w);
                for r in 0..R {
                    let a = acts.get_unchecked(r).get_unchecked(b);
                    let p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(act4(a, t), w));
                    i[r] = _mm256_add_epi32(i[r], _mm256_madd_epi16(p16, ones));
                }
            }
        } else {
            // Q4: all eight words in one 16-bit sum; Q5: two sums of four.
            let mut s16 = [zero; R];
            for t in 0..4 {
                let v = load(q.add(t * 64 + hb));
                let mut lo = _mm256_and_si256(v, m0f);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f);
                if KIND == Q5 {
                    // As in the AVX-512 kernel: element 4t + j's bit at
                    // bit 2t of byte j, element 16 + 4t + j's at 2t + 1.
                    let hv = load(q.add(256 + hb));
                    let (bl, bh) = match t {
                        0 => (_mm256_slli_epi16::<4>(hv), _mm256_slli_epi16::<3>(hv)),
                        1 => (_mm256_slli_epi16::<2>(hv), _mm256_slli_epi16::<1>(hv)),
                        2 => (hv, _mm256_srli_epi16::<1>(hv)),
                        _ => (_mm256_srli_epi16::<2>(hv), _mm256_srli_epi16::<3>(hv)),
                    };
                    lo = _mm256_or_si256(lo, _mm256_and_si256(bl, m10));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(bh, m10));
                }
                for r in 0..R {
                    let a = acts.get_unchecked(r).get_unchecked(b);
                    let x = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, act4(a, t)),
                        _mm256_maddubs_epi16(hi, act4(a, t + 4)),
                    );
                    s16[r] = _mm256_add_epi16(s16[r], x);
                }
                if KIND == Q5 && t == 1 {
                    for r in 0..R {
                        i[r] = _mm256_madd_epi16(s16[r], ones);
                        s16[r] = zero;
                    }
                }
            }
            for r in 0..R {
                i[r] = _mm256_add_epi32(i[r], _mm256_madd_epi16(s16[r], ones));
            }
        }
        let dw = if E8 {
            e8m0x8(q.add(d_at + LANES * h))
        } else {
            f16x8(q.add(d_at + 2 * LANES * h))
        };
        let mw = if MIN {
            f16x8(q.add(d_at + 32 + 2 * LANES * h))
        } else {
            _mm256_setzero_ps()
        };
        for r in 0..R {
            let a = acts.get_unchecked(r).get_unchecked(b);
            let v = if OFF {
                _mm256_add_epi32(i[r], _mm256_set1_epi32(*aux.get_unchecked(r).get_unchecked(b)))
            } else {
                i[r]
            };
            let s = _mm256_mul_ps(dw, _mm256_set1_ps(a.d));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, acc[r]);
            if MIN {
                acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s), acc[r]);
            }
        }
    });
}

/// Every byte's bit `from` moved to bit `to` (other bits left for the
/// caller to mask), as the AVX-512 kernel's `move_bit`.
#[inline(always)]
unsafe fn move_bit(v: __m256i, from: usize, to: usize) -> __m256i {
    if from < to {
        _mm256_sll_epi16(v, _mm_cvtsi32_si128((to - from) as i32))
    } else {
        _mm256_srl_epi16(v, _mm_cvtsi32_si128((from - to) as i32))
    }
}

/// Q4_K, and Q5_K (`FIVE`: bit j of the `qh` byte is the high bit of
/// block j's element): accumulator class `c` takes super-blocks c, c + 8,
/// ...
#[inline(always)]
unsafe fn dot_q4k<const R: usize, const NH: usize, const FIVE: bool>(
    p: *const u8,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    out: Out,
) {
    let ub = unit_bytes(if FIVE { GgmlType::Q5K } else { GgmlType::Q4K });
    let n_sb = n_blocks / 8;
    let neg = _mm256_set1_epi32(i32::MIN);
    let m0f = _mm256_set1_epi8(0x0f);
    let m10 = _mm256_set1_epi8(0x10);
    let zero = _mm256_setzero_si256();
    walk::<R, NH>(p, n_sb, ub, out, |q, sb, h, first, acc| {
        let hb = 32 * h;
        let mut isum = [zero; R];
        for jp in 0..4 {
            prefetch_part(q, ub, jp, 4, first);
            // Blocks 2jp and 2jp + 1: the low and high nibbles of
            // words 8jp .. 8jp + 8, each word loaded once; at most
            // 8 * 2 * 15 * 127 in a 16-bit lane (Q5_K's 5-bit
            // levels: 4 * 2 * 31 * 127, so two sums of four).
            let (j0, j1) = (2 * jp, 2 * jp + 1);
            let s0 = scale_pairs(q.add(Q4K_SC + 16 * j0 + LANES * h), false);
            let s1 = scale_pairs(q.add(Q4K_SC + 16 * j1 + LANES * h), false);
            let mut lo16 = [zero; R];
            let mut hi16 = [zero; R];
            for t in 0..8 {
                let v = load(q.add(Q4K_QS + (jp * 8 + t) * 64 + hb));
                let mut lo = _mm256_and_si256(v, m0f);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f);
                if FIVE {
                    let hv = load(q.add(Q5K_QH + t * 64 + hb));
                    lo = _mm256_or_si256(lo, _mm256_and_si256(move_bit(hv, j0, 4), m10));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(move_bit(hv, j1, 4), m10));
                }
                for r in 0..R {
                    let a = acts.get_unchecked(r).as_ptr().add(sb * 8);
                    lo16[r] = _mm256_add_epi16(lo16[r], _mm256_maddubs_epi16(lo, act4(&*a.add(j0), t)));
                    hi16[r] = _mm256_add_epi16(hi16[r], _mm256_maddubs_epi16(hi, act4(&*a.add(j1), t)));
                }
                if t == 7 || (FIVE && t == 3) {
                    for r in 0..R {
                        let x = _mm256_add_epi32(_mm256_madd_epi16(lo16[r], s0), _mm256_madd_epi16(hi16[r], s1));
                        isum[r] = _mm256_add_epi32(isum[r], x);
                        lo16[r] = zero;
                        hi16[r] = zero;
                    }
                }
            }
        }
        let d = f16x8(q.add(Q4K_D + 2 * LANES * h));
        for r in 0..R {
            let da = _mm256_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, da), acc[r]);
        }
        let dmin = f16x8(q.add(Q4K_DMIN + 2 * LANES * h));
        let mut mv = [zero; 4];
        for k in 0..4 {
            mv[k] = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                q.add(Q4K_MINS + 32 * k + 2 * LANES * h) as *const __m128i
            ));
        }
        for r in 0..R {
            let x = aux.get_unchecked(r);
            let mut msum = zero;
            for k in 0..4 {
                let m = _mm256_madd_epi16(mv[k], _mm256_set1_epi32(*x.get_unchecked(sb * 4 + k)));
                msum = _mm256_add_epi32(msum, m);
            }
            let da = _mm256_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
            let cm = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_mul_ps(dmin, da)), neg));
            acc[r] = _mm256_fmadd_ps(cm, _mm256_cvtepi32_ps(msum), acc[r]);
        }
    });
}

/// Q6_K's blocks `4 half + KP` and `4 half + KP + 2` of super-block `sb`:
/// they share the low-bits words (low and high nibbles) and the high-bits
/// words (bits `2 KP` and `2 KP + 4`), so each word is loaded once for
/// both. Levels are offset by 32 (taken out by the caller).
#[inline(always)]
unsafe fn q6k_pair<const KP: usize, const R: usize>(
    q: *const u8,
    sb: usize,
    half: usize,
    h: usize,
    acts: &[&[BlockQ8]],
    isum: &mut [__m256i; R],
) {
    let m0f = _mm256_set1_epi8(0x0f);
    let m30 = _mm256_set1_epi8(0x30);
    let hb = 32 * h;
    let lq = q.add(Q6K_HALF + 1536 * half + KP * 1024 + hb);
    let hq = q.add(Q6K_HALF + 1536 * half + 512 + hb);
    let (ka, kb) = (KP, KP + 2);
    let (ba, bb) = (sb * 8 + 4 * half + ka, sb * 8 + 4 * half + kb);
    for sg in 0..2 {
        // Group sg of each block (elements 16 sg ..): its words 4 sg .. 4 sg + 4.
        let sa = scale_pairs(q.add(Q6K_SC + 16 * (2 * (4 * half + ka) + sg) + LANES * h), true);
        let sbv = scale_pairs(q.add(Q6K_SC + 16 * (2 * (4 * half + kb) + sg) + LANES * h), true);
        for tp in 0..2 {
            // Words in pairs: two 6-bit products' sums per 16-bit lane at
            // most 2 * 2 * 63 * 127.
            let mut wa = [_mm256_setzero_si256(); 2];
            let mut wb = [_mm256_setzero_si256(); 2];
            for u in 0..2 {
                let t = 4 * sg + 2 * tp + u;
                let l = load(lq.add(t * 64));
                let hv = load(hq.add(t * 64));
                let (ha, hbits) = if KP == 0 {
                    (_mm256_slli_epi16::<4>(hv), hv)
                } else {
                    (_mm256_slli_epi16::<2>(hv), _mm256_srli_epi16::<2>(hv))
                };
                wa[u] = _mm256_or_si256(_mm256_and_si256(l, m0f), _mm256_and_si256(ha, m30));
                wb[u] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l), m0f),
                    _mm256_and_si256(hbits, m30),
                );
            }
            let t = 4 * sg + 2 * tp;
            for r in 0..R {
                let a = acts.get_unchecked(r);
                let (a0, a1) = (a.get_unchecked(ba), a.get_unchecked(bb));
                let xa = _mm256_add_epi16(
                    _mm256_maddubs_epi16(wa[0], act4(a0, t)),
                    _mm256_maddubs_epi16(wa[1], act4(a0, t + 1)),
                );
                let xb = _mm256_add_epi16(
                    _mm256_maddubs_epi16(wb[0], act4(a1, t)),
                    _mm256_maddubs_epi16(wb[1], act4(a1, t + 1)),
                );
                let x = _mm256_add_epi32(_mm256_madd_epi16(xa, sa), _mm256_madd_epi16(xb, sbv));
                isum[r] = _mm256_add_epi32(isum[r], x);
            }
        }
    }
}

/// Q6_K: accumulator class `c` takes super-blocks c, c + 8, ... Levels
/// are stored offset by 32; the offset is taken out once per super-block,
/// `-32 * sum over groups g of scale_g * sum(a_g)`, from the activations'
/// 16-element sums (which `aux` holds in pairs after the AVX-512 kernel's
/// starting values).
#[inline(always)]
unsafe fn dot_q6k<const R: usize, const NH: usize>(
    p: *const u8,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    out: Out,
) {
    let ub = unit_bytes(GgmlType::Q6K);
    let n_sb = n_blocks / 8;
    let zero = _mm256_setzero_si256();
    walk::<R, NH>(p, n_sb, ub, out, |q, sb, h, first, acc| {
        let mut isum = [zero; R];
        for half in 0..2 {
            prefetch_part(q, ub, 2 * half, 4, first);
            q6k_pair::<0, R>(q, sb, half, h, acts, &mut isum);
            prefetch_part(q, ub, 2 * half + 1, 4, first);
            q6k_pair::<1, R>(q, sb, half, h, acts, &mut isum);
        }
        // The offset: per block j, its two groups' scales beside
        // each other in every lane, against the row's two sums.
        let mut sp = [zero; 8];
        for j in 0..8 {
            let lo = _mm_loadl_epi64(q.add(Q6K_SC + 16 * (2 * j) + LANES * h) as *const __m128i);
            let hi = _mm_loadl_epi64(q.add(Q6K_SC + 16 * (2 * j + 1) + LANES * h) as *const __m128i);
            sp[j] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi));
        }
        let d = f16x8(q.add(Q6K_D + 2 * LANES * h));
        for r in 0..R {
            // The row's 16-element sums in pairs, after the starts.
            let x = aux.get_unchecked(r).as_ptr().add(2 * n_blocks + sb * 8);
            let mut corr = zero;
            for j in 0..8 {
                let pair = _mm256_set1_epi32(*x.add(j));
                corr = _mm256_add_epi32(corr, _mm256_madd_epi16(sp[j], pair));
            }
            let v = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<5>(corr));
            let da = _mm256_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(d, da), acc[r]);
        }
    });
}

/// IQ4_XS: accumulator class `c` takes super-blocks c, c + 8, ... Block
/// j's nibbles are looked up as signed levels (see [`signed_word`]) and
/// its integer sum times its signed 6-bit scale (less 32).
#[inline(always)]
unsafe fn dot_iq4xs<const R: usize, const NH: usize>(p: *const u8, n_blocks: usize, acts: &[&[BlockQ8]], out: Out) {
    let ub = unit_bytes(GgmlType::IQ4XS);
    let n_sb = n_blocks / 8;
    let m0f = _mm256_set1_epi8(0x0f);
    let lut = signed_table(GgmlType::IQ4XS);
    let zero = _mm256_setzero_si256();
    walk::<R, NH>(p, n_sb, ub, out, |q, sb, h, first, acc| {
        let hb = 32 * h;
        let mut isum = [zero; R];
        for j in 0..8 {
            prefetch_part(q, ub, j, 8, first);
            let mut i = [zero; R];
            for t in 0..4 {
                let v = load(q.add(IQ4XS_QS + 256 * j + t * 64 + hb));
                let lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m0f));
                let hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f));
                for r in 0..R {
                    let a = acts.get_unchecked(r).get_unchecked(sb * 8 + j);
                    let x = _mm256_add_epi32(signed_word(lo, act4(a, t)), signed_word(hi, act4(a, t + 4)));
                    i[r] = _mm256_add_epi32(i[r], x);
                }
            }
            let s = _mm256_cvtepi8_epi32(_mm_loadl_epi64(q.add(IQ4XS_SC + 16 * j + LANES * h) as *const __m128i));
            for r in 0..R {
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(i[r], s));
            }
        }
        let d = f16x8(q.add(IQ4XS_D + 2 * LANES * h));
        for r in 0..R {
            let da = _mm256_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, da), acc[r]);
        }
    });
}

/// Q3_K (`THREE`) and Q2_K: accumulator class `c` takes super-blocks c,
/// c + 8, ... Block j's levels are bits 2 (j % 4) of `qs` words
/// 8 (j / 4).., Q3_K's with bit j of the `hmask` bytes as 4 (levels
/// offset by 4, taken out with `aux`'s starting values, as in the AVX-512
/// kernel); each 16-element group's 16-bit sum (at most 4 * 2 * 7 * 127)
/// is widened times its scale. Q2_K's minimums meet the activations'
/// 16-element sums, which `aux` holds in pairs.
#[inline(always)]
unsafe fn dot_k23<const R: usize, const NH: usize, const THREE: bool>(
    p: *const u8,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    out: Out,
) {
    let ty = if THREE { GgmlType::Q3K } else { GgmlType::Q2K };
    let ub = unit_bytes(ty);
    let n_sb = n_blocks / 8;
    let m03 = _mm256_set1_epi8(0x03);
    let m04 = _mm256_set1_epi8(0x04);
    let neg = _mm256_set1_epi32(i32::MIN);
    let zero = _mm256_setzero_si256();
    let qs_at = if THREE { Q3K_QS } else { Q2K_QS };
    walk::<R, NH>(p, n_sb, ub, out, |q, sb, h, first, acc| {
        let hb = 32 * h;
        let mut isum = [zero; R];
        let mut msum = [zero; R];
        for j in 0..8 {
            prefetch_part(q, ub, j, 8, first);
            let (half, k) = (j / 4, j % 4);
            let blk = sb * 8 + j;
            // Each group's scale (Q2_K: and minimum) per lane.
            let (sc, mins) = if THREE {
                let sc = [
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        q.add(Q3K_SC + 16 * (2 * j) + LANES * h) as *const __m128i
                    )),
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        q.add(Q3K_SC + 16 * (2 * j + 1) + LANES * h) as *const __m128i
                    )),
                ];
                (sc, zero)
            } else {
                let raw =
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(q.add(Q2K_SC + 32 * j + 2 * LANES * h) as *const __m128i));
                let m0f = _mm256_set1_epi32(0x0f);
                let sc = [
                    _mm256_and_si256(raw, m0f),
                    _mm256_and_si256(_mm256_srli_epi32::<16>(raw), m0f),
                ];
                (
                    sc,
                    _mm256_and_si256(_mm256_srli_epi16::<4>(raw), _mm256_set1_epi16(0x0f)),
                )
            };
            let mut s16 = [[zero; R]; 2];
            for t in 0..8 {
                let l = load(q.add(qs_at + (8 * half + t) * 64 + hb));
                let mut w = _mm256_and_si256(_mm256_srl_epi16(l, _mm_cvtsi32_si128(2 * k as i32)), m03);
                if THREE {
                    let hm = load(q.add(Q3K_HM + t * 64 + hb));
                    w = _mm256_or_si256(w, _mm256_and_si256(move_bit(hm, j, 2), m04));
                }
                for r in 0..R {
                    let a = acts.get_unchecked(r).get_unchecked(blk);
                    s16[t / 4][r] = _mm256_add_epi16(s16[t / 4][r], _mm256_maddubs_epi16(w, act4(a, t)));
                }
            }
            for r in 0..R {
                let x = aux.get_unchecked(r);
                let ones = _mm256_set1_epi16(1);
                for g in 0..2 {
                    let mut i = _mm256_madd_epi16(s16[g][r], ones);
                    if THREE {
                        i = _mm256_add_epi32(i, _mm256_set1_epi32(*x.get_unchecked(2 * blk + g)));
                    }
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(i, sc[g]));
                }
                if !THREE {
                    let pair = _mm256_set1_epi32(*x.get_unchecked(2 * n_blocks + blk));
                    msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(mins, pair));
                }
            }
        }
        let d = f16x8(q.add(if THREE { Q3K_D } else { Q2K_D } + 2 * LANES * h));
        for r in 0..R {
            let da = _mm256_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, da), acc[r]);
        }
        if !THREE {
            let dmin = f16x8(q.add(Q2K_DMIN + 2 * LANES * h));
            for r in 0..R {
                let da = _mm256_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
                let cm = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_mul_ps(dmin, da)), neg));
                acc[r] = _mm256_fmadd_ps(cm, _mm256_cvtepi32_ps(msum[r]), acc[r]);
            }
        }
    });
}

#[inline(always)]
unsafe fn dot_r<const R: usize, const NH: usize>(
    p: *const u8,
    ty: GgmlType,
    n_blocks: usize,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    out: Out,
) {
    let ub = unit_bytes(ty);
    let z = _mm256_setzero_si256();
    match ty {
        GgmlType::Q4_0 => dot_blocks::<Q4, false, true, false, R, NH>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::Q4_1 => dot_blocks::<Q4, true, false, false, R, NH>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::Q5_0 => dot_blocks::<Q5, false, true, false, R, NH>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::Q5_1 => dot_blocks::<Q5, true, false, false, R, NH>(p, ub, n_blocks, acts, aux, z, out),
        // Signed levels here: no offset to take out.
        GgmlType::Q8_0 => dot_blocks::<Q8, false, false, false, R, NH>(p, ub, n_blocks, acts, aux, z, out),
        GgmlType::IQ4NL => {
            dot_blocks::<NL, false, false, false, R, NH>(p, ub, n_blocks, acts, aux, signed_table(ty), out)
        }
        GgmlType::MXFP4 => {
            dot_blocks::<NL, false, false, true, R, NH>(p, ub, n_blocks, acts, aux, signed_table(ty), out)
        }
        GgmlType::Q4K => dot_q4k::<R, NH, false>(p, n_blocks, acts, aux, out),
        GgmlType::Q5K => dot_q4k::<R, NH, true>(p, n_blocks, acts, aux, out),
        GgmlType::Q6K => dot_q6k::<R, NH>(p, n_blocks, acts, aux, out),
        GgmlType::IQ4XS => dot_iq4xs::<R, NH>(p, n_blocks, acts, out),
        GgmlType::Q3K => dot_k23::<R, NH, true>(p, n_blocks, acts, aux, out),
        GgmlType::Q2K => dot_k23::<R, NH, false>(p, n_blocks, acts, aux, out),
        _ => unreachable!(),
    }
}

/// Activation rows against one panel at `p`, at most [`MAX_ROWS`] per
/// pass over it. `NH` in the kernels: halves done per pass over a class's
/// units (2 for one row, 1 otherwise).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot(p: *const u8, ty: GgmlType, n_blocks: usize, acts: &[&[BlockQ8]], aux: &[&[i32]], out: Out) {
    let mut r0 = 0;
    let n = acts.len();
    while r0 < n {
        // Even parts: 5 rows as 3 + 2, 8 as 4 + 4.
        let parts = (n - r0).div_ceil(MAX_ROWS);
        let m = (n - r0).div_ceil(parts);
        let o = Out {
            ptr: out.ptr.add(r0 * out.stride),
            prefetch: out.prefetch && r0 == 0,
            ..out
        };
        let (a, x) = (&acts[r0..r0 + m], &aux[r0..r0 + m]);
        match m {
            1 => dot_r::<1, 2>(p, ty, n_blocks, a, x, o),
            2 => dot_r::<2, 1>(p, ty, n_blocks, a, x, o),
            3 => dot_r::<3, 1>(p, ty, n_blocks, a, x, o),
            _ => dot_r::<4, 1>(p, ty, n_blocks, a, x, o),
        }
        r0 += m;
    }
}
