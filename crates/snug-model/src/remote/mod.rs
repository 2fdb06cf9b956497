//! `snug pull` from Hugging Face and from plain URLs: the names, where the
//! files are kept, and the pull itself.
//!
//! A name is `hf:OWNER/REPO/PATH.gguf` (one file of a repository),
//! `hf:OWNER/REPO` or `hf:OWNER/REPO:QUANT` (the repository's one GGUF
//! file, or the one its quantization picks; [`hub::choose`]), or an
//! `http(s)://` URL. A hub URL of the endpoint (`.../resolve/main/...` or
//! the web page's `.../blob/main/...`) is read as the `hf:` name it is.
//!
//! Where the files go, beside the aliases' files in `<cache>/models/`:
//!
//! ```text
//! models/hf/OWNER/REPO/PATH.gguf          the file, named only once verified
//! models/hf/OWNER/REPO/PATH.gguf.sha256   its record: checksum, source, size
//! models/hf/OWNER/REPO/.F.gguf.partial    a download under way or cut off
//! models/hf/OWNER/REPO/.F.gguf.partial.meta   what the partial file is of
//! models/url/HOST[_PORT]/URL/PATH         the same for a URL (no query)
//! ```
//!
//! A file counts as cached only with its record beside it and the size the
//! record says, so nothing half-written is ever found where a model is
//! looked for: bytes arrive in the hidden partial file, which is checked,
//! fsynced and renamed over the name, and the record is written last
//! ([`download`]). The HTTP side (redirects, the token, ranges) is
//! [`http`]; the hub's listing and the choice among its files is [`hub`].
//!
//! Nothing here reads the environment: the endpoint, token and proxy come
//! in [`HubOptions`], filled by the binary.

mod download;
mod http;
mod hub;
#[cfg(test)]
mod tests;

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use hub::{choose, quant_matches, RepoFile, DEFAULT_QUANT};

use crate::catalog;
use crate::pull::{PullError, PullProgress};

/// The hub's address when none is given (`HF_ENDPOINT` overrides it).
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// How to reach the hub and the network.
#[derive(Clone)]
pub struct HubOptions {
    /// The hub's base URL, without a trailing slash.
    pub endpoint: String,
    /// A bearer token, sent only to the endpoint's own host.
    pub token: Option<String>,
    /// A proxy URL for every request, and the hosts that bypass it
    /// (comma-separated, as `NO_PROXY`).
    pub proxy: Option<String>,
    pub no_proxy: Option<String>,
    /// How many times a download cut off mid-way is resumed before the
    /// pull gives up (the partial file stays for the next pull).
    pub retries: u32,
    /// The wait before the first resume; it doubles each time.
    pub retry_wait: Duration,
}

impl Default for HubOptions {
    fn default() -> Self {
        HubOptions {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            token: None,
            proxy: None,
            no_proxy: None,
            retries: 3,
            retry_wait: Duration::from_secs(1),
        }
    }
}

impl fmt::Debug for HubOptions {
    // The token never reaches a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubOptions")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .field("proxy", &self.proxy)
            .field("no_proxy", &self.no_proxy)
            .field("retries", &self.retries)
            .field("retry_wait", &self.retry_wait)
            .finish()
    }
}

impl HubOptions {
    fn endpoint(&self) -> &str {
        self.endpoint.trim_end_matches('/')
    }
}

/// A name of something to pull from the network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteName {
    /// A repository on the hub (`OWNER/REPO`), one file of it (`file`),
    /// or the file a quantization picks (`quant`; never with `file`).
    Hf {
        repo: String,
        file: Option<String>,
        quant: Option<String>,
    },
    /// Any other `http://` or `https://` URL.
    Url(String),
}

const HF_PREFIXES: [&str; 3] = ["hf:", "hf.co/", "huggingface.co/"];

impl RemoteName {
    /// Reads `name` as a remote name, or `None` when it is not one (an
    /// alias or a path). `endpoint` is the hub's base URL: a URL into it
    /// is read as an `hf:` name.
    pub fn parse(name: &str, endpoint: &str) -> Option<Result<RemoteName, PullError>> {
        let name = name.trim();
        if let Some(rest) = HF_PREFIXES.iter().find_map(|p| name.strip_prefix(p)) {
            return Some(parse_hf(name, rest));
        }
        if name.starts_with("https://") || name.starts_with("http://") {
            if let Some(hf) = hub_url(name, endpoint.trim_end_matches('/')) {
                return Some(Ok(hf));
            }
            return Some(check_url(name).map(|()| RemoteName::Url(name.to_string())));
        }
        None
    }

    /// This name with `--quant QUANT` applied (a repository name only).
    pub fn with_quant(self, quant: Option<&str>) -> Result<RemoteName, PullError> {
        let Some(q) = quant else { return Ok(self) };
        let bad = |name: String, reason: &str| PullError::BadName {
            name,
            reason: reason.to_string(),
        };
        check_quant(q).map_err(|r| bad(q.to_string(), r))?;
        match self {
            RemoteName::Hf {
                repo,
                file: None,
                quant: None,
            } => Ok(RemoteName::Hf {
                repo,
                file: None,
                quant: Some(q.to_string()),
            }),
            RemoteName::Hf {
                repo,
                file: None,
                quant: Some(given),
            } if given.eq_ignore_ascii_case(q) => Ok(RemoteName::Hf {
                repo,
                file: None,
                quant: Some(given),
            }),
            RemoteName::Hf { repo, file: None, .. } => Err(bad(
                format!("hf:{repo}"),
                "the name gives one quantization and --quant another",
            )),
            other => Err(bad(
                other.to_string(),
                "--quant picks among a repository's files; this name is one file already",
            )),
        }
    }
}

impl fmt::Display for RemoteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteName::Hf {
                repo, file: Some(file), ..
            } => write!(f, "hf:{repo}/{file}"),
            RemoteName::Hf {
                repo, quant: Some(q), ..
            } => write!(f, "hf:{repo}:{q}"),
            RemoteName::Hf { repo, .. } => write!(f, "hf:{repo}"),
            RemoteName::Url(url) => f.write_str(url),
        }
    }
}

fn parse_hf(name: &str, rest: &str) -> Result<RemoteName, PullError> {
    let bad = |reason: &str| PullError::BadName {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() < 2 {
        return Err(bad(
            "write hf:OWNER/REPO, hf:OWNER/REPO:QUANT or hf:OWNER/REPO/FILE.gguf",
        ));
    }
    let owner = parts[0];
    let (repo, quant) = match parts[1].split_once(':') {
        Some((r, q)) if parts.len() == 2 => (r, Some(q)),
        Some(_) => {
            return Err(bad(
                "a quantization follows the repository (hf:OWNER/REPO:QUANT), not a file",
            ))
        }
        None => (parts[1], None),
    };
    for part in [owner, repo] {
        check_repo_part(part).map_err(bad)?;
    }
    if let Some(q) = quant {
        check_quant(q).map_err(bad)?;
    }
    let file = if parts.len() > 2 {
        for c in &parts[2..] {
            check_component(c).map_err(bad)?;
        }
        let file = parts[2..].join("/");
        if !file.to_ascii_lowercase().ends_with(".gguf") {
            return Err(bad("name a .gguf file of the repository, or the repository alone"));
        }
        Some(file)
    } else {
        None
    };
    Ok(RemoteName::Hf {
        repo: format!("{owner}/{repo}"),
        file,
        quant: quant.map(str::to_string),
    })
}

/// The `hf:` name of a URL of the endpoint's own files on `main`.
fn hub_url(url: &str, endpoint: &str) -> Option<RemoteName> {
    let rest = url.strip_prefix(endpoint)?.strip_prefix('/')?;
    let rest = rest.split(['?', '#']).next().unwrap_or(rest);
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() < 5 || !matches!(parts[2], "resolve" | "blob") || parts[3] != "main" {
        return None;
    }
    parse_hf(url, &format!("{}/{}/{}", parts[0], parts[1], parts[4..].join("/"))).ok()
}

fn check_repo_part(s: &str) -> Result<(), &'static str> {
    let ok = !s.is_empty()
        && s.len() <= 96
        && !s.starts_with(['.', '-'])
        && !s.contains("..")
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    ok.then_some(())
        .ok_or("an owner or repository name is letters, digits, '-', '_' and '.'")
}

fn check_quant(s: &str) -> Result<(), &'static str> {
    let ok = !s.is_empty() && s.len() <= 32 && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
    ok.then_some(())
        .ok_or("a quantization is letters, digits, '_' and '-' (as Q4_K_M)")
}

/// A path component that is safe as a file name in the cache: not empty,
/// not `.`/`..`, not hidden (the cache's own temporary names are), no
/// control characters or backslashes.
fn check_component(c: &str) -> Result<(), &'static str> {
    let ok =
        !c.is_empty() && c.len() <= 255 && !c.starts_with('.') && !c.chars().any(|ch| ch.is_control() || ch == '\\');
    ok.then_some(())
        .ok_or("each part of a file path must be a plain name (not empty, not starting with '.')")
}

fn check_url(url: &str) -> Result<(), PullError> {
    url_path_parts(url).map(|_| ())
}

/// A URL's host directory name and path components, checked.
fn url_path_parts(url: &str) -> Result<(String, Vec<String>), PullError> {
    let bad = |reason: &str| PullError::BadName {
        name: url.to_string(),
        reason: reason.to_string(),
    };
    let uri: ureq::http::Uri = url.parse().map_err(|_| bad("not a URL"))?;
    let authority = uri.authority().ok_or_else(|| bad("the URL has no host"))?;
    if authority.as_str().contains('@') {
        return Err(bad(
            "a URL with a user name or password would be kept in the cache's records",
        ));
    }
    let host: String = authority
        .host()
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let host = match authority.port_u16() {
        Some(p) => format!("{host}_{p}"),
        None => host,
    };
    let parts: Vec<String> = uri
        .path()
        .split('/')
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect();
    if parts.is_empty() || uri.path().ends_with('/') {
        return Err(bad("the URL does not end in a file name"));
    }
    for c in &parts {
        check_component(c).map_err(bad)?;
    }
    check_component(&host).map_err(bad)?;
    Ok((host, parts))
}

/// Where remote files live inside the cache.
fn remote_dir(cache: &Path) -> [PathBuf; 2] {
    let models = catalog::models_dir(cache);
    [models.join("hf"), models.join("url")]
}

/// The folder of `repo`'s files in `cache`.
fn repo_dir(cache: &Path, repo: &str) -> PathBuf {
    let mut p = catalog::models_dir(cache).join("hf");
    p.extend(repo.split('/'));
    p
}

/// The path of `file` of `repo` in `cache`.
pub fn hf_path(cache: &Path, repo: &str, file: &str) -> PathBuf {
    let mut p = repo_dir(cache, repo);
    p.extend(file.split('/'));
    p
}

/// The path of `url`'s file in `cache` (its query is not part of it).
pub fn url_path(cache: &Path, url: &str) -> Result<PathBuf, PullError> {
    let (host, parts) = url_path_parts(url)?;
    let mut p = catalog::models_dir(cache).join("url").join(host);
    p.extend(parts);
    Ok(p)
}

/// The record written beside a pulled file.
pub fn record_path(file: &Path) -> PathBuf {
    let mut name = file.file_name().unwrap_or_default().to_os_string();
    name.push(".sha256");
    file.with_file_name(name)
}

/// What the cache knows of a pulled file: its record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The file's SHA-256, lowercase hex.
    pub sha256: String,
    pub size: u64,
    /// The name it was pulled by, as `snug list` shows it
    /// (`hf:OWNER/REPO/FILE` or the URL).
    pub name: String,
    /// Where its bytes came from.
    pub url: String,
    /// Whether the checksum was published by the server and checked
    /// (`false`: computed from what arrived, with nothing to check it by).
    pub published: bool,
    /// The repository's commit, when the hub said it.
    pub revision: Option<String>,
}

impl Record {
    /// The record's text: a `sha256sum` line first, then `key value` lines.
    fn to_text(&self, file_name: &str) -> String {
        let mut t = format!(
            "{}  {file_name}\nname {}\nurl {}\nsize {}\nchecksum {}\n",
            self.sha256,
            self.name,
            self.url,
            self.size,
            if self.published { "published" } else { "computed" }
        );
        if let Some(r) = &self.revision {
            t.push_str(&format!("revision {r}\n"));
        }
        t
    }

    fn parse(text: &str) -> Option<Record> {
        let mut lines = text.lines();
        let sha256 = lines.next()?.split_whitespace().next()?.to_string();
        if !is_sha256(&sha256) {
            return None;
        }
        let (mut name, mut url, mut size, mut published, mut revision) = (None, None, None, None, None);
        for line in lines {
            let Some((k, v)) = line.split_once(' ') else { continue };
            match k {
                "name" => name = Some(v.to_string()),
                "url" => url = Some(v.to_string()),
                "size" => size = v.parse().ok(),
                "checksum" => published = Some(v == "published"),
                "revision" => revision = Some(v.to_string()),
                _ => {}
            }
        }
        Some(Record {
            sha256,
            size: size?,
            name: name?,
            url: url?,
            published: published?,
            revision,
        })
    }
}

/// Whether `s` is a SHA-256 in lowercase hex.
fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The record of the file at `path` if a pull of it finished: the record
/// is there and the file has the size it says.
pub fn cached_record(path: &Path) -> Option<Record> {
    let record = Record::parse(&fs::read_to_string(record_path(path)).ok()?)?;
    let meta = fs::metadata(path).ok()?;
    (meta.is_file() && meta.len() == record.size).then_some(record)
}

/// A pulled file in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cached {
    pub path: PathBuf,
    pub record: Record,
}

/// Every pulled file in `cache`, by name.
pub fn list_cached(cache: &Path) -> Vec<Cached> {
    let mut out = Vec::new();
    for dir in remote_dir(cache) {
        walk(&dir, 0, &mut out);
    }
    out.sort_by(|a, b| a.record.name.cmp(&b.record.name));
    out
}

/// Files nest as deep as a repository's folders or a URL's path; a tree
/// deeper than this is not snug's.
const MAX_DEPTH: usize = 32;

fn walk(dir: &Path, depth: usize, out: &mut Vec<Cached>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let Ok(ty) = e.file_type() else { continue };
        if ty.is_dir() && depth < MAX_DEPTH {
            walk(&e.path(), depth + 1, out);
        } else if ty.is_file() && !name.ends_with(".sha256") {
            if let Some(record) = cached_record(&e.path()) {
                out.push(Cached { path: e.path(), record });
            }
        }
    }
}

/// The cached file `name` stands for, if there is one, found without the
/// network: a file name's own file; for a repository, the file a pull of
/// it would pick among those cached ([`choose`]).
pub fn find_cached(name: &RemoteName, cache: &Path) -> Option<Cached> {
    let at = |path: PathBuf| cached_record(&path).map(|record| Cached { path, record });
    match name {
        RemoteName::Hf {
            repo, file: Some(f), ..
        } => at(hf_path(cache, repo, f)),
        RemoteName::Url(url) => at(url_path(cache, url).ok()?),
        RemoteName::Hf { repo, quant, .. } => {
            let dir = repo_dir(cache, repo);
            let mut found = Vec::new();
            walk(&dir, 0, &mut found);
            let files: Vec<RepoFile> = found
                .iter()
                .filter_map(|c| {
                    Some(RepoFile {
                        path: c.path.strip_prefix(&dir).ok()?.to_string_lossy().into_owned(),
                        size: c.record.size,
                        sha256: Some(c.record.sha256.clone()),
                    })
                })
                .collect();
            let pick = choose(repo, &files, quant.as_deref()).ok()?;
            at(hf_path(cache, repo, &pick.path))
        }
    }
}

/// What a pull did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pulled {
    pub cached: Cached,
    /// Whether bytes were downloaded (`false`: the cached copy was current).
    pub downloaded: bool,
    /// Bytes a partial file from an earlier pull already held.
    pub resumed_from: u64,
}

impl Pulled {
    /// The cached copy at `path`, current: nothing downloaded.
    fn already(path: PathBuf, record: Record) -> Pulled {
        Pulled {
            cached: Cached { path, record },
            downloaded: false,
            resumed_from: 0,
        }
    }
}

/// Pulls `name` into `cache`. A repository name asks the hub which files
/// it has and picks one; a file whose cached copy has the checksum the
/// hub publishes now is not downloaded again, and a newer one replaces it
/// only once verified. A URL already cached is not fetched again.
pub fn pull(
    name: &RemoteName,
    cache: &Path,
    options: &HubOptions,
    progress: &dyn PullProgress,
) -> Result<Pulled, PullError> {
    let client = http::Client::new(options)?;
    let result = match name {
        RemoteName::Url(url) => {
            let path = url_path(cache, url)?;
            if let Some(record) = cached_record(&path) {
                return Ok(Pulled::already(path, record));
            }
            download::fetch(
                &client,
                download::Job {
                    name: url.clone(),
                    url: url.clone(),
                    path,
                    expected: None,
                    size: None,
                },
                options,
                progress,
            )
        }
        RemoteName::Hf { repo, file, quant } => {
            let files = hub::list(&client, options.endpoint(), repo)?;
            let chosen = match file {
                Some(f) => hub::find(repo, &files, f)?,
                None => choose(repo, &files, quant.as_deref())?,
            };
            let path = hf_path(cache, repo, &chosen.path);
            let current = cached_record(&path)
                .filter(|r| chosen.sha256.as_ref().map_or(r.size == chosen.size, |s| *s == r.sha256));
            if let Some(record) = current {
                return Ok(Pulled::already(path, record));
            }
            download::fetch(
                &client,
                download::Job {
                    name: format!("hf:{repo}/{}", chosen.path),
                    url: format!(
                        "{}/{repo}/resolve/main/{}",
                        options.endpoint(),
                        http::encode_path(&chosen.path)
                    ),
                    path,
                    expected: chosen.sha256.clone(),
                    size: Some(chosen.size),
                },
                options,
                progress,
            )
        }
    };
    progress.finish();
    result
}

/// The cache path of a file name or URL (`None` for a repository name,
/// which stands for whichever of its files was picked).
pub fn path_of(name: &RemoteName, cache: &Path) -> Option<PathBuf> {
    match name {
        RemoteName::Hf {
            repo, file: Some(f), ..
        } => Some(hf_path(cache, repo, f)),
        RemoteName::Hf { .. } => None,
        RemoteName::Url(url) => url_path(cache, url).ok(),
    }
}

/// Removes a pulled file, the record first (a file without its record is
/// not cached, so an interrupted removal leaves nothing that looks
/// pulled), with any partial download of it, then the folders it leaves
/// empty up to the cache's own. Whether there was anything to remove.
pub fn remove(cache: &Path, path: &Path) -> std::io::Result<bool> {
    let mut removed = false;
    let record = record_path(path);
    if record.exists() {
        fs::remove_file(&record)?;
        removed = true;
    }
    if path.is_file() {
        fs::remove_file(path)?;
        removed = true;
    }
    removed |= download::remove_partial(path);
    let roots = remote_dir(cache);
    let mut dir = path.parent();
    while let Some(d) = dir {
        if roots.iter().any(|r| r == d) || fs::remove_dir(d).is_err() {
            break;
        }
        dir = d.parent();
    }
    Ok(removed)
}
