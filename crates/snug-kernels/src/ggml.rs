//! The arithmetic of llama.cpp's CPU backend (ggml on x86 with AVX-512, as
//! built by `GGML_NATIVE` with GCC), for runs whose tokens must equal
//! llama.cpp's ([`Numerics::Ggml`], `--numerics llama.cpp`).
//!
//! snug's own operations ([`crate::ops`], [`crate::dot`], the attention of
//! [`crate::kv`]) keep every intermediate in f32 and sum each row in one
//! fixed order. ggml rounds some intermediates to f16 and sums in the
//! order of whichever kernel a product takes; at the near-ties these small
//! models produce, either difference changes greedy tokens. Here:
//!
//! - matrix products in each kernel's float order ([`dot_quant`],
//!   [`Kernel`]), over activations quantized as [`crate::dot`] already
//!   quantizes them (ggml's rules);
//! - attention as its flash-attention kernel for one query row (which
//!   every row takes when a batch holds fewer than 64 rows and the KV view
//!   fewer than 512 positions): the query rounded to f16, scores summed as
//!   [`dot_f16`] sums them, the weighted value sum kept in f16 and rounded
//!   after every position ([`OnlineHead`]);
//! - GELU (Gemma 3) from a table indexed by the input rounded to f16,
//!   holding results rounded to f16; SiLU through ggml's vector `exp`
//!   ([`v_expf`]);
//! - RMS normalization with its squares summed in f64; rotary embedding
//!   with the angle advanced by repeated multiplication
//!   ([`crate::ops::Rope::apply_ggml`]); embedding rows dequantized with
//!   fused multiply-adds ([`dequantize_row`]).
//!
//! Each function performs ggml's operations in ggml's order, including the
//! fused multiply-adds its compiler forms (`-ffp-contract=fast`), so the
//! results match bit for bit where the inputs do. Unlike snug's own, some
//! of these kernels make a row's bits depend on its batch, because
//! llama.cpp's do ([`Kernel::for_row`]). Fidelity comes first here: the
//! products have AVX2 and AVX-512 VNNI paths (equal in bits to the scalar
//! reference), the other operations are scalar code.

use half::f16;

use crate::dot::{k_scales, k_weights, unpack, BlockQ8, QK8};
use crate::quant::GgmlType;

/// Which arithmetic a model's row-wise operations follow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numerics {
    /// snug's own: f32 throughout, vectorized (the default).
    #[default]
    Native,
    /// llama.cpp's CPU backend's, f16 roundings included (this module).
    Ggml,
}

impl Numerics {
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Native => "native",
            Numerics::Ggml => "ggml",
        }
    }

    pub fn parse(name: &str) -> Option<Numerics> {
        match name {
            "native" => Some(Numerics::Native),
            "ggml" | "llama.cpp" => Some(Numerics::Ggml),
            _ => None,
        }
    }
}

/// `x` rounded to f16 (to nearest, ties to even; overflow to infinity), as
/// an f32.
#[inline(always)]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// RMS normalization of each `w.len()`-wide row of `x` in place: squares
/// summed in f64 in element order, the mean rounded to f32, `scale = 1 /
/// sqrt(mean + eps)`, then `x * scale * w`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for row in x.chunks_exact_mut(dim) {
        let mut sum = 0f64;
        for &v in row.iter() {
            sum += (v * v) as f64;
        }
        let mean = (sum / dim as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044715;

/// ggml's GELU (tanh form) of one f32, as its compiler evaluates it.
fn gelu_f32(x: f32) -> f32 {
    let inner = (GELU_COEF_A * x).mul_add(x, 1.0);
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh())
}

/// GELU of every f16 value, rounded to f16 (ggml's table).
fn gelu_table() -> &'static [u16] {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_f32(f16::from_bits(bits).to_f32())).to_bits())
            .collect()
    })
}

/// GELU-gated product in place, `gate[i] = gelu(gate[i]) * up[i]`, with
/// GELU read from the f16 table (0 at or below -10, the identity at or
/// above 10).
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            f16::from_bits(table[f16::from_f32(x).to_bits() as usize]).to_f32() * u
        };
    }
}

/// `e^x` as ggml's AVX-512 `ggml_v_expf` computes each lane: `n =
/// round(x / ln 2)` by the shifter `1.5 * 2^23`, `b = x - n * ln 2` in two
/// fused steps, a degree-5 polynomial in `b` by fused multiply-adds, then
/// `2^n` applied exactly (`vscalefps`); `|n| > 192` saturates to 0 or
/// infinity.
#[inline(always)]
pub fn v_expf(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000);
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let u = b * b;
    let p = c(0x3c07_2010).mul_add(b, c(0x3d2b_9f17));
    let q = c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb));
    let j = p.mul_add(u, q).mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // j * 2^n is exact in f64; one rounding to f32 is what scalef does.
    (j as f64 * 2f64.powi(n as i32)) as f32
}

/// SiLU-gated product in place, `gate[i] = silu(gate[i]) * up[i]`, as
/// ggml's `ggml_vec_swiglu_f32` computes rows of `row` elements: `x / (1 +
/// v_expf(0 - x))` for each full group of 16, the library `expf` for the
/// rest of a row.
pub fn silu_mul(gate: &mut [f32], up: &[f32], row: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd() >= crate::cpu::Simd::Avx2 {
        // SAFETY: AVX2 and FMA detected (`simd`).
        return unsafe { silu_mul_fma(gate, up, row) };
    }
    silu_mul_body(gate, up, row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_fma(gate: &mut [f32], up: &[f32], row: usize) {
    silu_mul_body(gate, up, row)
}

#[inline(always)]
fn silu_mul_body(gate: &mut [f32], up: &[f32], row: usize) {
    assert_eq!(gate.len(), up.len());
    let full = row - row % 16;
    for (gr, ur) in gate.chunks_mut(row).zip(up.chunks(row)) {
        for (i, (g, &u)) in gr.iter_mut().zip(ur).enumerate() {
            let x = *g;
            let e = if i < full { v_expf(0.0 - x) } else { (-x).exp() };
            *g = x / (1.0 + e) * u;
        }
    }
}

/// The dot product of two f16-valued vectors as ggml's AVX-512 `vec_dot_f16`
/// sums it: element `i` into accumulator `(i / 16) % 4`, lane `i % 16`,
/// by fused multiply-adds; accumulators 2 and 3 added into 0 and 1, then 1
/// into 0; the 16 lanes folded in halves (`k + 8`, `k + 4`, `k + 2`,
/// `k + 1`); elements past the last multiple of 64 added in f64.
#[inline(always)]
pub fn dot_f16(x: &[f32], y: &[f32]) -> f32 {
    assert_eq!(x.len(), y.len());
    let n = x.len();
    let np = n & !63;
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            for (l, lane) in a.iter_mut().enumerate() {
                let e = i + 16 * j + l;
                *lane = x[e].mul_add(y[e], *lane);
            }
        }
    }
    let [a0, a1, a2, a3] = acc;
    let a: [f32; 16] = std::array::from_fn(|l| (a0[l] + a2[l]) + (a1[l] + a3[l]));
    let mut sum = reduce16(&a) as f64;
    for e in np..n {
        sum += (x[e] * y[e]) as f64;
    }
    sum as f32
}

/// `_mm512_reduce_add_ps` as GCC expands it: lane `k + 8` onto lane `k`,
/// then `k + 4`, then `(0 + 2) + (1 + 3)`.
#[inline(always)]
fn reduce16(a: &[f32; 16]) -> f32 {
    let h8: [f32; 8] = std::array::from_fn(|k| a[k + 8] + a[k]);
    let h4: [f32; 4] = std::array::from_fn(|k| h8[k + 4] + h8[k]);
    (h4[0] + h4[2]) + (h4[1] + h4[3])
}

/// llamafile's `tinyBLAS` on f16-valued rows (AVX-512): one 16-lane
/// accumulator of fused multiply-adds, element `i` into lane `i % 16`,
/// folded by [`reduce16`]. Length a multiple of 16.
pub fn dot_f16_tinyblas(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (xc, yc) in x.chunks_exact(16).zip(y.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = xc[l].mul_add(yc[l], acc[l]);
        }
    }
    reduce16(&acc)
}

/// `x` rounded to bf16 as the vector conversion does (to nearest, ties to
/// even; subnormals read as zero), as an f32.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    let x = daz(x);
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return f32::from_bits(((u >> 16) | 64) << 16);
    }
    f32::from_bits(((u.wrapping_add(0x7fff + ((u >> 16) & 1))) >> 16) << 16)
}

#[inline(always)]
fn daz(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

/// One step of `vdpbf16ps` on a lane: `c + a * b` rounded once (the
/// product of two bf16 values is exact in f32), inputs and result with
/// subnormals as zero.
#[inline(always)]
fn dpbf16_step(c: f32, a: f32, b: f32) -> f32 {
    daz(daz(a).mul_add(daz(b), daz(c)))
}

/// Chunk `chunk` (32 elements) of two bf16-valued rows into 16 lanes as
/// `_mm512_dpbf16_ps` adds it: lane `j` takes element `2j + 1`, then `2j`.
#[inline(always)]
fn dpbf16(acc: &mut [f32; 16], x: &[f32], y: &[f32]) {
    for (j, c) in acc.iter_mut().enumerate() {
        *c = dpbf16_step(*c, x[2 * j + 1], y[2 * j + 1]);
        *c = dpbf16_step(*c, x[2 * j], y[2 * j]);
    }
}

/// ggml's `vec_dot_bf16` with AVX-512 BF16 on bf16-valued rows: 64
/// elements a step, the first 32 into one accumulator and the next 32
/// into another ([`dpbf16`]), each folded by [`reduce16`] and added in
/// f64, the elements past the last multiple of 64 too.
pub fn dot_bf16(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len();
    let np = n & !63;
    let (mut c1, mut c2) = ([0f32; 16], [0f32; 16]);
    for i in (0..np).step_by(64) {
        dpbf16(&mut c1, &x[i..i + 32], &y[i..i + 32]);
        dpbf16(&mut c2, &x[i + 32..i + 64], &y[i + 32..i + 64]);
    }
    let mut sum = reduce16(&c1) as f64;
    sum += reduce16(&c2) as f64;
    for e in np..n {
        sum += (x[e] * y[e]) as f64;
    }
    sum as f32
}

/// llamafile's `tinyBLAS` on bf16-valued rows with AVX-512 BF16: one
/// accumulator, 32 elements a step ([`dpbf16`]), folded by [`reduce16`].
/// Length a multiple of 32.
pub fn dot_bf16_tinyblas(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (xc, yc) in x.chunks_exact(32).zip(y.chunks_exact(32)) {
        dpbf16(&mut acc, xc, yc);
    }
    reduce16(&acc)
}

/// ggml's `vec_dot_f32` with AVX-512 on f32 rows: [`dot_f16`]'s four
/// accumulators and fold, the elements past the last multiple of 64 added
/// by fused multiply-adds in f32.
pub fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len();
    let np = n & !63;
    let mut sum = dot_f16(&x[..np], &y[..np]);
    for e in np..n {
        sum = x[e].mul_add(y[e], sum);
    }
    sum
}

/// A row's experts as llama.cpp's graph chooses them (`p` as long as
/// `logits`, for the probabilities): `soft_max` of the
/// router scores (each 16 from the maximum through [`v_expf`], folded by
/// [`reduce16`], the rest through `expf`, all summed in f64; then every
/// value times the sum's reciprocal rounded to f32), `argsort_top_k`
/// (largest first), their probabilities summed in f64, the sum rounded to
/// f32 and clamped below by [`crate::ops::EXPERT_SUM_MIN`], each divided
/// by it.
pub fn route_experts(logits: &[f32], p: &mut [f32], sel: &mut [usize], weights: &mut [f32]) {
    let n = logits.len();
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f64;
    let mut i = 0;
    while i + 16 <= n {
        let mut lanes = [0f32; 16];
        for (l, v) in lanes.iter_mut().enumerate() {
            *v = v_expf(logits[i + l] - max);
        }
        p[i..i + 16].copy_from_slice(&lanes);
        sum += reduce16(&lanes) as f64;
        i += 16;
    }
    for (e, v) in p.iter_mut().enumerate().skip(i) {
        *v = (logits[e] - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    p.iter_mut().for_each(|v| *v *= inv);
    crate::ops::top_k(p, sel);
    let mut s = 0f64;
    for &e in sel.iter() {
        s += p[e] as f64;
    }
    let s = (s as f32).max(crate::ops::EXPERT_SUM_MIN);
    for (w, &e) in weights.iter_mut().zip(sel.iter()) {
        *w = p[e] / s;
    }
}

/// The running state of one query head in [`crate::kv::attend_group_ggml`]:
/// ggml's online softmax over positions in order.
pub(crate) struct OnlineHead<'a> {
    /// The value sum (f16-valued when `f16` is set).
    pub acc: &'a mut [f32],
    pub max: f32,
    pub sum: f32,
    pub f16: bool,
}

impl OnlineHead<'_> {
    /// Adds a position with score `s` (already scaled) and value `v`: a new
    /// maximum scales the sum so far by `exp(old - new)` and takes weight 1,
    /// any other score weight `exp(s - max)`; the value is added with a
    /// fused multiply-add (and rounded to f16 when the sum is kept in f16).
    #[inline(always)]
    pub fn push(&mut self, s: f32, v: &[f32]) {
        let mut ms = 1.0f32;
        let mut vs = 1.0f32;
        if s > self.max {
            let old = self.max;
            self.max = s;
            ms = (old - s).exp();
            if self.f16 {
                self.acc.iter_mut().for_each(|a| *a = round_f16(*a * ms));
            } else {
                self.acc.iter_mut().for_each(|a| *a *= ms);
            }
        } else {
            vs = (s - self.max).exp();
        }
        if self.f16 {
            for (a, &x) in self.acc.iter_mut().zip(v) {
                *a = round_f16(x.mul_add(vs, *a));
            }
        } else {
            for (a, &x) in self.acc.iter_mut().zip(v) {
                *a = x.mul_add(vs, *a);
            }
        }
        self.sum = self.sum.mul_add(ms, vs);
    }

    /// The attention output: the value sum times `1 / sum`.
    pub fn finish(&self, out: &mut [f32]) {
        let inv = if self.sum == 0.0 { 0.0 } else { 1.0 / self.sum };
        for (o, &a) in out.iter_mut().zip(self.acc.iter()) {
            *o = a * inv;
        }
    }
}

/// Whether [`dot_quant`] follows ggml's order for weight type `ty` (the
/// types of the models snug pulls; others take snug's own order).
pub fn dot_supports(ty: GgmlType) -> bool {
    crate::dot::supports(ty) && ty != GgmlType::Q5_1
}

/// The eight 32-bit lanes of one 32-element block's integer products as
/// ggml's 256-bit kernels form them: lane `k` sums elements `4k..4k + 4`.
#[inline(always)]
fn lanes8(w: &[i8; QK8], a: &[i8; QK8]) -> [i32; 8] {
    std::array::from_fn(|k| (0..4).map(|e| w[4 * k + e] as i32 * a[4 * k + e] as i32).sum())
}

/// ggml's `hsum_float_8`: the upper four lanes added to the lower four,
/// then `(r0 + r2) + (r1 + r3)`.
#[inline(always)]
fn hsum8(c: &[f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|k| c[k + 4] + c[k]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Which of llama.cpp's kernels a product row takes; it sums some types
/// in another order ([`dot_quant`]). See [`Kernel::for_row`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// One activation row at a time (`vec_dot`, repacked `gemv`).
    Single,
    /// The repacked Q4_K `gemm`, four activation rows at a time.
    Gemm4,
    /// The tiled K-quant kernel of batches of 8 rows or more.
    Tiled,
    /// llamafile's `tinyBLAS`, for products of 2 rows or more of the
    /// 32-element types it handles (IQ4_NL's `vec_dot` sums otherwise).
    Tinyblas,
}

impl Kernel {
    /// The kernel llama.cpp's x86 build runs for row `r` of an `n`-row
    /// product with weights of type `ty`: Q4_K weights are repacked, and
    /// their first `n - n % 4` rows go to `gemm`, the rest to `gemv`; Q6_K
    /// weights, not repacked, go to the tiled kernel from 8 rows on. So in
    /// llama.cpp these rows' last bits depend on their batch.
    pub fn for_row(ty: GgmlType, r: usize, n: usize) -> Kernel {
        match ty {
            GgmlType::Q4K if r < n - n % 4 => Kernel::Gemm4,
            GgmlType::Q6K if n >= 8 => Kernel::Tiled,
            GgmlType::IQ4NL if n >= 2 => Kernel::Tinyblas,
            _ => Kernel::Single,
        }
    }
}

/// One weight row (type `ty`, see [`dot_supports`]) times one quantized
/// activation row, in the float order of the kernel llama.cpp's x86 build
/// runs for that type:
///
/// - 32-element types (`vec_dot_q8_0_q8_0`, `q5_0`, `q4_0`, and llamafile's
///   `tinyBLAS_Q0_AVX` for batches, which sums alike): eight lane
///   accumulators, `acc[k] = fma(d_w * d_a, lane_k, acc[k])` block by
///   block, folded by `hsum_float_8`; Q4_1 adds its minimum terms, summed
///   apart by fused multiply-adds, after the fold;
/// - Q4_K (repacked to `q4_K_8x8` on x86): one accumulator of
///   `fma(isum, d * d_a)` and one of `fma(minsum, dmin * d_a)`, the second
///   subtracted at the end. Its `gemv` ([`Kernel::Single`]) adds once per
///   super-block; its `gemm` ([`Kernel::Gemm4`]) once per pair of
///   32-element blocks;
/// - Q6_K: `vec_dot_q6_K_q8_K` ([`Kernel::Single`]) forms per super-block
///   eight integer lanes (lane `m`: elements `4m..4m + 4` of each
///   32-element group, times their scales, less `32 * scale * sum(a)` over
///   16-element groups `2m` and `2m + 1`), each added as `fma(d * d_a,
///   lane)`, folded as above; the tiled kernel ([`Kernel::Tiled`]) adds
///   `fma(isum * d, d_a)` once per super-block into one accumulator.
///
/// - IQ4_NL and MXFP4 (`vec_dot_iq4_nl_q8_0`, `vec_dot_mxfp4_q8_0`):
///   blocks in pairs, the first of each pair into one set of eight lane
///   accumulators and the second into another (`fma(d_a * d_w, lane)`),
///   the two sets added lane by lane and folded by `hsum_float_8`, a last
///   odd block added as `fma(d, isum, sum)`; IQ4_NL in `tinyBLAS`
///   ([`Kernel::Tinyblas`]) sums as Q4_0 does;
/// - Q2_K, Q3_K, Q5_K and IQ4_XS (`vec_dot_*_q8_K`): per super-block
///   eight integer lanes (lane `k`: elements `4k..4k + 4` of each
///   32-element block times their group's scale), each added as
///   `fma(d_a·d, lane)` into its accumulator, folded by `hsum_float_8`;
///   Q2_K first adds, lane by lane, `fma(-(d_a·dmin), m[2k]·s[2k] +
///   m[2k+1]·s[2k+1])` (`m` its group minimums, `s` the activations' sums
///   over 16 elements); Q5_K sums its minimum terms apart, `fma(-(d_a·dmin),
///   minsum)` per super-block, added after the fold. These are the kernels
///   llama.cpp runs with `--no-repack` (its repacked Q2_K, IQ4_NL and MXFP4
///   layouts on AVX2/AVX-512 sum otherwise).
///
/// The integers are exact in every order; only these float steps decide
/// the result's last bits.
pub fn dot_quant(ty: GgmlType, w: &[u8], a: &[BlockQ8], kernel: Kernel) -> f32 {
    dot_quant_with(crate::cpu::simd(), ty, w, a, kernel)
}

/// [`dot_quant`] on a given SIMD level (for tests; a level above the
/// CPU's is not checked here). Every level gives the same bits: the
/// integer lanes are exact however they are formed, and the vector paths
/// perform the reference's float operations lane for lane.
pub fn dot_quant_with(level: crate::cpu::Simd, ty: GgmlType, w: &[u8], a: &[BlockQ8], kernel: Kernel) -> f32 {
    use crate::cpu::Simd;
    assert_eq!(
        w.len() / ty.type_size() * ty.block_size(),
        a.len() * QK8,
        "dot_quant: shapes"
    );
    #[cfg(target_arch = "x86_64")]
    if level >= Simd::Avx2 {
        // SAFETY: the caller's level is one the CPU has (`cpu::simd`).
        return unsafe {
            if level >= Simd::Avx512Vnni {
                x86::dot_quant_vnni(ty, w, a, kernel)
            } else {
                x86::dot_quant_avx2(ty, w, a, kernel)
            }
        };
    }
    let _ = level;
    dot_quant_body(ty, w, a, kernel)
}

#[inline(always)]
fn dot_quant_body(ty: GgmlType, w: &[u8], a: &[BlockQ8], kernel: Kernel) -> f32 {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
            let mut acc = [0f32; 8];
            let mut summs = 0f32;
            for (wb, ab) in w.chunks_exact(ty.type_size()).zip(a) {
                let u = unpack(ty, wb, 0);
                let d = u.scale * ab.d;
                let lanes = lanes8(&u.w, &ab.qs);
                for (c, &l) in acc.iter_mut().zip(&lanes) {
                    *c = d.mul_add(l as f32, *c);
                }
                if let Some(m) = u.min {
                    summs = m.mul_add(ab.s, summs);
                }
            }
            if ty == GgmlType::Q4_1 {
                hsum8(&acc) + summs
            } else {
                hsum8(&acc)
            }
        }
        GgmlType::Q4K => q4k_order(w, a, kernel, |wb, j, ab| {
            let wj = k_weights(ty, wb, j);
            wj.iter().zip(&ab.qs).map(|(&x, &y)| x as i32 * y as i32).sum()
        }),
        GgmlType::Q6K if kernel == Kernel::Tiled => q6k_tiled_order(w, a, |wb, j, ab| {
            let wj = k_weights(ty, wb, j);
            std::array::from_fn(|h| (16 * h..16 * h + 16).map(|i| wj[i] as i32 * ab.qs[i] as i32).sum())
        }),
        GgmlType::Q6K => {
            let mut acc = [0f32; 8];
            for (sb, wb) in w.chunks_exact(ty.type_size()).enumerate() {
                let ks = k_scales(ty, wb);
                let mut lanes = [0i32; 8];
                for g in 0..8 {
                    let mut wu = k_weights(ty, wb, g);
                    // ggml multiplies the unsigned levels (0..63) and takes
                    // the offset of 32 off afterwards.
                    wu.iter_mut().for_each(|x| *x += 32);
                    let ab = &a[sb * 8 + g];
                    let p = lanes8(&wu, &ab.qs);
                    for (m, l) in lanes.iter_mut().enumerate() {
                        *l += ks.sc[2 * g + m / 4] * p[m];
                    }
                }
                for (m, l) in lanes.iter_mut().enumerate() {
                    let qs = &a[sb * 8 + m].qs;
                    let b0: i32 = qs[..16].iter().map(|&q| q as i32).sum();
                    let b1: i32 = qs[16..].iter().map(|&q| q as i32).sum();
                    *l -= 32 * (ks.sc[2 * m] * b0 + ks.sc[2 * m + 1] * b1);
                }
                let d = a[sb * 8].d * ks.d;
                for (c, &l) in acc.iter_mut().zip(&lanes) {
                    *c = d.mul_add(l as f32, *c);
                }
            }
            hsum8(&acc)
        }
        GgmlType::IQ4NL if kernel == Kernel::Tinyblas => {
            let mut acc = [0f32; 8];
            for (wb, ab) in w.chunks_exact(ty.type_size()).zip(a) {
                let u = unpack(ty, wb, 0);
                let d = u.scale * ab.d;
                for (c, &l) in acc.iter_mut().zip(&lanes8(&u.w, &ab.qs)) {
                    *c = d.mul_add(l as f32, *c);
                }
            }
            hsum8(&acc)
        }
        GgmlType::IQ4NL | GgmlType::MXFP4 => pairs_order(ty, w, a, |wb, ab| lanes8(&unpack(ty, wb, 0).w, &ab.qs)),
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q5K | GgmlType::IQ4XS => {
            k_lanes_order(ty, w, a, |wb, j, ab| lanes8(&k_weights(ty, wb, j), &ab.qs))
        }
        _ => panic!("ggml::dot_quant: no ggml order for {ty}"),
    }
}

/// IQ4_NL's and MXFP4's `vec_dot` float steps around `lanes(block,
/// activation_block)`, the eight exact integer lanes of one block.
#[inline(always)]
fn pairs_order(ty: GgmlType, w: &[u8], a: &[BlockQ8], lanes: impl Fn(&[u8], &BlockQ8) -> [i32; 8]) -> f32 {
    let ts = ty.type_size();
    let nb = a.len();
    let (mut acc1, mut acc2) = ([0f32; 8], [0f32; 8]);
    let mut ib = 0;
    while ib + 1 < nb {
        for (acc, b) in [(&mut acc1, ib), (&mut acc2, ib + 1)] {
            let wb = &w[b * ts..(b + 1) * ts];
            let d = a[b].d * unpack(ty, wb, 0).scale;
            for (c, &l) in acc.iter_mut().zip(&lanes(wb, &a[b])) {
                *c = d.mul_add(l as f32, *c);
            }
        }
        ib += 2;
    }
    let sum: [f32; 8] = std::array::from_fn(|k| acc1[k] + acc2[k]);
    let mut sumf = hsum8(&sum);
    for b in ib..nb {
        let wb = &w[b * ts..(b + 1) * ts];
        let d = a[b].d * unpack(ty, wb, 0).scale;
        let isum: i32 = lanes(wb, &a[b]).iter().sum();
        sumf = d.mul_add(isum as f32, sumf);
    }
    sumf
}

/// The `vec_dot` float steps of Q2_K, Q3_K, Q5_K and IQ4_XS around
/// `lanes(super_block, j, activation_block)`, the eight exact integer
/// lanes of block `j` before scaling.
#[inline(always)]
fn k_lanes_order(ty: GgmlType, w: &[u8], a: &[BlockQ8], lanes: impl Fn(&[u8], usize, &BlockQ8) -> [i32; 8]) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (sb, wb) in w.chunks_exact(ty.type_size()).enumerate() {
        let ks = k_scales(ty, wb);
        let da = a[sb * 8].d;
        let (d, dmin) = (da * ks.d, -da * ks.dmin);
        let mut l8 = [0i32; 8];
        let mut m8 = [0i32; 8];
        let mut minsum = 0i32;
        for j in 0..8 {
            let ab = &a[sb * 8 + j];
            let p = lanes(wb, j, ab);
            for (k, l) in l8.iter_mut().enumerate() {
                *l += ks.sc[2 * j + k / 4] * p[k];
            }
            let s0: i32 = ab.qs[..16].iter().map(|&q| q as i32).sum();
            let s1: i32 = ab.qs[16..].iter().map(|&q| q as i32).sum();
            // Q2_K's lane k holds groups 2k and 2k + 1: block j's halves.
            m8[j] = ks.min[2 * j] * s0 + ks.min[2 * j + 1] * s1;
            minsum += m8[j];
        }
        match ty {
            GgmlType::Q2K => {
                for (c, &m) in acc.iter_mut().zip(&m8) {
                    *c = dmin.mul_add(m as f32, *c);
                }
            }
            GgmlType::Q5K => summs = dmin.mul_add(minsum as f32, summs),
            _ => {}
        }
        for (c, &l) in acc.iter_mut().zip(&l8) {
            *c = d.mul_add(l as f32, *c);
        }
    }
    if ty == GgmlType::Q5K {
        hsum8(&acc) + summs
    } else {
        hsum8(&acc)
    }
}

/// Q4_K's float steps in [`dot_quant`] around `block(super_block, j,
/// activation_block)`, the exact integer product of block `j` of a weight
/// super-block and its activation block.
#[inline(always)]
fn q4k_order(w: &[u8], a: &[BlockQ8], kernel: Kernel, block: impl Fn(&[u8], usize, &BlockQ8) -> i32) -> f32 {
    let ty = GgmlType::Q4K;
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (sb, wb) in w.chunks_exact(ty.type_size()).enumerate() {
        let ks = k_scales(ty, wb);
        let da = a[sb * 8].d;
        let (scale, scale_min) = (ks.d * da, ks.dmin * da);
        let (mut isum, mut minsum) = (0i32, 0i32);
        for j in 0..8 {
            let ab = &a[sb * 8 + j];
            isum += ks.sc[2 * j] * block(wb, j, ab);
            minsum += ks.min[2 * j] * ab.sum;
            if kernel == Kernel::Gemm4 && j % 2 == 1 {
                acc = (isum as f32).mul_add(scale, acc);
                acc_min = (minsum as f32).mul_add(scale_min, acc_min);
                (isum, minsum) = (0, 0);
            }
        }
        if kernel != Kernel::Gemm4 {
            acc = (isum as f32).mul_add(scale, acc);
            acc_min = (minsum as f32).mul_add(scale_min, acc_min);
        }
    }
    acc - acc_min
}

/// Q6_K's tiled float steps in [`dot_quant`] around `halves(super_block,
/// j, activation_block)`, the exact integer products of the two 16-element
/// halves of block `j`.
#[inline(always)]
fn q6k_tiled_order(w: &[u8], a: &[BlockQ8], halves: impl Fn(&[u8], usize, &BlockQ8) -> [i32; 2]) -> f32 {
    let ty = GgmlType::Q6K;
    let mut acc = 0f32;
    for (sb, wb) in w.chunks_exact(ty.type_size()).enumerate() {
        let ks = k_scales(ty, wb);
        let mut isum = 0i32;
        for j in 0..8 {
            let [p0, p1] = halves(wb, j, &a[sb * 8 + j]);
            isum += ks.sc[2 * j] * p0 + ks.sc[2 * j + 1] * p1;
        }
        acc = ((isum as f32) * ks.d).mul_add(a[sb * 8].d, acc);
    }
    acc
}

/// Vector versions of `dot_quant_body`: the weight levels come from the
/// row kernels' unpacking ([`crate::dot`]'s `Unpack`), each block's eight
/// integer lanes from one multiply-add chain, and the float steps are the
/// reference's, lane for lane.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{hsum8, k_lanes_order, pairs_order, q4k_order, q6k_tiled_order, Kernel};
    use crate::dot::x86::{hsum_i32, Unpack, IQ4NL, IQ4XS, MXFP4, Q2K, Q3K, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q6K, Q8_0};
    use crate::dot::{k_scales, BlockQ8};
    use crate::quant::GgmlType;

    /// Lane `k` of the result: the exact sum of elements `4k..4k + 4` of
    /// `w * a`. `SIGNED` weights move their sign onto the activations
    /// (activations lie in -127..=127, so the move is exact).
    #[inline(always)]
    unsafe fn lanes<const VNNI: bool, const SIGNED: bool>(w: __m256i, a: __m256i) -> __m256i {
        let (ax, sy) = if SIGNED {
            (_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
        } else {
            (w, a)
        };
        if VNNI {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
        }
    }

    #[inline(always)]
    unsafe fn act(b: &BlockQ8) -> __m256i {
        _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i)
    }

    #[inline(always)]
    unsafe fn to_array(v: __m256i) -> [i32; 8] {
        let mut out = [0i32; 8];
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, v);
        out
    }

    #[inline(always)]
    unsafe fn f16_at(b: *const u8) -> f32 {
        half::f16::from_bits((b as *const u16).read_unaligned()).to_f32()
    }

    /// The 32-element types: `acc[k] = fma(d_w * d_a, lane_k, acc[k])`,
    /// eight accumulators in one register.
    #[inline(always)]
    unsafe fn blocks32<U: Unpack, const VNNI: bool>(ty: GgmlType, w: &[u8], a: &[BlockQ8]) -> f32 {
        let ts = ty.type_size();
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        for (b, ab) in a.iter().enumerate() {
            let p = w.as_ptr().add(b * ts);
            // Types with a minimum have non-negative levels.
            let l = if U::HAS_MIN {
                lanes::<VNNI, false>(U::levels(p, 0), act(ab))
            } else {
                lanes::<VNNI, true>(U::levels(p, 0), act(ab))
            };
            let d = f16_at(p.add(U::D_AT)) * ab.d;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l), acc);
            if U::HAS_MIN {
                summs = f16_at(p.add(U::M_AT)).mul_add(ab.s, summs);
            }
        }
        let mut c = [0f32; 8];
        _mm256_storeu_ps(c.as_mut_ptr(), acc);
        if U::HAS_MIN {
            hsum8(&c) + summs
        } else {
            hsum8(&c)
        }
    }

    #[inline(always)]
    unsafe fn q4k<const VNNI: bool>(w: &[u8], a: &[BlockQ8], kernel: Kernel) -> f32 {
        q4k_order(w, a, kernel, |wb, j, ab| {
            hsum_i32(lanes::<VNNI, false>(Q4K::levels(wb.as_ptr(), j), act(ab)))
        })
    }

    #[inline(always)]
    unsafe fn q6k<const VNNI: bool>(w: &[u8], a: &[BlockQ8], kernel: Kernel) -> f32 {
        let ty = GgmlType::Q6K;
        if kernel == Kernel::Tiled {
            return q6k_tiled_order(w, a, |wb, j, ab| {
                let l = to_array(lanes::<VNNI, true>(Q6K::levels(wb.as_ptr(), j), act(ab)));
                [(l[0] + l[1]) + (l[2] + l[3]), (l[4] + l[5]) + (l[6] + l[7])]
            });
        }
        // `vec_dot_q6_K_q8_K`: unsigned levels (0..63), the offset of 32
        // taken off afterwards through the activations' 16-element sums.
        let mut acc = _mm256_setzero_ps();
        let ones = _mm256_set1_epi8(1);
        for (sb, wb) in w.chunks_exact(ty.type_size()).enumerate() {
            let ks = k_scales(ty, wb);
            let mut lanes_sb = _mm256_setzero_si256();
            let mut bias = [0i32; 8];
            for g in 0..8 {
                let ab = &a[sb * 8 + g];
                let wu = _mm256_add_epi8(Q6K::levels(wb.as_ptr(), g), _mm256_set1_epi8(32));
                let p = lanes::<VNNI, false>(wu, act(ab));
                let sc = _mm256_setr_epi32(
                    ks.sc[2 * g],
                    ks.sc[2 * g],
                    ks.sc[2 * g],
                    ks.sc[2 * g],
                    ks.sc[2 * g + 1],
                    ks.sc[2 * g + 1],
                    ks.sc[2 * g + 1],
                    ks.sc[2 * g + 1],
                );
                lanes_sb = _mm256_add_epi32(lanes_sb, _mm256_mullo_epi32(sc, p));
                // Sums of the activation block's two halves.
                let s = to_array(lanes::<VNNI, false>(ones, act(ab)));
                let (b0, b1) = ((s[0] + s[1]) + (s[2] + s[3]), (s[4] + s[5]) + (s[6] + s[7]));
                bias[g] = 32 * (ks.sc[2 * g] * b0 + ks.sc[2 * g + 1] * b1);
            }
            let bias = _mm256_loadu_si256(bias.as_ptr() as *const __m256i);
            let l = _mm256_sub_epi32(lanes_sb, bias);
            let d = a[sb * 8].d * ks.d;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(l), acc);
        }
        let mut c = [0f32; 8];
        _mm256_storeu_ps(c.as_mut_ptr(), acc);
        hsum8(&c)
    }

    #[inline(always)]
    unsafe fn dispatch<const VNNI: bool>(ty: GgmlType, w: &[u8], a: &[BlockQ8], kernel: Kernel) -> f32 {
        match ty {
            GgmlType::Q4_0 => blocks32::<Q4_0, VNNI>(ty, w, a),
            GgmlType::Q4_1 => blocks32::<Q4_1, VNNI>(ty, w, a),
            GgmlType::Q5_0 => blocks32::<Q5_0, VNNI>(ty, w, a),
            GgmlType::Q8_0 => blocks32::<Q8_0, VNNI>(ty, w, a),
            GgmlType::Q4K => q4k::<VNNI>(w, a, kernel),
            GgmlType::Q6K => q6k::<VNNI>(w, a, kernel),
            // The integer lanes from vectors, the float steps the reference's.
            GgmlType::IQ4NL if kernel == Kernel::Tinyblas => super::dot_quant_body(ty, w, a, kernel),
            GgmlType::IQ4NL => pairs_order(ty, w, a, |wb, ab| {
                to_array(lanes::<VNNI, true>(IQ4NL::levels(wb.as_ptr(), 0), act(ab)))
            }),
            GgmlType::MXFP4 => pairs_order(ty, w, a, |wb, ab| {
                to_array(lanes::<VNNI, true>(MXFP4::levels(wb.as_ptr(), 0), act(ab)))
            }),
            GgmlType::Q2K => k_lanes_order(ty, w, a, |wb, j, ab| {
                to_array(lanes::<VNNI, false>(Q2K::levels(wb.as_ptr(), j), act(ab)))
            }),
            GgmlType::Q3K => k_lanes_order(ty, w, a, |wb, j, ab| {
                to_array(lanes::<VNNI, true>(Q3K::levels(wb.as_ptr(), j), act(ab)))
            }),
            GgmlType::Q5K => k_lanes_order(ty, w, a, |wb, j, ab| {
                to_array(lanes::<VNNI, false>(Q5K::levels(wb.as_ptr(), j), act(ab)))
            }),
            GgmlType::IQ4XS => k_lanes_order(ty, w, a, |wb, j, ab| {
                to_array(lanes::<VNNI, true>(IQ4XS::levels(wb.as_ptr(), j), act(ab)))
            }),
            _ => panic!("ggml::dot_quant: no ggml order for {ty}"),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_quant_avx2(ty: GgmlType, w: &[u8], a: &[BlockQ8], kernel: Kernel) -> f32 {
        dispatch::<false>(ty, w, a, kernel)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dot_quant_vnni(ty: GgmlType, w: &[u8], a: &[BlockQ8], kernel: Kernel) -> f32 {
        dispatch::<true>(ty, w, a, kernel)
    }
}

/// Row `r` of an embedding table as f32, dequantized as ggml's `get_rows`
/// does: its K-quant and minimum types compute `d * q - m` as one fused
/// multiply-add (snug's [`crate::quant::dequantize`] rounds the product
/// first); other types are the same either way.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), crate::quant::DequantError> {
    match ty {
        GgmlType::Q2K | GgmlType::Q4K | GgmlType::Q5K if src.len() * 256 == dst.len() * ty.type_size() => {
            for (b, y) in src.chunks_exact(ty.type_size()).zip(dst.chunks_exact_mut(256)) {
                let ks = k_scales(ty, b);
                for j in 0..8 {
                    let q = k_weights(ty, b, j);
                    for h in 0..2 {
                        let d1 = ks.d * ks.sc[2 * j + h] as f32;
                        let m1 = ks.dmin * ks.min[2 * j + h] as f32;
                        let at = 32 * j + 16 * h;
                        for (o, &v) in y[at..at + 16].iter_mut().zip(&q[16 * h..16 * h + 16]) {
                            *o = d1.mul_add(v as f32, -m1);
                        }
                    }
                }
            }
            Ok(())
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 if src.len() * 32 == dst.len() * ty.type_size() => {
            for (b, y) in src.chunks_exact(ty.type_size()).zip(dst.chunks_exact_mut(32)) {
                let u = unpack(ty, b, 0);
                let m = u.min.unwrap_or(0.0);
                for (o, &v) in y.iter_mut().zip(&u.w) {
                    *o = (v as f32).mul_add(u.scale, m);
                }
            }
            Ok(())
        }
        _ => crate::quant::dequantize(ty, src, dst),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_support::{weights, Rng};
    use crate::dot::{act_format, quantize_row};
    use crate::quant::dequantize;

    /// The types [`dot_quant`] orders.
    const TYPES: [GgmlType; 12] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q5K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::MXFP4,
    ];

    /// The kernels each type can take.
    fn kernels(ty: GgmlType) -> &'static [Kernel] {
        match ty {
            GgmlType::Q4K => &[Kernel::Single, Kernel::Gemm4],
            GgmlType::Q6K => &[Kernel::Single, Kernel::Tiled],
            GgmlType::IQ4NL => &[Kernel::Single, Kernel::Tinyblas],
            _ => &[Kernel::Single],
        }
    }

    #[test]
    fn dot_quant_equals_the_exact_product_of_the_quantized_values() {
        let mut rng = Rng(5);
        for ty in TYPES {
            assert!(dot_supports(ty));
            let n = 1024;
            for _ in 0..8 {
                let w = weights(ty, n, &mut rng);
                let x: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0).collect();
                let mut a = vec![BlockQ8::default(); n / QK8];
                quantize_row(act_format(ty), &x, &mut a);
                // The exact value of what the integers and scales encode.
                let mut wf = vec![0f32; n];
                dequantize(ty, &w, &mut wf).unwrap();
                let exact: f64 = match ty {
                    // q8_1's `s` stands in for `d * sum(q)` (rounded to f16).
                    GgmlType::Q4_1 => (0..n / QK8)
                        .map(|b| {
                            let u = unpack(ty, &w[b * ty.type_size()..(b + 1) * ty.type_size()], 0);
                            let isum: i64 = (0..QK8).map(|i| u.w[i] as i64 * a[b].qs[i] as i64).sum();
                            isum as f64 * u.scale as f64 * a[b].d as f64 + u.min.unwrap() as f64 * a[b].s as f64
                        })
                        .sum(),
                    _ => (0..n)
                        .map(|i| wf[i] as f64 * a[i / QK8].qs[i % QK8] as f64 * a[i / QK8].d as f64)
                        .sum(),
                };
                let scale: f64 = (0..n)
                    .map(|i| (wf[i] as f64 * x[i] as f64).abs())
                    .sum::<f64>()
                    .max(1e-6);
                for &k in kernels(ty) {
                    let got = dot_quant(ty, &w, &a, k) as f64;
                    assert!((got - exact).abs() <= 1e-5 * scale, "{ty} {k:?}: {got} vs {exact}");
                }
            }
        }
    }

    #[test]
    fn every_simd_level_gives_the_reference_bits() {
        let mut rng = Rng(17);
        let levels = crate::cpu::Simd::available();
        for ty in TYPES {
            for case in 0..12 {
                // An odd number of 32-element blocks too (a last block
                // outside IQ4_NL's and MXFP4's pairs).
                let odd = if ty.block_size() == QK8 { 32 * (case % 2) } else { 0 };
                let n = 256 * (1 + case % 3) + odd;
                let w = weights(ty, n, &mut rng);
                // Wide, narrow and saturating activations (levels of +-127).
                let x: Vec<f32> = (0..n)
                    .map(|i| match case % 4 {
                        0 => rng.f32() * 40.0,
                        1 => rng.f32() * 1e-3,
                        2 => [1.0, -1.0][i % 2],
                        _ => rng.f32(),
                    })
                    .collect();
                let mut a = vec![BlockQ8::default(); n / QK8];
                quantize_row(act_format(ty), &x, &mut a);
                for &k in kernels(ty) {
                    let want = dot_quant_with(crate::cpu::Simd::Scalar, ty, &w, &a, k);
                    for &level in &levels {
                        let got = dot_quant_with(level, ty, &w, &a, k);
                        assert_eq!(got.to_bits(), want.to_bits(), "{ty} {k:?} {level:?} case {case}");
                    }
                }
            }
        }
    }

    #[test]
    fn kernels_follow_llama_cpps_batch_rules() {
        // Q4_K: rows before the last multiple of 4 take gemm.
        let q4k: Vec<Kernel> = (0..7).map(|r| Kernel::for_row(GgmlType::Q4K, r, 7)).collect();
        assert_eq!(q4k[..4], [Kernel::Gemm4; 4]);
        assert_eq!(q4k[4..], [Kernel::Single; 3]);
        assert_eq!(Kernel::for_row(GgmlType::Q4K, 0, 1), Kernel::Single);
        // Q6_K: the tiled kernel from 8 rows on.
        assert_eq!(Kernel::for_row(GgmlType::Q6K, 0, 7), Kernel::Single);
        assert_eq!(Kernel::for_row(GgmlType::Q6K, 6, 8), Kernel::Tiled);
        // Other types sum alike in every kernel.
        assert_eq!(Kernel::for_row(GgmlType::Q8_0, 0, 64), Kernel::Single);
    }

    #[test]
    fn the_kernels_differ_only_in_rounding() {
        // The same row through gemv and gemm (or vec_dot and tiled) can
        // differ in its last bits, never by more.
        let mut rng = Rng(9);
        let (mut differ, mut total) = (0, 0);
        for ty in [GgmlType::Q4K, GgmlType::Q6K] {
            for _ in 0..32 {
                let w = weights(ty, 2048, &mut rng);
                let x: Vec<f32> = (0..2048).map(|_| rng.f32()).collect();
                let mut a = vec![BlockQ8::default(); 2048 / QK8];
                quantize_row(act_format(ty), &x, &mut a);
                let ks = kernels(ty);
                let (p, q) = (dot_quant(ty, &w, &a, ks[0]), dot_quant(ty, &w, &a, ks[1]));
                assert!((p - q).abs() <= 1e-5 * p.abs().max(1e-3), "{ty}: {p} vs {q}");
                total += 1;
                differ += usize::from(p != q);
            }
        }
        assert!(
            differ > 0,
            "the orders never differed in {total} rows: the test sees nothing"
        );
    }

    #[test]
    fn v_expf_is_within_two_ulps_of_exp_and_saturates() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (v_expf(x), (x as f64).exp());
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(((got as f64) - want).abs() <= 2.0 * ulp as f64, "{x}: {got} vs {want}");
            x += 0.013;
        }
        assert_eq!(v_expf(0.0), 1.0);
        assert_eq!(v_expf(-300.0), 0.0);
        assert_eq!(v_expf(300.0), f32::INFINITY);
    }

    #[test]
    fn silu_takes_the_library_exp_only_past_full_groups_of_16() {
        let x: Vec<f32> = (0..20).map(|i| i as f32 * 0.37 - 3.1).collect();
        let mut g = x.clone();
        silu_mul(&mut g, &[1.0; 20], 20);
        for (i, (&xi, &gi)) in x.iter().zip(&g).enumerate() {
            let e = if i < 16 { v_expf(0.0 - xi) } else { (-xi).exp() };
            assert_eq!(gi, xi / (1.0 + e), "element {i}");
        }
    }

    #[test]
    fn q4k_rows_dequantize_with_fused_multiply_adds() {
        let mut rng = Rng(3);
        let w = weights(GgmlType::Q4K, 512, &mut rng);
        let (mut fused, mut plain) = (vec![0f32; 512], vec![0f32; 512]);
        dequantize_row(GgmlType::Q4K, &w, &mut fused).unwrap();
        dequantize(GgmlType::Q4K, &w, &mut plain).unwrap();
        for (f, p) in fused.iter().zip(&plain) {
            assert!((f - p).abs() <= 1e-6 * p.abs().max(1e-3));
        }
        assert!(dequantize_row(GgmlType::Q4K, &w[..100], &mut fused).is_err());
    }

    #[test]
    fn numerics_names_round_trip() {
        for n in [Numerics::Native, Numerics::Ggml] {
            assert_eq!(Numerics::parse(n.name()), Some(n));
        }
        assert_eq!(Numerics::parse("llama.cpp"), Some(Numerics::Ggml));
        assert_eq!(Numerics::parse("fast"), None);
    }

    #[test]
    fn gelu_table_is_f16_and_tracks_the_function() {
        let mut g = vec![-12.0, -3.0, -0.5, 0.0, 0.001, 0.5, 1.0, 3.0, 9.99, 12.0];
        let x = g.clone();
        let up = vec![2.0; g.len()];
        gelu_mul(&mut g, &up);
        for (&x, &y) in x.iter().zip(&g) {
            let exact = 0.5
                * x as f64
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x as f64 + 0.044715 * (x as f64).powi(3))).tanh());
            let want = if x <= -10.0 { 0.0 } else { 2.0 * exact };
            // f16 input and output: relative error within two f16 steps.
            assert!(
                (y as f64 - want).abs() <= 2e-3 * want.abs().max(1e-3),
                "x {x}: {y} vs {want}"
            );
            if (-10.0..10.0).contains(&x) {
                assert_eq!(round_f16(y / 2.0), y / 2.0, "x {x}: table value is an f16");
            }
        }
    }

    #[test]
    fn dot_f16_matches_a_plain_sum_closely_and_handles_tails() {
        for n in [1, 63, 64, 128, 200, 256] {
            let x: Vec<f32> = (0..n).map(|i| round_f16(((i * 37 % 23) as f32 - 11.0) / 7.0)).collect();
            let y: Vec<f32> = (0..n).map(|i| round_f16(((i * 17 % 19) as f32 - 9.0) / 5.0)).collect();
            let exact: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
            let got = dot_f16(&x, &y) as f64;
            assert!(
                (got - exact).abs() <= 1e-5 * exact.abs().max(1.0),
                "n {n}: {got} vs {exact}"
            );
        }
    }

    #[test]
    fn rms_norm_sums_in_f64() {
        let mut x = vec![3.0f32, 4.0, 0.0, 0.0];
        rms_norm(&mut x, &[1.0, 2.0, 1.0, 1.0], 0.0);
        // mean of squares 25 / 4, scale 0.4.
        assert_eq!(x, vec![1.2, 3.2, 0.0, 0.0]);
    }

    #[test]
    fn online_head_equals_softmax_weighted_sum() {
        let scores = [0.5f32, 2.0, -1.0, 2.5];
        let values: Vec<Vec<f32>> = (0..4).map(|i| vec![i as f32, 1.0]).collect();
        for f16 in [false, true] {
            let mut acc = vec![0.0; 2];
            let mut h = OnlineHead {
                acc: &mut acc,
                max: f32::NEG_INFINITY,
                sum: 0.0,
                f16,
            };
            for (s, v) in scores.iter().zip(&values) {
                h.push(*s, v);
            }
            let mut out = vec![0.0; 2];
            h.finish(&mut out);
            let m = 2.5f64;
            let w: Vec<f64> = scores.iter().map(|&s| (s as f64 - m).exp()).collect();
            let z: f64 = w.iter().sum();
            let want0: f64 = w.iter().enumerate().map(|(i, w)| w * i as f64).sum::<f64>() / z;
            let tol = if f16 { 2e-3 } else { 1e-6 };
            assert!((out[0] as f64 - want0).abs() < tol * want0, "{out:?} vs {want0}");
            assert!((out[1] as f64 - 1.0).abs() < tol, "{out:?}");
        }
    }
}
