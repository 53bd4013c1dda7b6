//! The GPU launcher of the matmul (`matmul.wgsl`): one pipeline per (variant,
//! format, mask, 16-bit operands, and transposes for the tiled one), a grid of 64×64-output
//! workgroups, batches past 65535 and `k` past [`PASS`] (or [`GUARD_PASS`]) split into
//! dispatches. The variant ([`Kernels`]) is `matmul` (register tiles, no
//! barriers: lavapipe) or `matmul_tiled` (operand tiles in workgroup memory:
//! hardware); both have the same grid and the same bits. A product's two
//! gradients, which read the same `dC`, may share one grid (`PAIR`).

use super::{Causal, Halves, Job, MatmulDims, MatmulOps};
use crate::backend::gpu::context::ctx;
use crate::backend::gpu::pipelines::{gpu_params, no_consts, Family, Kernel};
use crate::backend::gpu::variant::Kernels;
use crate::backend::gpu::{u32_of, GpuStorage};
use crate::backend::round::{fmt_code, Format};
use crate::{bail, Result};

gpu_params! {
    /// `matmul.wgsl` `MatmulParams`.
    pub struct MatmulParams {
        m: u32,
        k: u32,
        n: u32,
        trans_a: u32,
        trans_b: u32,
        fmt: u32,
        batch0: u32,
        p0: u32,
        p1: u32,
        last: u32,
        add: u32,
        heads: u32,
        a_bs: u32,
        a_hs: u32,
        a_ld: u32,
        b_bs: u32,
        b_hs: u32,
        b_ld: u32,
        c_bs: u32,
        c_hs: u32,
        c_ld: u32,
        keep_n: u32,
        split: u32,
        zero: u32,
        w2: u32,
    }
}

pub const FAMILY: Family = Family {
    name: "matmul",
    sources: &[
        include_str!("../../../shaders/exact.wgsl"),
        include_str!("../../../shaders/matmul.wgsl"),
    ],
    needs_math: true,
    consts: no_consts,
    entries: &["matmul", "matmul_tiled"],
    params: &[MatmulParams::LAYOUT],
};

/// Output columns of one matmul workgroup, either variant (matmul.wgsl: 8
/// invocations of `COLS`, or `TILE_MN`).
const MATMUL_COLS: usize = 64;
/// Output rows of one matmul workgroup (8 invocations of `ROWS`, or `TILE_MN`).
const MATMUL_ROWS: usize = 64;

/// Longest pass of a product (matmul.wgsl). Lavapipe (llvmpipe) stops a
/// shader silently after 65,535 loop iterations in all: `matmul` loops over
/// its row pairs at each of the pass's terms (5 iterations a term), and where
/// it keeps A's copy (`KEEP`) over half of `k` more.
pub const PASS: usize = 8192;

/// Longest pass of a guarded product (bf16 operands on a device whose `fma`
/// is not fused: `GUARD` in matmul.wgsl). Where a chain may have left f32's
/// normal range the kernel runs the pass again, a row at a time (8 rows):
/// with the first run, 13 iterations a term, which stay under lavapipe's
/// 65,535. The capstone's longest `k` (a micro-batch's 4,096 tokens) is
/// still one pass.
pub const GUARD_PASS: usize = 4096;

/// The longest pass of a product in `round` (see [`PASS`]).
fn pass(native_fma: bool, round: Option<Format>) -> usize {
    match guarded(native_fma, round) {
        true => GUARD_PASS,
        false => PASS,
    }
}

/// Whether a product runs guarded (`GUARD` in matmul.wgsl): bf16 operands,
/// whose products leave f32's normal range, on a device whose `fma` is not
/// fused (fp16 products never leave it).
pub(crate) fn guarded(native_fma: bool, round: Option<Format>) -> bool {
    !native_fma && round == Some(Format::Bf16)
}

/// The entry point of `variant`.
pub fn matmul_entry(variant: Kernels) -> &'static str {
    match variant {
        Kernels::Software => "matmul",
        Kernels::Hardware => "matmul_tiled",
    }
}

/// `variant`'s kernel (no pipeline constants) and its grid for the product
/// `d`, batches up to 65535 (x: column blocks, y: row blocks, z: batches).
pub fn matmul_launch(variant: Kernels, d: &MatmulDims) -> (Kernel, (usize, usize, usize)) {
    let grid = (d.n.div_ceil(MATMUL_COLS), d.m.div_ceil(MATMUL_ROWS), d.batch.min(65535));
    (Kernel::new(&FAMILY, matmul_entry(variant)), grid)
}

impl MatmulOps for GpuStorage {
    /// One dispatch where [`pair_dispatch`](GpuStorage::pair_dispatch) can;
    /// two otherwise.
    fn matmul_pair(jobs: [Job<'_, GpuStorage>; 2], round: Option<Format>) -> Result<[GpuStorage; 2]> {
        if let Some(outs) = GpuStorage::pair_dispatch(&jobs, round)? {
            return Ok(outs);
        }
        let [x, y] = jobs;
        Ok([x.run(round)?, y.run(round)?])
    }
    fn matmul_add(
        &self,
        rhs: &GpuStorage,
        d: MatmulDims,
        halves: Halves,
        round: Option<Format>,
        addend: &GpuStorage,
    ) -> Result<GpuStorage> {
        self.product(rhs, d, halves, round, Some(addend))
    }
    fn matmul(&self, rhs: &GpuStorage, d: MatmulDims, halves: Halves, round: Option<Format>) -> Result<GpuStorage> {
        self.product(rhs, d, halves, round, None)
    }
    /// One dispatch where A is dense ([`GpuStorage::keepable`]): the
    /// product's first column of workgroups writes A's words as it goes.
    fn matmul_keeping_a(
        &self,
        rhs: &GpuStorage,
        d: MatmulDims,
        round: Option<Format>,
        addend: Option<&GpuStorage>,
        keep: Format,
    ) -> Result<(GpuStorage, (GpuStorage, Option<usize>))> {
        let halves = Halves::default();
        if !self.keepable(&d) {
            let out = self.product(rhs, d, halves, round, addend)?;
            return Ok((out, crate::backend::pack::PackOps::pack(self, keep)?));
        }
        let c = ctx()?;
        let out = GpuStorage::alloc(c, d.batch * d.m * d.n)?;
        let words = GpuStorage::alloc(c, self.len().div_ceil(2))?;
        self.launch(rhs, d, halves, round, addend, &[&out], Some((&words, keep)), None)?;
        Ok((out, (words, None)))
    }
    /// Up to [`MAX_OUTS`] products a dispatch when `rhs` are views of one
    /// buffer evenly spaced ([`GpuStorage::spaced`]): one product batched
    /// over them (A broadcast, B `stride` elements apart), each batch's
    /// output its own buffer. Each output has the bits of its own product
    /// (batches never share sums).
    /// With `keep`, the first dispatch writes A's words too where A is dense.
    fn matmul_shared(
        &self,
        rhs: &[&GpuStorage],
        d: MatmulDims,
        halves: Halves,
        round: Option<Format>,
        keep: Option<Format>,
    ) -> Result<(Vec<GpuStorage>, Option<(GpuStorage, Option<usize>)>)> {
        let c = ctx()?;
        let same_len = rhs.iter().all(|b| b.len() == rhs[0].len());
        let stride = GpuStorage::spaced(rhs).filter(|_| same_len && rhs.len() > 1);
        let keep = keep.filter(|_| halves.a.is_none());
        let Some(stride) = stride.filter(|_| keep.is_none() || self.keepable(&d)) else {
            let outs = rhs.iter().map(|b| self.product(b, d, halves, round, None)).collect::<Result<_>>()?;
            let kept = keep.map(|f| crate::backend::pack::PackOps::pack(self, f)).transpose()?;
            return Ok((outs, kept));
        };
        let words = keep
            .map(|f| Ok::<_, crate::Error>((GpuStorage::alloc(c, self.len().div_ceil(2))?, f)))
            .transpose()?;
        let mut outs = Vec::with_capacity(rhs.len());
        for (g, group) in rhs.chunks(MAX_OUTS).enumerate() {
            let mine: Vec<GpuStorage> = (0..group.len())
                .map(|_| GpuStorage::alloc(c, d.m * d.n))
                .collect::<Result<_>>()?;
            let all = MatmulDims {
                batch: group.len(),
                a_batch_stride: 0,
                b_batch_stride: stride,
                ..d
            };
            let kept = words.as_ref().filter(|_| g == 0).map(|(w, f)| (w, *f));
            self.launch(group[0], all, halves, round, None, &mine.iter().collect::<Vec<_>>(), kept, None)?;
            outs.extend(mine);
        }
        Ok((outs, words.map(|(w, _)| (w, None))))
    }
}

/// `d`'s parameters for one pass over all of `k` from batch 0 (each output
/// to its own place, nothing kept).
fn params(d: &MatmulDims, round: Option<Format>, add: bool) -> Result<MatmulParams> {
    let [pa, pb, pc] = d.placements();
    Ok(MatmulParams {
        m: u32_of(d.m, "m")?,
        k: u32_of(d.k, "k")?,
        n: u32_of(d.n, "n")?,
        trans_a: d.trans_a as u32,
        trans_b: d.trans_b as u32,
        fmt: fmt_code(round),
        batch0: 0,
        p0: 0,
        p1: u32_of(d.k, "k")?,
        last: 1,
        add: add as u32,
        heads: u32_of(d.heads(), "heads")?,
        a_bs: u32_of(pa.outer, "batch stride")?,
        a_hs: u32_of(pa.inner, "head stride")?,
        a_ld: u32_of(pa.row, "row stride")?,
        b_bs: u32_of(pb.outer, "batch stride")?,
        b_hs: u32_of(pb.inner, "head stride")?,
        b_ld: u32_of(pb.row, "row stride")?,
        c_bs: u32_of(pc.outer, "batch stride")?,
        c_hs: u32_of(pc.inner, "head stride")?,
        c_ld: u32_of(pc.row, "row stride")?,
        keep_n: 0,
        split: 0,
        zero: 0,
        w2: 0,
    })
}

/// `d` with its batch folded into the rows where that leaves every value in
/// its place (A dense and untransposed, B broadcast): the same sums.
fn folded(d: MatmulDims) -> MatmulDims {
    let dense = !d.trans_a && d.b_batch_stride == 0 && d.a_batch_stride == d.m * d.k;
    match d.batch > 1 && dense && !d.tokens.any() && d.causal == Causal::No {
        true => MatmulDims {
            batch: 1,
            m: d.batch * d.m,
            a_batch_stride: 0,
            ..d
        },
        false => d,
    }
}

impl GpuStorage {
    /// The pair of [`MatmulOps::matmul_pair`] as one dispatch (`PAIR` in
    /// matmul.wgsl) where both read the same view of A in the same format,
    /// each is unbatched (or foldable), unmasked and one pass over `k`, and
    /// the second's B and addend, which the kernel binds writable, share no
    /// buffer with what the first reads. `None` where they do not.
    fn pair_dispatch(jobs: &[Job<'_, GpuStorage>; 2], round: Option<Format>) -> Result<Option<[GpuStorage; 2]>> {
        let c = ctx()?;
        let [x, y] = jobs;
        let (dx, dy) = (folded(x.d), folded(y.d));
        let pass = pass(c.native_fma, round);
        let one = |d: &MatmulDims| d.batch == 1 && d.k <= pass && d.causal == Causal::No && !d.tokens.any() && d.m * d.n > 0;
        let read: Vec<&GpuStorage> = [x.a, x.b].into_iter().chain(x.addend).collect();
        let apart = [y.b].into_iter().chain(y.addend).all(|w| read.iter().all(|r| !w.same_buffer(r)));
        let same_a = x.a.offset_from(y.a) == Some(0) && x.a.len() == y.a.len() && x.halves.a == y.halves.a;
        if !(same_a && one(&dx) && one(&dy) && apart) {
            return Ok(None);
        }
        let variant = Kernels::of(c);
        let (kernel, (gx0, gy0, _)) = matmul_launch(variant, &dx);
        let (_, (gx1, gy1, _)) = matmul_launch(variant, &dy);
        let (gx, gy) = (gx0.max(gx1), gy0 + gy1);
        if gx > 65535 || gy > 65535 {
            return Ok(None);
        }
        let kernel = kernel
            .with("FMT", fmt_code(round))
            .with("A_HALF", fmt_code(x.halves.a))
            .with("B_HALF", fmt_code(x.halves.b))
            .with("B2_HALF", fmt_code(y.halves.b))
            .with("GUARD", guarded(c.native_fma, round) as u32)
            .with("PAIR", 1);
        let outs = [GpuStorage::alloc(c, dx.m * dx.n)?, GpuStorage::alloc(c, dy.m * dy.n)?];
        let split = u32_of(gy0, "row blocks")?;
        let prms = [
            MatmulParams {
                split,
                ..params(&dx, round, x.addend.is_some())?
            },
            params(&dy, round, y.addend.is_some())?,
        ];
        // binding 4 is read only with the first's addend, 7 with the second's
        let e0 = x.addend.unwrap_or(x.a);
        let e1 = y.addend.unwrap_or(&outs[1]);
        let bufs = [x.a.bind(), x.b.bind(), outs[0].bind(), e0.bind(), outs[1].bind(), y.b.bind(), e1.bind()];
        c.dispatch(&kernel, &prms, &bufs, (gx as u32, gy as u32, 1))?;
        Ok(Some(outs))
    }
}

/// `A_SWIGLU` in matmul.wgsl: the up values (c1) beside the gate (A), and
/// where the gate's and up's words go when kept (c2, up's from the offset).
struct Gated<'a> {
    up: &'a GpuStorage,
    words: Option<(&'a GpuStorage, usize)>,
}

/// Outputs one matmul dispatch writes at most (`OUTS` in matmul.wgsl).
pub const MAX_OUTS: usize = 3;

impl GpuStorage {
    /// The product, `addend` added to its outputs in the last pass's stores.
    fn product(
        &self,
        rhs: &GpuStorage,
        d: MatmulDims,
        halves: Halves,
        round: Option<Format>,
        addend: Option<&GpuStorage>,
    ) -> Result<GpuStorage> {
        let out = GpuStorage::alloc(ctx()?, d.batch * d.m * d.n)?;
        self.launch(rhs, d, halves, round, addend, &[&out], None, None)?;
        Ok(out)
    }

    /// Whether the product `d` can write A's (`self`'s) words from its own
    /// dispatch (`keep_a` in matmul.wgsl): float32 values, untransposed and
    /// dense (one matrix broadcast, or the batch's one after another), and
    /// few enough words a workgroup that its loop stays under lavapipe's
    /// 65,535 iterations.
    fn keepable(&self, d: &MatmulDims) -> bool {
        let mk = d.m * d.k;
        let dense = (d.a_batch_stride == 0 && self.len() == mk) || (d.a_batch_stride == mk && self.len() == d.batch * mk);
        mk > 0 && !d.trans_a && !d.tokens.a && dense && d.k < 65536 && self.len() < (1 << 31)
    }

    /// SwiGLU of the gate `self` and `up` (of one length) as A of the
    /// product `d`, computed as the product loads it, and with `keep` the
    /// three 16-bit copies autograd keeps: SwiGLU's output (the product's
    /// A), the gate and up, each as
    /// [`PackOps::pack`](crate::backend::pack::PackOps::pack) packs it. One
    /// dispatch where A is [`keepable`](Self::keepable); `None` otherwise.
    #[allow(clippy::type_complexity)]
    pub(crate) fn swiglu_product(
        &self,
        up: &GpuStorage,
        rhs: &GpuStorage,
        d: MatmulDims,
        round: Option<Format>,
        addend: Option<&GpuStorage>,
        keep: Option<Format>,
    ) -> Result<Option<(GpuStorage, Option<[GpuStorage; 3]>)>> {
        let c = ctx()?;
        let n = self.len();
        // up is bound writable (c1): no other binding may share its buffer
        let shared = [self, rhs].into_iter().chain(addend).any(|r| r.same_buffer(up));
        // (no outputs: no workgroup would write the words)
        if !self.keepable(&d) || up.len() != n || shared || d.n == 0 {
            return Ok(None);
        }
        let Some(keep) = keep else {
            let out = GpuStorage::alloc(c, d.batch * d.m * d.n)?;
            let gated = Gated { up, words: None };
            self.launch(rhs, d, Halves::default(), round, addend, &[&out], None, Some(gated))?;
            return Ok(Some((out, None)));
        };
        let nw = n.div_ceil(2);
        // the gate's and up's words: views of one buffer (one binding), kept
        // by one node and released together
        let Some(gu) = GpuStorage::views(c, &[nw, nw])? else {
            return Ok(None);
        };
        let w2 = gu[1].offset_from(&gu[0]).expect("views of one buffer");
        let out = GpuStorage::alloc(c, d.batch * d.m * d.n)?;
        let words = GpuStorage::alloc(c, nw)?;
        let gated = Gated { up, words: Some((&gu[0], w2)) };
        self.launch(rhs, d, Halves::default(), round, addend, &[&out], Some((&words, keep)), Some(gated))?;
        let [g, u]: [GpuStorage; 2] = gu.try_into().ok().expect("two views");
        Ok(Some((out, Some([words, g, u]))))
    }

    /// Records the product's dispatches into `outs`: one buffer for all of
    /// `d`'s batches, or one buffer per batch (2 or 3 batches, no addend);
    /// with `kept`, A's words into its buffer (A [`keepable`](Self::keepable));
    /// with `gated`, A is SwiGLU's output (one output; its words and the
    /// gate's and up's with `kept`).
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        rhs: &GpuStorage,
        d: MatmulDims,
        halves: Halves,
        round: Option<Format>,
        addend: Option<&GpuStorage>,
        outs: &[&GpuStorage],
        kept: Option<(&GpuStorage, Format)>,
        gated: Option<Gated<'_>>,
    ) -> Result<()> {
        let c = ctx()?;
        let apart = outs.len() > 1;
        debug_assert!(!apart || (outs.len() == d.batch && d.batch <= MAX_OUTS && addend.is_none()));
        debug_assert!(gated.as_ref().is_none_or(|g| !apart && kept.is_some() == g.words.is_some() && halves == Halves::default()));
        if d.batch * d.m * d.n == 0 {
            return Ok(());
        }
        let variant = Kernels::of(c);
        let (kernel, (gx, gy, _)) = matmul_launch(variant, &d);
        if gx > 65535 || gy > 65535 {
            bail!(
                Device,
                "matmul of {}x{} outputs per batch is too large for one GPU dispatch",
                d.m,
                d.n
            );
        }
        // What changes the k loop's work is a pipeline constant (no branches
        // there); the layouts are too where the tiles are staged by them.
        let mut kernel = kernel
            .with("FMT", fmt_code(round))
            .with("CAUSAL", d.causal.code())
            .with("A_HALF", fmt_code(halves.a))
            .with("B_HALF", fmt_code(halves.b))
            .with("GUARD", guarded(c.native_fma, round) as u32)
            .with("OUTS", outs.len() as u32)
            .with("A_SWIGLU", gated.is_some() as u32)
            .with("KEEP", fmt_code(kept.map(|(_, f)| f)));
        if variant == Kernels::Hardware {
            kernel = kernel
                .with("TRANS_A", d.trans_a as u32)
                .with("TRANS_B", d.trans_b as u32);
        }
        // binding 4 is read only with `add`; A stands in for it otherwise
        let e = addend.unwrap_or(self);
        let pc = d.placements()[2];
        let pass = pass(c.native_fma, round);
        let mut b0 = 0usize;
        while b0 < d.batch {
            let nb = (d.batch - b0).min(65535);
            // k in passes of at most `pass` steps (see matmul.wgsl); at least one.
            let mut p0 = 0usize;
            loop {
                let p1 = (p0 + pass).min(d.k);
                let prm = MatmulParams {
                    batch0: b0 as u32,
                    p0: p0 as u32,
                    p1: p1 as u32,
                    last: (p1 == d.k) as u32,
                    c_bs: if apart { 0 } else { u32_of(pc.outer, "batch stride")? },
                    keep_n: u32_of(self.len(), "length")?,
                    w2: u32_of(gated.as_ref().and_then(|g| g.words).map_or(0, |(_, w2)| w2), "offset")?,
                    ..params(&d, round, addend.is_some())?
                };
                // with `gated`, c1 is up and c2 the gate's and up's words
                let out = |i: usize| match (&gated, i) {
                    (Some(g), 1) => g.up.bind(),
                    (Some(Gated { words: Some((w, _)), .. }), 2) => w.bind(),
                    _ => outs.get(i).unwrap_or(&outs[0]).bind(),
                };
                // binding 7 is written only with `keep`; C stands in otherwise
                let words = kept.map_or(out(0), |(w, _)| w.bind());
                c.dispatch(
                    &kernel,
                    &prm,
                    &[self.bind(), rhs.bind(), out(0), e.bind(), out(1), out(2), words],
                    (gx as u32, gy as u32, nb as u32),
                )?;
                p0 = p1;
                if p0 >= d.k {
                    break;
                }
            }
            b0 += nb;
        }
        Ok(())
    }
}
