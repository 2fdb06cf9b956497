//! Q4_K, Q5_K, Q6_K and Q3_K panels against many activation rows on AMX
//! tiles (Intel's Advanced Matrix Extensions, int8), with the very bits
//! of the vector kernels (`x86::dot_q4k`, `x86::dot_k`).
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
//! (-4064 to 4096, its scale signed and per 16 elements), Q3_K's `scale *
//! (level - 4)`, whose high byte is signed: the high tiles take
//! `tdpbssd` (signed both), which Q4_K's and Q5_K's high bytes (0 to 7)
//! read the same way. Only then are the tiles
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

use super::x86::{f16x16, i8x16, super_block_step, unpack_q23k, unpack_q4k, unpack_q6k, Out, Tree};
use super::{unit_bytes, Q3K_D, Q3K_SC, Q4K_D, Q4K_DMIN, Q4K_MINS, Q4K_QS, Q4K_SC, Q6K_D, Q6K_SC};
use crate::dot::BlockQ8;
use crate::quant::GgmlType;

/// Activation rows per call, at most: eight A tiles' worth.
pub const ROWS: usize = super::AMX_ROWS;

/// Bytes of expanded levels per super-block: 4 steps of 64 elements, each
/// a high and a low B tile of 16 x 64 bytes.
pub const SUPER_BLOCK_BYTES: usize = 8192;

thread_local! {
    /// Whether this thread has loaded the tile configuration.
    static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Each thread's accumulators and class sums for [`ROWS`] rows (32
    /// KiB), kept between calls: a call writes every row it reads (a
    /// class's accumulators are set before its blocks, and the tree's
    /// sums in class order before they are read), so nothing needs
    /// clearing, where a call building them afresh spent as long zeroing
    /// them as a small matrix's panel takes to multiply.
    static SUMS: std::cell::UnsafeCell<Box<Sums>> = std::cell::UnsafeCell::new(new_sums());
}

struct Sums {
    acc: [__m512; ROWS],
    tree: Tree<ROWS>,
}

/// Zero sums for every row.
// SAFETY: all-zero bits are valid floats.
const ZEROS: [__m512; ROWS] = unsafe { std::mem::zeroed() };

fn new_sums() -> Box<Sums> {
    // SAFETY: all-zero bits are a valid `Sums` (floats).
    unsafe { Box::<Sums>::new_zeroed().assume_init() }
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

/// The types the tiles take, as `dot`'s `KIND`.
pub const Q4K: u8 = 0;
pub const Q5K: u8 = 1;
pub const Q6K: u8 = 2;
pub const Q3K: u8 = 3;

/// Expands the panel unit at `q` (one super-block of 16 rows) into `lv`
/// ([`SUPER_BLOCK_BYTES`]): for step s (blocks 2s, 2s + 1), the high
/// bytes of `scale * (level - offset)` as 16 tile rows of 64 bytes, then
/// the low bytes. Q4_K and Q5_K: the block's scale (0 to 63), no offset
/// (at most 63 * 31 = 1953); Q6_K and Q3_K: the 16-element group's
/// signed scale, offsets 32 and 4 (-4064 to 4096; the high byte signed).
#[inline(always)]
unsafe fn expand<const KIND: u8>(q: *const u8, lv: *mut u8) {
    let m0f = _mm512_set1_epi8(0x0f);
    let lo_byte = _mm512_set1_epi16(0x00ff);
    let hi_byte = _mm512_set1_epi16(0xff00_u16 as i16);
    let off = _mm512_set1_epi16(match KIND {
        Q6K => 32,
        Q3K => 4,
        _ => 0,
    });
    // A scale per 32-bit lane, in both 16-bit halves.
    let both = |s: __m512i| {
        _mm512_or_si512(
            _mm512_and_si512(s, _mm512_set1_epi32(0xffff)),
            _mm512_slli_epi32::<16>(s),
        )
    };
    for step in 0..4 {
        let dst = lv.add(step * 2048);
        for h in 0..2 {
            let j = 2 * step + h;
            let w = match KIND {
                Q4K => {
                    // Low nibbles of the step's words, then high.
                    let mut w = [_mm512_setzero_si512(); 8];
                    for (t, x) in w.iter_mut().enumerate() {
                        let v = _mm512_loadu_si512(q.add(Q4K_QS + (step * 8 + t) * 64) as *const __m512i);
                        *x = if h == 0 {
                            _mm512_and_si512(v, m0f)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(v), m0f)
                        };
                    }
                    w
                }
                Q5K => unpack_q4k::<true>(q, j),
                Q6K => unpack_q6k(q, j / 4, j % 4),
                _ => unpack_q23k::<true>(q, j),
            };
            let (s0, s1) = match KIND {
                Q4K | Q5K => {
                    let s = both(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        q.add(Q4K_SC + 16 * j) as *const __m128i
                    )));
                    (s, s)
                }
                _ => {
                    let at = if KIND == Q6K { Q6K_SC } else { Q3K_SC };
                    (both(i8x16(q.add(at + 32 * j))), both(i8x16(q.add(at + 32 * j + 16))))
                }
            };
            for t in 0..8 {
                let s16 = if t < 4 { s0 } else { s1 };
                // Even and odd bytes, less the offset, times the scale,
                // as 16-bit words.
                let pe = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(w[t], lo_byte), off), s16);
                let po = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_srli_epi16::<8>(w[t]), off), s16);
                let high = _mm512_or_si512(_mm512_srli_epi16::<8>(pe), _mm512_and_si512(po, hi_byte));
                let low = _mm512_or_si512(_mm512_and_si512(pe, lo_byte), _mm512_slli_epi16::<8>(po));
                let row = 8 * h + t;
                _mm512_store_si512(dst.add(row * 64) as *mut __m512i, high);
                _mm512_store_si512(dst.add(1024 + row * 64) as *mut __m512i, low);
            }
        }
    }
}

/// Up to [`ROWS`] activation rows against the panel of type `KIND` at
/// `p`: `acts` and `aux`, the `rows` rows' blocks and aux values row after
/// row; `a`, their bytes as [`place_row`] lays them out, up to the next
/// multiple of 32 rows.
///
/// # Safety
///
/// [`crate::cpu::amx`] is true; the shapes as said; as for `x86::dot`
/// otherwise.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot<const KIND: u8>(
    p: *const u8,
    n_blocks: usize,
    a: *const i8,
    acts: &[BlockQ8],
    aux: &[i32],
    rows: usize,
    out: Out,
) {
    if !CONFIGURED.get() {
        let cfg = Config::new();
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        CONFIGURED.set(true);
    }
    let al = aux.len() / rows;
    let ty = match KIND {
        Q4K => GgmlType::Q4K,
        Q5K => GgmlType::Q5K,
        Q6K => GgmlType::Q6K,
        _ => GgmlType::Q3K,
    };
    let ub = unit_bytes(ty);
    let mins = matches!(KIND, Q4K | Q5K);
    let n_sb = n_blocks / 8;
    let zero = _mm512_setzero_si512();
    #[repr(C, align(64))]
    struct Aligned<T>(T);
    // One super-block's expanded levels, all written by `expand` before
    // any is read (left unset here: zeroing 12 KiB a call showed in
    // profiles).
    let mut lv = std::mem::MaybeUninit::<Aligned<[u8; SUPER_BLOCK_BYTES]>>::uninit();
    let b = lv.as_mut_ptr() as *mut u8;
    // The tiles' sums of one super-block and 32 rows: high and low for
    // rows 0..16, then for rows 16..32; all stored from the tiles before
    // any is read.
    let mut c = std::mem::MaybeUninit::<Aligned<[[[i32; 16]; 16]; 4]>>::uninit();
    let cp = c.as_mut_ptr() as *mut i32;
    // Units are stored class by class (super-blocks c, c + 8, ... for
    // accumulator class c; `super::unit_slot`), and read in that order.
    // SAFETY: this thread's own buffer, used by this call alone (a call
    // does not re-enter `dot`).
    let sums: *mut Sums = SUMS.with(|s| unsafe { &mut **s.get() as *mut Sums });
    let Sums { acc, tree } = unsafe { &mut *sums };
    let mut slot = 0;
    for class in 0..8 {
        if class >= n_sb {
            // No super-block in this class: its sums are zero.
            tree.push_rows(class, &ZEROS, rows);
            continue;
        }
        let mut sb = class;
        while sb < n_sb {
            let q = p.add(slot * ub);
            let mut mv = [zero; 4];
            expand::<KIND>(q, b);
            let (d, dmin) = match KIND {
                Q4K | Q5K => {
                    for (k, m) in mv.iter_mut().enumerate() {
                        *m = _mm512_cvtepu8_epi16(_mm256_loadu_si256(q.add(Q4K_MINS + 32 * k) as *const __m256i));
                    }
                    (f16x16(q.add(Q4K_D)), f16x16(q.add(Q4K_DMIN)))
                }
                Q6K => (f16x16(q.add(Q6K_D)), _mm512_setzero_ps()),
                _ => (f16x16(q.add(Q3K_D)), _mm512_setzero_ps()),
            };
            for g0 in (0..rows).step_by(32) {
                let a0 = a.add((g0 / 32 * n_sb + slot) * SUPER_BLOCK_BYTES);
                // Both tiles of 32 rows, even where the rows end in the
                // first (the bytes are there, zero; the sums unused).
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
                for r in g0..rows.min(g0 + 32) {
                    let (g, rr) = ((r - g0) / 16, r % 16);
                    let high = _mm512_load_si512(cp.add(512 * g + 16 * rr) as *const __m512i);
                    let low = _mm512_load_si512(cp.add(512 * g + 256 + 16 * rr) as *const __m512i);
                    let isum = [_mm512_add_epi32(_mm512_slli_epi32::<8>(high), low)];
                    let mut msum = [zero];
                    if mins {
                        let x = aux.as_ptr().add(r * al + sb * 4);
                        for (k, &m) in mv.iter().enumerate() {
                            msum[0] = _mm512_dpwssd_epi32(msum[0], m, _mm512_set1_epi32(*x.add(k)));
                        }
                    }
                    // A class's accumulators start at zero with its
                    // first super-block (set here, not cleared ahead:
                    // clearing 8 KiB per class showed in profiles).
                    let mut one = [if sb == class { _mm512_setzero_ps() } else { acc[r] }];
                    let row = acts.get_unchecked(r * n_blocks..(r + 1) * n_blocks);
                    super_block_step::<1>(&mut one, &[row], sb, d, &isum, mins.then_some((dmin, &msum)));
                    acc[r] = one[0];
                }
            }
            slot += 1;
            sb += 8;
        }
        tree.push_rows(class, acc, rows);
    }
    tree.store_rows(out, rows);
}
