//! What the engine, sessions and the prefix cache's disk tier may do with a
//! backend's KV pages, without reading their bytes in place: the page
//! table is the engine's, the bytes are the backend's. Pages move between
//! backends (and to files) through host buffers, as runs of bytes in the
//! order [`KvStore::export_page`] hands them out and
//! [`KvStore::import_page`] takes them back.

use super::{KvFormat, KvShape};
use crate::kvbasis::KeyBasis;

/// A backend's KV pages (and twin pages: an exact F16 copy of the pages
/// of the exact window when keys or values are stored lossily).
pub trait KvStore {
    fn shape(&self) -> KvShape;

    /// The formats of keys and of values.
    fn formats(&self) -> (KvFormat, KvFormat);

    /// Whether either part is stored lossily (Q8 or TQ4): then the engine
    /// keeps an exact window in twin pages.
    fn is_lossy(&self) -> bool {
        let (k, v) = self.formats();
        [k, v].iter().any(|f| matches!(f, KvFormat::Q8 | KvFormat::Tq4))
    }

    /// Pages held.
    fn n_pages(&self) -> usize;

    /// Bytes of one page (keys and values of every layer).
    fn page_bytes(&self) -> usize;

    /// Bytes of every page.
    fn bytes(&self) -> usize {
        self.page_bytes() * self.n_pages()
    }

    /// Bytes of one twin page.
    fn twin_page_bytes(&self) -> usize {
        self.shape().page_bytes(KvFormat::F16)
    }

    /// Bytes of the twins, and of the key basis and its tables.
    fn exact_window_bytes(&self) -> usize;

    /// Copies page `from` over page `to`.
    fn copy_page(&mut self, from: u32, to: u32);

    /// Copies twin `from` over twin `to`.
    fn copy_twin(&mut self, from: u32, to: u32);

    /// Bytes the first `slots` positions of a page (a twin when `twin`)
    /// take as stored, and so as exported.
    fn stored_bytes(&self, slots: usize, twin: bool) -> usize;

    /// Hands `f` the stored bytes of the first `slots` positions of page
    /// `page` (twin `page` when `twin`), in runs.
    fn export_page<E>(
        &self,
        page: u32,
        slots: usize,
        twin: bool,
        f: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<(), E>;

    /// Fills the first `slots` positions of page `page` (twin `page` when
    /// `twin`) run by run, in the order [`KvStore::export_page`] hands
    /// them out: `f` writes each run.
    fn import_page<E>(
        &mut self,
        page: u32,
        slots: usize,
        twin: bool,
        f: impl FnMut(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E>;

    /// The rotation signs of every (layer, KV head), which decide the
    /// stored bytes of Q8 and TQ4 (empty for the unrotated formats).
    fn rotation_signs(&self) -> &[Vec<u64>];

    /// The key basis TQ4 keys are coded in, if any.
    fn key_basis(&self) -> Option<&KeyBasis>;
}
