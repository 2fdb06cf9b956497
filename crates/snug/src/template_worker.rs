//! Where `snug` renders chat templates from model files: in a child
//! process (this same binary, `snug template-worker`) whose address space
//! is limited, so that a template that doubles a string until memory runs
//! out fails one render with a clear error instead of taking the process
//! (a server with its clients' conversations) down. The protocol and the
//! pool of workers are `snug_model::template_child`'s.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use snug_model::template::{ChatTemplate, Isolation};
use snug_model::template_child::{serve_renders, ChildRenderer};

/// Address space a template worker may use.
pub const MEMORY_MIB: u64 = 1024;

/// Longest a render may take (the instruction budget stops a looping
/// template well before this; the clock is for anything it misses).
pub const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Args)]
pub struct WorkerArgs {
    /// Address space limit, MiB.
    #[arg(long, default_value_t = MEMORY_MIB)]
    memory_mib: u64,
}

/// The model's chat template (or the plain fallback), rendering in a
/// template worker.
pub fn for_model(source: Option<&str>) -> Result<ChatTemplate> {
    let template = ChatTemplate::for_model(source)?;
    Ok(template.isolated(renderer()?))
}

fn renderer() -> Result<Arc<dyn Isolation>> {
    static RENDERER: OnceLock<Arc<ChildRenderer>> = OnceLock::new();
    if let Some(r) = RENDERER.get() {
        return Ok(r.clone());
    }
    let exe = std::env::current_exe().context("cannot find the snug binary to render chat templates")?;
    let r = RENDERER.get_or_init(|| {
        Arc::new(ChildRenderer::new(
            exe,
            vec!["template-worker".into(), "--memory-mib".into(), MEMORY_MIB.to_string()],
            MEMORY_MIB,
            TIMEOUT,
        ))
    });
    Ok(r.clone())
}

/// `snug template-worker`: limits this process's address space, then
/// answers render requests on stdin until it closes.
pub fn cmd_worker(a: WorkerArgs) -> Result<()> {
    let bytes = a.memory_mib.saturating_mul(1 << 20);
    let limit = libc::rlimit {
        rlim_cur: bytes as libc::rlim_t,
        rlim_max: bytes as libc::rlim_t,
    };
    // SAFETY: a plain system call with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
        return Err(std::io::Error::last_os_error()).context("cannot limit the template worker's memory");
    }
    serve_renders(std::io::stdin().lock(), std::io::stdout().lock()).context("template worker")
}
