//! Which of a family's two kernel variants a launcher records: the same
//! contract, the same bits, shaped for two kinds of device.
//!
//! * [`Kernels::Software`]: barrier-free register tiles and one invocation
//!   per row. A CPU running the shader (Mesa's lavapipe) pays for every
//!   barrier and workgroup-memory access, and runs 8 invocations as one
//!   vector, so it wants many independent lanes and few loads per
//!   arithmetic operation.
//! * [`Kernels::Hardware`]: operand tiles staged in workgroup memory with
//!   coalesced loads, a workgroup per row block, at least
//!   [`MIN_LANES`] invocations per workgroup — what a GPU wants.
//!
//! The adapter picks: a CPU adapter gets `Software`, every other `Hardware`.
//! `TINYLLM_GPU_KERNELS=software` or `=hardware` overrides that for the
//! process, and [`with_kernels`] for the calls made inside it on this thread
//! (the parity suite runs each family's sweep with both, so lavapipe holds
//! both variants to the spec).

use super::context::Context;
use std::cell::Cell;

/// A family's kernel variant (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    Software,
    Hardware,
}

/// Invocations of every `Hardware` workgroup at least (the dispatch-geometry
/// test holds the launchers to it at the capstone's shapes).
#[cfg(any(test, feature = "test-hooks"))]
pub const MIN_LANES: u32 = 64;

thread_local! {
    static FORCED: Cell<Option<Kernels>> = const { Cell::new(None) };
}

impl Kernels {
    /// The variant the launchers of this thread record on `c`'s adapter.
    pub fn of(c: &Context) -> Kernels {
        if let Some(k) = FORCED.with(Cell::get) {
            return k;
        }
        match std::env::var("TINYLLM_GPU_KERNELS").as_deref() {
            Ok("software") => Kernels::Software,
            Ok("hardware") => Kernels::Hardware,
            _ if c.info.device_type == wgpu::DeviceType::Cpu => Kernels::Software,
            _ => Kernels::Hardware,
        }
    }
    /// `software` or `hardware`, as `TINYLLM_GPU_KERNELS` spells it.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Software => "software",
            Kernels::Hardware => "hardware",
        }
    }
}

/// Runs `f` with this thread's launchers recording the `k` variant (whatever
/// the adapter); the previous choice comes back afterwards, even on a panic.
#[cfg(any(test, feature = "test-hooks"))]
pub fn with_kernels<R>(k: Kernels, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Kernels>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|c| c.replace(Some(k))));
    f()
}
