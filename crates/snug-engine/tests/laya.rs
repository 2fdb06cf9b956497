//! Native Laya checkpoints against the reference SDK: two tiny randomly
//! initialised checkpoints (ModernBERT and mmBERT layouts) and the SDK's
//! answers to a set of requests, built by `scripts/make-laya-fixtures.py`.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use std::path::{Path, PathBuf};

use serde_json::Value;
use snug_engine::decide::DecideError;
use snug_engine::laya::{parse_request, LayaAgent};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/laya")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(data().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Same keys and non-numeric values; numbers within `tol`.
fn assert_close(got: &Value, want: &Value, tol: f64, at: &str) {
    match (got, want) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!((a - b).abs() <= tol, "{at}: {a} vs reference {b}");
        }
        (Value::Object(a), Value::Object(b)) => {
            let mut ka: Vec<_> = a.keys().collect();
            let mut kb: Vec<_> = b.keys().collect();
            ka.sort();
            kb.sort();
            assert_eq!(ka, kb, "{at}: keys");
            for (k, v) in b {
                assert_close(&a[k], v, tol, &format!("{at}.{k}"));
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{at}: length");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_close(x, y, tol, &format!("{at}[{i}]"));
            }
        }
        _ => assert_eq!(got, want, "{at}"),
    }
}

fn check_checkpoint(kind: &str) {
    let reference = reference();
    let agent = LayaAgent::open(&data().join(kind), 2).unwrap();
    let cases = reference[kind]["cases"].as_array().unwrap();
    let mut compared = 0;
    let mut worst = 0f64;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let req = parse_request(&case["request"]).unwrap();
        if let Some(err) = case.get("error") {
            match agent.answer(&req) {
                Err(DecideError::Capacity(m)) => assert_eq!(m, err.as_str().unwrap(), "{kind}/{name}"),
                other => panic!("{kind}/{name}: expected the capacity error, got {other:?}"),
            }
            continue;
        }
        let (resp, answers) = agent.answer(&req).unwrap();
        assert_close(&resp, &case["response"], 1e-4 + 1e-9, &format!("{kind}/{name}"));
        if req.questions.is_empty() {
            continue;
        }
        // Tokens and marker positions exactly; logits closely.
        let enc = agent.encode(&req, &req.state).unwrap();
        for (q, (eq, a)) in req.questions.iter().zip(enc.questions.iter().zip(&answers)) {
            let row = &case["rows"][&q.question.name];
            let ids: Vec<u32> = row["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(eq.row.ids, ids, "{kind}/{name}/{}: token ids", q.question.name);
            let markers: Vec<usize> = row["markers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(eq.row.markers, markers, "{kind}/{name}/{}: markers", q.question.name);
            for (g, w) in a.logits.iter().zip(row["logits"].as_array().unwrap()) {
                let w = w.as_f64().unwrap();
                assert!(
                    (*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                    "{kind}/{name}: logit {g} vs {w}"
                );
            }
            // The reference's probabilities before rounding: its logits
            // through the same temperature.
            let t = a.temperature as f64;
            let z: Vec<f64> = row["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() / t)
                .collect();
            let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            let mut slots: Vec<f64> = e.iter().map(|x| x / sum).collect();
            if let Some(order) = &q.order {
                let mut p = vec![0.0; slots.len()];
                for (slot, &opt) in order.iter().enumerate() {
                    p[opt] = slots[slot];
                }
                slots = p;
            }
            for (g, w) in a.probabilities.iter().zip(&slots) {
                worst = worst.max((*g as f64 - w).abs());
            }
            let act = row["act_logits"][0].as_f64().unwrap();
            assert!((a.act_probability as f64 - act).abs() <= 1e-4, "{kind}/{name}: act");
            compared += 1;
        }
    }
    assert!(compared >= 20, "{kind}: only {compared} questions compared");
    eprintln!("{kind}: {compared} questions, largest probability difference from the reference {worst:.2e}");
    assert!(worst <= 1e-4, "{kind}: a probability is {worst} from the reference");
}

#[test]
fn tiny_modernbert_matches_the_reference() {
    check_checkpoint("tiny-modernbert");
}

#[test]
fn tiny_mmbert_matches_the_reference() {
    check_checkpoint("tiny-mmbert");
}

#[test]
fn a_question_gets_the_same_bits_alone_or_with_others() {
    let reference = reference();
    let agent = LayaAgent::open(&data().join("tiny-modernbert"), 2).unwrap();
    let case = &reference["tiny-modernbert"]["cases"][0]["request"];
    let req = parse_request(case).unwrap();
    let (_, together) = agent.answer(&req).unwrap();
    for (i, q) in req.questions.iter().enumerate() {
        let mut alone = req.clone();
        alone.questions = vec![q.clone()];
        let (_, a) = agent.answer(&alone).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a[0].logits), bits(&together[i].logits));
        assert_eq!(bits(&a[0].probabilities), bits(&together[i].probabilities));
        assert_eq!(a[0].act_probability.to_bits(), together[i].act_probability.to_bits());
    }
    // Passes of one row each: the same bits again.
    let mut agent = agent;
    agent.model.set_forward_tokens(1);
    let (_, split) = agent.answer(&req).unwrap();
    for (a, b) in split.iter().zip(&together) {
        assert_eq!(
            a.logits.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.logits.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn broken_checkpoints_get_clear_errors() {
    let dir = std::env::temp_dir().join(format!("snug-laya-broken-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let err = LayaAgent::open(&dir, 1).err().unwrap().to_string();
    assert!(err.contains("rl_agent_config.json"), "{err}");
    // Copy the tiny checkpoint, then cut its weights short.
    let src = data().join("tiny-modernbert");
    for sub in ["encoder", "tokenizer"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        for f in std::fs::read_dir(src.join(sub)).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), dir.join(sub).join(f.file_name())).unwrap();
        }
    }
    std::fs::copy(src.join("rl_agent_config.json"), dir.join("rl_agent_config.json")).unwrap();
    let w = std::fs::read(src.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &w[..w.len() / 2]).unwrap();
    let err = LayaAgent::open(&dir, 1).err().unwrap().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
