//! The facts `snug info` reports about a model file: architecture, size,
//! tensor types, head geometry, tokenizer, template, and a memory estimate.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::gguf::GgufHeader;
use crate::tokenizer::Tokenizer;

/// Bytes and tensor count of one tensor type.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct TypeUsage {
    pub tensors: usize,
    pub bytes: u64,
    pub elements: u64,
}

/// Attention geometry read from `<arch>.*` keys.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Geometry {
    pub layers: Option<u64>,
    pub embedding: Option<u64>,
    pub feed_forward: Option<u64>,
    pub heads: Option<u64>,
    pub kv_heads: Option<u64>,
    pub key_length: Option<u64>,
    pub value_length: Option<u64>,
    pub context_length: Option<u64>,
    pub rope_base: Option<f64>,
    pub sliding_window: Option<u64>,
    /// Layers that attend only within the sliding window (the rest are
    /// global). The split is fixed by the architecture, not stored in files.
    pub sliding_window_layers: Option<u64>,
    pub rms_eps: Option<f64>,
    /// A mixture of experts: experts per layer, used per token, and an
    /// expert's feed-forward width.
    pub experts: Option<u64>,
    pub experts_used: Option<u64>,
    pub expert_feed_forward: Option<u64>,
}

/// Tokenizer facts.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TokenizerFacts {
    pub kind: String,
    pub pre: Option<String>,
    pub vocab_size: usize,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    /// Set when the tokenizer cannot be built; the reason.
    pub error: Option<String>,
}

/// Everything `snug info` prints.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ModelInfo {
    pub architecture: Option<String>,
    pub name: Option<String>,
    pub gguf_version: u32,
    pub file_bytes: u64,
    pub parameters: u64,
    pub tensor_count: usize,
    pub tensor_types: BTreeMap<String, TypeUsage>,
    pub geometry: Geometry,
    pub tokenizer: TokenizerFacts,
    pub chat_template: bool,
    /// Bytes of tensor data (what the weights occupy once mapped).
    pub weights_bytes: u64,
    /// KV cache bytes per 1,024 tokens with f16 keys and values, all layers
    /// holding every token.
    pub kv_f16_bytes_per_1k_tokens: Option<u64>,
    /// KV cache bytes for a 1,024-token context when sliding-window layers
    /// keep only their window; equal to the above without a window.
    pub kv_f16_bytes_at_1k_context: Option<u64>,
}

/// How many of `layers` attend within a sliding window, for architectures
/// that have one (Gemma 3: every sixth layer is global).
fn sliding_window_layers(arch: Option<&str>, layers: Option<u64>, window: Option<u64>) -> Option<u64> {
    match (arch, layers, window) {
        (Some("gemma3"), Some(l), Some(_)) => Some(l - l / 6),
        _ => None,
    }
}

impl ModelInfo {
    /// Collects the facts from a parsed header. `file_bytes` is the file size.
    pub fn from_header(h: &GgufHeader, file_bytes: u64) -> ModelInfo {
        let arch = h.architecture().map(str::to_string);
        let key = |k: &str| arch.as_ref().map(|a| format!("{a}.{k}")).unwrap_or_default();
        let u = |k: &str| h.get_u64(&key(k));
        let f = |k: &str| h.get_f64(&key(k));
        let heads = u("attention.head_count");
        let embedding = u("embedding_length");
        let head_dim = match (heads, embedding) {
            (Some(hd), Some(e)) if hd > 0 => Some(e / hd),
            _ => None,
        };
        let geometry = Geometry {
            layers: u("block_count"),
            embedding,
            feed_forward: u("feed_forward_length"),
            heads,
            kv_heads: u("attention.head_count_kv").or(heads),
            key_length: u("attention.key_length").or(head_dim),
            value_length: u("attention.value_length").or(head_dim),
            context_length: u("context_length"),
            rope_base: f("rope.freq_base"),
            sliding_window: u("attention.sliding_window"),
            sliding_window_layers: sliding_window_layers(
                arch.as_deref(),
                u("block_count"),
                u("attention.sliding_window"),
            ),
            rms_eps: f("attention.layer_norm_rms_epsilon"),
            experts: u("expert_count"),
            experts_used: u("expert_used_count"),
            expert_feed_forward: u("expert_feed_forward_length"),
        };
        let mut tensor_types: BTreeMap<String, TypeUsage> = BTreeMap::new();
        let mut parameters = 0u64;
        let mut weights_bytes = 0u64;
        for t in &h.tensors {
            let e = tensor_types.entry(t.ty.name().to_string()).or_insert(TypeUsage {
                tensors: 0,
                bytes: 0,
                elements: 0,
            });
            e.tensors += 1;
            e.bytes += t.size;
            e.elements += t.elements;
            parameters += t.elements;
            weights_bytes += t.size;
        }
        let kv = match (
            geometry.layers,
            geometry.kv_heads,
            geometry.key_length,
            geometry.value_length,
        ) {
            (Some(l), Some(kvh), Some(k), Some(v)) => l
                .checked_mul(kvh)
                .and_then(|x| x.checked_mul(k + v))
                .and_then(|x| x.checked_mul(2 * 1024)),
            _ => None,
        };
        let kv_at_1k =
            kv.map(
                |full| match (geometry.sliding_window_layers, geometry.sliding_window, geometry.layers) {
                    (Some(swa), Some(w), Some(l)) if l > 0 && w < 1024 => {
                        let per_layer = full / l;
                        (l - swa) * per_layer + swa * per_layer * w / 1024
                    }
                    _ => full,
                },
            );
        let tokenizer = match Tokenizer::from_gguf(h) {
            Ok(t) => TokenizerFacts {
                kind: t.kind().gguf_name().to_string(),
                pre: h.get_str("tokenizer.ggml.pre").map(str::to_string),
                vocab_size: t.vocab_size(),
                bos: t.bos,
                eos: t.eos,
                add_bos: t.add_bos,
                error: None,
            },
            Err(e) => TokenizerFacts {
                kind: h.get_str("tokenizer.ggml.model").unwrap_or("none").to_string(),
                pre: h.get_str("tokenizer.ggml.pre").map(str::to_string),
                vocab_size: h.get_array("tokenizer.ggml.tokens").map_or(0, |a| a.len()),
                bos: None,
                eos: None,
                add_bos: false,
                error: Some(e.to_string()),
            },
        };
        ModelInfo {
            architecture: arch.clone(),
            name: h.get_str("general.name").map(str::to_string),
            gguf_version: h.version,
            file_bytes,
            parameters,
            tensor_count: h.tensors.len(),
            tensor_types,
            geometry,
            tokenizer,
            chat_template: h.get_str("tokenizer.chat_template").is_some(),
            weights_bytes,
            kv_f16_bytes_per_1k_tokens: kv,
            kv_f16_bytes_at_1k_context: kv_at_1k,
        }
    }
}
