//! Helpers for tests that run once per device.

/// Whether a GPU adapter is available for tests. With `TINYLLM_REQUIRE_GPU=1`
/// (as CI sets it) a missing adapter is a test failure, never a silent skip.
pub fn gpu_available() -> bool {
    match crate::gpu::adapter_name() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("TINYLLM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("TINYLLM_REQUIRE_GPU=1 but no GPU adapter is available: {e}");
            }
            eprintln!("no GPU adapter ({e}); skipping the GPU variant");
            false
        }
    }
}

/// Arms the test-only GPU perturbation on this thread until the guard drops: every
/// GPU call of `primitive` (as the profile names it) gets the lowest bit of
/// output element `element` flipped, one ulp (see `backend::perturb`).
pub fn gpu_perturb(primitive: &str, element: usize) -> crate::backend::perturb::Armed {
    crate::backend::perturb::arm(Some(crate::backend::perturb::Perturbation {
        primitive: primitive.to_string(),
        element,
    }))
}

pub use crate::tensor::saved::{saved_in_float32, SavedFloat32};
