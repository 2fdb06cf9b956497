//! `snug pull` from a Hugging Face hub and from URLs, as a user runs it:
//! the binary talks to the stand-in hub on loopback (`HF_ENDPOINT`), and
//! what it pulled is used afterwards with the hub gone.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use snug_model::testing::hub::{FakeHub, Fault};

const REPO: &str = "acme/Tiny-GGUF";
/// Nothing listens here: a run that reached for the network would fail.
const DEAD_ENDPOINT: &str = "http://127.0.0.1:9";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A GGUF file `snug info` reads: a header naming `name`, no tensors, and
/// `extra` bytes after it.
fn tiny_gguf(name: &str, extra: usize) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    let mut v = b"GGUF".to_vec();
    v.extend(3u32.to_le_bytes());
    v.extend(0u64.to_le_bytes());
    v.extend(2u64.to_le_bytes());
    for (k, val) in [("general.architecture", "llama"), ("general.name", name)] {
        string(&mut v, k);
        v.extend(8u32.to_le_bytes());
        string(&mut v, val);
    }
    v.resize(v.len().next_multiple_of(32), 0);
    v.extend((0..extra).map(|i| (i % 251) as u8));
    v
}

struct Setup {
    home: PathBuf,
    hub: FakeHub,
}

impl Setup {
    fn new(tag: &str) -> Setup {
        let home = std::env::temp_dir().join(format!("snug-pull-hf-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&home);
        Setup {
            home,
            hub: FakeHub::start().unwrap(),
        }
    }

    fn snug_at(&self, endpoint: &str, args: &[&str]) -> Output {
        let mut c = Command::new(env!("CARGO_BIN_EXE_snug"));
        for v in [
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
            "HTTPS_PROXY",
            "https_proxy",
            "ALL_PROXY",
            "all_proxy",
            "HTTP_PROXY",
            "http_proxy",
        ] {
            c.env_remove(v);
        }
        c.env("SNUG_HOME", &self.home)
            .env("SNUG_PACK", "off")
            .env("HF_ENDPOINT", endpoint)
            .env("HF_TOKEN", "hf_test_token")
            .args(args)
            .output()
            .unwrap()
    }

    fn snug(&self, args: &[&str]) -> Output {
        self.snug_at(&self.hub.url(), args)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.home);
    }
}

fn ok(out: &Output) -> (String, String) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stderr: {stderr}");
    (stdout, stderr)
}

/// A failed run: one line on stderr, starting "error:", naming `needle`.
fn one_line_error(out: &Output, needle: &str) {
    let err = text(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line expected: {err}");
    assert!(
        err.starts_with("error: ") && err.contains(needle),
        "{err:?} should mention {needle:?}"
    );
}

fn last_line(s: &str) -> &str {
    s.trim_end().lines().last().unwrap_or("")
}

#[test]
fn an_hf_pull_is_listed_runs_offline_and_is_removed() {
    let s = Setup::new("flow");
    let q4 = tiny_gguf("tiny q4", 200_000);
    let q8 = tiny_gguf("tiny q8", 300_000);
    s.hub.add_file(REPO, "tiny-Q4_K_M.gguf", &q4);
    s.hub.add_file(REPO, "tiny-Q8_0.gguf", &q8);
    s.hub.add_git_file(REPO, "README.md", b"# Tiny\n");
    s.hub.require_token("hf_test_token");
    // The first transfer is cut off; the pull resumes it by itself.
    s.hub.fail_next("/cdn/", Fault::CutAfter(120_000));

    let (stdout, stderr) = ok(&s.snug(&["pull", "hf:acme/Tiny-GGUF", "--quant", "q8_0"]));
    let path = s.home.join("models/hf/acme/Tiny-GGUF/tiny-Q8_0.gguf");
    assert_eq!(Path::new(last_line(&stdout)), path);
    assert!(
        stderr.contains("hf:acme/Tiny-GGUF/tiny-Q8_0.gguf pulled and verified"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), q8);
    let ranges: Vec<_> = s
        .hub
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/cdn/"))
        .map(|r| r.range)
        .collect();
    assert_eq!(ranges, vec![None, Some("bytes=120000-".to_string())]);

    // Without --quant, Q4_K_M is the default among several.
    let (stdout, _) = ok(&s.snug(&["pull", "hf:acme/Tiny-GGUF"]));
    assert!(last_line(&stdout).ends_with("tiny-Q4_K_M.gguf"), "{stdout}");

    let (list, _) = ok(&s.snug(&["list"]));
    for (name, size) in [
        ("hf:acme/Tiny-GGUF/tiny-Q4_K_M.gguf", "195.4 KiB"),
        ("hf:acme/Tiny-GGUF/tiny-Q8_0.gguf", "293.1 KiB"),
    ] {
        let line = list
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{list}"));
        assert!(line.contains(size) && line.contains("sha256 verified"), "{line}");
    }

    // With the hub gone, the names still open the files.
    for name in ["hf:acme/Tiny-GGUF/tiny-Q8_0.gguf", "hf:acme/Tiny-GGUF:Q8_0"] {
        let (info, _) = ok(&s.snug_at(DEAD_ENDPOINT, &["info", name]));
        assert!(info.contains("tiny q8"), "{info}");
    }
    let (info, _) = ok(&s.snug_at(DEAD_ENDPOINT, &["info", "hf:acme/Tiny-GGUF"]));
    assert!(info.contains("tiny q4"), "{info}");

    let (_, stderr) = ok(&s.snug_at(DEAD_ENDPOINT, &["rm", "hf:acme/Tiny-GGUF/tiny-Q8_0.gguf"]));
    assert!(stderr.contains("removed hf:acme/Tiny-GGUF/tiny-Q8_0.gguf"), "{stderr}");
    assert!(!path.exists());
    let (list, _) = ok(&s.snug(&["list"]));
    assert!(!list.contains("tiny-Q8_0") && list.contains("tiny-Q4_K_M"), "{list}");
}

#[test]
fn hub_failures_are_one_line_errors_and_keep_what_was_there() {
    let s = Setup::new("errors");
    s.hub.add_file(REPO, "tiny-Q5_K_M.gguf", &tiny_gguf("a", 1000));
    s.hub.add_file(REPO, "tiny-Q8_0.gguf", &tiny_gguf("b", 1000));

    one_line_error(&s.snug(&["pull", "hf:acme/Tiny-GGUF"]), "tiny-Q5_K_M.gguf");
    one_line_error(&s.snug(&["pull", "hf:acme/Tiny-GGUF"]), "--quant");
    one_line_error(&s.snug(&["pull", "hf:acme/Nope"]), "not found (HTTP 404)");
    s.hub.fail_next("/tree/", Fault::Status(429));
    one_line_error(
        &s.snug(&["pull", "hf:acme/Tiny-GGUF:Q8_0"]),
        "too many requests (HTTP 429)",
    );

    ok(&s.snug(&["pull", "hf:acme/Tiny-GGUF:Q8_0"]));
    let path = s.home.join("models/hf/acme/Tiny-GGUF/tiny-Q8_0.gguf");
    let good = std::fs::read(&path).unwrap();
    s.hub.add_file(REPO, "tiny-Q8_0.gguf", &tiny_gguf("c", 1000));
    s.hub.publish_sha256(REPO, "tiny-Q8_0.gguf", &"0".repeat(64));
    one_line_error(&s.snug(&["pull", "hf:acme/Tiny-GGUF:Q8_0"]), "checksum mismatch");
    assert_eq!(std::fs::read(&path).unwrap(), good);

    // Names that are neither: the nearest alias, or the hf: spelling.
    one_line_error(&s.snug(&["pull", "smolm2-135m"]), "did you mean \"smollm2-135m\"?");
    one_line_error(
        &s.snug(&["pull", "acme/Tiny-GGUF"]),
        "did you mean \"hf:acme/Tiny-GGUF\"?",
    );
    one_line_error(&s.snug(&["pull", "smollm2-135m", "--quant", "Q8_0"]), "is an alias");
}

#[test]
fn a_plain_url_is_pulled_and_its_computed_checksum_recorded() {
    let s = Setup::new("url");
    let bytes = tiny_gguf("from a url", 5000);
    s.hub.add_plain("m/tiny.gguf", &bytes, "\"v1\"");
    let url = format!("{}/files/m/tiny.gguf", s.hub.url());
    let (stdout, stderr) = ok(&s.snug(&["pull", &url]));
    assert!(stderr.contains("publishes no checksum"), "{stderr}");
    let path = PathBuf::from(last_line(&stdout));
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    let record = std::fs::read_to_string(format!("{}.sha256", path.display())).unwrap();
    assert!(
        record.contains("checksum computed") && record.contains(&format!("url {url}")),
        "{record}"
    );
    let (info, _) = ok(&s.snug_at(DEAD_ENDPOINT, &["info", &url]));
    assert!(info.contains("from a url"), "{info}");
    let (list, _) = ok(&s.snug(&["list"]));
    assert!(list.contains(&url) && list.contains("none published"), "{list}");
}

#[test]
fn a_real_model_pulled_from_the_hub_runs_offline_by_its_hf_name() {
    let Some(model) = snug_model::testing::model_path("smollm2-135m") else {
        return;
    };
    let s = Setup::new("run");
    let repo = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF";
    s.hub
        .add_file(repo, "smollm2-135m-instruct-q4_1.gguf", &std::fs::read(&model).unwrap());
    ok(&s.snug(&["pull", &format!("hf:{repo}")]));
    let run = |name: &str| {
        let out = s.snug_at(
            DEAD_ENDPOINT,
            &[
                "run",
                name,
                "-p",
                "The capital of France is",
                "-n",
                "8",
                "--json",
                "-t",
                "2",
            ],
        );
        let (stdout, _) = ok(&out);
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        v["text"].as_str().unwrap().to_string()
    };
    let from_hub = run(&format!("hf:{repo}/smollm2-135m-instruct-q4_1.gguf"));
    assert!(from_hub.starts_with(" Paris."), "{from_hub}");
    assert_eq!(from_hub, run(model.to_str().unwrap()));
    // Run once with panels packed into the cache; removing the model
    // removes its panels too.
    let name = format!("hf:{repo}/smollm2-135m-instruct-q4_1.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_snug"))
        .env("SNUG_HOME", &s.home)
        .env("SNUG_PACK", "cache")
        .env("HF_ENDPOINT", DEAD_ENDPOINT)
        .args(["run", &name, "-p", "Hi", "-n", "1", "-t", "2"])
        .output()
        .unwrap();
    ok(&out);
    let packs = || {
        std::fs::read_dir(s.home.join("packed"))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".snugpack"))
                    .count()
            })
            .unwrap_or(0)
    };
    if snug_kernels::panel::available(snug_kernels::GgmlType::Q4_1) {
        assert_eq!(packs(), 1);
    }
    ok(&s.snug_at(DEAD_ENDPOINT, &["rm", &name]));
    assert_eq!(packs(), 0);
}
