//! KV pages in device memory, in the CPU cache's layout and formats: F16,
//! and Q8 or TQ4 codes of the rotated vector with one f16 scale each
//! (snug_kernels::kv). Keys (and, apart, values) are `layers x kv_heads x
//! page_tokens` vectors a page; a coded part keeps its codes and its
//! scales in two arrays, as the CPU does. With a coded part, F16 twin pages
//! hold the exact window (page 0 and the newest pages of each sequence).
//! Pages are exported and imported in the runs the CPU's cache uses, so a
//! page moves between the devices as it is.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use snug_kernels::kv::{KvFormat, KvShape, KvStore};
use snug_kernels::kvbasis::{KeyBasis, OffsetTables, Trig};

use crate::{ptr, CudaError, Device};

/// One part of the keys or of the values: `width` bytes per vector.
struct Part {
    buf: CudaSlice<u8>,
    width: usize,
    ptr: u64,
}

/// Keys or values in one format: their elements (F16) or codes, then
/// their scales (Q8, TQ4).
struct Array {
    format: KvFormat,
    parts: Vec<Part>,
}

impl Array {
    fn new(dev: &Arc<Device>, format: KvFormat, vectors: usize, hd: usize) -> Result<Array, CudaError> {
        let widths = part_widths(format, hd).ok_or(CudaError::KvFormat(format.name()))?;
        let parts = widths
            .iter()
            .map(|&width| {
                let buf = dev.alloc::<u8>((vectors * width).max(1), "KV pages")?;
                let ptr = ptr(&buf, &dev.stream);
                Ok(Part { buf, width, ptr })
            })
            .collect::<Result<_, CudaError>>()?;
        Ok(Array { format, parts })
    }

    /// The elements' or codes' address, and the scales' (0 for F16).
    fn ptrs(&self) -> (u64, u64) {
        (self.parts[0].ptr, self.parts.get(1).map_or(0, |p| p.ptr))
    }
}

/// Bytes per vector of each part of a format: elements or codes, then
/// scales (as the CPU's cache keeps them); none for F32, which the device
/// does not keep.
fn part_widths(format: KvFormat, hd: usize) -> Option<Vec<usize>> {
    match format {
        KvFormat::F16 => Some(vec![2 * hd]),
        KvFormat::Q8 => Some(vec![hd, 2]),
        KvFormat::Tq4 => Some(vec![hd / 2, 2]),
        KvFormat::F32 => None,
    }
}

/// Kernel code of a format (kernels.cu's KV_F16, KV_Q8, KV_TQ4).
pub(crate) fn format_code(f: KvFormat) -> i32 {
    match f {
        KvFormat::Q8 => 1,
        KvFormat::Tq4 => 2,
        _ => 0,
    }
}

/// The key basis of TQ4 keys on the device: offsets and weights per
/// (layer, KV head, dimension), and per distinct rotary embedding its
/// pairs, the dimensions it leaves alone and its offset tables.
struct DeviceBasis {
    basis: Arc<KeyBasis>,
    /// Bytes of the basis and its tables on the host's terms
    /// (`KvStorage::exact_window_bytes` counts the same).
    bytes: usize,
    offset: CudaSlice<f32>,
    weight: CudaSlice<f32>,
    /// Per distinct embedding, its tables.
    trigs: Vec<DeviceTrig>,
    /// Per layer: its embedding's index in `trigs`, pairs and fixed
    /// dimensions.
    layer: Vec<(usize, usize, usize)>,
}

/// One rotary embedding's tables on the device: pairs (a, b interleaved),
/// fixed dimensions, `within` (cosines then sines, `[pair][t]`), `starts`
/// (cosines then sines, `[page][pair]`).
struct DeviceTrig {
    pairs: CudaSlice<i32>,
    fixed: CudaSlice<i32>,
    within: CudaSlice<f32>,
    starts: CudaSlice<f32>,
}

impl DeviceBasis {
    fn new(dev: &Arc<Device>, basis: Arc<KeyBasis>, page_tokens: usize, n_pages: usize) -> Result<Self, CudaError> {
        let s = &dev.stream;
        let tables = OffsetTables::new(&basis, page_tokens, n_pages);
        let mut seen: Vec<*const Trig> = Vec::new();
        let mut trigs = Vec::new();
        let mut layer = Vec::new();
        for l in 0..basis.layers {
            let t = tables.trig(l);
            let i = match seen.iter().position(|&p| std::ptr::eq(p, t)) {
                Some(i) => i,
                None => {
                    let pairs: Vec<i32> = t.pairs.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
                    let fixed: Vec<i32> = t.fixed.iter().map(|&d| d as i32).chain(std::iter::once(0)).collect();
                    let within: Vec<f32> = t.within_cos.iter().chain(&t.within_sin).copied().collect();
                    let starts: Vec<f32> = t.start_cos.iter().chain(&t.start_sin).copied().collect();
                    // (A word more each: a table may be empty.)
                    let with_end = |v: Vec<f32>| v.into_iter().chain(std::iter::once(0.0)).collect::<Vec<_>>();
                    trigs.push(DeviceTrig {
                        pairs: s.clone_htod(&pairs.iter().copied().chain(std::iter::once(0)).collect::<Vec<_>>())?,
                        fixed: s.clone_htod(&fixed)?,
                        within: s.clone_htod(&with_end(within))?,
                        starts: s.clone_htod(&with_end(starts))?,
                    });
                    seen.push(t);
                    seen.len() - 1
                }
            };
            layer.push((i, t.pairs.len(), t.fixed.len()));
        }
        Ok(DeviceBasis {
            bytes: basis.bytes() + tables.bytes(),
            offset: s.clone_htod(&basis.offset)?,
            weight: s.clone_htod(&basis.weight)?,
            trigs,
            layer,
            basis,
        })
    }
}

/// KV pages (and twin pages) on the device.
pub struct CudaKv {
    dev: Arc<Device>,
    shape: KvShape,
    n_pages: usize,
    n_twins: usize,
    k: Array,
    v: Array,
    twin_k: Array,
    twin_v: Array,
    /// The rotation's signs per (layer, KV head), on the host and, one
    /// after the other, on the device.
    signs: Vec<Vec<u64>>,
    signs_dev: CudaSlice<u64>,
    /// TQ4's codebook for the head size.
    book: CudaSlice<f32>,
    /// The key basis TQ4 keys are coded in.
    basis: Option<DeviceBasis>,
}

impl CudaKv {
    /// `n_pages` F16 pages of `shape` on `dev`.
    pub fn new(dev: &Arc<Device>, shape: KvShape, n_pages: usize) -> Result<CudaKv, CudaError> {
        CudaKv::with_formats(dev, shape, (KvFormat::F16, KvFormat::F16), n_pages, 0, None)
    }

    /// `n_pages` pages with keys and values in `formats`, `n_twins` F16
    /// twin pages, and TQ4 keys coded against `basis` (as the CPU's
    /// `KvStorage::with_key_basis`; ignored for other key formats). Head
    /// sizes a coded part cannot take are refused.
    pub fn with_formats(
        dev: &Arc<Device>,
        shape: KvShape,
        formats: (KvFormat, KvFormat),
        n_pages: usize,
        n_twins: usize,
        basis: Option<Arc<KeyBasis>>,
    ) -> Result<CudaKv, CudaError> {
        let hd = shape.head_dim;
        for f in [formats.0, formats.1] {
            if !f.supports_head_dim(hd) || hd > 256 {
                return Err(CudaError::KvFormat(f.name()));
            }
        }
        let half = shape.page_vectors() / 2;
        let rotated = [formats.0, formats.1]
            .iter()
            .any(|f| matches!(f, KvFormat::Q8 | KvFormat::Tq4));
        let signs: Vec<Vec<u64>> = if rotated {
            (0..shape.layers * shape.kv_heads)
                .map(|i| snug_kernels::tq4::signs(i / shape.kv_heads, i % shape.kv_heads, hd))
                .collect()
        } else {
            Vec::new()
        };
        let flat: Vec<u64> = signs.iter().flatten().copied().chain(std::iter::once(0)).collect();
        let book: Vec<f32> = if snug_kernels::tq4::supports_dim(hd) {
            snug_kernels::tq4::codebook(hd).to_vec()
        } else {
            vec![0.0; 16]
        };
        let s = &dev.stream;
        Ok(CudaKv {
            dev: dev.clone(),
            shape,
            n_pages,
            n_twins,
            k: Array::new(dev, formats.0, half * n_pages, hd)?,
            v: Array::new(dev, formats.1, half * n_pages, hd)?,
            twin_k: Array::new(dev, KvFormat::F16, half * n_twins, hd)?,
            twin_v: Array::new(dev, KvFormat::F16, half * n_twins, hd)?,
            signs,
            signs_dev: s.clone_htod(&flat)?,
            book: s.clone_htod(&book)?,
            basis: match (basis, formats.0) {
                (Some(b), KvFormat::Tq4) => Some(DeviceBasis::new(dev, b, shape.page_tokens, n_pages)?),
                _ => None,
            },
        })
    }

    /// The keys' address (elements or codes): what a captured pass is
    /// bound to.
    pub(crate) fn k_ptr(&self) -> u64 {
        self.k.parts[0].ptr
    }

    /// The values' address (elements or codes).
    pub(crate) fn v_ptr(&self) -> u64 {
        self.v.parts[0].ptr
    }

    /// What the kernels of `layer` read and write (kernels.cu's KvDesc).
    pub(crate) fn desc(&self, layer: usize) -> KvDesc {
        let s = &self.dev.stream;
        let ((k, ks), (v, vs)) = (self.k.ptrs(), self.v.ptrs());
        let mut d = KvDesc {
            k,
            ks,
            v,
            vs,
            tk: self.twin_k.parts[0].ptr,
            tv: self.twin_v.parts[0].ptr,
            signs: ptr(&self.signs_dev, s),
            book: ptr(&self.book, s),
            bm: 0,
            bw: 0,
            bpairs: 0,
            bfixed: 0,
            within: 0,
            starts: 0,
            rs: 1.0 / (self.shape.head_dim as f32).sqrt(),
            kf: format_code(self.k.format),
            vf: format_code(self.v.format),
            np: 0,
            nfixed: 0,
            n_pages: self.n_pages as i32,
        };
        if let Some(b) = &self.basis {
            let (i, np, nfixed) = b.layer[layer];
            let t = &b.trigs[i];
            d.bm = ptr(&b.offset, s);
            d.bw = ptr(&b.weight, s);
            d.bpairs = ptr(&t.pairs, s);
            d.bfixed = ptr(&t.fixed, s);
            d.within = ptr(&t.within, s);
            d.starts = ptr(&t.starts, s);
            d.np = np as i32;
            d.nfixed = nfixed as i32;
        }
        d
    }

    /// Whether both parts are F16 (no rotation, no twins).
    pub(crate) fn plain(&self) -> bool {
        self.k.format == KvFormat::F16 && self.v.format == KvFormat::F16
    }

    /// Vectors of one page's keys (or values).
    fn half_vectors(&self) -> usize {
        self.shape.page_vectors() / 2
    }

    /// [`ranges_of`] for this store's shape.
    fn ranges(&self, slots: usize, width: usize) -> Vec<std::ops::Range<usize>> {
        ranges_of(&self.shape, slots, width, self.half_vectors())
    }

    fn arrays(&self, twin: bool) -> [&Array; 2] {
        if twin {
            [&self.twin_k, &self.twin_v]
        } else {
            [&self.k, &self.v]
        }
    }
}

/// A cache as its kernels take it, by value (kernels.cu's `KvDesc`, field
/// for field): addresses, then the rotation's scale, the formats' codes,
/// the layer's rotary pairs and fixed dimensions, and the pages held.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct KvDesc {
    pub k: u64,
    pub ks: u64,
    pub v: u64,
    pub vs: u64,
    pub tk: u64,
    pub tv: u64,
    pub signs: u64,
    pub book: u64,
    pub bm: u64,
    pub bw: u64,
    pub bpairs: u64,
    pub bfixed: u64,
    pub within: u64,
    pub starts: u64,
    pub rs: f32,
    pub kf: i32,
    pub vf: i32,
    pub np: i32,
    pub nfixed: i32,
    pub n_pages: i32,
}

/// Copies one page's bytes (`bytes` from `f` to `t`) within a part.
fn copy_within(s: &Arc<cudarc::driver::CudaStream>, part: &mut CudaSlice<u8>, f: usize, t: usize, bytes: usize) {
    if f == t || bytes == 0 {
        return;
    }
    // Two pages of one allocation never overlap: split it between them and
    // copy from one half to the other.
    let (mut lo, mut hi) = part.split_at_mut(f.max(t));
    let (src, mut dst) = if f < t {
        (lo.slice(f..f + bytes), hi.slice_mut(..bytes))
    } else {
        (hi.slice(..bytes), lo.slice_mut(t..t + bytes))
    };
    s.memcpy_dtod(&src, &mut dst).expect("device page copy");
}

/// Copies page `from` over page `to` in every part of `arrays` (`n`
/// vectors a page).
fn copy_pages(s: &Arc<cudarc::driver::CudaStream>, arrays: [&mut Array; 2], n: usize, from: u32, to: u32) {
    for a in arrays {
        for p in &mut a.parts {
            let w = p.width;
            copy_within(s, &mut p.buf, from as usize * n * w, to as usize * n * w, n * w);
        }
    }
}

impl KvStore for CudaKv {
    fn shape(&self) -> KvShape {
        self.shape
    }

    fn formats(&self) -> (KvFormat, KvFormat) {
        (self.k.format, self.v.format)
    }

    fn n_pages(&self) -> usize {
        self.n_pages
    }

    fn page_bytes(&self) -> usize {
        let hd = self.shape.head_dim;
        self.half_vectors() * (self.k.format.vector_bytes(hd) + self.v.format.vector_bytes(hd))
    }

    fn exact_window_bytes(&self) -> usize {
        self.n_twins * self.twin_page_bytes() + self.basis.as_ref().map_or(0, |b| b.bytes)
    }

    fn copy_page(&mut self, from: u32, to: u32) {
        let (n, s) = (self.half_vectors(), self.dev.stream.clone());
        copy_pages(&s, [&mut self.k, &mut self.v], n, from, to);
    }

    fn copy_twin(&mut self, from: u32, to: u32) {
        let (n, s) = (self.half_vectors(), self.dev.stream.clone());
        copy_pages(&s, [&mut self.twin_k, &mut self.twin_v], n, from, to);
    }

    fn stored_bytes(&self, slots: usize, twin: bool) -> usize {
        self.arrays(twin)
            .iter()
            .flat_map(|a| &a.parts)
            .map(|p| self.ranges(slots, p.width).iter().map(|r| r.len()).sum::<usize>())
            .sum()
    }

    fn export_page<E>(
        &self,
        page: u32,
        slots: usize,
        twin: bool,
        mut f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let n = self.half_vectors();
        let s = &self.dev.stream;
        for a in self.arrays(twin) {
            for p in &a.parts {
                let ranges = self.ranges(slots, p.width);
                if ranges.is_empty() {
                    continue;
                }
                let at = page as usize * n * p.width;
                let host = s
                    .clone_dtoh(&p.buf.slice(at..at + n * p.width))
                    .expect("device page read");
                for r in ranges {
                    f(&host[r])?;
                }
            }
        }
        Ok(())
    }

    fn import_page<E>(
        &mut self,
        page: u32,
        slots: usize,
        twin: bool,
        mut f: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let n = self.half_vectors();
        let s = self.dev.stream.clone();
        let shape = self.shape;
        let arrays = if twin {
            [&mut self.twin_k, &mut self.twin_v]
        } else {
            [&mut self.k, &mut self.v]
        };
        for a in arrays {
            for p in &mut a.parts {
                let ranges = ranges_of(&shape, slots, p.width, n);
                if ranges.is_empty() {
                    continue;
                }
                let at = page as usize * n * p.width;
                let mut host = s
                    .clone_dtoh(&p.buf.slice(at..at + n * p.width))
                    .expect("device page read");
                for r in ranges {
                    f(&mut host[r])?;
                }
                s.memcpy_htod(&host, &mut p.buf.slice_mut(at..at + n * p.width))
                    .expect("device page write");
            }
        }
        Ok(())
    }

    fn rotation_signs(&self) -> &[Vec<u64>] {
        &self.signs
    }

    fn key_basis(&self) -> Option<&KeyBasis> {
        self.basis.as_ref().map(|b| &*b.basis)
    }
}

/// Byte ranges, relative to a page's first byte in a part of `width`, of
/// the first `slots` positions: one per (layer, KV head), or the whole
/// page (the CPU cache's runs).
fn ranges_of(s: &KvShape, slots: usize, width: usize, half_vectors: usize) -> Vec<std::ops::Range<usize>> {
    let slots = slots.min(s.page_tokens);
    if slots == 0 {
        return Vec::new();
    }
    if slots == s.page_tokens {
        return std::iter::once(0..half_vectors * width).collect();
    }
    (0..s.layers * s.kv_heads)
        .map(|i| {
            let at = i * s.page_tokens * width;
            at..at + slots * width
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use snug_kernels::kv::KvStorage;

    /// The runs a page is exported in, on the device's terms, are the
    /// CPU cache's runs (so pages and sessions move between the devices):
    /// every format pair, twins or not, whole and partial pages.
    #[test]
    fn a_pages_runs_are_the_cpu_caches() {
        let shape = KvShape {
            layers: 3,
            kv_heads: 2,
            head_dim: 64,
            page_tokens: 8,
        };
        let half = shape.page_vectors() / 2;
        for formats in [
            (KvFormat::F16, KvFormat::F16),
            (KvFormat::Q8, KvFormat::Q8),
            (KvFormat::Tq4, KvFormat::Q8),
            (KvFormat::F16, KvFormat::Tq4),
        ] {
            let cpu = KvStorage::with_formats(shape, formats.0, formats.1, 3).with_twins(2);
            for twin in [false, true] {
                for slots in [0, 3, 8] {
                    let mut want = Vec::new();
                    cpu.export_page::<()>(1, slots, twin, |r| {
                        want.push(r.len());
                        Ok(())
                    })
                    .unwrap();
                    let fs = if twin {
                        [KvFormat::F16, KvFormat::F16]
                    } else {
                        [formats.0, formats.1]
                    };
                    let got: Vec<usize> = fs
                        .iter()
                        .flat_map(|&f| part_widths(f, shape.head_dim).unwrap())
                        .flat_map(|w| ranges_of(&shape, slots, w, half))
                        .map(|r| r.len())
                        .collect();
                    assert_eq!(got, want, "{formats:?} twin {twin} slots {slots}");
                }
            }
        }
    }
}
