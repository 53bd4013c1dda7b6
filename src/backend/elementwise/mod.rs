//! Elementwise primitives: `y = f(x)` ([`UnaryOp`]) and `y = lhs op rhs` with
//! broadcasting ([`BinaryOp`], [`BinaryLayout`]). The bf16/fp16 cast is the
//! unary op [`UnaryOp::Round`].
//!
//! ## Contract
//! * `+ − ×` and `fma` are the exactly rounded IEEE operations on both devices;
//!   negation is `−0 − x` (the sign of zero flips like IEEE negation).
//! * Division, square root, `exp`, `log`, sigmoid and SiLU are the crate's own
//!   routines ([`math`](super::math), `mathlib.wgsl`): sigmoid is
//!   `div(1, 1 + exp(−0 − x))`, SiLU `x · sigmoid(x)`, SiLU's gradient
//!   `s · fma(x, 1 − s, 1)` with `s = sigmoid(x)`; rsqrt is `div(1, sqrt(x))`.
//! * `maximum` is NaN if either is NaN (the first one), else the larger, `+0`
//!   over `−0`; `Eq` is IEEE equality (NaN ≠ NaN, `+0 = −0`) as 1.0 / 0.0.
//! * Scalars are f64 and narrowed to the storage type once, on the host.
//! * Rounding is the integer round-to-nearest-even of [`round`](super::round).
//!
//! Op codes have one source: [`UnaryOp::code`] / [`BinaryOp::code`], whose
//! named constants are generated into the WGSL ([`wgsl_consts`]).

mod cpu;
pub(crate) mod spec;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;

use super::round::Format;
use super::primitive;
use super::{BinaryLayout, Storage, MAX_DIMS};
use crate::{bail, Result};

/// Elementwise functions of one input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Sigmoid,
    Silu,
    /// d silu / dx = s (1 + x (1 - s)), s = sigmoid(x)
    SiluGrad,
    Abs,
    Relu,
    /// 1 where x > 0, else 0 (relu's derivative)
    Step,
    Square,
    AddScalar(f64),
    MulScalar(f64),
    /// `x / c` through the crate's division
    DivScalar(f64),
    /// `c / x` through the crate's division
    RDivScalar(f64),
    Round(Format),
}

impl UnaryOp {
    /// One of each op (scalar ops with a sample scalar, both roundings): what
    /// the parity tests and the cross-check sweep run.
    pub const ALL: [UnaryOp; 19] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Sigmoid,
        UnaryOp::Silu,
        UnaryOp::SiluGrad,
        UnaryOp::Abs,
        UnaryOp::Relu,
        UnaryOp::Step,
        UnaryOp::Square,
        UnaryOp::AddScalar(0.75),
        UnaryOp::MulScalar(-1.5),
        UnaryOp::DivScalar(3.0),
        UnaryOp::RDivScalar(-0.3),
        UnaryOp::Round(Format::Bf16),
        UnaryOp::Round(Format::Fp16),
    ];

    /// A fixed name per op (scalar arguments left out), for the profile.
    pub fn name(&self) -> &'static str {
        match self {
            UnaryOp::Neg => "unary neg",
            UnaryOp::Exp => "unary exp",
            UnaryOp::Log => "unary log",
            UnaryOp::Sqrt => "unary sqrt",
            UnaryOp::Rsqrt => "unary rsqrt",
            UnaryOp::Recip => "unary recip",
            UnaryOp::Sigmoid => "unary sigmoid",
            UnaryOp::Silu => "unary silu",
            UnaryOp::SiluGrad => "unary silu grad",
            UnaryOp::Abs => "unary abs",
            UnaryOp::Relu => "unary relu",
            UnaryOp::Step => "unary step",
            UnaryOp::Square => "unary square",
            UnaryOp::AddScalar(_) => "unary add scalar",
            UnaryOp::MulScalar(_) => "unary mul scalar",
            UnaryOp::DivScalar(_) => "unary div scalar",
            UnaryOp::RDivScalar(_) => "unary scalar div",
            UnaryOp::Round(_) => "unary round",
        }
    }

    /// The op's code in `elementwise.wgsl` (`U_*` constants, generated from
    /// this function by [`wgsl_consts`]).
    pub fn code(&self) -> u32 {
        match self {
            UnaryOp::Neg => 0,
            UnaryOp::Exp => 1,
            UnaryOp::Log => 2,
            UnaryOp::Sqrt => 3,
            UnaryOp::Rsqrt => 4,
            UnaryOp::Recip => 5,
            UnaryOp::Sigmoid => 6,
            UnaryOp::Silu => 7,
            UnaryOp::SiluGrad => 8,
            UnaryOp::Abs => 9,
            UnaryOp::Relu => 10,
            UnaryOp::Step => 11,
            UnaryOp::Square => 12,
            UnaryOp::AddScalar(_) => 13,
            UnaryOp::MulScalar(_) => 14,
            UnaryOp::DivScalar(_) => 15,
            UnaryOp::RDivScalar(_) => 16,
            UnaryOp::Round(_) => 17,
        }
    }
}

/// Elementwise functions of two inputs (with broadcasting, see [`BinaryLayout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    /// NaN if either is NaN, else the larger (`+0` over `-0`)
    Maximum,
    /// 1.0 where equal (IEEE: NaN ≠ NaN, +0 = -0), else 0.0
    Eq,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 6] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::Eq,
    ];

    /// A fixed name per op, for the profile.
    pub fn name(&self) -> &'static str {
        match self {
            BinaryOp::Add => "binary add",
            BinaryOp::Sub => "binary sub",
            BinaryOp::Mul => "binary mul",
            BinaryOp::Div => "binary div",
            BinaryOp::Maximum => "binary maximum",
            BinaryOp::Eq => "binary eq",
        }
    }

    /// The op's code in `elementwise.wgsl` (`B_*` constants).
    pub fn code(&self) -> u32 {
        match self {
            BinaryOp::Add => 0,
            BinaryOp::Sub => 1,
            BinaryOp::Mul => 2,
            BinaryOp::Div => 3,
            BinaryOp::Maximum => 4,
            BinaryOp::Eq => 5,
        }
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
    for op in UnaryOp::ALL {
        if op != UnaryOp::Round(Format::Fp16) {
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

    #[test]
    fn op_codes_are_distinct_and_named_once() {
        let mut codes: Vec<u32> = UnaryOp::ALL.iter().map(UnaryOp::code).collect();
        codes.dedup(); // the two roundings share one code, side by side in ALL
        let n = codes.len();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), n, "unary codes collide");
        assert_eq!(codes, (0..n as u32).collect::<Vec<_>>());
        let mut b: Vec<u32> = BinaryOp::ALL.iter().map(BinaryOp::code).collect();
        b.sort();
        assert_eq!(b, (0..BinaryOp::ALL.len() as u32).collect::<Vec<_>>());
        let consts = wgsl_consts();
        assert!(consts.contains("const U_SILU_GRAD: u32 = 8u;"), "{consts}");
        assert!(consts.contains("const B_MAXIMUM: u32 = 4u;"), "{consts}");
    }
}
