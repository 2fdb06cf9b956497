use serde_json::json;

use super::*;

#[test]
fn questions_parse_in_laya_shapes() {
    let q = parse_questions(&json!({
        "route": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": null}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["not", "somewhat", "very"]},
        "refund": {"type": "noul", "instructions": "Is it a refund request?"},
        "lang": {"type": "choice", "instructions": "Language?", "options": ["en", "de"]},
    }))
    .unwrap();
    assert_eq!(
        q[0].options,
        vec![("billing".into(), Some("money".into())), ("tech".into(), None)]
    );
    assert_eq!(q[1].options[2], ("2".into(), Some("very".into())));
    assert_eq!(q[2].options, vec![("false".into(), None), ("true".into(), None)]);
    assert_eq!(q[3].options.len(), 2);
    for (bad, needle) in [
        (json!({"a": {"type": "vote", "instructions": "x"}}), "unknown type"),
        (json!({"a": {"type": "noul"}}), "instructions"),
        (
            json!({"a": {"type": "score", "instructions": "x", "criteria": ["a", null]}}),
            "null level",
        ),
        (
            json!({"a": {"type": "choice", "instructions": "x", "criteria": ["a", "a"]}}),
            "twice",
        ),
        (json!({"a": {"type": "choice", "instructions": "x"}}), "criteria"),
        (json!([1]), "object"),
    ] {
        let e = parse_questions(&bad).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn confidence_and_buckets_follow_laya() {
    assert_eq!(bucket(Kind::Choice, 2), "choice:2");
    assert_eq!(bucket(Kind::Score, 5), "score:3-5");
    assert_eq!(bucket(Kind::Choice, 11), "choice:11+");
    assert!((confidence(Kind::Choice, &[0.5, 0.5]) - 0.0).abs() < 1e-9);
    assert!((confidence(Kind::Choice, &[1.0, 0.0]) - 1.0).abs() < 1e-6);
    assert!((confidence(Kind::Noul, &[0.2, 0.8]) - 0.8).abs() < 1e-6);
    assert!((jev_confidence(Kind::Choice, &[0.5, 0.5])).abs() < 1e-9);
    assert!((jev_confidence(Kind::Choice, &[1.0, 0.0, 0.0]) - 1.0).abs() < 1e-9);
    assert!((jev_confidence(Kind::Score, &[0.0, 1.0, 0.0]) - 1.0).abs() < 1e-9);
    // Uniform over three levels: mean distance from the mode (0) is
    // 1, from the middle 2/3: clamped to 0.
    assert_eq!(jev_confidence(Kind::Score, &[1.0 / 3.0; 3]), 0.0);
    assert_eq!(clamp_temperature(0.1), 0.5);
    assert_eq!(clamp_temperature(f32::NAN), 1.0);
    let t = Temperatures {
        temperature: [2.0, 1.0, 1.0],
        temperature_by_options: [("choice:2".to_string(), 3.0)].into(),
    };
    assert_eq!(t.get(Kind::Choice, 2), 3.0);
    assert_eq!(t.get(Kind::Choice, 4), 2.0);
}

#[test]
fn min_confidence_marks_answers_without_changing_them() {
    let s = Scored {
        question: Question {
            name: "q".into(),
            kind: Kind::Choice,
            instructions: "x".into(),
            options: vec![("a".into(), None), ("b".into(), None)],
        },
        raw: vec![-0.5, -1.0],
        logprobs: vec![-0.5, -1.0],
        temperature: 1.0,
        probabilities: vec![0.6, 0.4],
    };
    let plain = answer_json(&s, None);
    assert_eq!(plain["choice"], "a");
    assert!(plain.get("abstention").is_none());
    let gated = answer_json(&s, Some(&MinConfidence::parse(&json!(0.7)).unwrap()));
    assert_eq!(gated["abstention"], "abstained");
    assert_eq!(gated["low_confidence"], true);
    assert_eq!(gated["choice"], "a");
    let by = MinConfidence::parse(&json!({"choice:2": 0.5, "default": 0.9})).unwrap();
    assert_eq!(answer_json(&s, Some(&by))["abstention"], "passed");
    assert!(MinConfidence::parse(&json!(1.5)).is_err());
    assert!(MinConfidence::parse(&json!({"x": 0.5})).is_err());
}

#[test]
fn calibration_finds_the_temperature_that_generated_the_labels() {
    // Logits whose true distribution is softmax(z / 2): labels drawn
    // from it deterministically in proportion.
    let mut ex = Vec::new();
    for i in 0..400 {
        let z = vec![(i % 7) as f32 * 0.5, 0.0, -((i % 5) as f32) * 0.4];
        let p = softmax_t(&z, 2.0);
        let u = ((i * 7919) % 1000) as f32 / 1000.0;
        let truth = if u < p[0] {
            0
        } else if u < p[0] + p[1] {
            1
        } else {
            2
        };
        ex.push(Example {
            kind: Kind::Choice,
            logprobs: z,
            truth,
        });
    }
    let t = calibrate(&ex, 10, 10);
    assert!((t.temperature[0] - 2.0).abs() < 0.4, "{t:?}");
    assert!(t.temperature_by_options.contains_key("choice:3-5"));
    assert_eq!(t.temperature[1], 1.0, "no score examples: default");
    let refs: Vec<&Example> = ex.iter().collect();
    assert!(nll(&refs, t.temperature[0]) <= nll(&refs, 1.0));
}
