//! Constrained decoding on the real models: what comes out follows the
//! grammar (JSON schema, JSON object, regex, choice, GBNF, Lark), and a
//! grammar keeps speculation lossless: the same tokens with speculation
//! on, off and auto, greedy and seeded, with drafts actually verified.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use serde_json::{json, Value};
use snug_core::speculate::Mode;
use snug_engine::generate::{GenerateRequest, Generation};
use snug_engine::grammar::{GrammarSpec, Grammars};
use snug_engine::sampling::SamplingParams;
use snug_engine::{Engine, EngineOptions};
use snug_model::testing::{model_path, MODELS};
use snug_model::{EncodeOptions, LoadOptions, ModelFiles, Tokenizer};

fn options() -> EngineOptions {
    EngineOptions {
        threads: 2,
        ctx: 1024,
        batch: 64,
        max_seqs: 1,
        page_tokens: 16,
        ..Default::default()
    }
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "city": {"type": "string", "maxLength": 40},
            "items": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
            "count": {"type": "integer"}
        },
        "required": ["name", "city", "items", "count"],
        "additionalProperties": false
    })
}

/// The prompt repeats the shape of the answer, so the drafter finds
/// drafts inside the JSON being written.
const PROMPT: &str = "Orders as JSON, one per line.\n\
    {\"name\": \"Anna Berg\", \"city\": \"Oslo\", \"items\": [\"chair\", \"table\"], \"count\": 3}\n\
    {\"name\": \"Tomas Lind\", \"city\": \"Bergen\", \"items\": [\"table\"], \"count\": 1}\n\
    {\"name\": \"Mia Holm\", \"city\": \"Oslo\", \"items\": [\"lamp\", \"chair\"], \"count\": 6}\n";

#[allow(clippy::too_many_arguments)] // a test's one call site per case
fn generate(
    engine: &mut Engine,
    tok: &Tokenizer,
    grammars: &Grammars,
    spec: &GrammarSpec,
    prompt: &str,
    params: &SamplingParams,
    mode: Mode,
    n: usize,
) -> Generation {
    let req = GenerateRequest {
        prompt: tok.encode(prompt, EncodeOptions::default()),
        max_tokens: n,
        params: params.clone(),
        stop: Vec::new(),
        speculate: mode,
        constraint: Some(grammars.compile(spec).unwrap()),
    };
    let seq = engine.create_sequence();
    let g = engine.generate(seq, tok, &req, |_| {}).unwrap();
    engine.free_sequence(seq);
    g
}

fn check_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 4, "{text}");
    assert!(o["name"].is_string() && o["city"].is_string(), "{text}");
    assert!(o["items"].as_array().unwrap().iter().all(Value::is_string), "{text}");
    assert!(o["count"].is_i64(), "{text}");
}

#[test]
fn a_schema_shapes_the_output_and_speculation_stays_lossless() {
    let greedy = SamplingParams::default();
    let sampled = SamplingParams {
        temperature: 0.9,
        top_k: 0,
        top_p: 0.95,
        min_p: 0.0,
        seed: 7,
        ..Default::default()
    };
    let spec = GrammarSpec::JsonSchema(person_schema());
    for alias in MODELS {
        let Some(path) = model_path(alias) else { continue };
        let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let model = snug_model::arch::Model::load(&file).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let grammars = Grammars::new(&tok, model.config.vocab).unwrap();
        let mut engine = Engine::new(&model, options());
        let mut drafted = 0;
        let mut accepted = 0;
        for params in [&greedy, &sampled] {
            let off = generate(&mut engine, &tok, &grammars, &spec, PROMPT, params, Mode::Off, 120);
            check_person(&off.text);
            for mode in [Mode::On, Mode::Auto] {
                let other = generate(&mut engine, &tok, &grammars, &spec, PROMPT, params, mode, 120);
                assert_eq!(
                    off.tokens, other.tokens,
                    "{alias} {mode:?} temperature {}",
                    params.temperature
                );
                assert_eq!(off.text, other.text);
                assert_eq!(off.finish_reason, other.finish_reason);
                drafted += other.stats.speculation.drafted;
                accepted += other.stats.speculation.accepted;
            }
        }
        eprintln!("{alias}: drafted {drafted}, accepted {accepted}");
        assert!(
            accepted > 0,
            "{alias}: no draft was accepted, so nothing was verified under the grammar"
        );
    }
}

#[test]
fn every_kind_of_grammar_bounds_the_output() {
    let Some(path) = model_path("smollm2-135m") else { return };
    let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
    let model = snug_model::arch::Model::load(&file).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let grammars = Grammars::new(&tok, model.config.vocab).unwrap();
    let mut engine = Engine::new(&model, options());
    let params = SamplingParams::default();
    let mut run = |spec: GrammarSpec, prompt: &str| {
        let g = generate(&mut engine, &tok, &grammars, &spec, prompt, &params, Mode::On, 60);
        g.text
    };

    let obj = run(GrammarSpec::JsonObject, "Describe a cat as JSON: ");
    assert!(serde_json::from_str::<Value>(&obj).unwrap().is_object(), "{obj}");

    let date = run(
        GrammarSpec::Regex(r"\d{4}-\d{2}-\d{2}".into()),
        "The date of the moon landing: ",
    );
    assert_eq!(date.len(), 10, "{date}");
    assert!(
        date.chars()
            .enumerate()
            .all(|(i, c)| if i == 4 || i == 7 { c == '-' } else { c.is_ascii_digit() }),
        "{date}"
    );

    let options = vec!["positive".to_string(), "negative".to_string(), "neutral".to_string()];
    let choice = run(GrammarSpec::Choice(options.clone()), "Review: I loved it!\nSentiment: ");
    assert!(options.contains(&choice), "{choice}");

    let gbnf = "root ::= \"yes\" | \"no\" | (\"maybe, \" [0-9]{1,2} \"%\")\n";
    let answer = run(GrammarSpec::Gbnf(gbnf.into()), "Is the sky blue? Answer: ");
    assert!(
        answer == "yes" || answer == "no" || (answer.starts_with("maybe, ") && answer.ends_with('%')),
        "{answer}"
    );

    let lark = "start: item (\", \" item)*\nitem: /[a-z]+/\n";
    let list = run(
        GrammarSpec::Lark(lark.into()),
        "Three fruits, lower case, comma separated: ",
    );
    assert!(
        !list.is_empty()
            && list
                .split(", ")
                .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase())),
        "{list:?}"
    );
}

#[test]
fn a_grammar_that_does_not_compile_is_an_error_naming_why() {
    let Some(path) = model_path("smollm2-135m") else { return };
    let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let grammars = Grammars::new(&tok, tok.vocab_size()).unwrap();
    for bad in [
        GrammarSpec::Lark("start: undefined_rule".into()),
        GrammarSpec::Regex("(unclosed".into()),
        GrammarSpec::Gbnf("root ::= \"a".into()),
        GrammarSpec::JsonSchema(json!({"type": "no-such-type"})),
        GrammarSpec::Choice(Vec::new()),
    ] {
        let e = grammars.compile(&bad).unwrap_err().to_string();
        assert!(e.starts_with("invalid grammar: ") && e.len() > 20, "{bad:?}: {e}");
    }
}
