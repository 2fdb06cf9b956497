//! The encoder and its decision head: loading from a checkpoint
//! directory, and the forward over rows of questions.

use super::*;

/// A LayerNorm's parameters (no bias where the encoder has none).
#[derive(Clone, Debug)]
pub(crate) struct Norm {
    pub(crate) w: Vec<f32>,
    pub(crate) b: Option<Vec<f32>>,
    pub(crate) eps: f32,
}

impl Norm {
    pub(crate) fn load(t: &Tensors, prefix: &str, d: usize, bias: bool, eps: f32) -> Result<Norm, LayaError> {
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
    pub(crate) fn apply(&self, x: &[f32], out: &mut [f32]) {
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
    pub(super) tensors: Tensors,
    pub(super) norms: Norms,
    pub(super) pool: ThreadPool,
    pub(super) forward_tokens: usize,
}

/// Tokens a pass holds activations for, by default: about 100 MB of
/// activations for ModernBERT-large, and room for four 512-token rows.
pub const FORWARD_TOKENS: usize = 2048;

pub(super) struct Norms {
    pub(super) embed: Norm,
    pub(super) attn: Vec<Option<Norm>>,
    pub(super) mlp: Vec<Norm>,
    pub(super) last: Norm,
    pub(super) head1: Vec<Norm>,
    pub(super) head2: Vec<Norm>,
    pub(super) scorer: Norm,
    pub(super) type_emb: Vec<f32>,
    pub(super) biases: HashMap<String, Vec<f32>>,
}

pub(super) fn special_token(cfg: &Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

pub(super) fn load_tokenizer(dir: &Path) -> Result<(tokenizers::Tokenizer, Specials), LayaError> {
    let path = dir.join("tokenizer").join("tokenizer.json");
    if !path.is_file() {
        return Err(format_err(
            &path,
            "missing; a Laya checkpoint ships its tokenizer in tokenizer/",
        ));
    }
    let bytes = snug_core::durable::read_regular(&path).map_err(io_err(&path))?;
    let tok = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| format_err(&path, e.to_string()))?;
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

    pub(super) fn load_small(t: &Tensors, c: &AgentConfig, e: &EncoderConfig) -> Result<Norms, LayaError> {
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

    pub(super) fn check_matrices(&self) -> Result<(), LayaError> {
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

    pub(super) fn w(&self, name: &str, rows: usize, cols: usize) -> Dense<'_> {
        self.tensors.dense(name, rows, cols).expect("shapes checked at open")
    }

    pub(super) fn bias(&self, name: &str) -> Option<&[f32]> {
        self.norms.biases.get(name).map(Vec::as_slice)
    }

    /// `out = x W^T (+ b)` for `n` rows.
    pub(super) fn linear(&self, name: &str, rows: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
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

    pub(super) fn forward_pass(&self, rows: &[Row]) -> Vec<RowOutput> {
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
            attention(&self.pool, &big, &spans, e.heads, hd, window, &mut att);
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
            attention(&self.pool, &big, &spans, head_heads, d / head_heads, None, &mut att);
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
    pub(super) fn decide_row(&self, r: &Row, h: &[f32]) -> RowOutput {
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
}

/// Bidirectional attention within each row's span; `qkv` rows hold
/// `[q | k | v]`, each `heads x hd`. A local layer's query sees keys
/// at most `window` positions away.
pub(crate) fn attention(
    pool: &ThreadPool,
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
    pool.run(tasks.len(), &|ti| {
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

use snug_kernels::pool::SendPtr;

/// Rotary embedding tables (rotate-half layout), computed in f32 like the
/// reference: `inv_freq = 1 / theta^(2i/hd)`, angle `pos * inv_freq`.
pub(super) struct Rope {
    pub(super) half: usize,
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
}

impl Rope {
    pub(super) fn new(hd: usize, theta: f64, len: usize) -> Rope {
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
    pub(super) fn apply(&self, qkv: &mut [f32], heads: usize, hd: usize, d: usize) {
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
