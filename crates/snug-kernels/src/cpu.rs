//! Which SIMD path the kernels take on this machine, decided once.
//!
//! Every SIMD path computes exactly what the scalar reference computes (the
//! kernels fix each output's operation order; see `dot`), so the choice
//! changes speed, never bits. `SNUG_SIMD=scalar|avx2|avx512` forces a path
//! (a path the CPU lacks falls back to the best one it has).

use std::sync::OnceLock;

/// A kernel implementation level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    /// Portable Rust; the reference.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 (F, BW, VL) with VNNI, on top of AVX2.
    Avx512Vnni,
}

impl Simd {
    pub fn name(self) -> &'static str {
        match self {
            Simd::Scalar => "scalar",
            Simd::Avx2 => "avx2",
            Simd::Avx512Vnni => "avx512-vnni",
        }
    }

    /// The best level this CPU supports.
    pub fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            if avx512 {
                return Simd::Avx512Vnni;
            }
            if avx2 {
                return Simd::Avx2;
            }
        }
        Simd::Scalar
    }

    /// Every level this CPU can run, lowest first (for tests).
    pub fn available() -> Vec<Simd> {
        let best = Simd::detect();
        [Simd::Scalar, Simd::Avx2, Simd::Avx512Vnni]
            .into_iter()
            .filter(|s| *s <= best)
            .collect()
    }
}

/// The level the kernels use: the best available, or `SNUG_SIMD` if set.
pub fn simd() -> Simd {
    static LEVEL: OnceLock<Simd> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = Simd::detect();
        let wanted = match std::env::var("SNUG_SIMD").as_deref() {
            Ok("scalar") => Simd::Scalar,
            Ok("avx2") => Simd::Avx2,
            Ok("avx512") => Simd::Avx512Vnni,
            _ => best,
        };
        wanted.min(best)
    })
}
