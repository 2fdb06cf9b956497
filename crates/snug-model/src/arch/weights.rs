//! Binding a GGUF file's tensors to the decoder's weights, with every
//! shape and type checked once at load so the forward pass never fails.

use snug_kernels::ggml::Numerics;
use snug_kernels::matmul::{f32_data, is_float, matmul_supports, Weight};
use snug_kernels::panel::{panel_bytes, PANEL_ROWS};
use snug_kernels::GgmlType;

use super::config::Config;
use super::forward::{forward, BatchRow, Experts, Ffn, Head, KvView, Layer, Weights};
use super::ModelError;
use crate::backend::{Backend, Cpu, CpuWorkspace, LlamaCpp, Native, WorkspaceSize};
use crate::files::ModelFiles;
use crate::gguf::GgufFile;
use snug_kernels::ops::Rope;

/// A loaded model: configuration and weights borrowed from the mapped file.
pub struct Model<'a> {
    pub config: Config,
    pub(super) weights: Weights<Weight<'a>, &'a [f32]>,
    /// Whose arithmetic the forward pass follows: snug's own (the
    /// default) or llama.cpp's, f16 roundings included, for output that
    /// must equal llama.cpp's token for token. `SNUG_NUMERICS` sets it at
    /// load; KV written under one cannot be read under the other.
    pub numerics: Numerics,
}

impl<'a> Model<'a> {
    /// The weights as bound from the file, for a backend that keeps its
    /// own copy (a GPU's).
    pub fn weights(&self) -> &Weights<Weight<'a>, &'a [f32]> {
        &self.weights
    }

    /// The output head's bytes as compute reads them (its panels where
    /// packed), for leasing them out while no row wants logits.
    pub fn head_bytes(&self) -> &'a [u8] {
        self.weights.output.packed.unwrap_or(self.weights.output.data)
    }

    /// Binds the tensors of `files` (which must outlive the model), to
    /// run in snug's own numerics.
    pub fn load(files: &'a ModelFiles) -> Result<Model<'a>, ModelError> {
        let file: &'a GgufFile = &files.gguf;
        let mut c = Config::from_gguf(file)?;
        let (hd, nh, nkv) = (c.head_dim, c.heads, c.kv_heads);
        let get = |name: &str| {
            file.tensor(name)
                .ok_or_else(|| ModelError::Missing(format!("tensor {name}")))
        };
        let bad = |name: &str, problem: String| ModelError::BadTensor {
            name: name.to_string(),
            problem,
        };
        // The matrices packed into panels where this machine runs them.
        let packed = files.packed();
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Weight<'a>, ModelError> {
            let t = get(name)?;
            if t.dims.len() != 2 || t.dims[0] as usize != cols || t.dims[1] as usize != rows {
                return Err(bad(name, format!("shape {:?}, expected [{cols}, {rows}]", t.dims)));
            }
            if !matmul_supports(t.ty) {
                return Err(bad(
                    name,
                    format!(
                        "type {} is not supported for matrix products (snug runs {})",
                        t.ty,
                        crate::gguf::supported_types()
                    ),
                ));
            }
            if is_float(t.ty) && !cols.is_multiple_of(16) {
                return Err(bad(
                    name,
                    format!("{} rows of {cols} elements (not a multiple of 16)", t.ty),
                ));
            }
            Ok(Weight {
                ty: t.ty,
                rows,
                cols,
                data: file.tensor_data(t),
                packed: packed.and_then(|p| p.get(name)),
            })
        };
        let vector = |name: &str, len: usize| -> Result<&'a [f32], ModelError> {
            let t = get(name)?;
            if t.ty != GgmlType::F32 || t.elements as usize != len {
                return Err(bad(
                    name,
                    format!("{} of {} elements, expected f32 of {len}", t.ty, t.elements),
                ));
            }
            Ok(f32_data(file.tensor_data(t)))
        };
        let opt_vector = |name: &str, len: usize| -> Result<Option<&'a [f32]>, ModelError> {
            match file.tensor(name) {
                None => Ok(None),
                Some(_) => vector(name, len).map(Some),
            }
        };
        // Llama 3.1's RoPE scaling: a divisor per rotated pair, one tensor
        // for every layer.
        c.rope_factors = opt_vector("rope_freqs.weight", c.rope_dim / 2)?.map(|f| f.to_vec());
        let embed = matrix("token_embd.weight", c.vocab, c.dim)?;
        if !embed.ty.can_dequantize() {
            return Err(bad(
                "token_embd.weight",
                format!("type {} cannot be looked up", embed.ty),
            ));
        }
        // Phi-3's LongRoPE: per-pair factors chosen by context length and
        // an attention factor; not implemented, so refused.
        if file.tensor("rope_factors_long.weight").is_some() || file.tensor("rope_factors_short.weight").is_some() {
            return Err(ModelError::Bad(
                "LongRoPE (rope_factors_long/short) is not supported (none, linear, and Llama 3.1's rope_freqs are)"
                    .into(),
            ));
        }
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let (qk, post) = (c.arch.qk_norms, c.arch.post_norms);
            // Query, key and value matrices, apart or fused in rows.
            let (wq, wk, wv) = if file.tensor(&n("attn_qkv.weight")).is_some() {
                let qkv = matrix(&n("attn_qkv.weight"), (nh + 2 * nkv) * hd, c.dim)?;
                (
                    rows_of(&qkv, 0, nh * hd),
                    rows_of(&qkv, nh * hd, nkv * hd),
                    rows_of(&qkv, (nh + nkv) * hd, nkv * hd),
                )
            } else {
                (
                    matrix(&n("attn_q.weight"), nh * hd, c.dim)?,
                    matrix(&n("attn_k.weight"), nkv * hd, c.dim)?,
                    matrix(&n("attn_v.weight"), nkv * hd, c.dim)?,
                )
            };
            let ffn = if c.experts > 0 {
                // Each expert's matrix is one slice of a 3-D tensor.
                let stack = |name: &str, rows: usize, cols: usize| -> Result<Vec<Weight<'a>>, ModelError> {
                    let t = get(name)?;
                    if t.dims.as_slice() != [cols as u64, rows as u64, c.experts as u64] {
                        return Err(bad(
                            name,
                            format!("shape {:?}, expected [{cols}, {rows}, {}]", t.dims, c.experts),
                        ));
                    }
                    if !snug_kernels::dot::supports(t.ty) {
                        return Err(bad(
                            name,
                            format!(
                                "type {} is not supported for experts (snug runs the quantized types: {})",
                                t.ty,
                                crate::gguf::supported_types()
                            ),
                        ));
                    }
                    let data = file.tensor_data(t);
                    let per = data.len() / c.experts;
                    // Packed, the stack is one matrix of every expert's
                    // rows, each expert's in whole panels.
                    let pk = packed.and_then(|p| p.get(name)).filter(|pk| pk.len() % c.experts == 0);
                    let pper = pk.map_or(0, |pk| pk.len() / c.experts);
                    Ok((0..c.experts)
                        .map(|e| Weight {
                            ty: t.ty,
                            rows,
                            cols,
                            data: &data[e * per..(e + 1) * per],
                            packed: pk.map(|pk| &pk[e * pper..(e + 1) * pper]),
                        })
                        .collect())
                };
                let fe = c.ff_expert;
                Ffn::Experts(Experts {
                    router: matrix(&n("ffn_gate_inp.weight"), c.experts, c.dim)?,
                    gate: stack(&n("ffn_gate_exps.weight"), fe, c.dim)?,
                    up: stack(&n("ffn_up_exps.weight"), fe, c.dim)?,
                    down: stack(&n("ffn_down_exps.weight"), c.dim, fe)?,
                    used: c.experts_used,
                })
            } else if file.tensor(&n("ffn_gate.weight")).is_some() {
                Ffn::Dense {
                    gate: matrix(&n("ffn_gate.weight"), c.ff, c.dim)?,
                    up: matrix(&n("ffn_up.weight"), c.ff, c.dim)?,
                    down: matrix(&n("ffn_down.weight"), c.dim, c.ff)?,
                }
            } else {
                // Gate and up fused (gate rows first).
                let up = matrix(&n("ffn_up.weight"), 2 * c.ff, c.dim)?;
                Ffn::Dense {
                    gate: rows_of(&up, 0, c.ff),
                    up: rows_of(&up, c.ff, c.ff),
                    down: matrix(&n("ffn_down.weight"), c.dim, c.ff)?,
                }
            };
            layers.push(Layer {
                attn_norm: vector(&n("attn_norm.weight"), c.dim)?,
                wq,
                wk,
                wv,
                wo: matrix(&n("attn_output.weight"), c.dim, nh * hd)?,
                bq: opt_vector(&n("attn_q.bias"), nh * hd)?,
                bk: opt_vector(&n("attn_k.bias"), nkv * hd)?,
                bv: opt_vector(&n("attn_v.bias"), nkv * hd)?,
                q_norm: if qk {
                    Some(vector(&n("attn_q_norm.weight"), hd)?)
                } else {
                    None
                },
                k_norm: if qk {
                    Some(vector(&n("attn_k_norm.weight"), hd)?)
                } else {
                    None
                },
                post_attn_norm: if post {
                    Some(vector(&n("post_attention_norm.weight"), c.dim)?)
                } else {
                    None
                },
                ffn_norm: vector(&n("ffn_norm.weight"), c.dim)?,
                ffn,
                post_ffn_norm: if post {
                    Some(vector(&n("post_ffw_norm.weight"), c.dim)?)
                } else {
                    None
                },
            });
        }
        let output_norm = vector("output_norm.weight", c.dim)?;
        let output = match file.tensor("output.weight") {
            Some(_) => matrix("output.weight", c.vocab, c.dim)?,
            None => embed,
        };
        Ok(Model {
            config: c,
            weights: Weights {
                embed,
                layers,
                output_norm,
                output,
            },
            numerics: Numerics::default(),
        })
    }

    /// Matrices that run on panels packed at load (see
    /// [`crate::packed`]).
    pub fn packed_matrices(&self) -> usize {
        let w = &self.weights;
        let mut n = w.layers.iter().fold(0, |n, l| {
            n + [&l.wq, &l.wk, &l.wv, &l.wo]
                .into_iter()
                .chain(l.ffn.matrices())
                .filter(|w| w.packed.is_some())
                .count()
        });
        n += w.output.packed.is_some() as usize;
        n
    }

    /// This model reading every matrix from the model file, as on a CPU
    /// without panels (the products then take the row-at-a-time kernels,
    /// or panels packed per call): for tests that the two compute the same
    /// bits.
    pub fn without_packed_panels(&self) -> Model<'a> {
        let strip = |w: &Weight<'a>| Weight { packed: None, ..*w };
        let w = &self.weights;
        Model {
            config: self.config.clone(),
            weights: Weights {
                embed: strip(&w.embed),
                layers: w
                    .layers
                    .iter()
                    .map(|l| Layer {
                        wq: strip(&l.wq),
                        wk: strip(&l.wk),
                        wv: strip(&l.wv),
                        wo: strip(&l.wo),
                        ffn: match &l.ffn {
                            Ffn::Dense { gate, up, down } => Ffn::Dense {
                                gate: strip(gate),
                                up: strip(up),
                                down: strip(down),
                            },
                            Ffn::Experts(e) => Ffn::Experts(Experts {
                                router: strip(&e.router),
                                ..e.clone()
                            }),
                        },
                        ..l.clone()
                    })
                    .collect(),
                output_norm: w.output_norm,
                output: strip(&w.output),
            },
            numerics: self.numerics,
        }
    }

    /// Bytes of tensor data the forward pass reads per token (all weights,
    /// as panels where they are packed, but the embedding table, of which
    /// one row is read, and of a mixture of experts the router and the
    /// experts a token uses).
    pub fn bytes_read_per_token(&self) -> u64 {
        let w = |w: &Weight| w.packed.map_or(w.data.len(), |p| p.len()) as u64;
        let per_layer: u64 = self
            .weights
            .layers
            .iter()
            .map(|l| {
                let ffn = match &l.ffn {
                    Ffn::Dense { gate, up, down } => w(gate) + w(up) + w(down),
                    Ffn::Experts(e) => w(&e.router) + e.used as u64 * (w(&e.gate[0]) + w(&e.up[0]) + w(&e.down[0])),
                };
                w(&l.wq) + w(&l.wk) + w(&l.wv) + w(&l.wo) + ffn
            })
            .sum();
        per_layer + w(&self.weights.output) + self.weights.embed.row_bytes() as u64
    }
}

/// Rows `start..start + count` of `w`, as a matrix of their own (a fused
/// tensor's part). Where the part starts on a panel boundary, it keeps
/// the whole tensor's packed panels from there (a last panel shared with
/// the next part computes rows that are not written).
fn rows_of<'a>(w: &Weight<'a>, start: usize, count: usize) -> Weight<'a> {
    let rb = w.row_bytes();
    let packed = w.packed.filter(|_| start.is_multiple_of(PANEL_ROWS)).map(|p| {
        let pb = panel_bytes(w.ty, w.cols);
        &p[start / PANEL_ROWS * pb..(start + count).div_ceil(PANEL_ROWS) * pb]
    });
    Weight {
        ty: w.ty,
        rows: count,
        cols: w.cols,
        data: &w.data[start * rb..(start + count) * rb],
        packed,
    }
}

/// Dequantizes a weight into `arena` and returns an f32 view of it.
fn to_f32<'b>(w: &Weight, arena: &'b [Vec<f32>], slot: usize) -> Weight<'b> {
    let v = &arena[slot];
    // SAFETY: any f32 buffer can be viewed as bytes.
    let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) };
    Weight {
        ty: GgmlType::F32,
        rows: w.rows,
        cols: w.cols,
        data: bytes,
        packed: None,
    }
}

impl Model<'_> {
    /// Every matrix dequantized to f32, for a float reference the quantized
    /// kernels can be compared with (`arena` receives the buffers). Slow and
    /// large: for accuracy studies, not inference.
    pub fn dequantized_buffers(&self) -> Vec<Vec<f32>> {
        let deq = |w: &Weight| {
            let mut v = vec![0f32; w.rows * w.cols];
            snug_kernels::dequantize(w.ty, w.data, &mut v).expect("supported types");
            v
        };
        let mut arena = Vec::new();
        for l in &self.weights.layers {
            let Ffn::Dense { gate, up, down } = &l.ffn else {
                // (A float reference of expert blocks is not built.)
                return Vec::new();
            };
            for w in [&l.wq, &l.wk, &l.wv, &l.wo, gate, up, down] {
                arena.push(deq(w));
            }
        }
        arena.push(deq(&self.weights.output));
        arena
    }

    /// This model with its matrices replaced by `arena` (from
    /// [`Model::dequantized_buffers`]; a model of dense blocks).
    pub fn with_f32_matrices<'b>(&'b self, arena: &'b [Vec<f32>]) -> Model<'b> {
        let w = &self.weights;
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| Layer {
                attn_norm: l.attn_norm,
                wq: to_f32(&l.wq, arena, 7 * i),
                wk: to_f32(&l.wk, arena, 7 * i + 1),
                wv: to_f32(&l.wv, arena, 7 * i + 2),
                wo: to_f32(&l.wo, arena, 7 * i + 3),
                bq: l.bq,
                bk: l.bk,
                bv: l.bv,
                q_norm: l.q_norm,
                k_norm: l.k_norm,
                post_attn_norm: l.post_attn_norm,
                ffn_norm: l.ffn_norm,
                ffn: match &l.ffn {
                    Ffn::Dense { gate, up, down } => Ffn::Dense {
                        gate: to_f32(gate, arena, 7 * i + 4),
                        up: to_f32(up, arena, 7 * i + 5),
                        down: to_f32(down, arena, 7 * i + 6),
                    },
                    Ffn::Experts(_) => panic!("with_f32_matrices: a model of dense blocks"),
                },
                post_ffn_norm: l.post_ffn_norm,
            })
            .collect();
        Model {
            config: self.config.clone(),
            weights: Weights {
                embed: w.embed,
                layers,
                output_norm: w.output_norm,
                output: to_f32(&w.output, arena, 7 * w.layers.len()),
            },
            numerics: self.numerics,
        }
    }
}

impl Model<'_> {
    /// Runs `rows` through the model on the CPU backend of its numerics,
    /// writing each row's keys and values into `kv`, and appends the
    /// logits of the rows that ask for them, in order, to `logits`
    /// (`vocab` floats each).
    pub fn forward(&self, rows: &[BatchRow], kv: &mut KvView, ws: &mut CpuWorkspace, logits: &mut Vec<f32>) {
        self.forward_to(rows, kv, ws, Head::Logits, logits)
    }

    /// [`Model::forward`], handing back what `head` asks for (logits, or
    /// the normed last hidden states, `dim` floats a row).
    pub fn forward_to(
        &self,
        rows: &[BatchRow],
        kv: &mut KvView,
        ws: &mut CpuWorkspace,
        head: Head,
        out: &mut Vec<f32>,
    ) {
        let (c, w) = (&self.config, &self.weights);
        match self.numerics {
            Numerics::Native => forward::<Cpu<Native>>(c, w, rows, kv, ws, head, out),
            Numerics::Ggml => forward::<Cpu<LlamaCpp>>(c, w, rows, kv, ws, head, out),
        }
    }

    /// A workspace for this model's forward passes (the same for either
    /// numerics).
    pub fn workspace(&self, size: WorkspaceSize) -> CpuWorkspace {
        <Cpu<Native> as Backend>::workspace(&self.config, size)
    }

    /// Each layer's rotary embedding (local layers may have their own
    /// base).
    pub fn layer_ropes(&self) -> Vec<Rope> {
        let c = &self.config;
        (0..c.layers).map(|l| c.rope(c.is_local(l))).collect()
    }
}
