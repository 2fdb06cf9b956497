//! Generating text for one sequence: reuse whatever prefix of the prompt
//! the sequence already holds, prefill the rest, then decode token by token
//! until an end-of-generation token, a stop string, the token limit or the
//! context limit.

use std::time::Instant;

use serde::Serialize;
use snug_model::tokenizer::{StreamDecoder, Tokenizer};

use crate::sampling::{Sampler, SamplingParams};
use crate::{Engine, EngineError, SeqId};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    /// Generation stops before any of these strings; they are not emitted.
    pub stop: Vec<String>,
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
        // Reuse the cached prefix; at least the last prompt token is fed
        // again so that its logits are computed.
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
            prefill_tokens: to_feed.len(),
            ..Default::default()
        };

        if to_feed.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let mut logits = self.feed(seq, to_feed)?.to_vec();
        let prefill_s = start.elapsed().as_secs_f64();
        stats.prefill_tok_s = to_feed.len() as f64 / prefill_s.max(1e-9);
        let mut stopped_by_string = false;
        let decode_start = Instant::now();
        while out_tokens.len() < req.max_tokens {
            let position = history.len() as u64;
            let next = sampler.sample(&logits, &history, &req.params, position);
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
            if self.tokens(seq)?.len() + 1 > self.options.ctx {
                context_full = true;
                break;
            }
            let next_logits = self.feed(seq, &[next])?;
            logits.clear();
            logits.extend_from_slice(next_logits);
        }
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
            reused_tokens: reuse,
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
