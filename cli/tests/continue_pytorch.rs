//! Continuing a run in PyTorch: `tinyllm export` writes a run's full
//! training state in one safetensors file, `scripts/continue_in_pytorch.py`
//! trains on from it under torchrun, and the folder it writes loads in
//! `tinyllm eval`/`generate`; `tinyllm import` turns the script's state
//! back into a run that `tinyllm train --resume` continues.
//!
//! The export's contents and every refusal (another version, another run, a
//! missing moment, a shape mismatch) are checked here without PyTorch. The
//! tests that run the script need a python with torch, transformers and
//! safetensors (`$TINYLLM_TORCH_PYTHON`, else `python3`): without one they
//! print a message and skip, unless `TINYLLM_REQUIRE_TORCH=1`, which makes
//! that a failure. CI has no torch and does not set it.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::tmpdir;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use tinyllm::nn::llama::Llama;
use tinyllm::ops::cross_entropy;
use tinyllm::train::continuation::{self, META_KEY};
use tinyllm::Device;

const BIN: &str = env!("CARGO_BIN_EXE_tinyllm");
const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../scripts/continue_in_pytorch.py"
);
/// The first continued step's loss, PyTorch against tinyllm (issue 41).
const TOLERANCE: f64 = 1e-5;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn run_bin(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(BIN).args(args).output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// A float32 run of `steps` steps of `preset` in `dir`.
fn train(dir: &Path, preset: &str, steps: usize) {
    let steps = steps.to_string();
    let (ok, out, err) = run_bin(&[
        "train",
        "--preset",
        preset,
        "--steps",
        &steps,
        "--fp32",
        "--device",
        "cpu",
        "--out",
        s(dir),
        "--plain",
        "--sample-len",
        "0",
    ]);
    assert!(ok, "train: {out}{err}");
}

/// `run` resumed to `steps` into `out`: tinyllm's own next steps.
fn resume(run: &Path, out: &Path, steps: usize) -> Vec<(usize, f64, f64)> {
    let steps = steps.to_string();
    let (ok, o, e) = run_bin(&[
        "train",
        "--resume",
        s(run),
        "--steps",
        &steps,
        "--out",
        s(out),
        "--plain",
        "--sample-len",
        "0",
    ]);
    assert!(ok, "resume: {o}{e}");
    metrics(out)
}

/// `(step, loss, lr)` of every row of a run's metrics.
fn metrics(run: &Path) -> Vec<(usize, f64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap() as usize,
                v["loss"].as_f64().unwrap(),
                v["lr"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn export(run: &Path, batches: usize, out: &Path) {
    let b = batches.to_string();
    let (ok, o, e) = run_bin(&[
        "export",
        "--checkpoint",
        s(run),
        "--batches",
        &b,
        "--out",
        s(out),
    ]);
    assert!(ok, "export: {o}{e}");
}

/// One trained tiny run, its export of 2 batches and tinyllm's steps 4..=5.
struct Fixture {
    root: PathBuf,
    run: PathBuf,
    file: PathBuf,
    next: Vec<(usize, f64, f64)>,
}

fn fixture(name: &str) -> Fixture {
    let root = tmpdir(name);
    let run = root.join("run");
    train(&run, "tiny", 3);
    let file = root.join("run.continue.safetensors");
    export(&run, 2, &file);
    let next = resume(&run, &root.join("resumed"), 5);
    Fixture {
        root,
        run,
        file,
        next,
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn the_export_holds_the_checkpoint_and_the_batches_tinyllm_trains_on_next() {
    let f = fixture("contents");
    let c = continuation::read_file(&f.file).unwrap();
    let m = &c.meta;
    assert_eq!((m.step, m.batches, m.precision.as_str()), (3, 2, "fp32"));
    assert_eq!(m.format, continuation::FORMAT);
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(f.run.join("checkpoint/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(m.run_id, state["run_id"].as_str().unwrap());
    // Weights and moments: the checkpoint's own bits, under the same names.
    let wbytes = std::fs::read(f.run.join("checkpoint/model.safetensors")).unwrap();
    let obytes = std::fs::read(f.run.join("checkpoint/optimizer.safetensors")).unwrap();
    let (w, o) = (
        SafeTensors::deserialize(&wbytes).unwrap(),
        SafeTensors::deserialize(&obytes).unwrap(),
    );
    for (i, name) in m.params.iter().enumerate() {
        assert_eq!(c.weights[i], f32s(w.tensor(name).unwrap().data()), "{name}");
        let (ea, eas, k) = c.moments[i].as_ref().expect("every parameter has moments");
        assert_eq!(*k, 3, "{name}");
        let ea_want = f32s(o.tensor(&format!("{name}.exp_avg")).unwrap().data());
        let eas_want = f32s(o.tensor(&format!("{name}.exp_avg_sq")).unwrap().data());
        assert_eq!((ea, eas), (&ea_want, &eas_want), "{name}");
    }
    // The rates are the resumed run's, to the bit.
    let lrs: Vec<f32> = f.next.iter().map(|r| r.2 as f32).collect();
    assert_eq!(m.schedule.lrs, lrs);
    // The batches are the ones the resumed run trained on: the exported
    // weights' full-batch loss on batch 0 is the loss tinyllm reported for
    // step 4 (it sums micro-batches, so to float32 rounding, not bits).
    let bytes = std::fs::read(&f.file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = |n: &str| -> Vec<u32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    let model = tinyllm::train::load_model(&f.run, Device::Cpu).unwrap();
    let (rows, t) = (m.data.batch, m.data.context);
    let loss = |i: usize| -> f64 {
        let _ng = tinyllm::no_grad();
        let x = ids(&format!("batch.{i}.input_ids"));
        let y = ids(&format!("batch.{i}.labels"));
        assert_eq!(x.len(), rows * t);
        let logits = Llama::forward(&model, &x, rows, t).unwrap();
        cross_entropy(&logits, &y).unwrap().item().unwrap()
    };
    let l0 = loss(0);
    let rel = (l0 - f.next[0].1).abs() / f.next[0].1;
    assert!(
        rel < 1e-6,
        "batch 0: {l0} vs the resumed step's {}",
        f.next[0].1
    );
    // …and batch 1 is another batch (the order moved on).
    assert_ne!(ids("batch.0.input_ids"), ids("batch.1.input_ids"));
    let (ok, out, err) = run_bin(&["export", "--checkpoint", s(&f.run), "--check", s(&f.file)]);
    assert!(ok && out.contains("ok"), "{out}{err}");
    // Imported back as it is, the file is the run: resumed, the same bits.
    let back = f.root.join("back");
    import(&f.file, &f.run, &back);
    let again = resume(&back, &back, 5);
    assert_eq!(again, f.next, "the imported run's steps 4..=5");
    let _ = std::fs::remove_dir_all(&f.root);
}

fn import(file: &Path, run: &Path, out: &Path) {
    let (ok, o, e) = run_bin(&[
        "import",
        "--continuation",
        s(file),
        "--checkpoint",
        s(run),
        "--out",
        s(out),
    ]);
    assert!(ok, "import: {o}{e}");
}

// ------------------------------------------------------ bad input ----

/// A safetensors file's tensors: name → (dtype, shape, bytes).
type Tensors = HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn tensors_of(bytes: &[u8]) -> Tensors {
    SafeTensors::deserialize(bytes)
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn serialize(t: &Tensors, md: Option<HashMap<String, String>>) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView)> = t
        .iter()
        .map(|(n, (d, sh, b))| {
            let v = safetensors::tensor::TensorView::new(*d, sh.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize(views, md).unwrap()
}

/// A copy of the continuation `src` as `dst`, with `edit` applied to its
/// tensors (name → dtype, shape, bytes) and its metadata JSON.
fn rewrite(src: &Path, dst: &Path, edit: impl FnOnce(&mut Tensors, &mut serde_json::Value)) {
    let bytes = std::fs::read(src).unwrap();
    let mut tensors = tensors_of(&bytes);
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta: serde_json::Value =
        serde_json::from_str(&header.metadata().as_ref().unwrap()[META_KEY]).unwrap();
    edit(&mut tensors, &mut meta);
    let md = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (META_KEY.to_string(), meta.to_string()),
    ]);
    std::fs::write(dst, serialize(&tensors, Some(md))).unwrap();
}

const EMBED: &str = "model.embed_tokens.weight";
const Q0: &str = "model.layers.0.self_attn.q_proj.weight";

/// The bad files and a word each refusal must say, with the name it must give.
fn bad_files(f: &Fixture) -> Vec<(PathBuf, &'static str, &'static str)> {
    let dir = f.root.join("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let version = dir.join("version.safetensors");
    rewrite(&f.file, &version, |_, m| {
        m["format"] = "tinyllm-continue-0".into()
    });
    let moment = dir.join("moment.safetensors");
    rewrite(&f.file, &moment, |t, _| {
        t.remove(&format!("{Q0}.exp_avg_sq"));
    });
    let shape = dir.join("shape.safetensors");
    rewrite(&f.file, &shape, |t, _| {
        let e = t.get_mut(EMBED).unwrap();
        e.1 = vec![e.1[1], e.1[0]];
    });
    let moment_shape = dir.join("moment-shape.safetensors");
    rewrite(&f.file, &moment_shape, |t, _| {
        let e = t.get_mut(&format!("{Q0}.exp_avg")).unwrap();
        e.1 = vec![e.1[0] * e.1[1]];
    });
    let ids = dir.join("ids.safetensors");
    rewrite(&f.file, &ids, |t, _| {
        let e = t.get_mut("batch.1.labels").unwrap();
        e.2[..8].copy_from_slice(&300i64.to_le_bytes());
    });
    vec![
        (ids, "outside", "batch.1.labels"),
        (version, "another version", "tinyllm-continue-0"),
        (moment, "missing AdamW moment", "exp_avg_sq"),
        (shape, "shape mismatch", EMBED),
        (moment_shape, "shape mismatch", "q_proj.weight.exp_avg"),
    ]
}

#[test]
fn tinyllm_refuses_a_bad_continuation_file_naming_what_is_wrong() {
    let f = fixture("bad-tinyllm");
    for (file, says, names) in bad_files(&f) {
        let (ok, out, err) = run_bin(&["export", "--checkpoint", s(&f.run), "--check", s(&file)]);
        assert!(!ok, "{} was accepted: {out}", file.display());
        assert!(
            err.contains(says) && err.contains(names) && err.contains(s(&file)),
            "{}: {err}",
            file.display()
        );
    }
    // A file of another run.
    let other = f.root.join("other");
    train(&other, "tiny", 3);
    let (ok, _, err) = run_bin(&["export", "--checkpoint", s(&other), "--check", s(&f.file)]);
    assert!(!ok && err.contains("another run"), "{err}");
    let into = f.root.join("into");
    let (ok, _, err) = run_bin(&[
        "import",
        "--continuation",
        s(&f.file),
        "--checkpoint",
        s(&other),
        "--out",
        s(&into),
    ]);
    assert!(
        !ok && err.contains("another run") && !into.exists(),
        "{err}"
    );
    for (file, says, _) in bad_files(&f) {
        let (ok, _, err) = run_bin(&[
            "import",
            "--continuation",
            s(&file),
            "--checkpoint",
            s(&f.run),
            "--out",
            s(&into),
        ]);
        assert!(!ok && err.contains(says) && !into.exists(), "{err}");
    }
    let (ok, _, err) = run_bin(&[
        "import",
        "--continuation",
        s(&f.file),
        "--checkpoint",
        s(&f.run),
        "--out",
        s(&other),
    ]);
    assert!(!ok && err.contains("not an empty directory"), "{err}");
    // Export refuses another text, and a file it did not write as --out.
    let text = f.root.join("text.txt");
    std::fs::write(&text, "some other text entirely. ".repeat(40)).unwrap();
    let (ok, _, err) = run_bin(&[
        "export",
        "--checkpoint",
        s(&f.run),
        "--data",
        s(&text),
        "--out",
        s(&f.root.join("x.safetensors")),
    ]);
    assert!(!ok && err.contains("trained on"), "{err}");
    let (ok, _, err) = run_bin(&["export", "--checkpoint", s(&f.run), "--out", s(&text)]);
    assert!(!ok && err.contains("not a continuation file"), "{err}");
    assert!(std::fs::read_to_string(&text)
        .unwrap()
        .starts_with("some other"));
    // Exporting over its own earlier file is fine.
    export(&f.run, 1, &f.file);
    let _ = std::fs::remove_dir_all(&f.root);
}

/// A folder as the script writes it (config.json, model.safetensors), with
/// `edit` applied to the weights: tinyllm names what is wrong.
#[test]
fn tinyllm_refuses_a_script_folder_with_a_missing_or_misshapen_tensor() {
    let root = tmpdir("bad-folder");
    let run = root.join("run");
    train(&run, "tiny", 1);
    let ck = run.join("checkpoint");
    type Edit = fn(&mut Tensors);
    let cases: [(&str, &str, Edit); 2] = [
        ("missing", "missing tensor", |t| {
            t.remove(Q0);
        }),
        ("shape", "has shape", |t| {
            let e = t.get_mut(Q0).unwrap();
            e.1 = vec![e.1[0] * e.1[1]];
        }),
    ];
    for (name, says, edit) in cases {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(ck.join("config.json"), dir.join("config.json")).unwrap();
        let mut t = tensors_of(&std::fs::read(ck.join("model.safetensors")).unwrap());
        edit(&mut t);
        std::fs::write(dir.join("model.safetensors"), serialize(&t, None)).unwrap();
        for cmd in [
            vec!["generate", "--checkpoint", s(&dir), "--len", "4"],
            vec![
                "eval",
                "--checkpoint",
                s(&dir),
                "--data",
                s(&run.join("metrics.jsonl")),
            ],
        ] {
            let (ok, _, err) = run_bin(&cmd);
            assert!(
                !ok && err.contains(says) && err.contains(Q0) && err.contains(s(&dir)),
                "{name}, {}: {err}",
                cmd[0]
            );
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

// ---------------------------------------------------------- PyTorch ----

/// A python with torch, transformers and safetensors, or `None` (with a
/// message); a failure instead when `TINYLLM_REQUIRE_TORCH=1`.
fn torch_python(test: &str) -> Option<String> {
    let found = std::env::var("TINYLLM_TORCH_PYTHON")
        .ok()
        .into_iter()
        .chain(["python3".to_string()])
        .find(|p| {
            Command::new(p)
                .args(["-c", "import torch, transformers, safetensors, numpy"])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    if found.is_none() {
        if std::env::var("TINYLLM_REQUIRE_TORCH").is_ok_and(|v| v == "1") {
            panic!("TINYLLM_REQUIRE_TORCH=1 but no python with torch, transformers and safetensors was found (set TINYLLM_TORCH_PYTHON)");
        }
        eprintln!("{test}: skipped: no python with torch, transformers and safetensors (TINYLLM_TORCH_PYTHON=...; TINYLLM_REQUIRE_TORCH=1 makes this a failure)");
    }
    found
}

/// The script under torchrun with `procs` gloo processes (1: no torchrun).
fn script(py: &str, procs: usize, args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(py);
    if procs > 1 {
        cmd.args(["-m", "torch.distributed.run", "--nproc_per_node"])
            .arg(procs.to_string())
            .arg("--standalone");
    }
    let o = cmd
        .arg(SCRIPT)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn pytorch_continues_with_tinyllm_s_losses_and_tinyllm_loads_the_result() {
    let Some(py) = torch_python("pytorch_continues_with_tinyllm_s_losses") else {
        return;
    };
    let root = tmpdir("pytorch");
    let run = root.join("run");
    train(&run, "small", 4);
    let file = root.join("run.continue.safetensors");
    export(&run, 2, &file);
    let next = resume(&run, &root.join("resumed"), 7);
    let out = root.join("torch");
    let json = root.join("losses.json");
    let (ok, o, e) = script(&py, 2, &[s(&file), "--out", s(&out), "--json", s(&json)]);
    assert!(ok, "the script: {o}{e}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["first_step"], 5);
    assert_eq!(v["processes"], 2);
    let losses: Vec<f64> = v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), 2);
    for (torch, ours) in losses.iter().zip(&next[..2]) {
        let rel = (torch - ours.1).abs() / ours.1;
        eprintln!(
            "step {}: PyTorch {torch:.7}, tinyllm {:.7}, relative difference {rel:.2e}",
            ours.0, ours.1
        );
        // The second step has gone through one AdamW update on each side
        // (the moments restored): it holds to the same bound.
        assert!(rel <= TOLERANCE, "step {}: {torch} vs {}", ours.0, ours.1);
    }
    // The way back: the script's folder loads in tinyllm, and its own
    // continuation file passes tinyllm's check.
    let (ok, o, e) = run_bin(&[
        "generate",
        "--checkpoint",
        s(&out),
        "--prompt",
        "the ",
        "--len",
        "8",
    ]);
    assert!(ok && o.starts_with("the "), "generate: {o}{e}");
    let (ok, o, e) = run_bin(&[
        "eval",
        "--checkpoint",
        s(&out),
        "--data",
        s(&run.join("metrics.jsonl")),
    ]);
    assert!(ok && o.contains("mean cross-entropy"), "eval: {o}{e}");
    let cont = out.join("continuation.safetensors");
    let (ok, o, e) = run_bin(&["export", "--checkpoint", s(&run), "--check", s(&cont)]);
    assert!(ok && o.contains("at step 6"), "{o}{e}");
    // …and, imported, tinyllm trains on from PyTorch's state: its step 7
    // is the uninterrupted run's.
    let back = root.join("back");
    import(&cont, &run, &back);
    let after = resume(&back, &back, 7);
    let (step, loss, _) = after[0];
    let rel = (loss - next[2].1).abs() / next[2].1;
    eprintln!(
        "step 7 after PyTorch's steps 5, 6: {loss:.7}, tinyllm throughout {:.7}, relative difference {rel:.2e}",
        next[2].1
    );
    assert!(step == 7 && rel <= TOLERANCE, "{after:?} vs {next:?}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn the_script_refuses_a_bad_continuation_file_naming_what_is_wrong() {
    let Some(py) = torch_python("the_script_refuses_a_bad_continuation_file") else {
        return;
    };
    let f = fixture("bad-script");
    for (file, says, names) in bad_files(&f) {
        let out = f.root.join("out");
        let (ok, o, err) = script(&py, 1, &[s(&file), "--out", s(&out)]);
        assert!(!ok, "{} was accepted: {o}", file.display());
        assert!(
            err.contains(says) && err.contains(names) && !err.contains("Traceback"),
            "{}: {err}",
            file.display()
        );
        assert!(!out.exists(), "nothing is written for a bad file");
    }
    // A folder holding another run's continuation is not overwritten.
    let other = f.root.join("other");
    train(&other, "tiny", 3);
    let ofile = f.root.join("other.safetensors");
    export(&other, 1, &ofile);
    let out = f.root.join("out");
    let (ok, o, e) = script(&py, 1, &[s(&ofile), "--out", s(&out)]);
    assert!(ok, "{o}{e}");
    let (ok, _, err) = script(&py, 1, &[s(&f.file), "--out", s(&out)]);
    assert!(!ok && err.contains("another run"), "{err}");
    let _ = std::fs::remove_dir_all(&f.root);
}
