//! The device side of the cross-check's probe (`probe.wgsl`): runs single
//! operations — a load and store, `+ − ×`, the device's `fma` and the
//! contract's `fma_c`, a product then a sum written apart, the crate's
//! division and roundings, and the device's own `/`, `sqrt`, `exp` — on
//! chosen operands, and gives back the bits. Each op's [`reference`]
//! (ProbeOp::reference) is what the contract (or IEEE) says the result is;
//! `crosscheck::probe` chooses the operands and reads the answers.

use super::context::ctx;
use super::pipelines::{gpu_params, Family, Kernel};
use super::{grid1d, u32_of, GpuStorage};
use crate::backend::{math, op_enum, round};
use crate::Result;

op_enum! {
    /// One operation of the probe kernel, on `(a, b, c)`; its name is how a
    /// report writes it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum ProbeOp {
        /// `a`, loaded and stored.
        Copy => "load/store a",
        /// `a`'s bits xor `b`'s, through `bitcast` (integer tricks on floats).
        Bits => "bitcast(bits(a) ^ bits(b))",
        Add => "a + b",
        Sub => "a - b",
        Mul => "a * b",
        /// The device's `fma(a, b, c)`.
        Fma => "fma(a, b, c)",
        /// The contract's `fma_c(a, b, c)` (the device's `fma` or the emulation).
        FmaC => "fma_c(a, b, c)",
        /// `p = a * b; p + c`, written as two operations.
        MulThenAdd => "p = a * b; p + c",
        /// The crate's division `m_div(a, b)`.
        Div => "m_div(a, b)",
        /// The crate's rounding to bf16.
        Bf16 => "bf16_f32(a)",
        /// The crate's rounding to fp16.
        Fp16 => "fp16_f32(a)",
        /// `(a + 2^23) − 2^23` with the constants in the source.
        Fold => "(a + 2^23) - 2^23",
        /// The device's own `a / b` (the kernels never use it).
        NativeDiv => "a / b (native)",
        /// The device's own `sqrt(a)` (never used either).
        NativeSqrt => "sqrt(a) (native)",
        /// The device's own `exp(a)` (never used either).
        NativeExp => "exp(a) (native)",
    }
}

impl ProbeOp {
    /// The result the contract (IEEE single precision, rounding to nearest,
    /// gradual underflow, one rounding per operation, nothing reassociated)
    /// gives, computed on the CPU.
    pub fn reference(self, a: f32, b: f32, c: f32) -> f32 {
        match self {
            ProbeOp::Copy => a,
            ProbeOp::Bits => f32::from_bits(a.to_bits() ^ b.to_bits()),
            ProbeOp::Add => a + b,
            ProbeOp::Sub => a - b,
            ProbeOp::Mul => a * b,
            ProbeOp::Fma | ProbeOp::FmaC => a.mul_add(b, c),
            ProbeOp::MulThenAdd => {
                let p = std::hint::black_box(a * b);
                p + c
            }
            ProbeOp::Div => math::div(a, b),
            ProbeOp::Bf16 => round::bf16_f32(a),
            ProbeOp::Fp16 => round::fp16_f32(a),
            ProbeOp::Fold => {
                let t = std::hint::black_box(a + 8_388_608.0);
                t - 8_388_608.0
            }
            ProbeOp::NativeDiv => a / b,
            ProbeOp::NativeSqrt => a.sqrt(),
            // correctly rounded for every f32 (the f64 result is far more precise)
            ProbeOp::NativeExp => (a as f64).exp() as f32,
        }
    }
}

/// The `P_*` constants, prepended to `probe.wgsl`.
pub fn wgsl_consts() -> String {
    ProbeOp::ALL
        .iter()
        .map(|op| {
            let name: String = format!("{op:?}")
                .chars()
                .flat_map(|ch| {
                    let sep = ch.is_uppercase().then_some('_');
                    sep.into_iter().chain(ch.to_uppercase())
                })
                .collect();
            format!("const P{name}: u32 = {}u;\n", op.code())
        })
        .collect()
}

gpu_params! {
    /// `probe.wgsl` `ProbeParams`: `n` cases.
    pub struct ProbeParams { n: u32 }
}

pub const FAMILY: Family = Family {
    name: "probe",
    sources: &[include_str!("../../../shaders/probe.wgsl")],
    needs_math: true,
    consts: wgsl_consts,
    entries: &["probe"],
    params: &[ProbeParams::LAYOUT],
};

const PROBE: Kernel = Kernel::new(&FAMILY, "probe");

/// Runs every case on the device; returns the results in order.
pub fn run(cases: &[(ProbeOp, [f32; 3])]) -> Result<Vec<f32>> {
    let c = ctx()?;
    let n = cases.len();
    // op codes travel as raw bits in an f32 buffer (the kernel reads u32s)
    let ops: Vec<f32> = cases.iter().map(|(op, _)| f32::from_bits(op.code())).collect();
    let xs: Vec<f32> = cases.iter().flat_map(|(_, v)| *v).collect();
    let ops = GpuStorage::upload(&ops)?;
    let xs = GpuStorage::upload(&xs)?;
    let out = GpuStorage::alloc(c, n)?;
    let prm = ProbeParams { n: u32_of(n, "probe cases")? };
    c.dispatch(&PROBE, &prm, &[ops.bind(), xs.bind(), out.bind()], grid1d(n))?;
    out.download()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_constants_are_generated_once_each() {
        crate::backend::check_op_table(&ProbeOp::ALL, ProbeOp::code, ProbeOp::name);
        let c = wgsl_consts();
        assert!(c.contains("const P_MUL_THEN_ADD: u32 = 7u;"), "{c}");
        assert!(c.contains("const P_NATIVE_EXP: u32 = 14u;"), "{c}");
        assert_eq!(c.lines().count(), ProbeOp::ALL.len());
    }
}
