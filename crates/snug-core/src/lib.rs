//! snug's bookkeeping, with no tensors in it: which KV pages exist, which
//! sequence uses which, and what a change to that costs; the drafter and
//! the speculation policy; and the memory ledger's counters. Everything here is plain data with fast unit tests;
//! the engine applies the plans it makes to the tensor storage.

pub mod alloc;
pub mod draft;
pub mod durable;
pub mod ledger;
pub mod pages;
pub mod prefix;
pub mod schedule;
pub mod speculate;
pub mod twins;

pub use alloc::CountingAlloc;
pub use ledger::Ledger;
pub use pages::{PageId, PagePool, PageTable, PagesError};
