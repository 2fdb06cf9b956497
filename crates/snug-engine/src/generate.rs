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

use std::collections::VecDeque;
use std::time::Instant;

use serde::Serialize;
use snug_core::draft::PromptLookup;
use snug_core::speculate::{Mode, Policy};
use snug_model::tokenizer::{StreamDecoder, Tokenizer};

use crate::sampling::{Sampler, SamplingParams};
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
struct StopFilter<'a> {
    stops: &'a [String],
    pending: String,
}

impl StopFilter<'_> {
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
        for s in self.stops {
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

impl Engine<'_> {
    /// Generates for `seq`, calling `on_text` with each piece of text as it
    /// becomes final.
    pub fn generate(
        &mut self,
        seq: SeqId,
        tok: &Tokenizer,
        req: &GenerateRequest,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation, EngineError> {
        let start = Instant::now();
        if req.prompt.len() > self.options.ctx {
            return Err(EngineError::ContextFull {
                len: 0,
                adding: req.prompt.len(),
                limit: self.options.ctx,
            });
        }
        // Reuse the cached prefix (an empty sequence first takes what the
        // prefix cache holds of the prompt); at least the last prompt
        // token is fed again so that its logits are computed.
        let rows_before = self.rows_computed();
        self.share_prefix(seq, &req.prompt)?;
        // With lossy pages sharing computes the first page itself.
        let recomputed = (self.rows_computed() - rows_before) as usize;
        let cached = self.tokens(seq)?;
        let mut reuse = common_prefix(cached, &req.prompt);
        if reuse == req.prompt.len() {
            reuse = reuse.saturating_sub(1);
        }
        self.truncate(seq, reuse)?;
        let to_feed = &req.prompt[reuse..];
        let mut sampler = Sampler::default();
        let mut history: Vec<u32> = req.prompt.clone();
        let mut out_tokens = Vec::new();
        let mut text = String::new();
        let mut decoder = StreamDecoder::new(false);
        let mut stops = StopFilter {
            stops: &req.stop,
            pending: String::new(),
        };
        let mut finish = FinishReason::Length;
        let mut context_full = false;
        let mut stats = GenerateStats {
            prefill_tokens: to_feed.len() + recomputed,
            ..Default::default()
        };

        if to_feed.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let mut logits = self.feed(seq, to_feed)?.to_vec();
        let prefill_s = start.elapsed().as_secs_f64();
        stats.prefill_tok_s = (to_feed.len() + recomputed) as f64 / prefill_s.max(1e-9);
        let mut policy = Policy::new(req.speculate, &[]);
        let mut calibrated = false;
        let mut drafter = PromptLookup::new(DRAFT_MIN_N, DRAFT_MAX_N);
        let mut spec = SpecStats {
            mode: req.speculate.as_str(),
            ..Default::default()
        };
        // Tokens already sampled and not yet emitted, each with whether its
        // KV is already written (accepted drafts) or not (the last one).
        let mut ready: VecDeque<(u32, bool)> = VecDeque::new();
        let mut stopped_by_string = false;
        let decode_start = Instant::now();
        while out_tokens.len() < req.max_tokens {
            let (next, in_kv) = match ready.pop_front() {
                Some(r) => r,
                None => (
                    sampler.sample(&logits, &history, &req.params, history.len() as u64),
                    false,
                ),
            };
            if out_tokens.is_empty() {
                stats.ttft_ms = start.elapsed().as_secs_f64() * 1e3;
            }
            if tok.is_eog(next) {
                finish = FinishReason::Stop;
                break;
            }
            out_tokens.push(next);
            history.push(next);
            let piece = decoder.push(tok, next);
            let (emit, stopped) = stops.push(&piece);
            text.push_str(&emit);
            on_text(&emit);
            if stopped {
                finish = FinishReason::Stop;
                stopped_by_string = true;
                break;
            }
            if out_tokens.len() == req.max_tokens {
                break;
            }
            if in_kv {
                continue;
            }
            let held = self.tokens(seq)?.len();
            if held + 1 > self.options.ctx {
                context_full = true;
                break;
            }
            // Draft: at most what fits in the context and is still wanted
            // (the sampled token itself takes one place of each).
            let room = (self.options.ctx - held - 1).min(req.max_tokens - out_tokens.len());
            let mut k = 0;
            let mut matched = 0;
            if req.speculate != Mode::Off && room > 0 {
                drafter.sync(&history);
                spec.state_bytes = spec.state_bytes.max(drafter.bytes());
                let (found, n) = drafter.draft_match(room.min(policy.max_draft));
                let available = found.len();
                matched = n;
                if available > 0 && req.speculate == Mode::Auto && !calibrated {
                    calibrated = true;
                    // The first time a draft is on offer: what do verify
                    // forwards cost on this machine (measured once per
                    // engine, then refined by every step)?
                    for (rows, secs) in self.speculation_costs(seq, next)? {
                        policy.observe(rows, secs);
                    }
                }
                k = policy.draft_len(available, matched);
            }
            // A verify that the page pool cannot hold becomes a plain step
            // (which it can: the pages the sampled token needs are fewer).
            if k > 0 && !self.has_room(seq, k + 1)? {
                k = 0;
            }
            let step_start = Instant::now();
            if k == 0 {
                let next_logits = self.feed(seq, &[next])?;
                logits.clear();
                logits.extend_from_slice(next_logits);
                let secs = step_start.elapsed().as_secs_f64();
                if req.speculate != Mode::Off {
                    spec.fallbacks += 1;
                    policy.observe(1, secs);
                }
                spec.decode_ms += secs * 1e3;
                continue;
            }
            // Verify: the sampled token and k draft tokens in one forward.
            let draft: Vec<u32> = drafter.draft(k).to_vec();
            let mut rows = Vec::with_capacity(k + 1);
            rows.push((seq, next, true));
            rows.extend(draft.iter().map(|&t| (seq, t, true)));
            let vocab = self.model.config.vocab;
            let all = self.step(&rows)?;
            policy.observe(rows.len(), step_start.elapsed().as_secs_f64());
            let base = history.len();
            let mut accepted = 0;
            for (i, &d) in draft.iter().enumerate() {
                let row = &all[i * vocab..(i + 1) * vocab];
                let target = sampler.sample(row, &history, &req.params, history.len() as u64);
                if target != d {
                    ready.push_back((target, false));
                    break;
                }
                accepted += 1;
                ready.push_back((target, true));
                history.push(target);
            }
            if accepted == draft.len() {
                let row = &all[draft.len() * vocab..(draft.len() + 1) * vocab];
                let target = sampler.sample(row, &history, &req.params, history.len() as u64);
                ready.push_back((target, false));
            }
            // The emitting loop pushes these again as it reaches them.
            history.truncate(base);
            self.truncate(seq, held + 1 + accepted)?;
            policy.record(matched, draft.len(), accepted);
            spec.rounds += 1;
            spec.drafted += draft.len();
            spec.accepted += accepted;
            spec.verify_ms += step_start.elapsed().as_secs_f64() * 1e3;
        }
        // Leave the sequence holding what plain decoding would have fed:
        // every emitted token but the last, or all of them when an
        // end-of-generation token ended it (accepted drafts may be ahead).
        let fed = if finish == FinishReason::Stop && !stopped_by_string {
            out_tokens.len()
        } else {
            out_tokens.len().saturating_sub(1)
        };
        let keep = (req.prompt.len() + fed).min(self.tokens(seq)?.len());
        self.truncate(seq, keep)?;
        self.register_pages(seq);
        if spec.drafted > 0 {
            spec.acceptance_rate = spec.accepted as f64 / spec.drafted as f64;
        }
        if spec.rounds > 0 {
            spec.mean_accepted = spec.accepted as f64 / spec.rounds as f64;
        }
        stats.speculation = spec;
        if !stopped_by_string {
            // Flush what was held back: partial characters, stop prefixes.
            let (mut tail, stopped) = stops.push(&decoder.finish());
            if stopped {
                finish = FinishReason::Stop;
            } else {
                tail.push_str(&stops.finish());
            }
            text.push_str(&tail);
            on_text(&tail);
        }
        let decode_s = decode_start.elapsed().as_secs_f64();
        stats.decode_tokens = out_tokens.len();
        // The first token comes from the prefill's logits; the rest each
        // took one decode step.
        stats.decode_tok_s = out_tokens.len().saturating_sub(1) as f64 / decode_s.max(1e-9);
        Ok(Generation {
            tokens: out_tokens,
            text,
            finish_reason: finish,
            context_full,
            prompt_tokens: req.prompt.len(),
            reused_tokens: reuse.saturating_sub(recomputed),
            stats,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filter_holds_back_possible_prefixes() {
        let stops = vec!["</end>".to_string()];
        let mut f = StopFilter {
            stops: &stops,
            pending: String::new(),
        };
        assert_eq!(f.push("hello <"), ("hello ".to_string(), false));
        assert_eq!(f.push("/en"), (String::new(), false));
        assert_eq!(f.push("d> more"), (String::new(), true));
        let mut f = StopFilter {
            stops: &stops,
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
