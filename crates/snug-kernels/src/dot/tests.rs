use super::test_support::{weights, Rng, TYPES};
use super::*;

/// The scalar reference for `ty`.
fn reference(ty: GgmlType, w: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
    if is_k(ty) {
        dot_rows_scalar_k(ty, w, acts, out)
    } else {
        dot_rows_scalar(ty, w, acts, out)
    }
}

fn acts(ty: GgmlType, n_elems: usize, rng: &mut Rng, scale: f32) -> Vec<BlockQ8> {
    let x: Vec<f32> = (0..n_elems).map(|_| rng.f32() * scale).collect();
    let mut q = vec![BlockQ8::default(); n_elems / QK8];
    quantize_row(act_format(ty), &x, &mut q);
    q
}

#[test]
fn vector_quantization_equals_the_scalar_reference_bitwise() {
    let mut rng = Rng(11);
    for format in [ActFormat::Q8_0, ActFormat::Q8_1, ActFormat::Q8K] {
        for case in 0..64 {
            let mut x: Vec<f32> = (0..1024).map(|_| rng.f32() * 3.0).collect();
            match case % 8 {
                // Exact halves after scaling: ties go to even.
                1 => x.iter_mut().for_each(|v| *v = (*v * 8.0).round() / 8.0 + 1.0 / 254.0),
                // Zero blocks and blocks with one non-zero element.
                2 => x[..256]
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = if i == 77 { -0.5 } else { 0.0 }),
                // Values too small for 127 / amax to be finite.
                3 => x[256..512].iter_mut().for_each(|v| *v *= 1e-38),
                // The largest magnitude twice, with both signs.
                4 => {
                    x[3] = 9.0;
                    x[40] = -9.0;
                    x[300] = -9.0;
                    x[301] = 9.0;
                }
                // NaN and infinities.
                5 => {
                    x[5] = f32::NAN;
                    x[600] = f32::INFINITY;
                    x[900] = f32::NEG_INFINITY;
                }
                _ => {}
            }
            let mut a = vec![BlockQ8::default(); x.len() / QK8];
            let mut b = a.clone();
            quantize_row(format, &x, &mut a);
            quantize_row_scalar(format, &x, &mut b);
            for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                assert_eq!(p.qs, q.qs, "{format:?} case {case} block {i}");
                assert_eq!(p.sum, q.sum, "{format:?} case {case} block {i}");
                assert_eq!(p.d.to_bits(), q.d.to_bits(), "{format:?} case {case} block {i}");
                assert_eq!(p.s.to_bits(), q.s.to_bits(), "{format:?} case {case} block {i}");
            }
        }
    }
}

#[test]
fn scalar_dot_matches_dequantized_float_dot() {
    let mut rng = Rng(7);
    for ty in TYPES {
        let n = 512;
        let w = weights(ty, n, &mut rng);
        let a = acts(ty, n, &mut rng, 3.0);
        let mut out = [0f32];
        reference(ty, &w, &[&a], &mut out);
        let mut wf = vec![0f32; n];
        crate::dequantize(ty, &w, &mut wf).unwrap();
        let af: Vec<f32> = a
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
            .collect();
        let want: f64 = wf.iter().zip(&af).map(|(x, y)| *x as f64 * *y as f64).sum();
        let mag: f64 = wf.iter().zip(&af).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
        // Q8_1's s is rounded to f16, so the min term carries that error.
        let tol = if act_format(ty) == ActFormat::Q8_1 { 2e-3 } else { 1e-5 };
        assert!(
            ((out[0] as f64) - want).abs() <= tol * mag + 1e-6,
            "{ty}: {} vs {want}",
            out[0]
        );
    }
}

#[test]
fn every_simd_path_is_bitwise_equal_to_scalar() {
    let mut rng = Rng(99);
    for level in Simd::available() {
        for ty in TYPES {
            for rows in [1, 3, 4] {
                let n = 1024;
                let w = weights(ty, n, &mut rng);
                let a: Vec<Vec<BlockQ8>> = (0..rows)
                    .map(|r| acts(ty, n, &mut rng, 1.0 + r as f32 * 10.0))
                    .collect();
                let refs: Vec<&[BlockQ8]> = a.iter().map(|v| v.as_slice()).collect();
                let mut want = vec![0f32; rows];
                reference(ty, &w, &refs, &mut want);
                let mut got = vec![0f32; rows];
                dot_rows_with(level, ty, &w, &refs, &mut got);
                for r in 0..rows {
                    assert_eq!(got[r].to_bits(), want[r].to_bits(), "{level:?} {ty} row {r}");
                }
            }
        }
    }
}

#[test]
fn tiles_of_weight_rows_equal_single_rows() {
    let mut rng = Rng(1234);
    for level in Simd::available() {
        for ty in TYPES {
            // An odd and an even number of super-blocks / blocks.
            for n in [768, 1024] {
                let n_w = 7;
                let n_r = 9;
                let ws: Vec<Vec<u8>> = (0..n_w).map(|_| weights(ty, n, &mut rng)).collect();
                let a: Vec<Vec<BlockQ8>> = (0..n_r).map(|r| acts(ty, n, &mut rng, 0.5 + r as f32 * 3.0)).collect();
                let refs: Vec<&[BlockQ8]> = a.iter().map(|v| v.as_slice()).collect();
                let wrefs: Vec<&[u8]> = ws.iter().map(|v| v.as_slice()).collect();
                for (nw, nr) in [(n_w, n_r), (4, 1), (2, 4), (5, 4), (3, 2), (1, 9)] {
                    let mut got = vec![0f32; nw * nr];
                    dot_tile_with(level, ty, &wrefs[..nw], &refs[..nr], &mut got);
                    for w in 0..nw {
                        let mut want = vec![0f32; nr];
                        reference(ty, &ws[w], &refs[..nr], &mut want);
                        for r in 0..nr {
                            assert_eq!(
                                got[w * nr + r].to_bits(),
                                want[r].to_bits(),
                                "{level:?} {ty} n {n} tile {nw}x{nr} at ({w}, {r})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_row_does_not_depend_on_its_batch() {
    let mut rng = Rng(5);
    for ty in TYPES {
        let n = 512;
        let w = weights(ty, n, &mut rng);
        let a: Vec<Vec<BlockQ8>> = (0..5).map(|_| acts(ty, n, &mut rng, 2.0)).collect();
        let refs: Vec<&[BlockQ8]> = a.iter().map(|v| v.as_slice()).collect();
        let mut all = vec![0f32; 5];
        dot_rows(ty, &w, &refs, &mut all);
        for r in 0..5 {
            let mut one = [0f32];
            dot_rows(ty, &w, &refs[r..r + 1], &mut one);
            assert_eq!(one[0].to_bits(), all[r].to_bits(), "{ty} row {r}");
        }
    }
}

#[test]
fn adversarial_activations() {
    // All-zero, all-equal, tiny (subnormal-scale) and large activations
    // (q8_1 keeps `s` in f16, so 32 * |x| must stay below 65504).
    let mut rng = Rng(3);
    for ty in TYPES {
        let n = 256;
        let w = weights(ty, n, &mut rng);
        for x in [vec![0f32; n], vec![1.5f32; n], vec![1e-38f32; n], vec![2e3f32; n]] {
            let mut q = vec![BlockQ8::default(); n / QK8];
            quantize_row(act_format(ty), &x, &mut q);
            let mut want = [0f32];
            reference(ty, &w, &[&q], &mut want);
            assert!(want[0].is_finite(), "{ty}");
            for level in Simd::available() {
                let mut got = [0f32];
                dot_rows_with(level, ty, &w, &[&q], &mut got);
                assert_eq!(got[0].to_bits(), want[0].to_bits(), "{level:?} {ty}");
            }
        }
    }
}

#[test]
fn activation_quantization_matches_ggml_rules() {
    // q8_0: d is amax/127 rounded to f16; q rounds x*127/amax to even.
    let mut x = vec![0f32; 32];
    x[0] = 2.54;
    x[1] = -1.27;
    x[2] = 0.01; // 0.01 * 127 / 2.54 = 0.5: ties to even, 0
    let mut q = [BlockQ8::default()];
    quantize_row(ActFormat::Q8_0, &x, &mut q);
    assert_eq!(&q[0].qs[..3], &[127, -64, 0]);
    assert_eq!(q[0].d, f16::from_f32(2.54 / 127.0).to_f32());
    // q8_K: the sign of the scale follows the largest-magnitude element.
    let mut x = vec![0.5f32; 256];
    x[7] = 4.0;
    let mut q = vec![BlockQ8::default(); 8];
    quantize_row(ActFormat::Q8K, &x, &mut q);
    assert_eq!(q[0].qs[7], -127);
    assert!(q[0].d < 0.0 && q.iter().all(|b| b.d == q[0].d));
}

#[test]
fn f32_dot_paths_agree() {
    let mut rng = Rng(11);
    let w: Vec<f32> = (0..160).map(|_| rng.f32()).collect();
    let x: Vec<f32> = (0..160).map(|_| rng.f32()).collect();
    assert_eq!(dot_f32(&w, &x).to_bits(), dot_f32_scalar(&w, &x).to_bits());
}
