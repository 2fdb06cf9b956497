//! The server's counters, gauges and histograms, written in Prometheus'
//! text exposition format for `GET /metrics`.
//!
//! Hand-written rather than taken from a metrics crate: the engine loop
//! updates a few dozen plain numbers under one lock once per step, and the
//! text format is a handful of lines per family; a registry with dynamic
//! labels and atomics would add more code paths than it saves.

use std::collections::BTreeMap;
use std::fmt::Write;

use snug_core::prefix::PrefixStats;
use snug_core::Ledger;

/// A cumulative histogram with fixed bucket bounds (seconds).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// Bounds for time to first token and whole requests.
pub const LATENCY_BOUNDS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Bounds for the time between two tokens.
pub const TOKEN_BOUNDS: &[f64] = &[0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        self.write_labelled(out, name, help, "");
    }

    /// As `write`, each line also carrying `labels` (`key="value",...`;
    /// empty for none).
    fn write_labelled(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let (sep, set) = if labels.is_empty() {
            (String::new(), String::new())
        } else {
            (format!(",{labels}"), format!("{{{labels}}}"))
        };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"{sep}}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"{sep}}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{set} {}", self.sum);
        let _ = writeln!(out, "{name}_count{set} {}", self.count);
    }
}

/// Everything `/metrics` reports.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// HTTP requests by route.
    pub requests: BTreeMap<&'static str, u64>,
    /// Finished requests by reason: stop, length, cancelled, error.
    pub finished: BTreeMap<&'static str, u64>,
    /// Refused requests by reason: queue_full, never_fits, bad_request,
    /// unauthorized, too_large, context_length.
    pub rejected: BTreeMap<&'static str, u64>,
    /// Requests that waited in the queue before admission.
    pub queued: u64,
    pub prompt_tokens: u64,
    pub reused_tokens: u64,
    pub generated_tokens: u64,
    pub ttft: Histogram,
    pub token_latency: Histogram,
    pub e2e: Histogram,
    pub running: u64,
    pub waiting: u64,
    pub kv_pages_total: u64,
    /// Held by requests.
    pub kv_pages_used: u64,
    /// Held by the prefix cache alone (evictable).
    pub kv_pages_cached: u64,
    /// Held or reserved by running requests (the scheduler's view).
    pub kv_pages_reserved: u64,
    pub kv_page_tokens: u64,
    pub kv_page_bytes: u64,
    pub ledger: Option<Ledger>,
    pub spec_rounds: u64,
    pub spec_drafted: u64,
    pub spec_accepted: u64,
    pub prefix: PrefixStats,
    /// Engine steps (forward passes) and rows they computed.
    pub steps: u64,
    pub rows: u64,
    /// Output head leases: times given back, bytes given back in all,
    /// times taken back by a forward that wanted logits.
    pub lease_releases: u64,
    pub lease_released_bytes: u64,
    pub lease_returns: u64,
    /// Decision requests: questions answered, and time per request.
    pub decide_questions: u64,
    pub decide: Histogram,
    /// The served model's name (the `model_name` label of the `vllm:`
    /// families) and the KV pages' format(s) (`f16`, `q8`, `tq4`, or
    /// `K/V` where keys and values differ).
    pub model_name: String,
    pub cache_dtype: String,
    /// KV-event batches dropped because the publisher fell behind (`None`
    /// without `--kv-events`).
    pub kv_events_dropped: Option<u64>,
}

impl Metrics {
    pub fn new(page_tokens: usize, page_bytes: usize) -> Metrics {
        Metrics {
            requests: BTreeMap::new(),
            finished: BTreeMap::new(),
            rejected: BTreeMap::new(),
            queued: 0,
            prompt_tokens: 0,
            reused_tokens: 0,
            generated_tokens: 0,
            ttft: Histogram::new(LATENCY_BOUNDS),
            token_latency: Histogram::new(TOKEN_BOUNDS),
            e2e: Histogram::new(LATENCY_BOUNDS),
            running: 0,
            waiting: 0,
            kv_pages_total: 0,
            kv_pages_used: 0,
            kv_pages_cached: 0,
            kv_pages_reserved: 0,
            kv_page_tokens: page_tokens as u64,
            kv_page_bytes: page_bytes as u64,
            ledger: None,
            spec_rounds: 0,
            spec_drafted: 0,
            spec_accepted: 0,
            prefix: PrefixStats::default(),
            steps: 0,
            rows: 0,
            lease_releases: 0,
            lease_released_bytes: 0,
            lease_returns: 0,
            decide_questions: 0,
            decide: Histogram::new(LATENCY_BOUNDS),
            model_name: String::new(),
            cache_dtype: String::new(),
            kv_events_dropped: None,
        }
    }

    pub fn request(&mut self, route: &'static str) {
        *self.requests.entry(route).or_default() += 1;
    }

    pub fn finished(&mut self, reason: &'static str) {
        *self.finished.entry(reason).or_default() += 1;
    }

    pub fn rejected(&mut self, reason: &'static str) {
        *self.rejected.entry(reason).or_default() += 1;
    }

    /// The Prometheus text; `rss` is the process' resident bytes now.
    pub fn render(&self, rss: u64, peak_rss: u64) -> String {
        let mut o = String::new();
        let family = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        let labelled = |o: &mut String, name: &str, label: &str, m: &BTreeMap<&'static str, u64>| {
            for (k, v) in m {
                let _ = writeln!(o, "{name}{{{label}=\"{k}\"}} {v}");
            }
        };
        family(&mut o, "snug_http_requests_total", "counter", "HTTP requests by route.");
        labelled(&mut o, "snug_http_requests_total", "route", &self.requests);
        family(
            &mut o,
            "snug_requests_finished_total",
            "counter",
            "Generations finished, by reason.",
        );
        labelled(&mut o, "snug_requests_finished_total", "reason", &self.finished);
        family(
            &mut o,
            "snug_requests_rejected_total",
            "counter",
            "Requests refused, by reason (503s: queue_full, never_fits).",
        );
        labelled(&mut o, "snug_requests_rejected_total", "reason", &self.rejected);
        let counters: [(&str, &str, u64); 13] = [
            (
                "snug_decide_questions_total",
                "Questions answered by /v1/systemone.",
                self.decide_questions,
            ),
            (
                "snug_lease_releases_total",
                "Times the output head's pages were given back before a forward without logits.",
                self.lease_releases,
            ),
            (
                "snug_lease_released_bytes_total",
                "Bytes of the output head given back, in all.",
                self.lease_released_bytes,
            ),
            (
                "snug_lease_returns_total",
                "Times a forward wanting logits faulted the head back in.",
                self.lease_returns,
            ),
            (
                "snug_requests_queued_total",
                "Requests that waited in the queue before admission.",
                self.queued,
            ),
            (
                "snug_prompt_tokens_total",
                "Prompt tokens of finished requests.",
                self.prompt_tokens,
            ),
            (
                "snug_prompt_tokens_reused_total",
                "Prompt tokens taken from the prefix cache instead of prefilled.",
                self.reused_tokens,
            ),
            (
                "snug_generated_tokens_total",
                "Tokens generated.",
                self.generated_tokens,
            ),
            ("snug_engine_steps_total", "Forward passes.", self.steps),
            ("snug_engine_rows_total", "Rows computed by forward passes.", self.rows),
            ("snug_speculation_rounds_total", "Verify forwards.", self.spec_rounds),
            (
                "snug_speculation_drafted_total",
                "Draft tokens verified.",
                self.spec_drafted,
            ),
            (
                "snug_speculation_accepted_total",
                "Draft tokens accepted.",
                self.spec_accepted,
            ),
        ];
        for (name, help, v) in counters {
            family(&mut o, name, "counter", help);
            let _ = writeln!(o, "{name} {v}");
        }
        let p = &self.prefix;
        let prefix: [(&str, u64); 6] = [
            ("lookups", p.lookups),
            ("hits", p.hits),
            ("reused_tokens", p.reused_tokens),
            ("evictions", p.evictions),
            ("disk_reads", p.disk_hits),
            ("disk_writes", p.disk_writes),
        ];
        family(
            &mut o,
            "snug_prefix_cache_total",
            "counter",
            "Prefix cache events by kind.",
        );
        for (k, v) in prefix {
            let _ = writeln!(o, "snug_prefix_cache_total{{event=\"{k}\"}} {v}");
        }
        if let Some(v) = self.kv_events_dropped {
            family(
                &mut o,
                "snug_kv_events_dropped_total",
                "counter",
                "KV-event batches dropped because the publisher fell behind.",
            );
            let _ = writeln!(o, "snug_kv_events_dropped_total {v}");
        }
        self.ttft.write(
            &mut o,
            "snug_time_to_first_token_seconds",
            "From receipt to the first token.",
        );
        self.token_latency.write(
            &mut o,
            "snug_time_per_output_token_seconds",
            "Between two tokens of a request.",
        );
        self.e2e.write(
            &mut o,
            "snug_request_duration_seconds",
            "From receipt to the last token.",
        );
        let gauges: [(&str, &str, u64); 4] = [
            ("snug_requests_running", "Requests admitted and running.", self.running),
            ("snug_requests_waiting", "Requests queued for admission.", self.waiting),
            ("snug_kv_page_tokens", "Positions per KV page.", self.kv_page_tokens),
            (
                "snug_kv_page_bytes",
                "Bytes per KV page (every layer).",
                self.kv_page_bytes,
            ),
        ];
        for (name, help, v) in gauges {
            family(&mut o, name, "gauge", help);
            let _ = writeln!(o, "{name} {v}");
        }
        family(
            &mut o,
            "snug_kv_pages",
            "gauge",
            "KV pages: total, used by requests, cached (prefix cache only, evictable), free, reserved (held or promised to running requests).",
        );
        let free = self
            .kv_pages_total
            .saturating_sub(self.kv_pages_used + self.kv_pages_cached);
        for (k, v) in [
            ("total", self.kv_pages_total),
            ("used", self.kv_pages_used),
            ("cached", self.kv_pages_cached),
            ("free", free),
            ("reserved", self.kv_pages_reserved),
        ] {
            let _ = writeln!(o, "snug_kv_pages{{state=\"{k}\"}} {v}");
        }
        family(
            &mut o,
            "snug_memory_bytes",
            "gauge",
            "The memory ledger by part, and the measured resident set.",
        );
        if let Some(l) = &self.ledger {
            for (k, v) in [
                ("runtime", l.runtime),
                ("weights_mapped", l.weights_mapped),
                ("weights_resident", l.weights_resident),
                ("kv_reserved", l.kv_reserved),
                ("kv_used", l.kv_used),
                ("kv_exact_window", l.kv_exact),
                ("scratch", l.scratch),
                ("heap_other", l.heap_other),
                ("ledger_total", l.total()),
            ] {
                let _ = writeln!(o, "snug_memory_bytes{{part=\"{k}\"}} {v}");
            }
            if let Some(d) = &l.device {
                for (k, v) in [
                    ("device_weights", d.weights),
                    ("device_kv_reserved", d.kv_reserved),
                    ("device_kv_used", d.kv_used),
                    ("device_scratch", d.scratch),
                    ("device_total", d.total()),
                ] {
                    let _ = writeln!(o, "snug_memory_bytes{{part=\"{k}\"}} {v}");
                }
            }
        }
        let _ = writeln!(o, "snug_memory_bytes{{part=\"rss\"}} {rss}");
        let _ = writeln!(o, "snug_memory_bytes{{part=\"peak_rss\"}} {peak_rss}");
        self.render_vllm(&mut o);
        o
    }

    /// The families inference routers and gateways read from a vLLM
    /// server, under vLLM's names and meaning, from the same numbers as
    /// snug's own (docs/SERVER.md lists the mapping). Every line carries
    /// `model_name`, as vLLM's do.
    fn render_vllm(&self, o: &mut String) {
        let model = format!("model_name=\"{}\"", label_value(&self.model_name));
        let family = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        let usage = if self.kv_pages_total == 0 {
            0.0
        } else {
            self.kv_pages_used as f64 / self.kv_pages_total as f64
        };
        let plain: [(&str, &str, &str, f64); 8] = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Requests admitted and running (snug_requests_running).",
                self.running as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Requests waiting for admission (snug_requests_waiting).",
                self.waiting as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage, 1 meaning full: pages held by requests over all pages.",
                usage,
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "gauge",
                "The same as vllm:kv_cache_usage_perc, under its earlier name.",
                usage,
            ),
            (
                "vllm:prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests (snug_prompt_tokens_total).",
                self.prompt_tokens as f64,
            ),
            (
                "vllm:generation_tokens_total",
                "counter",
                "Tokens generated (snug_generated_tokens_total).",
                self.generated_tokens as f64,
            ),
            (
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache (those of finished requests).",
                self.prompt_tokens as f64,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prompt tokens found in the prefix cache (snug_prompt_tokens_reused_total).",
                self.reused_tokens as f64,
            ),
        ];
        for (name, kind, help, v) in plain {
            family(o, name, kind, help);
            let _ = writeln!(o, "{name}{{{model}}} {v}");
        }
        family(
            o,
            "vllm:cache_config_info",
            "gauge",
            "The KV cache's configuration, in labels: positions per page, pages, format.",
        );
        let _ = writeln!(
            o,
            "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"{}\",num_gpu_blocks=\"{}\",{model}}} 1",
            self.kv_page_tokens,
            label_value(&self.cache_dtype),
            self.kv_pages_total
        );
        family(
            o,
            "vllm:request_success_total",
            "counter",
            "Finished requests by reason: stop, length, abort (cancelled), error.",
        );
        for (k, v) in &self.finished {
            let reason = match *k {
                "cancelled" => "abort",
                other => other,
            };
            let _ = writeln!(
                o,
                "vllm:request_success_total{{finished_reason=\"{reason}\",{model}}} {v}"
            );
        }
        self.ttft.write_labelled(
            o,
            "vllm:time_to_first_token_seconds",
            "Time to first token (snug_time_to_first_token_seconds).",
            &model,
        );
        self.token_latency.write_labelled(
            o,
            "vllm:inter_token_latency_seconds",
            "Time between two tokens of a request (snug_time_per_output_token_seconds).",
            &model,
        );
        self.e2e.write_labelled(
            o,
            "vllm:e2e_request_latency_seconds",
            "From receipt to the last token (snug_request_duration_seconds).",
            &model,
        );
    }
}

/// `v` as a Prometheus label value: backslash, double quote and newline
/// escaped.
fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.5, 3.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.write(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"1\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_count 4\n"), "{out}");
    }

    #[test]
    fn every_family_is_declared_once() {
        let mut m = Metrics::new(32, 1000);
        m.request("chat");
        m.rejected("queue_full");
        let text = m.render(1, 2);
        let mut seen = std::collections::HashSet::new();
        for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
            assert!(seen.insert(line.to_string()), "{line} twice");
        }
        assert!(text.contains("snug_requests_rejected_total{reason=\"queue_full\"} 1"));
        assert!(text.contains("snug_kv_pages{state=\"free\"} 0"));
    }

    #[test]
    fn vllm_families_carry_snugs_numbers_under_vllms_names() {
        let mut m = Metrics::new(32, 1000);
        m.model_name = "smol \"v2\"".into();
        m.cache_dtype = "q8/tq4".into();
        m.running = 3;
        m.waiting = 2;
        m.kv_pages_total = 40;
        m.kv_pages_used = 10;
        m.prompt_tokens = 100;
        m.reused_tokens = 64;
        m.generated_tokens = 7;
        m.finished("stop");
        m.finished("cancelled");
        m.ttft.observe(0.02);
        let text = m.render(1, 2);
        let label = "model_name=\"smol \\\"v2\\\"\"";
        for line in [
            format!("vllm:num_requests_running{{{label}}} 3"),
            format!("vllm:num_requests_waiting{{{label}}} 2"),
            format!("vllm:kv_cache_usage_perc{{{label}}} 0.25"),
            format!("vllm:gpu_cache_usage_perc{{{label}}} 0.25"),
            format!(
                "vllm:cache_config_info{{block_size=\"32\",cache_dtype=\"q8/tq4\",num_gpu_blocks=\"40\",{label}}} 1"
            ),
            format!("vllm:prompt_tokens_total{{{label}}} 100"),
            format!("vllm:generation_tokens_total{{{label}}} 7"),
            format!("vllm:prefix_cache_queries_total{{{label}}} 100"),
            format!("vllm:prefix_cache_hits_total{{{label}}} 64"),
            format!("vllm:request_success_total{{finished_reason=\"stop\",{label}}} 1"),
            format!("vllm:request_success_total{{finished_reason=\"abort\",{label}}} 1"),
            format!("vllm:time_to_first_token_seconds_bucket{{le=\"0.025\",{label}}} 1"),
            format!("vllm:time_to_first_token_seconds_count{{{label}}} 1"),
            format!("vllm:inter_token_latency_seconds_count{{{label}}} 0"),
            format!("vllm:e2e_request_latency_seconds_bucket{{le=\"+Inf\",{label}}} 0"),
        ] {
            assert!(text.lines().any(|l| l == line), "/metrics lacks {line}:\n{text}");
        }
        let mut seen = std::collections::HashSet::new();
        for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
            assert!(seen.insert(line.to_string()), "{line} twice");
        }
    }
}
