//! Chat templates rendered in `snug template-worker`: a template that
//! doubles a string until memory runs out costs the worker, not the
//! caller; a worker that hangs is stopped; and the real models' templates
//! render the same text there as in the caller.

use std::sync::Arc;
use std::time::Duration;

use snug_model::template::{ChatTemplate, Message, TemplateError};
use snug_model::template_child::ChildRenderer;
use snug_model::testing::model_path;
use snug_model::GgufFile;

fn worker(memory_mib: u64) -> Arc<ChildRenderer> {
    Arc::new(ChildRenderer::new(
        env!("CARGO_BIN_EXE_snug"),
        vec!["template-worker".into(), "--memory-mib".into(), memory_mib.to_string()],
        memory_mib,
        Duration::from_secs(30),
    ))
}

/// A string doubled 40 times: 1 TiB from 40 loop steps, well within the
/// instruction budget.
const DOUBLING: &str = "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";

fn peak_rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

fn hello() -> Vec<Message> {
    vec![
        Message::new("system", "You are terse."),
        Message::new("user", "Say hi in \"quotes\" — and ünïcödé."),
        Message::new("assistant", "\"hi\""),
        Message::new("user", "Again."),
    ]
}

#[test]
fn a_doubling_template_fails_with_a_memory_error_and_the_next_render_works() {
    let w = worker(256);
    let bomb = ChatTemplate::new(DOUBLING).unwrap().isolated(w.clone());
    let before = peak_rss_mib();
    let err = bomb.render(&hello(), true, "", "", serde_json::json!({})).unwrap_err();
    assert!(matches!(err, TemplateError::Memory(256)), "{err}");
    assert!(err.to_string().contains("256 MiB"), "{err}");
    // The caller never held the string.
    assert!(
        peak_rss_mib() < before + 64,
        "peak RSS grew from {before} MiB to {} MiB",
        peak_rss_mib()
    );
    // A new worker takes the next render.
    let small = ChatTemplate::new("{% for m in messages %}{{ m.role }};{% endfor %}")
        .unwrap()
        .isolated(w.clone());
    assert_eq!(
        small.render(&hello(), false, "", "", serde_json::json!({})).unwrap(),
        "system;user;assistant;user;"
    );
    assert_eq!(w.idle_workers(), 1);
}

#[test]
fn template_errors_come_back_with_their_kind() {
    let w = worker(256);
    let raise = ChatTemplate::new("{{ raise_exception('only user and assistant roles') }}")
        .unwrap()
        .isolated(w.clone());
    let err = raise.render(&hello(), true, "", "", serde_json::json!({})).unwrap_err();
    assert!(
        matches!(&err, TemplateError::Render(m) if m.contains("only user and assistant roles")),
        "{err}"
    );
    let forever = ChatTemplate::new("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
        .unwrap()
        .isolated(w.clone());
    assert!(matches!(
        forever.render(&hello(), true, "", "", serde_json::json!({})),
        Err(TemplateError::Budget)
    ));
    // The same worker answered all of it.
    assert_eq!(w.idle_workers(), 1);
}

#[test]
fn a_worker_that_does_not_answer_is_stopped_at_the_time_limit() {
    let w = Arc::new(ChildRenderer::new(
        "sleep",
        vec!["60".into()],
        64,
        Duration::from_millis(300),
    ));
    let t = ChatTemplate::new("{{ messages | length }}")
        .unwrap()
        .isolated(w.clone());
    let start = std::time::Instant::now();
    let err = t.render(&hello(), true, "", "", serde_json::json!({})).unwrap_err();
    assert!(matches!(err, TemplateError::Time(_)), "{err}");
    assert!(start.elapsed() < Duration::from_secs(20));
    assert_eq!(w.idle_workers(), 0);
    // A program that exits at once is reported as such, not as memory.
    let gone = ChatTemplate::new("{{ 1 }}")
        .unwrap()
        .isolated(Arc::new(ChildRenderer::new("true", vec![], 64, Duration::from_secs(5))));
    let err = gone.render(&hello(), true, "", "", serde_json::json!({})).unwrap_err();
    assert!(matches!(err, TemplateError::Isolation(_)), "{err}");
}

#[test]
fn the_real_models_templates_render_the_same_in_the_worker() {
    let w = worker(1024);
    let tools = serde_json::json!({"tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1.5}},
                       "required": ["city"]}}}]});
    let mut seen = 0;
    for alias in [
        "smollm2-135m",
        "gemma3-270m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
    ] {
        let Some(p) = model_path(alias) else { continue };
        let file = GgufFile::open(&p).unwrap();
        let source = file.get_str("tokenizer.chat_template");
        let here = ChatTemplate::for_model(source).unwrap();
        let there = ChatTemplate::for_model(source).unwrap().isolated(w.clone());
        for gen in [true, false] {
            let a = here.render(&hello(), gen, "<s>", "</s>", &tools).unwrap();
            let b = there.render(&hello(), gen, "<s>", "</s>", &tools).unwrap();
            assert_eq!(a, b, "{alias}");
            assert!(a.contains("ünïcödé"), "{alias}: {a}");
        }
        seen += 1;
    }
    assert!(seen > 0 || !snug_model::testing::required());
}

#[test]
fn a_burst_of_renders_shares_a_few_workers() {
    let w = worker(256);
    let t = Arc::new(
        ChatTemplate::new("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
            .unwrap()
            .isolated(w.clone()),
    );
    let threads: Vec<_> = (0..16)
        .map(|i| {
            let t = t.clone();
            std::thread::spawn(move || {
                let m = vec![Message::new("user", &format!("n{i}"))];
                (0..20)
                    .map(|_| t.render(&m, false, "", "", serde_json::json!({})).unwrap())
                    .all(|out| out == format!("user:n{i};"))
            })
        })
        .collect();
    for th in threads {
        assert!(th.join().unwrap(), "a render came back wrong");
    }
    assert!(w.live_workers() <= 4, "{} workers alive", w.live_workers());
    assert_eq!(w.idle_workers(), w.live_workers());
}
