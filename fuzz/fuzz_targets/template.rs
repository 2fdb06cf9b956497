//! Any template source is compiled and rendered over a conversation with
//! tools, within the render budget (instructions and output bytes), or
//! refused with an error: never a panic or a hang.
//!
//! Memory is not bounded inside the process (a string doubled in a
//! `namespace` grows without instructions to count); snug renders model
//! templates in a worker process with its own memory limit, tested apart.
//! So sources that use `namespace` are skipped here, and the run's
//! `-rss_limit_mb` catches any other way to grow memory.

#![no_main]

use libfuzzer_sys::fuzz_target;
use snug_model::template::{ChatTemplate, Message};

fuzz_target!(|data: &[u8]| {
    let source = String::from_utf8_lossy(data);
    if source.contains("namespace") {
        return;
    }
    let Ok(t) = ChatTemplate::new(&source) else { return };
    let messages = [
        Message::new("system", "Be brief."),
        Message::new("user", "What is the weather in Paris?"),
        Message::new("assistant", "Sunny."),
    ];
    let extra = serde_json::json!({"tools": [{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]});
    if let Ok(text) = t.render(&messages, true, "<s>", "</s>", &extra) {
        assert!(text.len() <= snug_model::template::MAX_RENDERED);
    }
});
