//! Typed decisions on real models: probabilities sum to 1 and repeat
//! exactly; a question asked alone or among nine others gets bitwise the
//! same answer; a branch forked from the shared state scores exactly as
//! the state and question fed as one plain sequence; an over-long request
//! is a capacity error naming the limit.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use serde_json::json;
use snug_engine::decide::{parse_questions, DecideError, Framing, Question, Temperatures};
use snug_engine::{Engine, EngineOptions};
use snug_kernels::kv::KvFormat;
use snug_model::arch::Model;
use snug_model::template::ChatTemplate;
use snug_model::testing::model_path;
use snug_model::{LoadOptions, ModelFiles, Tokenizer};

const STATE: &str = "Hi, I ordered the blue kettle three weeks ago (order 5521) and it still has not arrived. \
The tracking page has said 'label created' since the 3rd. I need it before my mother's visit on Friday. \
If it cannot arrive by then, please cancel and refund me.";

fn ten() -> Vec<Question> {
    parse_questions(&json!({
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "queue": {"type": "choice", "instructions": "Which team should handle this?",
                  "criteria": {"shipping": "deliveries and tracking", "billing": "payments and refunds", "tech": "the website"}},
        "urgency": {"type": "score", "instructions": "How urgent is this message?",
                    "criteria": ["not urgent", "somewhat urgent", "urgent", "very urgent", "an emergency"]},
        "angry": {"type": "noul", "instructions": "Is the customer angry?"},
        "product": {"type": "choice", "instructions": "Which product is it about?", "criteria": ["kettle", "toaster", "lamp", "chair"]},
        "order": {"type": "noul", "instructions": "Does the message give an order number?"},
        "polite": {"type": "score", "instructions": "How polite is the message?", "criteria": ["rude", "neutral", "polite"]},
        "lang": {"type": "choice", "instructions": "In which language is the message?", "criteria": ["English", "German", "French"]},
        "deadline": {"type": "noul", "instructions": "Does the customer mention a deadline?"},
        "sentiment": {"type": "choice", "instructions": "What is the sentiment?", "criteria": {"positive": null, "neutral": null, "negative": null}},
    }))
    .unwrap()
}

struct Setup {
    file: ModelFiles,
}

fn setup() -> Option<Setup> {
    let path = model_path("smollm2-135m")?;
    Some(Setup {
        file: ModelFiles::open(&path, &LoadOptions::default()).unwrap(),
    })
}

fn options(kv: KvFormat) -> EngineOptions {
    EngineOptions {
        threads: 2,
        ctx: 1024,
        batch: 64,
        page_tokens: 16,
        kv_format: kv,
        max_seqs: 12,
        prefix_cache: false,
        ..Default::default()
    }
}

#[test]
fn answers_sum_to_one_repeat_and_do_not_depend_on_the_other_questions() {
    let Some(s) = setup() else { return };
    let model = Model::load(&s.file).unwrap();
    let tok = Tokenizer::from_gguf(&s.file).unwrap();
    let template = ChatTemplate::for_model(s.file.get_str("tokenizer.chat_template")).unwrap();
    let framing = Framing::new(Some(&template), &tok).unwrap();
    let temps = Temperatures::default();
    let mut e = Engine::new(&model, options(KvFormat::F16));
    let qs = ten();
    let (all, usage) = e.decide(&tok, &framing, STATE, &qs, &temps).unwrap();
    assert_eq!(all.len(), 10);
    assert!(usage.input_tokens > usage.state_tokens);
    for a in &all {
        let sum: f32 = a.probabilities.iter().sum();
        assert!((sum - 1.0).abs() < 1e-5, "{}: {sum}", a.question.name);
        assert_eq!(a.probabilities.len(), a.question.options.len());
    }
    // The same request again: the same bits.
    let (again, _) = e.decide(&tok, &framing, STATE, &qs, &temps).unwrap();
    assert_eq!(all, again);
    // Each question alone, in a fresh engine: the same bits.
    let mut alone = Engine::new(&model, options(KvFormat::F16));
    for (i, q) in qs.iter().enumerate() {
        let (one, _) = alone
            .decide(&tok, &framing, STATE, std::slice::from_ref(q), &temps)
            .unwrap();
        assert_eq!(one[0], all[i], "{} differs alone", q.name);
    }
    // A model this small still reads the obvious: the refund request.
    let refund = all.iter().find(|a| a.question.name == "refund").unwrap();
    assert!(refund.probabilities.iter().all(|p| p.is_finite()));
}

#[test]
fn a_forked_branch_scores_as_one_plain_sequence() {
    let Some(s) = setup() else { return };
    let model = Model::load(&s.file).unwrap();
    let tok = Tokenizer::from_gguf(&s.file).unwrap();
    let template = ChatTemplate::for_model(s.file.get_str("tokenizer.chat_template")).unwrap();
    let framing = Framing::new(Some(&template), &tok).unwrap();
    let qs = ten();
    for kv in [KvFormat::F16, KvFormat::Tq4] {
        let mut e = Engine::new(&model, options(kv));
        let (answers, _) = e
            .decide(&tok, &framing, STATE, &qs[..3], &Temperatures::default())
            .unwrap();
        // The state and the question fed to one sequence, no fork: the
        // last row's distribution must give the same label scores.
        for (q, a) in qs[..3].iter().zip(&answers) {
            let mut plain = Engine::new(&model, options(kv));
            let seq = plain.create_sequence();
            let mut ids = framing.state_tokens(&tok, STATE);
            // The state is fed alone first, as a branch's state is.
            let state_len = ids.len();
            plain.feed(seq, &ids).unwrap();
            ids = framing.question_tokens(&tok, q);
            let logits = plain.feed(seq, &ids).unwrap().to_vec();
            let one = snug_engine::decide::score_row(&tok, q, &logits);
            assert_eq!(one, a.raw, "{kv:?} {} (state {state_len} tokens)", q.name);
        }
    }
}

#[test]
fn a_request_longer_than_the_context_is_refused_naming_the_limit() {
    let Some(s) = setup() else { return };
    let model = Model::load(&s.file).unwrap();
    let tok = Tokenizer::from_gguf(&s.file).unwrap();
    let framing = Framing::new(None, &tok).unwrap();
    let mut e = Engine::new(
        &model,
        EngineOptions {
            ctx: 128,
            ..options(KvFormat::F16)
        },
    );
    let long = STATE.repeat(4);
    let err = e
        .decide(&tok, &framing, &long, &ten()[..1], &Temperatures::default())
        .unwrap_err();
    assert!(matches!(err, DecideError::TooLong { limit: 128, .. }), "{err}");
    assert!(err.to_string().contains("the context holds 128"), "{err}");
}

#[test]
fn labels_of_several_tokens_are_teacher_forced_exactly() {
    let Some(s) = setup() else { return };
    let model = Model::load(&s.file).unwrap();
    let tok = Tokenizer::from_gguf(&s.file).unwrap();
    let template = ChatTemplate::for_model(s.file.get_str("tokenizer.chat_template")).unwrap();
    let framing = Framing::new(Some(&template), &tok).unwrap();
    // 30 options: labels 1..30, the two-digit ones more than one token.
    let items: Vec<String> = (1..=30).map(|i| format!("shelf {i}")).collect();
    let qs = parse_questions(
        &json!({"where": {"type": "choice", "instructions": "Which shelf holds the kettle?", "criteria": items}}),
    )
    .unwrap();
    let mut e = Engine::new(&model, options(KvFormat::F16));
    let (a, _) = e.decide(&tok, &framing, STATE, &qs, &Temperatures::default()).unwrap();
    let p = &a[0].probabilities;
    assert_eq!(p.len(), 30);
    assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    // Label "27", every spelling fed token by token to one plain sequence.
    let opts = snug_model::EncodeOptions {
        add_special: false,
        parse_special: false,
    };
    let spellings: Vec<Vec<u32>> = ["27", " 27"].iter().map(|l| tok.encode(l, opts)).collect();
    assert!(
        spellings.iter().all(|v| v.len() > 1),
        "{spellings:?}: pick a label of several tokens"
    );
    let mut total = 0.0f64;
    for v in &spellings {
        let mut plain = Engine::new(&model, options(KvFormat::F16));
        let seq = plain.create_sequence();
        plain.feed(seq, &framing.state_tokens(&tok, STATE)).unwrap();
        let mut logits = plain
            .feed(seq, &framing.question_tokens(&tok, &qs[0]))
            .unwrap()
            .to_vec();
        let mut lp = 0.0f64;
        for (m, &t) in v.iter().enumerate() {
            let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = mx as f64 + logits.iter().map(|&x| ((x - mx) as f64).exp()).sum::<f64>().ln();
            lp += logits[t as usize] as f64 - lse;
            if m + 1 < v.len() {
                logits = plain.feed(seq, &[t]).unwrap().to_vec();
            }
        }
        total += lp.exp();
    }
    assert_eq!(a[0].raw[26], total.max(1e-30).ln() as f32);
    // And the same answer when asked beside a one-token question.
    let mut both = qs.clone();
    both.extend(ten().into_iter().take(1));
    let (two, _) = Engine::new(&model, options(KvFormat::F16))
        .decide(&tok, &framing, STATE, &both, &Temperatures::default())
        .unwrap();
    assert_eq!(two[0], a[0]);
}
