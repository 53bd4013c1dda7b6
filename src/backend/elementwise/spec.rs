//! The spec of the elementwise primitives: the contract, one element at a time.

#![forbid(unsafe_code)]

use super::{BinaryOp, ElementwiseOps, UnaryOp};
use crate::backend::math::{div, exp, log, sqrt};
use crate::backend::round::round_f32;
use crate::backend::spec::{dot, fma, maximum, multi_index, SpecStorage};
use crate::backend::BinaryLayout;
use crate::Result;

/// `σ(x) = div(1, 1 + exp(−0 − x))`.
fn sigmoid(x: f32) -> f32 {
    div(1.0, 1.0 + exp(-0.0 - x))
}

fn unary(op: UnaryOp, x: f32) -> f32 {
    match op {
        UnaryOp::Neg => -0.0 - x,
        UnaryOp::Exp => exp(x),
        UnaryOp::Log => log(x),
        UnaryOp::Sqrt => sqrt(x),
        UnaryOp::Rsqrt => div(1.0, sqrt(x)),
        UnaryOp::Recip => div(1.0, x),
        UnaryOp::Sigmoid => sigmoid(x),
        UnaryOp::Silu => x * sigmoid(x),
        UnaryOp::SiluGrad => {
            let s = sigmoid(x);
            s * fma(x, 1.0 - s, 1.0)
        }
        UnaryOp::Abs => {
            if x < 0.0 || (x == 0.0 && x.is_sign_negative()) {
                -0.0 - x
            } else {
                x
            }
        }
        UnaryOp::Relu => {
            if x > 0.0 || x.is_nan() {
                x
            } else {
                0.0
            }
        }
        UnaryOp::Step => {
            if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        UnaryOp::Square => x * x,
        UnaryOp::AddScalar(c) => x + c as f32,
        UnaryOp::MulScalar(c) => x * c as f32,
        UnaryOp::DivScalar(c) => div(x, c as f32),
        UnaryOp::RDivScalar(c) => div(c as f32, x),
        UnaryOp::Round(f) => round_f32(x, f),
        UnaryOp::RoundFp8(f) => crate::backend::round::fp8_f32(x, f),
    }
}

fn binary(op: BinaryOp, a: f32, b: f32) -> f32 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => div(a, b),
        BinaryOp::Maximum => maximum(a, b),
        BinaryOp::Eq => {
            if a == b {
                1.0
            } else {
                0.0
            }
        }
    }
}

impl ElementwiseOps for SpecStorage {
    fn unary(&self, op: UnaryOp) -> Result<SpecStorage> {
        Ok(SpecStorage::new(self.get().iter().map(|&x| unary(op, x)).collect()))
    }

    fn binary(&self, rhs: &SpecStorage, op: BinaryOp, layout: &BinaryLayout) -> Result<SpecStorage> {
        let n: usize = layout.shape.iter().product();
        let (a, b) = (self.get(), rhs.get());
        let out = (0..n)
            .map(|i| {
                let idx = multi_index(i, &layout.shape);
                binary(op, a[dot(&idx, &layout.lhs_strides)], b[dot(&idx, &layout.rhs_strides)])
            })
            .collect();
        Ok(SpecStorage::new(out))
    }
}
