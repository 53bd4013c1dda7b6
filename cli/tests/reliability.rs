//! Reliability: crashes, bad files, bad flags, numerical faults, devices and
//! determinism. Every failure must be a clear error that names what is wrong,
//! never a panic, and must lose nothing: a checkpoint either loads and resumes
//! to the bits of the uninterrupted run, or is refused whole.
//!
//! Crashes use the real binary (`train`, tiny preset, CPU) and SIGKILL, at
//! exact points inside a checkpoint write (the test-only `TINYLLM_FAULT` hook
//! of `tinyllm::train::fault`) and at seeded random moments. The fuzzers run
//! `TINYLLM_FUZZ_ITERS` inputs each (default: a few hundred to a few thousand,
//! about 20 s in all); they print how many ran, loaded, were refused, panicked.

#[path = "../../tests/common/mod.rs"]
mod common;
use common::{rehash, spawn_reading_stderr, tmpdir, Rng};

use std::io::{BufRead, BufReader};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tinyllm::nn::llama::LlamaConfig;
use tinyllm::nn::{Layer, Linear, Module};
use tinyllm::optim::{AdamW, AdamWConfig};
use tinyllm::precision::{DynamicLossScaler, Precision, MIN_SCALE};
use tinyllm::train::checkpoint::{self, Verified};
use tinyllm::train::config::{DeviceChoice, TrainConfig, TrainOptions};
use tinyllm::train::data::Corpus;
use tinyllm::train::metrics::{MetricsLog, StepMetrics};
use tinyllm::train::{Start, Trainer};
use tinyllm::train_step_mixed;
use tinyllm::{Device, Generator, Tensor};

const BIN: &str = env!("CARGO_BIN_EXE_tinyllm");

fn fuzz_iters(default: usize) -> usize {
    std::env::var("TINYLLM_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs the binary; (success, stdout, stderr). A panic is never acceptable.
fn run_bin(args: &[&str], envs: &[(&str, &str)]) -> (bool, String, String) {
    let mut c = Command::new(BIN);
    // as a user runs it (cargo test sets CARGO, which the hints read as `cargo run`)
    c.args(args).env_remove("CARGO");
    for (k, v) in envs {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(
        !err.contains("panicked"),
        "the binary panicked on {args:?}:\n{err}"
    );
    (o.status.success(), out, err)
}

// ============================================================ crashes ====

/// The crash tests' run: 5 steps, a checkpoint after every step.
const STEPS: usize = 5;

fn train_args(out: &Path, steps: usize) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--plain",
        "--sample-len",
        "0",
        "--eval-every",
        "0",
        "--save-every",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend([
        "--steps".into(),
        steps.to_string(),
        "--out".into(),
        out.display().to_string(),
    ]);
    a
}

fn resume_args(out: &Path, steps: usize) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--device",
        "cpu",
        "--plain",
        "--sample-len",
        "0",
        "--eval-every",
        "0",
        "--save-every",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend([
        "--resume".into(),
        out.display().to_string(),
        "--steps".into(),
        steps.to_string(),
    ]);
    a
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// What a finished run leaves, in the terms that must match bit for bit.
#[derive(Debug, PartialEq)]
struct Outcome {
    model: Vec<u8>,
    optimizer: Vec<u8>,
    config: Vec<u8>,
    /// trainer_state.json without the output directory.
    state: serde_json::Value,
    /// (step, loss bits, skipped) of every line of metrics.jsonl.
    losses: Vec<(usize, u32, bool)>,
}

fn outcome(out: &Path) -> Outcome {
    let ck = out.join("checkpoint");
    let read = |n: &str| {
        std::fs::read(ck.join(n)).unwrap_or_else(|e| panic!("{}: {e}", ck.join(n).display()))
    };
    let mut state: serde_json::Value = serde_json::from_slice(&read("trainer_state.json")).unwrap();
    state["config"].as_object_mut().unwrap().remove("out");
    // each process that starts a run draws its own id
    state.as_object_mut().unwrap().remove("run_id");
    // and records its build once per process (a resumed run has more)
    state.as_object_mut().unwrap().remove("builds");
    let losses = MetricsLog::read(&out.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|m: &StepMetrics| (m.step, m.loss.to_bits(), m.skipped))
        .collect();
    Outcome {
        model: read("model.safetensors"),
        optimizer: read("optimizer.safetensors"),
        config: read("config.json"),
        state,
        losses,
    }
}

/// The uninterrupted run (computed once).
fn reference() -> &'static Outcome {
    static R: OnceLock<Outcome> = OnceLock::new();
    R.get_or_init(|| {
        let out = tmpdir("reference");
        let (ok, _, err) = run_bin(&strs(&train_args(&out, STEPS)), &[]);
        assert!(ok, "{err}");
        let o = outcome(&out);
        assert_eq!(o.losses.len(), STEPS);
        let _ = std::fs::remove_dir_all(&out);
        o
    })
}

/// Starts a run with `TINYLLM_FAULT=fault`, waits until it pauses at the
/// fault point, and kills it with SIGKILL.
fn kill_at(out: &Path, fault: &str) {
    let mut child = Command::new(BIN)
        .args(train_args(out, STEPS))
        .env("TINYLLM_FAULT", fault)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut seen = String::new();
    let mut reached = false;
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.starts_with("TINYLLM_FAULT_PAUSED") {
            reached = true;
            break;
        }
        seen.push_str(&line);
        seen.push('\n');
    }
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
    assert!(
        reached,
        "the run never reached fault point {fault}:\n{seen}"
    );
}

/// After a crash: a checkpoint at `expect` must load, and resuming it must
/// end exactly where the uninterrupted run ended; with `None` (no checkpoint
/// was complete) loading and resuming must be refused with a clear error.
fn check_recovers(out: &Path, expect: Option<usize>, what: &str) {
    match expect {
        Some(step) => {
            let st = Verified::open(out)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .train_state()
                .unwrap();
            assert_eq!(st.step, step, "{what}: the surviving checkpoint");
            if step < STEPS {
                let (ok, _, err) = run_bin(&strs(&resume_args(out, STEPS)), &[]);
                assert!(ok, "{what}: resume failed: {err}");
            }
            let got = outcome(out);
            assert!(
                got == *reference(),
                "{what}: the resumed run differs from the uninterrupted one"
            );
            // Nothing is left behind: no staging, no temporary files. One
            // exception, when no resume ran (the kill came during the last
            // save): killed after its swap but before the old copy was
            // removed, the previous checkpoint stays in `checkpoint.prev/` —
            // no process is left to clear it. It must then be the older one,
            // and `checkpoint/` the one that is used.
            assert!(!out.join("checkpoint.next").exists(), "{what}: leftovers");
            let prev = out.join("checkpoint.prev");
            if prev.exists() {
                assert_eq!(step, STEPS, "{what}: leftovers after a resume");
                assert_eq!(
                    checkpoint::resolve_dir(out),
                    out.join("checkpoint"),
                    "{what}"
                );
                if let Ok(old) = Verified::open(&prev) {
                    assert!(
                        old.train_state().unwrap().step < step,
                        "{what}: checkpoint.prev"
                    );
                }
            }
            let tmp = std::fs::read_dir(out.join("checkpoint"))
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .contains(".tmp")
                })
                .count();
            assert_eq!(tmp, 0, "{what}: temporary files in the checkpoint");
        }
        None => {
            let e = Verified::open(out)
                .err()
                .unwrap_or_else(|| panic!("{what}: a checkpoint loaded"))
                .to_string();
            assert!(
                e.contains("not a readable tinyllm checkpoint"),
                "{what}: {e}"
            );
            let (ok, _, err) = run_bin(&strs(&resume_args(out, STEPS)), &[]);
            assert!(
                !ok && err.contains("--resume")
                    && err.contains("not a readable tinyllm checkpoint"),
                "{what}: {err}"
            );
            // Starting over in the same directory is refused while it holds
            // the metrics of the lost run, works with --overwrite, and gives
            // the same bits.
            let had_metrics =
                std::fs::metadata(out.join("metrics.jsonl")).is_ok_and(|m| m.len() > 0);
            let (ok, _, err) = run_bin(&strs(&train_args(out, STEPS)), &[]);
            if had_metrics {
                assert!(
                    !ok && err.contains("already holds a run") && err.contains("--overwrite"),
                    "{what}: {err}"
                );
                let mut a = train_args(out, STEPS);
                a.push("--overwrite".into());
                let (ok, _, err) = run_bin(&strs(&a), &[]);
                assert!(ok, "{what}: {err}");
            } else {
                assert!(ok, "{what}: {err}");
            }
            assert!(
                outcome(out) == *reference(),
                "{what}: a fresh run after the crash differs"
            );
        }
    }
}

/// SIGKILL at every stage of writing the step-3 checkpoint (step 2's exists).
#[test]
fn sigkill_inside_a_checkpoint_write_loses_nothing() {
    let cases: [(&str, usize); 12] = [
        ("write:model.safetensors", 2),
        ("wrote:model.safetensors", 2),
        ("write:config.json", 2),
        ("wrote:config.json", 2),
        ("write:optimizer.safetensors", 2),
        ("wrote:optimizer.safetensors", 2),
        ("write:trainer_state.json", 2),
        ("write:manifest.json", 2),
        ("wrote:manifest.json", 2),
        ("staged", 2),
        ("swap", 3),
        ("swapped", 3),
    ];
    for (i, (point, expect)) in cases.iter().enumerate() {
        let out = tmpdir(&format!("kill-{i}"));
        kill_at(&out, &format!("{point}@3"));
        check_recovers(
            &out,
            Some(*expect),
            &format!("SIGKILL at {point} of step 3"),
        );
        let _ = std::fs::remove_dir_all(&out);
    }
    eprintln!(
        "crash points: {} SIGKILLs inside checkpoint writes, every one resumed bit-identically",
        cases.len()
    );
}

/// SIGKILL while the very first checkpoint is being written.
#[test]
fn sigkill_inside_the_first_checkpoint_write() {
    for (i, (point, expect)) in [
        ("write:model.safetensors", None),
        ("wrote:optimizer.safetensors", None),
        ("write:manifest.json", None),
        ("wrote:manifest.json", Some(1)),
        ("staged", Some(1)),
        ("swap", Some(1)),
        ("swapped", Some(1)),
    ]
    .iter()
    .enumerate()
    {
        let out = tmpdir(&format!("kill-first-{i}"));
        kill_at(&out, &format!("{point}@1"));
        check_recovers(&out, *expect, &format!("SIGKILL at {point} of step 1"));
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// SIGKILL at seeded random moments of a whole run (start-up, steps, saves).
#[test]
fn sigkill_at_random_moments_loses_nothing() {
    let _ = reference();
    // How long a run takes here, to spread the kills over it.
    let out = tmpdir("kill-random-timing");
    let t0 = Instant::now();
    assert!(run_bin(&strs(&train_args(&out, STEPS)), &[]).0);
    let span = t0.elapsed().as_micros() as u64;
    let _ = std::fs::remove_dir_all(&out);
    let mut rng = Rng(0x5eed_c4a5);
    let n: usize = std::env::var("TINYLLM_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let (mut before_any, mut resumed, mut finished) = (0, 0, 0);
    for i in 0..n {
        let out = tmpdir(&format!("kill-random-{i}"));
        let delay = Duration::from_micros(rng.next() % (span + span / 5).max(1));
        let mut child = Command::new(BIN)
            .args(train_args(&out, STEPS))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        let done = child.try_wait().unwrap().is_some();
        let _ = child.kill();
        let _ = child.wait();
        match Verified::open(&out) {
            Ok(ck) => {
                let step = ck.train_state().unwrap().step;
                if done || step == STEPS {
                    finished += 1;
                } else {
                    resumed += 1;
                }
                check_recovers(
                    &out,
                    Some(step),
                    &format!("SIGKILL after {delay:?} (checkpoint at step {step})"),
                );
            }
            Err(_) => {
                before_any += 1;
                check_recovers(
                    &out,
                    None,
                    &format!("SIGKILL after {delay:?} (no checkpoint yet)"),
                );
            }
        }
        let _ = std::fs::remove_dir_all(&out);
    }
    eprintln!("random SIGKILLs: {n} ({before_any} before any checkpoint: refused clearly, then rerun; {resumed} resumed bit-identically; {finished} after the last checkpoint)");
}

/// The directory states a crash can leave, built by hand (as after a power
/// loss between the swap's renames), and what loading and the next save do.
#[test]
fn crash_leftovers_are_resolved_by_the_next_save() {
    let (dir, cfg) = saved_tiny("leftovers", 2);
    let run = dir.parent().unwrap().to_path_buf();
    // Mid-swap: checkpoint/ moved aside, a complete checkpoint.next/ not yet in place.
    copy_dir(&dir, &run.join("checkpoint.next"));
    std::fs::rename(&dir, run.join("checkpoint.prev")).unwrap();
    assert!(checkpoint::resolve_dir(&run).ends_with("checkpoint.next"));
    assert_eq!(Verified::open(&run).unwrap().train_state().unwrap().step, 2);
    // The next save promotes it first, then writes step 3 over it.
    let corpus = Corpus::embedded();
    let mut t = Trainer::resume(cfg.clone(), Device::Cpu, &corpus, &run).unwrap();
    t.train_step().unwrap();
    t.save(&run).unwrap();
    assert_eq!(Verified::open(&run).unwrap().train_state().unwrap().step, 3);
    assert!(!run.join("checkpoint.next").exists() && !run.join("checkpoint.prev").exists());
    // A half-staged checkpoint.next/ with a corrupt file beside no checkpoint/
    // but a good checkpoint.prev/: the previous one is restored.
    std::fs::rename(run.join("checkpoint"), run.join("checkpoint.prev")).unwrap();
    copy_dir(&run.join("checkpoint.prev"), &run.join("checkpoint.next"));
    std::fs::write(run.join("checkpoint.next/model.safetensors"), b"partial").unwrap();
    checkpoint::recover(&run).unwrap();
    assert_eq!(Verified::open(&run).unwrap().train_state().unwrap().step, 3);
    assert!(run.join("checkpoint/manifest.json").exists());
    let _ = std::fs::remove_dir_all(&run);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

// ========================================================== bad files ====

fn tiny(extra: TrainOptions) -> TrainConfig {
    TrainConfig::resolve(&TrainOptions {
        preset: Some("tiny".into()),
        device: Some(DeviceChoice::Cpu),
        ..extra
    })
    .unwrap()
}

/// A tiny run's checkpoint after `steps` steps: (its directory, the config).
fn saved_tiny(name: &str, steps: usize) -> (PathBuf, TrainConfig) {
    let corpus = Corpus::embedded();
    let cfg = tiny(TrainOptions {
        steps: Some(10),
        precision: Some(Precision::Fp16),
        ..Default::default()
    });
    let mut t = Trainer::new(cfg.clone(), Device::Cpu, &corpus).unwrap();
    for _ in 0..steps {
        t.train_step().unwrap();
    }
    let dir = tmpdir(name);
    t.save(&dir).unwrap();
    (dir.join("checkpoint"), cfg)
}

fn snapshot_bits(t: &Trainer) -> Vec<(String, Vec<u32>)> {
    t.snapshot()
        .unwrap()
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// Every way of loading `dir` must fail, name `file` and leave a trainer untouched.
fn refused(dir: &Path, cfg: &TrainConfig, file: &str) -> String {
    let corpus = Corpus::embedded();
    let mut t = Trainer::new(cfg.clone(), Device::Cpu, &corpus).unwrap();
    let before = snapshot_bits(&t);
    let e = match Verified::open(dir) {
        Err(e) => e,
        Ok(ck) => {
            let (m, o) = t.model_and_optimizer_mut();
            match checkpoint::restore(&ck, m, o) {
                Err(e) => e,
                Ok(_) => Trainer::resume(cfg.clone(), Device::Cpu, &corpus, dir)
                    .err()
                    .expect("a bad checkpoint must not load"),
            }
        }
    }
    .to_string();
    assert!(
        before == snapshot_bits(&t),
        "a refused checkpoint changed the model or optimizer: {e}"
    );
    assert!(
        Trainer::resume(cfg.clone(), Device::Cpu, &corpus, dir).is_err(),
        "resume accepted it: {e}"
    );
    // What `eval` and `generate` load (they read no optimizer or trainer state
    // behind the checksum).
    if file != "trainer_state.json" && file != "optimizer.safetensors" {
        assert!(
            checkpoint::load_model(dir, Device::Cpu).is_err(),
            "load_model accepted it: {e}"
        );
    }
    assert!(
        e.contains(file) || (file == "manifest.json" && e.contains("manifest")),
        "the error does not name {file}: {e}"
    );
    e
}

/// A safetensors file with this header JSON and `data` bytes.
fn st_bytes(header: &str, data: &[u8]) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    b
}

#[test]
fn damaged_checkpoint_files_are_refused_naming_the_file() {
    let (dir, cfg) = saved_tiny("damaged", 2);
    let files = [
        "model.safetensors",
        "optimizer.safetensors",
        "config.json",
        "trainer_state.json",
        "manifest.json",
    ];
    let pristine: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap())
        .collect();
    let reset = || {
        for (f, b) in files.iter().zip(&pristine) {
            std::fs::write(dir.join(f), b).unwrap();
        }
    };
    let mut cases = 0;
    for (i, f) in files.iter().enumerate() {
        // Truncated (to nothing, to a byte, to half).
        for len in [0, 1, pristine[i].len() / 2] {
            std::fs::write(dir.join(f), &pristine[i][..len]).unwrap();
            let e = refused(&dir, &cfg, f);
            assert!(
                e.contains("truncated") || e.contains("corrupt manifest"),
                "{f} cut to {len}: {e}"
            );
            reset();
            cases += 1;
        }
        // One bit flipped, at the start, the middle and the end.
        for at in [0, pristine[i].len() / 2, pristine[i].len() - 1] {
            let mut b = pristine[i].clone();
            b[at] ^= 0x04;
            std::fs::write(dir.join(f), &b).unwrap();
            refused(&dir, &cfg, f);
            reset();
            cases += 1;
        }
        // Removed.
        std::fs::remove_file(dir.join(f)).unwrap();
        refused(&dir, &cfg, f);
        reset();
        cases += 1;
    }
    // Through the binary, once: eval and generate refuse it with the path.
    std::fs::write(dir.join("model.safetensors"), &pristine[0][..100]).unwrap();
    for cmd in ["eval", "generate"] {
        let (ok, _, err) = run_bin(&[cmd, "--checkpoint", dir.to_str().unwrap()], &[]);
        assert!(
            !ok && err.contains("--checkpoint")
                && err.contains("model.safetensors")
                && err.contains("truncated"),
            "{err}"
        );
    }
    reset();
    eprintln!("damaged files: {cases} truncations, bit flips and removals refused");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn malformed_safetensors_are_refused_behind_a_matching_checksum() {
    let (dir, cfg) = saved_tiny("malformed", 1);
    let good = std::fs::read(dir.join("model.safetensors")).unwrap();
    let good_opt = std::fs::read(dir.join("optimizer.safetensors")).unwrap();
    let hlen = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let with_len = |n: u64| {
        let mut b = good.clone();
        b[..8].copy_from_slice(&n.to_le_bytes());
        b
    };
    let f32s = |n: usize| vec![0u8; 4 * n];
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("header length u64::MAX", with_len(u64::MAX)),
        ("header length 2^40", with_len(1 << 40)),
        ("header length past the end", with_len(good.len() as u64)),
        ("header length 0", with_len(0)),
        ("header length cut into the JSON", with_len(hlen as u64 / 2)),
        ("under 8 bytes", good[..5].to_vec()),
        ("header not JSON", st_bytes("\u{0}\u{1}garbage", &[])),
        ("header not UTF-8", {
            let mut b = st_bytes("{\"a\":1}", &[]);
            b[9] = 0xff;
            b
        }),
        (
            "overlapping offsets",
            st_bytes(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                &f32s(3),
            ),
        ),
        (
            "offsets past the end",
            st_bytes(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4611686018427387904]}}"#,
                &f32s(2),
            ),
        ),
        (
            "offsets reversed",
            st_bytes(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#,
                &f32s(2),
            ),
        ),
        (
            "shape product overflows",
            st_bytes(
                r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#,
                &f32s(2),
            ),
        ),
        (
            "shape disagrees with offsets",
            st_bytes(
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                &f32s(2),
            ),
        ),
        (
            "negative offset",
            st_bytes(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}"#,
                &f32s(2),
            ),
        ),
        (
            "unknown dtype",
            st_bytes(
                r#"{"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}}"#,
                &f32s(2),
            ),
        ),
        (
            "a valid file of other tensors",
            st_bytes(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                &f32s(2),
            ),
        ),
        ("an empty valid file", st_bytes("{}", &[])),
    ];
    for (what, bytes) in &cases {
        for file in ["model.safetensors", "optimizer.safetensors"] {
            std::fs::write(dir.join(file), bytes).unwrap();
            rehash(&dir);
            let e = refused(&dir, &cfg, file);
            assert!(
                e.contains("not a valid safetensors file")
                    || e.contains("unexpected tensor")
                    || e.contains("missing tensor")
                    || e.contains("far more than"),
                "{what} in {file}: {e}"
            );
            std::fs::write(
                dir.join(file),
                if file == "model.safetensors" {
                    &good
                } else {
                    &good_opt
                },
            )
            .unwrap();
            rehash(&dir);
        }
    }
    eprintln!(
        "malformed safetensors: {} headers × 2 files refused",
        cases.len()
    );
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn wrong_dtype_shape_and_config_are_refused() {
    let (dir, cfg) = saved_tiny("wrongs", 1);
    let good = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&good).unwrap();
    // One tensor stored as F16 (half the bytes) or F64, the rest as they were.
    for (dtype, size) in [
        (safetensors::Dtype::F16, 2),
        (safetensors::Dtype::F64, 8),
        (safetensors::Dtype::I32, 4),
    ] {
        let data: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| {
                if n == "model.norm.weight" {
                    let k: usize = t.shape().iter().product();
                    (n, t.shape().to_vec(), dtype, vec![0u8; k * size])
                } else {
                    (n, t.shape().to_vec(), t.dtype(), t.data().to_vec())
                }
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = data
            .iter()
            .map(|(n, s, d, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        std::fs::write(
            dir.join("model.safetensors"),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
        rehash(&dir);
        let e = refused(&dir, &cfg, "model.safetensors");
        assert!(
            e.contains("model.norm.weight") && e.contains("expected F32"),
            "{e}"
        );
    }
    std::fs::write(dir.join("model.safetensors"), &good).unwrap();
    rehash(&dir);

    // config.json: absurd, inconsistent or hostile values.
    let cpath = dir.join("config.json");
    let cgood: serde_json::Value = serde_json::from_slice(&std::fs::read(&cpath).unwrap()).unwrap();
    let edits: Vec<(&str, serde_json::Value, &str)> = vec![
        ("hidden_size", 1u64.into(), "config.json"),
        ("hidden_size", 0u64.into(), "config.json"),
        ("hidden_size", (1u64 << 40).into(), "config.json"),
        ("vocab_size", u64::MAX.into(), "too large"),
        ("intermediate_size", (1u64 << 62).into(), "too large"),
        ("num_hidden_layers", (1u64 << 33).into(), "too large"),
        ("max_position_embeddings", (1u64 << 50).into(), "context"),
        ("num_attention_heads", 3u64.into(), "config.json"),
        ("num_attention_heads", 0u64.into(), "config.json"),
        ("hidden_size", (-32i64).into(), "hidden_size"),
        ("hidden_size", "32".into(), "hidden_size"),
        ("hidden_size", 32.5.into(), "hidden_size"),
        ("rms_norm_eps", (-1.0).into(), "rms_eps"),
        ("model_type", "gpt2".into(), "model_type"),
        ("tie_word_embeddings", true.into(), "tied"),
        ("num_key_value_heads", 1u64.into(), "grouped-query"),
        ("intermediate_size", 48u64.into(), "does not match"),
    ];
    for (k, v, want) in &edits {
        let mut c = cgood.clone();
        c[*k] = v.clone();
        std::fs::write(&cpath, serde_json::to_vec(&c).unwrap()).unwrap();
        rehash(&dir);
        let e = refused(&dir, &cfg, "config.json");
        assert!(e.contains(want), "config.json {k} = {v}: {e}");
    }
    std::fs::write(&cpath, serde_json::to_vec(&cgood).unwrap()).unwrap();

    // trainer_state.json: a saved run config that resolve() would never make.
    let spath = dir.join("trainer_state.json");
    let sgood: serde_json::Value = serde_json::from_slice(&std::fs::read(&spath).unwrap()).unwrap();
    let edits: Vec<(&str, serde_json::Value, &str)> = vec![
        ("batch", 0u64.into(), "--batch"),
        ("batch", (1u64 << 40).into(), "--batch"),
        ("micro_batch", 0u64.into(), "--micro-batch"),
        ("micro_batch", 99u64.into(), "--micro-batch"),
        ("accum", 7u64.into(), "--accum"),
        ("steps", 0u64.into(), "--steps"),
        ("lr", (-1.0).into(), "--lr"),
        ("clip", (-1.0).into(), "--clip"),
        ("ckpt_budget", 1u64.into(), "--ckpt-budget"),
        ("precision", "Fp8".into(), "trainer_state.json"),
        ("eval_rows", 0u64.into(), "eval_rows"),
    ];
    for (k, v, want) in &edits {
        let mut s = sgood.clone();
        s["config"][*k] = v.clone();
        std::fs::write(&spath, serde_json::to_vec(&s).unwrap()).unwrap();
        rehash(&dir);
        let e = refused(&dir, &cfg, "trainer_state.json");
        assert!(e.contains(want), "trainer_state.json config.{k} = {v}: {e}");
    }
    for (k, v) in [
        ("adam_steps", serde_json::json!([1, 2])),
        ("format", "tinyllm-checkpoint-0".into()),
        (
            "scaler",
            serde_json::json!({"scale": -1.0, "growth": 2.0, "backoff": 0.5, "interval": 2000, "good_steps": 0}),
        ),
    ] {
        let mut s = sgood.clone();
        s[k] = v;
        std::fs::write(&spath, serde_json::to_vec(&s).unwrap()).unwrap();
        rehash(&dir);
        let corpus = Corpus::embedded();
        let e = Trainer::resume(cfg.clone(), Device::Cpu, &corpus, &dir)
            .err()
            .expect("must be refused")
            .to_string();
        assert!(e.contains("trainer_state.json"), "{k}: {e}");
    }
    std::fs::write(&spath, serde_json::to_vec(&sgood).unwrap()).unwrap();
    rehash(&dir);

    // manifest.json: files outside the checkpoint, missing entries, another format.
    let mpath = dir.join("manifest.json");
    let mgood: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    let mut m = mgood.clone();
    m["files"]["../../../etc/passwd"] = serde_json::json!({"sha256": "00", "bytes": 1});
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    assert!(refused(&dir, &cfg, "manifest.json").contains("unknown file"));
    let mut m = mgood.clone();
    m["files"]
        .as_object_mut()
        .unwrap()
        .remove("optimizer.safetensors");
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    assert!(refused(&dir, &cfg, "manifest.json").contains("does not list optimizer.safetensors"));
    let mut m = mgood.clone();
    m["format"] = "safetensors".into();
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    assert!(refused(&dir, &cfg, "manifest.json").contains("unknown checkpoint format"));
    std::fs::write(&mpath, serde_json::to_vec(&mgood).unwrap()).unwrap();
    // And the untouched checkpoint still loads.
    checkpoint::load_model(&dir, Device::Cpu).unwrap();
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn bad_corpora_are_clear_errors_and_write_nothing() {
    let d = tmpdir("corpora");
    let write = |name: &str, b: &[u8]| {
        let p = d.join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let mut binary = b"\x7fELF\x02\x01\x01\x00\x00\x00".to_vec();
    binary.extend((0..4000u32).map(|i| (i * 7919 % 251) as u8));
    let nul_text = [b"plain text".as_slice(), &[0u8; 3], b"more text".as_slice()].concat();
    let cases: Vec<(PathBuf, &str)> = vec![
        (write("empty.txt", b""), "is empty"),
        (write("program.bin", &binary), "not UTF-8"),
        (
            write("nul.txt", &nul_text),
            "binary file (a NUL byte at offset 10)",
        ),
        (
            write("latin1.txt", b"caf\xe9 au lait, encore du caf\xe9"),
            "not UTF-8 text (invalid byte at offset 3)",
        ),
        (write("utf16.txt", b"\xff\xfeh\x00i\x00"), "not UTF-8"),
        (write("short.txt", b"tiny text"), "too short"),
        (d.join("missing.txt"), "cannot read corpus"),
        (d.clone(), "is not a regular file (a directory)"),
    ];
    for (path, want) in &cases {
        let out = d.join("out");
        let (ok, _, err) = run_bin(
            &[
                "train",
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--data",
                path.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
            &[],
        );
        assert!(
            !ok && err.contains(&path.display().to_string()) && err.contains(want),
            "{}: {err}",
            path.display()
        );
        assert!(
            !out.join("checkpoint").exists() && !out.join("metrics.jsonl").exists(),
            "a refused corpus left state behind"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

// ============================================================== fuzz ====

/// One random mutation of `b` (a safetensors file when `st`, else JSON).
fn mutate(b: &mut Vec<u8>, st: bool, rng: &mut Rng) -> String {
    const TOKENS: [&str; 14] = [
        "-1",
        "0",
        "1e308",
        "1e999",
        "18446744073709551615",
        "4294967296",
        "null",
        "\"x\"",
        "[]",
        "{}",
        "NaN",
        "true",
        "[0,0]",
        ",",
    ];
    let header_end = if st && b.len() >= 8 {
        (8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize).min(b.len())
    } else {
        b.len()
    };
    let region = if st && rng.chance(0.7) {
        header_end.max(1)
    } else {
        b.len().max(1)
    };
    match rng.below(7) {
        0 if !b.is_empty() => {
            let at = rng.below(region.min(b.len()));
            let bit = rng.below(8);
            b[at] ^= 1 << bit;
            format!("flip bit {bit} of byte {at}")
        }
        1 if !b.is_empty() => {
            // A digit for another digit: offsets, shapes and sizes shift.
            let digits: Vec<usize> = (0..region.min(b.len()))
                .filter(|&i| b[i].is_ascii_digit() && i >= 8)
                .collect();
            if digits.is_empty() {
                return "no digit".into();
            }
            let at = digits[rng.below(digits.len())];
            b[at] = b'0' + rng.below(10) as u8;
            format!("digit at {at}")
        }
        2 => {
            let at = rng.below(b.len() + 1);
            b.truncate(at);
            format!("truncate to {at}")
        }
        3 if st && b.len() >= 8 => {
            let v = match rng.below(4) {
                0 => rng.next(),
                1 => u64::MAX - rng.below(16) as u64,
                2 => (header_end as u64)
                    .wrapping_add(rng.below(64) as u64)
                    .wrapping_sub(40),
                _ => rng.below(b.len() * 2) as u64,
            };
            b[..8].copy_from_slice(&v.to_le_bytes());
            format!("header length {v}")
        }
        4 => {
            let at = rng.below(region.min(b.len()) + 1);
            let tok = TOKENS[rng.below(TOKENS.len())];
            let cut = rng.below(8).min(b.len() - at);
            b.splice(at..at + cut, tok.bytes());
            format!("splice {tok:?} at {at}")
        }
        5 if !b.is_empty() => {
            let at = rng.below(b.len());
            let len = rng.below(64).min(b.len() - at);
            let chunk = b[at..at + len].to_vec();
            let to = rng.below(region.min(b.len()) + 1);
            b.splice(to..to, chunk);
            format!("duplicate {len} bytes at {to}")
        }
        _ => {
            let n = rng.below(16) + 1;
            for _ in 0..n {
                let at = rng.below(b.len() + 1);
                b.insert(at, rng.next() as u8);
            }
            format!("insert {n} random bytes")
        }
    }
}

/// Random byte mutations of every file of a real checkpoint, mostly with the
/// manifest rehashed so the loaders behind the checksum see them. Nothing may
/// panic; a refusal must leave the model and optimizer untouched.
#[test]
fn fuzz_checkpoint_files() {
    let iters = fuzz_iters(250);
    let (dir, cfg) = saved_tiny("fuzz", 2);
    let files = [
        "model.safetensors",
        "optimizer.safetensors",
        "config.json",
        "trainer_state.json",
        "manifest.json",
    ];
    let pristine: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap())
        .collect();
    let corpus = Corpus::embedded();
    let mut t = Trainer::new(cfg.clone(), Device::Cpu, &corpus).unwrap();
    let base = snapshot_bits(&t);
    let mut rng = Rng(0xf022_0001);
    let (mut loaded, mut refused_n, mut panics) = (0usize, 0usize, Vec::new());
    let t0 = Instant::now();
    for i in 0..iters {
        let fi = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4][rng.below(11)];
        let mut b = pristine[fi].clone();
        let what: Vec<String> = (0..1 + rng.below(3))
            .map(|_| mutate(&mut b, fi < 2, &mut rng))
            .collect();
        std::fs::write(dir.join(files[fi]), &b).unwrap();
        if fi != 4 && rng.chance(0.9) {
            rehash(&dir);
        }
        // (restore into `t` refused?, the first error of any loader)
        let r = catch_unwind(AssertUnwindSafe(|| -> (bool, Result<(), String>) {
            let restored = match Verified::open(&dir) {
                Err(e) => Err(e),
                Ok(ck) => {
                    let (m, o) = t.model_and_optimizer_mut();
                    checkpoint::restore(&ck, m, o)
                }
            };
            let resumed = Trainer::resume(cfg.clone(), Device::Cpu, &corpus, &dir);
            let _model = checkpoint::load_model(&dir, Device::Cpu);
            let refused_restore = restored.is_err();
            match (restored, resumed) {
                (Ok(_), Ok(_)) => (false, Ok(())),
                (Err(e), _) | (_, Err(e)) => (refused_restore, Err(e.to_string())),
            }
        }));
        match r {
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panics.push(format!("#{i} {}: {what:?}: {msg}", files[fi]));
            }
            Ok((_, Ok(()))) => {
                loaded += 1;
                // A mutation the checks cannot see (a weight's value) loads; start over.
                t = Trainer::new(cfg.clone(), Device::Cpu, &corpus).unwrap();
            }
            Ok((refused_restore, Err(e))) => {
                refused_n += 1;
                assert!(
                    e.contains(dir.to_str().unwrap()),
                    "#{i} {what:?}: the error names no file: {e}"
                );
                if refused_restore {
                    assert!(
                        snapshot_bits(&t) == base,
                        "#{i} {}: {what:?} was refused but changed the model: {e}",
                        files[fi]
                    );
                } else {
                    // `restore` alone took it (e.g. a changed data fingerprint, which
                    // only `Trainer::resume` checks); start over.
                    t = Trainer::new(cfg.clone(), Device::Cpu, &corpus).unwrap();
                }
            }
        }
        std::fs::write(dir.join(files[fi]), &pristine[fi]).unwrap();
        std::fs::write(dir.join("manifest.json"), &pristine[4]).unwrap();
    }
    eprintln!(
        "fuzz_checkpoint_files: {iters} mutated checkpoints in {:.1} s: {loaded} loaded (value-only changes), {refused_n} refused with an error, {} panics",
        t0.elapsed().as_secs_f64(),
        panics.len()
    );
    assert!(panics.is_empty(), "panics:\n{}", panics.join("\n"));
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

fn random_json(rng: &mut Rng, depth: usize) -> serde_json::Value {
    use serde_json::Value;
    match rng.below(if depth > 1 { 8 } else { 10 }) {
        0 => Value::Null,
        1 => rng.chance(0.5).into(),
        2 => (rng.next() >> rng.below(64)).into(),
        3 => [
            0u64,
            1,
            2,
            3,
            4,
            16,
            32,
            64,
            256,
            1 << 16,
            1 << 31,
            1 << 32,
            u64::MAX,
        ][rng.below(13)]
        .into(),
        4 => (-(rng.below(1000) as i64)).into(),
        5 => [
            0.0,
            -0.0,
            1e-5,
            0.5,
            1.0,
            -1.0,
            1e30,
            f64::MAX,
            1e-310,
            32.5,
        ][rng.below(10)]
        .into(),
        6 => ["llama", "", "32", "NaN", "\u{0}", "LlamaForCausalLM"][rng.below(6)].into(),
        7 => (rng.next() % 100000).into(),
        8 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_json(rng, depth + 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.below(4))
                .map(|i| (format!("k{i}"), random_json(rng, depth + 1)))
                .collect(),
        ),
    }
}

/// Random JSON configs: `config.json` objects for `LlamaConfig::from_hf_json`
/// and the checkpoint loader, random run configs in `trainer_state.json`, and
/// random flag sets for `TrainConfig::resolve`. Nothing may panic, allocate
/// absurdly, or accept an invalid config.
#[test]
fn fuzz_configs() {
    let iters = fuzz_iters(3000);
    let mut rng = Rng(0xc0_f16);
    let keys = [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "model_type",
        "attention_dropout",
        "tinyllm_dropout",
    ];
    let tiny_cfg = LlamaConfig::preset("tiny").unwrap();
    let base = tiny_cfg.to_hf_json();
    let mut panics = Vec::new();
    let (mut ok_hf, mut ok_resolve) = (0, 0);
    let t0 = Instant::now();
    // 1. config.json alone (fast): from_hf_json + the size check.
    for i in 0..iters * 10 {
        let mut v = if rng.chance(0.3) {
            serde_json::json!({})
        } else {
            base.clone()
        };
        for _ in 0..1 + rng.below(4) {
            let k = keys[rng.below(keys.len())];
            v[k] = if rng.chance(0.7) {
                random_json(&mut rng, 2)
            } else {
                [1u64, 2, 4, 8, 32, 64, 256, 1 << 20, 1 << 40][rng.below(9)].into()
            };
        }
        match catch_unwind(AssertUnwindSafe(|| {
            LlamaConfig::from_hf_json(&v)
                .and_then(|c| tinyllm::train::config::check_model_size(&c).map(|_| c))
        })) {
            Err(_) => panics.push(format!("from_hf_json #{i}: {v}")),
            Ok(Ok(c)) => {
                ok_hf += 1;
                assert!(
                    c.validate().is_ok()
                        && c.num_params() <= tinyllm::train::config::MAX_MODEL_BYTES / 4,
                    "{v}"
                );
            }
            Ok(Err(_)) => {}
        }
    }
    let t1 = Instant::now();
    // 2. resolve() with random flags.
    for i in 0..iters * 10 {
        let n = |rng: &mut Rng| -> Option<usize> {
            rng.chance(0.4).then(|| {
                [
                    0,
                    1,
                    2,
                    3,
                    4,
                    7,
                    8,
                    16,
                    100,
                    65536,
                    65537,
                    1 << 40,
                    usize::MAX,
                ][rng.below(13)]
            })
        };
        let f = |rng: &mut Rng| -> Option<f32> {
            rng.chance(0.4).then(|| {
                [
                    0.0,
                    -0.0,
                    -1.0,
                    1e-3,
                    0.5,
                    1.0,
                    2.0,
                    f32::NAN,
                    f32::INFINITY,
                    -f32::INFINITY,
                    f32::MAX,
                    1e-45,
                ][rng.below(12)]
            })
        };
        let s = |rng: &mut Rng, opts: &[&str]| -> Option<String> {
            rng.chance(0.4)
                .then(|| opts[rng.below(opts.len())].to_string())
        };
        let o = TrainOptions {
            preset: s(&mut rng, &["tiny", "small", "capstone", "huge", ""]),
            steps: n(&mut rng),
            lr: f(&mut rng),
            seed: rng.chance(0.3).then(|| rng.next()),
            // typed: the strings the CLI would parse (an unknown one never
            // reaches resolve)
            device: s(&mut rng, &["cpu", "gpu", "auto", "tpu"]).and_then(|d| d.parse().ok()),
            precision: s(&mut rng, &["fp32", "bf16", "fp16", "fp8", "float16"])
                .and_then(|p| p.parse().ok()),
            batch: n(&mut rng),
            micro_batch: n(&mut rng),
            accum: n(&mut rng),
            checkpoint_activations: rng.chance(0.3).then(|| rng.chance(0.5)),
            ckpt_budget: n(&mut rng),
            clip: f(&mut rng),
            eval_every: n(&mut rng),
            save_every: n(&mut rng),
            warmup: n(&mut rng),
            dropout: f(&mut rng),
            ..Default::default()
        };
        match catch_unwind(AssertUnwindSafe(|| TrainConfig::resolve(&o))) {
            Err(_) => panics.push(format!("resolve #{i}: {o:?}")),
            Ok(Ok(c)) => {
                ok_resolve += 1;
                c.validate().unwrap();
                let _ = c.describe();
                let _ = c.lr_at(c.steps);
            }
            Ok(Err(e)) => assert!(
                e.to_string().contains("--") || e.to_string().contains("model config"),
                "{e}"
            ),
        }
    }
    let t2 = Instant::now();
    // 3. Through the checkpoint loader: random config.json and trainer_state.json configs.
    let (dir, cfg) = saved_tiny("fuzz-config", 1);
    let corpus = Corpus::embedded();
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("trainer_state.json")).unwrap()).unwrap();
    let cfg_json = std::fs::read(dir.join("config.json")).unwrap();
    let state_json = std::fs::read(dir.join("trainer_state.json")).unwrap();
    let run_keys: Vec<String> = state["config"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let mut loaded = 0;
    let n3 = iters / 40;
    for i in 0..n3 {
        let (file, text) = if i % 2 == 0 {
            let mut v = base.clone();
            for _ in 0..1 + rng.below(3) {
                v[keys[rng.below(keys.len())]] = random_json(&mut rng, 2);
            }
            ("config.json", v)
        } else {
            let mut v = state.clone();
            for _ in 0..1 + rng.below(3) {
                let k = &run_keys[rng.below(run_keys.len())];
                v["config"][k] = random_json(&mut rng, 2);
            }
            ("trainer_state.json", v)
        };
        std::fs::write(dir.join(file), serde_json::to_vec(&text).unwrap()).unwrap();
        rehash(&dir);
        match catch_unwind(AssertUnwindSafe(|| {
            let a = checkpoint::load_model(&dir, Device::Cpu).map(|_| ());
            let b = Verified::open(&dir)
                .and_then(|ck| ck.train_state())
                .map(|_| ());
            let c = Trainer::resume(cfg.clone(), Device::Cpu, &corpus, &dir).map(|_| ());
            a.and(b).and(c)
        })) {
            Err(_) => panics.push(format!("loader #{i} {file}: {text}")),
            Ok(Ok(())) => loaded += 1,
            Ok(Err(_)) => {}
        }
        std::fs::write(dir.join("config.json"), &cfg_json).unwrap();
        std::fs::write(dir.join("trainer_state.json"), &state_json).unwrap();
        rehash(&dir);
    }
    eprintln!(
        "fuzz_configs: {} config.json objects ({ok_hf} valid, {:.1} s), {} flag sets ({ok_resolve} valid, {:.1} s), {n3} checkpoint configs ({loaded} loaded, {:.1} s); {} panics",
        iters * 10,
        (t1 - t0).as_secs_f64(),
        iters * 10,
        (t2 - t1).as_secs_f64(),
        t2.elapsed().as_secs_f64(),
        panics.len()
    );
    assert!(panics.is_empty(), "panics:\n{}", panics.join("\n"));
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

// ====================================================== memory budget ====

// `--memory-budget` chooses the micro-batch and recompute policy, says so
// and why, and the run keeps to it: `train` at two budgets, `compare` at one
// (its mixed side).
#[test]
fn a_memory_budget_chooses_what_fits_and_says_why() {
    let d = tmpdir("budget");
    let run = |cmd: &str, budget: &str, out: &str| {
        let o = d.join(out);
        let (ok, _, err) = run_bin(
            &[
                cmd,
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--steps",
                "1",
                "--eval-every",
                "0",
                "--plain",
                "--memory-budget",
                budget,
                "--out",
                o.to_str().unwrap(),
            ],
            &[],
        );
        assert!(ok, "{cmd} --memory-budget {budget}:\n{err}");
        err
    };
    // roomy: the whole batch of 8 in one pass, nothing recomputed
    let err = run("train", "1GiB", "roomy");
    assert!(
        err.contains("memory budget 1.00 GiB: micro-batch 8 (1 accumulated), recompute none")
            && err.contains("recomputes nothing")
            && err.contains("batch 8 = 1 micro-batch(es) of 8"),
        "{err}"
    );
    // tight: one sequence per micro-batch
    let err = run("train", "1.05MiB", "tight");
    assert!(
        err.contains("memory budget 1.05 MiB: micro-batch 1 (8 accumulated), recompute none")
            && err.contains("batch 8 = 8 micro-batch(es) of 1"),
        "{err}"
    );
    let err = run("compare", "1GiB", "compare");
    assert!(
        err.contains("memory budget 1.00 GiB: micro-batch 8 (1 accumulated), recompute none"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

// ====================================================== bad arguments ====

#[test]
fn every_flag_is_validated_with_what_is_allowed() {
    let d = tmpdir("flags");
    let out = d.join("out");
    let o = out.to_str().unwrap();
    let t = |extra: &[&'static str]| -> Vec<&str> {
        let mut a = vec!["train", "--preset", "tiny", "--device", "cpu", "--out"];
        a.push(o);
        a.extend_from_slice(extra);
        a
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (t(&["--steps", "0"]), "--steps must be at least 1"),
        (
            t(&["--steps", "-3"]),
            "not a whole number: expected 0, 1, 2",
        ),
        (t(&["--steps", "1.5"]), "not a whole number"),
        (t(&["--batch", "0"]), "--batch must be at least 1"),
        (t(&["--batch", "-8"]), "not a whole number"),
        (t(&["--batch", "99999999999"]), "--batch must be 1..=65536"),
        (
            t(&["--micro-batch", "100000"]),
            "--micro-batch must be 1..=65536",
        ),
        (
            t(&["--micro-batch", "0"]),
            "--micro-batch must be at least 1",
        ),
        (
            t(&["--batch", "4", "--micro-batch", "8"]),
            "use a micro-batch of 1..=4",
        ),
        (t(&["--accum", "0"]), "--accum must be at least 1"),
        (
            t(&["--batch", "8", "--micro-batch", "4", "--accum", "3"]),
            "give any two of --batch, --micro-batch, --accum",
        ),
        (
            t(&["--ckpt-budget", "2"]),
            "the smallest achievable peak is 3",
        ),
        (
            t(&["--ckpt-budget", "0"]),
            "the smallest achievable peak is 3",
        ),
        (
            t(&["--ckpt-budget", "3", "--no-checkpoint-activations"]),
            "--ckpt-budget needs activation checkpointing",
        ),
        (
            t(&["--memory-budget", "abc"]),
            "--memory-budget: \"abc\" is not a size: expected a number with a unit, e.g. 2GiB",
        ),
        (
            t(&["--memory-budget", "0"]),
            "--memory-budget: \"0\" is no memory at all",
        ),
        (
            t(&["--memory-budget", "1KiB"]),
            "--memory-budget 1.0 KiB: nothing fits; the smallest plan is",
        ),
        (
            t(&["--memory-budget", "1KiB", "--micro-batch", "4"]),
            "nothing fits (with --micro-batch as given)",
        ),
        (
            t(&["--memory-budget", "1GiB", "--resume", "/tmp"]),
            "a resumed run keeps its own",
        ),
        (
            vec!["compare", "--preset", "tiny", "--memory-budget", "-1GiB"],
            "--memory-budget: \"-1GiB\" is not a size",
        ),
        (
            vec!["train", "--preset", "huge"],
            "expected capstone, small or tiny",
        ),
        (
            vec!["train", "--preset", "tiny", "--device", "tpu"],
            "expected auto, cpu, gpu or spec",
        ),
        (t(&["--precision", "fp8"]), "expected fp32, bf16 or fp16"),
        (t(&["--fp16", "--bf16"]), "cannot be used with"),
        (t(&["--lr", "NaN"]), "--lr must be a positive number"),
        (t(&["--lr", "-1"]), "--lr must be a positive number"),
        (t(&["--lr", "0"]), "--lr must be a positive number"),
        (t(&["--lr", "inf"]), "--lr must be a positive number"),
        (
            t(&["--clip", "-1"]),
            "--clip must be a positive number, or 0",
        ),
        (
            t(&["--clip", "NaN"]),
            "--clip must be a positive number, or 0",
        ),
        (t(&["--dropout", "1"]), "--dropout must be in [0, 1)"),
        (t(&["--dropout", "-0.5"]), "--dropout must be in [0, 1)"),
        (t(&["--dropout", "NaN"]), "--dropout must be in [0, 1)"),
        (t(&["--warmup", "30"]), "must be shorter than the run"),
        (t(&["--seed", "-1"]), "not a whole number"),
        (
            t(&["--sample-len", "99999999999"]),
            "--sample-len must be 0..=1000000",
        ),
        (t(&["--save-every", "x"]), "not a whole number"),
        (
            vec!["train", "--resume", "/nonexistent/run"],
            "--resume: /nonexistent/run: no such checkpoint directory",
        ),
        (
            vec!["train", "--resume", "/tmp"],
            "not a readable tinyllm checkpoint",
        ),
        (vec!["eval"], "--checkpoint <CHECKPOINT>"),
        (vec!["generate"], "--checkpoint <CHECKPOINT>"),
        (
            vec!["eval", "--checkpoint", "/nonexistent/ckpt"],
            "--checkpoint: /nonexistent/ckpt: no such checkpoint directory",
        ),
        (
            vec!["generate", "--checkpoint", "/nonexistent/ckpt"],
            "no such checkpoint directory",
        ),
        (
            vec![
                "generate",
                "--checkpoint",
                "/nonexistent/ckpt",
                "--temperature",
                "-1",
            ],
            "--temperature must be 0 (greedy) or positive",
        ),
        (
            vec![
                "generate",
                "--checkpoint",
                "/nonexistent/ckpt",
                "--temperature",
                "NaN",
            ],
            "--temperature must be 0 (greedy) or positive",
        ),
        (
            vec![
                "generate",
                "--checkpoint",
                "/nonexistent/ckpt",
                "--len",
                "18446744073709551615",
            ],
            "--len must be 0..=1000000",
        ),
        (
            vec![
                "generate",
                "--checkpoint",
                "/nonexistent/ckpt",
                "--top-k",
                "-1",
            ],
            "not a whole number",
        ),
        (
            vec![
                "eval",
                "--checkpoint",
                "/nonexistent/ckpt",
                "--device",
                "tpu",
            ],
            "expected auto, cpu, gpu or spec",
        ),
        (
            vec!["compare", "--preset", "tiny", "--micro-batch", "0"],
            "--micro-batch must be at least 1",
        ),
        (
            vec!["compare", "--preset", "tiny", "--profile"],
            "--profile: compare does not profile its runs",
        ),
    ];
    for (args, want) in &cases {
        let (ok, _, err) = run_bin(args, &[]);
        assert!(
            !ok && err.contains(want),
            "{args:?}: expected an error containing {want:?}, got:\n{err}"
        );
        assert!(
            !out.join("checkpoint").exists(),
            "{args:?} left a checkpoint behind"
        );
    }
    // Resuming a finished run to its own length has nothing to do and
    // changes nothing; to fewer steps it is refused; a resume may not change
    // the recipe.
    let (ok, _, err) = run_bin(&t(&["--steps", "2", "--sample-len", "0", "--plain"]), &[]);
    assert!(ok, "{err}");
    let metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let (ok, _, err) = run_bin(
        &["train", "--resume", o, "--steps", "2", "--sample-len", "0"],
        &[],
    );
    assert!(
        ok && err.contains("already finished at step 2 of 2: nothing to do"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(out.join("metrics.jsonl")).unwrap(),
        metrics,
        "the finished run was touched"
    );
    let (ok, _, err) = run_bin(&["train", "--resume", o, "--steps", "1"], &[]);
    assert!(
        !ok && err.contains("already at step 2 of 1") && err.contains("larger --steps"),
        "{err}"
    );
    let (ok, _, err) = run_bin(
        &["train", "--resume", o, "--steps", "4", "--lr", "0.5"],
        &[],
    );
    assert!(
        !ok && err.contains("--lr differs from the run being resumed"),
        "{err}"
    );
    let (ok, _, err) = run_bin(&[], &[]);
    assert!(!ok && err.contains("Usage"), "{err}");
    let (ok, _, err) = run_bin(&["eval", "--checkpoint", o], &[("TINYLLM_THREADS", "0")]);
    assert!(
        !ok && err.contains("TINYLLM_THREADS must be a whole number ≥ 1"),
        "{err}"
    );
    eprintln!(
        "flags: {} bad invocations refused with what is allowed",
        cases.len() + 4
    );
    let _ = std::fs::remove_dir_all(&d);
}

// ================================================== numerical faults ====

/// The metrics of a finished or stopped run.
fn metrics(out: &Path) -> Vec<StepMetrics> {
    MetricsLog::read(&out.join("metrics.jsonl")).unwrap()
}

fn assert_finite_checkpoint(out: &Path) {
    let m = checkpoint::load_model(out, Device::Cpu).unwrap();
    for (n, p) in m.named_parameters() {
        assert!(
            p.to_vec_f32().unwrap().iter().all(|x| x.is_finite()),
            "{n} is not finite"
        );
    }
}

/// fp16: an inf loss, a NaN loss and an inf gradient (finite loss) on chosen
/// steps of a real run: each step is skipped, the scale halves, training
/// recovers and the run ends with finite weights.
#[test]
fn fp16_run_skips_injected_overflows_and_recovers() {
    let out = tmpdir("fp16-faults");
    let mut a = train_args(&out, 10);
    a.push("--fp16".into());
    let (ok, _, err) = run_bin(
        &strs(&a),
        &[(
            "TINYLLM_FAULT",
            "loss-inf@3,loss-nan@4,grad-inf@5,grad-inf@8",
        )],
    );
    assert!(ok, "{err}");
    let m = metrics(&out);
    assert_eq!(m.len(), 10);
    for s in [3, 4, 5, 8] {
        let (before, at) = (&m[s - 2], &m[s - 1]);
        assert!(at.skipped, "step {s} was not skipped: {at:?}");
        assert_eq!(
            at.scale,
            before.scale / 2.0,
            "step {s}: the scale did not back off"
        );
    }
    assert!(
        !m[5].skipped && !m[6].skipped && !m[9].skipped,
        "training did not recover: {m:?}"
    );
    assert!(m.iter().all(|x| x.loss.is_finite() || x.skipped));
    assert!(m[9].scale >= m[0].scale / 16.0 && m[9].scale > MIN_SCALE);
    assert_finite_checkpoint(&out);
    let st = Verified::open(&out).unwrap().train_state().unwrap();
    assert_eq!(st.scaler.unwrap().scale, m[9].scale);
    let _ = std::fs::remove_dir_all(&out);
}

/// bf16 (no loss scaler): a non-finite loss or gradient stops the run before
/// the update, with an error that says so and points at the last good
/// checkpoint, which is intact, finite, and resumes to the reference bits.
#[test]
fn bf16_run_stops_on_non_finite_values_with_the_last_checkpoint_intact() {
    for (fault, want) in [
        ("loss-nan@3", "non-finite loss"),
        ("loss-inf@3", "non-finite loss"),
        ("grad-inf@3", "non-finite gradients"),
    ] {
        let out = tmpdir(&format!("bf16-{fault}"));
        let (ok, _, err) = run_bin(&strs(&train_args(&out, STEPS)), &[("TINYLLM_FAULT", fault)]);
        assert!(!ok, "{fault}: the run did not stop");
        assert!(
            err.contains(want) && err.contains("step 3") && err.contains("(step 2), is intact"),
            "{fault}: {err}"
        );
        assert_eq!(Verified::open(&out).unwrap().train_state().unwrap().step, 2);
        assert_finite_checkpoint(&out);
        check_recovers(&out, Some(2), fault);
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// Gradients that overflow at every scale from step 5 on drive the scale to
/// its floor: the run stops with an error (not an endless loop of skips),
/// and the last good checkpoint is the one from before the skipped steps
/// (the `--save-every` cadence waits while steps are skipped).
#[test]
fn an_overflow_streak_to_min_scale_is_an_error() {
    let out = tmpdir("floor");
    let mut a = train_args(&out, 100);
    let at = a.iter().position(|x| x == "--save-every").unwrap();
    a[at + 1] = "2".into();
    a.push("--fp16".into());
    let t0 = Instant::now();
    let (ok, _, err) = run_bin(&strs(&a), &[("TINYLLM_FAULT", "grad-inf@5-")]);
    // 65536 · 2^-41 is the first scale below 2^-24: 41 skips, steps 5..=45.
    assert!(
        !ok && err.contains("loss scale fell")
            && err.contains("training stopped at step 45")
            && err.contains(
                "(step 4, from before the skipped steps that began at step 5), is intact"
            ),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(120));
    let st = Verified::open(&out).unwrap().train_state().unwrap();
    assert_eq!(st.step, 4);
    assert_eq!(st.scaler.unwrap().scale, 65536.0);
    assert_finite_checkpoint(&out);
    // Training goes on from it (without the fault).
    let (ok, _, err) = run_bin(
        &[
            "train",
            "--resume",
            out.to_str().unwrap(),
            "--steps",
            "8",
            "--sample-len",
            "0",
        ],
        &[],
    );
    assert!(ok, "{err}");
    assert!(metrics(&out)[4..]
        .iter()
        .all(|m| !m.skipped && m.loss.is_finite()));
    let _ = std::fs::remove_dir_all(&out);
}

/// fp16: a loss that stays non-finite (a forward pass that overflows on
/// every batch) ends the run after five such steps with an error that says
/// so, and the checkpoint it names as the last good one is from before the
/// trouble and trains on: resumed without the fault, it reaches the
/// uninterrupted run's bits.
#[test]
fn fp16_non_finite_losses_end_the_run_at_a_good_checkpoint() {
    let reference = tmpdir("fp16-streak-ref");
    let out = tmpdir("fp16-streak");
    let args = |out: &Path| {
        let mut a = train_args(out, 12);
        let at = a.iter().position(|x| x == "--save-every").unwrap();
        a[at + 1] = "2".into();
        a.push("--fp16".into());
        a
    };
    let (ok, _, err) = run_bin(&strs(&args(&reference)), &[]);
    assert!(ok, "{err}");
    let (ok, stdout, err) = run_bin(&strs(&args(&out)), &[("TINYLLM_FAULT", "loss-nan@5-")]);
    assert!(!ok && !stdout.contains("done"), "{err}");
    assert!(
        err.contains("training stopped at step 9")
            && err.contains("non-finite on 5 steps in a row (steps 5-9)")
            && err.contains("in float32 too")
            && err.contains(
                "(step 4, from before the skipped steps that began at step 5), is intact"
            ),
        "{err}"
    );
    assert_eq!(Verified::open(&out).unwrap().train_state().unwrap().step, 4);
    let (ok, _, err) = run_bin(&["train", "--resume", out.to_str().unwrap()], &[]);
    assert!(ok, "the last good checkpoint does not train on: {err}");
    assert!(outcome(&out) == outcome(&reference));
    for d in [out, reference] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// fp16 whose forward pass overflows for real (a learning rate of 1e9): not
/// "done" with NaN losses, but an error that names the overflow.
#[test]
fn fp16_divergence_is_an_error_that_names_the_overflow() {
    let out = tmpdir("fp16-lr");
    let (ok, stdout, err) = run_bin(
        &[
            "train",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--fp16",
            "--lr",
            "1e9",
            "--steps",
            "30",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(!ok && !stdout.contains("done"), "{stdout}\n{err}");
    assert!(
        err.contains("the loss was non-finite on 5 steps in a row")
            && err.contains("has a finite loss in float32")
            && err.contains("the fp16 forward pass overflows"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Library level, fp16 and bf16 with a scaler: a regression whose loss is
/// made inf / NaN on chosen steps skips exactly those, backs off, recovers
/// and converges; the scale never grows to inf; without a scaler an inf
/// gradient under a finite loss is an error that leaves the weights alone.
#[test]
fn scaler_skips_backs_off_and_recovers_on_injected_faults() -> tinyllm::Result<()> {
    for prec in [Precision::Fp16, Precision::Bf16] {
        let gen = Generator::new(0);
        let model = Linear::new(4, 1, true, &gen, Device::Cpu)?;
        let mut opt = AdamW::new(model.parameters(), AdamWConfig::new(3e-2))?;
        let mut scaler = DynamicLossScaler::new(256.0, 2.0, 0.5, 1000)?;
        let x = Tensor::randn(&[32, 4], 1.0, &gen, Device::Cpu)?;
        let y = x.sum(-1, true)?;
        let micro: Vec<(Tensor, Tensor)> = (0..4)
            .map(|i| Ok((x.narrow(0, 8 * i, 8)?, y.narrow(0, 8 * i, 8)?)))
            .collect::<tinyllm::Result<_>>()?;
        let bad = [3usize, 4, 10, 30];
        let mut last = f32::INFINITY;
        for step in 0..300 {
            let poison = if bad.contains(&step) {
                if step % 2 == 0 {
                    f64::NAN
                } else {
                    f64::INFINITY
                }
            } else {
                1.0
            };
            let before = scaler.loss_scale();
            let r = train_step_mixed(
                &model,
                &micro,
                |(x, y)| tinyllm::ops::mse(&model.forward(x)?, y)?.mul_scalar(poison),
                &mut opt,
                prec,
                Some(&mut scaler),
                Some(1.0),
            )?;
            assert_eq!(r.skipped, bad.contains(&step), "{prec:?} step {step}");
            if r.skipped {
                assert_eq!(r.scale, before / 2.0);
            }
            assert!(r.scale.is_finite() && r.scale >= MIN_SCALE);
            for p in model.parameters() {
                assert!(
                    p.to_vec_f32()?.iter().all(|v| v.is_finite()),
                    "{prec:?} step {step}: non-finite weights"
                );
            }
            if !r.skipped {
                last = r.loss;
            }
        }
        assert!(
            last < 5e-2,
            "{prec:?}: did not converge after the faults (loss {last})"
        );
    }

    // Growth stops short of inf (zero gradients never overflow).
    let gen = Generator::new(1);
    let model = Linear::new(2, 1, false, &gen, Device::Cpu)?;
    let mut opt = AdamW::new(model.parameters(), AdamWConfig::new(1e-3))?;
    let mut scaler = DynamicLossScaler::new(2f32.powi(126), 2.0, 0.5, 1)?;
    let x = Tensor::zeros(&[4, 2], tinyllm::DType::F32, Device::Cpu)?;
    let micro = vec![(x.clone(), x.narrow(1, 0, 1)?)];
    for _ in 0..5 {
        let r = train_step_mixed(
            &model,
            &micro,
            |(x, _)| model.forward(x)?.sum(0, false)?.sum(0, false),
            &mut opt,
            Precision::Fp32,
            Some(&mut scaler),
            None,
        )?;
        assert!(!r.skipped && r.scale.is_finite(), "{r:?}");
    }

    // No scaler: an infinite gradient behind a finite loss is refused.
    let model = Linear::new(4, 1, true, &gen, Device::Cpu)?;
    let mut opt = AdamW::new(model.parameters(), AdamWConfig::new(1e-2))?;
    let x = Tensor::randn(&[8, 4], 1.0, &gen, Device::Cpu)?;
    let micro = vec![(x.clone(), x.sum(-1, true)?)];
    let before: Vec<Vec<u32>> = model
        .parameters()
        .iter()
        .map(|p| {
            p.to_vec_f32()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect();
    let w = model.parameters()[0].clone();
    for clip in [Some(1.0), None] {
        let e = train_step_mixed(
            &model,
            &micro,
            |(x, y)| {
                tinyllm::ops::mse(&model.forward(x)?, y)?
                    .add(&w.sub(&w.detach())?.sqrt()?.sum(-1, false)?.sum(-1, false)?)
            },
            &mut opt,
            Precision::Bf16,
            None,
            clip,
        )
        .expect_err("an inf gradient must not be stepped");
        assert!(e.to_string().contains("non-finite gradients"), "{e}");
        let after: Vec<Vec<u32>> = model
            .parameters()
            .iter()
            .map(|p| {
                p.to_vec_f32()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            })
            .collect();
        assert_eq!(before, after, "weights changed");
        assert!(
            model.parameters().iter().all(|p| p.grad().is_none_or(|g| g
                .to_vec_f32()
                .unwrap()
                .iter()
                .all(|v| *v == 0.0))),
            "gradients kept"
        );
    }
    Ok(())
}

/// A checkpoint of non-finite weights is never written over a good one.
#[test]
fn non_finite_weights_are_never_saved() {
    let (dir, cfg) = saved_tiny("nonfinite-save", 1);
    let run = dir.parent().unwrap();
    let corpus = Corpus::embedded();
    let t = Trainer::resume(cfg, Device::Cpu, &corpus, run).unwrap();
    let p = &t.model().parameters()[3];
    let mut v = p.to_vec_f32().unwrap();
    v[0] = f32::NAN;
    p.assign(&Tensor::from_vec(v, p.shape(), Device::Cpu).unwrap())
        .unwrap();
    let before = std::fs::read(dir.join("model.safetensors")).unwrap();
    let e = t
        .save(run)
        .expect_err("NaN weights must not be saved")
        .to_string();
    assert!(
        e.contains("not finite") && e.contains("previous checkpoint"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        before
    );
    assert!(!run.join("checkpoint.next").exists());
    Verified::open(run).unwrap();
    let _ = std::fs::remove_dir_all(run);
}

// ============================================================ devices ====

#[test]
fn a_missing_gpu_is_a_clear_error_or_a_cpu_fallback() {
    let d = tmpdir("devices");
    let o = d.join("out");
    for hide in [
        ("TINYLLM_ADAPTER", "nonexistent-adapter"),
        ("WGPU_BACKEND", "metal"),
    ] {
        let envs = [hide];
        let mut a = vec![
            "train",
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--sample-len",
            "0",
            "--plain",
            "--out",
            o.to_str().unwrap(),
        ];
        a.extend(["--device", "gpu"]);
        let (ok, _, err) = run_bin(&a, &envs);
        assert!(
            !ok && err.contains("--device gpu: no GPU adapter is available")
                && err.contains("use --device cpu or auto"),
            "{hide:?}: {err}"
        );
        assert!(!o.join("checkpoint").exists());
        a.truncate(a.len() - 2);
        a.extend(["--device", "auto"]);
        let (ok, _, err) = run_bin(&a, &envs);
        assert!(
            ok && err.contains("no GPU adapter") && err.contains("training on the CPU"),
            "{hide:?}: {err}"
        );
        assert!(o.join("checkpoint/manifest.json").exists());
        let (ok, _, err) = run_bin(
            &[
                "eval",
                "--device",
                "gpu",
                "--checkpoint",
                o.to_str().unwrap(),
            ],
            &envs,
        );
        assert!(!ok && err.contains("no GPU adapter"), "{err}");
        let _ = std::fs::remove_dir_all(&o);
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A GPU allocation beyond the device's limits is an Error, not a panic or an
/// abort (skips without an adapter). A real device OOM or device loss cannot
/// be provoked on a software adapter.
#[test]
fn an_oversized_gpu_tensor_is_an_error() {
    if !tinyllm::testing::gpu_available() {
        return;
    }
    // An outer product of 2^16 × 2^16 float32s: 16 GiB, past any binding limit.
    let a = Tensor::from_vec(vec![1.0; 1 << 16], &[1 << 16, 1], Device::Gpu).unwrap();
    let b = Tensor::from_vec(vec![1.0; 1 << 16], &[1, 1 << 16], Device::Gpu).unwrap();
    let e = catch_unwind(AssertUnwindSafe(|| {
        a.matmul(&b).and_then(|c| c.to_vec_f32()).map(|v| v.len())
    }))
    .expect("the GPU backend panicked on an oversized tensor")
    .expect_err("a 16 GiB tensor must be refused");
    assert!(
        e.to_string().contains("exceeds") || e.to_string().contains("GPU"),
        "{e}"
    );
    // The device is still usable afterwards. (A 1024-long sum: lavapipe caps a
    // shader loop at 65535 iterations, so longer single-invocation reductions
    // come out short on that software device.)
    let s = a
        .narrow(0, 0, 1024)
        .unwrap()
        .sum(0, false)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    assert_eq!(s, vec![1024.0]);
}

// ======================================================== determinism ====

/// The same seed and config give the same bits run after run and on 1, 2 or
/// 3 matmul threads (`TINYLLM_THREADS`), for bf16 with dropout and fp16.
#[test]
fn same_bits_on_any_thread_count() {
    for prec in ["--bf16", "--fp16"] {
        let mut runs: Vec<(String, Outcome)> = Vec::new();
        for threads in ["1", "2", "3", "1"] {
            let out = tmpdir(&format!("threads-{prec}-{threads}-{}", runs.len()));
            let mut a = train_args(&out, 3);
            a.extend([
                prec.into(),
                "--batch".into(),
                "16".into(),
                "--micro-batch".into(),
                "16".into(),
                "--dropout".into(),
                "0.1".into(),
            ]);
            let (ok, _, err) = run_bin(&strs(&a), &[("TINYLLM_THREADS", threads)]);
            assert!(ok, "{err}");
            runs.push((threads.into(), outcome(&out)));
            let _ = std::fs::remove_dir_all(&out);
        }
        for (t, o) in &runs[1..] {
            assert!(
                o.losses == runs[0].1.losses,
                "{prec}: losses differ with {t} threads"
            );
            assert!(
                *o == runs[0].1,
                "{prec}: final checkpoint differs with {t} threads"
            );
        }
    }
}

// ================================================ never lose a run ====

/// A run's arguments for the signal tests: `steps` steps on `device` in
/// `prec`, no periodic checkpoint (`--save-every 0`: the default, where a
/// signal used to lose everything), plain lines.
fn signal_args(out: &Path, steps: usize, prec: &str, device: &str) -> Vec<String> {
    [
        "train",
        "--preset",
        "tiny",
        "--device",
        device,
        prec,
        "--plain",
        "--sample-len",
        "0",
        "--eval-every",
        "0",
        "--steps",
        &steps.to_string(),
        "--out",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Spawns the binary with stderr piped; returns the child and its stderr
/// lines as they come.
fn spawn_bin(
    args: &[String],
    envs: &[(&str, &str)],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    spawn_reading_stderr(BIN, args, envs)
}

/// Reads lines until one starts with `prefix` (or panics after 300 s: a
/// cold shader cache on a software GPU can take minutes to start a run).
fn wait_for(rx: &std::sync::mpsc::Receiver<String>, prefix: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) if l.starts_with(prefix) => return seen,
            Ok(l) => seen.push(l),
            Err(_) => break,
        }
    }
    panic!("never saw {prefix:?}; stderr so far:\n{}", seen.join("\n"));
}

fn send_signal(child: &std::process::Child, sig: i32) {
    // SAFETY: kill(2) takes plain integers; the child is the caller's and not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

/// Waits at most `secs` for the child; its exit status (panics on a hang).
fn wait_exit(child: &mut std::process::Child, secs: u64) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the process did not exit within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGINT / SIGTERM in the middle of step `at` of `steps` (the
/// `await-signal` fault holds the step until the signal arrives): the step
/// finishes, a checkpoint is written, stderr gives its place and the exact
/// resume command, the exit status is 128 + the signal; running that command
/// ends on the bits of the uninterrupted run, for every precision on `device`.
fn interrupt_resumes_to_the_same_bits(device: &str, precisions: &[&str], steps: usize, at: usize) {
    for (i, prec) in precisions.iter().enumerate() {
        let (sig, name) = if i % 2 == 0 {
            (libc::SIGINT, "SIGINT")
        } else {
            (libc::SIGTERM, "SIGTERM")
        };
        let what = format!("{device} {prec} {name}");
        // The uninterrupted run, in this process (one GPU start-up for all).
        let reference = tmpdir(&format!("sig-ref-{device}{prec}"));
        let cfg = TrainConfig::resolve(&TrainOptions {
            preset: Some("tiny".into()),
            device: Some(device.parse().unwrap()),
            precision: Some(prec.trim_start_matches("--").parse().unwrap()),
            eval_every: Some(0),
            steps: Some(steps),
            out: Some(reference.clone()),
            ..Default::default()
        })
        .unwrap();
        tinyllm::train::run(cfg, Start::Fresh, tinyllm::train::Progress::Quiet).unwrap();
        let out = tmpdir(&format!("sig-{device}{prec}"));
        let fault = format!("await-signal@{at}");
        let (mut child, rx) = spawn_bin(
            &signal_args(&out, steps, prec, device),
            &[("TINYLLM_FAULT", &fault)],
        );
        wait_for(&rx, &format!("TINYLLM_FAULT_PAUSED {fault}"));
        send_signal(&child, sig);
        let st = wait_exit(&mut child, 120);
        let err: Vec<String> = rx.iter().collect();
        let err = err.join("\n");
        assert_eq!(st.code(), Some(128 + sig), "{what}: {err}");
        assert!(!err.contains("panicked"), "{what}: {err}");
        let o = out.display().to_string();
        assert!(
            err.contains(&format!(
                "interrupted by {name}: the run is saved at step {at} of {steps} in {o}/checkpoint"
            )),
            "{what}: {err}"
        );
        let cmd = err
            .lines()
            .find_map(|l| l.strip_prefix("resume with: "))
            .unwrap_or_else(|| panic!("{what}: no resume command in\n{err}"));
        assert_eq!(
            cmd,
            format!("tinyllm train --resume {o} --steps {steps}"),
            "{what}"
        );
        assert_eq!(
            Verified::open(&out).unwrap().train_state().unwrap().step,
            at
        );
        // Exactly that command (on the GPU without its closing text sample:
        // drawing it byte by byte on a software adapter takes seconds).
        let mut args: Vec<&str> = cmd.split(' ').skip(1).collect();
        if device == "gpu" {
            args.extend(["--sample-len", "0"]);
        }
        let (ok, _, err) = run_bin(&args, &[]);
        assert!(ok, "{what}: the printed resume command failed: {err}");
        assert!(
            outcome(&out) == outcome(&reference),
            "{what}: the resumed run differs from the uninterrupted one"
        );
        // the metrics say where the run was resumed, and so does its plot
        let resumed: Vec<usize> = metrics(&out)
            .iter()
            .filter(|m| m.resumed)
            .map(|m| m.step)
            .collect();
        assert_eq!(resumed, [at + 1], "{what}");
        let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
        assert!(svg.contains(&format!(">resumed at {at}<")), "{what}");
        assert!(!std::fs::read_to_string(reference.join("loss.svg"))
            .unwrap()
            .contains("resumed"));
        for d in [out, reference] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[test]
fn a_signal_saves_the_run_and_it_resumes_to_the_same_bits_cpu() {
    interrupt_resumes_to_the_same_bits("cpu", &["--fp32", "--bf16", "--fp16"], 6, 3);
}

#[test]
fn a_signal_saves_the_run_and_it_resumes_to_the_same_bits_gpu() {
    if tinyllm::testing::gpu_available() {
        // fp16, the precision with the most state (the loss scaler); the CPU
        // test covers the other two and the second signal.
        interrupt_resumes_to_the_same_bits("gpu", &["--fp16"], 4, 2);
    }
}

/// A second signal exits at once (here while the first checkpoint write is
/// held at a pause point, which the first signal does not end); what is on
/// disk still recovers to the uninterrupted run's bits.
#[test]
fn a_second_signal_exits_at_once() {
    let out = tmpdir("sig-twice");
    let (mut child, rx) = spawn_bin(&train_args(&out, STEPS), &[("TINYLLM_FAULT", "staged@2")]);
    wait_for(&rx, "TINYLLM_FAULT_PAUSED staged@2");
    send_signal(&child, libc::SIGINT);
    wait_for(&rx, "tinyllm: stopping after this step");
    assert!(
        child.try_wait().unwrap().is_none(),
        "one signal ended the save"
    );
    send_signal(&child, libc::SIGINT);
    let st = wait_exit(&mut child, 10);
    assert_eq!(st.code(), Some(130));
    // The staged step-2 checkpoint never replaced step 1's.
    check_recovers(&out, Some(1), "a second SIGINT inside the step-2 save");
    let _ = std::fs::remove_dir_all(&out);
}

/// SIGTERM during the very first step: that step still finishes and is
/// saved (exit 143), so even a run stopped at once loses nothing.
#[test]
fn a_signal_in_the_first_step_saves_it() {
    let out = tmpdir("sig-early");
    let (mut child, rx) = spawn_bin(
        &signal_args(&out, 3, "--bf16", "cpu"),
        &[("TINYLLM_FAULT", "await-signal@1")],
    );
    wait_for(&rx, "TINYLLM_FAULT_PAUSED await-signal@1");
    send_signal(&child, libc::SIGTERM);
    assert_eq!(wait_exit(&mut child, 60).code(), Some(143));
    let err: Vec<String> = rx.iter().collect();
    assert!(
        err.iter()
            .any(|l| l.contains("interrupted by SIGTERM: the run is saved at step 1 of 3")),
        "{err:?}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Two trainers on one --out: the second is refused at once with the first
/// one's pid, and the first finishes (here: saves on SIGINT) unharmed.
#[test]
fn a_second_process_on_the_same_out_is_refused_naming_the_first() {
    let out = tmpdir("lock");
    let (mut first, rx) = spawn_bin(
        &signal_args(&out, 4, "--bf16", "cpu"),
        &[("TINYLLM_FAULT", "await-signal@2")],
    );
    wait_for(&rx, "TINYLLM_FAULT_PAUSED await-signal@2");
    for extra in [vec![], vec!["--overwrite".to_string()]] {
        let mut a = signal_args(&out, 4, "--bf16", "cpu");
        a.extend(extra);
        let (ok, _, err) = run_bin(&strs(&a), &[]);
        assert!(
            !ok && err.contains("is in use by another tinyllm process")
                && err.contains(&format!("pid {}", first.id())),
            "{err}"
        );
    }
    let (ok, _, err) = run_bin(&["train", "--resume", out.to_str().unwrap()], &[]);
    assert!(
        !ok && err.contains("in use by another tinyllm process"),
        "{err}"
    );
    send_signal(&first, libc::SIGINT);
    assert_eq!(wait_exit(&mut first, 60).code(), Some(130));
    assert_eq!(Verified::open(&out).unwrap().train_state().unwrap().step, 2);
    // Released with the process: the run now resumes.
    let (ok, _, err) = run_bin(&["train", "--resume", out.to_str().unwrap()], &[]);
    assert!(ok, "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A new run into a directory that holds one is refused (nothing changes);
/// --overwrite replaces tinyllm's files only, and a user's own folders named
/// like checkpoints are never deleted or replaced.
#[test]
fn an_existing_run_and_a_users_folders_are_never_overwritten() {
    let out = tmpdir("existing");
    let a = train_args(&out, 2);
    let (ok, _, err) = run_bin(&strs(&a), &[]);
    assert!(ok, "{err}");
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let before = |f: &str| std::fs::read(out.join(f)).unwrap();
    let (lines, manifest) = (before("metrics.jsonl"), before("checkpoint/manifest.json"));
    let (ok, _, err) = run_bin(&strs(&train_args(&out, 3)), &[]);
    assert!(
        !ok && err.contains("already holds a run")
            && err.contains("--resume")
            && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(before("metrics.jsonl"), lines);
    assert_eq!(before("checkpoint/manifest.json"), manifest);
    let mut o = train_args(&out, 3);
    o.push("--overwrite".into());
    let (ok, _, err) = run_bin(&strs(&o), &[]);
    assert!(ok, "{err}");
    assert_eq!(metrics(&out).len(), 3);
    assert_eq!(before("notes.txt"), b"mine");
    let _ = std::fs::remove_dir_all(&out);

    for name in ["checkpoint", "checkpoint.prev", "checkpoint.next"] {
        let out = tmpdir(&format!("users-{name}"));
        std::fs::create_dir(out.join(name)).unwrap();
        std::fs::write(out.join(name).join("mine.txt"), "keep me").unwrap();
        for extra in [None, Some("--overwrite")] {
            let mut a = train_args(&out, 2);
            a.extend(extra.map(String::from));
            let (ok, _, err) = run_bin(&strs(&a), &[]);
            assert!(
                !ok && err.contains(&format!(
                    "{}/{name} exists but is not a tinyllm checkpoint",
                    out.display()
                )),
                "{name} {extra:?}: {err}"
            );
            assert_eq!(
                std::fs::read(out.join(name).join("mine.txt")).unwrap(),
                b"keep me"
            );
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// The read ends of stdout and stderr closed (`train ... 2>&1 | head -0`):
/// no panic, the run finishes and saves; `generate` into a closed pipe stops
/// at once and exits cleanly.
#[test]
fn closed_pipes_neither_panic_nor_lose_the_run() {
    let out = tmpdir("pipes");
    let mut child = Command::new(BIN)
        .args(signal_args(&out, 3, "--bf16", "cpu"))
        .args(["--save-every", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let st = wait_exit(&mut child, 60);
    assert!(st.success(), "train with closed pipes: {st:?}");
    assert_eq!(Verified::open(&out).unwrap().train_state().unwrap().step, 3);
    assert_eq!(metrics(&out).len(), 3);

    let mut child = Command::new(BIN)
        .args(["generate", "--len", "1000000", "--checkpoint"])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let st = wait_exit(&mut child, 30);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(
        st.success() && err.is_empty(),
        "generate into a closed pipe: {st:?} {err}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// `eval` says how far it is (a line at every tenth), and `generate` streams.
#[test]
fn eval_reports_progress_and_generate_streams() {
    let out = tmpdir("progress");
    let (ok, _, err) = run_bin(&strs(&train_args(&out, 1)), &[]);
    assert!(ok, "{err}");
    let text = out.join("text.txt");
    std::fs::write(&text, "a plain sentence of text. ".repeat(400)).unwrap();
    let (ok, stdout, err) = run_bin(
        &[
            "eval",
            "--checkpoint",
            out.to_str().unwrap(),
            "--data",
            text.to_str().unwrap(),
        ],
        &[],
    );
    assert!(ok && stdout.contains("mean cross-entropy"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("eval: ")).collect();
    // 10400 bytes: 649 windows of 16 tokens, in chunks of 8.
    assert_eq!(lines.len(), 10, "{err}");
    assert!(
        lines[0].starts_with("eval: 10% (") && lines[9] == "eval: 100% (649 of 649 windows)",
        "{err}"
    );

    let mut child = Command::new(BIN)
        .args([
            "generate",
            "--len",
            "1000000",
            "--prompt",
            "The ",
            "--checkpoint",
        ])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = [0u8; 64];
    let mut so = child.stdout.take().unwrap();
    std::io::Read::read_exact(&mut so, &mut first).unwrap();
    assert!(first.starts_with(b"The "));
    drop(so);
    assert!(wait_exit(&mut child, 30).success());
    let _ = std::fs::remove_dir_all(&out);
}

/// What resuming promises. A finished run extended with a larger --steps
/// holds the schedule's final learning rate (the end-of-run hint says so);
/// flags that resolve to the run's own values are not "differences"; a
/// corpus is recognised by its content, from any working directory and
/// however its path is spelled, and a different text is refused.
#[test]
fn resume_semantics_are_as_documented() {
    let d = tmpdir("resume-semantics");
    let run = d.join("run");
    std::fs::write(d.join("corpus.txt"), tinyllm::train::corpus::default_text()).unwrap();
    let mut a: Vec<String> = ["train", "--preset", "tiny", "--device", "cpu", "--plain"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(
        [
            "--sample-len",
            "0",
            "--steps",
            "4",
            "--batch",
            "16",
            "--micro-batch",
            "4",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    a.extend([
        "--data".into(),
        "corpus.txt".into(),
        "--out".into(),
        "run".into(),
    ]);
    let o = Command::new(BIN)
        .args(&a)
        .current_dir(&d)
        .env_remove("CARGO")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        stdout.contains("continue with: tinyllm train --resume run --steps 8")
            && stdout.contains("steps 5..8 run at the schedule's final learning rate"),
        "{stdout}"
    );
    let cfg = Verified::open(&run).unwrap().train_state().unwrap().config;

    // From another directory, no --data (the saved path is absolute), the
    // batch flags and the dropout repeated: an extension to 8 steps.
    let sub = d.join("elsewhere");
    std::fs::create_dir(&sub).unwrap();
    let o = Command::new(BIN)
        .args([
            "train",
            "--resume",
            "../run",
            "--steps",
            "8",
            "--sample-len",
            "0",
        ])
        .args(["--micro-batch", "4", "--dropout", "0.0", "--accum", "4"])
        .current_dir(&sub)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = metrics(&run);
    assert_eq!(m.len(), 8);
    let last = cfg.lr_at(4);
    assert_eq!(last, cfg.lr * cfg.min_lr_frac);
    for s in &m[4..] {
        assert_eq!(s.lr, last, "step {} of the extension", s.step);
    }
    // The same text by another spelling is accepted; another text is not.
    let o = Command::new(BIN)
        .args([
            "train",
            "--resume",
            "run",
            "--steps",
            "9",
            "--sample-len",
            "0",
        ])
        .args(["--data", "./elsewhere/../corpus.txt"])
        .current_dir(&d)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(d.join("other.txt"), "another text entirely. ".repeat(2000)).unwrap();
    let (ok, _, err) = run_bin(
        &["train", "--resume", run.to_str().unwrap(), "--steps", "10"],
        &[],
    );
    assert!(ok, "{err}");
    let (ok, _, err) = run_bin(
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--steps",
            "11",
            "--data",
            d.join("other.txt").to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        !ok && err.contains("the checkpoint was trained on") && err.contains("SHA-256"),
        "{err}"
    );
    // Into another run's directory: refused, that run is not touched.
    let other = d.join("other-run");
    let (ok, _, err) = run_bin(&strs(&train_args(&other, 1)), &[]);
    assert!(ok, "{err}");
    let (ok, _, err) = run_bin(
        &["train", "--resume", run.to_str().unwrap(), "--steps", "11"],
        &[],
    );
    assert!(ok, "{err}");
    let (ok, _, err) = run_bin(
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--steps",
            "12",
            "--out",
            other.to_str().unwrap(),
        ],
        &[],
    );
    assert!(!ok && err.contains("already holds a run"), "{err}");
    assert_eq!(metrics(&other).len(), 1);
    // A real difference names the flag and both values.
    let (ok, _, err) = run_bin(
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--steps",
            "11",
            "--micro-batch",
            "8",
        ],
        &[],
    );
    assert!(
        !ok && err.contains("--batch/--micro-batch/--accum differs")
            && err.contains("batch 16 in micro-batches of 8 given")
            && err.contains("the run has batch 16 in micro-batches of 4"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Memory admission: a run whose planned peak exceeds what the machine has
/// is a clear error before anything is allocated (not SIGABRT), on the CPU
/// and, with an adapter, on the GPU.
#[test]
fn a_run_that_cannot_fit_in_memory_is_refused_with_the_plan() {
    let mut devices = vec!["cpu"];
    if tinyllm::testing::gpu_available() {
        devices.push("gpu");
    }
    for dev in devices {
        let out = tmpdir(&format!("admission-{dev}"));
        let (ok, _, err) = run_bin(
            &[
                "train",
                "--preset",
                "small",
                "--batch",
                "65536",
                "--micro-batch",
                "65536",
                "--steps",
                "1",
                "--device",
                dev,
                "--out",
                out.to_str().unwrap(),
            ],
            &[],
        );
        assert!(
            !ok && err.contains("this run does not fit in memory")
                && err.contains("try --micro-batch")
                && err.contains("planned peak"),
            "{dev}: {err}"
        );
        assert!(!out.join("metrics.jsonl").exists());
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// Runs the binary with its address space capped at 2 GiB (so a runaway read
/// fails instead of filling the machine) and a deadline; (finished in time,
/// success, stderr, peak RSS in bytes). The peak is the last `VmHWM` read
/// from /proc while it runs: `getrusage`'s figure would include this test
/// process's own size, which the child has until it execs.
fn run_capped(args: &[&str], secs: u64) -> (bool, bool, String, u64) {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("CARGO")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: between fork and exec the closure only calls setrlimit(2),
    // which is async-signal-safe, on a limit struct on its own stack.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 2 << 30,
                rlim_max: 2 << 30,
            };
            libc::setrlimit(libc::RLIMIT_AS, &lim);
            Ok(())
        });
    }
    let mut child = c.spawn().unwrap();
    let pid = child.id();
    let mut err_pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err_pipe, &mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut timed_out = false;
    let mut peak = 0u64;
    let status = loop {
        let hwm = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            });
        peak = peak.max(hwm.unwrap_or(0) * 1024);
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline && !timed_out {
            timed_out = true;
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let err = reader.join().unwrap();
    let ok = status.success();
    (!timed_out, ok, err, peak)
}

/// `--data` that is not a regular file (`/dev/zero` never ends, a FIFO with
/// no writer never starts) or is larger than the limit is refused before it
/// is read; a large text costs its size in memory, not ~9 times it.
#[test]
fn the_corpus_is_read_with_bounds() {
    let d = tmpdir("corpus-bounds");
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let huge = d.join("huge.txt");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len((2 << 30) + 1)
        .unwrap(); // sparse: nothing is written
    let out = d.join("out");
    for (data, want) in [
        ("/dev/zero", "is not a regular file (a character device)"),
        (fifo.to_str().unwrap(), "is not a regular file (a FIFO)"),
        (
            huge.to_str().unwrap(),
            "more than tinyllm reads (2048 MiB at most)",
        ),
    ] {
        let (in_time, ok, err, _) = run_capped(
            &[
                "train",
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--steps",
                "1",
                "--data",
                data,
                "--out",
                out.to_str().unwrap(),
            ],
            20,
        );
        assert!(
            in_time && !ok && err.contains(data) && err.contains(want),
            "{data}: {err}"
        );
    }
    // 64 MiB of text: the process's peak stays near the text's size.
    let text = d.join("big.txt");
    let para = tinyllm::train::corpus::default_text().as_bytes();
    let mut f = std::fs::File::create(&text).unwrap();
    let mut n = 0;
    while n < 64 << 20 {
        std::io::Write::write_all(&mut f, para).unwrap();
        n += para.len();
    }
    drop(f);
    let (in_time, ok, err, rss) = run_capped(
        &[
            "train",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--sample-len",
            "0",
            "--data",
            text.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        120,
    );
    assert!(in_time && ok, "{err}");
    assert!(
        rss < n as u64 * 2 + (64 << 20),
        "peak RSS {} MiB for a text of {} MiB",
        rss >> 20,
        n >> 20
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A full disk while appending metrics stops the run with the file's path
/// and where the checkpoint stands; a failed checkpoint write leaves no
/// `checkpoint.next/` and keeps the last one; a plot that cannot be written
/// stops nothing.
#[test]
fn write_failures_are_reported_and_lose_nothing() {
    let out = tmpdir("enospc-metrics");
    let (ok, _, err) = run_bin(
        &strs(&train_args(&out, STEPS)),
        &[("TINYLLM_FAULT", "fail:metrics.jsonl@3")],
    );
    let o = out.display();
    assert!(
        !ok && err.contains("training stopped at step 3")
            && err.contains(&format!("{o}/checkpoint (step 2), is intact"))
            && err.contains(&format!("cannot append step 3 to {o}/metrics.jsonl"))
            && err.contains("No space left on device"),
        "{err}"
    );
    check_recovers(&out, Some(2), "metrics write failed at step 3");
    let _ = std::fs::remove_dir_all(&out);

    let out = tmpdir("enospc-save");
    let (ok, _, err) = run_bin(
        &strs(&train_args(&out, STEPS)),
        &[("TINYLLM_FAULT", "fail:optimizer.safetensors@3")],
    );
    let o = out.display();
    assert!(
        !ok && err.contains("the checkpoint of step 3 could not be written")
            && err.contains(&format!("{o}/checkpoint.next/optimizer.safetensors"))
            && err.contains("No space left on device")
            && err.contains("(step 2), is intact"),
        "{err}"
    );
    assert!(
        !out.join("checkpoint.next").exists(),
        "a failed save left its staging"
    );
    check_recovers(&out, Some(2), "checkpoint write failed at step 3");
    let _ = std::fs::remove_dir_all(&out);

    let out = tmpdir("plot");
    std::fs::create_dir_all(out.join("loss.svg")).unwrap(); // renaming onto it fails
    let mut a = train_args(&out, 4);
    let at = a.iter().position(|x| x == "--eval-every").unwrap();
    a[at + 1] = "1".into();
    let (ok, _, err) = run_bin(&strs(&a), &[]);
    assert!(ok, "a failed plot stopped the run: {err}");
    assert_eq!(err.matches("loss.svg").count(), 1, "one warning: {err}");
    assert!(
        err.contains("warning:") && err.contains("training goes on without its plot"),
        "{err}"
    );
    assert_eq!(Verified::open(&out).unwrap().train_state().unwrap().step, 4);
    let _ = std::fs::remove_dir_all(&out);
}

/// A checkpoint whose config.json has a non-numeric `rope_theta` (or other
/// optional number), or whose weights or moments are not finite, is refused
/// on load instead of taking a default or loading NaNs.
#[test]
fn non_numeric_config_values_and_non_finite_tensors_are_refused_on_load() {
    let (dir, cfg) = saved_tiny("bad-values", 2);
    let pristine: Vec<Vec<u8>> = ["config.json", "model.safetensors", "optimizer.safetensors"]
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap())
        .collect();
    for (k, v) in [
        ("rope_theta", serde_json::json!("10000")),
        ("rope_theta", serde_json::json!(null)),
        ("rms_norm_eps", serde_json::json!([1e-5])),
    ] {
        let mut c: serde_json::Value = serde_json::from_slice(&pristine[0]).unwrap();
        c[k] = v.clone();
        // the parser itself refuses it, whoever calls it
        let e = LlamaConfig::from_hf_json(&c).unwrap_err().to_string();
        assert!(e.contains(&format!("{k:?} must be a number")), "{e}");
        std::fs::write(dir.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
        rehash(&dir);
        let e = refused(&dir, &cfg, "config.json");
        assert!(
            e.contains(&format!("{k:?} must be a number, got {v}")),
            "{e}"
        );
        std::fs::write(dir.join("config.json"), &pristine[0]).unwrap();
    }
    for (fi, file) in [(1, "model.safetensors"), (2, "optimizer.safetensors")] {
        // The last 4 bytes are the last value of the last tensor.
        let mut b = pristine[fi].clone();
        let n = b.len();
        b[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
        std::fs::write(dir.join(file), &b).unwrap();
        rehash(&dir);
        let e = refused(&dir, &cfg, file);
        assert!(e.contains("holds a non-finite value (NaN at index"), "{e}");
        std::fs::write(dir.join(file), &pristine[fi]).unwrap();
    }
    rehash(&dir);
    Verified::open(&dir).unwrap();
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

/// With no desktop session (XDG_RUNTIME_DIR, WAYLAND_DISPLAY and DISPLAY
/// unset), a GPU run does not print Mesa's device-select layer's
/// "XDG_RUNTIME_DIR is invalid" lines. The library quiets it when it creates
/// its GPU context (the binary does nothing of its own), so any program using
/// the library is as quiet.
#[test]
fn no_xdg_runtime_dir_noise_on_a_gpu_probe() {
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let out = tmpdir("xdg");
    let (ok, _, err) = run_bin(&strs(&train_args(&out, 1)), &[]);
    assert!(ok, "{err}");
    let mut cmd = Command::new(BIN);
    cmd.args(["generate", "--device", "gpu", "--len", "4", "--checkpoint"])
        .arg(&out);
    for v in [
        "XDG_RUNTIME_DIR",
        "WAYLAND_DISPLAY",
        "DISPLAY",
        "MESA_VK_DEVICE_SELECT",
        "NODEVICE_SELECT",
    ] {
        cmd.env_remove(v);
    }
    let o = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("device: GPU"), "{err}");
    assert!(!err.contains("XDG_RUNTIME_DIR"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A missing --data file is reported before any device is probed: no
/// adapter note (nor the loader's noise) ahead of the one error that matters.
#[test]
fn a_missing_data_file_is_reported_before_probing_devices() {
    let d = tmpdir("missing_data_first");
    let missing = d.join("nope.txt");
    let ckpt = d.join("no-checkpoint");
    for args in [
        vec![
            "train",
            "--device",
            "auto",
            "--data",
            missing.to_str().unwrap(),
            "--out",
            d.join("out").to_str().unwrap(),
        ],
        vec![
            "eval",
            "--device",
            "auto",
            "--data",
            missing.to_str().unwrap(),
            "--checkpoint",
            ckpt.to_str().unwrap(),
        ],
    ] {
        let (ok, _, err) = run_bin(&args, &[]);
        assert!(!ok && err.contains("cannot read corpus"), "{args:?}: {err}");
        assert!(
            !err.contains("device:"),
            "{args:?} probed a device first: {err}"
        );
    }
}

/// A long comparison run in pieces ends where the one-shot comparison ends:
/// one side alone (`--side fp32`), the other interrupted by a signal in the
/// middle of a step, then `--resume`, which keeps the finished side and
/// continues the interrupted one. The held-out losses (JSON keeps every bit
/// of an f32) are those of `compare` run once.
#[test]
fn a_comparison_runs_one_side_at_a_time_and_resumes_to_the_same_bits() {
    let args = |out: &Path| -> Vec<String> {
        [
            "compare", "--preset", "tiny", "--steps", "8", "--device", "cpu", "--plain", "--out",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([out.display().to_string()])
        .collect()
    };
    let with = |out: &Path, extra: &[&str]| -> Vec<String> {
        let mut a = args(out);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let heldout = |json: &str| -> (u32, u32) {
        let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
        let l = |s: &str| (v[s]["heldout_loss"].as_f64().unwrap() as f32).to_bits();
        (l("fp32"), l("mixed"))
    };
    let once = tmpdir("cmp-once");
    let (ok, json, err) = run_bin(&strs(&with(&once, &["--json"])), &[]);
    assert!(ok, "{err}");
    let want = heldout(&json);
    // read back from the runs' metrics, a finished comparison reports the
    // figures it reported live
    let (ok, again, err) = run_bin(&strs(&with(&once, &["--resume", "--json"])), &[]);
    assert!(ok, "{err}");
    let figures = |json: &str| -> Vec<serde_json::Value> {
        let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
        ["fp32", "mixed"]
            .iter()
            .flat_map(|s| {
                [
                    "heldout_loss",
                    "final_loss",
                    "measured_peak_bytes",
                    "process_peak_bytes",
                ]
                .map(|k| v[s][k].clone())
            })
            .collect()
    };
    assert_eq!(figures(&again), figures(&json));

    let out = tmpdir("cmp-pieces");
    let (ok, _, err) = run_bin(&strs(&with(&out, &["--side", "fp32"])), &[]);
    assert!(ok, "{err}");
    assert!(
        err.contains("the fp32 side has finished") && err.contains("--side mixed --resume"),
        "{err}"
    );
    // plain progress lines say how long the run has left
    assert!(
        err.lines()
            .any(|l| l.starts_with("step") && l.contains(" eta ")),
        "{err}"
    );
    // a second start without --resume is refused, naming the way on
    let (ok, _, err) = run_bin(&strs(&with(&out, &["--side", "mixed"])), &[]);
    assert!(!ok && err.contains("--resume"), "{err}");

    let fault = "await-signal@3";
    let (mut child, rx) = spawn_bin(
        &with(&out, &["--side", "mixed", "--resume"]),
        &[("TINYLLM_FAULT", fault)],
    );
    wait_for(&rx, &format!("TINYLLM_FAULT_PAUSED {fault}"));
    send_signal(&child, libc::SIGINT);
    let st = wait_exit(&mut child, 120);
    let err = rx.iter().collect::<Vec<String>>().join("\n");
    assert!(!st.success(), "{err}");
    assert!(
        err.contains("interrupted by SIGINT") && err.contains("--resume"),
        "{err}"
    );
    assert_eq!(
        Verified::open(&out.join("mixed"))
            .unwrap()
            .train_state()
            .unwrap()
            .step,
        3
    );

    let (ok, json, err) = run_bin(&strs(&with(&out, &["--resume", "--json"])), &[]);
    assert!(ok, "{err}");
    assert_eq!(heldout(&json), want, "the comparison in pieces differs");
    let metrics = metrics(&out.join("mixed"));
    assert_eq!(
        metrics.iter().map(|m| m.step).collect::<Vec<_>>(),
        (1..=8).collect::<Vec<_>>()
    );
    assert!(metrics.iter().all(|m| m.process_peak_bytes.is_some()));
    // each phase's peak is measured on its own, within the step's
    for m in &metrics {
        let (f, b) = (
            m.forward_peak_bytes.unwrap(),
            m.backward_peak_bytes.unwrap(),
        );
        assert!(f > 0 && b > 0 && f.max(b) <= m.peak_bytes, "{m:?}");
    }
    for d in [once, out] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Under `cargo run` (cargo sets CARGO for what it runs) the printed
/// follow-up command is the cargo one, which a user without an installed
/// binary can paste; otherwise `tinyllm`.
#[test]
fn hints_speak_the_way_the_binary_was_run() {
    let out = tmpdir("hint-cargo");
    let o = Command::new(BIN)
        .args(train_args(&out, 2))
        .env("CARGO", "cargo")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o_s = out.display().to_string();
    assert!(
        stdout.contains(&format!(
            "continue with: cargo run --release -- train --resume {o_s} --steps 4"
        )),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

// ------------------------------------------ the CPU kernels' outputs and threads

/// A kernel's output is allocated without a zero fill and handed out only once
/// the parts its writer handed back written cover it: a gap, or a part from
/// elsewhere, is a panic rather than uninitialised values in a tensor.
#[test]
fn a_cpu_kernel_output_must_be_written_in_full() {
    use tinyllm::backend::cpu::{new_vec, write_exact};
    // parts in any order
    let full = new_vec(8, |out, w| {
        let (a, b) = out.split_at_mut(4);
        w.add(write_exact(b, [2.0f32; 4]));
        w.add(write_exact(a, [1.0; 4]));
    });
    assert_eq!(full, [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]);
    let gap = catch_unwind(|| new_vec(8, |out, w| w.add(write_exact(&mut out[..4], [1.0f32; 4]))));
    assert!(gap.is_err(), "half an output handed out");
    let elsewhere =
        catch_unwind(|| new_vec::<f32>(4, |_, w| w.add(Box::leak(Box::new([0.0f32; 4])))));
    assert!(elsewhere.is_err(), "a part outside the output counted");
}

/// The CPU threads call the caller's closure, which it only borrows: a job
/// whose task panics still waits, before the caller goes on (and the closure
/// and what it borrows go away), for the tasks other threads are running.
#[test]
fn a_cpu_job_waits_for_its_tasks_even_when_one_panics() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tinyllm::backend::cpu::pool;
    for _ in 0..20 {
        let running = AtomicUsize::new(0);
        let values: Vec<usize> = (0..64).collect();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool::run(16, &|i| {
                running.fetch_add(1, Ordering::SeqCst);
                assert!(i != 0, "the first task fails");
                std::thread::sleep(Duration::from_micros(300));
                assert_eq!(values.iter().sum::<usize>(), 63 * 64 / 2);
                running.fetch_sub(1, Ordering::SeqCst);
            })
        }));
        assert!(r.is_err());
        // every task but the failed one left before the caller went on
        assert_eq!(running.load(Ordering::SeqCst), 1);
    }
}

/// `TINYLLM_PIPELINE_CACHE=DIR` keeps the driver's compiled pipelines in one
/// file per adapter in DIR (on Vulkan, which offers it), replaced atomically:
/// a link planted at that name is replaced, never written through.
#[test]
fn the_pipeline_cache_is_one_file_in_the_directory_named() {
    if !tinyllm::testing::gpu_available() || std::env::var("WGPU_BACKEND").is_ok_and(|b| b == "gl")
    {
        return;
    }
    let out = tmpdir("pipeline-cache");
    let (ok, _, err) = run_bin(&strs(&train_args(&out.join("run"), 1)), &[]);
    assert!(ok, "{err}");
    let cache = out.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let generate = || {
        let o = Command::new(BIN)
            .args(["generate", "--device", "gpu", "--len", "4", "--checkpoint"])
            .arg(out.join("run"))
            .env("TINYLLM_PIPELINE_CACHE", &cache)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    generate();
    let files: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let file = &files[0];
    assert!(file
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("wgpu_pipeline_cache_vulkan"));
    assert!(std::fs::symlink_metadata(file).unwrap().is_file());
    // A link where the file goes: replaced, its target untouched.
    let victim = out.join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    std::fs::remove_file(file).unwrap();
    std::os::unix::fs::symlink(&victim, file).unwrap();
    generate();
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    assert!(std::fs::symlink_metadata(file).unwrap().is_file());
    let _ = std::fs::remove_dir_all(&out);
}
