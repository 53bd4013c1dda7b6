//! The GPU dispatches of a Llama training step's row kernels and products,
//! worked out from the shapes alone (no device): each kernel with its grid,
//! as the launchers record them. The dispatch-geometry test holds every
//! [`Kernels::Hardware`] kernel here to at least [`MIN_LANES`](crate::backend::gpu::variant::MIN_LANES)
//! invocations per workgroup at the capstone's shapes.

use crate::backend::gpu::grid1d;
use crate::backend::gpu::pipelines::Kernel;
use crate::backend::gpu::variant::Kernels;
use crate::backend::{fused, matmul, reduce, Causal, MatmulDims};

/// A training step's shapes: `tokens` rows (micro-batch × context `t`),
/// width `d`, MLP width `hidden`, `heads` heads, `vocab` logits per row.
#[derive(Clone, Copy, Debug)]
pub struct StepShapes {
    pub tokens: usize,
    pub d: usize,
    pub hidden: usize,
    pub heads: usize,
    pub t: usize,
    pub vocab: usize,
}

/// One dispatch: what it computes, the kernel, its workgroups.
#[derive(Clone, Copy, Debug)]
pub struct Dispatch {
    pub what: &'static str,
    pub kernel: Kernel,
    pub groups: (u32, u32, u32),
}

fn product(batch: usize, m: usize, k: usize, n: usize, causal: Causal) -> MatmulDims {
    MatmulDims {
        batch,
        m,
        k,
        n,
        trans_a: false,
        trans_b: false,
        a_batch_stride: m * k,
        b_batch_stride: k * n,
        causal,
        tokens: Default::default(),
    }
}

/// The row kernels and products of one step at `s`, for `variant`.
pub fn step_dispatches(variant: Kernels, s: StepShapes) -> Vec<Dispatch> {
    let mut out = Vec::new();
    let mut add = |what, (kernel, groups): (Kernel, (u32, u32, u32))| out.push(Dispatch { what, kernel, groups });
    let norm = fused::gpu::row_launches(variant, s.tokens, s.d);
    add("rms_norm", norm[0]);
    add("rms_norm backward (rows and weight)", norm[1]);
    let ce = fused::gpu::row_launches(variant, s.tokens, s.vocab);
    add("cross_entropy (rows)", ce[2]);
    add("cross_entropy (mean)", ce[3]);
    add("cross_entropy backward", ce[4]);
    let ((fwd, _), (bwd, _)) = reduce::gpu::softmax_kernels(variant);
    let score_rows = s.tokens / s.t * s.heads * s.t;
    add("attention softmax", (fwd, grid1d(score_rows)));
    add("attention softmax backward", (bwd, grid1d(score_rows)));
    let (n, d, h, v) = (s.tokens, s.d, s.hidden, s.vocab);
    let (bh, t, hd) = (s.tokens / s.t * s.heads, s.t, s.d / s.heads);
    for (what, batch, m, k, nn, causal) in [
        ("projection", 1, n, d, d, Causal::No),
        ("MLP up", 1, n, d, h, Causal::No),
        ("MLP down", 1, n, h, d, Causal::No),
        ("LM head", 1, n, d, v, Causal::No),
        ("projection weight gradient", 1, d, n, d, Causal::No),
        ("MLP weight gradient", 1, h, n, d, Causal::No),
        ("LM head weight gradient", 1, d, n, v, Causal::No),
        ("attention scores", bh, t, hd, t, Causal::Outputs),
        ("attention P·V", bh, t, t, hd, Causal::TermsUpToRow),
        ("attention Pᵀ·dY", bh, t, t, hd, Causal::TermsFromRow),
    ] {
        let (kernel, (x, y, z)) = matmul::gpu::matmul_launch(variant, &product(batch, m, k, nn, causal));
        add(what, (kernel, (x as u32, y as u32, z as u32)));
    }
    out
}
