//! Writes a GGUF model of a named shape with random weights: quantized
//! blocks of random codes with sane scales, norms of ones, and a real
//! model's tokenizer (its `tokenizer.*` metadata copied). For measuring
//! speed at sizes no real file here has; the values do not matter to
//! speed, and the output is gibberish.
//!
//!     synth_gguf --like REAL.gguf --shape 1.5b|7b|NAME=dim,layers,heads,kv_heads,ff[,head_dim]
//!         [--arch llama|qwen2|gemma3] [--window N] [--type q4_k] [--head-type q6_k] [--out FILE]
//!     synth_gguf --like REAL.gguf --tokenizer-only --out FILE
//!
//! `--tokenizer-only` writes the tokenizer's metadata and no tensors: a
//! few megabytes to carry where the real model cannot travel, to be the
//! `--like` of files made there.
//!
//! Shapes: `1.5b` is Qwen2.5-1.5B's (1536, 28 layers, 12/2 heads, ff
//! 8960), `7b` Llama-2-7B's (4096, 32, 32/32, 11008). The architecture is
//! `llama` unless `--arch` names another: `qwen2` adds query, key and
//! value biases (small random values); `gemma3` adds the query and key
//! norms, the post-attention and post-feed-forward norms, a tied output
//! head and a sliding window of `--window` positions (512 unless given)
//! on five layers of six. The vocabulary is the `--like` model's.
//!
//! (An example: it unwraps and exits on failure.)
#![allow(clippy::unwrap_used)]

use std::io::{BufWriter, Write};

use snug_kernels::GgmlType;
use snug_model::gguf::{Array, GgufFile, Value};

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).map(|i| args[i + 1].as_str())
}

fn parse_type(s: &str) -> GgmlType {
    GgmlType::ALL
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(s))
        .unwrap()
}

struct W<T: Write>(T);

impl<T: Write> W<T> {
    fn u32(&mut self, v: u32) {
        self.0.write_all(&v.to_le_bytes()).unwrap();
    }
    fn u64(&mut self, v: u64) {
        self.0.write_all(&v.to_le_bytes()).unwrap();
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.write_all(s.as_bytes()).unwrap();
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.write_all(b).unwrap();
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

/// Random blocks of `ty` for `n` elements, with every f16 scale set to a
/// small positive value (and f32/f16 elements small).
fn random_tensor(ty: GgmlType, n: usize, seed: &mut u64) -> Vec<u8> {
    let bytes = ty.bytes_for(n as u64).unwrap() as usize;
    let mut out: Vec<u8> = (0..bytes)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (*seed >> 33) as u8
        })
        .collect();
    let scale = half::f16::from_f32(0.002).to_bits().to_le_bytes();
    let f16s: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_mut(4) {
                let v = (c[0] as f32 - 128.0) * 1e-4;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in out.chunks_mut(2) {
                let v = half::f16::from_f32((c[0] as f32 - 128.0) * 1e-4);
                c.copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        _ => {
            for b in out.chunks_mut(ty.type_size()) {
                for &o in f16s {
                    b[o..o + 2].copy_from_slice(&scale);
                }
            }
        }
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let like = GgufFile::open(std::path::Path::new(arg(&args, "--like").unwrap())).unwrap();
    let shape = arg(&args, "--shape").unwrap_or("1.5b");
    let (dim, layers, heads, kv_heads, ff, hd) = match shape {
        "1.5b" => (1536, 28, 12, 2, 8960, 128),
        "7b" => (4096, 32, 32, 32, 11008, 128),
        s => {
            let v: Vec<usize> = s
                .split('=')
                .nth(1)
                .unwrap()
                .split(',')
                .map(|x| x.parse().unwrap())
                .collect();
            (v[0], v[1], v[2], v[3], v[4], v.get(5).copied().unwrap_or(v[0] / v[2]))
        }
    };
    let arch = arg(&args, "--arch").unwrap_or("llama");
    assert!(
        matches!(arch, "llama" | "qwen2" | "gemma3"),
        "--arch: llama, qwen2 or gemma3"
    );
    let ty = parse_type(arg(&args, "--type").unwrap_or("q4_K"));
    let head_ty = parse_type(arg(&args, "--head-type").unwrap_or("q6_K"));
    let out = arg(&args, "--out").map_or(format!("synth-{shape}.gguf"), str::to_string);
    let vocab = like.header.get_array("tokenizer.ggml.tokens").map(|a| a.len()).unwrap();
    let k = |name: &str| format!("{arch}.{name}");
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String(format!("synthetic {arch} {shape}")),
        ),
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
        let window: u32 = arg(&args, "--window").map_or(512, |w| w.parse().unwrap());
        meta.push((k("attention.sliding_window"), Value::U32(window)));
    }
    for (k, v) in &like.header.metadata {
        if k.starts_with("tokenizer.") {
            meta.push((k.clone(), v.clone()));
        }
    }
    // (name, dims innermost first, type)
    let mut tensors: Vec<(String, Vec<u64>, GgmlType)> =
        vec![("token_embd.weight".into(), vec![dim as u64, vocab as u64], ty)];
    if args.iter().any(|a| a == "--tokenizer-only") {
        meta.retain(|(k, _)| k.starts_with("tokenizer.") || k == "general.alignment");
        tensors.clear();
    }
    for l in 0..if tensors.is_empty() { 0 } else { layers } {
        let m = |n: &str, cols: usize, rows: usize| (format!("blk.{l}.{n}.weight"), vec![cols as u64, rows as u64], ty);
        tensors.push((format!("blk.{l}.attn_norm.weight"), vec![dim as u64], GgmlType::F32));
        let v = |n: &str, len: usize| (format!("blk.{l}.{n}"), vec![len as u64], GgmlType::F32);
        tensors.push(m("attn_q", dim, heads * hd));
        tensors.push(m("attn_k", dim, kv_heads * hd));
        tensors.push(m("attn_v", dim, kv_heads * hd));
        if arch == "qwen2" {
            tensors.push(v("attn_q.bias", heads * hd));
            tensors.push(v("attn_k.bias", kv_heads * hd));
            tensors.push(v("attn_v.bias", kv_heads * hd));
        }
        if arch == "gemma3" {
            tensors.push(v("attn_q_norm.weight", hd));
            tensors.push(v("attn_k_norm.weight", hd));
            tensors.push(v("post_attention_norm.weight", dim));
            tensors.push(v("post_ffw_norm.weight", dim));
        }
        tensors.push(m("attn_output", heads * hd, dim));
        tensors.push((format!("blk.{l}.ffn_norm.weight"), vec![dim as u64], GgmlType::F32));
        tensors.push(m("ffn_gate", dim, ff));
        tensors.push(m("ffn_up", dim, ff));
        tensors.push(m("ffn_down", ff, dim));
    }
    if !tensors.is_empty() {
        tensors.push(("output_norm.weight".into(), vec![dim as u64], GgmlType::F32));
        if arch != "gemma3" {
            tensors.push(("output.weight".into(), vec![dim as u64, vocab as u64], head_ty));
        }
    }

    let f = std::fs::File::create(&out).unwrap();
    let mut w = W(BufWriter::with_capacity(1 << 22, f));
    w.bytes(b"GGUF");
    w.u32(3);
    w.u64(tensors.len() as u64);
    w.u64(meta.len() as u64);
    let mut at = 0u64;
    for (k, v) in &meta {
        w.str(k);
        w.u32(value_type(v));
        write_value(&mut w, v);
    }
    let mut offsets = Vec::new();
    for (name, dims, t) in &tensors {
        w.str(name);
        w.u32(dims.len() as u32);
        for &d in dims {
            w.u64(d);
        }
        w.u32(t.id());
        w.u64(at);
        offsets.push(at);
        let n: u64 = dims.iter().product();
        at += t.bytes_for(n).unwrap().div_ceil(32) * 32;
    }
    // The data section starts at the next multiple of 32.
    w.0.flush().unwrap();
    let pos = w.0.get_ref().metadata().unwrap().len();
    w.bytes(&vec![0u8; (pos.div_ceil(32) * 32 - pos) as usize]);
    let mut seed = 0x5eed_u64;
    let mut total = 0u64;
    for (name, dims, t) in &tensors {
        let n: u64 = dims.iter().product();
        let data = if name.ends_with("norm.weight") {
            (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect()
        } else {
            random_tensor(*t, n as usize, &mut seed)
        };
        w.bytes(&data);
        let pad = data.len().div_ceil(32) * 32 - data.len();
        w.bytes(&vec![0u8; pad]);
        total += data.len() as u64;
    }
    w.0.flush().unwrap();
    eprintln!(
        "{out}: {} tensors, {total} bytes of weights, vocabulary {vocab}",
        tensors.len()
    );
}
