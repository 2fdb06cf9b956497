//! Writes a GGUF model of a named shape with random weights
//! (`snug_model::testing::synth`): quantized blocks of random codes with
//! sane scales, norms near one, and a real model's tokenizer. For
//! measuring speed at sizes no real file here has, and for checking
//! architectures against llama.cpp; the output is gibberish.
//!
//!     synth_gguf --like REAL.gguf --shape 1.5b|7b|NAME=dim,layers,heads,kv_heads,ff[,head_dim]
//!         [--arch llama|qwen2|qwen3|qwen3moe|gemma3|smollm3|granite|phi3] [--window N] [--type q4_k] [--head-type q6_k]
//!         [--scale 0.002] [--name NAME] [--rope-freqs F,F,...] [--rope-linear F]
//!         [--experts COUNT,USED,FF] [--out FILE]
//!     synth_gguf --like REAL.gguf --tokenizer-only --out FILE
//!
//! `--tokenizer-only` writes the tokenizer's metadata and no tensors: a
//! few megabytes to carry where the real model cannot travel, to be the
//! `--like` of files made there.
//!
//! Shapes: `1.5b` is Qwen2.5-1.5B's (1536, 28 layers, 12/2 heads, ff
//! 8960), `7b` Llama-2-7B's (4096, 32, 32/32, 11008). The architecture is
//! `llama` unless `--arch` names another: `qwen2` adds query, key and
//! value biases (small random values); `qwen3` adds the query and key
//! norms; `gemma3` adds those, the post-attention and post-feed-forward
//! norms, a tied output head and a sliding window of `--window` positions
//! (512 unless given) on five layers of six; `smollm3` has Llama's
//! tensors (every fourth layer attends without RoPE), `granite` too (with
//! Granite 3's multipliers in the metadata). The vocabulary is the
//! `--like` model's. `--rope-freqs` writes Llama 3.1's `rope_freqs` tensor
//! (the values repeated over the rotated pairs), `--rope-linear` linear
//! RoPE scaling by the factor given, `--experts` a mixture of experts in
//! every layer (`qwen3moe` has 8 of `ff / 4`, 2 used, by default; a
//! `llama` file with experts is Mixtral's layout).

use snug_kernels::GgmlType;
use snug_model::gguf::{GgufFile, Value};
use snug_model::testing::synth::{self, Shape, Spec};

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn parse_type(s: &str) -> Result<GgmlType, String> {
    GgmlType::ALL
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(s))
        .ok_or_else(|| format!("unknown type {s}"))
}

fn shape(s: &str) -> Result<Shape, String> {
    match s {
        "1.5b" => Ok(Shape::QWEN_1_5B),
        "7b" => Ok(Shape::LLAMA_7B),
        s => {
            let v: Vec<usize> = s
                .split('=')
                .nth(1)
                .ok_or("--shape: 1.5b, 7b or NAME=dim,layers,heads,kv_heads,ff[,head_dim]")?
                .split(',')
                .map(|x| x.parse().map_err(|_| format!("--shape: not a number: {x}")))
                .collect::<Result<_, _>>()?;
            if v.len() < 5 || v[2] == 0 {
                return Err("--shape: dim,layers,heads,kv_heads,ff[,head_dim]".into());
            }
            Ok(Shape {
                dim: v[0],
                layers: v[1],
                heads: v[2],
                kv_heads: v[3],
                ff: v[4],
                head_dim: v.get(5).copied().unwrap_or(v[0] / v[2]),
            })
        }
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let like = arg(&args, "--like").ok_or("--like REAL.gguf is required")?;
    let like = GgufFile::open(std::path::Path::new(like)).map_err(|e| e.to_string())?;
    let shape_name = arg(&args, "--shape").unwrap_or("1.5b");
    let arch = arg(&args, "--arch").unwrap_or("llama").to_string();
    let arch_name = arch.clone();
    let spec = Spec {
        name: arg(&args, "--name").map_or(format!("synthetic {arch} {shape_name}"), str::to_string),
        arch,
        shape: shape(shape_name)?,
        ty: parse_type(arg(&args, "--type").unwrap_or("q4_K"))?,
        head_ty: parse_type(arg(&args, "--head-type").unwrap_or("q6_K"))?,
        window: arg(&args, "--window").map_or(Ok(512), |w| w.parse().map_err(|_| "--window: a number"))?,
        scale: arg(&args, "--scale").map_or(Ok(0.002), |w| w.parse().map_err(|_| "--scale: a number"))?,
        tokenizer_only: args.iter().any(|a| a == "--tokenizer-only"),
        rope_freqs: arg(&args, "--rope-freqs")
            .map(|s| {
                s.split(',')
                    .map(|x| x.parse().map_err(|_| format!("--rope-freqs: not a number: {x}")))
                    .collect::<Result<Vec<f32>, String>>()
            })
            .transpose()?,
        rope_linear: arg(&args, "--rope-linear")
            .map(|x| x.parse().map_err(|_| "--rope-linear: a number".to_string()))
            .transpose()?,
        extra: match arg(&args, "--experts") {
            None => Vec::new(),
            Some(e) => {
                let v: Vec<u32> = e
                    .split(',')
                    .map(|x| x.parse().map_err(|_| format!("--experts: not a number: {x}")))
                    .collect::<Result<_, _>>()?;
                let [count, used, ff] = v[..] else {
                    return Err("--experts COUNT,USED,FF".into());
                };
                let k = |n: &str| format!("{arch_name}.{n}");
                let mut v = vec![
                    (k("expert_count"), Value::U32(count)),
                    (k("expert_used_count"), Value::U32(used)),
                ];
                // llama.cpp takes a `llama` file's expert width from
                // `feed_forward_length`.
                if arch_name != "llama" {
                    v.push((k("expert_feed_forward_length"), Value::U32(ff)));
                }
                v
            }
        },
    };
    let out = arg(&args, "--out").map_or(format!("synth-{shape_name}.gguf"), str::to_string);
    let bytes = synth::write(&like.header, &spec, std::path::Path::new(&out)).map_err(|e| format!("{out}: {e}"))?;
    let vocab = like.header.get_array("tokenizer.ggml.tokens").map_or(0, |a| a.len());
    eprintln!("{out}: {bytes} bytes of weights, vocabulary {vocab}");
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("synth_gguf: {e}");
        std::process::exit(1);
    }
}
