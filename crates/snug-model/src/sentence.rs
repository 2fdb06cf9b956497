//! Sentence-embedding checkpoints in the sentence-transformers layout: a
//! BERT encoder, a pooling step and, usually, a unit-length scaling.
//!
//! ```text
//! config.json                 the encoder's shape (model_type "bert")
//! model.safetensors           the weights (f32 as published; f16 and bf16 read too)
//! tokenizer.json              the WordPiece tokenizer
//! modules.json                the pipeline: Transformer, Pooling, Normalize
//! sentence_bert_config.json   max_seq_length, the longest input
//! 1_Pooling/config.json       mean, CLS, max or mean-sqrt-len pooling
//! ```
//!
//! The encoder is the original post-norm BERT: token, position and
//! token-type embeddings summed and normed; per layer, attention with
//! biased Q, K and V projections, the output projection added to the
//! residual and normed, then a GELU (erf) MLP added and normed. Everything
//! is f32, as in the reference. Attention stays within one input, and the
//! matrix products fix each output's operation order
//! ([`snug_kernels::dense`]), so an input's vector is bitwise the same
//! whether it is embedded alone or with others.
//!
//! The parts this shares with the Laya encoder (mapped tensors, layer
//! norms, bidirectional attention) come from [`crate::laya`].

use std::path::{Path, PathBuf};

use serde_json::Value;
use snug_kernels::dense::dense_matmul;
use snug_kernels::ops::gelu_erf;
use snug_kernels::pool::ThreadPool;

use crate::laya::{attention, format_err, get_usize, io_err, read_json, LayaError, Norm, Tensors};

/// How token vectors become one vector (`1_Pooling/config.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over every token, [CLS] and [SEP] included.
    Mean,
    /// The first token's vector.
    Cls,
    /// The largest value of each feature.
    Max,
    /// The sum divided by the square root of the token count.
    MeanSqrtLen,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Max => "max",
            Pooling::MeanSqrtLen => "mean_sqrt_len",
        }
    }
}

/// The encoder's shape (`config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub max_positions: usize,
    pub type_vocab: usize,
    pub norm_eps: f32,
}

/// A loaded sentence-embedding checkpoint.
pub struct SentenceModel {
    pub dir: PathBuf,
    pub config: BertConfig,
    /// The longest input in tokens, [CLS] and [SEP] included.
    pub max_tokens: usize,
    pub pooling: Pooling,
    /// Whether vectors are scaled to unit length.
    pub normalize: bool,
    tokenizer: tokenizers::Tokenizer,
    tensors: Tensors,
    /// Tensor names' prefix: "" or "bert." (both layouts are published).
    prefix: String,
    embed_norm: Norm,
    attn_norm: Vec<Norm>,
    out_norm: Vec<Norm>,
    /// Position and token-type embeddings summed for type 0, per position.
    position_type: Vec<f32>,
    pool: ThreadPool,
}

/// Whether `dir` holds a sentence-transformers checkpoint snug can run.
pub fn is_checkpoint(dir: &Path) -> bool {
    dir.is_dir()
        && dir.join("config.json").is_file()
        && dir.join("model.safetensors").is_file()
        && (dir.join("modules.json").is_file() || dir.join("sentence_bert_config.json").is_file())
}

/// Tokens one forward pass holds activations for.
const PASS_TOKENS: usize = 4096;

impl BertConfig {
    fn read(path: &Path) -> Result<BertConfig, LayaError> {
        let v = read_json(path)?;
        let kind = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        if kind != "bert" {
            return Err(format_err(
                path,
                format!("model_type {kind:?} is not supported; sentence checkpoints run on a BERT encoder (\"bert\")"),
            ));
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "gelu" {
                return Err(format_err(
                    path,
                    format!("hidden_act {act:?}: only \"gelu\" is supported"),
                ));
            }
        }
        if let Some(p) = v.get("position_embedding_type").and_then(Value::as_str) {
            if p != "absolute" {
                return Err(format_err(
                    path,
                    format!("position_embedding_type {p:?}: only \"absolute\" is supported"),
                ));
            }
        }
        let c = BertConfig {
            vocab: get_usize(&v, "vocab_size", None, path)?,
            hidden: get_usize(&v, "hidden_size", None, path)?,
            heads: get_usize(&v, "num_attention_heads", None, path)?,
            layers: get_usize(&v, "num_hidden_layers", None, path)?,
            intermediate: get_usize(&v, "intermediate_size", None, path)?,
            max_positions: get_usize(&v, "max_position_embeddings", Some(512), path)?,
            type_vocab: get_usize(&v, "type_vocab_size", Some(2), path)?,
            norm_eps: v.get("layer_norm_eps").and_then(Value::as_f64).unwrap_or(1e-12) as f32,
        };
        if c.heads == 0 || c.hidden == 0 || !c.hidden.is_multiple_of(c.heads) || c.vocab == 0 || c.type_vocab == 0 {
            return Err(format_err(
                path,
                format!(
                    "hidden_size {} does not split into {} heads (or a size is zero)",
                    c.hidden, c.heads
                ),
            ));
        }
        Ok(c)
    }
}

fn read_pooling(dir: &Path, hidden: usize) -> Result<(Pooling, bool), LayaError> {
    let modules = dir.join("modules.json");
    let mut pooling_dir = dir.join("1_Pooling");
    let mut normalize = false;
    if modules.is_file() {
        let v = read_json(&modules)?;
        let list = v
            .as_array()
            .ok_or_else(|| format_err(&modules, "must be a list of modules"))?;
        for m in list {
            let kind = m.get("type").and_then(Value::as_str).unwrap_or("");
            let sub = m.get("path").and_then(Value::as_str).unwrap_or("");
            match kind.rsplit('.').next().unwrap_or("") {
                "Transformer" => {}
                "Pooling" => pooling_dir = dir.join(sub),
                "Normalize" => normalize = true,
                other => {
                    return Err(format_err(
                        &modules,
                        format!("module {other:?} is not supported (Transformer, Pooling and Normalize are)"),
                    ))
                }
            }
        }
    }
    let cfg = pooling_dir.join("config.json");
    if !cfg.is_file() {
        return Ok((Pooling::Mean, normalize));
    }
    let v = read_json(&cfg)?;
    if let Some(d) = v.get("word_embedding_dimension").and_then(Value::as_u64) {
        if d as usize != hidden {
            return Err(format_err(
                &cfg,
                format!("word_embedding_dimension {d} is not hidden_size {hidden}"),
            ));
        }
    }
    let on = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    let modes = [
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_max_tokens", Pooling::Max),
        ("pooling_mode_mean_sqrt_len_tokens", Pooling::MeanSqrtLen),
    ];
    let chosen: Vec<Pooling> = modes.iter().filter(|(k, _)| on(k)).map(|&(_, p)| p).collect();
    if let Some((k, _)) = ["pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"]
        .iter()
        .map(|k| (k, on(k)))
        .find(|(_, x)| *x)
    {
        return Err(format_err(&cfg, format!("{k} is not supported")));
    }
    match chosen.as_slice() {
        [one] => Ok((*one, normalize)),
        [] => Ok((Pooling::Mean, normalize)),
        _ => Err(format_err(
            &cfg,
            "several pooling modes at once (a concatenated vector) are not supported",
        )),
    }
}

impl SentenceModel {
    /// Opens the checkpoint in `dir`, checking every tensor's shape.
    pub fn open(dir: &Path, threads: usize) -> Result<SentenceModel, LayaError> {
        let config = BertConfig::read(&dir.join("config.json"))?;
        let (pooling, normalize) = read_pooling(dir, config.hidden)?;
        let st = dir.join("sentence_bert_config.json");
        let max_tokens = if st.is_file() {
            get_usize(&read_json(&st)?, "max_seq_length", Some(config.max_positions), &st)?
        } else {
            config.max_positions
        }
        .min(config.max_positions);
        let tok_path = dir.join("tokenizer.json");
        let bytes = snug_core::durable::read_regular(&tok_path).map_err(io_err(&tok_path))?;
        let mut tokenizer =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| format_err(&tok_path, e.to_string()))?;
        // Inputs are checked against `max_tokens`, never cut or padded.
        tokenizer
            .with_truncation(None)
            .map_err(|e| format_err(&tok_path, e.to_string()))?;
        tokenizer.with_padding(None);
        if tokenizer.get_vocab_size(true) > config.vocab {
            return Err(format_err(
                &tok_path,
                "the tokenizer has more tokens than the encoder's vocabulary",
            ));
        }
        let tensors = Tensors::open(&dir.join("model.safetensors"))?;
        let prefix = if tensors.has("embeddings.word_embeddings.weight") {
            String::new()
        } else {
            "bert.".to_string()
        };
        let d = config.hidden;
        let eps = config.norm_eps;
        let norm = |name: &str| Norm::load(&tensors, &format!("{prefix}{name}"), d, true, eps);
        let embed_norm = norm("embeddings.LayerNorm")?;
        let mut attn_norm = Vec::new();
        let mut out_norm = Vec::new();
        for i in 0..config.layers {
            attn_norm.push(norm(&format!("encoder.layer.{i}.attention.output.LayerNorm"))?);
            out_norm.push(norm(&format!("encoder.layer.{i}.output.LayerNorm"))?);
        }
        let positions = tensors.dense(
            &format!("{prefix}embeddings.position_embeddings.weight"),
            config.max_positions,
            d,
        )?;
        let types = tensors.dense(
            &format!("{prefix}embeddings.token_type_embeddings.weight"),
            config.type_vocab,
            d,
        )?;
        let mut type0 = vec![0f32; d];
        types.row_f32(0, &mut type0);
        let mut position_type = vec![0f32; max_tokens * d];
        for (p, row) in position_type.chunks_exact_mut(d).enumerate() {
            positions.row_f32(p, row);
            row.iter_mut().zip(&type0).for_each(|(x, &t)| *x += t);
        }
        let model = SentenceModel {
            dir: dir.to_path_buf(),
            config,
            max_tokens,
            pooling,
            normalize,
            tokenizer,
            tensors,
            prefix,
            embed_norm,
            attn_norm,
            out_norm,
            position_type,
            pool: ThreadPool::new(threads.max(1)),
        };
        model.check()?;
        Ok(model)
    }

    fn check(&self) -> Result<(), LayaError> {
        let c = &self.config;
        let (d, f) = (c.hidden, c.intermediate);
        self.tensors
            .dense(&self.name("embeddings.word_embeddings.weight"), c.vocab, d)?;
        for i in 0..c.layers {
            let l = format!("encoder.layer.{i}");
            for (m, rows, cols) in [
                ("attention.self.query", d, d),
                ("attention.self.key", d, d),
                ("attention.self.value", d, d),
                ("attention.output.dense", d, d),
                ("intermediate.dense", f, d),
                ("output.dense", d, f),
            ] {
                self.tensors.dense(&self.name(&format!("{l}.{m}.weight")), rows, cols)?;
                self.tensors.vector(&self.name(&format!("{l}.{m}.bias")), rows)?;
            }
        }
        Ok(())
    }

    fn name(&self, n: &str) -> String {
        format!("{}{n}", self.prefix)
    }

    /// The length of the vectors.
    pub fn dim(&self) -> usize {
        self.config.hidden
    }

    pub fn vocab(&self) -> usize {
        self.config.vocab
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Bytes of the mapped weight file.
    pub fn weight_bytes(&self) -> usize {
        self.tensors.mapped_bytes()
    }

    /// Bytes of activations a pass allocates at most.
    pub fn scratch_bytes(&self) -> usize {
        let c = &self.config;
        PASS_TOKENS.max(self.max_tokens) * (6 * c.hidden + c.intermediate) * 4
    }

    /// `text` as the reference tokenizes it: [CLS], the WordPiece tokens,
    /// [SEP]. The length is not checked here.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, LayaError> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| LayaError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The vectors of `inputs` (token ids, each at most
    /// [`SentenceModel::max_tokens`] long and not empty). Inputs run in
    /// passes of a bounded number of tokens; each input's vector is the
    /// same bits however they are grouped.
    pub fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, LayaError> {
        for (i, t) in inputs.iter().enumerate() {
            if t.is_empty() || t.len() > self.max_tokens {
                return Err(format_err(
                    &self.dir,
                    format!(
                        "input {i} has {} tokens; this model takes 1 to {}",
                        t.len(),
                        self.max_tokens
                    ),
                ));
            }
            if let Some(&bad) = t.iter().find(|&&id| id as usize >= self.config.vocab) {
                return Err(format_err(
                    &self.dir,
                    format!(
                        "input {i}: token id {bad} is outside the vocabulary of {}",
                        self.config.vocab
                    ),
                ));
            }
        }
        let mut out = Vec::with_capacity(inputs.len());
        let mut start = 0;
        while start < inputs.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < inputs.len() && (end == start || tokens + inputs[end].len() <= PASS_TOKENS) {
                tokens += inputs[end].len();
                end += 1;
            }
            out.extend(self.pass(&inputs[start..end]));
            start = end;
        }
        Ok(out)
    }

    /// The token vectors of one pass (`n x hidden`) and the inputs' spans.
    fn hidden_states(&self, inputs: &[Vec<u32>]) -> (Vec<f32>, Vec<(usize, usize)>) {
        let c = &self.config;
        let (d, f) = (c.hidden, c.intermediate);
        let spans: Vec<(usize, usize)> = inputs
            .iter()
            .scan(0, |at, t| {
                let s = (*at, t.len());
                *at += t.len();
                Some(s)
            })
            .collect();
        let n: usize = inputs.iter().map(Vec::len).sum();
        let mut h = vec![0f32; n * d];
        let mut a = vec![0f32; n * d];
        let mut qkv = vec![0f32; n * 3 * d];
        let mut part = vec![0f32; n * d];
        let mut wide = vec![0f32; n * f];

        let words = self
            .tensors
            .dense(&self.name("embeddings.word_embeddings.weight"), c.vocab, d)
            .expect("checked at open");
        for (t, ids) in inputs.iter().enumerate() {
            let (s, _) = spans[t];
            for (p, &id) in ids.iter().enumerate() {
                let row = &mut a[(s + p) * d..(s + p + 1) * d];
                words.row_f32(id as usize, row);
                row.iter_mut()
                    .zip(&self.position_type[p * d..(p + 1) * d])
                    .for_each(|(x, &e)| *x += e);
            }
        }
        self.embed_norm.apply(&a, &mut h);

        let hd = d / c.heads;
        for i in 0..c.layers {
            let l = format!("encoder.layer.{i}");
            for (j, m) in ["query", "key", "value"].iter().enumerate() {
                self.linear(&format!("{l}.attention.self.{m}"), d, d, &h, n, &mut part);
                for t in 0..n {
                    qkv[t * 3 * d + j * d..t * 3 * d + (j + 1) * d].copy_from_slice(&part[t * d..(t + 1) * d]);
                }
            }
            attention(&self.pool, &qkv, &spans, c.heads, hd, None, &mut a);
            self.linear(&format!("{l}.attention.output.dense"), d, d, &a, n, &mut part);
            part.iter_mut().zip(&h).for_each(|(p, &x)| *p += x);
            self.attn_norm[i].apply(&part, &mut h);
            self.linear(&format!("{l}.intermediate.dense"), f, d, &h, n, &mut wide);
            gelu_erf(&mut wide);
            self.linear(&format!("{l}.output.dense"), d, f, &wide, n, &mut part);
            part.iter_mut().zip(&h).for_each(|(p, &x)| *p += x);
            self.out_norm[i].apply(&part, &mut h);
        }
        (h, spans)
    }

    fn pass(&self, inputs: &[Vec<u32>]) -> Vec<Vec<f32>> {
        let d = self.config.hidden;
        let (h, spans) = self.hidden_states(inputs);
        spans
            .iter()
            .map(|&(s, len)| {
                let rows = &h[s * d..(s + len) * d];
                let mut v = vec![0f32; d];
                match self.pooling {
                    Pooling::Cls => v.copy_from_slice(&rows[..d]),
                    Pooling::Max => {
                        v.fill(f32::NEG_INFINITY);
                        for r in rows.chunks_exact(d) {
                            v.iter_mut().zip(r).for_each(|(m, &x)| *m = m.max(x));
                        }
                    }
                    Pooling::Mean | Pooling::MeanSqrtLen => {
                        for r in rows.chunks_exact(d) {
                            v.iter_mut().zip(r).for_each(|(m, &x)| *m += x);
                        }
                        let div = if self.pooling == Pooling::Mean {
                            len as f32
                        } else {
                            (len as f32).sqrt()
                        };
                        v.iter_mut().for_each(|x| *x /= div);
                    }
                }
                if self.normalize {
                    let norm = v.iter().map(|&x| x * x).sum::<f32>().sqrt().max(1e-12);
                    v.iter_mut().for_each(|x| *x /= norm);
                }
                v
            })
            .collect()
    }

    /// `out = x W^T + b` for `n` rows.
    fn linear(&self, name: &str, rows: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
        let w = self
            .tensors
            .dense(&self.name(&format!("{name}.weight")), rows, cols)
            .expect("checked at open");
        dense_matmul(&self.pool, &w, &x[..n * cols], n, &mut out[..n * rows]);
        let bias = self
            .tensors
            .vector(&self.name(&format!("{name}.bias")), rows)
            .expect("checked at open");
        for r in out[..n * rows].chunks_exact_mut(rows) {
            r.iter_mut().zip(&bias).for_each(|(o, &b)| *o += b);
        }
    }
}
