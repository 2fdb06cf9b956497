//! The scheduler's bookkeeping: which requests run, which wait, which are
//! refused, and what the next forward pass computes. No tensors: the
//! engine loop asks for a [`Plan`], runs it, and reports back with
//! [`Scheduler::commit`].
//!
//! **Admission is fail-closed.** A request is admitted only when the KV
//! pages for its prompt plus its guaranteed output (the smaller of its
//! `max_tokens` and the configured guarantee) can be reserved next to every
//! reservation already made. One that cannot be admitted now waits in a
//! bounded queue (first come, first served: a later small request does not
//! overtake a waiting large one, so nothing starves); one that could never
//! fit, or finds the queue full, is refused at once, so the server answers
//! 503 rather than swapping or running out of memory.
//!
//! **Growth past the guarantee** takes unreserved pages. When a running
//! request needs a page and none is free, it stalls for that step; if every
//! running request stalls, the one furthest past its guarantee is stopped
//! (finish reason `length`) and its pages freed, so the batch always makes
//! progress.
//!
//! **Interleaving.** While requests are decoding, a prompt is prefilled in
//! chunks of `prefill_chunk` tokens, one chunk after every `decode_steps`
//! decode steps, so running requests keep streaming while a long prompt
//! enters. With nothing decoding, chunks run back to back. One decoding
//! request alone may speculate (a multi-row verify); several decode as one
//! batch of one row each. Batch invariance keeps every request's output
//! what it would be alone either way.
//!
//! ```text
//! submit -> [queue] -> admit (reserve pages) -> prefill chunks -> decode -> finish (release)
//!             |                                                     |
//!             +-- full / never fits: refused                        +-- stalled: wait; all stalled: stop one
//! ```

use std::collections::VecDeque;

/// A request's handle.
pub type RequestId = u64;

/// How the scheduler is sized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduleConfig {
    /// KV pages the requests may hold in all.
    pub pages: usize,
    pub page_tokens: usize,
    /// Output tokens every admitted request is sure to have room for.
    pub guaranteed_output: usize,
    /// Requests that may wait for admission.
    pub max_queue: usize,
    /// Most requests running at once.
    pub max_running: usize,
    /// Prompt tokens per prefill chunk.
    pub prefill_chunk: usize,
    /// Decode steps between two prefill chunks while requests decode.
    pub decode_steps: usize,
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the request needs {needed} KV pages with its guaranteed output; the budget holds {total}")]
    NeverFits { needed: usize, total: usize },
    #[error("{waiting} requests are already waiting (the most allowed)")]
    QueueFull { waiting: usize },
}

/// What became of a submitted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    Running,
    Queued { position: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Prompt tokens fed so far.
    Prefill {
        fed: usize,
    },
    Decode,
}

#[derive(Clone, Debug)]
struct Request {
    id: RequestId,
    prompt: usize,
    max_tokens: usize,
    /// Pages reserved at admission.
    reserved: usize,
    /// Positions in the KV cache.
    held: usize,
    /// Tokens generated.
    generated: usize,
    phase: Phase,
}

impl Request {
    fn guaranteed(&self, g: usize) -> usize {
        self.max_tokens.min(g)
    }
}

/// One step's work for the engine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// A prompt chunk: (request, first prompt index, tokens).
    pub prefill: Option<(RequestId, usize, usize)>,
    /// Requests that decode one token each this step.
    pub decode: Vec<RequestId>,
    /// Draft rows the one running request may verify beside its decode
    /// row (0 unless it runs alone; bounded by its pages and tokens left).
    pub speculate: usize,
    /// Requests stopped to make room (finish reason `length`).
    pub stopped: Vec<RequestId>,
    /// Requests that could not get a page this step.
    pub stalled: Vec<RequestId>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.prefill.is_none() && self.decode.is_empty()
    }
}

/// What a step did, for [`Scheduler::commit`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Positions each request gained in the KV cache (a prefill chunk's
    /// tokens; a decode step's 1, or 1 + accepted drafts).
    pub gained: Vec<(RequestId, usize)>,
    /// Tokens each request generated.
    pub generated: Vec<(RequestId, usize)>,
    /// Requests that finished (end of generation, stop string, limit,
    /// cancel).
    pub finished: Vec<RequestId>,
}

/// The scheduler.
#[derive(Debug)]
pub struct Scheduler {
    cfg: ScheduleConfig,
    running: Vec<Request>,
    queue: VecDeque<Request>,
    /// Decode steps since the last prefill chunk.
    since_chunk: usize,
}

impl Scheduler {
    pub fn new(cfg: ScheduleConfig) -> Scheduler {
        assert!(
            cfg.page_tokens > 0 && cfg.prefill_chunk > 0,
            "pages and chunks hold tokens"
        );
        Scheduler {
            cfg,
            running: Vec::new(),
            queue: VecDeque::new(),
            since_chunk: 0,
        }
    }

    pub fn config(&self) -> &ScheduleConfig {
        &self.cfg
    }

    fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.page_tokens)
    }

    /// Pages a running request holds or has reserved, whichever is more.
    fn claim(&self, r: &Request) -> usize {
        r.reserved.max(self.pages_for(r.held))
    }

    /// Pages claimed by running requests.
    pub fn claimed_pages(&self) -> usize {
        self.running.iter().map(|r| self.claim(r)).sum()
    }

    /// Pages neither held nor reserved.
    pub fn free_pages(&self) -> usize {
        self.cfg.pages.saturating_sub(self.claimed_pages())
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Offers a request of `prompt` tokens that may generate `max_tokens`.
    pub fn submit(&mut self, id: RequestId, prompt: usize, max_tokens: usize) -> Result<Admission, Refused> {
        let guaranteed = max_tokens.min(self.cfg.guaranteed_output);
        let needed = self.pages_for(prompt + guaranteed);
        if needed > self.cfg.pages {
            return Err(Refused::NeverFits {
                needed,
                total: self.cfg.pages,
            });
        }
        let r = Request {
            id,
            prompt,
            max_tokens,
            reserved: needed,
            held: 0,
            generated: 0,
            phase: Phase::Prefill { fed: 0 },
        };
        if self.queue.is_empty() && self.fits(&r) {
            self.running.push(r);
            return Ok(Admission::Running);
        }
        if self.queue.len() >= self.cfg.max_queue {
            return Err(Refused::QueueFull {
                waiting: self.queue.len(),
            });
        }
        self.queue.push_back(r);
        Ok(Admission::Queued {
            position: self.queue.len() - 1,
        })
    }

    fn fits(&self, r: &Request) -> bool {
        self.running.len() < self.cfg.max_running && r.reserved <= self.free_pages()
    }

    /// Admits waiting requests in order while they fit; returns them.
    pub fn admit(&mut self) -> Vec<RequestId> {
        let mut admitted = Vec::new();
        while let Some(r) = self.queue.front() {
            if !self.fits(r) {
                break;
            }
            let r = self.queue.pop_front().expect("just seen");
            admitted.push(r.id);
            self.running.push(r);
        }
        admitted
    }

    /// Drops a request wherever it is (a client went away); returns
    /// whether it was known.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let before = self.running.len() + self.queue.len();
        self.running.retain(|r| r.id != id);
        self.queue.retain(|r| r.id != id);
        before != self.running.len() + self.queue.len()
    }

    /// The next step's work.
    pub fn plan(&mut self) -> Plan {
        let mut plan = Plan::default();
        let pt = self.cfg.page_tokens;
        // Pages a decode row needs: one when the request's next position
        // starts a page it has not reserved.
        let mut free = self.free_pages();
        let mut decoding: Vec<usize> = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if r.phase != Phase::Decode {
                continue;
            }
            let needs = usize::from(r.held.is_multiple_of(pt) && self.pages_for(r.held + 1) > r.reserved);
            if needs <= free {
                free -= needs;
                decoding.push(i);
            } else {
                plan.stalled.push(r.id);
            }
        }
        // Everyone decoding is stuck and nothing else can move: stop the
        // request furthest past its guarantee.
        let prefilling = self.running.iter().any(|r| matches!(r.phase, Phase::Prefill { .. }));
        if decoding.is_empty() && !plan.stalled.is_empty() && !prefilling {
            let g = self.cfg.guaranteed_output;
            let victim = self
                .running
                .iter()
                .filter(|r| plan.stalled.contains(&r.id))
                .max_by_key(|r| (r.generated.saturating_sub(r.guaranteed(g)), r.id))
                .map(|r| r.id)
                .expect("a stalled request");
            self.running.retain(|r| r.id != victim);
            plan.stopped.push(victim);
            plan.stalled.retain(|&s| s != victim);
            return plan;
        }
        let chunk_due = decoding.is_empty() || self.since_chunk >= self.cfg.decode_steps;
        if chunk_due {
            // The oldest request still prefilling (reserved at admission,
            // so its chunk always fits).
            if let Some(r) = self.running.iter().find(|r| matches!(r.phase, Phase::Prefill { .. })) {
                let Phase::Prefill { fed } = r.phase else {
                    unreachable!()
                };
                let n = (r.prompt - fed).min(self.cfg.prefill_chunk);
                plan.prefill = Some((r.id, fed, n));
            }
        }
        plan.decode = decoding.iter().map(|&i| self.running[i].id).collect();
        if let ([only], None, 1) = (&decoding[..], plan.prefill, self.running.len()) {
            // Alone: may verify drafts within what it has reserved or free.
            let r = &self.running[*only];
            let room = (r.reserved.max(self.pages_for(r.held)) + free) * pt;
            let left = r.max_tokens.saturating_sub(r.generated);
            plan.speculate = room.saturating_sub(r.held + 1).min(left.saturating_sub(1));
        }
        plan
    }

    /// Records what a planned step did, releases finished requests and
    /// admits waiting ones (returned).
    pub fn commit(&mut self, plan: &Plan, outcome: &Outcome) -> Vec<RequestId> {
        if plan.prefill.is_some() {
            self.since_chunk = 0;
        } else if !plan.decode.is_empty() {
            self.since_chunk += 1;
        }
        for &(id, n) in &outcome.gained {
            if let Some(r) = self.running.iter_mut().find(|r| r.id == id) {
                r.held += n;
                if let Phase::Prefill { fed } = r.phase {
                    let fed = fed + n;
                    r.phase = if fed >= r.prompt {
                        Phase::Decode
                    } else {
                        Phase::Prefill { fed }
                    };
                }
            }
        }
        for &(id, n) in &outcome.generated {
            if let Some(r) = self.running.iter_mut().find(|r| r.id == id) {
                r.generated += n;
            }
        }
        self.running.retain(|r| !outcome.finished.contains(&r.id));
        self.admit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pages: usize) -> ScheduleConfig {
        ScheduleConfig {
            pages,
            page_tokens: 16,
            guaranteed_output: 32,
            max_queue: 2,
            max_running: 8,
            prefill_chunk: 64,
            decode_steps: 4,
        }
    }

    /// Runs plans to completion with every request generating until
    /// `max_tokens`; returns the order requests finished in.
    fn drive(s: &mut Scheduler, limit: usize) -> Vec<RequestId> {
        let mut done = Vec::new();
        let mut gen: std::collections::HashMap<RequestId, usize> = Default::default();
        let max: std::collections::HashMap<RequestId, usize> =
            s.running.iter().chain(&s.queue).map(|r| (r.id, r.max_tokens)).collect();
        for _ in 0..limit {
            let plan = s.plan();
            done.extend(&plan.stopped);
            if plan.is_empty() && plan.stopped.is_empty() {
                break;
            }
            let mut out = Outcome::default();
            if let Some((id, _, n)) = plan.prefill {
                out.gained.push((id, n));
            }
            for &id in &plan.decode {
                out.gained.push((id, 1));
                out.generated.push((id, 1));
                let g = gen.entry(id).or_default();
                *g += 1;
                if *g == max[&id] {
                    out.finished.push(id);
                    done.push(id);
                }
            }
            s.commit(&plan, &out);
            assert!(s.claimed_pages() <= s.cfg.pages, "never more than the budget");
        }
        done
    }

    #[test]
    fn admission_reserves_prompt_and_guaranteed_output() {
        let mut s = Scheduler::new(cfg(10));
        // 100 prompt + 32 guaranteed = 132 positions = 9 pages.
        assert_eq!(s.submit(1, 100, 500), Ok(Admission::Running));
        assert_eq!(s.free_pages(), 1);
        // A small one waits; it fits only when the first is done.
        assert_eq!(s.submit(2, 10, 10), Ok(Admission::Queued { position: 0 }));
        assert_eq!(s.submit(3, 10, 10), Ok(Admission::Queued { position: 1 }));
        assert_eq!(s.submit(4, 10, 10), Err(Refused::QueueFull { waiting: 2 }));
        assert_eq!(s.submit(5, 200, 10), Err(Refused::NeverFits { needed: 14, total: 10 }));
        assert!(s.cancel(1));
        assert_eq!(s.admit(), vec![2, 3]);
        assert_eq!(s.running(), 2);
    }

    #[test]
    fn prefill_chunks_interleave_with_decode_steps() {
        let mut s = Scheduler::new(cfg(64));
        s.submit(1, 10, 100).unwrap();
        // Alone and prefilling: a chunk straight away.
        let p = s.plan();
        assert_eq!(p.prefill, Some((1, 0, 10)));
        s.commit(
            &p,
            &Outcome {
                gained: vec![(1, 10)],
                ..Default::default()
            },
        );
        s.submit(2, 300, 10).unwrap();
        let mut chunks = Vec::new();
        for step in 0..30 {
            let p = s.plan();
            assert!(p.decode.contains(&1), "request 1 decodes every step");
            let mut out = Outcome {
                gained: vec![(1, 1)],
                generated: vec![(1, 1)],
                ..Default::default()
            };
            if let Some((id, at, n)) = p.prefill {
                chunks.push((step, at, n));
                out.gained.push((id, n));
            }
            s.commit(&p, &out);
        }
        // 4 decode steps after the last chunk (request 1's), a chunk beside
        // a decode step, 4 more, the next chunk.
        assert_eq!(&chunks[..3], &[(4, 0, 64), (9, 64, 64), (14, 128, 64)]);
        assert_eq!(chunks.iter().map(|c| c.2).sum::<usize>(), 300);
    }

    #[test]
    fn one_request_alone_may_speculate_several_do_not() {
        let mut s = Scheduler::new(cfg(64));
        s.submit(1, 16, 100).unwrap();
        let p = s.plan();
        s.commit(
            &p,
            &Outcome {
                gained: vec![(1, 16)],
                ..Default::default()
            },
        );
        let p = s.plan();
        assert_eq!(p.decode, vec![1]);
        assert!(p.speculate >= 8, "{p:?}");
        s.submit(2, 16, 100).unwrap();
        let p = s.plan();
        assert_eq!(p.speculate, 0, "another request runs: no verify");
    }

    #[test]
    fn growth_past_the_guarantee_stalls_then_stops_one_request() {
        // 6 pages; each request: 16 prompt + 16 guaranteed = 2 pages.
        let mut s = Scheduler::new(ScheduleConfig {
            guaranteed_output: 16,
            ..cfg(6)
        });
        for id in 1..=3 {
            assert_eq!(s.submit(id, 16, 1000), Ok(Admission::Running));
        }
        let done = drive(&mut s, 10_000);
        // Nobody can reach 1000 tokens in 6 pages: they are stopped one by
        // one, and the last alone runs until the budget is full.
        assert_eq!(done.len(), 3, "{done:?}");
        assert_eq!(s.running(), 0);
    }

    #[test]
    fn a_queue_drains_in_order_under_a_tight_budget() {
        let mut s = Scheduler::new(ScheduleConfig {
            max_queue: 16,
            ..cfg(8)
        });
        let mut admitted = Vec::new();
        for id in 0..12 {
            match s.submit(id, 40 + (id as usize % 3) * 20, 20).unwrap() {
                Admission::Running => admitted.push(id),
                Admission::Queued { .. } => {}
            }
        }
        assert!(s.waiting() > 0, "the budget cannot hold them all");
        let done = drive(&mut s, 100_000);
        let mut sorted = done.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..12).collect::<Vec<_>>(), "every request finishes");
        assert!(admitted.len() < 12);
    }
}
