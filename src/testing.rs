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

/// Arms the test-only GPU fault on this thread until the guard drops: every
/// GPU call of `primitive` (as the profile names it) gets the lowest bit of
/// output element `element` flipped, one ulp (see `backend::fault`).
pub fn gpu_fault(primitive: &str, element: usize) -> crate::backend::fault::Armed {
    crate::backend::fault::arm(Some(crate::backend::fault::Fault {
        primitive: primitive.to_string(),
        element,
    }))
}

thread_local! {
    static SAVED_FLOAT32: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, autograd keeps every saved tensor in float32 on this thread.
pub struct SavedFloat32 {
    prev: bool,
}

impl Drop for SavedFloat32 {
    fn drop(&mut self) {
        SAVED_FLOAT32.with(|w| w.set(self.prev));
    }
}

/// Keeps every tensor autograd saves in float32 on this thread until the
/// guard drops: the reference that 16-bit saved activations must match bit
/// for bit.
pub fn saved_in_float32() -> SavedFloat32 {
    SavedFloat32 {
        prev: SAVED_FLOAT32.with(|w| w.replace(true)),
    }
}

/// Whether [`saved_in_float32`] is in force on this thread.
pub(crate) fn saved_float32_only() -> bool {
    SAVED_FLOAT32.with(std::cell::Cell::get)
}
