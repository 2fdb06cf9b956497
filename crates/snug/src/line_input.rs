//! What `snug chat` reads: lines from a terminal with editing and history
//! (`rustyline`), or plain lines from a pipe; a message over several lines
//! (a line ending in `\`, or a block between lines of `"""`); and Ctrl-C,
//! which stops an answer being generated instead of the program.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use rustyline::error::ReadlineError;

/// Opens and closes a block of several lines.
const QUOTES: &str = "\"\"\"";

/// What one read gave.
pub enum Line {
    Text(String),
    /// Ctrl-C at the prompt.
    Interrupted,
    /// End of input (Ctrl-D, or the pipe closed).
    End,
}

pub struct Input {
    editor: Option<rustyline::DefaultEditor>,
    history: Option<PathBuf>,
}

impl Input {
    /// Line editing when stdin is a terminal (with history kept in
    /// `history`); plain lines otherwise.
    pub fn new(history: Option<PathBuf>) -> Input {
        // SAFETY: isatty only inspects the descriptor.
        let tty = unsafe { libc::isatty(0) } == 1;
        let editor = tty.then(rustyline::DefaultEditor::new).and_then(|e| e.ok());
        let mut input = Input { editor, history };
        if let (Some(e), Some(h)) = (&mut input.editor, &input.history) {
            let _ = e.load_history(h);
        }
        input
    }

    fn read_one(&mut self, prompt: &str) -> Result<Line> {
        match &mut self.editor {
            Some(e) => match e.readline(prompt) {
                Ok(l) => Ok(Line::Text(l)),
                Err(ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(ReadlineError::Eof) => Ok(Line::End),
                Err(err) => Err(err).context("reading the terminal"),
            },
            None => {
                let mut out = std::io::stdout();
                write!(out, "{prompt}")?;
                out.flush()?;
                let mut line = String::new();
                if std::io::stdin()
                    .lock()
                    .read_line(&mut line)
                    .context("reading standard input")?
                    == 0
                {
                    return Ok(Line::End);
                }
                Ok(Line::Text(line.trim_end_matches(['\n', '\r']).to_string()))
            }
        }
    }

    /// Reads one message: a line, or several joined by newlines (a line
    /// ending in `\` goes on to the next; `"""` opens a block that the
    /// next line of `"""` closes).
    pub fn read(&mut self, prompt: &str) -> Result<Line> {
        let first = match self.read_one(prompt)? {
            Line::Text(t) => t,
            other => return Ok(other),
        };
        let mut text;
        if let Some(after) = first.trim_start().strip_prefix(QUOTES) {
            if let Some(inner) = after.trim_end().strip_suffix(QUOTES) {
                text = inner.to_string();
            } else {
                let mut parts: Vec<String> = Vec::new();
                if !after.trim().is_empty() {
                    parts.push(after.to_string());
                }
                loop {
                    match self.read_one("... ")? {
                        Line::Text(l) => {
                            if let Some(head) = l.trim_end().strip_suffix(QUOTES) {
                                if !head.is_empty() {
                                    parts.push(head.to_string());
                                }
                                break;
                            }
                            parts.push(l);
                        }
                        Line::Interrupted => return Ok(Line::Interrupted),
                        Line::End => break,
                    }
                }
                text = parts.join("\n");
            }
        } else {
            text = first;
            while let Some(head) = text.strip_suffix('\\') {
                text = head.to_string();
                match self.read_one("... ")? {
                    Line::Text(l) => {
                        text.push('\n');
                        text.push_str(&l);
                    }
                    Line::Interrupted => return Ok(Line::Interrupted),
                    Line::End => break,
                }
            }
        }
        if let Some(e) = &mut self.editor {
            if !text.trim().is_empty() {
                let _ = e.add_history_entry(text.as_str());
                if let Some(h) = &self.history {
                    let _ = e.save_history(h);
                }
            }
        }
        Ok(Line::Text(text))
    }
}

/// Set by SIGINT while an answer is being generated (at the prompt the
/// terminal is in raw mode and Ctrl-C arrives as a key instead).
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From here on, SIGINT interrupts the answer being generated instead of
/// ending the program.
pub fn catch_interrupts() {
    // SAFETY: installs a handler that only stores to an atomic, which is
    // async-signal-safe; the struct is zeroed and then filled.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as usize;
        act.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(libc::SIGINT, &act, std::ptr::null_mut());
    }
}

/// Whether Ctrl-C came since the last call (and clears it).
pub fn take_interrupt() -> bool {
    INTERRUPTED.swap(false, Ordering::SeqCst)
}

/// Clears a Ctrl-C that came before an answer started.
pub fn clear_interrupt() {
    INTERRUPTED.store(false, Ordering::SeqCst);
}
