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
