//! The autocast state: which 16-bit format, if any, every matmul on this
//! thread rounds its operands and output to. It lives here, below the ops that
//! read it; [`precision`](crate::precision) builds the user-facing scope on it.

use crate::backend::round::Format;
use std::cell::Cell;

thread_local! {
    static AUTOCAST: Cell<Option<Format>> = const { Cell::new(None) };
}

/// The format every matmul on this thread rounds to right now, if any.
pub fn autocast_dtype() -> Option<Format> {
    AUTOCAST.with(Cell::get)
}

/// While alive, every matmul on this thread (`Tensor::matmul`, `Linear`,
/// attention; CPU and GPU) computes `cast(cast(a) @ cast(b))` with f32
/// accumulation. Dropping it restores the enclosing state — also while
/// unwinding from a panic — so guards nest and the innermost format applies.
#[must_use = "autocast ends when the guard is dropped"]
pub struct AutocastGuard {
    prev: Option<Format>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.prev));
    }
}

/// Enters an autocast scope with `fmt` (or, with `None`, a float32 scope that
/// switches an enclosing autocast off). The scope lasts as long as the
/// returned [`AutocastGuard`]; it covers this thread only.
///
/// ```
/// use tinyllm::precision::{autocast, cast};
/// use tinyllm::{Device, Format, Tensor};
/// let a = Tensor::from_vec(vec![1.001, 2.0, -3.3, 0.7], &[2, 2], Device::Cpu)?;
/// let b = Tensor::from_vec(vec![0.3, 5.5, -1.1, 0.01], &[2, 2], Device::Cpu)?;
/// let bf = |t: &Tensor| cast(t, Format::Bf16);
/// // what a bf16 matmul means: cast(cast(a) @ cast(b)), accumulated in f32
/// let want = bf(&bf(&a)?.matmul(&bf(&b)?)?)?;
/// let got = {
///     let _bf16 = autocast(Format::Bf16);
///     a.matmul(&b)?
/// };
/// assert_eq!(got.to_vec_f32()?, want.to_vec_f32()?);
/// // outside the scope, matmuls are float32 again
/// assert_ne!(a.matmul(&b)?.to_vec_f32()?, want.to_vec_f32()?);
/// # Ok::<(), tinyllm::Error>(())
/// ```
pub fn autocast(fmt: impl Into<Option<Format>>) -> AutocastGuard {
    let prev = AUTOCAST.with(|a| a.replace(fmt.into()));
    AutocastGuard { prev }
}
