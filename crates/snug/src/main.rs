//! The `snug` command line: flags are parsed into one struct per command,
//! then handed to the library crates. Errors become one line on stderr and
//! a non-zero exit code.

mod bench;
mod calibration;
mod chat;
mod decide;
mod embed;
mod env;
mod eval;
mod line_input;
mod model_cmd;
mod progress;
mod run;
mod serve;
mod session;
mod template_worker;

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use snug_model::arch::Model;
use snug_model::catalog::{self, DEFAULT_ALIAS};
use snug_model::{pull, remote};
use snug_model::{LoadOptions, ModelFiles};

#[derive(Parser)]
#[command(name = "snug", version, about = "Run language models where memory is the limit.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download a model into the cache: a known alias, a GGUF file of a
    /// Hugging Face repository, or a URL (or check a local GGUF file);
    /// prints the file's path as the last line.
    #[command(after_help = r#"Examples:
  snug pull                      the default model (smollm2-135m)
  snug pull qwen2.5-coder-0.5b
  snug pull hf:bartowski/SmolLM2-135M-Instruct-GGUF --quant Q8_0
  snug pull hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf
  snug pull https://example.com/models/model.gguf
  snug pull --all

A repository name picks its only GGUF file, or the one --quant names, or
Q4_K_M when there are several. An interrupted download resumes on the next
pull. HF_ENDPOINT names another hub, HF_TOKEN is sent to it."#)]
    Pull(PullArgs),
    /// Show a model's architecture, size, tensor types, geometry, tokenizer
    /// and memory estimate.
    #[command(after_help = "Examples:\n  snug info smollm2-135m\n  snug info ./model.gguf --json --metadata")]
    Info(InfoArgs),
    /// Turn text into token ids, as the model's tokenizer does.
    #[command(after_help = r#"Examples:
  snug tokenize smollm2-135m "Hello, world"
  echo "Hello" | snug tokenize smollm2-135m - --json"#)]
    Tokenize(TokenizeArgs),
    /// List the known model aliases and whether each is cached, then every
    /// file pulled by hf: name or URL.
    List,
    /// Remove pulled models from the cache.
    #[command(after_help = r#"Examples:
  snug rm qwen2.5-coder-1.5b
  snug rm gemma3-270m all-minilm-l6-v2"#)]
    Rm(RmArgs),
    /// Generate text from a prompt, streaming it to stdout.
    #[command(after_help = r#"Examples:
  snug run smollm2-135m -p "The capital of France is" -n 16
  snug run -m ./model.gguf --chat -p "Write a haiku" --temp 0.7
  snug run qwen2.5-coder-0.5b --system "Answer in one line." -p "What is Rust?"
  snug run smollm2-135m                  no prompt: a chat"#)]
    Run(RunArgs),
    /// Measure prefill and decode throughput (like llama-bench).
    #[command(
        after_help = "Examples:\n  snug bench smollm2-135m -p 128,512 -n 128 -r 3\n  snug bench -m ./model.gguf -d 0,1024,4096 --kv f16,q8,tq4 -o json"
    )]
    Bench(BenchArgs),
    /// Chat interactively; the KV cache is kept between turns.
    #[command(after_help = r#"Examples:
  snug chat
  snug chat qwen2.5-coder-1.5b --system "You are terse." --session work
  (in the chat: /help, /set temperature 0.7, /save NAME, /load NAME; Ctrl-C stops an answer)"#)]
    Chat(ChatArgs),
    /// Evaluate a model on text.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// Inspect saved sessions.
    #[command(subcommand)]
    Session(SessionCommand),
    /// Serve the model over an OpenAI-compatible HTTP API.
    #[command(after_help = r#"Examples:
  snug serve smollm2-135m --port 8080
  snug serve -m ./model.gguf --parallel 4 --memory-budget 512MiB --log-format json
  curl localhost:8080/v1/chat/completions -d '{"messages":[{"role":"user","content":"hi"}]}'"#)]
    Serve(serve::ServeArgs),
    /// Answer closed questions about a text with probabilities (choice,
    /// score, yes/no); `decide calibrate` fits their temperatures.
    #[command(after_help = r#"Examples:
  snug decide smollm2-135m --state "The printer is on fire" --question "urgent:noul:Is this urgent?""#)]
    Decide(decide::DecideArgs),
    /// Turn texts into embedding vectors, one JSON array per line.
    #[command(after_help = r#"Examples:
  snug embed all-minilm-l6-v2 "The cat sat on the mat." "A feline rested on a rug."
  snug embed qwen2.5-coder-0.5b -f notes.txt --json"#)]
    Embed(embed::EmbedArgs),
    /// Render chat templates sent on stdin, under a memory limit (started
    /// by snug itself).
    #[command(hide = true)]
    TemplateWorker(template_worker::WorkerArgs),
}

#[derive(Subcommand)]
enum SessionCommand {
    /// Print a session file's header (model, KV layout, tokens, sampler)
    /// after checking every checksum.
    Info(SessionInfoArgs),
    /// List the named chat sessions (`chat --session NAME`) in the cache.
    List(SessionListArgs),
}

#[derive(Args)]
struct SessionListArgs {
    /// Print one JSON object per line.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct SessionInfoArgs {
    /// The session file.
    file: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The KV cache's formats.
#[derive(Args, Default, Clone)]
struct KvArgs {
    /// KV cache format: f16, f32, q8 (int8 of the rotated vector and a
    /// scale, 51-52% of f16) or tq4 (4-bit codes of the rotated vector and
    /// a scale, 25-27% of f16).
    /// [default: f16, or a resumed session's]
    #[arg(long)]
    kv: Option<String>,
    /// Format of the keys only (overrides --kv for keys).
    #[arg(long)]
    kv_k: Option<String>,
    /// Format of the values only (overrides --kv for values).
    #[arg(long)]
    kv_v: Option<String>,
    /// Positions per KV page. With q8 or tq4, a sequence's first page and
    /// the page each new token falls in are also kept in F16 (the exact
    /// window). [default: 32, or a resumed session's]
    #[arg(long)]
    kv_page: Option<usize>,
    /// Whose arithmetic the forward pass follows: `native` (snug's own:
    /// f32 throughout, every row's bits independent of its batch) or
    /// `llama.cpp` (the float order and f16 roundings of llama.cpp's x86
    /// CPU build, for tokens equal to its own; rows' bits then depend on
    /// the batch as they do in llama.cpp, and speculation is off). KV made
    /// under one is not reused under the other. [default: native, or
    /// SNUG_NUMERICS]
    #[arg(long, value_name = "NAME")]
    numerics: Option<String>,
    /// Where the forward passes run: `cpu`, or `cuda` (the first NVIDIA
    /// GPU: the weights uploaded once, F16 KV pages in device memory; the
    /// driver and NVRTC are loaded then; see docs/CUDA.md). [default: cpu]
    #[arg(long, value_name = "DEVICE")]
    device: Option<String>,
}

impl KvArgs {
    /// `--numerics` if given (else what the model loaded with).
    fn numerics(&self) -> Result<Option<snug_kernels::ggml::Numerics>> {
        self.numerics
            .as_deref()
            .map(|n| {
                snug_kernels::ggml::Numerics::parse(n)
                    .with_context(|| format!("unknown --numerics {n:?} (native or llama.cpp)"))
            })
            .transpose()
    }
}

/// The model's weights on the GPU `--device` names, if it names one.
fn gpu_for(cache: &KvArgs, model: &Model) -> Result<Option<snug_engine::device::Gpu>> {
    match cache.device.as_deref() {
        None | Some("cpu") => Ok(None),
        Some("cuda") => {
            if model.numerics != snug_kernels::ggml::Numerics::Native {
                bail!("--numerics llama.cpp runs on the CPU only; leave it out with --device cuda");
            }
            let defines = &env::get().cuda_defines;
            snug_cuda::check_run_knobs(defines).map_err(|e| anyhow::anyhow!("SNUG_CUDA_DEFINES: {e}"))?;
            let dev = snug_cuda::Device::open_with(0, defines).map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?;
            let w = snug_cuda::CudaWeights::upload(&dev, model.weights())
                .map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?;
            Ok(Some(snug_engine::device::Gpu(std::sync::Arc::new(w))))
        }
        Some(d) => bail!("unknown --device {d:?} (cpu or cuda)"),
    }
}

/// Loads the model with the arithmetic `--numerics` asks for (else
/// `SNUG_NUMERICS`'s, else snug's own).
fn load_model<'a>(file: &'a ModelFiles, cache: &KvArgs) -> Result<Model<'a>> {
    let mut model = Model::load(file)?;
    model.numerics = cache.numerics()?.unwrap_or(env::get().numerics);
    Ok(model)
}

#[derive(Subcommand)]
enum EvalCommand {
    /// Perplexity over a text file in windows (as llama-perplexity), and
    /// with a compressed KV format its KL divergence and top-1 agreement
    /// against F16 KV.
    Ppl(EvalPplArgs),
}

#[derive(Args)]
struct EvalPplArgs {
    /// A model alias, hf: name or URL (pulled if needed), or a path to a GGUF file.
    model: String,
    /// The text file.
    file: PathBuf,
    #[command(flatten)]
    cache: KvArgs,
    /// Tokens per window; the second half of each is scored.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Rows per forward pass.
    #[arg(long, default_value_t = 512)]
    batch: usize,
    /// Stop after this many windows.
    #[arg(long)]
    max_windows: Option<usize>,
    /// Threads (default: the number of physical cores).
    #[arg(short = 't', long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Print one JSON object: ppl, kl_vs_f16, top1_vs_f16, tokens, ...
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ChatArgs {
    /// A model alias, hf: name or URL (pulled if needed), or a path to a GGUF file.
    #[arg(default_value = DEFAULT_ALIAS)]
    model: String,
    /// The model, given as llama.cpp's tools take it (instead of MODEL).
    #[arg(short = 'm', long = "model", value_name = "MODEL", conflicts_with = "model")]
    model_flag: Option<String>,
    /// A system message to start the conversation with.
    #[arg(long)]
    system: Option<String>,
    /// Keep the conversation in a session: resumed at start if it exists,
    /// saved after every turn. A name (kept in the cache's `sessions`
    /// folder) or a path ending in `.snug` or holding a `/`.
    #[arg(long, value_name = "NAME")]
    session: Option<String>,
    /// Prefill the whole conversation every turn instead of reusing the
    /// KV it already holds (to measure what reuse saves).
    #[arg(long)]
    no_cache_reuse: bool,
    #[command(flatten)]
    gen: GenArgs,
}

#[derive(Args)]
struct BenchArgs {
    /// A model alias, hf: name or URL (pulled if needed), or a path to a GGUF file.
    #[arg(default_value = DEFAULT_ALIAS)]
    model: String,
    /// The model, given as llama.cpp's tools take it (instead of MODEL).
    #[arg(short = 'm', long = "model", value_name = "MODEL", conflicts_with = "model")]
    model_flag: Option<String>,
    /// Prefill tests: comma-separated prompt lengths.
    #[arg(short = 'p', long = "n-prompt", default_value = "128,512")]
    prompt: String,
    /// Decode tests: comma-separated numbers of generated tokens.
    #[arg(short = 'n', long = "n-gen", default_value = "128")]
    gen: String,
    /// Context depths to run each test at: comma-separated.
    #[arg(short = 'd', long = "n-depth", default_value = "0")]
    depth: String,
    /// Repetitions (after one warm-up); medians are reported.
    #[arg(short = 'r', long, default_value_t = 3)]
    reps: usize,
    /// Threads (default: the number of physical cores).
    #[arg(short = 't', long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Rows per forward pass when prefilling.
    #[arg(short = 'b', long, default_value_t = 512)]
    batch: usize,
    /// Output: md or json.
    #[arg(short = 'o', long, default_value = "md")]
    output: String,
    /// Sequences decoding together, comma-separated (as llama-batched-bench's
    /// `-npl`): each count prefills that many sequences of the first `-p`
    /// length, then generates the first `-n` tokens in each, every step one
    /// forward pass over all of them; reported as `ppP xN` and `tgT xN`,
    /// tokens per second summed over the sequences (instead of the
    /// single-sequence tests).
    #[arg(long, value_name = "N,...")]
    parallel: Option<String>,
    /// Time each forward pass' operations (norms, products, attention, the
    /// head) and print, per test, the microseconds a token each took
    /// (CPU only; a clock read per operation).
    #[arg(long)]
    profile: bool,
    // `--kv` takes a comma-separated list here, each format run in turn
    // (as llama-bench's `-ctk`/`-ctv` lists).
    #[command(flatten)]
    cache: KvArgs,
}

#[derive(Args)]
struct GenArgs {
    /// Most tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy. [default: 0, or a resumed
    /// session's; so for every sampling flag]
    #[arg(long, visible_alias = "temp")]
    temperature: Option<f32>,
    /// [default: 40]
    #[arg(long)]
    top_k: Option<usize>,
    /// [default: 0.95]
    #[arg(long)]
    top_p: Option<f32>,
    /// [default: 0.05]
    #[arg(long)]
    min_p: Option<f32>,
    /// Penalty for tokens among the last 64 (1.0 is none). [default: 1.0]
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Subtracted from the logits of tokens among the last 64. [default: 0]
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// [default: 0]
    #[arg(long)]
    seed: Option<u64>,
    /// Threads (default: the number of physical cores).
    #[arg(short = 't', long, value_parser = crate::parse_threads)]
    threads: Option<usize>,
    /// Context length (default: the model's, at most 4096).
    #[arg(short = 'c', long, visible_alias = "ctx-size")]
    ctx: Option<usize>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    cache: KvArgs,
    /// Most bytes the KV cache may take (e.g. 256MiB, 1G); the context
    /// shrinks to what fits.
    #[arg(long)]
    kv_budget: Option<String>,
    /// Speculative decoding from prompt lookup: on, off, or auto (drafts
    /// when this machine's measured verify cost and the acceptance so far
    /// promise a gain). The output is the same either way.
    #[arg(long, default_value = "auto")]
    speculate: String,
    /// Append one JSON line per request (tokens, timing, speculation) to
    /// this file.
    #[arg(long, value_name = "PATH")]
    metrics_file: Option<PathBuf>,
    /// Keep full KV pages of earlier prompts here too (a disk tier of the
    /// prefix cache that survives restarts), one folder per model and KV
    /// layout.
    #[arg(long, value_name = "DIR")]
    prefix_cache_dir: Option<PathBuf>,
    /// Most bytes the prefix cache's disk tier keeps (least recently used
    /// pages go first).
    #[arg(long, value_name = "SIZE", default_value = "2GiB")]
    prefix_cache_size: String,
    /// Do not share cached KV pages between sequences (the prefix cache's
    /// RAM tier is on by default).
    #[arg(long, conflicts_with = "prefix_cache_dir")]
    no_prefix_cache: bool,
}

#[derive(Args)]
struct RunArgs {
    /// A model alias, hf: name or URL (pulled if needed), or a path to a GGUF file.
    #[arg(default_value = DEFAULT_ALIAS)]
    model: String,
    /// The model, given as llama.cpp's tools take it (instead of MODEL).
    #[arg(short = 'm', long = "model", value_name = "MODEL", conflicts_with = "model")]
    model_flag: Option<String>,
    /// The prompt; `-` reads standard input. With `--session`, text to
    /// append (a new user turn if the session is a chat). Without a
    /// prompt or a session, `run` starts a chat (as `snug chat`).
    #[arg(short = 'p', long)]
    prompt: Option<String>,
    /// A system message before the prompt (implies --chat).
    #[arg(long)]
    system: Option<String>,
    /// Resume from this session file if it exists (decode only: no
    /// prefill of what it holds), and save the state back to it after
    /// generating.
    #[arg(long, value_name = "FILE")]
    session: Option<PathBuf>,
    /// Save the state after generating to this session file (instead of
    /// the `--session` file).
    #[arg(long, value_name = "FILE")]
    save_session: Option<PathBuf>,
    /// Format the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Print one JSON object (text, token_ids, prompt_tokens, finish_reason, stats) instead of streaming.
    #[arg(long)]
    json: bool,
    /// Print timing and memory to stderr after the text.
    #[arg(long)]
    stats: bool,
    /// Constrain the output to JSON matching this schema (given inline).
    #[arg(short = 'j', long, value_name = "SCHEMA", group = "constraint")]
    json_schema: Option<String>,
    /// Constrain the output to JSON matching the schema in this file.
    #[arg(long, value_name = "FILE", group = "constraint")]
    json_schema_file: Option<PathBuf>,
    /// Constrain the output to a grammar: GBNF (as llama.cpp's), or
    /// llguidance's Lark when it has no `::=`.
    #[arg(long, group = "constraint")]
    grammar: Option<String>,
    /// Constrain the output to the grammar in this file (GBNF or Lark).
    #[arg(long, value_name = "FILE", group = "constraint")]
    grammar_file: Option<PathBuf>,
    /// Constrain the output to match this regular expression.
    #[arg(long, value_name = "REGEX", group = "constraint")]
    regex: Option<String>,
    #[command(flatten)]
    gen: GenArgs,
}

#[derive(Args)]
struct RmArgs {
    /// Models to remove, by alias, hf: name or URL (see `snug list`).
    #[arg(required = true)]
    models: Vec<String>,
}

#[derive(Args)]
struct PullArgs {
    /// A model alias, hf:OWNER/REPO[/FILE.gguf] (or hf:OWNER/REPO:QUANT), an
    /// http(s) URL of a GGUF file, or a path to a GGUF file.
    #[arg(default_value = DEFAULT_ALIAS)]
    model: String,
    /// Which of a repository's GGUF files to pull, by the quantization in
    /// its name (Q4_K_M, Q8_0, ...); without it, the only one, or Q4_K_M.
    #[arg(long, value_name = "QUANT")]
    quant: Option<String>,
    /// Pull every known model; prints one path a line.
    #[arg(long, conflicts_with_all = ["model", "quant"])]
    all: bool,
}

#[derive(Args)]
struct InfoArgs {
    /// A model alias, hf: name or URL (pulled if needed), or a path to a GGUF file.
    #[arg(default_value = DEFAULT_ALIAS)]
    model: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also list every metadata key (long arrays are summarised).
    #[arg(long)]
    metadata: bool,
}

#[derive(Args)]
struct TokenizeArgs {
    /// A model alias, hf: name or URL (pulled if needed), or a path to a GGUF file.
    model: String,
    /// The text to tokenize; `-` reads standard input.
    text: String,
    /// Print `{"ids": [...], "pieces": [...]}` instead of one token a line.
    #[arg(long)]
    json: bool,
    /// Never add BOS/EOS, whatever the model's metadata says.
    #[arg(long)]
    no_bos: bool,
    /// Treat control-token text such as `<|im_start|>` as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Batch mode: TEXT is a file (or `-`) holding one JSON string per line;
    /// prints one JSON object per line.
    #[arg(long, conflicts_with = "json")]
    jsonl: bool,
}

/// Every heap allocation is counted for the memory ledger.
#[global_allocator]
static HEAP: snug_core::CountingAlloc = snug_core::CountingAlloc::new();

/// Resident bytes when the process started, before any model: program text,
/// libraries, the main stack.
static RUNTIME_RSS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::TemplateWorker(a) = cli.command {
        return match template_worker::cmd_worker(a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "error: {}", error_line(&e));
                ExitCode::FAILURE
            }
        };
    }
    RUNTIME_RSS.get_or_init(|| run::rss_bytes("VmRSS:"));
    env::get();
    let result = match cli.command {
        Command::Pull(a) => model_cmd::cmd_pull(a),
        Command::Info(a) => model_cmd::cmd_info(a),
        Command::Tokenize(a) => model_cmd::cmd_tokenize(a),
        Command::List => model_cmd::cmd_list(),
        Command::Rm(a) => model_cmd::cmd_rm(a),
        Command::Run(mut a) => {
            if let Some(m) = a.model_flag.take() {
                a.model = m;
            }
            if a.prompt.is_none() && a.session.is_none() {
                chat::cmd_chat(ChatArgs {
                    model: a.model,
                    model_flag: None,
                    system: a.system,
                    session: None,
                    no_cache_reuse: false,
                    gen: a.gen,
                })
            } else {
                run::cmd_run(a)
            }
        }
        Command::Bench(mut a) => {
            if let Some(m) = a.model_flag.take() {
                a.model = m;
            }
            bench::cmd_bench(a)
        }
        Command::Chat(mut a) => {
            if let Some(m) = a.model_flag.take() {
                a.model = m;
            }
            chat::cmd_chat(a)
        }
        Command::Eval(EvalCommand::Ppl(a)) => eval::cmd_eval_ppl(a),
        Command::Session(SessionCommand::Info(a)) => session::cmd_info(a),
        Command::Session(SessionCommand::List(a)) => session::cmd_list(a),
        Command::Serve(a) => serve::cmd_serve(a),
        Command::Decide(a) => decide::cmd_decide(a),
        Command::Embed(a) => embed::cmd_embed(a),
        Command::TemplateWorker(_) => Ok(()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// `--threads N`: at least 1 and at most the threads this machine runs at
/// once. snug's pool spins between parallel sections, so more threads than
/// that would not run slower but stall.
pub(crate) fn parse_threads(text: &str) -> Result<usize, String> {
    let n: usize = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of threads"))?;
    let most = std::thread::available_parallelism().map_or(1, |n| n.get());
    match n {
        0 => Err("must be at least 1".into()),
        n if n > most => Err(format!(
            "{n} threads, but this machine runs {most} at once; use at most {most}"
        )),
        n => Ok(n),
    }
}

/// An error and its causes on one line, each cause once: a library error
/// that already says its cause (`PATH: Is a directory`) is not followed
/// by that cause again.
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string().replace('\n', " ");
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// A model alias, hf: name, URL or path, pulled if it is not a file and
/// not cached yet.
fn resolve_model(name: &str) -> Result<PathBuf> {
    let env = env::get();
    if !std::path::Path::new(name).exists() {
        let into = catalog::models_dir(&env.cache);
        if let Some(entry) = catalog::lookup(name) {
            if entry.cached(&env.cache).is_none() {
                eprintln!(
                    "pulling {} ({}) into {}",
                    entry.alias,
                    human_bytes(entry.size),
                    into.display()
                );
            }
        } else if let Some(Ok(remote)) = remote::RemoteName::parse(name, &env.hub.endpoint) {
            if remote::find_cached(&remote, &env.cache).is_none() {
                eprintln!("pulling {remote} into {}", into.display());
            }
        }
    }
    let bar = progress::PullBar::new();
    Ok(pull::resolve(name, &env.cache, &env.pip, &env.hub, &bar)?)
}

/// The directory of an encoder checkpoint (a Laya decision checkpoint or
/// a sentence-embedding model) that `name` names, pulling a known one;
/// `None` for a GGUF model.
fn encoder_checkpoint(name: &str) -> Result<Option<PathBuf>> {
    let path = std::path::Path::new(name);
    let dir = if path.exists() {
        path.to_path_buf()
    } else if catalog::lookup(name).is_some_and(|e| e.is_dir()) {
        resolve_model(name)?
    } else {
        return Ok(None);
    };
    let is = |d: &std::path::Path| snug_model::laya::is_checkpoint(d) || snug_model::sentence::is_checkpoint(d);
    if is(&dir) {
        return Ok(Some(dir));
    }
    if dir.is_dir() {
        bail!(
            "{}: not a regular file: a directory, but neither a Laya checkpoint (rl_agent_config.json) nor a sentence-embedding checkpoint (config.json, model.safetensors and modules.json)",
            dir.display()
        );
    }
    Ok(None)
}

fn open_model(name: &str) -> Result<ModelFiles> {
    Ok(open_model_at(name)?.1)
}

/// [`open_model`], also returning the file's path.
fn open_model_at(name: &str) -> Result<(PathBuf, ModelFiles)> {
    let path = resolve_model(name)?;
    if snug_model::sentence::is_checkpoint(&path) {
        bail!(
            "{name} is a sentence-embedding model: it makes embeddings (snug embed, snug serve) and generates no text"
        );
    }
    let options = LoadOptions {
        pack: env::get().pack.clone(),
    };
    let file = ModelFiles::open(&path, &options).with_context(|| format!("{}", path.display()))?;
    Ok((path, file))
}

pub(crate) use snug_core::ledger::human_bytes;

fn read_stdin() -> Result<String> {
    let mut s = String::new();
    std::io::stdin()
        .read_to_string(&mut s)
        .context("reading standard input")?;
    Ok(s)
}

/// A byte count: a number with an optional unit (k, M, G for powers of
/// 1000; KiB, MiB, GiB for powers of 1024; B for bytes).
fn parse_size(text: &str) -> Result<usize> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("not a size: {text:?} (e.g. 256MiB, 1G, 500000000)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => bail!("unknown size unit in {text:?} (B, k, M, G, KiB, MiB, GiB)"),
    };
    let v = n * mult;
    if !v.is_finite() || v < 1.0 || v > usize::MAX as f64 {
        bail!("size {text:?} is out of range");
    }
    Ok(v as usize)
}

#[cfg(test)]
mod error_tests {
    #[test]
    fn an_os_error_is_said_once_in_an_error_line() {
        let io = std::io::Error::from_raw_os_error(21);
        let e = anyhow::Error::new(snug_engine::session::SessionError::Io {
            path: "/tmp".into(),
            source: io,
        })
        .context("cannot resume");
        let line = super::error_line(&e);
        let os = std::io::Error::from_raw_os_error(21).to_string();
        assert_eq!(line.matches(&os).count(), 1, "{line}");
        assert!(line.starts_with("cannot resume: /tmp: "), "{line}");
    }
}

#[cfg(test)]
mod size_tests {
    #[test]
    fn sizes_parse_with_units_and_bad_ones_are_errors() {
        use super::parse_size;
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("1.5k").unwrap(), 1500);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("0").is_err());
    }
}
