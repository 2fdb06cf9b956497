//! The memory ledger: where every resident byte of a run goes.
//!
//! ```text
//! total = runtime + weights (resident) + KV (reserved) + KV exact window
//!       + speculation state + scratch + other heap
//! ```
//!
//! `runtime` is the process's resident size before the model is opened
//! (program text, libraries, thread stacks); weights are the pages of the
//! mapped model file that are resident (`mincore`); KV pages and scratch are
//! allocated whole and written at start, so reserved is resident; the KV
//! exact window is the F16 twin pages and key basis of lossy formats; the
//! speculation state is the drafter's n-gram index at its largest; "other
//! heap" is the rest of the counted heap's peak (tokenizer, logits, token
//! lists). The total is checked against the measured peak resident size.
//!
//! A run on a GPU keeps its weights, KV pages and scratch in device memory:
//! those are the [`Device`] lines, outside the host total (the host then
//! holds the mapped file, the tokenizer and the step's tables).

/// One run's memory, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    pub runtime: u64,
    pub weights_mapped: u64,
    pub weights_resident: u64,
    pub kv_reserved: u64,
    pub kv_used: u64,
    pub scratch: u64,
    /// Twin pages and key basis of a lossy KV format.
    pub kv_exact: u64,
    /// The drafter's index (speculative decoding).
    pub speculation: u64,
    pub heap_other: u64,
    /// Device memory, where the forward passes run on a GPU.
    pub device: Option<Device>,
}

/// A GPU run's device memory, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Device {
    pub weights: u64,
    pub kv_reserved: u64,
    pub kv_used: u64,
    pub scratch: u64,
}

impl Device {
    pub fn total(&self) -> u64 {
        self.weights + self.kv_reserved + self.scratch
    }
}

impl Ledger {
    /// A ledger from the heap's peak, which includes the KV pages and the
    /// scratch (both heap allocations).
    pub fn from_heap_peak(
        runtime: u64,
        weights_mapped: u64,
        weights_resident: u64,
        kv_reserved: u64,
        kv_used: u64,
        scratch: u64,
        heap_peak: u64,
    ) -> Ledger {
        Ledger {
            runtime,
            weights_mapped,
            weights_resident,
            kv_reserved,
            kv_used,
            scratch,
            kv_exact: 0,
            speculation: 0,
            heap_other: heap_peak.saturating_sub(kv_reserved + scratch),
            device: None,
        }
    }

    /// A GPU run's ledger: the KV pages and scratch are in device memory
    /// (`device`), so the host's heap peak is all "other heap".
    pub fn on_device(
        runtime: u64,
        weights_mapped: u64,
        weights_resident: u64,
        heap_peak: u64,
        device: Device,
    ) -> Ledger {
        Ledger {
            device: Some(device),
            ..Ledger::from_heap_peak(runtime, weights_mapped, weights_resident, 0, 0, 0, heap_peak)
        }
    }

    /// Moves the exact window's and the speculation state's bytes (heap
    /// allocations too) out of "other heap" onto their own lines.
    pub fn with_exact_and_speculation(mut self, kv_exact: u64, speculation: u64) -> Ledger {
        self.heap_other = self.heap_other.saturating_sub(kv_exact + speculation);
        self.kv_exact = kv_exact;
        self.speculation = speculation;
        self
    }

    /// The bytes the ledger says are resident.
    pub fn total(&self) -> u64 {
        self.runtime
            + self.weights_resident
            + self.kv_reserved
            + self.kv_exact
            + self.speculation
            + self.scratch
            + self.heap_other
    }

    /// `total / measured`: 1.0 when the ledger matches a measured resident
    /// size exactly.
    pub fn ratio_to(&self, measured: u64) -> f64 {
        if measured == 0 {
            return f64::NAN;
        }
        self.total() as f64 / measured as f64
    }
}

/// A byte count for people: `512 B`, `1.5 KiB`, `3.2 GiB` (binary units,
/// one decimal).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_read_in_binary_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_bytes(u64::MAX), "16777216.0 TiB");
    }

    #[test]
    fn other_heap_excludes_kv_and_scratch() {
        let l = Ledger::from_heap_peak(5, 100, 90, 40, 10, 8, 60);
        assert_eq!(l.heap_other, 12);
        assert_eq!(l.total(), 5 + 90 + 40 + 8 + 12);
        assert!((l.ratio_to(155) - 1.0).abs() < 1e-12);
        // A heap peak below the engine's buffers (not possible in a real run)
        // does not underflow.
        assert_eq!(Ledger::from_heap_peak(0, 0, 0, 40, 0, 8, 10).heap_other, 0);
        // The exact window and the drafter come out of other heap: the
        // total stays the same.
        let m = l.with_exact_and_speculation(7, 3);
        assert_eq!((m.heap_other, m.kv_exact, m.speculation), (2, 7, 3));
        assert_eq!(m.total(), l.total());
    }

    #[test]
    fn device_memory_stays_out_of_the_host_total() {
        let d = Device {
            weights: 1000,
            kv_reserved: 400,
            kv_used: 100,
            scratch: 50,
        };
        let l = Ledger::on_device(5, 100, 90, 60, d);
        assert_eq!((l.kv_reserved, l.scratch, l.heap_other), (0, 0, 60));
        assert_eq!(l.total(), 5 + 90 + 60);
        assert_eq!(l.device.unwrap().total(), 1450);
    }
}
