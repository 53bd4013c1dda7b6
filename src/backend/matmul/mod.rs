//! Batched matrix products: `C[b] = op(A[b]) @ op(B[b])`, with transposed
//! operands read in place and, under autocast, rounding to bf16/fp16.
//!
//! ## Contract
//! Each output is `acc = +0.0; for p in 0..k ascending: acc = fma(a[i,p],
//! b[p,j], acc)`. With `round = Some(fmt)` both operands are rounded to `fmt`
//! as they are read and the output is rounded once. Tiling and threading may
//! split rows, columns and batches, never `k`; rounding is idempotent, so a
//! kernel may round an operand once when it loads (or packs) a tile.
//!
//! A [`Causal`] mask (attention's products, where `m` and the masked axis
//! index the same positions) leaves part of the work out, exactly:
//! `Outputs` writes `+0` for `c[i,j]` with `j > i` without computing it;
//! `TermsUpToRow` gives output row `i` only the terms `p ≤ i`, and
//! `TermsFromRow` only `p ≥ i`, each still ascending from `+0` — the terms
//! left out are not added at all (not added as zeros), so the result does not
//! depend on what the operands hold there.
//!
//! Either operand may be read from 16-bit storage (a [`Packed`] copy, the
//! one autograd keeps for backward): value `e` is `unpack`'s value `e`,
//! widened as it is read, so the product is the one over the unpacked buffer
//! bit for bit — without writing that buffer out. A product may also write
//! A's 16-bit copy as it reads A ([`Storage::matmul_keeping_a`]): the words
//! [`Storage::pack`] writes, whichever dispatch writes them.
//!
//! Two products may run as one primitive ([`Operand::matmul_pair`]: a
//! product's two gradients); each output is still its own product's chain.

pub(crate) mod cpu;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;
mod spec;

use super::copy::CopyOps;
use super::elementwise::{BinaryOp, ElementwiseOps};
use super::pack::{KeptCopy, PackOps, Packed};
use super::round::Format;
use super::BinaryLayout;
use super::primitive;
use super::Storage;
use crate::{bail, Result};

/// A batched matmul `C[b] = op(A[b]) @ op(B[b])`, `op(A)` of shape (m, k),
/// `op(B)` of shape (k, n). `trans_a` means A is stored (k, m); `trans_b`, B
/// stored (n, k). A batch stride of 0 broadcasts one matrix over the batch.
/// C's matrices are dense, one after another, unless `tokens` places them
/// (and A's or B's) otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a_batch_stride: usize,
    pub b_batch_stride: usize,
    pub causal: Causal,
    pub tokens: TokenMajor,
}

/// Token-major operands (none by default): attention's per-head products over the layout the
/// projections write and read. With `heads = h > 0`, matrix `bi = b·h + hh`
/// of an operand marked here lies in a `(B, R, h, S)` buffer (`R × S` the
/// matrix as stored) at `b·R·h·S + hh·S`, its rows `h·S` apart, instead of
/// at its batch stride with rows `S` apart. Where values lie changes no bit:
/// every output is still its one ascending chain.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenMajor {
    pub heads: usize,
    pub a: bool,
    pub b: bool,
    pub c: bool,
}

impl TokenMajor {
    pub(crate) fn any(&self) -> bool {
        self.a || self.b || self.c
    }
}

/// Where an operand's matrices lie in its buffer: matrix `bi` at
/// `(bi / heads)·outer + (bi % heads)·inner` ([`MatmulDims::heads`]), its
/// rows `row` elements apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub outer: usize,
    pub inner: usize,
    pub row: usize,
}

impl Placement {
    /// The first element of matrix `bi`.
    pub fn start(&self, bi: usize, heads: usize) -> usize {
        (bi / heads) * self.outer + (bi % heads) * self.inner
    }
}

impl MatmulDims {
    /// The ways the batch splits for [`placements`](Self::placements): the
    /// heads with token-major operands, 1 without.
    pub fn heads(&self) -> usize {
        self.tokens.heads.max(1)
    }

    /// Where A's, B's and C's matrices lie.
    pub fn placements(&self) -> [Placement; 3] {
        let h = self.heads();
        let (m, k, n) = (self.m, self.k, self.n);
        // each as stored: (rows, columns), batch stride, token-major
        let a = (if self.trans_a { (k, m) } else { (m, k) }, self.a_batch_stride, self.tokens.a);
        let b = (if self.trans_b { (n, k) } else { (k, n) }, self.b_batch_stride, self.tokens.b);
        let c = ((m, n), m * n, self.tokens.c);
        [a, b, c].map(|((r, s), stride, tokens)| match tokens {
            true => Placement {
                outer: r * h * s,
                inner: s,
                row: h * s,
            },
            false => Placement {
                outer: stride * h,
                inner: stride,
                row: s,
            },
        })
    }

    /// The same product over head-major copies of its token-major operands.
    fn head_major(&self) -> MatmulDims {
        let t = self.tokens;
        MatmulDims {
            a_batch_stride: if t.a { self.m * self.k } else { self.a_batch_stride },
            b_batch_stride: if t.b { self.k * self.n } else { self.b_batch_stride },
            tokens: TokenMajor::default(),
            ..*self
        }
    }

    /// An error unless `tokens` describes a split of the batch.
    fn check_tokens(&self) -> Result<()> {
        let t = self.tokens;
        if t.any() && (t.heads == 0 || !self.batch.is_multiple_of(t.heads)) {
            bail!(Shape, "matmul: token-major operands need heads dividing the batch ({} into {})", self.batch, t.heads);
        }
        Ok(())
    }

    /// The product's row in the profile: its shape and the multiply-adds
    /// actually done.
    pub(crate) fn profiled(&self) -> crate::profile::Product {
        crate::profile::Product {
            batch: self.batch,
            m: self.m,
            k: self.k,
            n: self.n,
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            macs: self.causal.macs(self.m, self.k, self.n),
        }
    }

    /// A short description, e.g. `2× (33×17)ᵀ·(17×35) bf16 causal Outputs
    /// (batch strides 561, 595)`: what a report or a trace shows.
    pub fn describe(&self, round: Option<Format>) -> String {
        let t = |on: bool| if on { "ᵀ" } else { "" };
        let tag = |on: bool, name: &'static str| if on { name } else { "" };
        let causal = match self.causal {
            Causal::No => String::new(),
            c => format!(" causal {c:?}"),
        };
        let tokens = match self.tokens {
            t if t.any() => format!(" token-major{}{}{} of {} heads", tag(t.a, " A"), tag(t.b, " B"), tag(t.c, " C"), t.heads),
            _ => String::new(),
        };
        format!(
            "{}× ({}×{}){}·({}×{}){} {}{causal} (batch strides {}, {}){tokens}",
            self.batch,
            self.m,
            self.k,
            t(self.trans_a),
            self.k,
            self.n,
            t(self.trans_b),
            round.map_or("f32", Format::name),
            self.a_batch_stride,
            self.b_batch_stride
        )
    }
}

/// Which part of a causal attention product is computed (see the contract).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Causal {
    /// The whole product.
    #[default]
    No,
    /// `c[i,j]` for `j ≤ i`; `+0` above the diagonal (scores `q kᵀ`, `dP = dY vᵀ`).
    Outputs,
    /// Row `i` sums the terms `p ≤ i` (`P v`, `dS k`: the operand's row is
    /// causally masked past the diagonal).
    TermsUpToRow,
    /// Row `i` sums the terms `p ≥ i` (`Pᵀ dY`, `dSᵀ q`).
    TermsFromRow,
}

impl Causal {
    /// The terms `[lo, hi)` that some row of `[i0, i1)` sums, out of `k`.
    pub fn terms(self, i0: usize, i1: usize, k: usize) -> (usize, usize) {
        match self {
            Causal::No | Causal::Outputs => (0, k),
            Causal::TermsUpToRow => (0, i1.min(k)),
            Causal::TermsFromRow => (i0.min(k), k),
        }
    }
    /// Whether output `(i, j)` sums term `p` (a masked output sums none: +0).
    pub fn includes(self, i: usize, j: usize, p: usize) -> bool {
        match self {
            Causal::No => true,
            Causal::Outputs => j <= i,
            Causal::TermsUpToRow => p <= i,
            Causal::TermsFromRow => p >= i,
        }
    }
    /// The multiply-adds of one `(m×k)·(k×n)` product with this mask.
    pub fn macs(self, m: usize, k: usize, n: usize) -> usize {
        if self == Causal::No {
            return m * k * n;
        }
        // row i's outputs × terms
        (0..m)
            .map(|i| match self {
                Causal::No => k * n,
                Causal::Outputs => (i + 1).min(n) * k,
                Causal::TermsUpToRow => (i + 1).min(k) * n,
                Causal::TermsFromRow => (k - i.min(k)) * n,
            })
            .sum()
    }
    /// The code of `matmul.wgsl`'s `CAUSAL` pipeline constant.
    pub fn code(self) -> u32 {
        self as u32
    }
}

/// Which operands a device reads from 16-bit storage, and in what format:
/// their buffers then hold words of two values each (see [`Packed`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Halves {
    pub a: Option<Format>,
    pub b: Option<Format>,
}

/// One product of [`Operand::matmul_pair`]: `a @ b` of `dims`, plus
/// `addend` when given.
pub struct Product {
    pub a: Operand,
    pub b: Operand,
    pub dims: MatmulDims,
    pub addend: Option<Storage>,
}

impl Product {
    /// This product alone: [`Operand::matmul`], or [`Operand::matmul_add`]
    /// with its addend.
    pub fn run(&self, round: Option<Format>) -> Result<Storage> {
        match &self.addend {
            Some(e) => self.a.matmul_add(&self.b, self.dims, round, e),
            None => self.a.matmul(&self.b, self.dims, round),
        }
    }
}

/// An operand of a product: a buffer of values, or a 16-bit copy (both
/// handles, cheap to clone).
#[derive(Clone, Debug)]
pub enum Operand {
    Values(Storage),
    Half(Packed),
}

impl Operand {
    /// The buffer the device reads, and the format of its words if 16-bit.
    pub(crate) fn parts(&self) -> (&Storage, Option<Format>) {
        match self {
            Operand::Values(s) => (s, None),
            Operand::Half(p) => (p.words(), Some(p.format())),
        }
    }

    /// How many values it holds.
    pub(crate) fn len(&self) -> usize {
        match self {
            Operand::Values(s) => s.len(),
            Operand::Half(p) => p.len(),
        }
    }
}

/// A product with token-major operands over head-major copies: each marked
/// operand copied head-major (a 16-bit one widened as it is read, which
/// changes no value the product reads), the dense product, its output copied
/// back token-major and the addend added (`e + c`, the sum the fused store
/// forms). The CPU's way: its attention, which reads token-major values in
/// place, never asks for it.
pub(crate) fn over_head_major<S>(a: &S, b: &S, d: MatmulDims, halves: Halves, round: Option<Format>, addend: Option<&S>) -> Result<S>
where
    S: MatmulOps + CopyOps + PackOps + ElementwiseOps,
{
    let (h, t) = (d.tokens.heads, d.tokens);
    let seqs = d.batch / h;
    // (B, R, h, S) read as (B, h, R, S)
    let gather = |x: &S, half: Option<Format>, (r, s): (usize, usize)| -> Result<S> {
        let (shape, strides) = ([seqs, h, r, s], [r * h * s, s, h * s, 1]);
        match half {
            Some(f) => x.unpack_strided(f, &shape, &strides, 0),
            None => x.strided_copy(&shape, &strides, 0),
        }
    };
    let (m, k, n) = (d.m, d.k, d.n);
    let stored_a = if d.trans_a { (k, m) } else { (m, k) };
    let stored_b = if d.trans_b { (n, k) } else { (k, n) };
    let a_copy = t.a.then(|| gather(a, halves.a, stored_a)).transpose()?;
    let b_copy = t.b.then(|| gather(b, halves.b, stored_b)).transpose()?;
    let (a, ha) = a_copy.as_ref().map_or((a, halves.a), |x| (x, None));
    let (b, hb) = b_copy.as_ref().map_or((b, halves.b), |x| (x, None));
    let (dense, halves) = (d.head_major(), Halves { a: ha, b: hb });
    if !t.c {
        return match addend {
            Some(e) => a.matmul_add(b, dense, halves, round, e),
            None => a.matmul(b, dense, halves, round),
        };
    }
    // (B, h, m, n) laid out as (B, m, h, n)
    let c = a
        .matmul(b, dense, halves, round)?
        .strided_copy(&[seqs, m, h, n], &[h * m * n, n, m * n, 1], 0)?;
    match addend {
        Some(e) => e.binary(&c, BinaryOp::Add, &BinaryLayout::flat(d.batch * m * n)),
        None => Ok(c),
    }
}

/// One product of [`MatmulOps::matmul_pair`]: `a·b` of `d`, read as
/// `halves` says, with `addend` added as [`MatmulOps::matmul_add`] adds it.
pub struct Job<'a, S> {
    pub a: &'a S,
    pub b: &'a S,
    pub d: MatmulDims,
    pub halves: Halves,
    pub addend: Option<&'a S>,
}

impl<S: MatmulOps> Job<'_, S> {
    /// This product alone.
    pub fn run(&self, round: Option<Format>) -> Result<S> {
        match self.addend {
            Some(e) => self.a.matmul_add(self.b, self.d, self.halves, round, e),
            None => self.a.matmul(self.b, self.d, self.halves, round),
        }
    }
}

/// The devices' products (see the module docs for the contract).
pub trait MatmulOps: Sized {
    fn matmul(&self, rhs: &Self, d: MatmulDims, halves: Halves, round: Option<Format>) -> Result<Self>;
    /// `e + c` for every output `c` of [`matmul`](Self::matmul) (no causal
    /// mask): the product's bits, then the elementwise sum's, `addend` first.
    fn matmul_add(&self, rhs: &Self, d: MatmulDims, halves: Halves, round: Option<Format>, addend: &Self)
        -> Result<Self>;
    /// [`matmul`](Self::matmul) of `self` with each of `rhs`, one unbatched
    /// product's dims `d` each (B not 16-bit), and with `keep`, `self` packed
    /// as [`PackOps::pack`] packs it; a GPU runs them as one product batched
    /// over `rhs` where they lie side by side in one buffer.
    #[allow(clippy::type_complexity)]
    fn matmul_shared(
        &self,
        rhs: &[&Self],
        d: MatmulDims,
        halves: Halves,
        round: Option<Format>,
        keep: Option<Format>,
    ) -> Result<(Vec<Self>, Option<(Self, Option<usize>)>)>
    where
        Self: PackOps,
    {
        let outs = rhs.iter().map(|b| self.matmul(b, d, halves, round)).collect::<Result<_>>()?;
        Ok((outs, keep.map(|f| self.pack(f)).transpose()?))
    }
    /// Two products, each [`Job::run`]'s bits: a product's two gradients,
    /// which a GPU runs as one dispatch where they share A.
    fn matmul_pair(jobs: [Job<'_, Self>; 2], round: Option<Format>) -> Result<[Self; 2]> {
        let [x, y] = jobs;
        Ok([x.run(round)?, y.run(round)?])
    }
    /// [`matmul`](Self::matmul) (or [`matmul_add`](Self::matmul_add) with
    /// `addend`) of float32 operands, and `self` packed to `keep` as
    /// [`PackOps::pack`] packs it: the 16-bit copy autograd keeps of an
    /// activation a product reads. A GPU writes the words from the product's
    /// own dispatch where A is dense.
    fn matmul_keeping_a(
        &self,
        rhs: &Self,
        d: MatmulDims,
        round: Option<Format>,
        addend: Option<&Self>,
        keep: Format,
    ) -> Result<(Self, (Self, Option<usize>))>
    where
        Self: PackOps,
    {
        let halves = Halves::default();
        let c = match addend {
            Some(e) => self.matmul_add(rhs, d, halves, round, e)?,
            None => self.matmul(rhs, d, halves, round)?,
        };
        Ok((c, self.pack(keep)?))
    }
}

impl Storage {
    /// The contract's matmul; `self` is A, `rhs` is B.
    pub fn matmul(&self, rhs: &Storage, dims: MatmulDims, round: Option<Format>) -> Result<Storage> {
        Operand::Values(self.clone()).matmul(&Operand::Values(rhs.clone()), dims, round)
    }

    /// [`matmul`](Self::matmul) (or [`Operand::matmul_add`] with `addend`)
    /// and A packed to `keep`, as one primitive: the product's bits, and the
    /// 16-bit copy and count of [`Storage::pack`] (on a GPU written by the
    /// product's dispatch where it can, instead of a pack of its own).
    pub fn matmul_keeping_a(
        &self,
        rhs: &Storage,
        dims: MatmulDims,
        round: Option<Format>,
        addend: Option<&Storage>,
        keep: Format,
    ) -> Result<(Storage, KeptCopy)> {
        dims.check_tokens()?;
        if addend.is_some_and(|e| dims.causal != Causal::No || e.len() != dims.batch * dims.m * dims.n) {
            bail!(Shape, "matmul_add: an addend for {} outputs ({:?})", dims.batch * dims.m * dims.n, dims.causal);
        }
        let name = if addend.is_some() { "matmul add" } else { "matmul" };
        let scope = crate::profile::product_scope(dims.profiled());
        let mut parts = vec![self, rhs];
        parts.extend(addend);
        let (c, (w, n)): (Storage, (Storage, Option<usize>)) = primitive!(profile scope, name, || dims.describe(round), slice &parts => |ds| {
            ds[0].matmul_keeping_a(ds[1], dims, round, ds.get(2).copied(), keep)
        });
        Ok((c, (Packed::new(keep, self.len(), w), n)))
    }
}

impl Operand {
    /// `self @ b` for each `b` of `rhs` (on `self`'s device, float32 values):
    /// the bits of [`matmul`](Self::matmul) of each, as one primitive (on a
    /// GPU one dispatch when the `rhs` are views of one buffer, evenly
    /// spaced: weights laid out together). `dims` is each product's,
    /// unbatched and dense. With `keep`, also `self` (float32 values) packed
    /// to that format, and how many values the rounding changed (the CPU's
    /// count, as [`Storage::pack`]).
    pub fn matmul_shared(
        &self,
        rhs: &[&Storage],
        dims: MatmulDims,
        round: Option<Format>,
        keep: Option<Format>,
    ) -> Result<(Vec<Storage>, Option<KeptCopy>)> {
        if dims.batch != 1 || dims.tokens.any() || rhs.is_empty() {
            bail!(Shape, "matmul_shared: one or more unbatched, dense products ({} of {dims:?})", rhs.len());
        }
        let (a, ha) = self.parts();
        if keep.is_some() && ha.is_some() {
            bail!(DType, "matmul_shared: only float32 values are kept in 16 bits");
        }
        let halves = Halves { a: ha, b: None };
        let all = MatmulDims { batch: rhs.len(), ..dims };
        let mut prof = crate::profile::product_scope(all.profiled());
        let mut parts = vec![a];
        parts.extend_from_slice(rhs);
        let (outs, kept): (Vec<Storage>, Option<(Storage, Option<usize>)>) = super::on_device!(slice &parts => |ds| {
            let (a, bs) = ds.split_first().expect("A and B");
            a.matmul_shared(bs, dims, halves, round, keep).map(|(v, k)| {
                (v.into_iter().map(super::Lift::lift).collect::<Vec<Storage>>(), k)
            })
        });
        let mut refs: Vec<&Storage> = outs.iter().collect();
        refs.extend(kept.as_ref().map(|(w, _)| w));
        prof.moved(|| super::traffic("matmul", &parts, &refs));
        super::observed("matmul", || all.describe(round), &refs)?;
        let kept = kept.zip(keep).map(|((w, n), f)| (Packed::new(f, a.len(), w), n));
        Ok((outs, kept))
    }

    /// Two products as one primitive, each the bits of
    /// [`matmul`](Self::matmul) (or [`matmul_add`](Self::matmul_add) with
    /// its addend) alone: a product's two gradients (on a GPU one dispatch
    /// where both read the same A).
    pub fn matmul_pair(jobs: [Product; 2], round: Option<Format>) -> Result<[Storage; 2]> {
        for j in &jobs {
            j.dims.check_tokens()?;
            let len = j.dims.batch * j.dims.m * j.dims.n;
            if j.addend.as_ref().is_some_and(|e| j.dims.causal != Causal::No || e.len() != len) {
                bail!(Shape, "matmul_add: an addend for {len} outputs ({:?})", j.dims.causal);
            }
        }
        let flops: f64 = jobs.iter().map(|j| j.dims.profiled().flops()).sum();
        let mut prof = crate::profile::scope_with_flops(crate::profile::MATMUL, || flops);
        let [(a0, h0), (b0, g0), (a1, h1), (b1, g1)] =
            [&jobs[0].a, &jobs[0].b, &jobs[1].a, &jobs[1].b].map(Operand::parts);
        let halves = [Halves { a: h0, b: g0 }, Halves { a: h1, b: g1 }];
        let mut parts = vec![a0, b0, a1, b1];
        let mut at = [None, None];
        for (i, j) in jobs.iter().enumerate() {
            if let Some(e) = &j.addend {
                at[i] = Some(parts.len());
                parts.push(e);
            }
        }
        let outs: [Storage; 2] = super::on_device!(slice &parts => |ds| {
            let job = |i: usize| Job { a: ds[2 * i], b: ds[2 * i + 1], d: jobs[i].dims, halves: halves[i], addend: at[i].map(|k| ds[k]) };
            MatmulOps::matmul_pair([job(0), job(1)], round)
        });
        let refs: Vec<&Storage> = outs.iter().collect();
        prof.moved(|| super::traffic("matmul", &parts, &refs));
        let describe = || format!("{} and {}", jobs[0].dims.describe(round), jobs[1].dims.describe(round));
        super::observed("matmul", describe, &refs)?;
        Ok(outs)
    }

    /// The contract's matmul; `self` is A, `rhs` is B.
    pub fn matmul(&self, rhs: &Operand, dims: MatmulDims, round: Option<Format>) -> Result<Storage> {
        dims.check_tokens()?;
        let ((a, ha), (b, hb)) = (self.parts(), rhs.parts());
        let halves = Halves { a: ha, b: hb };
        let scope = crate::profile::product_scope(dims.profiled());
        Ok(primitive!(profile scope, "matmul", || dims.describe(round), [a, b] => |a, b| {
            a.matmul(b, dims, halves, round)
        }))
    }

    /// `addend + self @ rhs`: every output of the contract's matmul with the
    /// addend's value added, `e + c` — the bits of the product followed by
    /// the elementwise sum (each device adds as the product writes its outputs).
    /// No causal mask.
    pub fn matmul_add(
        &self,
        rhs: &Operand,
        dims: MatmulDims,
        round: Option<Format>,
        addend: &Storage,
    ) -> Result<Storage> {
        let len = dims.batch * dims.m * dims.n;
        if dims.causal != Causal::No || addend.len() != len {
            bail!(Shape, "matmul_add: an addend of {} values for {len} outputs ({:?})", addend.len(), dims.causal);
        }
        dims.check_tokens()?;
        let ((a, ha), (b, hb)) = (self.parts(), rhs.parts());
        let halves = Halves { a: ha, b: hb };
        let scope = crate::profile::product_scope(dims.profiled());
        Ok(primitive!(profile scope, "matmul add", || dims.describe(round), [a, b, addend] => |a, b, e| {
            a.matmul_add(b, dims, halves, round, e)
        }))
    }
}
