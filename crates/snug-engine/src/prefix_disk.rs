//! The prefix cache's disk tier: full KV pages kept as files keyed by
//! their prefix hash, so that a later process (after a restart) shares a
//! prompt's prefix instead of prefilling it.
//!
//! Files live in `DIR/<identity>/`, where `<identity>` hashes everything
//! the bytes depend on (model, tokenizer, KV formats, page size, rotation,
//! key basis), so caches of different models or layouts never mix. Each
//! page is written once, when it fills (write-through: a process that
//! exits keeps what it computed), to a temporary name and renamed. A file
//! holds a small header (magic, version, length, CRC-32) and the page as
//! stored; a read checks all of them, and a bad file is deleted and
//! counted as a miss, never used. When the folder grows past its cap, the
//! least recently used files (by modification time, which a hit renews)
//! are deleted down to 90% of it.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use snug_core::prefix::Key;
use snug_kernels::kv::KvStore;

const MAGIC: &[u8; 8] = b"SNUGPAGE";
const VERSION: u32 = 1;
const HEADER: usize = 24;

pub struct DiskTier {
    dir: PathBuf,
    cap: u64,
    bytes: u64,
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

impl DiskTier {
    /// The tier in `root/<identity>`, holding at most `cap` bytes.
    pub fn open(root: &Path, identity: &str, cap: u64) -> std::io::Result<DiskTier> {
        let dir = root.join(identity);
        std::fs::create_dir_all(&dir)?;
        let mut bytes = 0;
        for e in std::fs::read_dir(&dir)? {
            let e = e?;
            if e.file_name().to_string_lossy().ends_with(".kvpage") {
                bytes += e.metadata()?.len();
            }
        }
        Ok(DiskTier { dir, cap, bytes })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes of page files in the folder.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn path(&self, key: &Key) -> PathBuf {
        self.dir.join(format!("{}.kvpage", hex(key)))
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.path(key).exists()
    }

    /// Writes page `page` of `storage` (all positions) as `key`, unless a
    /// file for it exists. Returns whether it wrote.
    pub fn write(&mut self, key: &Key, storage: &impl KvStore, page: u32) -> std::io::Result<bool> {
        let path = self.path(key);
        if path.exists() {
            return Ok(false);
        }
        let pt = storage.shape().page_tokens;
        let len = storage.stored_bytes(pt, false) as u64;
        let mut crc = crc32fast::Hasher::new();
        storage
            .export_page::<()>(page, pt, false, |r| {
                crc.update(r);
                Ok(())
            })
            .expect("hashing cannot fail");
        let mut head = Vec::with_capacity(HEADER);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&crc.finalize().to_le_bytes());
        head.extend_from_slice(&len.to_le_bytes());
        snug_core::durable::write_with(&path, |file| {
            let mut f = std::io::BufWriter::with_capacity(1 << 20, file);
            f.write_all(&head)?;
            storage.export_page(page, pt, false, |r| f.write_all(r))?;
            f.flush()
        })?;
        self.bytes += HEADER as u64 + len;
        if self.bytes > self.cap {
            self.prune()?;
        }
        Ok(true)
    }

    /// Reads the page saved as `key` into page `page` of `storage`.
    /// Returns false (and deletes the file) if it is missing, of another
    /// size, or fails its checksum; the page's bytes are then undefined
    /// and must not be used.
    pub fn read(&mut self, key: &Key, storage: &mut impl KvStore, page: u32) -> bool {
        let path = self.path(key);
        let Ok(f) = snug_core::durable::open_regular(&path) else {
            return false;
        };
        let pt = storage.shape().page_tokens;
        let len = storage.stored_bytes(pt, false) as u64;
        let mut head = [0u8; HEADER];
        let ok = f.read_exact_at(&mut head, 0).is_ok()
            && &head[..8] == MAGIC
            && head[8..12] == VERSION.to_le_bytes()
            && head[16..24] == len.to_le_bytes()
            && f.metadata().is_ok_and(|m| m.len() == HEADER as u64 + len);
        let mut crc = crc32fast::Hasher::new();
        let mut at = HEADER as u64;
        let ok = ok
            && storage
                .import_page(page, pt, false, |run| {
                    f.read_exact_at(run, at)?;
                    crc.update(run);
                    at += run.len() as u64;
                    Ok::<(), std::io::Error>(())
                })
                .is_ok()
            && crc.finalize().to_le_bytes() == head[12..16];
        if ok {
            // Renew its place in the least-recently-used order.
            let _ = f.set_modified(std::time::SystemTime::now());
        } else {
            let size = f.metadata().map_or(0, |m| m.len());
            drop(f);
            if std::fs::remove_file(&path).is_ok() {
                self.bytes = self.bytes.saturating_sub(size);
            }
        }
        ok
    }

    /// Deletes the least recently used files down to 90% of the cap.
    fn prune(&mut self) -> std::io::Result<()> {
        let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            let e = e?;
            if e.file_name().to_string_lossy().ends_with(".kvpage") {
                let m = e.metadata()?;
                files.push((m.modified()?, m.len(), e.path()));
            }
        }
        files.sort();
        self.bytes = files.iter().map(|f| f.1).sum();
        let target = self.cap / 10 * 9;
        for (_, len, path) in files {
            if self.bytes <= target {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                self.bytes -= len;
            }
        }
        Ok(())
    }
}
