//! A model folder for people who write their own loop: `save_model` writes a
//! Hugging Face folder that `tinyllm eval`/`generate` load, `load_model` reads
//! one (with or without tinyllm's manifest), and both directions agree with an
//! independent reference — Hugging Face's `LlamaForCausalLM` forward pass in
//! numpy (`tests/reference/llama_numpy.py`, float64), which reads and writes
//! the folder format itself.
//!
//! The reference tests need a `python3` with numpy (`apt-get install
//! python3-numpy`): without one they print a message and skip, unless
//! `TINYLLM_REQUIRE_NUMPY=1` (CI), which makes that a failure.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::tmpdir;
use std::path::{Path, PathBuf};
use std::process::Command;
use tinyllm::nn::llama::{Llama, LlamaConfig};
use tinyllm::nn::Module;
use tinyllm::ops::cross_entropy;
use tinyllm::optim::{AdamW, AdamWConfig};
use tinyllm::precision::Precision;
use tinyllm::train::data::{Batch, ByteTokenizer};
use tinyllm::train::{load_model, save_model};
use tinyllm::{Device, MixedStep};

const BIN: &str = env!("CARGO_BIN_EXE_tinyllm");
const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/reference/llama_numpy.py"
);
/// float32 (tinyllm, its own math library) against float64 (the reference):
/// the largest logit difference, relative to the largest logit.
const TOLERANCE: f64 = 1e-4;

const TEXT: &str = "the cat sat on the mat. the dog sat on the log. the cat saw the dog. ";

/// The loop a user writes, with the public API only: a tiny Llama, AdamW, a
/// few bf16 steps over two micro-batches of text, then `save_model`.
fn user_loop(dir: &Path) -> tinyllm::Result<Llama> {
    let cfg = LlamaConfig::preset("tiny")?;
    let model = Llama::new(&cfg, 42, Device::Cpu)?.with_recompute(Some(3))?;
    let mut opt = AdamW::new(model.parameters(), AdamWConfig::new(1e-2))?;
    let ids = ByteTokenizer::encode(TEXT);
    let (rows, t) = (4, cfg.context);
    let batch = Batch {
        ids: ids[..rows * t].to_vec(),
        targets: ids[1..rows * t + 1].to_vec(),
        rows,
        t,
    };
    let micro = batch.split(2);
    let loss = |mb: &Batch| cross_entropy(&model.forward(&mb.ids, mb.rows, mb.t)?, &mb.targets);
    let mut losses = Vec::new();
    for _ in 0..8 {
        let r = MixedStep::new(Precision::Bf16)
            .clip(1.0)
            .run(&model, &micro, loss, &mut opt)?;
        losses.push(r.loss);
    }
    assert!(losses[7] < losses[0], "the loop learns: {losses:?}");
    save_model(&model, dir)?;
    Ok(model)
}

fn run_bin(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(BIN).args(args).output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_user_loop_saves_a_folder_that_eval_and_generate_load() {
    let root = tmpdir("user-loop");
    let dir = root.join("model");
    user_loop(&dir).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "manifest.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let text = root.join("text.txt");
    std::fs::write(&text, TEXT.repeat(4)).unwrap();
    let (ok, out, err) = run_bin(&["eval", "--checkpoint", s(&dir), "--data", s(&text)]);
    assert!(ok && out.contains("mean cross-entropy"), "eval: {out}{err}");
    let (ok, out, err) = run_bin(&[
        "generate",
        "--checkpoint",
        s(&dir),
        "--prompt",
        "the ",
        "--len",
        "12",
    ]);
    assert!(ok && out.starts_with("the "), "generate: {out}{err}");
    // Without --data there are no held-out windows to read: a clear error.
    let (ok, _, err) = run_bin(&["eval", "--checkpoint", s(&dir)]);
    assert!(
        !ok && err.contains(s(&dir)) && err.contains("--data"),
        "{err}"
    );

    // A plain Hugging Face folder: the weights and config.json, nothing else.
    let plain = root.join("plain");
    std::fs::create_dir(&plain).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(dir.join(f), plain.join(f)).unwrap();
    }
    let (ok, out, err) = run_bin(&["eval", "--checkpoint", s(&plain), "--data", s(&text)]);
    assert!(ok && out.contains("mean cross-entropy"), "eval: {out}{err}");
    let (ok, out, err) = run_bin(&["generate", "--checkpoint", s(&plain), "--len", "5"]);
    assert!(ok, "generate: {out}{err}");
    let _ = std::fs::remove_dir_all(&root);
}

/// The tokenizer beside the weights maps each byte of UTF-8 text to its id.
#[test]
fn the_tokenizer_file_is_the_byte_vocabulary() {
    let dir = tmpdir("tokenizer");
    let model = Llama::new(&LlamaConfig::preset("tiny").unwrap(), 0, Device::Cpu).unwrap();
    save_model(&model, &dir).unwrap();
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir.join(f)).unwrap()).unwrap()
    };
    let tok = read("tokenizer.json");
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    assert_eq!(vocab.len(), 256);
    for b in 0..=255u8 {
        assert_eq!(vocab[&format!("<0x{b:02X}>")], b as u64);
    }
    assert_eq!(tok["model"]["type"], "BPE");
    assert_eq!(tok["model"]["byte_fallback"], true);
    assert!(tok["model"]["merges"].as_array().unwrap().is_empty());
    assert!(tok["pre_tokenizer"].is_null() && tok["normalizer"].is_null());
    let tc = read("tokenizer_config.json");
    assert_eq!(tc["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(read("generation_config.json")["max_length"], 16);
    assert_eq!(read("config.json")["architectures"][0], "LlamaForCausalLM");
    let m = read("manifest.json");
    assert_eq!(m["format"], "tinyllm-model-1");
    assert_eq!(m["files"].as_object().unwrap().len(), 5);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What `save_model` refuses, and that it never overwrites a file it did not
/// write; what `load_model` names when it refuses.
#[test]
fn save_model_keeps_to_its_own_files_and_load_model_names_the_folder() {
    let root = tmpdir("refusals");
    let model = Llama::new(&LlamaConfig::preset("tiny").unwrap(), 0, Device::Cpu).unwrap();
    // A file of the folder's names that is the user's.
    let dir = root.join("theirs");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), b"mine").unwrap();
    let e = save_model(&model, &dir).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("did not write"),
        "{e}"
    );
    assert_eq!(std::fs::read(dir.join("tokenizer.json")).unwrap(), b"mine");
    assert!(!dir.join("model.safetensors").exists(), "nothing written");
    // A link at one of its names.
    #[cfg(unix)]
    {
        let dir = root.join("link");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink(root.join("elsewhere"), dir.join("config.json")).unwrap();
        let e = save_model(&model, &dir).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
    }
    // A run's directory, and a run's checkpoint.
    let run = root.join("run");
    std::fs::create_dir_all(run.join("checkpoint")).unwrap();
    let e = save_model(&model, &run).unwrap_err().to_string();
    assert!(e.contains("holds a training run"), "{e}");
    // Its own earlier save is replaced; foreign files beside it stay.
    let dir = root.join("mine");
    save_model(&model, &dir).unwrap();
    std::fs::write(dir.join("README.md"), b"notes").unwrap();
    save_model(&model, &dir).unwrap();
    assert_eq!(std::fs::read(dir.join("README.md")).unwrap(), b"notes");
    load_model(&dir, Device::Cpu).unwrap();
    // A damaged file is caught by the manifest; the error names the folder.
    let w = dir.join("model.safetensors");
    let mut b = std::fs::read(&w).unwrap();
    let n = b.len();
    b[n - 1] ^= 1;
    std::fs::write(&w, &b).unwrap();
    let e = load_model(&dir, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains(s(&dir)) && e.contains("SHA-256"), "{e}");
    // Without the manifest the same folder is a plain Hugging Face folder.
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    load_model(&dir, Device::Cpu).unwrap();
    // A plain folder's errors name it too.
    std::fs::remove_file(&w).unwrap();
    let e = load_model(&dir, Device::Cpu).err().unwrap().to_string();
    assert!(
        e.contains(s(&dir)) && e.contains("model.safetensors"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

// ------------------------------------------------- the numpy reference ----

/// A python3 with numpy: `$TINYLLM_PYTHON`, `python3` or `/usr/bin/python3`.
/// `None` (with a message) when there is none, a failure instead when
/// `TINYLLM_REQUIRE_NUMPY=1`.
fn python(test: &str) -> Option<String> {
    let found = std::env::var("TINYLLM_PYTHON")
        .ok()
        .into_iter()
        .chain(["python3".to_string(), "/usr/bin/python3".to_string()])
        .find(|p| {
            Command::new(p)
                .args(["-c", "import numpy"])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    if found.is_none() {
        if std::env::var("TINYLLM_REQUIRE_NUMPY").is_ok_and(|v| v == "1") {
            panic!("TINYLLM_REQUIRE_NUMPY=1 but no python3 with numpy was found (apt-get install python3-numpy)");
        }
        eprintln!("{test}: skipped: no python3 with numpy (apt-get install python3-numpy; TINYLLM_REQUIRE_NUMPY=1 makes this a failure)");
    }
    found
}

/// The reference's logits for `ids` (`batch` sequences), row-major `(B·T, V)`.
fn reference(py: &str, dir: &Path, ids: &[u32], batch: usize, mutate: Option<&str>) -> Vec<f64> {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let mut cmd = Command::new(py);
    cmd.args([SCRIPT, "logits", s(dir), "--ids", &ids.join(",")])
        .args(["--batch", &batch.to_string()]);
    if let Some(m) = mutate {
        cmd.args(["--mutate", m]);
    }
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "the reference failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// tinyllm's float32 logits, on the CPU, without a graph.
fn tinyllm_logits(model: &Llama, ids: &[u32], batch: usize) -> Vec<f32> {
    let _ng = tinyllm::no_grad();
    model
        .forward(ids, batch, ids.len() / batch)
        .unwrap()
        .to_vec_f32()
        .unwrap()
}

/// The largest difference, relative to the largest reference logit.
fn rel_diff(ours: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let worst = ours
        .iter()
        .zip(reference)
        .fold(0.0f64, |m, (&a, &b)| m.max((a as f64 - b).abs()));
    worst / scale
}

fn text_ids(n: usize) -> Vec<u32> {
    ByteTokenizer::encode(TEXT)
        .into_iter()
        .cycle()
        .take(n)
        .collect()
}

/// (a) tinyllm → the reference: a trained model saved by `save_model`.
#[test]
fn saved_models_match_the_numpy_reference() {
    let Some(py) = python("saved_models_match_the_numpy_reference") else {
        return;
    };
    let dir = tmpdir("to-reference");
    let model = user_loop(&dir).unwrap();
    let ids = text_ids(2 * model.cfg.context);
    let d = rel_diff(
        &tinyllm_logits(&model, &ids, 2),
        &reference(&py, &dir, &ids, 2, None),
    );
    eprintln!("tinyllm -> reference: largest logit difference {d:.2e} of the largest logit");
    assert!(d < TOLERANCE, "{d:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// (b) the reference → tinyllm: random folders the script writes, loaded by
/// `load_model` (a plain Hugging Face folder: no manifest, configs with
/// another width, head count, RoPE theta and eps).
#[test]
fn reference_folders_load_and_match() {
    let Some(py) = python("reference_folders_load_and_match") else {
        return;
    };
    let root = tmpdir("from-reference");
    // (hidden, layers, heads, intermediate, context, rms eps, rope theta, std)
    let cases = [
        (48, 3, 3, 80, 24, "1e-2", "500", "0.2"),
        (32, 2, 2, 64, 16, "1e-6", "10000", "0.02"),
    ];
    for (i, (c, l, h, f, t, eps, theta, std)) in cases.into_iter().enumerate() {
        let dir = root.join(format!("case{i}"));
        let st = Command::new(&py)
            .args([SCRIPT, "write", s(&dir), "--seed", &i.to_string()])
            .args(["--hidden", &c.to_string(), "--layers", &l.to_string()])
            .args(["--heads", &h.to_string(), "--intermediate", &f.to_string()])
            .args(["--context", &t.to_string(), "--rms-eps", eps])
            .args(["--rope-theta", theta, "--std", std])
            .status()
            .unwrap();
        assert!(st.success());
        let model = load_model(&dir, Device::Cpu).unwrap();
        assert_eq!((model.cfg.d_model, model.cfg.n_heads), (c, h));
        assert_eq!(model.cfg.rope_theta, theta.parse::<f64>().unwrap());
        let ids = text_ids(2 * t);
        let d = rel_diff(
            &tinyllm_logits(&model, &ids, 2),
            &reference(&py, &dir, &ids, 2, None),
        );
        eprintln!(
            "reference -> tinyllm, case {i}: largest logit difference {d:.2e} of the largest logit"
        );
        assert!(d < TOLERANCE, "case {i}: {d:e}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The comparison can fail: the reference broken on purpose (rotate_half's
/// halves swapped, eps outside the square root, one weight changed by 1 %)
/// gives logits far outside the tolerance.
#[test]
fn the_reference_comparison_can_fail() {
    let Some(py) = python("the_reference_comparison_can_fail") else {
        return;
    };
    let dir: PathBuf = tmpdir("mutated-reference");
    let st = Command::new(&py)
        .args([SCRIPT, "write", s(&dir), "--hidden", "48", "--layers", "3"])
        .args(["--heads", "3", "--intermediate", "80", "--context", "24"])
        .args(["--rms-eps", "1e-2", "--rope-theta", "500"])
        .status()
        .unwrap();
    assert!(st.success());
    let model = load_model(&dir, Device::Cpu).unwrap();
    let ids = text_ids(24);
    let ours = tinyllm_logits(&model, &ids, 1);
    for m in ["rotate_half", "eps", "weight"] {
        let d = rel_diff(&ours, &reference(&py, &dir, &ids, 1, Some(m)));
        eprintln!("reference with {m} broken: largest logit difference {d:.2e}");
        assert!(d > TOLERANCE, "{m}: {d:e} is within the tolerance");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
