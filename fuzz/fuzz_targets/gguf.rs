//! Any byte string given to the GGUF reader yields a header or an error,
//! never a panic, a hang or an allocation out of proportion to the input.

#![no_main]

use libfuzzer_sys::fuzz_target;
use snug_model::GgufHeader;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = GgufHeader::parse(data) {
        // Whatever parses must describe tensors inside the input.
        for t in &h.tensors {
            let end = h.data_offset + t.offset + t.size;
            assert!(end <= data.len() as u64);
        }
        // Building a tokenizer from fuzzed metadata must not panic either.
        let _ = snug_model::Tokenizer::from_gguf(&h);
    }
});
