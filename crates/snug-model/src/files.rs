//! A model's files as the caller holds them: the GGUF file and the panels
//! its matrices are packed into (in memory, or mapped from a cache file),
//! opened once under [`LoadOptions`]. [`crate::arch::Model`] borrows both.

use std::path::Path;

use crate::gguf::{GgufError, GgufFile};
use crate::packed::{PackMode, PackedWeights};

/// How a model's files are opened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Where the matrices are packed into panels (in memory unless told
    /// otherwise).
    pub pack: PackMode,
}

/// A GGUF model file and its packed panels.
pub struct ModelFiles {
    pub gguf: GgufFile,
    packed: Option<PackedWeights>,
}

/// The matrices the decoder multiplies by, by name, in the order they are
/// packed: each layer's seven (or Phi-3's fused ones), then the output head (the embedding table
/// where the head is tied).
fn decoder_matrices(file: &GgufFile) -> Vec<String> {
    let layers = file
        .architecture()
        .and_then(|a| file.get_u64(&format!("{a}.block_count")))
        .unwrap_or(0);
    let mut names = Vec::new();
    for l in 0..layers {
        for m in [
            "attn_q",
            "attn_k",
            "attn_v",
            // Phi-3's query, key and value matrices in one.
            "attn_qkv",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            // A mixture of experts: the router, and every expert's
            // matrices stacked in one tensor each.
            "ffn_gate_inp",
            "ffn_gate_exps",
            "ffn_up_exps",
            "ffn_down_exps",
        ] {
            names.push(format!("blk.{l}.{m}.weight"));
        }
    }
    names.push(if file.tensor("output.weight").is_some() {
        "output.weight".into()
    } else {
        "token_embd.weight".into()
    });
    names
}

impl ModelFiles {
    /// Opens the GGUF file at `path` and packs its matrices per `options`.
    pub fn open(path: &Path, options: &LoadOptions) -> Result<ModelFiles, GgufError> {
        Ok(ModelFiles::new(GgufFile::open(path)?, options))
    }

    /// `gguf` with its matrices packed per `options`.
    pub fn new(gguf: GgufFile, options: &LoadOptions) -> ModelFiles {
        let names = decoder_matrices(&gguf);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let packed = PackedWeights::for_model(&gguf, &refs, &options.pack);
        if packed.is_some() {
            // Packing read the matrices through the map; compute reads the
            // panels from now on, so give those pages back.
            gguf.release_all();
        }
        ModelFiles { gguf, packed }
    }

    /// The panels, where any matrix is packed.
    pub fn packed(&self) -> Option<&PackedWeights> {
        self.packed.as_ref()
    }

    /// Drops this process' resident pages of `bytes` (tensor data lent by
    /// the model file or its panels); they are read again on next use.
    /// Returns the bytes advised. Used to lease out parts of the weights a
    /// phase of work does not read.
    pub fn release(&self, bytes: &[u8]) -> u64 {
        let n = self.gguf.release(bytes);
        if n > 0 {
            return n;
        }
        self.packed.as_ref().map_or(0, |p| p.release(bytes))
    }

    /// Bytes of the model mapped for compute: the file and its panels.
    pub fn mapped_bytes(&self) -> u64 {
        self.gguf.file_size() + self.packed.as_ref().map_or(0, |p| p.len())
    }

    /// Bytes of the file and its panels resident in this process.
    pub fn weights_resident_bytes(&self) -> Option<u64> {
        let packed = match &self.packed {
            Some(p) => p.resident_bytes()?,
            None => 0,
        };
        Some(self.gguf.resident_bytes()? + packed)
    }
}

/// The GGUF file's reading methods (header, tensors) on the pair.
impl std::ops::Deref for ModelFiles {
    type Target = GgufFile;
    fn deref(&self) -> &GgufFile {
        &self.gguf
    }
}
