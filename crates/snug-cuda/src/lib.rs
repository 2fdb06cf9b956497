//! snug's CUDA backend: the decoder's operations ([`Backend`]) on an NVIDIA
//! GPU, over weights uploaded once in their GGUF block formats and KV pages
//! in device memory.
//!
//! The kernels (`kernels.cu`) are CUDA C compiled at run time by NVRTC for
//! the device's own architecture, and the driver and NVRTC are loaded when
//! a device is opened: building snug needs no CUDA toolkit, and a machine
//! without a GPU gets an error naming what is missing from
//! [`Device::open`], never a crash. Every kernel computes a row's values in
//! an order fixed by the row's shape alone, so a row's bits do not depend
//! on its batch, as on the CPU.
//!
//! What runs here today: the whole decoder (every architecture the CPU
//! runs, every weight type of the real models and F16/BF16/Q5_1/Q5_K) over
//! F16 KV pages; see docs/CUDA.md for what does not yet.

mod kv;
mod stage;
mod weights;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use snug_kernels::kv::{KvSlot, KvStore, NO_TWIN};
use snug_kernels::GgmlType;
use snug_model::arch::{Activation, BatchRow, Config, Experts, Head, KvView};
use snug_model::backend::{Backend, Buf, WorkspaceSize};
use stage::{Pinned, Staged, RING};

pub use kv::CudaKv;
pub use weights::{CudaMatrix, CudaVector, CudaWeights};

/// Why the GPU cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver found (libcuda.so): this machine has no NVIDIA driver installed")]
    NoDriver,
    #[error(
        "no NVRTC library found (libnvrtc.so): install the CUDA toolkit's NVRTC or put its folder in LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error("no CUDA device {0} (the driver sees {1})")]
    NoDevice(usize, i32),
    #[error("CUDA: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("compiling the CUDA kernels failed: {0}")]
    Compile(String),
    #[error("too little device memory: {what} needs {need} bytes, {free} are free")]
    OutOfMemory { what: String, need: usize, free: usize },
    #[error("mixture-of-experts models are not supported on CUDA (run them on the CPU)")]
    Experts,
    #[error("weight type {0} is not supported on CUDA")]
    Unsupported(GgmlType),
    #[error("head dimension {0} is not supported on CUDA (a multiple of 16, at most 256)")]
    HeadDim(usize),
    #[error("embedding width {0} is not supported on CUDA (at most 12,288)")]
    Width(usize),
    #[error("KV format {0} is not supported on CUDA (f16, q8 and tq4 are, for head sizes up to 256)")]
    KvFormat(&'static str),
    #[error("kernel macro {0:?} is not one a run may set (NAME=N, N a whole number, NAME one of {1})")]
    Knob(String, String),
}

/// The kernels' knobs that change how fast they run, never what they
/// compute, with the least value each takes: the ones a run of the engine
/// may set (measuring knobs such as SKIP, which make outputs wrong, and
/// shapes the host divides by are left to the `gpucheck` example).
pub const RUN_KNOBS: [(&str, u32); 3] = [("NORM_EARLY", 0), ("MV_U", 1), ("MV_BLOCKS", 1)];

/// Checks macros given for a run (`NAME=VALUE`): each names one of
/// [`RUN_KNOBS`] with a whole number at least its least value.
pub fn check_run_knobs(defines: &[String]) -> Result<(), CudaError> {
    for d in defines {
        let ok = d.split_once('=').is_some_and(|(name, value)| {
            RUN_KNOBS
                .iter()
                .any(|&(k, least)| k == name && value.parse::<u32>().is_ok_and(|v| v >= least && v <= 64))
        });
        if !ok {
            let names: Vec<&str> = RUN_KNOBS.iter().map(|(k, _)| *k).collect();
            return Err(CudaError::Knob(d.clone(), names.join(", ")));
        }
    }
    Ok(())
}

/// The kernels' source (kernels.cu), compiled when a device is opened.
pub const SOURCE: &str = include_str!("kernels.cu");

/// The weight types the kernels read.
pub const TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Whether matrices of `ty` are multiplied as floats (the others as
/// integers against quantized activations).
fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

fn type_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4K => "q4_k",
        GgmlType::Q5K => "q5_k",
        GgmlType::Q6K => "q6_k",
        GgmlType::Q2K => "q2_k",
        GgmlType::Q3K => "q3_k",
        GgmlType::IQ4NL => "iq4_nl",
        GgmlType::IQ4XS => "iq4_xs",
        GgmlType::MXFP4 => "mxfp4",
        _ => return None,
    })
}

/// The addresses of a kernel's arguments (references to locals), as the
/// driver takes them.
macro_rules! kernel_args {
    ($($a:expr),*) => {
        [$( ($a) as *const _ as *mut std::ffi::c_void ),*]
    };
}

/// The kernels compiled by NVRTC to PTX for `arch` (`sm_90`, say). Needs
/// NVRTC, not a GPU.
pub fn compile(arch: &str) -> Result<String, CudaError> {
    compile_with(arch, &[])
}

/// [`compile`] with macros of kernels.cu set (`NAME=VALUE`): the tuning
/// knobs it declares with `#ifndef`, for measuring variants.
pub fn compile_with(arch: &str, defines: &[String]) -> Result<String, CudaError> {
    compile_source(arch, SOURCE, defines)
}

/// [`compile_with`] of another kernel source than the one built in: a
/// variant of kernels.cu being measured (it must declare the same kernels).
pub fn compile_source(arch: &str, source: &str, defines: &[String]) -> Result<String, CudaError> {
    // SAFETY: only probes whether the library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let opts = cudarc::nvrtc::CompileOptions {
        // Only the multiply-adds the source writes: the compiler fuses
        // nothing else, so the arithmetic is the source's.
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        options: std::iter::once(format!("--gpu-architecture={arch}"))
            .chain(defines.iter().map(|d| format!("-D{d}")))
            .collect(),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| CudaError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

/// The kernels of one compiled module.
struct Kernels {
    /// Float matrices times f32 activations.
    matmul: Vec<(GgmlType, CudaFunction)>,
    /// Quantized products of a few rows, up to three matrices a launch.
    matvec: Vec<(GgmlType, CudaFunction)>,
    /// Quantized products on tensor cores (many rows).
    mma: Vec<(GgmlType, CudaFunction)>,
    /// Q4_K and Q5_K products on tensor cores, tiles staged in shared
    /// memory (many rows).
    mmt: Vec<(GgmlType, CudaFunction)>,
    rows: Vec<(GgmlType, CudaFunction)>,
    quantize_q8: CudaFunction,
    quantize_q8k: CudaFunction,
    rms_norm: CudaFunction,
    /// RMS norm with the row quantized for the product after it.
    norm_q8: CudaFunction,
    scale: CudaFunction,
    add: CudaFunction,
    add_bias: CudaFunction,
    rope_write_kv: CudaFunction,
    write_kv_f16: CudaFunction,
    /// Keys and values into Q8 or TQ4 (or F16) pages and their twins.
    write_kv_coded: CudaFunction,
    attend_f16: CudaFunction,
    /// Attention over pages with a coded part.
    attend_coded: CudaFunction,
    /// Attention for groups of rows of one sequence (prefill).
    attend_f16_rows: CudaFunction,
    /// The same with the work of a group's rows tiled over the block's
    /// threads, for heads of 64, 128 and 256.
    attend_f16_tiled: [CudaFunction; 3],
    gated: CudaFunction,
    /// The gated activation, quantized for the down projection.
    gated_q8: CudaFunction,
    gather: CudaFunction,
    _module: Arc<CudaModule>,
}

/// An opened GPU: its context, the stream every operation runs on, and the
/// compiled kernels.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    k: Kernels,
    /// The device's name and compute capability.
    pub name: String,
    pub capability: (i32, i32),
    /// Whether kernels may be launched to overlap the one before them
    /// (see [`launch_raw`]).
    pub overlap: bool,
    /// Rows per block of `attend_f16_rows` (kernels.cu's ATT_ROWS).
    att_rows: usize,
    /// Whether a prefill's attention takes `attend_f16_tiled` where the
    /// head's width allows (kernels.cu's ATT_TILED).
    att_tiled: bool,
    /// kernels.cu's NORM_EARLY (see `norm_threads`).
    norm_early: bool,
    /// The staged tiles' shape (kernels.cu's MMT_R, MMT_S, MMT_WR,
    /// MMT_WO): row tiles and output tiles per warp, warps along rows
    /// and along outputs.
    mmt_tile: (u32, u32, u32, u32),
}

static DEVICE: OnceLock<Arc<Device>> = OnceLock::new();

impl Device {
    /// Opens GPU `ordinal` and compiles the kernels for it (once per
    /// process; later calls return the same device).
    pub fn open(ordinal: usize) -> Result<Arc<Device>, CudaError> {
        Device::open_with(ordinal, &[])
    }

    /// [`Device::open`] with the kernels compiled with `defines` (see
    /// [`compile_with`]); only the first opening of the process compiles.
    pub fn open_with(ordinal: usize, defines: &[String]) -> Result<Arc<Device>, CudaError> {
        Device::open_source(ordinal, SOURCE, defines)
    }

    /// [`Device::open_with`] with the kernels of `source` (see
    /// [`compile_source`]).
    pub fn open_source(ordinal: usize, source: &str, defines: &[String]) -> Result<Arc<Device>, CudaError> {
        if let Some(d) = DEVICE.get() {
            return Ok(d.clone());
        }
        // SAFETY: only probes whether the libraries can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::NoNvrtc);
        }
        let count = CudaContext::device_count()?;
        if ordinal as i32 >= count {
            return Err(CudaError::NoDevice(ordinal, count));
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream: orders every operation, so no events are needed. Not
        // the legacy default stream, which a graph cannot be captured from.
        // SAFETY: no slice is used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let capability = ctx.compute_capability()?;
        let name = ctx.name()?;
        let ptx = compile_source(&format!("sm_{}{}", capability.0, capability.1), source, defines)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
        let f = |n: &str| module.load_function(n);
        let mut matmul = Vec::new();
        let mut matvec = Vec::new();
        let mut mma = Vec::new();
        let mut mmt = Vec::new();
        let mut rows = Vec::new();
        for ty in TYPES {
            let s = type_suffix(ty).expect("listed");
            rows.push((ty, f(&format!("rows_{s}"))?));
            if is_float(ty) {
                matmul.push((ty, f(&format!("matmul_{s}"))?));
            } else {
                matvec.push((ty, f(&format!("matvec_{s}"))?));
                // Q2_K, Q3_K and IQ4_XS have no tensor-core kernel: many
                // rows take the one-row product, four rows a warp.
                if !matches!(ty, GgmlType::Q2K | GgmlType::Q3K | GgmlType::IQ4XS) {
                    mma.push((ty, f(&format!("mma_{s}"))?));
                }
                if matches!(ty, GgmlType::Q4K | GgmlType::Q5K) {
                    mmt.push((ty, f(&format!("mmt_{s}"))?));
                }
            }
        }
        let k = Kernels {
            matmul,
            matvec,
            mma,
            mmt,
            rows,
            quantize_q8: f("quantize_q8")?,
            quantize_q8k: f("quantize_q8k")?,
            rms_norm: f("rms_norm")?,
            norm_q8: f("norm_q8")?,
            scale: f("scale")?,
            add: f("add")?,
            add_bias: f("add_bias")?,
            rope_write_kv: f("rope_write_kv")?,
            write_kv_f16: f("write_kv_f16")?,
            write_kv_coded: f("write_kv_coded")?,
            attend_coded: f("attend_coded")?,
            attend_f16: f("attend_f16")?,
            attend_f16_rows: f("attend_f16_rows")?,
            attend_f16_tiled: [
                f("attend_f16_tiled64")?,
                f("attend_f16_tiled128")?,
                f("attend_f16_tiled256")?,
            ],
            gated: f("gated")?,
            gated_q8: f("gated_q8")?,
            gather: f("gather")?,
            _module: module,
        };
        // Whether the driver takes launches that may overlap the kernel
        // before (Hopper and later, a driver of CUDA 12.3 or later), in a
        // stream and captured in a graph: two empty launches of each tell.
        let overlap = capability.0 >= 9 && {
            let (x, len, by) = (0u64, 0u64, 1.0f32);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            let twice = || {
                (0..2).try_for_each(|_| {
                    let mut args = kernel_args!(&x, &len, &by);
                    // SAFETY: `scale`'s arguments; with a length of 0 it
                    // touches no memory.
                    unsafe { launch_raw(&stream, &k.scale, cfg, true, &mut args) }
                })
            };
            let plain = twice().and_then(|()| stream.synchronize()).is_ok();
            let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            plain && stream.begin_capture(mode).is_ok() && {
                let launched = twice().is_ok();
                match stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)) {
                    Ok(Some(g)) if launched => g.launch().and_then(|()| stream.synchronize()).is_ok(),
                    _ => false,
                }
            }
        };
        let dev = Arc::new(Device {
            ctx,
            stream,
            k,
            overlap,
            name,
            capability,
            att_rows: define(source, defines, "ATT_ROWS") as usize,
            att_tiled: define(source, defines, "ATT_TILED") != 0,
            norm_early: define(source, defines, "NORM_EARLY") != 0,
            mmt_tile: (
                define(source, defines, "MMT_R"),
                define(source, defines, "MMT_S"),
                define(source, defines, "MMT_WR"),
                define(source, defines, "MMT_WO"),
            ),
        });
        // The staged tiles' two stages are more shared memory than a
        // launch gets without asking.
        for (ty, f) in &dev.k.mmt {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dev.mmt_shared_bytes(*ty) as i32,
            )?;
        }
        Ok(DEVICE.get_or_init(|| dev).clone())
    }

    /// The device opened by [`Device::open`], if any.
    pub fn current() -> Option<Arc<Device>> {
        DEVICE.get().cloned()
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Allocates `n` zeroed elements, or says how short memory is.
    pub(crate) fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
        what: &str,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(|e| {
            let free = self.ctx.mem_get_info().map(|m| m.0).unwrap_or(0);
            if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                CudaError::OutOfMemory {
                    what: what.to_string(),
                    need: n * std::mem::size_of::<T>(),
                    free,
                }
            } else {
                CudaError::Driver(e)
            }
        })
    }

    /// Waits for every queued operation.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// Rows `rows` of `m` dequantized to f32 by the kernels that read
    /// it (for checking them against the CPU's dequantizers).
    pub fn dequantize_rows(&self, m: &CudaMatrix, rows: &[u32]) -> Result<Vec<f32>, CudaError> {
        let s = &self.stream;
        let t = s.clone_htod(rows)?;
        let out = self.alloc::<f32>(rows.len() * m.cols, "dequantized rows")?;
        let (w, rb, cols, tp, op) = (m.ptr, m.row_bytes as u64, m.cols as i32, ptr(&t, s), ptr(&out, s));
        let mut b = s.launch_builder(self.rows_fn(m.ty));
        b.arg(&w).arg(&rb).arg(&cols).arg(&tp).arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (rows.len() as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; the rows
        // are the caller's, checked against the matrix here.
        assert!(rows.iter().all(|&r| (r as usize) < m.rows), "row out of range");
        unsafe { b.launch(cfg) }?;
        Ok(s.clone_dtoh(&out)?)
    }

    fn matmul_fn(&self, ty: GgmlType) -> &CudaFunction {
        kernel_for(&self.k.matmul, ty)
    }

    fn matvec_fn(&self, ty: GgmlType) -> &CudaFunction {
        kernel_for(&self.k.matvec, ty)
    }

    fn mma_fn(&self, ty: GgmlType) -> Option<&CudaFunction> {
        self.k.mma.iter().find(|(t, _)| *t == ty).map(|x| &x.1)
    }

    /// Rows and outputs of a staged tile.
    fn mmt_block(&self) -> (u32, u32) {
        let (r, s, wr, wo) = self.mmt_tile;
        (16 * r * wr, 8 * s * wo)
    }

    /// The shared memory of a staged tile of type `ty`: two stages of
    /// kernels.cu's MMT_STAGE bytes (a padded row of activations per row,
    /// a padded super-block per output).
    fn mmt_shared_bytes(&self, ty: GgmlType) -> u32 {
        let (rb, ob) = self.mmt_block();
        let per_output = if ty == GgmlType::Q4K { MMT_WS_Q4K } else { MMT_WS_Q5K };
        2 * (rb * MMT_AS + ob * per_output)
    }

    fn mmt_fn(&self, ty: GgmlType) -> Option<&CudaFunction> {
        self.k.mmt.iter().find(|(t, _)| *t == ty).map(|x| &x.1)
    }

    fn rows_fn(&self, ty: GgmlType) -> &CudaFunction {
        kernel_for(&self.k.rows, ty)
    }
}

/// The tiles of the quantized products on tensor cores: a warp's 16 rows
/// by 16 outputs (kernels.cu's matmul_mma_body, every type), or for Q4_K
/// and Q5_K a block's tiles staged in shared memory (mmt_body; the
/// default). The bits are the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiles {
    Warp,
    Staged,
}

/// The value of kernels.cu's macro `name`: as `defines` set it
/// (`NAME=VALUE`), else its default in `source` (the first `#define NAME
/// VALUE`, under its `#ifndef`), else 0. The host reads the knobs that
/// shape its launches this way, so that it always agrees with the kernels.
fn define(source: &str, defines: &[String], name: &str) -> u32 {
    defines
        .iter()
        .filter_map(|d| d.split_once('='))
        .find(|(n, _)| *n == name)
        .and_then(|(_, v)| v.parse().ok())
        .or_else(|| {
            source.lines().find_map(|l| {
                let rest = l.trim().strip_prefix("#define ")?.strip_prefix(name)?;
                rest.strip_prefix(' ')?.trim().parse().ok()
            })
        })
        .unwrap_or(0)
}

/// The kernel of type `ty` in `list` (every type uploaded has one).
fn kernel_for(list: &[(GgmlType, CudaFunction)], ty: GgmlType) -> &CudaFunction {
    &list.iter().find(|(t, _)| *t == ty).expect("type checked at upload").1
}

/// The raw address of a device allocation (valid while it lives).
pub(crate) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// A block of `block` threads per row, `n` rows.
fn per_row(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn grid(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(block).max(1), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One engine's device buffers: a buffer per [`Buf`], the logits, the
/// attention scores, and the small per-batch tables (tokens, positions,
/// KV slots, page lists) uploaded once per forward pass.
pub struct CudaWorkspace {
    dev: Arc<Device>,
    max_rows: usize,
    ctx: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: usize,
    bufs: Vec<CudaSlice<f32>>,
    buf_ptr: [u64; 10],
    tmp: CudaSlice<f32>,
    /// Activations quantized for an integer matrix product (48-byte blocks
    /// of 32, the CPU's `BlockQ8`).
    q8: CudaSlice<u8>,
    logits: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    /// Attention over coded pages: per (row, query head, page) the running
    /// maximum, its factor and the page's sum.
    runs: CudaSlice<f32>,
    /// Pages a sequence of the context spans, at most.
    max_pages: usize,
    /// The tables written every pass, in [`Which`]'s order: per row its
    /// token, position, KV page, slot, then the gathered rows; the batch's
    /// page lists, each row's offset into them, each row's first key
    /// position (global and local layers) and last; each row's twin, and
    /// the batch's twin lists (coded caches).
    tables: Vec<Staged<u32>>,
    /// RoPE pairs of a head, the rotations of the global and local layers,
    /// and each row's cosines and sines for them (computed on the host,
    /// as the CPU computes them).
    rope_pairs: (CudaSlice<i32>, CudaSlice<i32>),
    /// Per dimension of a head, 1 where RoPE rotates it.
    rope_rotated: CudaSlice<i32>,
    ropes: [snug_kernels::ops::Rope; 2],
    rope_cs: [Staged<f32>; 2],
    has_local: bool,
    /// Where the logits come back to the host.
    logits_host: Pinned<f32>,
    /// Decode steps as CUDA graphs: one per (rows, KV store), captured on
    /// its first pass and replayed after.
    graphs: HashMap<(usize, u64), Graph>,
    graphs_on: bool,
    /// Whether kernels are launched to overlap the one before them (the
    /// same bits either way; see [`launch_raw`]).
    overlap: bool,
    /// Whether products of many rows use tensor cores (the same bits
    /// either way).
    tensor_cores: bool,
    /// Which tiles products of many rows use (the same bits whichever).
    tiles: Tiles,
    mode: Mode,
    /// The host region of the tables this pass writes (see [`RING`]).
    region: usize,
    /// Passes launched one by one so far (they take the ring's regions in
    /// turn).
    turns: usize,
    /// Per ring region, an event recorded after the last pass that used
    /// it; the region is written again once the event has happened.
    fences: Vec<Option<cudarc::driver::CudaEvent>>,
    /// The ring region of the pass before, when its fence is still to be
    /// recorded (at the start of the next pass, after all its work).
    unfenced: Option<usize>,
    key: (usize, u64),
    /// What the quantized activations hold: (input address, rows, columns,
    /// format). Products of one input (queries, keys and values; gate and
    /// up) quantize it once; any other launch forgets it.
    quantized: Option<(u64, usize, usize, u8)>,
    /// Work held back to be launched with the next call.
    pending: Pending,
    pairs: usize,
    /// The first device error of the pass, reported by [`CudaWorkspace::check`].
    error: Option<cudarc::driver::DriverError>,
}

impl CudaWorkspace {
    /// A workspace for `c` of `size` on `dev`.
    pub fn new(dev: &Arc<Device>, c: &Config, size: WorkspaceSize) -> Result<CudaWorkspace, CudaError> {
        if c.head_dim > 256 || !c.head_dim.is_multiple_of(16) {
            return Err(CudaError::HeadDim(c.head_dim));
        }
        if c.dim > 12_288 {
            return Err(CudaError::Width(c.dim));
        }
        let rows = size.rows.max(1);
        let ctx = size.ctx.max(1);
        let mut bufs = Vec::new();
        for b in Buf::ALL {
            bufs.push(dev.alloc::<f32>(rows * b.width(c), "activations")?);
        }
        let s = &dev.stream;
        let mut buf_ptr = [0u64; 10];
        for (i, b) in bufs.iter().enumerate() {
            buf_ptr[i] = ptr(b, s);
        }
        let max_pages = ctx.div_ceil(size.page_tokens.max(1)) + 1;
        let ropes = [c.rope(false), c.rope(true)];
        let p = ropes[0].pairs(c.head_dim);
        let pairs = p.len();
        let pa: Vec<i32> = p.iter().map(|x| x.0 as i32).collect();
        let pb: Vec<i32> = p.iter().map(|x| x.1 as i32).collect();
        let rope_pairs = (s.clone_htod(&pa)?, s.clone_htod(&pb)?);
        let mut rotated = vec![0i32; c.head_dim];
        for &(a, b, _) in &p {
            rotated[a] = 1;
            rotated[b] = 1;
        }
        let rope_rotated = s.clone_htod(&rotated)?;
        let widest = c.dim.max(c.ff).max(c.heads * c.head_dim);
        Ok(CudaWorkspace {
            dev: dev.clone(),
            max_rows: rows,
            ctx,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            layers: c.layers,
            bufs,
            buf_ptr,
            tmp: dev.alloc(rows * widest, "activations")?,
            q8: dev.alloc(rows * widest.div_ceil(32) * 48, "quantized activations")?,
            logits: dev.alloc(rows * c.vocab, "logits")?,
            scores: dev.alloc(rows * c.heads * ctx, "attention scores")?,
            runs: dev.alloc(rows * c.heads * max_pages * 3, "attention scores")?,
            max_pages,
            tables: Which::ALL
                .iter()
                .map(|w| {
                    Staged::new(
                        dev,
                        if matches!(w, Which::Table | Which::Twins) {
                            rows * max_pages
                        } else {
                            rows
                        },
                        "batch tables",
                    )
                })
                .collect::<Result<_, _>>()?,
            rope_pairs,
            rope_rotated,
            ropes,
            rope_cs: [
                Staged::new(dev, rows * pairs.max(1) * 2, "rotations")?,
                Staged::new(dev, rows * pairs.max(1) * 2, "rotations")?,
            ],
            has_local: (0..c.layers).any(|l| c.is_local(l)),
            logits_host: Pinned::new(rows.min(GRAPH_ROWS) * c.vocab)?,
            graphs: HashMap::new(),
            graphs_on: true,
            overlap: dev.overlap,
            tensor_cores: true,
            tiles: Tiles::Staged,
            mode: Mode::Direct,
            region: 1,
            turns: 0,
            fences: (0..RING).map(|_| None).collect(),
            unfenced: None,
            key: (0, 0),
            quantized: None,
            pending: Pending::None,
            pairs,
            error: None,
        })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        let f: usize = self.bufs.iter().map(|b| b.num_bytes()).sum();
        f + self.tmp.num_bytes()
            + self.q8.num_bytes()
            + self.logits.num_bytes()
            + self.scores.num_bytes()
            + self.runs.num_bytes()
            + self.rope_cs.iter().map(|b| b.device_bytes()).sum::<usize>()
            + self.tables.iter().map(|b| b.device_bytes()).sum::<usize>()
    }

    /// The first device error since the last check.
    pub fn check(&mut self) -> Result<(), CudaError> {
        match self.error.take() {
            Some(e) => Err(CudaError::Driver(e)),
            None => Ok(()),
        }
    }

    fn note<T>(&mut self, r: Result<T, cudarc::driver::DriverError>) {
        if let Err(e) = r {
            self.error.get_or_insert(e);
        }
    }

    fn p(&self, b: Buf) -> u64 {
        self.buf_ptr[b as usize]
    }

    /// Writes table `which` for this pass (see [`stage`]).
    fn upload(&mut self, which: Which, data: &[u32]) {
        let s = self.dev.stream.clone();
        let r = stage(&mut self.tables[which as usize], &s, self.mode, self.region, data);
        self.staged(r);
    }

    /// Writes rotation table `i` for this pass (see [`stage`]).
    fn upload_f32(&mut self, i: usize, data: &[f32]) {
        let s = self.dev.stream.clone();
        let r = stage(&mut self.rope_cs[i], &s, self.mode, self.region, data);
        self.staged(r);
    }

    /// After [`stage`]: a table that grew (or failed to) has moved, so the
    /// graphs that hold its old address go.
    fn staged(&mut self, r: Result<bool, cudarc::driver::DriverError>) {
        if !matches!(r, Ok(false)) {
            self.graphs.clear();
        }
        self.note(r);
    }

    /// Records ring region `region`'s fence after all the work queued.
    fn fence(&mut self, region: usize) -> Result<(), cudarc::driver::DriverError> {
        let slot = &mut self.fences[region - 1];
        if slot.is_none() {
            *slot = Some(self.dev.stream.context().new_event(None)?);
        }
        match slot {
            Some(event) => event.record(&self.dev.stream),
            None => Ok(()),
        }
    }

    fn table(&self, which: Which) -> u64 {
        ptr(&self.tables[which as usize].dev, &self.dev.stream)
    }

    /// Whether decode steps run as CUDA graphs (on by default; the bits
    /// are the same either way).
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs_on = on;
        if !on {
            self.graphs.clear();
        }
    }

    /// Whether kernels are launched to overlap the one before them (on by
    /// default where the device and driver allow it; the bits are the
    /// same either way). Graphs captured before keep how they were made.
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on && self.dev.overlap;
        self.graphs.clear();
    }

    /// Whether products of 16 rows or more run on tensor cores (on by
    /// default; the bits are the same either way).
    pub fn set_tensor_cores(&mut self, on: bool) {
        self.tensor_cores = on;
    }

    /// Which tiles products on tensor cores use (the bits are the same
    /// whichever).
    pub fn set_tiles(&mut self, tiles: Tiles) {
        self.tiles = tiles;
    }

    /// Graphs captured so far.
    pub fn graph_count(&self) -> usize {
        self.graphs.len()
    }
}

impl Drop for CudaWorkspace {
    fn drop(&mut self) {
        // No copy may still read the page-locked tables when they go.
        let _ = self.dev.stream.synchronize();
    }
}

/// Writes `data` into table `t` for this pass and, unless a graph replays
/// the pass, queues its copy (a captured copy takes the whole table, so a
/// replay copies whatever this pass wrote). Returns whether the table grew
/// (its device address changed). Tables are sized for the workspace's
/// rows: a pass that outgrows one cannot be a graph's.
fn stage<T: Copy + cudarc::driver::ValidAsZeroBits + cudarc::driver::DeviceRepr>(
    t: &mut Staged<T>,
    s: &Arc<CudaStream>,
    mode: Mode,
    region: usize,
    data: &[T],
) -> Result<bool, cudarc::driver::DriverError> {
    let grew = t.write(s, region, data)?;
    if grew && mode != Mode::Direct {
        return Err(cudarc::driver::DriverError(
            cudarc::driver::sys::CUresult::CUDA_ERROR_ILLEGAL_STATE,
        ));
    }
    if mode != Mode::Replay {
        let n = if mode == Mode::Capture { t.len() } else { data.len() };
        t.copy(s, region, n)?;
    }
    Ok(grew)
}

/// A captured pass.
struct Graph(CudaGraph);

// SAFETY: launching a graph binds its context to the calling thread first;
// the workspace that owns it is used by one thread at a time.
unsafe impl Send for Graph {}

/// Rows a pass may have to run as a graph.
const GRAPH_ROWS: usize = 64;

/// How the launches of the current pass are made.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// Launched one by one.
    Direct,
    /// Recorded into a graph, which runs at the end of the pass.
    Capture,
    /// Not launched: the pass' graph runs at the end.
    Replay,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    Tokens,
    Pos,
    Page,
    Slot,
    Gather,
    Table,
    RowTable,
    StartGlobal,
    StartLocal,
    End,
    /// Per row, the twin its keys and values are also written to.
    TwinSlot,
    /// The batch's twin lists, as `Table` (NO_TWIN where none).
    Twins,
}

impl Which {
    const ALL: [Which; 12] = [
        Which::Tokens,
        Which::Pos,
        Which::Page,
        Which::Slot,
        Which::Gather,
        Which::Table,
        Which::RowTable,
        Which::StartGlobal,
        Which::StartLocal,
        Which::End,
        Which::TwinSlot,
        Which::Twins,
    ];
}

/// Launches kernel `f` in `cfg` with the arguments given (references to
/// locals, in the kernel's order and types), noting a failure in `ws`.
macro_rules! launch {
    ($ws:expr, $f:expr, $cfg:expr, $($a:expr),*) => {{
        $ws.quantized = None;
        if $ws.mode != Mode::Replay {
            let mut args = kernel_args!($($a),*);
            // SAFETY: each caller passes the kernel's arguments in its
            // order and types, with buffers that hold what the launch reads
            // and writes (the workspace is sized for its rows and context).
            let r = unsafe { launch_raw(&$ws.dev.stream, $f, $cfg, $ws.overlap, &mut args) };
            $ws.note(r);
        }
    }};
}

/// Launches `f` in `cfg` on `stream` with `args`. With `overlap`, the
/// launch may start while the kernel before it in the stream is still
/// running (programmatic dependent launch): every kernel waits for the one
/// before it in `after_previous` (kernels.cu) before touching any buffer,
/// so only its start-up and its first loads of weights overlap.
///
/// # Safety
///
/// `args` are the addresses of the kernel's arguments, in its order and
/// types; the buffers they name hold what the kernel reads and writes.
unsafe fn launch_raw(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    overlap: bool,
    args: &mut [*mut std::ffi::c_void],
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    stream.context().bind_to_thread()?;
    // SAFETY: a plain C struct and union, valid zeroed.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: if overlap { &mut attr } else { std::ptr::null_mut() },
        numAttrs: u32::from(overlap),
    };
    // SAFETY: the configuration and attribute outlive the call; the caller
    // vouches for the arguments.
    unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }.result()
}

/// Launches an element-wise kernel over `len` elements, 256 a block.
macro_rules! elementwise {
    ($ws:expr, $f:expr, $len:expr, $($a:expr),*) => {{
        if $len > 0 {
            launch!($ws, $f, grid($len, 256), $($a),*);
        }
    }};
}

/// The CUDA backend.
pub struct Cuda;

impl Backend for Cuda {
    type Matrix<'w> = CudaMatrix;
    type Vector<'w> = CudaVector;
    type Workspace = CudaWorkspace;
    type Kv = CudaKv;

    const LLAMA_CPP_GRAPH: bool = false;

    fn workspace(c: &Config, size: WorkspaceSize) -> CudaWorkspace {
        let dev = Device::current().expect("Device::open before a CUDA workspace");
        CudaWorkspace::new(&dev, c, size).expect("device memory for the workspace")
    }

    fn max_rows(ws: &CudaWorkspace) -> usize {
        ws.max_rows
    }

    fn begin(ws: &mut CudaWorkspace, rows: &[BatchRow], head: Head, kv: &KvView<CudaKv>) {
        // What the pass before held back runs before this one.
        flush(ws);
        // The pass before, launched one by one, returned without waiting
        // for its copies: its region is fenced by everything queued so far.
        if let Some(region) = ws.unfenced.take() {
            let r = ws.fence(region);
            ws.note(r);
        }
        ws.mode = Mode::Direct;
        ws.region = 0;
        ws.quantized = None;
        // Decode steps and verifications (a few rows, every one wanting
        // logits) run as graphs; prefill chunks pay for their launches.
        let step = head == Head::Logits
            && !rows.is_empty()
            && rows.len() <= GRAPH_ROWS.min(ws.max_rows)
            && rows.iter().all(|r| r.logits)
            && !snug_model::arch::trace::enabled();
        if ws.graphs_on && step && ws.error.is_none() {
            ws.key = (rows.len(), kv.storage.k_ptr());
            if ws.graphs.contains_key(&ws.key) {
                ws.mode = Mode::Replay;
                return;
            }
            let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            match ws.dev.stream.begin_capture(mode) {
                Ok(()) => {
                    ws.mode = Mode::Capture;
                    return;
                }
                // Launched one by one from now on.
                Err(_) => ws.graphs_on = false,
            }
        }
        // Launched one by one: the next region of the ring, once the pass
        // that last used it has run.
        let region = 1 + ws.turns % RING;
        ws.turns += 1;
        if let Some(e) = &ws.fences[region - 1] {
            let r = e.synchronize();
            ws.note(r);
        }
        ws.region = region;
        ws.unfenced = Some(region);
    }

    fn embed(ws: &mut CudaWorkspace, table: &CudaMatrix, rows: &[BatchRow]) {
        flush(ws);
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let pos: Vec<u32> = rows.iter().map(|r| r.pos as u32).collect();
        ws.upload(Which::Tokens, &tokens);
        ws.upload(Which::Pos, &pos);
        let dev = ws.dev.clone();
        let (w, rb, cols) = (table.ptr, table.row_bytes as u64, table.cols as i32);
        let (t, x) = (ws.table(Which::Tokens), ws.p(Buf::X));
        launch!(
            ws,
            dev.rows_fn(table.ty),
            per_row(rows.len(), 128),
            &w,
            &rb,
            &cols,
            &t,
            &x
        );
    }

    fn scale(ws: &mut CudaWorkspace, buf: Buf, len: usize, by: f32) {
        flush(ws);
        let dev = ws.dev.clone();
        let (x, n) = (ws.p(buf), len as u64);
        elementwise!(ws, &dev.k.scale, len, &x, &n, &by);
    }

    fn copy(ws: &mut CudaWorkspace, from: Buf, to: Buf, len: usize) {
        flush(ws);
        ws.quantized = None;
        if ws.mode == Mode::Replay {
            return;
        }
        let s = ws.dev.stream.clone();
        let (i, j) = (from as usize, to as usize);
        let (a, b) = snug_model::backend::read_and_write(&mut ws.bufs, i, j);
        let r = s.memcpy_dtod(&a.slice(..len), &mut b.slice_mut(..len));
        ws.note(r);
    }

    fn rms_norm(ws: &mut CudaWorkspace, buf: Buf, len: usize, w: &CudaVector, eps: f32) {
        let x = ws.p(buf);
        hold_norm(ws, x, 0, x, len / w.len, w, eps);
    }

    fn add_norm(ws: &mut CudaWorkspace, x: Buf, add: Option<Buf>, to: Buf, len: usize, w: &CudaVector, eps: f32) {
        let (xp, ap, tp) = (ws.p(x), add.map_or(0, |b| ws.p(b)), ws.p(to));
        hold_norm(ws, xp, ap, tp, len / w.len, w, eps);
    }

    fn matmul(ws: &mut CudaWorkspace, w: &CudaMatrix, from: Buf, to: Buf, rows: usize) {
        let (x, y) = (ws.p(from), ws.p(to));
        product(ws, w, x, y, rows, true);
    }

    fn add_bias(ws: &mut CudaWorkspace, buf: Buf, rows: usize, bias: &CudaVector) {
        flush(ws);
        let dev = ws.dev.clone();
        let (x, bp, width, len) = (ws.p(buf), bias.ptr, bias.len as i32, (rows * bias.len) as u64);
        elementwise!(ws, &dev.k.add_bias, rows * bias.len, &x, &bp, &width, &len);
    }

    fn add(ws: &mut CudaWorkspace, to: Buf, from: Buf, len: usize) {
        flush(ws);
        let dev = ws.dev.clone();
        let (t, f, n) = (ws.p(to), ws.p(from), len as u64);
        elementwise!(ws, &dev.k.add, len, &t, &f, &n);
    }

    fn rope_write_kv(
        ws: &mut CudaWorkspace,
        layer: usize,
        rows: &[BatchRow],
        rope: Option<bool>,
        slots: &[KvSlot],
        kv: &mut CudaKv,
    ) {
        flush(ws);
        if rows.is_empty() {
            return;
        }
        if layer == 0 {
            if ws.pairs > 0 {
                rope_tables(ws, rows);
            }
            kv_tables(ws, slots);
        }
        let local = match rope {
            Some(local) if ws.pairs > 0 => local,
            // Nothing to rotate: the keys and values go as they are.
            _ => return write_kv(ws, layer, slots, kv),
        };
        let dev = ws.dev.clone();
        let s = &dev.stream;
        let shape = kv.shape();
        let (q, k, v) = (ws.p(Buf::Q), ws.p(Buf::K), ws.p(Buf::V));
        let cs = ptr(&ws.rope_cs[usize::from(local)].dev, s);
        let (heads, kvh, hd, pairs) = (ws.heads as i32, ws.kv_heads as i32, ws.head_dim as i32, ws.pairs as i32);
        let (pa, pb, rot) = (
            ptr(&ws.rope_pairs.0, s),
            ptr(&ws.rope_pairs.1, s),
            ptr(&ws.rope_rotated, s),
        );
        let (pg, sl) = (ws.table(Which::Page), ws.table(Which::Slot));
        let (l, layers, pt) = (layer as i32, shape.layers as i32, shape.page_tokens as i32);
        // A coded cache is written after the rotation, by write_kv.
        let plain = kv.plain();
        let (kc, vc) = if plain { (kv.k_ptr(), kv.v_ptr()) } else { (0, 0) };
        let total = (ws.heads + ws.kv_heads) * ws.pairs + ws.kv_heads * ws.head_dim;
        let cfg = LaunchConfig {
            grid_dim: (rows.len() as u32, total.div_ceil(128) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            ws,
            &dev.k.rope_write_kv,
            cfg,
            &q,
            &k,
            &v,
            &cs,
            &heads,
            &kvh,
            &hd,
            &pa,
            &pb,
            &pairs,
            &rot,
            &pg,
            &sl,
            &l,
            &layers,
            &pt,
            &kc,
            &vc
        );
        if !plain {
            write_kv_with(ws, layer, slots, kv, cs, pairs);
        }
    }

    fn attention(ws: &mut CudaWorkspace, c: &Config, layer: usize, rows: &[BatchRow], kv: &KvView<CudaKv>, scale: f32) {
        flush(ws);
        if rows.is_empty() {
            return;
        }
        let local = c.is_local(layer);
        if layer == 0 {
            // The page lists of the batch's sequences, and each row's
            // window in a global and in a local layer.
            let mut table = Vec::new();
            let mut twins = Vec::new();
            let mut offset = Vec::new();
            let coded = !kv.storage.plain();
            for (s, pages) in kv.pages.iter().enumerate() {
                offset.push(table.len() as u32);
                table.extend_from_slice(pages);
                if coded {
                    let of = kv.twins.get(s).copied().unwrap_or(&[]);
                    twins.extend((0..pages.len()).map(|i| of.get(i).copied().unwrap_or(NO_TWIN)));
                }
            }
            let row_table: Vec<u32> = rows.iter().map(|r| offset[r.seq]).collect();
            let end: Vec<u32> = rows.iter().map(|r| r.pos as u32 + 1).collect();
            let global: Vec<u32> = vec![0; rows.len()];
            let local_layer = (0..c.layers).find(|&l| c.is_local(l));
            let local_start: Vec<u32> = rows
                .iter()
                .map(|r| local_layer.map_or(0, |l| c.window_start(l, r.pos)) as u32)
                .collect();
            ws.upload(Which::Table, &table);
            if coded {
                ws.upload(Which::Twins, &twins);
            }
            ws.upload(Which::RowTable, &row_table);
            ws.upload(Which::End, &end);
            ws.upload(Which::StartGlobal, &global);
            ws.upload(Which::StartLocal, &local_start);
        }
        let dev = ws.dev.clone();
        let s = &dev.stream;
        let shape = kv.storage.shape();
        let (q, out) = (ws.p(Buf::Q), ws.p(Buf::Attn));
        let (table, rt, st, en) = (
            ws.table(Which::Table),
            ws.table(Which::RowTable),
            ws.table(if local { Which::StartLocal } else { Which::StartGlobal }),
            ws.table(Which::End),
        );
        let (heads, kvh, hd, l, layers, pt) = (
            ws.heads as i32,
            ws.kv_heads as i32,
            ws.head_dim as i32,
            layer as i32,
            ws.layers as i32,
            shape.page_tokens as i32,
        );
        let (kc, vc, sc, ctx) = (
            kv.storage.k_ptr(),
            kv.storage.v_ptr(),
            ptr(&ws.scores, s),
            ws.ctx as i32,
        );
        if !kv.storage.plain() {
            // Pages with a coded part: a block per row and query head.
            let desc = kv.storage.desc(layer);
            let (tw, runs, mp, n) = (
                ws.table(Which::Twins),
                ptr(&ws.runs, s),
                ws.max_pages as i32,
                rows.len() as i32,
            );
            let cfg = LaunchConfig {
                grid_dim: (rows.len() as u32, ws.heads as u32, 1),
                block_dim: (ATT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                ws,
                &dev.k.attend_coded,
                cfg,
                &q,
                &table,
                &tw,
                &rt,
                &st,
                &en,
                &heads,
                &kvh,
                &hd,
                &l,
                &layers,
                &pt,
                &desc,
                &scale,
                &sc,
                &runs,
                &ctx,
                &mp,
                &out,
                &n
            );
            return;
        }
        // The queries, a tile of values and their weights (kernels.cu): in
        // a prefill, groups of rows share their keys' and values' loads.
        let tile = ATT_TILE_BYTES / (ws.head_dim * 2);
        let start = |r: &BatchRow| c.window_start(layer, r.pos);
        let n = rows.len() as i32;
        if let Some((kernel, group)) =
            tiled_group(ws.head_dim).filter(|&(_, g)| dev.att_tiled && groups_share(rows, g, start))
        {
            let cfg = LaunchConfig {
                grid_dim: (rows.len().div_ceil(group) as u32, ws.heads as u32, 1),
                block_dim: (ATT_THREADS, 1, 1),
                shared_mem_bytes: tiled_shared_bytes(ws.head_dim, group),
            };
            let gr = group as i32;
            launch!(
                ws,
                &dev.k.attend_f16_tiled[kernel],
                cfg,
                &q,
                &table,
                &rt,
                &st,
                &en,
                &heads,
                &kvh,
                &hd,
                &l,
                &layers,
                &pt,
                &kc,
                &vc,
                &scale,
                &sc,
                &ctx,
                &out,
                &n,
                &gr
            );
            return;
        }
        let (f, group) = if groups_share(rows, dev.att_rows, start) {
            (&dev.k.attend_f16_rows, dev.att_rows)
        } else {
            (&dev.k.attend_f16, 1)
        };
        let cfg = LaunchConfig {
            grid_dim: (rows.len().div_ceil(group) as u32, ws.heads as u32, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: (group * (ws.head_dim * 4 + tile * 4) + ATT_TILE_BYTES) as u32,
        };
        launch!(
            ws, f, cfg, &q, &table, &rt, &st, &en, &heads, &kvh, &hd, &l, &layers, &pt, &kc, &vc, &scale, &sc, &ctx,
            &out, &n
        );
    }

    fn experts(_: &mut CudaWorkspace, _: &Experts<CudaMatrix>, _: &Config, _: usize) {
        // Models with experts are refused when their weights are uploaded
        // (`CudaError::Experts`), so no pass reaches this.
        unreachable!("mixture-of-experts blocks on CUDA")
    }

    fn gated(ws: &mut CudaWorkspace, act: Activation, rows: usize, width: usize) {
        flush(ws);
        if rows * width > 0 {
            let gelu = i32::from(matches!(act, Activation::Gelu));
            ws.pending = Pending::Gated { rows, width, gelu };
        }
    }

    fn gather_rows(ws: &mut CudaWorkspace, from: Buf, to: Buf, width: usize, which: &[usize]) {
        flush(ws);
        if which.is_empty() {
            return;
        }
        let idx: Vec<u32> = which.iter().map(|&r| r as u32).collect();
        ws.upload(Which::Gather, &idx);
        let dev = ws.dev.clone();
        let s = &dev.stream;
        let (src, w, wi) = (ws.p(from), width as i32, ws.table(Which::Gather));
        // In place, rows go through the spare buffer first.
        let dst = if from == to { ptr(&ws.tmp, s) } else { ws.p(to) };
        launch!(ws, &dev.k.gather, per_row(which.len(), 256), &src, &dst, &wi, &w);
        if from == to && ws.mode != Mode::Replay {
            let n = which.len() * width;
            let i = to as usize;
            let r = s.memcpy_dtod(&ws.tmp.slice(..n), &mut ws.bufs[i].slice_mut(..n));
            ws.note(r);
        }
    }

    fn logits(ws: &mut CudaWorkspace, head: &CudaMatrix, from: Buf, rows: usize, out: &mut [f32]) {
        if ws.mode == Mode::Replay {
            // What is held back is in the graph.
            ws.pending = Pending::None;
        }
        if rows == 0 {
            return flush(ws);
        }
        let s = ws.dev.stream.clone();
        let (x, y) = (ws.p(from), ptr(&ws.logits, &s));
        let n = rows * head.rows;
        let mode = std::mem::replace(&mut ws.mode, Mode::Direct);
        if mode == Mode::Direct {
            product(ws, head, x, y, rows, false);
            let r = s.memcpy_dtoh(&ws.logits.slice(..n), &mut out[..n]);
            return ws.note(r);
        }
        if mode == Mode::Capture {
            ws.mode = Mode::Capture;
            product(ws, head, x, y, rows, false);
            ws.mode = Mode::Direct;
            // SAFETY: the page-locked buffer holds `GRAPH_ROWS` rows of
            // logits and lives as long as the graph (both are the
            // workspace's).
            let r = unsafe {
                cudarc::driver::result::memcpy_dtoh_async(&mut ws.logits_host.as_mut_slice()[..n], y, s.cu_stream())
            };
            ws.note(r);
            let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
            match s.end_capture(flags) {
                Ok(Some(g)) if ws.error.is_none() => {
                    ws.graphs.insert(ws.key, Graph(g));
                }
                Ok(_) => {
                    // A launch failed while capturing (noted): this pass
                    // has no result, and later ones launch one by one.
                    ws.graphs_on = false;
                    return;
                }
                Err(e) => {
                    ws.graphs_on = false;
                    return ws.note::<()>(Err(e));
                }
            }
        }
        let r = match ws.graphs.get(&ws.key) {
            Some(g) => g.0.launch().and_then(|()| s.synchronize()),
            None => Ok(()),
        };
        ws.note(r);
        out[..n].copy_from_slice(&ws.logits_host.as_slice()[..n]);
    }

    fn read(ws: &mut CudaWorkspace, buf: Buf, out: &mut [f32]) {
        flush(ws);
        let s = &ws.dev.stream;
        let n = out.len();
        // A failed copy leaves zeros; the next device call reports it.
        if s.memcpy_dtoh(&ws.bufs[buf as usize].slice(..n), out).is_err() {
            out.fill(0.0);
        }
    }

    fn trace(ws: &mut CudaWorkspace, name: &str, layer: usize, layers: usize, buf: Buf, len: usize) {
        if !snug_model::arch::trace::enabled() {
            return;
        }
        flush(ws);
        let mut host = vec![0f32; len];
        Self::read(ws, buf, &mut host);
        snug_model::arch::trace::trace(name, layer, layers, &host);
    }
}

/// Holds back an RMS norm (see [`Pending`]).
fn hold_norm(ws: &mut CudaWorkspace, x: u64, add: u64, out: u64, rows: usize, w: &CudaVector, eps: f32) {
    flush(ws);
    if rows > 0 {
        ws.pending = Pending::Norm {
            x,
            add,
            out,
            rows,
            w: *w,
            eps,
        };
    }
}

/// RMS norm of `rows` rows at device address `x` (each first plus the row
/// at `add`, written back, unless `add` is 0) into `out` (kernels.cu).
fn norm_into(ws: &mut CudaWorkspace, x: u64, add: u64, out: u64, rows: usize, w: &CudaVector, eps: f32) {
    let dev = ws.dev.clone();
    let (wp, dim) = (w.ptr, w.len as i32);
    // The row in shared memory: up to 48 KiB (a width of 12,288).
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (norm_threads(&dev, w.len), 1, 1),
        shared_mem_bytes: (w.len * 4) as u32,
    };
    launch!(ws, &dev.k.rms_norm, cfg, &x, &add, &out, &wp, &dim, &eps);
}

/// Threads of a norm's block for rows of `dim`: with kernels.cu's
/// NORM_EARLY, 512 for wide rows, so that each warp quantizes one q8_K
/// super-block of a 4,096-wide row and each thread holds at most 16 of its
/// weights (`rms_norm_body`; the bits do not depend on it); else 256.
fn norm_threads(dev: &Device, dim: usize) -> u32 {
    if dev.norm_early && dim > 2048 {
        512
    } else {
        256
    }
}

/// Each row's cosines and sines for the global and local rotations, as
/// the CPU's `Rope::apply` computes them (the same library calls on the
/// same host), uploaded for the pass.
fn rope_tables(ws: &mut CudaWorkspace, rows: &[BatchRow]) {
    for i in 0..1 + usize::from(ws.has_local) {
        let pairs = ws.ropes[i].pairs(ws.head_dim);
        let mut cs = Vec::with_capacity(rows.len() * pairs.len() * 2);
        for r in rows {
            for &(_, _, f) in &pairs {
                let (sin, cos) = (r.pos as f32 * f).sin_cos();
                cs.push(cos);
                cs.push(sin);
            }
        }
        ws.upload_f32(i, &cs);
    }
}

/// Each row's keys and values of `layer` into its slot, in the cache's
/// formats (and, for a coded cache, into its page's twin where it has one;
/// the pass' page, slot and twin tables uploaded already), with no
/// rotation.
fn write_kv(ws: &mut CudaWorkspace, layer: usize, slots: &[KvSlot], kv: &mut CudaKv) {
    write_kv_with(ws, layer, slots, kv, 0, 0)
}

/// [`write_kv`] after the rotation whose cosines and sines are at `cs`
/// (`pairs` a row): TQ4 keys turn their basis' offset by them.
fn write_kv_with(ws: &mut CudaWorkspace, layer: usize, slots: &[KvSlot], kv: &mut CudaKv, cs: u64, pairs: i32) {
    let dev = ws.dev.clone();
    let shape = kv.shape();
    let (k, v, pg, sl) = (ws.p(Buf::K), ws.p(Buf::V), ws.table(Which::Page), ws.table(Which::Slot));
    let (l, layers, kvh, pt, hd) = (
        layer as i32,
        shape.layers as i32,
        shape.kv_heads as i32,
        shape.page_tokens as i32,
        shape.head_dim as i32,
    );
    if kv.plain() {
        let cfg = LaunchConfig {
            grid_dim: (
                slots.len() as u32,
                (shape.kv_heads * shape.head_dim).div_ceil(128) as u32,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (kc, vc) = (kv.k_ptr(), kv.v_ptr());
        launch!(
            ws,
            &dev.k.write_kv_f16,
            cfg,
            &k,
            &v,
            &pg,
            &sl,
            &l,
            &layers,
            &kvh,
            &pt,
            &hd,
            &kc,
            &vc
        );
        return;
    }
    let tw = ws.table(Which::TwinSlot);
    let desc = kv.desc(layer);
    let cfg = LaunchConfig {
        grid_dim: (slots.len() as u32, shape.kv_heads as u32, 2),
        block_dim: (shape.head_dim.next_multiple_of(32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        ws,
        &dev.k.write_kv_coded,
        cfg,
        &k,
        &v,
        &pg,
        &sl,
        &tw,
        &l,
        &layers,
        &kvh,
        &pt,
        &hd,
        &cs,
        &pairs,
        &desc
    );
}

/// Each row's KV page and slot, uploaded for the pass.
fn kv_tables(ws: &mut CudaWorkspace, slots: &[KvSlot]) {
    let page: Vec<u32> = slots.iter().map(|s| s.page).collect();
    let slot: Vec<u32> = slots.iter().map(|s| s.slot as u32).collect();
    let twin: Vec<u32> = slots.iter().map(|s| s.twin.unwrap_or(NO_TWIN)).collect();
    ws.upload(Which::Page, &page);
    ws.upload(Which::Slot, &slot);
    ws.upload(Which::TwinSlot, &twin);
}

/// `y[r] = w * x[r]` for `rows` rows, `x` and `y` device addresses: over
/// quantized weights, the activations are quantized first (as the CPU
/// quantizes them) and the products are integer dot products in the CPU's
/// order; over float weights, f32 dot products in the CPU's order.
/// Work held back by one call, to be launched together with the call after
/// it: a norm or gated activation whose output the next product
/// quantizes (one launch instead of two), and products of one input that
/// follow each other (queries, keys and values; gate and up: one launch).
/// Every other call launches what is held first, so the work runs in the
/// same order, on the same values.
#[derive(Clone, Copy)]
enum Pending {
    None,
    Norm {
        x: u64,
        add: u64,
        out: u64,
        rows: usize,
        w: CudaVector,
        eps: f32,
    },
    Gated {
        rows: usize,
        width: usize,
        gelu: i32,
    },
    Products {
        x: u64,
        rows: usize,
        n: usize,
        list: [(CudaMatrix, u64); 3],
    },
}

/// Launches the work held back (see [`Pending`]).
fn flush(ws: &mut CudaWorkspace) {
    match std::mem::replace(&mut ws.pending, Pending::None) {
        Pending::None => {}
        Pending::Norm {
            x,
            add,
            out,
            rows,
            w,
            eps,
        } => norm_into(ws, x, add, out, rows, &w, eps),
        Pending::Gated { rows, width, gelu } => {
            let dev = ws.dev.clone();
            let (g, u, n) = (ws.p(Buf::Gate), ws.p(Buf::Up), (rows * width) as u64);
            elementwise!(ws, &dev.k.gated, rows * width, &g, &u, &n, &gelu);
        }
        Pending::Products { rows, n, list, .. } => products(ws, &list[..n], rows),
    }
}

/// The kernels' code for an activation format (`FMT_*` in kernels.cu).
fn format_code(f: snug_kernels::dot::ActFormat) -> i32 {
    match f {
        snug_kernels::dot::ActFormat::Q8_0 => 0,
        snug_kernels::dot::ActFormat::Q8_1 => 1,
        snug_kernels::dot::ActFormat::Q8K => 2,
    }
}

/// `y = w x` for `rows` rows at device addresses `x` and `y`. A product
/// of a few rows is held back when `defer` (see [`Pending`]); the norm or
/// activation held back before it, when it produced `x`, is launched
/// with the quantization of `x`.
fn product(ws: &mut CudaWorkspace, w: &CudaMatrix, x: u64, y: u64, rows: usize, defer: bool) {
    if rows == 0 {
        return;
    }
    if is_float(w.ty) {
        flush(ws);
        return float_product(ws, w, x, y, rows);
    }
    let format = snug_kernels::dot::act_format(w.ty);
    let key = (x, rows, w.cols, format as u8);
    let quantized = ws.quantized;
    if let Pending::Products {
        x: px,
        rows: pr,
        n,
        list,
    } = &mut ws.pending
    {
        let joins = defer
            && *px == x
            && *pr == rows
            && *n < list.len()
            && list[0].0.ty == w.ty
            && list[0].0.cols == w.cols
            && y != x
            && list[..*n].iter().all(|&(_, o)| o != y)
            && quantized == Some(key);
        if joins {
            list[*n] = (*w, y);
            *n += 1;
            return;
        }
    }
    let dev = ws.dev.clone();
    let q8 = ptr(&ws.q8, &dev.stream);
    let fmt = format_code(format);
    match ws.pending {
        Pending::Norm {
            x: nx,
            add,
            out,
            rows: nr,
            w: nw,
            eps,
        } if out == x && nr == rows && nw.len == w.cols => {
            ws.pending = Pending::None;
            let (wp, dim) = (nw.ptr, nw.len as i32);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (norm_threads(&dev, nw.len), 1, 1),
                shared_mem_bytes: (nw.len * 4) as u32,
            };
            launch!(ws, &dev.k.norm_q8, cfg, &nx, &add, &out, &wp, &dim, &eps, &fmt, &q8);
            ws.quantized = (y != x).then_some(key);
        }
        Pending::Gated { rows: gr, width, gelu } if x == ws.p(Buf::Gate) && gr == rows && width == w.cols => {
            ws.pending = Pending::None;
            let (g, u) = (ws.p(Buf::Gate), ws.p(Buf::Up));
            let blocks = (rows * width / 32) as u64;
            let cfg = if format == snug_kernels::dot::ActFormat::Q8K {
                per_row(rows * width / 256, 256)
            } else {
                grid_of(blocks as usize, 8)
            };
            launch!(ws, &dev.k.gated_q8, cfg, &g, &u, &blocks, &gelu, &fmt, &q8);
            ws.quantized = (y != x).then_some(key);
        }
        _ => flush(ws),
    }
    if ws.mode == Mode::Replay {
        return;
    }
    if ws.quantized != Some(key) {
        match format {
            snug_kernels::dot::ActFormat::Q8K => {
                launch!(ws, &dev.k.quantize_q8k, per_row(rows * w.cols / 256, 256), &x, &q8);
            }
            _ => {
                let blocks = (rows * w.cols / 32) as u64;
                launch!(
                    ws,
                    &dev.k.quantize_q8,
                    grid_of(blocks as usize, 8),
                    &x,
                    &blocks,
                    &fmt,
                    &q8
                );
            }
        }
        // The product writes `y`, not the input.
        ws.quantized = (y != x).then_some(key);
    }
    // Many rows: tensor cores (the same operations on each product).
    if rows >= MMA_ROWS && ws.tensor_cores {
        let (wp, rb_, outs, n) = (w.ptr, w.row_bytes as u64, w.rows as i32, rows as i32);
        let nab = (w.cols / 32) as i32;
        // The staged tiles address their copies with 32-bit offsets.
        let small = (w.rows * w.row_bytes) as u64 >> 32 == 0 && (rows * w.cols / 32 * 48) as u64 >> 32 == 0;
        let kernel = match dev.mmt_fn(w.ty).filter(|_| ws.tiles == Tiles::Staged && small) {
            Some(f) => {
                let (rb, ob) = dev.mmt_block();
                let (_, _, wr, wo) = dev.mmt_tile;
                let cfg = LaunchConfig {
                    grid_dim: ((rows as u32).div_ceil(rb), (w.rows as u32).div_ceil(ob), 1),
                    block_dim: (32 * wr * wo, 1, 1),
                    shared_mem_bytes: dev.mmt_shared_bytes(w.ty),
                };
                Some((f, cfg))
            }
            None => dev.mma_fn(w.ty).map(|f| {
                let cfg = LaunchConfig {
                    grid_dim: ((rows as u32).div_ceil(16), (w.rows as u32).div_ceil(64), 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                (f, cfg)
            }),
        };
        if let Some((f, cfg)) = kernel {
            // Blocks of 32, or super-blocks of 256 for the K-quants.
            let nblk = (w.cols / w.ty.block_size()) as i32;
            let mut args = kernel_args!(&wp, &rb_, &nblk, &outs, &q8, &nab, &n, &y);
            // SAFETY: the arguments match the kernels' signature; the
            // quantized activations hold `rows` rows of `cols / 32` blocks,
            // and the shared memory is what the staged tiles' two stages
            // take.
            let r = unsafe { launch_raw(&dev.stream, f, cfg, ws.overlap, &mut args) };
            return ws.note(r);
        }
    }
    if defer {
        ws.pending = Pending::Products {
            x,
            rows,
            n: 1,
            list: [(*w, y); 3],
        };
    } else {
        products(ws, &[(*w, y)], rows);
    }
}

/// Up to three quantized products of one type and width, of the input
/// already quantized in the workspace, in one launch.
fn products(ws: &mut CudaWorkspace, list: &[(CudaMatrix, u64)], rows: usize) {
    if list.is_empty() || ws.mode == Mode::Replay {
        return;
    }
    let dev = ws.dev.clone();
    let w = list[0].0;
    // Blocks of 32, or super-blocks of 256 for the K-quants.
    let (nblk, nab, n, rb) = (
        (w.cols / w.ty.block_size()) as i32,
        (w.cols / 32) as i32,
        rows as i32,
        w.row_bytes as u64,
    );
    let mut wp = [0u64; 3];
    let mut outs = [0i32; 3];
    let mut y = [0u64; 3];
    for (i, (m, to)) in list.iter().enumerate() {
        wp[i] = m.ptr;
        outs[i] = m.rows as i32;
        y[i] = *to;
    }
    let total: u32 = list.iter().map(|(m, _)| m.rows as u32).sum();
    let q8 = ptr(&ws.q8, &dev.stream);
    // A warp per output, 4 a block (kernels.cu).
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(4), (rows as u32).div_ceil(4), 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = kernel_args!(
        &wp[0], &wp[1], &wp[2], &rb, &nblk, &outs[0], &outs[1], &outs[2], &q8, &nab, &n, &y[0], &y[1], &y[2]
    );
    // SAFETY: the arguments match the kernel's signature; the quantized
    // activations hold `rows` rows of `cols / 32` blocks, and each output
    // holds `rows` rows of its matrix's outputs.
    let r = unsafe { launch_raw(&dev.stream, dev.matvec_fn(w.ty), cfg, ws.overlap, &mut args) };
    ws.note(r);
}

/// A float matrix times f32 activations.
fn float_product(ws: &mut CudaWorkspace, w: &CudaMatrix, x: u64, y: u64, rows: usize) {
    if ws.mode == Mode::Replay {
        return;
    }
    ws.quantized = None;
    let dev = ws.dev.clone();
    let (wp, rb, outs, n, cols) = (w.ptr, w.row_bytes as u64, w.rows as i32, rows as i32, w.cols as i32);
    let cfg = LaunchConfig {
        grid_dim: ((w.rows as u32).div_ceil(4), (rows as u32).div_ceil(4), 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = kernel_args!(&wp, &rb, &cols, &outs, &x, &n, &y);
    // SAFETY: the arguments match the kernel's signature; the buffers
    // hold `rows` rows of `cols` and `outs`.
    let r = unsafe { launch_raw(&dev.stream, dev.matmul_fn(w.ty), cfg, ws.overlap, &mut args) };
    ws.note(r);
}

/// The attention kernel's threads per (row, head) and bytes of values it
/// holds in shared memory at a time (`ATT_THREADS`, `ATT_TILE_BYTES` in
/// kernels.cu).
const ATT_THREADS: u32 = 128;
const ATT_TILE_BYTES: usize = 16384;
/// kernels.cu's MMT_AS and MMT_WS: bytes of a staged tile's row of
/// activations and of its output's weights (Q4_K, Q5_K).
const MMT_AS: u32 = 416;
const MMT_WS_Q4K: u32 = 160;
const MMT_WS_Q5K: u32 = 192;
/// kernels.cu's ATT_TP: positions of a tile of keys in `attend_f16_tiled`.
const ATT_TP: usize = 32;

/// Which of the `attend_f16_tiled` kernels runs heads of `hd`, and the
/// rows of its groups (kernels.cu's NR of it): 8, or 4 for heads of 256
/// (whose queries take twice the registers).
fn tiled_group(hd: usize) -> Option<(usize, usize)> {
    match hd {
        64 => Some((0, 8)),
        128 => Some((1, 8)),
        256 => Some((2, 4)),
        _ => None,
    }
}

/// Shared memory of `attend_f16_tiled` for heads of `hd` and groups of
/// `group` rows: the largest of its scores' part (a tile of keys and the
/// lanes' accumulators), its values' part (a tile of values and their
/// weights) and `attend_f16`'s for a group that does not share.
fn tiled_shared_bytes(hd: usize, group: usize) -> u32 {
    let tile = ATT_TILE_BYTES / (hd * 2);
    let scores = ATT_TP * (hd + 8) * 2 + 16 * (group * ATT_TP + 4) * 4;
    let values = ATT_TILE_BYTES + tile * group * 4;
    let alone = hd * 4 + tile * 4 + ATT_TILE_BYTES;
    scores.max(values).max(alone) as u32
}

/// The batch from which `attend_f16_rows` is used.
const ATT_GROUP_MIN: usize = 8;

/// Whether a batch's attention runs `attend_f16_rows` (a block per group
/// of `group` rows): only where at least half of its groups are rows of
/// one sequence from one first position (`start`: the row's window
/// start), which share their keys' and values' loads, as a prefill's
/// rows do. The kernel runs a group that does not share a row at a time,
/// so rows of different sequences (many sequences decoding together)
/// would get a block per `group` rows instead of one each. Both kernels
/// give a row the same bits.
fn groups_share(rows: &[BatchRow], group: usize, start: impl Fn(&BatchRow) -> usize) -> bool {
    if rows.len() < ATT_GROUP_MIN || group < 2 {
        return false;
    }
    let shared = rows
        .chunks(group)
        .filter(|g| g.len() > 1 && g.iter().all(|r| r.seq == g[0].seq && start(r) == start(&g[0])))
        .count();
    2 * shared >= rows.len().div_ceil(group)
}

/// Rows from which a quantized product runs on tensor cores.
const MMA_ROWS: usize = 16;

/// `n` warps' work, 8 warps a block.
fn grid_of(n: usize, warps: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(warps).max(1), 1, 1),
        block_dim: (32 * warps, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_compile_for_hopper() {
        match compile("sm_90") {
            Ok(ptx) => {
                for ty in TYPES {
                    let s = type_suffix(ty).expect("listed");
                    let k = if is_float(ty) { "matmul" } else { "matvec" };
                    assert!(ptx.contains(&format!(".entry {k}_{s}(")), "{k}_{s} missing");
                }
                for k in [
                    "attend_f16",
                    "attend_f16_rows",
                    "attend_f16_tiled64",
                    "attend_f16_tiled128",
                    "attend_f16_tiled256",
                    "quantize_q8",
                    "quantize_q8k",
                    "rms_norm",
                    "norm_q8",
                    "gated_q8",
                    "rope_write_kv",
                    "mma_q4_k",
                    "mmt_q4_k",
                    "mmt_q5_k",
                    "mma_q6_k",
                    "mma_iq4_nl",
                    "mma_mxfp4",
                    "rows_q2_k",
                    "rows_q3_k",
                    "rows_iq4_xs",
                ] {
                    assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing");
                }
                // Nothing spills to local memory: every kernel's state
                // stays in registers.
                assert!(!ptx.contains("ld.local"), "a kernel spills to local memory");
            }
            Err(CudaError::NoNvrtc) => eprintln!("skipping: no NVRTC library on this machine"),
            Err(e) => panic!("{e}"),
        }
    }

    /// A run may set only the knobs that keep its outputs, to sane values.
    #[test]
    fn a_run_sets_only_knobs_that_keep_the_outputs() {
        let ok = |d: &[&str]| check_run_knobs(&d.iter().map(|s| s.to_string()).collect::<Vec<_>>()).is_ok();
        assert!(ok(&[]));
        assert!(ok(&["NORM_EARLY=0", "MV_U=2", "MV_BLOCKS=4"]));
        for bad in [
            "SKIP=31",
            "ATT_ROWS=0",
            "MV_U=0",
            "MV_U=x",
            "NORM_EARLY",
            "=1",
            "NORM_EARLY=-1",
            "MV_U=1000",
        ] {
            let e = check_run_knobs(&[bad.to_string()]).expect_err(bad);
            assert!(e.to_string().contains("NORM_EARLY, MV_U"), "{e}");
        }
        // Every knob a run may set is declared by kernels.cu.
        for (k, _) in RUN_KNOBS {
            assert!(SOURCE.contains(&format!("#ifndef {k}\n")), "{k}");
        }
    }

    /// A prefill's rows share their attention loads in groups; rows of
    /// many sequences decoding together do not, and run a block each.
    #[test]
    fn attention_groups_rows_only_where_they_share() {
        let row = |seq, pos| BatchRow {
            seq,
            pos,
            token: 0,
            logits: false,
        };
        let none = |_: &BatchRow| 0;
        let prompt: Vec<BatchRow> = (0..64).map(|p| row(0, p)).collect();
        assert!(groups_share(&prompt, 4, none));
        let decoding: Vec<BatchRow> = (0..64).map(|s| row(s, 100)).collect();
        assert!(!groups_share(&decoding, 4, none));
        // Too few rows, or groups of one.
        assert!(!groups_share(&prompt[..7], 4, none));
        assert!(!groups_share(&prompt, 1, none));
        // A window that starts each row apart shares nothing.
        assert!(!groups_share(&prompt, 4, |r: &BatchRow| r.pos));
        // A prompt of 32 rows beside 32 sequences decoding: half the groups.
        let mixed: Vec<BatchRow> = (0..32).map(|p| row(0, p)).chain((1..33).map(|s| row(s, 50))).collect();
        assert!(groups_share(&mixed, 4, none));
    }

    /// The knobs the host reads to shape its launches have their defaults
    /// from kernels.cu, and `NAME=VALUE` overrides them.
    #[test]
    fn the_hosts_knobs_are_the_kernels_defaults() {
        for (name, want) in [
            ("ATT_ROWS", 4),
            ("ATT_TILED", 0),
            ("ATT_TP", ATT_TP as u32),
            ("NORM_EARLY", 1),
            ("MMT_R", 2),
            ("MMT_S", 2),
            ("MMT_WR", 2),
            ("MMT_WO", 2),
            ("MMT_RAW", 2),
        ] {
            assert_eq!(define(SOURCE, &[], name), want, "{name}");
        }
        assert_eq!(define(SOURCE, &["NORM_EARLY=0".into()], "NORM_EARLY"), 0);
        // A name that only starts another macro's is not that macro.
        assert_eq!(define("#define MMT_RB 16\n#define MMT_R 3\n", &[], "MMT_R"), 3);
        assert_eq!(define("", &[], "MMT_R"), 0);
    }

    /// The level tables kernels.cu holds as words of four bytes are the
    /// CPU's (IQ4_NL and IQ4_XS; MXFP4).
    #[test]
    fn the_kernels_level_tables_are_the_cpus() {
        let word = |name: &str| -> u32 {
            let line = SOURCE
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} missing"));
            let hex = line.split_whitespace().nth(2).expect("a value");
            u32::from_str_radix(hex.trim_start_matches("0x").trim_end_matches('u'), 16).expect("hex")
        };
        for (prefix, want) in [
            ("IQ4", snug_kernels::quant::IQ4_LEVELS),
            ("MXFP4", snug_kernels::quant::MXFP4_LEVELS),
        ] {
            let got: Vec<i8> = (0..4)
                .flat_map(|k| word(&format!("{prefix}_T{k}")).to_le_bytes())
                .map(|b| b as i8)
                .collect();
            assert_eq!(got, want, "{prefix}");
        }
    }

    #[test]
    fn no_driver_is_an_error_not_a_crash() {
        // On a machine without a GPU this names what is missing; with one,
        // it opens it.
        match Device::open(0) {
            Ok(d) => assert!(!d.name.is_empty()),
            Err(e) => assert!(!e.to_string().is_empty(), "{e:?}"),
        }
    }
}
