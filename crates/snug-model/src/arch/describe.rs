//! Architectures as descriptions. One decoder (see `forward.rs`) runs every
//! supported architecture; what sets one apart from another is the handful
//! of facts below, so adding an architecture of the same family is adding
//! one [`Description`] to [`ARCHITECTURES`] (and its metadata keys, when
//! they differ, to `config.rs`).
//!
//! Tensors that an architecture may or may not have are found by name
//! rather than described: Q/K/V biases are used where the file has them
//! (Qwen2), and the output head is tied to the embedding table where the
//! file has no `output.weight`.

use snug_kernels::ops::RopeLayout;

/// The gate's nonlinearity in the feed-forward block (`act(gate) * up`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU, `x * sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation.
    Gelu,
}

/// Layers that attend within a sliding window: all but every `period`-th.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Every `period`-th layer (the last of each group) is global.
    pub period: usize,
    /// The metadata key (after `ARCH.`) of the local layers' RoPE base,
    /// and its value where the file lacks it.
    pub local_base_key: &'static str,
    pub local_base_default: f32,
}

/// What one architecture fixes about the decoder.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Description {
    /// `general.architecture` in GGUF files, and the prefix of the
    /// architecture's metadata keys.
    pub name: &'static str,
    /// Which dimensions RoPE rotates together.
    pub rope_layout: RopeLayout,
    pub activation: Activation,
    /// RMS norms of each head's queries and keys before RoPE
    /// (`attn_q_norm`, `attn_k_norm`).
    pub qk_norms: bool,
    /// RMS norms of each block's output before the residual add
    /// (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    /// Embedding rows multiplied by `sqrt(dim)`.
    pub scaled_embedding: bool,
    /// Local and global layers, where the file sets a window
    /// (`attention.sliding_window`).
    pub sliding_window: Option<SlidingWindow>,
    /// llama.cpp's graph for this architecture scales queries before
    /// attention (which then rounds them to f16) rather than scores in it;
    /// a backend that follows llama.cpp's arithmetic does the same.
    pub llama_cpp_prescales_queries: bool,
    /// Every `n`-th layer (the last of each group) attends without RoPE
    /// (SmolLM3's NoPE layers).
    pub no_rope_period: Option<usize>,
    /// Granite's multipliers, read from the file: of the embedding rows
    /// (`embedding_scale`), of each block's output before the residual sum
    /// (`residual_scale`), of attention scores (`attention.scale`) and the
    /// logits' divisor (`logit_scale`).
    pub multipliers: bool,
}

/// Llama and relatives (SmolLM2): adjacent-pair RoPE, SiLU gate.
pub const LLAMA: Description = Description {
    name: "llama",
    rope_layout: RopeLayout::Adjacent,
    activation: Activation::Silu,
    qk_norms: false,
    post_norms: false,
    scaled_embedding: false,
    sliding_window: None,
    llama_cpp_prescales_queries: false,
    no_rope_period: None,
    multipliers: false,
};

/// Qwen2: as Llama with half-split RoPE (and Q/K/V biases, an untied
/// head, found in the file).
pub const QWEN2: Description = Description {
    name: "qwen2",
    rope_layout: RopeLayout::Halves,
    ..LLAMA
};

/// Qwen3: as Qwen2 without biases, with RMS norms of each head's queries
/// and keys before RoPE (and a head dimension of its own,
/// `attention.key_length`, which may differ from width / heads).
pub const QWEN3: Description = Description {
    name: "qwen3",
    rope_layout: RopeLayout::Halves,
    qk_norms: true,
    ..LLAMA
};

/// SmolLM3: as Llama, with every fourth layer attending without RoPE.
pub const SMOLLM3: Description = Description {
    name: "smollm3",
    no_rope_period: Some(4),
    ..LLAMA
};

/// Granite (3.x dense): as Llama, with four multipliers from the file.
pub const GRANITE: Description = Description {
    name: "granite",
    multipliers: true,
    ..LLAMA
};

/// Gemma 3: scaled embedding, q/k norms, post-block norms, GELU gate, five
/// sliding-window layers to one global.
pub const GEMMA3: Description = Description {
    name: "gemma3",
    rope_layout: RopeLayout::Halves,
    activation: Activation::Gelu,
    qk_norms: true,
    post_norms: true,
    scaled_embedding: true,
    sliding_window: Some(SlidingWindow {
        period: 6,
        local_base_key: "rope.freq_base_swa",
        local_base_default: 10000.0,
    }),
    llama_cpp_prescales_queries: true,
    no_rope_period: None,
    multipliers: false,
};

/// Phi-3 and Phi-4: as Llama with half-split RoPE, and queries scaled
/// before attention in llama.cpp's graph (its files fuse the query, key
/// and value matrices into `attn_qkv` and the gate and up matrices into
/// one `ffn_up` of twice the width, found in the file). Phi-3's sliding
/// window is ignored, as llama.cpp ignores it.
pub const PHI3: Description = Description {
    name: "phi3",
    rope_layout: RopeLayout::Halves,
    llama_cpp_prescales_queries: true,
    ..LLAMA
};

/// Qwen3's mixture-of-experts models: Qwen3's attention, every layer's
/// feed-forward block a mixture of experts (`expert_count`,
/// `expert_used_count`, `ffn_gate_inp` and the `ffn_*_exps` tensors, found
/// in the file; a `llama` file with them is Mixtral-style).
pub const QWEN3MOE: Description = Description {
    name: "qwen3moe",
    ..QWEN3
};

/// Every supported architecture.
pub const ARCHITECTURES: &[&Description] = &[&LLAMA, &QWEN2, &QWEN3, &QWEN3MOE, &GEMMA3, &SMOLLM3, &GRANITE, &PHI3];

/// The description named `name`, if snug supports it.
pub fn describe(name: &str) -> Option<&'static Description> {
    ARCHITECTURES.iter().copied().find(|d| d.name == name)
}

/// The supported architectures' names, comma-separated.
pub fn supported() -> String {
    ARCHITECTURES.iter().map(|d| d.name).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_description_is_found_by_its_name_and_names_are_unique() {
        for d in ARCHITECTURES {
            assert_eq!(describe(d.name), Some(*d));
        }
        let mut names: Vec<_> = ARCHITECTURES.iter().map(|d| d.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ARCHITECTURES.len());
        assert_eq!(describe("mamba"), None);
    }
}
