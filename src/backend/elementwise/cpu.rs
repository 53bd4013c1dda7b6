//! The CPU reference of the elementwise primitives.

use super::{BinaryOp, ElementwiseOps, UnaryOp};
use crate::backend::cpu::{
    both, both2, for_each_run, maximum, sigmoid_into, simd, write_lanes, CpuStorage, Elem,
};
use crate::backend::math::LANES;
use crate::backend::BinaryLayout;
use crate::Result;

impl ElementwiseOps for CpuStorage {
    fn unary(&self, op: UnaryOp) -> Result<CpuStorage> {
        Ok(both!(self, x => unary_t(x, op)))
    }

    fn binary(&self, rhs: &CpuStorage, op: BinaryOp, layout: &BinaryLayout) -> Result<CpuStorage> {
        Ok(both2!(self, rhs, a, b => binary_t(a, b, op, layout)))
    }
}

simd::multiversion! {
    /// Every unary op as one loop over the slice: the op is matched once, outside,
    /// so each arm is a straight-line body the compiler vectorises (the f32 math
    /// functions are branch-free for that reason, see [`math`]).
    fn unary_t<T: Elem>(x: &[T], op: UnaryOp) -> Vec<T> {
        #[inline(always)]
        fn map<T: Copy>(x: &[T], f: impl Fn(T) -> T) -> Vec<T> {
            x.iter().map(|&v| f(v)).collect()
        }
        /// The ops with a vector form (division, exp): a group of lanes at a
        /// time, so each is one vector operation ([`Elem::div_lanes`]).
        #[inline(always)]
        fn map_lanes<T: Elem>(x: &[T], f: impl Fn([T; LANES]) -> [T; LANES]) -> Vec<T> {
            let mut out = Vec::with_capacity(x.len());
            write_lanes(&mut out.spare_capacity_mut()[..x.len()], x, f);
            // SAFETY: write_lanes wrote every value.
            unsafe { out.set_len(x.len()) };
            out
        }
        let sigmoid = |x: &[T]| {
            let mut s = Vec::with_capacity(x.len());
            sigmoid_into(&mut s.spare_capacity_mut()[..x.len()], x);
            // SAFETY: sigmoid_into wrote every value.
            unsafe { s.set_len(x.len()) };
            s
        };
        match op {
            UnaryOp::Neg => map(x, |v| T::NEG_ZERO.sub(v)),
            UnaryOp::Exp => map_lanes(x, |v| T::exp_lanes(v)),
            UnaryOp::Log => map(x, |v| v.log()),
            UnaryOp::Sqrt => map(x, |v| v.sqrt()),
            UnaryOp::Rsqrt => map_lanes(x, |v| T::div_lanes([T::ONE; LANES], v.map(T::sqrt))),
            UnaryOp::Recip => map_lanes(x, |v| T::div_lanes([T::ONE; LANES], v)),
            UnaryOp::Sigmoid => sigmoid(x),
            UnaryOp::Silu => {
                let mut s = sigmoid(x);
                s.iter_mut().zip(x).for_each(|(s, &v)| *s = v.mul(*s));
                s
            }
            // s * (1 + x * (1 - s)) = s * fma(x, 1 - s, 1)
            UnaryOp::SiluGrad => {
                let mut s = sigmoid(x);
                s.iter_mut()
                    .zip(x)
                    .for_each(|(s, &v)| *s = s.mul(v.fma(T::ONE.sub(*s), T::ONE)));
                s
            }
            UnaryOp::Abs => map(x, |v| {
                if v < T::ZERO || (v == T::ZERO && T::ONE.div(v) < T::ZERO) {
                    T::NEG_ZERO.sub(v)
                } else {
                    v
                }
            }),
            UnaryOp::Relu => map(x, |v| {
                if v > T::ZERO || v.is_nan() {
                    v
                } else {
                    T::ZERO
                }
            }),
            UnaryOp::Step => map(x, |v| if v > T::ZERO { T::ONE } else { T::ZERO }),
            UnaryOp::Square => map(x, |v| v.mul(v)),
            UnaryOp::AddScalar(c) => {
                let c = T::from_f64(c);
                map(x, |v| v.add(c))
            }
            UnaryOp::MulScalar(c) => {
                let c = T::from_f64(c);
                map(x, |v| v.mul(c))
            }
            UnaryOp::DivScalar(c) => {
                let c = T::from_f64(c);
                map_lanes(x, |v| T::div_lanes(v, [c; LANES]))
            }
            UnaryOp::RDivScalar(c) => {
                let c = T::from_f64(c);
                map(x, |v| c.div(v))
            }
            UnaryOp::Round(f) => map(x, |v| v.round_to(f)),
        }
    }
}

/// `f` over a broadcast layout; each run is a slice loop (both contiguous, or
/// one side a broadcast scalar) whenever the strides allow.
#[inline(always)]
fn broadcast_map<T: Elem>(
    a: &[T],
    b: &[T],
    layout: &BinaryLayout,
    f: impl Fn(T, T) -> T,
) -> Vec<T> {
    let n: usize = layout.shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    for_each_run(layout, |li, ri, len, lst, rst| match (lst, rst) {
        (1, 1) => out.extend(
            a[li..li + len]
                .iter()
                .zip(&b[ri..ri + len])
                .map(|(&x, &y)| f(x, y)),
        ),
        (1, 0) => {
            let y = b[ri];
            out.extend(a[li..li + len].iter().map(|&x| f(x, y)))
        }
        (0, 1) => {
            let x = a[li];
            out.extend(b[ri..ri + len].iter().map(|&y| f(x, y)))
        }
        _ => out.extend((0..len).map(|t| f(a[li + t * lst], b[ri + t * rst]))),
    });
    out
}

simd::multiversion! {
    fn binary_t<T: Elem>(a: &[T], b: &[T], op: BinaryOp, layout: &BinaryLayout) -> Vec<T> {
        match op {
            BinaryOp::Add => broadcast_map(a, b, layout, |x, y| x.add(y)),
            BinaryOp::Sub => broadcast_map(a, b, layout, |x, y| x.sub(y)),
            BinaryOp::Mul => broadcast_map(a, b, layout, |x, y| x.mul(y)),
            BinaryOp::Div => broadcast_map(a, b, layout, |x, y| x.div(y)),
            BinaryOp::Maximum => broadcast_map(a, b, layout, maximum),
            BinaryOp::Eq => broadcast_map(a, b, layout, |x, y| if x == y { T::ONE } else { T::ZERO }),
        }
    }
}
