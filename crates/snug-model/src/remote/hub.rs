//! The hub's side of a pull: which files a repository has (its tree
//! listing), and which of them a name means.
//!
//! The listing is `GET {endpoint}/api/models/OWNER/REPO/tree/main?recursive=true`:
//! a JSON array of `{"type", "path", "size", "lfs": {"oid", "size"}}`
//! entries, paged by a `Link: <...>; rel="next"` header. An LFS file's
//! `oid` is the SHA-256 of its bytes; a file kept in git alone has none
//! (its `oid` is git's SHA-1 of a blob, which checks nothing here).
//!
//! Choosing: a repository of quantizations holds one GGUF file per
//! quantization, named for it (`Model-Q4_K_M.gguf`, `model.q8_0.gguf`).
//! With one GGUF file, that one; with several, the one `--quant` names,
//! or `Q4_K_M` if it is there (ollama's and llama.cpp's default too);
//! otherwise the error lists them. Vision projectors (`mmproj*`) are never
//! picked by themselves, and a model split into several files is refused
//! by name, since snug reads one file.

use serde::Deserialize;

use super::http::{Answer, Client};
use super::{check_component, is_sha256};
use crate::pull::PullError;
use snug_core::ledger::human_bytes as human;

/// The quantization picked among several files when none is named.
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// One file of a repository.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoFile {
    /// Its path in the repository.
    pub path: String,
    pub size: u64,
    /// The SHA-256 the hub publishes for it (LFS files).
    pub sha256: Option<String>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(rename = "type", default)]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    lfs: Option<Lfs>,
}

/// The tree listing says `oid`; the model API's `siblings` say `sha256`.
#[derive(Deserialize)]
struct Lfs {
    #[serde(default)]
    oid: Option<String>,
    #[serde(default)]
    sha256: Option<String>,
    #[serde(default)]
    size: Option<u64>,
}

/// A listing larger than this is not a repository's.
const MAX_LISTING_BYTES: u64 = 64 << 20;
/// Pages of a listing followed at most.
const MAX_PAGES: usize = 1000;

/// The files of `repo` on `main`.
pub(super) fn list(client: &Client, endpoint: &str, repo: &str) -> Result<Vec<RepoFile>, PullError> {
    let mut url = format!("{endpoint}/api/models/{repo}/tree/main?recursive=true");
    let mut files = Vec::new();
    for _ in 0..MAX_PAGES {
        let answer = client.get(&url, None, None)?.expect_ok(&format!("hf:{repo}"))?;
        let next = answer.link_next();
        let body = answer.read_all(MAX_LISTING_BYTES)?;
        let entries: Vec<Entry> = serde_json::from_slice(&body).map_err(|e| PullError::BadAnswer {
            url: url.clone(),
            reason: format!("the file listing is not the hub's JSON ({e})"),
        })?;
        // A path that could leave the repository's folder in the cache
        // (`..`, a hidden name) is no file a name can pick.
        let safe = |p: &str| p.split('/').all(|c| check_component(c).is_ok());
        for e in entries.into_iter().filter(|e| e.kind == "file" && safe(&e.path)) {
            let (sha256, size) = match e.lfs {
                Some(lfs) => (lfs.oid.or(lfs.sha256), lfs.size.unwrap_or(e.size)),
                None => (None, e.size),
            };
            let sha256 = sha256
                .map(|s| s.trim_start_matches("sha256:").to_ascii_lowercase())
                .filter(|s| is_sha256(s));
            files.push(RepoFile {
                path: e.path,
                size,
                sha256,
            });
        }
        match next {
            Some(n) => url = n,
            None => return Ok(files),
        }
    }
    Err(PullError::BadAnswer {
        url,
        reason: format!("the file listing goes on past {MAX_PAGES} pages"),
    })
}

impl Answer {
    /// The `rel="next"` target of a `Link` header.
    fn link_next(&self) -> Option<String> {
        let link = self.header("link")?;
        link.split(',').find_map(|part| {
            let (target, params) = part.split_once(';')?;
            let target = target.trim().strip_prefix('<')?.strip_suffix('>')?;
            params
                .split(';')
                .any(|p| matches!(p.trim(), "rel=\"next\"" | "rel=next"))
                .then(|| self.resolve(target))
        })
    }
}

/// The file `path` of `repo`, from its listing.
pub(super) fn find<'a>(repo: &str, files: &'a [RepoFile], path: &str) -> Result<&'a RepoFile, PullError> {
    files.iter().find(|f| f.path == path).ok_or_else(|| PullError::NoFile {
        repo: repo.to_string(),
        file: path.to_string(),
        files: describe(&candidates(files)),
    })
}

/// The GGUF file of `repo` that `quant` (or, without it, the rule in this
/// module's docs) picks among `files`.
pub fn choose<'a>(repo: &str, files: &'a [RepoFile], quant: Option<&str>) -> Result<&'a RepoFile, PullError> {
    let all = candidates(files);
    if all.is_empty() {
        return Err(PullError::NoGguf { repo: repo.to_string() });
    }
    let matching =
        |q: &str| -> Vec<&'a RepoFile> { all.iter().copied().filter(|f| quant_matches(&f.path, q)).collect() };
    let pick = match quant {
        Some(q) => match matching(q).as_slice() {
            [one] => *one,
            found => {
                return Err(PullError::Quant {
                    repo: repo.to_string(),
                    quant: q.to_string(),
                    matched: if found.is_empty() {
                        "no".to_string()
                    } else {
                        found.len().to_string()
                    },
                    files: describe(if found.is_empty() { &all } else { found }),
                })
            }
        },
        None if all.len() == 1 => all[0],
        None => match matching(DEFAULT_QUANT).as_slice() {
            [one] => *one,
            found => {
                return Err(PullError::ChooseFile {
                    repo: repo.to_string(),
                    default: if found.is_empty() {
                        format!(" and none is {DEFAULT_QUANT}")
                    } else {
                        format!(" and {} are {DEFAULT_QUANT}", found.len())
                    },
                    files: describe(&all),
                })
            }
        },
    };
    if let Some((_, parts)) = split_part(&pick.path).filter(|&(_, n)| n > 1) {
        return Err(PullError::Split {
            file: format!("hf:{repo}/{}", pick.path),
            parts,
        });
    }
    Ok(pick)
}

/// The files a repository name may pick: its GGUF files less vision
/// projectors (unless there is nothing else) and less the second and later
/// parts of split models (the first stands for them).
fn candidates(files: &[RepoFile]) -> Vec<&RepoFile> {
    let gguf: Vec<&RepoFile> = files
        .iter()
        .filter(|f| f.path.to_ascii_lowercase().ends_with(".gguf"))
        .filter(|f| split_part(&f.path).is_none_or(|(n, _)| n == 1))
        .collect();
    let models: Vec<&RepoFile> = gguf.iter().copied().filter(|f| !is_projector(&f.path)).collect();
    if models.is_empty() {
        gguf
    } else {
        models
    }
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn is_projector(path: &str) -> bool {
    base_name(path).to_ascii_lowercase().starts_with("mmproj")
}

/// `(k, n)` for the k-th of n parts of a split model
/// (`NAME-0000k-of-0000n.gguf`).
fn split_part(path: &str) -> Option<(u32, u32)> {
    let stem = base_name(path);
    let stem = stem.get(..stem.len().checked_sub(5)?)?;
    let (head, total) = stem.rsplit_once("-of-")?;
    let (_, part) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(part) || !digits(total) {
        return None;
    }
    Some((part.parse().ok()?, total.parse().ok()?))
}

/// Whether a file's path names quantization `quant`: the name appears, in
/// any case, not inside a longer word (`Q4_K` is not `Q4_K_M`, `Q4_K_M` is
/// not `IQ4_K_M`).
pub fn quant_matches(path: &str, quant: &str) -> bool {
    let hay = path.to_ascii_lowercase();
    let needle = quant.to_ascii_lowercase();
    if needle.is_empty() {
        return false;
    }
    hay.match_indices(&needle).any(|(i, _)| {
        let before = hay[..i].chars().next_back();
        let after = hay[i + needle.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_alphanumeric())
            && !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// Files for a message: path and size each, the first few dozen.
fn describe(files: &[&RepoFile]) -> String {
    const SHOWN: usize = 40;
    if files.is_empty() {
        return "none".to_string();
    }
    let mut parts: Vec<String> = files
        .iter()
        .take(SHOWN)
        .map(|f| match split_part(&f.path) {
            Some((_, n)) if n > 1 => format!("{} ({}, first of {n} parts)", f.path, human(f.size)),
            _ => format!("{} ({})", f.path, human(f.size)),
        })
        .collect();
    if files.len() > SHOWN {
        parts.push(format!("and {} more", files.len() - SHOWN));
    }
    parts.join(", ")
}
