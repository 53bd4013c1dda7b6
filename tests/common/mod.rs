//! Shared test helpers: every test is written once and run on each device.
#![allow(dead_code, unused_macros, unused_imports)]

pub use tinyllm::{Device, Result, Tensor};

/// `device_test!(name, |dev| { ... })` defines `name::cpu` and `name::gpu`.
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
        }
    };
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
/// times, independent of the crate's own `Generator`.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    /// Uniform in `[lo, hi)`.
    pub fn unif(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
    /// A value with a full 24-bit mantissa and moderate magnitude (so products
    /// are inexact: an unfused multiply-add would show).
    pub fn moderate(&mut self) -> f32 {
        let m = (self.next() as u32 & 0x007f_ffff) | 0x3f80_0000; // [1, 2)
        let e = self.below(9) as i32 - 4;
        let s = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
        s * f32::from_bits(m) * 2f32.powi(e)
    }
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
