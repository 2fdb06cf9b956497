//! Attention over lossy pages: keys or values (or both) stored as Q8 or
//! TQ4 codes of the rotated vector, read in place, page by page with a
//! running softmax.
//!
//! One body ([`body`]) serves every SIMD level: it is written over
//! [`Lanes`], sixteen f32 lanes, and each level implements `Lanes` with the
//! same operation per lane (an array of 16 for the scalar reference, two
//! 8-lane registers for AVX2, one 16-lane register for AVX-512). Every
//! reduction goes through lanes in a fixed way, so the three levels give
//! the same bits, and the order depends on the position range and the
//! page size alone, so a row's result does not depend on its batch.
//!
//! The arithmetic, per head and page:
//!
//! - **Scores.** Coded keys against the query divided by the key basis'
//!   weights and rotated once (`q·k = (R q)·(R k)`), coordinate `e` in
//!   lane `e` (Q8) or in the lane order of the codes (TQ4, see
//!   [`Kind::lane`]). Each 16-lane chunk takes one fused multiply-add; a
//!   block of positions shares one fold ([`fold16`] per head and
//!   position). Then, 16 positions at a time: the fold times the key's
//!   scale, plus the key offset's part, times the attention scale. The
//!   offset's part (see [`crate::kvbasis`]) is `Σ_j X'_j cos θ_j t` plus
//!   `Σ_j Y'_j sin θ_j t` (each summed over the pairs in order, positions
//!   in lanes), plus the unrotated dimensions' part. Keys of the exact
//!   window (F16 twins) and plain keys take the plain query and no scale
//!   or offset: exactly `dot_f32(q, k) * scale`.
//! - **Running softmax.** The page's maximum (lanes by the `maxps` rule,
//!   then in order) joins the running one; when it grows the sums so far
//!   are multiplied by `exp_fixed(old - new)`. The page's
//!   `exp_fixed(score - max)` are added up in 16 lanes (score `t` in lane
//!   `t % 16`) and folded, then added to the running sum.
//! - **Values.** Each exponential times its value's scale (coded values)
//!   is the weight of the value's levels; values add up per lane by fused
//!   multiply-adds in position order, coded ones in the rotated domain (in
//!   their part's lane order), twins' and plain ones into the output. At
//!   the end the rotated sums are put back in order, rotated back, added
//!   to the output, and the output is divided by the running sum.
//!
//! Scratch is one page of scores per head whatever the context, and a
//! page's codes are used while they are in cache; the next page's codes
//! are asked for at the start of each page, since pages lie anywhere.

use super::{AttnQuery, AttnScratch, Data, KvStorage};
use crate::ops::{exp_fixed, fold16};

/// How one part (keys or values) is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Tq4,
    Q8,
    F16,
    F32,
}

impl Kind {
    fn of(d: &Data) -> Kind {
        match d {
            Data::Tq4 { .. } => Kind::Tq4,
            Data::Q8 { .. } => Kind::Q8,
            Data::F16(_) => Kind::F16,
            Data::F32(_) => Kind::F32,
        }
    }

    /// Stored as codes of the rotated vector, with a scale per vector.
    #[inline(always)]
    fn coded(self) -> bool {
        matches!(self, Kind::Tq4 | Kind::Q8)
    }

    /// Bytes of one vector of `hd` elements.
    #[inline(always)]
    fn vector_bytes(self, hd: usize) -> usize {
        match self {
            Kind::Tq4 => hd / 2,
            Kind::Q8 => hd,
            Kind::F16 => 2 * hd,
            Kind::F32 => 4 * hd,
        }
    }

    /// The lane that coordinate `e` of a vector of `hd` is kept in: TQ4
    /// codes of 32 coordinates are 16 bytes, whose low nibbles (the even
    /// coordinates) are read as one chunk and high nibbles (the odd ones)
    /// as the next; a vector of 16 is 8 bytes, low nibbles then high
    /// nibbles in one chunk.
    #[inline(always)]
    fn lane(self, e: usize, hd: usize) -> usize {
        match self {
            Kind::Tq4 if hd == 16 => e / 2 + 8 * (e % 2),
            Kind::Tq4 => 32 * (e / 32) + 16 * (e % 2) + (e % 32) / 2,
            _ => e,
        }
    }
}

/// A part's kind, known when compiling (the common pairs) or at run time.
trait Part: Copy {
    fn kind(self) -> Kind;
}

#[derive(Clone, Copy)]
struct Tq4;
#[derive(Clone, Copy)]
struct Q8;
#[derive(Clone, Copy)]
struct Dyn(Kind);
/// The exact window's twins.
#[derive(Clone, Copy)]
struct Twin;

impl Part for Tq4 {
    #[inline(always)]
    fn kind(self) -> Kind {
        Kind::Tq4
    }
}

impl Part for Q8 {
    #[inline(always)]
    fn kind(self) -> Kind {
        Kind::Q8
    }
}

impl Part for Twin {
    #[inline(always)]
    fn kind(self) -> Kind {
        Kind::F16
    }
}

impl Part for Dyn {
    #[inline(always)]
    fn kind(self) -> Kind {
        self.0
    }
}

/// Sixteen f32 lanes and the operations the kernel performs on them. Each
/// implementation performs the same IEEE operation per lane, so results are
/// the same bits at every level.
///
/// # Safety
/// Implementations for a SIMD level may only be used where the CPU has it;
/// the pointer arguments must be valid for the elements they name.
pub(super) trait Lanes: Copy {
    /// The 16 TQ4 levels, held as the level looks them up.
    type Book: Copy;
    unsafe fn book(levels: &[f32; 16]) -> Self::Book;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    /// The first `k` lanes from `p` (no others are read), zeros after.
    unsafe fn load_first(p: *const f32, k: usize) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// Writes the first `k` lanes only.
    unsafe fn store_first(self, p: *mut f32, k: usize);
    /// The first `k` lanes, zeros after.
    unsafe fn first(self, k: usize) -> Self;
    /// 16 halves, in order.
    unsafe fn f16(p: *const u16) -> Self;
    /// 16 int8 codes, in order.
    unsafe fn q8(p: *const i8) -> Self;
    /// The levels of the low nibbles of 16 code bytes, or (`HIGH`) of
    /// their high nibbles.
    unsafe fn tq4<const HIGH: bool>(p: *const u8, book: Self::Book) -> Self;
    /// The levels of 8 code bytes: low nibbles, then high nibbles.
    unsafe fn tq4_8(p: *const u8, book: Self::Book) -> Self;
    /// `if a > b { a } else { b }` per lane (the `maxps` rule: `b` when
    /// either is NaN or both are zeros).
    unsafe fn max(a: Self, b: Self) -> Self;
    /// Lanes `k..` set to `v`.
    unsafe fn fill_after(self, k: usize, v: f32) -> Self;
    /// `a * b + c`, rounded once.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn sub(a: Self, b: Self) -> Self;
    /// [`exp_fixed`] of each lane.
    unsafe fn exp(self) -> Self;
    /// [`fold16`] of each of 8 registers.
    unsafe fn folds(a: &[Self; 8]) -> [f32; 8];
    /// Asks for the cache line at `p`.
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
}

/// The scalar reference: an array of 16.
#[derive(Clone, Copy)]
pub(super) struct Scalar([f32; 16]);

impl Lanes for Scalar {
    type Book = [f32; 16];

    #[inline(always)]
    unsafe fn book(levels: &[f32; 16]) -> [f32; 16] {
        *levels
    }
    #[inline(always)]
    unsafe fn zero() -> Self {
        Scalar([0.0; 16])
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Scalar([x; 16])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Scalar(std::array::from_fn(|i| *p.add(i)))
    }
    #[inline(always)]
    unsafe fn load_first(p: *const f32, k: usize) -> Self {
        Scalar(std::array::from_fn(|i| if i < k { *p.add(i) } else { 0.0 }))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        for (i, &x) in self.0.iter().enumerate() {
            *p.add(i) = x;
        }
    }
    #[inline(always)]
    unsafe fn store_first(self, p: *mut f32, k: usize) {
        for (i, &x) in self.0.iter().enumerate().take(k) {
            *p.add(i) = x;
        }
    }
    #[inline(always)]
    unsafe fn first(self, k: usize) -> Self {
        Scalar(std::array::from_fn(|i| if i < k { self.0[i] } else { 0.0 }))
    }
    #[inline(always)]
    unsafe fn f16(p: *const u16) -> Self {
        Scalar(std::array::from_fn(|i| half::f16::from_bits(*p.add(i)).to_f32()))
    }
    #[inline(always)]
    unsafe fn q8(p: *const i8) -> Self {
        Scalar(std::array::from_fn(|i| *p.add(i) as f32))
    }
    #[inline(always)]
    unsafe fn tq4<const HIGH: bool>(p: *const u8, book: [f32; 16]) -> Self {
        Scalar(std::array::from_fn(|i| {
            let b = *p.add(i);
            book[usize::from(if HIGH { b >> 4 } else { b & 0x0f })]
        }))
    }
    #[inline(always)]
    unsafe fn tq4_8(p: *const u8, book: [f32; 16]) -> Self {
        Scalar(std::array::from_fn(|i| {
            let b = *p.add(i % 8);
            book[usize::from(if i < 8 { b & 0x0f } else { b >> 4 })]
        }))
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Scalar(std::array::from_fn(|i| if a.0[i] > b.0[i] { a.0[i] } else { b.0[i] }))
    }
    #[inline(always)]
    unsafe fn fill_after(self, k: usize, v: f32) -> Self {
        Scalar(std::array::from_fn(|i| if i < k { self.0[i] } else { v }))
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Scalar(std::array::from_fn(|i| a.0[i].mul_add(b.0[i], c.0[i])))
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Scalar(std::array::from_fn(|i| a.0[i] * b.0[i]))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Scalar(std::array::from_fn(|i| a.0[i] + b.0[i]))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Scalar(std::array::from_fn(|i| a.0[i] - b.0[i]))
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        Scalar(self.0.map(exp_fixed))
    }
    #[inline(always)]
    unsafe fn folds(a: &[Self; 8]) -> [f32; 8] {
        std::array::from_fn(|g| fold16(&a[g].0))
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86;

/// Whether [`attend`] takes this cache: a part coded, heads in whole
/// 16-blocks.
pub(super) fn takes(kv: &KvStorage) -> bool {
    let hd = kv.shape.head_dim;
    kv.is_lossy() && hd.is_multiple_of(16) && hd <= super::ROTATED_MAX_DIM
}

/// Attention of the query heads `q` that share KV head `kv_head` over a
/// cache with a lossy part, at the level `level` (the same bits at every
/// level). Groups of more than 8 heads go 8 at a time: a head's result does
/// not depend on which heads share its pass.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    level: crate::cpu::Simd,
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let hd = kv.shape.head_dim;
    for (qs, os) in q.chunks(8 * hd).zip(out.chunks_mut(8 * hd)) {
        match level {
            // SAFETY: the level's features were detected (`simd`).
            #[cfg(target_arch = "x86_64")]
            crate::cpu::Simd::Avx512Vnni => unsafe {
                x86::attend_avx512(kv, layer, kv_head, query, qs, scale, os, scratch)
            },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            crate::cpu::Simd::Avx2 => unsafe { x86::attend_avx2(kv, layer, kv_head, query, qs, scale, os, scratch) },
            // SAFETY: the scalar lanes need no CPU feature; the body keeps
            // every pointer inside the cache and the scratch.
            _ => unsafe { by_kinds::<Scalar, false>(kv, layer, kv_head, query, qs, scale, os, scratch) },
        }
    }
}

/// The body for the storage's pair of kinds and the group's size (and
/// the block of positions its scores take: blocks times heads fill at
/// most 8 registers): TQ4 and Q8 alone compiled for their kinds when
/// `FIXED`, every other pair (and every pair when not) reading kinds at
/// run time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn by_kinds<L: Lanes, const FIXED: bool>(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    macro_rules! by_group {
        ($k:expr, $v:expr) => {
            match q.len() / kv.shape.head_dim {
                1 => body::<L, 1, 4, _, _>(kv, layer, kv_head, query, q, scale, out, scratch, $k, $v),
                2 => body::<L, 2, 4, _, _>(kv, layer, kv_head, query, q, scale, out, scratch, $k, $v),
                3 => body::<L, 3, 2, _, _>(kv, layer, kv_head, query, q, scale, out, scratch, $k, $v),
                4 => body::<L, 4, 2, _, _>(kv, layer, kv_head, query, q, scale, out, scratch, $k, $v),
                5 => body::<L, 5, 1, _, _>(kv, layer, kv_head, query, q, scale, out, scratch, $k, $v),
                6 => body::<L, 6, 1, _, _>(kv, layer, kv_head, query, q, scale, out, scratch, $k, $v),
                7 => body::<L, 7, 1, _, _>(kv, layer, kv_head, query, q, scale, out, scratch, $k, $v),
                8 => body::<L, 8, 1, _, _>(kv, layer, kv_head, query, q, scale, out, scratch, $k, $v),
                g => unreachable!("coded attention takes 1 to 8 query heads at once, not {g}"),
            }
        };
    }
    let (k, v) = (Kind::of(&kv.k), Kind::of(&kv.v));
    match (FIXED, k, v) {
        (true, Kind::Tq4, Kind::Tq4) => by_group!(Tq4, Tq4),
        (true, Kind::Q8, Kind::Q8) => by_group!(Q8, Q8),
        _ => by_group!(Dyn(k), Dyn(v)),
    }
}

/// A part's bytes and its scales (empty for the plain kinds).
fn raw(d: &Data) -> (*const u8, &[u16]) {
    match d {
        Data::Tq4 { codes, scales } => (codes.as_ptr(), scales),
        Data::Q8 { codes, scales } => (codes.as_ptr() as *const u8, scales),
        Data::F16(x) => (x.as_ptr() as *const u8, &[]),
        Data::F32(x) => (x.as_ptr() as *const u8, &[]),
    }
}

/// Lanes `16c .. 16c + 16` of a vector at `vector`, unscaled, in the
/// kind's lane order ([`Kind::lane`]), for `c = 2 c2 + HIGH`.
#[inline(always)]
unsafe fn chunk<L: Lanes, const HIGH: bool>(kind: Kind, vector: *const u8, c2: usize, book: L::Book) -> L {
    let c = 2 * c2 + usize::from(HIGH);
    match kind {
        Kind::Tq4 => L::tq4::<HIGH>(vector.add(c2 * 16), book),
        Kind::Q8 => L::q8(vector.add(c * 16) as *const i8),
        Kind::F16 => L::f16((vector as *const u16).add(c * 16)),
        Kind::F32 => L::load((vector as *const f32).add(c * 16)),
    }
}

/// The last lanes of a vector with an odd number `c + 1` of chunks (a TQ4
/// vector of 16, or a plain one).
#[inline(always)]
unsafe fn last_chunk<L: Lanes>(kind: Kind, vector: *const u8, c: usize, book: L::Book) -> L {
    match kind {
        Kind::Tq4 => L::tq4_8(vector, book),
        Kind::Q8 => L::q8(vector.add(c * 16) as *const i8),
        Kind::F16 => L::f16((vector as *const u16).add(c * 16)),
        Kind::F32 => L::load((vector as *const f32).add(c * 16)),
    }
}

/// 16 lanes from `p`, the first `k` only when fewer remain.
#[inline(always)]
unsafe fn load_upto<L: Lanes>(p: *const f32, k: usize) -> L {
    if k >= 16 {
        L::load(p)
    } else {
        L::load_first(p, k)
    }
}

/// The `k <= 16` f16 scales at `p` as lanes (zeros after).
#[inline(always)]
unsafe fn scales16<L: Lanes>(p: *const u16, k: usize) -> L {
    if k >= 16 {
        L::f16(p)
    } else {
        let mut b = [0u16; 16];
        std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), k);
        L::f16(b.as_ptr())
    }
}

/// Writes the first `k` lanes of `x` to `p` (all 16 when `k >= 16`).
#[inline(always)]
unsafe fn store_upto<L: Lanes>(x: L, p: *mut f32, k: usize) {
    if k >= 16 {
        x.store(p)
    } else {
        x.store_first(p, k)
    }
}

/// Asks for the `bytes` bytes at `p`, a cache line at a time.
#[inline(always)]
unsafe fn prefetch_run<L: Lanes>(p: *const u8, bytes: usize) {
    for o in (0..bytes.min(8192)).step_by(64) {
        L::prefetch(p.add(o));
    }
}

/// The lanes of a register, in order.
#[inline(always)]
unsafe fn lanes_of<L: Lanes>(x: L) -> [f32; 16] {
    let mut a = [0f32; 16];
    x.store(a.as_mut_ptr());
    a
}

/// What every block of scores of a call shares.
struct Block<B> {
    hd: usize,
    book: B,
    scores: *mut f32,
    pt: usize,
}

impl<B: Copy> Block<B> {
    /// The folded dot products of `P` consecutive positions (vectors at
    /// `keys`, `bytes` apart, `t` into the page's scores) for `G` heads
    /// against the queries at `q`, unscaled; `P * G <= 8`, so one fold
    /// serves the block.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn score<L: Lanes<Book = B>, const G: usize, const P: usize, K: Part>(
        &self,
        part: K,
        keys: *const u8,
        bytes: usize,
        q: *const f32,
        t: usize,
    ) {
        let (hd, kind) = (self.hd, part.kind());
        let chunks = hd / 16;
        let mut a = [[L::zero(); G]; P];
        macro_rules! step {
            ($c:expr, |$k:ident| $load:expr) => {{
                let c = $c;
                let mut x = [L::zero(); P];
                for (j, xj) in x.iter_mut().enumerate() {
                    let $k = keys.add(j * bytes);
                    *xj = $load;
                }
                for g in 0..G {
                    let qv = L::load(q.add(g * hd + c * 16));
                    for j in 0..P {
                        a[j][g] = L::fma(qv, x[j], a[j][g]);
                    }
                }
            }};
        }
        for c2 in 0..chunks / 2 {
            step!(2 * c2, |k| chunk::<L, false>(kind, k, c2, self.book));
            step!(2 * c2 + 1, |k| chunk::<L, true>(kind, k, c2, self.book));
        }
        if chunks % 2 == 1 {
            step!(chunks - 1, |k| last_chunk::<L>(kind, k, chunks - 1, self.book));
        }
        let mut flat = [L::zero(); 8];
        for j in 0..P {
            for g in 0..G {
                flat[j * G + g] = a[j][g];
            }
        }
        let sums = L::folds(&flat);
        for j in 0..P {
            for g in 0..G {
                *self.scores.add(g * self.pt + t + j) = sums[j * G + g];
            }
        }
    }
}

/// A page's weights (`w[g * pt + t]` for its `n` positions) and the head
/// size.
struct Weights {
    w: *const f32,
    pt: usize,
    n: usize,
    hd: usize,
}

impl Weights {
    /// Adds the weighted values (vectors at `values`, `bytes` apart) of
    /// the `G` heads to the sums at `into` (`hd` apart), lane by lane in
    /// position order.
    #[inline(always)]
    unsafe fn add<L: Lanes, const G: usize, V: Part>(
        &self,
        part: V,
        values: *const u8,
        bytes: usize,
        into: *mut f32,
        book: L::Book,
    ) {
        let (hd, kind) = (self.hd, part.kind());
        let chunks = hd / 16;
        macro_rules! pass {
            ($c:expr, |$v:ident| $load:expr) => {{
                let c = $c;
                let mut ar = [L::zero(); G];
                for (g, arg) in ar.iter_mut().enumerate() {
                    *arg = L::load(into.add(g * hd + c * 16));
                }
                for t in 0..self.n {
                    let $v = values.add(t * bytes);
                    let x = $load;
                    for (g, arg) in ar.iter_mut().enumerate() {
                        *arg = L::fma(L::splat(*self.w.add(g * self.pt + t)), x, *arg);
                    }
                }
                for (g, arg) in ar.iter().enumerate() {
                    arg.store(into.add(g * hd + c * 16));
                }
            }};
        }
        for c2 in 0..chunks / 2 {
            if G > 4 {
                // Registers for one chunk's sums of every head only.
                pass!(2 * c2, |v| chunk::<L, false>(kind, v, c2, book));
                pass!(2 * c2 + 1, |v| chunk::<L, true>(kind, v, c2, book));
                continue;
            }
            // Both chunks of a pair in one pass: the weights are read once.
            let c = 2 * c2;
            let mut lo = [L::zero(); G];
            let mut hi = [L::zero(); G];
            for g in 0..G {
                lo[g] = L::load(into.add(g * hd + c * 16));
                hi[g] = L::load(into.add(g * hd + c * 16 + 16));
            }
            for t in 0..self.n {
                let v = values.add(t * bytes);
                let (x0, x1) = (
                    chunk::<L, false>(kind, v, c2, book),
                    chunk::<L, true>(kind, v, c2, book),
                );
                for g in 0..G {
                    let w = L::splat(*self.w.add(g * self.pt + t));
                    lo[g] = L::fma(w, x0, lo[g]);
                    hi[g] = L::fma(w, x1, hi[g]);
                }
            }
            for g in 0..G {
                lo[g].store(into.add(g * hd + c * 16));
                hi[g].store(into.add(g * hd + c * 16 + 16));
            }
        }
        if chunks % 2 == 1 {
            pass!(chunks - 1, |v| last_chunk::<L>(kind, v, chunks - 1, book));
        }
    }
}

/// [`crate::kvbasis::Trig::shift`] of the `G` heads' `(X, Y)` at `xy`
/// (`hd` apart) to page `page`, into `out`, 16 pairs at a time (the same
/// products and sums, each rounded alone).
#[inline(always)]
unsafe fn shift<L: Lanes, const G: usize>(
    trig: &crate::kvbasis::Trig,
    xy: *const f32,
    page: usize,
    hd: usize,
    out: *mut f32,
) {
    let np = trig.pairs.len();
    let (c, s) = (
        trig.start_cos.as_ptr().add(page * np),
        trig.start_sin.as_ptr().add(page * np),
    );
    for j in (0..np).step_by(16) {
        let k = np - j;
        let (cv, sv) = (load_upto::<L>(c.add(j), k), load_upto::<L>(s.add(j), k));
        for g in 0..G {
            let (x, y) = (
                load_upto::<L>(xy.add(g * hd + j), k),
                load_upto::<L>(xy.add(g * hd + np + j), k),
            );
            store_upto(L::add(L::mul(x, cv), L::mul(y, sv)), out.add(g * hd + j), k);
            store_upto(L::sub(L::mul(y, cv), L::mul(x, sv)), out.add(g * hd + np + j), k);
        }
    }
}

/// The key offset's part of the scores of positions `first..first + len`
/// of a page, for `G` heads: `Σ_j X'_j cos θ_j t` and `Σ_j Y'_j sin θ_j t`
/// (each over the pairs in order, positions in lanes), added, plus the
/// head's unrotated part `c0`; written to `out[g * page_tokens + t]`.
#[inline(always)]
unsafe fn page_offsets<L: Lanes, const G: usize>(
    trig: &crate::kvbasis::Trig,
    xy: *const f32,
    hd: usize,
    c0: &[f32],
    first: usize,
    len: usize,
    out: *mut f32,
) {
    let (np, pt) = (trig.pairs.len(), trig.page_tokens);
    let (cs, sn) = (trig.within_cos.as_ptr(), trig.within_sin.as_ptr());
    // Two blocks of 16 positions at once (independent sums, so more of
    // them are in flight); each lane's sums are the same either way.
    let mut t = 0;
    while t < len {
        let k0 = (len - t).min(16);
        let k1 = (len - t).saturating_sub(16).min(16);
        let mut ax = [[L::zero(); G]; 2];
        let mut ay = [[L::zero(); G]; 2];
        for j in 0..np {
            let row = j * pt + first + t;
            let c0v = load_upto::<L>(cs.add(row), k0);
            let s0v = load_upto::<L>(sn.add(row), k0);
            let (c1v, s1v) = if k1 > 0 {
                (
                    load_upto::<L>(cs.add(row + 16), k1),
                    load_upto::<L>(sn.add(row + 16), k1),
                )
            } else {
                (L::zero(), L::zero())
            };
            for g in 0..G {
                let (x, y) = (L::splat(*xy.add(g * hd + j)), L::splat(*xy.add(g * hd + np + j)));
                ax[0][g] = L::fma(x, c0v, ax[0][g]);
                ay[0][g] = L::fma(y, s0v, ay[0][g]);
                ax[1][g] = L::fma(x, c1v, ax[1][g]);
                ay[1][g] = L::fma(y, s1v, ay[1][g]);
            }
        }
        for (b, k) in [(0, k0), (1, k1)] {
            if k == 0 {
                continue;
            }
            for g in 0..G {
                let o = L::add(L::add(ax[b][g], ay[b][g]), L::splat(c0[g]));
                store_upto(o, out.add(g * pt + t + 16 * b), k);
            }
        }
        t += 32;
    }
}

/// The kernel: see the module's documentation for its arithmetic.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn body<L: Lanes, const G: usize, const P: usize, K: Part, V: Part>(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    kp: K,
    vp: V,
) {
    let (kk, vk) = (kp.kind(), vp.kind());
    let hd = kv.shape.head_dim;
    let pt = kv.shape.page_tokens;
    let chunks = hd / 16;
    let ((ck, sk), (cv, sv)) = (raw(&kv.k), raw(&kv.v));
    let (kb, vb) = (kk.vector_bytes(hd), vk.vector_bytes(hd));
    let (tk, tv): (&[u16], &[u16]) = match (&kv.twin_k, &kv.twin_v) {
        (Data::F16(a), Data::F16(b)) => (a, b),
        _ => (&[], &[]),
    };
    let signs = kv.signs_of(layer, kv_head);
    let book = if kk == Kind::Tq4 || vk == Kind::Tq4 {
        L::book(crate::tq4::codebook(hd))
    } else {
        L::book(&[0.0; 16])
    };
    let AttnScratch {
        scores,
        kv: tmp,
        rotated: qr,
        acc,
        xy,
        shifted,
        c0,
        run,
        offsets,
    } = scratch;
    assert!(scores.len() >= G * pt && offsets.len() >= G * pt && qr.len() >= G * hd && tmp.len() >= hd);
    assert!(run.len() >= 2 * G && c0.len() >= G);
    assert!(out.len() == G * hd && q.len() == G * hd);
    // The key basis applies to TQ4 keys only (see `with_key_basis`).
    let offset = match (&kv.basis, kk) {
        (Some((b, t)), Kind::Tq4) => Some((&**b, t.trig(layer))),
        _ => None,
    };
    for g in 0..G {
        let qg = &q[g * hd..(g + 1) * hd];
        let qrg = &mut qr[g * hd..(g + 1) * hd];
        if kk.coded() {
            tmp.copy_from_slice(qg);
            if let Some((b, trig)) = offset {
                tmp.iter_mut().zip(b.weight(layer, kv_head)).for_each(|(x, &w)| *x /= w);
                c0[g] = trig.prepare(qg, b.offset(layer, kv_head), &mut xy[g * hd..(g + 1) * hd]);
            }
            crate::tq4::rotate(tmp, signs);
            for (e, &x) in tmp.iter().enumerate() {
                qrg[kk.lane(e, hd)] = x;
            }
        } else {
            qrg.copy_from_slice(qg);
        }
    }
    out.fill(0.0);
    acc[..G * hd].fill(0.0);
    let (maxes, sums) = run[..2 * G].split_at_mut(G);
    maxes.fill(f32::NEG_INFINITY);
    sums.fill(0.0);
    let (qp, qrp, sp) = (q.as_ptr(), qr.as_ptr(), scores.as_mut_ptr());
    let mut p = query.start;
    while p < query.end {
        let (index, first) = (p / pt, p % pt);
        let last = (pt - 1).min(query.end - 1 - index * pt);
        let len = last + 1 - first;
        let exact = query.exact(index, pt);
        let base = match exact {
            Some(t) => kv.vector(t, layer, kv_head, 0),
            None => kv.vector(query.pages[index], layer, kv_head, 0),
        };
        // The next page's codes, while this one is worked on.
        let next = (index + 1) * pt;
        if next < query.end && query.exact(index + 1, pt).is_none() {
            let nb = kv.vector(query.pages[index + 1], layer, kv_head, 0);
            let n = pt.min(query.end - next);
            prefetch_run::<L>(ck.add(nb * kb), n * kb);
            prefetch_run::<L>(cv.add(nb * vb), n * vb);
        }
        // Scores of the page, a block of positions at a time.
        let block = Block {
            hd,
            book,
            scores: sp,
            pt,
        };
        let off = match (exact, offset) {
            (None, Some((_, trig))) => {
                shift::<L, G>(trig, xy.as_ptr(), index, hd, shifted.as_mut_ptr());
                page_offsets::<L, G>(trig, shifted.as_ptr(), hd, c0, first, len, offsets.as_mut_ptr());
                Some(offsets.as_ptr())
            }
            _ => None,
        };
        let mut t = 0;
        macro_rules! blocks {
            ($p:tt) => {
                while len - t >= $p {
                    let vi = base + first + t;
                    match exact {
                        Some(_) => {
                            let keys = (tk.as_ptr() as *const u8).add(vi * 2 * hd);
                            block.score::<L, G, $p, _>(Twin, keys, 2 * hd, qp, t)
                        }
                        None => block.score::<L, G, $p, _>(kp, ck.add(vi * kb), kb, qrp, t),
                    }
                    t += $p;
                }
            };
        }
        blocks!(P);
        if P > 1 {
            blocks!(1);
        }
        // Scores: the fold times the key's scale (coded keys), plus the
        // offset's part, times the attention scale; then the running
        // softmax, rescaling the sums so far if the maximum grew.
        let kscales = (exact.is_none() && kk.coded()).then(|| sk.as_ptr().add(base + first));
        let vscales = (exact.is_none() && vk.coded()).then(|| sv.as_ptr().add(base + first));
        for g in 0..G {
            let sc = sp.add(g * pt);
            let mut m = L::splat(f32::NEG_INFINITY);
            for t in (0..len).step_by(16) {
                let k = (len - t).min(16);
                let mut x = load_upto::<L>(sc.add(t), k);
                if let Some(ks) = kscales {
                    x = L::mul(x, scales16(ks.add(t), k));
                }
                if let Some(o) = off {
                    x = L::add(x, load_upto(o.add(g * pt + t), k));
                }
                x = L::mul(x, L::splat(scale));
                store_upto(x, sc.add(t), k);
                m = L::max(m, x.fill_after(k, f32::NEG_INFINITY));
            }
            let grown = lanes_of(m).iter().fold(maxes[g], |m, &v| if v > m { v } else { m });
            if grown > maxes[g] {
                let c = exp_fixed(maxes[g] - grown);
                sums[g] *= c;
                let cv = L::splat(c);
                for arr in [out.as_mut_ptr(), acc.as_mut_ptr()] {
                    for ch in 0..chunks {
                        let ptr = arr.add(g * hd + ch * 16);
                        L::mul(L::load(ptr), cv).store(ptr);
                    }
                }
                maxes[g] = grown;
            }
            // The weights: the exponentials, times the value's scale
            // (coded values, whose levels are summed unscaled).
            let gv = L::splat(grown);
            let mut total = L::zero();
            for t in (0..len).step_by(16) {
                let k = (len - t).min(16);
                let e = L::sub(load_upto(sc.add(t), k), gv).exp().first(k);
                total = L::add(total, e);
                let w = match vscales {
                    Some(vs) => L::mul(e, scales16(vs.add(t), k)),
                    None => e,
                };
                store_upto(w, sc.add(t), k);
            }
            sums[g] += fold16(&lanes_of(total));
        }
        // Values of the page: twins' and plain ones into the output, coded
        // ones into the rotated sums.
        let weights = Weights { w: sp, pt, n: len, hd };
        match exact {
            Some(_) => {
                let v = (tv.as_ptr() as *const u8).add((base + first) * 2 * hd);
                weights.add::<L, G, _>(Twin, v, 2 * hd, out.as_mut_ptr(), book);
            }
            None => {
                let into = if vk.coded() { acc.as_mut_ptr() } else { out.as_mut_ptr() };
                weights.add::<L, G, _>(vp, cv.add((base + first) * vb), vb, into, book);
            }
        }
        p = index * pt + last + 1;
    }
    for g in 0..G {
        let o = &mut out[g * hd..(g + 1) * hd];
        if vk.coded() {
            for (e, t) in tmp.iter_mut().enumerate() {
                *t = acc[g * hd + vk.lane(e, hd)];
            }
            crate::tq4::rotate_back(tmp, signs);
            crate::ops::add(o, tmp);
        }
        let inv = 1.0 / sums[g];
        o.iter_mut().for_each(|x| *x *= inv);
    }
}
