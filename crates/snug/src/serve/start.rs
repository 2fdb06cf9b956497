//! Starting the server: checks, the engine thread, the listener, and
//! shutdown on a signal.

use super::*;

pub fn cmd_serve(mut a: ServeArgs) -> Result<()> {
    if let Some(m) = a.model_flag.take() {
        a.model = m;
    }
    if !is_loopback(&a.host) && a.api_key.as_deref().is_none_or(str::is_empty) {
        bail!(
            "--host {} is not a loopback address: set --api-key (or SNUG_API_KEY) so that only clients with the key are served",
            a.host
        );
    }
    let speculate = snug_core::speculate::Mode::parse(&a.speculate)
        .with_context(|| format!("unknown --speculate {:?} (on, off or auto)", a.speculate))?;
    let max_body = crate::parse_size(&a.max_body)?;
    if a.parallel == 0 || a.prefill_chunk == 0 {
        bail!("--parallel and --prefill-chunk must be at least 1");
    }
    let checkpoint = crate::encoder_checkpoint(&a.model)?;
    let opened = if checkpoint.is_some() {
        None
    } else {
        Some(crate::open_model_at(&a.model)?)
    };
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(&(a.host.as_str(), a.port))
                .map_err(anyhow::Error::from)
                .and_then(|mut it| it.next().context("no address"))
        })
        .with_context(|| format!("--host {}: not an address", a.host))?;
    // Bind first: a port in use is a clear error before the model loads.
    let std_listener = std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    std_listener.set_nonblocking(true)?;
    let Some((path, file)) = opened else {
        let dir = checkpoint.expect("an encoder checkpoint when no model file was opened");
        return encoder::serve(&a, &dir, std_listener, max_body);
    };

    let kv_events = match &a.kv_events {
        Some(endpoint) => {
            let format = kv_events::WireFormat::parse(&a.kv_events_format).context("--kv-events-format")?;
            let cfg = kv_events::EventsConfig {
                endpoint: endpoint.clone(),
                replay: a.kv_events_replay.clone(),
                topic: a.kv_events_topic.clone(),
                format,
                medium: if a.cache.device.as_deref().is_some_and(|d| d != "cpu") {
                    "GPU"
                } else {
                    "CPU"
                },
            };
            Some(kv_events::start(cfg).map_err(anyhow::Error::msg)?)
        }
        None => None,
    };

    let tok = Tokenizer::from_gguf(&file)?;
    let facts = ollama::Facts::of(&file, &path);
    let template = crate::template_worker::for_model(file.get_str("tokenizer.chat_template"))?;
    let bos = tok.bos.and_then(|b| tok.token_text(b)).unwrap_or("").to_string();
    let eos = tok.eos.and_then(|e| tok.token_text(e)).unwrap_or("").to_string();
    let model_id = a.alias.clone().unwrap_or_else(|| a.model.clone());

    let (tx, rx) = mpsc::channel::<Msg>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(usize, usize, Arc<Mutex<Metrics>>)>>();
    let engine_thread = {
        let mut a = EngineArgs::from(&a);
        a.kv_events = kv_events;
        let path = path.clone();
        std::thread::Builder::new()
            .name("snug-engine".into())
            .spawn(move || engine_main(a, path, file, speculate, rx, ready_tx))?
    };
    let (ctx, vocab, metrics) = match ready_rx.recv() {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(e),
        Err(_) => bail!("the engine stopped while starting"),
    };
    locked(&metrics).model_name = model_id.clone();
    let state = Arc::new(AppState {
        jobs: Mutex::new(tx),
        tok,
        template,
        bos,
        eos,
        model_id,
        ctx,
        vocab,
        metrics,
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        next_id: AtomicU64::new(1),
        started: unix_now(),
        draining: AtomicBool::new(false),
        facts,
        grammars: std::sync::OnceLock::new(),
        chats_dir: (!a.no_web).then(|| {
            a.chats_dir
                .clone()
                .unwrap_or_else(|| crate::env::get().cache.join("chats"))
        }),
    });
    let log = match (a.no_access_log, a.log_format.as_str()) {
        (true, _) => AccessLog::Off,
        (false, "json") => AccessLog::Json,
        _ => AccessLog::Text,
    };
    let app = router(state.clone(), max_body, log);
    let http_state = state.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let cut = rt.block_on(async move {
        let state = http_state;
        let listener = TimedListener::new(
            tokio::net::TcpListener::from_std(std_listener)?,
            std::time::Duration::from_secs(a.read_timeout),
            a.max_connections,
        );
        let tokens = {
            let m = locked(&state.metrics);
            m.kv_pages_total * m.kv_page_tokens
        };
        eprintln!(
            "snug serve: {} on http://{} (context {}, the KV budget holds {} tokens)",
            state.model_id,
            axum::serve::Listener::local_addr(&listener)?,
            state.ctx,
            tokens
        );
        let shutdown_state = state.clone();
        let signalled = Arc::new(tokio::sync::Notify::new());
        let told = signalled.clone();
        let server = axum::serve(listener, app.into_make_service_with_connect_info::<Conn>()).with_graceful_shutdown(
            async move {
                shutdown_signal().await;
                shutdown_state.draining.store(true, Ordering::SeqCst);
                eprintln!("snug serve: draining (finishing running requests)");
                told.notify_one();
            },
        );
        let limit = std::time::Duration::from_secs(a.shutdown_timeout);
        let cut = tokio::select! {
            r = server => {
                r?;
                false
            }
            cut = stragglers(&signalled, || {
                let m = locked(&state.metrics);
                m.running + m.waiting + m.queued
            }, limit) => {
                if cut {
                    eprintln!("snug serve: --shutdown-timeout ({} s) passed: cutting the requests still running", a.shutdown_timeout);
                } else {
                    eprintln!("snug serve: closing connections that have no request under way");
                }
                cut
            }
        };
        anyhow::Ok(cut)
    })?;
    // Every connection is closed: let the engine finish (or, past the
    // shutdown timeout, drop what it runs) and stop.
    let _ = locked(&state.jobs).send(if cut { Msg::Stop } else { Msg::Drain });
    let _ = engine_thread.join();
    eprintln!("snug serve: stopped");
    Ok(())
}

/// After a shutdown signal, once no request is running or waiting and
/// their answers have had a moment to reach their clients: the
/// connections still open then (idle, or a client that sent only part of
/// a request) are not waited for. Requests still running `limit` after
/// the signal are not waited for either; returns whether any were.
pub(super) async fn stragglers(
    signalled: &tokio::sync::Notify,
    busy: impl Fn() -> u64,
    limit: std::time::Duration,
) -> bool {
    signalled.notified().await;
    let deadline = tokio::time::Instant::now() + limit;
    while busy() > 0 {
        if tokio::time::Instant::now() >= deadline {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + std::time::Duration::from_secs(2))).await;
    false
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// The flags the engine thread needs (the rest stay with HTTP).
pub(super) struct EngineArgs {
    pub(super) gen: crate::GenArgs,
    pub(super) budget: Option<String>,
    pub(super) parallel: usize,
    pub(super) max_queue: usize,
    pub(super) guaranteed_output: usize,
    pub(super) prefill_chunk: usize,
    pub(super) decode_steps: usize,
    pub(super) metrics_file: Option<PathBuf>,
    pub(super) model: String,
    pub(super) lease_head: bool,
    pub(super) kv_events: Option<kv_events::Sender>,
}

impl From<&ServeArgs> for EngineArgs {
    fn from(a: &ServeArgs) -> EngineArgs {
        EngineArgs {
            gen: crate::GenArgs {
                max_tokens: 0,
                temperature: None,
                top_k: None,
                top_p: None,
                min_p: None,
                repeat_penalty: None,
                presence_penalty: None,
                seed: None,
                threads: a.threads,
                ctx: a.ctx,
                stop: Vec::new(),
                cache: crate::KvArgs {
                    kv: a.cache.kv.clone(),
                    kv_k: a.cache.kv_k.clone(),
                    kv_v: a.cache.kv_v.clone(),
                    kv_page: a.cache.kv_page,
                    numerics: a.cache.numerics.clone(),
                    device: a.cache.device.clone(),
                },
                kv_budget: None,
                speculate: a.speculate.clone(),
                metrics_file: None,
                prefix_cache_dir: a.prefix_cache_dir.clone(),
                prefix_cache_size: a.prefix_cache_size.clone(),
                no_prefix_cache: a.no_prefix_cache,
            },
            budget: a.memory_budget.clone(),
            parallel: a.parallel,
            max_queue: a.max_queue,
            guaranteed_output: a.guaranteed_output,
            prefill_chunk: a.prefill_chunk,
            decode_steps: a.decode_steps,
            metrics_file: a.metrics_file.clone(),
            model: a.model.clone(),
            lease_head: a.lease_head,
            kv_events: None,
        }
    }
}

type Ready = mpsc::Sender<Result<(usize, usize, Arc<Mutex<Metrics>>)>>;

/// The engine thread: loads the model, sizes the engine and the scheduler
/// from the budget, reports ready, then runs the loop.
pub(super) fn engine_main(
    a: EngineArgs,
    path: PathBuf,
    file: ModelFiles,
    speculate: snug_core::speculate::Mode,
    rx: mpsc::Receiver<Msg>,
    ready: Ready,
) {
    let setup = || -> Result<_> {
        let model = crate::load_model(&file, &a.gen.cache)?;
        let tok = Tokenizer::from_gguf(&file)?;
        let mut o: EngineOptions = crate::run::engine_options(&a.gen, &model, &tok, None)?;
        o.max_seqs = a.parallel;
        // One step carries a prefill chunk and every running request's
        // decode row (or one request's verify).
        o.batch = a.prefill_chunk + a.parallel.max(snug_core::speculate::MAX_DRAFT + 1);
        let page = snug_engine::kv_page_bytes(&model, &o);
        if let Some(b) = &a.budget {
            let budget = crate::parse_size(b)?;
            let twins = snug_engine::kv_twin_bytes(&model, &o);
            if budget < page + twins {
                bail!(
                    "--memory-budget {b} holds no KV page: a page takes {} ({} positions in these formats){}",
                    crate::human_bytes(page as u64),
                    o.page_tokens,
                    if twins > 0 {
                        format!(
                            " after the exact window's F16 twin pages, {} for --parallel {}",
                            crate::human_bytes(twins as u64),
                            a.parallel
                        )
                    } else {
                        String::new()
                    }
                );
            }
            o.kv_budget = Some(budget);
        }
        Ok((model, tok, o, page))
    };
    let (model, tok, opts, page) = match setup() {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    // Requests are checked against the context asked for; a prompt the
    // budget cannot hold is the scheduler's refusal (503), not a context
    // error.
    let ctx = opts.ctx.min(model.config.context_length);
    let mut engine = match Engine::try_new(&model, opts) {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    if a.gen.prefix_cache_dir.is_some() {
        let identity = crate::session::model_identity(&path, &file, &a.model);
        let r = identity.and_then(|id| crate::run::enable_prefix_disk(&a.gen, &mut engine, Some(&id)));
        if let Err(e) = r {
            let _ = ready.send(Err(e));
            return;
        }
    }
    if a.kv_events.is_some() {
        engine.record_cache_events();
    }
    let speculate = crate::run::speculation_for(speculate, engine.model);
    let mut calibration = (speculate == snug_core::speculate::Mode::Auto)
        .then(|| crate::calibration::load(&path, engine.options.threads, &mut engine));
    let total = engine.kv_pages().total;
    let pt = engine.options.page_tokens;
    let metrics = Arc::new(Mutex::new(Metrics::new(pt, page)));
    {
        let mut m = locked(&metrics);
        m.kv_pages_total = total as u64;
        let fk = engine.options.kv_format;
        m.cache_dtype = crate::eval::kv_name(fk, engine.options.kv_format_v.unwrap_or(fk));
    }
    let template = match crate::template_worker::for_model(file.get_str("tokenizer.chat_template")) {
        Ok(t) => t,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let framing = match snug_engine::decide::Framing::new(Some(&template), &tok) {
        Ok(f) => f,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    let temperatures = match crate::decide::load_temperatures(&path, None) {
        Ok(t) => t,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let cfg = worker::LoopConfig {
        schedule: ScheduleConfig {
            pages: total,
            page_tokens: pt,
            guaranteed_output: a.guaranteed_output,
            max_queue: a.max_queue,
            max_running: a.parallel,
            prefill_chunk: a.prefill_chunk,
            decode_steps: a.decode_steps,
        },
        speculate,
        metrics_file: a.metrics_file.clone(),
        framing,
        temperatures,
        kv_events: a.kv_events.clone(),
    };
    let _ = ready.send(Ok((ctx, model.config.vocab, metrics.clone())));
    let head = model.head_bytes();
    let release = || file.release(head);
    let lease: Option<&dyn Fn() -> u64> = if a.lease_head { Some(&release) } else { None };
    worker::run(
        &mut engine,
        &tok,
        cfg,
        rx,
        metrics,
        |e| crate::run::ledger(&file, e, 0),
        lease,
    );
    if let Some(c) = &mut calibration {
        crate::calibration::save(c, &engine);
    }
}
