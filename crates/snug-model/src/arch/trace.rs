//! The forward pass' intermediate values, for comparing with other
//! runtimes' tensor dumps: the sum and first values of each, printed to
//! stderr, and each written raw to a directory. Off unless a program turns
//! it on ([`configure`]; the `snug` binary does for `SNUG_TRACE`,
//! `SNUG_TRACE_ALL` and `SNUG_DUMP=DIR`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// What is traced.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Print each intermediate of the first and last layers (and the
    /// output's).
    pub first_and_last: bool,
    /// ... of every layer.
    pub every_layer: bool,
    /// Also write every intermediate (f32, native byte order) to
    /// `DIR/NNNN_NAME-LAYER.bin`, numbered in order.
    pub dump: Option<PathBuf>,
}

static TRACE: OnceLock<Trace> = OnceLock::new();

/// Sets what is traced, once, before the first forward pass; returns
/// whether it took effect.
pub fn configure(t: Trace) -> bool {
    TRACE.set(t).is_ok()
}

/// Whether anything is traced (a backend whose buffers are elsewhere
/// copies them to the host only then; a GPU's decode steps run as graphs
/// only when not).
pub fn enabled() -> bool {
    TRACE.get().is_some_and(Trace::any)
}

impl Trace {
    /// Whether this traces anything at all.
    pub fn any(&self) -> bool {
        self.first_and_last || self.every_layer || self.dump.is_some()
    }
}

/// Traces `v`, the intermediate `name` of `layer` (`usize::MAX`: the
/// output's) of a model of `layers` layers.
pub fn trace(name: &str, layer: usize, layers: usize, v: &[f32]) {
    let Some(t) = TRACE.get().filter(|t| t.any()) else {
        return;
    };
    let label = if layer == usize::MAX {
        "out".to_string()
    } else {
        layer.to_string()
    };
    if let Some(dir) = &t.dump {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
        let _ = std::fs::write(dir.join(format!("{n:04}_{name}-{label}.bin")), bytes);
    }
    let edge = layer == usize::MAX || layer == 0 || layer + 1 == layers;
    if t.every_layer || (t.first_and_last && edge) {
        let sum: f64 = v.iter().map(|&x| x as f64).sum();
        let head: Vec<String> = v.iter().take(4).map(|x| format!("{x:.4}")).collect();
        eprintln!("trace {name}-{layer}: sum = {sum:.6} [{}]", head.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_of_nothing_traces_nothing() {
        // The binary configures a trace from the environment on every run;
        // with nothing asked for, backends must not copy or print.
        assert!(!Trace::default().any());
        let every = Trace {
            first_and_last: true,
            every_layer: true,
            ..Trace::default()
        };
        assert!(every.any());
        let dump = Trace {
            dump: Some(PathBuf::from("d")),
            ..Trace::default()
        };
        assert!(dump.any());
    }
}
