//! Tool calling on `/v1/chat/completions`: the request's `tools` go to the
//! chat template, the model's calls come back as `tool_calls`.
//!
//! The call syntax is the one Qwen2.5 is trained on (and Hermes, and many
//! others): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
//! A template that renders `tools` itself (Qwen2.5's does) gets them as
//! the `tools` variable; for one that does not, the tools and the syntax
//! are described in a system message, so every model snug runs answers in
//! the same syntax. `tool_choice: "required"` or a named function binds the
//! output to a grammar of calls whose arguments follow each function's
//! JSON schema; `auto` lets the model choose and keeps only calls whose
//! JSON parses (anything else stays text). Assistant messages with
//! `tool_calls` and `tool` messages go back through the template as the
//! model wrote and read them.

use serde_json::{json, Map, Value};
use snug_engine::grammar::GrammarSpec;

use super::api::ApiError;

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(message, Some(param))
}

/// What the request lets the model do with its tools.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked.
#[derive(Clone, Debug)]
pub struct Tools {
    /// As the request gave them (`{"type": "function", "function": {...}}`).
    pub defs: Vec<Value>,
    names: Vec<String>,
    pub choice: Choice,
    pub parallel: bool,
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`. `None`: no tools
/// (or `tool_choice: "none"`), a plain chat.
pub fn read(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<&Value>,
) -> Result<Option<Tools>, ApiError> {
    let defs: Vec<Value> = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(bad("tools must be a list of tools", "tools")),
    };
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("parallel_tool_calls must be true or false", "parallel_tool_calls")),
    };
    let mut names = Vec::with_capacity(defs.len());
    for (i, t) in defs.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                format!("tools[{i}]: only tools of type \"function\" are supported"),
                "tools",
            ));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| bad(format!("tools[{i}] needs a function object"), "tools"))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let good = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
        if !good {
            return Err(bad(
                format!("tools[{i}].function.name must be 1 to 64 letters, digits, '_', '-' or '.'; got {name:?}"),
                "tools",
            ));
        }
        if names.iter().any(|n| n == name) {
            return Err(bad(format!("two tools are named {name:?}"), "tools"));
        }
        match f.get("parameters") {
            None | Some(Value::Null) | Some(Value::Object(_)) => {}
            Some(_) => {
                return Err(bad(
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                    "tools",
                ))
            }
        }
        names.push(name.to_string());
    }
    let choice = match choice {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(bad(
                    format!("tool_choice {other:?} is not none, auto, required or a function"),
                    "tool_choice",
                ))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad(
                        "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice",
                    )
                })?;
            if !names.iter().any(|n| n == name) {
                return Err(bad(
                    format!("tool_choice names {name:?}, which is not among the tools"),
                    "tool_choice",
                ));
            }
            Choice::Named(name.to_string())
        }
    };
    if defs.is_empty() {
        if choice == Choice::Auto {
            return Ok(None);
        }
        return Err(bad("tool_choice needs tools", "tool_choice"));
    }
    Ok(Some(Tools {
        defs,
        names,
        choice,
        parallel,
    }))
}

impl Tools {
    fn function(&self, name: &str) -> Option<&Map<String, Value>> {
        self.defs
            .iter()
            .filter_map(|t| t.get("function").and_then(Value::as_object))
            .find(|f| f.get("name").and_then(Value::as_str) == Some(name))
    }

    /// The schema of one call's JSON: its name and its arguments.
    fn call_schema(&self, name: &str) -> Value {
        let params = self
            .function(name)
            .and_then(|f| f.get("parameters"))
            .filter(|p| p.is_object())
            .cloned()
            .unwrap_or_else(|| json!({"type": "object"}));
        json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    }

    /// The grammar of the answer: calls only (`required`, a named
    /// function), or, under `auto` with an answer format, calls or an
    /// answer in that format. `None` when the model is free to write
    /// anything.
    pub fn grammar(&self, answer: Option<&GrammarSpec>) -> Result<Option<GrammarSpec>, ApiError> {
        let (names, answer): (Vec<&str>, _) = match &self.choice {
            // Calls only: an answer's format has nothing to shape.
            Choice::Named(n) => (vec![n.as_str()], None),
            Choice::Required => (self.names.iter().map(String::as_str).collect(), None),
            Choice::Auto if answer.is_some() => (self.names.iter().map(String::as_str).collect(), answer),
            Choice::Auto => return Ok(None),
        };
        let mut schema = if names.len() == 1 {
            self.call_schema(names[0])
        } else {
            json!({"anyOf": names.iter().map(|n| self.call_schema(n)).collect::<Vec<_>>()})
        };
        schema["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        let many = self.parallel && !matches!(self.choice, Choice::Named(_));
        let calls = if many { "call (\"\\n\" call)*" } else { "call" };
        let mut lark = String::new();
        match answer {
            None => lark.push_str(&format!("start: {calls}\n")),
            Some(a) => {
                let answer = match a {
                    GrammarSpec::JsonObject => json!({"type": "object", "x-guidance": schema["x-guidance"]}),
                    GrammarSpec::JsonSchema(s) => {
                        let mut s = s.clone();
                        if let Some(o) = s.as_object_mut() {
                            o.entry("x-guidance").or_insert_with(|| schema["x-guidance"].clone());
                        }
                        s
                    }
                    _ => {
                        return Err(bad(
                            "with tools, the answer's format may only be a JSON object or schema",
                            "response_format",
                        ))
                    }
                };
                lark.push_str(&format!("start: {calls} | answer\nanswer: %json {answer}\n"));
            }
        }
        lark.push_str(&format!(
            "call: {} body {}\nbody: %json {schema}\n",
            Value::from(format!("{OPEN}\n")),
            Value::from(format!("\n{CLOSE}"))
        ));
        Ok(Some(GrammarSpec::Lark(lark)))
    }

    /// A system message describing the tools and the call syntax, for a
    /// template that does not render tools itself.
    pub fn system_text(&self) -> String {
        let mut s = String::from(
            "You may call functions to answer. To call one, reply with only\n\
             <tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>\n\
             (one block per call). A function's result comes back in <tool_response></tool_response>.\n\
             Functions:\n",
        );
        for t in &self.defs {
            if let Some(f) = t.get("function") {
                s.push_str(&f.to_string());
                s.push('\n');
            }
        }
        s
    }
}

/// One call the model made.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments as compact JSON text (what OpenAI's clients parse).
    pub arguments: String,
}

impl Call {
    /// A call's JSON as the model wrote it, if it is one.
    fn parse(body: &str) -> Option<Call> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            None | Some(Value::Null) => "{}".to_string(),
            Some(Value::String(s)) => {
                // Arguments written as a JSON string holding JSON.
                let inner: Value = serde_json::from_str(s).ok()?;
                inner.to_string()
            }
            Some(a @ Value::Object(_)) => a.to_string(),
            Some(_) => return None,
        };
        Some(Call { name, arguments })
    }

    pub fn json(&self, id: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// What a piece of the answer turned out to be.
#[derive(Clone, Debug, PartialEq)]
pub enum Out {
    Text(String),
    Call(Call),
}

/// Splits an answer, as it streams, into text and calls. Text that might
/// be the start of a call is held back until it is clear; whitespace
/// around calls is dropped. An answer that starts with `{` or a code fence
/// is held whole: if it is nothing but calls to known functions written as
/// bare JSON (`{"name": ..., "arguments": ...}`, fenced or not, as small
/// models often write them), those are its calls. Reading a whole answer
/// is the same as reading it in pieces, so streamed and whole answers
/// agree.
#[derive(Debug, Default)]
pub struct Splitter {
    /// Function names a bare-JSON answer may call.
    names: Vec<String>,
    /// Whether the answer is held whole as a possible bare call (`None`
    /// until its first non-blank character).
    bare: Option<bool>,
    buf: String,
    in_call: bool,
    /// Whitespace held back: emitted only if more text follows.
    ws: String,
    /// Whether the next text starts a part (leading whitespace dropped).
    at_start: bool,
    /// Calls settled so far.
    calls: usize,
}

impl Splitter {
    pub fn new(tools: &Tools) -> Splitter {
        Splitter {
            names: tools.names.clone(),
            at_start: true,
            ..Default::default()
        }
    }

    fn text(&mut self, t: &str, out: &mut Vec<Out>) {
        let t = if self.at_start { t.trim_start() } else { t };
        if t.is_empty() {
            return;
        }
        self.at_start = false;
        let body = t.trim_end();
        if body.is_empty() {
            self.ws.push_str(t);
            return;
        }
        let mut s = std::mem::take(&mut self.ws);
        s.push_str(body);
        self.ws.push_str(&t[body.len()..]);
        out.push(Out::Text(s));
    }

    /// Reads the next piece; returns what is settled.
    pub fn push(&mut self, piece: &str) -> Vec<Out> {
        self.buf.push_str(piece);
        let mut out = Vec::new();
        if self.bare.is_none() {
            match self.buf.trim_start().chars().next() {
                None => return out,
                Some(c) => self.bare = Some(c == '{' || c == '`'),
            }
        }
        if self.bare == Some(true) {
            return out;
        }
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(CLOSE) else { break };
                let body: String = self.buf[..end].to_string();
                self.buf.drain(..end + CLOSE.len());
                self.in_call = false;
                self.settle_call(&body, true, &mut out);
            } else if let Some(at) = self.buf.find(OPEN) {
                let before: String = self.buf[..at].to_string();
                self.text(&before, &mut out);
                self.ws.clear();
                self.buf.drain(..at + OPEN.len());
                self.in_call = true;
            } else {
                // Hold back a tail that could be the start of OPEN.
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&n| self.buf.ends_with(&OPEN[..n]))
                    .unwrap_or(0);
                let cut = self.buf.len() - keep;
                let text: String = self.buf[..cut].to_string();
                self.buf.drain(..cut);
                self.text(&text, &mut out);
                break;
            }
        }
        out
    }

    fn settle_call(&mut self, body: &str, closed: bool, out: &mut Vec<Out>) {
        match Call::parse(body) {
            Some(c) => {
                out.push(Out::Call(c));
                self.calls += 1;
                self.at_start = true;
                self.ws.clear();
            }
            None => {
                // Not a call after all: it stays text, as written.
                let raw = format!("{OPEN}{body}{}", if closed { CLOSE } else { "" });
                self.text(&raw, out);
            }
        }
    }

    /// Calls settled so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The rest, at the end of the answer.
    pub fn finish(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        if self.bare == Some(true) {
            self.bare = Some(false);
            if let Some(calls) = bare_calls(&self.buf, &self.names) {
                self.buf.clear();
                self.calls += calls.len();
                return calls.into_iter().map(Out::Call).collect();
            }
            let held = std::mem::take(&mut self.buf);
            out = self.push(&held);
        }
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            self.settle_call(&rest, false, &mut out);
        } else {
            self.text(&rest, &mut out);
        }
        self.ws.clear();
        out
    }
}

/// An answer that is only calls to `names` written as bare JSON objects
/// (one or more, inside a code fence or not).
fn bare_calls(answer: &str, names: &[String]) -> Option<Vec<Call>> {
    let mut body = answer.trim();
    if let Some(rest) = body.strip_prefix("```") {
        let rest = rest.strip_prefix("json").unwrap_or(rest);
        body = rest.strip_suffix("```")?.trim();
    }
    let mut calls = Vec::new();
    for v in serde_json::Deserializer::from_str(body).into_iter::<Value>() {
        let c = Call::parse(&v.ok()?.to_string())?;
        if !names.contains(&c.name) {
            return None;
        }
        calls.push(c);
    }
    (!calls.is_empty()).then_some(calls)
}

/// A whole answer split into its text (`None` when there is none) and
/// its calls.
pub fn split(answer: &str, tools: &Tools) -> (Option<String>, Vec<Call>) {
    let mut s = Splitter::new(tools);
    let mut parts = s.push(answer);
    parts.extend(s.finish());
    let mut text = String::new();
    let mut calls = Vec::new();
    for p in parts {
        match p {
            Out::Text(t) => text.push_str(&t),
            Out::Call(c) => calls.push(c),
        }
    }
    ((!text.is_empty()).then_some(text), calls)
}

/// A request's messages as the template reads them: assistant
/// `tool_calls` with their arguments as JSON objects (as chat templates
/// expect), and `tool` messages with their text. For a template without
/// tools, calls are written into the assistant's text in the call syntax
/// and tool results become user turns in `<tool_response>` blocks.
pub fn template_messages(messages: Vec<Value>, native: bool) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    for mut m in messages {
        let calls: Vec<Value> = m
            .get("tool_calls")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut calls_as_objects = Vec::with_capacity(calls.len());
        for mut c in calls {
            if let Some(args) = c.pointer("/function/arguments").and_then(Value::as_str) {
                if let Ok(v) = serde_json::from_str::<Value>(args) {
                    c["function"]["arguments"] = v;
                }
            }
            calls_as_objects.push(c);
        }
        if native {
            if !calls_as_objects.is_empty() {
                m["tool_calls"] = Value::Array(calls_as_objects);
            }
            out.push(m);
            continue;
        }
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default().to_string();
        let content = m.get("content").and_then(Value::as_str).unwrap_or_default().to_string();
        if role == "tool" {
            let block = format!("<tool_response>\n{content}\n</tool_response>");
            // Results of several calls go back in one user turn.
            if let Some(prev) = out.last_mut().filter(|p| p.get("x-tool-results").is_some()) {
                let text = format!("{}\n{block}", prev["content"].as_str().unwrap_or_default());
                prev["content"] = Value::from(text);
            } else {
                out.push(json!({"role": "user", "content": block, "x-tool-results": true}));
            }
            continue;
        }
        let mut text = content;
        for c in &calls_as_objects {
            let name = c.pointer("/function/name").cloned().unwrap_or(Value::Null);
            let args = c.pointer("/function/arguments").cloned().unwrap_or_else(|| json!({}));
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&format!(
                "{OPEN}\n{}\n{CLOSE}",
                json!({"name": name, "arguments": args})
            ));
        }
        out.push(json!({"role": role, "content": text}));
    }
    for m in &mut out {
        if let Some(o) = m.as_object_mut() {
            o.remove("x-tool-results");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    }

    #[test]
    fn choices_read_and_bad_ones_are_named() {
        let t = read(Some(&weather()), None, None).unwrap().unwrap();
        assert_eq!(t.choice, Choice::Auto);
        assert!(read(Some(&weather()), Some(&json!("none")), None).unwrap().is_none());
        let t = read(Some(&weather()), Some(&json!("required")), Some(&json!(false)))
            .unwrap()
            .unwrap();
        assert_eq!((t.choice, t.parallel), (Choice::Required, false));
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = read(Some(&weather()), Some(&named), None).unwrap().unwrap();
        assert_eq!(t.choice, Choice::Named("get_weather".into()));
        let other = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(
            read(Some(&weather()), Some(&other), None).unwrap_err().param,
            Some("tool_choice")
        );
        assert_eq!(
            read(None, Some(&json!("required")), None).unwrap_err().param,
            Some("tool_choice")
        );
        assert_eq!(
            read(Some(&json!([{"type": "code"}])), None, None).unwrap_err().param,
            Some("tools")
        );
        let spaced = json!([{"type": "function", "function": {"name": "a b"}}]);
        assert_eq!(read(Some(&spaced), None, None).unwrap_err().param, Some("tools"));
    }

    #[test]
    fn an_answer_splits_into_text_and_calls_whole_or_streamed() {
        let answer = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n\
                      <tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Bergen\\\"}\"}\n</tool_call>";
        let tools = read(Some(&weather()), None, None).unwrap().unwrap();
        let (text, calls) = split(answer, &tools);
        assert_eq!(text.as_deref(), Some("Let me look."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, "{\"city\":\"Oslo\"}");
        assert_eq!(calls[1].arguments, "{\"city\":\"Bergen\"}");
        // Streamed a few bytes at a time: the same parts.
        for step in [1, 3, 7] {
            let mut s = Splitter::new(&tools);
            let mut parts = Vec::new();
            let chars: Vec<char> = answer.chars().collect();
            for chunk in chars.chunks(step) {
                parts.extend(s.push(&chunk.iter().collect::<String>()));
            }
            parts.extend(s.finish());
            let text: String = parts
                .iter()
                .filter_map(|p| if let Out::Text(t) = p { Some(t.as_str()) } else { None })
                .collect();
            let streamed: Vec<&Call> = parts
                .iter()
                .filter_map(|p| if let Out::Call(c) = p { Some(c) } else { None })
                .collect();
            assert_eq!(text, "Let me look.", "step {step}");
            assert_eq!(streamed, calls.iter().collect::<Vec<_>>(), "step {step}");
        }
    }

    #[test]
    fn broken_calls_stay_text_and_plain_text_passes() {
        let tools = read(Some(&weather()), None, None).unwrap().unwrap();
        let split = |a: &str| split(a, &tools);
        let (text, calls) = split("Hello <b>world</b>");
        assert_eq!((text.as_deref(), calls.len()), (Some("Hello <b>world</b>"), 0));
        let (text, calls) = split("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": </tool_call>");
        assert!(calls.is_empty());
        assert!(text.unwrap().starts_with("<tool_call>"));
        // A call cut off by the token limit whose JSON is whole still counts.
        let (text, calls) = split("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}");
        assert_eq!((text, calls.len()), (None, 1));
        // Bare JSON calls to known functions, fenced or not, are calls;
        // JSON that is not a call stays text.
        let fenced = "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n```";
        let (text, calls) = split(fenced);
        assert_eq!((text, calls.len()), (None, 1));
        let (_, calls) =
            split("{\"name\": \"get_weather\", \"arguments\": {}}\n{\"name\": \"get_weather\", \"arguments\": {}}");
        assert_eq!(calls.len(), 2);
        let (text, calls) = split("{\"name\": \"unknown\", \"arguments\": {}}");
        assert_eq!(
            (text.as_deref(), calls.len()),
            (Some("{\"name\": \"unknown\", \"arguments\": {}}"), 0)
        );
        let (text, calls) = split("```python\nprint(1)\n```");
        assert_eq!((text.as_deref(), calls.len()), (Some("```python\nprint(1)\n```"), 0));
    }

    #[test]
    fn the_grammar_binds_calls_to_the_schemas() {
        let t = read(Some(&weather()), Some(&json!("required")), None).unwrap().unwrap();
        let Some(GrammarSpec::Lark(g)) = t.grammar(None).unwrap() else {
            panic!()
        };
        assert!(g.starts_with("start: call (\"\\n\" call)*\n"), "{g}");
        assert!(g.contains("\"const\":\"get_weather\""), "{g}");
        let auto = read(Some(&weather()), None, None).unwrap().unwrap();
        assert!(auto.grammar(None).unwrap().is_none());
        let Some(GrammarSpec::Lark(g)) = auto.grammar(Some(&GrammarSpec::JsonObject)).unwrap() else {
            panic!()
        };
        assert!(g.contains("| answer"), "{g}");
    }

    #[test]
    fn history_goes_back_through_the_template() {
        let msgs = vec![
            json!({"role": "user", "content": "Weather in Oslo?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "12 C"}),
            json!({"role": "tool", "tool_call_id": "c2", "content": "rain"}),
        ];
        let native = template_messages(msgs.clone(), true);
        assert_eq!(native[1]["tool_calls"][0]["function"]["arguments"]["city"], "Oslo");
        let plain = template_messages(msgs, false);
        assert_eq!(plain.len(), 3);
        assert!(plain[1]["content"]
            .as_str()
            .unwrap()
            .contains("<tool_call>\n{\"name\":\"get_weather\""));
        assert_eq!(plain[2]["role"], "user");
        assert_eq!(
            plain[2]["content"],
            "<tool_response>\n12 C\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        );
    }
}
