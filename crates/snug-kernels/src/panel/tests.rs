use super::*;
use crate::dot::test_support::{weights, Rng, TYPES};
use crate::dot::{act_format, dot_rows_with, quantize_row, QK8};

#[test]
fn tiles_cover_the_rows_evenly() {
    for n in 0..100 {
        let t: Vec<(usize, usize)> = tiles(n).collect();
        assert_eq!(t.len(), n.div_ceil(TILE_ROWS), "{n}");
        let mut next = 0;
        for &(r0, rt) in &t {
            assert_eq!(r0, next, "{n}: tiles are contiguous");
            assert!((1..=TILE_ROWS).contains(&rt), "{n}: tile of {rt}");
            next += rt;
        }
        assert_eq!(next, n);
        let (lo, hi) = (t.iter().map(|x| x.1).min(), t.iter().map(|x| x.1).max());
        assert!(hi.unwrap_or(0) - lo.unwrap_or(0) <= 1, "{n}: {t:?}");
    }
}

/// Random activation rows of `n` elements, quantized for `ty`, with
/// their panel aux values (row r's values grow with r).
fn activations(ty: GgmlType, n: usize, rows: usize, rng: &mut Rng) -> (Vec<Vec<BlockQ8>>, Vec<Vec<i32>>) {
    let nb = n / QK8;
    let acts: Vec<Vec<BlockQ8>> = (0..rows)
        .map(|r| {
            let x: Vec<f32> = (0..n).map(|_| rng.f32() * (0.5 + r as f32)).collect();
            let mut q = vec![BlockQ8::default(); nb];
            quantize_row(act_format(ty), &x, &mut q);
            q
        })
        .collect();
    let aux = acts
        .iter()
        .map(|a| {
            let mut v = vec![0; aux_len(ty, nb)];
            activation_aux(ty, a, &mut v);
            v
        })
        .collect();
    (acts, aux)
}

#[test]
fn panels_equal_the_scalar_reference_bitwise() {
    if !available(GgmlType::Q8_0) {
        eprintln!("no AVX2 here: panels are not used");
        return;
    }
    let mut rng = Rng(42);
    for ty in TYPES.into_iter().filter(|&t| available(t)) {
        // Fewer than 8, exactly 8, and more than 8 blocks or super-blocks
        // (accumulator classes with no, one and two blocks).
        for n in [768, 2048, 2304, 4608] {
            for n_w in [16, 5, 1] {
                let ws: Vec<Vec<u8>> = (0..n_w).map(|_| weights(ty, n, &mut rng)).collect();
                let wrefs: Vec<&[u8]> = ws.iter().map(|v| v.as_slice()).collect();
                let n_r = 17;
                let (acts, aux) = activations(ty, n, n_r, &mut rng);
                let arefs: Vec<&[BlockQ8]> = acts.iter().map(|v| v.as_slice()).collect();
                let xrefs: Vec<&[i32]> = aux.iter().map(|v| v.as_slice()).collect();
                let mut panel = Panel::new();
                panel.pack(ty, &wrefs);
                // The same rows as one panel of a packed matrix.
                let flat: Vec<u8> = ws.concat();
                let mut packed = vec![0u8; packed_matrix_bytes(ty, n_w, n)];
                pack_matrix(ty, &flat, n_w, n, &mut packed);
                assert_eq!(&packed[..], panel.as_ref().data, "{ty}: matrix and panel packing");
                // Every tile size, and splits into two and three tiles.
                for rows in [n_r, 9, 8, 7, 6, 5, 4, 3, 2, 1] {
                    let mut got = vec![0f32; n_w * rows];
                    panel.dot(&arefs[..rows], &xrefs[..rows], &mut got);
                    for w in 0..n_w {
                        let mut want = vec![0f32; rows];
                        dot_rows_with(Simd::Scalar, ty, &ws[w], &arefs[..rows], &mut want);
                        for r in 0..rows {
                            assert_eq!(
                                got[w * rows + r].to_bits(),
                                want[r].to_bits(),
                                "{ty} n {n} rows {n_w}x{rows} at ({w}, {r}): {} vs {}",
                                got[w * rows + r],
                                want[r]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The AVX2 panel kernels, run directly, on any machine with AVX2 (an
/// AVX-512 machine otherwise takes the AVX-512 kernels and never runs
/// these).
/// The AVX2 kernels' 16-bit partial sums at their largest: every level at
/// its top (Q4_K 15, Q5_K 31) against activations of magnitude 127
/// everywhere.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_panels_do_not_overflow_their_16_bit_sums() {
    if !Simd::available().contains(&Simd::Avx2) {
        eprintln!("no AVX2 here");
        return;
    }
    let mut rng = Rng(11);
    let n = 2048;
    let nb = n / QK8;
    // Bytes of each super-block past d, dmin and the scales (the levels,
    // and Q5_K's high bits): all ones.
    for (ty, levels_at) in [(GgmlType::Q4K, 16), (GgmlType::Q5K, 16)] {
        let ts = ty.type_size();
        let ws: Vec<Vec<u8>> = (0..16)
            .map(|_| {
                let mut w = weights(ty, n, &mut rng);
                for sb in w.chunks_mut(ts) {
                    sb[levels_at..].fill(0xFF);
                }
                w
            })
            .collect();
        let flat: Vec<u8> = ws.concat();
        let mut packed = vec![0u8; packed_matrix_bytes(ty, 16, n)];
        pack_matrix(ty, &flat, 16, n, &mut packed);
        let x = vec![1.0f32; n];
        let mut a = vec![BlockQ8::default(); nb];
        quantize_row(act_format(ty), &x, &mut a);
        // (q8_K takes the scale's sign from the largest element: -127.)
        assert!(a.iter().all(|b| b.qs.iter().all(|&q| q.unsigned_abs() == 127)));
        let mut aux = vec![0; aux_len(ty, nb)];
        activation_aux(ty, &a, &mut aux);
        for rows in [1, 4] {
            let arefs: Vec<&[BlockQ8]> = vec![&a; rows];
            let xrefs: Vec<&[i32]> = vec![&aux; rows];
            let mut got = vec![f32::NAN; rows * PANEL_ROWS];
            let out = x86::Out {
                ptr: got.as_mut_ptr(),
                stride: PANEL_ROWS,
                mask: u16::MAX,
                prefetch: false,
            };
            // SAFETY: AVX2 checked; `rows` rows of 16 outputs.
            unsafe { avx2::dot(packed.as_ptr(), ty, nb, &arefs, &xrefs, out) };
            for (w, row) in ws.iter().enumerate() {
                let mut want = [0f32; 1];
                dot_rows_with(Simd::Scalar, ty, row, &arefs[..1], &mut want);
                for r in 0..rows {
                    assert_eq!(got[r * PANEL_ROWS + w].to_bits(), want[0].to_bits(), "{ty} row {w}");
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_panels_equal_the_scalar_reference_bitwise() {
    if !Simd::available().contains(&Simd::Avx2) {
        eprintln!("no AVX2 here");
        return;
    }
    let mut rng = Rng(7);
    for ty in TYPES.into_iter().filter(|&t| supports(t)) {
        for n in [768, 2304, 4608] {
            let nb = n / QK8;
            for n_w in [16, 5] {
                let ws: Vec<Vec<u8>> = (0..n_w).map(|_| weights(ty, n, &mut rng)).collect();
                let flat: Vec<u8> = ws.concat();
                let mut packed = vec![0u8; packed_matrix_bytes(ty, n_w, n)];
                pack_matrix(ty, &flat, n_w, n, &mut packed);
                let (acts, aux) = activations(ty, n, 9, &mut rng);
                let arefs: Vec<&[BlockQ8]> = acts.iter().map(|v| v.as_slice()).collect();
                let xrefs: Vec<&[i32]> = aux.iter().map(|v| v.as_slice()).collect();
                for rows in [9, 8, 5, 4, 3, 2, 1] {
                    let mut got = vec![f32::NAN; rows * PANEL_ROWS];
                    let out = x86::Out {
                        ptr: got.as_mut_ptr(),
                        stride: PANEL_ROWS,
                        mask: u16::MAX,
                        prefetch: true,
                    };
                    // SAFETY: AVX2 checked; `rows` rows of 16 outputs.
                    unsafe { avx2::dot(packed.as_ptr(), ty, nb, &arefs[..rows], &xrefs[..rows], out) };
                    for w in 0..n_w {
                        let mut want = vec![0f32; rows];
                        dot_rows_with(Simd::Scalar, ty, &ws[w], &arefs[..rows], &mut want);
                        for r in 0..rows {
                            assert_eq!(
                                got[r * PANEL_ROWS + w].to_bits(),
                                want[r].to_bits(),
                                "{ty} AVX2 n {n} rows {n_w}x{rows} at ({w}, {r})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The AMX kernels against the scalar reference, where the CPU has AMX:
/// every row count of a call, weights with extreme scales and levels.
#[test]
fn amx_panels_equal_the_scalar_reference_bitwise() {
    if !amx_available(GgmlType::Q4K) {
        eprintln!("no AMX here");
        return;
    }
    let mut rng = Rng(11);
    for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q3K] {
        for n in [256, 2048, 2304, 4608] {
            for n_w in [16, 5] {
                let mut ws: Vec<Vec<u8>> = (0..n_w).map(|_| weights(ty, n, &mut rng)).collect();
                // One row of the largest products of scale and level: Q4_K's
                // 63 * 15, Q5_K's 63 * 31, Q6_K's -128 * -32, Q3_K's -32 * -4.
                for b in ws[0].chunks_exact_mut(ty.type_size()) {
                    match ty {
                        GgmlType::Q4K | GgmlType::Q5K => b[4..].fill(0xff),
                        GgmlType::Q6K => {
                            b[..192].fill(0);
                            b[192..208].fill(0x80);
                        }
                        // hmask and qs zero (level -4), scales 0 (-32).
                        _ => b[..108].fill(0),
                    }
                }
                let flat: Vec<u8> = ws.concat();
                let mut packed = vec![0u8; packed_matrix_bytes(ty, n_w, n)];
                pack_matrix(ty, &flat, n_w, n, &mut packed);
                let panel = PanelRef::of_matrix(ty, n, &packed, 0);
                let n_r = AMX_ROWS;
                let (acts, aux) = activations(ty, n, n_r, &mut rng);
                let arefs: Vec<&[BlockQ8]> = acts.iter().map(|v| v.as_slice()).collect();
                let (flat_acts, flat_aux) = (acts.concat(), aux.concat());
                let al = aux[0].len();
                let mut bytes = vec![0i8; n_r * n];
                for (r, a) in acts.iter().enumerate() {
                    amx_place_row(a, r, &mut bytes);
                }
                for rows in [128, 127, 100, 64, 33, 32, 31, 17, 16, 15, 2, 1] {
                    let mut got = vec![f32::NAN; rows * PANEL_ROWS];
                    // SAFETY: `rows` rows of 16 outputs.
                    unsafe {
                        panel.amx_dot_into(
                            &bytes,
                            &flat_acts[..rows * (n / 32)],
                            &flat_aux[..rows * al],
                            rows,
                            n_w,
                            got.as_mut_ptr(),
                            PANEL_ROWS,
                        )
                    };
                    for w in 0..n_w {
                        let mut want = vec![0f32; rows];
                        dot_rows_with(Simd::Scalar, ty, &ws[w], &arefs[..rows], &mut want);
                        for r in 0..rows {
                            assert_eq!(
                                got[r * PANEL_ROWS + w].to_bits(),
                                want[r].to_bits(),
                                "{ty} AMX n {n} rows {n_w}x{rows} at ({w}, {r}): {} vs {}",
                                got[r * PANEL_ROWS + w],
                                want[r]
                            );
                        }
                    }
                }
            }
        }
    }
}
