//! The AVX2 and AVX-512 lanes, and the kernel's entries compiled for
//! each level.

use std::arch::x86_64::*;

use super::{Call, Lanes, Part};
use crate::ops::x86::exp8;
use crate::ops::x86_512::exp16;

/// Eight sums of pairs of 8-lane halves (`lo[g] + hi[g]` already
/// added), each folded as `((0+1)+(2+3))+((4+5)+(6+7))`: pairs of
/// registers go through `hadd` together, so the sums share their
/// shuffles.
#[inline(always)]
unsafe fn fold8(y: &[__m256; 8]) -> [f32; 8] {
    let h01 = _mm256_hadd_ps(y[0], y[1]);
    let h23 = _mm256_hadd_ps(y[2], y[3]);
    let h45 = _mm256_hadd_ps(y[4], y[5]);
    let h67 = _mm256_hadd_ps(y[6], y[7]);
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    let lo = _mm256_permute2f128_ps::<0x20>(h0123, h4567);
    let hi = _mm256_permute2f128_ps::<0x31>(h0123, h4567);
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(lo, hi));
    out
}

/// [`crate::ops::fold16`] of up to eight 16-lane registers at once.
#[inline(always)]
pub(in crate::kv) unsafe fn hsums<const G: usize>(a: &[__m512; G]) -> [f32; 8] {
    let mut y = [_mm256_setzero_ps(); 8];
    for g in 0..G {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a[g])));
        y[g] = _mm256_add_ps(_mm512_castps512_ps256(a[g]), hi);
    }
    fold8(&y)
}

/// Lanes `0..8` and `8..16` in two AVX2 registers.
#[derive(Clone, Copy)]
pub(in crate::kv) struct Avx2(__m256, __m256);

/// Which of the 8 lanes of a half are below `k`.
#[inline(always)]
unsafe fn below(k: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(k as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// The levels of 8 nibbles (one per 32-bit lane): two 8-entry
/// look-ups, the nibble's bit 3 choosing between them.
#[inline(always)]
unsafe fn look8(i: __m256i, book: (__m256, __m256)) -> __m256 {
    let lo = _mm256_permutevar8x32_ps(book.0, i);
    let hi = _mm256_permutevar8x32_ps(book.1, i);
    _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(i)))
}

impl Lanes for Avx2 {
    type Book = (__m256, __m256);

    #[inline(always)]
    unsafe fn book(levels: &[f32; 16]) -> Self::Book {
        (
            _mm256_loadu_ps(levels.as_ptr()),
            _mm256_loadu_ps(levels.as_ptr().add(8)),
        )
    }
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx2(_mm256_setzero_ps(), _mm256_setzero_ps())
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Avx2(_mm256_set1_ps(x), _mm256_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Avx2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
    #[inline(always)]
    unsafe fn load_first(p: *const f32, k: usize) -> Self {
        Avx2(
            _mm256_maskload_ps(p, below(k)),
            _mm256_maskload_ps(p.add(8), below(k.saturating_sub(8))),
        )
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self.0);
        _mm256_storeu_ps(p.add(8), self.1);
    }
    #[inline(always)]
    unsafe fn store_first(self, p: *mut f32, k: usize) {
        _mm256_maskstore_ps(p, below(k), self.0);
        _mm256_maskstore_ps(p.add(8), below(k.saturating_sub(8)), self.1);
    }
    #[inline(always)]
    unsafe fn first(self, k: usize) -> Self {
        Avx2(
            _mm256_and_ps(self.0, _mm256_castsi256_ps(below(k))),
            _mm256_and_ps(self.1, _mm256_castsi256_ps(below(k.saturating_sub(8)))),
        )
    }
    #[inline(always)]
    unsafe fn f16(p: *const u16) -> Self {
        Avx2(
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(8) as *const __m128i)),
        )
    }
    #[inline(always)]
    unsafe fn q8(p: *const i8) -> Self {
        let x = _mm_loadu_si128(p as *const __m128i);
        Avx2(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(x, x))),
        )
    }
    #[inline(always)]
    unsafe fn tq4<const HIGH: bool>(p: *const u8, book: Self::Book) -> Self {
        let idx = |q: *const u8| {
            let i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q as *const __m128i));
            if HIGH {
                _mm256_srli_epi32::<4>(i)
            } else {
                i
            }
        };
        Avx2(look8(idx(p), book), look8(idx(p.add(8)), book))
    }
    #[inline(always)]
    unsafe fn tq4_8(p: *const u8, book: Self::Book) -> Self {
        let x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        Avx2(look8(x, book), look8(_mm256_srli_epi32::<4>(x), book))
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Avx2(_mm256_max_ps(a.0, b.0), _mm256_max_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn fill_after(self, k: usize, v: f32) -> Self {
        let fill = _mm256_set1_ps(v);
        Avx2(
            _mm256_blendv_ps(fill, self.0, _mm256_castsi256_ps(below(k))),
            _mm256_blendv_ps(fill, self.1, _mm256_castsi256_ps(below(k.saturating_sub(8)))),
        )
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Avx2(_mm256_fmadd_ps(a.0, b.0, c.0), _mm256_fmadd_ps(a.1, b.1, c.1))
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Avx2(_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx2(_mm256_add_ps(a.0, b.0), _mm256_add_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx2(_mm256_sub_ps(a.0, b.0), _mm256_sub_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        Avx2(exp8(self.0), exp8(self.1))
    }
    #[inline(always)]
    unsafe fn folds(a: &[Self; 8]) -> [f32; 8] {
        let mut y = [_mm256_setzero_ps(); 8];
        for g in 0..8 {
            y[g] = _mm256_add_ps(a[g].0, a[g].1);
        }
        fold8(&y)
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    }
    #[inline(always)]
    unsafe fn run<const G: usize, const P: usize, const BLOCK: bool, K: Part, V: Part>(c: &mut Call, kp: K, vp: V) {
        run_avx2::<G, P, BLOCK, K, V>(c, kp, vp)
    }
}

/// All 16 lanes in one AVX-512 register.
#[derive(Clone, Copy)]
pub(in crate::kv) struct Avx512(__m512);

#[inline(always)]
fn mask(k: usize) -> __mmask16 {
    if k >= 16 {
        0xffff
    } else {
        ((1u32 << k) - 1) as __mmask16
    }
}

impl Lanes for Avx512 {
    type Book = __m512;

    #[inline(always)]
    unsafe fn book(levels: &[f32; 16]) -> __m512 {
        _mm512_loadu_ps(levels.as_ptr())
    }
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx512(_mm512_setzero_ps())
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Avx512(_mm512_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Avx512(_mm512_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn load_first(p: *const f32, k: usize) -> Self {
        Avx512(_mm512_maskz_loadu_ps(mask(k), p))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self.0);
    }
    #[inline(always)]
    unsafe fn store_first(self, p: *mut f32, k: usize) {
        _mm512_mask_storeu_ps(p, mask(k), self.0);
    }
    #[inline(always)]
    unsafe fn first(self, k: usize) -> Self {
        Avx512(_mm512_maskz_mov_ps(mask(k), self.0))
    }
    #[inline(always)]
    unsafe fn f16(p: *const u16) -> Self {
        Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)))
    }
    #[inline(always)]
    unsafe fn q8(p: *const i8) -> Self {
        Avx512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            p as *const __m128i,
        ))))
    }
    #[inline(always)]
    unsafe fn tq4<const HIGH: bool>(p: *const u8, book: __m512) -> Self {
        // The look-up reads the low 4 bits of each index only.
        let i = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        let i = if HIGH { _mm512_srli_epi32::<4>(i) } else { i };
        Avx512(_mm512_permutexvar_ps(i, book))
    }
    #[inline(always)]
    unsafe fn tq4_8(p: *const u8, book: __m512) -> Self {
        let x = _mm_loadl_epi64(p as *const __m128i);
        let m = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(x, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), m);
        Avx512(_mm512_permutexvar_ps(
            _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)),
            book,
        ))
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Avx512(_mm512_max_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn fill_after(self, k: usize, v: f32) -> Self {
        Avx512(_mm512_mask_mov_ps(_mm512_set1_ps(v), mask(k), self.0))
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Avx512(_mm512_fmadd_ps(a.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Avx512(_mm512_mul_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx512(_mm512_add_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx512(_mm512_sub_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        Avx512(exp16(self.0))
    }
    #[inline(always)]
    unsafe fn folds(a: &[Self; 8]) -> [f32; 8] {
        let mut r = [_mm512_setzero_ps(); 8];
        for g in 0..8 {
            r[g] = a[g].0;
        }
        hsums(&r)
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    }
    #[inline(always)]
    unsafe fn run<const G: usize, const P: usize, const BLOCK: bool, K: Part, V: Part>(c: &mut Call, kp: K, vp: V) {
        run_avx512::<G, P, BLOCK, K, V>(c, kp, vp)
    }
}

/// [`super::body`] at AVX2, a function of its own.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline(never)]
unsafe fn run_avx2<const G: usize, const P: usize, const BLOCK: bool, K: Part, V: Part>(c: &mut Call, kp: K, vp: V) {
    super::body::<Avx2, G, P, BLOCK, K, V>(c, kp, vp)
}

/// [`super::body`] at AVX-512, a function of its own.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline(never)]
unsafe fn run_avx512<const G: usize, const P: usize, const BLOCK: bool, K: Part, V: Part>(c: &mut Call, kp: K, vp: V) {
    super::body::<Avx512, G, P, BLOCK, K, V>(c, kp, vp)
}
