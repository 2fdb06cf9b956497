#![allow(clippy::needless_range_loop, clippy::int_plus_one)] // register arrays indexed by head and position; blocks of `$p`
//! Attention over F16 pages with 512-bit vectors: a register holds one
//! 16-element chunk, which is exactly the dot product's 16 lanes, so
//! each lane takes the same fused multiply-adds as `dot_f32` and the
//! value sums the same as `axpy`, and the lanes are folded by the same
//! tree. Scores of several (position, head) pairs share one fold
//! (`folds`); value sums keep up to 64 dimensions of every head of the
//! group in registers over all positions; each page is walked as one
//! contiguous run of vectors.

use std::arch::x86_64::*;

use super::attend::F16_TILE as TILE;
use super::{softmax_row, AttnQuery, AttnRow, KvStorage};

/// Positions the prefetch cursor runs ahead of the scores (measured
/// with `attnbench`, keys and values in memory: 8 to 64 all gain about
/// a third over none; 16 was best).
const AHEAD: usize = 16;

/// The query range's runs of consecutive positions within one page:
/// (index in the range of the run's first position, element offset of
/// its vector, positions).
fn runs<'a>(
    kv: &'a KvStorage,
    layer: usize,
    is_v: bool,
    kv_head: usize,
    query: &'a AttnQuery,
) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let pt = kv.shape.page_tokens;
    let mut p = query.start;
    std::iter::from_fn(move || {
        if p >= query.end {
            return None;
        }
        let (index, first) = (p / pt, p % pt);
        let len = (pt - first).min(query.end - p);
        let run = (
            p - query.start,
            kv.offset(query.pages[index], layer, is_v, kv_head, first),
            len,
        );
        p += len;
        Some(run)
    })
}

/// A cursor some positions ahead of the scores' pass: at each step it
/// asks for the key and the value there to be brought into cache, so
/// the keys arrive before the pass reaches them and the values before
/// the value pass does. A page's vectors are a few KiB in one place,
/// pages anywhere, which the hardware's prefetchers do not follow.
struct Ahead<'a> {
    kv: &'a KvStorage,
    pages: &'a [u32],
    layer: usize,
    kv_head: usize,
    pos: usize,
    end: usize,
    off: usize,
}

impl<'a> Ahead<'a> {
    fn new(kv: &'a KvStorage, layer: usize, kv_head: usize, query: &'a AttnQuery, distance: usize) -> Ahead<'a> {
        let mut a = Ahead {
            kv,
            pages: query.pages,
            layer,
            kv_head,
            pos: query.start,
            end: query.end,
            off: 0,
        };
        a.seek();
        for _ in 0..distance {
            a.advance();
        }
        a
    }

    #[inline(always)]
    fn seek(&mut self) {
        if self.pos < self.end {
            let pt = self.kv.shape.page_tokens;
            self.off = self.kv.offset(
                self.pages[self.pos / pt],
                self.layer,
                false,
                self.kv_head,
                self.pos % pt,
            );
        }
    }

    #[inline(always)]
    fn advance(&mut self) {
        self.pos += 1;
        if self.pos.is_multiple_of(self.kv.shape.page_tokens) {
            self.seek();
        } else {
            self.off += self.kv.shape.head_dim;
        }
    }

    /// Prefetches the key and the value at the cursor, then moves on.
    #[inline(always)]
    unsafe fn step(&mut self, dk: *const u16, dv: *const u16) {
        if self.pos >= self.end {
            return;
        }
        for l in (0..self.kv.shape.head_dim).step_by(32) {
            _mm_prefetch::<_MM_HINT_T0>(dk.add(self.off + l) as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(dv.add(self.off + l) as *const i8);
        }
        self.advance();
    }
}

/// Where register `f` of [`folds`] goes in, so that its sum comes out
/// in lane `f`.
const fn slot(f: usize) -> usize {
    match f {
        0..4 => 2 * f,
        4..8 => 2 * (f - 4) + 1,
        8..12 => 8 + 2 * (f - 8),
        _ => 9 + 2 * (f - 12),
    }
}

/// [`crate::ops::fold16`] of 16 registers at once, the sum of register
/// `f` in lane `f`: the halves' sums `l[k] + l[k + 8]` of two
/// registers in one, then three rounds of pairwise sums, each round
/// taking sixteen lanes at a time, so every register's lanes are summed
/// by the same tree as `fold16`'s (`((0+1)+(2+3))+((4+5)+(6+7))`) with a
/// few shuffles shared by all of them, and no lane leaves a register.
#[inline(always)]
unsafe fn folds(a: &[__m512; 16]) -> __m512 {
    let mut s = [_mm512_setzero_ps(); 16];
    for f in 0..16 {
        s[slot(f)] = a[f];
    }
    // Two registers' halves' sums: lanes 0..8 the first's, 8..16 the
    // second's.
    let halves =
        |x: __m512, y: __m512| _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y));
    // Sums of neighbouring lanes, within each 128-bit part: x's two
    // pairs, then y's.
    let pairs = |x: __m512, y: __m512| _mm512_add_ps(_mm512_shuffle_ps::<0x88>(x, y), _mm512_shuffle_ps::<0xDD>(x, y));
    let z: [__m512; 8] = std::array::from_fn(|i| halves(s[2 * i], s[2 * i + 1]));
    let w: [__m512; 4] = std::array::from_fn(|i| pairs(z[2 * i], z[2 * i + 1]));
    let (v0, v1) = (pairs(w[0], w[1]), pairs(w[2], w[3]));
    // Each register's sums of lanes 0..4 and of 4..8 are in parts 0 and
    // 1 (or 2 and 3) of v0 or v1.
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(v0, v1),
        _mm512_shuffle_f32x4::<0xDD>(v0, v1),
    )
}

/// `$f::<G, R>(args)` for `$g` query heads (1 to 8) and `$r` value
/// registers (8, 4, 2, else 1): one compiled body for each pair.
macro_rules! by_shape {
    ($f:ident, $g:expr, $r:expr, $args:tt) => {
        match $r {
            8 => by_shape!(@g $f, $g, 8, $args),
            4 => by_shape!(@g $f, $g, 4, $args),
            2 => by_shape!(@g $f, $g, 2, $args),
            _ => by_shape!(@g $f, $g, 1, $args),
        }
    };
    (@g $f:ident, $g:expr, $r:literal, ($($a:expr),*)) => {
        match $g {
            1 => $f::<1, $r>($($a),*),
            2 => $f::<2, $r>($($a),*),
            3 => $f::<3, $r>($($a),*),
            4 => $f::<4, $r>($($a),*),
            5 => $f::<5, $r>($($a),*),
            6 => $f::<6, $r>($($a),*),
            7 => $f::<7, $r>($($a),*),
            8 => $f::<8, $r>($($a),*),
            g => unreachable!("attention: {g} query heads per KV head take the generic path"),
        }
    };
}

/// A 16-element chunk of a key or value, as stored in the pages (F16)
/// or converted already (f32): the same values either way.
trait Chunk: Copy {
    unsafe fn load(p: *const Self) -> __m512;
}

impl Chunk for u16 {
    #[inline(always)]
    unsafe fn load(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

impl Chunk for f32 {
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

/// Scores of `P` consecutive positions (keys at `k`, `hd` apart) for
/// `G` heads, `P * G <= 16`, written to `scores[g * n + j]`.
#[inline(always)]
unsafe fn score_block<T: Chunk, const G: usize, const P: usize>(
    k: *const T,
    hd: usize,
    q: *const f32,
    scale: f32,
    scores: *mut f32,
    n: usize,
) {
    debug_assert!(G * P <= 16);
    // Register `g * P + j`: head `g`'s sum for position `j` (the rest
    // stay zero).
    let mut a = [_mm512_setzero_ps(); 16];
    for c in (0..hd).step_by(16) {
        let mut kc = [_mm512_setzero_ps(); P];
        for (j, kj) in kc.iter_mut().enumerate() {
            *kj = T::load(k.add(j * hd + c));
        }
        for g in 0..G {
            let qv = _mm512_loadu_ps(q.add(g * hd + c));
            for j in 0..P {
                a[g * P + j] = _mm512_fmadd_ps(qv, kc[j], a[g * P + j]);
            }
        }
    }
    let sums = _mm512_mul_ps(folds(&a), _mm512_set1_ps(scale));
    let low = ((1u32 << P) - 1) as __mmask16;
    for g in 0..G {
        // Head `g`'s `P` scores moved to the first lanes, then stored.
        let x = if g == 0 {
            sums
        } else {
            _mm512_permutexvar_ps(
                _mm512_add_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32((g * P) as i32),
                ),
                sums,
            )
        };
        _mm512_mask_storeu_ps(scores.add(g * n), low, x);
    }
}

/// Positions a block of scores takes: their accumulators fill at most
/// 16 registers (and the keys at most 8 more).
const fn per_block(g: usize) -> usize {
    match g {
        1 | 2 => 8,
        3 | 4 => 4,
        _ => 2,
    }
}

/// Attention of `G` heads, value sums `R` registers (`16 * R`
/// dimensions) wide; `R` divides `head_dim / 16`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn group<const G: usize, const R: usize>(
    dk: &[u16],
    dv: &[u16],
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let hd = kv.shape.head_dim;
    let n = query.end - query.start;
    let sp = scores.as_mut_ptr();
    let mut ahead = Ahead::new(kv, layer, kv_head, query, AHEAD);
    for (i0, off, len) in runs(kv, layer, false, kv_head, query) {
        let k = dk.as_ptr().add(off);
        let mut t = 0;
        macro_rules! blocks {
            ($p:expr) => {
                while t + $p <= len {
                    for _ in 0..$p {
                        ahead.step(dk.as_ptr(), dv.as_ptr());
                    }
                    score_block::<u16, G, { $p }>(k.add(t * hd), hd, q.as_ptr(), scale, sp.add(i0 + t), n);
                    t += $p;
                }
            };
        }
        match per_block(G) {
            8 => blocks!(8),
            4 => blocks!(4),
            2 => blocks!(2),
            _ => {}
        }
        blocks!(1);
    }
    for g in 0..G {
        softmax_row(&mut scores[g * n..(g + 1) * n]);
    }
    let sp = scores.as_ptr();
    for d0 in (0..hd).step_by(16 * R) {
        let mut o = [[_mm512_setzero_ps(); R]; G];
        for (i0, off, len) in runs(kv, layer, true, kv_head, query) {
            let v = dv.as_ptr().add(off + d0);
            for t in 0..len {
                let mut vr = [_mm512_setzero_ps(); R];
                for (r, x) in vr.iter_mut().enumerate() {
                    *x = _mm512_cvtph_ps(_mm256_loadu_si256(v.add(t * hd + 16 * r) as *const __m256i));
                }
                for (g, og) in o.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*sp.add(g * n + i0 + t));
                    for r in 0..R {
                        og[r] = _mm512_fmadd_ps(w, vr[r], og[r]);
                    }
                }
            }
        }
        for (g, og) in o.iter().enumerate() {
            for (r, x) in og.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(g * hd + d0 + 16 * r), *x);
            }
        }
    }
}

/// Value registers a head: as many as leave room for the group's
/// accumulators, the values and a weight in 32 registers, dividing the
/// head's chunks.
fn value_registers(hd: usize, group: usize) -> usize {
    debug_assert_eq!(hd % 16, 0);
    let most = match group {
        1 | 2 => 8,
        3..=6 => 4,
        _ => 2,
    };
    [8, 4, 2, 1]
        .into_iter()
        .find(|&r| r <= most && (hd / 16).is_multiple_of(r))
        .unwrap_or(1)
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn attend_group_f16(
    dk: &[u16],
    dv: &[u16],
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let hd = kv.shape.head_dim;
    let r = value_registers(hd, q.len() / hd);
    by_shape!(
        group,
        q.len() / hd,
        r,
        (dk, dv, kv, layer, kv_head, query, q, scale, out, scores)
    );
}

/// Converts the vectors of positions `p0..p1` (keys, or values with
/// `is_v`) of the sequence with `pages` to f32, one after another at
/// `tile`. F16 to f32 is exact: the values are the ones a row reads
/// from the pages itself.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn to_f32(
    d: &[u16],
    kv: &KvStorage,
    layer: usize,
    is_v: bool,
    kv_head: usize,
    pages: &[u32],
    (p0, p1): (usize, usize),
    tile: *mut f32,
) {
    let (pt, hd) = (kv.shape.page_tokens, kv.shape.head_dim);
    let mut p = p0;
    while p < p1 {
        let (index, first) = (p / pt, p % pt);
        let len = (pt - first).min(p1 - p);
        let off = kv.offset(pages[index], layer, is_v, kv_head, first);
        debug_assert!(off + len * hd <= d.len());
        let (src, dst) = (d.as_ptr().add(off), tile.add((p - p0) * hd));
        for e in (0..len * hd).step_by(16) {
            _mm512_storeu_ps(dst.add(e), u16::load(src.add(e)));
        }
        p += len;
    }
}

/// [`group`] for several rows of one sequence together (up to 16, `G`
/// query heads each, row `i`'s scores at `offs[i]` of `scores`): each
/// tile of positions is converted to f32 once for all of them, then
/// every row runs over it the operations it runs alone, in the same
/// order (its value sums carried from tile to tile in its output).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn rows_group<const G: usize, const R: usize>(
    dk: &[u16],
    dv: &[u16],
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    rows: &mut [AttnRow],
    offs: &[usize],
    scale: f32,
    scores: &mut [f32],
    tile: &mut [f32],
) {
    let hd = kv.shape.head_dim;
    let step = (TILE / hd).max(1);
    let pages = rows[0].query.pages;
    let lo = rows.iter().map(|r| r.query.start).min().unwrap_or(0);
    let hi = rows.iter().map(|r| r.query.end).max().unwrap_or(0);
    let (sp, tp) = (scores.as_mut_ptr(), tile.as_mut_ptr());
    let mut p0 = lo;
    while p0 < hi {
        let p1 = (p0 + step).min(hi);
        to_f32(dk, kv, layer, false, kv_head, pages, (p0, p1), tp);
        for (row, &off) in rows.iter().zip(offs) {
            let (s, e) = (row.query.start, row.query.end);
            let (a, b) = (p0.max(s), p1.min(e));
            if a >= b {
                continue;
            }
            let (n, len) = (e - s, b - a);
            let k = tp.add((a - p0) * hd) as *const f32;
            let dst = sp.add(off + a - s);
            let mut t = 0;
            macro_rules! blocks {
                ($p:expr) => {
                    while t + $p <= len {
                        score_block::<f32, G, { $p }>(k.add(t * hd), hd, row.q.as_ptr(), scale, dst.add(t), n);
                        t += $p;
                    }
                };
            }
            match per_block(G) {
                8 => blocks!(8),
                4 => blocks!(4),
                2 => blocks!(2),
                _ => {}
            }
            blocks!(1);
        }
        p0 = p1;
    }
    for (row, &off) in rows.iter_mut().zip(offs) {
        let n = row.query.end - row.query.start;
        for g in 0..G {
            softmax_row(&mut scores[off + g * n..off + (g + 1) * n]);
        }
        row.out.fill(0.0);
    }
    let sp = scores.as_ptr();
    let mut p0 = lo;
    while p0 < hi {
        let p1 = (p0 + step).min(hi);
        to_f32(dv, kv, layer, true, kv_head, pages, (p0, p1), tp);
        for (row, &off) in rows.iter_mut().zip(offs) {
            let (s, e) = (row.query.start, row.query.end);
            let (a, b) = (p0.max(s), p1.min(e));
            if a >= b {
                continue;
            }
            let n = e - s;
            let w = sp.add(off + a - s);
            let op = row.out.as_mut_ptr();
            for d0 in (0..hd).step_by(16 * R) {
                let mut o = [[_mm512_setzero_ps(); R]; G];
                for (g, og) in o.iter_mut().enumerate() {
                    for (r, x) in og.iter_mut().enumerate() {
                        *x = _mm512_loadu_ps(op.add(g * hd + d0 + 16 * r));
                    }
                }
                let v = tp.add((a - p0) * hd + d0) as *const f32;
                for t in 0..b - a {
                    let mut vr = [_mm512_setzero_ps(); R];
                    for (r, x) in vr.iter_mut().enumerate() {
                        *x = _mm512_loadu_ps(v.add(t * hd + 16 * r));
                    }
                    for (g, og) in o.iter_mut().enumerate() {
                        let w = _mm512_set1_ps(*w.add(g * n + t));
                        for r in 0..R {
                            og[r] = _mm512_fmadd_ps(w, vr[r], og[r]);
                        }
                    }
                }
                for (g, og) in o.iter().enumerate() {
                    for (r, x) in og.iter().enumerate() {
                        _mm512_storeu_ps(op.add(g * hd + d0 + 16 * r), *x);
                    }
                }
            }
        }
        p0 = p1;
    }
}

/// [`attend_group_f16`] of several rows of one sequence, each with the
/// same number of query heads (at most 8) and the same bits as alone:
/// row `i`'s scores at `offs[i]` of `scores`, and [`TILE`] elements (at
/// least one vector) in `tile`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn attend_rows_f16(
    dk: &[u16],
    dv: &[u16],
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    rows: &mut [AttnRow],
    offs: &[usize],
    scale: f32,
    scores: &mut [f32],
    tile: &mut [f32],
) {
    let hd = kv.shape.head_dim;
    let g = rows[0].q.len() / hd;
    debug_assert!(tile.len() >= TILE.max(hd) && rows.iter().all(|r| r.q.len() == g * hd));
    by_shape!(
        rows_group,
        g,
        value_registers(hd, g),
        (dk, dv, kv, layer, kv_head, rows, offs, scale, scores, tile)
    );
}
