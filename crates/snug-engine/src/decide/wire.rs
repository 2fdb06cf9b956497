//! Decisions on the wire: questions parsed from a `/v1/systemone`
//! request's JSON (each checked, with an error naming what is wrong) and
//! answers rendered into its response's shape.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::*;

fn render(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Reads the `questions` object of a request: a map from name to
/// `{type, instructions, criteria}`. `criteria` is, for choice, a map from
/// key to description (or null) or a list of keys; for score, a list of
/// level descriptions; for noul, optionally `{"true": ..., "false": ...}`.
/// `options` (choice) and `levels` (score) are read as `criteria` too.
pub fn parse_questions(v: &Value) -> Result<Vec<Question>, DecideError> {
    let bad = |m: String| DecideError::Invalid(m);
    let obj = v
        .as_object()
        .ok_or_else(|| bad("'questions' must be an object from question name to question".into()))?;
    if obj.len() > MAX_QUESTIONS {
        return Err(bad(format!("too many questions ({} > {MAX_QUESTIONS})", obj.len())));
    }
    let mut out = Vec::with_capacity(obj.len());
    for (name, q) in obj {
        let q = q
            .as_object()
            .ok_or_else(|| bad(format!("question {name:?} must be an object")))?;
        let kind = match q.get("type").and_then(Value::as_str) {
            Some("choice") => Kind::Choice,
            Some("score") => Kind::Score,
            Some("noul") => Kind::Noul,
            other => {
                return Err(bad(format!(
                    "question {name:?}: unknown type {}; use one of choice, score, noul",
                    other.map_or("(none)".to_string(), |t| format!("{t:?}"))
                )))
            }
        };
        let instructions = match q.get("instructions") {
            Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
            Some(v) if !v.is_null() && !v.is_string() => render(v),
            _ => {
                return Err(bad(format!(
                    "question {name:?}: no 'instructions'; add the text the model should answer"
                )))
            }
        };
        let criteria = q
            .get("criteria")
            .or_else(|| q.get("options"))
            .or_else(|| q.get("levels"))
            .filter(|c| !c.is_null());
        let options: Vec<(String, Option<String>)> = match kind {
            Kind::Choice => match criteria {
                Some(Value::Object(m)) => m
                    .iter()
                    .map(|(k, d)| (k.clone(), (!d.is_null()).then(|| render(d)).filter(|d| !d.is_empty())))
                    .collect(),
                Some(Value::Array(a)) => {
                    let mut keys = Vec::new();
                    for k in a {
                        if k.is_null() || k.is_array() || k.is_object() {
                            return Err(bad(format!("question {name:?}: choice labels must be strings or numbers")));
                        }
                        keys.push((render(k), None));
                    }
                    keys
                }
                _ => {
                    return Err(bad(format!(
                        "question {name:?}: a choice question takes 'criteria' as a map of label -> description, or a list of labels"
                    )))
                }
            },
            Kind::Score => match criteria {
                Some(Value::Array(a)) if !a.is_empty() => {
                    let mut levels = Vec::new();
                    for (i, d) in a.iter().enumerate() {
                        if d.is_null() {
                            return Err(bad(format!(
                                "score question {name:?} has a null level at index {i}; give every level a description"
                            )));
                        }
                        levels.push((i.to_string(), Some(render(d))));
                    }
                    levels
                }
                _ => {
                    return Err(bad(format!(
                        "question {name:?}: a score question takes 'criteria' as a list of level descriptions, index 0 first"
                    )))
                }
            },
            Kind::Noul => {
                let mut t = None;
                let mut f = None;
                match criteria {
                    None => {}
                    Some(Value::Object(m)) => {
                        for (k, d) in m {
                            let d = (!d.is_null()).then(|| render(d));
                            match k.to_ascii_lowercase().as_str() {
                                "true" => t = d,
                                "false" => f = d,
                                _ => {
                                    return Err(bad(format!(
                                        "question {name:?}: noul criteria take only 'true' and 'false'"
                                    )))
                                }
                            }
                        }
                    }
                    Some(_) => {
                        return Err(bad(format!(
                            "question {name:?}: noul criteria must be an object with 'true' and 'false'"
                        )))
                    }
                }
                vec![("false".into(), f), ("true".into(), t)]
            }
        };
        if options.is_empty() {
            return Err(bad(format!("question {name:?} has no options")));
        }
        let most = if kind == Kind::Score { MAX_LEVELS } else { MAX_OPTIONS };
        if options.len() > most {
            return Err(bad(format!(
                "question {name:?} has {} options; at most {most} are supported",
                options.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some((k, _)) = options.iter().find(|(k, _)| !seen.insert(k.clone())) {
            return Err(bad(format!("question {name:?}: the label {k:?} appears twice")));
        }
        out.push(Question {
            name: name.clone(),
            kind,
            instructions,
            options,
        });
    }
    Ok(out)
}

/// `min_confidence`: one threshold, or one per bucket with a default.
#[derive(Clone, Debug, PartialEq)]
pub enum MinConfidence {
    All(f64),
    ByBucket(BTreeMap<String, f64>),
}

impl MinConfidence {
    pub fn parse(v: &Value) -> Result<MinConfidence, DecideError> {
        let bad = |m: String| DecideError::Invalid(m);
        let num = |x: &Value| {
            x.as_f64()
                .filter(|f| (0.0..=1.0).contains(f) && !x.is_boolean())
                .ok_or_else(|| bad(format!("min_confidence must be a number in [0.0, 1.0], got {x}")))
        };
        match v {
            Value::Object(m) if !m.is_empty() => {
                let mut out = BTreeMap::new();
                for (k, x) in m {
                    let ok = k == "default"
                        || k.split_once(':').is_some_and(|(t, s)| {
                            ["choice", "score", "noul"].contains(&t) && ["2", "3-5", "6-10", "11+"].contains(&s)
                        });
                    if !ok {
                        return Err(bad(format!(
                            "min_confidence map keys must be a bucket like 'choice:3-5' or 'default', got {k:?}"
                        )));
                    }
                    out.insert(k.clone(), num(x)?);
                }
                Ok(MinConfidence::ByBucket(out))
            }
            Value::Object(_) => Err(bad("a min_confidence map must not be empty".into())),
            x => Ok(MinConfidence::All(num(x)?)),
        }
    }

    /// The threshold for an answer of `kind` with `k` options.
    pub fn threshold(&self, kind: Kind, k: usize) -> f64 {
        match self {
            MinConfidence::All(t) => *t,
            MinConfidence::ByBucket(m) => m
                .get(&bucket(kind, k))
                .or_else(|| m.get("default"))
                .copied()
                .unwrap_or(0.0),
        }
    }
}

/// One answer as Laya writes it.
pub fn answer_json(s: &Scored, min: Option<&MinConfidence>) -> Value {
    let q = &s.question;
    let p = &s.probabilities;
    let k = p.len();
    let r = |x: f32| round4(x as f64);
    let top = p.iter().copied().fold(0.0f32, f32::max) as f64;
    let mut a = Map::new();
    a.insert("type".into(), json!(q.kind.name()));
    let probs: Map<String, Value> = q
        .options
        .iter()
        .zip(p)
        .map(|((key, _), &x)| (key.clone(), json!(r(x))))
        .collect();
    match q.kind {
        Kind::Choice => {
            a.insert("choice".into(), json!(q.options[argmax(p)].0));
            a.insert("probabilities".into(), Value::Object(probs));
        }
        Kind::Score => {
            score_fields(q, p, &mut a);
            a.insert("probabilities".into(), Value::Object(probs));
        }
        Kind::Noul => {
            a.insert("noul".into(), json!(r(p[1])));
            a.insert("probabilities".into(), json!({"false": r(p[0]), "true": r(p[1])}));
        }
    }
    a.insert("confidence".into(), json!(round4(confidence(q.kind, p))));
    a.insert("answer_confidence".into(), json!(round4(top.clamp(0.0, 1.0))));
    if q.kind != Kind::Noul {
        a.insert("x_jev_confidence".into(), json!(round4(jev_confidence(q.kind, p))));
    }
    a.insert("temperature".into(), json!(round4(s.temperature as f64)));
    if let Some(m) = min {
        gate(&mut a, m, q.kind, k, top);
    }
    Value::Object(a)
}

/// A score answer's `score` (the expected level) and `legend`.
pub fn score_fields(q: &Question, p: &[f32], a: &mut Map<String, Value>) {
    let expected: f64 = p.iter().enumerate().map(|(i, &x)| i as f64 * x as f64).sum();
    a.insert("score".into(), json!(round4(expected)));
    let legend: Map<String, Value> = q
        .options
        .iter()
        .map(|(key, d)| (key.clone(), json!(d.clone().unwrap_or_default())))
        .collect();
    a.insert("legend".into(), Value::Object(legend));
}

/// The `min_confidence` gate on one answer: `abstention` (`passed` or
/// `abstained`, comparing `conf` with the threshold of the answer's
/// bucket), `abstention_threshold`, and `low_confidence` when abstained.
pub fn gate(a: &mut Map<String, Value>, m: &MinConfidence, kind: Kind, k: usize, conf: f64) {
    let t = m.threshold(kind, k);
    let passed = conf >= t;
    a.insert("abstention".into(), json!(if passed { "passed" } else { "abstained" }));
    a.insert("abstention_threshold".into(), json!(t));
    if !passed {
        a.insert("low_confidence".into(), json!(true));
    }
}

/// The whole response: `model`, `answers` (in the request's order),
/// `usage`.
pub fn response_json(model: &str, scored: &[Scored], usage: &DecideUsage, min: Option<&MinConfidence>) -> Value {
    let answers: Map<String, Value> = scored
        .iter()
        .map(|s| (s.question.name.clone(), answer_json(s, min)))
        .collect();
    json!({
        "model": model,
        "answers": answers,
        "usage": {
            "input_tokens": usage.input_tokens,
            "output_tokens": 0,
            "state_tokens": usage.state_tokens,
            "cached_tokens": usage.cached_tokens,
        },
    })
}
