//! A model's matrices repacked into panels (see `snug_kernels::panel`),
//! once per model file, and kept in a cache file beside snug's other
//! caches so that later runs map them as they map the GGUF file.
//!
//! Panels hold the GGUF blocks' own bytes with 16 rows' words interleaved,
//! so the cache file is about as large as the matrices it holds, and
//! every matrix product, a decode step's single row included, runs on it:
//! with AVX-512 VNNI one `vpdpbusd` does 64 multiply-adds for 16 rows, and
//! with AVX2 the same panels are walked as two halves of 8 rows. Without
//! either, nothing is packed and the row-at-a-time kernels read the GGUF
//! file directly. All compute the same bits.
//!
//! The file is `<cache>/packed/<model file name>-<key>.snugpack`, where the
//! key hashes the panel layout's version, the model file's size and
//! modification time, and every packed tensor's name, type, shape and
//! offset; a file whose header does not carry the expected key and length
//! is rebuilt. It is written to a temporary name, synced and renamed, so a
//! crash never leaves a partial file under the real name.
//!
//! `SNUG_PACK=off` turns packing off (the row kernels then run every
//! product); `SNUG_PACK=memory` packs into memory instead of a file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapMut};
use snug_kernels::panel::{self, pack_matrix, packed_matrix_bytes};

use crate::gguf::{GgufFile, TensorInfo};

/// Version of the panel layout; part of every cache file's key. 4: the
/// same layout as 3, bumped so that files written through a writable map
/// (slow to read while their pages stay cached; see [`write_file`]) are
/// written once more.
const LAYOUT_VERSION: u64 = 4;
const MAGIC: &[u8; 8] = b"SNUGPAK1";
const HEADER: usize = 64;
const ALIGN: usize = 64;

enum Backing {
    Map(Mmap),
    Memory(MmapMut),
}

/// Packed matrices, by tensor name.
pub struct PackedWeights {
    backing: Backing,
    at: HashMap<String, (usize, usize)>,
    path: Option<PathBuf>,
}

/// How a model file's matrices are packed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PackMode {
    /// In a cache file in this directory, made once and mapped after (what
    /// the `snug` binary does, under its cache directory).
    Cache(std::path::PathBuf),
    /// In memory, at every load (the default: a library writes no file it
    /// was not asked to).
    #[default]
    Memory,
    /// Not at all.
    Off,
}

struct Plan<'f> {
    /// Each packed tensor, its offset in the file, and its columns and rows
    /// ([`shape`]).
    tensors: Vec<(&'f TensorInfo, usize, usize, usize)>,
    total: usize,
    key: u64,
}

fn fnv(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

/// A packable tensor's columns and rows: a matrix's, or a stack of
/// experts' matrices (`[cols, rows, experts]`) as one matrix of all their
/// rows, where each expert's rows fill whole panels (so that expert e's
/// panels are the e-th equal part of the packed bytes).
fn shape(t: &TensorInfo) -> Option<(usize, usize)> {
    match *t.dims.as_slice() {
        [cols, rows] => Some((cols as usize, rows as usize)),
        [cols, rows, experts] if (rows as usize).is_multiple_of(panel::PANEL_ROWS) => {
            Some((cols as usize, usize::try_from(rows.checked_mul(experts)?).ok()?))
        }
        _ => None,
    }
}

fn plan<'f>(file: &'f GgufFile, names: &[&str]) -> Plan<'f> {
    let mut key = 0xcbf2_9ce4_8422_2325u64;
    fnv(&mut key, &LAYOUT_VERSION.to_le_bytes());
    fnv(&mut key, &file.file_size().to_le_bytes());
    if let Some(t) = file.modified() {
        let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        fnv(&mut key, &d.as_nanos().to_le_bytes());
    }
    let mut tensors = Vec::new();
    let mut total = HEADER;
    let mut seen = std::collections::HashSet::new();
    for &name in names {
        let Some(t) = file.tensor(name) else { continue };
        let Some((cols, rows)) = shape(t) else { continue };
        if !seen.insert(name) || !panel::available(t.ty) {
            continue;
        }
        if !cols.is_multiple_of(t.ty.block_size()) {
            continue;
        }
        fnv(&mut key, name.as_bytes());
        fnv(&mut key, &[0xff]);
        fnv(&mut key, &(t.ty as u32).to_le_bytes());
        fnv(&mut key, &(cols as u64).to_le_bytes());
        fnv(&mut key, &(rows as u64).to_le_bytes());
        fnv(&mut key, &t.offset.to_le_bytes());
        tensors.push((t, total, cols, rows));
        total += packed_matrix_bytes(t.ty, rows, cols).next_multiple_of(ALIGN);
    }
    Plan { tensors, total, key }
}

/// The file's first [`HEADER`] bytes: magic, the plan's key and length.
fn header(plan: &Plan) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&plan.key.to_le_bytes());
    h[16..24].copy_from_slice(&(plan.total as u64).to_le_bytes());
    h
}

/// Packs rows `r0..r1` of tensor `t` (`cols` wide) into `dst`, their
/// panels split over the machine's threads.
fn pack_rows(file: &GgufFile, t: &TensorInfo, cols: usize, rows: usize, r0: usize, r1: usize, dst: &mut [u8]) {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let data = file.tensor_data(t);
    let pb = panel::panel_bytes(t.ty, cols);
    let rb = data.len() / rows;
    let groups = (r1 - r0).div_ceil(panel::PANEL_ROWS);
    let per = groups.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (i, chunk) in dst.chunks_mut(per * pb).enumerate() {
            let a = r0 + i * per * panel::PANEL_ROWS;
            let b = (a + per * panel::PANEL_ROWS).min(r1);
            let src = &data[a * rb..b * rb];
            s.spawn(move || pack_matrix(t.ty, src, b - a, cols, chunk));
        }
    });
}

/// Packs every planned tensor into `out` (the whole file image).
fn fill(file: &GgufFile, plan: &Plan, out: &mut [u8]) {
    out[..HEADER].copy_from_slice(&header(plan));
    for &(t, at, cols, rows) in &plan.tensors {
        let len = packed_matrix_bytes(t.ty, rows, cols);
        pack_rows(file, t, cols, rows, 0, rows, &mut out[at..at + len]);
        // The products read the panels from now on: the rows just read
        // need not stay resident (they are read again from the file if
        // anything asks), so packing a model never holds it twice.
        file.release(file.tensor_data(t));
    }
}

/// Bytes of panels packed at a time when writing a cache file.
const WRITE_PIECE: usize = 32 << 20;

/// Writes the file image [`fill`] makes to `f` (sized to the plan, zero
/// where nothing is written), packing up to [`WRITE_PIECE`] bytes at a
/// time into one buffer and writing each piece with plain writes. The
/// page cache then holds the file as the kernel lays out written data,
/// in large pieces of memory where it can; a file whose pages were first
/// touched through a writable map was, on one machine, read about 1.3x
/// more slowly by the products for as long as those pages stayed cached
/// (docs/BENCHMARKS.md).
fn write_file(file: &GgufFile, plan: &Plan, f: &mut std::fs::File) -> std::io::Result<()> {
    write_pieces(file, plan, f, WRITE_PIECE)
}

fn write_pieces(file: &GgufFile, plan: &Plan, f: &mut std::fs::File, piece: usize) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    f.set_len(plan.total as u64)?;
    f.write_all(&header(plan))?;
    let mut buf: Vec<u8> = Vec::new();
    for &(t, at, cols, rows) in &plan.tensors {
        let pb = panel::panel_bytes(t.ty, cols);
        let groups = rows.div_ceil(panel::PANEL_ROWS);
        let per_piece = (piece / pb.max(1)).max(1);
        let mut g = 0;
        while g < groups {
            let g1 = (g + per_piece).min(groups);
            let (r0, r1) = (g * panel::PANEL_ROWS, (g1 * panel::PANEL_ROWS).min(rows));
            let len = (g1 - g) * pb;
            buf.clear();
            buf.resize(len, 0);
            pack_rows(file, t, cols, rows, r0, r1, &mut buf);
            f.seek(SeekFrom::Start((at + g * pb) as u64))?;
            f.write_all(&buf)?;
            g = g1;
        }
        file.release(file.tensor_data(t));
    }
    Ok(())
}

/// What went wrong building or opening a cache file.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("packed weights {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

impl PackedWeights {
    /// The panels of the tensors `names` (those of a type and shape panels
    /// handle; others are skipped), per `mode`; `None` when nothing is
    /// packed (mode off, or a CPU without panels). A cache file that
    /// cannot be written falls back to memory.
    pub fn for_model(file: &GgufFile, names: &[&str], mode: &PackMode) -> Option<PackedWeights> {
        if *mode == PackMode::Off {
            return None;
        }
        let plan = plan(file, names);
        if plan.tensors.is_empty() {
            return None;
        }
        if let PackMode::Cache(dir) = mode {
            if let Ok(p) = Self::from_cache(file, &plan, dir) {
                return Some(p);
            }
        }
        Self::in_memory(file, &plan)
    }

    /// As [`PackedWeights::for_model`] with a cache file in `dir`, with no
    /// fallback: `Ok(None)` when nothing is packed here.
    pub fn open_or_build(file: &GgufFile, names: &[&str], dir: &Path) -> Result<Option<PackedWeights>, PackError> {
        let plan = plan(file, names);
        if plan.tensors.is_empty() {
            return Ok(None);
        }
        Self::from_cache(file, &plan, dir).map(Some)
    }

    fn in_memory(file: &GgufFile, plan: &Plan) -> Option<PackedWeights> {
        let mut v = MmapMut::map_anon(plan.total).ok()?;
        fill(file, plan, &mut v);
        Some(PackedWeights {
            backing: Backing::Memory(v),
            at: index(plan),
            path: None,
        })
    }

    fn from_cache(file: &GgufFile, plan: &Plan, dir: &Path) -> Result<PackedWeights, PackError> {
        let stem = file
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let path = dir.join(format!("{stem}-{:016x}.snugpack", plan.key));
        let io = |source| PackError::Io {
            path: path.display().to_string(),
            source,
        };
        if let Some(map) = open_valid(&path, plan) {
            return Ok(PackedWeights {
                backing: Backing::Map(map),
                at: index(plan),
                path: Some(path),
            });
        }
        std::fs::create_dir_all(dir).map_err(io)?;
        snug_core::durable::write_with(&path, |f| write_file(file, plan, f)).map_err(io)?;
        // Older files of the same model (a changed file or layout) are
        // stale: remove them.
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with(&format!("{stem}-")) && n.ends_with(".snugpack") && e.path() != path {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let map = open_valid(&path, plan).ok_or_else(|| io(std::io::Error::other("written file does not verify")))?;
        Ok(PackedWeights {
            backing: Backing::Map(map),
            at: index(plan),
            path: Some(path),
        })
    }

    /// Removes the cache files in `dir` packed from a model file named as
    /// `model` is (when the model is removed). How many were removed.
    pub fn remove_cached(dir: &Path, model: &Path) -> usize {
        let Some(stem) = model.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            return 0;
        };
        let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
        entries
            .flatten()
            .filter(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with(&format!("{stem}-")) && n.ends_with(".snugpack")
            })
            .filter(|e| std::fs::remove_file(e.path()).is_ok())
            .count()
    }

    /// The packed panels of tensor `name`, if it was packed.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        let &(at, len) = self.at.get(name)?;
        Some(&self.bytes()[at..at + len])
    }

    fn bytes(&self) -> &[u8] {
        match &self.backing {
            Backing::Map(m) => m,
            Backing::Memory(v) => v,
        }
    }

    /// Bytes of packed data (the cache file's size).
    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    /// The cache file, where the panels are mapped from one.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Drops this process' resident pages of `bytes`, a part of the panels,
    /// when they are mapped from the cache file (they are read again from
    /// the page cache or the file on next use); panels packed in memory are
    /// never dropped. Returns the bytes advised (whole pages inside
    /// `bytes`).
    pub fn release(&self, bytes: &[u8]) -> u64 {
        match &self.backing {
            Backing::Map(m) => crate::mapping::release_range(m, bytes),
            Backing::Memory(_) => 0,
        }
    }

    /// Bytes of the panels resident in this process (as
    /// [`GgufFile::resident_bytes`] counts them for the model file).
    pub fn resident_bytes(&self) -> Option<u64> {
        let b = self.bytes();
        crate::mapping::mapping_rss(b.as_ptr() as usize).map(|r| r.min(b.len() as u64))
    }
}

fn index(plan: &Plan) -> HashMap<String, (usize, usize)> {
    plan.tensors
        .iter()
        .map(|&(t, at, cols, rows)| (t.name.clone(), (at, packed_matrix_bytes(t.ty, rows, cols))))
        .collect()
}

/// The cache file at `path` mapped, if its header carries the plan's key
/// and length.
fn open_valid(path: &Path, plan: &Plan) -> Option<Mmap> {
    let f = snug_core::durable::open_regular(path).ok()?;
    if f.metadata().ok()?.len() != plan.total as u64 {
        return None;
    }
    // SAFETY: read-only map of a file only ever replaced by rename, never
    // written in place.
    let map = unsafe { Mmap::map(&f) }.ok()?;
    let ok =
        &map[..8] == MAGIC && map[8..16] == plan.key.to_le_bytes() && map[16..24] == (plan.total as u64).to_le_bytes();
    ok.then_some(map)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failure may panic
    use super::*;

    /// The cache file written piece by piece, pieces of a few panels (the
    /// last of each tensor short), is byte for byte the image packed in
    /// memory.
    #[test]
    fn file_written_in_pieces_equals_the_image_in_memory() {
        let Some(path) = crate::testing::model_path("smollm2-135m") else {
            return;
        };
        let file = GgufFile::open(&path).unwrap();
        let names = ["blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"];
        let plan = plan(&file, &names);
        if plan.tensors.is_empty() {
            eprintln!("no panels on this CPU: nothing is packed");
            return;
        }
        let mut want = vec![0u8; plan.total];
        fill(&file, &plan, &mut want);
        let dir = std::env::temp_dir().join(format!("snug-pieces-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at = dir.join("pieces.snugpack");
        let mut f = std::fs::File::create(&at).unwrap();
        let pb = panel::panel_bytes(plan.tensors[0].0.ty, plan.tensors[0].2);
        write_pieces(&file, &plan, &mut f, 3 * pb).unwrap();
        drop(f);
        let got = std::fs::read(&at).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(got.len(), want.len());
        assert!(got == want, "the file differs from the image");
    }
}
