//! Choosing the next token from logits: greedy, or temperature sampling
//! with top-k, top-p and min-p, after repetition and presence penalties.
//!
//! Randomness is counter-based: the uniform draw for a token depends only on
//! the request's seed and the token's position, never on how many draws
//! came before or on other requests. So a seeded run is reproducible, and
//! speculative verification can sample any position exactly as plain
//! decoding would.

use serde::{Deserialize, Serialize};

/// Sampling settings of one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    /// 1.0 means no limit.
    pub top_p: f32,
    /// 0.0 means no limit.
    pub min_p: f32,
    /// 1.0 means no penalty.
    pub repeat_penalty: f32,
    /// Subtracted from the logit of every token already present.
    pub presence_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub penalty_last_n: usize,
    pub seed: u64,
    /// Added to a token's logit before anything else (OpenAI's
    /// `logit_bias`); `-inf` bans the token.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// A uniform number in [0, 1) for (seed, position): SplitMix64 of both.
pub fn uniform(seed: u64, position: u64) -> f64 {
    let mut z = seed
        ^ position
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The token with the largest logit (lowest id on ties), as a scan that
/// keeps the first logit and takes each one greater than the best so far
/// finds it: NaNs are never taken, and a NaN first logit (which nothing
/// is greater than) gives 0.
///
/// Greedy decoding and every row of a verify call this on a whole
/// vocabulary (49,152 to 262,144 logits), where that scan's chain of
/// dependent compares cost 65 µs a call on SmolLM2's. Here the maximum is
/// taken in 16 independent lanes (vector max instructions), then the
/// first logit equal to it is looked for 64 at a time.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    const SEARCH: usize = 64;
    let Some(&first) = logits.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
        }
    }
    let mut best = first;
    for &v in lanes.iter().chain(tail) {
        if v > best {
            best = v;
        }
    }
    // The first logit equal to the maximum (+0 and -0 alike, as the scan's
    // `>` treats them) is the one the scan keeps.
    let block = logits
        .chunks(SEARCH)
        .position(|c| c.iter().fold(false, |any, &v| any | (v == best)))
        .unwrap_or(0);
    let at = logits[block * SEARCH..].iter().position(|&v| v == best).unwrap_or(0);
    (block * SEARCH + at) as u32
}

/// Reusable buffers for sampling.
#[derive(Default)]
pub struct Sampler {
    work: Vec<f32>,
    cand: Vec<(f32, u32)>,
}

impl Sampler {
    /// Picks the token at `position` given `logits` and the `history` of
    /// tokens before it (prompt and generated).
    pub fn sample(&mut self, logits: &[f32], history: &[u32], p: &SamplingParams, position: u64) -> u32 {
        let penalize = p.repeat_penalty != 1.0 || p.presence_penalty != 0.0;
        let logits: &[f32] = if penalize || !p.logit_bias.is_empty() {
            self.work.clear();
            self.work.extend_from_slice(logits);
            for &(t, b) in &p.logit_bias {
                if let Some(l) = self.work.get_mut(t as usize) {
                    *l += b;
                }
            }
            let recent = &history[history.len().saturating_sub(p.penalty_last_n)..];
            let mut seen: Vec<u32> = if penalize { recent.to_vec() } else { Vec::new() };
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(l) = self.work.get_mut(t as usize) {
                    if p.repeat_penalty != 1.0 {
                        *l = if *l > 0.0 {
                            *l / p.repeat_penalty
                        } else {
                            *l * p.repeat_penalty
                        };
                    }
                    *l -= p.presence_penalty;
                }
            }
            &self.work
        } else {
            logits
        };
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        // Candidates by logit, highest first (lowest id on ties).
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            self.cand.truncate(p.top_k);
        }
        self.cand.sort_unstable_by(by_logit);
        // Softmax with temperature, in f64 for a stable cumulative sum.
        let max = self.cand[0].0;
        let mut probs: Vec<f64> = self
            .cand
            .iter()
            .map(|&(l, _)| (((l - max) / p.temperature) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &x) in probs.iter().enumerate() {
                cum += x;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
        }
        let kept_total: f64 = probs[..keep].iter().sum();
        let u = uniform(p.seed, position) * kept_total;
        let mut cum = 0.0;
        for (p, c) in probs[..keep].iter().zip(&self.cand) {
            cum += p;
            if u < cum {
                return c.1;
            }
        }
        self.cand[keep - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scan `argmax` must agree with: keep the first, take each
    /// logit greater than the best so far.
    fn scan(logits: &[f32]) -> u32 {
        let mut best = 0usize;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_of_the_largest_as_a_scan_finds_it() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        // Few distinct values, so that ties are common; NaNs, infinities
        // and both zeros among them.
        let values = [
            -1.5f32,
            -0.0,
            0.0,
            0.25,
            2.0,
            7.5,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -3.0,
        ];
        for len in (0..200).chain([1000, 49_152, 151_936]) {
            for round in 0..4 {
                let v: Vec<f32> = (0..len)
                    .map(|_| {
                        let r = next();
                        if round == 0 {
                            // Mostly distinct values.
                            (r % 1_000_003) as f32 * 1e-3 - 500.0
                        } else {
                            values[(r % (values.len() as u64 + 6 * round)) as usize % values.len()]
                        }
                    })
                    .collect();
                assert_eq!(argmax(&v), scan(&v), "len {len} round {round}");
            }
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 2.0]), 2);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[0.0, -0.0]), 0);
        let mut late = vec![-1.0f32; 49_152];
        late[49_151] = 3.0;
        late[70] = 3.0;
        assert_eq!(argmax(&late), 70);
    }

    #[test]
    fn logit_bias_moves_tokens_before_greedy_and_sampling() {
        let mut s = Sampler::default();
        let logits = [1.0, 3.0, 2.0, -1.0];
        let mut p = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        assert_eq!(s.sample(&logits, &[], &p, 0), 1);
        p.logit_bias = vec![(1, -1.0e30)];
        assert_eq!(s.sample(&logits, &[], &p, 0), 2);
        p.logit_bias = vec![(3, 5.0)];
        assert_eq!(s.sample(&logits, &[], &p, 0), 3);
        // Sampled: a banned token is never drawn, whatever the seed.
        p.temperature = 1.0;
        p.top_k = 0;
        p.top_p = 1.0;
        p.min_p = 0.0;
        p.logit_bias = vec![(1, -1.0e30), (2, -1.0e30)];
        for pos in 0..200 {
            let t = s.sample(&logits, &[], &p, pos);
            assert!(t == 0 || t == 3, "drew banned token {t}");
        }
        // The bias is not serialized when empty: sessions saved before it
        // existed read back the same.
        let json = serde_json::to_string(&SamplingParams::default()).unwrap();
        assert!(!json.contains("logit_bias"), "{json}");
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::default();
        let p = SamplingParams::default();
        assert_eq!(s.sample(&[0.0, 3.0, 3.0, 1.0], &[], &p, 0), 1);
    }

    #[test]
    fn seeded_sampling_depends_only_on_seed_and_position() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 0.8,
            ..Default::default()
        };
        let mut a = Sampler::default();
        let mut b = Sampler::default();
        let x: Vec<u32> = (0..50).map(|pos| a.sample(&logits, &[], &p, pos)).collect();
        // Another sampler, positions visited in another order.
        let y: Vec<u32> = (0..50).rev().map(|pos| b.sample(&logits, &[], &p, pos)).collect();
        let y: Vec<u32> = y.into_iter().rev().collect();
        assert_eq!(x, y);
        assert!(x.iter().any(|&t| t != x[0]), "sampling should vary across positions");
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let mut s = Sampler::default();
        let p = SamplingParams {
            repeat_penalty: 2.0,
            ..Default::default()
        };
        assert_eq!(s.sample(&[1.0, 1.5], &[1], &p, 0), 0);
    }

    #[test]
    fn uniform_is_in_range() {
        for i in 0..1000 {
            let u = uniform(42, i);
            assert!((0.0..1.0).contains(&u));
        }
    }
}
