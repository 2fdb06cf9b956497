//! The one forward path: a batch of rows through every layer, reading and
//! writing KV through the engine's page lists, on any [`Backend`].
//!
//! Each row is (sequence, position, token). A row's keys and values are
//! written to its sequence's page at its position before attention runs, so
//! a prefill chunk attends causally within itself, and a verify batch of k
//! draft tokens sees each earlier draft. Every operation computes a row
//! from that row alone in a fixed order; the bits of a row's logits and KV
//! therefore do not depend on the batch.

use snug_kernels::kv::{KvSlot, KvStorage, KvStore, NO_TWIN};

use super::config::Config;
use super::profile::{Laps, Op};
use crate::backend::{Backend, Buf};

/// One row of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRow {
    /// Index of the row's sequence in [`KvView::pages`].
    pub seq: usize,
    /// Position of the token in its sequence.
    pub pos: usize,
    pub token: u32,
    /// Whether logits are wanted for this row.
    pub logits: bool,
}

/// The engine's KV storage and, per sequence of the batch, its pages. Every
/// row's position must already have a page.
pub struct KvView<'a, K = KvStorage> {
    pub storage: &'a mut K,
    pub pages: &'a [&'a [u32]],
    /// Per sequence, each page's twin ([`snug_kernels::kv::NO_TWIN`] where
    /// none); empty slices when the cache keeps no exact window.
    pub twins: &'a [&'a [u32]],
}

/// One layer's weights, as matrices `M` and vectors `V` of a backend.
#[derive(Clone)]
pub struct Layer<M, V> {
    pub attn_norm: V,
    pub wq: M,
    pub wk: M,
    pub wv: M,
    pub wo: M,
    pub bq: Option<V>,
    pub bk: Option<V>,
    pub bv: Option<V>,
    pub q_norm: Option<V>,
    pub k_norm: Option<V>,
    pub post_attn_norm: Option<V>,
    pub ffn_norm: V,
    pub ffn: Ffn<M>,
    pub post_ffn_norm: Option<V>,
}

/// A layer's feed-forward block.
#[derive(Clone)]
pub enum Ffn<M> {
    /// `down(act(gate x) * up x)`.
    Dense { gate: M, up: M, down: M },
    /// A mixture of experts.
    Experts(Experts<M>),
}

/// A mixture-of-experts block: the router scores every expert for a row
/// (`router x`, softmax), the row's `used` best experts each run a dense
/// block, and their outputs are summed weighted by their scores
/// (renormalized over the chosen ones). Which experts a row takes and the
/// order of their sum depend on the row alone.
#[derive(Clone)]
pub struct Experts<M> {
    /// `experts x dim`.
    pub router: M,
    /// Per expert, as a dense block's.
    pub gate: Vec<M>,
    pub up: Vec<M>,
    pub down: Vec<M>,
    /// Experts per row.
    pub used: usize,
}

impl<M> Ffn<M> {
    /// Every matrix of the block (the router first, then each expert's).
    pub fn matrices(&self) -> Vec<&M> {
        match self {
            Ffn::Dense { gate, up, down } => vec![gate, up, down],
            Ffn::Experts(e) => std::iter::once(&e.router)
                .chain(e.gate.iter().zip(&e.up).zip(&e.down).flat_map(|((g, u), d)| [g, u, d]))
                .collect(),
        }
    }
}

/// What a forward pass hands back for the rows that ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// Logits over the vocabulary (`vocab` floats a row).
    Logits,
    /// The last hidden state after the output norm (`dim` floats a row):
    /// what the output head reads, and what embeddings pool.
    Hidden,
}

/// A decoder's weights.
#[derive(Clone)]
pub struct Weights<M, V> {
    pub embed: M,
    pub layers: Vec<Layer<M, V>>,
    pub output_norm: V,
    /// The output head (the embedding table where tied).
    pub output: M,
}

/// Runs `rows` through the decoder of `c` and `w` on backend `B`, writing
/// each row's keys and values into `kv`, and appends what `head` asks for
/// of the rows that want output, in order, to `out`.
pub fn forward<'w, B: Backend>(
    c: &Config,
    w: &Weights<B::Matrix<'w>, B::Vector<'w>>,
    rows: &[BatchRow],
    kv: &mut KvView<B::Kv>,
    ws: &mut B::Workspace,
    head: Head,
    logits: &mut Vec<f32>,
) {
    let n = rows.len();
    let max = B::max_rows(ws);
    assert!(n <= max, "batch of {n} rows over the workspace size {max}");
    let dim = c.dim;
    let qd = c.heads * c.head_dim;
    let kvd = c.kv_heads * c.head_dim;
    let nl = c.layers;
    let trace = |ws: &mut B::Workspace, name: &str, l: usize, buf: Buf, len: usize| B::trace(ws, name, l, nl, buf, len);

    let mut laps = Laps::start();
    B::begin(ws, rows, head, kv);
    B::embed(ws, &w.embed, rows);
    if c.embed_scale != 1.0 {
        B::scale(ws, Buf::X, n * dim, c.embed_scale);
    }
    laps.lap(Op::Embed);
    // Where each row's keys and values go (the same in every layer).
    let pt = kv.storage.shape().page_tokens;
    let slots: Vec<KvSlot> = rows
        .iter()
        .map(|row| {
            let index = row.pos / pt;
            let twin = kv
                .twins
                .get(row.seq)
                .and_then(|t| t.get(index))
                .copied()
                .filter(|&t| t != NO_TWIN);
            KvSlot {
                page: kv.pages[row.seq][index],
                slot: row.pos % pt,
                pos: row.pos,
                twin,
            }
        })
        .collect();
    // llama.cpp scales Gemma 3's queries before its attention rounds them
    // to f16, and attends with a scale of 1.
    let prescale = B::LLAMA_CPP_GRAPH && c.arch.llama_cpp_prescales_queries;
    let scale = if prescale { 1.0 } else { c.attn_scale };

    let mut compacted = false;
    // A layer's feed-forward output waits in O to be added to the
    // residual stream with the next layer's first norm (one pass where the
    // backend fuses them), unless the trace wants each layer's output.
    let defer = !super::trace::enabled();
    let mut pending = None;
    let mut live = n;
    trace(ws, "inp_embd", 0, Buf::X, n * dim);
    for (l, layer) in w.layers.iter().enumerate() {
        // Attention block.
        B::add_norm(ws, Buf::X, pending.take(), Buf::H, n * dim, &layer.attn_norm, c.rms_eps);
        trace(ws, "attn_norm", l, Buf::H, n * dim);
        laps.lap(Op::Norm);
        B::matmul_many(
            ws,
            &[&layer.wq, &layer.wk, &layer.wv],
            Buf::H,
            &[Buf::Q, Buf::K, Buf::V],
            n,
        );
        trace(ws, "Qcur_mm", l, Buf::Q, n * qd);
        trace(ws, "Kcur_mm", l, Buf::K, n * kvd);
        trace(ws, "Vcur", l, Buf::V, n * kvd);
        for (buf, bias) in [(Buf::Q, &layer.bq), (Buf::K, &layer.bk), (Buf::V, &layer.bv)] {
            if let Some(b) = bias {
                B::add_bias(ws, buf, n, b);
            }
        }
        if let Some(qn) = &layer.q_norm {
            B::rms_norm(ws, Buf::Q, n * qd, qn, c.rms_eps);
        }
        if let Some(kn) = &layer.k_norm {
            B::rms_norm(ws, Buf::K, n * kvd, kn, c.rms_eps);
        }
        laps.lap(Op::Qkv);
        let rope = c.uses_rope(l).then(|| c.is_local(l));
        B::rope_write_kv(ws, l, rows, rope, &slots, kv.storage);
        trace(ws, "Qcur_rope", l, Buf::Q, n * qd);
        trace(ws, "Kcur_rope", l, Buf::K, n * kvd);
        if prescale {
            B::scale(ws, Buf::Q, n * qd, c.attn_scale);
        }
        laps.lap(Op::Rope);
        B::attention(ws, c, l, rows, kv, scale);
        trace(ws, "kqv_out", l, Buf::Attn, n * qd);
        laps.lap(Op::Attention);
        B::matmul(ws, &layer.wo, Buf::Attn, Buf::O, n);
        trace(ws, "attn_out", l, Buf::O, n * dim);
        laps.lap(Op::AttnOut);
        if let Some(pn) = &layer.post_attn_norm {
            B::rms_norm(ws, Buf::O, n * dim, pn, c.rms_eps);
        }
        if c.residual_scale != 1.0 {
            B::scale(ws, Buf::O, n * dim, c.residual_scale);
        }

        // llama.cpp runs its last layer's feed-forward block on the rows
        // it returns logits for only, so its matrix products see that
        // batch; a backend following its graph does the same (no other
        // row's state after the last layer is used).
        let mut n = n;
        let mut residual = Some(Buf::O);
        if l + 1 == nl && B::LLAMA_CPP_GRAPH {
            B::add(ws, Buf::X, Buf::O, n * dim);
            residual = None;
            let keep: Vec<usize> = (0..n).filter(|&r| rows[r].logits).collect();
            B::gather_rows(ws, Buf::X, Buf::X, dim, &keep);
            n = keep.len();
            compacted = true;
        }

        // Feed-forward block (after the attention block's residual sum).
        B::add_norm(ws, Buf::X, residual, Buf::H, n * dim, &layer.ffn_norm, c.rms_eps);
        trace(ws, "ffn_inp", l, Buf::X, n * dim);
        trace(ws, "ffn_norm", l, Buf::H, n * dim);
        laps.lap(Op::Norm);
        match &layer.ffn {
            Ffn::Dense { gate, up, down } if super::trace::enabled() => {
                // The products' outputs before the activation, traced.
                B::matmul_many(ws, &[gate, up], Buf::H, &[Buf::Gate, Buf::Up], n);
                trace(ws, "ffn_gate", l, Buf::Gate, n * c.ff);
                trace(ws, "ffn_up", l, Buf::Up, n * c.ff);
                laps.lap(Op::GateUp);
                B::gated(ws, c.arch.activation, n, c.ff);
                trace(ws, "ffn_act", l, Buf::Gate, n * c.ff);
                laps.lap(Op::Act);
                B::matmul(ws, down, Buf::Gate, Buf::O, n);
                laps.lap(Op::Down);
            }
            Ffn::Dense { gate, up, down } => {
                // The products and the activation, which a backend may run
                // as one job (the profile then counts the activation in
                // the products' time).
                B::gate_up(ws, gate, up, Buf::H, n, c.ff, c.arch.activation);
                laps.lap(Op::GateUp);
                B::matmul(ws, down, Buf::Gate, Buf::O, n);
                laps.lap(Op::Down);
            }
            Ffn::Experts(e) => {
                B::experts(ws, e, c, n);
                laps.lap(Op::Experts);
            }
        }
        trace(ws, "ffn_out", l, Buf::O, n * dim);
        if let Some(pn) = &layer.post_ffn_norm {
            B::rms_norm(ws, Buf::O, n * dim, pn, c.rms_eps);
        }
        if c.residual_scale != 1.0 {
            B::scale(ws, Buf::O, n * dim, c.residual_scale);
        }
        live = n;
        if defer {
            pending = Some(Buf::O);
        } else {
            B::add(ws, Buf::X, Buf::O, n * dim);
            trace(ws, "l_out", l, Buf::X, n * dim);
        }
        laps.lap(Op::Norm);
    }

    // Logits for the rows that want them.
    if let Some(o) = pending {
        B::add(ws, Buf::X, o, live * dim);
    }
    let want: Vec<usize> = if compacted {
        (0..rows.iter().filter(|r| r.logits).count()).collect()
    } else {
        (0..n).filter(|&r| rows[r].logits).collect()
    };
    let m = want.len();
    B::gather_rows(ws, Buf::X, Buf::Sel, dim, &want);
    B::rms_norm(ws, Buf::Sel, m * dim, &w.output_norm, c.rms_eps);
    let start = logits.len();
    if head == Head::Hidden {
        logits.resize(start + m * dim, 0.0);
        B::read(ws, Buf::Sel, &mut logits[start..]);
        laps.lap(Op::Head);
        return;
    }
    logits.resize(start + m * c.vocab, 0.0);
    B::logits(ws, &w.output, Buf::Sel, m, &mut logits[start..]);
    if c.logit_scale != 1.0 {
        // As llama.cpp scales them: by the divisor's reciprocal.
        let by = 1.0 / c.logit_scale;
        for x in &mut logits[start..] {
            *x *= by;
        }
    }
    laps.lap(Op::Head);
    trace(ws, "result_norm", usize::MAX, Buf::Sel, m * dim);
    super::trace::trace("result_output", usize::MAX, nl, &logits[start..]);
}
