//! Which build, on which machine, produced a run: recorded in the first
//! metrics line of every process of the run and appended to the checkpoint's
//! list at every start and resume, so a run stitched across builds and
//! devices says so.

use serde::{Deserialize, Serialize};

/// One process's build and device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// The crate's version.
    pub version: String,
    /// The git commit built from (`None`: not built from a git checkout).
    pub commit: Option<String>,
    /// Whether tracked files differed from that commit.
    pub dirty: bool,
    /// A fingerprint of the sources that decide a run's bits (kernels,
    /// shaders, ops, model, optimizer, precision, the step and the batches):
    /// two builds with the same one give the same bits. `None` in records
    /// written before it existed.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub numerics: Option<String>,
    /// The CPU kernels' instruction set (`portable`, `avx2+fma`, …).
    pub cpu_kernels: String,
    /// The CPU kernels' threads.
    pub threads: usize,
    /// `cpu` or `gpu`.
    pub device: String,
    /// The GPU adapter, on the GPU.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub adapter: Option<String>,
}

impl Provenance {
    /// This process, running on `device`.
    pub fn here(device: crate::Device) -> Provenance {
        let gpu = device == crate::Device::Gpu;
        Provenance {
            version: env!("CARGO_PKG_VERSION").into(),
            commit: option_env!("TINYLLM_GIT_COMMIT").map(Into::into),
            dirty: option_env!("TINYLLM_GIT_DIRTY") == Some("true"),
            numerics: Some(env!("TINYLLM_NUMERICS").into()),
            cpu_kernels: crate::backend::cpu::simd::level().name().into(),
            threads: crate::backend::cpu::cpu_threads(),
            device: if gpu { "gpu" } else { "cpu" }.into(),
            adapter: gpu.then(|| crate::backend::adapter_name().ok()).flatten(),
        }
    }
}
