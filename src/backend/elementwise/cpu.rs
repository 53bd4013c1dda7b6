//! The CPU reference of the elementwise primitives.

use super::{BinaryOp, ElementwiseOps, UnaryOp};
use crate::backend::cpu::pool;
use crate::backend::cpu::{
    both, both2, cpu_threads, fill, for_each_run, maximum, new_vec, sigmoid_into, simd, split_at_starts,
    split_layout, write_exact, write_lanes, CpuStorage, Elem,
};
use crate::backend::cpu::simd::LANES;
use crate::backend::BinaryLayout;
use crate::Result;
use std::mem::MaybeUninit;

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
            new_vec(x.len(), |out, written| written.add(write_lanes(out, x, f)))
        }
        let sigmoid = |x: &[T]| new_vec(x.len(), |s, written| written.add(sigmoid_into(s, x)));
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
            UnaryOp::RoundFp8(f) => map(x, |v| v.round_fp8(f)),
        }
    }
}

/// `a op b` over a broadcast layout, its pieces (see `split_layout`) on the
/// threads: each output is the op of its own two inputs, so the bits do not
/// depend on the split.
fn binary_t<T: Elem>(a: &[T], b: &[T], op: BinaryOp, layout: &BinaryLayout) -> Vec<T> {
    let n: usize = layout.shape.iter().product();
    new_vec(n, |out, written| {
        if n == 0 {
            return;
        }
        let pieces = split_layout(layout, cpu_threads());
        let outs = split_at_starts(out, &pieces);
        written.add_all(pool::map(outs.into_iter().zip(&pieces), |(o, (_, l0, r0, piece))| {
            binary_into(o, &a[*l0..], &b[*r0..], op, piece)
        }));
    })
}

simd::multiversion! {
    fn binary_into<'o, T: Elem>(
        o: &'o mut [MaybeUninit<T>],
        a: &[T],
        b: &[T],
        op: BinaryOp,
        layout: &BinaryLayout,
    ) -> &'o mut [T] {
        match op {
            BinaryOp::Add => broadcast_into(o, a, b, layout, |x, y| x.add(y)),
            BinaryOp::Sub => broadcast_into(o, a, b, layout, |x, y| x.sub(y)),
            BinaryOp::Mul => broadcast_into(o, a, b, layout, |x, y| x.mul(y)),
            BinaryOp::Div => broadcast_into(o, a, b, layout, |x, y| x.div(y)),
            BinaryOp::Maximum => broadcast_into(o, a, b, layout, maximum),
            BinaryOp::Eq => broadcast_into(o, a, b, layout, |x, y| if x == y { T::ONE } else { T::ZERO }),
        }
    }
}

/// `f` over a broadcast layout into `out` (the layout's size), handed back
/// written: each run a slice loop (both contiguous, or one side a broadcast
/// scalar) whenever the strides allow.
#[inline(always)]
fn broadcast_into<'o, T: Elem>(
    out: &'o mut [MaybeUninit<T>],
    a: &[T],
    b: &[T],
    layout: &BinaryLayout,
    f: impl Fn(T, T) -> T,
) -> &'o mut [T] {
    fill(out, |out, written| {
        let mut rest = out;
        for_each_run(layout, |li, ri, len, lst, rst| {
            let (o, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            written.add(match (lst, rst) {
                (1, 1) => {
                    let (x, y) = (&a[li..li + len], &b[ri..ri + len]);
                    write_exact(o, x.iter().zip(y).map(|(&x, &y)| f(x, y)))
                }
                (1, 0) => {
                    let (x, y) = (&a[li..li + len], b[ri]);
                    write_exact(o, x.iter().map(|&x| f(x, y)))
                }
                (0, 1) => {
                    let (x, y) = (a[li], &b[ri..ri + len]);
                    write_exact(o, y.iter().map(|&y| f(x, y)))
                }
                _ => write_exact(o, (0..len).map(|t| f(a[li + t * lst], b[ri + t * rst]))),
            });
        });
        assert!(rest.is_empty(), "the layout covers the output");
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::set_cpu_threads;

    /// Binary ops over broadcast and transposed layouts large enough to be
    /// split over the threads, against each output computed from its own
    /// indices: one thread and three (pieces that are not halves).
    #[test]
    fn threaded_binary_ops_give_each_outputs_own_value() {
        let (r, c) = (301, 131);
        assert!(r * c >= pool::SPLIT_VALUES);
        let a: Vec<f32> = (0..r * c).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..r * c).map(|i| (i as f32 * 0.11).cos() + 1.5).collect();
        // (lhs strides, rhs strides) over the output shape (r, c)
        let layouts = [
            ([c, 1], [c, 1]), // both contiguous
            ([c, 1], [0, 1]), // a row broadcast down
            ([c, 1], [1, 0]), // a column broadcast across
            ([1, r], [c, 1]), // the left side transposed
            ([0, 0], [1, r]), // a scalar and a transposed right side
        ];
        for threads in [1, 3] {
            set_cpu_threads(Some(threads));
            for (ls, rs) in layouts {
                let layout = BinaryLayout {
                    shape: vec![r, c],
                    lhs_strides: ls.to_vec(),
                    rhs_strides: rs.to_vec(),
                };
                for (op, f) in [
                    (BinaryOp::Add, (|x, y| x + y) as fn(f32, f32) -> f32),
                    (BinaryOp::Sub, |x, y| x - y),
                    (BinaryOp::Mul, |x, y| x * y),
                    (BinaryOp::Div, |x, y| x / y),
                ] {
                    let got = binary_t(&a, &b, op, &layout);
                    for (k, &v) in got.iter().enumerate() {
                        let (i, j) = (k / c, k % c);
                        let want = f(a[i * ls[0] + j * ls[1]], b[i * rs[0] + j * rs[1]]);
                        assert_eq!(v.to_bits(), want.to_bits(), "{op:?} {layout} output {k}, {threads} threads");
                    }
                }
            }
        }
        set_cpu_threads(None);
    }
}
