//! Helpers shared by the integration tests: locating real models and the
//! shared reference fixtures.
//!
//! Tests that need a real model find it in snug's cache (`snug pull ALIAS`)
//! or in `$SNUG_TEST_MODELS` (a directory holding the GGUF files). When a
//! model is missing the test is skipped with a message, unless
//! `SNUG_REQUIRE_MODELS=1` (as CI sets it), which turns a missing model into
//! a failure so that nothing passes without having run.

#![allow(dead_code)]

use std::path::PathBuf;

use snug_model::catalog;

pub fn require() -> bool {
    std::env::var("SNUG_REQUIRE_MODELS").is_ok_and(|v| v == "1")
}

/// The GGUF file of `alias`, or `None` (after a message) when the test
/// should be skipped.
pub fn model_path(alias: &str) -> Option<PathBuf> {
    let entry = catalog::lookup(alias).expect("known alias");
    if let Some(dir) = std::env::var_os("SNUG_TEST_MODELS") {
        let p = PathBuf::from(dir).join(entry.file_name);
        if p.exists() {
            return Some(p);
        }
    }
    if let Some(p) = entry.cached(&catalog::cache_dir()) {
        return Some(p);
    }
    if require() {
        panic!("model {alias} is required (SNUG_REQUIRE_MODELS=1) but not pulled: run `snug pull {alias}`");
    }
    eprintln!("skipping: model {alias} not pulled (run `snug pull {alias}`)");
    None
}

/// The shared fixtures directory (`../shared/fixtures` beside the checkout).
pub fn fixtures_dir() -> Option<PathBuf> {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/fixtures"
    ));
    if p.is_dir() {
        return Some(p);
    }
    if require() {
        panic!(
            "shared fixtures are required but {} is missing",
            p.display()
        );
    }
    eprintln!("skipping: shared fixtures not found at {}", p.display());
    None
}

/// This crate's own test data.
pub fn data_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data"))
}

/// The four real models: alias and fixture key are the same.
pub const MODELS: [&str; 4] = [
    "smollm2-135m",
    "gemma3-270m",
    "qwen2.5-coder-0.5b",
    "qwen2.5-coder-1.5b",
];
