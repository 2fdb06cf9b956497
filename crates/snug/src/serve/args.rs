//! `snug serve`'s flags.

use super::*;

#[derive(Args)]
pub struct ServeArgs {
    /// A model alias, hf: name or URL (pulled if needed), or a path to a GGUF file.
    #[arg(default_value = snug_model::catalog::DEFAULT_ALIAS)]
    pub(super) model: String,
    /// The model, given as llama-server takes it (instead of MODEL).
    #[arg(short = 'm', long = "model", value_name = "MODEL", conflicts_with = "model")]
    pub(super) model_flag: Option<String>,
    /// Address to listen on. Anything but a loopback address needs
    /// --api-key.
    #[arg(long, default_value = "127.0.0.1")]
    pub(super) host: String,
    /// Port to listen on; 0 takes a free one (printed at start).
    #[arg(long, default_value_t = 8080)]
    pub(super) port: u16,
    /// Clients must send `Authorization: Bearer KEY` (every route but
    /// /health). Also read from SNUG_API_KEY.
    #[arg(long, env = "SNUG_API_KEY", hide_env_values = true)]
    pub(super) api_key: Option<String>,
    /// Bytes the KV cache may take for all requests together (e.g.
    /// 512MiB). Requests are admitted only with room for their prompt and
    /// guaranteed output inside it. [default: --parallel contexts of
    /// --ctx]
    #[arg(long, value_name = "SIZE")]
    pub(super) memory_budget: Option<String>,
    /// Requests that may wait for admission; more get 503.
    #[arg(long, default_value_t = 64)]
    pub(super) max_queue: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 8)]
    pub(super) parallel: usize,
    /// Output tokens every admitted request is sure to have room for
    /// (reserved with its prompt); past it, a request grows into free
    /// pages.
    #[arg(long, default_value_t = 256)]
    pub(super) guaranteed_output: usize,
    /// Prompt tokens per prefill chunk.
    #[arg(long, default_value_t = 128)]
    pub(super) prefill_chunk: usize,
    /// Decode steps between two prefill chunks while requests decode.
    #[arg(long, default_value_t = 2)]
    pub(super) decode_steps: usize,
    /// Context length per request (default: the model's, at most 4096).
    #[arg(short = 'c', long)]
    pub(super) ctx: Option<usize>,
    /// Threads (default: the number of physical cores).
    #[arg(short = 't', long, value_parser = crate::parse_threads)]
    pub(super) threads: Option<usize>,
    #[command(flatten)]
    pub(super) cache: crate::KvArgs,
    /// Speculative decoding (for a request running alone): on, off or
    /// auto. The output is the same either way.
    #[arg(long, default_value = "auto")]
    pub(super) speculate: String,
    /// Where the web page's conversations are saved (default: `chats/` in
    /// snug's cache).
    #[arg(long, value_name = "DIR")]
    pub(super) chats_dir: Option<PathBuf>,
    /// Do not serve the web chat page at `/` (nor its conversation store).
    #[arg(long, conflicts_with = "chats_dir")]
    pub(super) no_web: bool,
    /// Largest request body in bytes (e.g. 4MiB).
    #[arg(long, value_name = "SIZE", default_value = "4MiB")]
    pub(super) max_body: String,
    /// Seconds a connection has to send a whole request once the server
    /// waits for one (headers and body, however paced); an idle
    /// connection is closed after as long.
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(super) read_timeout: u64,
    /// Connections open at once; past it, new ones wait in the kernel's
    /// backlog until one closes (so clients that hold connections cannot
    /// exhaust the process's file descriptors).
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(super) max_connections: u64,
    /// Seconds after SIGTERM or SIGINT that running requests may take to
    /// finish; then they are cut and the server exits.
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub(super) shutdown_timeout: u64,
    /// Access-log lines on stderr, one per request: `text` or `json`.
    #[arg(long, value_name = "FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub(super) log_format: String,
    /// No access-log lines.
    #[arg(long)]
    pub(super) no_access_log: bool,
    /// Append one JSON line per finished request (tokens, TTFT, per-token
    /// latency percentiles, speculation, peak KV pages) to this file.
    #[arg(long, value_name = "PATH")]
    pub(super) metrics_file: Option<PathBuf>,
    /// The model's name in /v1/models and responses [default: the model
    /// argument].
    #[arg(long)]
    pub(super) alias: Option<String>,
    /// Keep full KV pages of earlier prompts here too (the prefix cache's
    /// disk tier).
    #[arg(long, value_name = "DIR")]
    pub(super) prefix_cache_dir: Option<PathBuf>,
    #[arg(long, value_name = "SIZE", default_value = "2GiB")]
    pub(super) prefix_cache_size: String,
    /// Publish the prefix cache's changes for routers, in vLLM's KV-event
    /// format, on this ZeroMQ endpoint (e.g. tcp://*:5557; a wildcard
    /// host binds, a named one connects).
    #[arg(long, value_name = "ENDPOINT", conflicts_with = "no_prefix_cache")]
    pub(super) kv_events: Option<String>,
    /// Answer replay requests for missed event batches here (e.g.
    /// tcp://*:5558).
    #[arg(long, value_name = "ENDPOINT", requires = "kv_events")]
    pub(super) kv_events_replay: Option<String>,
    /// The topic frame of every event message.
    #[arg(long, value_name = "TOPIC", default_value = "", requires = "kv_events")]
    pub(super) kv_events_topic: String,
    /// Each event as a `map` with named fields (vLLM's current form) or
    /// a positional `array` (its older form).
    #[arg(long, value_name = "FORMAT", default_value = "map", value_parser = ["map", "array"], requires = "kv_events")]
    pub(super) kv_events_format: String,
    /// Do not share cached KV pages between requests.
    #[arg(long, conflicts_with = "prefix_cache_dir")]
    pub(super) no_prefix_cache: bool,
    /// Give the output head's resident pages back to the system while
    /// only prompt chunks that need no logits run (they fault back in
    /// when logits are next wanted). Lowers resident memory during long
    /// prefills, at the cost of re-reading the head; see docs/SERVER.md.
    #[arg(long)]
    pub(super) lease_head: bool,
}
