//! Row-wise operations of a transformer: normalization, rotary position
//! embedding, activations, softmax. Each works on one row at a time in a
//! fixed order, so results never depend on the batch around the row.

/// RMS normalization of each `dim`-wide row of `x` in place, times `w`
/// (`w` already holds any "+1" the architecture uses).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for row in x.chunks_exact_mut(dim) {
        let ss = crate::vec::sum_squares(row);
        let scale = 1.0 / (ss / dim as f32 + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// RMS normalization of `x` into `out` (rows of `w.len()`).
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm(out, w, eps);
}

/// How rotary embedding pairs the elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent elements (2i, 2i+1): llama as converted to GGUF.
    Adjacent,
    /// Halves (i, i + d/2): GPT-NeoX style, used by Qwen2 and Gemma.
    Halves,
}

/// Precomputed inverse frequencies for one rotary configuration.
#[derive(Clone, Debug)]
pub struct Rope {
    pub layout: RopeLayout,
    /// Pair i's angle per position: `freq_scale * (theta^(-2i / rot_dim) /
    /// factors[i])`.
    inv_freq: Vec<f32>,
    /// `theta^(-2 / rot_dim)`: the ratio of consecutive pairs' angles, as
    /// ggml steps the angle (see [`Rope::apply_ggml`]).
    theta_scale: f32,
    /// Every angle's multiplier (`1 / factor` under linear scaling).
    freq_scale: f32,
    /// Pair i's angle divisor (Llama 3.1's `rope_freqs`; 1 without).
    factors: Vec<f32>,
}

impl Rope {
    /// Rotary embedding over the first `rot_dim` elements of each head with
    /// base `theta`.
    pub fn new(layout: RopeLayout, rot_dim: usize, theta: f32) -> Rope {
        let inv_freq = (0..rot_dim / 2)
            .map(|i| theta.powf(-(2.0 * i as f32) / rot_dim as f32))
            .collect();
        let theta_scale = theta.powf(-2.0 / rot_dim as f32);
        Rope {
            layout,
            inv_freq,
            theta_scale,
            freq_scale: 1.0,
            factors: vec![1.0; rot_dim / 2],
        }
    }

    /// This rotation with every angle multiplied by `freq_scale` (linear
    /// scaling: `1 / factor`) and pair i's divided by `factors[i]` (Llama
    /// 3.1's frequency factors, the `rope_freqs` tensor), as llama.cpp
    /// applies them: `freq_scale * (angle / factor)`. With a scale of 1 and
    /// factors of 1, every angle is the unscaled one, bit for bit.
    pub fn scaled(mut self, freq_scale: f32, factors: Option<&[f32]>) -> Rope {
        if let Some(f) = factors {
            for (d, &x) in self.factors.iter_mut().zip(f) {
                *d = x;
            }
        }
        self.freq_scale = freq_scale;
        for (inv, &f) in self.inv_freq.iter_mut().zip(&self.factors) {
            *inv = freq_scale * (*inv / f);
        }
        self
    }

    /// The rotated pairs of a head of `d` elements: (first index, second
    /// index, inverse frequency), in the order [`Rope::apply`] visits them.
    pub fn pairs(&self, d: usize) -> Vec<(usize, usize, f32)> {
        self.inv_freq
            .iter()
            .enumerate()
            .map(|(i, &f)| {
                let (a, b) = self.pair(i, d);
                (a, b, f)
            })
            .collect()
    }

    /// The elements of pair `i` in a head of `d`.
    #[inline(always)]
    fn pair(&self, i: usize, d: usize) -> (usize, usize) {
        match self.layout {
            RopeLayout::Adjacent => (2 * i, 2 * i + 1),
            RopeLayout::Halves => (i, i + d / 2),
        }
    }

    /// The number of rotated pairs (half the rotated dimensions).
    pub fn pair_count(&self) -> usize {
        self.inv_freq.len()
    }

    /// Each pair's (sine, cosine) at `pos`, as [`Rope::apply`] computes
    /// them; [`Rope::rotate`] with them gives [`Rope::apply`]'s bits, so a
    /// row's heads (and layers) can share one computation.
    pub fn angles(&self, pos: usize, sc: &mut [(f32, f32)]) {
        for (sc, f) in sc.iter_mut().zip(&self.inv_freq) {
            *sc = (pos as f32 * f).sin_cos();
        }
    }

    /// [`Rope::angles`] as [`Rope::apply_ggml`] computes them.
    pub fn angles_ggml(&self, pos: usize, sc: &mut [(f32, f32)]) {
        let mut angle = pos as f32;
        for (i, sc) in sc.iter_mut().enumerate().take(self.inv_freq.len()) {
            let theta = self.freq_scale * (angle / self.factors[i]);
            *sc = (theta.sin(), theta.cos());
            angle *= self.theta_scale;
        }
    }

    /// Rotates one head by its pairs' (sine, cosine) from [`Rope::angles`]:
    /// [`Rope::apply`]'s arithmetic.
    pub fn rotate(&self, head: &mut [f32], sc: &[(f32, f32)]) {
        let d = head.len();
        for (i, &(sin, cos)) in sc.iter().enumerate() {
            let (a, b) = self.pair(i, d);
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos - x1 * sin;
            head[b] = x0 * sin + x1 * cos;
        }
    }

    /// [`Rope::rotate`] with [`Rope::apply_ggml`]'s arithmetic (its
    /// fused multiply-adds), by angles from [`Rope::angles_ggml`].
    pub fn rotate_ggml(&self, head: &mut [f32], sc: &[(f32, f32)]) {
        let d = head.len();
        for (i, &(sin, cos)) in sc.iter().enumerate() {
            let (a, b) = self.pair(i, d);
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0.mul_add(cos, -(x1 * sin));
            head[b] = x0.mul_add(sin, x1 * cos);
        }
    }

    /// Rotates one head vector (`head.len()` = head dim) for position `pos`.
    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let d = head.len();
        for (i, f) in self.inv_freq.iter().enumerate() {
            let angle = pos as f32 * f;
            let (sin, cos) = angle.sin_cos();
            let (a, b) = self.pair(i, d);
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos - x1 * sin;
            head[b] = x0 * sin + x1 * cos;
        }
    }

    /// [`Rope::apply`] as llama.cpp's CPU backend computes it: the angle
    /// starts at `pos` and is multiplied by `theta^(-2 / rot_dim)` from one
    /// pair to the next (in f32, so its rounding accumulates), and each
    /// pair is rotated with the fused multiply-adds its compiler forms.
    pub fn apply_ggml(&self, head: &mut [f32], pos: usize) {
        let d = head.len();
        let mut angle = pos as f32;
        for i in 0..self.inv_freq.len() {
            let theta = self.freq_scale * (angle / self.factors[i]);
            let (sin, cos) = (theta.sin(), theta.cos());
            let (a, b) = self.pair(i, d);
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0.mul_add(cos, -(x1 * sin));
            head[b] = x0.mul_add(sin, x1 * cos);
            angle *= self.theta_scale;
        }
    }
}

/// `e^x` by a fixed sequence of operations (range reduction by `ln 2` in
/// two parts, a degree-7 Taylor polynomial on `|r| <= ln 2 / 2`, scaling by
/// `2^n` through the exponent bits), so that the scalar code here and the
/// vector code in [`x86`] give the same bits. Inputs are clamped to
/// `[-87, 88]` (results stay normal and finite). Relative error below
/// 2e-7, like the C library's `expf` to within a few units in the last
/// place.
#[inline(always)]
#[allow(clippy::manual_clamp)] // `clamp` keeps NaN; `max`/`min` map it to a bound, as the vector code does
pub fn exp_fixed(x: f32) -> f32 {
    let x = x.max(EXP_LO).min(EXP_HI);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_C[7];
    for c in EXP_C[..7].iter().rev() {
        p = p.mul_add(r, *c);
    }
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

pub(crate) const EXP_LO: f32 = -87.0;
pub(crate) const EXP_HI: f32 = 88.0;
/// `ln 2` split so that `n * LN2_HI` is exact for the `n` that occur.
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// `1 / k!` for k = 0..=7.
pub(crate) const EXP_C: [f32; 8] = [
    1.0,
    1.0,
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5040.0,
];

/// The canonical sum of 16 lanes, folded as a dot product folds its
/// lanes: lane `k` plus lane `k + 8`, then `((0+1)+(2+3))+((4+5)+(6+7))`.
#[inline(always)]
pub(crate) fn fold16(l: &[f32; 16]) -> f32 {
    let s: [f32; 8] = std::array::from_fn(|k| l[k] + l[k + 8]);
    ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))
}

/// Softmax of one head's attention scores in place, by fixed operations:
/// the maximum, `exp_fixed(x - max)` of every score, the exponentials
/// summed in 16 lanes (score `i` into lane `i % 16`, each lane in order)
/// and folded by [`fold16`], then every exponential times the sum's
/// reciprocal. The order depends on the length alone; the vector paths
/// run the same operations 8 or 16 lanes at a time and give the same bits.
pub fn softmax_fixed(x: &mut [f32]) {
    match crate::cpu::simd() {
        // SAFETY: the level's features were detected.
        #[cfg(target_arch = "x86_64")]
        crate::cpu::Simd::Avx512Vnni => unsafe { x86_512::softmax_fixed(x) },
        #[cfg(target_arch = "x86_64")]
        crate::cpu::Simd::Avx2 => unsafe { x86::softmax_fixed(x) },
        _ => softmax_fixed_scalar(x),
    }
}

/// The smallest sum of the chosen experts' scores divided by (llama.cpp's
/// clamp, which keeps a row of tiny scores finite).
pub const EXPERT_SUM_MIN: f32 = 6.103_515_6e-5;

/// A row's experts from its router scores: the softmax of `logits`
/// ([`softmax_fixed`], into `p`, as long), the `sel.len()` highest (ties to
/// the lower index), best first, and their probabilities divided by their
/// sum (summed in that order, at least [`EXPERT_SUM_MIN`]).
pub fn route_experts(logits: &[f32], p: &mut [f32], sel: &mut [usize], weights: &mut [f32]) {
    p.copy_from_slice(logits);
    softmax_fixed(p);
    top_k(p, sel);
    let mut sum = 0f32;
    for &e in sel.iter() {
        sum += p[e];
    }
    let sum = sum.max(EXPERT_SUM_MIN);
    for (w, &e) in weights.iter_mut().zip(sel.iter()) {
        *w = p[e] / sum;
    }
}

/// The indices of the `sel.len()` largest values of `p`, largest first
/// (equal values by index; NaN as the smallest): a scan per place, no
/// allocation (a row takes a few experts of at most a few hundred).
pub fn top_k(p: &[f32], sel: &mut [usize]) {
    let key = |i: usize| if p[i].is_nan() { f32::NEG_INFINITY } else { p[i] };
    for k in 0..sel.len() {
        let mut best = None;
        for i in (0..p.len()).filter(|i| !sel[..k].contains(i)) {
            if best.is_none_or(|b| key(i).total_cmp(&key(b)).is_gt()) {
                best = Some(i);
            }
        }
        sel[k] = best.unwrap_or(0);
    }
}

/// The scalar reference of [`softmax_fixed`].
pub fn softmax_fixed_scalar(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let mut lanes = [0f32; 16];
    for (i, v) in x.iter_mut().enumerate() {
        *v = exp_fixed(*v - max);
        lanes[i % 16] += *v;
    }
    let inv = 1.0 / fold16(&lanes);
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `sqrt(2 / pi)`, of GELU's tanh approximation.
const GELU_S: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044715;

/// SiLU: `x / (1 + e^-x)`.
#[inline(always)]
fn silu1(x: f32) -> f32 {
    x / (1.0 + exp_fixed(-x))
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(y))` with
/// `y = sqrt(2/pi) (x + 0.044715 x^3)`, computed as `x / (1 + e^(-2y))`
/// (the same function: `(1 + tanh y) / 2` is the logistic function of
/// `2y`), which needs one exponential and no cancellation near zero.
#[inline(always)]
fn gelu1(x: f32) -> f32 {
    let y = GELU_S * x * (1.0 + GELU_A * x * x);
    x / (1.0 + exp_fixed(-2.0 * y))
}

/// SiLU-gated product in place: `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd() >= crate::cpu::Simd::Avx2 {
        // SAFETY: AVX2 and FMA detected.
        return unsafe { x86::gated::<false>(gate, up) };
    }
    silu_mul_scalar(gate, up)
}

/// GELU (tanh approximation) gated product in place.
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd() >= crate::cpu::Simd::Avx2 {
        // SAFETY: AVX2 and FMA detected.
        return unsafe { x86::gated::<true>(gate, up) };
    }
    gelu_mul_scalar(gate, up)
}

/// The scalar reference of [`silu_mul`].
pub fn silu_mul_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu1(*g) * u;
    }
}

/// The scalar reference of [`gelu_mul`].
pub fn gelu_mul_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = gelu1(*g) * u;
    }
}

/// Abramowitz and Stegun 7.1.26: `erf(z) = 1 - t (a1 + t (a2 + ... a5)) e^(-z^2)`
/// for `z >= 0`, `t = 1 / (1 + p z)`; absolute error below 1.5e-7.
const ERF_P: f32 = 0.327_591_1;
const ERF_A: [f32; 5] = [0.254_829_6, -0.284_496_74, 1.421_413_8, -1.453_152_1, 1.061_405_4];

/// GELU, exact (erf) form: `0.5 x (1 + erf(x / sqrt 2))`, erf as
/// [`ERF_A`] with [`exp_fixed`]; the vector code gives the same bits.
#[inline(always)]
fn gelu_erf1(x: f32) -> f32 {
    let z = x * std::f32::consts::FRAC_1_SQRT_2;
    let a = z.abs();
    let t = 1.0 / a.mul_add(ERF_P, 1.0);
    let mut p = ERF_A[4];
    for c in ERF_A[..4].iter().rev() {
        p = p.mul_add(t, *c);
    }
    let p = p * t;
    let e = exp_fixed(-(a * a));
    let erf = (1.0 - p * e).copysign(z);
    0.5 * x * (1.0 + erf)
}

/// GELU (erf form) in place, as PyTorch's default GELU (encoder
/// checkpoints); within 2e-7 of the exact function times `|x|`.
pub fn gelu_erf(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd() >= crate::cpu::Simd::Avx2 {
        // SAFETY: AVX2 and FMA detected.
        return unsafe { x86::gelu_erf(x) };
    }
    gelu_erf_scalar(x)
}

/// The scalar reference of [`gelu_erf`].
pub fn gelu_erf_scalar(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = gelu_erf1(*v));
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! Eight lanes of the scalar code's exact operations.
    use std::arch::x86_64::*;

    use super::{EXP_C, EXP_HI, EXP_LO, GELU_A, GELU_S, LN2_HI, LN2_LO};

    /// Eight lanes of [`super::exp_fixed`].
    #[inline(always)]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        // `max(x, lo)` returns `lo` for NaN, as `f32::max` does.
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_C[7]);
        for k in (0..7).rev() {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[k]));
        }
        let e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }

    /// [`super::softmax_fixed_scalar`], 8 lanes at a time: the 16 sum
    /// lanes are two registers.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_fixed(x: &mut [f32]) {
        let n = x.len();
        let (n8, n16) = (n / 8 * 8, n / 16 * 16);
        let p = x.as_mut_ptr();
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for i in (0..n8).step_by(8) {
            m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
        }
        let mut ml = [0f32; 8];
        _mm256_storeu_ps(ml.as_mut_ptr(), m);
        let max = ml.iter().chain(&x[n8..]).fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        let mv = _mm256_set1_ps(max);
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in (0..n16).step_by(16) {
            let e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
            let e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i + 8)), mv));
            _mm256_storeu_ps(p.add(i), e0);
            _mm256_storeu_ps(p.add(i + 8), e1);
            a0 = _mm256_add_ps(a0, e0);
            a1 = _mm256_add_ps(a1, e1);
        }
        let mut lanes = [0f32; 16];
        _mm256_storeu_ps(lanes.as_mut_ptr(), a0);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a1);
        for i in n16..n {
            x[i] = super::exp_fixed(x[i] - max);
            lanes[i % 16] += x[i];
        }
        let inv = 1.0 / super::fold16(&lanes);
        let iv = _mm256_set1_ps(inv);
        for i in (0..n8).step_by(8) {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), iv));
        }
        x[n8..].iter_mut().for_each(|v| *v *= inv);
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu_erf(x: &mut [f32]) {
        use super::{ERF_A, ERF_P};
        let n8 = x.len() / 8 * 8;
        let sign = _mm256_set1_ps(-0.0);
        let one = _mm256_set1_ps(1.0);
        for i in (0..n8).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            let z = _mm256_mul_ps(v, _mm256_set1_ps(std::f32::consts::FRAC_1_SQRT_2));
            let a = _mm256_andnot_ps(sign, z);
            let t = _mm256_div_ps(one, _mm256_fmadd_ps(a, _mm256_set1_ps(ERF_P), one));
            let mut p = _mm256_set1_ps(ERF_A[4]);
            for k in (0..4).rev() {
                p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(ERF_A[k]));
            }
            let p = _mm256_mul_ps(p, t);
            let e = exp8(_mm256_xor_ps(_mm256_mul_ps(a, a), sign));
            let m = _mm256_sub_ps(one, _mm256_mul_ps(p, e));
            let erf = _mm256_or_ps(_mm256_andnot_ps(sign, m), _mm256_and_ps(sign, z));
            let y = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5), v), _mm256_add_ps(one, erf));
            _mm256_storeu_ps(x.as_mut_ptr().add(i), y);
        }
        super::gelu_erf_scalar(&mut x[n8..]);
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gated<const GELU: bool>(gate: &mut [f32], up: &[f32]) {
        let one = _mm256_set1_ps(1.0);
        let n8 = gate.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            let z = if GELU {
                let xx = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_A), x), x);
                let y = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_S), x), _mm256_add_ps(one, xx));
                _mm256_mul_ps(_mm256_set1_ps(-2.0), y)
            } else {
                _mm256_sub_ps(_mm256_setzero_ps(), x)
            };
            let g = _mm256_div_ps(x, _mm256_add_ps(one, exp8(z)));
            _mm256_storeu_ps(
                gate.as_mut_ptr().add(i),
                _mm256_mul_ps(g, _mm256_loadu_ps(up.as_ptr().add(i))),
            );
        }
        if GELU {
            super::gelu_mul_scalar(&mut gate[n8..], &up[n8..]);
        } else {
            super::silu_mul_scalar(&mut gate[n8..], &up[n8..]);
        }
    }
}

/// `x += y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Softmax in place over `x`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_512 {
    //! Sixteen lanes of the scalar code's exact operations.
    use std::arch::x86_64::*;

    use super::{EXP_C, EXP_HI, EXP_LO, LN2_HI, LN2_LO};

    /// Sixteen lanes of [`super::exp_fixed`].
    #[inline(always)]
    pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_C[7]);
        for k in (0..7).rev() {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C[k]));
        }
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
        _mm512_mul_ps(p, _mm512_castsi512_ps(e))
    }

    /// [`super::softmax_fixed_scalar`], 16 lanes at a time: the sum lanes
    /// are one register.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn softmax_fixed(x: &mut [f32]) {
        let n = x.len();
        let n16 = n / 16 * 16;
        let p = x.as_mut_ptr();
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..n16).step_by(16) {
            m = _mm512_max_ps(m, _mm512_loadu_ps(p.add(i)));
        }
        let mut ml = [0f32; 16];
        _mm512_storeu_ps(ml.as_mut_ptr(), m);
        let max = ml.iter().chain(&x[n16..]).fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        let mv = _mm512_set1_ps(max);
        let mut a = _mm512_setzero_ps();
        for i in (0..n16).step_by(16) {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), mv));
            _mm512_storeu_ps(p.add(i), e);
            a = _mm512_add_ps(a, e);
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), a);
        for i in n16..n {
            x[i] = super::exp_fixed(x[i] - max);
            lanes[i % 16] += x[i];
        }
        let inv = 1.0 / super::fold16(&lanes);
        let iv = _mm512_set1_ps(inv);
        for i in (0..n16).step_by(16) {
            _mm512_storeu_ps(p.add(i), _mm512_mul_ps(_mm512_loadu_ps(p.add(i)), iv));
        }
        x[n16..].iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_takes_the_largest_first_ties_to_the_lower_index() {
        let p = [0.1, 0.5, f32::NAN, 0.5, 0.9, 0.0];
        let mut sel = [0usize; 4];
        top_k(&p, &mut sel);
        assert_eq!(sel, [4, 1, 3, 0]);
        let (mut probs, mut w) = ([0f32; 6], [0f32; 2]);
        let mut two = [0usize; 2];
        route_experts(&[1.0, 3.0, 2.0, 0.0, -1.0, 3.0], &mut probs, &mut two, &mut w);
        assert_eq!(two, [1, 5]);
        assert_eq!(w, [0.5, 0.5]);
    }

    fn head(d: usize) -> Vec<f32> {
        (0..d).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect()
    }

    #[test]
    fn unscaled_rope_keeps_its_bits_and_scaling_slows_the_rotation() {
        for layout in [RopeLayout::Adjacent, RopeLayout::Halves] {
            let plain = Rope::new(layout, 64, 10000.0);
            let same = Rope::new(layout, 64, 10000.0).scaled(1.0, Some(&[1.0; 32]));
            for pos in [0, 1, 7, 100, 4099] {
                for ggml in [false, true] {
                    let (mut a, mut b) = (head(64), head(64));
                    if ggml {
                        plain.apply_ggml(&mut a, pos);
                        same.apply_ggml(&mut b, pos);
                    } else {
                        plain.apply(&mut a, pos);
                        same.apply(&mut b, pos);
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&b), "{layout:?} pos {pos} ggml {ggml}");
                }
            }
            // Dividing every frequency by 4 (factors), or multiplying every
            // angle by 1/4 (linear scaling), rotates position 4p as the
            // plain rotation does position p.
            let factors = Rope::new(layout, 64, 10000.0).scaled(1.0, Some(&[4.0; 32]));
            let linear = Rope::new(layout, 64, 10000.0).scaled(0.25, None);
            for pos in [1, 3, 50] {
                let mut want = head(64);
                plain.apply(&mut want, pos);
                for (rope, ggml) in [(&factors, false), (&factors, true), (&linear, false), (&linear, true)] {
                    let mut got = head(64);
                    if ggml {
                        rope.apply_ggml(&mut got, 4 * pos);
                    } else {
                        rope.apply(&mut got, 4 * pos);
                    }
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() < 1e-4, "{layout:?} pos {pos}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn gelu_erf_is_exact_gelu_to_2e7_and_the_same_bits_on_every_level() {
        let xs: Vec<f32> = (-4000..=4000)
            .map(|i| i as f32 * 0.0025)
            .chain([-30.0, 30.0, 0.0, -0.0, 1e-6])
            .collect();
        let mut got = xs.clone();
        gelu_erf_scalar(&mut got);
        for (&x, &g) in xs.iter().zip(&got) {
            let exact = 0.5 * x as f64 * (1.0 + erf_ref(x as f64 / std::f64::consts::SQRT_2));
            assert!(
                (g as f64 - exact).abs() <= 2.5e-7 * (1.0 + (x as f64).abs()),
                "{x}: {g} vs {exact}"
            );
        }
        let mut simd = xs.clone();
        gelu_erf(&mut simd);
        assert!(simd.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn fixed_softmax_is_a_softmax_and_the_same_bits_on_every_level() {
        let mut x = 0x2545_f491u32;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 20000) as f32 / 1000.0 - 10.0
        };
        for n in [1, 2, 7, 8, 15, 16, 17, 31, 33, 100, 2049] {
            let mut row: Vec<f32> = (0..n).map(|_| rnd()).collect();
            // Ties, the maximum repeated, a score far below the rest.
            if n > 3 {
                row[1] = row[0];
                row[2] = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                row[3] = -200.0;
            }
            let mut want = row.clone();
            softmax_fixed_scalar(&mut want);
            let sum: f64 = want.iter().map(|&v| v as f64).sum();
            assert!((sum - 1.0).abs() < 1e-5, "length {n}: sums to {sum}");
            let m = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
            let z: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
            for (&r, &w) in row.iter().zip(&want) {
                let exact = (r as f64 - m).exp() / z;
                // `x - max` is rounded to f32 first: its error, up to
                // |x - max| * 2^-24, is a relative error of the result.
                let tol = 3e-7 + (r as f64 - m).abs() * 6e-8;
                assert!(
                    (w as f64 - exact).abs() <= tol * exact + 1e-30,
                    "length {n}: {r} {w} {exact}"
                );
            }
            let mut got = row.clone();
            softmax_fixed(&mut got);
            assert!(
                got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "length {n}"
            );
            #[cfg(target_arch = "x86_64")]
            {
                use crate::cpu::Simd;
                if Simd::detect() >= Simd::Avx2 {
                    let mut got = row.clone();
                    // SAFETY: AVX2 and FMA detected.
                    unsafe { x86::softmax_fixed(&mut got) };
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "avx2, length {n}"
                    );
                }
                if Simd::detect() >= Simd::Avx512Vnni {
                    let mut got = row.clone();
                    // SAFETY: AVX-512 F detected.
                    unsafe { x86_512::softmax_fixed(&mut got) };
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "avx512, length {n}"
                    );
                }
            }
        }
    }

    /// erf by its Taylor series (|x| < 3) or continued fraction: slow, exact enough.
    fn erf_ref(x: f64) -> f64 {
        if x.abs() > 5.0 {
            return x.signum();
        }
        let mut sum = 0.0f64;
        let mut term = x;
        let mut n = 0.0f64;
        while term.abs() > 1e-17 * sum.abs().max(1e-300) || n < 5.0 {
            sum += term / (2.0 * n + 1.0);
            n += 1.0;
            term *= -x * x / n;
            if n > 400.0 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn rms_norm_normalizes() {
        let mut x = vec![3.0f32, 4.0, 0.0, 0.0];
        rms_norm(&mut x, &[1.0; 4], 0.0);
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn shared_angles_rotate_to_apply_s_bits() {
        // A row's heads share one computation of the angles; the rotation
        // by them must be the per-head rotation's, both arithmetics, with
        // scaling, factors, and a partial rotation (rot_dim < head dim).
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let factors: Vec<f32> = (0..16).map(|i| 1.0 + i as f32 / 5.0).collect();
        for layout in [RopeLayout::Adjacent, RopeLayout::Halves] {
            for rope in [
                Rope::new(layout, 64, 10000.0),
                Rope::new(layout, 32, 1e6).scaled(0.25, Some(&factors)),
            ] {
                let mut sc = vec![(0.0, 0.0); rope.pair_count()];
                for pos in [0, 1, 9, 777, 131_071] {
                    let (mut want, mut got) = (head(64), head(64));
                    rope.apply(&mut want, pos);
                    rope.angles(pos, &mut sc);
                    rope.rotate(&mut got, &sc);
                    assert_eq!(bits(&got), bits(&want), "{layout:?} pos {pos}");
                    let (mut want, mut got) = (head(64), head(64));
                    rope.apply_ggml(&mut want, pos);
                    rope.angles_ggml(pos, &mut sc);
                    rope.rotate_ggml(&mut got, &sc);
                    assert_eq!(bits(&got), bits(&want), "{layout:?} pos {pos} ggml");
                }
            }
        }
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        for layout in [RopeLayout::Adjacent, RopeLayout::Halves] {
            let r = Rope::new(layout, 8, 10000.0);
            let v: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
            let mut a = v.clone();
            r.apply(&mut a, 0);
            assert_eq!(a, v);
            r.apply(&mut a, 17);
            let n0: f32 = v.iter().map(|x| x * x).sum();
            let n1: f32 = a.iter().map(|x| x * x).sum();
            assert!((n0 - n1).abs() < 1e-4);
        }
    }

    #[test]
    fn activations_match_float64_and_vector_paths_match_scalar() {
        let mut worst_exp = 0f64;
        for i in 0..175_000 {
            let x = (i as f32 - 87_000.0) / 1000.0;
            let e = exp_fixed(x) as f64;
            let want = (x as f64).exp();
            worst_exp = worst_exp.max(((e - want) / want).abs());
        }
        assert!(worst_exp < 2e-7, "exp relative error {worst_exp}");
        let xs: Vec<f32> = (0..4099).map(|i| (i as f32 - 2049.0) / 97.0).collect();
        let up: Vec<f32> = (0..4099).map(|i| 1.0 + (i % 7) as f32 / 8.0).collect();
        for gelu in [false, true] {
            let (mut fast, mut slow) = (xs.clone(), xs.clone());
            if gelu {
                gelu_mul(&mut fast, &up);
                gelu_mul_scalar(&mut slow, &up);
            } else {
                silu_mul(&mut fast, &up);
                silu_mul_scalar(&mut slow, &up);
            }
            for i in 0..xs.len() {
                assert_eq!(fast[i].to_bits(), slow[i].to_bits(), "gelu {gelu} at {}", xs[i]);
                let x = xs[i] as f64;
                let want = if gelu {
                    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
                } else {
                    x / (1.0 + (-x).exp())
                } * up[i] as f64;
                assert!(
                    (slow[i] as f64 - want).abs() <= 1e-6 * want.abs() + 1e-6,
                    "gelu {gelu} at {x}: {} vs {want}",
                    slow[i]
                );
            }
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -1e30];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
    }
}
