//! Where a forward pass' time goes, by operation: the decoder takes the
//! time after each of its steps and adds it to the step's kind (the
//! norms, the attention inputs' products, attention, ...). Off unless a
//! program turns it on ([`enable`]; `snug bench --profile` does), when
//! it costs a clock read per step and nothing else.
//!
//! The times are the caller's: on the CPU a step returns when its work is
//! done, so a step's time is its work, its threads' hand-offs and any
//! imbalance between them. A backend whose steps run asynchronously (a
//! GPU's) would be timed at their launches only, so only the CPU's
//! backends are profiled this way.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The kinds of step a forward pass is timed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The tokens' embeddings (and their scale).
    Embed,
    /// Norms, residual sums and scales between the products.
    Norm,
    /// The queries', keys' and values' products (and biases, their norms).
    Qkv,
    /// Rotary positions and the keys' and values' writes to the pages.
    Rope,
    /// Attention over the pages.
    Attention,
    /// The attention output's product.
    AttnOut,
    /// The feed-forward block's gate and up products.
    GateUp,
    /// The gate's activation times the up product.
    Act,
    /// The feed-forward block's down product.
    Down,
    /// A mixture of experts' block, whole.
    Experts,
    /// The output norm and the output head's product.
    Head,
}

impl Op {
    /// Every kind, in a pass' order.
    pub const ALL: [Op; 11] = [
        Op::Embed,
        Op::Norm,
        Op::Qkv,
        Op::Rope,
        Op::Attention,
        Op::AttnOut,
        Op::GateUp,
        Op::Act,
        Op::Down,
        Op::Experts,
        Op::Head,
    ];

    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::Norm => "norms",
            Op::Qkv => "q/k/v",
            Op::Rope => "rope+kv",
            Op::Attention => "attention",
            Op::AttnOut => "attn out",
            Op::GateUp => "gate/up",
            Op::Act => "activation",
            Op::Down => "down",
            Op::Experts => "experts",
            Op::Head => "head",
        }
    }
}

const N: usize = Op::ALL.len();

/// Nanoseconds per kind and a count of passes.
pub(crate) struct Totals {
    nanos: [AtomicU64; N],
    passes: AtomicU64,
}

impl Totals {
    const fn new() -> Totals {
        Totals {
            nanos: [const { AtomicU64::new(0) }; N],
            passes: AtomicU64::new(0),
        }
    }

    fn reset(&self) {
        for n in &self.nanos {
            n.store(0, Ordering::Relaxed);
        }
        self.passes.store(0, Ordering::Relaxed);
    }

    fn take(&self) -> ([u64; N], u64) {
        let mut t = [0; N];
        for (t, n) in t.iter_mut().zip(&self.nanos) {
            *t = n.load(Ordering::Relaxed);
        }
        (t, self.passes.load(Ordering::Relaxed))
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static TOTALS: Totals = Totals::new();

/// Turns the profile on or off for every later pass.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether passes are being timed.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Clears the times taken so far.
pub fn reset() {
    TOTALS.reset();
}

/// The times taken since the last [`reset`]: nanoseconds per kind, in
/// [`Op::ALL`]'s order, and the number of passes.
pub fn take() -> ([u64; N], u64) {
    TOTALS.take()
}

/// A pass' clock: `None` while the profile is off.
pub(crate) struct Laps<'a> {
    totals: &'a Totals,
    last: Option<Instant>,
}

impl Laps<'static> {
    /// Starts a pass' clock (counting the pass) if the profile is on.
    pub(crate) fn start() -> Laps<'static> {
        Laps::on(&TOTALS, enabled())
    }
}

impl<'a> Laps<'a> {
    fn on(totals: &'a Totals, on: bool) -> Laps<'a> {
        if on {
            totals.passes.fetch_add(1, Ordering::Relaxed);
        }
        Laps {
            totals,
            last: on.then(Instant::now),
        }
    }

    /// Adds the time since the last lap to `op`.
    #[inline]
    pub(crate) fn lap(&mut self, op: Op) {
        if let Some(last) = &mut self.last {
            let now = Instant::now();
            let ns = now.duration_since(*last).as_nanos() as u64;
            self.totals.nanos[op as usize].fetch_add(ns, Ordering::Relaxed);
            *last = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_listed_in_their_index_order() {
        // `lap` indexes the totals by the kind's discriminant.
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{}", op.name());
        }
    }

    #[test]
    fn laps_add_to_their_kind_only_while_on() {
        let totals = Totals::new();
        let mut off = Laps::on(&totals, false);
        off.lap(Op::Qkv);
        assert_eq!(totals.take(), ([0; N], 0));
        let mut on = Laps::on(&totals, true);
        std::thread::sleep(std::time::Duration::from_millis(2));
        on.lap(Op::Attention);
        on.lap(Op::Head);
        let (t, passes) = totals.take();
        assert_eq!(passes, 1);
        assert!(t[Op::Attention as usize] >= 2_000_000, "{t:?}");
        for op in Op::ALL {
            if op != Op::Attention && op != Op::Head {
                assert_eq!(t[op as usize], 0, "{}", op.name());
            }
        }
        totals.reset();
        assert_eq!(totals.take(), ([0; N], 0));
    }
}
