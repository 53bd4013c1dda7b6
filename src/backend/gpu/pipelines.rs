//! The WGSL sources, how they are composed, and the kernel catalogue.
//!
//! Shaders are real files in `shaders/`, compiled into the binary with
//! `include_str!`. A kernel family that uses the math library gets the math
//! prelude prepended by plain string concatenation (WGSL has no includes):
//! the `fma_c` selector line, `fma.wgsl`, `mathlib.wgsl` and `cast.wgsl`.
//! Each (family, entry point) becomes one pipeline, compiled once and cached
//! in the context.
//!
//! `fma_c` is the contract's fused multiply-add: the device's `fma` when a
//! probe at start-up shows it is exactly fused, else `fma_soft` (fma.wgsl,
//! integer emulation). On Mesa's lavapipe `fma` is not fused.

pub const FMA: &str = include_str!("../../../shaders/fma.wgsl");
pub const MATHLIB: &str = include_str!("../../../shaders/mathlib.wgsl");
pub const CAST: &str = include_str!("../../../shaders/cast.wgsl");

/// One shader file and whether it needs the math library prepended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Family {
    pub name: &'static str,
    pub source: &'static str,
    pub needs_math: bool,
}

pub const ELEMENTWISE: Family = Family {
    name: "elementwise",
    source: include_str!("../../../shaders/elementwise.wgsl"),
    needs_math: true,
};
pub const MATMUL: Family = Family {
    name: "matmul",
    source: include_str!("../../../shaders/matmul.wgsl"),
    needs_math: true,
};
pub const REDUCE: Family = Family {
    name: "reduce",
    source: include_str!("../../../shaders/reduce.wgsl"),
    needs_math: true,
};
pub const COPY: Family = Family {
    name: "copy",
    source: include_str!("../../../shaders/copy.wgsl"),
    needs_math: false,
};
pub const GATHER: Family = Family {
    name: "gather",
    source: include_str!("../../../shaders/gather.wgsl"),
    needs_math: false,
};
pub const RNG: Family = Family {
    name: "rng",
    source: include_str!("../../../shaders/rng.wgsl"),
    needs_math: true,
};
pub const OPTIM: Family = Family {
    name: "optim",
    source: include_str!("../../../shaders/optim.wgsl"),
    needs_math: true,
};

pub const FAMILIES: [Family; 7] = [ELEMENTWISE, MATMUL, REDUCE, COPY, GATHER, RNG, OPTIM];

/// The math prelude, with `fma_c` bound to the device's `fma` (`native_fma`)
/// or to the integer emulation.
pub fn prelude(native_fma: bool) -> String {
    let sel = if native_fma {
        "// fma_c: the device's fma, probed to be exactly fused\n\
         fn fma_c(a: f32, b: f32, c: f32) -> f32 { return fma(a, b, c); }"
    } else {
        "// fma_c: the device's fma is not fused (probed): integer emulation\n\
         fn fma_c(a: f32, b: f32, c: f32) -> f32 { return fma_soft(a, b, c); }"
    };
    format!("{sel}\n{FMA}\n{MATHLIB}\n{CAST}\n")
}

/// The full source of a family as the backend compiles it.
pub fn compose(f: Family, native_fma: bool) -> String {
    if f.needs_math {
        format!("{}{}", prelude(native_fma), f.source)
    } else {
        f.source.to_string()
    }
}

/// Kernel of the start-up probe: `d[4i+3] = fma(d[4i], d[4i+1], d[4i+2])` with
/// the device's own `fma` (operands from a buffer, so nothing can be folded).
pub const FMA_PROBE: &str = "
@group(0) @binding(0) var<storage, read_write> d: array<f32>;
@compute @workgroup_size(1)
fn probe() {
    let n = arrayLength(&d) / 4u;
    for (var i = 0u; i < n; i++) {
        d[4u * i + 3u] = fma(d[4u * i], d[4u * i + 1u], d[4u * i + 2u]);
    }
}
";

/// Every kernel (one pipeline each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Unary,
    Binary,
    /// matmul.wgsl specialised (override constants) for its rounding format
    /// (`FMT_*` code: 0 none, 1 bf16, 2 fp16) and operand layouts.
    Matmul {
        fmt: u8,
        trans_a: bool,
        trans_b: bool,
    },
    Reduce,
    Softmax,
    SoftmaxBackward,
    ChunkSumSquares,
    StridedCopy,
    ConcatPart,
    GatherRows,
    ScatterAddRows,
    DropoutMask,
    ScaleInPlace,
    FiniteCheckUnscale,
    AdamW,
    Sgd,
    SgdMomentum,
}

impl Kernel {
    /// One kernel per entry point (a specialised kernel appears once).
    pub const ALL: [Kernel; 17] = [
        Kernel::Unary,
        Kernel::Binary,
        Kernel::Matmul {
            fmt: 0,
            trans_a: false,
            trans_b: false,
        },
        Kernel::Reduce,
        Kernel::Softmax,
        Kernel::SoftmaxBackward,
        Kernel::ChunkSumSquares,
        Kernel::StridedCopy,
        Kernel::ConcatPart,
        Kernel::GatherRows,
        Kernel::ScatterAddRows,
        Kernel::DropoutMask,
        Kernel::ScaleInPlace,
        Kernel::FiniteCheckUnscale,
        Kernel::AdamW,
        Kernel::Sgd,
        Kernel::SgdMomentum,
    ];

    /// Values of the kernel's pipeline-overridable constants on device `c`.
    pub fn constants(self, c: &super::context::Context) -> Vec<(&'static str, f64)> {
        match self {
            Kernel::ScaleInPlace | Kernel::FiniteCheckUnscale | Kernel::AdamW => {
                vec![("PER_LANE", c.optim_per_lane as f64)]
            }
            Kernel::Matmul {
                fmt,
                trans_a,
                trans_b,
            } => vec![
                ("FMT", fmt as f64),
                ("TRANS_A", trans_a as u8 as f64),
                ("TRANS_B", trans_b as u8 as f64),
            ],
            _ => Vec::new(),
        }
    }

    pub fn family_and_entry(self) -> (Family, &'static str) {
        match self {
            Kernel::Unary => (ELEMENTWISE, "unary"),
            Kernel::Binary => (ELEMENTWISE, "binary"),
            Kernel::Matmul { .. } => (MATMUL, "matmul"),
            Kernel::Reduce => (REDUCE, "reduce"),
            Kernel::Softmax => (REDUCE, "softmax_rows"),
            Kernel::SoftmaxBackward => (REDUCE, "softmax_rows_backward"),
            Kernel::ChunkSumSquares => (REDUCE, "chunk_sum_squares"),
            Kernel::StridedCopy => (COPY, "strided_copy"),
            Kernel::ConcatPart => (COPY, "concat_part"),
            Kernel::GatherRows => (GATHER, "gather_rows"),
            Kernel::ScatterAddRows => (GATHER, "scatter_add_rows"),
            Kernel::DropoutMask => (RNG, "dropout_mask"),
            Kernel::ScaleInPlace => (OPTIM, "scale_in_place"),
            Kernel::FiniteCheckUnscale => (OPTIM, "finite_check_unscale"),
            Kernel::AdamW => (OPTIM, "adamw_step"),
            Kernel::Sgd => (OPTIM, "sgd_step"),
            Kernel::SgdMomentum => (OPTIM, "sgd_momentum_step"),
        }
    }
}
