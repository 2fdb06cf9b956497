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
        }
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

    /// Stores one position's keys and values (`kv_heads * head_dim` each).
    pub fn write(&mut self, layer: usize, page: u32, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.shape.head_dim;
        for h in 0..self.shape.kv_heads {
            let i = self.vector(page, layer, h, slot);
            let signs = self.signs.get(layer * self.shape.kv_heads + h).map_or(&[][..], |v| v);
            self.k.put(i, &k[h * hd..(h + 1) * hd], signs);
            self.v.put(i, &v[h * hd..(h + 1) * hd], signs);
        }
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

    /// Key or value vector at (page, layer, head, slot), as f32 into `out`.
    #[inline]
    fn read(&self, page: u32, layer: usize, is_v: bool, head: usize, slot: usize, out: &mut [f32]) {
        self.read_rotated(page, layer, is_v, head, slot, out);
        if matches!(self.format_of(is_v), KvFormat::Q8 | KvFormat::Tq4) {
            crate::tq4::rotate_back(out, self.signs_of(layer, head));
        }
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

/// Softmax of one head's scores in place: max, exp, sum in position order.
fn softmax_row(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let mut sum = 0f32;
    for s in row.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|s| *s *= inv);
}

/// One query row's attention inputs.
pub struct AttnQuery<'a> {
    /// The sequence's pages, in position order.
    pub pages: &'a [u32],
    /// Keys at positions `start..end` are attended to.
    pub start: usize,
    pub end: usize,
}

/// Scratch for one thread's attention: scores of a group of query heads
/// over the context, one key or value vector, and (TQ4) the group's
/// rotated queries.
pub struct AttnScratch {
    pub scores: Vec<f32>,
    pub kv: Vec<f32>,
    pub rotated: Vec<f32>,
}

impl AttnScratch {
    /// For contexts up to `ctx` positions and up to `group` query heads per
    /// KV head.
    pub fn new(ctx: usize, head_dim: usize, group: usize) -> AttnScratch {
        AttnScratch {
            scores: crate::vec::committed(0.0, ctx * group.max(1)),
            kv: crate::vec::committed(0.0, head_dim),
            rotated: crate::vec::committed(0.0, head_dim * group.max(1)),
        }
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
        // SAFETY: AVX2, FMA and F16C are present (checked by `simd`).
        unsafe { x86::attend_group_f16(dk, dv, kv, layer, kv_head, query, q, scale, out, scores) };
        return;
    }
    let rotated = |f| matches!(f, KvFormat::Q8 | KvFormat::Tq4);
    if rotated(kv.format) || rotated(kv.format_v) {
        // Rotated parts are read as stored: see `attend_group_read`.
        return attend_group_read(kv, layer, kv_head, query, q, scale, out, scratch, true);
    }
    attend_group_generic(kv, layer, kv_head, query, q, scale, out, scratch)
}

/// [`attend_group`] through `read` (every vector decoded back to its own
/// domain), `dot_f32` and `axpy`: the reference the fused F16 path and the
/// rotated-domain path are tested against.
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
    attend_group_read(kv, layer, kv_head, query, q, scale, out, scratch, false)
}

/// Scores in position order, softmax, values summed in position order.
/// With `rotated_domain`, Q8 and TQ4 parts are read as stored, in the
/// rotated domain: for rotated keys each query head is rotated once and
/// scored against the keys as stored; rotated values are summed as stored
/// and the sum rotated back once per head. Since the rotation is
/// orthogonal this is attention over the stored vectors, up to rounding.
/// Without it, every vector is decoded back first (the reference).
#[allow(clippy::too_many_arguments)]
fn attend_group_read(
    kv: &KvStorage,
    layer: usize,
    kv_head: usize,
    query: &AttnQuery,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    rotated_domain: bool,
) {
    let pt = kv.shape.page_tokens;
    let hd = kv.shape.head_dim;
    let group = q.len() / hd;
    let n = query.end - query.start;
    let signs = kv.signs_of(layer, kv_head);
    let rotated = |f| rotated_domain && matches!(f, KvFormat::Q8 | KvFormat::Tq4);
    let (k_rot, v_rot) = (rotated(kv.format), rotated(kv.format_v));
    let read = |is_v: bool, p: usize, buf: &mut [f32]| {
        let (page, slot) = (query.pages[p / pt], p % pt);
        if rotated_domain {
            kv.read_rotated(page, layer, is_v, kv_head, slot, buf)
        } else {
            kv.read(page, layer, is_v, kv_head, slot, buf)
        }
    };
    let AttnScratch {
        scores,
        kv: kbuf,
        rotated: qr,
    } = scratch;
    let (scores, qr) = (&mut scores[..group * n], &mut qr[..group * hd]);
    qr.copy_from_slice(q);
    if k_rot {
        for g in 0..group {
            crate::tq4::rotate(&mut qr[g * hd..(g + 1) * hd], signs);
        }
    }
    for (i, p) in (query.start..query.end).enumerate() {
        read(false, p, kbuf);
        for g in 0..group {
            scores[g * n + i] = crate::dot::dot_f32(&qr[g * hd..(g + 1) * hd], kbuf) * scale;
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
    if v_rot {
        for g in 0..group {
            crate::tq4::rotate_back(&mut out[g * hd..(g + 1) * hd], signs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            start: 0,
            end: 40,
        };
        let attend = |format: KvFormat, generic: bool| {
            let mut kv = KvStorage::new(shape, format, 4);
            for (p, (k, v)) in rows.iter().enumerate() {
                kv.write(1, pages[p / 16], p % 16, k, v);
            }
            let mut s = AttnScratch::new(64, hd, group);
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
                kv.write(1, pages[p / 16], p % 16, k, v);
            }
            let mut s = AttnScratch::new(64, hd, group);
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
                kv.write(0, 2, p, k, v);
            }
            kv.copy_page(2, 1);
            let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
            for slot in [0, 7, 15] {
                kv.read(2, 0, true, 1, slot, &mut a);
                kv.read(1, 0, true, 1, slot, &mut b);
                assert_eq!(a, b);
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
                    kv.write(1, pages[p / 16], p % 16, &k, &v);
                }
                let q: Vec<f32> = (0..group * hd).map(|_| rnd() * 3.0).collect();
                for (start, end) in [(0, 1), (0, 60), (13, 47)] {
                    let query = AttnQuery {
                        pages: &pages,
                        start,
                        end,
                    };
                    let mut s1 = AttnScratch::new(64, hd, group);
                    let mut s2 = AttnScratch::new(64, hd, group);
                    let (mut a, mut b) = (vec![0f32; group * hd], vec![0f32; group * hd]);
                    attend_group(&kv, 1, 1, &query, &q, 0.125, &mut a, &mut s1);
                    attend_group_generic(&kv, 1, 1, &query, &q, 0.125, &mut b, &mut s2);
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "head dim {hd}, group {group}, {start}..{end}"
                    );
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
