//! The checkpoint's configuration: the agent's (`rl_agent_config.json`)
//! and the encoder's (`encoder/config.json`).

use super::*;

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

pub(crate) fn read_json(path: &Path) -> Result<Value, LayaError> {
    let text = snug_core::durable::read_regular_string(path).map_err(io_err(path))?;
    serde_json::from_str(&text).map_err(|e| format_err(path, format!("not valid JSON: {e}")))
}

pub(crate) fn get_usize(v: &Value, key: &str, default: Option<usize>, path: &Path) -> Result<usize, LayaError> {
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
