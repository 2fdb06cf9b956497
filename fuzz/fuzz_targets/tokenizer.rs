//! Any UTF-8 text tokenizes without panicking, and decoding gives it back
//! (SmolLM2's byte-level BPE is lossless but for the bytes its vocabulary
//! lacks). Needs `SNUG_FUZZ_MODEL` to point
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
        // Byte-level BPE decodes to the text's bytes, less those the
        // vocabulary has no token for (SmolLM2 lacks bytes 0x13 and 0x14):
        // llama.cpp drops such a byte too.
        let table = snug_model::tokenizer::pretokenize::byte_to_char_table();
        let expected: Vec<u8> = text
            .bytes()
            .filter(|&b| tok.token_id(&table[b as usize].to_string()).is_some())
            .collect();
        let mut got = Vec::new();
        for &id in &ids {
            tok.piece_bytes(id, false, &mut got);
        }
        assert_eq!(got, expected);
    }
});
