//! One file's transfer, resumable, verified, and named only when whole.
//!
//! ```text
//!  .F.partial  ◄── bytes as they arrive (locked: one pull of F at a time)
//!  .F.partial.meta   url, sha256, size and validator the bytes are of
//!        │ cut off: kept; the next pull asks for `Range: bytes=N-`
//!        │ whole: size checked, GGUF magic checked, SHA-256 checked, fsync
//!        ▼
//!  F.sha256 removed (the old F stops counting) ─► rename .F.partial → F
//!        ─► F.sha256 written (durable) ─► .F.partial.meta removed
//! ```
//!
//! A partial file is resumed only if it is of the same thing: the same
//! URL and, where known, the same published checksum and size. Where no
//! checksum is published, the server's validator (a strong `ETag` or
//! `Last-Modified`) goes out as `If-Range`, so a changed file comes back
//! whole (200) instead of as a tail of something else. A checksum that
//! fails after a resume is tried once more from the first byte; one that
//! fails on a whole download deletes it and names both sums.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::http::{Answer, Client};
use super::{record_path, Cached, HubOptions, Pulled, Record};
use crate::pull::{write_atomic, PullError, PullProgress, Unit};

/// What to fetch and where to put it.
pub(super) struct Job {
    /// The name it is pulled by (`hf:...` or the URL), for messages and
    /// the record.
    pub name: String,
    pub url: String,
    pub path: PathBuf,
    /// The SHA-256 the hub's listing publishes, and the size.
    pub expected: Option<String>,
    pub size: Option<u64>,
}

/// What a partial file is a download of.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Meta {
    url: String,
    sha256: Option<String>,
    size: Option<u64>,
    validator: Option<String>,
}

impl Meta {
    fn to_text(&self) -> String {
        let mut t = format!("url {}\n", self.url);
        if let Some(s) = &self.sha256 {
            t.push_str(&format!("sha256 {s}\n"));
        }
        if let Some(n) = self.size {
            t.push_str(&format!("size {n}\n"));
        }
        if let Some(v) = &self.validator {
            t.push_str(&format!("validator {v}\n"));
        }
        t
    }

    fn read(path: &Path) -> Option<Meta> {
        let text = fs::read_to_string(path).ok()?;
        let mut m = Meta::default();
        for line in text.lines() {
            let Some((k, v)) = line.split_once(' ') else { continue };
            match k {
                "url" => m.url = v.to_string(),
                "sha256" => m.sha256 = Some(v.to_string()),
                "size" => m.size = v.parse().ok(),
                "validator" => m.validator = Some(v.to_string()),
                _ => {}
            }
        }
        (!m.url.is_empty()).then_some(m)
    }
}

/// The partial file and its description, beside `path`.
fn partial_paths(path: &Path) -> (PathBuf, PathBuf) {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    (
        path.with_file_name(format!(".{name}.partial")),
        path.with_file_name(format!(".{name}.partial.meta")),
    )
}

/// Removes a partial download of `path`; whether there was one.
pub(super) fn remove_partial(path: &Path) -> bool {
    let (partial, meta) = partial_paths(path);
    let removed = fs::remove_file(partial).is_ok();
    fs::remove_file(meta).is_ok() || removed
}

fn io_err(what: String) -> impl FnOnce(io::Error) -> PullError {
    move |source| PullError::Io { context: what, source }
}

/// Downloads `job` into its path as this module's docs say.
pub(super) fn fetch(
    client: &Client,
    job: Job,
    options: &HubOptions,
    progress: &dyn PullProgress,
) -> Result<Pulled, PullError> {
    let dir = job.path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let (partial, meta_path) = partial_paths(&job.path);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&partial)
        .map_err(io_err(format!("opening {}", partial.display())))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => return Err(PullError::Busy { name: job.name }),
        Err(fs::TryLockError::Error(e)) => return Err(io_err(format!("locking {}", partial.display()))(e)),
    }
    let mut transfer = Transfer {
        client,
        job: &job,
        options,
        progress,
        file: &mut file,
        meta_path: &meta_path,
        hasher: Sha256::new(),
        have: 0,
        meta: None,
        revision: None,
        bar_total: None,
    };
    let resumed_from = transfer.start()?;
    let mut outcome = transfer.run();
    if resumed_from > 0 && matches!(outcome, Err(PullError::Checksum { .. })) {
        // The part kept from before may be of other bytes: once more
        // from the first byte.
        transfer.restart()?;
        outcome = transfer.run();
    }
    let (sha256, expected) = match outcome {
        Ok(v) => v,
        Err(e) => {
            if matches!(
                e,
                PullError::Checksum { .. } | PullError::NotGguf { .. } | PullError::Http { status: 404 | 410, .. }
            ) {
                drop(file);
                remove_partial(&job.path);
            }
            return Err(e);
        }
    };
    let record = Record {
        sha256,
        size: transfer.have,
        name: job.name.clone(),
        url: job.url.clone(),
        published: expected,
        revision: transfer.revision.clone(),
    };
    install(&partial, &job.path, &record)?;
    let _ = fs::remove_file(&meta_path);
    drop(file);
    Ok(Pulled {
        cached: Cached { path: job.path, record },
        downloaded: true,
        resumed_from,
    })
}

/// Moves the checked partial file over `path` and records it.
fn install(partial: &Path, path: &Path, record: &Record) -> Result<(), PullError> {
    let rec = record_path(path);
    if rec.exists() {
        fs::remove_file(&rec).map_err(io_err(format!("removing {}", rec.display())))?;
    }
    fs::rename(partial, path).map_err(io_err(format!("renaming into {}", path.display())))?;
    snug_core::durable::sync_dir_of(path);
    let file_name = path.file_name().unwrap_or_default().to_string_lossy();
    write_atomic(&rec, record.to_text(&file_name).as_bytes())
}

struct Transfer<'a> {
    client: &'a Client,
    job: &'a Job,
    options: &'a HubOptions,
    progress: &'a dyn PullProgress,
    file: &'a mut File,
    meta_path: &'a Path,
    /// The hash of the file's first `have` bytes.
    hasher: Sha256,
    have: u64,
    meta: Option<Meta>,
    revision: Option<String>,
    /// The size the progress bar counts to.
    bar_total: Option<u64>,
}

/// Why a body stopped before its end.
enum Stop {
    /// The connection failed or closed early: resumable.
    Cut(String),
    /// The partial file could not be written.
    Write(io::Error),
}

impl Transfer<'_> {
    fn partial_name(&self) -> String {
        partial_paths(&self.job.path).0.display().to_string()
    }

    /// Keeps what a partial file of the same download holds (hashing it
    /// again), or empties it; returns the bytes kept.
    fn start(&mut self) -> Result<u64, PullError> {
        let job = self.job;
        let agree = |a: &Option<String>, b: &Option<String>| a.is_none() || b.is_none() || a == b;
        let meta = Meta::read(self.meta_path).filter(|m| {
            m.url == job.url
                && agree(&m.sha256, &job.expected)
                && (m.size.is_none() || job.size.is_none() || m.size == job.size)
                && (m.sha256.is_some() || job.expected.is_some() || m.validator.is_some())
        });
        let len = self
            .file
            .metadata()
            .map_err(io_err(format!("reading {}", self.partial_name())))?
            .len();
        let fits = meta
            .as_ref()
            .is_some_and(|m| m.size.or(job.size).is_none_or(|n| len <= n));
        if meta.is_none() || !fits || len == 0 {
            self.restart()?;
            return Ok(0);
        }
        self.meta = meta;
        self.show("resuming");
        let mut buf = vec![0u8; 1 << 20];
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(io_err(format!("reading {}", self.partial_name())))?;
        while self.have < len {
            let want = buf.len().min((len - self.have) as usize);
            let n = self
                .file
                .read(&mut buf[..want])
                .map_err(io_err(format!("reading {}", self.partial_name())))?;
            if n == 0 {
                break;
            }
            self.hasher.update(&buf[..n]);
            self.have += n as u64;
            self.progress.advance(n as u64);
        }
        Ok(self.have)
    }

    /// Empties the partial file and forgets what it was.
    fn restart(&mut self) -> Result<(), PullError> {
        let name = self.partial_name();
        self.file.set_len(0).map_err(io_err(format!("emptying {name}")))?;
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(io_err(format!("emptying {name}")))?;
        self.hasher = Sha256::new();
        self.have = 0;
        self.meta = None;
        let _ = fs::remove_file(self.meta_path);
        self.show("downloading");
        Ok(())
    }

    /// A progress bar counting to the size known now, from `have`.
    fn show(&mut self, verb: &str) {
        self.bar_total = self.total();
        self.progress
            .stage(&format!("{verb} {}", self.job.name), self.bar_total, Unit::Bytes);
        self.progress.advance(self.have);
    }

    fn total(&self) -> Option<u64> {
        self.job.size.or(self.meta.as_ref().and_then(|m| m.size))
    }

    fn expected(&self) -> Option<String> {
        self.job
            .expected
            .clone()
            .or_else(|| self.meta.as_ref().and_then(|m| m.sha256.clone()))
    }

    /// Fetches the rest, resuming after cuts as the options allow; returns
    /// the SHA-256 of the whole file and whether it was published.
    fn run(&mut self) -> Result<(String, bool), PullError> {
        let mut cuts = 0u32;
        let mut restarted = false;
        loop {
            if self.have > 0 && self.total() == Some(self.have) {
                break;
            }
            let answer = self.ask()?;
            match answer.status {
                206 => {}
                200 => {
                    if self.have > 0 {
                        // The server sends the whole file (it ignores
                        // ranges, or the file changed): start over.
                        self.restart()?;
                    }
                }
                416 if self.have > 0 && !restarted => {
                    let whole =
                        answer.unsatisfied_total() == Some(self.have) && self.total().is_none_or(|t| t == self.have);
                    if whole {
                        break;
                    }
                    restarted = true;
                    self.restart()?;
                    continue;
                }
                s if (200..300).contains(&s) => {
                    return Err(PullError::BadAnswer {
                        url: answer.url,
                        reason: format!("HTTP {s} instead of the file"),
                    })
                }
                _ => return Err(answer.into_error(&self.job.name)),
            }
            self.learn(&answer)?;
            match self.copy(answer) {
                Ok(()) => break,
                Err(Stop::Write(e)) => return Err(io_err(format!("writing {}", self.partial_name()))(e)),
                Err(Stop::Cut(reason)) => {
                    cuts += 1;
                    if cuts > self.options.retries {
                        return Err(PullError::Interrupted {
                            name: self.job.name.clone(),
                            done: self.have,
                            total: self.total().map_or("?".to_string(), |t| t.to_string()),
                            reason,
                        });
                    }
                    let wait = self.options.retry_wait.saturating_mul(1 << (cuts - 1).min(6));
                    std::thread::sleep(wait);
                }
            }
        }
        self.finish()
    }

    /// Asks for the bytes from `have` on.
    fn ask(&self) -> Result<Answer, PullError> {
        let from = (self.have > 0).then_some(self.have);
        // Only a download with no checksum to check it by needs the
        // server to promise the bytes are of the same file.
        let validator = match (&self.expected(), &self.meta) {
            (None, Some(m)) => m.validator.clone(),
            _ => None,
        };
        self.client.get(&self.job.url, from, validator.as_deref())
    }

    /// Takes the size, checksum and validator from an answer about to be
    /// read, and writes them beside the partial file.
    fn learn(&mut self, answer: &Answer) -> Result<(), PullError> {
        let bad = |reason: String| PullError::BadAnswer {
            url: answer.url.clone(),
            reason,
        };
        let served = if answer.status == 206 {
            let (first, total) = answer
                .content_range()
                .ok_or_else(|| bad("a partial answer (206) without Content-Range".into()))?;
            if first != self.have {
                return Err(bad(format!(
                    "asked for the bytes from {} on, got those from {first}",
                    self.have
                )));
            }
            total
        } else {
            answer.content_length()
        }
        .or(answer.hub.size);
        if let (Some(want), Some(got)) = (self.job.size, served) {
            if want != got {
                return Err(bad(format!("the file is {got} bytes here but {want} in the listing")));
            }
        }
        let published = answer.hub.sha256.clone().or_else(|| answer.linked_sha256());
        let kept = self.meta.take().filter(|_| answer.status == 206);
        let meta = Meta {
            url: self.job.url.clone(),
            sha256: self
                .job
                .expected
                .clone()
                .or(published)
                .or_else(|| kept.as_ref().and_then(|m| m.sha256.clone())),
            size: self.job.size.or(served),
            validator: answer
                .validator()
                .or_else(|| kept.as_ref().and_then(|m| m.validator.clone())),
        };
        if let Some(c) = &answer.hub.commit {
            self.revision = Some(c.clone());
        }
        if kept.as_ref() != Some(&meta) {
            write_atomic(self.meta_path, meta.to_text().as_bytes())?;
        }
        self.meta = Some(meta);
        if self.bar_total != self.total() {
            // The server has just said how large the file is.
            self.show("downloading");
        }
        Ok(())
    }

    /// Appends an answer's body to the partial file.
    fn copy(&mut self, answer: Answer) -> Result<(), Stop> {
        let total = self.total();
        let mut body = answer.into_reader();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Stop::Cut(e.to_string())),
            };
            if total.is_some_and(|t| self.have + n as u64 > t) {
                return Err(Stop::Cut("the server sent more bytes than the file has".into()));
            }
            self.file.write_all(&buf[..n]).map_err(Stop::Write)?;
            self.hasher.update(&buf[..n]);
            self.have += n as u64;
            self.progress.advance(n as u64);
        }
        match total {
            Some(t) if self.have < t => Err(Stop::Cut("the connection closed early".into())),
            _ => Ok(()),
        }
    }

    /// Checks and syncs the whole partial file; its SHA-256 and whether
    /// the server published it.
    fn finish(&mut self) -> Result<(String, bool), PullError> {
        let name = self.partial_name();
        self.file.flush().map_err(io_err(format!("writing {name}")))?;
        self.file.sync_all().map_err(io_err(format!("writing {name}")))?;
        let mut magic = [0u8; 16];
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(io_err(format!("reading {name}")))?;
        let n = read_up_to(self.file, &mut magic).map_err(io_err(format!("reading {name}")))?;
        if !magic[..n].starts_with(b"GGUF") {
            return Err(PullError::NotGguf {
                url: self.job.url.clone(),
                start: String::from_utf8_lossy(&magic[..n]).into_owned(),
            });
        }
        let actual: String = self
            .hasher
            .clone()
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        match self.expected() {
            Some(expected) if expected != actual => Err(PullError::Checksum {
                file: self.job.name.clone(),
                expected,
                actual,
            }),
            Some(_) => Ok((actual, true)),
            None => Ok((actual, false)),
        }
    }
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}
