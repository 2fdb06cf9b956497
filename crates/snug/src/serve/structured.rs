//! Structured output: the request fields that bind what the model writes
//! to a grammar, in the spellings clients use: OpenAI's `response_format`
//! (`json_object`, `json_schema`), llama.cpp's `grammar` (GBNF, or Lark
//! after a `%llguidance` line) and `json_schema`, and vLLM's
//! `structured_outputs` / `guided_json`, `guided_regex`, `guided_choice`,
//! `guided_grammar`. At most one may be set. The grammar is compiled when
//! the request arrives (a grammar that does not compile is a 400 naming
//! the field) and applied to every token the request samples.

use serde_json::Value;
use snug_engine::grammar::GrammarSpec;

use super::api::ApiError;

/// A request's grammar and the field it came from (for error messages).
#[derive(Clone, Debug)]
pub struct Structured {
    pub spec: GrammarSpec,
    pub param: &'static str,
}

/// The grammar fields of a request, as read from its body.
#[derive(serde::Deserialize, Debug, Default)]
pub struct GrammarFields {
    pub response_format: Option<Value>,
    pub grammar: Option<Value>,
    pub json_schema: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
}

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(message, Some(param))
}

fn text(v: &Value, param: &'static str) -> Result<String, ApiError> {
    v.as_str()
        .filter(|s| !s.trim().is_empty())
        .map(str::to_string)
        .ok_or_else(|| bad(format!("{param} must be a non-empty string"), param))
}

/// A schema given as an object, or as a string holding one.
fn schema(v: &Value, param: &'static str) -> Result<Value, ApiError> {
    let v = match v {
        Value::String(s) => {
            serde_json::from_str(s).map_err(|e| bad(format!("{param} is not valid JSON: {e}"), param))?
        }
        v => v.clone(),
    };
    if !v.is_object() && !v.is_boolean() {
        return Err(bad(format!("{param} must be a JSON schema object"), param));
    }
    Ok(v)
}

fn choices(v: &Value, param: &'static str) -> Result<GrammarSpec, ApiError> {
    let list: Option<Vec<String>> = v
        .as_array()
        .and_then(|a| a.iter().map(|x| x.as_str().map(str::to_string)).collect());
    match list {
        Some(l) if !l.is_empty() => Ok(GrammarSpec::Choice(l)),
        _ => Err(bad(format!("{param} must be a non-empty list of strings"), param)),
    }
}

/// A grammar in llama.cpp's field: GBNF, or llguidance's Lark after a
/// first line `%llguidance {}`, or Lark when it has no `::=` at all.
fn grammar_text(src: String) -> GrammarSpec {
    let trimmed = src.trim_start();
    if let Some(rest) = trimmed.strip_prefix("%llguidance") {
        let body = rest.trim_start();
        let body = body.strip_prefix("{}").unwrap_or(body);
        return GrammarSpec::Lark(body.to_string());
    }
    if src.contains("::=") {
        GrammarSpec::Gbnf(src)
    } else {
        GrammarSpec::Lark(src)
    }
}

impl GrammarFields {
    /// The one grammar the request asks for, if any.
    pub fn read(&self) -> Result<Option<Structured>, ApiError> {
        let mut found: Vec<Structured> = Vec::new();
        let mut put = |spec: GrammarSpec, param: &'static str| found.push(Structured { spec, param });
        if let Some(rf) = self.response_format.as_ref().filter(|v| !v.is_null()) {
            let p = "response_format";
            match rf.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("json_object") => match rf.get("schema") {
                    Some(s) if !s.is_null() => put(GrammarSpec::JsonSchema(schema(s, p)?), p),
                    _ => put(GrammarSpec::JsonObject, p),
                },
                Some("json_schema") => {
                    let s = rf
                        .get("json_schema")
                        .and_then(|j| j.get("schema"))
                        .or_else(|| rf.get("schema"))
                        .ok_or_else(|| bad("response_format json_schema needs json_schema.schema", p))?;
                    put(GrammarSpec::JsonSchema(schema(s, p)?), p);
                }
                Some(other) => {
                    return Err(bad(
                        format!("response_format type {other:?} is not one of text, json_object, json_schema"),
                        p,
                    ))
                }
                None => return Err(bad("response_format needs a type", p)),
            }
        }
        if let Some(g) = self.grammar.as_ref().filter(|v| !v.is_null()) {
            put(grammar_text(text(g, "grammar")?), "grammar");
        }
        if let Some(s) = self.json_schema.as_ref().filter(|v| !v.is_null()) {
            put(GrammarSpec::JsonSchema(schema(s, "json_schema")?), "json_schema");
        }
        if let Some(s) = self.guided_json.as_ref().filter(|v| !v.is_null()) {
            put(GrammarSpec::JsonSchema(schema(s, "guided_json")?), "guided_json");
        }
        if let Some(r) = self.guided_regex.as_ref().filter(|v| !v.is_null()) {
            put(GrammarSpec::Regex(text(r, "guided_regex")?), "guided_regex");
        }
        if let Some(c) = self.guided_choice.as_ref().filter(|v| !v.is_null()) {
            put(choices(c, "guided_choice")?, "guided_choice");
        }
        if let Some(g) = self.guided_grammar.as_ref().filter(|v| !v.is_null()) {
            put(grammar_text(text(g, "guided_grammar")?), "guided_grammar");
        }
        if let Some(so) = self.structured_outputs.as_ref().filter(|v| !v.is_null()) {
            let p = "structured_outputs";
            let Some(o) = so.as_object() else {
                return Err(bad("structured_outputs must be an object", p));
            };
            for (k, v) in o {
                match k.as_str() {
                    "json" => put(GrammarSpec::JsonSchema(schema(v, p)?), p),
                    "json_object" if v.as_bool() == Some(true) => put(GrammarSpec::JsonObject, p),
                    "regex" => put(GrammarSpec::Regex(text(v, p)?), p),
                    "choice" => put(choices(v, p)?, p),
                    "grammar" => put(grammar_text(text(v, p)?), p),
                    _ if v.is_null() => {}
                    other => {
                        return Err(bad(
                            format!(
                            "structured_outputs.{other} is not supported (json, json_object, regex, choice, grammar)"
                        ),
                            p,
                        ))
                    }
                }
            }
        }
        match found.len() {
            0 | 1 => Ok(found.pop()),
            _ => Err(bad(
                format!(
                    "one output constraint per request; this one sets {} and {}",
                    found[0].param, found[1].param
                ),
                found[1].param,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<Option<Structured>, ApiError> {
        serde_json::from_value::<GrammarFields>(v).unwrap().read()
    }

    #[test]
    fn each_spelling_gives_its_grammar() {
        assert!(read(json!({})).unwrap().is_none());
        assert!(read(json!({"response_format": {"type": "text"}})).unwrap().is_none());
        let s = read(json!({"response_format": {"type": "json_object"}}))
            .unwrap()
            .unwrap();
        assert_eq!(s.spec, GrammarSpec::JsonObject);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let s = read(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}}}))
        .unwrap()
        .unwrap();
        assert_eq!(s.spec, GrammarSpec::JsonSchema(schema.clone()));
        let s = read(json!({"guided_json": schema.to_string()})).unwrap().unwrap();
        assert_eq!(s.spec, GrammarSpec::JsonSchema(schema.clone()));
        let s = read(json!({"grammar": "root ::= \"a\""})).unwrap().unwrap();
        assert!(matches!(s.spec, GrammarSpec::Gbnf(_)));
        let s = read(json!({"grammar": "%llguidance {}\nstart: \"a\""}))
            .unwrap()
            .unwrap();
        assert_eq!(s.spec, GrammarSpec::Lark("\nstart: \"a\"".into()));
        let s = read(json!({"structured_outputs": {"choice": ["x", "y"]}}))
            .unwrap()
            .unwrap();
        assert_eq!(s.spec, GrammarSpec::Choice(vec!["x".into(), "y".into()]));
        let s = read(json!({"guided_regex": "[a-z]+"})).unwrap().unwrap();
        assert_eq!((s.spec, s.param), (GrammarSpec::Regex("[a-z]+".into()), "guided_regex"));
    }

    #[test]
    fn two_constraints_or_a_bad_value_are_refused_by_name() {
        let e = read(json!({"response_format": {"type": "json_object"}, "guided_regex": "a"})).unwrap_err();
        assert!(
            e.message.contains("response_format") && e.message.contains("guided_regex"),
            "{}",
            e.message
        );
        let e = read(json!({"response_format": {"type": "xml"}})).unwrap_err();
        assert_eq!(e.param, Some("response_format"));
        let e = read(json!({"response_format": {"type": "json_schema"}})).unwrap_err();
        assert!(e.message.contains("schema"));
        let e = read(json!({"guided_choice": []})).unwrap_err();
        assert_eq!(e.param, Some("guided_choice"));
        let e = read(json!({"guided_json": "{not json"})).unwrap_err();
        assert!(e.message.contains("not valid JSON"));
        let e = read(json!({"structured_outputs": {"xml": "a"}})).unwrap_err();
        assert!(e.message.contains("structured_outputs.xml"));
    }
}
