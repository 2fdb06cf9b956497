//! KV pages in device memory, F16, in the CPU cache's layout: a page's
//! keys (and, apart, its values) are `layers x kv_heads x page_tokens x
//! head_dim` elements, so a page exported here imports on the CPU as is.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use snug_kernels::kv::{KvFormat, KvShape, KvStore};
use snug_kernels::kvbasis::KeyBasis;

use crate::{ptr, CudaError, Device};

/// F16 KV pages on the device.
pub struct CudaKv {
    dev: Arc<Device>,
    shape: KvShape,
    n_pages: usize,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    k_ptr: u64,
    v_ptr: u64,
}

impl CudaKv {
    /// `n_pages` pages of `shape` on `dev`.
    pub fn new(dev: &Arc<Device>, shape: KvShape, n_pages: usize) -> Result<CudaKv, CudaError> {
        let half = shape.page_elems() / 2 * n_pages;
        let k = dev.alloc::<u16>(half, "KV pages")?;
        let v = dev.alloc::<u16>(half, "KV pages")?;
        let (k_ptr, v_ptr) = (ptr(&k, &dev.stream), ptr(&v, &dev.stream));
        Ok(CudaKv {
            dev: dev.clone(),
            shape,
            n_pages,
            k,
            v,
            k_ptr,
            v_ptr,
        })
    }

    pub(crate) fn k_ptr(&self) -> u64 {
        self.k_ptr
    }

    pub(crate) fn v_ptr(&self) -> u64 {
        self.v_ptr
    }

    /// Elements of one page's keys (or values).
    fn half_page(&self) -> usize {
        self.shape.page_elems() / 2
    }

    /// Element ranges of a page's first `slots` positions within the
    /// page's keys: one per (layer, KV head), or the whole page.
    fn ranges(&self, slots: usize) -> Vec<std::ops::Range<usize>> {
        let s = &self.shape;
        let slots = slots.min(s.page_tokens);
        if slots == s.page_tokens {
            return std::iter::once(0..self.half_page()).collect();
        }
        (0..s.layers * s.kv_heads)
            .map(|i| {
                let at = i * s.page_tokens * s.head_dim;
                at..at + slots * s.head_dim
            })
            .collect()
    }
}

fn as_bytes(v: &[u16]) -> &[u8] {
    // SAFETY: u16 has no padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 2) }
}

fn as_bytes_mut(v: &mut [u16]) -> &mut [u8] {
    // SAFETY: as above, and any bytes are a valid u16.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 2) }
}

impl KvStore for CudaKv {
    fn shape(&self) -> KvShape {
        self.shape
    }

    fn formats(&self) -> (KvFormat, KvFormat) {
        (KvFormat::F16, KvFormat::F16)
    }

    fn n_pages(&self) -> usize {
        self.n_pages
    }

    fn page_bytes(&self) -> usize {
        self.shape.page_bytes(KvFormat::F16)
    }

    fn exact_window_bytes(&self) -> usize {
        0
    }

    fn copy_page(&mut self, from: u32, to: u32) {
        let h = self.half_page();
        let (f, t) = (from as usize * h, to as usize * h);
        let s = self.dev.stream.clone();
        if f == t {
            return;
        }
        for part in [&mut self.k, &mut self.v] {
            // Two pages of one allocation never overlap: split it between
            // them and copy from one half to the other.
            let (mut lo, mut hi) = part.split_at_mut(f.max(t));
            let (src, mut dst) = if f < t {
                (lo.slice(f..f + h), hi.slice_mut(..h))
            } else {
                (hi.slice(..h), lo.slice_mut(t..t + h))
            };
            s.memcpy_dtod(&src, &mut dst).expect("device page copy");
        }
    }

    fn copy_twin(&mut self, _from: u32, _to: u32) {
        // F16 pages keep no twins.
    }

    fn stored_bytes(&self, slots: usize, _twin: bool) -> usize {
        let s = &self.shape;
        2 * s.layers * s.kv_heads * slots.min(s.page_tokens) * s.head_dim * 2
    }

    fn export_page<E>(
        &self,
        page: u32,
        slots: usize,
        _twin: bool,
        mut f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let h = self.half_page();
        let at = page as usize * h;
        let s = &self.dev.stream;
        for part in [&self.k, &self.v] {
            let host = s.clone_dtoh(&part.slice(at..at + h)).expect("device page read");
            for r in self.ranges(slots) {
                f(as_bytes(&host[r]))?;
            }
        }
        Ok(())
    }

    fn import_page<E>(
        &mut self,
        page: u32,
        slots: usize,
        _twin: bool,
        mut f: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let h = self.half_page();
        let at = page as usize * h;
        let ranges = self.ranges(slots);
        let s = self.dev.stream.clone();
        for part in [&mut self.k, &mut self.v] {
            let mut host = s.clone_dtoh(&part.slice(at..at + h)).expect("device page read");
            for r in &ranges {
                f(as_bytes_mut(&mut host[r.clone()]))?;
            }
            s.memcpy_htod(&host, &mut part.slice_mut(at..at + h))
                .expect("device page write");
        }
        Ok(())
    }

    fn rotation_signs(&self) -> &[Vec<u64>] {
        &[]
    }

    fn key_basis(&self) -> Option<&KeyBasis> {
        None
    }
}
