//! Dequantization must be bit-exact against an independent implementation:
//! the `gguf` Python package's dequantizer, run by
//! `scripts/make_dequant_fixtures.py` on blocks from the real models and on
//! random blocks with adversarial scales (`tests/data/dequant/`).
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use std::path::PathBuf;

use snug_kernels::{dequantize, GgmlType};

fn data(name: &str) -> Vec<u8> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/dequant")).join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Same bits, or both NaN.
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn every_supported_type_is_bit_exact_against_gguf_py() {
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::MXFP4,
    ];
    for ty in types {
        let name = ty.name().to_lowercase();
        let blocks = data(&format!("{name}.blocks"));
        let want: Vec<f32> = data(&format!("{name}.f32"))
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(
            blocks.len() / ty.type_size() * ty.block_size(),
            want.len(),
            "{name}: fixture sizes"
        );
        let mut got = vec![0f32; want.len()];
        dequantize(ty, &blocks, &mut got).unwrap();
        let bad: Vec<usize> = (0..want.len()).filter(|&i| !same(got[i], want[i])).collect();
        assert!(
            bad.is_empty(),
            "{name}: {} of {} values differ, first at {}: got {} want {}",
            bad.len(),
            want.len(),
            bad[0],
            got[bad[0]],
            want[bad[0]]
        );
    }
}
