//! Where `snug` renders chat templates from model files: in a child
//! process (this same binary, `snug template-worker`) whose address space
//! is limited, so that a template that doubles a string until memory runs
//! out fails one render with a clear error instead of taking the process
//! (a server with its clients' conversations) down. The protocol and the
//! pool of workers are `snug_model::template_child`'s.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use snug_model::template::{ChatTemplate, Isolation, Message, TemplateError};
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
/// template worker. It is tried once on a short conversation: a template
/// that runs past its budget of instructions, output, memory or time
/// there would on every request, so the model is refused with that
/// reason. (A template that raises an error there, say on a system
/// message it does not support, is kept: the error is the request's.)
pub fn for_model(source: Option<&str>) -> Result<ChatTemplate> {
    let template = ChatTemplate::for_model(source)?.isolated(renderer()?);
    let conversation = [
        Message::new("system", "You are a helpful assistant."),
        Message::new("user", "Hello, who are you?"),
        Message::new("assistant", "I am an assistant."),
        Message::new("user", "Tell me a short story."),
    ];
    match template.render(&conversation, true, "", "", serde_json::json!({})) {
        Err(
            e @ (TemplateError::Budget | TemplateError::TooLong | TemplateError::Memory(_) | TemplateError::Time(_)),
        ) => {
            bail!("the model's chat template cannot be used: {e}")
        }
        Err(TemplateError::Isolation(m)) => bail!("chat templates cannot be rendered: {m}"),
        _ => Ok(template),
    }
}

fn renderer() -> Result<Arc<dyn Isolation>> {
    static RENDERER: OnceLock<Arc<ChildRenderer>> = OnceLock::new();
    if let Some(r) = RENDERER.get() {
        return Ok(r.clone());
    }
    // The running binary itself, even if its file has since been replaced
    // (an upgrade while a server runs): /proc/self/exe names its inode.
    let proc_exe = std::path::Path::new("/proc/self/exe");
    let exe = if proc_exe.exists() {
        proc_exe.to_path_buf()
    } else {
        std::env::current_exe().context("cannot find the snug binary to render chat templates")?
    };
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
