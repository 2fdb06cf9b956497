//! GGUF models of a named shape with random weights, for measuring speed
//! at sizes no real file here has and for testing architectures no real
//! file here has: quantized blocks of random codes with sane scales, norms
//! near one, and a real model's tokenizer (its `tokenizer.*` metadata
//! copied). Deterministic: the same spec writes the same bytes. The
//! output is gibberish; the arithmetic is a real model's.
//!
//! `synth_gguf` (an example of this crate) is the command-line face.

use std::io::{BufWriter, Write};
use std::path::Path;

use snug_kernels::GgmlType;

use crate::gguf::{Array, GgufHeader, Value};

/// A decoder's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ff: usize,
    pub head_dim: usize,
}

impl Shape {
    /// Qwen2.5-1.5B's shape.
    pub const QWEN_1_5B: Shape = Shape {
        dim: 1536,
        layers: 28,
        heads: 12,
        kv_heads: 2,
        ff: 8960,
        head_dim: 128,
    };
    /// Llama-2-7B's shape.
    pub const LLAMA_7B: Shape = Shape {
        dim: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 32,
        ff: 11008,
        head_dim: 128,
    };
}

/// What to write.
#[derive(Clone, Debug)]
pub struct Spec {
    /// `llama`, `qwen2` (adds Q/K/V biases), `qwen3` (adds per-head Q/K
    /// norms), `gemma3` (Q/K norms, post-block norms, a tied head and a
    /// sliding window on five layers of six), `smollm3` (Llama's tensors;
    /// every fourth layer without RoPE), `granite` (Llama's tensors;
    /// Granite 3's four multipliers in the metadata), `phi3` (fused
    /// query/key/value and gate/up matrices) or `qwen3moe` (Qwen3's
    /// attention, a mixture of experts in every layer: 8 experts of
    /// `ff / 4`, 2 used, unless `extra` sets `ARCH.expert_count`,
    /// `ARCH.expert_used_count`, `ARCH.expert_feed_forward_length`; any
    /// architecture given an `expert_count` there gets experts).
    pub arch: String,
    pub shape: Shape,
    /// The matrices' type, and the output head's (untied architectures).
    pub ty: GgmlType,
    pub head_ty: GgmlType,
    /// Gemma 3's sliding window.
    pub window: u32,
    /// Every quantized block's scale (0.002 gives activations of a
    /// real model's size; larger ones sharper logits).
    pub scale: f32,
    /// `general.name`.
    pub name: String,
    /// Llama 3.1's RoPE scaling: a frequency divisor per rotated pair,
    /// written as the `rope_freqs` tensor (the values given are repeated
    /// over the pairs). Not drawn from the random stream, so the other
    /// tensors keep their bytes.
    pub rope_freqs: Option<Vec<f32>>,
    /// Linear RoPE scaling by this factor (`rope.scaling.type = linear`).
    pub rope_linear: Option<f32>,
    /// More metadata, written after the rest (for files that ask for what
    /// snug does not run).
    pub extra: Vec<(String, Value)>,
    /// The tokenizer's metadata alone, no tensors: a few megabytes to
    /// carry where the real model cannot travel, the `like` of files
    /// written there.
    pub tokenizer_only: bool,
}

/// The architectures [`write`] knows.
pub const ARCHS: [&str; 8] = [
    "llama", "qwen2", "qwen3", "gemma3", "smollm3", "granite", "phi3", "qwen3moe",
];

/// Writes the model `spec` describes to `out`, with `like`'s tokenizer.
/// Returns the bytes of weights written.
pub fn write(like: &GgufHeader, spec: &Spec, out: &Path) -> std::io::Result<u64> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    let arch = spec.arch.as_str();
    if !ARCHS.contains(&arch) {
        return Err(bad(format!("architecture {arch}: one of {}", ARCHS.join(", "))));
    }
    let Shape {
        dim,
        layers,
        heads,
        kv_heads,
        ff,
        head_dim: hd,
    } = spec.shape;
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(bad(format!("{heads} heads over {kv_heads} KV heads")));
    }
    for (what, cols, t) in [
        ("width", dim, spec.ty),
        ("feed-forward width", ff, spec.ty),
        ("head width", heads * hd, spec.ty),
    ] {
        if !cols.is_multiple_of(t.block_size()) {
            return Err(bad(format!(
                "{what} {cols} is not a multiple of {t}'s block of {}",
                t.block_size()
            )));
        }
    }
    if !dim.is_multiple_of(spec.head_ty.block_size()) {
        return Err(bad(format!(
            "width {dim} is not a multiple of {}'s block",
            spec.head_ty
        )));
    }
    let vocab = like
        .get_array("tokenizer.ggml.tokens")
        .map(|a| a.len())
        .ok_or_else(|| bad("the `like` file has no tokenizer".into()))?;
    let k = |name: &str| format!("{arch}.{name}");
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(spec.name.clone())),
        ("general.alignment".into(), Value::U32(32)),
        (k("block_count"), Value::U32(layers as u32)),
        (k("context_length"), Value::U32(8192)),
        (k("embedding_length"), Value::U32(dim as u32)),
        (k("feed_forward_length"), Value::U32(ff as u32)),
        (k("attention.head_count"), Value::U32(heads as u32)),
        (k("attention.head_count_kv"), Value::U32(kv_heads as u32)),
        (k("attention.key_length"), Value::U32(hd as u32)),
        (k("attention.value_length"), Value::U32(hd as u32)),
        (k("rope.dimension_count"), Value::U32(hd as u32)),
        (
            k("rope.freq_base"),
            Value::F32(if arch == "llama" { 10000.0 } else { 1_000_000.0 }),
        ),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (k("vocab_size"), Value::U32(vocab as u32)),
    ];
    if arch == "gemma3" {
        meta.push((k("attention.sliding_window"), Value::U32(spec.window)));
    }
    if arch == "granite" {
        // Granite 3.x's values (its 2B model's).
        meta.push((k("embedding_scale"), Value::F32(12.0)));
        meta.push((k("residual_scale"), Value::F32(0.22)));
        meta.push((k("attention.scale"), Value::F32(0.015625)));
        meta.push((k("logit_scale"), Value::F32(8.0)));
    }
    // Experts: from `extra`, or Qwen3-MoE's defaults.
    let extra_u = |name: &str| {
        spec.extra
            .iter()
            .find(|(key, _)| *key == k(name))
            .and_then(|(_, v)| match v {
                Value::U32(x) => Some(*x as usize),
                Value::U64(x) => Some(*x as usize),
                _ => None,
            })
    };
    let experts = extra_u("expert_count").unwrap_or(if arch == "qwen3moe" { 8 } else { 0 });
    let (used, ff_expert) = (
        extra_u("expert_used_count").unwrap_or(2),
        // (llama.cpp reads a `llama` file's expert width from
        // `feed_forward_length`.)
        extra_u("expert_feed_forward_length").unwrap_or(if arch == "qwen3moe" { ff / 4 } else { ff }),
    );
    if experts > 0 {
        for (name, v) in [
            ("expert_count", experts),
            ("expert_used_count", used),
            ("expert_feed_forward_length", ff_expert),
        ] {
            if extra_u(name).is_none() && (arch == "qwen3moe" || name != "expert_feed_forward_length") {
                meta.push((k(name), Value::U32(v as u32)));
            }
        }
    }
    if let Some(f) = spec.rope_linear {
        meta.push((k("rope.scaling.type"), Value::String("linear".into())));
        meta.push((k("rope.scaling.factor"), Value::F32(f)));
    }
    let rope_freqs: Option<Vec<f32>> = match &spec.rope_freqs {
        Some(f) if f.is_empty() => return Err(bad("rope_freqs: no values".into())),
        Some(f) => Some((0..hd / 2).map(|i| f[i % f.len()]).collect()),
        None => None,
    };
    meta.extend(spec.extra.iter().cloned());
    for (key, v) in &like.metadata {
        if key.starts_with("tokenizer.") {
            meta.push((key.clone(), v.clone()));
        }
    }
    // (name, dims innermost first, type)
    let mut tensors: Vec<(String, Vec<u64>, GgmlType)> = Vec::new();
    if spec.tokenizer_only {
        meta.retain(|(key, _)| key.starts_with("tokenizer.") || key == "general.alignment");
    } else {
        tensors.push(("token_embd.weight".into(), vec![dim as u64, vocab as u64], spec.ty));
        if rope_freqs.is_some() {
            tensors.push(("rope_freqs.weight".into(), vec![(hd / 2) as u64], GgmlType::F32));
        }
        for l in 0..layers {
            let m = |n: &str, cols: usize, rows: usize| {
                (format!("blk.{l}.{n}.weight"), vec![cols as u64, rows as u64], spec.ty)
            };
            let v = |n: &str, len: usize| (format!("blk.{l}.{n}"), vec![len as u64], GgmlType::F32);
            tensors.push(v("attn_norm.weight", dim));
            if arch == "phi3" {
                // Phi-3's fused matrices.
                tensors.push(m("attn_qkv", dim, (heads + 2 * kv_heads) * hd));
            } else {
                tensors.push(m("attn_q", dim, heads * hd));
                tensors.push(m("attn_k", dim, kv_heads * hd));
                tensors.push(m("attn_v", dim, kv_heads * hd));
            }
            if arch == "qwen2" {
                tensors.push(v("attn_q.bias", heads * hd));
                tensors.push(v("attn_k.bias", kv_heads * hd));
                tensors.push(v("attn_v.bias", kv_heads * hd));
            }
            if arch == "gemma3" || arch == "qwen3" || arch == "qwen3moe" {
                tensors.push(v("attn_q_norm.weight", hd));
                tensors.push(v("attn_k_norm.weight", hd));
            }
            if arch == "gemma3" {
                tensors.push(v("post_attention_norm.weight", dim));
                tensors.push(v("post_ffw_norm.weight", dim));
            }
            tensors.push(m("attn_output", heads * hd, dim));
            tensors.push(v("ffn_norm.weight", dim));
            if experts > 0 {
                let e = |n: &str, cols: usize, rows: usize| {
                    let dims = vec![cols as u64, rows as u64, experts as u64];
                    (format!("blk.{l}.{n}.weight"), dims, spec.ty)
                };
                tensors.push((
                    format!("blk.{l}.ffn_gate_inp.weight"),
                    vec![dim as u64, experts as u64],
                    GgmlType::F32,
                ));
                tensors.push(e("ffn_gate_exps", dim, ff_expert));
                tensors.push(e("ffn_up_exps", dim, ff_expert));
                tensors.push(e("ffn_down_exps", ff_expert, dim));
                continue;
            } else if arch == "phi3" {
                tensors.push(m("ffn_up", dim, 2 * ff));
            } else {
                tensors.push(m("ffn_gate", dim, ff));
                tensors.push(m("ffn_up", dim, ff));
            }
            tensors.push(m("ffn_down", ff, dim));
        }
        tensors.push(("output_norm.weight".into(), vec![dim as u64], GgmlType::F32));
        if arch != "gemma3" {
            tensors.push(("output.weight".into(), vec![dim as u64, vocab as u64], spec.head_ty));
        }
    }

    let f = std::fs::File::create(out)?;
    let mut w = W(BufWriter::with_capacity(1 << 22, f), None);
    w.bytes(b"GGUF");
    w.u32(3);
    w.u64(tensors.len() as u64);
    w.u64(meta.len() as u64);
    let mut at = 0u64;
    for (key, v) in &meta {
        w.str(key);
        w.u32(value_type(v));
        write_value(&mut w, v);
    }
    for (name, dims, t) in &tensors {
        w.str(name);
        w.u32(dims.len() as u32);
        for &d in dims {
            w.u64(d);
        }
        w.u32(t.id());
        w.u64(at);
        let n: u64 = dims.iter().product();
        at += t.bytes_for(n).unwrap_or(0).div_ceil(32) * 32;
    }
    // The data section starts at the next multiple of 32.
    w.0.flush()?;
    let header = w.0.get_ref().metadata()?.len();
    w.bytes(&vec![0u8; (header.div_ceil(32) * 32 - header) as usize]);
    let mut seed = 0x5eed_u64;
    let mut total = 0u64;
    for (name, dims, t) in &tensors {
        let n: u64 = dims.iter().product();
        let data: Vec<u8> = if let (true, Some(f)) = (name == "rope_freqs.weight", &rope_freqs) {
            f.iter().flat_map(|x| x.to_le_bytes()).collect()
        } else if name.ends_with("ffn_gate_inp.weight") {
            // Router scores a few units apart, so a row's experts are
            // clear choices.
            random_tensor(GgmlType::F16, n as usize, &mut seed, 0.125)
                .chunks_exact(2)
                .flat_map(|c| {
                    half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]))
                        .to_f32()
                        .to_le_bytes()
                })
                .collect()
        } else if name.ends_with("norm.weight") {
            // Near one, not all equal: a norm's weights then matter.
            (0..n)
                .flat_map(|i| (1.0f32 + ((i * 7919) % 97) as f32 / 970.0 - 0.05).to_le_bytes())
                .collect()
        } else {
            random_tensor(*t, n as usize, &mut seed, spec.scale)
        };
        w.bytes(&data);
        let pad = data.len().div_ceil(32) * 32 - data.len();
        w.bytes(&vec![0u8; pad]);
        total += data.len() as u64;
    }
    if let Some(e) = w.1 {
        return Err(e);
    }
    w.0.flush()?;
    Ok(total)
}

struct W<T: Write>(T, Option<std::io::Error>);

/// A writer that keeps the first error and ignores writes after it
/// (checked once, at the end).
impl<T: Write> W<T> {
    fn bytes(&mut self, b: &[u8]) {
        if self.1.is_none() {
            if let Err(e) = self.0.write_all(b) {
                self.1 = Some(e);
            }
        }
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.bytes(s.as_bytes());
    }
}

/// GGUF's metadata type ids.
fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn write_value<T: Write>(w: &mut W<T>, v: &Value) {
    match v {
        Value::U8(x) => w.bytes(&[*x]),
        Value::I8(x) => w.bytes(&x.to_le_bytes()),
        Value::U16(x) => w.bytes(&x.to_le_bytes()),
        Value::I16(x) => w.bytes(&x.to_le_bytes()),
        Value::U32(x) => w.u32(*x),
        Value::I32(x) => w.bytes(&x.to_le_bytes()),
        Value::F32(x) => w.bytes(&x.to_le_bytes()),
        Value::Bool(x) => w.bytes(&[u8::from(*x)]),
        Value::String(s) => w.str(s),
        Value::U64(x) => w.u64(*x),
        Value::I64(x) => w.bytes(&x.to_le_bytes()),
        Value::F64(x) => w.bytes(&x.to_le_bytes()),
        Value::Array(a) => write_array(w, a),
    }
}

fn write_array<T: Write>(w: &mut W<T>, a: &Array) {
    macro_rules! flat {
        ($id:expr, $v:expr, $f:expr) => {{
            w.u32($id);
            w.u64($v.len() as u64);
            for x in $v {
                $f(&mut *w, x);
            }
        }};
    }
    match a {
        Array::U8(v) => flat!(0, v, |w: &mut W<T>, x: &u8| w.bytes(&[*x])),
        Array::I8(v) => flat!(1, v, |w: &mut W<T>, x: &i8| w.bytes(&x.to_le_bytes())),
        Array::U16(v) => flat!(2, v, |w: &mut W<T>, x: &u16| w.bytes(&x.to_le_bytes())),
        Array::I16(v) => flat!(3, v, |w: &mut W<T>, x: &i16| w.bytes(&x.to_le_bytes())),
        Array::U32(v) => flat!(4, v, |w: &mut W<T>, x: &u32| w.u32(*x)),
        Array::I32(v) => flat!(5, v, |w: &mut W<T>, x: &i32| w.bytes(&x.to_le_bytes())),
        Array::F32(v) => flat!(6, v, |w: &mut W<T>, x: &f32| w.bytes(&x.to_le_bytes())),
        Array::Bool(v) => flat!(7, v, |w: &mut W<T>, x: &bool| w.bytes(&[u8::from(*x)])),
        Array::String(v) => flat!(8, v, |w: &mut W<T>, x: &String| w.str(x)),
        Array::U64(v) => flat!(10, v, |w: &mut W<T>, x: &u64| w.u64(*x)),
        Array::I64(v) => flat!(11, v, |w: &mut W<T>, x: &i64| w.bytes(&x.to_le_bytes())),
        Array::F64(v) => flat!(12, v, |w: &mut W<T>, x: &f64| w.bytes(&x.to_le_bytes())),
        Array::Array(v) => flat!(9, v, |w: &mut W<T>, x: &Array| write_array(w, x)),
    }
}

/// Random blocks of `ty` for `n` elements: random codes, every scale set
/// to a small positive value (`scale`; an E8M0 exponent near it for
/// MXFP4), f32 elements small (norms are written apart). Types that subtract a minimum get
/// one that centres each block on zero (otherwise every weight has the
/// same positive mean, every output row the same offset, and one token
/// wins every step): Q4_1 and Q5_1 get `m = -d * (levels - 1) / 2`, the
/// K-quants each group's minimum code equal to its scale code and `dmin =
/// d * (levels - 1) / 2`.
fn random_tensor(ty: GgmlType, n: usize, seed: &mut u64, scale: f32) -> Vec<u8> {
    let bytes = ty.bytes_for(n as u64).unwrap_or(0) as usize;
    let mut out: Vec<u8> = (0..bytes)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (*seed >> 33) as u8
        })
        .collect();
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    let d = f16(scale);
    // (offset of d, offset of the minimum's factor, that factor / d).
    let (d_at, min_at, centre): (&[usize], Option<usize>, f32) = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS => (&[0], None, 0.0),
        GgmlType::Q4_1 => (&[0], Some(2), -7.5),
        GgmlType::Q5_1 => (&[0], Some(2), -15.5),
        GgmlType::Q4K => (&[0], Some(2), 7.5),
        GgmlType::Q5K => (&[0], Some(2), 15.5),
        GgmlType::Q2K => (&[80], Some(82), 1.5),
        GgmlType::Q3K => (&[108], None, 0.0),
        GgmlType::Q6K => (&[208], None, 0.0),
        _ => (&[], None, 0.0),
    };
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_mut(4) {
                let v = (c[0] as f32 - 128.0) * 1e-4;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        // Matrices of floats: uniform in (-4, 4) * `scale` (as large as
        // a 4-bit type's weights at that scale).
        GgmlType::F16 => {
            for c in out.chunks_mut(2) {
                let v = (u16::from_le_bytes([c[0], c[1]]) as f32 / 32768.0 - 1.0) * 4.0 * scale;
                c.copy_from_slice(&f16(v));
            }
        }
        GgmlType::BF16 => {
            for c in out.chunks_mut(2) {
                let v = (u16::from_le_bytes([c[0], c[1]]) as f32 / 32768.0 - 1.0) * 4.0 * scale;
                c.copy_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
            }
        }
        GgmlType::MXFP4 => {
            // 2^(e - 128) just below `scale`.
            let e = (scale.log2().floor() as i32 + 128).clamp(2, 254) as u8;
            for b in out.chunks_mut(ty.type_size()) {
                b[0] = e;
            }
        }
        _ => {
            for b in out.chunks_mut(ty.type_size()) {
                for &o in d_at {
                    b[o..o + 2].copy_from_slice(&d);
                }
                if let Some(m) = min_at {
                    b[m..m + 2].copy_from_slice(&f16(scale * centre));
                }
                match ty {
                    // Minimum codes equal to the scale codes.
                    GgmlType::Q4K | GgmlType::Q5K => {
                        b.copy_within(4..8, 8);
                        for v in &mut b[12..16] {
                            *v = (*v & 0x0F) | (*v << 4);
                        }
                    }
                    GgmlType::Q2K => {
                        for v in &mut b[..16] {
                            *v = (*v & 0x0F) | (*v << 4);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    out
}
