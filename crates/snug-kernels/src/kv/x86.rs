//! Attention over F16 pages with the conversions fused into the dot
//! products and value sums: the same operations, in the same order, as
//! the generic path (`dot_f32` lanes and tree, `axpy`'s fused
//! multiply-adds), without a call per position.

use std::arch::x86_64::*;

use super::{softmax_row, AttnQuery, KvStorage};

/// The canonical sum of a dot product's two 8-lane sets (`reduce_sets`):
/// lanes added pairwise, then `((0+1)+(2+3))+((4+5)+(6+7))`, as vector
/// operations in that association.
#[inline(always)]
unsafe fn reduce(a0: __m256, a1: __m256) -> f32 {
    let s = _mm256_add_ps(a0, a1);
    let h = _mm256_hadd_ps(s, s);
    let h = _mm256_hadd_ps(h, h);
    _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)))
}

/// Scores and value sums of `G` query heads sharing a KV head: each key
/// and value element is converted once for the whole group, and a
/// head's accumulators stay in registers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn group_f16<const G: usize>(
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
    let pt = kv.shape.page_tokens;
    let hd = kv.shape.head_dim;
    let n = query.end - query.start;
    for (i, p) in (query.start..query.end).enumerate() {
        let o = kv.offset(query.pages[p / pt], layer, false, kv_head, p % pt);
        let k = dk[o..o + hd].as_ptr();
        let mut a0 = [_mm256_setzero_ps(); G];
        let mut a1 = [_mm256_setzero_ps(); G];
        for c in (0..hd).step_by(16) {
            let k0 = _mm256_cvtph_ps(_mm_loadu_si128(k.add(c) as *const __m128i));
            let k1 = _mm256_cvtph_ps(_mm_loadu_si128(k.add(c + 8) as *const __m128i));
            for g in 0..G {
                let qg = q.as_ptr().add(g * hd + c);
                a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg), k0, a0[g]);
                a1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg.add(8)), k1, a1[g]);
            }
        }
        for g in 0..G {
            *scores.get_unchecked_mut(g * n + i) = reduce(a0[g], a1[g]) * scale;
        }
    }
    for g in 0..G {
        softmax_row(&mut scores[g * n..(g + 1) * n]);
    }
    // Values: 16 dimensions at a time, every position, into registers;
    // each head's lanes still take the positions in order.
    for c in (0..hd).step_by(16) {
        let mut o0 = [_mm256_setzero_ps(); G];
        let mut o1 = [_mm256_setzero_ps(); G];
        for (i, p) in (query.start..query.end).enumerate() {
            let o = kv.offset(query.pages[p / pt], layer, true, kv_head, p % pt);
            let v = dv.as_ptr().add(o + c);
            let v0 = _mm256_cvtph_ps(_mm_loadu_si128(v as *const __m128i));
            let v1 = _mm256_cvtph_ps(_mm_loadu_si128(v.add(8) as *const __m128i));
            for g in 0..G {
                let w = _mm256_set1_ps(*scores.get_unchecked(g * n + i));
                o0[g] = _mm256_fmadd_ps(w, v0, o0[g]);
                o1[g] = _mm256_fmadd_ps(w, v1, o1[g]);
            }
        }
        for g in 0..G {
            _mm256_storeu_ps(out.as_mut_ptr().add(g * hd + c), o0[g]);
            _mm256_storeu_ps(out.as_mut_ptr().add(g * hd + c + 8), o1[g]);
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
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
    debug_assert_eq!(hd % 16, 0);
    match q.len() / hd {
        1 => group_f16::<1>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
        2 => group_f16::<2>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
        3 => group_f16::<3>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
        4 => group_f16::<4>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
        5 => group_f16::<5>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
        6 => group_f16::<6>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
        7 => group_f16::<7>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
        8 => group_f16::<8>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
        g => unreachable!("attention: {g} query heads per KV head take the generic path"),
    }
}

/// Converts positions `p0..p1` of the keys (or values, `is_v`) of the
/// sequence with `pages` to f32, one after another at `tile` (exact: the
/// values a row reads from the pages itself).
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
        for e in (0..len * hd).step_by(8) {
            _mm256_storeu_ps(
                dst.add(e),
                _mm256_cvtph_ps(_mm_loadu_si128(src.add(e) as *const __m128i)),
            );
        }
        p += len;
    }
}

/// [`group_f16`] for several rows of one sequence together (`G` query
/// heads each, row `i`'s scores at `offs[i]` of `scores`): each tile of
/// positions is converted to f32 once for all of them, then every row
/// runs over it the operations it runs alone, in the same order (its
/// value sums carried from tile to tile in its output).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn rows_f16<const G: usize>(
    dk: &[u16],
    dv: &[u16],
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    rows: &mut [super::AttnRow],
    offs: &[usize],
    scale: f32,
    scores: &mut [f32],
    tile: &mut [f32],
) {
    let hd = kv.shape.head_dim;
    let step = (super::attend::F16_TILE / hd).max(1);
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
            let n = e - s;
            let q = row.q.as_ptr();
            for p in a..b {
                let k = tp.add((p - p0) * hd) as *const f32;
                let mut a0 = [_mm256_setzero_ps(); G];
                let mut a1 = [_mm256_setzero_ps(); G];
                for c in (0..hd).step_by(16) {
                    let k0 = _mm256_loadu_ps(k.add(c));
                    let k1 = _mm256_loadu_ps(k.add(c + 8));
                    for g in 0..G {
                        let qg = q.add(g * hd + c);
                        a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg), k0, a0[g]);
                        a1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg.add(8)), k1, a1[g]);
                    }
                }
                for g in 0..G {
                    *sp.add(off + g * n + p - s) = reduce(a0[g], a1[g]) * scale;
                }
            }
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
            for c in (0..hd).step_by(16) {
                let mut o0 = [_mm256_setzero_ps(); G];
                let mut o1 = [_mm256_setzero_ps(); G];
                for g in 0..G {
                    o0[g] = _mm256_loadu_ps(op.add(g * hd + c));
                    o1[g] = _mm256_loadu_ps(op.add(g * hd + c + 8));
                }
                let v = tp.add((a - p0) * hd + c) as *const f32;
                for t in 0..b - a {
                    let v0 = _mm256_loadu_ps(v.add(t * hd));
                    let v1 = _mm256_loadu_ps(v.add(t * hd + 8));
                    for g in 0..G {
                        let wg = _mm256_set1_ps(*w.add(g * n + t));
                        o0[g] = _mm256_fmadd_ps(wg, v0, o0[g]);
                        o1[g] = _mm256_fmadd_ps(wg, v1, o1[g]);
                    }
                }
                for g in 0..G {
                    _mm256_storeu_ps(op.add(g * hd + c), o0[g]);
                    _mm256_storeu_ps(op.add(g * hd + c + 8), o1[g]);
                }
            }
        }
        p0 = p1;
    }
}

/// [`attend_group_f16`] of several rows of one sequence, each with the
/// same number of query heads (at most 8) and the same bits as alone:
/// row `i`'s scores at `offs[i]` of `scores`, and `F16_TILE` elements (at
/// least one head) in `tile`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_rows_f16(
    dk: &[u16],
    dv: &[u16],
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    rows: &mut [super::AttnRow],
    offs: &[usize],
    scale: f32,
    scores: &mut [f32],
    tile: &mut [f32],
) {
    let hd = kv.shape.head_dim;
    debug_assert_eq!(hd % 16, 0);
    let a = (dk, dv, kv, layer, kv_head);
    match rows[0].q.len() / hd {
        1 => rows_f16::<1>(a.0, a.1, a.2, a.3, a.4, rows, offs, scale, scores, tile),
        2 => rows_f16::<2>(a.0, a.1, a.2, a.3, a.4, rows, offs, scale, scores, tile),
        3 => rows_f16::<3>(a.0, a.1, a.2, a.3, a.4, rows, offs, scale, scores, tile),
        4 => rows_f16::<4>(a.0, a.1, a.2, a.3, a.4, rows, offs, scale, scores, tile),
        5 => rows_f16::<5>(a.0, a.1, a.2, a.3, a.4, rows, offs, scale, scores, tile),
        6 => rows_f16::<6>(a.0, a.1, a.2, a.3, a.4, rows, offs, scale, scores, tile),
        7 => rows_f16::<7>(a.0, a.1, a.2, a.3, a.4, rows, offs, scale, scores, tile),
        8 => rows_f16::<8>(a.0, a.1, a.2, a.3, a.4, rows, offs, scale, scores, tile),
        g => unreachable!("attention: {g} query heads per KV head take the generic path"),
    }
}
