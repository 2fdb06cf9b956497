//! Small vector primitives used by attention and normalization, each with a
//! scalar reference and an AVX2 path that computes the same bits (fused
//! multiply-adds per element, sums in fixed lanes).

use half::f16;

use crate::cpu::{simd, Simd};

/// `y[i] = fma(a, x[i], y[i])`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len());
    match simd() {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx512Vnni => unsafe { x86::axpy(y, a, x) },
        _ => axpy_scalar(y, a, x),
    }
}

pub fn axpy_scalar(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o = a.mul_add(*v, *o);
    }
}

/// Sum of squares: element i goes to lane i % 8 (fused), then the lanes are
/// summed as ((0+1)+(2+3))+((4+5)+(6+7)).
pub fn sum_squares(x: &[f32]) -> f32 {
    match simd() {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx512Vnni => unsafe { x86::sum_squares(x) },
        _ => sum_squares_scalar(x),
    }
}

fn reduce8(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

pub fn sum_squares_scalar(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for (i, v) in x.iter().enumerate() {
        lanes[i % 8] = v.mul_add(*v, lanes[i % 8]);
    }
    reduce8(lanes)
}

/// Converts f16 bits to f32 (exact).
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    match simd() {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx512Vnni => unsafe { x86::f16_to_f32(src, dst) },
        _ => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = f16::from_bits(*s).to_f32();
            }
        }
    }
}

/// Converts f32 to f16 bits, rounding to nearest even.
pub fn f32_to_f16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    match simd() {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx512Vnni => unsafe { x86::f32_to_f16(src, dst) },
        _ => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = f16::from_f32(*s).to_bits();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len() / 8 * 8;
        let av = _mm256_set1_ps(a);
        for i in (0..n).step_by(8) {
            let yp = y.as_mut_ptr().add(i);
            let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(yp));
            _mm256_storeu_ps(yp, r);
        }
        for i in n..y.len() {
            y[i] = a.mul_add(x[i], y[i]);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sum_squares(x: &[f32]) -> f32 {
        let n = x.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        for i in (0..n).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        for (i, v) in x[n..].iter().enumerate() {
            lanes[i] = v.mul_add(*v, lanes[i]);
        }
        super::reduce8(lanes)
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        for i in n..src.len() {
            dst[i] = f16::from_bits(src[i]).to_f32();
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f32_to_f16(src: &[f32], dst: &mut [u16]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
        for i in n..src.len() {
            dst[i] = f16::from_f32(src[i]).to_bits();
        }
    }
}

/// A vector of `n` copies of `value` whose memory is written now, so it is
/// resident from the start. Engine buffers (KV pages, scratch) use it: the
/// memory ledger counts what they reserve, and reserved memory must really
/// be held, not left to fault in later (a zeroed allocation from the system
/// is mapped lazily and would only count once touched).
pub fn committed<T: Copy>(value: T, n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(value);
    }
    // Keep the writes even where `value` is all zeros and the allocator
    // handed out fresh zero pages.
    std::hint::black_box(v.as_mut_ptr());
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_paths_match_scalar_bitwise() {
        let x: Vec<f32> = (0..203).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let mut y1: Vec<f32> = (0..203).map(|i| i as f32 * 0.01).collect();
        let mut y2 = y1.clone();
        axpy(&mut y1, 0.37, &x);
        axpy_scalar(&mut y2, 0.37, &x);
        assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(sum_squares(&x).to_bits(), sum_squares_scalar(&x).to_bits());
        let mut h = vec![0u16; 203];
        f32_to_f16(&x, &mut h);
        let mut back = vec![0f32; 203];
        f16_to_f32(&h, &mut back);
        for (i, v) in x.iter().enumerate() {
            assert_eq!(h[i], f16::from_f32(*v).to_bits());
            assert_eq!(back[i], f16::from_bits(h[i]).to_f32());
        }
    }
}
