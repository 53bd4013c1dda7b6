//! Elementwise primitives: `y = f(x)` ([`UnaryOp`]) and `y = lhs op rhs` with
//! broadcasting ([`BinaryOp`], [`BinaryLayout`]). The bf16/fp16 cast is the
//! unary op [`UnaryOp::Round`].
//!
//! ## Contract
//! * `+ − ×` and `fma` are the exactly rounded IEEE operations on both devices;
//!   negation is `−0 − x` (the sign of zero flips like IEEE negation).
//! * Division, square root, `exp`, `log`, sigmoid and SiLU are the crate's own
//!   routines ([`math`](super::math), `math.wgsl`): sigmoid is
//!   `div(1, 1 + exp(−0 − x))`, SiLU `x · sigmoid(x)`, SiLU's gradient
//!   `s · fma(x, 1 − s, 1)` with `s = sigmoid(x)`; rsqrt is `div(1, sqrt(x))`.
//! * `maximum` is NaN if either is NaN (the first one), else the larger, `+0`
//!   over `−0`; `Eq` is IEEE equality (NaN ≠ NaN, `+0 = −0`) as 1.0 / 0.0.
//! * Scalars are f64 and narrowed to the storage type once, on the host.
//! * Rounding is the integer round-to-nearest-even of [`round`](super::round).
//!
//! Each op enum is one table (`op_enum!`, in the backend's `mod.rs`): its `ALL`,
//! `name` and `code` are derived from it, and the named constants of the codes
//! are generated into the WGSL ([`wgsl_consts`]), where a test holds every
//! constant to a `case` of the shader's switch.

mod cpu;
pub(crate) mod spec;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;

use super::round::{Format, Fp8};
use super::{op_enum, primitive};
use super::{BinaryLayout, Storage, MAX_DIMS};
use crate::{bail, Result};

op_enum! {
    /// Elementwise functions of one input. `ALL` holds the scalar ops with a
    /// sample scalar and both roundings.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub enum UnaryOp {
        Neg => "unary neg",
        Exp => "unary exp",
        Log => "unary log",
        Sqrt => "unary sqrt",
        Rsqrt => "unary rsqrt",
        Recip => "unary recip",
        Sigmoid => "unary sigmoid",
        Silu => "unary silu",
        /// d silu / dx = s (1 + x (1 - s)), s = sigmoid(x)
        SiluGrad => "unary silu grad",
        Abs => "unary abs",
        Relu => "unary relu",
        /// 1 where x > 0, else 0 (relu's derivative)
        Step => "unary step",
        Square => "unary square",
        AddScalar(f64) [0.75] => "unary add scalar",
        MulScalar(f64) [-1.5] => "unary mul scalar",
        /// `x / c` through the crate's division
        DivScalar(f64) [3.0] => "unary div scalar",
        /// `c / x` through the crate's division
        RDivScalar(f64) [-0.3] => "unary scalar div",
        Round(Format) [Format::Bf16, Format::Fp16] => "unary round",
        /// To the nearest E4M3 or E5M2 value (see [`round`](super::round)).
        RoundFp8(Fp8) [Fp8::E4M3, Fp8::E5M2] => "unary round fp8",
    }
}

op_enum! {
    /// Elementwise functions of two inputs (with broadcasting, see [`BinaryLayout`]).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum BinaryOp {
        Add => "binary add",
        Sub => "binary sub",
        Mul => "binary mul",
        Div => "binary div",
        /// NaN if either is NaN, else the larger (`+0` over `-0`)
        Maximum => "binary maximum",
        /// 1.0 where equal (IEEE: NaN ≠ NaN, +0 = -0), else 0.0
        Eq => "binary eq",
    }
}

/// `"unary add scalar"` → `U_ADD_SCALAR`: the WGSL constant of an op's code.
fn wgsl_const(prefix: &str, name: &str) -> String {
    let stem = name.split_once(' ').map_or(name, |(_, rest)| rest);
    format!("{prefix}_{}", stem.to_uppercase().replace(' ', "_"))
}

/// The `U_*` and `B_*` op-code constants, prepended to `elementwise.wgsl`.
pub fn wgsl_consts() -> String {
    let mut s = String::from("// generated from UnaryOp::code and BinaryOp::code\n");
    for (i, op) in UnaryOp::ALL.iter().enumerate() {
        // a variant with several samples (the two roundings) is one constant
        if i == 0 || UnaryOp::ALL[i - 1].code() != op.code() {
            let line = format!("const {}: u32 = {}u;\n", wgsl_const("U", op.name()), op.code());
            s.push_str(&line);
        }
    }
    for op in BinaryOp::ALL {
        let line = format!("const {}: u32 = {}u;\n", wgsl_const("B", op.name()), op.code());
        s.push_str(&line);
    }
    s
}

/// The two devices' elementwise primitives (see the module docs for the contract).
pub trait ElementwiseOps: Sized {
    /// `y = f(x)` for every element.
    fn unary(&self, op: UnaryOp) -> Result<Self>;
    /// `y[i] = lhs[li] op rhs[ri]` over `layout.shape` (row-major output),
    /// `li`/`ri` the multi-index dotted with each input's strides.
    fn binary(&self, rhs: &Self, op: BinaryOp, layout: &BinaryLayout) -> Result<Self>;
}

impl Storage {
    /// `y = f(x)` elementwise; see [`UnaryOp`] and the module's contract.
    pub fn unary(&self, op: UnaryOp) -> Result<Storage> {
        Ok(primitive!(op.name(), || format!("{op:?} n {}", self.len()), [self] => |x| x.unary(op)))
    }

    /// `y[i] = lhs[li] op rhs[ri]` over a broadcast layout.
    pub fn binary(&self, rhs: &Storage, op: BinaryOp, layout: &BinaryLayout) -> Result<Storage> {
        if layout.shape.len() > MAX_DIMS {
            bail!(
                Shape,
                "binary op on {} dimensions: at most {MAX_DIMS} are supported",
                layout.shape.len()
            );
        }
        Ok(primitive!(op.name(), || format!("{op:?} {layout}"), [self, rhs] => |a, b| a.binary(b, op, layout)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::check_op_table;

    #[test]
    fn op_codes_are_dense_and_named_once() {
        check_op_table(&UnaryOp::ALL, UnaryOp::code, UnaryOp::name);
        check_op_table(&BinaryOp::ALL, BinaryOp::code, BinaryOp::name);
        let consts = wgsl_consts();
        assert!(consts.contains("const U_SILU_GRAD: u32 = 8u;"), "{consts}");
        assert!(consts.contains("const U_ROUND: u32 = 17u;"), "{consts}");
        assert!(consts.contains("const B_MAXIMUM: u32 = 4u;"), "{consts}");
        let n = |all: &[u32]| *all.last().unwrap() as usize + 1;
        let codes: Vec<u32> = UnaryOp::ALL.iter().map(|op| op.code()).collect();
        assert_eq!(consts.matches("const U_").count(), n(&codes), "{consts}");
        let codes: Vec<u32> = BinaryOp::ALL.iter().map(|op| op.code()).collect();
        assert_eq!(consts.matches("const B_").count(), n(&codes), "{consts}");
    }
}
