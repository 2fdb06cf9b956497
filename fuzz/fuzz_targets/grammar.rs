//! Any grammar a request can send (GBNF, Lark, a regex, a JSON schema, a
//! choice list) is compiled for SmolLM2's vocabulary or refused with an
//! error, never a panic or a hang; a compiled one then runs a few steps
//! (mask, take an allowed token, check a draft, roll back) without
//! failing. Needs `SNUG_FUZZ_MODEL` to point at a GGUF file with a
//! tokenizer.
//!
//! The first byte picks the kind; the rest is the grammar's text.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use snug_engine::grammar::{gbnf_to_lark, GrammarSpec, Grammars};
use snug_model::{GgufFile, Tokenizer};

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| {
        let path = std::env::var("SNUG_FUZZ_MODEL").expect("set SNUG_FUZZ_MODEL to a GGUF file");
        let f = GgufFile::open(std::path::Path::new(&path)).expect("model opens");
        let tok = Tokenizer::from_gguf(&f).expect("tokenizer builds");
        Grammars::new(&tok, tok.vocab_size()).expect("the vocabulary's trie builds")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else { return };
    let text = String::from_utf8_lossy(rest).into_owned();
    let spec = match kind % 6 {
        0 => {
            let _ = gbnf_to_lark(&text);
            GrammarSpec::Gbnf(text)
        }
        1 => GrammarSpec::Lark(text),
        2 => GrammarSpec::Regex(text),
        3 => match serde_json::from_str(&text) {
            Ok(v) => GrammarSpec::JsonSchema(v),
            Err(_) => return,
        },
        4 => GrammarSpec::Choice(text.split('|').map(str::to_string).collect()),
        _ => GrammarSpec::JsonObject,
    };
    let Ok(mut c) = grammars().compile(&spec) else { return };
    let mut taken = 0;
    for _ in 0..6 {
        let Ok(mask) = c.allowed() else { break };
        let mut first = None;
        mask.iter_set_entries(|i| {
            if first.is_none() {
                first = Some(i as u32);
            }
        });
        let Some(t) = first else { break };
        let _ = c.valid_prefix(&[t, t]);
        if c.consume(t).is_err() {
            break;
        }
        taken += 1;
    }
    let _ = c.rollback(taken);
    let _ = c.is_accepting();
});
