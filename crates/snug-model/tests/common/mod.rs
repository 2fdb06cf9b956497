//! Paths shared by this crate's integration tests.

#![allow(dead_code, unused_imports)]

use std::path::PathBuf;

pub use snug_model::testing::{model_path, MODELS};

/// The shared fixtures directory beside the checkout.
pub fn fixtures_dir() -> Option<PathBuf> {
    snug_model::testing::fixtures_dir(&PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")))
}

/// This crate's own test data.
pub fn data_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data"))
}
