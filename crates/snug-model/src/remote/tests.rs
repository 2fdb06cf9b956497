//! Pulls against the stand-in hub on loopback (`testing::hub`): names,
//! choosing a file, redirects and tokens, resuming, checksums, and the
//! failures a user meets. No test here reaches the network.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;
use crate::pull::NoProgress;
use crate::testing::hub::{sha256_hex, FakeHub, Fault, COMMIT};

const REPO: &str = "acme/Tiny-GGUF";

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("snug-remote-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A file that passes for a GGUF model: the magic, then `n` bytes.
fn gguf(n: usize, seed: u8) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend((0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
    v
}

fn options(hub: &FakeHub) -> HubOptions {
    HubOptions {
        endpoint: hub.url(),
        retries: 0,
        retry_wait: Duration::from_millis(5),
        ..HubOptions::default()
    }
}

fn name(s: &str, hub: &FakeHub) -> RemoteName {
    RemoteName::parse(s, &hub.url()).unwrap().unwrap()
}

/// The hidden files beside `path` (partial downloads, temporaries).
fn hidden_beside(path: &Path) -> Vec<String> {
    std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn names_read_as_the_hub_and_urls_spell_them() {
    let ep = "https://huggingface.co";
    let p = |s: &str| RemoteName::parse(s, ep);
    assert!(p("smollm2-135m").is_none());
    assert!(p("./model.gguf").is_none());
    let hf = |repo: &str, file: Option<&str>, quant: Option<&str>| RemoteName::Hf {
        repo: repo.into(),
        file: file.map(Into::into),
        quant: quant.map(Into::into),
    };
    assert_eq!(p("hf:a/b").unwrap().unwrap(), hf("a/b", None, None));
    assert_eq!(p("hf:a/b:Q8_0").unwrap().unwrap(), hf("a/b", None, Some("Q8_0")));
    assert_eq!(p("hf.co/a/b:q4_k_m").unwrap().unwrap(), hf("a/b", None, Some("q4_k_m")));
    assert_eq!(
        p("hf:a/b/sub/m.Q4_K_M.gguf").unwrap().unwrap(),
        hf("a/b", Some("sub/m.Q4_K_M.gguf"), None)
    );
    // The hub's own URLs, the web page's included, are the hf: name.
    assert_eq!(
        p("https://huggingface.co/a/b/blob/main/m.gguf").unwrap().unwrap(),
        hf("a/b", Some("m.gguf"), None)
    );
    assert_eq!(
        p("https://huggingface.co/a/b/resolve/main/m.gguf?download=true")
            .unwrap()
            .unwrap(),
        hf("a/b", Some("m.gguf"), None)
    );
    assert_eq!(
        p("https://example.com/x/m.gguf").unwrap().unwrap(),
        RemoteName::Url("https://example.com/x/m.gguf".into())
    );
    assert_eq!(hf("a/b", Some("m.gguf"), None).to_string(), "hf:a/b/m.gguf");
    for bad in [
        "hf:a",
        "hf:a/",
        "hf:../b",
        "hf:a/b/../../etc/passwd.gguf",
        "hf:a/b/.hidden.gguf",
        "hf:a/b/config.json",
        "hf:a/b/m.gguf:Q8_0",
        "hf:a/b:Q8 0",
        "https://example.com/",
        "https://user:pw@example.com/m.gguf",
        "https://example.com/a/../m.gguf",
    ] {
        assert!(
            matches!(p(bad), Some(Err(PullError::BadName { .. }))),
            "{bad} should be refused"
        );
    }
    let repo = p("hf:a/b").unwrap().unwrap();
    assert_eq!(
        repo.clone().with_quant(Some("Q8_0")).unwrap(),
        hf("a/b", None, Some("Q8_0"))
    );
    assert!(p("hf:a/b:Q4_K_M").unwrap().unwrap().with_quant(Some("Q8_0")).is_err());
    assert!(p("hf:a/b/m.gguf").unwrap().unwrap().with_quant(Some("Q8_0")).is_err());
}

#[test]
fn url_files_keep_host_and_path_in_the_cache() {
    let cache = Path::new("/c");
    assert_eq!(
        url_path(cache, "http://127.0.0.1:8080/files/a/m.gguf?sig=1").unwrap(),
        Path::new("/c/models/url/127.0.0.1_8080/files/a/m.gguf")
    );
    assert_eq!(
        hf_path(cache, "o/r", "d/m.gguf"),
        Path::new("/c/models/hf/o/r/d/m.gguf")
    );
}

fn files(paths: &[&str]) -> Vec<RepoFile> {
    paths
        .iter()
        .map(|p| RepoFile {
            path: p.to_string(),
            size: 1 << 20,
            sha256: None,
        })
        .collect()
}

#[test]
fn a_quantization_picks_one_file_and_several_are_listed() {
    let one = files(&["README.md", "m-Q8_0.gguf"]);
    assert_eq!(choose("o/r", &one, None).unwrap().path, "m-Q8_0.gguf");
    let many = files(&[
        "m-IQ4_K_M.gguf",
        "m-Q4_K.gguf",
        "m-Q4_K_M.gguf",
        "m-Q8_0.gguf",
        "mmproj-m-f16.gguf",
    ]);
    assert_eq!(choose("o/r", &many, None).unwrap().path, "m-Q4_K_M.gguf");
    assert_eq!(choose("o/r", &many, Some("q8_0")).unwrap().path, "m-Q8_0.gguf");
    assert_eq!(choose("o/r", &many, Some("Q4_K")).unwrap().path, "m-Q4_K.gguf");
    let err = choose("o/r", &many, Some("Q5_K_M")).unwrap_err().to_string();
    assert!(
        err.contains("no .gguf files matching Q5_K_M") && err.contains("m-Q8_0.gguf (1.0 MiB)"),
        "{err}"
    );
    assert!(!err.contains("mmproj"), "{err}");
    let no_default = files(&["m.Q5_K_M.gguf", "m.Q8_0.gguf"]);
    let err = choose("o/r", &no_default, None).unwrap_err().to_string();
    assert!(
        err.contains("several .gguf files and none is Q4_K_M")
            && err.contains("--quant")
            && err.contains("m.Q5_K_M.gguf")
            && err.contains("m.Q8_0.gguf"),
        "{err}"
    );
    let split = files(&[
        "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
        "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf",
    ]);
    let err = choose("o/r", &split, None).unwrap_err();
    assert!(matches!(err, PullError::Split { parts: 2, .. }), "{err}");
    assert!(matches!(
        choose("o/r", &files(&["a.bin"]), None),
        Err(PullError::NoGguf { .. })
    ));
    assert!(quant_matches("dir/Model.q4_k_m.gguf", "Q4_K_M"));
    assert!(!quant_matches("Model-Q4_K_M.gguf", "Q4_K"));
    assert!(!quant_matches("Model-IQ4_K_M.gguf", "Q4_K_M"));
}

#[test]
fn an_hf_file_is_pulled_through_the_redirect_and_verified() {
    let hub = FakeHub::start().unwrap();
    let bytes = gguf(300_000, 1);
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", &bytes);
    hub.add_file(REPO, "tiny-Q8_0.gguf", &gguf(1000, 2));
    hub.add_git_file(REPO, "README.md", b"# tiny\n");
    hub.require_token("secret");
    let cache = scratch("redirect");
    let mut opts = options(&hub);
    opts.token = Some("secret".into());

    // The listing's `../../escape-Q4_K_M.gguf` would make Q4_K_M
    // ambiguous, were it not left out.
    let pulled = pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &opts, &NoProgress).unwrap();
    assert!(pulled.downloaded);
    let path = hf_path(&cache, REPO, "tiny-Q4_K_M.gguf");
    assert_eq!(pulled.cached.path, path);
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    let r = &pulled.cached.record;
    assert_eq!(r.sha256, sha256_hex(&bytes));
    assert!(r.published);
    assert_eq!(r.name, "hf:acme/Tiny-GGUF/tiny-Q4_K_M.gguf");
    assert_eq!(r.revision.as_deref(), Some(COMMIT));
    assert_eq!(hidden_beside(&path), Vec::<String>::new());

    // The token went to the hub's own URLs, not to where it redirected.
    let log = hub.requests();
    let cdn: Vec<_> = log.iter().filter(|r| r.path.starts_with("/cdn/")).collect();
    assert_eq!(cdn.len(), 1);
    assert_eq!(cdn[0].authorization, None);
    assert!(log
        .iter()
        .filter(|r| !r.path.starts_with("/cdn/"))
        .all(|r| r.authorization.as_deref() == Some("Bearer secret")));

    // Cached: found without the network, by file or by repository; a
    // second pull asks the listing only.
    assert_eq!(list_cached(&cache).len(), 1);
    let by_repo = find_cached(&name("hf:acme/Tiny-GGUF", &hub), &cache).unwrap();
    assert_eq!(by_repo.path, path);
    let again = pull(
        &name("hf:acme/Tiny-GGUF/tiny-Q4_K_M.gguf", &hub),
        &cache,
        &opts,
        &NoProgress,
    )
    .unwrap();
    assert!(!again.downloaded);
    assert_eq!(hub.requests().len(), log.len() + 1);

    // Without the token, the hub's refusal names what to do.
    let err = pull(
        &name("hf:acme/Tiny-GGUF:Q8_0", &hub),
        &cache,
        &options(&hub),
        &NoProgress,
    )
    .unwrap_err();
    assert!(
        matches!(err, PullError::Http { status: 401, .. }) && err.to_string().contains("HF_TOKEN"),
        "{err}"
    );
    assert!(remove(&cache, &path).unwrap());
    assert!(!remove(&cache, &path).unwrap());
    assert!(list_cached(&cache).is_empty());
    assert!(!cache.join("models/hf/acme").exists());
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_paged_listing_and_a_file_in_git_alone_are_pulled() {
    let hub = FakeHub::start().unwrap();
    hub.page_size(2);
    for q in ["Q2_K", "Q3_K_S", "Q5_K_M", "Q6_K"] {
        hub.add_file(REPO, &format!("sub/tiny-{q}.gguf"), &gguf(100, 3));
    }
    let small = gguf(500, 4);
    hub.add_git_file(REPO, "sub/tiny-Q8_0.gguf", &small);
    let cache = scratch("paged");
    let pulled = pull(
        &name("hf:acme/Tiny-GGUF:Q8_0", &hub),
        &cache,
        &options(&hub),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(std::fs::read(&pulled.cached.path).unwrap(), small);
    assert_eq!(pulled.cached.path, hf_path(&cache, REPO, "sub/tiny-Q8_0.gguf"));
    // A git file's ETag is a SHA-1: nothing published to check by.
    assert!(!pulled.cached.record.published);
    assert_eq!(pulled.cached.record.sha256, sha256_hex(&small));
    assert!(hub.requests().iter().filter(|r| r.path.contains("/tree/main")).count() >= 3);
    let err = pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &options(&hub), &NoProgress).unwrap_err();
    assert!(matches!(err, PullError::ChooseFile { .. }), "{err}");
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_download_cut_midway_is_resumed_by_the_next_pull() {
    let hub = FakeHub::start().unwrap();
    let bytes = gguf(400_000, 5);
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", &bytes);
    hub.fail_next("/cdn/", Fault::CutAfter(150_000));
    let cache = scratch("resume");
    let n = name("hf:acme/Tiny-GGUF/tiny-Q4_K_M.gguf", &hub);
    let err = pull(&n, &cache, &options(&hub), &NoProgress).unwrap_err();
    assert!(
        matches!(err, PullError::Interrupted { done: 150_000, .. }) && err.to_string().contains("resume"),
        "{err}"
    );
    // Nothing where models are looked for: the bytes are in a hidden file.
    let path = hf_path(&cache, REPO, "tiny-Q4_K_M.gguf");
    assert!(!path.exists());
    assert!(find_cached(&n, &cache).is_none() && list_cached(&cache).is_empty());
    assert!(hidden_beside(&path).contains(&".tiny-Q4_K_M.gguf.partial".to_string()));

    let pulled = pull(&n, &cache, &options(&hub), &NoProgress).unwrap();
    assert_eq!(pulled.resumed_from, 150_000);
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert!(pulled.cached.record.published);
    let last = hub
        .requests()
        .into_iter()
        .rev()
        .find(|r| r.path.starts_with("/cdn/"))
        .unwrap();
    assert_eq!(last.range.as_deref(), Some("bytes=150000-"));
    assert_eq!(hidden_beside(&path), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_cut_within_one_pull_is_resumed_after_a_wait() {
    let hub = FakeHub::start().unwrap();
    let bytes = gguf(200_000, 6);
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", &bytes);
    hub.fail_next("/cdn/", Fault::CutAfter(70_000));
    hub.fail_next("/cdn/", Fault::CutAfter(50_000));
    let cache = scratch("retry");
    let mut opts = options(&hub);
    opts.retries = 2;
    let pulled = pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &opts, &NoProgress).unwrap();
    assert_eq!(std::fs::read(&pulled.cached.path).unwrap(), bytes);
    let ranges: Vec<_> = hub
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/cdn/"))
        .map(|r| r.range)
        .collect();
    assert_eq!(
        ranges,
        vec![
            None,
            Some("bytes=70000-".to_string()),
            Some("bytes=120000-".to_string())
        ]
    );
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_wrong_checksum_deletes_the_download_and_keeps_the_older_copy() {
    let hub = FakeHub::start().unwrap();
    let good = gguf(100_000, 7);
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", &good);
    let cache = scratch("checksum");
    let n = name("hf:acme/Tiny-GGUF/tiny-Q4_K_M.gguf", &hub);
    pull(&n, &cache, &options(&hub), &NoProgress).unwrap();
    let path = hf_path(&cache, REPO, "tiny-Q4_K_M.gguf");

    // A new version whose bytes do not match what the hub publishes.
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", &gguf(100_000, 8));
    let claimed = "ab".repeat(32);
    hub.publish_sha256(REPO, "tiny-Q4_K_M.gguf", &claimed);
    let err = pull(&n, &cache, &options(&hub), &NoProgress).unwrap_err();
    match &err {
        PullError::Checksum { file, expected, actual } => {
            assert_eq!(file, "hf:acme/Tiny-GGUF/tiny-Q4_K_M.gguf");
            assert_eq!(expected, &claimed);
            assert_eq!(actual, &sha256_hex(&gguf(100_000, 8)));
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("deleted"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), good);
    assert_eq!(find_cached(&n, &cache).unwrap().record.sha256, sha256_hex(&good));
    assert_eq!(hidden_beside(&path), Vec::<String>::new());

    // A good new version replaces the old one.
    let newer = gguf(120_000, 9);
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", &newer);
    assert!(pull(&n, &cache, &options(&hub), &NoProgress).unwrap().downloaded);
    assert_eq!(std::fs::read(&path).unwrap(), newer);
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn missing_files_and_busy_servers_are_errors_that_say_so() {
    let hub = FakeHub::start().unwrap();
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", &gguf(1000, 10));
    let cache = scratch("errors");
    let opts = options(&hub);
    let err = pull(&name("hf:acme/Nope", &hub), &cache, &opts, &NoProgress).unwrap_err();
    assert!(matches!(err, PullError::Http { status: 404, .. }), "{err}");
    assert!(
        err.to_string().contains("hf:acme/Nope is not found (HTTP 404)"),
        "{err}"
    );
    let err = pull(&name("hf:acme/Tiny-GGUF/other.gguf", &hub), &cache, &opts, &NoProgress).unwrap_err();
    assert!(
        matches!(err, PullError::NoFile { .. }) && err.to_string().contains("tiny-Q4_K_M.gguf"),
        "{err}"
    );
    hub.fail_next("/resolve/", Fault::Status(404));
    let err = pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &opts, &NoProgress).unwrap_err();
    assert!(matches!(err, PullError::Http { status: 404, .. }), "{err}");
    hub.fail_next("/tree/", Fault::Status(429));
    let err = pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &opts, &NoProgress).unwrap_err();
    assert!(
        matches!(err, PullError::Http { status: 429, .. }) && err.to_string().contains("wait 7 s"),
        "{err}"
    );
    hub.fail_next("/tree/", Fault::Page);
    let err = pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &opts, &NoProgress).unwrap_err();
    assert!(
        matches!(err, PullError::BadAnswer { .. }) && err.to_string().contains("not the hub's JSON"),
        "{err}"
    );
    hub.fail_next("/cdn/", Fault::Status(500));
    let err = pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &opts, &NoProgress).unwrap_err();
    assert!(matches!(err, PullError::Http { status: 500, .. }), "{err}");
    assert!(list_cached(&cache).is_empty());

    // Another pull of the same file at the same time is refused.
    let path = hf_path(&cache, REPO, "tiny-Q4_K_M.gguf");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let held = std::fs::File::create(path.with_file_name(".tiny-Q4_K_M.gguf.partial")).unwrap();
    held.lock().unwrap();
    let err = pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &opts, &NoProgress).unwrap_err();
    assert!(matches!(err, PullError::Busy { .. }), "{err}");
    drop(held);
    assert!(pull(&name("hf:acme/Tiny-GGUF", &hub), &cache, &opts, &NoProgress).is_ok());

    // Nothing listens: one line saying so.
    let dead = HubOptions {
        endpoint: "http://127.0.0.1:9".into(),
        ..opts.clone()
    };
    let err = pull(&name("hf:acme/Tiny-GGUF:Q8_0", &hub), &cache, &dead, &NoProgress).unwrap_err();
    assert!(matches!(err, PullError::Network { .. }), "{err}");
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_plain_url_is_pulled_with_its_computed_checksum_and_resumed_by_validator() {
    let hub = FakeHub::start().unwrap();
    let bytes = gguf(250_000, 11);
    hub.add_plain("models/m.gguf", &bytes, "\"v1\"");
    let cache = scratch("url");
    let url = format!("{}/files/models/m.gguf", hub.url());
    let n = RemoteName::parse(&url, "https://huggingface.co").unwrap().unwrap();
    hub.fail_next("/files/", Fault::CutAfter(100_000));
    assert!(matches!(
        pull(&n, &cache, &options(&hub), &NoProgress),
        Err(PullError::Interrupted { .. })
    ));
    let pulled = pull(&n, &cache, &options(&hub), &NoProgress).unwrap();
    assert_eq!(pulled.resumed_from, 100_000);
    assert_eq!(std::fs::read(&pulled.cached.path).unwrap(), bytes);
    assert!(!pulled.cached.record.published);
    assert_eq!(pulled.cached.record.sha256, sha256_hex(&bytes));
    let last = hub.requests().pop().unwrap();
    assert_eq!(last.if_range.as_deref(), Some("\"v1\""));
    // A redirect to a path on the same host is followed.
    let moved = RemoteName::Url(format!("{}/moved/models/m.gguf", hub.url()));
    let pulled = pull(&moved, &cache, &options(&hub), &NoProgress).unwrap();
    assert_eq!(std::fs::read(&pulled.cached.path).unwrap(), bytes);
    // Cached: not fetched again.
    let before = hub.requests().len();
    assert!(!pull(&n, &cache, &options(&hub), &NoProgress).unwrap().downloaded);
    assert_eq!(hub.requests().len(), before);
    assert_eq!(list_cached(&cache)[0].record.name, url);

    // A file that changed under a partial download comes back whole.
    let url2 = format!("{}/files/models/n.gguf", hub.url());
    let n2 = RemoteName::parse(&url2, "https://huggingface.co").unwrap().unwrap();
    hub.add_plain("models/n.gguf", &gguf(90_000, 12), "\"v1\"");
    hub.fail_next("/files/models/n", Fault::CutAfter(40_000));
    assert!(pull(&n2, &cache, &options(&hub), &NoProgress).is_err());
    let changed = gguf(80_000, 13);
    hub.add_plain("models/n.gguf", &changed, "\"v2\"");
    let pulled = pull(&n2, &cache, &options(&hub), &NoProgress).unwrap();
    assert_eq!(std::fs::read(&pulled.cached.path).unwrap(), changed);

    // Something that is not a GGUF file (a web page) is not kept.
    hub.add_plain("page.gguf", b"<!DOCTYPE html><html>", "\"p\"");
    let page = RemoteName::Url(format!("{}/files/page.gguf", hub.url()));
    let err = pull(&page, &cache, &options(&hub), &NoProgress).unwrap_err();
    assert!(
        matches!(err, PullError::NotGguf { .. }) && err.to_string().contains("<!DOCTYPE"),
        "{err}"
    );
    let page_path = url_path(&cache, &page.to_string()).unwrap();
    assert!(!page_path.exists());
    assert_eq!(hidden_beside(&page_path), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&cache);
}
