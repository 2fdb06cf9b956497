//! Chat templates render byte-identically to Python's Jinja2 (set up as
//! Hugging Face's `apply_chat_template` sets it up): the templates inside
//! the real models, and hand-written templates that exercise Jinja features.
//! Expected strings come from `scripts/make_template_fixtures.py`.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

mod common;

use minijinja::Value;
use snug_model::template::ChatTemplate;
use snug_model::GgufFile;

fn fixture() -> serde_json::Value {
    let p = common::data_dir().join("chat_templates.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn render(t: &ChatTemplate, case: &serde_json::Value, bos: &str, eos: &str) -> String {
    t.render_value(
        Value::from_serialize(&case["messages"]),
        case["add_generation_prompt"].as_bool().unwrap(),
        bos,
        eos,
        Value::from_serialize(&case["extra"]),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", case["name"]))
}

#[test]
fn handwritten_templates_match_jinja2() {
    let f = fixture();
    let mut n = 0;
    for case in f["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("template").is_some())
    {
        let t = ChatTemplate::new(case["template"].as_str().unwrap()).unwrap();
        let got = render(&t, case, "<s>", "</s>");
        assert_eq!(got, case["expected"].as_str().unwrap(), "template {}", case["name"]);
        n += 1;
    }
    assert!(n >= 10, "only {n} handwritten cases");
}

#[test]
fn model_templates_match_jinja2() {
    let f = fixture();
    for alias in ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"] {
        let Some(path) = common::model_path(alias) else {
            continue;
        };
        let file = GgufFile::open(&path).unwrap();
        let t = ChatTemplate::for_model(file.get_str("tokenizer.chat_template")).unwrap();
        assert!(!t.is_fallback, "{alias} has a template");
        let cases: Vec<_> = f["cases"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["model"] == alias)
            .collect();
        assert!(cases.len() >= 10, "{alias}: {} cases", cases.len());
        for case in cases {
            let got = render(&t, case, "<BOS>", "<EOS>");
            assert_eq!(
                got,
                case["expected"].as_str().unwrap(),
                "{alias} {} gen={}",
                case["name"],
                case["add_generation_prompt"]
            );
        }
    }
}

#[test]
fn gemma_base_model_uses_the_plain_fallback() {
    let Some(path) = common::model_path("gemma3-270m") else {
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    assert!(file.get_str("tokenizer.chat_template").is_none());
    let t = ChatTemplate::for_model(None).unwrap();
    assert!(t.is_fallback);
}
