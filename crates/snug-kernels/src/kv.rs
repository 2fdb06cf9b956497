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
}

impl KvFormat {
    pub fn bytes_per_element(self) -> usize {
        match self {
            KvFormat::F32 => 4,
            KvFormat::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::F16 => "f16",
        }
    }
}

enum Data {
    F32(Vec<f32>),
    F16(Vec<u16>),
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

    /// Bytes a page takes in `format`.
    pub fn page_bytes(&self, format: KvFormat) -> usize {
        self.page_elems() * format.bytes_per_element()
    }
}

/// The KV pages.
pub struct KvStorage {
    pub shape: KvShape,
    pub format: KvFormat,
    n_pages: usize,
    data: Data,
}

impl KvStorage {
    pub fn new(shape: KvShape, format: KvFormat, n_pages: usize) -> KvStorage {
        let n = shape.page_elems() * n_pages;
        let data = match format {
            KvFormat::F32 => Data::F32(vec![0.0; n]),
            KvFormat::F16 => Data::F16(vec![0; n]),
        };
        KvStorage {
            shape,
            format,
            n_pages,
            data,
        }
    }

    pub fn n_pages(&self) -> usize {
        self.n_pages
    }

    pub fn bytes(&self) -> usize {
        self.shape.page_bytes(self.format) * self.n_pages
    }

    /// Offset of (page, layer, K or V, kv head, slot).
    #[inline]
    fn offset(&self, page: u32, layer: usize, is_v: bool, head: usize, slot: usize) -> usize {
        let s = &self.shape;
        let per_kv = s.kv_heads * s.page_tokens * s.head_dim;
        (page as usize * s.layers + layer) * 2 * per_kv
            + usize::from(is_v) * per_kv
            + (head * s.page_tokens + slot) * s.head_dim
    }

    /// Stores one position's keys and values (`kv_heads * head_dim` each).
    pub fn write(&mut self, layer: usize, page: u32, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.shape.head_dim;
        for h in 0..self.shape.kv_heads {
            let ko = self.offset(page, layer, false, h, slot);
            let vo = self.offset(page, layer, true, h, slot);
            let (kh, vh) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            match &mut self.data {
                Data::F32(d) => {
                    d[ko..ko + hd].copy_from_slice(kh);
                    d[vo..vo + hd].copy_from_slice(vh);
                }
                Data::F16(d) => {
                    crate::vec::f32_to_f16(kh, &mut d[ko..ko + hd]);
                    crate::vec::f32_to_f16(vh, &mut d[vo..vo + hd]);
                }
            }
        }
    }

    /// Copies page `from` over page `to`.
    pub fn copy_page(&mut self, from: u32, to: u32) {
        let n = self.shape.page_elems();
        let (f, t) = (from as usize * n, to as usize * n);
        match &mut self.data {
            Data::F32(d) => d.copy_within(f..f + n, t),
            Data::F16(d) => d.copy_within(f..f + n, t),
        }
    }

    /// Key or value vector at (page, layer, head, slot), as f32 into `out`.
    #[inline]
    fn read(&self, page: u32, layer: usize, is_v: bool, head: usize, slot: usize, out: &mut [f32]) {
        let o = self.offset(page, layer, is_v, head, slot);
        let hd = self.shape.head_dim;
        match &self.data {
            Data::F32(d) => out.copy_from_slice(&d[o..o + hd]),
            Data::F16(d) => crate::vec::f16_to_f32(&d[o..o + hd], out),
        }
    }
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
/// over the context, and one key or value vector.
pub struct AttnScratch {
    pub scores: Vec<f32>,
    pub kv: Vec<f32>,
}

impl AttnScratch {
    /// For contexts up to `ctx` positions and up to `group` query heads per
    /// KV head.
    pub fn new(ctx: usize, head_dim: usize, group: usize) -> AttnScratch {
        AttnScratch {
            scores: vec![0.0; ctx * group.max(1)],
            kv: vec![0.0; head_dim],
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
    let pt = kv.shape.page_tokens;
    let hd = kv.shape.head_dim;
    let group = q.len() / hd;
    let n = query.end - query.start;
    let (scores, kbuf) = (&mut scratch.scores[..group * n], &mut scratch.kv);
    for (i, p) in (query.start..query.end).enumerate() {
        kv.read(query.pages[p / pt], layer, false, kv_head, p % pt, kbuf);
        for g in 0..group {
            scores[g * n + i] = crate::dot::dot_f32(&q[g * hd..(g + 1) * hd], kbuf) * scale;
        }
    }
    for g in 0..group {
        let row = &mut scores[g * n..(g + 1) * n];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        let mut sum = 0f32;
        for s in row.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|s| *s *= inv);
    }
    out.fill(0.0);
    for (i, p) in (query.start..query.end).enumerate() {
        kv.read(query.pages[p / pt], layer, true, kv_head, p % pt, kbuf);
        for g in 0..group {
            crate::vec::axpy(&mut out[g * hd..(g + 1) * hd], scores[g * n + i], kbuf);
        }
    }
}
