//! When to speculate, and how far: a cost model of verify forwards against
//! plain decode steps, and the acceptance rate seen so far.
//!
//! A verify of `k` drafted tokens runs `k + 1` rows in one forward and
//! yields `1 + (accepted drafts)` tokens. With a per-token acceptance rate
//! `a` (drafts are accepted as a prefix, so the chance that the first `i`
//! all pass is about `a^i`), the expected tokens per verify are
//! `1 + a + a^2 + ... + a^k`, and the gain over plain decoding is that
//! number times `cost(1) / cost(k + 1)`. In `auto` mode the policy drafts
//! the `k` with the best expected gain, and only when it exceeds 1. After a
//! run of declined drafts it verifies one draft token anyway, so a rate
//! learned on unrepetitive text can recover when the text starts to repeat.

/// Speculation setting of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Plain decoding.
    Off,
    /// Verify every draft the drafter finds (up to the maximum length).
    On,
    /// Verify drafts when the cost model expects a gain.
    Auto,
}

impl Mode {
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "off" => Some(Mode::Off),
            "on" => Some(Mode::On),
            "auto" => Some(Mode::Auto),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::On => "on",
            Mode::Auto => "auto",
        }
    }
}

/// Most draft tokens verified at once.
pub const MAX_DRAFT: usize = 8;

/// Longest n-gram match the acceptance statistics distinguish.
const MAX_MATCH: usize = crate::draft::MAX_N;

/// Declined drafts after which `auto` verifies one token to re-measure.
const PROBE_EVERY: u32 = 8;

/// Prior acceptance rate of a draft found by an n-token match, by n.
const PRIOR: [f64; MAX_MATCH + 1] = [0.2, 0.2, 0.3, 0.45, 0.6];

/// The speculation policy of one generation.
#[derive(Clone, Debug)]
pub struct Policy {
    pub mode: Mode,
    pub max_draft: usize,
    /// Measured seconds per forward of `r` rows at index `r - 1` (a moving
    /// average), for 1..=MAX_DRAFT+1; `None` where not measured.
    measured: [Option<f64>; MAX_DRAFT + 1],
    /// Per length of the n-gram that found the draft (index n, up to
    /// `draft::MAX_N`): decayed counts of accepted draft tokens and of draft
    /// tokens tested. A 4-token match predicts better than a 2-token one.
    succ: [f64; MAX_MATCH + 1],
    tried: [f64; MAX_MATCH + 1],
    declined: u32,
}

impl Policy {
    /// A policy with forward costs measured for some row counts (`(rows,
    /// seconds)`); see [`Policy::observe`].
    pub fn new(mode: Mode, costs: &[(usize, f64)]) -> Policy {
        let mut p = Policy {
            mode,
            max_draft: MAX_DRAFT,
            measured: [None; MAX_DRAFT + 1],
            // A prior worth two tokens of evidence, cautious for short
            // matches (a wasted verify costs more than a missed one gains)
            // and hopeful for long ones, which rarely occur by chance.
            succ: std::array::from_fn(|n| 2.0 * PRIOR[n]),
            tried: [2.0; MAX_MATCH + 1],
            declined: 0,
        };
        for &(rows, secs) in costs {
            p.observe(rows, secs);
        }
        p
    }

    /// Records how long a forward of `rows` rows took (a moving average
    /// per row count). The cost of any row count is read off a straight
    /// line fitted to the measured ones (least squares, slope at least 0);
    /// with one measurement it is taken as proportional to rows, the
    /// pessimistic compute-bound case.
    pub fn observe(&mut self, rows: usize, secs: f64) {
        if !(1..=MAX_DRAFT + 1).contains(&rows) || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let m = &mut self.measured[rows - 1];
        *m = Some(match *m {
            Some(old) => 0.7 * old + 0.3 * secs,
            None => secs,
        });
    }

    fn cost(&self, rows: usize) -> f64 {
        let pts: Vec<(f64, f64)> = self
            .measured
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.map(|s| ((i + 1) as f64, s)))
            .collect();
        let x = rows as f64;
        match pts.len() {
            0 => x,
            1 => pts[0].1 * x / pts[0].0,
            n => {
                let n = n as f64;
                let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
                let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
                let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
                let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
                let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
                (my + slope * (x - mx)).max(my * 1e-3)
            }
        }
    }

    /// Cost of a forward of `rows` rows relative to one row.
    pub fn relative_cost(&self, rows: usize) -> f64 {
        self.cost(rows.clamp(1, MAX_DRAFT + 1)) / self.cost(1)
    }

    /// The current estimate of the per-token acceptance rate of drafts
    /// found by an n-gram of `n` tokens.
    pub fn acceptance(&self, n: usize) -> f64 {
        let n = n.min(MAX_MATCH);
        self.succ[n] / self.tried[n]
    }

    /// Expected tokens per second gained by verifying `k` draft tokens found
    /// by an `n`-token match, as a multiple of plain decoding.
    pub fn expected_gain(&self, n: usize, k: usize) -> f64 {
        let a = self.acceptance(n);
        let mut tokens = 1.0;
        let mut p = 1.0;
        for _ in 0..k {
            p *= a;
            tokens += p;
        }
        tokens / self.relative_cost(k + 1)
    }

    /// How many of `available` draft tokens, found by an `n`-token match,
    /// to verify; 0 means a plain decode step.
    pub fn draft_len(&mut self, available: usize, n: usize) -> usize {
        let most = available.min(self.max_draft);
        if most == 0 {
            return 0;
        }
        match self.mode {
            Mode::Off => 0,
            Mode::On => most,
            Mode::Auto => {
                let (best_k, _) = (1..=most)
                    .map(|k| (k, self.expected_gain(n, k)))
                    .fold((0, 1.0), |acc, x| if x.1 > acc.1 { x } else { acc });
                if best_k > 0 {
                    self.declined = 0;
                    best_k
                } else {
                    self.declined += 1;
                    if self.declined >= PROBE_EVERY {
                        self.declined = 0;
                        1
                    } else {
                        0
                    }
                }
            }
        }
    }

    /// Records a verify of `drafted` tokens, found by an `n`-token match,
    /// of which the first `accepted` matched.
    pub fn record(&mut self, n: usize, drafted: usize, accepted: usize) {
        const DECAY: f64 = 0.9;
        let n = n.min(MAX_MATCH);
        // Tokens actually tested: the accepted ones and the first rejected.
        let tested = (accepted + usize::from(accepted < drafted)) as f64;
        self.succ[n] = self.succ[n] * DECAY + accepted as f64;
        self.tried[n] = self.tried[n] * DECAY + tested;
        // Keep a margin so the estimate never becomes certain.
        self.tried[n] = self.tried[n].max(self.succ[n] + 0.5);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cheap_verify() -> Vec<(usize, f64)> {
        // Memory-bound decode: more rows cost little.
        vec![(1, 10.0), (2, 10.5), (4, 11.5), (9, 14.0)]
    }

    #[test]
    fn costs_are_interpolated() {
        let p = Policy::new(Mode::Auto, &cheap_verify());
        assert!((p.relative_cost(1) - 1.0).abs() < 1e-12);
        // The fitted line is increasing and close to the measurements.
        assert!(p.relative_cost(3) > p.relative_cost(2) && p.relative_cost(9) > p.relative_cost(3));
        assert!((p.relative_cost(9) - 1.4).abs() < 0.05, "{}", p.relative_cost(9));
        let p = Policy::new(Mode::Auto, &[(1, 2.0)]);
        assert!((p.relative_cost(5) - 5.0).abs() < 1e-12);
        // Two points: the line through them. Measurements refine it as a
        // moving average.
        let mut p = Policy::new(Mode::Auto, &[(1, 10.0), (9, 20.0)]);
        assert!((p.relative_cost(5) - 1.5).abs() < 1e-12);
        p.observe(9, 10.0);
        assert!((p.relative_cost(9) - 1.7).abs() < 1e-12);
        p.observe(0, 1.0);
        p.observe(3, f64::NAN);
        assert!((p.relative_cost(9) - 1.7).abs() < 1e-12);
        // Noise never makes more rows cheaper.
        let p = Policy::new(Mode::Auto, &[(1, 10.0), (3, 12.0), (4, 11.0)]);
        assert!(p.relative_cost(9) >= p.relative_cost(4));
    }

    #[test]
    fn off_never_drafts_and_on_always_does() {
        let mut off = Policy::new(Mode::Off, &cheap_verify());
        assert_eq!(off.draft_len(5, 3), 0);
        let mut on = Policy::new(Mode::On, &cheap_verify());
        assert_eq!(on.draft_len(5, 3), 5);
        assert_eq!(on.draft_len(50, 3), MAX_DRAFT);
        assert_eq!(on.draft_len(0, 3), 0);
    }

    #[test]
    fn auto_follows_acceptance() {
        let mut p = Policy::new(Mode::Auto, &cheap_verify());
        for _ in 0..50 {
            p.record(4, 8, 8);
        }
        assert!(p.acceptance(4) > 0.9);
        assert!(p.draft_len(8, 4) >= 6, "{}", p.draft_len(8, 4));
        for _ in 0..100 {
            p.record(2, 4, 0);
        }
        assert!(p.acceptance(2) < 0.05);
        // Statistics are kept per match length.
        assert!(p.acceptance(4) > 0.9);
        assert!(p.draft_len(8, 4) >= 6);
        // Declines, then probes with one token after a run of declines.
        let lens: Vec<usize> = (0..PROBE_EVERY).map(|_| p.draft_len(8, 2)).collect();
        assert!(lens[..PROBE_EVERY as usize - 1].iter().all(|&k| k == 0));
        assert_eq!(lens[PROBE_EVERY as usize - 1], 1);
    }

    #[test]
    fn expensive_verify_is_declined() {
        // Compute-bound: every row costs as much as a decode step.
        let mut p = Policy::new(Mode::Auto, &[(1, 1.0), (9, 9.0)]);
        for _ in 0..20 {
            p.record(3, 4, 2);
        }
        assert_eq!(p.draft_len(8, 3), 0);
    }

    #[test]
    fn modes_parse() {
        for m in [Mode::Off, Mode::On, Mode::Auto] {
            assert_eq!(Mode::parse(m.as_str()), Some(m));
        }
        assert_eq!(Mode::parse("yes"), None);
    }
}
