//! Small tables the host writes on every forward pass (tokens, positions,
//! KV slots, page lists, rotations) and the logits it reads back, through
//! page-locked host memory: its copies are plain asynchronous driver
//! calls, which a CUDA graph captures and replays (reading the host
//! memory as it is at replay).

use std::marker::PhantomData;

use std::sync::Arc;

use cudarc::driver::{result, CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};

use crate::{ptr, CudaError, Device};

/// Page-locked host memory of `len` elements, zeroed.
pub(crate) struct Pinned<T> {
    host: *mut T,
    len: usize,
    _t: PhantomData<T>,
}

// SAFETY: the memory is owned by this value alone.
unsafe impl<T: Send> Send for Pinned<T> {}
unsafe impl<T: Sync> Sync for Pinned<T> {}

impl<T: Copy + ValidAsZeroBits> Pinned<T> {
    pub(crate) fn new(len: usize) -> Result<Pinned<T>, DriverError> {
        let len = len.max(1);
        let bytes = len * std::mem::size_of::<T>();
        // SAFETY: a fresh allocation of `bytes`, zeroed before use (zero
        // is a valid `T`).
        let host = unsafe {
            let p = result::malloc_host(bytes, 0)? as *mut T;
            std::ptr::write_bytes(p, 0, len);
            p
        };
        Ok(Pinned {
            host,
            len,
            _t: PhantomData,
        })
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialized elements, owned here.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.len) }
    }
}

impl<T> Drop for Pinned<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`; the workspace synchronizes
        // its stream before dropping (no copy is pending).
        let _ = unsafe { result::free_host(self.host as *mut std::ffi::c_void) };
    }
}

/// Host regions of each table: region 0 for passes run as graphs (each
/// waits for its graph before returning, so nothing reads it after), and
/// `RING` regions taken in turn by passes launched one by one, which do not
/// wait for their copies: the host writes a pass's tables while the
/// passes before it may still be reading theirs.
pub(crate) const RING: usize = 2;

/// A table written by the host into page-locked memory and copied to its
/// device buffer. The host side holds `1 + RING` regions of `cap`
/// elements (see [`RING`]); the device side, one.
pub(crate) struct Staged<T> {
    host: Pinned<T>,
    cap: usize,
    pub(crate) dev: CudaSlice<T>,
}

impl<T: Copy + ValidAsZeroBits + DeviceRepr> Staged<T> {
    pub(crate) fn new(dev: &Device, len: usize, what: &str) -> Result<Staged<T>, CudaError> {
        let cap = len.max(1);
        Ok(Staged {
            host: Pinned::new(cap * (1 + RING))?,
            cap,
            dev: dev.alloc::<T>(cap, what)?,
        })
    }

    /// Writes `data` into host region `region`, growing both sides when it
    /// is longer than a region (after waiting for every queued copy: the
    /// device address then changes, and the caller drops graphs that hold
    /// the old one). Returns whether it grew.
    pub(crate) fn write(&mut self, stream: &Arc<CudaStream>, region: usize, data: &[T]) -> Result<bool, DriverError> {
        let grew = data.len() > self.cap;
        if grew {
            stream.synchronize()?;
            self.cap = data.len();
            self.host = Pinned::new(self.cap * (1 + RING))?;
            self.dev = stream.alloc_zeros::<T>(self.cap)?;
        }
        let at = region * self.cap;
        self.host.as_mut_slice()[at..at + data.len()].copy_from_slice(data);
        Ok(grew)
    }

    /// Queues the copy of the first `n` elements of host region `region`
    /// to the device.
    pub(crate) fn copy(&self, stream: &CudaStream, region: usize, n: usize) -> Result<(), DriverError> {
        let n = n.min(self.cap);
        let at = region * self.cap;
        let dst = ptr(&self.dev, stream);
        // SAFETY: both sides hold at least `n` elements; the host memory
        // is not written again before this copy has run (see `RING`), and
        // lives until the workspace is dropped, after its stream is
        // synchronized.
        unsafe { result::memcpy_htod_async(dst, &self.host.as_slice()[at..at + n], stream.cu_stream()) }
    }

    /// Capacity of a region, in elements.
    pub(crate) fn len(&self) -> usize {
        self.cap
    }

    /// Bytes held on the device.
    pub(crate) fn device_bytes(&self) -> usize {
        self.cap * std::mem::size_of::<T>()
    }
}
