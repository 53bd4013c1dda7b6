//! A 512³ f32 product on `Device::Cpu` through the public API: the figure a
//! crate that depends on tinyllm gets (the CPU kernel is chosen at run time, so
//! it needs no target features of its own).
//!
//! ```text
//! cargo run --release --example matmul_512
//! ```
//! Prints the kernel path, the median of 21 products and the GFLOP/s.

use std::time::Instant;
use tinyllm::{cpu_kernel_path, Device, Generator, Result, Tensor};

fn main() -> Result<()> {
    let n = 512;
    let gen = Generator::new(0);
    let a = Tensor::randn(&[n, n], 1.0, &gen, Device::Cpu)?;
    let b = Tensor::randn(&[n, n], 1.0, &gen, Device::Cpu)?;
    let checksum: f64 = a.matmul(&b)?.to_vec_f64()?.iter().sum();
    let mut times: Vec<f64> = (0..21)
        .map(|_| {
            let t = Instant::now();
            drop(a.matmul(&b));
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let gflops = 2.0 * (n as f64).powi(3) / median / 1e9;
    println!(
        "512³ f32 matmul on {}: median {:.2} ms, {gflops:.1} GFLOP/s (checksum {checksum:.6e})",
        cpu_kernel_path(),
        median * 1e3
    );
    Ok(())
}
