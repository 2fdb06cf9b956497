//! Laya decision checkpoints: a bidirectional ModernBERT-family encoder
//! (ModernBERT for `laya` and `laya-typed-decisions`, mmBERT for
//! `laya-multilingual`) with a typed decision head, read from the
//! directory the Laya SDK publishes:
//!
//! ```text
//! rl_agent_config.json      max_len, head_max_len, head_layers, act_costs, temperatures
//! model.safetensors         every weight (f16 as published; f32 and bf16 also read)
//! encoder/config.json       the encoder's shape, layer types and RoPE thetas
//! tokenizer/tokenizer.json  the tokenizer, with tokenizer_config.json naming
//!                           its [CLS], [SEP], [MASK] and [PAD] tokens
//! ```
//!
//! The forward takes rows (one per question: token ids, the positions of
//! the option markers, the question type) and returns each row's option
//! logits and action logits. f16 weights stay memory-mapped and are widened
//! inside the matrix products ([`snug_kernels::dense`]); everything is
//! computed in f32 like the reference. Each row is computed on its own (the
//! matrix products fix every output's operation order and attention never
//! crosses rows), so a row's logits are bitwise the same whatever else is
//! in the batch.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use serde_json::Value;
use snug_kernels::dense::{attend, dense_matmul, Dense, DenseData};
use snug_kernels::ops::gelu_erf;
use snug_kernels::pool::ThreadPool;

/// Why a checkpoint cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LayaError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("the tokenizer failed: {0}")]
    Tokenizer(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LayaError + '_ {
    move |source| LayaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn format_err(path: &Path, message: impl Into<String>) -> LayaError {
    LayaError::Format {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Whether `dir` looks like a Laya checkpoint (it has `rl_agent_config.json`).
pub fn is_checkpoint(dir: &Path) -> bool {
    dir.is_dir() && dir.join("rl_agent_config.json").is_file()
}

/// `rl_agent_config.json`: the decision model's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentConfig {
    /// The encoder the checkpoint was trained from (a name; informational).
    pub encoder: String,
    /// Tokens per row.
    pub max_len: usize,
    /// Tokens a question (instructions and options) may take.
    pub head_max_len: usize,
    pub head_layers: usize,
    /// Action-head outputs: one per entry of `act_costs`, plus "act".
    pub n_act: usize,
    /// Temperatures per type (choice, score, noul) as shipped (unclamped).
    pub temperature: [f64; 3],
    /// Temperatures per option-count bucket (`choice:3-5`, ...) as shipped.
    pub temperature_by_options: BTreeMap<String, f64>,
}

/// `encoder/config.json`: the ModernBERT-family encoder's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct EncoderConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub norm_eps: f32,
    /// Per layer: global attention (else local, within `window` tokens).
    pub global: Vec<bool>,
    /// A local layer's query sees keys at most this far away.
    pub window: usize,
    pub global_theta: f64,
    pub local_theta: f64,
    pub norm_bias: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
}

/// The tokenizer's structural tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Specials {
    pub cls: u32,
    pub sep: u32,
    pub mask: u32,
    pub pad: u32,
    /// The mask token's text, which is blanked out of user text.
    pub mask_text: String,
}

fn read_json(path: &Path) -> Result<Value, LayaError> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    serde_json::from_str(&text).map_err(|e| format_err(path, format!("not valid JSON: {e}")))
}

fn get_usize(v: &Value, key: &str, default: Option<usize>, path: &Path) -> Result<usize, LayaError> {
    match v.get(key) {
        Some(x) => x
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| format_err(path, format!("'{key}' must be a non-negative integer"))),
        None => default.ok_or_else(|| format_err(path, format!("'{key}' is missing"))),
    }
}

impl AgentConfig {
    pub fn read(path: &Path) -> Result<AgentConfig, LayaError> {
        let v = read_json(path)?;
        if !v.is_object() {
            return Err(format_err(path, "must be a JSON object"));
        }
        match v.get("option_layout").and_then(Value::as_str) {
            None | Some("sequential") => {}
            Some(other) => {
                return Err(format_err(
                    path,
                    format!("option_layout {other:?} is not supported; only the sequential layout is"),
                ))
            }
        }
        let temperature = match v.get("temperature") {
            None => [1.0; 3],
            Some(Value::Array(a)) if a.len() == 3 => [0, 1, 2].map(|i| a[i].as_f64().unwrap_or(f64::NAN)),
            Some(_) => return Err(format_err(path, "'temperature' must be a list of 3 numbers")),
        };
        let mut by_options = BTreeMap::new();
        if let Some(m) = v.get("temperature_by_options").and_then(Value::as_object) {
            for (k, t) in m {
                by_options.insert(k.clone(), t.as_f64().unwrap_or(f64::NAN));
            }
        }
        let n_act = v.get("act_costs").and_then(Value::as_object).map_or(0, |m| m.len()) + 1;
        let max_len = get_usize(&v, "max_len", Some(512), path)?;
        let head_max_len = get_usize(&v, "head_max_len", Some(192), path)?;
        if max_len == 0 || head_max_len == 0 {
            return Err(format_err(path, "max_len and head_max_len must be positive"));
        }
        Ok(AgentConfig {
            encoder: v.get("encoder").and_then(Value::as_str).unwrap_or("").to_string(),
            max_len,
            head_max_len,
            head_layers: get_usize(&v, "head_layers", Some(2), path)?,
            n_act,
            temperature,
            temperature_by_options: by_options,
        })
    }
}

impl EncoderConfig {
    pub fn read(path: &Path) -> Result<EncoderConfig, LayaError> {
        let v = read_json(path)?;
        match v.get("model_type").and_then(Value::as_str) {
            Some("modernbert") => {}
            other => {
                return Err(format_err(
                    path,
                    format!("model_type {other:?} is not supported; Laya checkpoints use a ModernBERT-family encoder"),
                ))
            }
        }
        match v.get("hidden_activation").and_then(Value::as_str).unwrap_or("gelu") {
            "gelu" => {}
            other => {
                return Err(format_err(
                    path,
                    format!("hidden_activation {other:?} is not supported"),
                ))
            }
        }
        let layers = get_usize(&v, "num_hidden_layers", None, path)?;
        let hidden = get_usize(&v, "hidden_size", None, path)?;
        let heads = get_usize(&v, "num_attention_heads", None, path)?;
        if heads == 0 || hidden % heads != 0 || (hidden / heads) % 2 != 0 {
            return Err(format_err(path, "hidden_size must split into heads of even size"));
        }
        let global = match v.get("layer_types").and_then(Value::as_array) {
            Some(types) => {
                if types.len() != layers {
                    return Err(format_err(path, "layer_types must name every layer"));
                }
                let mut g = Vec::with_capacity(layers);
                for t in types {
                    g.push(match t.as_str() {
                        Some("full_attention") => true,
                        Some("sliding_attention") => false,
                        _ => return Err(format_err(path, format!("unknown layer type {t}"))),
                    });
                }
                g
            }
            None => {
                let every = get_usize(&v, "global_attn_every_n_layers", Some(3), path)?.max(1);
                (0..layers).map(|i| i % every == 0).collect()
            }
        };
        let theta = |kind: &str, old: &str, default: f64| -> f64 {
            let rope = v.get("rope_parameters");
            rope.and_then(|r| r.get(kind))
                .and_then(|p| p.get("rope_theta"))
                .or_else(|| rope.and_then(|r| r.get("rope_theta")))
                .or_else(|| v.get(old))
                .and_then(Value::as_f64)
                .unwrap_or(default)
        };
        let flag = |key: &str| v.get(key).and_then(Value::as_bool).unwrap_or(false);
        Ok(EncoderConfig {
            vocab: get_usize(&v, "vocab_size", None, path)?,
            hidden,
            heads,
            layers,
            intermediate: get_usize(&v, "intermediate_size", None, path)?,
            norm_eps: v.get("norm_eps").and_then(Value::as_f64).unwrap_or(1e-5) as f32,
            global,
            window: get_usize(&v, "local_attention", Some(128), path)? / 2,
            global_theta: theta("full_attention", "global_rope_theta", 160000.0),
            local_theta: theta("sliding_attention", "local_rope_theta", 10000.0),
            norm_bias: flag("norm_bias"),
            attention_bias: flag("attention_bias"),
            mlp_bias: flag("mlp_bias"),
        })
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dtype {
    F16,
    F32,
}

enum Storage {
    Mapped { dtype: Dtype, range: Range<usize> },
    Owned(Vec<f32>),
}

struct TensorEntry {
    shape: Vec<usize>,
    storage: Storage,
}

/// The tensors of `model.safetensors`, memory-mapped.
struct Tensors {
    path: PathBuf,
    map: Mmap,
    entries: HashMap<String, TensorEntry>,
}

impl Tensors {
    fn open(path: &Path) -> Result<Tensors, LayaError> {
        let file = File::open(path).map_err(io_err(path))?;
        // SAFETY: the file is opened read-only and treated as immutable;
        // replacing a checkpoint under a running process is unsupported.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| format_err(path, format!("not a safetensors file: {e}")))?;
        let base = 8 + header_len;
        let mut entries = HashMap::new();
        for (name, info) in meta.tensors() {
            let (start, end) = info.data_offsets;
            let range = base + start..base + end;
            if range.end > map.len() || start > end {
                return Err(format_err(
                    path,
                    format!("tensor {name} lies past the end of the file (truncated?)"),
                ));
            }
            let storage = match info.dtype {
                safetensors::Dtype::F16 if (map.as_ptr() as usize + range.start).is_multiple_of(2) => Storage::Mapped {
                    dtype: Dtype::F16,
                    range,
                },
                safetensors::Dtype::F32 if (map.as_ptr() as usize + range.start).is_multiple_of(4) => Storage::Mapped {
                    dtype: Dtype::F32,
                    range,
                },
                safetensors::Dtype::F16 => Storage::Owned(
                    map[range]
                        .chunks_exact(2)
                        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                ),
                safetensors::Dtype::F32 => Storage::Owned(
                    map[range]
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                ),
                safetensors::Dtype::BF16 => Storage::Owned(
                    map[range]
                        .chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                ),
                other => {
                    return Err(format_err(
                        path,
                        format!("tensor {name}: dtype {other:?} is not supported"),
                    ))
                }
            };
            entries.insert(
                name.clone(),
                TensorEntry {
                    shape: info.shape.clone(),
                    storage,
                },
            );
        }
        Ok(Tensors {
            path: path.to_path_buf(),
            map,
            entries,
        })
    }

    fn entry(&self, name: &str, shape: &[usize]) -> Result<&TensorEntry, LayaError> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| format_err(&self.path, format!("tensor {name} is missing")))?;
        if e.shape != shape {
            return Err(format_err(
                &self.path,
                format!("tensor {name} has shape {:?}; the configs say {shape:?}", e.shape),
            ));
        }
        Ok(e)
    }

    fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// A matrix (`rows x cols`), or a vector (`cols == 0` means 1-D of `rows`).
    fn dense(&self, name: &str, rows: usize, cols: usize) -> Result<Dense<'_>, LayaError> {
        let shape: Vec<usize> = if cols == 0 { vec![rows] } else { vec![rows, cols] };
        let e = self.entry(name, &shape)?;
        let data = match &e.storage {
            Storage::Owned(v) => DenseData::F32(v),
            Storage::Mapped { dtype, range } => {
                let bytes = &self.map[range.clone()];
                match dtype {
                    // SAFETY: alignment was checked when the entry was made;
                    // the length is a whole number of elements.
                    Dtype::F16 => DenseData::F16(unsafe {
                        std::slice::from_raw_parts(bytes.as_ptr() as *const u16, bytes.len() / 2)
                    }),
                    Dtype::F32 => DenseData::F32(unsafe {
                        std::slice::from_raw_parts(bytes.as_ptr() as *const f32, bytes.len() / 4)
                    }),
                }
            }
        };
        Ok(Dense {
            rows,
            cols: cols.max(1),
            data,
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LayaError> {
        let d = self.dense(name, len, 0)?;
        let mut out = vec![0f32; len];
        match d.data {
            DenseData::F16(h) => out
                .iter_mut()
                .zip(h)
                .for_each(|(o, &b)| *o = f16::from_bits(b).to_f32()),
            DenseData::F32(f) => out.copy_from_slice(f),
        }
        Ok(out)
    }

    fn mapped_bytes(&self) -> usize {
        self.map.len()
    }
}

/// A LayerNorm's parameters (no bias where the encoder has none).
#[derive(Clone, Debug)]
struct Norm {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    eps: f32,
}

impl Norm {
    fn load(t: &Tensors, prefix: &str, d: usize, bias: bool, eps: f32) -> Result<Norm, LayaError> {
        let b = if bias || t.has(&format!("{prefix}.bias")) {
            Some(t.vector(&format!("{prefix}.bias"), d)?)
        } else {
            None
        };
        Ok(Norm {
            w: t.vector(&format!("{prefix}.weight"), d)?,
            b,
            eps,
        })
    }

    /// Normalizes each `d`-wide row of `x` into `out`.
    fn apply(&self, x: &[f32], out: &mut [f32]) {
        let d = self.w.len();
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
            let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + self.eps as f64).sqrt();
            for i in 0..d {
                let y = ((xr[i] as f64 - mean) * rstd) as f32 * self.w[i];
                or[i] = match &self.b {
                    Some(b) => y + b[i],
                    None => y,
                };
            }
        }
    }
}

/// A row for the forward: one question's sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub ids: Vec<u32>,
    /// Positions of the option markers (`[MASK]` tokens), in slot order.
    pub markers: Vec<usize>,
    /// 0 choice, 1 score, 2 noul.
    pub qtype: usize,
}

/// What the forward gives for a row.
#[derive(Clone, Debug, PartialEq)]
pub struct RowOutput {
    /// One logit per option marker.
    pub logits: Vec<f32>,
    /// The action head's logits; `act[0]` is "act".
    pub act: Vec<f32>,
}

/// A loaded checkpoint.
pub struct LayaModel {
    pub dir: PathBuf,
    pub config: AgentConfig,
    pub encoder: EncoderConfig,
    pub tokenizer: tokenizers::Tokenizer,
    pub specials: Specials,
    tensors: Tensors,
    norms: Norms,
    pool: ThreadPool,
    forward_tokens: usize,
}

/// Tokens a pass holds activations for, by default: about 100 MB of
/// activations for ModernBERT-large, and room for four 512-token rows.
pub const FORWARD_TOKENS: usize = 2048;

struct Norms {
    embed: Norm,
    attn: Vec<Option<Norm>>,
    mlp: Vec<Norm>,
    last: Norm,
    head1: Vec<Norm>,
    head2: Vec<Norm>,
    scorer: Norm,
    type_emb: Vec<f32>,
    biases: HashMap<String, Vec<f32>>,
}

fn special_token(cfg: &Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn load_tokenizer(dir: &Path) -> Result<(tokenizers::Tokenizer, Specials), LayaError> {
    let path = dir.join("tokenizer").join("tokenizer.json");
    if !path.is_file() {
        return Err(format_err(
            &path,
            "missing; a Laya checkpoint ships its tokenizer in tokenizer/",
        ));
    }
    let tok = tokenizers::Tokenizer::from_file(&path).map_err(|e| format_err(&path, e.to_string()))?;
    let cfg_path = dir.join("tokenizer").join("tokenizer_config.json");
    let cfg = if cfg_path.is_file() {
        read_json(&cfg_path)?
    } else {
        Value::Null
    };
    let find = |key: &str, fallbacks: &[&str]| -> Result<(u32, String), LayaError> {
        let named = special_token(&cfg, key);
        for text in named.iter().map(String::as_str).chain(fallbacks.iter().copied()) {
            if let Some(id) = tok.token_to_id(text) {
                return Ok((id, text.to_string()));
            }
        }
        Err(format_err(
            &path,
            format!("the tokenizer has no {key} (looked for {named:?} and {fallbacks:?})"),
        ))
    };
    let (cls, _) = find("cls_token", &["[CLS]", "<cls>", "<bos>"])?;
    let (sep, _) = find("sep_token", &["[SEP]", "<sep>", "<eos>"])?;
    let (mask, mask_text) = find("mask_token", &["[MASK]", "<mask>"])?;
    let (pad, _) = find("pad_token", &["[PAD]", "<pad>"])?;
    Ok((
        tok,
        Specials {
            cls,
            sep,
            mask,
            pad,
            mask_text,
        },
    ))
}

impl LayaModel {
    /// Opens the checkpoint in `dir`, checking every tensor's shape.
    pub fn open(dir: &Path, threads: usize) -> Result<LayaModel, LayaError> {
        let cfg_path = dir.join("rl_agent_config.json");
        if !cfg_path.is_file() {
            return Err(format_err(
                dir,
                "not a Laya checkpoint: rl_agent_config.json is missing (it ships with a checkpoint's weights)",
            ));
        }
        let config = AgentConfig::read(&cfg_path)?;
        let encoder = EncoderConfig::read(&dir.join("encoder").join("config.json"))?;
        let (tokenizer, specials) = load_tokenizer(dir)?;
        let tensors = Tensors::open(&dir.join("model.safetensors"))?;
        let d = encoder.hidden;
        if d % (d / 64).max(1) != 0 {
            return Err(format_err(
                dir,
                format!("hidden_size {d} does not split into the decision head's 64-wide heads"),
            ));
        }
        let norms = Self::load_small(&tensors, &config, &encoder)?;
        let model = LayaModel {
            dir: dir.to_path_buf(),
            config,
            encoder,
            tokenizer,
            specials,
            tensors,
            norms,
            pool: ThreadPool::new(threads.max(1)),
            forward_tokens: FORWARD_TOKENS,
        };
        model.check_matrices()?;
        if model.tokenizer.get_vocab_size(true) > model.encoder.vocab {
            return Err(format_err(
                dir,
                "the tokenizer has more tokens than the encoder's vocabulary",
            ));
        }
        Ok(model)
    }

    fn load_small(t: &Tensors, c: &AgentConfig, e: &EncoderConfig) -> Result<Norms, LayaError> {
        let d = e.hidden;
        let eps = e.norm_eps;
        let mut biases = HashMap::new();
        let mut bias = |name: String, len: usize| -> Result<(), LayaError> {
            let v = t.vector(&name, len)?;
            biases.insert(name, v);
            Ok(())
        };
        for j in 0..c.head_layers {
            let p = format!("head.layers.{j}");
            bias(format!("{p}.self_attn.in_proj_bias"), 3 * d)?;
            bias(format!("{p}.self_attn.out_proj.bias"), d)?;
            bias(format!("{p}.linear1.bias"), 4 * d)?;
            bias(format!("{p}.linear2.bias"), d)?;
        }
        bias("scorer.1.bias".into(), d)?;
        bias("scorer.3.bias".into(), 1)?;
        bias("act_head.0.bias".into(), 256)?;
        bias("act_head.2.bias".into(), c.n_act)?;
        for i in 0..e.layers {
            if e.attention_bias {
                bias(format!("encoder.layers.{i}.attn.Wqkv.bias"), 3 * d)?;
                bias(format!("encoder.layers.{i}.attn.Wo.bias"), d)?;
            }
            if e.mlp_bias {
                bias(format!("encoder.layers.{i}.mlp.Wi.bias"), 2 * e.intermediate)?;
                bias(format!("encoder.layers.{i}.mlp.Wo.bias"), d)?;
            }
        }
        let type_emb = {
            let m = t.dense("type_emb.weight", 3, d)?;
            let mut v = vec![0f32; 3 * d];
            for r in 0..3 {
                m.row_f32(r, &mut v[r * d..(r + 1) * d]);
            }
            v
        };
        Ok(Norms {
            embed: Norm::load(t, "encoder.embeddings.norm", d, e.norm_bias, eps)?,
            attn: (0..e.layers)
                .map(|i| {
                    if i == 0 {
                        Ok(None)
                    } else {
                        Norm::load(t, &format!("encoder.layers.{i}.attn_norm"), d, e.norm_bias, eps).map(Some)
                    }
                })
                .collect::<Result<_, _>>()?,
            mlp: (0..e.layers)
                .map(|i| Norm::load(t, &format!("encoder.layers.{i}.mlp_norm"), d, e.norm_bias, eps))
                .collect::<Result<_, _>>()?,
            last: Norm::load(t, "encoder.final_norm", d, e.norm_bias, eps)?,
            head1: (0..c.head_layers)
                .map(|j| Norm::load(t, &format!("head.layers.{j}.norm1"), d, true, 1e-5))
                .collect::<Result<_, _>>()?,
            head2: (0..c.head_layers)
                .map(|j| Norm::load(t, &format!("head.layers.{j}.norm2"), d, true, 1e-5))
                .collect::<Result<_, _>>()?,
            scorer: Norm::load(t, "scorer.0", d, true, 1e-5)?,
            type_emb,
            biases,
        })
    }

    fn check_matrices(&self) -> Result<(), LayaError> {
        let e = &self.encoder;
        let d = e.hidden;
        let t = &self.tensors;
        t.dense("encoder.embeddings.tok_embeddings.weight", e.vocab, d)?;
        for i in 0..e.layers {
            let p = format!("encoder.layers.{i}");
            t.dense(&format!("{p}.attn.Wqkv.weight"), 3 * d, d)?;
            t.dense(&format!("{p}.attn.Wo.weight"), d, d)?;
            t.dense(&format!("{p}.mlp.Wi.weight"), 2 * e.intermediate, d)?;
            t.dense(&format!("{p}.mlp.Wo.weight"), d, e.intermediate)?;
        }
        for j in 0..self.config.head_layers {
            let p = format!("head.layers.{j}");
            t.dense(&format!("{p}.self_attn.in_proj_weight"), 3 * d, d)?;
            t.dense(&format!("{p}.self_attn.out_proj.weight"), d, d)?;
            t.dense(&format!("{p}.linear1.weight"), 4 * d, d)?;
            t.dense(&format!("{p}.linear2.weight"), d, 4 * d)?;
        }
        t.dense("scorer.1.weight", d, d)?;
        t.dense("scorer.3.weight", 1, d)?;
        t.dense("act_head.0.weight", 256, d + 4)?;
        t.dense("act_head.2.weight", self.config.n_act, 256)?;
        Ok(())
    }

    /// Parameters in the weight file (the temperature buffer included).
    pub fn parameters(&self) -> u64 {
        self.tensors
            .entries
            .values()
            .map(|e| e.shape.iter().product::<usize>() as u64)
            .sum()
    }

    /// Bytes of the mapped weight file.
    pub fn weight_bytes(&self) -> usize {
        self.tensors.mapped_bytes()
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn w(&self, name: &str, rows: usize, cols: usize) -> Dense<'_> {
        self.tensors.dense(name, rows, cols).expect("shapes checked at open")
    }

    fn bias(&self, name: &str) -> Option<&[f32]> {
        self.norms.biases.get(name).map(Vec::as_slice)
    }

    /// `out = x W^T (+ b)` for `n` rows.
    fn linear(&self, name: &str, rows: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
        let w = self.w(&format!("{name}.weight"), rows, cols);
        dense_matmul(&self.pool, &w, &x[..n * cols], n, &mut out[..n * rows]);
        if let Some(b) = self.bias(&format!("{name}.bias")) {
            for r in out[..n * rows].chunks_exact_mut(rows) {
                r.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
            }
        }
    }

    /// Tokens one pass holds activations for (see [`LayaModel::forward`]).
    pub fn forward_tokens(&self) -> usize {
        self.forward_tokens
    }

    /// Sets the tokens one pass holds activations for (at least one row
    /// always runs). Answers do not depend on it.
    pub fn set_forward_tokens(&mut self, tokens: usize) {
        self.forward_tokens = tokens.max(1);
    }

    /// Bytes of activations a pass over `tokens` tokens allocates.
    pub fn scratch_bytes(&self, tokens: usize) -> usize {
        let e = &self.encoder;
        let d = e.hidden;
        let wide = (3 * d).max(2 * e.intermediate).max(4 * d);
        tokens * (3 * d + wide + e.intermediate) * 4
    }

    /// Runs `rows` through the encoder and the decision head. Rows run in
    /// passes of at most [`LayaModel::forward_tokens`] tokens, so the
    /// activations stay bounded however many questions and states come
    /// at once; rows never interact, so the grouping changes no bits.
    pub fn forward(&self, rows: &[Row]) -> Vec<RowOutput> {
        let mut out = Vec::with_capacity(rows.len());
        let mut start = 0;
        while start < rows.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < rows.len() && (end == start || tokens + rows[end].ids.len() <= self.forward_tokens) {
                tokens += rows[end].ids.len();
                end += 1;
            }
            out.extend(self.forward_pass(&rows[start..end]));
            start = end;
        }
        out
    }

    fn forward_pass(&self, rows: &[Row]) -> Vec<RowOutput> {
        if rows.is_empty() {
            return Vec::new();
        }
        let e = &self.encoder;
        let d = e.hidden;
        let inter = e.intermediate;
        let spans: Vec<(usize, usize)> = rows
            .iter()
            .scan(0, |at, r| {
                let s = (*at, r.ids.len());
                *at += r.ids.len();
                Some(s)
            })
            .collect();
        let n: usize = rows.iter().map(|r| r.ids.len()).sum();
        let wide = (3 * d).max(2 * inter).max(4 * d);
        let mut h = vec![0f32; n * d];
        let mut a = vec![0f32; n * d];
        let mut big = vec![0f32; n * wide];
        let mut att = vec![0f32; n * d];
        let mut mlp = vec![0f32; n * inter];

        // Embeddings, then their norm.
        let emb = self.w("encoder.embeddings.tok_embeddings.weight", e.vocab, d);
        for (t, &id) in rows.iter().flat_map(|r| r.ids.iter()).enumerate() {
            emb.row_f32((id as usize).min(e.vocab - 1), &mut a[t * d..(t + 1) * d]);
        }
        self.norms.embed.apply(&a, &mut h);

        let hd = e.head_dim();
        let max_len = rows.iter().map(|r| r.ids.len()).max().unwrap_or(0);
        let rope_g = Rope::new(hd, e.global_theta, max_len);
        let rope_l = Rope::new(hd, e.local_theta, max_len);
        for i in 0..e.layers {
            let p = format!("encoder.layers.{i}");
            let x = match &self.norms.attn[i] {
                Some(norm) => {
                    norm.apply(&h, &mut a);
                    &a
                }
                None => &h,
            };
            self.linear(&format!("{p}.attn.Wqkv"), 3 * d, d, x, n, &mut big);
            let (rope, window) = if e.global[i] {
                (&rope_g, None)
            } else {
                (&rope_l, Some(e.window))
            };
            for &(s, len) in &spans {
                rope.apply(&mut big[s * 3 * d..(s + len) * 3 * d], e.heads, hd, d);
            }
            self.attention(&big, &spans, e.heads, hd, window, &mut att);
            self.linear(&format!("{p}.attn.Wo"), d, d, &att, n, &mut a);
            h.iter_mut().zip(&a).for_each(|(h, &v)| *h += v);
            self.norms.mlp[i].apply(&h, &mut a);
            self.linear(&format!("{p}.mlp.Wi"), 2 * inter, d, &a, n, &mut big);
            for t in 0..n {
                let r = &mut big[t * 2 * inter..(t + 1) * 2 * inter];
                let (input, gate) = r.split_at_mut(inter);
                gelu_erf(input);
                let g = &mut mlp[t * inter..(t + 1) * inter];
                for c in 0..inter {
                    g[c] = input[c] * gate[c];
                }
            }
            self.linear(&format!("{p}.mlp.Wo"), d, inter, &mlp, n, &mut a);
            h.iter_mut().zip(&a).for_each(|(h, &v)| *h += v);
        }
        self.norms.last.apply(&h, &mut a);
        std::mem::swap(&mut h, &mut a);

        // Decision head: type embedding, transformer layers, scorer.
        for (r, &(s, len)) in rows.iter().zip(&spans) {
            let te = &self.norms.type_emb[r.qtype.min(2) * d..(r.qtype.min(2) + 1) * d];
            for t in s..s + len {
                h[t * d..(t + 1) * d].iter_mut().zip(te).for_each(|(h, &v)| *h += v);
            }
        }
        let head_heads = (d / 64).max(1);
        for j in 0..self.config.head_layers {
            let p = format!("head.layers.{j}");
            self.norms.head1[j].apply(&h, &mut a);
            let w = self.w(&format!("{p}.self_attn.in_proj_weight"), 3 * d, d);
            dense_matmul(&self.pool, &w, &a, n, &mut big[..n * 3 * d]);
            let b = self.bias(&format!("{p}.self_attn.in_proj_bias")).expect("loaded");
            big[..n * 3 * d]
                .chunks_exact_mut(3 * d)
                .for_each(|r| r.iter_mut().zip(b).for_each(|(o, &b)| *o += b));
            self.attention(&big, &spans, head_heads, d / head_heads, None, &mut att);
            self.linear(&format!("{p}.self_attn.out_proj"), d, d, &att, n, &mut a);
            h.iter_mut().zip(&a).for_each(|(h, &v)| *h += v);
            self.norms.head2[j].apply(&h, &mut a);
            self.linear(&format!("{p}.linear1"), 4 * d, d, &a, n, &mut big);
            big[..n * 4 * d].iter_mut().for_each(|v| *v = v.max(0.0));
            self.linear(&format!("{p}.linear2"), d, 4 * d, &big, n, &mut a);
            h.iter_mut().zip(&a).for_each(|(h, &v)| *h += v);
        }

        rows.iter()
            .zip(&spans)
            .map(|(r, &(s, _))| self.decide_row(r, &h[s * d..]))
            .collect()
    }

    /// The scorer at each marker and the action head on the first token.
    fn decide_row(&self, r: &Row, h: &[f32]) -> RowOutput {
        let d = self.encoder.hidden;
        let k = r.markers.len();
        let mut m = vec![0f32; k * d];
        for (i, &pos) in r.markers.iter().enumerate() {
            m[i * d..(i + 1) * d].copy_from_slice(&h[pos * d..(pos + 1) * d]);
        }
        let mut normed = vec![0f32; k * d];
        self.norms.scorer.apply(&m, &mut normed);
        let mut hidden = vec![0f32; k * d];
        self.linear("scorer.1", d, d, &normed, k, &mut hidden);
        gelu_erf(&mut hidden);
        let mut logits = vec![0f32; k];
        self.linear("scorer.3", 1, d, &hidden, k, &mut logits);

        // The action head's features, from the untempered softmax.
        let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = logits.iter().map(|&z| (z - mx).exp()).collect();
        let sum: f32 = e.iter().sum();
        let p: Vec<f32> = e.iter().map(|&x| x / sum).collect();
        let kk = (k.max(2)) as f32;
        let ent = -p.iter().map(|&x| x * x.max(1e-9).ln()).sum::<f32>() / kk.ln();
        let mut sorted = p.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let top1 = sorted.first().copied().unwrap_or(0.0);
        let top2 = sorted.get(1).copied().unwrap_or(0.0);
        let mut input = h[..d].to_vec();
        input.extend_from_slice(&[top1, top1 - top2, ent, kk / 255.0]);
        let mut mid = vec![0f32; 256];
        self.linear("act_head.0", 256, d + 4, &input, 1, &mut mid);
        gelu_erf(&mut mid);
        let mut act = vec![0f32; self.config.n_act];
        self.linear("act_head.2", self.config.n_act, 256, &mid, 1, &mut act);
        RowOutput { logits, act }
    }

    /// Bidirectional attention within each row's span; `qkv` rows hold
    /// `[q | k | v]`, each `heads x hd`. A local layer's query sees keys
    /// at most `window` positions away.
    fn attention(
        &self,
        qkv: &[f32],
        spans: &[(usize, usize)],
        heads: usize,
        hd: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) {
        let d = heads * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let out_ptr = SendPtr(out.as_mut_ptr());
        let tasks: Vec<(usize, usize, usize)> = spans
            .iter()
            .flat_map(|&(s, len)| (0..heads).map(move |hh| (s, len, hh)))
            .collect();
        self.pool.run(tasks.len(), &|ti| {
            let (s, len, hh) = tasks[ti];
            let op = &out_ptr;
            let mut k = vec![0f32; len * hd];
            let mut v = vec![0f32; len * hd];
            for t in 0..len {
                let row = &qkv[(s + t) * 3 * d..(s + t + 1) * 3 * d];
                k[t * hd..(t + 1) * hd].copy_from_slice(&row[d + hh * hd..d + (hh + 1) * hd]);
                v[t * hd..(t + 1) * hd].copy_from_slice(&row[2 * d + hh * hd..2 * d + (hh + 1) * hd]);
            }
            let mut scores = vec![0f32; len];
            let mut acc = vec![0f32; hd];
            for i in 0..len {
                let q = &qkv[(s + i) * 3 * d + hh * hd..(s + i) * 3 * d + (hh + 1) * hd];
                let (lo, hi) = match window {
                    Some(w) => (i.saturating_sub(w), (i + w + 1).min(len)),
                    None => (0, len),
                };
                attend(
                    q,
                    &k[lo * hd..hi * hd],
                    &v[lo * hd..hi * hd],
                    scale,
                    &mut scores[..hi - lo],
                    &mut acc,
                );
                for (c, &a) in acc.iter().enumerate() {
                    // SAFETY: each (token, head) slice is written by one task.
                    unsafe { *op.0.add((s + i) * d + hh * hd + c) = a };
                }
            }
        });
    }
}

use snug_kernels::pool::SendPtr;

/// Rotary embedding tables (rotate-half layout), computed in f32 like the
/// reference: `inv_freq = 1 / theta^(2i/hd)`, angle `pos * inv_freq`.
struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    fn new(hd: usize, theta: f64, len: usize) -> Rope {
        let half = hd / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / hd as f32))
            .collect();
        let mut cos = vec![0f32; len * half];
        let mut sin = vec![0f32; len * half];
        for p in 0..len {
            for i in 0..half {
                let a = p as f32 * inv[i];
                cos[p * half + i] = a.cos();
                sin[p * half + i] = a.sin();
            }
        }
        Rope { half, cos, sin }
    }

    /// Rotates the q and k parts of each `[q | k | v]` row in place;
    /// positions count from the span's start.
    fn apply(&self, qkv: &mut [f32], heads: usize, hd: usize, d: usize) {
        let half = self.half;
        for (p, row) in qkv.chunks_exact_mut(3 * d).enumerate() {
            let (c, s) = (&self.cos[p * half..(p + 1) * half], &self.sin[p * half..(p + 1) * half]);
            for part in 0..2 {
                for hh in 0..heads {
                    let x = &mut row[part * d + hh * hd..part * d + (hh + 1) * hd];
                    for i in 0..half {
                        let (a, b) = (x[i], x[i + half]);
                        x[i] = a * c[i] - b * s[i];
                        x[i + half] = b * c[i] + a * s[i];
                    }
                }
            }
        }
    }
}
