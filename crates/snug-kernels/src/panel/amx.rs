//! Q4_K and Q6_K panels against many activation rows on AMX tiles
//! (Intel's Advanced Matrix Extensions, int8), with the very bits of the
//! vector kernels (`x86::dot_q4k`, `x86::dot_k`).
//!
//! The vector kernel spends most of its time not in `vpdpbusd` but in
//! scaling each 32-element block's sum by the block's 6-bit scale
//! (`vpmulld`) before the super-block's float step. A tile product that
//! stops at every block to hand its sums to that scaling is no faster
//! (tried: 0.92-0.97x). Here the scale goes into the weights instead: a
//! task expands its panel once ([`expand_q4k`]) into `scale * level`
//! (at most 63 * 15 = 945) split into a high and a low byte, and two tile
//! products (`tdpbsud`: signed activations, unsigned weights) sum a whole
//! 256-element super-block for 16 activation rows and 16 weight rows:
//! `256 * high + low` is exactly the integer the vector kernel builds
//! block by block. Q6_K's expanded weights are `scale * (level - 32)`
//! (-4064 to 4096, its scale signed and per 16 elements), whose high
//! byte is signed: the high tiles take `tdpbssd` (signed both), which
//! Q4_K's high bytes (0 to 3) read the same way. Only then are the tiles
//! read back, once per
//! super-block, for the same float steps in the same order.
//!
//! A tile product is fast enough that feeding it decides the speed: a
//! call takes up to 128 activation rows (their bytes stay in L2 for the
//! task's whole panel) and walks the panel super-block by super-block,
//! expanding each into 8 KiB that stay in L1 while every group of 32
//! rows takes its products from them.
//!
//! The expanded levels are the B operand as AMX lays it out: B's row k
//! holds, for each of the 16 columns (weight rows), four consecutive
//! elements, which is a panel's word. The activations are A: their bytes
//! copied row by row ([`crate::matmul`]), 64 to a tile row.

use std::arch::asm;
use std::arch::x86_64::*;

use super::x86::{f16x16, super_block_step, unpack_q6k, Out, Tree};
use super::{unit_bytes, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_QS, Q4K_SC, Q6K_D, Q6K_SC};
use crate::dot::BlockQ8;
use crate::quant::GgmlType;

/// Activation rows per call, at most: eight A tiles' worth.
pub const ROWS: usize = 128;

/// Bytes of expanded levels per super-block: 4 steps of 64 elements, each
/// a high and a low B tile of 16 x 64 bytes.
pub const SUPER_BLOCK_BYTES: usize = 8192;

thread_local! {
    /// Whether this thread has loaded the tile configuration.
    static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The one tile shape used: all eight tiles 16 rows of 64 bytes (tmm0-1:
/// activations, tmm2-3: high and low weights, tmm4-7: sums).
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    fn new() -> Config {
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c[48 + t] = 16;
        }
        Config(c)
    }
}

/// Places activation row `r`'s bytes (`blocks`: its Q8_K blocks, a whole
/// number of super-blocks) where the A tiles read them at `a`: per group
/// of 32 rows, per super-block in the panels' unit order, per step of 64
/// elements, the group's 32 rows of 64 bytes (two tiles one after the
/// other), so that a tile is 1 KiB in one piece.
///
/// # Safety
///
/// `a` has room for the rows up to the next multiple of 32.
pub unsafe fn place_row(blocks: &[BlockQ8], r: usize, a: *mut i8) {
    let n_sb = blocks.len() / 8;
    let (g, rr) = (r / 32, r % 32);
    for sb in 0..n_sb {
        let at = a.add((g * n_sb + super::unit_slot(sb, n_sb)) * SUPER_BLOCK_BYTES + rr * 64);
        for step in 0..4 {
            let dst = at.add(step * 2048);
            let (b0, b1) = (&blocks[8 * sb + 2 * step], &blocks[8 * sb + 2 * step + 1]);
            std::ptr::copy_nonoverlapping(b0.qs.as_ptr(), dst, 32);
            std::ptr::copy_nonoverlapping(b1.qs.as_ptr(), dst.add(32), 32);
        }
    }
}

/// Expands the Q4_K panel unit at `q` (one super-block of 16 rows) into
/// `lv` ([`SUPER_BLOCK_BYTES`]): for step s (blocks 2s, 2s + 1), the high
/// bytes of `scale * level` as 16 tile rows of 64 bytes, then the low
/// bytes.
#[inline(always)]
unsafe fn expand_unit(q: *const u8, lv: *mut u8) {
    let m0f = _mm512_set1_epi8(0x0f);
    let lo_byte = _mm512_set1_epi16(0x00ff);
    let hi_byte = _mm512_set1_epi16(0xff00_u16 as i16);
    for step in 0..4 {
        let dst = lv.add(step * 2048);
        for h in 0..2 {
            // Block 2 step + h: low nibbles of the step's words, then
            // high. Its scale per lane, in both 16-bit halves.
            let s = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(Q4K_SC + 16 * (2 * step + h)) as *const __m128i));
            let s16 = _mm512_or_si512(s, _mm512_slli_epi32::<16>(s));
            for t in 0..8 {
                let v = _mm512_loadu_si512(q.add(Q4K_QS + (step * 8 + t) * 64) as *const __m512i);
                let w = if h == 0 {
                    _mm512_and_si512(v, m0f)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(v), m0f)
                };
                // Even and odd bytes times the scale, as 16-bit words.
                let pe = _mm512_mullo_epi16(_mm512_and_si512(w, lo_byte), s16);
                let po = _mm512_mullo_epi16(_mm512_srli_epi16::<8>(w), s16);
                let high = _mm512_or_si512(_mm512_srli_epi16::<8>(pe), _mm512_and_si512(po, hi_byte));
                let low = _mm512_or_si512(_mm512_and_si512(pe, lo_byte), _mm512_slli_epi16::<8>(po));
                let row = 8 * h + t;
                _mm512_store_si512(dst.add(row * 64) as *mut __m512i, high);
                _mm512_store_si512(dst.add(1024 + row * 64) as *mut __m512i, low);
            }
        }
    }
}

/// Expands the Q6_K panel unit at `q` as [`expand_unit`] does Q4_K's,
/// with `scale * (level - 32)` (-4064 to 4096; its high byte signed, for
/// `tdpbssd`), the scale being the 16-element group's.
#[inline(always)]
unsafe fn expand_unit_q6k(q: *const u8, lv: *mut u8) {
    let lo_byte = _mm512_set1_epi16(0x00ff);
    let hi_byte = _mm512_set1_epi16(0xff00_u16 as i16);
    let m32 = _mm512_set1_epi16(32);
    for step in 0..4 {
        let dst = lv.add(step * 2048);
        for h in 0..2 {
            let j = 2 * step + h;
            let w = unpack_q6k(q, j / 4, j % 4);
            for half in 0..2 {
                let s = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(Q6K_SC + 32 * j + 16 * half) as *const __m128i));
                let s16 = _mm512_or_si512(
                    _mm512_and_si512(s, _mm512_set1_epi32(0xffff)),
                    _mm512_slli_epi32::<16>(s),
                );
                for t in 4 * half..4 * half + 4 {
                    let pe = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(w[t], lo_byte), m32), s16);
                    let po = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_srli_epi16::<8>(w[t]), m32), s16);
                    let high = _mm512_or_si512(_mm512_srli_epi16::<8>(pe), _mm512_and_si512(po, hi_byte));
                    let low = _mm512_or_si512(_mm512_and_si512(pe, lo_byte), _mm512_slli_epi16::<8>(po));
                    let row = 8 * h + t;
                    _mm512_store_si512(dst.add(row * 64) as *mut __m512i, high);
                    _mm512_store_si512(dst.add(1024 + row * 64) as *mut __m512i, low);
                }
            }
        }
    }
}

/// Up to [`ROWS`] activation rows (`acts.len()`) against the Q4_K panel
/// (Q6_K: `SIX`) at `p`. `a`: the rows' bytes as [`place_row`] lays them out, up to the
/// next multiple of 32 rows.
///
/// # Safety
///
/// [`crate::cpu::amx`] is true; the shapes as said; as for `x86::dot`
/// otherwise.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot<const SIX: bool>(
    p: *const u8,
    n_blocks: usize,
    a: *const i8,
    acts: &[&[BlockQ8]],
    aux: &[&[i32]],
    out: Out,
) {
    if !CONFIGURED.get() {
        let cfg = Config::new();
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        CONFIGURED.set(true);
    }
    let rows = acts.len();
    let ub = unit_bytes(if SIX { GgmlType::Q6K } else { GgmlType::Q4K });
    let n_sb = n_blocks / 8;
    let zero = _mm512_setzero_si512();
    #[repr(C, align(64))]
    struct Aligned<T>(T);
    // One super-block's expanded levels.
    let mut lv = Aligned([0u8; SUPER_BLOCK_BYTES]);
    let b = lv.0.as_mut_ptr();
    // The tiles' sums of one super-block and 32 rows: high and low for
    // rows 0..16, then for rows 16..32.
    let mut c = Aligned([[[0i32; 16]; 16]; 4]);
    let cp = c.0.as_mut_ptr() as *mut i32;
    // Units are stored class by class (super-blocks c, c + 8, ... for
    // accumulator class c; `super::unit_slot`), and read in that order.
    let mut tree = Tree::<ROWS>::new();
    let mut acc = [_mm512_setzero_ps(); ROWS];
    let mut slot = 0;
    for class in 0..8 {
        acc[..rows].fill(_mm512_setzero_ps());
        let mut sb = class;
        while sb < n_sb {
            let q = p.add(slot * ub);
            let mut mv = [zero; 4];
            let (d, dmin) = if SIX {
                expand_unit_q6k(q, b);
                (f16x16(q.add(Q6K_D)), _mm512_setzero_ps())
            } else {
                expand_unit(q, b);
                for (k, m) in mv.iter_mut().enumerate() {
                    *m = _mm512_cvtepu8_epi16(_mm256_loadu_si256(q.add(Q4K_MINS + 32 * k) as *const __m256i));
                }
                (f16x16(q.add(Q4K_D)), f16x16(q.add(Q4K_DMIN)))
            };
            for g0 in (0..rows).step_by(32) {
                let a0 = a.add((g0 / 32 * n_sb + slot) * SUPER_BLOCK_BYTES);
                if rows - g0 > 16 {
                    asm!(
                        "tilezero tmm4",
                        "tilezero tmm5",
                        "tilezero tmm6",
                        "tilezero tmm7",
                        "2:",
                        "tileloadd tmm2, [{b} + {w}*1]",
                        "tileloadd tmm3, [{b} + {w}*1 + 1024]",
                        "tileloadd tmm0, [{a} + {w}*1]",
                        "tileloadd tmm1, [{a} + {w}*1 + 1024]",
                        "tdpbssd tmm4, tmm0, tmm2",
                        "tdpbsud tmm5, tmm0, tmm3",
                        "tdpbssd tmm6, tmm1, tmm2",
                        "tdpbsud tmm7, tmm1, tmm3",
                        "add {b}, 2048",
                        "add {a}, 2048",
                        "dec {n}",
                        "jnz 2b",
                        "tilestored [{c} + {w}*1], tmm4",
                        "tilestored [{c} + {w}*1 + 1024], tmm5",
                        "tilestored [{c} + {w}*1 + 2048], tmm6",
                        "tilestored [{c} + {w}*1 + 3072], tmm7",
                        b = inout(reg) b => _,
                        a = inout(reg) a0 => _,
                        n = inout(reg) 4usize => _,
                        w = in(reg) 64usize,
                        c = in(reg) cp,
                        options(nostack),
                    );
                } else {
                    asm!(
                        "tilezero tmm4",
                        "tilezero tmm5",
                        "2:",
                        "tileloadd tmm2, [{b} + {w}*1]",
                        "tileloadd tmm3, [{b} + {w}*1 + 1024]",
                        "tileloadd tmm0, [{a} + {w}*1]",
                        "tdpbssd tmm4, tmm0, tmm2",
                        "tdpbsud tmm5, tmm0, tmm3",
                        "add {b}, 2048",
                        "add {a}, 2048",
                        "dec {n}",
                        "jnz 2b",
                        "tilestored [{c} + {w}*1], tmm4",
                        "tilestored [{c} + {w}*1 + 1024], tmm5",
                        b = inout(reg) b => _,
                        a = inout(reg) a0 => _,
                        n = inout(reg) 4usize => _,
                        w = in(reg) 64usize,
                        c = in(reg) cp,
                        options(nostack),
                    );
                }
                for r in g0..rows.min(g0 + 32) {
                    let (g, rr) = ((r - g0) / 16, r % 16);
                    let high = _mm512_load_si512(cp.add(512 * g + 16 * rr) as *const __m512i);
                    let low = _mm512_load_si512(cp.add(512 * g + 256 + 16 * rr) as *const __m512i);
                    let isum = [_mm512_add_epi32(_mm512_slli_epi32::<8>(high), low)];
                    let mut msum = [zero];
                    if !SIX {
                        let x = aux.get_unchecked(r);
                        for (k, &m) in mv.iter().enumerate() {
                            msum[0] = _mm512_dpwssd_epi32(msum[0], m, _mm512_set1_epi32(*x.get_unchecked(sb * 4 + k)));
                        }
                    }
                    let mut one = [acc[r]];
                    super_block_step::<1>(
                        &mut one,
                        std::slice::from_ref(acts.get_unchecked(r)),
                        sb,
                        d,
                        &isum,
                        (!SIX).then_some((dmin, &msum)),
                    );
                    acc[r] = one[0];
                }
            }
            slot += 1;
            sb += 8;
        }
        tree.push(class, &acc);
    }
    tree.store_rows(out, rows);
}
