//! An output directory prepared by someone else: planted links, special
//! files, user files inside checkpoints, copied and swapped checkpoints, a
//! reader racing a writer. Every case runs the real binary (the tiny preset on
//! the CPU) and checks two things: the error names what is wrong, and nothing
//! outside the paths the user named was written or deleted (a "victim" file or
//! checkpoint outside `--out`, compared byte for byte before and after).
#![cfg(unix)]

#[path = "../../tests/common/mod.rs"]
mod common;
use common::{rehash, spawn_reading_stderr, tmpdir};

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tinyllm::train::checkpoint::Verified;
use tinyllm::train::metrics::MetricsLog;
use tinyllm::train::outdir;

/// The binary under test: this build's, or another build's given in
/// `TINYLLM_TEST_BIN` (to show which cases an older build fails).
fn bin_path() -> String {
    std::env::var("TINYLLM_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_tinyllm").into())
}

/// Runs the binary with `args` in `cwd` (the test's own when `None`), killed
/// after 300 s (a hang is a failure); (exit code, stdout, stderr).
fn bin_in(cwd: Option<&Path>, args: &[&str]) -> (i32, String, String) {
    let mut c = Command::new(bin_path());
    c.args(args)
        .env_remove("CARGO")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(d) = cwd {
        c.current_dir(d);
    }
    let mut child = c.spawn().unwrap();
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = r.read_to_end(&mut b);
            String::from_utf8_lossy(&b).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let shown: Vec<String> = args.iter().map(|a| a.chars().take(40).collect()).collect();
            panic!("{shown:?} did not finish within 300 s (it hangs)");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(
        !err.contains("panicked"),
        "{:?} panicked:\n{err}",
        &args[..1]
    );
    (status.code().unwrap_or(-1), out, err)
}

fn bin(args: &[&str]) -> (i32, String, String) {
    bin_in(None, args)
}

const TRAIN: [&str; 10] = [
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
];

/// `train` (tiny, CPU, a checkpoint every step) with `extra` flags.
fn train(extra: &[&str]) -> (i32, String, String) {
    let mut a = TRAIN.to_vec();
    a.extend(["--save-every", "1"]);
    a.extend(extra);
    bin(&a)
}

/// `train --resume DIR --steps N` (the tiny flags above) with `extra` flags.
fn resume(dir: &Path, steps: &str, extra: &[&str]) -> (i32, String, String) {
    let mut a = TRAIN.to_vec();
    a.extend(["--resume", s(dir), "--steps", steps]);
    a.extend(extra);
    bin(&a)
}

fn ok(r: (i32, String, String)) -> String {
    assert_eq!(r.0, 0, "expected success:\n{}", r.2);
    r.2
}

fn refused(r: (i32, String, String), wants: &[&str]) -> String {
    assert_ne!(r.0, 0, "expected a refusal:\n{}", r.2);
    for w in wants {
        assert!(r.2.contains(w), "the error should mention {w:?}:\n{}", r.2);
    }
    r.2
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every file under `dir` (links as links), with its bytes: what must not
/// change.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap()).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_symlink() {
                let to = std::fs::read_link(e.path()).unwrap();
                out.push((e.path(), to.into_os_string().into_encoded_bytes()));
            } else {
                out.push((e.path(), std::fs::read(e.path()).unwrap()));
            }
        }
    }
    out
}

/// A finished 2-step run in `dir` (its checkpoint is a victim's "best model").
fn finished_run(dir: &Path) {
    ok(train(&["--steps", "2", "--out", s(dir)]));
}

fn step_of(dir: &Path) -> usize {
    Verified::open(dir).unwrap().train_state().unwrap().step
}

// ------------------------------------------------------------- 1. the lock

#[test]
fn a_linked_lock_file_is_refused_and_its_target_untouched() {
    let root = tmpdir("lock-link");
    let victim = root.join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    for cmd in ["train", "compare"] {
        let out = root.join(format!("out-{cmd}"));
        // compare locks each side's directory
        let lockdir = if cmd == "train" {
            out.clone()
        } else {
            out.join("fp32")
        };
        std::fs::create_dir_all(&lockdir).unwrap();
        symlink(&victim, lockdir.join(".tinyllm.lock")).unwrap();
        let r = match cmd {
            "train" => train(&["--steps", "2", "--out", s(&out)]),
            _ => bin(&[
                "compare",
                "--preset",
                "tiny",
                "--steps",
                "2",
                "--device",
                "cpu",
                "--plain",
                "--out",
                s(&out),
            ]),
        };
        refused(r, &[".tinyllm.lock", "symbolic link"]);
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "precious",
            "{cmd}"
        );
    }
}

// ------------------------------------------- 2. links under checkpoint names

#[test]
fn checkpoint_links_are_never_deleted_or_written_through() {
    let root = tmpdir("ck-links");
    let best = root.join("models-best");
    finished_run(&best);
    let before = snapshot(&best);
    for name in ["checkpoint", "checkpoint.prev", "checkpoint.next"] {
        let out = root.join(format!("out-{name}"));
        finished_run(&out);
        if name == "checkpoint" {
            std::fs::rename(out.join("checkpoint"), out.join("moved")).unwrap();
        }
        symlink(best.join("checkpoint"), out.join(name)).unwrap();
        refused(
            train(&["--overwrite", "--steps", "2", "--out", s(&out)]),
            &[name, "symbolic link"],
        );
        assert_eq!(snapshot(&best), before, "--overwrite with {name} linked");
        assert_ne!(resume(&out, "4", &[]).0, 0, "--resume with {name} linked");
        assert_eq!(snapshot(&best), before, "--resume with {name} linked");
        assert!(outdir::is_link(&out.join(name)), "the link itself stays");
    }
    // compare: a side's checkpoint, and a whole side, linked elsewhere
    let (cmp1, cmp2) = (root.join("cmp1"), root.join("cmp2"));
    std::fs::create_dir_all(cmp1.join("fp32")).unwrap();
    symlink(best.join("checkpoint"), cmp1.join("fp32/checkpoint")).unwrap();
    std::fs::create_dir_all(&cmp2).unwrap();
    symlink(&best, cmp2.join("mixed")).unwrap();
    for cmp in [&cmp1, &cmp2] {
        for flag in ["--overwrite", "--resume"] {
            let r = bin(&[
                "compare",
                "--preset",
                "tiny",
                "--steps",
                "2",
                "--device",
                "cpu",
                "--plain",
                flag,
                "--out",
                s(cmp),
            ]);
            refused(r, &["symbolic link"]);
            assert_eq!(
                snapshot(&best),
                before,
                "compare {flag} in {}",
                cmp.display()
            );
        }
    }
}

// --------------------------------------------------- 3. temporary names

#[test]
fn temporary_files_never_follow_a_planted_link() {
    let root = tmpdir("tmp-names");
    let victim = root.join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    let out = root.join("out");
    std::fs::create_dir_all(&out).unwrap();
    // The name the writer used to choose (`.NAME.tmp-PID`), planted for this
    // process, and the targets themselves linked.
    let pid = std::process::id();
    for name in ["loss.svg", "metrics.jsonl", "a.txt"] {
        symlink(&victim, out.join(format!(".{name}.tmp-{pid}"))).unwrap();
    }
    outdir::write_atomic(&out, "a.txt", b"new").unwrap();
    assert_eq!(std::fs::read(out.join("a.txt")).unwrap(), b"new");
    assert!(!outdir::is_link(&out.join("a.txt")));
    symlink(&victim, out.join("b.txt")).unwrap();
    outdir::write_atomic(&out, "b.txt", b"new").unwrap();
    assert!(!outdir::is_link(&out.join("b.txt")), "the link is replaced");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    // two temporary names for one file differ
    let (f1, p1) = outdir::create_temp(&out, "c").unwrap();
    let (f2, p2) = outdir::create_temp(&out, "c").unwrap();
    assert_ne!(p1, p2);
    drop((f1, f2));
    // the run's own files linked elsewhere: refused before anything is written
    for name in ["loss.svg", "metrics.jsonl"] {
        let run = root.join(format!("run-{name}"));
        std::fs::create_dir_all(&run).unwrap();
        symlink(&victim, run.join(name)).unwrap();
        refused(
            train(&["--steps", "2", "--out", s(&run)]),
            &[name, "symbolic link"],
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }
}

// ------------------------------------- 4. user files inside a checkpoint

#[test]
fn user_files_inside_a_checkpoint_are_never_deleted() {
    let root = tmpdir("user-files");
    for (i, (file, flags)) in [
        ("NOTES.md", vec!["--resume", "RUN", "--steps", "4"]),
        // (an HF file tinyllm does not write: tokenizer.json is its own now)
        (
            "special_tokens_map.json",
            vec!["--overwrite", "--steps", "2", "--out", "RUN"],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let run = root.join(format!("run{i}"));
        finished_run(&run);
        let note = run.join("checkpoint").join(file);
        std::fs::write(&note, "mine").unwrap();
        let flags: Vec<&str> = flags
            .iter()
            .map(|f| if *f == "RUN" { s(&run) } else { f })
            .collect();
        let mut a = TRAIN.to_vec();
        a.extend(["--save-every", "1"]);
        a.extend(&flags);
        refused(bin(&a), &[file, "did not write"]);
        assert_eq!(std::fs::read_to_string(&note).unwrap(), "mine", "{flags:?}");
        assert_eq!(step_of(&run), 2, "the run is as it was");
    }
    // The library refuses to delete such a directory too, and deletes an
    // untouched one of its own entirely.
    let run = root.join("run0");
    assert!(outdir::remove_ours(&run.join("checkpoint")).is_err());
    std::fs::remove_file(run.join("checkpoint/NOTES.md")).unwrap();
    outdir::remove_ours(&run.join("checkpoint")).unwrap();
    assert!(!run.join("checkpoint").exists());
}

// ---------------------------------------- 5. special files in a checkpoint

#[test]
fn special_files_in_a_checkpoint_are_refused_without_blocking() {
    let root = tmpdir("special");
    // manifest.json a FIFO (no writer: reading it would block forever)
    let run = root.join("fifo");
    finished_run(&run);
    let m = run.join("checkpoint/manifest.json");
    std::fs::remove_file(&m).unwrap();
    let c = std::ffi::CString::new(s(&m)).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    refused(bin(&["eval", "--checkpoint", s(&run)]), &["FIFO"]);
    refused(resume(&run, "4", &[]), &["manifest.json"]);
    // model.safetensors a link to /dev/zero: refused, not read until memory ends
    let run = root.join("zero");
    finished_run(&run);
    let w = run.join("checkpoint/model.safetensors");
    std::fs::remove_file(&w).unwrap();
    symlink("/dev/zero", &w).unwrap();
    refused(
        bin(&["eval", "--checkpoint", s(&run)]),
        &["model.safetensors", "not a regular file"],
    );
    refused(
        bin(&["generate", "--checkpoint", s(&run), "--len", "5"]),
        &["model.safetensors"],
    );
}

// ------------------------------------------- 6. readers racing a writer

#[test]
fn readers_never_call_a_checkpoint_corrupted_while_a_run_saves() {
    let root = tmpdir("race");
    let run = root.join("run");
    finished_run(&run);
    let mut a: Vec<String> = TRAIN.iter().map(|s| s.to_string()).collect();
    a.extend(
        ["--save-every", "1", "--resume", s(&run), "--steps", "400"]
            .iter()
            .map(|s| s.to_string()),
    );
    let mut child = Command::new(bin_path())
        .args(&a)
        .env_remove("CARGO")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (mut reads, mut errors, mut evals) = (0, Vec::new(), 0);
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(40) {
        match Verified::open(&run).and_then(|ck| ck.train_state()) {
            Ok(_) => reads += 1,
            Err(e) => errors.push(e.to_string()),
        }
        if reads % 20 == 0 {
            let (code, _, err) = bin(&["eval", "--checkpoint", s(&run)]);
            evals += 1;
            if code != 0 {
                errors.push(err);
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    eprintln!("{reads} reads and {evals} evals while the run saved");
    assert!(reads > 50, "too few reads overlapped the run ({reads})");
    assert!(
        errors.is_empty(),
        "{} failed: {:?}",
        errors.len(),
        errors.first()
    );
}

// -------------------------------- 7. --overwrite deletes only at the end

#[test]
fn overwrite_deletes_nothing_when_the_new_run_is_refused() {
    let root = tmpdir("overwrite-late");
    let run = root.join("run");
    finished_run(&run);
    let before = snapshot(&run);
    let capstone = |extra: &[&str]| {
        let mut a = vec![
            "train",
            "--preset",
            "capstone",
            "--device",
            "cpu",
            "--plain",
            "--overwrite",
            "--steps",
            "2",
            "--out",
            s(&run),
        ];
        a.extend(extra);
        bin(&a)
    };
    // refused by the memory admission (a micro-batch no machine holds)
    refused(
        capstone(&["--batch", "4096", "--micro-batch", "4096"]),
        &["does not fit in memory"],
    );
    // refused when the data is too short for the model's context
    let short = root.join("short.txt");
    std::fs::write(&short, "too short for a context of 512").unwrap();
    let r = capstone(&["--data", s(&short)]);
    assert_ne!(r.0, 0, "{}", r.2);
    let after: Vec<_> = snapshot(&run)
        .into_iter()
        .filter(|(p, _)| !p.ends_with(".tinyllm.lock"))
        .collect();
    let before: Vec<_> = before
        .into_iter()
        .filter(|(p, _)| !p.ends_with(".tinyllm.lock"))
        .collect();
    assert_eq!(after, before, "the old run is intact");
}

// ------------------------ 8. a snapshot never replaces the run it came from

#[test]
fn resuming_a_kept_copy_never_replaces_the_newer_run() {
    let root = tmpdir("snapshot");
    let run = root.join("run");
    ok(train(&["--steps", "4", "--out", s(&run)]));
    let keep = run.join("keep-step4");
    std::fs::create_dir(&keep).unwrap();
    for e in std::fs::read_dir(run.join("checkpoint")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), keep.join(e.file_name())).unwrap();
    }
    let resume = |dir: &Path, steps: &str, out: Option<&Path>| {
        let mut a = TRAIN.to_vec();
        a.extend(["--save-every", "1", "--resume", s(dir), "--steps", steps]);
        if let Some(o) = out {
            a.extend(["--out", s(o)]);
        }
        bin(&a)
    };
    ok(resume(&run, "8", None));
    refused(
        resume(&keep, "6", None),
        &["is not its current checkpoint", "--out NEW_DIR"],
    );
    assert_eq!(step_of(&run), 8);
    assert_eq!(
        MetricsLog::read(&run.join("metrics.jsonl")).unwrap().len(),
        8
    );
    // as a new run in its own directory it continues, under a new run id
    let branch = root.join("branch");
    ok(resume(&keep, "6", Some(&branch)));
    assert_eq!(step_of(&branch), 6);
    let id = |d: &Path| Verified::open(d).unwrap().train_state().unwrap().run_id;
    assert!(!id(&run).is_empty());
    assert_ne!(id(&run), id(&branch));
    assert_eq!(step_of(&run), 8, "the original run is untouched");
}

// --------------------------------------------- 9. --out inside a checkpoint

#[test]
fn an_out_inside_a_checkpoint_is_refused() {
    let root = tmpdir("out-in-ck");
    let run = root.join("run");
    finished_run(&run);
    let before = snapshot(&run.join("checkpoint"));
    for out in ["checkpoint", "checkpoint/sub", "checkpoint.next"] {
        let o = run.join(out);
        refused(
            train(&["--steps", "2", "--out", s(&o)]),
            &["inside the checkpoint"],
        );
        let cmp = bin(&[
            "compare",
            "--preset",
            "tiny",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--plain",
            "--out",
            s(&o),
        ]);
        refused(cmp, &["inside the checkpoint"]);
    }
    assert_eq!(snapshot(&run.join("checkpoint")), before);
    assert!(!run.join("checkpoint.next").exists());
    ok(resume(&run, "3", &[]));
}

// ------------------------------------------ 10. compare --resume's recipe

fn compare_args<'a>(out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "compare",
        "--preset",
        "tiny",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--plain",
        "--out",
        s(out),
    ];
    a.extend(extra);
    a
}

#[test]
fn compare_resume_keeps_each_sides_recipe() {
    let root = tmpdir("compare-recipe");
    let out = root.join("cmp");
    ok(bin(&compare_args(
        &out,
        &["--side", "fp32", "--seed", "1337", "--lr", "0.01"],
    )));
    let err = refused(
        bin(&compare_args(
            &out,
            &["--side", "mixed", "--resume", "--seed", "7", "--lr", "0.05"],
        )),
        &["fp32"],
    );
    assert!(err.contains("--lr") || err.contains("--seed"), "{err}");
    assert!(!out.join("mixed/checkpoint").exists(), "nothing trained");
    // the same call without the changed values continues with the saved recipe
    ok(bin(&compare_args(
        &out,
        &[
            "--side", "mixed", "--resume", "--seed", "1337", "--lr", "0.01",
        ],
    )));
    let st = |side: &str| {
        Verified::open(&out.join(side))
            .unwrap()
            .train_state()
            .unwrap()
            .config
    };
    assert_eq!((st("mixed").seed, st("mixed").lr), (1337, 0.01));
    assert_eq!((st("fp32").seed, st("fp32").lr), (1337, 0.01));
}

/// Spawns the binary (stderr piped, read line by line).
fn spawn(
    args: &[&str],
    envs: &[(&str, &str)],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    spawn_reading_stderr(&bin_path(), args, envs)
}

/// Waits for the `await-signal` fault's pause line, sends `sig`, returns the
/// exit code and the rest of stderr.
fn signal_at_pause(
    mut child: std::process::Child,
    rx: std::sync::mpsc::Receiver<String>,
    sig: i32,
) -> (i32, String) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .expect("never paused");
        if rx
            .recv_timeout(left)
            .expect("never paused")
            .starts_with("TINYLLM_FAULT_PAUSED")
        {
            break;
        }
    }
    // SAFETY: kill(2) takes plain integers; the child is ours and not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
    let st = child.wait().unwrap();
    // The reader thread may still hold the last lines: read to the pipe's end.
    let rest: Vec<String> = rx.iter().collect();
    (st.code().unwrap_or(-1), rest.join("\n"))
}

#[test]
fn an_interrupted_compare_exits_as_train_does() {
    let root = tmpdir("compare-signal");
    let out = root.join("cmp");
    let a = compare_args(&out, &["--side", "fp32"]);
    let (child, rx) = spawn(&a, &[("TINYLLM_FAULT", "await-signal@2")]);
    let (code, err) = signal_at_pause(child, rx, libc::SIGTERM);
    assert_eq!(code, 128 + libc::SIGTERM, "{err}");
    assert!(err.contains("--resume"), "{err}");
    assert_eq!(step_of(&out.join("fp32")), 2);
}

// ---------------------------------------------- 11. relative --resume

#[test]
fn a_relative_resume_from_inside_the_run_works() {
    let root = tmpdir("relative");
    let run = root.join("run");
    finished_run(&run);
    let mut a = TRAIN.to_vec();
    a.extend(["--resume", "checkpoint", "--steps", "3"]);
    ok(bin_in(Some(&run), &a));
    assert_eq!(step_of(&run), 3);
    a.truncate(TRAIN.len());
    a.extend(["--resume", ".", "--steps", "4"]);
    ok(bin_in(Some(&run), &a));
    assert_eq!(step_of(&run), 4);
}

// ------------------------------ 12. eval and generate admit their memory

#[test]
fn eval_and_generate_refuse_a_context_that_cannot_fit() {
    let root = tmpdir("admit");
    let run = root.join("run");
    finished_run(&run);
    let ck = run.join("checkpoint");
    let cpath = ck.join("config.json");
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&cpath).unwrap()).unwrap();
    c["max_position_embeddings"] = 65536.into();
    std::fs::write(&cpath, serde_json::to_vec(&c).unwrap()).unwrap();
    rehash(&ck);
    let text = root.join("long.txt");
    std::fs::write(&text, "to be or not to be ".repeat(12_000)).unwrap();
    refused(
        bin(&["eval", "--checkpoint", s(&run), "--data", s(&text)]),
        &["eval", "65536", "cannot run"],
    );
    let prompt = "a".repeat(70_000);
    refused(
        bin(&[
            "generate",
            "--checkpoint",
            s(&run),
            "--prompt",
            &prompt,
            "--len",
            "3",
        ]),
        &["generate", "65536", "cannot run"],
    );
}

// --------------------------------------------------------- 13. SIGHUP

#[test]
fn sighup_saves_the_run_like_sigterm() {
    let root = tmpdir("sighup");
    let out = root.join("run");
    let mut a = TRAIN.to_vec();
    a.extend(["--steps", "5", "--out", s(&out)]);
    let (child, rx) = spawn(&a, &[("TINYLLM_FAULT", "await-signal@3")]);
    let (code, err) = signal_at_pause(child, rx, libc::SIGHUP);
    assert_eq!(code, 128 + libc::SIGHUP, "{err}");
    assert!(err.contains("SIGHUP"), "{err}");
    assert_eq!(step_of(&out), 3);
}

// ------------------------------------------------ 14. restored ranges

#[test]
fn restored_counters_and_sizes_are_range_checked() {
    let root = tmpdir("ranges");
    let run = root.join("run");
    finished_run(&run);
    let ck = run.join("checkpoint");
    let spath = ck.join("trainer_state.json");
    let orig = std::fs::read(&spath).unwrap();
    for bad in [u64::from(u32::MAX >> 1), u64::MAX] {
        let mut st: serde_json::Value = serde_json::from_slice(&orig).unwrap();
        st["adam_steps"][0] = bad.into();
        std::fs::write(&spath, serde_json::to_vec(&st).unwrap()).unwrap();
        rehash(&ck);
        refused(
            resume(&run, "4", &[]),
            &["trainer_state.json", "adam_steps[0]"],
        );
    }
    std::fs::write(&spath, &orig).unwrap();
    rehash(&ck);
    let cpath = ck.join("config.json");
    let corig = std::fs::read(&cpath).unwrap();
    let mut c: serde_json::Value = serde_json::from_slice(&corig).unwrap();
    c["vocab_size"] = 300.into();
    std::fs::write(&cpath, serde_json::to_vec(&c).unwrap()).unwrap();
    rehash(&ck);
    refused(
        bin(&["eval", "--checkpoint", s(&run)]),
        &["config.json", "vocab_size 300"],
    );
    refused(
        bin(&["generate", "--checkpoint", s(&run), "--len", "3"]),
        &["vocab_size 300"],
    );
    std::fs::write(&cpath, &corig).unwrap();
    rehash(&ck);
    let huge = u64::MAX.to_string();
    refused(
        train(&["--steps", &huge, "--out", s(&root.join("huge"))]),
        &["--steps"],
    );
    refused(resume(&run, &huge, &[]), &["--steps"]);
    assert_eq!(step_of(&run), 2);
}

// ------------------------------------------------------------------ also

#[test]
fn a_missing_scaler_moved_data_and_swapped_runs_are_named() {
    let root = tmpdir("also");
    // an fp16 state without its scaler entry
    let run = root.join("fp16");
    ok(train(&["--fp16", "--steps", "2", "--out", s(&run)]));
    let ck = run.join("checkpoint");
    let spath = ck.join("trainer_state.json");
    let mut st: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spath).unwrap()).unwrap();
    st.as_object_mut().unwrap().remove("scaler");
    std::fs::write(&spath, serde_json::to_vec(&st).unwrap()).unwrap();
    rehash(&ck);
    refused(resume(&run, "4", &[]), &["no \"scaler\" entry"]);

    // the corpus moved after the run
    let text = root.join("text.txt");
    std::fs::write(
        &text,
        "All the world's a stage, and all the men and women merely players. ".repeat(40),
    )
    .unwrap();
    let run = root.join("data");
    ok(train(&[
        "--steps",
        "2",
        "--data",
        s(&text),
        "--out",
        s(&run),
    ]));
    let moved = root.join("moved.txt");
    std::fs::rename(&text, &moved).unwrap();
    refused(resume(&run, "3", &[]), &["give --data with its new path"]);
    ok(resume(&run, "3", &["--data", s(&moved)]));

    // a checkpoint swapped in from another run
    let (a_run, b_run) = (root.join("a"), root.join("b"));
    ok(train(&["--steps", "2", "--seed", "1", "--out", s(&a_run)]));
    ok(train(&["--steps", "3", "--seed", "2", "--out", s(&b_run)]));
    std::fs::rename(a_run.join("checkpoint"), root.join("a-checkpoint")).unwrap();
    std::fs::rename(b_run.join("checkpoint"), a_run.join("checkpoint")).unwrap();
    refused(resume(&a_run, "5", &[]), &["another run"]);
    let other = root.join("continued");
    ok(resume(&a_run, "5", &["--out", s(&other)]));
    assert_eq!(step_of(&other), 5);
}
