//! Shared test helpers: every test is written once and run on each device.
#![allow(dead_code, unused_macros, unused_imports)]

pub use tinyllm::{Device, Result, Tensor};

/// `device_test!(name, |dev| { ... })` defines `name::cpu`, `name::gpu` and
/// `name::spec` (the executable spec, a device like the others).
/// The body returns `Result<()>`. The GPU variant skips (with a message) when
/// no adapter exists, and fails instead when `TINYLLM_REQUIRE_GPU=1` (CI).
#[macro_export]
macro_rules! device_test {
    ($name:ident, |$dev:ident| $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn run($dev: tinyllm::Device) -> tinyllm::Result<()> {
                $body
                #[allow(unreachable_code)]
                Ok(())
            }
            #[test]
            fn cpu() {
                run(tinyllm::Device::Cpu).unwrap();
            }
            #[test]
            fn gpu() {
                if tinyllm::testing::gpu_available() {
                    run(tinyllm::Device::Gpu).unwrap();
                }
            }
            #[test]
            fn spec() {
                run(tinyllm::Device::Spec).unwrap();
            }
        }
    };
}

/// In a `#[test]` that needs the GPU: returns early (skips, with a message)
/// without an adapter, fails instead when `TINYLLM_REQUIRE_GPU=1` (CI).
#[macro_export]
macro_rules! require_gpu {
    () => {
        if !tinyllm::testing::gpu_available() {
            return;
        }
    };
}

/// Set in a child process that [`in_child`] starts.
pub const CHILD: &str = "TINYLLM_TEST_CHILD";

/// Runs `body` in a child process: this binary's test `test` again, alone,
/// with `env` set, required to pass; in that child (where [`CHILD`] is set),
/// runs `body` itself. A process has one GPU device, and lavapipe compiles a
/// pipeline on that device's queue thread the first time it runs, so one
/// process's cold compiles queue behind each other; a child's device compiles
/// on another core beside them. The child leaves a pipeline cache file the
/// environment names (`TINYLLM_PIPELINE_CACHE`) to the parent.
pub fn in_child(test: &str, env: &[(&str, &str)], body: impl FnOnce()) {
    if std::env::var_os(CHILD).is_some() {
        return body();
    }
    let t = std::time::Instant::now();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .env_remove("TINYLLM_PIPELINE_CACHE")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "{text}\n{test} in a child process: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    assert!(out.status.success(), "{test} failed in its child process");
    assert!(text.contains("1 passed"), "{test}: the child ran no test");
}

/// Bit patterns, so comparisons are exact (NaN payloads are canonicalised).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter()
        .map(|x| if x.is_nan() { 0x7fc0_0000 } else { x.to_bits() })
        .collect()
}

pub fn t(data: &[f32], shape: &[usize], dev: Device) -> Tensor {
    Tensor::from_vec(data.to_vec(), shape, dev).unwrap()
}

pub fn param(data: &[f32], shape: &[usize], dev: Device) -> Tensor {
    t(data, shape, dev).requires_grad_(true)
}

pub fn vals(x: &Tensor) -> Vec<f32> {
    x.to_vec_f32().unwrap()
}

pub fn grad(x: &Tensor) -> Vec<f32> {
    x.grad().expect("a gradient").to_vec_f32().unwrap()
}

/// Deterministic pseudo-random values in [-scale, scale).
pub fn randv(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    tinyllm::Generator::new(seed)
        .uniform(n)
        .into_iter()
        .map(|u| (2.0 * u - 1.0) * scale)
        .collect()
}

/// The tests' one small PRNG (splitmix64), for test data, fuzzers and kill
/// times: the library's, which the cross-check sweep uses too.
pub use tinyllm::crosscheck::cases::Rng;

/// A `tiny` lockstep of `steps` steps in `precision` (this process's
/// adapter against the CPU), bit-identical; `what` names the setting in the
/// failure message.
pub fn assert_tiny_lockstep(steps: usize, precision: tinyllm::precision::Precision, what: &str) {
    use tinyllm::crosscheck::lockstep::{self, LockstepOptions};
    let o = LockstepOptions {
        preset: "tiny".into(),
        steps,
        precision,
        seed: None,
    };
    let l = lockstep::run(&o, &mut |_| {}).unwrap();
    assert!(
        l.bit_identical(),
        "{what}, {}: {:?}",
        precision.name(),
        l.divergence
    );
}

/// Spawns `program` with `args` and `envs`, stdout discarded and stderr
/// piped; returns the child and its stderr lines as they come (a reader
/// thread), for a test that acts while the process runs (signals, a second
/// process on the same files).
pub fn spawn_reading_stderr<S: AsRef<std::ffi::OsStr>>(
    program: &str,
    args: &[S],
    envs: &[(&str, &str)],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader};
    let mut c = std::process::Command::new(program);
    c.args(args)
        .env_remove("CARGO")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    for (k, v) in envs {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(|l| l.ok()) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// A fresh, empty directory for one test: named after the test binary, the
/// process and `name`, so parallel tests and concurrent runs never share one.
pub fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "tinyllm-{}-{}-{name}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Rewrites a checkpoint's manifest so it matches its files as they are now
/// (to reach the checks behind the checksum).
pub fn rehash(dir: &std::path::Path) {
    let mpath = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    for (name, entry) in m["files"].as_object_mut().unwrap().iter_mut() {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        entry["sha256"] = tinyllm::train::sha256::Sha256::digest_hex(&bytes).into();
        entry["bytes"] = (bytes.len() as u64).into();
    }
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
}
