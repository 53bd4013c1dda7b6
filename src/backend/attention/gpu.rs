//! The GPU's attention (`attention.wgsl`): forward in one dispatch, backward
//! in two (a pass per query row, then one per key row), each with the
//! batched composition's bits ([`batched`]), all heads in each dispatch.

use super::{batched, forward_then_pack, Arg, Attention, AttentionOps, Keeping};
use crate::backend::gpu::context::{ctx, Context};
use crate::backend::gpu::pipelines::{gpu_params, no_consts, Family, Kernel};
use crate::backend::gpu::{u32_of, Bind, GpuStorage};
use crate::backend::matmul::gpu::guarded;
use crate::backend::round::{fmt_code, Format};
use crate::Result;

gpu_params! {
    /// `attention.wgsl` `AttnParams`: heads of `t` rows of `d`, from head
    /// `head0`; `scale` f32 bits; `tokens` the heads of a token-major `v`,
    /// `y` and their gradients (0: head-major).
    /// `keep`, `keep_v`: `attention_keeping`'s FMT_* codes of q's and k's
    /// words and of v's (0 for the other kernels, which write none).
    pub struct AttnParams { t: u32, d: u32, head0: u32, scale: u32, tokens: u32, keep: u32, keep_v: u32 }
}

pub const FAMILY: Family = Family {
    name: "attention",
    sources: &[
        include_str!("../../../shaders/exact.wgsl"),
        include_str!("../../../shaders/attention.wgsl"),
    ],
    needs_math: true,
    consts: no_consts,
    entries: &["attention", "attention_keeping", "attention_rows", "attention_columns"],
    params: &[AttnParams::LAYOUT],
};

const FORWARD: Kernel = Kernel::new(&FAMILY, "attention");
const KEEPING: Kernel = Kernel::new(&FAMILY, "attention_keeping");
const ROWS: Kernel = Kernel::new(&FAMILY, "attention_rows");
const COLUMNS: Kernel = Kernel::new(&FAMILY, "attention_columns");

/// Whether the kernels' loops fit: on a device that caps a shader's loop
/// steps (lavapipe, 65,535) each invocation's must stay under the cap (the
/// counts are attention.wgsl's, the two backward passes' the most); longer rows run
/// the composition, whose kernels split their loops into passes. The same
/// bits either way.
fn fused_fits(c: &Context, a: &Attention) -> bool {
    let (t, t4, d4) = (a.t, a.t.div_ceil(4), a.d.div_ceil(4));
    let rows = 4 * t4 * (5 + d4) + 5 * t + 2 * d4 * (t + 1) + 4 * d4;
    let columns = 4 * d4 * (t + 1) + 8 * d4;
    !c.info.name.contains("llvmpipe") || rows.max(columns) <= 60_000
}

/// `kernel` with `a`'s formats and the 16-bit formats of q, k and v.
fn specialised(c: &Context, kernel: Kernel, a: &Attention, halves: [Option<Format>; 3]) -> Kernel {
    kernel
        .with("S_FMT", fmt_code(a.scores))
        .with("Y_FMT", fmt_code(a.round))
        .with("P_FMT", fmt_code(a.probs))
        .with("Q_HALF", fmt_code(halves[0]))
        .with("K_HALF", fmt_code(halves[1]))
        .with("V_HALF", fmt_code(halves[2]))
        .with("S_GUARD", guarded(c.native_fma, a.scores) as u32)
        .with("Y_GUARD", guarded(c.native_fma, a.round) as u32)
}

/// One dispatch of `kernel` per 65,535 heads: a workgroup per 64 rows of a
/// head (`keep`: the forward's words, [`AttnParams`]).
fn launch(c: &Context, kernel: &Kernel, a: &Attention, keep: [Option<Format>; 2], binds: &[Bind]) -> Result<()> {
    let (t, d) = (a.t, a.d);
    u32_of(a.heads * t * t.max(d), "attention size")?;
    let mut head0 = 0;
    while head0 < a.heads {
        let n = (a.heads - head0).min(65535);
        let prm = AttnParams {
            t: t as u32,
            d: d as u32,
            head0: head0 as u32,
            scale: a.scale.to_bits(),
            tokens: u32_of(a.tokens.unwrap_or(0), "heads")?,
            keep: fmt_code(keep[0]),
            keep_v: fmt_code(keep[1]),
        };
        c.dispatch(kernel, &prm, binds, (u32_of(t.div_ceil(64), "t")?, n as u32, 1))?;
        head0 += n;
    }
    Ok(())
}

impl AttentionOps for GpuStorage {
    fn attention(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>) -> Result<Self> {
        let c = ctx()?;
        if !fused_fits(c, a) {
            return batched::forward(a, q, k, v);
        }
        let y = GpuStorage::alloc(c, a.heads * a.t * a.d)?;
        if y.is_empty() {
            return Ok(y);
        }
        let p = GpuStorage::alloc(c, a.heads * a.t * a.t)?;
        let kernel = specialised(c, FORWARD, a, [q.1, k.1, v.1]);
        launch(c, &kernel, a, [None; 2], &[q.0.bind(), k.0.bind(), v.0.bind(), p.bind(), y.bind()])?;
        Ok(y)
    }

    /// One dispatch, each query row's invocation writing its rows' words
    /// where D is even (no word spans two rows); else the forward, then the
    /// packs.
    fn attention_keeping(a: &Attention, q: &Self, k: &Self, v: &Self, keep: [Format; 2]) -> Result<Keeping<Self>> {
        let c = ctx()?;
        let n = a.heads * a.t * a.d;
        if !fused_fits(c, a) || !a.d.is_multiple_of(2) || n == 0 {
            return forward_then_pack(a, q, k, v, keep);
        }
        let y = GpuStorage::alloc(c, n)?;
        let [wq, wk, wv] = [(); 3].map(|_| GpuStorage::alloc(c, n / 2));
        let (wq, wk, wv) = (wq?, wk?, wv?);
        let p = GpuStorage::alloc(c, a.heads * a.t * a.t)?;
        let kernel = specialised(c, KEEPING, a, [None; 3]);
        let binds = [q.bind(), k.bind(), v.bind(), p.bind(), y.bind(), wq.bind(), wk.bind(), wv.bind()];
        launch(c, &kernel, a, [Some(keep[0]), Some(keep[1])], &binds)?;
        Ok((y, [(wq, None), (wk, None), (wv, None)]))
    }

    fn attention_backward(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>, g: &Self) -> Result<[Self; 3]> {
        let c = ctx()?;
        if !fused_fits(c, a) {
            return batched::backward(a, q, k, v, g);
        }
        let n = a.heads * a.t * a.d;
        let [dq, dk, dv] = [(); 3].map(|_| GpuStorage::alloc(c, n));
        let (dq, dk, dv) = (dq?, dk?, dv?);
        if n == 0 {
            return Ok([dq, dk, dv]);
        }
        let [p, ds] = [(); 2].map(|_| GpuStorage::alloc(c, a.heads * a.t * a.t));
        let (p, ds) = (p?, ds?);
        let halves = [q.1, k.1, v.1];
        let rows = specialised(c, ROWS, a, halves);
        launch(c, &rows, a, [None; 2], &[q.0.bind(), k.0.bind(), v.0.bind(), p.bind(), ds.bind(), g.bind(), dq.bind()])?;
        let columns = specialised(c, COLUMNS, a, halves);
        launch(c, &columns, a, [None; 2], &[q.0.bind(), p.bind(), ds.bind(), dk.bind(), dv.bind(), g.bind()])?;
        Ok([dq, dk, dv])
    }
}
