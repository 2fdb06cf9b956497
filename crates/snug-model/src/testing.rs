//! Helpers for tests that need the real models or the shared reference
//! fixtures, used by this workspace's integration tests.
//!
//! A model is found in `$SNUG_TEST_MODELS` (a directory holding the GGUF
//! files) or in snug's cache (`snug pull ALIAS`). When it is missing the test
//! is skipped with a message, unless `SNUG_REQUIRE_MODELS=1` (as CI sets it),
//! which turns a missing model into a failure so that nothing passes
//! without having run. The shared reference fixtures beside the checkout
//! are handled the same way under `SNUG_REQUIRE_FIXTURES=1`.

pub mod hub;
pub mod synth;

use std::path::{Path, PathBuf};

use crate::catalog;

/// snug's cache directory as the `snug` binary finds it. This module is
/// the test harness' side of the library, set up by the environment the
/// tests run in (as `SNUG_REQUIRE_MODELS`), so it reads it itself.
fn cache_dir() -> PathBuf {
    let var = |n: &str| std::env::var_os(n);
    catalog::cache_dir_in(var("SNUG_HOME"), var("XDG_CACHE_HOME"), var("HOME"))
}

/// The four real models, by alias.
pub const MODELS: [&str; 4] = [
    "smollm2-135m",
    "gemma3-270m",
    "qwen2.5-coder-0.5b",
    "qwen2.5-coder-1.5b",
];

/// Whether missing models are failures (`SNUG_REQUIRE_MODELS=1`).
pub fn required() -> bool {
    std::env::var("SNUG_REQUIRE_MODELS").is_ok_and(|v| v == "1")
}

/// Whether missing shared fixtures are failures (`SNUG_REQUIRE_FIXTURES=1`;
/// `scripts/test` sets it in CI and wherever `../shared/fixtures` exists).
pub fn fixtures_required() -> bool {
    std::env::var("SNUG_REQUIRE_FIXTURES").is_ok_and(|v| v == "1")
}

/// The GGUF file of `alias`, or `None` (after a message) when the test
/// should be skipped.
pub fn model_path(alias: &str) -> Option<PathBuf> {
    let entry = catalog::lookup(alias).unwrap_or_else(|| panic!("unknown alias {alias}"));
    if let Some(dir) = std::env::var_os("SNUG_TEST_MODELS") {
        let p = PathBuf::from(dir).join(entry.file_name);
        if p.exists() {
            return Some(p);
        }
    }
    if let Some(p) = entry.cached(&cache_dir()) {
        return Some(p);
    }
    assert!(
        !required(),
        "model {alias} is required (SNUG_REQUIRE_MODELS=1) but not pulled: run `snug pull {alias}`"
    );
    eprintln!("skipping: model {alias} not pulled (run `snug pull {alias}`)");
    None
}

/// The shared fixtures directory, `../shared/fixtures` beside the checkout
/// whose workspace root is `workspace`.
pub fn fixtures_dir(workspace: &Path) -> Option<PathBuf> {
    let p = workspace.join("../shared/fixtures");
    if p.is_dir() {
        return Some(p);
    }
    assert!(
        !required(),
        "shared fixtures are required but {} is missing",
        p.display()
    );
    eprintln!("skipping: shared fixtures not found at {}", p.display());
    None
}

/// A backend a test body runs on: how a model selects it and what it
/// promises.
#[derive(Clone, Copy, Debug)]
pub struct TestBackend {
    pub name: &'static str,
    pub numerics: snug_kernels::ggml::Numerics,
}

impl TestBackend {
    /// Loads the model of `file` to run on this backend.
    pub fn load<'a>(&self, file: &'a crate::ModelFiles) -> Result<crate::arch::Model<'a>, crate::arch::ModelError> {
        let mut m = crate::arch::Model::load(file)?;
        m.numerics = self.numerics;
        Ok(m)
    }
}

/// snug's own CPU arithmetic ([`crate::backend::Native`]).
pub const NATIVE: TestBackend = TestBackend {
    name: "native",
    numerics: snug_kernels::ggml::Numerics::Native,
};

/// llama.cpp's CPU arithmetic ([`crate::backend::LlamaCpp`]). It pairs
/// rows in its matrix products as llama.cpp does, so a row's bits depend
/// on its batch there: it runs the suites that do not promise otherwise.
pub const LLAMA_CPP: TestBackend = TestBackend {
    name: "llama_cpp",
    numerics: snug_kernels::ggml::Numerics::Ggml,
};

/// Runs one test body on every backend, as a module of one test per
/// backend: `test_backends! { fn name(backend) { ... } }`, where `backend`
/// is a [`TestBackend`]. With `batch_invariant:` before `fn`, only on the
/// backends that keep a row's bits whatever its batch (the batch
/// invariance, speculation and prefix-cache suites). A new backend is
/// added to these lists once and inherits every suite.
#[macro_export]
macro_rules! test_backends {
    (batch_invariant: fn $name:ident($b:ident) $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn body($b: $crate::testing::TestBackend) $body
            #[test]
            fn native() {
                body($crate::testing::NATIVE)
            }
        }
    };
    (fn $name:ident($b:ident) $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn body($b: $crate::testing::TestBackend) $body
            #[test]
            fn native() {
                body($crate::testing::NATIVE)
            }
            #[test]
            fn llama_cpp() {
                body($crate::testing::LLAMA_CPP)
            }
        }
    };
}

/// A copy of the GGUF file `bytes` whose chat template is `template`
/// (followed by spaces, so that the data section keeps its alignment).
/// Panics if the file has no chat template.
pub fn with_chat_template(bytes: &[u8], template: &str) -> Vec<u8> {
    let header = crate::GgufHeader::parse(bytes).expect("a GGUF file");
    let key = b"tokenizer.chat_template";
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(key);
    needle.extend_from_slice(&8u32.to_le_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("the file has a chat template")
        + needle.len();
    let old_len = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes")) as usize;
    let align = header.alignment as usize;
    let mut new = template.to_string();
    while new.len() < old_len || !(new.len() - old_len).is_multiple_of(align) {
        new.push(' ');
    }
    let mut out = bytes[..at].to_vec();
    out.extend_from_slice(&(new.len() as u64).to_le_bytes());
    out.extend_from_slice(new.as_bytes());
    out.extend_from_slice(&bytes[at + 8 + old_len..]);
    out
}
