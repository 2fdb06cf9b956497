//! Row-interleaved weight panels: the matrix-product kernel for many
//! activation rows (prefill chunks, verify batches).
//!
//! A panel holds 16 weight rows rearranged so that one 512-bit vector
//! carries 4 consecutive elements of each of the 16 rows, one row per
//! 32-bit lane, as unsigned bytes (the type's levels plus a fixed offset).
//! One `vpdpbusd` against an activation's 4 bytes, broadcast to every lane,
//! then does 64 multiply-adds for 16 rows at once, where the row-at-a-time
//! kernels of [`crate::dot`] need a multiply and a widening add per 32
//! products of one row. Packing costs about one pass over the 16 rows and
//! is shared by every activation row of the call.
//!
//! The arithmetic is exactly the reference's (see [`crate::dot`]): each
//! lane computes its row's integer `isum` per block (the offset is taken
//! back out with the activation block's sum, exactly), then performs the
//! same float operations in the same order, accumulators by block number
//! modulo 8. So a row's result is bitwise the row-at-a-time kernels' result
//! (tested), and choosing panels by batch size changes no bits.
//!
//! Panels need AVX-512 with VNNI; elsewhere [`available`] is false and the
//! matrix product uses the row-at-a-time kernels.

use crate::cpu::{simd, Simd};
use crate::dot::BlockQ8;
use crate::quant::GgmlType;

/// Weight rows per panel (the lanes of a 512-bit vector of 32-bit sums).
pub const PANEL_ROWS: usize = 16;

/// Whether panels run on this machine for weight type `ty`.
pub fn available(ty: GgmlType) -> bool {
    simd() == Simd::Avx512Vnni && supports(ty)
}

/// The weight types panels handle: every type the row kernels handle.
pub fn supports(ty: GgmlType) -> bool {
    crate::dot::supports(ty)
}

/// The offset added to a per-32-block type's levels to make them unsigned.
fn level_offset(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        GgmlType::Q8_0 => 128,
        _ => 0,
    }
}

/// 32-bit values per activation row that panels read beside the row's
/// blocks ([`activation_aux`]), for rows of `n_blocks` 32-element blocks.
pub fn aux_len(ty: GgmlType, n_blocks: usize) -> usize {
    match ty {
        // Per 16 elements: -32 times their activation sum.
        GgmlType::Q6K => n_blocks * 2,
        // Per pair of blocks: their two activation sums as 16-bit halves.
        GgmlType::Q4K | GgmlType::Q5K => n_blocks / 2,
        // Per block: -offset times its activation sum.
        _ => n_blocks,
    }
}

/// The per-row values that take a panel's level offset back out (or, for
/// Q4_K / Q5_K, feed its minimums), from one quantized activation row.
pub fn activation_aux(ty: GgmlType, act: &[BlockQ8], out: &mut [i32]) {
    assert_eq!(out.len(), aux_len(ty, act.len()), "activation_aux: length");
    match ty {
        GgmlType::Q6K => {
            for (b, o) in act.iter().zip(out.chunks_exact_mut(2)) {
                for (h, v) in o.iter_mut().enumerate() {
                    let s: i32 = b.qs[16 * h..16 * h + 16].iter().map(|&q| q as i32).sum();
                    *v = -32 * s;
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            for (p, o) in act.chunks_exact(2).zip(out.iter_mut()) {
                *o = ((p[0].sum as u16 as u32) | ((p[1].sum as u16 as u32) << 16)) as i32;
            }
        }
        _ => {
            let off = level_offset(ty);
            for (b, o) in act.iter().zip(out.iter_mut()) {
                *o = -off * b.sum;
            }
        }
    }
}

/// Sixteen weight rows of one type, interleaved (see the module docs).
/// Buffers grow to the largest row seen and are reused.
#[derive(Default)]
pub struct Panel {
    ty: Option<GgmlType>,
    /// 32-element blocks per row.
    n_blocks: usize,
    /// Per block: 8 vectors of (16 rows x 4 bytes).
    qs: Vec<u8>,
    /// Per block (per super-block for K-quants): 16 scales.
    d: Vec<f32>,
    /// Per block: 16 minimums (`dmin` per super-block for K-quants).
    m: Vec<f32>,
    /// K-quants: per block (Q6_K: per 16 elements), 16 integer scales.
    sc: Vec<i32>,
    /// Q4_K / Q5_K: per pair of blocks, 16 pairs of 16-bit minimums.
    mins: Vec<i32>,
}

impl Panel {
    pub fn new() -> Panel {
        Panel::default()
    }

    /// Bytes held by the panel's buffers.
    pub fn bytes(&self) -> usize {
        self.qs.capacity() + 4 * (self.d.capacity() + self.m.capacity() + self.sc.capacity() + self.mins.capacity())
    }

    /// Packs `rows` (1 to 16 weight rows of type `ty`, one length). Lanes
    /// past the last row repeat it.
    pub fn pack(&mut self, ty: GgmlType, rows: &[&[u8]]) {
        assert!(available(ty), "panels: unsupported type {ty} or CPU");
        assert!(!rows.is_empty() && rows.len() <= PANEL_ROWS, "panels: 1 to 16 rows");
        let row_bytes = rows[0].len();
        assert!(rows.iter().all(|r| r.len() == row_bytes), "panels: rows of one length");
        assert_eq!(row_bytes % ty.type_size(), 0, "panels: whole weight blocks");
        let n_blocks = row_bytes / ty.type_size() * (ty.block_size() / 32);
        let n_sb = n_blocks / 8;
        let k = matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K);
        self.ty = Some(ty);
        self.n_blocks = n_blocks;
        let grow = |v: &mut Vec<i32>, n: usize| {
            if v.len() < n {
                v.resize(n, 0)
            }
        };
        if self.qs.len() < n_blocks * 512 {
            self.qs.resize(n_blocks * 512, 0);
        }
        let per_scale = if k { n_sb } else { n_blocks };
        if self.d.len() < per_scale * 16 {
            self.d.resize(per_scale * 16, 0.0);
        }
        if self.m.len() < per_scale * 16 {
            self.m.resize(per_scale * 16, 0.0);
        }
        if ty == GgmlType::Q6K {
            grow(&mut self.sc, n_sb * 16 * 16);
        } else if k {
            grow(&mut self.sc, n_sb * 8 * 16);
            grow(&mut self.mins, n_sb * 4 * 16);
        }
        let lane_rows: [&[u8]; PANEL_ROWS] = std::array::from_fn(|i| rows[i.min(rows.len() - 1)]);
        // SAFETY: `available` checked the CPU; buffers sized above.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            x86::pack(self, ty, &lane_rows)
        }
    }

    /// Dot products of the packed rows with each activation row in `acts`
    /// (`aux` holds each row's [`activation_aux`]): `out[lane * acts.len() +
    /// r]` for the first `out.len() / acts.len()` lanes.
    pub fn dot(&self, acts: &[&[BlockQ8]], aux: &[&[i32]], out: &mut [f32]) {
        assert!(
            !acts.is_empty() && out.len().is_multiple_of(acts.len()),
            "panel: output shape"
        );
        let lanes = out.len() / acts.len();
        let n = acts.len();
        self.dot_with(acts, aux, lanes, |r, vals| {
            for (lane, &v) in vals.iter().enumerate() {
                out[lane * n + r] = v;
            }
        });
    }

    /// As [`Panel::dot`], handing each activation row's results (its first
    /// `lanes` lanes) to `put(r, values)`.
    pub fn dot_with(&self, acts: &[&[BlockQ8]], aux: &[&[i32]], lanes: usize, mut put: impl FnMut(usize, &[f32])) {
        let ty = self.ty.expect("panel: packed");
        assert_eq!(acts.len(), aux.len(), "panel: one aux per activation row");
        assert!(lanes <= PANEL_ROWS, "panel: at most 16 lanes");
        assert!(
            acts.iter().all(|a| a.len() == self.n_blocks),
            "panel: activation length"
        );
        let al = aux_len(ty, self.n_blocks);
        assert!(aux.iter().all(|a| a.len() == al), "panel: aux length");
        let n = acts.len();
        let mut r0 = 0;
        while r0 < n {
            let rt = (n - r0).min(4);
            let mut tile = std::mem::MaybeUninit::<[[f32; PANEL_ROWS]; 4]>::uninit();
            // SAFETY: `pack` checked the CPU; shapes checked above. The
            // kernel writes rows 0..rt of the tile, and only those are read.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                x86::dot(self, ty, &acts[r0..r0 + rt], &aux[r0..r0 + rt], tile.as_mut_ptr())
            };
            let tile = tile.as_ptr() as *const [f32; PANEL_ROWS];
            for r in 0..rt {
                // SAFETY: written by the kernel above.
                let vals = unsafe { &*tile.add(r) };
                put(r0 + r, &vals[..lanes]);
            }
            r0 += rt;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // lane- and row-indexed register arrays
mod x86 {
    use std::arch::x86_64::*;

    use super::{level_offset, Panel, PANEL_ROWS};
    use crate::dot::x86::{scales_mins_k4, Unpack, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};
    use crate::dot::BlockQ8;
    use crate::quant::GgmlType;

    /// Eight 32-bit elements of each of 16 rows (`v[i]`, row i) as 8
    /// vectors: vector t holds element t of every row, row i in lane i.
    /// Rows i and i + 8 share a vector, then each 256-bit half goes through
    /// an 8x8 transpose.
    #[inline(always)]
    unsafe fn transpose(v: &[__m256i; PANEL_ROWS]) -> [__m512i; 8] {
        // (Loops, not closures: a closure does not inherit the target
        // features, and its intrinsics would become calls.)
        let mut a = [_mm512_setzero_si512(); 8];
        for i in 0..8 {
            a[i] = _mm512_inserti64x4(_mm512_castsi256_si512(v[i]), v[i + 8], 1);
        }
        let mut t = [_mm512_setzero_si512(); 8];
        for i in 0..4 {
            t[2 * i] = _mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
        }
        // u[q] for rows 0..4 (q < 4) and rows 4..8 (q >= 4): element
        // (q % 4) and (q % 4) + 4 of each row.
        let mut u = [_mm512_setzero_si512(); 8];
        for g in [0, 4] {
            u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
            u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
            u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
            u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
        }
        let lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
        let hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
        let mut out = [_mm512_setzero_si512(); 8];
        for q in 0..4 {
            out[q] = _mm512_permutex2var_epi64(u[q], lo, u[q + 4]);
            out[q + 4] = _mm512_permutex2var_epi64(u[q], hi, u[q + 4]);
        }
        out
    }

    /// [`transpose`], stored as one block's 8 vectors at `dst`.
    #[inline(always)]
    unsafe fn transpose_store(v: &[__m256i; PANEL_ROWS], dst: *mut u8) {
        let t = transpose(v);
        for (q, x) in t.iter().enumerate() {
            _mm512_storeu_si512(dst.add(q * 64) as *mut __m512i, *x);
        }
    }

    /// Sixteen f16 values as f32, stored at `dst`.
    #[inline(always)]
    unsafe fn f16x16_store(h: &[*const u8; PANEL_ROWS], dst: *mut f32) {
        let mut v = [0u16; PANEL_ROWS];
        for i in 0..PANEL_ROWS {
            v[i] = (h[i] as *const u16).read_unaligned();
        }
        let x = _mm256_loadu_si256(v.as_ptr() as *const __m256i);
        _mm512_storeu_ps(dst, _mm512_cvtph_ps(x));
    }

    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            (p as *const u16).read_unaligned() as i32
        )))
    }

    #[inline(always)]
    unsafe fn pack_blocks<U: Unpack>(p: &mut Panel, ty: GgmlType, rows: &[&[u8]; PANEL_ROWS]) {
        let ts = ty.type_size();
        let off = _mm256_set1_epi8(level_offset(ty) as u8 as i8);
        for b in 0..p.n_blocks {
            let blk: [*const u8; PANEL_ROWS] = std::array::from_fn(|i| rows[i].as_ptr().add(b * ts));
            let mut v = [_mm256_setzero_si256(); PANEL_ROWS];
            for i in 0..PANEL_ROWS {
                v[i] = _mm256_add_epi8(U::levels(blk[i], 0), off);
            }
            transpose_store(&v, p.qs.as_mut_ptr().add(b * 512));
            for i in 0..PANEL_ROWS {
                p.d[b * 16 + i] = f16_at(blk[i].add(U::D_AT));
                if U::HAS_MIN {
                    p.m[b * 16 + i] = f16_at(blk[i].add(U::M_AT));
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn pack_k<U: Unpack>(p: &mut Panel, ty: GgmlType, rows: &[&[u8]; PANEL_ROWS]) {
        let ts = ty.type_size();
        let six = ty == GgmlType::Q6K;
        let off = _mm256_set1_epi8(if six { 32 } else { 0 });
        for sb in 0..p.n_blocks / 8 {
            let blk: [*const u8; PANEL_ROWS] = std::array::from_fn(|i| rows[i].as_ptr().add(sb * ts));
            for j in 0..8 {
                let mut v = [_mm256_setzero_si256(); PANEL_ROWS];
                for i in 0..PANEL_ROWS {
                    v[i] = _mm256_add_epi8(U::levels(blk[i], j), off);
                }
                transpose_store(&v, p.qs.as_mut_ptr().add((sb * 8 + j) * 512));
            }
            // Scales (and minimums) of the 16 rows: per row a vector of
            // 16-bit values, transposed so that lane i is row i.
            let mut sv = [_mm256_setzero_si256(); PANEL_ROWS];
            for i in 0..PANEL_ROWS {
                sv[i] = if six {
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(blk[i].add(192) as *const __m128i))
                } else {
                    scales_mins_k4(blk[i])
                };
            }
            let t = transpose(&sv);
            let mut at = [std::ptr::null::<u8>(); PANEL_ROWS];
            for i in 0..PANEL_ROWS {
                at[i] = blk[i].add(U::D_AT);
            }
            f16x16_store(&at, p.d.as_mut_ptr().add(sb * 16));
            let sc = p.sc.as_mut_ptr();
            if six {
                // Vector q: the signed scales of groups 2q and 2q + 1.
                for q in 0..8 {
                    let even = _mm512_srai_epi32(_mm512_slli_epi32(t[q], 16), 16);
                    let odd = _mm512_srai_epi32(t[q], 16);
                    _mm512_storeu_si512(sc.add((sb * 16 + 2 * q) * 16) as *mut __m512i, even);
                    _mm512_storeu_si512(sc.add((sb * 16 + 2 * q + 1) * 16) as *mut __m512i, odd);
                }
            } else {
                for i in 0..PANEL_ROWS {
                    at[i] = blk[i].add(U::M_AT);
                }
                f16x16_store(&at, p.m.as_mut_ptr().add(sb * 16));
                // Vectors 0..4: scales of blocks 2q and 2q + 1; 4..8: the
                // minimum pairs, already in the panel's form.
                let low = _mm512_set1_epi32(0xffff);
                for q in 0..4 {
                    let even = _mm512_and_si512(t[q], low);
                    let odd = _mm512_srli_epi32(t[q], 16);
                    _mm512_storeu_si512(sc.add((sb * 8 + 2 * q) * 16) as *mut __m512i, even);
                    _mm512_storeu_si512(sc.add((sb * 8 + 2 * q + 1) * 16) as *mut __m512i, odd);
                    _mm512_storeu_si512(p.mins.as_mut_ptr().add((sb * 4 + q) * 16) as *mut __m512i, t[q + 4]);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn pack(p: &mut Panel, ty: GgmlType, rows: &[&[u8]; PANEL_ROWS]) {
        match ty {
            GgmlType::Q4_0 => pack_blocks::<Q4_0>(p, ty, rows),
            GgmlType::Q4_1 => pack_blocks::<Q4_1>(p, ty, rows),
            GgmlType::Q5_0 => pack_blocks::<Q5_0>(p, ty, rows),
            GgmlType::Q5_1 => pack_blocks::<Q5_1>(p, ty, rows),
            GgmlType::Q8_0 => pack_blocks::<Q8_0>(p, ty, rows),
            GgmlType::Q4K => pack_k::<Q4K>(p, ty, rows),
            GgmlType::Q5K => pack_k::<Q5K>(p, ty, rows),
            GgmlType::Q6K => pack_k::<Q6K>(p, ty, rows),
            _ => unreachable!(),
        }
    }

    /// The activation's 4 bytes at element `4t` of block `a`, in every lane.
    #[inline(always)]
    unsafe fn act4(a: &BlockQ8, t: usize) -> __m512i {
        _mm512_set1_epi32((a.qs.as_ptr().add(4 * t) as *const i32).read_unaligned())
    }

    /// The canonical sum of a lane's eight accumulators,
    /// `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`, for 16 lanes and
    /// `R` activation rows, built as the classes finish (a few registers
    /// instead of an array of all eight).
    struct Tree<const R: usize> {
        pending: [__m512; R],
        low: [__m512; R],
        high: [__m512; R],
    }

    impl<const R: usize> Tree<R> {
        #[inline(always)]
        unsafe fn new() -> Self {
            Tree {
                pending: [_mm512_setzero_ps(); R],
                low: [_mm512_setzero_ps(); R],
                high: [_mm512_setzero_ps(); R],
            }
        }

        /// Takes class `c`'s accumulators (classes in order 0..8).
        #[inline(always)]
        unsafe fn push(&mut self, c: usize, acc: &[__m512; R]) {
            for r in 0..R {
                match c {
                    0 | 2 | 4 | 6 => self.pending[r] = acc[r],
                    1 => self.low[r] = _mm512_add_ps(self.pending[r], acc[r]),
                    3 => self.low[r] = _mm512_add_ps(self.low[r], _mm512_add_ps(self.pending[r], acc[r])),
                    5 => self.high[r] = _mm512_add_ps(self.pending[r], acc[r]),
                    _ => {
                        let h = _mm512_add_ps(self.high[r], _mm512_add_ps(self.pending[r], acc[r]));
                        self.low[r] = _mm512_add_ps(self.low[r], h);
                    }
                }
            }
        }

        /// Stores the sums (after class 7).
        #[inline(always)]
        unsafe fn store(&self, out: *mut [[f32; PANEL_ROWS]; 4]) {
            for r in 0..R {
                _mm512_storeu_ps((*out)[r].as_mut_ptr(), self.low[r]);
            }
        }
    }

    /// Per-32-block types: accumulator class `c` takes blocks c, c+8, ...
    #[inline(always)]
    unsafe fn dot_blocks<const MIN: bool, const OFF: bool, const R: usize>(
        p: &Panel,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: *mut [[f32; PANEL_ROWS]; 4],
    ) {
        let mut tree = Tree::<R>::new();
        for c in 0..8 {
            let mut acc = [_mm512_setzero_ps(); R];
            let mut b = c;
            while b < p.n_blocks {
                let q = p.qs.as_ptr().add(b * 512);
                let mut w = [_mm512_setzero_si512(); 8];
                for t in 0..8 {
                    w[t] = _mm512_loadu_si512(q.add(t * 64) as *const __m512i);
                }
                let dw = _mm512_loadu_ps(p.d.as_ptr().add(b * 16));
                let mw = if MIN {
                    _mm512_loadu_ps(p.m.as_ptr().add(b * 16))
                } else {
                    _mm512_setzero_ps()
                };
                for r in 0..R {
                    let a = acts.get_unchecked(r).get_unchecked(b);
                    let mut i = if OFF {
                        _mm512_set1_epi32(*aux.get_unchecked(r).get_unchecked(b))
                    } else {
                        _mm512_setzero_si512()
                    };
                    for t in 0..8 {
                        i = _mm512_dpbusd_epi32(i, w[t], act4(a, t));
                    }
                    let s = _mm512_mul_ps(dw, _mm512_set1_ps(a.d));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), s, acc[r]);
                    if MIN {
                        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s), acc[r]);
                    }
                }
                b += 8;
            }
            tree.push(c, &acc);
        }
        tree.store(out);
    }

    /// K-quant types: accumulator class `c` takes super-blocks c, c+8, ...
    /// `SIX`: Q6_K (signed 8-bit scales per 16 elements, levels offset by
    /// 32, no minimum); otherwise Q4_K / Q5_K (6-bit scales per 32
    /// elements, minimums).
    #[inline(always)]
    unsafe fn dot_k<const SIX: bool, const R: usize>(
        p: &Panel,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: *mut [[f32; PANEL_ROWS]; 4],
    ) {
        let n_sb = p.n_blocks / 8;
        let neg = _mm512_set1_epi32(i32::MIN);
        let mut tree = Tree::<R>::new();
        for c in 0..8 {
            let mut acc = [_mm512_setzero_ps(); R];
            let mut sb = c;
            while sb < n_sb {
                let mut isum = [_mm512_setzero_si512(); R];
                for j in 0..8 {
                    let blk = sb * 8 + j;
                    let q = p.qs.as_ptr().add(blk * 512);
                    let mut w = [_mm512_setzero_si512(); 8];
                    for t in 0..8 {
                        w[t] = _mm512_loadu_si512(q.add(t * 64) as *const __m512i);
                    }
                    if SIX {
                        let s0 = _mm512_loadu_si512(p.sc.as_ptr().add((2 * blk) * 16) as *const __m512i);
                        let s1 = _mm512_loadu_si512(p.sc.as_ptr().add((2 * blk + 1) * 16) as *const __m512i);
                        for r in 0..R {
                            let a = acts.get_unchecked(r).get_unchecked(blk);
                            let x = aux.get_unchecked(r);
                            let mut i0 = _mm512_set1_epi32(*x.get_unchecked(2 * blk));
                            let mut i1 = _mm512_set1_epi32(*x.get_unchecked(2 * blk + 1));
                            for t in 0..4 {
                                i0 = _mm512_dpbusd_epi32(i0, w[t], act4(a, t));
                                i1 = _mm512_dpbusd_epi32(i1, w[t + 4], act4(a, t + 4));
                            }
                            isum[r] = _mm512_add_epi32(
                                isum[r],
                                _mm512_add_epi32(_mm512_mullo_epi32(i0, s0), _mm512_mullo_epi32(i1, s1)),
                            );
                        }
                    } else {
                        let s = _mm512_loadu_si512(p.sc.as_ptr().add(blk * 16) as *const __m512i);
                        for r in 0..R {
                            let a = acts.get_unchecked(r).get_unchecked(blk);
                            let mut i0 = _mm512_setzero_si512();
                            let mut i1 = _mm512_setzero_si512();
                            for t in 0..4 {
                                i0 = _mm512_dpbusd_epi32(i0, w[t], act4(a, t));
                                i1 = _mm512_dpbusd_epi32(i1, w[t + 4], act4(a, t + 4));
                            }
                            isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_add_epi32(i0, i1), s));
                        }
                    }
                }
                let d = _mm512_loadu_ps(p.d.as_ptr().add(sb * 16));
                for r in 0..R {
                    let da = _mm512_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, da), acc[r]);
                }
                if !SIX {
                    let dmin = _mm512_loadu_ps(p.m.as_ptr().add(sb * 16));
                    let mut mv = [_mm512_setzero_si512(); 4];
                    for q in 0..4 {
                        mv[q] = _mm512_loadu_si512(p.mins.as_ptr().add((sb * 4 + q) * 16) as *const __m512i);
                    }
                    for r in 0..R {
                        let x = aux.get_unchecked(r);
                        let mut msum = _mm512_setzero_si512();
                        for q in 0..4 {
                            msum = _mm512_dpwssd_epi32(msum, mv[q], _mm512_set1_epi32(*x.get_unchecked(sb * 4 + q)));
                        }
                        let da = _mm512_set1_ps(acts.get_unchecked(r).get_unchecked(sb * 8).d);
                        let cm =
                            _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, da)), neg));
                        acc[r] = _mm512_fmadd_ps(cm, _mm512_cvtepi32_ps(msum), acc[r]);
                    }
                }
                sb += 8;
            }
            tree.push(c, &acc);
        }
        tree.store(out);
    }

    #[inline(always)]
    unsafe fn dot_r<const R: usize>(
        p: &Panel,
        ty: GgmlType,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: *mut [[f32; PANEL_ROWS]; 4],
    ) {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => dot_blocks::<false, true, R>(p, acts, aux, out),
            GgmlType::Q4_1 | GgmlType::Q5_1 => dot_blocks::<true, false, R>(p, acts, aux, out),
            GgmlType::Q4K | GgmlType::Q5K => dot_k::<false, R>(p, acts, aux, out),
            GgmlType::Q6K => dot_k::<true, R>(p, acts, aux, out),
            _ => unreachable!(),
        }
    }

    /// Up to four activation rows against a packed panel.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dot(
        p: &Panel,
        ty: GgmlType,
        acts: &[&[BlockQ8]],
        aux: &[&[i32]],
        out: *mut [[f32; PANEL_ROWS]; 4],
    ) {
        match acts.len() {
            1 => dot_r::<1>(p, ty, acts, aux, out),
            2 => dot_r::<2>(p, ty, acts, aux, out),
            3 => dot_r::<3>(p, ty, acts, aux, out),
            _ => dot_r::<4>(p, ty, acts, aux, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_support::{weights, Rng, TYPES};
    use crate::dot::{act_format, dot_rows_with, quantize_row, QK8};

    #[test]
    fn panels_equal_the_scalar_reference_bitwise() {
        if !available(GgmlType::Q8_0) {
            eprintln!("no AVX-512 VNNI here: panels are not used");
            return;
        }
        let mut rng = Rng(42);
        for ty in TYPES {
            // Fewer than 8, exactly 8, and more than 8 blocks or super-blocks
            // (accumulator classes with no, one and two blocks).
            for n in [768, 2048, 2304, 4608] {
                let nb = n / QK8;
                for n_w in [16, 5, 1] {
                    let ws: Vec<Vec<u8>> = (0..n_w).map(|_| weights(ty, n, &mut rng)).collect();
                    let wrefs: Vec<&[u8]> = ws.iter().map(|v| v.as_slice()).collect();
                    let n_r = 7;
                    let acts: Vec<Vec<BlockQ8>> = (0..n_r)
                        .map(|r| {
                            let x: Vec<f32> = (0..n).map(|_| rng.f32() * (0.5 + r as f32)).collect();
                            let mut q = vec![BlockQ8::default(); nb];
                            quantize_row(act_format(ty), &x, &mut q);
                            q
                        })
                        .collect();
                    let aux: Vec<Vec<i32>> = acts
                        .iter()
                        .map(|a| {
                            let mut v = vec![0; aux_len(ty, nb)];
                            activation_aux(ty, a, &mut v);
                            v
                        })
                        .collect();
                    let arefs: Vec<&[BlockQ8]> = acts.iter().map(|v| v.as_slice()).collect();
                    let xrefs: Vec<&[i32]> = aux.iter().map(|v| v.as_slice()).collect();
                    let mut panel = Panel::new();
                    panel.pack(ty, &wrefs);
                    for rows in [n_r, 4, 3, 1] {
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
}
