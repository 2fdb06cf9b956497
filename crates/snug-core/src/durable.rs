//! Files written whole or not at all.
//!
//! Every file snug keeps (sessions, the prefix cache's disk tier, packed
//! weights, checksum records, fingerprints, calibration tables) is written
//! the same way: into a temporary file beside it, synced to disk, renamed
//! over the name, and the directory synced so that the rename itself
//! survives a crash. A reader then sees the old file or the new one, never
//! a part; a write that fails removes its temporary file and leaves the old
//! file as it was.
//!
//! Temporary names are `.{name}.{pid}.{n}.{host}.tmp`: the process id
//! lets a later process remove what a killed one left
//! ([`remove_stale_temps`]), `n` (a counter of this process) keeps two
//! threads writing one name apart, and the host name keeps processes of
//! two machines apart where they share a folder (a network file system
//! under several replicas, whose process ids may well be equal): a
//! process only ever removes temporaries of its own host.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The directory `path` is in (`.` for a bare name).
fn dir_of(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// This machine's name as it goes into a temporary name: letters, digits
/// and `-` (anything else becomes `-`), at most 63 characters; `host` when
/// the name cannot be read.
fn host_tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(|| {
        let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let tag: String = raw
            .trim()
            .chars()
            .take(63)
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' })
            .collect();
        if tag.is_empty() {
            "host".into()
        } else {
            tag
        }
    })
}

/// A fresh temporary name beside `path`.
pub fn temp_path(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    dir_of(path).join(format!(".{name}.{}.{n}.{}.tmp", std::process::id(), host_tag()))
}

/// Syncs the directory `path` is in, so that a rename into it is on disk.
/// Best effort: a file system that cannot open a directory for syncing
/// keeps the rename in its own time.
pub fn sync_dir_of(path: &Path) {
    if let Ok(d) = File::open(dir_of(path)) {
        let _ = d.sync_all();
    }
}

/// Writes `path` through `write`, which gets a new empty file opened for
/// reading and writing (it may seek, set the length or map it): the file
/// is synced, renamed over `path` and the directory synced. On any error
/// the temporary file is removed and `path` is left as it was.
pub fn write_with<T>(path: &Path, write: impl FnOnce(&mut File) -> io::Result<T>) -> io::Result<T> {
    let tmp = temp_path(path);
    let result = (|| {
        let mut f = File::options().read(true).write(true).create_new(true).open(&tmp)?;
        let value = write(&mut f)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        Ok(value)
    })();
    match result {
        Ok(v) => {
            sync_dir_of(path);
            Ok(v)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Writes `bytes` as the whole of `path` ([`write_with`]).
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(path, |f| f.write_all(bytes))
}

/// Removes the temporary files that writes of `path` by processes of this
/// host no longer running left behind (a write killed midway). Whether a
/// process runs is read from `/proc`; without it nothing is removed.
/// Another host's temporaries are left alone: their process may be
/// running there.
pub fn remove_stale_temps(path: &Path) {
    let Some(name) = path.file_name() else {
        return;
    };
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir_of(path)) else {
        return;
    };
    let prefix = format!(".{}.", name.to_string_lossy());
    for e in entries.flatten() {
        let f = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = f.strip_prefix(&prefix).and_then(|r| r.strip_suffix(".tmp")) else {
            continue;
        };
        let mut parts = rest.split('.');
        let Some(Ok(pid)) = parts.next().map(str::parse::<u32>) else {
            continue;
        };
        // `pid`, `pid.n` (older forms) or `pid.n.host`.
        if parts.nth(1).is_some_and(|host| host != host_tag()) {
            continue;
        }
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("snug-durable-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let d = scratch_dir("whole");
        let p = d.join("f.bin");
        write(&p, b"first").unwrap();
        write(&p, b"second, longer").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second, longer");
        let names: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.bin")]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_removes_its_temporary() {
        let d = scratch_dir("fail");
        let p = d.join("f.bin");
        write(&p, b"kept").unwrap();
        let err = write_with(&p, |f| {
            f.write_all(b"half")?;
            Err::<(), _>(io::Error::other("disk full"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "disk full");
        assert_eq!(std::fs::read(&p).unwrap(), b"kept");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_write_into_a_missing_directory_is_an_error() {
        let d = scratch_dir("missing");
        let p = d.join("no").join("f.bin");
        assert_eq!(write(&p, b"x").unwrap_err().kind(), io::ErrorKind::NotFound);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn stale_temporaries_of_dead_processes_are_removed_and_live_ones_kept() {
        if !Path::new("/proc/self").exists() {
            return;
        }
        let d = scratch_dir("stale");
        let p = d.join("s.snug");
        // No process has an id this large (the kernel's limit is 2^22).
        let dead = d.join(".s.snug.4294967.0.tmp");
        let dead_old_form = d.join(".s.snug.4294966.tmp");
        let live = temp_path(&p);
        let dead_here = d.join(format!(".s.snug.4294967.3.{}.tmp", host_tag()));
        let elsewhere = d.join(".s.snug.4294967.3.another-host.tmp");
        let other = d.join(".t.snug.4294967.0.tmp");
        for f in [&dead, &dead_old_form, &dead_here, &elsewhere, &live, &other] {
            std::fs::write(f, b"x").unwrap();
        }
        remove_stale_temps(&p);
        assert!(!dead.exists() && !dead_old_form.exists() && !dead_here.exists());
        assert!(live.exists() && other.exists());
        assert!(elsewhere.exists(), "another host's process may be running");
        std::fs::remove_dir_all(&d).unwrap();
    }
}

/// Opens `path` for reading if it is a regular file. Anything else (a
/// directory, a FIFO, a socket, a device) is refused with "not a regular
/// file", and without blocking: a FIFO with no writer would otherwise hold
/// the open (or the first read) forever.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
    }
    #[cfg(unix)]
    {
        // Back to blocking reads (regular files never block, but the flag
        // would be inherited by anything handed this descriptor).
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        // SAFETY: fcntl on a descriptor this function owns.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
            }
        }
    }
    Ok(file)
}

/// The whole of `path` if it is a regular file (see [`open_regular`]).
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut open_regular(path)?, &mut bytes)?;
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_string(path: &Path) -> io::Result<String> {
    String::from_utf8(read_regular(path)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

#[cfg(all(test, unix))]
mod regular_tests {
    use super::*;

    #[test]
    fn a_fifo_a_directory_and_a_device_are_refused_without_blocking() {
        let dir = std::env::temp_dir().join(format!("snug-regular-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for p in [fifo.as_path(), dir.as_path(), Path::new("/dev/null")] {
            let e = open_regular(p).unwrap_err();
            assert_eq!(e.to_string(), "not a regular file", "{}", p.display());
        }
        let file = dir.join("f");
        std::fs::write(&file, b"abc").unwrap();
        assert_eq!(read_regular(&file).unwrap(), b"abc");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
