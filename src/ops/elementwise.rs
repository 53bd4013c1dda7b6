//! Elementwise ops with NumPy broadcasting. `x: any shape -> y: same shape`
//! (binary: the broadcast shape; gradients are summed back to each input's shape).

use crate::backend::{BinaryLayout, BinaryOp, UnaryOp};
use crate::tensor::shape::{broadcast_shape, broadcast_strides};
use crate::{Result, Tensor};

impl Tensor {
    fn unary_op(
        &self,
        op: UnaryOp,
        name: &'static str,
        vjp: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + 'static,
    ) -> Result<Tensor> {
        let s = self.storage().unary(op)?;
        let y = Tensor::from_storage(s.clone(), self.shape())?;
        let x = self.clone();
        Ok(Tensor::from_op(
            s,
            self.shape().to_vec(),
            name,
            &[self],
            move |g| {
                // x: the input, y: the output (a constant view of it), g: upstream
                Ok(vec![Some(vjp(&x.detach(), &y, g)?)])
            },
        ))
    }

    /// `-x` (as `-0 - x`, so the sign of zero flips like IEEE negation).
    pub fn neg(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Neg, "neg", |_, _, g| g.neg())
    }
    /// `e^x`; backward `g · y`.
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Exp, "exp", |_, y, g| g.mul(y))
    }
    /// `ln x`; backward `g / x`.
    pub fn log(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Log, "log", |x, _, g| g.div(x))
    }
    /// `√x`; backward `g / (2y)`.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sqrt, "sqrt", |_, y, g| g.div(y)?.mul_scalar(0.5))
    }
    /// `1/√x`; backward `-g y³ / 2`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Rsqrt, "rsqrt", |_, y, g| {
            g.mul(y)?.mul(y)?.mul(y)?.mul_scalar(-0.5)
        })
    }
    /// `1/x`; backward `-g y²`.
    pub fn recip(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Recip, "recip", |_, y, g| g.mul(y)?.mul(y)?.neg())
    }
    /// `σ(x)`; backward `g · y (1 − y)`.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sigmoid, "sigmoid", |_, y, g| {
            g.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?)
        })
    }
    /// `x σ(x)`; backward `g · σ(x)(1 + x(1 − σ(x)))`.
    pub fn silu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Silu, "silu", |x, _, g| {
            let d = Tensor::from_storage(x.storage().unary(UnaryOp::SiluGrad)?, x.shape())?;
            g.mul(&d)
        })
    }
    /// `max(x, 0)`; backward `g · [x > 0]`.
    pub fn relu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Relu, "relu", |x, _, g| {
            let d = Tensor::from_storage(x.storage().unary(UnaryOp::Step)?, x.shape())?;
            g.mul(&d)
        })
    }
    /// `x²`; backward `2 g x`.
    pub fn square(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Square, "square", |x, _, g| {
            g.mul(x)?.mul_scalar(2.0)
        })
    }
    /// `x + c`.
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::AddScalar(c), "add_scalar", |_, _, g| Ok(g.clone()))
    }
    /// `x · c`.
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::MulScalar(c), "mul_scalar", move |_, _, g| {
            g.mul_scalar(c)
        })
    }
    /// `x / c` (the crate's division).
    pub fn div_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::DivScalar(c), "div_scalar", move |_, _, g| {
            g.div_scalar(c)
        })
    }

    fn binary_op(
        &self,
        rhs: &Tensor,
        op: BinaryOp,
        name: &'static str,
        vjp: impl FnOnce(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)> + 'static,
    ) -> Result<Tensor> {
        let shape = broadcast_shape(self.shape(), rhs.shape()).map_err(|e| e.context(name))?;
        let layout = BinaryLayout {
            lhs_strides: broadcast_strides(self.shape(), &shape),
            rhs_strides: broadcast_strides(rhs.shape(), &shape),
            shape: shape.clone(),
        };
        let s = self
            .storage()
            .binary(&rhs.storage(), op, &layout)
            .map_err(|e| e.context(name))?;
        let y = Tensor::from_storage(s.clone(), &shape)?;
        let (a, b) = (self.clone(), rhs.clone());
        Ok(Tensor::from_op(s, shape, name, &[self, rhs], move |g| {
            let (ga, gb) = vjp(&a.detach(), &b.detach(), &y, g)?;
            let ga = if a.requires_grad() {
                Some(ga.sum_to(a.shape())?)
            } else {
                None
            };
            let gb = if b.requires_grad() {
                Some(gb.sum_to(b.shape())?)
            } else {
                None
            };
            Ok(vec![ga, gb])
        }))
    }

    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Add, "add", |_, _, _, g| {
            Ok((g.clone(), g.clone()))
        })
    }
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Sub, "sub", |_, _, _, g| {
            Ok((g.clone(), g.neg()?))
        })
    }
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Mul, "mul", |a, b, _, g| {
            Ok((g.mul(b)?, g.mul(a)?))
        })
    }
    /// `a / b` (the crate's division); backward `g/b`, `−(g/b)·y/b`.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Div, "div", |_, b, y, g| {
            let ga = g.div(b)?;
            let gb = ga.mul(y)?.neg()?;
            Ok((ga, gb))
        })
    }
    /// 1.0 where equal, else 0.0 (not differentiable: a constant).
    pub fn eq_mask(&self, rhs: &Tensor) -> Result<Tensor> {
        let _g = crate::no_grad();
        self.binary_op(rhs, BinaryOp::Eq, "eq", |_, _, _, g| {
            Ok((g.zeros_like()?, g.zeros_like()?))
        })
    }
}
