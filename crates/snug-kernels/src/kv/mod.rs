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

mod coded;

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
pub const NO_TWIN: u32 = u32::MAX;

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

    /// Stores `x` as vector `i` (`signs`: the rotation of its layer and
    /// head, for the rotated formats).
    fn put(&mut self, i: usize, x: &[f32], signs: &[u64]) {
        let hd = x.len();
        let o = i * hd;
        match self {
            Data::F32(d) => d[o..o + hd].copy_from_slice(x),
            Data::F16(d) => crate::vec::f32_to_f16(x, &mut d[o..o + hd]),
            Data::Q8 { codes, scales } => {
                let mut work = [0f32; ROTATED_MAX_DIM];
                let w = &mut work[..hd];
                w.copy_from_slice(x);
                crate::tq4::rotate(w, signs);
                scales[i] = q8_encode(w, &mut codes[o..o + hd]);
            }
            Data::Tq4 { codes, scales } => {
                let mut work = [0f32; ROTATED_MAX_DIM];
                let sc = crate::tq4::encode(x, signs, &mut codes[o / 2..(o + hd) / 2], &mut work[..hd]);
                scales[i] = half::f16::from_f32(sc).to_bits();
            }
        }
    }

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

/// The KV pages.
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

    /// Whether either part is stored lossily (Q8 or TQ4): then the engine
    /// keeps an exact window in twin pages.
    pub fn is_lossy(&self) -> bool {
        [self.format, self.format_v]
            .iter()
            .any(|f| matches!(f, KvFormat::Q8 | KvFormat::Tq4))
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

    /// The key basis TQ4 keys are coded in, if any.
    pub fn key_basis(&self) -> Option<&KeyBasis> {
        self.basis.as_ref().map(|(b, _)| &**b)
    }

    pub fn n_twins(&self) -> usize {
        self.n_twins
    }

    /// Bytes of one twin page.
    pub fn twin_page_bytes(&self) -> usize {
        self.shape.page_bytes(KvFormat::F16)
    }

    /// Bytes of the twins, the key basis and its tables.
    pub fn exact_window_bytes(&self) -> usize {
        self.n_twins * self.twin_page_bytes() + self.basis.as_ref().map_or(0, |(b, t)| b.bytes() + t.bytes())
    }

    /// Copies twin `from` over twin `to`.
    pub fn copy_twin(&mut self, from: u32, to: u32) {
        let n = self.shape.page_vectors() / 2;
        let hd = self.shape.head_dim;
        self.twin_k.copy(from as usize * n, to as usize * n, n, hd);
        self.twin_v.copy(from as usize * n, to as usize * n, n, hd);
    }

    pub fn n_pages(&self) -> usize {
        self.n_pages
    }

    /// Bytes of one page (keys and values of every layer).
    pub fn page_bytes(&self) -> usize {
        let half = self.shape.page_vectors() / 2;
        half * (self.format.vector_bytes(self.shape.head_dim) + self.format_v.vector_bytes(self.shape.head_dim))
    }

    pub fn bytes(&self) -> usize {
        self.page_bytes() * self.n_pages
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
        let hd = self.shape.head_dim;
        let mut coded = [0f32; ROTATED_MAX_DIM];
        for h in 0..self.shape.kv_heads {
            let i = self.vector(at.page, layer, h, at.slot);
            let signs = self.signs.get(layer * self.shape.kv_heads + h).map_or(&[][..], |v| v);
            let (kh, vh) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            match &self.basis {
                Some((b, _)) => {
                    let x = &mut coded[..hd];
                    b.to_coded(layer, h, at.pos, kh, x);
                    self.k.put(i, x, signs);
                }
                None => self.k.put(i, kh, signs),
            }
            self.v.put(i, vh, signs);
            if let Some(t) = at.twin {
                let j = self.vector(t, layer, h, at.slot);
                self.twin_k.put(j, kh, &[]);
                self.twin_v.put(j, vh, &[]);
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

    /// Bytes the first `slots` positions of a page take as stored.
    pub fn stored_bytes(&self, slots: usize, twin: bool) -> usize {
        let mut n = 0;
        self.page_ranges(0, slots, twin, |_, _, r| n += r.len());
        n
    }

    /// Hands `f` the stored bytes of the first `slots` positions of page
    /// `page` (twin `page` when `twin`), in runs (see
    /// [`KvStorage::fill_page`], which takes them back in the same order).
    /// Nothing is copied.
    pub fn page_runs<E>(
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

    /// Fills the first `slots` positions of page `page` (twin `page`
    /// when `twin`) run by run, in the order [`KvStorage::page_runs`]
    /// hands them out: `f` writes each run.
    pub fn fill_page<E>(
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

    /// The rotation signs of every (layer, KV head), for the session
    /// identity (empty for the unrotated formats).
    pub fn rotation_signs(&self) -> &[Vec<u64>] {
        &self.signs
    }

    /// Copies page `from` over page `to`.
    pub fn copy_page(&mut self, from: u32, to: u32) {
        let n = self.shape.page_vectors() / 2;
        let hd = self.shape.head_dim;
        self.k.copy(from as usize * n, to as usize * n, n, hd);
        self.v.copy(from as usize * n, to as usize * n, n, hd);
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

/// Softmax of one head's scores in place ([`crate::ops::softmax_fixed`]:
/// the same bits on every path, in an order fixed by the row's length).
fn softmax_row(row: &mut [f32]) {
    crate::ops::softmax_fixed(row)
}

/// One query row's attention inputs.
pub struct AttnQuery<'a> {
    /// The sequence's pages, in position order.
    pub pages: &'a [u32],
    /// The twin of each page ([`NO_TWIN`] where none); empty when the
    /// cache keeps no exact window.
    pub twins: &'a [u32],
    /// Keys at positions `start..end` are attended to.
    pub start: usize,
    pub end: usize,
}

impl AttnQuery<'_> {
    /// The twin that page `index` of the sequence is read from, for this
    /// query (at position `end - 1`): page 0 and the query's own page, when
    /// the cache keeps an exact window.
    #[inline]
    pub fn exact(&self, index: usize, page_tokens: usize) -> Option<u32> {
        if self.twins.is_empty() {
            return None;
        }
        let own = (self.end - 1) / page_tokens;
        if index == 0 || index == own {
            let t = self.twins[index];
            assert!(t != NO_TWIN, "page {index} of the exact window has no twin");
            Some(t)
        } else {
            None
        }
    }
}

/// Scratch for one thread's attention: scores of a group of query heads
/// over the context, one key or value vector, and (TQ4) the group's
/// rotated queries.
pub struct AttnScratch {
    pub scores: Vec<f32>,
    pub kv: Vec<f32>,
    pub rotated: Vec<f32>,
    /// Rotated-domain value sums of the group.
    pub acc: Vec<f32>,
    /// The key offset's per-pair terms of the group, and their shift to a
    /// page.
    pub xy: Vec<f32>,
    pub shifted: Vec<f32>,
    /// The key offset's unrotated part, per head.
    pub c0: Vec<f32>,
    /// Running maximum and sum of exponentials per head (attention over
    /// lossy pages, page by page).
    pub run: Vec<f32>,
    /// The key offset's part of one page's scores, per head.
    pub offsets: Vec<f32>,
}

impl AttnScratch {
    /// For up to `group` query heads per KV head and contexts up to `ctx`
    /// positions over F16 or F32 pages. Attention over lossy pages (Q8,
    /// TQ4) goes page by page and needs only `page_tokens` scores a head,
    /// whatever the context: pass `ctx = 0` for a cache in those formats.
    pub fn new(ctx: usize, head_dim: usize, group: usize, page_tokens: usize) -> AttnScratch {
        AttnScratch {
            scores: crate::vec::committed(0.0, ctx.max(page_tokens) * group.max(1)),
            kv: crate::vec::committed(0.0, head_dim),
            rotated: crate::vec::committed(0.0, head_dim * group.max(1)),
            acc: crate::vec::committed(0.0, head_dim * group.max(1)),
            xy: crate::vec::committed(0.0, head_dim * group.max(1)),
            shifted: crate::vec::committed(0.0, head_dim * group.max(1)),
            c0: crate::vec::committed(0.0, group.max(1)),
            run: crate::vec::committed(0.0, 2 * group.max(1)),
            offsets: crate::vec::committed(0.0, page_tokens * group.max(1)),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        [
            &self.scores,
            &self.kv,
            &self.rotated,
            &self.acc,
            &self.xy,
            &self.shifted,
            &self.c0,
            &self.run,
            &self.offsets,
        ]
        .iter()
        .map(|v| v.capacity() * 4)
        .sum()
    }
}

/// Attention of the `q.len() / head_dim` query heads that share KV head
/// `kv_head` of `layer`, over positions `query.start..query.end`, written to
/// `out` (same shape as `q`). Each key and value is read once for the whole
/// group. Per head: scores are `scale * q·k` (fixed-order dot), softmaxed in
/// f32, and values are accumulated in position order with fused
/// multiply-adds; the order of every operation is fixed by the position
/// range alone, so a head's result does not depend on batching.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    #[cfg(target_arch = "x86_64")]
    if let (Data::F16(dk), Data::F16(dv), true) = (
        &kv.k,
        &kv.v,
        crate::cpu::simd() >= crate::cpu::Simd::Avx2 && q.len() / kv.shape.head_dim <= 8,
    ) {
        let n = query.end - query.start;
        let scores = &mut scratch.scores[..q.len() / kv.shape.head_dim * n];
        if crate::cpu::simd() >= crate::cpu::Simd::Avx512Vnni {
            // SAFETY: AVX-512 F/BW, AVX2, FMA and F16C are present.
            unsafe { x86_f16_512::attend_group_f16(dk, dv, kv, layer, kv_head, query, q, scale, out, scores) };
        } else {
            // SAFETY: AVX2, FMA and F16C are present (checked by `simd`).
            unsafe { x86::attend_group_f16(dk, dv, kv, layer, kv_head, query, q, scale, out, scores) };
        }
        return;
    }
    if coded::takes(kv) {
        return coded::attend(crate::cpu::simd(), kv, layer, kv_head, query, q, scale, out, scratch);
    }
    attend_group_generic(kv, layer, kv_head, query, q, scale, out, scratch)
}

/// [`attend_group`] through `read` (every vector decoded back to its own
/// domain), `dot_f32` and `axpy`, with the whole row of scores softmaxed
/// at once: the reference the fused F16 path (bitwise) and the lossy
/// paths (to rounding) are tested against.
#[allow(clippy::too_many_arguments)]
pub fn attend_group_generic(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    attend_group_decoded(kv, layer, kv_head, query, q, scale, out, scratch)
}

/// [`attend_group`] with the arithmetic of llama.cpp's flash attention for
/// one query row ([`crate::ggml`]): over F16 keys, each query head rounded
/// to f16 and its scores summed as [`crate::ggml::dot_f16`] sums them, then
/// times `scale`; an online softmax over the positions in order, the value
/// sum kept in f16 (F32 values: in f32); the sum divided out at the end.
/// Lossy formats are read decoded, as F32 pages are.
#[allow(clippy::too_many_arguments)]
pub fn attend_group_ggml(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd() >= crate::cpu::Simd::Avx2 {
        // SAFETY: AVX2 and FMA detected (`simd`).
        return unsafe { attend_group_ggml_fma(kv, layer, kv_head, query, q, scale, out, scratch) };
    }
    attend_group_ggml_body(kv, layer, kv_head, query, q, scale, out, scratch)
}

/// [`attend_group_ggml`] compiled with FMA instructions (same results,
/// without a library call per fused multiply-add).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_group_ggml_fma(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    attend_group_ggml_body(kv, layer, kv_head, query, q, scale, out, scratch)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_group_ggml_body(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    use crate::ggml::{dot_f16, round_f16, OnlineHead};
    let pt = kv.shape.page_tokens;
    let hd = kv.shape.head_dim;
    let group = q.len() / hd;
    let f16_k = matches!(kv.format, KvFormat::F16);
    let f16_v = matches!(kv.format_v, KvFormat::F16);
    let read = |is_v: bool, p: usize, buf: &mut [f32]| {
        let (index, slot) = (p / pt, p % pt);
        match query.exact(index, pt) {
            Some(t) => kv.read_twin(t, layer, is_v, kv_head, slot, buf),
            None => kv.read(query.pages[index], layer, is_v, kv_head, slot, p, buf),
        }
    };
    let AttnScratch {
        kv: kbuf,
        rotated: qh,
        acc,
        shifted: vbuf,
        run,
        ..
    } = scratch;
    let (qh, acc, vbuf) = (&mut qh[..group * hd], &mut acc[..group * hd], &mut vbuf[..hd]);
    let (maxes, sums) = run[..2 * group].split_at_mut(group);
    for (d, &x) in qh.iter_mut().zip(q) {
        *d = if f16_k { round_f16(x) } else { x };
    }
    acc.fill(0.0);
    maxes.fill(f32::NEG_INFINITY);
    sums.fill(0.0);
    for p in query.start..query.end {
        read(false, p, kbuf);
        read(true, p, vbuf);
        for g in 0..group {
            let s = dot_f16(kbuf, &qh[g * hd..(g + 1) * hd]) * scale;
            let mut head = OnlineHead {
                acc: &mut acc[g * hd..(g + 1) * hd],
                max: maxes[g],
                sum: sums[g],
                f16: f16_v,
            };
            head.push(s, vbuf);
            (maxes[g], sums[g]) = (head.max, head.sum);
        }
    }
    for g in 0..group {
        let head = OnlineHead {
            acc: &mut acc[g * hd..(g + 1) * hd],
            max: maxes[g],
            sum: sums[g],
            f16: f16_v,
        };
        head.finish(&mut out[g * hd..(g + 1) * hd]);
    }
}

/// Scores in position order, softmax, values summed in position order,
/// every vector decoded back to its own domain first (pages of the exact
/// window read from their twins): the reference.
#[allow(clippy::too_many_arguments)]
fn attend_group_decoded(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let pt = kv.shape.page_tokens;
    let hd = kv.shape.head_dim;
    let group = q.len() / hd;
    let n = query.end - query.start;
    let read = |is_v: bool, p: usize, buf: &mut [f32]| {
        let (index, slot) = (p / pt, p % pt);
        match query.exact(index, pt) {
            Some(t) => kv.read_twin(t, layer, is_v, kv_head, slot, buf),
            None => kv.read(query.pages[index], layer, is_v, kv_head, slot, p, buf),
        }
    };
    let AttnScratch { scores, kv: kbuf, .. } = scratch;
    let scores = &mut scores[..group * n];
    for (i, p) in (query.start..query.end).enumerate() {
        read(false, p, kbuf);
        for g in 0..group {
            scores[g * n + i] = crate::dot::dot_f32(&q[g * hd..(g + 1) * hd], kbuf) * scale;
        }
    }
    for g in 0..group {
        softmax_row(&mut scores[g * n..(g + 1) * n]);
    }
    out.fill(0.0);
    for (i, p) in (query.start..query.end).enumerate() {
        read(true, p, kbuf);
        for g in 0..group {
            crate::vec::axpy(&mut out[g * hd..(g + 1) * hd], scores[g * n + i], kbuf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn page_runs_round_trip_into_another_page_of_another_storage() {
        let shape = KvShape {
            layers: 2,
            kv_heads: 2,
            head_dim: 64,
            page_tokens: 16,
        };
        let mut x = 0x9e37_79b9u32;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 1000.0 - 1.0
        };
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
                a.page_runs::<()>(from, slots, twin, |r| {
                    runs.push(r.to_vec());
                    Ok(())
                })
                .unwrap();
                assert_eq!(runs.iter().map(Vec::len).sum::<usize>(), a.stored_bytes(slots, twin));
                let mut it = runs.into_iter();
                b.fill_page::<()>(to, slots, twin, |r| {
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
        let mut x = 0x2545_f491u32;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 1000.0 - 1.0
        };
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
            let mut x = 0x9e37_79b9u32 ^ (hd * 7 + group + pt) as u32;
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 2000) as f32 / 1000.0 - 1.0
            };
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
                    let what = format!("{fk:?}/{fv:?}, hd {hd}, rot {rot}, pages of {pt}, group {group}, from {start}, twins {twinned}");
                    // Lossy pages need one page of scores, whatever the
                    // context: no scratch for the other positions.
                    let mut small = AttnScratch::new(0, hd, group, pt);
                    let mut want = vec![0f32; group * hd];
                    coded::attend(Simd::Scalar, &kv, 1, 1, &query, &q, 0.1, &mut want, &mut small);
                    for level in Simd::available() {
                        let mut got = vec![f32::NAN; group * hd];
                        coded::attend(level, &kv, 1, 1, &query, &q, 0.1, &mut got, &mut small);
                        assert!(
                            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{what}: {level:?} differs from the scalar lanes"
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

    #[test]
    fn fused_f16_attention_matches_the_generic_path_bitwise() {
        // Every group size the fused path specializes (1..=8 query heads per
        // KV head, 9 goes generic), at the head sizes of the four models.
        for hd in [64, 256] {
            for group in 1..=9 {
                let shape = KvShape {
                    layers: 2,
                    kv_heads: 2,
                    head_dim: hd,
                    page_tokens: 16,
                };
                let mut kv = KvStorage::new(shape, KvFormat::F16, 6);
                let mut x = 0x1234_5678u32 ^ (hd * 31 + group) as u32;
                let mut rnd = move || {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x % 2000) as f32 / 1000.0 - 1.0
                };
                let pages = [3u32, 0, 5, 1];
                for p in 0..60 {
                    let k: Vec<f32> = (0..2 * hd).map(|_| rnd()).collect();
                    let v: Vec<f32> = (0..2 * hd).map(|_| rnd()).collect();
                    kv.write(1, slot_at(&pages, p), &k, &v);
                }
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
                            unsafe {
                                x86_f16_512::attend_group_f16(dk, dv, &kv, 1, 1, &query, &q, 0.125, &mut a, scores)
                            };
                            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "avx512");
                        }
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
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
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop, clippy::int_plus_one)] // register arrays indexed by head and position; blocks of `$p`
mod x86_f16_512 {
    //! Attention over F16 pages with 512-bit vectors: a register holds one
    //! 16-element chunk, which is exactly the dot product's 16 lanes, so
    //! each lane takes the same fused multiply-adds as `dot_f32` and the
    //! value sums the same as `axpy`, and the lanes are folded by the same
    //! tree. Scores of several (position, head) pairs share one fold
    //! (`hsums`); value sums keep up to 64 dimensions of every head of the
    //! group in registers over all positions; each page is walked as one
    //! contiguous run of vectors.

    use std::arch::x86_64::*;

    use super::coded::x86::hsums;
    use super::{softmax_row, AttnQuery, KvStorage};

    /// Positions the prefetch cursor runs ahead of the scores (measured
    /// with `attnbench`, keys and values in memory: 8 to 64 all gain about
    /// a third over none; 16 was best).
    const AHEAD: usize = 16;

    /// The query range's runs of consecutive positions within one page:
    /// (index in the range of the run's first position, element offset of
    /// its vector, positions).
    fn runs<'a>(
        kv: &'a KvStorage,
        layer: usize,
        is_v: bool,
        kv_head: usize,
        query: &'a AttnQuery,
    ) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
        let pt = kv.shape.page_tokens;
        let mut p = query.start;
        std::iter::from_fn(move || {
            if p >= query.end {
                return None;
            }
            let (index, first) = (p / pt, p % pt);
            let len = (pt - first).min(query.end - p);
            let run = (
                p - query.start,
                kv.offset(query.pages[index], layer, is_v, kv_head, first),
                len,
            );
            p += len;
            Some(run)
        })
    }

    /// A cursor some positions ahead of the scores' pass: at each step it
    /// asks for the key and the value there to be brought into cache, so
    /// the keys arrive before the pass reaches them and the values before
    /// the value pass does. A page's vectors are a few KiB in one place,
    /// pages anywhere, which the hardware's prefetchers do not follow.
    struct Ahead<'a> {
        kv: &'a KvStorage,
        pages: &'a [u32],
        layer: usize,
        kv_head: usize,
        pos: usize,
        end: usize,
        off: usize,
    }

    impl<'a> Ahead<'a> {
        fn new(kv: &'a KvStorage, layer: usize, kv_head: usize, query: &'a AttnQuery, distance: usize) -> Ahead<'a> {
            let mut a = Ahead {
                kv,
                pages: query.pages,
                layer,
                kv_head,
                pos: query.start,
                end: query.end,
                off: 0,
            };
            a.seek();
            for _ in 0..distance {
                a.advance();
            }
            a
        }

        #[inline(always)]
        fn seek(&mut self) {
            if self.pos < self.end {
                let pt = self.kv.shape.page_tokens;
                self.off = self.kv.offset(
                    self.pages[self.pos / pt],
                    self.layer,
                    false,
                    self.kv_head,
                    self.pos % pt,
                );
            }
        }

        #[inline(always)]
        fn advance(&mut self) {
            self.pos += 1;
            if self.pos.is_multiple_of(self.kv.shape.page_tokens) {
                self.seek();
            } else {
                self.off += self.kv.shape.head_dim;
            }
        }

        /// Prefetches the key and the value at the cursor, then moves on.
        #[inline(always)]
        unsafe fn step(&mut self, dk: *const u16, dv: *const u16) {
            if self.pos >= self.end {
                return;
            }
            for l in (0..self.kv.shape.head_dim).step_by(32) {
                _mm_prefetch::<_MM_HINT_T0>(dk.add(self.off + l) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(dv.add(self.off + l) as *const i8);
            }
            self.advance();
        }
    }

    /// Scores of `P` consecutive positions (keys at `k`, `hd` apart) for
    /// `G` heads, `P * G <= 16`, written to `scores[g * n + j]`.
    #[inline(always)]
    unsafe fn score_block<const G: usize, const P: usize>(
        k: *const u16,
        hd: usize,
        q: *const f32,
        scale: f32,
        scores: *mut f32,
        n: usize,
    ) {
        let mut a = [[_mm512_setzero_ps(); G]; P];
        for c in (0..hd).step_by(16) {
            let mut kc = [_mm512_setzero_ps(); P];
            for (j, kj) in kc.iter_mut().enumerate() {
                *kj = _mm512_cvtph_ps(_mm256_loadu_si256(k.add(j * hd + c) as *const __m256i));
            }
            for g in 0..G {
                let qv = _mm512_loadu_ps(q.add(g * hd + c));
                for j in 0..P {
                    a[j][g] = _mm512_fmadd_ps(qv, kc[j], a[j][g]);
                }
            }
        }
        let mut flat = [[_mm512_setzero_ps(); 8]; 2];
        for j in 0..P {
            for g in 0..G {
                flat[(j * G + g) / 8][(j * G + g) % 8] = a[j][g];
            }
        }
        let mut sums = [[0f32; 8]; 2];
        sums[0] = hsums(&flat[0]);
        if P * G > 8 {
            sums[1] = hsums(&flat[1]);
        }
        for j in 0..P {
            for g in 0..G {
                *scores.add(g * n + j) = sums[(j * G + g) / 8][(j * G + g) % 8] * scale;
            }
        }
    }

    /// Attention of `G` heads, value sums `R` registers (`16 * R`
    /// dimensions) wide; `R` divides `head_dim / 16`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn group<const G: usize, const R: usize>(
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
        let n = query.end - query.start;
        // Positions a block of scores takes: their accumulators fill at most
        // 16 registers (and the keys at most 8 more).
        const fn per_block(g: usize) -> usize {
            match g {
                1 | 2 => 8,
                3 | 4 => 4,
                _ => 2,
            }
        }
        let sp = scores.as_mut_ptr();
        let mut ahead = Ahead::new(kv, layer, kv_head, query, AHEAD);
        for (i0, off, len) in runs(kv, layer, false, kv_head, query) {
            let k = dk.as_ptr().add(off);
            let mut t = 0;
            macro_rules! blocks {
                ($p:expr) => {
                    while t + $p <= len {
                        for _ in 0..$p {
                            ahead.step(dk.as_ptr(), dv.as_ptr());
                        }
                        score_block::<G, { $p }>(k.add(t * hd), hd, q.as_ptr(), scale, sp.add(i0 + t), n);
                        t += $p;
                    }
                };
            }
            match per_block(G) {
                8 => blocks!(8),
                4 => blocks!(4),
                2 => blocks!(2),
                _ => {}
            }
            blocks!(1);
        }
        for g in 0..G {
            softmax_row(&mut scores[g * n..(g + 1) * n]);
        }
        let sp = scores.as_ptr();
        for d0 in (0..hd).step_by(16 * R) {
            let mut o = [[_mm512_setzero_ps(); R]; G];
            for (i0, off, len) in runs(kv, layer, true, kv_head, query) {
                let v = dv.as_ptr().add(off + d0);
                for t in 0..len {
                    let mut vr = [_mm512_setzero_ps(); R];
                    for (r, x) in vr.iter_mut().enumerate() {
                        *x = _mm512_cvtph_ps(_mm256_loadu_si256(v.add(t * hd + 16 * r) as *const __m256i));
                    }
                    for (g, og) in o.iter_mut().enumerate() {
                        let w = _mm512_set1_ps(*sp.add(g * n + i0 + t));
                        for r in 0..R {
                            og[r] = _mm512_fmadd_ps(w, vr[r], og[r]);
                        }
                    }
                }
            }
            for (g, og) in o.iter().enumerate() {
                for (r, x) in og.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(g * hd + d0 + 16 * r), *x);
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
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
        let chunks = hd / 16;
        // Value registers a head: as many as leave room for the group's
        // accumulators, the values and a weight in 32 registers, dividing
        // the head's chunks.
        let most = match q.len() / hd {
            1 | 2 => 8,
            3..=6 => 4,
            _ => 2,
        };
        let r = [8, 4, 2, 1]
            .into_iter()
            .find(|&r| r <= most && chunks.is_multiple_of(r))
            .unwrap_or(1);
        macro_rules! by_group {
            ($r:literal) => {
                match q.len() / hd {
                    1 => group::<1, $r>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
                    2 => group::<2, $r>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
                    3 => group::<3, $r>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
                    4 => group::<4, $r>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
                    5 => group::<5, $r>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
                    6 => group::<6, $r>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
                    7 => group::<7, $r>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
                    8 => group::<8, $r>(dk, dv, kv, layer, kv_head, query, q, scale, out, scores),
                    g => unreachable!("attention: {g} query heads per KV head take the generic path"),
                }
            };
        }
        match r {
            8 => by_group!(8),
            4 => by_group!(4),
            2 => by_group!(2),
            _ => by_group!(1),
        }
    }
}
