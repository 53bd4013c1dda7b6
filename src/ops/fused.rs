//! Fused transformer ops: RMSNorm, SwiGLU, RoPE and softmax cross-entropy,
//! each one backend primitive forward and one backward (`backend::fused`),
//! the Llama's building blocks.
//!
//! Each gives bit for bit the values *and the gradients* of the composition
//! of single ops it replaces — kept below in [`reference`](mod@reference),
//! the definition the fused primitives are tested against. Gradients
//! include the order in which autograd adds a tensor's contributions (float
//! addition does not associate), and that is where the fused ops differ in
//! shape:
//!
//! * SwiGLU and cross-entropy: the composition hands each input one
//!   gradient, and so does the fused op — equal in any graph.
//! * RMSNorm: the composition's input feeds `x·r` and `x²`, whose gradients
//!   autograd adds in that order, each onto whatever `x` had gathered before.
//!   The fused op's backward takes what autograd gathered for `x` so far and
//!   returns it with the two added in that order, in the pass that computes
//!   them — the composition's sums, provided nothing else consuming `x` runs
//!   *between* the two (it cannot in the Llama: the residual branch that
//!   also reads `x` consumes the norm's output and runs before both).
//! * RoPE: the composition gives `x` three contributions (`x·cos` and one
//!   per half of `rotate_half`); the fused op gives their sum, formed in the
//!   same order, so it is exact where `x` has nothing else gathered before —
//!   as in the Llama, where `x` is a fresh view of the projected heads that
//!   only RoPE reads. (It could add into the gathered gradient as RMSNorm
//!   does, for a graph the model never builds.)

use super::{arrived, stored};
use crate::backend::Storage;
use crate::tensor::autocast::{output_format, OpClass};
use crate::tensor::saved::{Keep, Saved};
use crate::tensor::shape::numel;
use crate::{bail, Result, Tensor};

impl Tensor {
    /// RMSNorm over the last axis: `x: (.., d)`, `w: (d)` -> `(.., d)`,
    /// `y = x · rsqrt(mean(x²) + eps) · w` (`eps` narrowed to the dtype once).
    /// The composition's bits: [`reference::rms_norm`].
    pub fn rms_norm(&self, w: &Tensor, eps: f64) -> Result<Tensor> {
        let d = match self.shape().last() {
            Some(&d) if w.shape() == [d] => d,
            _ => bail!(
                Shape,
                "rms_norm: input {:?} and weight {:?}: the weight must be (d,) for an input (.., d)",
                self.shape(),
                w.shape()
            ),
        };
        let lead = self.shape()[..self.dims() - 1].to_vec();
        let rows = numel(&lead);
        let f = output_format(OpClass::RmsNorm, &[self]);
        let (y, rstd) = self.storage().rms_norm(&w.storage(), rows, d, eps)?;
        let y = stored(y, f)?;
        let (want_dx, want_dw) = (self.requires_grad(), w.requires_grad());
        let (x, wk) = (Saved::keep(self)?, w.detach());
        // x's gradient adds into what autograd gathered for it before this
        // node (see the module docs), the weight's into its `.grad` of
        // earlier micro-batches
        Ok(Tensor::record_gathering(
            y,
            self.shape().to_vec(),
            "rms_norm",
            &[self, w],
            move |g, gathered| {
                let g = &arrived(g, f)?;
                let x = x.get()?;
                let mut earlier = |i, wanted| {
                    if wanted {
                        gathered.take(i).map(|e| e.storage())
                    } else {
                        None
                    }
                };
                let (ex, ew) = (earlier(0, want_dx), earlier(1, want_dw));
                let (dx, dw) = x.storage().rms_norm_backward(
                    &wk.storage(),
                    &rstd,
                    &g.storage(),
                    ex.as_ref(),
                    ew.as_ref(),
                    &lead,
                    d,
                    want_dx,
                    want_dw,
                )?;
                let t = |s: Option<crate::backend::Storage>, shape: &[usize]| {
                    s.map(|s| Tensor::from_storage(s, shape)).transpose()
                };
                Ok(vec![t(dx, x.shape())?, t(dw, &[d])?])
            },
        )
        .with_half(f))
    }

    /// SwiGLU `silu(self) · up` (`self` the gate), elementwise over equal
    /// shapes. The composition's bits: [`reference::swiglu`].
    pub fn swiglu(&self, up: &Tensor) -> Result<Tensor> {
        if self.shape() != up.shape() {
            bail!(
                Shape,
                "swiglu: gate {:?} and up {:?} differ in shape",
                self.shape(),
                up.shape()
            );
        }
        let f = output_format(OpClass::Swiglu, &[self, up]);
        // the 16-bit copies backward keeps, written by the same primitive
        // (where the output is not rounded into a second buffer, which would
        // then be made while both copies are held)
        let y = match [Keep::values(self), Keep::values(up)].map(Saved::to_pack) {
            [Some(a), Some(b)] if a == b && f.is_none() => {
                let (y, [(pg, cg), (pu, cu)]) = self.storage().swiglu_keeping(&up.storage(), a)?;
                Saved::adopt(self, pg, cg)?;
                Saved::adopt(up, pu, cu)?;
                y
            }
            _ => self.storage().swiglu(&up.storage())?,
        };
        let y = stored(y, f)?;
        let [gate, upk] = Saved::all([Keep::values(self), Keep::values(up)])?;
        Ok(
            Tensor::record(y, self.shape().to_vec(), "swiglu", &[self, up], move |g| {
                let g = &arrived(g, f)?;
                // 16-bit kept operands are read as kept, never widened into a copy
                let (dg, du) = gate.arg().op.swiglu_backward(&upk.arg().op, &g.storage())?;
                Ok(vec![
                    Some(Tensor::from_storage(dg, g.shape())?),
                    Some(Tensor::from_storage(du, g.shape())?),
                ])
            })
            .with_half(f),
        )
    }

    /// Rotary position embedding (rotate-half, Hugging Face's pairs
    /// `(i, i + D/2)`): `x: (.., T, D)`, `cos, sin: (T, D)` ->
    /// `x·cos + rotate_half(x)·sin`. The tables are constants: they get no
    /// gradient. The composition's bits: [`reference::rope`].
    pub fn rope(&self, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let r = self.dims();
        if r < 2 {
            bail!(
                Shape,
                "rope: input {:?} needs axes (.., T, D)",
                self.shape()
            );
        }
        let (t, d) = (self.shape()[r - 2], self.shape()[r - 1]);
        self.rope_into(cos, sin, (t, d, 1), self.shape().to_vec())
    }

    /// RoPE into attention's layout: `x: (B, T, H·D)`, as a projection
    /// writes it, -> `(B, H, T, D)`, every head rotated at its position;
    /// `cos, sin: (T, D)`. Bit for bit [`rope`](Self::rope) of
    /// `x.reshape(&[B, T, H, D])?.permute(&[0, 2, 1, 3])`, forward and
    /// backward, without the permute's pass over the values.
    pub fn rope_heads(&self, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, t, d) = self.heads_dims(heads)?;
        self.rope_into(cos, sin, (t, d, heads), vec![b, heads, t, d])
    }

    /// `(B, T, D)` of `self: (B, T, H·D)` with `H = heads`.
    fn heads_dims(&self, heads: usize) -> Result<(usize, usize, usize)> {
        let s = self.shape();
        if s.len() != 3 || heads == 0 || !s[2].is_multiple_of(heads) {
            bail!(
                Shape,
                "rope_heads: input {s:?} needs axes (B, T, H·D) with H = {heads} heads"
            );
        }
        Ok((s[0], s[1], s[2] / heads))
    }

    /// [`rope_heads`](Self::rope_heads) of `self` and `other` (of one
    /// shape: attention's q and k), bit for bit, as one primitive (on a GPU
    /// one dispatch for both).
    pub fn rope_heads_pair(
        &self,
        other: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        heads: usize,
    ) -> Result<(Tensor, Tensor)> {
        if other.shape() != self.shape() {
            bail!(
                Shape,
                "rope_heads_pair: inputs {:?} and {:?} differ in shape",
                self.shape(),
                other.shape()
            );
        }
        let (b, t, d) = self.heads_dims(heads)?;
        let dims = (t, d, heads);
        self.check_rope(cos, sin, dims)?;
        let (y0, y1) = self.storage().rope_pair(
            &other.storage(),
            &cos.storage(),
            &sin.storage(),
            t,
            d,
            heads,
        )?;
        let shape = vec![b, heads, t, d];
        let (q, k) = (
            self.rope_node(y0, cos, sin, dims, shape.clone())?,
            other.rope_node(y1, cos, sin, dims, shape)?,
        );
        // both backwards as one primitive once both gradients are in
        let (fq, fk) = (
            output_format(OpClass::Rope, &[self]),
            output_format(OpClass::Rope, &[other]),
        );
        let (c, s) = (cos.storage(), sin.storage());
        let in_shape = self.shape().to_vec();
        crate::tensor::autograd::join(
            &q,
            &k,
            Box::new(move |gq, gk| {
                let (gq, gk) = (arrived(gq, fq)?, arrived(gk, fk)?);
                let (dq, dk) =
                    gq.storage()
                        .rope_backward_pair(&gk.storage(), &c, &s, t, d, heads)?;
                Ok([
                    vec![Some(Tensor::from_storage(dq, &in_shape)?)],
                    vec![Some(Tensor::from_storage(dk, &in_shape)?)],
                ])
            }),
        );
        Ok((q, k))
    }

    /// [`rope`](Self::rope) and [`rope_heads`](Self::rope_heads): token-major
    /// rows of `heads` per position into `shape`, head-major.
    fn rope_into(
        &self,
        cos: &Tensor,
        sin: &Tensor,
        (t, d, heads): (usize, usize, usize),
        shape: Vec<usize>,
    ) -> Result<Tensor> {
        self.check_rope(cos, sin, (t, d, heads))?;
        let y = self
            .storage()
            .rope(&cos.storage(), &sin.storage(), t, d, heads)?;
        self.rope_node(y, cos, sin, (t, d, heads), shape)
    }

    fn check_rope(
        &self,
        cos: &Tensor,
        sin: &Tensor,
        (t, d, _): (usize, usize, usize),
    ) -> Result<()> {
        if cos.shape() != [t, d] || sin.shape() != cos.shape() {
            bail!(
                Shape,
                "rope: input {:?} needs tables of ({t}, {d}) (positions, head dimension), got cos {:?} and sin {:?}",
                self.shape(),
                cos.shape(),
                sin.shape()
            );
        }
        if !d.is_multiple_of(2) {
            bail!(
                Shape,
                "rope needs an even head dimension (it rotates pairs (i, i + D/2)), got {:?}",
                self.shape()
            );
        }
        if cos.requires_grad() || sin.requires_grad() {
            bail!(
                Shape,
                "rope: the cos/sin tables are constants here (no gradient flows to them); use reference::rope to differentiate them"
            );
        }
        Ok(())
    }

    /// The rotated values `y` of `self` as a node of the graph: stored as
    /// the policy says, its backward RoPE's.
    fn rope_node(
        &self,
        y: Storage,
        cos: &Tensor,
        sin: &Tensor,
        (t, d, heads): (usize, usize, usize),
        shape: Vec<usize>,
    ) -> Result<Tensor> {
        // the tables are constants cast to x's format: only x is followed
        let f = output_format(OpClass::Rope, &[self]);
        let y = stored(y, f)?;
        let (c, s) = (cos.storage(), sin.storage());
        let in_shape = self.shape().to_vec();
        Ok(Tensor::record(y, shape, "rope", &[self], move |g| {
            let dx = arrived(g, f)?
                .storage()
                .rope_backward(&c, &s, t, d, heads)?;
            Ok(vec![Some(Tensor::from_storage(dx, &in_shape)?)])
        })
        .with_half(f))
    }
}

/// Softmax cross-entropy averaged over rows,
/// `mean_r (logsumexp(row r) − row r[target r])`: `logits: (n, v)`,
/// `targets: n ids < v` -> a 0-d tensor. One primitive each way, taking the
/// ids as they are; the composition's bits: [`reference::cross_entropy`].
/// Errors if `logits` is not `(n, v)` with `n = targets.len()`, or a target
/// is `>= v`.
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    check_cross_entropy(logits, targets)?;
    let v = logits.shape()[1];
    let f = output_format(OpClass::CrossEntropy, &[logits]);
    // the 16-bit copy backward keeps, written by the same primitive
    let (loss, stats) = match Saved::to_pack(Keep::values(logits)) {
        Some(keep) => {
            let (loss, stats, (p, changed)) =
                logits.storage().cross_entropy_keeping(targets, v, keep)?;
            Saved::adopt(logits, p, changed)?;
            (loss, stats)
        }
        None => logits.storage().cross_entropy(targets, v)?,
    };
    let loss = stored(loss, f)?;
    let x = Saved::keep(logits)?;
    let (ids, shape) = (targets.to_vec(), logits.shape().to_vec());
    Ok(
        Tensor::record(loss, vec![], "cross_entropy", &[logits], move |g| {
            // 16-bit kept logits are read as kept, never widened into a copy
            let dx =
                x.arg()
                    .op
                    .cross_entropy_backward(&ids, &stats, &arrived(g, f)?.storage(), v)?;
            Ok(vec![Some(Tensor::from_storage(dx, &shape)?)])
        })
        .with_half(f),
    )
}

fn check_cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<()> {
    if logits.dims() != 2 || logits.shape()[0] != targets.len() {
        bail!(
            Shape,
            "cross_entropy: logits {:?} need shape (n, v) with n = {} targets",
            logits.shape(),
            targets.len()
        );
    }
    let v = logits.shape()[1];
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
        bail!(
            Index,
            "cross_entropy: target {t} out of range for {v} classes"
        );
    }
    Ok(())
}

/// The compositions of single ops the fused ops replace: the definition of
/// their values and gradients, bit for bit (`tests/fused.rs` holds them to it).
pub mod reference {
    use super::check_cross_entropy;
    use crate::{bail, Result, Tensor};

    /// `x / √(mean(x²) + eps) · w` over the last axis.
    pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
        let r = x.square()?.mean(-1, true)?.add_scalar(eps)?.rsqrt()?;
        x.mul(&r)?.mul(w)
    }

    /// `silu(gate) · up`.
    pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        gate.silu()?.mul(up)
    }

    /// `rotate_half(x) = cat(−x₂, x₁)` over the last axis, `x₁`/`x₂` its halves
    /// (Hugging Face's convention: pairs are `(i, i + D/2)`, not adjacent).
    pub fn rotate_half(x: &Tensor) -> Result<Tensor> {
        let d = *x.shape().last().unwrap_or(&0);
        if !d.is_multiple_of(2) {
            bail!(
                Shape,
                "rotate_half needs an even last axis, got {:?}",
                x.shape()
            );
        }
        let x1 = x.narrow(-1, 0, d / 2)?;
        let x2 = x.narrow(-1, d / 2, d / 2)?;
        Tensor::cat(&[&x2.neg()?, &x1], -1)
    }

    /// `x · cos + rotate_half(x) · sin`: `x: (.., T, D)`, `cos, sin: (T, D)`.
    pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        x.mul(cos)?.add(&rotate_half(x)?.mul(sin)?)
    }

    /// `log_softmax`, the target entries picked with the embedding gather
    /// (rows of width 1), summed, divided by `n`, negated.
    pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
        check_cross_entropy(logits, targets)?;
        let (n, v) = (logits.shape()[0], logits.shape()[1]);
        let lsm = logits.log_softmax()?.reshape(&[n * v, 1])?;
        let ids: Vec<u32> = targets
            .iter()
            .enumerate()
            .map(|(r, &t)| (r * v) as u32 + t)
            .collect();
        lsm.embedding(&ids)?.sum_all()?.div_scalar(n as f64)?.neg()
    }
}
