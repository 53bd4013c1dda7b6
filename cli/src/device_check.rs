//! `tinyllm device-check`: everything a new GPU should be asked, in one
//! JSON report — the cross-check on every backend the machine offers, the
//! kernel benchmarks, and a few steps of the capstone recipe with `--profile`
//! on the GPU and on the CPU. Each part runs as a child process of this
//! binary (the GPU backend is chosen once per process), with a time limit,
//! and a part that fails is recorded as such: the report is always written.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The backends asked, in this order (one device may answer through two).
const BACKENDS: [&str; 4] = ["vulkan", "metal", "dx12", "gl"];

pub struct Plan {
    pub out: PathBuf,
    pub preset: String,
    pub steps: usize,
    pub backends: Vec<String>,
    pub limit: Duration,
}

/// What one child process did.
struct Ran {
    code: Option<i32>,
    seconds: f64,
    stdout: String,
    stderr: String,
    timed_out: bool,
}

impl Ran {
    fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "exit_code": self.code,
            "seconds": (self.seconds * 10.0).round() / 10.0,
            "timed_out": self.timed_out,
        })
    }
    /// The last lines of stderr: why a part failed.
    fn tail(&self) -> String {
        let lines: Vec<&str> = self.stderr.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }
}

/// Runs this binary with `args`, killed after `limit`.
fn run_self(args: &[String], limit: Duration) -> std::io::Result<Ran> {
    let exe = std::env::current_exe()?;
    let t = Instant::now();
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Drain both pipes while waiting, so a chatty child never blocks.
    let mut so = child.stdout.take().expect("piped");
    let mut se = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            timed_out = true;
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Ok(Ran {
        code: status.code(),
        seconds: t.elapsed().as_secs_f64(),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        timed_out,
    })
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A part whose stdout is one JSON object: that object with the run's summary.
fn json_part(args: &[String], limit: Duration, say: &dyn Fn(&str)) -> serde_json::Value {
    say(&format!("tinyllm {}", args.join(" ")));
    match run_self(args, limit) {
        Ok(r) => {
            let parsed: Option<serde_json::Value> = serde_json::from_str(r.stdout.trim()).ok();
            let mut v = r.summary();
            v["report"] = parsed.unwrap_or(serde_json::Value::Null);
            if r.code != Some(0) {
                v["stderr_tail"] = r.tail().into();
            }
            say(&format!("  exit {:?} after {:.0} s", r.code, r.seconds));
            v
        }
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    }
}

/// A training part: its printed output (plan, progress, profile) as text.
fn text_part(args: &[String], limit: Duration, say: &dyn Fn(&str)) -> serde_json::Value {
    say(&format!("tinyllm {}", args.join(" ")));
    match run_self(args, limit) {
        Ok(r) => {
            let mut v = r.summary();
            v["stdout"] = r.stdout.clone().into();
            v["stderr_tail"] = r.tail().into();
            say(&format!("  exit {:?} after {:.0} s", r.code, r.seconds));
            v
        }
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    }
}

/// Runs every part and writes `report.json` into `plan.out` (which must not
/// exist yet). Returns the report's path.
pub fn run(plan: &Plan, say: &dyn Fn(&str)) -> tinyllm::Result<PathBuf> {
    let out = &plan.out;
    if out.symlink_metadata().is_ok() {
        tinyllm::bail!(
            Config,
            "{} already exists: device-check writes a new directory; give another --out",
            out.display()
        );
    }
    std::fs::create_dir_all(out)
        .map_err(|e| tinyllm::Error::io(format!("creating {}", out.display()), e))?;
    let limit = plan.limit;
    let mut crosscheck = serde_json::Map::new();
    for b in &plan.backends {
        let steps = plan.steps.to_string();
        let args = strs(&["crosscheck", "--json", "--steps", &steps, "--backend", b]);
        crosscheck.insert(b.clone(), json_part(&args, limit, say));
    }
    let bench = json_part(&strs(&["bench", "--json"]), limit, say);
    let steps = plan.steps.to_string();
    let recipe = |device: &str, dir: &Path| {
        let mut a = strs(&[
            "train",
            "--preset",
            &plan.preset,
            "--bf16",
            "--micro-batch",
            "8",
            "--accum",
            "4",
            "--checkpoint-activations",
            "--steps",
            &steps,
            "--profile",
            "--sample-len",
            "0",
            "--device",
            device,
            "--out",
        ]);
        a.push(dir.display().to_string());
        a
    };
    let mut profile = serde_json::Map::new();
    for device in ["gpu", "cpu"] {
        let args = recipe(device, &out.join(format!("run-{device}")));
        profile.insert(device.into(), text_part(&args, limit, say));
    }
    let report = serde_json::json!({
        "tinyllm": env!("CARGO_PKG_VERSION"),
        "recipe": format!("--preset {} --bf16 --micro-batch 8 --accum 4 --checkpoint-activations --steps {}", plan.preset, plan.steps),
        "crosscheck": crosscheck,
        "bench": bench,
        "profile": profile,
    });
    let text = serde_json::to_string_pretty(&report).expect("a JSON value serialises");
    tinyllm::train::checkpoint::write_atomic(out, "report.json", text.as_bytes())?;
    Ok(out.join("report.json"))
}

/// The backends named by `--backends` (comma-separated), or all of them.
pub fn backends(arg: Option<&str>) -> tinyllm::Result<Vec<String>> {
    let Some(a) = arg else {
        return Ok(strs(&BACKENDS));
    };
    let v: Vec<String> = a.split(',').map(|s| s.trim().to_string()).collect();
    for b in &v {
        if !BACKENDS.contains(&b.as_str()) {
            tinyllm::bail!(
                Config,
                "--backends: unknown backend {b:?} (vulkan, metal, dx12 or gl)"
            );
        }
    }
    Ok(v)
}
