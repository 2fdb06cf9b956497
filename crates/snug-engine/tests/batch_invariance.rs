//! A row's logits and the KV it writes are bitwise the same however it is
//! batched: a prompt as one chunk, as uneven chunks, or token by token; a
//! sequence decoded alone or beside another; a row first or last in its
//! batch. Checked on all four real models.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use snug_engine::StepRow;
use snug_engine::{Engine, EngineOptions};
use snug_kernels::kv::KvFormat;
use snug_model::arch::Model;
use snug_model::testing::{model_path, MODELS};
use snug_model::{EncodeOptions, LoadOptions, ModelFiles, Tokenizer};

const PROMPT: &str = "In 1905, Albert Einstein published four papers that changed physics: on the photoelectric \
effect, Brownian motion, special relativity, and the equivalence of mass and energy. Each one, on its own, \
would have made a career; together they made a year that physicists still call miraculous.";

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Feeds `tokens` to a fresh sequence in chunks of the given sizes and
/// returns the logits after every token.
fn logits_by_chunks(engine: &mut Engine, tokens: &[u32], chunks: &[usize]) -> Vec<Vec<u32>> {
    let seq = engine.create_sequence();
    let vocab = engine.model.config.vocab;
    let mut out = Vec::new();
    let mut at = 0;
    for &n in chunks {
        let rows: Vec<StepRow> = tokens[at..at + n].iter().map(|&t| StepRow::new(seq, t, true)).collect();
        let l = engine.step(&rows).unwrap();
        out.extend(l.chunks_exact(vocab).map(bits));
        at += n;
    }
    assert_eq!(at, tokens.len());
    engine.free_sequence(seq);
    out
}

fn options() -> EngineOptions {
    EngineOptions {
        threads: 2,
        ctx: 128,
        batch: 64,
        max_seqs: 4,
        page_tokens: 16,
        ..Default::default()
    }
}

/// Options with keys and values in TQ4, keys in the model's calibrated
/// basis, and an exact window.
fn tq4_options(model: &Model, tok: &Tokenizer) -> EngineOptions {
    let ids = tok.encode(
        snug_engine::calibrate::TEXT,
        EncodeOptions {
            add_special: true,
            parse_special: false,
        },
    );
    EngineOptions {
        kv_format: KvFormat::Tq4,
        key_basis: Some(snug_engine::calibrate::key_basis(model, &ids, 2).unwrap()),
        ..options()
    }
}

snug_model::test_backends! {
    batch_invariant: fn chunking_never_changes_a_rows_logits(backend) {
        for alias in MODELS {
            let Some(path) = model_path(alias) else { continue };
            let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
            let model = backend.load(&file).unwrap();
            let tok = Tokenizer::from_gguf(&file).unwrap();
            let mut ids = tok.encode(PROMPT, EncodeOptions::default());
            ids.truncate(37);
            assert_eq!(ids.len(), 37, "{alias}: prompt too short");
            // TQ4 pages with the exact window: which pages a row reads from
            // twins depends on its position alone.
            let mut engine = Engine::new(&model, tq4_options(&model, &tok));
            let whole = logits_by_chunks(&mut engine, &ids, &[37]);
            for chunks in [&[1, 7, 29][..], &[16, 5, 16], &[1; 37]] {
                let other = logits_by_chunks(&mut engine, &ids, chunks);
                assert!(whole == other, "{alias}: TQ4, chunks {chunks:?} differ from one chunk");
            }
            let mut engine = Engine::new(&model, options());
            let whole = logits_by_chunks(&mut engine, &ids, &[37]);
            let split = logits_by_chunks(&mut engine, &ids, &[1, 7, 29]);
            let single = logits_by_chunks(&mut engine, &ids, &[1; 37]);
            for p in 0..37 {
                assert!(
                    whole[p] == split[p],
                    "{alias}: position {p}, 1+7+29 chunks differ from one chunk"
                );
                assert!(
                    whole[p] == single[p],
                    "{alias}: position {p}, token by token differs from one chunk"
                );
            }
            // A batch wider than the scratch is split by the engine: same bits.
            let mut narrow = Engine::new(&model, EngineOptions { batch: 5, ..options() });
            let narrow_whole = logits_by_chunks(&mut narrow, &ids, &[37]);
            assert!(whole == narrow_whole, "{alias}: engine batch width changed logits");
        }
    }
}

snug_model::test_backends! {
    fn panels_packed_at_load_change_no_bits(backend) {
        for alias in MODELS {
            let Some(path) = model_path(alias) else { continue };
            let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
            let packed = backend.load(&file).unwrap();
            if snug_kernels::panel::available(snug_kernels::GgmlType::Q8_0) && std::env::var("SNUG_PACK").is_err() {
                assert!(packed.packed_matrices() > 0, "{alias}: nothing packed");
            }
            let plain = packed.without_packed_panels();
            assert_eq!(plain.packed_matrices(), 0);
            let tok = Tokenizer::from_gguf(&file).unwrap();
            let mut ids = tok.encode(PROMPT, EncodeOptions::default());
            ids.truncate(37);
            // One chunk (panels either way: packed at load, or per call) and
            // token by token (packed panels against the row-at-a-time kernels).
            for chunks in [&[37][..], &[1; 37][..]] {
                let a = logits_by_chunks(&mut Engine::new(&packed, options()), &ids, chunks);
                let b = logits_by_chunks(&mut Engine::new(&plain, options()), &ids, chunks);
                for p in 0..37 {
                    assert!(
                        a[p] == b[p],
                        "{alias}: position {p} differs with packed panels ({} chunks)",
                        chunks.len()
                    );
                }
            }
        }
    }
}

snug_model::test_backends! {
    batch_invariant: fn decoding_beside_other_sequences_never_changes_a_rows_logits(backend) {
        for alias in MODELS {
            let Some(path) = model_path(alias) else { continue };
            let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
            let model = backend.load(&file).unwrap();
            let tok = Tokenizer::from_gguf(&file).unwrap();
            let vocab = model.config.vocab;
            let a_ids = tok.encode("The quick brown fox", EncodeOptions::default());
            let b_ids = tok.encode("def add(a, b):\n    return", EncodeOptions::default());
            let mut engine = Engine::new(&model, options());

            // Alone.
            let a = engine.create_sequence();
            engine.feed(a, &a_ids).unwrap();
            let alone_a = bits(engine.feed(a, &[a_ids[0]]).unwrap());
            let b = engine.create_sequence();
            engine.feed(b, &b_ids).unwrap();
            let alone_b = bits(engine.feed(b, &[b_ids[0]]).unwrap());
            engine.free_sequence(a);
            engine.free_sequence(b);

            // Together, in both orders, and with the prompts prefilled together.
            for swap in [false, true] {
                let a = engine.create_sequence();
                let b = engine.create_sequence();
                let mut rows: Vec<StepRow> = a_ids.iter().map(|&t| StepRow::new(a, t, false)).collect();
                rows.extend(b_ids.iter().map(|&t| StepRow::new(b, t, false)));
                engine.step(&rows).unwrap();
                let step = if swap {
                    vec![StepRow::new(b, b_ids[0], true), StepRow::new(a, a_ids[0], true)]
                } else {
                    vec![StepRow::new(a, a_ids[0], true), StepRow::new(b, b_ids[0], true)]
                };
                let l = engine.step(&step).unwrap().to_vec();
                let (la, lb) = if swap {
                    (&l[vocab..], &l[..vocab])
                } else {
                    (&l[..vocab], &l[vocab..])
                };
                assert!(
                    bits(la) == alone_a,
                    "{alias}: sequence A changed beside B (swap {swap})"
                );
                assert!(
                    bits(lb) == alone_b,
                    "{alias}: sequence B changed beside A (swap {swap})"
                );
                engine.free_sequence(a);
                engine.free_sequence(b);
            }
        }
    }
}

snug_model::test_backends! {
    fn rollback_and_fork_reproduce_the_same_logits(backend) {
        let Some(path) = model_path("smollm2-135m") else { return };
        let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
        let model = backend.load(&file).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let ids = tok.encode(PROMPT, EncodeOptions::default());
        let mut engine = Engine::new(&model, options());
        let s = engine.create_sequence();
        engine.feed(s, &ids[..20]).unwrap();
        let first = bits(engine.feed(s, &ids[20..25]).unwrap());
        // Roll back five positions (a rejected draft) and feed them again.
        engine.truncate(s, 20).unwrap();
        assert_eq!(bits(engine.feed(s, &ids[20..25]).unwrap()), first);
        // A fork shares the first 25 positions and continues on its own pages.
        let f = engine.fork(s).unwrap();
        let from_fork = bits(engine.feed(f, &ids[25..27]).unwrap());
        let from_orig = bits(engine.feed(s, &ids[25..27]).unwrap());
        assert_eq!(from_fork, from_orig);
    }
}

snug_model::test_backends! {
    batch_invariant: fn a_deep_rollback_over_tq4_rebuilds_the_exact_window_bit_for_bit(backend) {
        // Truncating far back leaves the partly filled last page without its
        // F16 twin; the engine recomputes that page's positions. What follows
        // must be what a sequence that never went further computes.
        for alias in ["smollm2-135m", "qwen2.5-coder-0.5b"] {
            let Some(path) = model_path(alias) else { continue };
            let file = ModelFiles::open(&path, &LoadOptions::default()).unwrap();
            let model = backend.load(&file).unwrap();
            let tok = Tokenizer::from_gguf(&file).unwrap();
            let ids = tok.encode(&format!("{PROMPT} {PROMPT}"), EncodeOptions::default());
            assert!(ids.len() > 100, "{alias}: prompt too short");
            let mut engine = Engine::new(&model, tq4_options(&model, &tok));
            let fresh = engine.create_sequence();
            engine.feed(fresh, &ids[..41]).unwrap();
            let want = bits(engine.feed(fresh, &ids[41..45]).unwrap());
            let s = engine.create_sequence();
            engine.feed(s, &ids[..100]).unwrap();
            engine.truncate(s, 41).unwrap();
            assert_eq!(engine.tokens(s).unwrap(), &ids[..41]);
            assert_eq!(bits(engine.feed(s, &ids[41..45]).unwrap()), want, "{alias}");
            // A fork gets copies of the twins and continues alike.
            let f = engine.fork(s).unwrap();
            let a = bits(engine.feed(f, &ids[45..47]).unwrap());
            let b = bits(engine.feed(s, &ids[45..47]).unwrap());
            assert_eq!(a, b, "{alias}: fork");
        }
    }
}
