//! Test-only (compiled with the `test-hooks` feature alone): one GPU
//! primitive's output perturbed by one ulp in one element, so the tests can
//! show that the cross-check's sweep and its lockstep trace find a real
//! difference and name the primitive and the call. A build without the
//! feature (the release binary) has no hook at all.
//!
//! Armed per thread by [`arm`] (the tests' in-process runs), or for the whole
//! process by `TINYLLM_GPU_PERTURB=PRIMITIVE[#ELEMENT]` (the tests that run the
//! binary): every GPU call of the primitive named as the profile names it
//! (`softmax`, `unary silu`, `matmul`, `adamw`, …) gets the lowest bit of
//! output element `ELEMENT` (default 0, clamped to the output) flipped: the
//! next or the previous float, one ulp away. The first output buffer is the
//! one perturbed (a parameter for the in-place optimizer kernels); a
//! primitive whose result is a host value (the sum of squares) has that
//! value perturbed.

use super::{Device, Storage};
use crate::Result;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Which primitive, and which element of its output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Perturbation {
    pub primitive: String,
    pub element: usize,
}

impl std::str::FromStr for Perturbation {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Perturbation> {
        let (name, element) = match s.rsplit_once('#') {
            Some((n, e)) => (
                n,
                e.trim().parse().map_err(|_| {
                    crate::Error::config(format!("TINYLLM_GPU_PERTURB={s:?}: {e:?} is not an element index"))
                })?,
            ),
            None => (s, 0),
        };
        Ok(Perturbation {
            primitive: name.trim().to_string(),
            element,
        })
    }
}

thread_local! {
    /// `Some`: this thread's setting, over the environment's.
    static ARMED: RefCell<Option<Option<Perturbation>>> = const { RefCell::new(None) };
}

fn from_env() -> Option<&'static Perturbation> {
    static F: OnceLock<Option<Perturbation>> = OnceLock::new();
    F.get_or_init(|| {
        std::env::var("TINYLLM_GPU_PERTURB")
            .ok()
            .filter(|s| !s.trim().is_empty())
            .and_then(|s| s.parse().ok())
    })
    .as_ref()
}

/// The perturbation armed for `primitive` on this thread, if any.
fn armed_for(primitive: &str) -> Option<Perturbation> {
    let own = ARMED.with_borrow(|a| a.clone());
    let f = match own {
        Some(f) => f,
        None => from_env().cloned(),
    };
    f.filter(|f| f.primitive == primitive)
}

/// Arms `p` (or, with `None`, disarms even the environment's) on this
/// thread until the guard drops.
pub fn arm(p: Option<Perturbation>) -> Armed {
    let prev = ARMED.with_borrow_mut(|a| a.replace(p));
    Armed(prev)
}

/// Restores the thread's previous setting when dropped.
#[must_use]
pub struct Armed(Option<Option<Perturbation>>);

impl Drop for Armed {
    fn drop(&mut self) {
        let prev = self.0.take();
        ARMED.with_borrow_mut(|a| *a = prev);
    }
}

fn flip(x: f32) -> f32 {
    f32::from_bits(x.to_bits() ^ 1)
}

/// Perturbs the first of `outs` when it is on the GPU and a perturbation is armed
/// for `primitive`.
pub fn perturb(primitive: &str, outs: &[&Storage]) -> Result<()> {
    let Some(f) = armed_for(primitive) else {
        return Ok(());
    };
    let Some(out) = outs.first().filter(|o| o.device() == Device::Gpu && !o.is_empty()) else {
        return Ok(());
    };
    let g = out.gpu();
    let mut v = g.download()?;
    let i = f.element.min(v.len() - 1);
    v[i] = flip(v[i]);
    super::gpu::context::ctx()?.upload(g.bind(), bytemuck::cast_slice(&v))
}

/// [`perturb`] for a primitive with a host result: the buffers it updated in
/// place if there are any, else the value.
pub fn perturb_value(primitive: &str, outs: &[&Storage], on_gpu: bool, value: f32) -> Result<f32> {
    if !outs.is_empty() {
        perturb(primitive, outs)?;
        return Ok(value);
    }
    Ok(match armed_for(primitive) {
        Some(_) if on_gpu => flip(value),
        _ => value,
    })
}
