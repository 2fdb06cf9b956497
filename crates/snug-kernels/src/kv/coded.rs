//! Attention over lossy pages: keys or values (or both) stored as Q8 or
//! TQ4 codes of the rotated vector, page by page with a running softmax.
//! A page's codes are decoded once (to the levels, unscaled, exact) for
//! every row of a call: a prefill chunk's rows of one sequence go through
//! the pages together and share the decoding.
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
//! This file is one concern (the kernel, its lanes and its entry), which
//! is why it is longer than the others.
//!
//! Scratch is one page of scores per head and one decoded page whatever
//! the context, and a page's codes are used while they are in cache; the
//! next page's codes are asked for at the start of each page, since pages
//! lie anywhere.

use super::{AttnQuery, AttnRow, AttnScratch, Data, KvStorage, KvStore};
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
pub(super) trait Part: Copy {
    fn kind(self) -> Kind;
    /// The part its vectors are read as once a coded page is decoded (in
    /// the part's lane order, unscaled): f32 for a coded kind, itself for
    /// a plain one (whose vectors are read in place).
    type Read: Part;
    fn read(self) -> Self::Read;
}

#[derive(Clone, Copy)]
struct Tq4;
#[derive(Clone, Copy)]
struct Q8;
#[derive(Clone, Copy)]
struct Dyn(Kind);
/// Decoded vectors.
#[derive(Clone, Copy)]
struct F32s;
/// The exact window's twins.
#[derive(Clone, Copy)]
struct Twin;

impl Part for Tq4 {
    type Read = F32s;
    #[inline(always)]
    fn kind(self) -> Kind {
        Kind::Tq4
    }
    #[inline(always)]
    fn read(self) -> F32s {
        F32s
    }
}

impl Part for Q8 {
    type Read = F32s;
    #[inline(always)]
    fn kind(self) -> Kind {
        Kind::Q8
    }
    #[inline(always)]
    fn read(self) -> F32s {
        F32s
    }
}

impl Part for Twin {
    type Read = Twin;
    #[inline(always)]
    fn kind(self) -> Kind {
        Kind::F16
    }
    #[inline(always)]
    fn read(self) -> Twin {
        self
    }
}

impl Part for F32s {
    type Read = F32s;
    #[inline(always)]
    fn kind(self) -> Kind {
        Kind::F32
    }
    #[inline(always)]
    fn read(self) -> F32s {
        self
    }
}

impl Part for Dyn {
    type Read = Dyn;
    #[inline(always)]
    fn kind(self) -> Kind {
        self.0
    }
    #[inline(always)]
    fn read(self) -> Dyn {
        Dyn(if self.0.coded() { Kind::F32 } else { self.0 })
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
    /// [`body`] for this level, compiled as a function of its own (with
    /// the level's CPU features).
    #[inline(always)]
    unsafe fn run<const G: usize, const P: usize, const BLOCK: bool, K: Part, V: Part>(c: &mut Call, kp: K, vp: V)
    where
        Self: Sized,
    {
        run_plain::<Self, G, P, BLOCK, K, V>(c, kp, vp)
    }
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

/// Attention of the query heads of `rows` (one sequence's rows) that share
/// KV head `kv_head`, over a cache with a lossy part, at the level `level`
/// (the same bits at every level, and for a row the same bits whichever
/// rows share the call). Groups of more than 8 heads go 8 at a time: a
/// head's result does not depend on which heads share its pass.
pub(super) fn attend(
    level: crate::cpu::Simd,
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    rows: &mut [AttnRow],
    scale: f32,
    scratch: &mut AttnScratch,
) {
    let hd = kv.shape.head_dim;
    let Some(group) = rows.first().map(|r| r.q.len() / hd) else {
        return;
    };
    for h in (0..group).step_by(8) {
        let g = (group - h).min(8);
        let mut call = Call {
            kv,
            layer,
            kv_head,
            rows: &mut *rows,
            h,
            scale,
            scratch: &mut *scratch,
        };
        match level {
            // SAFETY: the level's features were detected (`simd`).
            #[cfg(target_arch = "x86_64")]
            crate::cpu::Simd::Avx512Vnni => unsafe { by_kinds::<x86::Avx512, true>(&mut call, g) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            crate::cpu::Simd::Avx2 => unsafe { by_kinds::<x86::Avx2, true>(&mut call, g) },
            // SAFETY: the scalar lanes need no CPU feature; the body keeps
            // every pointer inside the cache and the scratch.
            _ => unsafe { by_kinds::<Scalar, false>(&mut call, g) },
        }
    }
}

/// One call's arguments, as the compiled bodies take them: heads `h..h +
/// G` of every row.
pub(super) struct Call<'c, 'r> {
    kv: &'c KvStorage,
    layer: usize,
    kv_head: usize,
    rows: &'c mut [AttnRow<'r>],
    h: usize,
    scale: f32,
    scratch: &'c mut AttnScratch,
}

/// [`body`] compiled as a function of its own (each one is large; the
/// compiler takes far longer over one function holding them all).
#[inline(never)]
unsafe fn run_plain<L: Lanes, const G: usize, const P: usize, const BLOCK: bool, K: Part, V: Part>(
    c: &mut Call,
    kp: K,
    vp: V,
) {
    body::<L, G, P, BLOCK, K, V>(c, kp, vp)
}

/// The body for the storage's pair of kinds and the `g` heads from `h`
/// (and the block of positions its scores take: blocks times heads fill
/// at most 8 registers): TQ4 and Q8 alone compiled for their kinds when
/// `FIXED`, every other pair (and every pair when not) reading kinds at
/// run time.
#[inline(always)]
unsafe fn by_kinds<L: Lanes, const FIXED: bool>(c: &mut Call, g: usize) {
    // One row reads the codes in place; several decode each page once.
    let block = c.rows.len() > 1;
    macro_rules! by_group {
        ($k:expr, $v:expr) => {{
            macro_rules! go {
                ($g:tt, $p:tt) => {
                    if block {
                        L::run::<$g, $p, true, _, _>(c, $k, $v)
                    } else {
                        L::run::<$g, $p, false, _, _>(c, $k, $v)
                    }
                };
            }
            match g {
                1 => go!(1, 4),
                2 => go!(2, 4),
                3 => go!(3, 2),
                4 => go!(4, 2),
                5 => go!(5, 1),
                6 => go!(6, 1),
                7 => go!(7, 1),
                8 => go!(8, 1),
                g => unreachable!("coded attention takes 1 to 8 query heads at once, not {g}"),
            }
        }};
    }
    let (k, v) = (Kind::of(&c.kv.k), Kind::of(&c.kv.v));
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

/// Decodes the vectors of slots `from..to` of a page (slot 0 at `src`,
/// `bytes` apart) to f32 in the part's lane order, unscaled, `hd` apart
/// from `dst` (slot 0). Every lane is the exact value a chunk load gives,
/// so reading the decoded vectors gives the scores and sums the same bits.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn decode<L: Lanes, K: Part>(
    part: K,
    src: *const u8,
    bytes: usize,
    hd: usize,
    from: usize,
    to: usize,
    dst: *mut f32,
    book: L::Book,
) {
    let (kind, chunks) = (part.kind(), hd / 16);
    for t in from..to {
        let (v, d) = (src.add(t * bytes), dst.add(t * hd));
        for c2 in 0..chunks / 2 {
            chunk::<L, false>(kind, v, c2, book).store(d.add(32 * c2));
            chunk::<L, true>(kind, v, c2, book).store(d.add(32 * c2 + 16));
        }
        if chunks % 2 == 1 {
            last_chunk::<L>(kind, v, chunks - 1, book).store(d.add(16 * (chunks - 1)));
        }
    }
}

/// What every row of a call shares: the cache's parts and the scratch that
/// one row's page step uses and leaves.
struct Ctx<'a, B> {
    kv: &'a KvStorage,
    layer: usize,
    kv_head: usize,
    hd: usize,
    pt: usize,
    kk: Kind,
    vk: Kind,
    sk: *const u16,
    sv: *const u16,
    tk: *const u16,
    tv: *const u16,
    signs: &'a [u64],
    book: B,
    offset: Option<(&'a crate::kvbasis::KeyBasis, &'a crate::kvbasis::Trig)>,
    scale: f32,
    tmp: *mut f32,
    scores: *mut f32,
    offsets: *mut f32,
    shifted: *mut f32,
}

/// One row's query heads, output and running state (its slots of the
/// scratch).
struct Row<'a> {
    query: &'a AttnQuery<'a>,
    q: *const f32,
    out: *mut f32,
    qr: *mut f32,
    xy: *mut f32,
    c0: *mut f32,
    acc: *mut f32,
    /// `G` running maxima, then `G` running sums.
    run: *mut f32,
}

impl<B: Copy> Ctx<'_, B> {
    /// The row's queries as the keys are read (divided by the key basis'
    /// weights and rotated, in the keys' lane order), its offset terms,
    /// and empty sums.
    #[inline(always)]
    unsafe fn prepare<L: Lanes<Book = B>, const G: usize>(&self, row: &Row) {
        let (hd, kk) = (self.hd, self.kk);
        let tmp = std::slice::from_raw_parts_mut(self.tmp, hd);
        for g in 0..G {
            let qg = std::slice::from_raw_parts(row.q.add(g * hd), hd);
            let qrg = std::slice::from_raw_parts_mut(row.qr.add(g * hd), hd);
            if kk.coded() {
                tmp.copy_from_slice(qg);
                if let Some((b, trig)) = self.offset {
                    tmp.iter_mut()
                        .zip(b.weight(self.layer, self.kv_head))
                        .for_each(|(x, &w)| *x /= w);
                    let xy = std::slice::from_raw_parts_mut(row.xy.add(g * hd), hd);
                    *row.c0.add(g) = trig.prepare(qg, b.offset(self.layer, self.kv_head), xy);
                }
                crate::tq4::rotate(tmp, self.signs);
                for (e, &x) in tmp.iter().enumerate() {
                    qrg[kk.lane(e, hd)] = x;
                }
            } else {
                qrg.copy_from_slice(qg);
            }
        }
        std::slice::from_raw_parts_mut(row.out, G * hd).fill(0.0);
        std::slice::from_raw_parts_mut(row.acc, G * hd).fill(0.0);
        std::slice::from_raw_parts_mut(row.run, G).fill(f32::NEG_INFINITY);
        std::slice::from_raw_parts_mut(row.run.add(G), G).fill(0.0);
    }

    /// The row's step over page `index` of its sequence: scores, the
    /// running softmax, values. Keys and values the row reads coded come
    /// from `keys` and `values` (slot 0 of the page, vectors `kb` and `vb`
    /// apart, read as `ks` and `vs`: the cache's codes, or the same
    /// vectors decoded); the exact window's from the twins.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn page<L: Lanes<Book = B>, const G: usize, const P: usize, KS: Part, VS: Part>(
        &self,
        row: &Row,
        index: usize,
        ks: KS,
        keys: *const u8,
        kb: usize,
        vs: VS,
        values: *const u8,
        vb: usize,
    ) {
        let (hd, pt, kk, vk) = (self.hd, self.pt, self.kk, self.vk);
        let chunks = hd / 16;
        let query = row.query;
        let first = if index == query.start / pt { query.start % pt } else { 0 };
        let last = (pt - 1).min(query.end - 1 - index * pt);
        let len = last + 1 - first;
        let exact = query.exact(index, pt);
        let base = match exact {
            Some(t) => self.kv.vector(t, self.layer, self.kv_head, 0),
            None => self.kv.vector(query.pages[index], self.layer, self.kv_head, 0),
        };
        let sp = self.scores;
        // Scores of the page, a block of positions at a time.
        let block = Block {
            hd,
            book: self.book,
            scores: sp,
            pt,
        };
        let off = match (exact, self.offset) {
            (None, Some((_, trig))) => {
                shift::<L, G>(trig, row.xy, index, hd, self.shifted);
                let c0 = std::slice::from_raw_parts(row.c0, G);
                page_offsets::<L, G>(trig, self.shifted, hd, c0, first, len, self.offsets);
                Some(self.offsets as *const f32)
            }
            _ => None,
        };
        let mut t = 0;
        macro_rules! blocks {
            ($p:tt) => {
                while len - t >= $p {
                    match exact {
                        Some(_) => {
                            let keys = self.tk.add((base + first + t) * hd) as *const u8;
                            block.score::<L, G, $p, _>(Twin, keys, 2 * hd, row.q, t)
                        }
                        None => block.score::<L, G, $p, _>(ks, keys.add((first + t) * kb), kb, row.qr, t),
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
        let kscales = (exact.is_none() && kk.coded()).then(|| self.sk.add(base + first));
        let vscales = (exact.is_none() && vk.coded()).then(|| self.sv.add(base + first));
        let (maxes, sums) = (row.run, row.run.add(G));
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
                x = L::mul(x, L::splat(self.scale));
                store_upto(x, sc.add(t), k);
                m = L::max(m, x.fill_after(k, f32::NEG_INFINITY));
            }
            let was = *maxes.add(g);
            let grown = lanes_of(m).iter().fold(was, |m, &v| if v > m { v } else { m });
            if grown > was {
                let c = exp_fixed(was - grown);
                *sums.add(g) *= c;
                let cv = L::splat(c);
                for arr in [row.out, row.acc] {
                    for ch in 0..chunks {
                        let ptr = arr.add(g * hd + ch * 16);
                        L::mul(L::load(ptr), cv).store(ptr);
                    }
                }
                *maxes.add(g) = grown;
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
            *sums.add(g) += fold16(&lanes_of(total));
        }
        // Values of the page: twins' and plain ones into the output, coded
        // ones into the rotated sums.
        let weights = Weights { w: sp, pt, n: len, hd };
        match exact {
            Some(_) => {
                let v = self.tv.add((base + first) * hd) as *const u8;
                weights.add::<L, G, _>(Twin, v, 2 * hd, row.out, self.book);
            }
            None => {
                let into = if vk.coded() { row.acc } else { row.out };
                weights.add::<L, G, _>(vs, values.add(first * vb), vb, into, self.book);
            }
        }
    }

    /// The row's output: the rotated sums put back in order, rotated back
    /// and added; then divided by the running sums.
    #[inline(always)]
    unsafe fn finish<const G: usize>(&self, row: &Row) {
        let (hd, vk) = (self.hd, self.vk);
        let tmp = std::slice::from_raw_parts_mut(self.tmp, hd);
        for g in 0..G {
            let o = std::slice::from_raw_parts_mut(row.out.add(g * hd), hd);
            if vk.coded() {
                for (e, t) in tmp.iter_mut().enumerate() {
                    *t = *row.acc.add(g * hd + vk.lane(e, hd));
                }
                crate::tq4::rotate_back(tmp, self.signs);
                crate::ops::add(o, tmp);
            }
            let inv = 1.0 / *row.run.add(G + g);
            o.iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// The kernel over heads `h..h + G` of every row of `rows` (see the
/// module's documentation for its arithmetic). One row (not `BLOCK`)
/// reads the pages' codes in place. Several rows (of one sequence) go
/// through the pages together: the vectors of a page that any of them
/// reads coded are decoded once (exact values, so a row's arithmetic is
/// the same with any company), and each row takes its step over the
/// decoded page.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn body<L: Lanes, const G: usize, const P: usize, const BLOCK: bool, K: Part, V: Part>(
    c: &mut Call,
    kp: K,
    vp: V,
) {
    let Call {
        kv,
        layer,
        kv_head,
        ref mut rows,
        h,
        scale,
        ref mut scratch,
    } = *c;
    let (kk, vk) = (kp.kind(), vp.kind());
    let hd = kv.shape.head_dim;
    let pt = kv.shape.page_tokens;
    let ((ck, sk), (cv, sv)) = (raw(&kv.k), raw(&kv.v));
    let (kb, vb) = (kk.vector_bytes(hd), vk.vector_bytes(hd));
    let (tk, tv): (&[u16], &[u16]) = match (&kv.twin_k, &kv.twin_v) {
        (Data::F16(a), Data::F16(b)) => (a, b),
        _ => (&[], &[]),
    };
    let book = if kk == Kind::Tq4 || vk == Kind::Tq4 {
        L::book(crate::tq4::codebook(hd))
    } else {
        L::book(&[0.0; 16])
    };
    let n = rows.len();
    assert!(n <= scratch.rows, "{n} rows at once, scratch for {}", scratch.rows);
    let AttnScratch {
        scores,
        kv: tmp,
        rotated,
        acc,
        xy,
        shifted,
        c0,
        run,
        offsets,
        decoded,
        ..
    } = scratch;
    assert!(scores.len() >= G * pt && offsets.len() >= G * pt && tmp.len() >= hd && shifted.len() >= G * hd);
    assert!(rotated.len() >= n * G * hd && acc.len() >= n * G * hd && xy.len() >= n * G * hd);
    assert!(run.len() >= 2 * n * G && c0.len() >= n * G);
    assert!(!BLOCK || decoded.len() >= 2 * pt * hd);
    for r in rows.iter() {
        assert!(r.q.len() >= (h + G) * hd && r.out.len() == r.q.len());
        assert!(std::ptr::eq(r.query.pages, rows[0].query.pages));
    }
    let ctx = Ctx {
        kv,
        layer,
        kv_head,
        hd,
        pt,
        kk,
        vk,
        sk: sk.as_ptr(),
        sv: sv.as_ptr(),
        tk: tk.as_ptr(),
        tv: tv.as_ptr(),
        signs: kv.signs_of(layer, kv_head),
        book,
        // The key basis applies to TQ4 keys only (see `with_key_basis`).
        offset: match (&kv.basis, kk) {
            (Some((b, t)), Kind::Tq4) => Some((&**b, t.trig(layer))),
            _ => None,
        },
        scale,
        tmp: tmp.as_mut_ptr(),
        scores: scores.as_mut_ptr(),
        offsets: offsets.as_mut_ptr(),
        shifted: shifted.as_mut_ptr(),
    };
    let (qr, ac, xyp, c0p, rp_run) = (
        rotated.as_mut_ptr(),
        acc.as_mut_ptr(),
        xy.as_mut_ptr(),
        c0.as_mut_ptr(),
        run.as_mut_ptr(),
    );
    let rp = rows.as_mut_ptr();
    // Row `r`'s slots (rows are not moved or otherwise borrowed meanwhile).
    let at = |r: usize| {
        let row = &mut *rp.add(r);
        Row {
            query: &*(&row.query as *const AttnQuery),
            q: row.q.as_ptr().add(h * hd),
            out: row.out.as_mut_ptr().add(h * hd),
            qr: qr.add(r * G * hd),
            xy: xyp.add(r * G * hd),
            c0: c0p.add(r * G),
            acc: ac.add(r * G * hd),
            run: rp_run.add(2 * r * G),
        }
    };
    for r in 0..n {
        ctx.prepare::<L, G>(&at(r));
    }
    let pages = at(0).query.pages;
    let page_of = |index: usize| kv.vector(pages[index], layer, kv_head, 0);
    if !BLOCK {
        // One row: the codes read in place.
        assert!(n == 1);
        let row = at(0);
        let query = row.query;
        let mut index = query.start / pt;
        while index * pt < query.end {
            // The next page's codes, while this one is worked on.
            let next = (index + 1) * pt;
            if next < query.end && query.exact(index + 1, pt).is_none() {
                let nb = page_of(index + 1);
                let n = pt.min(query.end - next);
                prefetch_run::<L>(ck.add(nb * kb), n * kb);
                prefetch_run::<L>(cv.add(nb * vb), n * vb);
            }
            let base = page_of(index);
            ctx.page::<L, G, P, _, _>(&row, index, kp, ck.add(base * kb), kb, vp, cv.add(base * vb), vb);
            index += 1;
        }
        ctx.finish::<G>(&row);
        return;
    }
    let (lo, hi) = (0..n).fold((usize::MAX, 0), |(lo, hi), r| {
        let q = at(r).query;
        (lo.min(q.start), hi.max(q.end))
    });
    let (dk, dv) = decoded.split_at_mut(pt * hd);
    let (dk, dv) = (dk.as_mut_ptr(), dv.as_mut_ptr());
    let mut index = lo / pt;
    while index * pt < hi {
        let (p0, p1) = (index * pt, (index + 1) * pt);
        let covers = |q: &AttnQuery| q.start < p1 && q.end > p0;
        // The slots that some row reads coded.
        let (a, b) = (0..n)
            .map(|r| at(r).query)
            .filter(|q| covers(q) && q.exact(index, pt).is_none())
            .fold((pt, 0), |(a, b), q| {
                (a.min(q.start.max(p0) - p0), b.max(q.end.min(p1) - p0))
            });
        let base = page_of(index);
        if a < b {
            // The next page's codes, while this one is worked on.
            if p1 < hi {
                let nb = page_of(index + 1);
                let n = pt.min(hi - p1);
                prefetch_run::<L>(ck.add(nb * kb), n * kb);
                prefetch_run::<L>(cv.add(nb * vb), n * vb);
            }
            if kk.coded() {
                decode::<L, _>(kp, ck.add(base * kb), kb, hd, a, b, dk, book);
            }
            if vk.coded() {
                decode::<L, _>(vp, cv.add(base * vb), vb, hd, a, b, dv, book);
            }
        }
        let (keys, kbytes) = match kk.coded() {
            true => (dk as *const u8, 4 * hd),
            false => (ck.add(base * kb), kb),
        };
        let (values, vbytes) = match vk.coded() {
            true => (dv as *const u8, 4 * hd),
            false => (cv.add(base * vb), vb),
        };
        for r in 0..n {
            let row = at(r);
            if covers(row.query) {
                ctx.page::<L, G, P, _, _>(&row, index, kp.read(), keys, kbytes, vp.read(), values, vbytes);
            }
        }
        index += 1;
    }
    for r in 0..n {
        ctx.finish::<G>(&at(r));
    }
}
