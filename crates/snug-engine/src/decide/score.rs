//! Scoring questions on the engine: branches of a state's sequence run
//! as one batch, label log-probabilities read from their logits.

use snug_model::Tokenizer;

use super::framing::{label, label_tokens, label_variants};
use super::*;
use crate::StepRow;
use crate::{Engine, SeqId};

/// One question's result before it is written out.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub question: Question,
    /// Log-probability of each option's label after the state.
    pub raw: Vec<f32>,
    /// `raw` less the label's log-probability after the content-free
    /// state: the scores the temperature divides.
    pub logprobs: Vec<f32>,
    pub temperature: f32,
    pub probabilities: Vec<f32>,
}

/// The softmax of `z / t`.
pub fn softmax_t(z: &[f32], t: f32) -> Vec<f32> {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = z.iter().map(|&x| (((x - m) / t) as f64).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|&x| (x / s) as f32).collect()
}

/// Log-softmax value of one token in a row of logits, in f64.
fn ln_p(row: &[f32], id: u32) -> f64 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m as f64 + row.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln();
    row[id as usize] as f64 - lse
}

/// Log-softmax value of `ids` (summed in probability) in a row of logits.
fn logprob_of(row: &[f32], ids: &[u32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m as f64 + row.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln();
    let p: f64 = ids.iter().map(|&i| ((row[i as usize] as f64) - lse).exp()).sum();
    p.max(1e-30).ln() as f32
}

/// The log-probability of each of `q`'s option labels in one row of
/// logits (the row after the question's last token).
pub fn score_row(tok: &Tokenizer, q: &Question, row: &[f32]) -> Vec<f32> {
    let k = q.options.len();
    (0..k)
        .map(|i| logprob_of(row, &label_tokens(tok, &label(q.kind, k, i))))
        .collect()
}

/// What a decision request used.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecideUsage {
    /// State tokens plus every question's tokens.
    pub input_tokens: usize,
    pub state_tokens: usize,
    /// State tokens taken from the prefix cache.
    pub cached_tokens: usize,
}

impl Engine<'_> {
    /// Answers `questions` about `state` (see the module's notes). Each
    /// question is a branch of the state's sequence; all branches run in
    /// one forward pass.
    pub fn decide(
        &mut self,
        tok: &Tokenizer,
        framing: &Framing,
        state: &str,
        questions: &[Question],
        temps: &Temperatures,
    ) -> Result<(Vec<Scored>, DecideUsage), DecideError> {
        let state_ids = framing.state_tokens(tok, state);
        let branches: Vec<Vec<u32>> = questions.iter().map(|q| framing.question_tokens(tok, q)).collect();
        let (limit, fits) = (self.context_limit(), self.options.ctx);
        for (q, b) in questions.iter().zip(&branches) {
            let needed = state_ids.len() + b.len();
            if needed > limit {
                return Err(DecideError::TooLong {
                    question: q.name.clone(),
                    state: state_ids.len(),
                    question_tokens: b.len(),
                    needed,
                    limit,
                });
            }
            if needed > fits {
                return Err(DecideError::OverBudget {
                    question: q.name.clone(),
                    needed,
                    fits,
                });
            }
        }
        // Per question, per option: the label's spellings.
        let labels: Vec<Vec<Vec<Vec<u32>>>> = questions
            .iter()
            .map(|q| {
                let k = q.options.len();
                (0..k).map(|i| label_variants(tok, &label(q.kind, k, i))).collect()
            })
            .collect();
        if let Some((q, _)) = questions.iter().zip(&labels).find(|(_, l)| l.iter().any(Vec::is_empty)) {
            return Err(DecideError::Invalid(format!(
                "question {:?}: an option label has no tokens in this model's vocabulary",
                q.name
            )));
        }
        let mut usage = DecideUsage {
            input_tokens: state_ids.len() + branches.iter().map(Vec::len).sum::<usize>(),
            state_tokens: state_ids.len(),
            cached_tokens: 0,
        };
        if questions.is_empty() {
            return Ok((Vec::new(), usage));
        }
        // Questions whose content-free prior is not known yet.
        let neutral = framing.state_tokens(tok, NEUTRAL_STATE);
        let prior_key = |b: &Vec<u32>| -> Vec<u32> { neutral.iter().chain(b).copied().collect() };
        let mut missing: Vec<usize> = Vec::new();
        for (i, b) in branches.iter().enumerate() {
            let k = prior_key(b);
            if !self.decide_priors.contains_key(&k) && !missing.iter().any(|&j| prior_key(&branches[j]) == k) {
                missing.push(i);
            }
        }
        let seq = self.create_sequence();
        let prior_seq = if missing.is_empty() {
            None
        } else {
            Some(self.create_sequence())
        };
        let mut seqs: Vec<SeqId> = Vec::new();
        // (branch, option, spelling, first row in the second forward)
        let mut conts: Vec<(usize, usize, usize, usize)> = Vec::new();
        let result = (|| -> Result<(Vec<f32>, Vec<f32>), DecideError> {
            usage.cached_tokens = self.share_prefix(seq, &state_ids)?;
            let held = self.tokens(seq)?.len();
            let mut rest: Vec<StepRow> = state_ids[held..].iter().map(|&t| StepRow::new(seq, t, false)).collect();
            if let Some(p) = prior_seq {
                rest.extend(neutral.iter().map(|&t| StepRow::new(p, t, false)));
            }
            if !rest.is_empty() {
                self.step(&rest)?;
            }
            for _ in questions {
                seqs.push(self.fork(seq)?);
            }
            if let Some(p) = prior_seq {
                for _ in &missing {
                    seqs.push(self.fork(p)?);
                }
            }
            let mut rows = Vec::with_capacity(usage.input_tokens);
            let order: Vec<usize> = (0..questions.len()).chain(missing.iter().copied()).collect();
            for (&s, &i) in seqs.iter().zip(&order) {
                let b = &branches[i];
                rows.extend(b.iter().enumerate().map(|(j, &t)| StepRow::new(s, t, j + 1 == b.len())));
            }
            let first = self.step(&rows)?.to_vec();
            // Labels of several tokens: each spelling's tokens but the last
            // are fed to a fork of its branch, in one more forward, for the
            // probabilities of the tokens after the first.
            let mut more = Vec::new();
            for (j, &i) in order.iter().enumerate() {
                for (o, variants) in labels[i].iter().enumerate() {
                    for (v, ids) in variants.iter().enumerate().filter(|(_, ids)| ids.len() > 1) {
                        let c = self.fork(seqs[j])?;
                        seqs.push(c);
                        conts.push((j, o, v, more.len()));
                        more.extend(ids[..ids.len() - 1].iter().map(|&t| StepRow::new(c, t, true)));
                    }
                }
            }
            let second = if more.is_empty() {
                Vec::new()
            } else {
                self.step(&more)?.to_vec()
            };
            Ok((first, second))
        })();
        for &s in &seqs {
            self.free_sequence(s);
        }
        if let Some(p) = prior_seq {
            self.free_sequence(p);
        }
        self.free_sequence(seq);
        let (logits, second) = result?;
        let vocab = self.model.config.vocab;
        // A branch's label scores: one-token spellings from its last row;
        // longer ones chained through the second forward's rows.
        let scores = |j: usize, i: usize| -> Vec<f32> {
            let row = &logits[j * vocab..(j + 1) * vocab];
            labels[i]
                .iter()
                .enumerate()
                .map(|(o, variants)| {
                    if variants.iter().all(|v| v.len() == 1) {
                        let ids: Vec<u32> = variants.iter().map(|v| v[0]).collect();
                        return logprob_of(row, &ids);
                    }
                    let p: f64 = variants
                        .iter()
                        .enumerate()
                        .map(|(v, ids)| {
                            let mut lp = ln_p(row, ids[0]);
                            if let Some(&(_, _, _, at)) = conts.iter().find(|c| c.0 == j && c.1 == o && c.2 == v) {
                                for (m, &t) in ids[1..].iter().enumerate() {
                                    let r = &second[(at + m) * vocab..(at + m + 1) * vocab];
                                    lp += ln_p(r, t);
                                }
                            }
                            lp.exp()
                        })
                        .sum();
                    p.max(1e-30).ln() as f32
                })
                .collect()
        };
        for (n, &i) in missing.iter().enumerate() {
            let prior = scores(questions.len() + n, i);
            self.decide_priors.insert(prior_key(&branches[i]), prior);
        }
        let scored = questions
            .iter()
            .zip(&branches)
            .enumerate()
            .map(|(i, (q, b))| {
                let raw = scores(i, i);
                let prior = &self.decide_priors[&prior_key(b)];
                let logprobs: Vec<f32> = raw.iter().zip(prior).map(|(r, p)| r - p).collect();
                let t = temps.get(q.kind, q.options.len());
                Scored {
                    question: q.clone(),
                    probabilities: softmax_t(&logprobs, t),
                    raw,
                    logprobs,
                    temperature: t,
                }
            })
            .collect();
        Ok((scored, usage))
    }
}

/// Laya's confidence: 1 - H(p)/ln k (choice, score); max(p, 1-p) for noul.
pub fn confidence(kind: Kind, p: &[f32]) -> f64 {
    let k = p.len();
    if kind == Kind::Noul {
        let t = p[1] as f64;
        return t.max(1.0 - t);
    }
    if k < 2 {
        return 1.0;
    }
    let h: f64 = p
        .iter()
        .map(|&x| {
            let x = (x as f64).clamp(1e-12, 1.0);
            -x * x.ln()
        })
        .sum();
    (1.0 - h / (k as f64).ln()).clamp(0.0, 1.0)
}

/// Jev's confidence, as Laya adds it for choice and score answers:
/// choice, (max p - 1/n) / (1 - 1/n); score, 1 - (the mean distance of the
/// distribution from its mode) / (that of a uniform one from the middle),
/// at least 0. One option: 1.
pub fn jev_confidence(kind: Kind, p: &[f32]) -> f64 {
    let n = p.len();
    let sum: f64 = p.iter().map(|&x| x as f64).sum();
    if n <= 1 || sum <= 0.0 {
        return 1.0;
    }
    let p: Vec<f64> = p.iter().map(|&x| x as f64 / sum).collect();
    let nf = n as f64;
    match kind {
        Kind::Score => {
            let mode = p.iter().enumerate().fold(0, |b, (i, &x)| if x > p[b] { i } else { b });
            let spread: f64 = p
                .iter()
                .enumerate()
                .map(|(i, &x)| x * (i as f64 - mode as f64).abs())
                .sum();
            let d: f64 = (0..n).map(|i| (i as f64 - (nf - 1.0) / 2.0).abs()).sum::<f64>() / nf;
            (1.0 - spread / d).max(0.0)
        }
        _ => {
            let top = p.iter().copied().fold(0.0, f64::max);
            (top - 1.0 / nf) / (1.0 - 1.0 / nf)
        }
    }
}

/// The index of the first of the highest probabilities.
pub fn argmax(p: &[f32]) -> usize {
    crate::sampling::argmax(p) as usize
}

/// Rounded to 4 decimals, as Laya writes every number.
pub fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}
