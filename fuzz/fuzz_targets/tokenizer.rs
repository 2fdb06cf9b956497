//! Any UTF-8 text tokenizes without panicking, and decoding gives it back
//! (SmolLM2's byte-level BPE is lossless). Needs `SNUG_FUZZ_MODEL` to point
//! at a GGUF file with a tokenizer.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use snug_model::{EncodeOptions, GgufFile, Tokenizer};

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = std::env::var("SNUG_FUZZ_MODEL").expect("set SNUG_FUZZ_MODEL to a GGUF file");
        let f = GgufFile::open(std::path::Path::new(&path)).expect("model opens");
        Tokenizer::from_gguf(&f).expect("tokenizer builds")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let tok = tokenizer();
    let opts = EncodeOptions {
        add_special: false,
        parse_special: false,
    };
    let ids = tok.encode(text, opts);
    if tok.kind() == snug_model::tokenizer::TokenizerKind::Bpe {
        assert_eq!(tok.decode(&ids, false), text);
    }
});
