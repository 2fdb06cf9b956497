//! llama.cpp's GBNF, read into llguidance's Lark dialect.
//!
//! The two share most of their shape (alternation, grouping, `* + ?`,
//! `{m,n}`, double-quoted literals); what differs is spelled differently:
//! `name ::= ...` becomes `name: ...`, `root` becomes `start`, character
//! classes become regular expressions, `.` matches any character, and names
//! (letters, digits and dashes in GBNF) become lower-case Lark rule names.
//! Each rule is written on one line, so GBNF's line rules (a rule goes on
//! after `|` or inside parentheses) need no counterpart.

use std::collections::HashMap;

enum Tok {
    Name(String),
    Define,
    Literal(String),
    Class(String),
    Any,
    Punct(String),
}

/// Translates a GBNF grammar into Lark; the error says what and where.
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let toks = lex(src)?;
    let mut names: HashMap<String, String> = HashMap::new();
    let mut taken: HashMap<String, usize> = HashMap::new();
    let mut rename = |n: &str| -> String {
        if let Some(r) = names.get(n) {
            return r.clone();
        }
        let r = if n == "root" {
            "start".to_string()
        } else {
            let base: String = n
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() {
                        c.to_ascii_lowercase()
                    } else {
                        '_'
                    }
                })
                .collect();
            let base = format!("r_{base}");
            let count = taken.entry(base.clone()).or_insert(0);
            *count += 1;
            if *count == 1 {
                base
            } else {
                format!("{base}_{count}")
            }
        };
        names.insert(n.to_string(), r.clone());
        r
    };
    let mut out = String::new();
    let mut has_root = false;
    for (i, t) in toks.iter().enumerate() {
        match t {
            Tok::Name(n) => {
                let starts_rule = matches!(toks.get(i + 1), Some(Tok::Define));
                if starts_rule {
                    if !out.is_empty() {
                        out.push('\n');
                    }
                    has_root |= n == "root";
                } else {
                    out.push(' ');
                }
                out.push_str(&rename(n));
            }
            Tok::Define => {
                if i == 0 || !matches!(toks[i - 1], Tok::Name(_)) {
                    return Err("'::=' must follow a rule name".into());
                }
                out.push(':');
            }
            Tok::Literal(s) => {
                out.push(' ');
                out.push_str(&serde_json::Value::from(s.as_str()).to_string());
            }
            Tok::Class(c) => {
                out.push_str(" /");
                out.push_str(c);
                out.push('/');
            }
            Tok::Any => out.push_str(" /(?s:.)/"),
            Tok::Punct(p) => {
                out.push(' ');
                out.push_str(p);
            }
        }
        if i == 0 && !matches!(toks.get(1), Some(Tok::Define)) {
            return Err("a GBNF grammar starts with 'name ::='".into());
        }
    }
    if !has_root {
        return Err("a GBNF grammar needs a 'root' rule".into());
    }
    out.push('\n');
    Ok(out)
}

fn lex(src: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = src.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    let err = |i: usize, what: &str| -> String {
        let line = chars[..i.min(chars.len())].iter().filter(|&&c| c == '\n').count() + 1;
        format!("GBNF line {line}: {what}")
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                toks.push(Tok::Define);
                i += 3;
            }
            '"' => {
                i += 1;
                let mut s = String::new();
                loop {
                    match chars.get(i) {
                        None => return Err(err(i, "unterminated string")),
                        Some('"') => break,
                        Some('\\') => {
                            let (ch, n) = escape(&chars[i + 1..]).ok_or_else(|| err(i, "bad escape"))?;
                            s.push(ch);
                            i += 1 + n;
                        }
                        Some(&ch) => {
                            s.push(ch);
                            i += 1;
                        }
                    }
                }
                i += 1;
                toks.push(Tok::Literal(s));
            }
            '[' => {
                i += 1;
                let mut class = String::from("[");
                if chars.get(i) == Some(&'^') {
                    class.push('^');
                    i += 1;
                }
                loop {
                    match chars.get(i) {
                        None => return Err(err(i, "unterminated character class")),
                        Some(']') => break,
                        Some('\\') => {
                            let (ch, n) = escape(&chars[i + 1..]).ok_or_else(|| err(i, "bad escape"))?;
                            push_class_char(&mut class, ch);
                            i += 1 + n;
                        }
                        Some('-') => {
                            class.push('-');
                            i += 1;
                        }
                        Some(&ch) => {
                            push_class_char(&mut class, ch);
                            i += 1;
                        }
                    }
                }
                i += 1;
                class.push(']');
                toks.push(Tok::Class(class));
            }
            '.' => {
                toks.push(Tok::Any);
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                toks.push(Tok::Punct(c.to_string()));
                i += 1;
            }
            '{' => {
                let end = chars[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .ok_or_else(|| err(i, "unterminated '{'"))?;
                let body: String = chars[i + 1..i + end].iter().filter(|c| !c.is_whitespace()).collect();
                if body.is_empty() || !body.chars().all(|c| c.is_ascii_digit() || c == ',') {
                    return Err(err(i, "a repetition is {m}, {m,}, {m,n} or {,n}"));
                }
                toks.push(Tok::Punct(format!("{{{body}}}")));
                i += end + 1;
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_') {
                    i += 1;
                }
                toks.push(Tok::Name(chars[start..i].iter().collect()));
            }
            other => return Err(err(i, &format!("unexpected '{other}'"))),
        }
    }
    if toks.is_empty() {
        return Err("the grammar is empty".into());
    }
    Ok(toks)
}

/// A character inside a regular-expression class, escaped where the class
/// syntax or the `/.../` delimiters would read it otherwise.
fn push_class_char(class: &mut String, ch: char) {
    match ch {
        '\\' | ']' | '[' | '^' | '-' | '&' | '~' | '/' => {
            class.push('\\');
            class.push(ch);
        }
        '\n' => class.push_str("\\n"),
        '\r' => class.push_str("\\r"),
        '\t' => class.push_str("\\t"),
        c if c.is_control() => class.push_str(&format!("\\x{{{:x}}}", c as u32)),
        c => class.push(c),
    }
}

/// A GBNF escape after its backslash: the character and how many source
/// characters it took.
fn escape(rest: &[char]) -> Option<(char, usize)> {
    let hex = |n: usize| -> Option<(char, usize)> {
        let s: String = rest.get(1..1 + n)?.iter().collect();
        let v = u32::from_str_radix(&s, 16).ok()?;
        Some((char::from_u32(v)?, 1 + n))
    };
    match rest.first()? {
        'n' => Some(('\n', 1)),
        'r' => Some(('\r', 1)),
        't' => Some(('\t', 1)),
        'x' => hex(2),
        'u' => hex(4),
        'U' => hex(8),
        &c => Some((c, 1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_literals_classes_and_repeats_translate() {
        let g = "root ::= answer ( \",\" answer ){0,2}\nanswer ::= \"yes\" | \"no\" | [0-9]+ # digits\n";
        let lark = gbnf_to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: r_answer ( \",\" r_answer ) {0,2}\nr_answer: \"yes\" | \"no\" | /[0-9]/ +\n"
        );
    }

    #[test]
    fn names_with_dashes_and_escapes_in_classes() {
        let lark = gbnf_to_lark("root ::= my-item\nmy-item ::= [^\"\\\\\\n] \"\\x41\" .").unwrap();
        assert!(lark.contains("start: r_my_item"), "{lark}");
        assert!(lark.contains("r_my_item: /[^\"\\\\\\n]/ \"A\" /(?s:.)/"), "{lark}");
    }

    #[test]
    fn errors_say_what_is_wrong() {
        assert!(gbnf_to_lark("").unwrap_err().contains("empty"));
        assert!(gbnf_to_lark("item ::= \"a\"").unwrap_err().contains("root"));
        assert!(gbnf_to_lark("root ::= \"a").unwrap_err().contains("unterminated"));
        assert!(gbnf_to_lark("root ::= [a-").unwrap_err().contains("unterminated"));
        assert!(gbnf_to_lark("root ::= \"a\"{x}").unwrap_err().contains("repetition"));
        assert!(gbnf_to_lark("\"a\" ::= b").unwrap_err().contains("rule name"));
    }
}
