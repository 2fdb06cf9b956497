//! The panel cache file: built once, mapped by later loads, rebuilt when
//! its header does not match, stale files of the same model removed, and
//! its panels equal to packing the tensors directly.
#![allow(clippy::unwrap_used)] // a test or a tool: a failure may panic

use std::path::PathBuf;

use snug_kernels::panel::{self, pack_matrix, packed_matrix_bytes};
use snug_model::packed::PackedWeights;
use snug_model::testing::model_path;
use snug_model::GgufFile;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("snug-packed-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn cache_file_is_built_once_verified_and_rebuilt_when_wrong() {
    let Some(path) = model_path("smollm2-135m") else { return };
    let file = GgufFile::open(&path).unwrap();
    if !panel::available(snug_kernels::GgmlType::Q4_1) {
        eprintln!("no AVX-512 VNNI here: nothing is packed");
        return;
    }
    let names = [
        "blk.0.attn_q.weight",
        "blk.3.ffn_down.weight",
        "token_embd.weight",
        "no.such.tensor",
    ];
    let dir = temp_dir("cache");
    // A stale file of the same model (another key) is removed by a build.
    std::fs::create_dir_all(&dir).unwrap();
    let stem = path.file_name().unwrap().to_string_lossy().into_owned();
    let stale = dir.join(format!("{stem}-0000000000000000.snugpack"));
    std::fs::write(&stale, b"old").unwrap();

    let built = PackedWeights::open_or_build(&file, &names, &dir).unwrap().unwrap();
    let cache = built.path().unwrap().to_path_buf();
    assert!(cache.starts_with(&dir) && cache.exists());
    assert!(!stale.exists(), "stale cache file kept");
    assert!(built.get("no.such.tensor").is_none());
    for name in &names[..3] {
        let t = file.tensor(name).unwrap();
        let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
        let mut want = vec![0u8; packed_matrix_bytes(t.ty, rows, cols)];
        pack_matrix(t.ty, file.tensor_data(t), rows, cols, &mut want);
        assert!(built.get(name).unwrap() == &want[..], "{name}: panels differ");
    }
    let modified = std::fs::metadata(&cache).unwrap().modified().unwrap();
    drop(built);

    // A second load maps the same file without writing it.
    let again = PackedWeights::open_or_build(&file, &names, &dir).unwrap().unwrap();
    assert_eq!(again.path(), Some(cache.as_path()));
    assert_eq!(std::fs::metadata(&cache).unwrap().modified().unwrap(), modified);
    let first = again.get(names[0]).unwrap().to_vec();
    drop(again);

    // A damaged header (or a truncated file) is rebuilt, not trusted.
    let mut bytes = std::fs::read(&cache).unwrap();
    bytes[8] ^= 0xff;
    std::fs::write(&cache, &bytes).unwrap();
    let rebuilt = PackedWeights::open_or_build(&file, &names, &dir).unwrap().unwrap();
    assert_eq!(rebuilt.get(names[0]).unwrap(), &first[..]);
    drop(rebuilt);
    std::fs::write(&cache, &bytes[..bytes.len() / 2]).unwrap();
    let rebuilt = PackedWeights::open_or_build(&file, &names, &dir).unwrap().unwrap();
    assert_eq!(rebuilt.get(names[0]).unwrap(), &first[..]);
    assert_eq!(std::fs::metadata(&cache).unwrap().len(), rebuilt.len());
    drop(rebuilt);

    // No temporary files are left behind.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");

    // A directory that cannot be made is an error (the model loader then
    // packs into memory instead).
    let blocker = temp_dir("blocker");
    std::fs::write(&blocker, b"a file").unwrap();
    let err = PackedWeights::open_or_build(&file, &names, &blocker.join("sub"));
    assert!(err.is_err());
    let _ = std::fs::remove_file(&blocker);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stack of experts' matrices (`[cols, rows, experts]`) packs as one
/// matrix of all their rows, expert e's panels its e-th equal part: the
/// same bytes as packing expert e's rows alone.
#[test]
fn expert_stacks_pack_expert_by_expert() {
    use snug_model::testing::synth::{self, Shape, Spec};
    let Some(like) = model_path("smollm2-135m") else { return };
    if !panel::available(snug_kernels::GgmlType::Q4K) {
        eprintln!("no panels here: nothing is packed");
        return;
    }
    let like = GgufFile::open(&like).unwrap();
    let dir = temp_dir("experts");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("moe.gguf");
    let spec = Spec {
        arch: "qwen3moe".into(),
        shape: Shape {
            dim: 256,
            layers: 1,
            heads: 4,
            kv_heads: 2,
            // Experts of 256 (a quarter), one Q4_K super-block a row.
            ff: 1024,
            head_dim: 64,
        },
        ty: snug_kernels::GgmlType::Q4K,
        head_ty: snug_kernels::GgmlType::Q6K,
        window: 0,
        scale: 0.002,
        name: "experts".into(),
        rope_freqs: None,
        rope_linear: None,
        extra: Vec::new(),
        tokenizer_only: false,
    };
    synth::write(&like.header, &spec, &path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let names = ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"];
    let packed = PackedWeights::open_or_build(&file, &names, &dir.join("packed"))
        .unwrap()
        .unwrap();
    for name in names {
        let t = file.tensor(name).unwrap();
        let (cols, rows, experts) = (t.dims[0] as usize, t.dims[1] as usize, t.dims[2] as usize);
        let got = packed.get(name).unwrap();
        let data = file.tensor_data(t);
        let (per, pper) = (data.len() / experts, packed_matrix_bytes(t.ty, rows, cols));
        assert_eq!(got.len(), experts * pper, "{name}: packed length");
        for e in 0..experts {
            let mut want = vec![0u8; pper];
            pack_matrix(t.ty, &data[e * per..(e + 1) * per], rows, cols, &mut want);
            assert!(got[e * pper..(e + 1) * pper] == want[..], "{name}: expert {e}'s panels");
        }
    }
    drop(packed);
    let _ = std::fs::remove_dir_all(&dir);
}
