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
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Rotary embedding over the first `rot_dim` elements of each head with
    /// base `theta`.
    pub fn new(layout: RopeLayout, rot_dim: usize, theta: f32) -> Rope {
        let inv_freq = (0..rot_dim / 2)
            .map(|i| theta.powf(-(2.0 * i as f32) / rot_dim as f32))
            .collect();
        Rope { layout, inv_freq }
    }

    /// Rotates one head vector (`head.len()` = head dim) for position `pos`.
    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let d = head.len();
        for (i, f) in self.inv_freq.iter().enumerate() {
            let angle = pos as f32 * f;
            let (sin, cos) = angle.sin_cos();
            let (a, b) = match self.layout {
                RopeLayout::Adjacent => (2 * i, 2 * i + 1),
                RopeLayout::Halves => (i, i + d / 2),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos - x1 * sin;
            head[b] = x0 * sin + x1 * cos;
        }
    }
}

/// SiLU-gated product in place: `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// GELU (tanh approximation) gated product in place.
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let t = (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh();
        *g = 0.5 * x * (1.0 + t) * u;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_normalizes() {
        let mut x = vec![3.0f32, 4.0, 0.0, 0.0];
        rms_norm(&mut x, &[1.0; 4], 0.0);
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
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
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -1e30];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
    }
}
