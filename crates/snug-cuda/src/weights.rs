//! Weights in device memory: every matrix uploaded once, in its GGUF block
//! format, and every vector as f32.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use snug_kernels::matmul::Weight;
use snug_kernels::GgmlType;
use snug_model::arch::{Ffn, Layer, Weights};

use crate::{ptr, CudaError, Device, TYPES};

/// A matrix in device memory (`rows x cols`, a row per output), in its
/// file's block format.
#[derive(Clone, Copy, Debug)]
pub struct CudaMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub(crate) ptr: u64,
}

/// A vector of f32 in device memory.
#[derive(Clone, Copy, Debug)]
pub struct CudaVector {
    pub len: usize,
    pub(crate) ptr: u64,
}

/// A model's weights on the device: the allocations, and the decoder's
/// view of them.
pub struct CudaWeights {
    pub weights: Weights<CudaMatrix, CudaVector>,
    /// Bytes of device memory held.
    pub bytes: usize,
    _held: Vec<CudaSlice<u8>>,
    _held_f32: Vec<CudaSlice<f32>>,
}

impl CudaWeights {
    /// Uploads `w` to `dev`. A matrix whose type the kernels do not read,
    /// or whose rows are not whole chunks of 32, is refused.
    pub fn upload(dev: &Arc<Device>, w: &Weights<Weight<'_>, &[f32]>) -> Result<CudaWeights, CudaError> {
        let mut up = Uploader {
            dev,
            held: Vec::new(),
            held_f32: Vec::new(),
            bytes: 0,
        };
        let mut layers = Vec::new();
        for l in &w.layers {
            layers.push(Layer {
                attn_norm: up.vector(l.attn_norm)?,
                wq: up.matrix(&l.wq)?,
                wk: up.matrix(&l.wk)?,
                wv: up.matrix(&l.wv)?,
                wo: up.matrix(&l.wo)?,
                bq: up.opt(l.bq)?,
                bk: up.opt(l.bk)?,
                bv: up.opt(l.bv)?,
                q_norm: up.opt(l.q_norm)?,
                k_norm: up.opt(l.k_norm)?,
                post_attn_norm: up.opt(l.post_attn_norm)?,
                ffn_norm: up.vector(l.ffn_norm)?,
                ffn: match &l.ffn {
                    Ffn::Dense { gate, up: u, down } => Ffn::Dense {
                        gate: up.matrix(gate)?,
                        up: up.matrix(u)?,
                        down: up.matrix(down)?,
                    },
                    Ffn::Experts(_) => return Err(CudaError::Experts),
                },
                post_ffn_norm: up.opt(l.post_ffn_norm)?,
            });
        }
        let embed = up.matrix(&w.embed)?;
        // A tied head is the embedding table: upload it once.
        let output = if std::ptr::eq(w.output.data.as_ptr(), w.embed.data.as_ptr()) {
            embed
        } else {
            up.matrix(&w.output)?
        };
        let output_norm = up.vector(w.output_norm)?;
        Ok(CudaWeights {
            weights: Weights {
                embed,
                layers,
                output_norm,
                output,
            },
            bytes: up.bytes,
            _held: up.held,
            _held_f32: up.held_f32,
        })
    }
}

impl CudaWeights {
    /// One matrix uploaded alone (its allocation comes with it).
    pub fn matrix(dev: &Arc<Device>, w: &Weight<'_>) -> Result<(CudaMatrix, CudaSlice<u8>), CudaError> {
        let mut up = Uploader {
            dev,
            held: Vec::new(),
            held_f32: Vec::new(),
            bytes: 0,
        };
        let m = up.matrix(w)?;
        Ok((m, up.held.pop().expect("one upload")))
    }
}

struct Uploader<'d> {
    dev: &'d Arc<Device>,
    held: Vec<CudaSlice<u8>>,
    held_f32: Vec<CudaSlice<f32>>,
    bytes: usize,
}

impl Uploader<'_> {
    fn matrix(&mut self, w: &Weight<'_>) -> Result<CudaMatrix, CudaError> {
        if !TYPES.contains(&w.ty) || !w.cols.is_multiple_of(32) {
            return Err(CudaError::Unsupported(w.ty));
        }
        let row_bytes = w.row_bytes();
        let data = &w.data[..row_bytes * w.rows];
        let mut d = self.dev.alloc::<u8>(data.len(), "weights")?;
        self.dev.stream.memcpy_htod(data, &mut d)?;
        let p = ptr(&d, &self.dev.stream);
        self.bytes += data.len();
        self.held.push(d);
        Ok(CudaMatrix {
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            row_bytes,
            ptr: p,
        })
    }

    fn vector(&mut self, v: &[f32]) -> Result<CudaVector, CudaError> {
        let mut d = self.dev.alloc::<f32>(v.len(), "weights")?;
        self.dev.stream.memcpy_htod(v, &mut d)?;
        let p = ptr(&d, &self.dev.stream);
        self.bytes += v.len() * 4;
        self.held_f32.push(d);
        Ok(CudaVector { len: v.len(), ptr: p })
    }

    fn opt(&mut self, v: Option<&[f32]>) -> Result<Option<CudaVector>, CudaError> {
        v.map(|v| self.vector(v)).transpose()
    }
}
