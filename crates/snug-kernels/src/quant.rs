//! GGML tensor types: their ids, block geometry, byte layouts and scalar
//! dequantization to f32.
//!
//! The layouts follow ggml's `block_*` structs (all little-endian, packed, no
//! padding). Each dequantizer reproduces ggml's arithmetic in the same order,
//! so results are bit-exact against ggml and against the `gguf` Python
//! package, which the tests check on blocks from the real models and on random
//! blocks. These scalar routines are the reference that later SIMD kernels
//! are tested against; they are not the hot path.

use half::f16;

/// Elements in one super-block of the K-quant family.
pub const QK_K: usize = 256;

/// A GGML tensor element type, as stored in a GGUF tensor info.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    IQ4NL = 20,
    IQ4XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    BF16 = 30,
    MXFP4 = 39,
}

impl GgmlType {
    /// Every type this crate knows the geometry of.
    pub const ALL: [GgmlType; 23] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::BF16,
        GgmlType::MXFP4,
    ];

    /// The type with GGML id `id`, if its geometry is known.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.into_iter().find(|t| *t as u32 == id)
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// ggml's name for the type (`q4_K`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q8_1 => "q8_1",
            GgmlType::Q2K => "q2_K",
            GgmlType::Q3K => "q3_K",
            GgmlType::Q4K => "q4_K",
            GgmlType::Q5K => "q5_K",
            GgmlType::Q6K => "q6_K",
            GgmlType::Q8K => "q8_K",
            GgmlType::IQ4NL => "iq4_nl",
            GgmlType::IQ4XS => "iq4_xs",
            GgmlType::I8 => "i8",
            GgmlType::I16 => "i16",
            GgmlType::I32 => "i32",
            GgmlType::I64 => "i64",
            GgmlType::F64 => "f64",
            GgmlType::BF16 => "bf16",
            GgmlType::MXFP4 => "mxfp4",
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::I8
            | GgmlType::I16
            | GgmlType::I32
            | GgmlType::I64
            | GgmlType::F64 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::IQ4NL
            | GgmlType::MXFP4 => 32,
            GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::Q8K
            | GgmlType::IQ4XS => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::I32 => 4,
            GgmlType::F16 | GgmlType::BF16 | GgmlType::I16 => 2,
            GgmlType::I8 => 1,
            GgmlType::I64 | GgmlType::F64 => 8,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q8_1 => 2 + 2 + 32,
            GgmlType::Q2K => QK_K / 16 + QK_K / 4 + 2 + 2,
            GgmlType::Q3K => QK_K / 8 + QK_K / 4 + 12 + 2,
            GgmlType::Q4K => 2 + 2 + 12 + QK_K / 2,
            GgmlType::Q5K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            GgmlType::Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            GgmlType::Q8K => 4 + QK_K + QK_K / 16 * 2,
            GgmlType::IQ4NL => 2 + 16,
            GgmlType::IQ4XS => 2 + 2 + QK_K / 64 + QK_K / 2,
            GgmlType::MXFP4 => 1 + 16,
        }
    }

    /// Whether [`dequantize`] supports this type: the float types and
    /// every type the dot products take.
    pub fn can_dequantize(self) -> bool {
        matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) || crate::dot::supports(self)
    }

    /// Bytes taken by `n` elements, or `None` if `n` is not a whole number
    /// of blocks or the size overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }
}

/// ggml's name for a type id snug has no geometry for (the other i-quants,
/// the ternary and newer FP4 types), for errors that name it.
pub fn foreign_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        16 => "iq2_xxs",
        17 => "iq2_xs",
        18 => "iq3_xxs",
        19 => "iq1_s",
        21 => "iq3_s",
        22 => "iq2_s",
        29 => "iq1_m",
        34 => "tq1_0",
        35 => "tq2_0",
        40 => "nvfp4",
        41 => "q1_0",
        42 => "q2_0",
        _ => return None,
    })
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a dequantization call was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DequantError {
    #[error("dequantization of {0} is not supported")]
    Unsupported(GgmlType),
    #[error("{ty}: {bytes} bytes do not hold {elements} elements")]
    SizeMismatch {
        ty: GgmlType,
        bytes: usize,
        elements: usize,
    },
}

/// Dequantizes `src` (whole blocks of type `ty`) into `dst`, one f32 per
/// element.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), DequantError> {
    if !ty.can_dequantize() {
        return Err(DequantError::Unsupported(ty));
    }
    let bs = ty.block_size();
    let ts = ty.type_size();
    if !dst.len().is_multiple_of(bs) || src.len() != dst.len() / bs * ts {
        return Err(DequantError::SizeMismatch {
            ty,
            bytes: src.len(),
            elements: dst.len(),
        });
    }
    let blocks = src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = f16_at(b, 0)),
        GgmlType::BF16 => {
            blocks.for_each(|(b, y)| y[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| dequant_q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| dequant_q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| dequant_q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| dequant_q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| dequant_q8_0(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| dequant_q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| dequant_q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| dequant_q6_k(b, y)),
        GgmlType::Q2K => blocks.for_each(|(b, y)| dequant_q2_k(b, y)),
        GgmlType::Q3K => blocks.for_each(|(b, y)| dequant_q3_k(b, y)),
        GgmlType::IQ4NL => blocks.for_each(|(b, y)| dequant_iq4_nl(b, y)),
        GgmlType::IQ4XS => blocks.for_each(|(b, y)| dequant_iq4_xs(b, y)),
        GgmlType::MXFP4 => blocks.for_each(|(b, y)| dequant_mxfp4(b, y)),
        _ => unreachable!("can_dequantize covers the match"),
    }
    Ok(())
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

// block_q4_0 { d: f16, qs: [u8; 16] }: element j is the low nibble of qs[j],
// element j + 16 the high nibble, both offset by -8.
fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        let x0 = (qs[j] & 0x0F) as i32 - 8;
        let x1 = (qs[j] >> 4) as i32 - 8;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

// block_q4_1 { d: f16, m: f16, qs: [u8; 16] }: y = q * d + m.
fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

// block_q5_0 { d: f16, qh: u32 (5th bits), qs: [u8; 16] }, offset -16.
fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = ((qs[j] & 0x0F) | xh0) as i32 - 16;
        let x1 = ((qs[j] >> 4) | xh1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

// block_q5_1 { d: f16, m: f16, qh: u32, qs: [u8; 16] }: y = q * d + m.
fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = (qs[j] & 0x0F) | xh0;
        let x1 = (qs[j] >> 4) | xh1;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

// block_q8_0 { d: f16, qs: [i8; 32] }.
fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = b[2 + j] as i8 as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes
/// shared by Q4_K and Q5_K.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

// block_q4_K { d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128] }: eight
// sub-blocks of 32, each y = d * sc * q - dmin * m.
fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

// block_q5_K { d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128] }.
fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (chunk, (ql, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let u1 = 1u8 << (2 * chunk);
        let u2 = 2u8 << (2 * chunk);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

// block_q6_K { ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 }: two
// halves of 128 elements, each element 4 low bits from ql and 2 high bits
// from qh, offset -32, with one scale per 16 elements.
fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let y = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// IQ4_NL's and IQ4_XS's 16 non-uniform levels (ggml's `kvalues_iq4nl`).
pub const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// MXFP4's levels: the FP4 (E2M1) values doubled, so they are integers
/// (ggml's `kvalues_mxfp4`); the block scale is halved to match.
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of an E8M0 scale, `2^(e - 128)`, as ggml computes it (the two
/// smallest exponents as subnormals).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    f32::from_bits(if e < 2 {
        0x0020_0000 << e
    } else {
        ((e as u32) - 1) << 23
    })
}

/// The sixteen 6-bit scales of a Q3_K super-block (its 12 packed bytes),
/// each less 32.
#[inline]
pub fn q3k_scales(q: &[u8]) -> [i8; 16] {
    let w = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    const K1: u32 = 0x0303_0303;
    const K2: u32 = 0x0f0f_0f0f;
    let aux = [
        (a0 & K2) | ((tmp & K1) << 4),
        (a1 & K2) | (((tmp >> 2) & K1) << 4),
        ((a0 >> 4) & K2) | (((tmp >> 4) & K1) << 4),
        ((a1 >> 4) & K2) | (((tmp >> 6) & K1) << 4),
    ];
    std::array::from_fn(|g| ((aux[g / 4] >> (8 * (g % 4))) & 0xff) as i8 - 32)
}

/// The 6-bit scale of block `j` (0..8) of an IQ4_XS super-block, less 32.
#[inline]
pub fn iq4xs_scale(b: &[u8], j: usize) -> i8 {
    let sh = u16::from_le_bytes([b[2], b[3]]);
    let lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
    let hi = ((sh >> (2 * j)) & 3) as u8;
    (lo | (hi << 4)) as i8 - 32
}

// block_q2_K { scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16 }: two
// halves of 128 elements; element l of block j (0..4) of a half is bits
// 2j..2j + 2 of qs[l]; each 16 elements have a 4-bit scale (low nibble)
// and a 4-bit minimum (high nibble): y = d * sc * q - dmin * m.
fn dequant_q2_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 80);
    let min = f16_at(b, 82);
    for (g, y) in y.chunks_exact_mut(16).enumerate() {
        let sc = b[g];
        let (dl, ml) = (d * (sc & 0x0F) as f32, min * (sc >> 4) as f32);
        let (half, j, part) = (g / 8, (g / 2) % 4, g % 2);
        let q = &b[16 + 32 * half + 16 * part..16 + 32 * half + 16 * part + 16];
        for (v, &q) in y.iter_mut().zip(q) {
            *v = dl * ((q >> (2 * j)) & 3) as f32 - ml;
        }
    }
}

// block_q3_K { hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16 }:
// as Q2_K's layout for the two low bits; the third bit of element l of
// block j is bit j of hmask[l], and a clear bit subtracts 4. Scales are
// 6-bit, less 32.
fn dequant_q3_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 108);
    let scales = q3k_scales(&b[96..108]);
    for (g, y) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * scales[g] as f32;
        let (half, j, part) = (g / 8, (g / 2) % 4, g % 2);
        let q = &b[32 + 32 * half + 16 * part..32 + 32 * half + 16 * part + 16];
        let hm = &b[16 * part..16 * part + 16];
        let bit = 1u8 << (4 * half + j);
        for ((v, &q), &h) in y.iter_mut().zip(q).zip(hm) {
            let level = ((q >> (2 * j)) & 3) as i8 - if h & bit != 0 { 0 } else { 4 };
            *v = dl * level as f32;
        }
    }
}

// block_iq4_nl { d: f16, qs: [u8; 16] }: nibbles index IQ4_LEVELS.
fn dequant_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        y[j] = d * IQ4_LEVELS[(b[2 + j] & 0x0F) as usize] as f32;
        y[j + 16] = d * IQ4_LEVELS[(b[2 + j] >> 4) as usize] as f32;
    }
}

// block_iq4_xs { d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128] }:
// eight blocks of 32 laid out as IQ4_NL's, each with a 6-bit scale.
fn dequant_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, y) in y.chunks_exact_mut(32).enumerate() {
        let dl = d * iq4xs_scale(b, j) as f32;
        let qs = &b[8 + 16 * j..8 + 16 * j + 16];
        for i in 0..16 {
            y[i] = dl * IQ4_LEVELS[(qs[i] & 0x0F) as usize] as f32;
            y[i + 16] = dl * IQ4_LEVELS[(qs[i] >> 4) as usize] as f32;
        }
    }
}

// block_mxfp4 { e: u8 (E8M0), qs: [u8; 16] }: nibbles index MXFP4_LEVELS.
fn dequant_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for j in 0..16 {
        y[j] = MXFP4_LEVELS[(b[1 + j] & 0x0F) as usize] as f32 * d;
        y[j + 16] = MXFP4_LEVELS[(b[1 + j] >> 4) as usize] as f32 * d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_match_ggml() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        // Sizes from ggml's static_asserts on its block structs.
        assert_eq!(GgmlType::Q4K.type_size(), 144);
        assert_eq!(GgmlType::Q5K.type_size(), 176);
        assert_eq!(GgmlType::Q6K.type_size(), 210);
        assert_eq!(GgmlType::Q2K.type_size(), 84);
        assert_eq!(GgmlType::Q3K.type_size(), 110);
        assert_eq!(GgmlType::Q8K.type_size(), 292);
        assert_eq!(GgmlType::IQ4XS.type_size(), 136);
        assert_eq!(GgmlType::IQ4NL.type_size(), 18);
        assert_eq!(GgmlType::MXFP4.type_size(), 17);
        assert_eq!(GgmlType::from_id(4), None, "q4_2 was removed from ggml");
    }

    #[test]
    fn size_mismatch_is_an_error_not_a_panic() {
        let mut out = [0f32; 32];
        assert!(matches!(
            dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out),
            Err(DequantError::SizeMismatch { .. })
        ));
        assert_eq!(
            dequantize(GgmlType::I32, &[0u8; 4], &mut [0f32; 1]),
            Err(DequantError::Unsupported(GgmlType::I32))
        );
    }

    #[test]
    fn q8_0_scales_signed_bytes() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        b[2] = (-4i8) as u8;
        b[3] = 6;
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q8_0, &b, &mut out).unwrap();
        assert_eq!(&out[..3], &[-2.0, 3.0, 0.0]);
    }
}
