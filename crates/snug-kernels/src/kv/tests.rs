use super::*;

/// Two layers of two KV heads of 64, pages of 16 positions.
const SMALL: KvShape = KvShape {
    layers: 2,
    kv_heads: 2,
    head_dim: 64,
    page_tokens: 16,
};

/// Values uniform in [-1, 1) from a xorshift generator seeded with `x`.
fn uniform(mut x: u32) -> impl FnMut() -> f32 {
    move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x % 2000) as f32 / 1000.0 - 1.0
    }
}

/// Where position `p` of a sequence with 16-position `pages` goes.
fn slot_at(pages: &[u32], p: usize) -> KvSlot {
    KvSlot {
        page: pages[p / 16],
        slot: p % 16,
        pos: p,
        twin: None,
    }
}

#[test]
fn export_page_round_trip_into_another_page_of_another_storage() {
    let shape = SMALL;
    let mut rnd = uniform(0x9e37_79b9u32);
    for (fk, fv) in [
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::Tq4, KvFormat::Q8),
        (KvFormat::F32, KvFormat::Tq4),
    ] {
        let mut a = KvStorage::with_formats(shape, fk, fv, 3).with_twins(2);
        let pages = [2u32, 1];
        // 16 positions fill page 2; 5 more start page 1 (with twin 1).
        for p in 0..21 {
            let k: Vec<f32> = (0..128).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..128).map(|_| rnd()).collect();
            let mut at = slot_at(&pages, p);
            at.twin = (p >= 16).then_some(1);
            for l in 0..2 {
                a.write(l, at, &k, &v);
            }
        }
        let mut b = KvStorage::with_formats(shape, fk, fv, 3).with_twins(2);
        for (from, to, slots, twin) in [(2u32, 0u32, 16, false), (1, 2, 5, false), (1, 0, 5, true)] {
            let mut runs: Vec<Vec<u8>> = Vec::new();
            a.export_page::<()>(from, slots, twin, |r| {
                runs.push(r.to_vec());
                Ok(())
            })
            .unwrap();
            assert_eq!(runs.iter().map(Vec::len).sum::<usize>(), a.stored_bytes(slots, twin));
            let mut it = runs.into_iter();
            b.import_page::<()>(to, slots, twin, |r| {
                r.copy_from_slice(&it.next().unwrap());
                Ok(())
            })
            .unwrap();
            for l in 0..2 {
                for h in 0..2 {
                    for slot in 0..slots {
                        for is_v in [false, true] {
                            let (mut x, mut y) = ([0f32; 64], [0f32; 64]);
                            if twin {
                                a.read_twin(from, l, is_v, h, slot, &mut x);
                                b.read_twin(to, l, is_v, h, slot, &mut y);
                            } else {
                                a.read(from, l, is_v, h, slot, slot, &mut x);
                                b.read(to, l, is_v, h, slot, slot, &mut y);
                            }
                            assert_eq!(x.map(f32::to_bits), y.map(f32::to_bits), "{fk:?}/{fv:?} {from}->{to}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn compressed_pages_are_small_and_attention_on_them_is_close() {
    for hd in [64, 128, 256] {
        let f16 = KvFormat::F16.vector_bytes(hd) as f64;
        assert!(KvFormat::Tq4.vector_bytes(hd) as f64 / f16 <= 0.27, "{hd}");
        assert!(KvFormat::Q8.vector_bytes(hd) as f64 / f16 <= 0.52, "{hd}");
    }
    let hd = 128;
    let group = 3;
    let shape = KvShape {
        layers: 2,
        kv_heads: 2,
        head_dim: hd,
        page_tokens: 16,
    };
    let mut rnd = uniform(0x2545_f491u32);
    let pages = [2u32, 0, 3];
    let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..40)
        .map(|_| {
            // Keys with an outlier coordinate, as real keys have.
            let k: Vec<f32> = (0..2 * hd)
                .map(|i| rnd() + if i % hd == 5 { 6.0 } else { 0.0 })
                .collect();
            let v: Vec<f32> = (0..2 * hd).map(|_| rnd()).collect();
            (k, v)
        })
        .collect();
    let q: Vec<f32> = (0..group * hd).map(|_| rnd() * 0.5).collect();
    let query = AttnQuery {
        pages: &pages,
        twins: &[],
        start: 0,
        end: 40,
    };
    let attend = |format: KvFormat, generic: bool| {
        let mut kv = KvStorage::new(shape, format, 4);
        for (p, (k, v)) in rows.iter().enumerate() {
            kv.write(1, slot_at(&pages, p), k, v);
        }
        let mut s = AttnScratch::new(64, hd, group, 16);
        let mut out = vec![0f32; group * hd];
        if generic {
            attend_group_generic(&kv, 1, 1, &query, &q, 0.09, &mut out, &mut s);
        } else {
            attend_group(&kv, 1, 1, &query, &q, 0.09, &mut out, &mut s);
        }
        out
    };
    let rel = |a: &[f32], b: &[f32]| {
        let d: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let n: f32 = b.iter().map(|y| y * y).sum();
        (d / n).sqrt()
    };
    let exact = attend(KvFormat::F32, true);
    // The rotated-domain path computes attention over the decoded
    // vectors: the same as decoding each vector, up to rounding.
    let tq4 = attend(KvFormat::Tq4, false);
    assert!(rel(&tq4, &attend(KvFormat::Tq4, true)) < 1e-5);
    // Random values average out in the output as their errors do, so
    // the output keeps about the per-vector error of 4-bit codes
    // (~10%); model quality is measured on real text, not here.
    assert!(rel(&tq4, &exact) < 0.15, "tq4 {}", rel(&tq4, &exact));
    let q8 = attend(KvFormat::Q8, false);
    assert!(rel(&q8, &exact) < 0.01, "q8 {}", rel(&q8, &exact));
    // Keys and values in different formats: each part read as stored.
    for (fk, fv) in [
        (KvFormat::Q8, KvFormat::Tq4),
        (KvFormat::F16, KvFormat::Tq4),
        (KvFormat::Tq4, KvFormat::F32),
    ] {
        let mut kv = KvStorage::with_formats(shape, fk, fv, 4);
        assert_eq!(
            kv.page_bytes(),
            shape.page_vectors() / 2 * (fk.vector_bytes(hd) + fv.vector_bytes(hd))
        );
        for (p, (k, v)) in rows.iter().enumerate() {
            kv.write(1, slot_at(&pages, p), k, v);
        }
        let mut s = AttnScratch::new(64, hd, group, 16);
        let (mut a, mut b) = (vec![0f32; group * hd], vec![0f32; group * hd]);
        attend_group(&kv, 1, 1, &query, &q, 0.09, &mut a, &mut s);
        attend_group_generic(&kv, 1, 1, &query, &q, 0.09, &mut b, &mut s);
        assert!(rel(&a, &b) < 1e-5, "{fk:?}/{fv:?}");
        assert!(rel(&a, &exact) < 0.15, "{fk:?}/{fv:?}: {}", rel(&a, &exact));
    }
    // Copy-on-write copies of compressed pages keep their contents.
    for format in [KvFormat::Q8, KvFormat::Tq4] {
        let mut kv = KvStorage::new(shape, format, 4);
        for (p, (k, v)) in rows.iter().enumerate().take(16) {
            kv.write(
                0,
                KvSlot {
                    page: 2,
                    slot: p,
                    pos: p,
                    twin: None,
                },
                k,
                v,
            );
        }
        kv.copy_page(2, 1);
        let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
        for slot in [0, 7, 15] {
            kv.read(2, 0, true, 1, slot, slot, &mut a);
            kv.read(1, 0, true, 1, slot, slot, &mut b);
            assert_eq!(a, b);
        }
    }
}

/// Rows of `query`'s sequence ending at `ends`, with queries `qs` and
/// outputs `outs`.
fn rows_ending_at<'a>(
    query: &AttnQuery<'a>,
    ends: &[usize],
    qs: &'a [Vec<f32>],
    outs: &'a mut [Vec<f32>],
) -> Vec<AttnRow<'a>> {
    ends.iter()
        .zip(qs)
        .zip(outs.iter_mut())
        .map(|((&end, q), out)| AttnRow {
            query: AttnQuery { end, ..*query },
            q,
            out,
        })
        .collect()
}

#[test]
fn coded_attention_is_the_same_bits_at_every_level_and_close_to_the_reference() {
    // TQ4 keys coded in a basis with offsets and uneven weights (full
    // and partial rotary), Q8 keys as they are, plain keys or values
    // beside coded ones, an exact window in twins, pages of 16 and of
    // 20 positions (lanes left over), groups of 1 to 11 heads: every
    // SIMD level gives the scalar lanes' bits, and all agree with
    // decoding every vector to rounding and are close to F32 attention.
    use crate::cpu::Simd;
    use crate::kvbasis::KeyBasis;
    use crate::ops::{Rope, RopeLayout};
    use std::sync::Arc;
    let cases = [
        (16, 16, RopeLayout::Adjacent, 16, 2),
        (32, 32, RopeLayout::Halves, 20, 5),
        (64, 64, RopeLayout::Adjacent, 16, 3),
        (64, 48, RopeLayout::Halves, 20, 1),
        (128, 128, RopeLayout::Halves, 16, 8),
        (128, 128, RopeLayout::Halves, 20, 11),
        (256, 256, RopeLayout::Halves, 16, 4),
    ];
    for (hd, rot, layout, pt, group) in cases {
        let shape = KvShape {
            layers: 2,
            kv_heads: 2,
            head_dim: hd,
            page_tokens: pt,
        };
        let mut rnd = uniform(0x9e37_79b9u32 ^ (hd * 7 + group + pt) as u32);
        let ropes = vec![Rope::new(layout, rot, 10000.0); 2];
        let mut basis = KeyBasis::identity(2, 2, hd, ropes.clone());
        for (i, m) in basis.offset.iter_mut().enumerate() {
            *m = if i % 5 == 0 { 4.0 } else { 0.3 * ((i % 7) as f32 - 3.0) };
        }
        for (i, w) in basis.weight.iter_mut().enumerate() {
            *w = 0.5 + ((i % hd) % 8 / 2) as f32 * 0.4;
        }
        let basis = Arc::new(basis);
        let pages = [4u32, 1, 6, 0, 2];
        let twins = [3u32, NO_TWIN, NO_TWIN, NO_TWIN, 0];
        let end = 4 * pt + 6;
        let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..end)
            .map(|p| {
                let mut k: Vec<f32> = (0..2 * hd).map(|_| rnd()).collect();
                for h in 0..2 {
                    let mut m = vec![0f32; hd];
                    basis.offset_at(1, h, p, &mut m);
                    k[h * hd..(h + 1) * hd].iter_mut().zip(&m).for_each(|(a, b)| *a += b);
                }
                (k, (0..2 * hd).map(|_| rnd()).collect())
            })
            .collect();
        let q: Vec<f32> = (0..group * hd).map(|_| rnd() * 0.4).collect();
        let fill = |kv: &mut KvStorage, with_twins: bool| {
            for (p, (k, v)) in rows.iter().enumerate() {
                let idx = p / pt;
                let twin = (with_twins && twins[idx] != NO_TWIN).then_some(twins[idx]);
                let at = KvSlot {
                    page: pages[idx],
                    slot: p % pt,
                    pos: p,
                    twin,
                };
                kv.write(1, at, k, v);
            }
        };
        let mut exact = KvStorage::new(shape, KvFormat::F32, 8);
        fill(&mut exact, false);
        let rel = |a: &[f32], b: &[f32]| {
            let d: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
            let n: f32 = b.iter().map(|y| y * y).sum();
            (d / n).sqrt()
        };
        for (fk, fv) in [
            (KvFormat::Tq4, KvFormat::Tq4),
            (KvFormat::Q8, KvFormat::Q8),
            (KvFormat::Q8, KvFormat::Tq4),
            (KvFormat::Tq4, KvFormat::Q8),
            (KvFormat::F16, KvFormat::Tq4),
            (KvFormat::Tq4, KvFormat::F32),
        ] {
            let mut kv = KvStorage::with_formats(shape, fk, fv, 8)
                .with_twins(4)
                .with_key_basis(basis.clone());
            fill(&mut kv, true);
            for (start, twinned) in [(0, true), (0, false), (pt + 3, true), (end - 1, true)] {
                let query = AttnQuery {
                    pages: &pages,
                    twins: if twinned { &twins } else { &[] },
                    start,
                    end,
                };
                let what = format!(
                    "{fk:?}/{fv:?}, hd {hd}, rot {rot}, pages of {pt}, group {group}, from {start}, twins {twinned}"
                );
                // Lossy pages need one page of scores, whatever the
                // context: no scratch for the other positions.
                let mut small = AttnScratch::new(0, hd, group, pt);
                let one = |level, query: &AttnQuery, q: &[f32], out: &mut [f32], s: &mut AttnScratch| {
                    let mut rows = [AttnRow { query: *query, q, out }];
                    coded::attend(level, &kv, 1, 1, &mut rows, 0.1, s);
                };
                let mut want = vec![0f32; group * hd];
                one(Simd::Scalar, &query, &q, &mut want, &mut small);
                for level in Simd::available() {
                    let mut got = vec![f32::NAN; group * hd];
                    one(level, &query, &q, &mut got, &mut small);
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: {level:?} differs from the scalar lanes"
                    );
                }
                // Rows of the sequence at other positions (the exact
                // window needs the query's own page twinned), through
                // the pages together: each row the same bits as alone.
                let ends: Vec<usize> = [end, end - 1, 4 * pt + 1, end - 3, pt + 4, 2 * pt]
                    .into_iter()
                    .filter(|&e| e > start && (!twinned || e > 4 * pt))
                    .collect();
                let qs: Vec<Vec<f32>> = (0..ends.len())
                    .map(|i| q.iter().map(|x| x * (1.0 + 0.25 * i as f32)).collect())
                    .collect();
                let mut block = AttnScratch::for_rows(0, hd, group, pt, ends.len());
                for level in Simd::available() {
                    let alone: Vec<Vec<f32>> = ends
                        .iter()
                        .zip(&qs)
                        .map(|(&end, q)| {
                            let mut o = vec![0f32; group * hd];
                            one(level, &AttnQuery { end, ..query }, q, &mut o, &mut small);
                            o
                        })
                        .collect();
                    let mut outs = vec![vec![f32::NAN; group * hd]; ends.len()];
                    let mut rows = rows_ending_at(&query, &ends, &qs, &mut outs);
                    coded::attend(level, &kv, 1, 1, &mut rows, 0.1, &mut block);
                    for (i, (a, b)) in outs.iter().zip(&alone).enumerate() {
                        assert!(
                            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{what}: {level:?}, row {i} of {} together differs from alone",
                            ends.len()
                        );
                    }
                }
                let mut outs = vec![vec![f32::NAN; group * hd]; ends.len()];
                let mut rows = rows_ending_at(&query, &ends, &qs, &mut outs);
                // Blocks of at most 3 rows.
                let mut three = AttnScratch::for_rows(0, hd, group, pt, 3);
                attend_rows(&kv, 1, 1, &mut rows, 0.1, &mut three);
                for ((&end, q), got) in ends.iter().zip(&qs).zip(&outs) {
                    let mut o = vec![0f32; group * hd];
                    attend_group(&kv, 1, 1, &AttnQuery { end, ..query }, q, 0.1, &mut o, &mut small);
                    assert!(
                        o.iter().zip(got).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{what}: attend_rows"
                    );
                }
                let mut fast = vec![0f32; group * hd];
                attend_group(&kv, 1, 1, &query, &q, 0.1, &mut fast, &mut small);
                assert!(
                    fast.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}"
                );
                let mut s = AttnScratch::new(end, hd, group, pt);
                let mut decoded = vec![0f32; group * hd];
                attend_group_generic(&kv, 1, 1, &query, &q, 0.1, &mut decoded, &mut s);
                assert!(rel(&want, &decoded) < 1e-4, "{what}: {}", rel(&want, &decoded));
                let plain = AttnQuery { twins: &[], ..query };
                let mut truth = vec![0f32; group * hd];
                attend_group(&exact, 1, 1, &plain, &q, 0.1, &mut truth, &mut s);
                assert!(rel(&want, &truth) < 0.15, "{what}: vs f32 {}", rel(&want, &truth));
            }
        }
    }
}

/// F16 storage of two layers of two KV heads of `hd`, 16 positions a
/// page, `pages.len() + 2` pages (every page named lies below that),
/// layer 1 holding random keys and values at positions `0..n` of the
/// sequence with `pages`.
fn f16_pages(hd: usize, pages: &[u32], n: usize, rnd: &mut impl FnMut() -> f32) -> KvStorage {
    let shape = KvShape {
        layers: 2,
        kv_heads: 2,
        head_dim: hd,
        page_tokens: 16,
    };
    let mut kv = KvStorage::new(shape, KvFormat::F16, pages.len() + 2);
    for p in 0..n {
        let k: Vec<f32> = (0..2 * hd).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..2 * hd).map(|_| rnd()).collect();
        kv.write(1, slot_at(pages, p), &k, &v);
    }
    kv
}

#[test]
fn fused_f16_attention_matches_the_generic_path_bitwise() {
    // Every group size the fused path specializes (1..=8 query heads per
    // KV head, 9 goes generic), at the head sizes of the four models.
    for hd in [64, 256] {
        for group in 1..=9 {
            let mut rnd = uniform(0x1234_5678u32 ^ (hd * 31 + group) as u32);
            let pages = [3u32, 0, 5, 1];
            let kv = f16_pages(hd, &pages, 60, &mut rnd);
            let q: Vec<f32> = (0..group * hd).map(|_| rnd() * 3.0).collect();
            for (start, end) in [(0, 1), (0, 60), (13, 47), (5, 6), (31, 58)] {
                let query = AttnQuery {
                    pages: &pages,
                    twins: &[],
                    start,
                    end,
                };
                let mut s1 = AttnScratch::new(64, hd, group, 16);
                let mut s2 = AttnScratch::new(64, hd, group, 16);
                let (mut a, mut b) = (vec![0f32; group * hd], vec![0f32; group * hd]);
                attend_group(&kv, 1, 1, &query, &q, 0.125, &mut a, &mut s1);
                attend_group_generic(&kv, 1, 1, &query, &q, 0.125, &mut b, &mut s2);
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "head dim {hd}, group {group}, {start}..{end}"
                );
                // Each vector path on its own, whichever one dispatch picks.
                #[cfg(target_arch = "x86_64")]
                if group <= 8 {
                    use crate::cpu::Simd;
                    let (Data::F16(dk), Data::F16(dv)) = (&kv.k, &kv.v) else {
                        unreachable!()
                    };
                    let scores = &mut s1.scores[..group * (end - start)];
                    if Simd::detect() >= Simd::Avx2 {
                        a.fill(f32::NAN);
                        // SAFETY: AVX2, FMA and F16C detected.
                        unsafe { x86::attend_group_f16(dk, dv, &kv, 1, 1, &query, &q, 0.125, &mut a, scores) };
                        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "avx2");
                    }
                    if Simd::detect() >= Simd::Avx512Vnni {
                        a.fill(f32::NAN);
                        // SAFETY: AVX-512 F/BW, AVX2, FMA and F16C detected.
                        unsafe { x86_f16_512::attend_group_f16(dk, dv, &kv, 1, 1, &query, &q, 0.125, &mut a, scores) };
                        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "avx512");
                    }
                }
            }
        }
    }
}

#[test]
fn f16_rows_taken_together_are_each_the_bits_of_a_row_alone() {
    // Blocks of rows over F16 pages (a tile of keys and values converted
    // to f32 once for the block) against each row through the reference:
    // every group size, both head sizes, contexts across several tiles,
    // rows of a causal chunk and rows of a sliding window (their starts
    // move), blocks cut short by the scores' room.
    for hd in [64, 256] {
        for group in 1..=9 {
            let mut rnd = uniform(0x0bad_cafe ^ (hd * 131 + group) as u32);
            let pages = [7u32, 2, 9, 0, 11, 4, 1, 8, 3, 10];
            let kv = f16_pages(hd, &pages, 160, &mut rnd);
            let ends: Vec<usize> = (150..160).collect();
            let qs: Vec<Vec<f32>> = ends
                .iter()
                .map(|_| (0..group * hd).map(|_| rnd() * 3.0).collect())
                .collect();
            for (window, rows_room) in [(None, 8), (Some(70), 8), (None, 3), (Some(5), 16)] {
                let start = |end: usize| window.map_or(0, |w: usize| end.saturating_sub(w));
                let mut want = vec![vec![0f32; group * hd]; ends.len()];
                for ((&end, q), out) in ends.iter().zip(&qs).zip(want.iter_mut()) {
                    let query = AttnQuery {
                        pages: &pages,
                        twins: &[],
                        start: start(end),
                        end,
                    };
                    let mut s = AttnScratch::new(160, hd, group, 16);
                    attend_group_generic(&kv, 1, 1, &query, q, 0.125, out, &mut s);
                }
                // Each row of a block through `run` against the row alone.
                let check = |label: &str, run: &mut dyn FnMut(&mut [AttnRow], &mut AttnScratch)| {
                    let mut got = vec![vec![f32::NAN; group * hd]; ends.len()];
                    let mut rows: Vec<AttnRow> = ends
                        .iter()
                        .zip(&qs)
                        .zip(got.iter_mut())
                        .map(|((&end, q), out)| AttnRow {
                            query: AttnQuery {
                                pages: &pages,
                                twins: &[],
                                start: start(end),
                                end,
                            },
                            q,
                            out,
                        })
                        .collect();
                    let mut s = AttnScratch::for_rows(160, hd, group, 16, rows_room);
                    run(&mut rows, &mut s);
                    drop(rows);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{label}: head dim {hd}, group {group}, window {window:?}, room {rows_room}, row {i}"
                        );
                    }
                };
                check("attend_rows", &mut |rows, s| attend_rows(&kv, 1, 1, rows, 0.125, s));
                // The blocks' kernels of every vector level this CPU runs.
                #[cfg(target_arch = "x86_64")]
                for level in crate::cpu::Simd::available()
                    .into_iter()
                    .filter(|&l| l >= crate::cpu::Simd::Avx2)
                {
                    let (Data::F16(dk), Data::F16(dv)) = (&kv.k, &kv.v) else {
                        unreachable!("F16 pages")
                    };
                    check(&format!("{level:?}"), &mut |rows, s| {
                        super::attend::f16_blocks(level, dk, dv, &kv, 1, 1, rows, 0.125, s)
                    });
                }
            }
        }
    }
}

#[test]
fn a_batch_written_on_the_pool_is_the_rows_written_one_by_one() {
    // Every format and a key basis; twins on some pages; a batch of two
    // sequences, and one where two rows share a slot (the later one wins,
    // so that batch is written in order).
    let shape = SMALL;
    let mut rnd = uniform(0x1234_5679u32);
    let rope = crate::ops::Rope::new(crate::ops::RopeLayout::Halves, 64, 10000.0);
    let mut basis = crate::kvbasis::KeyBasis::identity(2, 2, 64, vec![rope; 2]);
    for (i, m) in basis.offset.iter_mut().enumerate() {
        *m = 0.2 * ((i % 9) as f32 - 4.0);
    }
    let basis = std::sync::Arc::new(basis);
    let pool = crate::pool::ThreadPool::new(3);
    let n = 70;
    let k: Vec<f32> = (0..n * 128).map(|_| rnd()).collect();
    let v: Vec<f32> = (0..n * 128).map(|_| rnd()).collect();
    // Sequence A: positions 0..40 on pages 5, 2, 7 (twins 1, -, 0);
    // sequence B: positions 3..33 on pages 4, 6, 3.
    let (pa, ta) = ([5u32, 2, 7], [Some(1u32), None, Some(0)]);
    let pb = [4u32, 6, 3];
    let at: Vec<KvSlot> = (0..40)
        .map(|p| KvSlot {
            page: pa[p / 16],
            slot: p % 16,
            pos: p,
            twin: ta[p / 16],
        })
        .chain((3..33).map(|p| KvSlot {
            page: pb[p / 16],
            slot: p % 16,
            pos: p,
            twin: None,
        }))
        .collect();
    let shared = {
        let mut s = at.clone();
        s[50] = s[10];
        s
    };
    for (fk, fv) in [
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::F32, KvFormat::Q8),
        (KvFormat::Tq4, KvFormat::Tq4),
        (KvFormat::Q8, KvFormat::Tq4),
    ] {
        for slots in [&at, &shared] {
            let new = || {
                KvStorage::with_formats(shape, fk, fv, 8)
                    .with_twins(2)
                    .with_key_basis(basis.clone())
            };
            let (mut one, mut many) = (new(), new());
            for l in 0..2 {
                for (r, &a) in slots.iter().enumerate() {
                    one.write(l, a, &k[r * 128..(r + 1) * 128], &v[r * 128..(r + 1) * 128]);
                }
                many.write_rows(l, slots, &k, &v, &pool);
            }
            for (a, b) in [
                (&one.k, &many.k),
                (&one.v, &many.v),
                (&one.twin_k, &many.twin_k),
                (&one.twin_v, &many.twin_v),
            ] {
                assert!(a.part_bytes() == b.part_bytes(), "{fk:?}/{fv:?}");
            }
        }
    }
}
