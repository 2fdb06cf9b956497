use half::f16;

use crate::quant::GgmlType;

/// A deterministic generator for test data.
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Every quantized weight type the kernels take.
pub(crate) const TYPES: [GgmlType; 13] = [
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

/// Random weight blocks with sane f16 scales.
pub(crate) fn weights(ty: GgmlType, n_elems: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..ty.bytes_for(n_elems as u64).unwrap())
        .map(|_| rng.next() as u8)
        .collect();
    let ts = ty.type_size();
    let scale_at: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS => &[0],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    for blk in w.chunks_exact_mut(ts) {
        if ty == GgmlType::MXFP4 {
            // An E8M0 exponent: 2^-9 .. 2^-2 (halved), and now and then
            // one of the smallest three (subnormal halves and the first
            // normal one).
            let r = rng.next();
            blk[0] = if r.is_multiple_of(16) {
                (r / 16 % 3) as u8
            } else {
                118 + (r / 16 % 8) as u8
            };
        }
        for &at in scale_at {
            let v = f16::from_f32(rng.f32() * 0.05);
            blk[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    w
}
