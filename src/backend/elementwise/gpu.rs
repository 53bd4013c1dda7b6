//! The GPU launchers of the elementwise primitives (`elementwise.wgsl`).

use super::{BinaryOp, ElementwiseOps, UnaryOp};
use crate::backend::gpu::context::ctx;
use crate::backend::gpu::pipelines::{gpu_params, Family, Kernel};
use crate::backend::gpu::{grid1d, pad6, u32_of, GpuStorage};
use crate::backend::round::fmt_code;
use crate::backend::{BinaryLayout, MAX_DIMS};
use crate::Result;

gpu_params! {
    /// `elementwise.wgsl` `UnaryParams`: x: (n) -> y: (n).
    pub struct UnaryParams { n: u32, op: u32, c: u32, fmt: u32 }
}

gpu_params! {
    /// `elementwise.wgsl` `BinaryParams`: the output shape and both inputs'
    /// strides, padded on the left to six dimensions.
    pub struct BinaryParams {
        n: u32,
        op: u32,
        _pad0: u32,
        _pad1: u32,
        shape: [u32; MAX_DIMS],
        ls: [u32; MAX_DIMS],
        rs: [u32; MAX_DIMS],
    }
}

pub const FAMILY: Family = Family {
    name: "elementwise",
    sources: &[include_str!("../../../shaders/elementwise.wgsl")],
    needs_math: true,
    consts: super::wgsl_consts,
    entries: &["unary", "binary"],
    params: &[UnaryParams::LAYOUT, BinaryParams::LAYOUT],
};

const UNARY: Kernel = Kernel::new(&FAMILY, "unary");
const BINARY: Kernel = Kernel::new(&FAMILY, "binary");

impl ElementwiseOps for GpuStorage {
    fn unary(&self, op: UnaryOp) -> Result<GpuStorage> {
        let c = ctx()?;
        let n = self.len();
        let out = GpuStorage::alloc(c, n)?;
        // scalars narrowed to f32 once, on the host, like the CPU's T::from_f64;
        // every op listed, so a new op with an argument must say where it goes
        let (scalar, fmt) = match op {
            UnaryOp::AddScalar(s)
            | UnaryOp::MulScalar(s)
            | UnaryOp::DivScalar(s)
            | UnaryOp::RDivScalar(s) => (s as f32, 0),
            UnaryOp::Round(f) => (0.0, fmt_code(Some(f))),
            UnaryOp::RoundFp8(f) => (0.0, f.code()),
            UnaryOp::Neg
            | UnaryOp::Exp
            | UnaryOp::Log
            | UnaryOp::Sqrt
            | UnaryOp::Rsqrt
            | UnaryOp::Recip
            | UnaryOp::Sigmoid
            | UnaryOp::Silu
            | UnaryOp::SiluGrad
            | UnaryOp::Abs
            | UnaryOp::Relu
            | UnaryOp::Step
            | UnaryOp::Square => (0.0, 0),
        };
        let prm = UnaryParams {
            n: u32_of(n, "length")?,
            op: op.code(),
            c: scalar.to_bits(),
            fmt,
        };
        c.dispatch(&UNARY, &prm, &[self.bind(), out.bind()], grid1d(n))?;
        Ok(out)
    }

    fn binary(&self, rhs: &GpuStorage, op: BinaryOp, layout: &BinaryLayout) -> Result<GpuStorage> {
        let c = ctx()?;
        let n: usize = layout.shape.iter().product();
        let out = GpuStorage::alloc(c, n)?;
        let (shape, ls) = pad6(&layout.shape, &layout.lhs_strides)?;
        let (_, rs) = pad6(&layout.shape, &layout.rhs_strides)?;
        let prm = BinaryParams {
            n: u32_of(n, "length")?,
            op: op.code(),
            _pad0: 0,
            _pad1: 0,
            shape,
            ls,
            rs,
        };
        c.dispatch(
            &BINARY,
            &prm,
            &[self.bind(), rhs.bind(), out.bind()],
            grid1d(n),
        )?;
        Ok(out)
    }
}
