//! The WGSL sources, how they are composed, and the kernel catalogue.
//!
//! Shaders are real files in `shaders/`, compiled into the binary with
//! `include_str!`. A kernel family that uses the math library gets
//! `mathlib.wgsl` and `cast.wgsl` prepended by plain string concatenation
//! (WGSL has no includes). Each (family, entry point) becomes one pipeline,
//! compiled once and cached in the context.

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
    needs_math: false,
};
pub const OPTIM: Family = Family {
    name: "optim",
    source: include_str!("../../../shaders/optim.wgsl"),
    needs_math: true,
};

pub const FAMILIES: [Family; 7] = [ELEMENTWISE, MATMUL, REDUCE, COPY, GATHER, RNG, OPTIM];

/// The full source of a family as the backend compiles it.
pub fn compose(f: Family) -> String {
    if f.needs_math {
        format!("{MATHLIB}\n{CAST}\n{}", f.source)
    } else {
        f.source.to_string()
    }
}

/// Every kernel (one pipeline each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Unary,
    Binary,
    Matmul,
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
    pub const ALL: [Kernel; 17] = [
        Kernel::Unary,
        Kernel::Binary,
        Kernel::Matmul,
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

    pub fn family_and_entry(self) -> (Family, &'static str) {
        match self {
            Kernel::Unary => (ELEMENTWISE, "unary"),
            Kernel::Binary => (ELEMENTWISE, "binary"),
            Kernel::Matmul => (MATMUL, "matmul"),
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
