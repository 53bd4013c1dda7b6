//! The GPU's attention (`attention.wgsl`): forward in one dispatch, backward
//! in two (a pass per query row, then one per key row), each with the
//! batched composition's bits ([`batched`]), all heads in each dispatch.

use super::{
    attention_then_rope_backward, batched, forward_then_pack, rope_then_attention, Arg, Attention, AttentionOps, Keeping,
    RopeKeep, RopeOut, Rotary,
};
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
    /// words (0: float32 values) and of v's (0: none), `kw` where k's start;
    /// `cos_at`, `sin_at`: where RoPE's tables start in their binding;
    /// `zero`: +0; `rot_back`: 1 where the backward rotates dq and dk back
    /// (RoPE), `r_fmt` the rotated values' FMT_* code.
    pub struct AttnParams {
        t: u32, d: u32, head0: u32, scale: u32, tokens: u32, keep: u32, keep_v: u32, kw: u32, cos_at: u32,
        sin_at: u32, zero: u32, rot_back: u32, r_fmt: u32,
    }
}

pub const FAMILY: Family = Family {
    name: "attention",
    sources: &[
        include_str!("../../../shaders/exact.wgsl"),
        include_str!("../../../shaders/rope.wgsl"),
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
    let rows = 4 * t4 * (5 + d4) + 5 * t + 2 * d4 * (t + 1) + 4 * d4 + a.d / 2;
    let columns = 4 * d4 * (t + 1) + 8 * d4 + a.d / 2;
    !c.info.name.contains("llvmpipe") || rows.max(columns) <= 60_000
}

/// How a dispatch rotates by RoPE: in the forward's loads or the backward's
/// stores, with the tables' binding and where each starts in it.
#[derive(Clone, Copy)]
enum Rotation<'a> {
    Off,
    Load(Rotary, Tables<'a>),
    Back(Rotary, Tables<'a>),
}

/// RoPE's cos and sin through one binding, and where each starts in it.
type Tables<'a> = (Bind<'a>, usize, usize);

/// `kernel` with `a`'s formats, the 16-bit formats of q, k and v, and
/// `rope`'s where the forward rotates (the backward's are runtime values).
fn specialised(c: &Context, kernel: Kernel, a: &Attention, halves: [Option<Format>; 3], rope: Rotation) -> Kernel {
    let load = match rope {
        Rotation::Load(r, _) => Some(r.round),
        Rotation::Off | Rotation::Back(..) => None,
    };
    kernel
        .with("S_FMT", fmt_code(a.scores))
        .with("Y_FMT", fmt_code(a.round))
        .with("P_FMT", fmt_code(a.probs))
        .with("Q_HALF", fmt_code(halves[0]))
        .with("K_HALF", fmt_code(halves[1]))
        .with("V_HALF", fmt_code(halves[2]))
        .with("S_GUARD", guarded(c.native_fma, a.scores) as u32)
        .with("Y_GUARD", guarded(c.native_fma, a.round) as u32)
        .with("ROT_LOAD", load.is_some() as u32)
        .with("R_FMT", fmt_code(load.flatten()))
}

/// What a dispatch writes besides its outputs: the keeping forward's codes
/// ([`AttnParams`]) and where k's words start.
#[derive(Clone, Copy, Default)]
struct Words {
    keep: u32,
    keep_v: u32,
    kw: usize,
}

/// One dispatch of `kernel` per 65,535 heads: a workgroup per 64 rows of a
/// head. `binds` are the kernel's in order with RoPE's tables (binding 4)
/// left out: `rope`'s, or a stand-in never read (the first binding).
fn launch(c: &Context, kernel: &Kernel, a: &Attention, words: Words, rope: Rotation, binds: &[Bind]) -> Result<()> {
    let (t, d) = (a.t, a.d);
    u32_of(a.heads * t * t.max(d), "attention size")?;
    let (back, (tables, cos_at, sin_at)) = match rope {
        Rotation::Off => (None, (binds[0], 0, 0)),
        Rotation::Load(_, tb) => (None, tb),
        Rotation::Back(r, tb) => (Some(r.round), tb),
    };
    let mut all = binds.to_vec();
    all.insert(3, tables);
    let mut head0 = 0;
    while head0 < a.heads {
        let n = (a.heads - head0).min(65535);
        let prm = AttnParams {
            t: t as u32,
            d: d as u32,
            head0: head0 as u32,
            scale: a.scale.to_bits(),
            tokens: u32_of(a.tokens.unwrap_or(0), "heads")?,
            keep: words.keep,
            keep_v: words.keep_v,
            kw: u32_of(words.kw, "words")?,
            cos_at: u32_of(cos_at, "table offset")?,
            sin_at: u32_of(sin_at, "table offset")?,
            zero: 0,
            rot_back: back.is_some() as u32,
            r_fmt: fmt_code(back.flatten()),
        };
        c.dispatch(kernel, &prm, &all, (u32_of(t.div_ceil(64), "t")?, n as u32, 1))?;
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
        let kernel = specialised(c, FORWARD, a, [q.1, k.1, v.1], Rotation::Off);
        let binds = [q.0.bind(), k.0.bind(), v.0.bind(), p.bind(), y.bind()];
        launch(c, &kernel, a, Words::default(), Rotation::Off, &binds)?;
        Ok(y)
    }

    /// One dispatch, each query row's invocation writing its rows' words
    /// where D is even (no word spans two rows); else the forward, then the
    /// packs. q's and k's words are views of one buffer.
    fn attention_keeping(a: &Attention, q: &Self, k: &Self, v: &Self, keep: [Format; 2]) -> Result<Keeping<Self>> {
        let c = ctx()?;
        let n = a.heads * a.t * a.d;
        if !fused_fits(c, a) || !a.d.is_multiple_of(2) || n == 0 {
            return forward_then_pack(a, q, k, v, keep);
        }
        let Some(qk) = GpuStorage::views(c, &[n / 2, n / 2])? else {
            return forward_then_pack(a, q, k, v, keep);
        };
        let (y, wv) = (GpuStorage::alloc(c, n)?, GpuStorage::alloc(c, n / 2)?);
        let p = GpuStorage::alloc(c, a.heads * a.t * a.t)?;
        let kernel = specialised(c, KEEPING, a, [None; 3], Rotation::Off);
        let words = Words {
            keep: fmt_code(Some(keep[0])),
            keep_v: fmt_code(Some(keep[1])),
            kw: qk[1].offset_from(&qk[0]).unwrap_or(0),
        };
        let binds = [q.bind(), k.bind(), v.bind(), p.bind(), y.bind(), qk[0].bind(), wv.bind()];
        launch(c, &kernel, a, words, Rotation::Off, &binds)?;
        let [wq, wk]: [GpuStorage; 2] = qk.try_into().unwrap_or_else(|_| unreachable!("two views"));
        Ok((y, [(wq, None), (wk, None), (wv, None)]))
    }

    /// One dispatch rotating q and k as it reads them, where the kernels
    /// fit and the tables share a buffer (as the model lays them out); else
    /// the composition.
    fn attention_rope(a: &Attention, r: Rotary, q: &Self, k: &Self, v: &Self, tables: [&Self; 2], keep: Option<RopeKeep>) -> Result<RopeOut<Self>> {
        let c = ctx()?;
        let n = a.heads * a.t * a.d;
        let one = tables[0].one_binding(tables[1]);
        let (Some(tb), true, true) = (one, fused_fits(c, a), n > 0 && a.tokens.is_some()) else {
            return rope_then_attention(a, r, [q, k, v], tables, keep);
        };
        let rope = Rotation::Load(r, tb);
        let y = GpuStorage::alloc(c, n)?;
        let p = GpuStorage::alloc(c, a.heads * a.t * a.t)?;
        let Some((fqk, fv)) = keep else {
            let kernel = specialised(c, FORWARD, a, [None; 3], rope);
            launch(c, &kernel, a, Words::default(), rope, &[q.bind(), k.bind(), v.bind(), p.bind(), y.bind()])?;
            return Ok((y, None));
        };
        // q's and k's rotated rows, float32 values or words, one buffer
        let len = if fqk.is_some() { n / 2 } else { n };
        let Some(qk) = GpuStorage::views(c, &[len, len])? else {
            return rope_then_attention(a, r, [q, k, v], tables, keep);
        };
        let wv = fv.map(|_| GpuStorage::alloc(c, n / 2)).transpose()?;
        let words = Words {
            keep: fmt_code(fqk),
            keep_v: fmt_code(fv),
            kw: qk[1].offset_from(&qk[0]).unwrap_or(0),
        };
        // without v's words, a stand-in never written: p, written already
        let wv_bind = wv.as_ref().unwrap_or(&p).bind();
        let kernel = specialised(c, KEEPING, a, [None; 3], rope);
        let binds = [q.bind(), k.bind(), v.bind(), p.bind(), y.bind(), qk[0].bind(), wv_bind];
        launch(c, &kernel, a, words, rope, &binds)?;
        let [wq, wk]: [GpuStorage; 2] = qk.try_into().unwrap_or_else(|_| unreachable!("two views"));
        Ok((y, Some(([(wq, None), (wk, None)], wv.map(|w| (w, None))))))
    }

    fn attention_backward(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>, g: &Self) -> Result<[Self; 3]> {
        let c = ctx()?;
        if !fused_fits(c, a) {
            return batched::backward(a, q, k, v, g);
        }
        backward(c, a, [q, k, v], g, Rotation::Off)
    }

    fn attention_rope_backward(a: &Attention, r: Rotary, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>, g: &Self, tables: [&Self; 2]) -> Result<[Self; 3]> {
        let c = ctx()?;
        let one = tables[0].one_binding(tables[1]);
        let (Some(tb), true, true) = (one, fused_fits(c, a), a.tokens.is_some()) else {
            return attention_then_rope_backward(a, r, [q, k, v], g, tables);
        };
        backward(c, a, [q, k, v], g, Rotation::Back(r, tb))
    }
}

/// The backward's two passes (rotating dq and dk back with `rope`).
fn backward(c: &Context, a: &Attention, [q, k, v]: [Arg<GpuStorage>; 3], g: &GpuStorage, rope: Rotation) -> Result<[GpuStorage; 3]> {
    let n = a.heads * a.t * a.d;
    let [dq, dk, dv] = [(); 3].map(|_| GpuStorage::alloc(c, n));
    let (dq, dk, dv) = (dq?, dk?, dv?);
    if n == 0 {
        return Ok([dq, dk, dv]);
    }
    let [p, ds] = [(); 2].map(|_| GpuStorage::alloc(c, a.heads * a.t * a.t));
    let (p, ds) = (p?, ds?);
    let halves = [q.1, k.1, v.1];
    let rows = specialised(c, ROWS, a, halves, rope);
    let binds = [q.0.bind(), k.0.bind(), v.0.bind(), p.bind(), ds.bind(), g.bind(), dq.bind()];
    launch(c, &rows, a, Words::default(), rope, &binds)?;
    let columns = specialised(c, COLUMNS, a, halves, rope);
    let binds = [q.0.bind(), p.bind(), ds.bind(), dk.bind(), dv.bind(), g.bind()];
    launch(c, &columns, a, Words::default(), rope, &binds)?;
    Ok([dq, dk, dv])
}
