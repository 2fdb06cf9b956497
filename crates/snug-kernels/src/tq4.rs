//! TQ4, a 4-bit format for key and value vectors: per vector a scale (f16)
//! and, for each coordinate of the vector rotated by a fixed random-sign
//! Hadamard transform, a 4-bit code into a 16-level Lloyd-Max codebook.
//!
//! Why it works: a unit vector rotated by a random orthogonal transform
//! looks like a uniformly random unit vector, whose coordinates all follow
//! one known distribution, with density proportional to
//! `(1 - x²)^((d - 3) / 2)` on [-1, 1] in dimension `d` (about a normal of
//! variance 1/d). One codebook, optimal for that distribution, then fits
//! every coordinate of every vector, with no per-block scales: the format
//! costs `d / 2 + 2` bytes a vector, 25.4–26.6% of f16 at `d` = 256–64.
//! The rotation is `R = H D / √d` (`D`: random signs, seeded per layer and
//! head; `H`: the Walsh-Hadamard matrix), orthogonal, applied in
//! `O(d log d)`; spikes in a few coordinates (common in keys) are spread
//! over all of them.
//!
//! Attention never rotates a stored vector back: `q·k = (R q)·(R k)`, so a
//! query is rotated once per head and scored against codes directly, and
//! values are summed in the rotated domain and rotated back once per head.
//!
//! The codebook is derived here, not pasted: Lloyd's algorithm on the
//! density above, integrated numerically in f64 on a fine grid (see
//! [`codebook`]).

use std::sync::OnceLock;

/// Levels of the codebook.
pub const LEVELS: usize = 16;

/// Bytes of one encoded vector of `d` elements: 4-bit codes and an f16
/// scale.
pub const fn vector_bytes(d: usize) -> usize {
    d / 2 + 2
}

/// Whether TQ4 handles vectors of `d` elements (a power of two, 4 to 4096:
/// the Hadamard transform needs one).
pub fn supports_dim(d: usize) -> bool {
    d.is_power_of_two() && (4..=4096).contains(&d)
}

/// The 16-level Lloyd-Max codebook for a coordinate of a random unit vector
/// in dimension `d`, ascending (symmetric about 0).
///
/// Lloyd's algorithm: start from quantiles, then alternate (1) each
/// boundary is the midpoint of its two levels and (2) each level is the
/// mean of the density over its cell, until levels move by less than 1e-12.
/// Means are integrals of `x (1 - x²)^((d-3)/2)` over the cell, computed by
/// the trapezoid rule on 2^16 + 1 points of [-1, 1], in f64.
pub fn codebook(d: usize) -> &'static [f32; LEVELS] {
    // One slot per supported dimension (powers of two 4..=4096), filled on
    // first use; later calls read it without a lock (attention asks for
    // the codebook once per stored vector it reads).
    static BOOKS: [OnceLock<[f32; LEVELS]>; 11] = [const { OnceLock::new() }; 11];
    assert!(supports_dim(d), "tq4: dimension {d} is not a power of two in 4..=4096");
    BOOKS[d.trailing_zeros() as usize - 2].get_or_init(|| derive_codebook(d))
}

fn derive_codebook(d: usize) -> [f32; LEVELS] {
    assert!(d >= 4, "tq4: dimension {d} too small");
    let n = (1 << 16) + 1;
    let xs: Vec<f64> = (0..n).map(|i| -1.0 + 2.0 * i as f64 / (n - 1) as f64).collect();
    let e = (d as f64 - 3.0) / 2.0;
    let pdf: Vec<f64> = xs.iter().map(|&x| (1.0 - x * x).max(0.0).powf(e)).collect();
    // Cumulative integrals of pdf and x * pdf (trapezoids).
    let h = 2.0 / (n - 1) as f64;
    let mut cm = vec![0f64; n];
    let mut cx = vec![0f64; n];
    for i in 1..n {
        cm[i] = cm[i - 1] + 0.5 * h * (pdf[i] + pdf[i - 1]);
        cx[i] = cx[i - 1] + 0.5 * h * (xs[i] * pdf[i] + xs[i - 1] * pdf[i - 1]);
    }
    let total = cm[n - 1];
    // Index of the grid point nearest to x.
    let at = |x: f64| (((x + 1.0) / h).round() as usize).min(n - 1);
    // Start: centres of 16 equal-probability cells.
    let mut levels = [0f64; LEVELS];
    for (k, l) in levels.iter_mut().enumerate() {
        let target = (k as f64 + 0.5) / LEVELS as f64 * total;
        let i = cm.partition_point(|&c| c < target).min(n - 1);
        *l = xs[i];
    }
    for _ in 0..10_000 {
        let mut bounds = [0usize; LEVELS + 1];
        bounds[0] = 0;
        bounds[LEVELS] = n - 1;
        for k in 1..LEVELS {
            bounds[k] = at(0.5 * (levels[k - 1] + levels[k]));
        }
        let mut moved = 0f64;
        for k in 0..LEVELS {
            let (a, b) = (bounds[k], bounds[k + 1]);
            let mass = cm[b] - cm[a];
            if mass > 0.0 {
                let m = (cx[b] - cx[a]) / mass;
                moved = moved.max((m - levels[k]).abs());
                levels[k] = m;
            }
        }
        if moved < 1e-12 {
            break;
        }
    }
    // Exact symmetry (the density is even).
    let mut out = [0f32; LEVELS];
    for k in 0..LEVELS / 2 {
        let v = 0.5 * (levels[LEVELS - 1 - k] - levels[k]);
        out[k] = -v as f32;
        out[LEVELS - 1 - k] = v as f32;
    }
    out
}

/// The random signs of the rotation for (`layer`, `head`): bit i of the
/// returned words is coordinate i's sign (1 = negate). SplitMix64 of the
/// pair, fixed forever (an encoded cache is only valid with its signs).
pub fn signs(layer: usize, head: usize, d: usize) -> Vec<u64> {
    let mut state = 0x5155_4e47_5451_3400u64 ^ ((layer as u64) << 32) ^ head as u64;
    (0..d.div_ceil(64))
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        })
        .collect()
}

/// In-place Walsh-Hadamard transform (unnormalized), butterflies in a
/// fixed order.
fn hadamard(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

fn apply_signs(x: &mut [f32], signs: &[u64]) {
    for (i, v) in x.iter_mut().enumerate() {
        if (signs[i / 64] >> (i % 64)) & 1 == 1 {
            *v = -*v;
        }
    }
}

/// `x ← R x` with `R = H D / √d`.
pub fn rotate(x: &mut [f32], signs: &[u64]) {
    apply_signs(x, signs);
    hadamard(x);
    let s = 1.0 / (x.len() as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

/// `y ← Rᵀ y = D H y / √d`.
pub fn rotate_back(y: &mut [f32], signs: &[u64]) {
    hadamard(y);
    let s = 1.0 / (y.len() as f32).sqrt();
    y.iter_mut().for_each(|v| *v *= s);
    apply_signs(y, signs);
}

/// Encodes `x` (length `d`) into `codes` (`d / 2` bytes, element 2i in the
/// low nibble of byte i) and returns the vector's scale: the rotated unit
/// vector's coordinates each take their nearest level, and the scale is the
/// least-squares fit of the levels to the rotated vector (`⟨Rx, c⟩ / ‖c‖²`),
/// so that `scale * c` is the closest multiple of the codes to `R x`.
/// `work` is scratch of length `d`.
pub fn encode(x: &[f32], signs: &[u64], codes: &mut [u8], work: &mut [f32]) -> f32 {
    let d = x.len();
    let book = codebook(d);
    work.copy_from_slice(x);
    rotate(work, signs);
    let norm = work.iter().map(|v| v * v).sum::<f32>().sqrt();
    if norm == 0.0 || !norm.is_finite() {
        codes.fill(0x88);
        return 0.0;
    }
    // Cell boundaries: midpoints between levels.
    let mut bounds = [0f32; LEVELS - 1];
    for k in 0..LEVELS - 1 {
        bounds[k] = 0.5 * (book[k] + book[k + 1]);
    }
    let inv = 1.0 / norm;
    let (mut dot, mut sq) = (0f32, 0f32);
    for (i, &v) in work.iter().enumerate() {
        let u = v * inv;
        let c = bounds.partition_point(|&b| b < u);
        let l = book[c];
        dot += v * l;
        sq += l * l;
        let byte = &mut codes[i / 2];
        if i % 2 == 0 {
            *byte = (*byte & 0xf0) | c as u8;
        } else {
            *byte = (*byte & 0x0f) | ((c as u8) << 4);
        }
    }
    if sq > 0.0 {
        dot / sq
    } else {
        0.0
    }
}

/// The rotated-domain vector `scale * c` of an encoded vector, into `out`.
pub fn decode_rotated(codes: &[u8], scale: f32, out: &mut [f32]) {
    let book = codebook(out.len());
    for (i, o) in out.iter_mut().enumerate() {
        let c = (codes[i / 2] >> (4 * (i % 2))) & 0x0f;
        *o = scale * book[c as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codebook_is_symmetric_ascending_and_near_the_gaussian_one() {
        let mut outers = Vec::new();
        for d in [64, 128, 256] {
            let c = codebook(d);
            assert!(c.windows(2).all(|w| w[0] < w[1]), "{d}: {c:?}");
            for k in 0..LEVELS {
                assert_eq!(c[k], -c[LEVELS - 1 - k]);
            }
            // About a normal of variance 1/d, with lighter tails (the
            // support ends at ±1): the outer level, scaled by √d, is below
            // the 2.733 of a 16-level Lloyd-Max quantizer of N(0, 1) and
            // approaches it as d grows.
            let outer = c[LEVELS - 1] * (d as f32).sqrt();
            assert!(outer < 2.733 && outer > 2.55, "{d}: outer level {outer}");
            outers.push(outer);
        }
        assert!(outers.windows(2).all(|w| w[0] < w[1]), "{outers:?}");
    }

    #[test]
    fn rotation_is_orthogonal_and_encoding_is_accurate() {
        let d = 128;
        let s = signs(3, 1, d);
        let mut x = 0x9e37_79b9u32;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 20001) as f32 / 10000.0 - 1.0
        };
        let v: Vec<f32> = (0..d).map(|i| rnd() + if i == 7 { 20.0 } else { 0.0 }).collect();
        let mut r = v.clone();
        rotate(&mut r, &s);
        let n0: f32 = v.iter().map(|a| a * a).sum();
        let n1: f32 = r.iter().map(|a| a * a).sum();
        assert!((n0 - n1).abs() < 1e-3 * n0);
        rotate_back(&mut r, &s);
        assert!(v.iter().zip(&r).all(|(a, b)| (a - b).abs() < 1e-4));
        // 4-bit codes keep the vector within ~10% relative error (an
        // optimal 16-level quantizer of a Gaussian: 9.5% RMS).
        let mut codes = vec![0u8; d / 2];
        let mut work = vec![0f32; d];
        let scale = encode(&v, &s, &mut codes, &mut work);
        let mut back = vec![0f32; d];
        decode_rotated(&codes, scale, &mut back);
        rotate_back(&mut back, &s);
        let err: f32 = v.iter().zip(&back).map(|(a, b)| (a - b) * (a - b)).sum();
        assert!((err / n0).sqrt() < 0.11, "relative error {}", (err / n0).sqrt());
        assert_eq!(encode(&vec![0.0; d], &s, &mut codes, &mut work), 0.0);
    }
}
