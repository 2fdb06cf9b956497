//! Token ids must equal llama.cpp's: on the shared fixture strings, on a
//! corpus of code, prose, unicode and whitespace (`tokenize_corpus.json`),
//! on 300 seeded random adversarial strings that agreed in a differential
//! run of about 87,000 strings a model (`tokenize_random.json`), and on the
//! strings where that run found disagreements, all involving characters
//! added in Unicode 16.0 (`tokenize_unicode16.json`). All ids come from
//! llama.cpp built from the llama-cpp-python 0.3.36 sources.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

mod common;

use std::path::Path;

use snug_model::{EncodeOptions, GgufFile, Tokenizer};

fn check_file(reference: &Path) {
    let text = std::fs::read_to_string(reference).expect("reference file");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference json");
    let mut checked = 0;
    for alias in common::MODELS {
        let Some(path) = common::model_path(alias) else {
            continue;
        };
        let file = GgufFile::open(&path).expect("model opens");
        let tok = Tokenizer::from_gguf(&file).expect("tokenizer builds");
        let Some(cases) = v["models"][alias]["cases"].as_array() else {
            continue;
        };
        let mut failures = Vec::new();
        for case in cases {
            let s = case["text"].as_str().unwrap();
            let want: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode(s, EncodeOptions::default());
            if got != want {
                failures.push(format!("{alias} {s:?}\n  want {want:?}\n  got  {got:?}"));
            }
            checked += 1;
        }
        assert!(
            failures.is_empty(),
            "{} of {} strings differ:\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
    }
    eprintln!("{checked} strings checked against {}", reference.display());
}

#[test]
fn ids_equal_llama_cpp_on_shared_fixture() {
    let Some(dir) = common::fixtures_dir() else {
        return;
    };
    check_file(&dir.join("tokenize/llama.cpp.json"));
}

#[test]
fn ids_equal_llama_cpp_on_own_corpus() {
    check_file(&common::data_dir().join("tokenize_corpus.json"));
}

#[test]
fn ids_equal_llama_cpp_on_random_strings() {
    check_file(&common::data_dir().join("tokenize_random.json"));
}

#[test]
fn characters_from_unicode_16_split_as_in_llama_cpp() {
    check_file(&common::data_dir().join("tokenize_unicode16.json"));
}
