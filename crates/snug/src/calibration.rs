//! A per-machine cache of the forward costs that `--speculate auto`
//! measures before its first draft (forwards of 1, 2, 3, 5 and 9 rows), so that
//! later runs of the same model file with the same thread count skip the
//! measurement. One small JSON file per (model file, size, threads, SIMD
//! path, panels packed or not) under `~/.cache/snug/calibration/`; delete it to measure again.
//! A missing, unreadable or malformed file is ignored (the run measures), and
//! so is one another build of snug wrote: a build's kernels set the costs,
//! and a policy that reads a slower build's 9-row cost drafts too short.

use std::fs;
use std::path::{Path, PathBuf};

use snug_engine::Engine;

const VERSION: u64 = 2;

/// Where one model's costs are cached, and whether they were loaded.
pub struct Calibration {
    path: Option<PathBuf>,
    loaded: bool,
}

/// The cache file for `model` run with `threads` threads.
fn cache_path(model: &Path, threads: usize, panels: bool) -> Option<PathBuf> {
    let len = fs::metadata(model).ok()?.len();
    let name = model
        .file_name()?
        .to_string_lossy()
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '.', "_");
    let simd = snug_kernels::cpu::kernels_name();
    // Panels packed at load change the costs (the rows' bits stay).
    let simd = if panels {
        format!("{simd}-panels")
    } else {
        simd.to_string()
    };
    Some(
        crate::env::get()
            .cache
            .clone()
            .join("calibration")
            .join(format!("{name}-{len}-t{threads}-{simd}.json")),
    )
}

/// This build of snug: its version and its executable's size and time
/// (a rebuilt binary measures again).
fn build() -> String {
    let exe = std::env::current_exe().and_then(fs::metadata);
    let (len, secs) = exe.map_or((0, 0), |m| {
        let t = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        (m.len(), t.map_or(0, |t| t.as_secs()))
    });
    format!("{} {len} {secs}", env!("CARGO_PKG_VERSION"))
}

fn parse(text: &str, build: &str) -> Option<Vec<(usize, f64)>> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    if v.get("version")?.as_u64()? != VERSION || v.get("build")?.as_str()? != build {
        return None;
    }
    v.get("costs")?
        .as_array()?
        .iter()
        .map(|e| Some((e.get(0)?.as_u64()? as usize, e.get(1)?.as_f64()?)))
        .collect()
}

/// Seeds `engine` with cached costs for `model`, if there are any.
pub fn load(model: &Path, threads: usize, engine: &mut Engine) -> Calibration {
    let path = cache_path(model, threads, engine.model.packed_matrices() > 0);
    let costs = path
        .as_ref()
        .and_then(|p| fs::read_to_string(p).ok())
        .and_then(|t| parse(&t, &build()));
    if let Some(c) = &costs {
        engine.set_speculation_costs(c);
    }
    let loaded = engine.known_speculation_costs().is_some();
    Calibration { path, loaded }
}

/// Writes the costs `engine` measured, when none were loaded (temp file,
/// fsync, rename: a reader never sees half a file). Failures are ignored:
/// the cache only saves time.
pub fn save(c: &mut Calibration, engine: &Engine) {
    let (Some(path), false, Some(costs)) = (&c.path, c.loaded, engine.known_speculation_costs()) else {
        return;
    };
    let _ = write(path, costs, &build());
    c.loaded = true;
}

fn write(path: &Path, costs: &[(usize, f64)], build: &str) -> std::io::Result<()> {
    let dir = path.parent().expect("cache paths have a parent");
    fs::create_dir_all(dir)?;
    let body = serde_json::json!({
        "version": VERSION,
        "build": build,
        "costs": costs.iter().map(|&(r, s)| serde_json::json!([r, s])).collect::<Vec<_>>(),
    });
    snug_core::durable::write(path, body.to_string().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_it_writes_and_rejects_the_rest() {
        let dir = std::env::temp_dir().join(format!("snug-calibration-{}", std::process::id()));
        let path = dir.join("m.json");
        let b = build();
        write(&path, &[(1, 0.01), (9, 0.03)], &b).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let got = parse(&text, &b).unwrap();
        assert_eq!(got, vec![(1, 0.01), (9, 0.03)]);
        // Another build's costs are measured again.
        assert!(parse(&text, "0.0.0 1 2").is_none());
        assert!(parse("{", &b).is_none());
        // A file of an earlier version (1: two row counts) is measured again,
        // and one without a build.
        assert!(parse(r#"{"version": 1, "costs": [[1, 0.01], [9, 0.03]]}"#, &b).is_none());
        assert!(parse(r#"{"version": 2, "costs": [[1, 0.01], [9, 0.03]]}"#, &b).is_none());
        assert!(parse(&format!(r#"{{"version": 2, "build": "{b}", "costs": [[1, "x"]]}}"#), &b).is_none());
        fs::remove_dir_all(&dir).unwrap();
    }
}
