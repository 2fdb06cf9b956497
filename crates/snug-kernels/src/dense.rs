//! Dense matrix products for weights stored as f16 or f32 (encoder
//! checkpoints in safetensors), with f32 activations and f32 results.
//!
//! Activations are not quantized: these weights come from checkpoints
//! whose reference runs in float32, and the answers are held to it. Every
//! output `out[r][o] = sum_k x[r][k] * w[o][k]` is computed in one fixed
//! order: eight lanes, lane `j` accumulating elements `k = 8i + j` with
//! fused multiply-adds, the lanes summed as `((l0+l4)+(l2+l6)) +
//! ((l1+l5)+(l3+l7))`, then the `cols % 8` tail added one fused
//! multiply-add at a time. That order depends only on the output itself,
//! so a row's results are bitwise the same whatever the batch width, the
//! row's place in it, the tile it lands in, the thread count, or the SIMD
//! level (the AVX2 and AVX-512 paths are tested bitwise against the scalar
//! one).

use half::f16;

use crate::cpu::{simd, Simd};
use crate::pool::ThreadPool;

/// The elements of a dense weight matrix.
#[derive(Clone, Copy, Debug)]
pub enum DenseData<'a> {
    F16(&'a [u16]),
    F32(&'a [f32]),
}

/// A row-major `rows x cols` weight matrix: `rows` output features of
/// `cols` inputs each (PyTorch's `nn.Linear` layout).
#[derive(Clone, Copy, Debug)]
pub struct Dense<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: DenseData<'a>,
}

impl<'a> Dense<'a> {
    /// Row `r` widened to f32 into `out` (embedding lookups).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let k = self.cols;
        match self.data {
            DenseData::F16(d) => {
                for (o, &h) in out.iter_mut().zip(&d[r * k..(r + 1) * k]) {
                    *o = f16::from_bits(h).to_f32();
                }
            }
            DenseData::F32(d) => out.copy_from_slice(&d[r * k..(r + 1) * k]),
        }
    }

    pub fn bytes(&self) -> usize {
        match self.data {
            DenseData::F16(d) => d.len() * 2,
            DenseData::F32(d) => d.len() * 4,
        }
    }
}

/// Output features a task takes.
const FEATURES_PER_TASK: usize = 16;
/// Activation rows a tile covers.
const TILE_ROWS: usize = 4;
/// Output features a tile covers on AVX2 and the scalar path.
const TILE_OUTS: usize = 3;
/// Output features a tile covers on AVX-512 (four pairs, each pair's two
/// eight-lane chains in the halves of one register).
const TILE_OUTS_512: usize = 8;

/// A tile's results: `[activation row][output]`.
type Tile = [[f32; TILE_OUTS_512]; TILE_ROWS];

use crate::pool::SendPtr;

/// `out` (`n_rows x w.rows`) = `x` (`n_rows x w.cols`) times `w` transposed.
pub fn dense_matmul(pool: &ThreadPool, w: &Dense, x: &[f32], n_rows: usize, out: &mut [f32]) {
    dense_matmul_with(simd(), pool, w, x, n_rows, out)
}

/// [`dense_matmul`] on a chosen SIMD level (for tests and benchmarks).
pub fn dense_matmul_with(level: Simd, pool: &ThreadPool, w: &Dense, x: &[f32], n_rows: usize, out: &mut [f32]) {
    let (k, n) = (w.cols, w.rows);
    assert_eq!(x.len(), n_rows * k, "dense_matmul: input shape");
    assert_eq!(out.len(), n_rows * n, "dense_matmul: output shape");
    match w.data {
        DenseData::F16(d) => assert_eq!(d.len(), n * k, "dense_matmul: weight shape"),
        DenseData::F32(d) => assert_eq!(d.len(), n * k, "dense_matmul: weight shape"),
    }
    let out_ptr = SendPtr(out.as_mut_ptr());
    let tile_outs = if level >= Simd::Avx512Vnni {
        TILE_OUTS_512
    } else {
        TILE_OUTS
    };
    let tasks = n.div_ceil(FEATURES_PER_TASK);
    pool.run(tasks, &|t| {
        let op = &out_ptr;
        let (o0, o1) = (t * FEATURES_PER_TASK, ((t + 1) * FEATURES_PER_TASK).min(n));
        for r0 in (0..n_rows).step_by(TILE_ROWS) {
            let nr = TILE_ROWS.min(n_rows - r0);
            let mut o = o0;
            while o < o1 {
                let no = tile_outs.min(o1 - o);
                let mut res = [[0f32; TILE_OUTS_512]; TILE_ROWS];
                tile(level, w, o, no, x, r0, nr, &mut res);
                for (r, row) in res.iter().enumerate().take(nr) {
                    for (j, &v) in row.iter().enumerate().take(no) {
                        // SAFETY: each (r, o) is written by exactly one task.
                        unsafe { *op.0.add((r0 + r) * n + o + j) = v };
                    }
                }
                o += no;
            }
        }
    });
}

/// The products of weight rows `o..o + no` with activation rows
/// `r0..r0 + nr`, into `res[row][output]`.
#[allow(clippy::too_many_arguments)]
fn tile(level: Simd, w: &Dense, o: usize, no: usize, x: &[f32], r0: usize, nr: usize, res: &mut Tile) {
    let k = w.cols;
    #[cfg(target_arch = "x86_64")]
    if level >= Simd::Avx512Vnni {
        // SAFETY: the level is only >= Avx512Vnni where the CPU has
        // AVX-512 F/BW/VL on top of AVX2, FMA and F16C.
        unsafe {
            let xs = &x[r0 * k..(r0 + nr) * k];
            match w.data {
                DenseData::F16(d) => avx512::tile_f16(&d[o * k..(o + no) * k], xs, k, no, nr, res),
                DenseData::F32(d) => avx512::tile_f32(&d[o * k..(o + no) * k], xs, k, no, nr, res),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if level >= Simd::Avx2 {
        // SAFETY: the level is only >= Avx2 where the CPU has AVX2, FMA
        // and F16C (`Simd::detect`); the slices cover the rows named.
        unsafe {
            let xs = &x[r0 * k..(r0 + nr) * k];
            match w.data {
                DenseData::F16(d) => avx2::tile_f16(&d[o * k..(o + no) * k], xs, k, no, nr, res),
                DenseData::F32(d) => avx2::tile_f32(&d[o * k..(o + no) * k], xs, k, no, nr, res),
            }
        }
        return;
    }
    let _ = level;
    for r in 0..nr {
        let xr = &x[(r0 + r) * k..(r0 + r + 1) * k];
        for (j, slot) in res[r].iter_mut().enumerate().take(no) {
            let oo = o + j;
            *slot = match w.data {
                DenseData::F16(d) => dot_f16_scalar(&d[oo * k..(oo + 1) * k], xr),
                DenseData::F32(d) => dot_f32_scalar(&d[oo * k..(oo + 1) * k], xr),
            };
        }
    }
}

fn reduce_lanes(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// The reference dot product of an f16 weight row and an f32 row.
pub fn dot_f16_scalar(w: &[u16], x: &[f32]) -> f32 {
    let k = x.len();
    let body = k - k % 8;
    let mut l = [0f32; 8];
    for i in (0..body).step_by(8) {
        for j in 0..8 {
            l[j] = x[i + j].mul_add(f16::from_bits(w[i + j]).to_f32(), l[j]);
        }
    }
    let mut s = reduce_lanes(&l);
    for i in body..k {
        s = x[i].mul_add(f16::from_bits(w[i]).to_f32(), s);
    }
    s
}

/// The reference dot product of two f32 rows, in the order of this module.
pub fn dot_f32_scalar(w: &[f32], x: &[f32]) -> f32 {
    let k = x.len();
    let body = k - k % 8;
    let mut l = [0f32; 8];
    for i in (0..body).step_by(8) {
        for j in 0..8 {
            l[j] = x[i + j].mul_add(w[i + j], l[j]);
        }
    }
    let mut s = reduce_lanes(&l);
    for i in body..k {
        s = x[i].mul_add(w[i], s);
    }
    s
}

/// [`dot_f32_scalar`] on the best SIMD level (attention's products).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd() >= Simd::Avx2 {
        let mut res = [[0f32; TILE_OUTS_512]; TILE_ROWS];
        // SAFETY: AVX2/FMA present (see `tile`).
        unsafe { avx2::tile_f32(a, b, a.len(), 1, 1, &mut res) };
        return res[0][0];
    }
    dot_f32_scalar(a, b)
}

/// `y += a * x`, one fused multiply-add per element.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd() >= Simd::Avx2 {
        // SAFETY: AVX2/FMA present (see `tile`).
        unsafe { avx2::axpy(y, a, x) };
        return;
    }
    for (y, &x) in y.iter_mut().zip(x) {
        *y = a.mul_add(x, *y);
    }
}

/// Attention for one query: `out = sum_j e^(s_j - m) v_j / sum_j e^(s_j - m)`
/// with `s_j = dot(q, k_j) * scale` over the `n = scores.len()` rows of
/// `k` and `v` (each `hd` wide), `m` the largest score. Each score is this
/// module's dot product; exponentials are [`crate::ops::exp_fixed`]; the
/// sums and the weighted sum of values run in key order, one fused
/// multiply-add per element. `scores` is scratch.
pub fn attend(q: &[f32], k: &[f32], v: &[f32], scale: f32, scores: &mut [f32], out: &mut [f32]) {
    attend_with(simd(), q, k, v, scale, scores, out)
}

/// [`attend`] on a chosen SIMD level.
pub fn attend_with(level: Simd, q: &[f32], k: &[f32], v: &[f32], scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let hd = q.len();
    let n = scores.len();
    assert!(
        k.len() >= n * hd && v.len() >= n * hd && out.len() == hd,
        "attend: shapes"
    );
    #[cfg(target_arch = "x86_64")]
    if level >= Simd::Avx2 {
        // SAFETY: AVX2/FMA present (see `tile`); shapes checked above.
        unsafe { avx2::attend(q, k, v, scale, scores, out) };
        return;
    }
    let _ = level;
    let mut m = f32::NEG_INFINITY;
    for (j, s) in scores.iter_mut().enumerate() {
        *s = dot_f32_scalar(&k[j * hd..(j + 1) * hd], q) * scale;
        m = m.max(*s);
    }
    finish_attend(m, v, scores, out);
}

/// Exponentials, their sum, and the weighted sum of values (shared by
/// both levels; the compiler vectorizes it where the caller enables AVX2).
#[inline(always)]
fn finish_attend(m: f32, v: &[f32], scores: &mut [f32], out: &mut [f32]) {
    let hd = out.len();
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = crate::ops::exp_fixed(*s - m);
        sum += *s;
    }
    out.iter_mut().for_each(|o| *o = 0.0);
    for (j, &p) in scores.iter().enumerate() {
        for (o, &x) in out.iter_mut().zip(&v[j * hd..(j + 1) * hd]) {
            *o = p.mul_add(x, *o);
        }
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Tile, TILE_OUTS, TILE_ROWS};

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // lanes (l0+l4, l1+l5, l2+l6, l3+l7), then ((0+2), (1+3)), then
        // their sum: the scalar `reduce_lanes` order.
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)))
    }

    /// Loads eight weights of one row as f32.
    trait Weights: Copy {
        unsafe fn load8(p: *const Self) -> __m256;
        unsafe fn get(p: *const Self) -> f32;
    }

    impl Weights for u16 {
        #[inline(always)]
        unsafe fn load8(p: *const u16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
        #[inline(always)]
        unsafe fn get(p: *const u16) -> f32 {
            half::f16::from_bits(*p).to_f32()
        }
    }

    impl Weights for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn get(p: *const f32) -> f32 {
            *p
        }
    }

    /// `R x O` products, each one 8-lane fused chain over `k` (the
    /// module's order), written to `res[r][o]`.
    #[inline(always)]
    unsafe fn block<W: Weights, const R: usize, const O: usize>(w: *const W, x: *const f32, k: usize, res: &mut Tile) {
        let body = k - k % 8;
        let mut acc = [[_mm256_setzero_ps(); O]; R];
        let mut i = 0;
        while i < body {
            let mut wv = [_mm256_setzero_ps(); O];
            for (o, v) in wv.iter_mut().enumerate() {
                *v = W::load8(w.add(o * k + i));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(r * k + i));
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, *v, *a);
                }
            }
            i += 8;
        }
        for (r, row) in acc.iter().enumerate() {
            for (o, a) in row.iter().enumerate() {
                let mut s = hsum(*a);
                for j in body..k {
                    s = (*x.add(r * k + j)).mul_add(W::get(w.add(o * k + j)), s);
                }
                res[r][o] = s;
            }
        }
    }

    #[inline(always)]
    unsafe fn dispatch<W: Weights>(w: *const W, x: *const f32, k: usize, no: usize, nr: usize, res: &mut Tile) {
        match (nr, no) {
            (4, 3) => block::<W, 4, 3>(w, x, k, res),
            (4, 2) => block::<W, 4, 2>(w, x, k, res),
            (4, 1) => block::<W, 4, 1>(w, x, k, res),
            (3, 3) => block::<W, 3, 3>(w, x, k, res),
            (3, 2) => block::<W, 3, 2>(w, x, k, res),
            (3, 1) => block::<W, 3, 1>(w, x, k, res),
            (2, 3) => block::<W, 2, 3>(w, x, k, res),
            (2, 2) => block::<W, 2, 2>(w, x, k, res),
            (2, 1) => block::<W, 2, 1>(w, x, k, res),
            (1, 3) => block::<W, 1, 3>(w, x, k, res),
            (1, 2) => block::<W, 1, 2>(w, x, k, res),
            _ => block::<W, 1, 1>(w, x, k, res),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_f16(w: &[u16], x: &[f32], k: usize, no: usize, nr: usize, res: &mut Tile) {
        debug_assert!(w.len() >= no * k && x.len() >= nr * k && no <= TILE_OUTS && nr <= TILE_ROWS);
        dispatch(w.as_ptr(), x.as_ptr(), k, no, nr, res)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_f32(w: &[f32], x: &[f32], k: usize, no: usize, nr: usize, res: &mut Tile) {
        debug_assert!(w.len() >= no * k && x.len() >= nr * k && no <= TILE_OUTS && nr <= TILE_ROWS);
        dispatch(w.as_ptr(), x.as_ptr(), k, no, nr, res)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn attend(q: &[f32], k: &[f32], v: &[f32], scale: f32, scores: &mut [f32], out: &mut [f32]) {
        let hd = q.len();
        let n = scores.len();
        let mut res: Tile = [[0.0; super::TILE_OUTS_512]; TILE_ROWS];
        let mut m = f32::NEG_INFINITY;
        let mut j = 0;
        while j < n {
            let no = TILE_OUTS.min(n - j);
            dispatch(k.as_ptr().add(j * hd), q.as_ptr(), hd, no, 1, &mut res);
            for (o, &r) in res[0].iter().enumerate().take(no) {
                let s = r * scale;
                scores[j + o] = s;
                m = m.max(s);
            }
            j += no;
        }
        super::finish_attend(m, v, scores, out);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let k = y.len().min(x.len());
        let body = k - k % 8;
        let av = _mm256_set1_ps(a);
        let (yp, xp) = (y.as_mut_ptr(), x.as_ptr());
        let mut i = 0;
        while i < body {
            _mm256_storeu_ps(
                yp.add(i),
                _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i))),
            );
            i += 8;
        }
        for j in body..k {
            *yp.add(j) = a.mul_add(*xp.add(j), *yp.add(j));
        }
    }
}

/// The AVX-512 tile: outputs in pairs, output `2p` in the low eight lanes
/// of a register and `2p + 1` in the high eight, each activation block
/// broadcast to both halves. Every lane does what the AVX2 lane does (the
/// same elements, the same fused multiply-adds in the same order, the
/// same reduction of eight lanes), so results are bitwise the AVX2 and
/// scalar ones; a register does two outputs' work per instruction.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Tile, TILE_OUTS_512, TILE_ROWS};

    /// The module's eight-lane reduction (as `avx2::hsum`).
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)))
    }

    /// Eight weights of row `a` in the low half and of row `b` in the high.
    trait Weights: Copy {
        unsafe fn load_pair(a: *const Self, b: *const Self) -> __m512;
        unsafe fn get(p: *const Self) -> f32;
    }

    impl Weights for u16 {
        #[inline(always)]
        unsafe fn load_pair(a: *const u16, b: *const u16) -> __m512 {
            let h = _mm256_set_m128i(
                _mm_loadu_si128(b as *const __m128i),
                _mm_loadu_si128(a as *const __m128i),
            );
            _mm512_cvtph_ps(h)
        }
        #[inline(always)]
        unsafe fn get(p: *const u16) -> f32 {
            half::f16::from_bits(*p).to_f32()
        }
    }

    impl Weights for f32 {
        #[inline(always)]
        unsafe fn load_pair(a: *const f32, b: *const f32) -> __m512 {
            let lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
            _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(b)), 1))
        }
        #[inline(always)]
        unsafe fn get(p: *const f32) -> f32 {
            *p
        }
    }

    /// `R` rows times `P` pairs of outputs; `w[o]` points at output `o`'s
    /// row (an odd count repeats the last row in the spare half, whose
    /// result is dropped).
    #[inline(always)]
    unsafe fn block<W: Weights, const R: usize, const P: usize>(
        w: &[*const W; TILE_OUTS_512],
        x: *const f32,
        k: usize,
        no: usize,
        res: &mut Tile,
    ) {
        let body = k - k % 8;
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let mut i = 0;
        while i < body {
            let mut wv = [_mm512_setzero_ps(); P];
            for (p, v) in wv.iter_mut().enumerate() {
                *v = W::load_pair(w[2 * p].add(i), w[2 * p + 1].add(i));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let x8 = _mm256_castps_pd(_mm256_loadu_ps(x.add(r * k + i)));
                let xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(x8));
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, *v, *a);
                }
            }
            i += 8;
        }
        for (r, row) in acc.iter().enumerate() {
            for (p, a) in row.iter().enumerate() {
                let halves = [
                    _mm512_castps512_ps256(*a),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(*a), 1)),
                ];
                for (h, half) in halves.iter().enumerate() {
                    let o = 2 * p + h;
                    if o >= no {
                        break;
                    }
                    let mut s = hsum(*half);
                    for j in body..k {
                        s = (*x.add(r * k + j)).mul_add(W::get(w[o].add(j)), s);
                    }
                    res[r][o] = s;
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn dispatch<W: Weights>(w: *const W, x: *const f32, k: usize, no: usize, nr: usize, res: &mut Tile) {
        let rows: [*const W; TILE_OUTS_512] = std::array::from_fn(|o| w.add(o.min(no - 1) * k));
        let w = &rows;
        match (nr, no.div_ceil(2)) {
            (4, 4) => block::<W, 4, 4>(w, x, k, no, res),
            (4, 3) => block::<W, 4, 3>(w, x, k, no, res),
            (4, 2) => block::<W, 4, 2>(w, x, k, no, res),
            (4, _) => block::<W, 4, 1>(w, x, k, no, res),
            (3, 4) => block::<W, 3, 4>(w, x, k, no, res),
            (3, 3) => block::<W, 3, 3>(w, x, k, no, res),
            (3, 2) => block::<W, 3, 2>(w, x, k, no, res),
            (3, _) => block::<W, 3, 1>(w, x, k, no, res),
            (2, 4) => block::<W, 2, 4>(w, x, k, no, res),
            (2, 3) => block::<W, 2, 3>(w, x, k, no, res),
            (2, 2) => block::<W, 2, 2>(w, x, k, no, res),
            (2, _) => block::<W, 2, 1>(w, x, k, no, res),
            (_, 4) => block::<W, 1, 4>(w, x, k, no, res),
            (_, 3) => block::<W, 1, 3>(w, x, k, no, res),
            (_, 2) => block::<W, 1, 2>(w, x, k, no, res),
            _ => block::<W, 1, 1>(w, x, k, no, res),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn tile_f16(w: &[u16], x: &[f32], k: usize, no: usize, nr: usize, res: &mut Tile) {
        debug_assert!(w.len() >= no * k && x.len() >= nr * k && (1..=TILE_OUTS_512).contains(&no) && nr <= TILE_ROWS);
        dispatch(w.as_ptr(), x.as_ptr(), k, no, nr, res)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn tile_f32(w: &[f32], x: &[f32], k: usize, no: usize, nr: usize, res: &mut Tile) {
        debug_assert!(w.len() >= no * k && x.len() >= nr * k && (1..=TILE_OUTS_512).contains(&no) && nr <= TILE_ROWS);
        dispatch(w.as_ptr(), x.as_ptr(), k, no, nr, res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn simd_paths_equal_the_reference_bitwise_for_any_batch_width() {
        let pool = ThreadPool::new(2);
        let mut seed = 5;
        for &(rows, cols) in &[(37usize, 64usize), (20, 100), (5, 7), (33, 260)] {
            let w32: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            let w16: Vec<u16> = w32.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
            let n = 9;
            let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut seed)).collect();
            for data in [DenseData::F16(&w16), DenseData::F32(&w32)] {
                let w = Dense { rows, cols, data };
                let mut want = vec![0f32; n * rows];
                dense_matmul_with(Simd::Scalar, &pool, &w, &x, n, &mut want);
                for (r, row) in want.chunks(rows).enumerate() {
                    for (o, &v) in row.iter().enumerate() {
                        let xr = &x[r * cols..(r + 1) * cols];
                        let refv = match data {
                            DenseData::F16(d) => dot_f16_scalar(&d[o * cols..(o + 1) * cols], xr),
                            DenseData::F32(d) => dot_f32_scalar(&d[o * cols..(o + 1) * cols], xr),
                        };
                        assert_eq!(v.to_bits(), refv.to_bits());
                    }
                }
                for level in Simd::available() {
                    for width in [1, 2, 3, 4, 5, 9] {
                        let mut got = vec![0f32; width * rows];
                        dense_matmul_with(level, &pool, &w, &x[..width * cols], width, &mut got);
                        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{level:?} width {width} {rows}x{cols}");
                    }
                }
            }
        }
    }

    #[test]
    fn attention_for_one_query_matches_the_reference_on_every_level() {
        let mut seed = 3;
        for &(n, hd) in &[(1usize, 64usize), (7, 32), (130, 48), (5, 20)] {
            let q: Vec<f32> = (0..hd).map(|_| lcg(&mut seed)).collect();
            let k: Vec<f32> = (0..n * hd).map(|_| lcg(&mut seed)).collect();
            let v: Vec<f32> = (0..n * hd).map(|_| lcg(&mut seed)).collect();
            let mut want = vec![0f32; hd];
            attend_with(Simd::Scalar, &q, &k, &v, 0.125, &mut vec![0f32; n], &mut want);
            // Against a plain f64 softmax, loosely.
            let s: Vec<f64> = (0..n)
                .map(|j| (0..hd).map(|c| q[c] as f64 * k[j * hd + c] as f64).sum::<f64>() * 0.125)
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..hd {
                let r: f64 = (0..n).map(|j| e[j] * v[j * hd + c] as f64).sum::<f64>() / z;
                assert!((want[c] as f64 - r).abs() < 1e-5, "{n}x{hd}: {} vs {r}", want[c]);
            }
            for level in Simd::available() {
                let mut got = vec![0f32; hd];
                attend_with(level, &q, &k, &v, 0.125, &mut vec![0f32; n], &mut got);
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{level:?} {n}x{hd}"
                );
            }
        }
    }

    #[test]
    fn dot_and_axpy_match_their_references() {
        let mut seed = 9;
        let a: Vec<f32> = (0..77).map(|_| lcg(&mut seed)).collect();
        let b: Vec<f32> = (0..77).map(|_| lcg(&mut seed)).collect();
        assert_eq!(dot_f32(&a, &b).to_bits(), dot_f32_scalar(&a, &b).to_bits());
        let mut y = b.clone();
        axpy(&mut y, 0.37, &a);
        for i in 0..77 {
            assert_eq!(y[i].to_bits(), 0.37f32.mul_add(a[i], b[i]).to_bits());
        }
    }
}
