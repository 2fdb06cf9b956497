//! Typed decisions on a native Laya checkpoint (a ModernBERT-family
//! encoder with a decision head; see [`snug_model::laya`]), with Laya's
//! request encoding and answers.
//!
//! **Encoding.** Each question becomes one row:
//!
//! ```text
//! [CLS] "<type> question: <instructions>" [SEP] [MASK] " <option 0>" [MASK] " <option 1>" ... [SEP] <state> [SEP]
//! ```
//!
//! Options are rendered as Laya renders them (`label: description`,
//! `level i: description`, `false: ...` / `true: ...`), each cut to 48
//! tokens. The question may take `head_max_len` tokens: when the options
//! leave fewer than 16 for the instructions, every option is cut to
//! `max(4, (head_max_len - 16) / n)` tokens, and the instructions to what
//! is left (at least 8). The state fills the rest of `max_len`: a text or
//! object keeps its start, a conversation (a JSON list) keeps its newest
//! end, and `usage` reports what was dropped. A question whose option
//! markers do not all fit in `max_len` is refused with Laya's capacity
//! error. The mask token is blanked out of every user text.
//!
//! **Answers.** The head gives one logit per option marker; divided by
//! the temperature of the question's type and option-count bucket (from
//! the checkpoint, clamped to [0.5, 5]), a softmax gives the
//! probabilities. Choice answers name the most probable key, score answers
//! the expected level, noul answers P(true); `confidence`,
//! `answer_confidence`, `action.act_probability` and the `min_confidence`
//! gate are as Laya defines them.

use serde_json::{json, Map, Value};
use snug_model::laya::{LayaError, LayaModel, Row, RowOutput};

use crate::decide::{self, clamp_temperature, confidence, round4, DecideError, Kind, MinConfidence, Question};

/// Tokens an option's text may take.
const OPTION_TOKENS: usize = 48;

/// Python's `json.dumps(v, ensure_ascii=False)`, which the SDK renders
/// structured text with (the token ids depend on it).
pub fn py_json(v: &Value) -> String {
    snug_model::template::python_json(v)
}

/// A criterion as text: strings as they are, anything else as JSON.
fn render_criterion(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => py_json(other),
    }
}

/// Python's `str()` of a scalar label.
fn py_str(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        other => other.to_string(),
    }
}

/// A question as the encoder reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct LayaQuestion {
    pub question: Question,
    /// `"<type> question: <instructions>"`.
    pub head_text: String,
    /// Option texts in option order.
    pub options: Vec<String>,
    /// Slot `s` holds option `order[s]`.
    pub order: Option<Vec<usize>>,
}

/// A `/v1/systemone` request, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct LayaRequest {
    pub state: Value,
    pub questions: Vec<LayaQuestion>,
    pub max_len: Option<usize>,
    pub head_max_len: Option<usize>,
    pub min_confidence: Option<MinConfidence>,
}

fn bad(m: String) -> DecideError {
    DecideError::Invalid(m)
}

/// Reads `questions` for the encoder (the checks of
/// [`decide::parse_questions`], then Laya's option texts).
pub fn parse_laya_questions(v: &Value) -> Result<Vec<LayaQuestion>, DecideError> {
    let checked = decide::parse_questions(v)?;
    let Some(obj) = v.as_object() else {
        return Err(bad(
            "'questions' must be an object from question name to question".into()
        ));
    };
    let mut out = Vec::with_capacity(checked.len());
    for question in checked {
        let q = &obj[&question.name];
        let name = &question.name;
        let ins = match &q["instructions"] {
            Value::String(s) => s.clone(),
            other => py_json(other),
        };
        let crit = q
            .get("criteria")
            .or_else(|| q.get("options"))
            .or_else(|| q.get("levels"));
        let options: Vec<String> = match question.kind {
            Kind::Choice => match crit {
                Some(Value::Object(m)) => m
                    .iter()
                    .map(|(k, d)| match d {
                        Value::Null => k.clone(),
                        Value::String(s) if s.is_empty() => k.clone(),
                        d => format!("{k}: {}", render_criterion(d)),
                    })
                    .collect(),
                Some(Value::Array(a)) => a.iter().map(py_str).collect(),
                _ => unreachable!("checked by parse_questions"),
            },
            Kind::Score => match crit {
                Some(Value::Array(a)) => a
                    .iter()
                    .enumerate()
                    .map(|(i, c)| format!("level {i}: {}", render_criterion(c)))
                    .collect(),
                _ => unreachable!("checked by parse_questions"),
            },
            Kind::Noul => {
                let (mut f, mut t) = (None, None);
                if let Some(Value::Object(m)) = crit {
                    for (k, d) in m {
                        let d = match d {
                            Value::Null => None,
                            Value::String(s) if s.is_empty() => None,
                            d => Some(render_criterion(d)),
                        };
                        if k.eq_ignore_ascii_case("true") {
                            t = d;
                        } else {
                            f = d;
                        }
                    }
                }
                let (fl, tl) = noul_labels(name, q.get("labels"))?;
                vec![
                    format!(
                        "{fl}: {}",
                        f.unwrap_or_else(|| "no, the statement does not hold".into())
                    ),
                    format!("{tl}: {}", t.unwrap_or_else(|| "yes, the statement holds".into())),
                ]
            }
        };
        if question.kind != Kind::Noul && q.get("labels").is_some() {
            return Err(bad(format!(
                "question {name:?}: labels is only supported for noul questions"
            )));
        }
        let order = match q.get("option_order") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => {
                let k = options.len();
                let idx: Vec<usize> = a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect();
                let mut seen = vec![false; k];
                let perm = idx.len() == k
                    && a.len() == k
                    && idx.iter().all(|&i| i < k && !std::mem::replace(&mut seen[i], true));
                if !perm {
                    return Err(bad(format!(
                        "question {name:?}: 'option_order' must be a permutation of range({k}) -- one slot per option"
                    )));
                }
                Some(idx)
            }
            Some(_) => return Err(bad(format!("question {name:?}: 'option_order' must be a list"))),
        };
        out.push(LayaQuestion {
            head_text: format!("{} question: {ins}", question.kind.name()),
            question,
            options,
            order,
        });
    }
    Ok(out)
}

fn noul_labels(name: &str, v: Option<&Value>) -> Result<(String, String), DecideError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(("false".into(), "true".into()));
    };
    let err = || {
        bad(format!(
            "question {name:?}: noul labels must map exactly 'false' and 'true' to distinct non-empty strings"
        ))
    };
    let m = v.as_object().ok_or_else(err)?;
    if m.len() != 2 {
        return Err(err());
    }
    let get = |k: &str| {
        m.get(k)
            .and_then(Value::as_str)
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    match (get("false"), get("true")) {
        (Some(f), Some(t)) if f != t => Ok((f, t)),
        _ => Err(err()),
    }
}

fn budget(v: Option<&Value>, name: &str) -> Result<Option<usize>, DecideError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_i64() {
            Some(n) if n > 0 && !x.is_boolean() => {
                if n > 8192 {
                    Err(bad(format!("{name} exceeds server limit ({n} > 8192)")))
                } else {
                    Ok(Some(n as usize))
                }
            }
            Some(_) => Err(bad(format!("{name} must be a positive integer"))),
            None => Err(bad(format!("{name} must be an integer"))),
        },
    }
}

/// Reads a whole request body: `state`, `questions`, and optionally
/// `max_len`, `head_max_len`, `min_confidence`.
pub fn parse_request(body: &Value) -> Result<LayaRequest, DecideError> {
    let state = body
        .get("state")
        .filter(|s| !s.is_null())
        .cloned()
        .ok_or_else(|| bad("'state' is required".into()))?;
    Ok(LayaRequest {
        state,
        questions: parse_laya_questions(body.get("questions").unwrap_or(&Value::Null))?,
        max_len: budget(body.get("max_len"), "max_len")?,
        head_max_len: budget(body.get("head_max_len"), "head_max_len")?,
        min_confidence: match body.get("min_confidence") {
            None | Some(Value::Null) => None,
            Some(v) => Some(MinConfidence::parse(v)?),
        },
    })
}

/// How the head budget treated one question's options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptionStats {
    pub total: usize,
    /// Options whose token spans still differ after the cut.
    pub distinct: usize,
    pub tokens_per_option: Option<usize>,
}

/// One question's encoded row, with what its budget did.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodedQuestion {
    pub row: Row,
    pub options: OptionStats,
    pub state_used: usize,
}

/// A state's rows, one per question.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    pub questions: Vec<EncodedQuestion>,
    pub state_tokens: usize,
}

/// One answered question.
#[derive(Clone, Debug, PartialEq)]
pub struct LayaAnswer {
    pub question: Question,
    pub logits: Vec<f32>,
    pub temperature: f32,
    /// In option order.
    pub probabilities: Vec<f32>,
    pub act_probability: f32,
}

/// A loaded checkpoint with its (clamped) temperatures.
pub struct LayaAgent {
    pub model: LayaModel,
    pub temperatures: decide::Temperatures,
}

impl LayaAgent {
    pub fn open(dir: &std::path::Path, threads: usize) -> Result<LayaAgent, LayaError> {
        let model = LayaModel::open(dir, threads)?;
        let c = &model.config;
        let temperatures = decide::Temperatures {
            temperature: c.temperature.map(|t| clamp_temperature(t as f32)),
            temperature_by_options: c
                .temperature_by_options
                .iter()
                .map(|(k, &t)| (k.clone(), clamp_temperature(t as f32)))
                .collect(),
        };
        Ok(LayaAgent { model, temperatures })
    }

    fn tokens(&self, text: &str) -> Result<Vec<u32>, DecideError> {
        let text = text.replace(&self.model.specials.mask_text, " ");
        self.model
            .tokenizer
            .encode(text.as_str(), false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| DecideError::Template(format!("the tokenizer failed: {e}")))
    }

    /// The question half of a row: ids, marker positions, option stats.
    fn head(&self, q: &LayaQuestion, head_max_len: usize) -> Result<(Vec<u32>, Vec<usize>, OptionStats), DecideError> {
        let sp = &self.model.specials;
        let mut head_ids = self.tokens(&q.head_text)?;
        let k = q.options.len();
        let order: Vec<usize> = q.order.clone().unwrap_or_else(|| (0..k).collect());
        let mut opt_ids = Vec::with_capacity(k);
        for &i in &order {
            let mut t = self.tokens(&format!(" {}", q.options[i]))?;
            t.truncate(OPTION_TOKENS);
            let mut o = Vec::with_capacity(t.len() + 1);
            o.push(sp.mask);
            o.extend(t);
            opt_ids.push(o);
        }
        let hm = head_max_len as i64;
        let total = |o: &[Vec<u32>]| o.iter().map(|x| x.len() as i64).sum::<i64>();
        let mut opt_budget = hm - total(&opt_ids);
        let mut per_option = None;
        if opt_budget < 16 {
            let per = ((hm - 16).div_euclid(k.max(1) as i64)).max(4) as usize;
            per_option = Some(per);
            opt_ids.iter_mut().for_each(|o| o.truncate(per));
            opt_budget = hm - total(&opt_ids);
        }
        head_ids.truncate(opt_budget.max(8) as usize);
        let mut ids = Vec::with_capacity(head_ids.len() + 2 + total(&opt_ids) as usize + 1);
        ids.push(sp.cls);
        ids.extend(head_ids);
        ids.push(sp.sep);
        let mut markers = Vec::with_capacity(k);
        for o in &opt_ids {
            markers.push(ids.len());
            ids.extend_from_slice(o);
        }
        ids.push(sp.sep);
        let distinct = opt_ids.iter().collect::<std::collections::HashSet<_>>().len();
        Ok((
            ids,
            markers,
            OptionStats {
                total: k,
                distinct,
                tokens_per_option: per_option,
            },
        ))
    }

    /// Encodes one state against every question.
    pub fn encode(&self, req: &LayaRequest, state: &Value) -> Result<Encoded, DecideError> {
        let max_len = req.max_len.unwrap_or(self.model.config.max_len);
        let head_max_len = req.head_max_len.unwrap_or(self.model.config.head_max_len);
        let text = match state {
            Value::String(s) => s.clone(),
            other => py_json(other),
        };
        let left = state.is_array();
        let state_ids = self.tokens(&text)?;
        let mut questions = Vec::with_capacity(req.questions.len());
        for q in &req.questions {
            let (mut ids, mut markers, stats) = self.head(q, head_max_len)?;
            let room = max_len.saturating_sub(ids.len() + 1);
            let st = if left {
                &state_ids[state_ids.len().saturating_sub(room)..]
            } else {
                &state_ids[..room.min(state_ids.len())]
            };
            let used = st.len();
            ids.extend_from_slice(st);
            ids.push(self.model.specials.sep);
            ids.truncate(max_len);
            markers.retain(|&m| m < max_len);
            if markers.len() != stats.total {
                return Err(DecideError::Capacity(format!(
                    "question '{}': only {} of its {} option markers fit in max_len={max_len} with head_max_len={head_max_len} spent on the question; lower head_max_len, raise max_len, or use fewer options",
                    q.question.name,
                    markers.len(),
                    stats.total
                )));
            }
            let qtype = q.question.kind as usize;
            questions.push(EncodedQuestion {
                row: Row { ids, markers, qtype },
                options: stats,
                state_used: used,
            });
        }
        Ok(Encoded {
            questions,
            state_tokens: state_ids.len(),
        })
    }

    /// Turns one row's output into probabilities.
    pub fn answer_row(&self, q: &LayaQuestion, out: &RowOutput) -> LayaAnswer {
        let k = out.logits.len();
        let t = self.temperatures.get(q.question.kind, k);
        let z: Vec<f32> = out.logits.iter().map(|&x| x / t).collect();
        let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = z.iter().map(|&x| (x - m).exp()).collect();
        let s: f32 = e.iter().sum();
        let slots: Vec<f32> = e.iter().map(|&x| x / s).collect();
        let probabilities = match &q.order {
            Some(order) => {
                let mut p = vec![0f32; k];
                for (slot, &opt) in order.iter().enumerate() {
                    p[opt] = slots[slot];
                }
                p
            }
            None => slots,
        };
        let am = out.act.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let ae: Vec<f32> = out.act.iter().map(|&x| (x - am).exp()).collect();
        let act_probability = ae[0] / ae.iter().sum::<f32>();
        LayaAnswer {
            question: q.question.clone(),
            logits: out.logits.clone(),
            temperature: t,
            probabilities,
            act_probability,
        }
    }

    /// Answers `req` about each of `states` in one forward; a response
    /// object per state.
    pub fn answer_states(
        &self,
        req: &LayaRequest,
        states: &[Value],
    ) -> Result<Vec<(Value, Vec<LayaAnswer>)>, DecideError> {
        self.answer_jobs(&[(req, states)]).remove(0)
    }

    /// Answers several requests (each about one or more states) in one
    /// forward: every question of every state is a row of the same batch.
    /// A request that cannot be encoded gets its error; the others are
    /// answered. Rows are computed independently, so each answer is the
    /// same bits as when its request is answered alone.
    #[allow(clippy::type_complexity)]
    pub fn answer_jobs(
        &self,
        jobs: &[(&LayaRequest, &[Value])],
    ) -> Vec<Result<Vec<(Value, Vec<LayaAnswer>)>, DecideError>> {
        let encoded: Vec<Result<Vec<Encoded>, DecideError>> = jobs
            .iter()
            .map(|(req, states)| states.iter().map(|s| self.encode(req, s)).collect())
            .collect();
        let rows: Vec<Row> = encoded
            .iter()
            .flatten()
            .flat_map(|es| es.iter().flat_map(|e| e.questions.iter().map(|q| q.row.clone())))
            .collect();
        let outs = self.model.forward(&rows);
        let mut at = 0;
        let empty = json!({"model": "laya-rl-agent", "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}});
        jobs.iter()
            .zip(encoded)
            .map(|((req, states), enc)| {
                let enc = enc?;
                if req.questions.is_empty() {
                    return Ok(states.iter().map(|_| (empty.clone(), Vec::new())).collect());
                }
                Ok(enc
                    .iter()
                    .map(|e| {
                        let answers: Vec<LayaAnswer> = req
                            .questions
                            .iter()
                            .zip(&outs[at..at + e.questions.len()])
                            .map(|(q, o)| self.answer_row(q, o))
                            .collect();
                        at += e.questions.len();
                        (response_json(req, e, &answers), answers)
                    })
                    .collect())
            })
            .collect()
    }

    /// Answers one request.
    pub fn answer(&self, req: &LayaRequest) -> Result<(Value, Vec<LayaAnswer>), DecideError> {
        let mut r = self.answer_states(req, std::slice::from_ref(&req.state))?;
        Ok(r.remove(0))
    }
}

/// One answer as Laya writes it.
fn answer_json(a: &LayaAnswer, min: Option<&MinConfidence>) -> Value {
    let q = &a.question;
    let p = &a.probabilities;
    let k = p.len();
    let r = |x: f32| round4(x as f64);
    let top = p.iter().copied().fold(0.0f32, f32::max) as f64;
    let answer_conf = round4(if k < 1 { 1.0 } else { top.clamp(0.0, 1.0) });
    let mut o = Map::new();
    o.insert("type".into(), json!(q.kind.name()));
    match q.kind {
        Kind::Choice => {
            o.insert("choice".into(), json!(q.options[decide::argmax(p)].0));
            let probs: Map<String, Value> = q
                .options
                .iter()
                .zip(p)
                .map(|((key, _), &x)| (key.clone(), json!(r(x))))
                .collect();
            o.insert("probabilities".into(), Value::Object(probs));
            o.insert("confidence".into(), json!(round4(confidence(q.kind, p))));
        }
        Kind::Score => {
            decide::score_fields(q, p, &mut o);
            let probs: Map<String, Value> = (0..k).map(|i| (i.to_string(), json!(r(p[i])))).collect();
            o.insert("probabilities".into(), Value::Object(probs));
            o.insert("confidence".into(), json!(round4(confidence(q.kind, p))));
        }
        Kind::Noul => {
            o.insert("noul".into(), json!(r(p[1])));
            o.insert("confidence".into(), json!(round4(confidence(q.kind, p))));
        }
    }
    o.insert("answer_confidence".into(), json!(answer_conf));
    o.insert("action".into(), json!({"act_probability": r(a.act_probability)}));
    if let Some(m) = min {
        decide::gate(&mut o, m, q.kind, k, answer_conf);
    }
    Value::Object(o)
}

/// The response for one state: `model`, `answers`, `usage`.
pub fn response_json(req: &LayaRequest, enc: &Encoded, answers: &[LayaAnswer]) -> Value {
    let out: Map<String, Value> = answers
        .iter()
        .map(|a| (a.question.name.clone(), answer_json(a, req.min_confidence.as_ref())))
        .collect();
    let dropped = enc
        .questions
        .iter()
        .map(|q| enc.state_tokens - q.state_used)
        .max()
        .unwrap_or(0);
    let truncated: Vec<&str> = enc
        .questions
        .iter()
        .zip(&req.questions)
        .filter(|(e, _)| e.state_used < enc.state_tokens)
        .map(|(_, q)| q.question.name.as_str())
        .collect();
    let mut usage = json!({
        "input_tokens": enc.questions.iter().map(|q| q.row.ids.len()).sum::<usize>(),
        "output_tokens": 0,
        "state_tokens": enc.state_tokens,
        "state_tokens_dropped": dropped,
        "truncated": dropped > 0,
        "truncated_questions": truncated,
    });
    let collapsed: Map<String, Value> = enc
        .questions
        .iter()
        .zip(&req.questions)
        .filter(|(e, _)| e.options.distinct < e.options.total)
        .map(|(e, q)| {
            (
                q.question.name.clone(),
                json!({"total": e.options.total, "distinct": e.options.distinct, "tokens_per_option": e.options.tokens_per_option}),
            )
        })
        .collect();
    if !collapsed.is_empty() {
        usage["options"] = Value::Object(collapsed);
    }
    json!({"model": "laya-rl-agent", "answers": out, "usage": usage})
}
