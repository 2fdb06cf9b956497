//! KV page storage and attention that reads it through page lists.
//!
//! Storage is one allocation of `n_pages` pages; a page holds keys and
//! values of `page_tokens` consecutive positions for every layer:
//!
//! ```text
//! page p: [layer 0: K [kv_head][slot][head_dim] | V [kv_head][slot][head_dim]] [layer 1 ...] ...
//! ```
//!
//! so copying a page (copy-on-write after a fork) is one contiguous copy,
//! and attention for one KV head scans one contiguous run per page. Which
//! page holds which position is the caller's business (`snug-core` page
//! tables); attention receives the page list of each sequence.
//!
//! **Exact window.** With a lossy format (Q8 or TQ4) the engine also keeps
//! *twin* pages: F16 copies of a sequence's first page and of its newest
//! pages, written beside the coded form. A query at position `p` reads its
//! sequence's page 0 and its own page (the one holding `p`) from their
//! twins, every other page coded. Attention in small models leans on
//! exactly those tokens (the first token takes 20–70% of many heads'
//! attention, and recent tokens much of the rest), so keeping them exact
//! cuts the error coding adds to attention severalfold, for a fixed number
//! of pages per sequence. Which pages are read exact depends on the query's
//! position alone, so results stay batch-invariant; and an own page's twin
//! can always be rebuilt bit for bit by recomputing its positions, which
//! read nothing exact but page 0 and that page.

mod attend;
mod coded;
mod store;

use attend::softmax_row;
pub use attend::{attend_group, attend_group_generic, attend_group_ggml, attend_rows, AttnQuery, AttnRow, AttnScratch};
pub use store::KvStore;

use crate::kvbasis::{KeyBasis, OffsetTables};

/// How keys and values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvFormat {
    F32,
    F16,
    /// Per vector: the vector rotated as TQ4 rotates it (spreading outlier
    /// coordinates), then one f16 scale (`max |x| / 127`) and an int8 per
    /// element.
    Q8,
    /// Per vector: an f16 scale and 4-bit codes of the rotated vector
    /// (see [`crate::tq4`]).
    Tq4,
}

impl KvFormat {
    /// Bytes of one stored vector of `head_dim` elements.
    pub fn vector_bytes(self, head_dim: usize) -> usize {
        match self {
            KvFormat::F32 => 4 * head_dim,
            KvFormat::F16 => 2 * head_dim,
            KvFormat::Q8 => head_dim + 2,
            KvFormat::Tq4 => crate::tq4::vector_bytes(head_dim),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::F16 => "f16",
            KvFormat::Q8 => "q8",
            KvFormat::Tq4 => "tq4",
        }
    }

    /// The format named `name` (as [`KvFormat::name`] spells it).
    pub fn parse(name: &str) -> Option<KvFormat> {
        [KvFormat::F32, KvFormat::F16, KvFormat::Q8, KvFormat::Tq4]
            .into_iter()
            .find(|f| f.name() == name)
    }

    /// Whether vectors of `head_dim` elements can be stored in this format.
    pub fn supports_head_dim(self, head_dim: usize) -> bool {
        match self {
            KvFormat::Tq4 | KvFormat::Q8 => crate::tq4::supports_dim(head_dim) && head_dim <= ROTATED_MAX_DIM,
            _ => head_dim > 0,
        }
    }
}

/// Largest head size Q8 and TQ4 pages take (their encoders' scratch is on
/// the stack).
const ROTATED_MAX_DIM: usize = 1024;

/// Marks a page without a twin in [`AttnQuery::twins`].
pub use snug_core::twins::NO_TWIN;

/// The random-sign rotation's signs for every (layer, KV head).
fn rotation_signs(shape: &KvShape) -> Vec<Vec<u64>> {
    (0..shape.layers * shape.kv_heads)
        .map(|i| crate::tq4::signs(i / shape.kv_heads, i % shape.kv_heads, shape.head_dim))
        .collect()
}

/// One of the two arrays (keys, or values): vector `i` of the array is
/// (page, layer, KV head, slot) in that order, `i = ((page * layers +
/// layer) * kv_heads + head) * page_tokens + slot`.
enum Data {
    F32(Vec<f32>),
    F16(Vec<u16>),
    /// Codes of the rotated vector (`head_dim` per vector) and f16 scales
    /// (one per vector).
    Q8 {
        codes: Vec<i8>,
        scales: Vec<u16>,
    },
    /// 4-bit codes (`head_dim / 2` bytes per vector) and f16 scales.
    Tq4 {
        codes: Vec<u8>,
        scales: Vec<u16>,
    },
}

impl Data {
    fn new(format: KvFormat, vectors: usize, hd: usize) -> Data {
        let n = vectors * hd;
        match format {
            KvFormat::F32 => Data::F32(crate::vec::committed(0.0, n)),
            KvFormat::F16 => Data::F16(crate::vec::committed(0, n)),
            KvFormat::Q8 => Data::Q8 {
                codes: crate::vec::committed(0, n),
                scales: crate::vec::committed(0, vectors),
            },
            KvFormat::Tq4 => Data::Tq4 {
                codes: crate::vec::committed(0, n / 2),
                scales: crate::vec::committed(0, vectors),
            },
        }
    }

    /// Where this array's elements (or codes) and scales are, for writes
    /// of distinct vectors from several threads at once ([`Raw::put`]).
    fn raw(&mut self) -> Raw {
        fn r<T>(v: &mut [T]) -> (*mut T, usize) {
            (v.as_mut_ptr(), v.len())
        }
        match self {
            Data::F32(d) => Raw::F32(r(d)),
            Data::F16(d) => Raw::F16(r(d)),
            Data::Q8 { codes, scales } => Raw::Q8(r(codes), r(scales)),
            Data::Tq4 { codes, scales } => Raw::Tq4(r(codes), r(scales)),
        }
    }
}

/// A [`Data`]'s arrays as pointers and lengths (elements or codes, then
/// scales), taken through `&mut` and written only where no other thread
/// reads or writes.
#[derive(Clone, Copy)]
enum Raw {
    F32((*mut f32, usize)),
    F16((*mut u16, usize)),
    Q8((*mut i8, usize), (*mut u16, usize)),
    Tq4((*mut u8, usize), (*mut u16, usize)),
}

// SAFETY: the pointers are only written through by `Raw::put`, whose
// callers give each thread vectors of its own.
unsafe impl Send for Raw {}
// SAFETY: as above.
unsafe impl Sync for Raw {}

/// `len` elements of `(p, n)` from `at`, bounds checked.
///
/// # Safety
/// No other slice over those elements may be in use while this one is.
unsafe fn raw_slice<'a, T>((p, n): (*mut T, usize), at: usize, len: usize) -> &'a mut [T] {
    assert!(at + len <= n, "vector out of its array");
    // SAFETY: in bounds (checked); exclusive as the caller promises.
    unsafe { std::slice::from_raw_parts_mut(p.add(at), len) }
}

impl Raw {
    /// Stores `x` as vector `i` (`signs`: the rotation of its layer and
    /// head, for the rotated formats).
    ///
    /// # Safety
    /// `self` must come from [`Data::raw`] of an array still alive and not
    /// reallocated, and no other thread may read or write vector `i` while
    /// this runs.
    unsafe fn put(self, i: usize, x: &[f32], signs: &[u64]) {
        let hd = x.len();
        let o = i * hd;
        // SAFETY (every arm): vector `i` is this call's alone, as promised.
        match self {
            Raw::F32(d) => unsafe { raw_slice(d, o, hd) }.copy_from_slice(x),
            Raw::F16(d) => crate::vec::f32_to_f16(x, unsafe { raw_slice(d, o, hd) }),
            Raw::Q8(codes, scales) => {
                let mut work = [0f32; ROTATED_MAX_DIM];
                let w = &mut work[..hd];
                w.copy_from_slice(x);
                crate::tq4::rotate(w, signs);
                let sc = q8_encode(w, unsafe { raw_slice(codes, o, hd) });
                let scale = unsafe { raw_slice(scales, i, 1) };
                scale[0] = sc;
            }
            Raw::Tq4(codes, scales) => {
                let mut work = [0f32; ROTATED_MAX_DIM];
                let sc = crate::tq4::encode(x, signs, unsafe { raw_slice(codes, o / 2, hd / 2) }, &mut work[..hd]);
                let scale = unsafe { raw_slice(scales, i, 1) };
                scale[0] = half::f16::from_f32(sc).to_bits();
            }
        }
    }
}

impl Data {
    /// Copies vectors `from..from + n` to `to..`.
    fn copy(&mut self, from: usize, to: usize, n: usize, hd: usize) {
        let (f, t, e) = (from * hd, to * hd, n * hd);
        match self {
            Data::F32(d) => d.copy_within(f..f + e, t),
            Data::F16(d) => d.copy_within(f..f + e, t),
            Data::Q8 { codes, scales } => {
                codes.copy_within(f..f + e, t);
                scales.copy_within(from..from + n, to);
            }
            Data::Tq4 { codes, scales } => {
                codes.copy_within(f / 2..(f + e) / 2, t / 2);
                scales.copy_within(from..from + n, to);
            }
        }
    }

    /// Bytes per vector of each part: elements (or codes), then scales
    /// (0 for the unscaled formats).
    fn part_widths(&self, hd: usize) -> [usize; 2] {
        match self {
            Data::F32(_) => [4 * hd, 0],
            Data::F16(_) => [2 * hd, 0],
            Data::Q8 { .. } => [hd, 2],
            Data::Tq4 { .. } => [hd / 2, 2],
        }
    }

    /// The parts' bytes, as in memory (little-endian on every target).
    fn part_bytes(&self) -> [&[u8]; 2] {
        fn b<T: Copy>(v: &[T]) -> &[u8] {
            // SAFETY: plain numbers, any bit pattern is a valid u8.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        }
        match self {
            Data::F32(d) => [b(d), &[]],
            Data::F16(d) => [b(d), &[]],
            Data::Q8 { codes, scales } => [b(codes), b(scales)],
            Data::Tq4 { codes, scales } => [codes, b(scales)],
        }
    }

    /// [`Data::part_bytes`], to write.
    fn part_bytes_mut(&mut self) -> [&mut [u8]; 2] {
        fn b<T: Copy>(v: &mut [T]) -> &mut [u8] {
            // SAFETY: plain numbers: every byte pattern written is a valid
            // value of the element type.
            unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
        }
        match self {
            Data::F32(d) => [b(d), &mut []],
            Data::F16(d) => [b(d), &mut []],
            Data::Q8 { codes, scales } => [b(codes), b(scales)],
            Data::Tq4 { codes, scales } => [codes, b(scales)],
        }
    }

    /// Vector `i` as stored: for Q8 and TQ4 still in the rotated domain.
    fn get_rotated(&self, i: usize, out: &mut [f32]) {
        let hd = out.len();
        let o = i * hd;
        match self {
            Data::F32(d) => out.copy_from_slice(&d[o..o + hd]),
            Data::F16(d) => crate::vec::f16_to_f32(&d[o..o + hd], out),
            Data::Q8 { codes, scales } => {
                let s = half::f16::from_bits(scales[i]).to_f32();
                for (y, &c) in out.iter_mut().zip(&codes[o..o + hd]) {
                    *y = c as f32 * s;
                }
            }
            Data::Tq4 { codes, scales } => {
                let s = half::f16::from_bits(scales[i]).to_f32();
                crate::tq4::decode_rotated(&codes[o / 2..(o + hd) / 2], s, out);
            }
        }
    }
}

/// Shape of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub page_tokens: usize,
}

impl KvShape {
    /// Elements of one page.
    pub fn page_elems(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.page_tokens * self.head_dim
    }

    /// Key and value vectors of one page.
    pub fn page_vectors(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.page_tokens
    }

    /// Bytes a page takes with keys and values in `format`.
    pub fn page_bytes(&self, format: KvFormat) -> usize {
        self.page_vectors() * format.vector_bytes(self.head_dim)
    }
}

/// Where one position's keys and values go.
#[derive(Clone, Copy, Debug)]
pub struct KvSlot {
    pub page: u32,
    pub slot: usize,
    /// The position in its sequence (TQ4 keys are coded relative to the
    /// offset rotated to it).
    pub pos: usize,
    /// The page's twin, which gets an F16 copy.
    pub twin: Option<u32>,
}

/// The KV pages in host memory (the CPU backends' [`KvStore`]).
pub struct KvStorage {
    pub shape: KvShape,
    /// Format of the keys.
    pub format: KvFormat,
    /// Format of the values.
    pub format_v: KvFormat,
    n_pages: usize,
    k: Data,
    v: Data,
    /// The rotation's signs per (layer, KV head), for Q8 and TQ4.
    signs: Vec<Vec<u64>>,
    /// F16 twin pages (same layout as pages).
    n_twins: usize,
    twin_k: Data,
    twin_v: Data,
    /// The key basis of TQ4 keys and its scoring tables.
    basis: Option<(std::sync::Arc<KeyBasis>, OffsetTables)>,
}

impl KvStorage {
    /// Storage with keys and values in one format.
    pub fn new(shape: KvShape, format: KvFormat, n_pages: usize) -> KvStorage {
        KvStorage::with_formats(shape, format, format, n_pages)
    }

    /// Storage with keys in `format_k` and values in `format_v`.
    pub fn with_formats(shape: KvShape, format_k: KvFormat, format_v: KvFormat, n_pages: usize) -> KvStorage {
        for f in [format_k, format_v] {
            assert!(
                f.supports_head_dim(shape.head_dim),
                "KV format {} cannot store head size {}",
                f.name(),
                shape.head_dim
            );
        }
        let half = shape.page_vectors() / 2 * n_pages;
        let rotated = |f| matches!(f, KvFormat::Q8 | KvFormat::Tq4);
        KvStorage {
            shape,
            format: format_k,
            format_v,
            n_pages,
            k: Data::new(format_k, half, shape.head_dim),
            v: Data::new(format_v, half, shape.head_dim),
            signs: if rotated(format_k) || rotated(format_v) {
                rotation_signs(&shape)
            } else {
                Vec::new()
            },
            n_twins: 0,
            twin_k: Data::F16(Vec::new()),
            twin_v: Data::F16(Vec::new()),
            basis: None,
        }
    }

    /// Adds `n` F16 twin pages.
    pub fn with_twins(mut self, n: usize) -> KvStorage {
        let half = self.shape.page_vectors() / 2 * n;
        self.n_twins = n;
        self.twin_k = Data::new(KvFormat::F16, half, self.shape.head_dim);
        self.twin_v = Data::new(KvFormat::F16, half, self.shape.head_dim);
        self
    }

    /// Codes TQ4 keys relative to `basis` (ignored for other key formats).
    pub fn with_key_basis(mut self, basis: std::sync::Arc<KeyBasis>) -> KvStorage {
        let s = &self.shape;
        assert!(
            basis.layers == s.layers && basis.kv_heads == s.kv_heads && basis.head_dim == s.head_dim,
            "key basis shape differs from the cache's"
        );
        if self.format == KvFormat::Tq4 {
            let tables = OffsetTables::new(&basis, s.page_tokens, self.n_pages);
            self.basis = Some((basis, tables));
        }
        self
    }

    pub fn n_twins(&self) -> usize {
        self.n_twins
    }

    /// Index of (page, layer, KV head, slot) in the key or the value array.
    #[inline]
    fn vector(&self, page: u32, layer: usize, head: usize, slot: usize) -> usize {
        let s = &self.shape;
        ((page as usize * s.layers + layer) * s.kv_heads + head) * s.page_tokens + slot
    }

    /// Element offset of (page, layer, K or V, kv head, slot) in its array.
    #[inline]
    fn offset(&self, page: u32, layer: usize, _is_v: bool, head: usize, slot: usize) -> usize {
        self.vector(page, layer, head, slot) * self.shape.head_dim
    }

    fn signs_of(&self, layer: usize, head: usize) -> &[u64] {
        self.signs.get(layer * self.shape.kv_heads + head).map_or(&[], |v| v)
    }

    /// Stores one position's keys and values (`kv_heads * head_dim` each),
    /// and their F16 copy in the page's twin if it has one.
    pub fn write(&mut self, layer: usize, at: KvSlot, k: &[f32], v: &[f32]) {
        let raw = self.raws();
        // SAFETY: `&mut self`: no one else reads or writes the arrays.
        unsafe { self.write_raw(&raw, layer, at, k, v) }
    }

    /// [`KvStorage::write`] for a batch's rows, row `r` at `at[r]` from
    /// `k` and `v` (`kv_heads * head_dim` floats a row), spread over `pool`
    /// where there are enough rows to pay for it. Each vector is coded
    /// alone, so the result is the same as writing the rows one by one; rows
    /// that share a slot are written one by one, in order, so the last
    /// wins as it would.
    pub fn write_rows(&mut self, layer: usize, at: &[KvSlot], k: &[f32], v: &[f32], pool: &crate::pool::ThreadPool) {
        let kvd = self.shape.kv_heads * self.shape.head_dim;
        let n = at.len();
        let row = |r: usize| (&k[r * kvd..(r + 1) * kvd], &v[r * kvd..(r + 1) * kvd]);
        let distinct = || {
            let pt = self.shape.page_tokens as u64;
            let mut seen: Vec<u64> = at.iter().map(|a| a.page as u64 * pt + a.slot as u64).collect();
            seen.extend(
                at.iter()
                    .filter_map(|a| a.twin.map(|t| (1 << 63) | (t as u64 * pt + a.slot as u64))),
            );
            seen.sort_unstable();
            seen.windows(2).all(|w| w[0] != w[1])
        };
        if n < 16 || pool.threads() == 1 || !distinct() {
            for (r, &a) in at.iter().enumerate() {
                let (k, v) = row(r);
                self.write(layer, a, k, v);
            }
            return;
        }
        let raw = self.raws();
        let this = &*self;
        let tasks = n.min(4 * pool.threads());
        pool.run(tasks, &|t| {
            let rows = t * n / tasks..(t + 1) * n / tasks;
            for (r, &a) in rows.clone().zip(&at[rows]) {
                let (k, v) = row(r);
                // SAFETY: every row's slots (and its twin's) are its own
                // (checked above), and tasks take disjoint rows.
                unsafe { this.write_raw(&raw, layer, a, k, v) }
            }
        });
    }

    /// Pointers into the keys, values and their twins, for
    /// [`KvStorage::write_raw`].
    fn raws(&mut self) -> [Raw; 4] {
        [self.k.raw(), self.v.raw(), self.twin_k.raw(), self.twin_v.raw()]
    }

    /// [`KvStorage::write`] through `raw` (from [`KvStorage::raws`]).
    ///
    /// # Safety
    /// No other thread may read or write `at`'s vectors (nor its twin's)
    /// while this runs, and the arrays must not have changed since `raw`
    /// was taken.
    unsafe fn write_raw(&self, raw: &[Raw; 4], layer: usize, at: KvSlot, k: &[f32], v: &[f32]) {
        let hd = self.shape.head_dim;
        let mut coded = [0f32; ROTATED_MAX_DIM];
        let [rk, rv, tk, tv] = *raw;
        for h in 0..self.shape.kv_heads {
            let i = self.vector(at.page, layer, h, at.slot);
            let signs = self.signs.get(layer * self.shape.kv_heads + h).map_or(&[][..], |v| v);
            let (kh, vh) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            // SAFETY (each put): vector `i` of the page, and `j` of its
            // twin, are this call's alone, as the caller promises.
            match &self.basis {
                Some((b, _)) => {
                    let x = &mut coded[..hd];
                    b.to_coded(layer, h, at.pos, kh, x);
                    unsafe { rk.put(i, x, signs) };
                }
                None => unsafe { rk.put(i, kh, signs) },
            }
            unsafe { rv.put(i, vh, signs) };
            if let Some(t) = at.twin {
                let j = self.vector(t, layer, h, at.slot);
                unsafe { tk.put(j, kh, &[]) };
                unsafe { tv.put(j, vh, &[]) };
            }
        }
    }

    /// Byte ranges holding the first `slots` positions of `page` (a twin
    /// when `twin`): for keys then values, each part (elements or codes,
    /// then scales), one range per (layer, KV head), or one per part when
    /// the page is whole. Calls `f(array, part, range)`.
    fn page_ranges(
        &self,
        page: u32,
        slots: usize,
        twin: bool,
        mut f: impl FnMut(usize, usize, std::ops::Range<usize>),
    ) {
        let s = &self.shape;
        let slots = slots.min(s.page_tokens);
        let hd = s.head_dim;
        let arrays = if twin {
            [&self.twin_k, &self.twin_v]
        } else {
            [&self.k, &self.v]
        };
        for (a, data) in arrays.into_iter().enumerate() {
            for (part, &w) in data.part_widths(hd).iter().enumerate() {
                if w == 0 || slots == 0 {
                    continue;
                }
                if slots == s.page_tokens {
                    let first = self.vector(page, 0, 0, 0) * w;
                    f(a, part, first..first + s.page_vectors() / 2 * w);
                    continue;
                }
                for l in 0..s.layers {
                    for h in 0..s.kv_heads {
                        let first = self.vector(page, l, h, 0) * w;
                        f(a, part, first..first + slots * w);
                    }
                }
            }
        }
    }

    fn data(&self, is_v: bool) -> &Data {
        if is_v {
            &self.v
        } else {
            &self.k
        }
    }

    fn format_of(&self, is_v: bool) -> KvFormat {
        if is_v {
            self.format_v
        } else {
            self.format
        }
    }

    /// Key or value vector at (page, layer, head, slot), decoded to f32
    /// into `out` (`pos`: its position, which the key basis needs).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn read(&self, page: u32, layer: usize, is_v: bool, head: usize, slot: usize, pos: usize, out: &mut [f32]) {
        self.read_rotated(page, layer, is_v, head, slot, out);
        if matches!(self.format_of(is_v), KvFormat::Q8 | KvFormat::Tq4) {
            crate::tq4::rotate_back(out, self.signs_of(layer, head));
        }
        if let (false, Some((b, _))) = (is_v, &self.basis) {
            let mut work = [0f32; ROTATED_MAX_DIM];
            b.from_coded(layer, head, pos, out, &mut work[..out.len()]);
        }
    }

    /// The twin's copy of the vector at (twin, layer, head, slot).
    #[inline]
    fn read_twin(&self, twin: u32, layer: usize, is_v: bool, head: usize, slot: usize, out: &mut [f32]) {
        let i = self.vector(twin, layer, head, slot);
        if is_v { &self.twin_v } else { &self.twin_k }.get_rotated(i, out);
    }

    /// The vector at (page, layer, head, slot) as stored: for Q8 and TQ4 in
    /// the rotated domain (`scale * codes` or `scale * levels`), not
    /// rotated back.
    #[inline]
    fn read_rotated(&self, page: u32, layer: usize, is_v: bool, head: usize, slot: usize, out: &mut [f32]) {
        let i = self.vector(page, layer, head, slot);
        self.data(is_v).get_rotated(i, out);
    }
}

impl KvStore for KvStorage {
    fn shape(&self) -> KvShape {
        self.shape
    }

    fn formats(&self) -> (KvFormat, KvFormat) {
        (self.format, self.format_v)
    }

    fn n_pages(&self) -> usize {
        self.n_pages
    }

    fn page_bytes(&self) -> usize {
        let half = self.shape.page_vectors() / 2;
        half * (self.format.vector_bytes(self.shape.head_dim) + self.format_v.vector_bytes(self.shape.head_dim))
    }

    fn exact_window_bytes(&self) -> usize {
        self.n_twins * self.twin_page_bytes() + self.basis.as_ref().map_or(0, |(b, t)| b.bytes() + t.bytes())
    }

    fn copy_page(&mut self, from: u32, to: u32) {
        let n = self.shape.page_vectors() / 2;
        let hd = self.shape.head_dim;
        self.k.copy(from as usize * n, to as usize * n, n, hd);
        self.v.copy(from as usize * n, to as usize * n, n, hd);
    }

    fn copy_twin(&mut self, from: u32, to: u32) {
        let n = self.shape.page_vectors() / 2;
        let hd = self.shape.head_dim;
        self.twin_k.copy(from as usize * n, to as usize * n, n, hd);
        self.twin_v.copy(from as usize * n, to as usize * n, n, hd);
    }

    fn stored_bytes(&self, slots: usize, twin: bool) -> usize {
        let mut n = 0;
        self.page_ranges(0, slots, twin, |_, _, r| n += r.len());
        n
    }

    /// Nothing is copied: the runs are the stored bytes.
    fn export_page<E>(
        &self,
        page: u32,
        slots: usize,
        twin: bool,
        mut f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let arrays = if twin {
            [&self.twin_k, &self.twin_v]
        } else {
            [&self.k, &self.v]
        };
        let parts = arrays.map(Data::part_bytes);
        let mut result = Ok(());
        self.page_ranges(page, slots, twin, |a, part, r| {
            if result.is_ok() {
                result = f(&parts[a][part][r]);
            }
        });
        result
    }

    fn import_page<E>(
        &mut self,
        page: u32,
        slots: usize,
        twin: bool,
        mut f: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut ranges = Vec::new();
        self.page_ranges(page, slots, twin, |a, part, r| ranges.push((a, part, r)));
        let (k, v) = if twin {
            (&mut self.twin_k, &mut self.twin_v)
        } else {
            (&mut self.k, &mut self.v)
        };
        let parts = [k.part_bytes_mut(), v.part_bytes_mut()];
        for (a, part, r) in ranges {
            f(&mut parts[a][part][r])?;
        }
        Ok(())
    }

    fn rotation_signs(&self) -> &[Vec<u64>] {
        &self.signs
    }

    fn key_basis(&self) -> Option<&KeyBasis> {
        self.basis.as_ref().map(|(b, _)| &**b)
    }
}

/// Quantizes `x` to int8 codes with one scale, `max |x| / 127` rounded to
/// f16 (the stored scale is the one quantized with); returns its bits.
fn q8_encode(x: &[f32], codes: &mut [i8]) -> u16 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s16 = half::f16::from_f32(amax / 127.0);
    let s = s16.to_f32();
    if s == 0.0 || !s.is_finite() {
        codes.fill(0);
        return if s.is_finite() { s16.to_bits() } else { 0 };
    }
    let inv = 1.0 / s;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    s16.to_bits()
}

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_f16_512;

#[cfg(test)]
mod tests;
