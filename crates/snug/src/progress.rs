//! Progress bars on stderr for long work (pulling models), drawn with
//! `indicatif`; hidden automatically when stderr is not a terminal.

use indicatif::{ProgressBar, ProgressStyle};
use snug_model::pull::{PullProgress, Unit};
use std::sync::Mutex;

/// A progress bar that follows a pull's stages.
pub struct PullBar {
    bar: Mutex<Option<ProgressBar>>,
}

impl PullBar {
    pub fn new() -> PullBar {
        PullBar { bar: Mutex::new(None) }
    }
}

impl PullProgress for PullBar {
    fn stage(&self, message: &str, total: Option<u64>, unit: Unit) {
        let mut slot = self.bar.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = slot.take() {
            old.finish_and_clear();
        }
        let bar = match total {
            Some(n) => ProgressBar::new(n),
            None => ProgressBar::new_spinner(),
        };
        let template = match unit {
            Unit::Bytes => "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            Unit::Packages => "{msg} [{bar:30}] {pos}/{len} {elapsed}",
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(message.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        *slot = Some(bar);
    }

    fn advance(&self, n: u64) {
        if let Some(b) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            b.inc(n);
        }
    }

    fn finish(&self) {
        if let Some(b) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
            b.finish_and_clear();
        }
    }
}

/// A bar of `len` steps labelled `what` (e.g. "windows"), for other long
/// work.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed} eta {eta}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_string());
    bar
}
