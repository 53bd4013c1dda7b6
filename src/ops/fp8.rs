//! fp8 products with delayed scaling (the recipe and its state:
//! [`tensor::fp8`](crate::tensor::fp8)).
//!
//! `linear(x, W)` = `gcast(cast8(x, s_x) @ cast8(W, s_W)ᵀ)`: the operands
//! cast to E4M3 with their scales and read unscaled, the product
//! accumulated in f32 in the matmul contract's order and its output rounded
//! per the autocast policy (fp8 values are bf16 and fp16 values too, so the
//! policy's operand rounding changes nothing); `gcast` is the identity
//! forward and casts the gradient arriving for the output to E5M2 with its
//! own scale, before both gradient products read it. Every cast records
//! its tensor's amax and saturations on the device while grad mode is on
//! (a training pass), never in an evaluation.

use crate::backend::reduce::ReduceOp;
use crate::backend::round::Fp8;
use crate::backend::{BinaryLayout, BinaryOp, Storage, UnaryOp};
use crate::ops::matmul::matmul_with;
use crate::tensor::autocast::autocast_dtype;
use crate::tensor::fp8::{DelayedScaling, Role};
use crate::{is_grad_enabled, Result, Tensor};
use std::cell::RefCell;
use std::rc::Rc;

// Each step of the casts and their records below is its own statement: a
// chain's temporaries would all live to its end, several of `x`'s size at
// once beside `x`; one at a time, a cast holds at most two.

/// `rd(x·s)/s` elementwise, `rd` rounding to `fmt` and saturating: a finite
/// `x·s` past the format's maximum becomes ±max (E4M3's rounding saturates
/// by itself; E5M2's would give inf, so `x·s` is clamped first, as
/// Transformer Engine's casts saturate — one large gradient must not turn
/// the step's gradients to inf). NaN stays NaN. With `s` a power of two
/// both multiplications are exact.
pub(crate) fn quantize(x: &Storage, scale: f32, fmt: Fp8) -> Result<Storage> {
    let inv = 1.0 / scale as f64;
    let mut v = x.unary(UnaryOp::MulScalar(scale as f64))?;
    if fmt == Fp8::E5M2 {
        v = clamp_abs(&v, fmt.max())?;
    }
    v = v.unary(UnaryOp::RoundFp8(fmt))?;
    v.unary(UnaryOp::MulScalar(inv))
}

/// `x` clamped to `[−m, m]` (NaN kept): `−max(−max(x, −m), −m)`.
fn clamp_abs(x: &Storage, m: f32) -> Result<Storage> {
    let c = Storage::full(1, -(m as f64), x.dtype(), x.device())?;
    let layout = BinaryLayout {
        shape: vec![x.len()],
        lhs_strides: vec![1],
        rhs_strides: vec![0],
    };
    let mut v = x.binary(&c, BinaryOp::Maximum, &layout)?;
    v = v.unary(UnaryOp::Neg)?;
    v = v.binary(&c, BinaryOp::Maximum, &layout)?;
    v.unary(UnaryOp::Neg)
}

/// `max |x|` over every element, a 1-element device value (NaN propagates).
pub(crate) fn amax(x: &Storage) -> Result<Storage> {
    let v = x.unary(UnaryOp::Abs)?;
    v.reduce(ReduceOp::Max, 1, x.len(), 1)
}

/// How many `|x·s|` exceed `fmax`, a 1-element device value (an exact
/// integer below 2^24 elements): `Σ step(|x·s| − fmax)`.
pub(crate) fn saturations(x: &Storage, scale: f32, fmax: f32) -> Result<Storage> {
    let mut v = x.unary(UnaryOp::MulScalar(scale as f64))?;
    v = v.unary(UnaryOp::Abs)?;
    v = v.unary(UnaryOp::AddScalar(-(fmax as f64)))?;
    v = v.unary(UnaryOp::Step)?;
    v.reduce(ReduceOp::Sum, 1, x.len(), 1)
}

/// The scaled cast as a constant tensor op: `rd(x·s)/s` (saturating; see
/// the module docs), `x`'s shape.
pub fn scaled_round(x: &Tensor, scale: f32, fmt: Fp8) -> Result<Tensor> {
    Tensor::from_storage(quantize(&x.storage(), scale, fmt)?, x.shape())
}

/// `max |x|`, a `(1,)` tensor on `x`'s device.
pub fn amax_of(x: &Tensor) -> Result<Tensor> {
    Tensor::from_storage(amax(&x.storage())?, &[1])
}

/// How many `|x·s|` exceed `fmt`'s maximum, a `(1,)` tensor on `x`'s device.
pub fn saturations_of(x: &Tensor, scale: f32, fmt: Fp8) -> Result<Tensor> {
    Tensor::from_storage(saturations(&x.storage(), scale, fmt.max())?, &[1])
}

/// Records `x`'s amax and saturations at `scale` for `role` of `slot`.
fn record(
    recipe: &RefCell<DelayedScaling>,
    slot: usize,
    role: Role,
    x: &Storage,
    scale: f32,
) -> Result<()> {
    let (a, n) = (amax(x)?, saturations(x, scale, role.format().max())?);
    recipe.borrow_mut().record(slot, role, a, n)
}

/// `x` cast with `role`'s scale in `slot` and read unscaled, recorded in
/// training; the gradient passes through unchanged (straight-through).
pub fn cast_operand(
    x: &Tensor,
    recipe: &Rc<RefCell<DelayedScaling>>,
    slot: usize,
    role: Role,
) -> Result<Tensor> {
    let scale = recipe.borrow().scale(slot, role);
    let s = x.storage();
    if is_grad_enabled() {
        record(recipe, slot, role, &s, scale)?;
    }
    let q = quantize(&s, scale, role.format())?;
    Ok(Tensor::record(
        q,
        x.shape().to_vec(),
        "fp8 cast",
        &[x],
        |g| Ok(vec![Some(g.clone())]),
    ))
}

/// The identity forward; backward casts the gradient to E5M2 with the
/// output gradient's scale in `slot` (read when backward runs: the scale of
/// the step), recording its amax.
fn cast_grad(y: &Tensor, recipe: &Rc<RefCell<DelayedScaling>>, slot: usize) -> Result<Tensor> {
    let r = recipe.clone();
    let half = y.half();
    let out = Tensor::record(
        y.storage(),
        y.shape().to_vec(),
        "fp8 grad cast",
        &[y],
        move |g| {
            let role = Role::Grad;
            let scale = r.borrow().scale(slot, role);
            let s = g.storage();
            record(&r, slot, role, &s, scale)?;
            let q = quantize(&s, scale, role.format())?;
            Ok(vec![Some(Tensor::from_storage(q, g.shape())?)])
        },
    );
    Ok(out.with_half(half))
}

/// `x Wᵀ` in fp8 under `recipe` (see the module docs): `x: (.., in)`,
/// `w: (out, in)` -> `(.., out)`.
pub fn linear(x: &Tensor, w: &Tensor, recipe: &Rc<RefCell<DelayedScaling>>) -> Result<Tensor> {
    let slot = recipe.borrow_mut().slot(w.id());
    let xq = cast_operand(x, recipe, slot, Role::Input)?;
    let wq = cast_operand(w, recipe, slot, Role::Weight)?;
    let y = matmul_with(&xq, &wq, false, true, autocast_dtype())?;
    cast_grad(&y, recipe, slot)
}
