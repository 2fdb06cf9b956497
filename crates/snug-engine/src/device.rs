//! Where an engine's forward passes run: the CPU (the model's own
//! backend, KV pages in host memory) or a CUDA GPU (the weights uploaded,
//! pages in device memory). The engine, sessions and the prefix
//! cache's disk tier reach the pages only through [`KvStore`], so both
//! kinds of pages serve them alike, and a page exported from one imports
//! into the other.

use std::sync::Arc;

use snug_cuda::{CudaKv, CudaWeights, CudaWorkspace};
use snug_kernels::kv::{KvFormat, KvShape, KvStorage, KvStore};
use snug_kernels::kvbasis::KeyBasis;
use snug_model::backend::CpuWorkspace;

/// A model's weights on a GPU, for [`crate::EngineOptions::gpu`].
#[derive(Clone)]
pub struct Gpu(pub Arc<CudaWeights>);

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({} bytes of weights)", self.0.bytes)
    }
}

/// An engine's KV pages.
pub(crate) enum Kv {
    Cpu(KvStorage),
    Cuda(CudaKv),
}

/// An engine's forward buffers (one per engine: the variants' sizes do not
/// matter).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Scratch {
    Cpu(CpuWorkspace),
    Cuda(CudaWorkspace),
}

impl Scratch {
    /// Bytes held (device bytes for a GPU's).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Scratch::Cpu(w) => w.bytes(),
            Scratch::Cuda(w) => w.bytes(),
        }
    }
}

/// KV pages on the GPU in `formats`, with `twins` twin pages (for a coded
/// part's exact window) and TQ4 keys in `basis`; why not, where the GPU
/// cannot hold them or does not take the formats.
pub(crate) fn gpu_kv(
    shape: KvShape,
    formats: (KvFormat, KvFormat),
    n_pages: usize,
    twins: usize,
    basis: Option<Arc<KeyBasis>>,
) -> Result<CudaKv, String> {
    let dev = snug_cuda::Device::current().ok_or("no CUDA device is open")?;
    CudaKv::with_formats(&dev, shape, formats, n_pages, twins, basis).map_err(|e| e.to_string())
}

macro_rules! each {
    ($self:expr, $s:ident => $e:expr) => {
        match $self {
            Kv::Cpu($s) => $e,
            Kv::Cuda($s) => $e,
        }
    };
}

impl KvStore for Kv {
    fn shape(&self) -> KvShape {
        each!(self, s => s.shape())
    }

    fn formats(&self) -> (KvFormat, KvFormat) {
        each!(self, s => s.formats())
    }

    fn n_pages(&self) -> usize {
        each!(self, s => s.n_pages())
    }

    fn page_bytes(&self) -> usize {
        each!(self, s => s.page_bytes())
    }

    fn twin_page_bytes(&self) -> usize {
        each!(self, s => s.twin_page_bytes())
    }

    fn exact_window_bytes(&self) -> usize {
        each!(self, s => s.exact_window_bytes())
    }

    fn copy_page(&mut self, from: u32, to: u32) {
        each!(self, s => s.copy_page(from, to))
    }

    fn copy_twin(&mut self, from: u32, to: u32) {
        each!(self, s => s.copy_twin(from, to))
    }

    fn stored_bytes(&self, slots: usize, twin: bool) -> usize {
        each!(self, s => s.stored_bytes(slots, twin))
    }

    fn export_page<E>(
        &self,
        page: u32,
        slots: usize,
        twin: bool,
        f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        each!(self, s => s.export_page(page, slots, twin, f))
    }

    fn import_page<E>(
        &mut self,
        page: u32,
        slots: usize,
        twin: bool,
        f: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        each!(self, s => s.import_page(page, slots, twin, f))
    }

    fn rotation_signs(&self) -> &[Vec<u64>] {
        each!(self, s => s.rotation_signs())
    }

    fn key_basis(&self) -> Option<&KeyBasis> {
        each!(self, s => s.key_basis())
    }
}
