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

/// Most draft tokens verified at once. A copy accepts nearly every draft
/// token, and where a verify's rows are bound by their multiply-adds a
/// 17-row verify costs far less than twice a 9-row one, so long copies
/// gain from drafts of 16.
pub const MAX_DRAFT: usize = 16;

/// Classes of matches the acceptance statistics keep apart: by the length
/// n of the n-gram that found the draft (0 to `draft::MAX_N`), then
/// matches that agree back [`AGREES`] tokens and `draft::LONG_MATCH`.
const CLASSES: usize = crate::draft::MAX_N + 3;

/// How far back a match agrees for the first of the two long classes.
const AGREES: usize = 8;

/// The acceptance class of a draft found by a match of `n` tokens.
fn class(n: usize) -> usize {
    if n >= crate::draft::LONG_MATCH {
        CLASSES - 1
    } else if n >= AGREES {
        CLASSES - 2
    } else {
        n.min(crate::draft::MAX_N)
    }
}

/// Declined drafts after which `auto` verifies one token to re-measure; the
/// interval doubles after each probe that fails, up to `MAX_PROBE_EVERY`,
/// and returns to `PROBE_EVERY` after one that succeeds.
const PROBE_EVERY: u32 = 8;
const MAX_PROBE_EVERY: u32 = 128;

/// Prior acceptance rate of a draft, by class: found by an n-token match
/// (n = 0 to 4), or by a match that agrees 8 or 16 tokens back. Text being
/// copied agrees far back, and there the longest draft pays from the first
/// verify: at a rate of 0.8, 4 draft tokens have the better expected gain
/// than 8 whenever 9 rows cost more than 1.29 times 5 rows (as where the
/// rows' multiply-adds set a verify's pace), at 0.95 only past 1.63 times.
const PRIOR: [f64; CLASSES] = [0.2, 0.2, 0.3, 0.45, 0.6, 0.8, 0.95];

/// The speculation policy of one generation.
#[derive(Clone, Debug)]
pub struct Policy {
    pub mode: Mode,
    pub max_draft: usize,
    /// Measured seconds per forward of `r` rows at index `r - 1` (a moving
    /// average), for 1..=MAX_DRAFT+1; `None` where not measured.
    measured: [Option<f64>; MAX_DRAFT + 1],
    /// Per class of the match that found the draft (see [`class`]): decayed
    /// counts of accepted draft tokens and of draft tokens tested. A 4-token
    /// match predicts better than a 2-token one, and one that agrees 8 or
    /// 16 tokens back better still.
    succ: [f64; CLASSES],
    tried: [f64; CLASSES],
    declined: u32,
    probe_every: u32,
    /// Whether the last draft length handed out was a probe.
    probing: bool,
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
            tried: [2.0; CLASSES],
            declined: 0,
            probe_every: PROBE_EVERY,
            probing: false,
        };
        for &(rows, secs) in costs {
            p.observe(rows, secs);
        }
        p
    }

    /// Records how long a forward of `rows` rows took (a moving average
    /// per row count). See [`Policy::relative_cost`] for how unmeasured row
    /// counts are estimated.
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

    /// The cost of `rows` rows, never below a measured smaller row count's
    /// (noise never makes more rows cheaper). An unmeasured row count is
    /// charged the cost of the next larger measured one: forward cost grows
    /// with rows but not in a straight line (the matrix product changes
    /// kernels with the row count, and a kernel's fixed cost is paid once),
    /// so a line through two measurements can underestimate the rows
    /// between them, and an underestimate makes `auto` draft at a loss.
    /// Past the largest measured count the cost grows along the last two
    /// measurements' slope (or in proportion to rows with one).
    fn cost(&self, rows: usize) -> f64 {
        let mut pts: Vec<(usize, f64)> = Vec::new();
        for (i, m) in self.measured.iter().enumerate() {
            if let Some(s) = *m {
                let floor = pts.last().map_or(0.0, |p| p.1);
                pts.push((i + 1, s.max(floor)));
            }
        }
        if let Some(&(_, s)) = pts.iter().find(|p| p.0 >= rows) {
            return s;
        }
        match pts.as_slice() {
            [] => rows as f64,
            [(r, s)] => s * rows as f64 / *r as f64,
            [.., (r0, s0), (r1, s1)] => s1 + (s1 - s0) / (r1 - r0) as f64 * (rows - r1) as f64,
        }
    }

    /// Cost of a forward of `rows` rows relative to one row.
    pub fn relative_cost(&self, rows: usize) -> f64 {
        self.cost(rows.clamp(1, MAX_DRAFT + 1)) / self.cost(1)
    }

    /// The current estimate of the per-token acceptance rate of drafts
    /// found by a match of `n` tokens (as `draft::PromptLookup::draft_match`
    /// reports it).
    pub fn acceptance(&self, n: usize) -> f64 {
        let c = class(n);
        self.succ[c] / self.tried[c]
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
                self.probing = false;
                if best_k > 0 {
                    self.declined = 0;
                    best_k
                } else {
                    self.declined += 1;
                    if self.declined >= self.probe_every {
                        self.declined = 0;
                        self.probing = true;
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
        let c = class(n);
        // Tokens actually tested: the accepted ones and the first rejected.
        let tested = (accepted + usize::from(accepted < drafted)) as f64;
        self.succ[c] = self.succ[c] * DECAY + accepted as f64;
        self.tried[c] = self.tried[c] * DECAY + tested;
        // Keep a margin so the estimate never becomes certain.
        self.tried[c] = self.tried[c].max(self.succ[c] + 0.5);
        if std::mem::take(&mut self.probing) {
            self.probe_every = if accepted == 0 {
                (self.probe_every * 2).min(MAX_PROBE_EVERY)
            } else {
                PROBE_EVERY
            };
        }
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
    fn unmeasured_costs_are_bounded_from_above() {
        let p = Policy::new(Mode::Auto, &cheap_verify());
        assert!((p.relative_cost(1) - 1.0).abs() < 1e-12);
        // Measured counts as measured; others charged the next larger one.
        assert!((p.relative_cost(2) - 1.05).abs() < 1e-12);
        assert!((p.relative_cost(3) - 1.15).abs() < 1e-12);
        assert!((p.relative_cost(9) - 1.4).abs() < 1e-12);
        let p = Policy::new(Mode::Auto, &[(1, 2.0)]);
        assert!((p.relative_cost(5) - 5.0).abs() < 1e-12);
        // Two points: everything between costs the larger. Measurements
        // refine it as a moving average.
        let mut p = Policy::new(Mode::Auto, &[(1, 10.0), (9, 20.0)]);
        assert!((p.relative_cost(5) - 2.0).abs() < 1e-12);
        p.observe(2, 15.0);
        assert!((p.relative_cost(2) - 1.5).abs() < 1e-12);
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
        // A failed probe doubles the wait for the next one.
        p.record(2, 1, 0);
        let lens: Vec<usize> = (0..2 * PROBE_EVERY).map(|_| p.draft_len(8, 2)).collect();
        assert!(lens[..2 * PROBE_EVERY as usize - 1].iter().all(|&k| k == 0));
        assert_eq!(lens[2 * PROBE_EVERY as usize - 1], 1);
        // A successful one brings it back.
        p.record(2, 1, 1);
        let lens: Vec<usize> = (0..PROBE_EVERY).map(|_| p.draft_len(8, 2)).collect();
        assert_eq!(lens[PROBE_EVERY as usize - 1], 1);
    }

    #[test]
    fn a_copy_drafts_long_from_the_first_verify() {
        use crate::draft::LONG_MATCH;
        // A 9-row verify costs 2.7 decode steps (compute-bound rows): a
        // fresh 4-gram match is not worth a verify, one that agrees 8
        // tokens back is worth the longest.
        let p = Policy::new(Mode::Auto, &[(1, 1.0), (9, 2.7)]);
        assert_eq!(p.clone().draft_len(8, 4), 0);
        assert_eq!(p.clone().draft_len(8, AGREES), 8);
        // With the short verifies measured, a 4-token match and one that
        // agrees 8 back draft 4 tokens; one that agrees 16 back, all 8.
        let p = Policy::new(Mode::Auto, &[(1, 1.0), (2, 1.05), (3, 1.2), (5, 1.4), (9, 2.1)]);
        assert_eq!(p.clone().draft_len(8, 4), 4);
        assert_eq!(p.clone().draft_len(8, AGREES), 4);
        assert_eq!(p.clone().draft_len(8, LONG_MATCH), 8);
        // Lengths between two classes count as the lower one.
        assert_eq!(p.acceptance(6), p.acceptance(4));
        assert_eq!(p.acceptance(AGREES + 3), p.acceptance(AGREES));
        assert_eq!(p.acceptance(LONG_MATCH + 3), p.acceptance(LONG_MATCH));
        // Long matches keep their own statistics: failures lower them.
        let mut p = p;
        for _ in 0..30 {
            p.record(LONG_MATCH, 8, 0);
        }
        assert_eq!(p.draft_len(8, LONG_MATCH), 0);
        assert!(p.acceptance(AGREES) > 0.7);
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
