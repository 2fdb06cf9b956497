//! Generating text for one sequence: reuse whatever prefix of the prompt
//! the sequence already holds, prefill the rest, then decode until an
//! end-of-generation token, a stop string, the token limit or the context
//! limit.
//!
//! Decoding may speculate: the drafter proposes the tokens that followed
//! the latest earlier occurrence of the last few tokens; the sampled token
//! and the draft run as one batch through the forward path; each row's
//! target is sampled exactly as plain decoding would sample that position
//! (same logits, by batch invariance; same history; same counter-based
//! random draw), drafts are kept while they equal their targets, and the
//! rest is rolled back by truncating the page table. So the output is the
//! same, byte for byte, with speculation on or off.
//!
//! A request may carry a grammar ([`crate::grammar`]): every token is then
//! sampled under the grammar's mask for its position. Drafts are cut to the
//! prefix the grammar accepts (and never run past an end-of-generation
//! token), verification masks each row with the state after the rows
//! before it, and the grammar is rolled back to where plain decoding would
//! stand; so the output stays the same with speculation on or off.

use std::collections::VecDeque;
use std::time::Instant;

use serde::Serialize;
use snug_core::draft::PromptLookup;
use snug_core::speculate::{Mode, Policy};
use snug_model::tokenizer::{StreamDecoder, Tokenizer};

use crate::grammar::Constraint;
use crate::sampling::{Sampler, SamplingParams};
use crate::StepRow;
use crate::{Engine, EngineError, SeqId};

/// N-gram sizes the drafter matches, longest first.
pub const DRAFT_MIN_N: usize = 2;
pub const DRAFT_MAX_N: usize = 4;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    /// Generation stops before any of these strings; they are not emitted.
    pub stop: Vec<String>,
    /// Speculative decoding (never changes the output).
    pub speculate: Mode,
    /// A grammar the output must follow, from its start.
    pub constraint: Option<Constraint>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// The token limit or the context limit.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Timing of one generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GenerateStats {
    pub ttft_ms: f64,
    pub prefill_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tokens: usize,
    pub decode_tok_s: f64,
    pub speculation: SpecStats,
    /// Time spent in the grammar engine (masks, checks), when the request
    /// has a grammar.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grammar_ms: Option<f64>,
}

/// What speculation did during one generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SpecStats {
    pub mode: &'static str,
    /// Verify forwards (a sampled token plus its draft).
    pub rounds: usize,
    /// Draft tokens verified.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// `accepted / drafted`.
    pub acceptance_rate: f64,
    /// Accepted draft tokens per verify round.
    pub mean_accepted: f64,
    /// Plain decode steps taken with speculation on or auto: no draft
    /// found, or the policy judged it unprofitable.
    pub fallbacks: usize,
    pub verify_ms: f64,
    pub decode_ms: f64,
    /// Bytes the drafter's index held at its largest.
    pub state_bytes: usize,
}

/// The result of a generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated tokens (without an end-of-generation token).
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Whether a stop string (rather than an end-of-generation token)
    /// ended it.
    pub stopped_by_string: bool,
    /// Why the limit was hit, when `finish_reason` is `Length` because of
    /// the context.
    pub context_full: bool,
    pub prompt_tokens: usize,
    /// Prompt tokens already in the sequence's KV cache and not prefilled.
    pub reused_tokens: usize,
    pub stats: GenerateStats,
}

/// Longest common prefix of two token lists.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Holds back streamed text that might be the start of a stop string.
#[derive(Debug)]
struct StopFilter {
    stops: Vec<String>,
    pending: String,
}

impl StopFilter {
    /// Adds text; returns what can be emitted and whether a stop was hit.
    fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// The forward a decoding asked for last, to interpret its logits.
#[derive(Debug)]
enum Pending {
    None,
    /// One row: the sampled token.
    Plain,
    /// The sampled token and a draft; `held` positions before it.
    Verify {
        draft: Vec<u32>,
        held: usize,
        matched: usize,
    },
}

/// One generation as a state machine, so that a loop can advance many of
/// them in one batched forward: [`Decoding::start`] reuses what the
/// sequence holds and leaves the rest of the prompt to feed
/// ([`Decoding::prompt_left`], [`Decoding::prefilled`]); then
/// [`Decoding::next_rows`] emits every token already decided and says which
/// tokens the next forward appends (the sampled token, and a draft to
/// verify behind it); [`Decoding::absorb`] takes that forward's logits;
/// [`Decoding::finish`] settles the sequence. [`Engine::generate`] is this
/// loop for one sequence. Whatever batch the rows ride in, the output is the
/// same (batch invariance), so a request decoded beside others gives what
/// it gives alone.
pub struct Decoding {
    pub seq: SeqId,
    req: GenerateRequest,
    start: Instant,
    sampler: Sampler,
    history: Vec<u32>,
    out_tokens: Vec<u32>,
    text: String,
    decoder: StreamDecoder,
    stops: StopFilter,
    finish: Option<FinishReason>,
    stopped_by_string: bool,
    context_full: bool,
    stats: GenerateStats,
    spec: SpecStats,
    policy: Policy,
    calibrated: bool,
    drafter: PromptLookup,
    /// Tokens already sampled and not yet emitted, each with whether its
    /// KV is already written (accepted drafts) or not (the last one).
    ready: VecDeque<(u32, bool)>,
    logits: Vec<f32>,
    reuse: usize,
    recomputed: usize,
    /// Prompt tokens fed so far, from `reuse` on.
    fed: usize,
    decode_start: Option<Instant>,
    pending: Pending,
    step_start: Instant,
    constraint: Option<Constraint>,
    /// Logits under the constraint's mask.
    masked: Vec<f32>,
    /// The grammar allowed nothing after the tokens in `ready`: the
    /// generation ends when they are emitted.
    finish_after_ready: bool,
}

impl Decoding {
    /// Samples the token at the next position of the history from `row`
    /// (the logits kept from the last forward when `None`), under the
    /// grammar's mask when there is one; `None` when the grammar allows no
    /// token at all.
    fn pick(&mut self, row: Option<&[f32]>) -> Result<Option<u32>, EngineError> {
        let Decoding {
            sampler,
            constraint,
            masked,
            logits,
            history,
            req,
            ..
        } = self;
        let logits: &[f32] = row.unwrap_or(logits);
        let (params, position) = (&req.params, history.len() as u64);
        match constraint {
            None => Ok(Some(sampler.sample(logits, history, params, position))),
            Some(c) => {
                // Greedy: when the grammar accepts the best token, take it;
                // checking one token costs far less than a whole mask. (The
                // choice depends only on the logits and the grammar's state,
                // so plain decoding and verification make it alike.)
                if params.temperature <= 0.0 {
                    let best = sampler.sample(logits, history, params, position);
                    if c.valid_prefix(&[best]) == 1 {
                        return Ok(Some(best));
                    }
                }
                if !c.mask(logits, masked)? {
                    return Ok(None);
                }
                Ok(Some(sampler.sample(masked, history, params, position)))
            }
        }
    }

    /// Starts generating `req` on `seq`: reuses the prefix of the prompt
    /// the sequence holds (an empty sequence first takes what the prefix
    /// cache holds); at least the last prompt token is left to feed, so
    /// that its logits are computed.
    pub fn start(engine: &mut Engine, seq: SeqId, req: GenerateRequest) -> Result<Decoding, EngineError> {
        let start = Instant::now();
        if req.prompt.len() > engine.options.ctx {
            return Err(EngineError::ContextFull {
                len: 0,
                adding: req.prompt.len(),
                limit: engine.options.ctx,
            });
        }
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let rows_before = engine.rows_computed();
        engine.share_prefix(seq, &req.prompt)?;
        // With lossy pages sharing computes the first page itself.
        let recomputed = (engine.rows_computed() - rows_before) as usize;
        let cached = engine.tokens(seq)?;
        let mut reuse = common_prefix(cached, &req.prompt);
        if reuse == req.prompt.len() {
            reuse = reuse.saturating_sub(1);
        }
        engine.truncate(seq, reuse)?;
        Ok(Decoding {
            seq,
            start,
            sampler: Sampler::default(),
            history: req.prompt.clone(),
            out_tokens: Vec::new(),
            text: String::new(),
            decoder: StreamDecoder::new(false),
            stops: StopFilter {
                stops: req.stop.clone(),
                pending: String::new(),
            },
            finish: None,
            stopped_by_string: false,
            context_full: false,
            stats: GenerateStats {
                prefill_tokens: req.prompt.len() - reuse + recomputed,
                ..Default::default()
            },
            spec: SpecStats {
                mode: req.speculate.as_str(),
                ..Default::default()
            },
            policy: Policy::new(req.speculate, &[]),
            calibrated: false,
            drafter: PromptLookup::new(DRAFT_MIN_N, DRAFT_MAX_N),
            ready: VecDeque::new(),
            logits: Vec::new(),
            reuse,
            recomputed,
            fed: 0,
            decode_start: None,
            pending: Pending::None,
            step_start: start,
            constraint: req.constraint.clone(),
            masked: Vec::new(),
            finish_after_ready: false,
            req,
        })
    }

    /// Prompt tokens not fed yet.
    pub fn prompt_left(&self) -> &[u32] {
        &self.req.prompt[self.reuse + self.fed..]
    }

    /// Prompt tokens reused from the sequence or the prefix cache.
    pub fn reused_tokens(&self) -> usize {
        self.reuse.saturating_sub(self.recomputed)
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.out_tokens.len()
    }

    pub fn request(&self) -> &GenerateRequest {
        &self.req
    }

    /// Records that the next `n` prompt tokens were fed; with the last of
    /// them, `logits` are the last row's.
    pub fn prefilled(&mut self, n: usize, logits: Option<&[f32]>) {
        self.fed += n;
        if self.prompt_left().is_empty() {
            let logits = logits.expect("the last prompt row's logits");
            self.logits.clear();
            self.logits.extend_from_slice(logits);
            let secs = self.start.elapsed().as_secs_f64();
            self.stats.prefill_tok_s = self.stats.prefill_tokens as f64 / secs.max(1e-9);
            self.decode_start = Some(Instant::now());
        }
    }

    /// Whether the generation has ended (then [`Decoding::finish`]).
    pub fn is_done(&self) -> bool {
        self.finish.is_some() || self.context_full
    }

    /// Ends the generation early (the scheduler needed its pages):
    /// finish reason `length`.
    pub fn stop(&mut self) {
        if self.finish.is_none() {
            self.finish = Some(FinishReason::Length);
        }
    }

    /// Emits the tokens already decided (through `on_text`) until a
    /// forward is needed; returns the tokens it appends to the sequence
    /// (the sampled token, then up to `max_draft` draft tokens to verify),
    /// or `None` when the generation is over. The prompt must be fed.
    pub fn next_rows(
        &mut self,
        engine: &mut Engine,
        tok: &Tokenizer,
        max_draft: usize,
        mut on_text: impl FnMut(&str),
    ) -> Result<Option<Vec<u32>>, EngineError> {
        debug_assert!(self.prompt_left().is_empty(), "feed the prompt first");
        let seq = self.seq;
        while !self.is_done() && self.out_tokens.len() < self.req.max_tokens {
            let (next, in_kv) = match self.ready.pop_front() {
                Some(r) => r,
                None if self.finish_after_ready => {
                    self.finish = Some(FinishReason::Stop);
                    break;
                }
                None => {
                    match self.pick(None)? {
                        Some(t) => (t, false),
                        // The grammar allows nothing more: it is complete.
                        None => {
                            self.finish = Some(FinishReason::Stop);
                            break;
                        }
                    }
                }
            };
            if self.out_tokens.is_empty() {
                self.stats.ttft_ms = self.start.elapsed().as_secs_f64() * 1e3;
            }
            if tok.is_eog(next) {
                self.finish = Some(FinishReason::Stop);
                break;
            }
            if let Some(c) = &mut self.constraint {
                c.consume(next)?;
            }
            self.out_tokens.push(next);
            self.history.push(next);
            let piece = self.decoder.push(tok, next);
            let (emit, stopped) = self.stops.push(&piece);
            self.text.push_str(&emit);
            on_text(&emit);
            if stopped {
                self.finish = Some(FinishReason::Stop);
                self.stopped_by_string = true;
                break;
            }
            if self.out_tokens.len() == self.req.max_tokens {
                break;
            }
            if in_kv {
                continue;
            }
            let held = engine.tokens(seq)?.len();
            if held + 1 > engine.options.ctx {
                self.context_full = true;
                break;
            }
            // Draft: at most what fits in the context and is still wanted
            // (the sampled token itself takes one place of each).
            let room = (engine.options.ctx - held - 1)
                .min(self.req.max_tokens - self.out_tokens.len())
                .min(max_draft);
            let mut k = 0;
            let mut matched = 0;
            if self.req.speculate != Mode::Off && room > 0 {
                self.drafter.sync(&self.history);
                self.spec.state_bytes = self.spec.state_bytes.max(self.drafter.bytes());
                let (found, n) = self.drafter.draft_match(room.min(self.policy.max_draft));
                let mut available = found.len();
                if let Some(c) = &mut self.constraint {
                    // Only what the grammar accepts, and nothing past an
                    // end of generation (the grammar is not advanced
                    // through one).
                    let before_eog = found.iter().position(|&t| tok.is_eog(t)).unwrap_or(found.len());
                    available = c.valid_prefix(&found[..before_eog]);
                }
                matched = n;
                if available > 0 && self.req.speculate == Mode::Auto && !self.calibrated {
                    self.calibrated = true;
                    // The first time a draft is on offer: what do verify
                    // forwards cost on this machine (measured once per
                    // engine, then refined by every step)?
                    for (rows, secs) in engine.speculation_costs(seq, next)? {
                        self.policy.observe(rows, secs);
                    }
                }
                k = self.policy.draft_len(available, matched);
            }
            // A verify that the page pool cannot hold becomes a plain step
            // (which it can: the pages the sampled token needs are fewer).
            if k > 0 && !engine.has_room(seq, k + 1)? {
                k = 0;
            }
            self.step_start = Instant::now();
            if k == 0 {
                self.pending = Pending::Plain;
                return Ok(Some(vec![next]));
            }
            let draft: Vec<u32> = self.drafter.draft(k).to_vec();
            let mut rows = Vec::with_capacity(k + 1);
            rows.push(next);
            rows.extend_from_slice(&draft);
            self.pending = Pending::Verify { draft, held, matched };
            return Ok(Some(rows));
        }
        if self.finish.is_none() {
            self.finish = Some(FinishReason::Length);
        }
        Ok(None)
    }

    /// Takes the logits of the rows [`Decoding::next_rows`] returned (one
    /// row each, in order). `timed`: the forward ran these rows alone, so
    /// its time may refine the speculation policy.
    pub fn absorb(&mut self, engine: &mut Engine, logits: &[f32], timed: bool) -> Result<(), EngineError> {
        let secs = self.step_start.elapsed().as_secs_f64();
        let vocab = engine.model.config.vocab;
        match std::mem::replace(&mut self.pending, Pending::None) {
            Pending::None => panic!("absorb without a forward"),
            Pending::Plain => {
                self.logits.clear();
                self.logits.extend_from_slice(&logits[..vocab]);
                if self.req.speculate != Mode::Off {
                    self.spec.fallbacks += 1;
                    if timed {
                        self.policy.observe(1, secs);
                    }
                }
                self.spec.decode_ms += secs * 1e3;
            }
            Pending::Verify { draft, held, matched } => {
                if timed {
                    self.policy.observe(draft.len() + 1, secs);
                }
                let base = self.history.len();
                let mut accepted = 0;
                let mut dead_end = false;
                for (i, &d) in draft.iter().enumerate() {
                    let Some(target) = self.pick(Some(&logits[i * vocab..(i + 1) * vocab]))? else {
                        dead_end = true;
                        break;
                    };
                    if target != d {
                        self.ready.push_back((target, false));
                        break;
                    }
                    accepted += 1;
                    self.ready.push_back((target, true));
                    self.history.push(target);
                    if let Some(c) = &mut self.constraint {
                        c.consume(target)?;
                    }
                }
                if accepted == draft.len() && !dead_end {
                    let picked = self.pick(Some(&logits[draft.len() * vocab..(draft.len() + 1) * vocab]))?;
                    dead_end = picked.is_none();
                    if let Some(target) = picked {
                        self.ready.push_back((target, false));
                    }
                }
                if dead_end {
                    // Plain decoding would stop where the grammar allows
                    // nothing: after the accepted drafts.
                    self.finish_after_ready = true;
                }
                // The emitting loop pushes these again as it reaches them.
                self.history.truncate(base);
                if let Some(c) = &mut self.constraint {
                    c.rollback(accepted)?;
                }
                engine.truncate(self.seq, held + 1 + accepted)?;
                self.policy.record(matched, draft.len(), accepted);
                self.spec.rounds += 1;
                self.spec.drafted += draft.len();
                self.spec.accepted += accepted;
                self.spec.verify_ms += self.step_start.elapsed().as_secs_f64() * 1e3;
            }
        }
        Ok(())
    }

    /// Settles the sequence (it keeps what plain decoding would have fed)
    /// and returns the result; the last of the text goes to `on_text`.
    pub fn finish(
        mut self,
        engine: &mut Engine,
        tok: &Tokenizer,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation, EngineError> {
        let _ = tok;
        let seq = self.seq;
        let mut finish = self.finish.unwrap_or(FinishReason::Length);
        // Every emitted token but the last, or all of them when an
        // end-of-generation token ended it (accepted drafts may be ahead).
        let fed = if finish == FinishReason::Stop && !self.stopped_by_string {
            self.out_tokens.len()
        } else {
            self.out_tokens.len().saturating_sub(1)
        };
        let keep = (self.req.prompt.len() + fed).min(engine.tokens(seq)?.len());
        engine.truncate(seq, keep)?;
        engine.register_pages(seq);
        let mut spec = self.spec;
        if spec.drafted > 0 {
            spec.acceptance_rate = spec.accepted as f64 / spec.drafted as f64;
        }
        if spec.rounds > 0 {
            spec.mean_accepted = spec.accepted as f64 / spec.rounds as f64;
        }
        self.stats.speculation = spec;
        self.stats.grammar_ms = self.constraint.as_ref().map(|c| c.spent().as_secs_f64() * 1e3);
        if !self.stopped_by_string {
            // Flush what was held back: partial characters, stop prefixes.
            let (mut tail, stopped) = self.stops.push(&self.decoder.finish());
            if stopped {
                finish = FinishReason::Stop;
            } else {
                tail.push_str(&self.stops.finish());
            }
            self.text.push_str(&tail);
            on_text(&tail);
        }
        let decode_s = self.decode_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.stats.decode_tokens = self.out_tokens.len();
        // The first token comes from the prefill's logits; the rest each
        // took one decode step.
        self.stats.decode_tok_s = self.out_tokens.len().saturating_sub(1) as f64 / decode_s.max(1e-9);
        Ok(Generation {
            tokens: self.out_tokens,
            text: self.text,
            finish_reason: finish,
            stopped_by_string: self.stopped_by_string,
            context_full: self.context_full,
            prompt_tokens: self.req.prompt.len(),
            reused_tokens: self.reuse.saturating_sub(self.recomputed),
            stats: self.stats,
        })
    }
}

impl Engine<'_> {
    /// Generates for `seq`, calling `on_text` with each piece of text as it
    /// becomes final.
    pub fn generate(
        &mut self,
        seq: SeqId,
        tok: &Tokenizer,
        req: &GenerateRequest,
        on_text: impl FnMut(&str),
    ) -> Result<Generation, EngineError> {
        self.generate_until(seq, tok, req, on_text, &|| false)
    }

    /// [`Engine::generate`], asking `stop` before each decode step: when it
    /// says yes the generation ends there (finish reason `length`), with
    /// what it has emitted so far and the sequence's KV holding every
    /// token fed until then (an interrupted answer that the conversation
    /// keeps).
    pub fn generate_until(
        &mut self,
        seq: SeqId,
        tok: &Tokenizer,
        req: &GenerateRequest,
        mut on_text: impl FnMut(&str),
        stop: &dyn Fn() -> bool,
    ) -> Result<Generation, EngineError> {
        let mut d = Decoding::start(self, seq, req.clone())?;
        let prompt = d.prompt_left().to_vec();
        let logits = self.feed(seq, &prompt)?;
        d.prefilled(prompt.len(), Some(logits));
        loop {
            if stop() {
                d.stop();
                break;
            }
            let Some(tokens) = d.next_rows(self, tok, usize::MAX, &mut on_text)? else {
                break;
            };
            let rows: Vec<StepRow> = tokens.iter().map(|&t| StepRow::new(seq, t, true)).collect();
            self.step(&rows)?;
            let logits = self.take_logits();
            let absorbed = d.absorb(self, &logits, true);
            self.give_back_logits(logits);
            absorbed?;
        }
        d.finish(self, tok, on_text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filter_holds_back_possible_prefixes() {
        let stops = vec!["</end>".to_string()];
        let mut f = StopFilter {
            stops: stops.clone(),
            pending: String::new(),
        };
        assert_eq!(f.push("hello <"), ("hello ".to_string(), false));
        assert_eq!(f.push("/en"), (String::new(), false));
        assert_eq!(f.push("d> more"), (String::new(), true));
        let mut f = StopFilter {
            stops: stops.clone(),
            pending: String::new(),
        };
        assert_eq!(f.push("a </b"), ("a </b".to_string(), false));
    }

    #[test]
    fn common_prefix_counts_equal_leading_tokens() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
    }
}
