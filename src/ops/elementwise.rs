//! Elementwise ops with NumPy broadcasting. `x: any shape -> y: same shape`
//! (binary: the broadcast shape; gradients are summed back to each input's shape).
//!
//! Each op keeps alive exactly what its backward reads — the input, the output,
//! or nothing — so the graph never holds an activation no gradient uses.

use crate::backend::{BinaryLayout, BinaryOp, UnaryOp};
use crate::tensor::autocast::{output_format, OpClass};
use crate::tensor::saved::Saved;
use crate::tensor::shape::{broadcast_shape, broadcast_strides};
use crate::{Result, Tensor};

/// What a unary op's backward needs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    Nothing,
    Input,
    Output,
}

impl Tensor {
    /// `vjp(kept, g)` gets the kept tensor (a constant view), or `g` itself
    /// when nothing was kept.
    fn unary_op(
        &self,
        op: UnaryOp,
        name: &'static str,
        keep: Keep,
        vjp: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor> + 'static,
    ) -> Result<Tensor> {
        let s = self.storage().unary(op)?;
        let kept = match keep {
            Keep::Nothing => None,
            Keep::Input => Some(Saved::keep(self)?),
            Keep::Output => Some(Saved::Full(Tensor::from_storage(s.clone(), self.shape())?)),
        };
        Ok(Tensor::record(
            s,
            self.shape().to_vec(),
            name,
            &[self],
            move |g| {
                let kept = kept.map(|k| k.get()).transpose()?;
                Ok(vec![Some(vjp(kept.as_ref().unwrap_or(g), g)?)])
            },
        ))
    }

    /// `-x` (as `-0 - x`, so the sign of zero flips like IEEE negation).
    pub fn neg(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Neg, "neg", Keep::Nothing, |_, g| g.neg())
    }
    /// `e^x`; backward `g · y`.
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Exp, "exp", Keep::Output, |y, g| g.mul(y))
    }
    /// `ln x`; backward `g / x`.
    pub fn log(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Log, "log", Keep::Input, |x, g| g.div(x))
    }
    /// `√x`; backward `g / (2y)`.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sqrt, "sqrt", Keep::Output, |y, g| {
            g.div(y)?.mul_scalar(0.5)
        })
    }
    /// `1/√x`; backward `-g y³ / 2`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Rsqrt, "rsqrt", Keep::Output, |y, g| {
            g.mul(y)?.mul(y)?.mul(y)?.mul_scalar(-0.5)
        })
    }
    /// `1/x`; backward `-g y²`.
    pub fn recip(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Recip, "recip", Keep::Output, |y, g| {
            g.mul(y)?.mul(y)?.neg()
        })
    }
    /// `σ(x)`; backward `g · y (1 − y)`.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sigmoid, "sigmoid", Keep::Output, |y, g| {
            g.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?)
        })
    }
    /// `x σ(x)`; backward `g · σ(x)(1 + x(1 − σ(x)))`.
    pub fn silu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Silu, "silu", Keep::Input, |x, g| {
            let d = Tensor::from_storage(x.storage().unary(UnaryOp::SiluGrad)?, x.shape())?;
            g.mul(&d)
        })
    }
    /// `max(x, 0)`; backward `g · [x > 0]`.
    pub fn relu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Relu, "relu", Keep::Input, |x, g| {
            let d = Tensor::from_storage(x.storage().unary(UnaryOp::Step)?, x.shape())?;
            g.mul(&d)
        })
    }
    /// `x²`; backward `2 g x`.
    pub fn square(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Square, "square", Keep::Input, |x, g| {
            g.mul(x)?.mul_scalar(2.0)
        })
    }
    /// `x + c`.
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_op(
            UnaryOp::AddScalar(c),
            "add_scalar",
            Keep::Nothing,
            |_, g| Ok(g.clone()),
        )
    }
    /// `x · c`.
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_op(
            UnaryOp::MulScalar(c),
            "mul_scalar",
            Keep::Nothing,
            move |_, g| g.mul_scalar(c),
        )
    }
    /// `x / c` (the crate's division).
    pub fn div_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_op(
            UnaryOp::DivScalar(c),
            "div_scalar",
            Keep::Nothing,
            move |_, g| g.div_scalar(c),
        )
    }

    /// `keep(a_needs_grad, b_needs_grad) -> (keep a, keep b, keep y)` says what
    /// the backward reads; `vjp(a, b, y, g)` gets those (the rest `None`) and
    /// returns the gradients, which are then summed back to each input's shape.
    #[allow(clippy::type_complexity)]
    fn binary_op(
        &self,
        rhs: &Tensor,
        op: BinaryOp,
        name: &'static str,
        keep: fn(bool, bool) -> (bool, bool, bool),
        vjp: impl FnOnce(
                Option<&Tensor>,
                Option<&Tensor>,
                Option<&Tensor>,
                &Tensor,
            ) -> Result<(Option<Tensor>, Option<Tensor>)>
            + 'static,
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
        let (ra, rb) = (self.requires_grad(), rhs.requires_grad());
        let (ka, kb, ky) = keep(ra, rb);
        let a = ka.then(|| Saved::keep(self)).transpose()?;
        let b = kb.then(|| Saved::keep(rhs)).transpose()?;
        let y = if ky {
            Some(Tensor::from_storage(s.clone(), &shape)?)
        } else {
            None
        };
        let (sa, sb) = (self.shape().to_vec(), rhs.shape().to_vec());
        Ok(Tensor::record(s, shape, name, &[self, rhs], move |g| {
            let (a, b) = (
                a.map(|a| a.get()).transpose()?,
                b.map(|b| b.get()).transpose()?,
            );
            let (ga, gb) = vjp(a.as_ref(), b.as_ref(), y.as_ref(), g)?;
            let ga = match (ra, ga) {
                (true, Some(ga)) => Some(ga.sum_to(&sa)?),
                _ => None,
            };
            let gb = match (rb, gb) {
                (true, Some(gb)) => Some(gb.sum_to(&sb)?),
                _ => None,
            };
            Ok(vec![ga, gb])
        }))
    }

    /// `self + rhs` as one of a model's residual connections: [`add`](Self::add),
    /// the sum stored as the autocast policy's `residual_add` entry says.
    pub fn residual_add(&self, rhs: &Tensor) -> Result<Tensor> {
        let f = output_format(OpClass::ResidualAdd, &[self, rhs]);
        super::stored_as(self.add(rhs)?, f)
    }

    /// `a + b`, broadcasting; backward passes `g` to both (summed back to each
    /// shape). Errors if the shapes do not broadcast or the tensors are on
    /// different devices or have different dtypes.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(
            rhs,
            BinaryOp::Add,
            "add",
            |_, _| (false, false, false),
            |_, _, _, g| Ok((Some(g.clone()), Some(g.clone()))),
        )
    }
    /// `a − b`, broadcasting; backward `g`, `−g`. Errors as [`add`](Self::add).
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(
            rhs,
            BinaryOp::Sub,
            "sub",
            |_, _| (false, false, false),
            |_, _, _, g| Ok((Some(g.clone()), Some(g.neg()?))),
        )
    }
    /// Backward `g·b`, `g·a`: each operand is kept only if the other one needs a gradient.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(
            rhs,
            BinaryOp::Mul,
            "mul",
            |ra, rb| (rb, ra, false),
            |a, b, _, g| {
                Ok((
                    b.map(|b| g.mul(b)).transpose()?,
                    a.map(|a| g.mul(a)).transpose()?,
                ))
            },
        )
    }
    /// `a / b` (the crate's division); backward `g/b`, `−(g/b)·y/b`.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(
            rhs,
            BinaryOp::Div,
            "div",
            |_, rb| (false, true, rb),
            |_, b, y, g| {
                let ga = g.div(b.expect("div keeps its divisor"))?;
                let gb = y.map(|y| ga.mul(y)?.neg()).transpose()?;
                Ok((Some(ga), gb))
            },
        )
    }
    /// 1.0 where equal, else 0.0 (not differentiable: a constant).
    pub fn eq_mask(&self, rhs: &Tensor) -> Result<Tensor> {
        let _g = crate::no_grad();
        self.binary_op(
            rhs,
            BinaryOp::Eq,
            "eq",
            |_, _| (false, false, false),
            |_, _, _, _| Ok((None, None)),
        )
    }
}

/// Arithmetic operators on references: `&a + &b`, `&a * 2.0`, `-&a`. Each is
/// the named op ([`Tensor::add`], [`Tensor::mul_scalar`], …) with its
/// broadcasting, autograd and autocast, and like it returns a `Result` (a
/// shape mismatch is an error, not a panic), so chains read
/// `(&(&a * &b)? + &c)?`.
///
/// ```
/// use tinyllm::{Device, Tensor};
/// let a = Tensor::from_vec(vec![1.0, 2.0], &[2], Device::Cpu)?;
/// let b = Tensor::from_vec(vec![10.0, 20.0], &[2], Device::Cpu)?;
/// let y = (&(&a * &b)? - &a)?;
/// assert_eq!(y.to_vec_f32()?, vec![9.0, 38.0]);
/// assert_eq!((-&(&a * 0.5)?)?.to_vec_f32()?, vec![-0.5, -1.0]);
/// assert!((&a + &Tensor::zeros(&[3], tinyllm::DType::F32, Device::Cpu)?).is_err());
/// # Ok::<(), tinyllm::Error>(())
/// ```
mod operators {
    use crate::{Result, Tensor};
    use std::ops::{Add, Div, Mul, Neg, Sub};

    macro_rules! tensor_op {
        ($trait:ident, $method:ident, $op:ident, $scalar:expr) => {
            impl $trait<&Tensor> for &Tensor {
                type Output = Result<Tensor>;
                fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                    self.$op(rhs)
                }
            }
            impl $trait<f64> for &Tensor {
                type Output = Result<Tensor>;
                fn $method(self, c: f64) -> Result<Tensor> {
                    $scalar(self, c)
                }
            }
        };
    }
    tensor_op!(Add, add, add, |t: &Tensor, c| t.add_scalar(c));
    tensor_op!(Sub, sub, sub, |t: &Tensor, c: f64| t.add_scalar(-c));
    tensor_op!(Mul, mul, mul, |t: &Tensor, c| t.mul_scalar(c));
    tensor_op!(Div, div, div, |t: &Tensor, c| t.div_scalar(c));

    impl Neg for &Tensor {
        type Output = Result<Tensor>;
        fn neg(self) -> Result<Tensor> {
            Tensor::neg(self)
        }
    }
}
