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
//! bit for bit — without writing that buffer out.

pub(crate) mod cpu;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;
mod spec;

use super::pack::Packed;
use super::round::Format;
use super::primitive;
use super::Storage;
use crate::{bail, Result};

/// A batched matmul `C[b] = op(A[b]) @ op(B[b])`, `op(A)` of shape (m, k),
/// `op(B)` of shape (k, n). `trans_a` means A is stored (k, m); `trans_b`, B
/// stored (n, k). A batch stride of 0 broadcasts one matrix over the batch.
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
}

impl MatmulDims {
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
        let causal = match self.causal {
            Causal::No => String::new(),
            c => format!(" causal {c:?}"),
        };
        format!(
            "{}× ({}×{}){}·({}×{}){} {}{causal} (batch strides {}, {})",
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

/// The devices' products (see the module docs for the contract).
pub trait MatmulOps: Sized {
    fn matmul(&self, rhs: &Self, d: MatmulDims, halves: Halves, round: Option<Format>) -> Result<Self>;
    /// `e + c` for every output `c` of [`matmul`](Self::matmul) (no causal
    /// mask): the product's bits, then the elementwise sum's, `addend` first.
    fn matmul_add(&self, rhs: &Self, d: MatmulDims, halves: Halves, round: Option<Format>, addend: &Self)
        -> Result<Self>;
}

impl Storage {
    /// The contract's matmul; `self` is A, `rhs` is B.
    pub fn matmul(&self, rhs: &Storage, dims: MatmulDims, round: Option<Format>) -> Result<Storage> {
        Operand::Values(self.clone()).matmul(&Operand::Values(rhs.clone()), dims, round)
    }
}

impl Operand {
    /// The contract's matmul; `self` is A, `rhs` is B.
    pub fn matmul(&self, rhs: &Operand, dims: MatmulDims, round: Option<Format>) -> Result<Storage> {
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
        let ((a, ha), (b, hb)) = (self.parts(), rhs.parts());
        let halves = Halves { a: ha, b: hb };
        let scope = crate::profile::product_scope(dims.profiled());
        Ok(primitive!(profile scope, "matmul add", || dims.describe(round), [a, b, addend] => |a, b, e| {
            a.matmul_add(b, dims, halves, round, e)
        }))
    }
}
