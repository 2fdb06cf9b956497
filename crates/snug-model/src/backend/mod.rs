//! The seam between the decoder and the machine it runs on.
//!
//! The decoder (`arch/forward.rs`) is written once, as a sequence of
//! operations on named buffers of one batch ([`Buf`]): embed, normalize,
//! multiply, rotate, store keys and values, attend, gate, gather logits. A
//! [`Backend`] carries them out. It owns where tensors live (its
//! [`Backend::Matrix`] and [`Backend::Vector`] handles, bound once at load),
//! the buffers and threads of one engine's passes
//! ([`Backend::Workspace`]), and the KV pages ([`Backend::Kv`], a
//! [`KvStore`] the engine and sessions move pages through).
//!
//! Two backends exist, both on the CPU and sharing its memory: [`Native`]
//! (snug's own kernels, each row's arithmetic fixed whatever the batch)
//! and [`LlamaCpp`] (llama.cpp's arithmetic, f16 roundings included, for
//! output equal to its token for token). A new backend is one
//! implementation of this trait plus its kernels; see
//! docs/ARCHITECTURE.md.

mod cpu;

pub use cpu::{Cpu, CpuArithmetic, CpuWorkspace, LlamaCpp, Native, ATTN_ROWS};
pub use snug_kernels::kv::KvStore;

use snug_kernels::kv::KvSlot;

use crate::arch::{Activation, BatchRow, Config, Experts, Head, KvView};

/// Element `i` to read and element `j` (another) to write, of one slice:
/// how a backend reads one of its buffers while it writes another.
///
/// # Panics
/// If `i == j`.
pub fn read_and_write<T>(items: &mut [T], i: usize, j: usize) -> (&T, &mut T) {
    assert_ne!(i, j, "a buffer read and written at once");
    if i < j {
        let (a, b) = items.split_at_mut(j);
        (&a[i], &mut b[0])
    } else {
        let (a, b) = items.split_at_mut(i);
        (&b[0], &mut a[j])
    }
}

/// A buffer of one batch: `rows` rows of the width given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The residual stream, `dim` wide.
    X,
    /// A sublayer's normalized input, `dim`.
    H,
    /// Queries, `heads * head_dim`.
    Q,
    /// Keys, `kv_heads * head_dim`.
    K,
    /// Values, `kv_heads * head_dim`.
    V,
    /// Attention's output, `heads * head_dim`.
    Attn,
    /// A sublayer's output, `dim`.
    O,
    /// The feed-forward gate, then the gated product, `ff`.
    Gate,
    /// The feed-forward up projection, `ff`.
    Up,
    /// The rows logits are computed for, `dim`.
    Sel,
}

impl Buf {
    pub const ALL: [Buf; 10] = [
        Buf::X,
        Buf::H,
        Buf::Q,
        Buf::K,
        Buf::V,
        Buf::Attn,
        Buf::O,
        Buf::Gate,
        Buf::Up,
        Buf::Sel,
    ];

    /// Floats of one row of this buffer under `c`.
    pub fn width(self, c: &Config) -> usize {
        match self {
            Buf::X | Buf::H | Buf::O | Buf::Sel => c.dim,
            Buf::Q | Buf::Attn => c.heads * c.head_dim,
            Buf::K | Buf::V => c.kv_heads * c.head_dim,
            Buf::Gate | Buf::Up => c.ff.max(c.ff_expert),
        }
    }
}

/// How large one engine's workspace is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceSize {
    /// Rows of the largest batch.
    pub rows: usize,
    /// Positions of the longest context; 0 where the KV pages are lossy
    /// (attention over them needs no scratch per position).
    pub ctx: usize,
    /// Positions per KV page.
    pub page_tokens: usize,
    /// Threads (the CPU backends run a pool of this many).
    pub threads: usize,
}

/// The operations of a decoder's forward pass on one kind of machine.
///
/// Every operation works on the first rows of a [`Buf`] in the workspace
/// and computes each row from that row alone, in an order that does not
/// depend on how many rows there are: a row's bits never depend on its
/// batch. Lengths are in floats unless named rows.
pub trait Backend: Sync {
    /// A matrix the decoder multiplies by (`rows x cols`, a row per
    /// output).
    /// `'w` is the lifetime of the model file it was bound from (the CPU
    /// backends read the mapped file in place).
    type Matrix<'w>: Sync;
    /// A vector of floats: a norm's weights, a bias.
    type Vector<'w>: Sync;
    /// The buffers (and threads, scratch) of one engine's passes.
    type Workspace: Send;
    /// The KV pages.
    type Kv: KvStore;

    /// Whether the decoder follows llama.cpp's graph where it differs
    /// from snug's: queries scaled before attention where the
    /// architecture says so, and the last layer's feed-forward block run
    /// on the rows that want logits only.
    const LLAMA_CPP_GRAPH: bool;

    /// A workspace for `c` of `size`.
    fn workspace(c: &Config, size: WorkspaceSize) -> Self::Workspace;

    /// Rows the workspace holds.
    fn max_rows(ws: &Self::Workspace) -> usize;

    /// Called first in every forward pass with its rows and what it hands
    /// back: a backend that records a pass' launches once and replays them
    /// (the CUDA backend's graphs for decode steps) decides here. Nothing
    /// by default.
    fn begin(_ws: &mut Self::Workspace, _rows: &[BatchRow], _head: Head, _kv: &KvView<Self::Kv>) {}

    /// Writes each row's token's embedding into [`Buf::X`].
    fn embed(ws: &mut Self::Workspace, table: &Self::Matrix<'_>, rows: &[BatchRow]);

    /// Multiplies the first `len` floats of `buf` by `by`.
    fn scale(ws: &mut Self::Workspace, buf: Buf, len: usize, by: f32);

    /// Copies the first `len` floats of `from` to `to`.
    fn copy(ws: &mut Self::Workspace, from: Buf, to: Buf, len: usize);

    /// RMS-normalizes the first `len` floats of `buf`, as rows of
    /// `w`'s length.
    fn rms_norm(ws: &mut Self::Workspace, buf: Buf, len: usize, w: &Self::Vector<'_>, eps: f32);

    /// `x += add` (where given), then `to = x` RMS-normalized with `w`,
    /// over the first `len` floats as rows of `w`'s length: the residual
    /// sum and the next block's norm. By default [`Backend::add`],
    /// [`Backend::copy`] and [`Backend::rms_norm`]; a backend may do it in
    /// one pass, with the same arithmetic.
    fn add_norm(
        ws: &mut Self::Workspace,
        x: Buf,
        add: Option<Buf>,
        to: Buf,
        len: usize,
        w: &Self::Vector<'_>,
        eps: f32,
    ) {
        if let Some(from) = add {
            Self::add(ws, x, from, len);
        }
        Self::copy(ws, x, to, len);
        Self::rms_norm(ws, to, len, w, eps);
    }

    /// `to[r] = w * from[r]` for the first `rows` rows.
    fn matmul(ws: &mut Self::Workspace, w: &Self::Matrix<'_>, from: Buf, to: Buf, rows: usize);

    /// `to[i][r] = ws[i] * from[r]` for each product i: products of one
    /// input (a layer's query, key and value; its gate and up), which a
    /// backend may run together; each output's bits are
    /// [`Backend::matmul`]'s.
    fn matmul_many(ws: &mut Self::Workspace, mats: &[&Self::Matrix<'_>], from: Buf, to: &[Buf], rows: usize) {
        for (w, &t) in mats.iter().zip(to) {
            Self::matmul(ws, w, from, t, rows);
        }
    }

    /// Adds `bias` to each of the first `rows` rows of `buf`.
    fn add_bias(ws: &mut Self::Workspace, buf: Buf, rows: usize, bias: &Self::Vector<'_>);

    /// `to += from` over the first `len` floats.
    fn add(ws: &mut Self::Workspace, to: Buf, from: Buf, len: usize);

    /// Rotates each row's query and key heads to its position (`rope`:
    /// `Some(local)`, with the local layers' RoPE base where `local`;
    /// `None` in a layer without RoPE), gathering the key basis'
    /// statistics of `layer` where the workspace collects them, then
    /// stores each row's keys and values of `layer` at its slot.
    fn rope_write_kv(
        ws: &mut Self::Workspace,
        layer: usize,
        rows: &[BatchRow],
        rope: Option<bool>,
        slots: &[KvSlot],
        kv: &mut Self::Kv,
    );

    /// Attention of each row's query heads over its sequence's KV pages
    /// in `layer`, into [`Buf::Attn`]; scores are scaled by `scale`.
    fn attention(
        ws: &mut Self::Workspace,
        c: &Config,
        layer: usize,
        rows: &[BatchRow],
        kv: &KvView<Self::Kv>,
        scale: f32,
    );

    /// A mixture-of-experts feed-forward block ([`Experts`]) on the first
    /// `rows` rows of [`Buf::H`], into [`Buf::O`].
    fn experts(ws: &mut Self::Workspace, e: &Experts<Self::Matrix<'_>>, c: &Config, rows: usize);

    /// `gate = act(gate) * up` over the first `rows` rows.
    fn gated(ws: &mut Self::Workspace, act: Activation, rows: usize, width: usize);

    /// A feed-forward block's gate and up products of the first `rows`
    /// rows of `from`, into [`Buf::Gate`] and [`Buf::Up`], then
    /// [`Backend::gated`]: the bits of those two steps, which a backend
    /// may run as one.
    fn gate_up<'w>(
        ws: &mut Self::Workspace,
        gate: &Self::Matrix<'w>,
        up: &Self::Matrix<'w>,
        from: Buf,
        rows: usize,
        width: usize,
        act: Activation,
    ) {
        Self::matmul_many(ws, &[gate, up], from, &[Buf::Gate, Buf::Up], rows);
        Self::gated(ws, act, rows, width);
    }

    /// Copies rows `which` (ascending) of `from` to rows `0..` of `to`.
    fn gather_rows(ws: &mut Self::Workspace, from: Buf, to: Buf, width: usize, which: &[usize]);

    /// Logits of the first `rows` rows of `from` under the output head,
    /// into host memory.
    fn logits(ws: &mut Self::Workspace, head: &Self::Matrix<'_>, from: Buf, rows: usize, out: &mut [f32]);

    /// Copies the first `out.len()` floats of `buf` into host memory.
    fn read(ws: &mut Self::Workspace, buf: Buf, out: &mut [f32]);

    /// Hands the first `len` floats of `buf` to the forward pass' trace
    /// (see [`crate::arch::trace`]) when tracing is on.
    fn trace(ws: &mut Self::Workspace, name: &str, layer: usize, layers: usize, buf: Buf, len: usize);
}
