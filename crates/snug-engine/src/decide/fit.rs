//! Temperatures per question type and option count, and fitting them to
//! labelled examples.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;

/// Temperatures by question type and option-count bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Temperatures {
    /// Per type: choice, score, noul.
    pub temperature: [f32; 3],
    /// Per bucket (`choice:2`, `choice:3-5`, `choice:6-10`, `choice:11+`,
    /// and so for score and noul), over the type's value.
    #[serde(default)]
    pub temperature_by_options: BTreeMap<String, f32>,
}

impl Default for Temperatures {
    fn default() -> Self {
        Temperatures {
            temperature: [1.0; 3],
            temperature_by_options: BTreeMap::new(),
        }
    }
}

/// Temperatures are kept in [0.5, 5]; anything not a finite number is 1.
pub fn clamp_temperature(t: f32) -> f32 {
    if t.is_finite() {
        t.clamp(0.5, 5.0)
    } else {
        1.0
    }
}

/// The bucket of a question of `kind` with `k` options.
pub fn bucket(kind: Kind, k: usize) -> String {
    let size = match k {
        0..=2 => "2",
        3..=5 => "3-5",
        6..=10 => "6-10",
        _ => "11+",
    };
    format!("{}:{size}", kind.name())
}

impl Temperatures {
    pub fn get(&self, kind: Kind, k: usize) -> f32 {
        clamp_temperature(
            *self
                .temperature_by_options
                .get(&bucket(kind, k))
                .unwrap_or(&self.temperature[kind.index()]),
        )
    }

    /// All values clamped.
    pub fn clamped(mut self) -> Temperatures {
        for t in &mut self.temperature {
            *t = clamp_temperature(*t);
        }
        for t in self.temperature_by_options.values_mut() {
            *t = clamp_temperature(*t);
        }
        self
    }
}

/// A labeled example for calibration: raw label log-probabilities and the
/// index of the right option.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub kind: Kind,
    pub logprobs: Vec<f32>,
    pub truth: usize,
}

/// Mean negative log-likelihood of the examples at temperature `t`.
pub fn nll(examples: &[&Example], t: f32) -> f64 {
    let n = examples.len().max(1) as f64;
    examples
        .iter()
        .map(|e| -(softmax_t(&e.logprobs, t)[e.truth].max(1e-30) as f64).ln())
        .sum::<f64>()
        / n
}

/// The temperature in [0.5, 5] that minimizes [`nll`] (golden-section
/// search on log t; the NLL of a softmax in 1/t is convex, so unimodal).
pub fn fit_temperature(examples: &[&Example]) -> f32 {
    let (mut lo, mut hi) = (0.5f64.ln(), 5.0f64.ln());
    let g = (5f64.sqrt() - 1.0) / 2.0;
    let f = |x: f64| nll(examples, x.exp() as f32);
    let (mut a, mut b) = (hi - g * (hi - lo), lo + g * (hi - lo));
    let (mut fa, mut fb) = (f(a), f(b));
    for _ in 0..60 {
        if fa < fb {
            hi = b;
            b = a;
            fb = fa;
            a = hi - g * (hi - lo);
            fa = f(a);
        } else {
            lo = a;
            a = b;
            fa = fb;
            b = lo + g * (hi - lo);
            fb = f(b);
        }
    }
    clamp_temperature(((lo + hi) / 2.0).exp() as f32)
}

/// Fits temperatures: one per type (from at least `min_type` examples of
/// it) and one per bucket (from at least `min_bucket`); the rest stay 1.
pub fn calibrate(examples: &[Example], min_type: usize, min_bucket: usize) -> Temperatures {
    let mut t = Temperatures::default();
    for kind in [Kind::Choice, Kind::Score, Kind::Noul] {
        let of: Vec<&Example> = examples.iter().filter(|e| e.kind == kind).collect();
        if of.len() >= min_type.max(1) {
            t.temperature[kind.index()] = fit_temperature(&of);
        }
        let mut buckets: BTreeMap<String, Vec<&Example>> = BTreeMap::new();
        for e in of {
            buckets.entry(bucket(kind, e.logprobs.len())).or_default().push(e);
        }
        for (b, es) in buckets {
            if es.len() >= min_bucket.max(1) {
                t.temperature_by_options.insert(b, fit_temperature(&es));
            }
        }
    }
    t
}
