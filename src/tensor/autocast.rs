//! The autocast state: which 16-bit format, if any, every matmul on this
//! thread rounds its operands and output to. It lives here, below the ops that
//! read it; [`precision`](crate::precision) builds the user-facing scope on it.
//!
//! The state is a stack of the live scopes, innermost last; the innermost
//! one's format applies. A guard removes its own scope, wherever it sits, so
//! guards dropped out of order (the outer one first, say by moving it into a
//! `drop` call) still leave, once all are gone, autocast as it was before them.

use crate::backend::round::Format;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

thread_local! {
    /// The innermost live scope's format: what every matmul reads.
    static AUTOCAST: Cell<Option<Format>> = const { Cell::new(None) };
    /// The live scopes, innermost last: (the guard's id, its format).
    static SCOPES: RefCell<Vec<(u64, Option<Format>)>> = const { RefCell::new(Vec::new()) };
    /// The next guard's id.
    static NEXT_ID: Cell<u64> = const { Cell::new(0) };
}

/// The format every matmul on this thread rounds to right now, if any.
pub fn autocast_dtype() -> Option<Format> {
    AUTOCAST.with(Cell::get)
}

/// While alive, every matmul on this thread (`Tensor::matmul`, `Linear`,
/// attention; CPU and GPU) computes `cast(cast(a) @ cast(b))` with f32
/// accumulation. Dropping it ends its own scope — also while unwinding from a
/// panic, and also when an enclosing guard was dropped first — so guards nest
/// and the innermost live format applies. It stays on the thread that made it
/// (not `Send`): the state it changes is that thread's.
#[must_use = "autocast ends when the guard is dropped: bind it to a named variable, or use autocast_scope"]
pub struct AutocastGuard {
    id: u64,
    _this_thread: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        SCOPES.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(i) = s.iter().rposition(|&(id, _)| id == self.id) {
                s.remove(i);
            }
            AUTOCAST.with(|a| a.set(s.last().and_then(|&(_, f)| f)));
        });
    }
}

/// Enters an autocast scope with `fmt` (or, with `None`, a float32 scope that
/// switches an enclosing autocast off). The scope lasts as long as the
/// returned [`AutocastGuard`]; it covers this thread only. Bind the guard to a
/// named variable (`let _bf16 = …`): `let _ = autocast(…)` drops it at once,
/// an empty scope. [`autocast_scope`] takes the work as a closure instead and
/// cannot be misused that way.
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
///
/// A guard left unused is a warning (an error where `unused_must_use` is
/// denied), and `let _ = autocast(…)` is rejected where the
/// `let_underscore_drop` lint is denied:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// tinyllm::precision::autocast(tinyllm::Format::Bf16); // the scope ends here
/// ```
///
/// ```compile_fail
/// #![deny(let_underscore_drop)]
/// let _ = tinyllm::precision::autocast(tinyllm::Format::Bf16); // so does this one
/// ```
#[must_use = "autocast ends when the guard is dropped: bind it to a named variable, or use autocast_scope"]
pub fn autocast(fmt: impl Into<Option<Format>>) -> AutocastGuard {
    let fmt = fmt.into();
    let id = NEXT_ID.with(|n| n.replace(n.get() + 1));
    SCOPES.with(|s| s.borrow_mut().push((id, fmt)));
    AUTOCAST.with(|a| a.set(fmt));
    AutocastGuard {
        id,
        _this_thread: PhantomData,
    }
}

/// Runs `f` in an autocast scope with `fmt` (or, with `None`, in float32) and
/// returns its result: [`autocast`] with the scope's extent written as a
/// closure, so it cannot end early. The enclosing state is back when `f`
/// returns or panics.
///
/// ```
/// use tinyllm::precision::{autocast_dtype, autocast_scope};
/// use tinyllm::Format;
/// let inside = autocast_scope(Format::Bf16, autocast_dtype);
/// assert_eq!(inside, Some(Format::Bf16));
/// assert_eq!(autocast_dtype(), None);
/// ```
pub fn autocast_scope<R>(fmt: impl Into<Option<Format>>, f: impl FnOnce() -> R) -> R {
    let _scope = autocast(fmt);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards dropped outer first: the inner format holds while the inner
    /// guard lives, and nothing is left switched on once both are gone.
    #[test]
    fn guards_dropped_out_of_order_leave_nothing_on() {
        assert_eq!(autocast_dtype(), None);
        let outer = autocast(Format::Bf16);
        let inner = autocast(Format::Fp16);
        drop(outer);
        assert_eq!(
            autocast_dtype(),
            Some(Format::Fp16),
            "the inner scope is still live"
        );
        drop(inner);
        assert_eq!(autocast_dtype(), None, "a format left switched on");

        // Three deep, the middle one first: the others keep their order.
        let a = autocast(Format::Bf16);
        let b = autocast(None);
        let c = autocast(Format::Fp16);
        drop(b);
        assert_eq!(autocast_dtype(), Some(Format::Fp16));
        drop(c);
        assert_eq!(
            autocast_dtype(),
            Some(Format::Bf16),
            "back to the outermost"
        );
        drop(a);
        assert_eq!(autocast_dtype(), None);
    }

    /// The closure form applies its format inside, nests, returns the
    /// closure's value and restores the state, also after a panic.
    #[test]
    fn autocast_scope_covers_exactly_its_closure() {
        let seen = autocast_scope(Format::Bf16, || {
            let inner = autocast_scope(Format::Fp16, autocast_dtype);
            let off = autocast_scope(None, autocast_dtype);
            (autocast_dtype(), inner, off)
        });
        assert_eq!(seen, (Some(Format::Bf16), Some(Format::Fp16), None));
        assert_eq!(autocast_dtype(), None);
        let r = std::panic::catch_unwind(|| {
            autocast_scope(Format::Fp16, || {
                panic!("intentional panic inside autocast_scope")
            })
        });
        assert!(r.is_err());
        assert_eq!(autocast_dtype(), None);
    }
}
