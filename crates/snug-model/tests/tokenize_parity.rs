//! Token ids must equal llama.cpp's: on the shared fixture strings, and on
//! a larger corpus of code, prose, unicode and whitespace made with
//! llama.cpp's `llama-tokenize` (`tests/data/tokenize_corpus.json`).

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
        let cases = v["models"][alias]["cases"]
            .as_array()
            .expect("cases for every model");
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
