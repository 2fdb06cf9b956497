//! Hyperparameters of a decoder, read from GGUF metadata under its
//! architecture's [`Description`].

use snug_kernels::ops::{Rope, RopeLayout};

use crate::gguf::GgufHeader;

use super::describe::{self, Description};
use super::ModelError;

/// Everything the forward pass needs to know about the shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// What the architecture fixes.
    pub arch: &'static Description,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ff: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_layout: RopeLayout,
    pub rope_dim: usize,
    /// RoPE base of global layers.
    pub rope_base: f32,
    /// RoPE base of sliding-window layers.
    pub rope_base_local: f32,
    /// Global layers' angle multiplier: `1 / rope.scaling.factor` under
    /// linear scaling, else 1.
    pub rope_freq_scale: f32,
    /// Global layers' per-pair frequency divisors: the `rope_freqs` tensor
    /// (Llama 3.1's scaling), set when the model's tensors are bound.
    pub rope_factors: Option<Vec<f32>>,
    /// Sliding window in positions (a key at `p` is seen from `q` when
    /// `q - p < window`), if any.
    pub sliding_window: Option<usize>,
    /// Every `swa_period`-th layer (the last of each group) is global.
    pub swa_period: usize,
    /// Multiplier of the embedding rows.
    pub embed_scale: f32,
    /// Multiplier of attention scores.
    pub attn_scale: f32,
    /// Multiplier of each block's output before the residual sum.
    pub residual_scale: f32,
    /// Divisor of the logits (they are multiplied by its reciprocal).
    pub logit_scale: f32,
    /// Experts of a mixture-of-experts block (0: dense blocks), experts
    /// each row takes, and an expert's feed-forward width.
    pub experts: usize,
    pub experts_used: usize,
    pub ff_expert: usize,
}

impl Config {
    pub fn from_gguf(h: &GgufHeader) -> Result<Config, ModelError> {
        let arch_name = h
            .architecture()
            .ok_or(ModelError::Missing("general.architecture".into()))?;
        let arch = describe::describe(arch_name)
            .ok_or_else(|| ModelError::UnsupportedArch(arch_name.to_string(), describe::supported()))?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<usize, ModelError> {
            h.get_u64(&key(k))
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::Missing(key(k)))
        };
        let dim = req("embedding_length")?;
        let layers = req("block_count")?;
        let heads = req("attention.head_count")?;
        let kv_heads = h.get_u64(&key("attention.head_count_kv")).map_or(heads, |v| v as usize);
        let ff = req("feed_forward_length")?;
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || dim == 0 || layers == 0 {
            return Err(ModelError::Bad(format!(
                "{heads} heads and {kv_heads} KV heads over embedding {dim} do not fit"
            )));
        }
        let head_dim = h
            .get_u64(&key("attention.key_length"))
            .map_or(dim / heads, |v| v as usize);
        let value_dim = h
            .get_u64(&key("attention.value_length"))
            .map_or(head_dim, |v| v as usize);
        if value_dim != head_dim || !head_dim.is_multiple_of(16) || head_dim > 1024 {
            return Err(ModelError::Bad(format!(
                "head dim {head_dim} (values {value_dim}) is not supported"
            )));
        }
        let vocab = h
            .get_array("tokenizer.ggml.tokens")
            .map(|a| a.len())
            .ok_or(ModelError::Missing("tokenizer.ggml.tokens".into()))?;
        let context_length = h.get_u64(&key("context_length")).map_or(2048, |v| v as usize);
        let rms_eps = h.get_f64(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6) as f32;
        let rope_base = h.get_f64(&key("rope.freq_base")).unwrap_or(10000.0) as f32;
        let rope_dim = h.get_u64(&key("rope.dimension_count")).map_or(head_dim, |v| v as usize);
        // Position interpolation by a constant factor is linear scaling;
        // YaRN and the others change angles in ways not done here, and a
        // model run without them would answer wrongly.
        let rope_freq_scale = match h.get_str(&key("rope.scaling.type")) {
            None | Some("none") => 1.0,
            Some("linear") => match h.get_f64(&key("rope.scaling.factor")) {
                Some(f) if f > 0.0 => (1.0 / f) as f32,
                _ => 1.0,
            },
            Some(other) => {
                return Err(ModelError::Bad(format!(
                    "RoPE scaling {other:?} is not supported (none, linear, and Llama 3.1's rope_freqs are)"
                )))
            }
        };
        let (sliding_window, swa_period, rope_base_local) = match arch.sliding_window {
            None => (None, 1, rope_base),
            Some(sw) => (
                h.get_u64(&key("attention.sliding_window"))
                    .map(|v| v as usize)
                    .filter(|&w| w > 0),
                sw.period,
                h.get_f64(&key(sw.local_base_key))
                    .map_or(sw.local_base_default, |v| v as f32),
            ),
        };
        let rope_layout = arch.rope_layout;
        let mut embed_scale = if arch.scaled_embedding {
            (dim as f32).sqrt()
        } else {
            1.0
        };
        let mut attn_scale = 1.0 / (head_dim as f32).sqrt();
        let (mut residual_scale, mut logit_scale) = (1.0, 1.0);
        if arch.multipliers {
            // Each where the file sets it (and not to zero, which llama.cpp
            // reads as unset).
            let set = |k: &str| h.get_f64(&key(k)).filter(|&v| v != 0.0).map(|v| v as f32);
            embed_scale = set("embedding_scale").unwrap_or(embed_scale);
            attn_scale = set("attention.scale").unwrap_or(attn_scale);
            residual_scale = set("residual_scale").unwrap_or(1.0);
            logit_scale = set("logit_scale").unwrap_or(1.0);
        }
        let experts = h.get_u64(&key("expert_count")).map_or(0, |v| v as usize);
        let experts_used = h.get_u64(&key("expert_used_count")).map_or(0, |v| v as usize);
        if experts > 0 {
            if experts_used == 0 || experts_used > experts || experts > 512 {
                return Err(ModelError::Bad(format!(
                    "{experts_used} experts used of {experts} is not supported"
                )));
            }
            // Softmax over the experts (1) is the gating snug runs;
            // sigmoid gating (DeepSeek's) differs.
            if let Some(g) = h.get_u64(&key("expert_gating_func")).filter(|&g| g != 1) {
                return Err(ModelError::Bad(format!(
                    "expert gating function {g} is not supported (softmax is)"
                )));
            }
            if h.get_u64(&key("expert_shared_count")).is_some_and(|n| n > 0) {
                return Err(ModelError::Bad("shared experts are not supported".into()));
            }
        }
        let ff_expert = if experts > 0 {
            h.get_u64(&key("expert_feed_forward_length")).map_or(ff, |v| v as usize)
        } else {
            0
        };
        Ok(Config {
            arch,
            dim,
            layers,
            heads,
            kv_heads,
            head_dim,
            ff,
            vocab,
            context_length,
            rms_eps,
            rope_layout,
            rope_dim,
            rope_base,
            rope_base_local,
            rope_freq_scale,
            rope_factors: None,
            sliding_window,
            swa_period,
            embed_scale,
            attn_scale,
            residual_scale,
            logit_scale,
            experts,
            experts_used,
            ff_expert,
        })
    }

    /// The rotary embedding of global layers (`local: false`, with the
    /// model's scaling) or of sliding-window layers (their own base,
    /// unscaled, as llama.cpp runs them).
    pub fn rope(&self, local: bool) -> Rope {
        let rope = Rope::new(
            self.rope_layout,
            self.rope_dim,
            if local { self.rope_base_local } else { self.rope_base },
        );
        if local {
            rope
        } else {
            rope.scaled(self.rope_freq_scale, self.rope_factors.as_deref())
        }
    }

    /// Whether layer `l` rotates its queries and keys (all but an
    /// architecture's NoPE layers).
    pub fn uses_rope(&self, layer: usize) -> bool {
        self.arch.no_rope_period.is_none_or(|p| !(layer + 1).is_multiple_of(p))
    }

    /// Whether layer `l` attends within the sliding window.
    pub fn is_local(&self, layer: usize) -> bool {
        self.sliding_window.is_some() && !(layer + 1).is_multiple_of(self.swa_period)
    }

    /// The first key position query position `pos` sees in layer `l`.
    pub fn window_start(&self, layer: usize, pos: usize) -> usize {
        match self.sliding_window {
            Some(w) if self.is_local(layer) => (pos + 1).saturating_sub(w),
            _ => 0,
        }
    }
}
