//! The GGUF reader, tokenizer round trips and streaming detokenizer on the
//! four real models.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

mod common;

use snug_kernels::{dequantize, GgmlType};
use snug_model::tokenizer::StreamDecoder;
use snug_model::{EncodeOptions, GgufFile, Tokenizer};

/// (alias, architecture, tensors, blocks, [(type, count)]) as listed in the
/// models' documentation (read off with the `gguf` Python package).
type Facts = (&'static str, &'static str, usize, u64, &'static [(GgmlType, usize)]);

const FACTS: &[Facts] = &[
    (
        "smollm2-135m",
        "llama",
        272,
        30,
        &[(GgmlType::Q4_1, 210), (GgmlType::Q8_0, 1), (GgmlType::F32, 61)],
    ),
    (
        "gemma3-270m",
        "gemma3",
        236,
        18,
        &[
            (GgmlType::Q5_0, 81),
            (GgmlType::Q8_0, 10),
            (GgmlType::Q4K, 27),
            (GgmlType::Q6K, 9),
            (GgmlType::F32, 109),
        ],
    ),
    (
        "qwen2.5-coder-0.5b",
        "qwen2",
        291,
        24,
        &[
            (GgmlType::Q5_0, 133),
            (GgmlType::Q8_0, 13),
            (GgmlType::Q6K, 12),
            (GgmlType::Q4K, 12),
            (GgmlType::F32, 121),
        ],
    ),
    (
        "qwen2.5-coder-1.5b",
        "qwen2",
        339,
        28,
        &[(GgmlType::Q4K, 169), (GgmlType::Q6K, 29), (GgmlType::F32, 141)],
    ),
];

#[test]
fn headers_match_the_documented_facts() {
    for &(alias, arch, n_tensors, blocks, types) in FACTS {
        let Some(path) = common::model_path(alias) else {
            continue;
        };
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.architecture(), Some(arch), "{alias}");
        assert_eq!(f.tensors.len(), n_tensors, "{alias}");
        assert_eq!(f.get_u64(&format!("{arch}.block_count")), Some(blocks), "{alias}");
        for &(ty, count) in types {
            assert_eq!(f.tensors.iter().filter(|t| t.ty == ty).count(), count, "{alias} {ty}");
        }
        // Every tensor lies inside the file, aligned, without overlap.
        let mut spans: Vec<(u64, u64)> = f.tensors.iter().map(|t| (t.offset, t.offset + t.size)).collect();
        spans.sort();
        assert!(
            spans.windows(2).all(|w| w[0].1 <= w[1].0),
            "{alias}: overlapping tensors"
        );
        assert!(f.data_offset + spans.last().unwrap().1 <= f.file_size());
    }
}

#[test]
fn embedding_rows_dequantize_to_finite_values() {
    for alias in common::MODELS {
        let Some(path) = common::model_path(alias) else {
            continue;
        };
        let f = GgufFile::open(&path).unwrap();
        let t = f.tensor("token_embd.weight").unwrap();
        let row = t.dims[0] as usize;
        let row_bytes = t.ty.bytes_for(row as u64).unwrap() as usize;
        let mut out = vec![0f32; row];
        dequantize(t.ty, &f.tensor_data(t)[..row_bytes], &mut out).unwrap();
        assert!(out.iter().all(|v| v.is_finite()), "{alias}");
        assert!(out.iter().any(|&v| v != 0.0), "{alias}: an all-zero first row");
    }
}

const SAMPLES: &[&str] = &[
    "Hello, world! 1234567",
    "naïve café — 日本語 🙂👍🏽 𝄞",
    "fn main() {\n\tprintln!(\"{}\", 42);\n}\n",
    "   spaces   and\ttabs\r\n",
    "<|im_start|>user\nhi<|im_end|>",
];

#[test]
fn decode_inverts_encode() {
    for alias in common::MODELS {
        let Some(path) = common::model_path(alias) else {
            continue;
        };
        let f = GgufFile::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&f).unwrap();
        let opts = EncodeOptions {
            add_special: false,
            parse_special: true,
        };
        for s in SAMPLES {
            let ids = tok.encode(s, opts);
            assert_eq!(tok.decode(&ids, true), *s, "{alias}");
        }
    }
}

#[test]
fn streaming_never_splits_a_character() {
    for alias in common::MODELS {
        let Some(path) = common::model_path(alias) else {
            continue;
        };
        let f = GgufFile::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&f).unwrap();
        let opts = EncodeOptions {
            add_special: false,
            parse_special: false,
        };
        for s in SAMPLES {
            let ids = tok.encode(s, opts);
            let mut dec = StreamDecoder::new(false);
            let mut streamed = String::new();
            let mut split_seen = false;
            for &id in &ids {
                let chunk = dec.push(&tok, id);
                // Each chunk is a whole UTF-8 string by type; check nothing
                // was replaced on the way.
                assert!(!chunk.contains('\u{FFFD}'), "{alias}: {chunk:?}");
                split_seen |= dec.pending_bytes() > 0;
                streamed.push_str(&chunk);
            }
            streamed.push_str(&dec.finish());
            assert_eq!(streamed, tok.decode(&ids, false), "{alias}");
            if s.contains('𝄞') && alias != "gemma3-270m" {
                // Byte-level BPE splits this rare character across tokens.
                assert!(split_seen, "{alias}: expected a held-back partial character");
            }
        }
    }
}

#[test]
fn end_of_generation_tokens_follow_the_vocabulary() {
    let cases = [
        ("smollm2-135m", &["<|im_end|>", "<|endoftext|>"][..]),
        ("gemma3-270m", &["<eos>", "<end_of_turn>"][..]),
        (
            "qwen2.5-coder-0.5b",
            &[
                "<|im_end|>",
                "<|endoftext|>",
                "<|fim_pad|>",
                "<|repo_name|>",
                "<|file_sep|>",
            ][..],
        ),
    ];
    for (alias, texts) in cases {
        let Some(path) = common::model_path(alias) else {
            continue;
        };
        let f = GgufFile::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&f).unwrap();
        for t in texts {
            let id = tok.token_id(t).unwrap();
            assert!(tok.is_eog(id), "{alias}: {t} should end generation");
        }
        assert!(!tok.is_eog(tok.encode("the", EncodeOptions::default()).last().copied().unwrap()));
    }
}
