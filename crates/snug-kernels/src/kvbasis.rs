//! The key basis: what TQ4 codes a key relative to.
//!
//! Keys of one (layer, KV head) share a large common part: before RoPE
//! their mean is most of their norm (80–90% of the energy in SmolLM2 and
//! Qwen2.5, whose key projections carry biases). A 4-bit code spends its
//! precision on the whole vector, so the part that differs from key to key,
//! the part attention actually discriminates on, gets little. The basis
//! takes the common part out and shapes the error:
//!
//! - **Offset.** A fixed pre-RoPE vector `m` per (layer, KV head). TQ4
//!   codes `k - rope(m, p)` for the key at position `p`; scoring adds the
//!   offset's exact contribution `q·rope(m, p)` back (one short sum per
//!   position, see `kv::attend_group`).
//! - **Weights.** Per rotary pair a weight `w`; TQ4 codes `w ⊙ (k -
//!   rope(m, p))` and scoring divides the query by `w` once. The rotation
//!   spreads the coding error evenly over the weighted coordinates, so a
//!   pair's error in the key scales as `1 / w`. The score error `q·e` is
//!   smallest for `w⁴ ∝ Q / R`, with `Q` the queries' mean energy in the
//!   pair and `R` the keys' (offset removed): pairs the queries read get
//!   the precision. A weight is the same for both elements of a pair, so
//!   it commutes with RoPE.
//!
//! Both come from a short calibration pass (mean pre-RoPE key, per-pair
//! energies of keys and queries over a fixed text; see
//! `snug_engine::calibrate`), so they are a property of the model, fixed
//! for every sequence, and part of a cache's identity like the rotation's
//! signs.

use crate::ops::Rope;

/// Sums over calibration rows, per (layer, KV head, dimension).
#[derive(Clone, Debug)]
pub struct KeyStats {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Rows summed per layer.
    pub rows: Vec<u64>,
    /// Sum and sum of squares of pre-RoPE keys.
    pub k_sum: Vec<f64>,
    pub k_sq: Vec<f64>,
    /// Sum of squares of (post-RoPE) queries, over the group's heads.
    pub q_sq: Vec<f64>,
}

impl KeyStats {
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, group: usize) -> KeyStats {
        let n = layers * kv_heads * head_dim;
        KeyStats {
            layers,
            kv_heads,
            head_dim,
            group,
            rows: vec![0; layers],
            k_sum: vec![0.0; n],
            k_sq: vec![0.0; n],
            q_sq: vec![0.0; n],
        }
    }

    /// Adds one row's pre-RoPE keys (`kv_heads * head_dim`) of `layer`.
    pub fn add_keys(&mut self, layer: usize, k: &[f32]) {
        let o = layer * self.kv_heads * self.head_dim;
        for (i, &x) in k.iter().enumerate() {
            self.k_sum[o + i] += x as f64;
            self.k_sq[o + i] += x as f64 * x as f64;
        }
        self.rows[layer] += 1;
    }

    /// Adds one row's queries (`kv_heads * group * head_dim`) of `layer`.
    pub fn add_queries(&mut self, layer: usize, q: &[f32]) {
        let hd = self.head_dim;
        let o = layer * self.kv_heads * hd;
        for (i, &x) in q.iter().enumerate() {
            let head = i / hd;
            let kv = head / self.group;
            self.q_sq[o + kv * hd + i % hd] += x as f64 * x as f64;
        }
    }
}

/// The offsets and weights of every (layer, KV head), with each layer's
/// RoPE.
#[derive(Clone, Debug)]
pub struct KeyBasis {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Pre-RoPE offset, `head_dim` per (layer, KV head).
    pub offset: Vec<f32>,
    /// Weight per dimension, `head_dim` per (layer, KV head): one value
    /// per rotary pair, mean square 1 per head.
    pub weight: Vec<f32>,
    /// Each layer's rotary embedding.
    pub ropes: Vec<Rope>,
}

/// The groups of dimensions that share a weight: rotary pairs, then each
/// dimension RoPE leaves alone.
fn weight_groups(rope: &Rope, d: usize) -> Vec<Vec<usize>> {
    let mut seen = vec![false; d];
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (a, b, _) in rope.pairs(d) {
        seen[a] = true;
        seen[b] = true;
        groups.push(vec![a, b]);
    }
    groups.extend((0..d).filter(|&i| !seen[i]).map(|i| vec![i]));
    groups
}

impl KeyBasis {
    /// The basis that changes nothing (offset 0, weights 1): plain TQ4.
    pub fn identity(layers: usize, kv_heads: usize, head_dim: usize, ropes: Vec<Rope>) -> KeyBasis {
        let n = layers * kv_heads * head_dim;
        KeyBasis {
            layers,
            kv_heads,
            head_dim,
            offset: vec![0.0; n],
            weight: vec![1.0; n],
            ropes,
        }
    }

    /// The basis from calibration sums: offset = mean pre-RoPE key;
    /// weight of a group = `(Q / R)^(1/4)`, normalized to mean square 1
    /// over the head (`Q`: the group's mean query energy, `R`: its mean
    /// key energy about the offset; both floored at 1e-6 of their head's
    /// mean so that an unused pair keeps a finite weight).
    pub fn from_stats(stats: &KeyStats, ropes: Vec<Rope>) -> KeyBasis {
        let (layers, kvh, hd) = (stats.layers, stats.kv_heads, stats.head_dim);
        assert_eq!(ropes.len(), layers, "one RoPE per layer");
        let mut b = KeyBasis::identity(layers, kvh, hd, ropes);
        for l in 0..layers {
            let n = stats.rows[l];
            if n == 0 {
                continue;
            }
            let groups = weight_groups(&b.ropes[l], hd);
            for h in 0..kvh {
                let o = (l * kvh + h) * hd;
                let mean: Vec<f64> = (0..hd).map(|d| stats.k_sum[o + d] / n as f64).collect();
                let r: Vec<f64> = groups
                    .iter()
                    .map(|g| {
                        g.iter()
                            .map(|&d| (stats.k_sq[o + d] / n as f64 - mean[d] * mean[d]).max(0.0))
                            .sum()
                    })
                    .collect();
                let q: Vec<f64> = groups
                    .iter()
                    .map(|g| {
                        g.iter()
                            .map(|&d| stats.q_sq[o + d] / (n * stats.group as u64) as f64)
                            .sum()
                    })
                    .collect();
                let floor = |v: &[f64]| 1e-6 * v.iter().sum::<f64>() / v.len() as f64 + f64::MIN_POSITIVE;
                let (fr, fq) = (floor(&r), floor(&q));
                let raw: Vec<f64> = r
                    .iter()
                    .zip(&q)
                    .map(|(&r, &q)| (q.max(fq) / r.max(fr)).powf(0.25))
                    .collect();
                let ms = groups
                    .iter()
                    .zip(&raw)
                    .map(|(g, w)| g.len() as f64 * w * w)
                    .sum::<f64>()
                    / hd as f64;
                let norm = ms.sqrt();
                for (g, w) in groups.iter().zip(&raw) {
                    for &d in g {
                        b.weight[o + d] = (w / norm) as f32;
                    }
                }
                for (m, &v) in b.offset[o..o + hd].iter_mut().zip(&mean) {
                    *m = v as f32;
                }
            }
        }
        b
    }

    pub fn offset(&self, layer: usize, head: usize) -> &[f32] {
        let o = (layer * self.kv_heads + head) * self.head_dim;
        &self.offset[o..o + self.head_dim]
    }

    pub fn weight(&self, layer: usize, head: usize) -> &[f32] {
        let o = (layer * self.kv_heads + head) * self.head_dim;
        &self.weight[o..o + self.head_dim]
    }

    /// `rope(offset, pos)` of (layer, head) into `out`.
    pub fn offset_at(&self, layer: usize, head: usize, pos: usize, out: &mut [f32]) {
        out.copy_from_slice(self.offset(layer, head));
        self.ropes[layer].apply(out, pos);
    }

    /// The coded form of key `k` at `pos`: `w ⊙ (k - rope(m, pos))`.
    pub fn to_coded(&self, layer: usize, head: usize, pos: usize, k: &[f32], out: &mut [f32]) {
        self.offset_at(layer, head, pos, out);
        for ((o, &x), &w) in out.iter_mut().zip(k).zip(self.weight(layer, head)) {
            *o = (x - *o) * w;
        }
    }

    /// A key back from its coded form (in place): `x / w + rope(m, pos)`.
    pub fn from_coded(&self, layer: usize, head: usize, pos: usize, x: &mut [f32], work: &mut [f32]) {
        self.offset_at(layer, head, pos, work);
        for ((v, &m), &w) in x.iter_mut().zip(work.iter()).zip(self.weight(layer, head)) {
            *v = *v / w + m;
        }
    }

    /// Bytes the basis takes.
    pub fn bytes(&self) -> usize {
        (self.offset.len() + self.weight.len()) * 4
    }
}

/// Everything scoring needs to add `q·rope(m, p)` for any position `p`
/// without a sine or cosine: per rotary configuration, `cos` and `sin` of
/// `θ_j t` for the offsets `t` within a page and of `θ_j B` for every page
/// start `B` (angles in f64, stored f32).
pub struct OffsetTables {
    pub page_tokens: usize,
    /// Index into `trig` of each layer's RoPE.
    layer_trig: Vec<usize>,
    trig: Vec<Trig>,
}

pub struct Trig {
    /// (first, second) element of each rotary pair.
    pub pairs: Vec<(usize, usize)>,
    /// Dimensions RoPE leaves alone.
    pub fixed: Vec<usize>,
    /// `[j][t]`: cos and sin of `θ_j t`, t < page_tokens (pair-major, so
    /// that consecutive positions of one pair are one vector).
    pub within_cos: Vec<f32>,
    pub within_sin: Vec<f32>,
    pub page_tokens: usize,
    /// `[page][j]`: cos and sin of `θ_j page * page_tokens`.
    pub start_cos: Vec<f32>,
    pub start_sin: Vec<f32>,
}

impl OffsetTables {
    pub fn new(basis: &KeyBasis, page_tokens: usize, pages: usize) -> OffsetTables {
        let hd = basis.head_dim;
        // Each distinct RoPE (by its pairs and frequencies) and its tables.
        type Pairs = Vec<(usize, usize, f32)>;
        let mut trig: Vec<(Pairs, Trig)> = Vec::new();
        let mut layer_trig = Vec::with_capacity(basis.layers);
        for rope in &basis.ropes {
            let pairs = rope.pairs(hd);
            if let Some(i) = trig.iter().position(|(p, _)| *p == pairs) {
                layer_trig.push(i);
                continue;
            }
            let angles = |pos: usize| pairs.iter().map(move |&(_, _, f)| pos as f64 * f as f64);
            let mut t = Trig {
                pairs: pairs.iter().map(|&(a, b, _)| (a, b)).collect(),
                fixed: weight_groups(rope, hd)
                    .into_iter()
                    .filter(|g| g.len() == 1)
                    .map(|g| g[0])
                    .collect(),
                within_cos: Vec::new(),
                within_sin: Vec::new(),
                page_tokens,
                start_cos: Vec::new(),
                start_sin: Vec::new(),
            };
            for &(_, _, f) in &pairs {
                for pos in 0..page_tokens {
                    let a = pos as f64 * f as f64;
                    t.within_cos.push(a.cos() as f32);
                    t.within_sin.push(a.sin() as f32);
                }
            }
            for page in 0..pages {
                for a in angles(page * page_tokens) {
                    t.start_cos.push(a.cos() as f32);
                    t.start_sin.push(a.sin() as f32);
                }
            }
            layer_trig.push(trig.len());
            trig.push((pairs, t));
        }
        OffsetTables {
            page_tokens,
            layer_trig,
            trig: trig.into_iter().map(|(_, t)| t).collect(),
        }
    }

    pub fn trig(&self, layer: usize) -> &Trig {
        &self.trig[self.layer_trig[layer]]
    }

    pub fn bytes(&self) -> usize {
        self.trig
            .iter()
            .map(|t| 4 * (t.within_cos.len() + t.within_sin.len() + t.start_cos.len() + t.start_sin.len()))
            .sum()
    }
}

impl Trig {
    /// For query `q` and offset `m`: the pairs' `(X, Y)` with
    /// `q·rope(m, p) = C + Σ_j X_j cos θ_j p + Y_j sin θ_j p`, written to
    /// `xy` (`[X..., Y...]`), and `C`, the unrotated dimensions' part.
    pub fn prepare(&self, q: &[f32], m: &[f32], xy: &mut [f32]) -> f32 {
        let np = self.pairs.len();
        for (j, &(a, b)) in self.pairs.iter().enumerate() {
            xy[j] = q[a] * m[a] + q[b] * m[b];
            xy[np + j] = q[b] * m[a] - q[a] * m[b];
        }
        self.fixed.iter().map(|&d| q[d] * m[d]).sum()
    }

    /// `(X', Y')` for the page starting at `page * page_tokens`, so that
    /// the position `t` into the page takes `Σ_j X'_j cos θ_j t + Y'_j sin
    /// θ_j t`. The attention kernel performs the same products and sums
    /// 16 pairs at a time (`kv::coded`); this form checks the tables.
    pub fn shift(&self, xy: &[f32], page: usize, out: &mut [f32]) {
        let np = self.pairs.len();
        let (c, s) = (
            &self.start_cos[page * np..(page + 1) * np],
            &self.start_sin[page * np..(page + 1) * np],
        );
        for j in 0..np {
            let (x, y) = (xy[j], xy[np + j]);
            out[j] = x * c[j] + y * s[j];
            out[np + j] = y * c[j] - x * s[j];
        }
    }

    /// The offset's score at position `t` into a page, from [`Trig::shift`]'s
    /// `(X', Y')`: pairs in order, one accumulator.
    #[inline]
    pub fn at(&self, xy: &[f32], t: usize) -> f32 {
        let (np, pt) = (self.pairs.len(), self.page_tokens);
        let mut acc = 0f32;
        for j in 0..np {
            acc = xy[j].mul_add(self.within_cos[j * pt + t], acc);
            acc = xy[np + j].mul_add(self.within_sin[j * pt + t], acc);
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::RopeLayout;

    #[test]
    fn offset_tables_give_the_score_of_the_rotated_offset() {
        for layout in [RopeLayout::Adjacent, RopeLayout::Halves] {
            let hd = 64;
            let rope = Rope::new(layout, 48, 10000.0);
            let mut basis = KeyBasis::identity(1, 1, hd, vec![rope.clone()]);
            for (i, m) in basis.offset.iter_mut().enumerate() {
                *m = ((i * 37 % 11) as f32 - 5.0) * 0.7;
            }
            let q: Vec<f32> = (0..hd).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.3).collect();
            let tables = OffsetTables::new(&basis, 16, 40);
            let t = tables.trig(0);
            let mut xy = vec![0f32; hd];
            let mut shifted = vec![0f32; hd];
            let c0 = t.prepare(&q, basis.offset(0, 0), &mut xy);
            for pos in [0usize, 5, 16, 17, 255, 639] {
                t.shift(&xy, pos / 16, &mut shifted);
                let got = c0 + t.at(&shifted, pos % 16);
                let mut m = vec![0f32; hd];
                basis.offset_at(0, 0, pos, &mut m);
                let want: f32 = q.iter().zip(&m).map(|(a, b)| a * b).sum();
                assert!(
                    (got - want).abs() < 1e-3 * (1.0 + want.abs()),
                    "{layout:?} {pos}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn weights_follow_query_over_key_energy() {
        // Two pairs: the queries use only the first; the keys vary equally
        // in both. The first pair gets the larger weight, mean square 1.
        let rope = Rope::new(RopeLayout::Halves, 4, 10000.0);
        let mut s = KeyStats::new(1, 1, 4, 1);
        for i in 0..100 {
            let x = if i % 2 == 0 { 1.0 } else { -1.0 };
            s.add_keys(0, &[3.0 + x, 3.0 + x, x, x]);
            s.add_queries(0, &[2.0, 0.0, 2.0, 0.0]);
        }
        let b = KeyBasis::from_stats(&s, vec![rope]);
        assert!((b.offset(0, 0)[0] - 3.0).abs() < 1e-6 && b.offset(0, 0)[3].abs() < 1e-6);
        let w = b.weight(0, 0);
        assert!(w[0] > 10.0 * w[1], "{w:?}");
        assert_eq!(w[0], w[2]);
        let ms: f32 = w.iter().map(|x| x * x).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-5);
        // Coding then decoding a key gives it back.
        let k = [1.5f32, -2.0, 0.25, 4.0];
        let (mut x, mut work) = ([0f32; 4], [0f32; 4]);
        b.to_coded(0, 0, 9, &k, &mut x);
        b.from_coded(0, 0, 9, &mut x, &mut work);
        for (a, b) in x.iter().zip(&k) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
