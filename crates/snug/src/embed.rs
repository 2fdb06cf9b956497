//! `snug embed`: text to vectors, from a sentence-embedding checkpoint
//! (the vectors its reference computes) or from a GGUF decoder (its
//! tokens' last hidden states, pooled and scaled to unit length, as
//! `/v1/embeddings` serves them).

use std::io::{BufRead, IsTerminal};

use anyhow::{bail, Context, Result};
use clap::Args;
use snug_engine::{Engine, EngineOptions};
use snug_model::sentence::SentenceModel;
use snug_model::{EncodeOptions, Tokenizer};

#[derive(Args)]
pub struct EmbedArgs {
    /// A sentence-embedding checkpoint (a directory, or the alias
    /// all-minilm-l6-v2), or a GGUF model alias or file.
    #[arg(default_value = "all-minilm-l6-v2")]
    pub model: String,
    /// The texts; without any (and without --file), one text per line of
    /// standard input.
    pub texts: Vec<String>,
    /// A file with one text per line.
    #[arg(short = 'f', long)]
    pub file: Option<std::path::PathBuf>,
    /// Print one OpenAI-style embeddings object instead of a JSON array
    /// per line.
    #[arg(long)]
    pub json: bool,
    /// Compute threads [default: the physical cores].
    #[arg(short = 't', long, value_parser = crate::parse_threads)]
    pub threads: Option<usize>,
}

fn texts(a: &EmbedArgs) -> Result<Vec<String>> {
    let mut texts = a.texts.clone();
    if let Some(f) = &a.file {
        let body = snug_core::durable::read_regular_string(f).with_context(|| format!("{}", f.display()))?;
        texts.extend(body.lines().filter(|l| !l.trim().is_empty()).map(str::to_string));
    } else if texts.is_empty() {
        let stdin = std::io::stdin();
        if stdin.is_terminal() {
            eprintln!("(reading texts from standard input, one per line; end with Ctrl-D)");
        }
        for line in stdin.lock().lines() {
            let line = line.context("reading standard input")?;
            if !line.trim().is_empty() {
                texts.push(line);
            }
        }
    }
    if texts.is_empty() {
        bail!("no texts to embed: give them as arguments, with --file, or on standard input");
    }
    Ok(texts)
}

pub fn cmd_embed(a: EmbedArgs) -> Result<()> {
    let texts = texts(&a)?;
    let t0 = std::time::Instant::now();
    let (vectors, tokens) = match crate::encoder_checkpoint(&a.model)? {
        Some(dir) if snug_model::sentence::is_checkpoint(&dir) => {
            let threads = a.threads.unwrap_or_else(snug_kernels::pool::physical_cores);
            let m = SentenceModel::open(&dir, threads).with_context(|| format!("{}", dir.display()))?;
            let inputs = texts.iter().map(|t| m.tokenize(t)).collect::<Result<Vec<_>, _>>()?;
            if let Some((i, t)) = inputs.iter().enumerate().find(|(_, t)| t.len() > m.max_tokens) {
                bail!(
                    "text {} has {} tokens; {} takes at most {} (its max_seq_length); split it",
                    i + 1,
                    t.len(),
                    a.model,
                    m.max_tokens
                );
            }
            let tokens = inputs.iter().map(Vec::len).sum::<usize>();
            (m.embed(&inputs)?, tokens)
        }
        Some(dir) => bail!(
            "{}: a Laya checkpoint answers decisions (snug decide), it makes no embeddings",
            dir.display()
        ),
        None => {
            let (_, file) = crate::open_model_at(&a.model)?;
            let model = crate::load_model(&file, &crate::KvArgs::default())?;
            let tok = Tokenizer::from_gguf(&file)?;
            let inputs: Vec<Vec<u32>> = texts
                .iter()
                .map(|t| {
                    tok.encode(
                        t,
                        EncodeOptions {
                            add_special: true,
                            parse_special: false,
                        },
                    )
                })
                .collect();
            let ctx = model.config.context_length.min(8192);
            if let Some((i, t)) = inputs.iter().enumerate().find(|(_, t)| t.len() > ctx) {
                bail!("text {} has {} tokens, over the context of {ctx}", i + 1, t.len());
            }
            let mut o = EngineOptions {
                ctx,
                max_seqs: 8,
                batch: 512,
                prefix_cache: false,
                ..EngineOptions::default()
            };
            if let Some(t) = a.threads {
                o.threads = t;
            }
            let mut engine = Engine::new(&model, o);
            let tokens = inputs.iter().map(Vec::len).sum::<usize>();
            (engine.embed_batch(&inputs)?, tokens)
        }
    };
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        // Built as a struct (not `json!`) so each float prints as its
        // shortest f32 form, as the per-line output does.
        #[derive(serde::Serialize)]
        struct Item<'a> {
            object: &'static str,
            index: usize,
            embedding: &'a [f32],
        }
        let data: Vec<Item> = vectors
            .iter()
            .enumerate()
            .map(|(index, v)| Item {
                object: "embedding",
                index,
                embedding: v,
            })
            .collect();
        #[derive(serde::Serialize)]
        struct Usage {
            prompt_tokens: usize,
            total_tokens: usize,
        }
        #[derive(serde::Serialize)]
        struct Body<'a> {
            object: &'static str,
            data: Vec<Item<'a>>,
            model: &'a str,
            usage: Usage,
        }
        let body = Body {
            object: "list",
            data,
            model: &a.model,
            usage: Usage {
                prompt_tokens: tokens,
                total_tokens: tokens,
            },
        };
        println!("{}", serde_json::to_string(&body)?);
    } else {
        for v in &vectors {
            println!("{}", serde_json::to_string(v)?);
        }
    }
    eprintln!(
        "[{} texts, {} tokens, {} dimensions, {:.0} ms]",
        vectors.len(),
        tokens,
        vectors.first().map_or(0, Vec::len),
        secs * 1e3
    );
    Ok(())
}
