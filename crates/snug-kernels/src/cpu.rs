//! Which SIMD path the kernels take on this machine, decided once.
//!
//! Every SIMD path computes exactly what the scalar reference computes (the
//! kernels fix each output's operation order; see `dot`), so the choice
//! changes speed, never bits. A program may cap the level before the first
//! kernel runs ([`limit`]; the `snug` binary does so for
//! `SNUG_SIMD=scalar|avx2|avx512`); a level the CPU lacks falls back to the
//! best one it has.

use std::sync::atomic::{AtomicU8, Ordering};
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

impl Simd {
    /// The level a name gives (`scalar`, `avx2`, `avx512`).
    pub fn parse(name: &str) -> Option<Simd> {
        match name {
            "scalar" => Some(Simd::Scalar),
            "avx2" => Some(Simd::Avx2),
            "avx512" => Some(Simd::Avx512Vnni),
            _ => None,
        }
    }
}

/// The cap [`limit`] set (`u8::MAX`: none).
static CAP: AtomicU8 = AtomicU8::new(u8::MAX);
static LEVEL: OnceLock<Simd> = OnceLock::new();

/// Caps the level the kernels use at `level`, for comparing levels on one
/// machine. Takes effect only before the first kernel asks ([`simd`] is
/// decided once); returns whether it did.
pub fn limit(level: Simd) -> bool {
    CAP.store(level as u8, Ordering::Relaxed);
    LEVEL.get().is_none()
}

/// The level the kernels use: the best available, capped by [`limit`].
pub fn simd() -> Simd {
    *LEVEL.get_or_init(|| {
        let best = Simd::detect();
        let cap = match CAP.load(Ordering::Relaxed) {
            0 => Simd::Scalar,
            1 => Simd::Avx2,
            _ => Simd::Avx512Vnni,
        };
        cap.min(best)
    })
}

static AMX_OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static AMX: OnceLock<bool> = OnceLock::new();

/// Turns the AMX tile kernels off, for comparing them with the vector
/// kernels (they compute the same bits). Takes effect only before the
/// first kernel asks ([`amx`]); returns whether it did.
pub fn disable_amx() -> bool {
    AMX_OFF.store(true, Ordering::Relaxed);
    AMX.get().is_none()
}

/// The kernels in use, for reports: the SIMD level's name, with `+amx`
/// where products of many rows run on AMX tiles.
pub fn kernels_name() -> &'static str {
    if amx() {
        "avx512-vnni+amx"
    } else {
        simd().name()
    }
}

/// Whether the matrix products of many rows use AMX tiles (Intel's
/// Advanced Matrix Extensions, int8): the level is AVX-512 VNNI, the CPU
/// has AMX-TILE and AMX-INT8, and the operating system grants this
/// process the tile state (Linux 5.16 on, asked once here).
pub fn amx() -> bool {
    *AMX.get_or_init(|| simd() == Simd::Avx512Vnni && !AMX_OFF.load(Ordering::Relaxed) && amx_granted())
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_granted() -> bool {
    // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf.edx & (3 << 24) != 3 << 24 {
        return false;
    }
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the tile data
    // state is granted per process on request; older kernels refuse.
    let ret: i64;
    // SAFETY: a plain system call with integer arguments; it reads and
    // writes no memory of ours.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") 158i64 => ret,
            in("rdi") 0x1023i64,
            in("rsi") 18i64,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn amx_granted() -> bool {
    false
}
