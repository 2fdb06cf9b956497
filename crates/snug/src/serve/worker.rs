//! The engine loop of `snug serve`: one thread owns the model, the engine
//! and the scheduler; HTTP handlers hand it jobs through a channel and
//! read each job's events from a channel of its own. Every turn of the
//! loop reads as plan -> forward -> commit:
//!
//! - **plan**: take new jobs (admitted, queued or refused by the
//!   scheduler), drop the ones whose client went away, ask the scheduler
//!   what the step computes (a prefill chunk, decode rows, a verify);
//! - **forward**: one batched pass of the engine over every row;
//! - **commit**: hand each request its logits, report to the scheduler
//!   what each gained, finish the done ones and start the newly admitted.
//!
//! A request's tokens are decided by its own [`Decoding`], exactly as
//! `snug run` decides them; batch invariance makes its rows' logits the
//! same in any batch, so every request's output is what it would be alone.

use std::collections::HashMap;
use std::io::Write;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use snug_core::schedule::{Admission, Outcome, Plan, Refused, RequestId, ScheduleConfig, Scheduler};
use snug_core::speculate::Mode;
use snug_engine::decide::{DecideError, DecideUsage, Framing, Question, Scored, Temperatures};
use snug_engine::generate::{Decoding, FinishReason, GenerateRequest, Generation};
use snug_engine::sampling::SamplingParams;
use snug_engine::{Engine, EngineError, SeqId};
use snug_model::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use super::locked;
use super::metrics::Metrics;
use snug_engine::StepRow;

/// A generation asked for by a client.
pub struct Job {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    /// The grammar the output follows, at its start.
    pub constraint: Option<snug_engine::grammar::Constraint>,
    pub events: UnboundedSender<Event>,
    /// When the server received it (time to first token counts from here).
    pub received: Instant,
}

/// What the engine loop tells a job's handler.
#[derive(Debug)]
pub enum Event {
    /// Admitted and running, or waiting in the queue.
    Accepted,
    /// Not admitted: the queue is full or it can never fit.
    Refused(Refused),
    /// It could not run (the engine refused it).
    Failed(String),
    /// Text that is final.
    Text(String),
    Done(Summary),
}

/// How a request ended.
#[derive(Clone, Debug)]
pub struct Summary {
    pub finish_reason: FinishReason,
    /// A stop string ended it (not an end-of-generation token).
    pub stopped_by_string: bool,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub reused_tokens: usize,
}

/// A decision request (`/v1/systemone`): answered between two steps.
pub struct DecideJob {
    pub state: String,
    pub questions: Vec<Question>,
    pub reply: tokio::sync::oneshot::Sender<Result<(Vec<Scored>, DecideUsage), DecideError>>,
}

/// An embeddings request: answered between two steps.
pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    pub reply: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, snug_engine::EngineError>>,
}

/// Messages to the engine loop.
pub enum Msg {
    Job(Job),
    Decide(DecideJob),
    Embed(EmbedJob),
    /// Finish what runs and waits, then return.
    Drain,
    /// Return now, dropping what runs and waits (their clients are gone).
    Stop,
}

/// Settings of the loop beyond the engine's.
pub struct LoopConfig {
    pub schedule: ScheduleConfig,
    pub speculate: Mode,
    pub metrics_file: Option<std::path::PathBuf>,
    /// How decision requests are framed for this model, and their
    /// temperatures.
    pub framing: Framing,
    pub temperatures: Temperatures,
    /// Where the prefix cache's changes go for routers, if anywhere.
    pub kv_events: Option<super::kv_events::Sender>,
}

/// A job the scheduler knows about.
struct Active {
    job: Job,
    /// Set once admitted.
    run: Option<Running>,
}

struct Running {
    seq: SeqId,
    decoding: Decoding,
    /// When the last token was emitted, and the gaps since.
    last_token: Option<Instant>,
    gaps_ms: Vec<f64>,
    first_token: Option<Instant>,
    started: Instant,
    peak_pages: usize,
}

/// Runs until the channel closes or a [`Msg::Drain`] and nothing is left.
///
/// `lease`, when given, gives back the output head's resident pages (and
/// returns the bytes): it is called before a forward in which no row wants
/// logits (a prefill chunk that is not a prompt's last, with nothing
/// decoding), and the head is faulted back in by the next forward that
/// does want logits.
pub fn run(
    engine: &mut Engine,
    tok: &Tokenizer,
    cfg: LoopConfig,
    rx: Receiver<Msg>,
    metrics: Arc<Mutex<Metrics>>,
    ledger: impl Fn(&Engine) -> snug_core::Ledger,
    lease: Option<&dyn Fn() -> u64>,
) {
    let mut l = Loop {
        sched: Scheduler::new(cfg.schedule),
        cfg,
        active: HashMap::new(),
        metrics,
        lease,
        head_out: false,
        ledger_at: None,
    };
    let mut draining = false;
    loop {
        // Intake: block when there is nothing to do.
        if l.active.is_empty() {
            if draining {
                return;
            }
            l.emit_events(engine);
            l.publish(engine, &ledger, true);
            match rx.recv() {
                Ok(Msg::Job(job)) => l.submit(engine, job),
                Ok(Msg::Decide(d)) => {
                    l.decide(engine, tok, d);
                    continue;
                }
                Ok(Msg::Embed(e)) => {
                    l.embed(engine, e);
                    continue;
                }
                Ok(Msg::Drain | Msg::Stop) | Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(Msg::Job(job)) => l.submit(engine, job),
                Ok(Msg::Decide(d)) => l.decide(engine, tok, d),
                Ok(Msg::Embed(e)) => l.embed(engine, e),
                Ok(Msg::Drain) => draining = true,
                Ok(Msg::Stop) => return,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    draining = true;
                    break;
                }
            }
        }
        l.drop_gone(engine);
        l.step(engine, tok);
        l.emit_events(engine);
        l.publish(engine, &ledger, false);
    }
}

struct Loop<'l> {
    sched: Scheduler,
    cfg: LoopConfig,
    active: HashMap<RequestId, Active>,
    metrics: Arc<Mutex<Metrics>>,
    lease: Option<&'l dyn Fn() -> u64>,
    /// Whether the head's pages were given back and not used since.
    head_out: bool,
    /// When the ledger was last read.
    ledger_at: Option<Instant>,
}

impl Loop<'_> {
    fn submit(&mut self, engine: &mut Engine, job: Job) {
        let id = job.id;
        match self.sched.submit(id, job.prompt.len(), job.max_tokens) {
            Err(r) => {
                let mut m = locked(&self.metrics);
                m.rejected(match r {
                    Refused::QueueFull { .. } => "queue_full",
                    Refused::NeverFits { .. } => "never_fits",
                });
                let _ = job.events.send(Event::Refused(r));
            }
            Ok(a) => {
                if a != Admission::Running {
                    locked(&self.metrics).queued += 1;
                }
                let _ = job.events.send(Event::Accepted);
                self.active.insert(id, Active { job, run: None });
                if a == Admission::Running {
                    self.start(engine, vec![id]);
                }
            }
        }
    }

    /// Answers a decision request at once (one prefill of the state and
    /// one batched forward of its questions), with pages free now.
    fn decide(&mut self, engine: &mut Engine, tok: &Tokenizer, d: DecideJob) {
        let t0 = Instant::now();
        let r = engine.decide(tok, &self.cfg.framing, &d.state, &d.questions, &self.cfg.temperatures);
        {
            let mut m = locked(&self.metrics);
            m.decide_questions += d.questions.len() as u64;
            m.decide.observe(t0.elapsed().as_secs_f64());
        }
        let _ = d.reply.send(r);
    }

    /// Answers an embeddings request at once (short inputs share a
    /// forward), with pages free now.
    fn embed(&mut self, engine: &mut Engine, e: EmbedJob) {
        let _ = e.reply.send(engine.embed_batch(&e.inputs));
    }

    /// Starts admitted requests: each takes a sequence and reuses what the
    /// prefix cache holds of its prompt.
    fn start(&mut self, engine: &mut Engine, mut ids: Vec<RequestId>) {
        while !ids.is_empty() {
            let mut gained = Vec::new();
            let mut failed = Vec::new();
            for id in ids.drain(..) {
                let Some(a) = self.active.get_mut(&id) else { continue };
                let seq = engine.create_sequence();
                let req = GenerateRequest {
                    prompt: a.job.prompt.clone(),
                    max_tokens: a.job.max_tokens,
                    params: a.job.params.clone(),
                    stop: a.job.stop.clone(),
                    speculate: self.cfg.speculate,
                    constraint: a.job.constraint.clone(),
                };
                match Decoding::start(engine, seq, req) {
                    Ok(d) => {
                        let held = engine.tokens(seq).map_or(0, <[u32]>::len);
                        gained.push((id, held));
                        a.run = Some(Running {
                            seq,
                            decoding: d,
                            last_token: None,
                            gaps_ms: Vec::new(),
                            first_token: None,
                            started: Instant::now(),
                            peak_pages: 0,
                        });
                    }
                    Err(e) => {
                        engine.free_sequence(seq);
                        failed.push((id, e));
                    }
                }
            }
            let finished: Vec<RequestId> = failed.iter().map(|f| f.0).collect();
            for (id, e) in failed {
                self.fail(id, &e);
            }
            ids = self.sched.commit(
                &Plan::default(),
                &Outcome {
                    gained,
                    finished,
                    ..Default::default()
                },
            );
        }
    }

    fn fail(&mut self, id: RequestId, e: &EngineError) {
        if let Some(a) = self.active.remove(&id) {
            let _ = a.job.events.send(Event::Failed(e.to_string()));
            locked(&self.metrics).finished("error");
        }
    }

    /// Cancels the requests whose client went away: their pages return.
    fn drop_gone(&mut self, engine: &mut Engine) {
        let gone: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| a.job.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.sched.cancel(id);
            if let Some(Active { run: Some(r), .. }) = self.active.remove(&id) {
                engine.free_sequence(r.seq);
            }
            locked(&self.metrics).finished("cancelled");
        }
        let admitted = self.sched.admit();
        self.start(engine, admitted);
    }

    /// One turn: plan, forward, commit.
    fn step(&mut self, engine: &mut Engine, tok: &Tokenizer) {
        // Plan.
        let plan = self.sched.plan();
        let mut finished: Vec<RequestId> = Vec::new();
        for &id in &plan.stopped {
            if let Some(r) = self.active.get_mut(&id).and_then(|a| a.run.as_mut()) {
                r.decoding.stop();
            }
            finished.push(id);
        }
        if plan.is_empty() {
            let idle = finished.is_empty();
            for id in finished {
                self.finish(engine, tok, id);
            }
            if idle {
                // Nothing can move until a request ends or is cancelled.
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            return;
        }
        // Rows: the prefill chunk's, then each decoding request's.
        let mut rows: Vec<StepRow> = Vec::new();
        // (request, rows it added, its logits rows, positions before)
        let mut spans: Vec<(RequestId, usize, usize, usize)> = Vec::new();
        if let Some((id, _, n)) = plan.prefill {
            if let Some(r) = self.active.get(&id).and_then(|a| a.run.as_ref()) {
                let left = r.decoding.prompt_left();
                let n = n.min(left.len());
                let last = n == left.len();
                rows.extend(
                    left[..n]
                        .iter()
                        .enumerate()
                        .map(|(i, &t)| StepRow::new(r.seq, t, last && i + 1 == n)),
                );
                let before = engine.tokens(r.seq).map_or(0, <[u32]>::len);
                spans.push((id, n, usize::from(last), before));
            }
        }
        let alone = plan.prefill.is_none() && plan.decode.len() == 1;
        let mut generated = Vec::new();
        for &id in &plan.decode {
            let Some(a) = self.active.get_mut(&id) else { continue };
            let Some(r) = a.run.as_mut() else { continue };
            let events = &a.job.events;
            let max_draft = if alone { plan.speculate } else { 0 };
            let before_out = r.decoding.generated();
            let next = r.decoding.next_rows(engine, tok, max_draft, |t| {
                if !t.is_empty() {
                    let _ = events.send(Event::Text(t.to_string()));
                }
            });
            let emitted = r.decoding.generated() - before_out;
            generated.push((id, emitted));
            note_tokens(r, emitted, &self.metrics);
            match next {
                Ok(Some(tokens)) => {
                    let before = engine.tokens(r.seq).map_or(0, <[u32]>::len);
                    rows.extend(tokens.iter().map(|&t| StepRow::new(r.seq, t, true)));
                    spans.push((id, tokens.len(), tokens.len(), before));
                }
                Ok(None) => finished.push(id),
                Err(e) => {
                    engine.free_sequence(r.seq);
                    self.sched.cancel(id);
                    self.fail(id, &e);
                }
            }
        }
        // Forward.
        let mut outcome = Outcome::default();
        if !rows.is_empty() {
            self.lease_head(&rows);
            let step = engine.step(&rows).map(|_| ());
            let logits = match step {
                Ok(()) => engine.take_logits(),
                Err(e) => {
                    // Nothing was appended (the engine checks before it
                    // writes); the requests in this step fail.
                    for &(id, ..) in &spans {
                        if let Some(Active { run: Some(r), .. }) = self.active.get(&id) {
                            engine.free_sequence(r.seq);
                        }
                        self.sched.cancel(id);
                        self.fail(id, &e);
                    }
                    return;
                }
            };
            // Commit: each request takes its rows' logits.
            let vocab = engine.model.config.vocab;
            let mut at = 0;
            let is_prefill = |id| plan.prefill.is_some_and(|p| p.0 == id);
            for &(id, n, with_logits, before) in &spans {
                let slice = &logits[at * vocab..(at + with_logits) * vocab];
                at += with_logits;
                let Some(r) = self.active.get_mut(&id).and_then(|a| a.run.as_mut()) else {
                    continue;
                };
                let result = if is_prefill(id) {
                    r.decoding.prefilled(n, (with_logits > 0).then_some(slice));
                    Ok(())
                } else {
                    r.decoding.absorb(engine, slice, alone)
                };
                let held = engine.tokens(r.seq).map_or(0, <[u32]>::len);
                r.peak_pages = r.peak_pages.max(held.div_ceil(self.sched.config().page_tokens));
                if let Err(e) = result {
                    engine.free_sequence(r.seq);
                    self.sched.cancel(id);
                    self.fail(id, &e);
                    continue;
                }
                outcome.gained.push((id, held.saturating_sub(before)));
            }
            engine.give_back_logits(logits);
            let mut m = locked(&self.metrics);
            m.steps += 1;
            m.rows += rows.len() as u64;
        }
        outcome.generated = generated;
        outcome.finished = finished.clone();
        let admitted = self.sched.commit(&plan, &outcome);
        for id in finished {
            self.finish(engine, tok, id);
        }
        self.start(engine, admitted);
    }

    /// Gives the output head back before a forward that wants no logits;
    /// notes when one that does takes it again.
    fn lease_head(&mut self, rows: &[StepRow]) {
        let Some(release) = self.lease else { return };
        let wants = rows.iter().any(|r| r.logits);
        let mut m = locked(&self.metrics);
        if !wants && !self.head_out {
            m.lease_released_bytes += release();
            m.lease_releases += 1;
            self.head_out = true;
        } else if wants && self.head_out {
            m.lease_returns += 1;
            self.head_out = false;
        }
    }

    /// Ends a request: the rest of its text, its summary, its metrics
    /// line; its sequence is freed (its full pages stay in the prefix
    /// cache).
    fn finish(&mut self, engine: &mut Engine, tok: &Tokenizer, id: RequestId) {
        let Some(Active { job, run: Some(r) }) = self.active.remove(&id) else {
            return;
        };
        let Running {
            seq,
            decoding,
            gaps_ms,
            first_token,
            started,
            peak_pages,
            ..
        } = r;
        let events = &job.events;
        let g = decoding.finish(engine, tok, |t| {
            if !t.is_empty() {
                let _ = events.send(Event::Text(t.to_string()));
            }
        });
        engine.free_sequence(seq);
        let g = match g {
            Ok(g) => g,
            Err(e) => {
                let _ = events.send(Event::Failed(e.to_string()));
                locked(&self.metrics).finished("error");
                return;
            }
        };
        let ttft_ms = first_token.map(|t| (t - job.received).as_secs_f64() * 1e3);
        let queue_ms = (started - job.received).as_secs_f64() * 1e3;
        {
            let mut m = locked(&self.metrics);
            m.finished(g.finish_reason.as_str());
            m.prompt_tokens += g.prompt_tokens as u64;
            m.reused_tokens += g.reused_tokens as u64;
            m.generated_tokens += g.tokens.len() as u64;
            if let Some(t) = ttft_ms {
                m.ttft.observe(t / 1e3);
            }
            m.e2e.observe(job.received.elapsed().as_secs_f64());
            let s = &g.stats.speculation;
            m.spec_rounds += s.rounds as u64;
            m.spec_drafted += s.drafted as u64;
            m.spec_accepted += s.accepted as u64;
        }
        if let Some(path) = &self.cfg.metrics_file {
            let line = metrics_line(id, &g, ttft_ms, queue_ms, &gaps_ms, peak_pages);
            let written = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
            if let Err(e) = written {
                eprintln!("warning: writing the metrics file {}: {e}", path.display());
            }
        }
        // Last, so that the request's metrics are recorded by the time
        // its client has the answer.
        let _ = events.send(Event::Done(Summary {
            finish_reason: g.finish_reason,
            stopped_by_string: g.stopped_by_string,
            prompt_tokens: g.prompt_tokens,
            completion_tokens: g.tokens.len(),
            reused_tokens: g.reused_tokens,
        }));
    }

    /// Hands the prefix cache's changes since the last turn to the KV-event
    /// publisher, if there is one.
    fn emit_events(&mut self, engine: &mut Engine) {
        if let Some(tx) = &self.cfg.kv_events {
            tx.send(super::kv_events::Batch {
                block_size: engine.options.page_tokens,
                events: engine.take_cache_events(),
            });
        }
    }

    /// Copies the gauges (pages, queue, ledger) into the metrics.
    /// The ledger reads the weights' resident size from /proc, which costs
    /// milliseconds: it is refreshed when the loop goes idle and at most
    /// once a second while it works.
    fn publish(&mut self, engine: &Engine, ledger: &impl Fn(&Engine) -> snug_core::Ledger, idle: bool) {
        let fresh = idle || self.ledger_at.is_none_or(|t| t.elapsed().as_secs_f64() >= 1.0);
        let l = fresh.then(|| ledger(engine));
        if fresh {
            self.ledger_at = Some(Instant::now());
        }
        let snug_engine::KvPages { total, used, idle } = engine.kv_pages();
        let mut m = locked(&self.metrics);
        m.running = self.sched.running() as u64;
        m.waiting = self.sched.waiting() as u64;
        m.kv_pages_total = total as u64;
        m.kv_pages_used = used.saturating_sub(idle) as u64;
        m.kv_pages_cached = idle as u64;
        m.kv_pages_reserved = self.sched.claimed_pages() as u64;
        if l.is_some() {
            m.ledger = l;
        }
        if let Some(p) = engine.prefix_stats() {
            m.prefix = p;
        }
        m.kv_events_dropped = self.cfg.kv_events.as_ref().map(super::kv_events::Sender::dropped);
    }
}

/// Records `n` tokens just emitted by a request: its first-token time and
/// the gaps between tokens (tokens emitted together share the gap).
fn note_tokens(r: &mut Running, n: usize, metrics: &Mutex<Metrics>) {
    if n == 0 {
        return;
    }
    let now = Instant::now();
    match r.last_token {
        None => r.first_token = Some(now),
        Some(t) => {
            let gap = (now - t).as_secs_f64() / n as f64;
            let mut m = locked(metrics);
            for _ in 0..n {
                r.gaps_ms.push(gap * 1e3);
                m.token_latency.observe(gap);
            }
        }
    }
    r.last_token = Some(now);
}

/// A percentile of sorted samples (nearest rank).
fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

fn metrics_line(
    id: RequestId,
    g: &Generation,
    ttft_ms: Option<f64>,
    queue_ms: f64,
    gaps: &[f64],
    peak_pages: usize,
) -> serde_json::Value {
    let mut sorted = gaps.to_vec();
    sorted.sort_by(f64::total_cmp);
    serde_json::json!({
        "id": id,
        "prompt_tokens": g.prompt_tokens,
        "reused_tokens": g.reused_tokens,
        "output_tokens": g.tokens.len(),
        "finish_reason": g.finish_reason.as_str(),
        "queue_ms": queue_ms,
        "ttft_ms": ttft_ms,
        "token_latency_ms": {
            "p50": percentile(&sorted, 50.0),
            "p90": percentile(&sorted, 90.0),
            "p99": percentile(&sorted, 99.0),
            "max": sorted.last(),
        },
        "speculation": g.stats.speculation,
        "peak_kv_pages": peak_pages,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
        assert_eq!(super::percentile(&v, 50.0), Some(5.0));
        assert_eq!(super::percentile(&v, 90.0), Some(9.0));
        assert_eq!(super::percentile(&v, 99.0), Some(10.0));
        assert_eq!(super::percentile(&[], 50.0), None);
    }
}
