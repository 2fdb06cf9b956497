//! Facts about this process' file mappings, and giving their pages back:
//! shared by the model file and its panel cache file.

use memmap2::Mmap;

/// `Rss` of the mapping that starts at `start`, from `/proc/self/smaps`.
pub(crate) fn mapping_rss(start: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut in_mapping = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, _)) = first.split_once('-') {
            if let Ok(lo) = usize::from_str_radix(lo, 16) {
                in_mapping = lo == start;
                continue;
            }
        }
        if in_mapping {
            if let Some(rest) = line.strip_prefix("Rss:") {
                let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
                return Some(kb * 1024);
            }
        }
    }
    None
}

/// `madvise(MADV_DONTNEED)` over the whole pages of `bytes` that lie in the
/// read-only file map `map`; 0 when `bytes` is not in it.
pub(crate) fn release_range(map: &Mmap, bytes: &[u8]) -> u64 {
    let base = map.as_ptr() as usize;
    let (lo, hi) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
    if lo < base || hi > base + map.len() || bytes.is_empty() {
        return 0;
    }
    const PAGE: usize = 4096;
    let start = (lo - base).div_ceil(PAGE) * PAGE;
    let end = (hi - base) / PAGE * PAGE;
    if end <= start {
        return 0;
    }
    // SAFETY: the map is a read-only view of a file, so dropped pages are
    // re-read unchanged on access.
    #[cfg(unix)]
    if unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) }.is_ok() {
        return (end - start) as u64;
    }
    0
}
