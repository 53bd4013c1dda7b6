//! Matrix products. Under [`autocast`](crate::precision::autocast) every
//! product is `cast(cast(a) @ cast(b))`: operands rounded to the 16-bit format,
//! f32 accumulation in the contract's order, the output rounded once; its
//! backward products are rounded the same way (the gradient arrives through a
//! cast, so it is rounded too).

use super::arrived;
use crate::backend::round::Format;
use crate::backend::{MatmulDims, Operand, Product, Storage};
use crate::tensor::autocast::{
    autocast_dtype, cast_table, output_format, product_format, OpClass, Rule,
};
use crate::tensor::is_grad_enabled;
use crate::tensor::saved::{Arg, Keep, Saved};
use crate::tensor::shape::numel;
use crate::{bail, Result, Tensor};

/// `op(a) @ op(b)` over matching leading (batch) axes; `ta`/`tb` read the last
/// two axes transposed. `a: (.., m, k)` (or `(.., k, m)` when `ta`), `b: (.., k, n)`
/// (or `(.., n, k)` when `tb`) -> `(.., m, n)`: the values, their shape, and
/// the product's dims, with `addend`'s values added to the outputs if given
/// (see [`Operand::matmul_add`]). Nothing is recorded.
pub(crate) fn product(
    a: Arg,
    b: Arg,
    ta: bool,
    tb: bool,
    round: Option<Format>,
    addend: Option<&Storage>,
) -> Result<(Storage, Vec<usize>, MatmulDims)> {
    let (j, shape) = job(a, b, ta, tb, addend.cloned())?;
    Ok((j.run(round)?, shape, j.dims))
}

/// [`product`] as a [`Product`] to run, and its output's shape.
fn job(
    a: Arg,
    b: Arg,
    ta: bool,
    tb: bool,
    addend: Option<Storage>,
) -> Result<(Product, Vec<usize>)> {
    let (dims, shape) = product_dims(a.shape, b.shape, ta, tb)?;
    let job = Product {
        a: a.op,
        b: b.op,
        dims,
        addend,
    };
    Ok((job, shape))
}

/// The dims of [`product`] and its output's shape.
fn product_dims(a: &[usize], b: &[usize], ta: bool, tb: bool) -> Result<(MatmulDims, Vec<usize>)> {
    let (ra, rb) = (a.len(), b.len());
    if ra < 2 || rb < 2 {
        bail!(
            Shape,
            "matmul needs at least 2-d operands, got {a:?} and {b:?}"
        );
    }
    let (m, ka) = if ta {
        (a[ra - 1], a[ra - 2])
    } else {
        (a[ra - 2], a[ra - 1])
    };
    let (kb, n) = if tb {
        (b[rb - 1], b[rb - 2])
    } else {
        (b[rb - 2], b[rb - 1])
    };
    if ka != kb {
        bail!(
            Shape,
            "matmul: inner dimensions differ ({a:?}{} @ {b:?}{})",
            if ta { "ᵀ" } else { "" },
            if tb { "ᵀ" } else { "" }
        );
    }
    let k = ka;
    let (lead_a, lead_b) = (&a[..ra - 2], &b[..rb - 2]);
    let (batch, b_stride, lead) = if lead_b.is_empty() {
        (numel(lead_a), 0, lead_a.to_vec())
    } else if lead_a == lead_b {
        (numel(lead_a), k * n, lead_a.to_vec())
    } else {
        bail!(Shape, "matmul: batch axes {lead_a:?} and {lead_b:?} differ");
    };
    let dims = MatmulDims {
        batch,
        m,
        k,
        n,
        trans_a: ta,
        trans_b: tb,
        a_batch_stride: m * k,
        b_batch_stride: b_stride,
        causal: Default::default(),
        tokens: Default::default(),
    };
    let mut shape = lead;
    shape.extend([m, n]);
    Ok((dims, shape))
}

/// `op(a) @ op(b)` over matching leading (batch) axes, recorded for
/// backward; `ta`/`tb` read the last two axes transposed. `a: (.., m, k)`
/// (or `(.., k, m)` when `ta`), `b: (.., k, n)` (or `(.., n, k)` when `tb`)
/// -> `(.., m, n)`.
pub fn matmul_with(
    a: &Tensor,
    b: &Tensor,
    ta: bool,
    tb: bool,
    round: Option<Format>,
) -> Result<Tensor> {
    recorded(a, b, ta, tb, round, None)
}

/// [`matmul_with`], with `e`'s values added to the outputs when given (`e`
/// of the output's shape, a tensor other than `a` and `b`).
fn recorded(
    a: &Tensor,
    b: &Tensor,
    ta: bool,
    tb: bool,
    round: Option<Format>,
    e: Option<&Tensor>,
) -> Result<Tensor> {
    let addend = e.map(|e| e.storage());
    // The copy of `a` backward keeps, written by the product as it reads `a`.
    let keep = b
        .requires_grad()
        .then(|| Saved::to_pack(Keep::operand(a, round)))
        .flatten();
    let (s, shape, dims) = match keep {
        Some(f) if !ta => {
            let (dims, shape) = product_dims(a.shape(), b.shape(), ta, tb)?;
            let (s, (p, changed)) =
                a.storage()
                    .matmul_keeping_a(&b.storage(), dims, round, addend.as_ref(), f)?;
            Saved::adopt(a, p, changed)?;
            (s, shape, dims)
        }
        _ => product(a.arg(), b.arg(), ta, tb, round, addend.as_ref())?,
    };
    record(a, b, round, e, s, shape, dims)
}

/// The product `s` of [`recorded`]'s operands (of `dims`, `shape`) as a
/// tensor recorded for backward.
fn record(
    a: &Tensor,
    b: &Tensor,
    round: Option<Format>,
    e: Option<&Tensor>,
    s: Storage,
    shape: Vec<usize>,
    dims: MatmulDims,
) -> Result<Tensor> {
    // Keep each operand only if the other one needs a gradient, as backward
    // reads it: rounded to the format (in 16 bits) under autocast, read by
    // the backward products as it is kept.
    let (ra, rb) = (a.requires_grad(), b.requires_grad());
    let a_kept = rb.then(|| Saved::operand(a, round)).transpose()?;
    let b_kept = ra.then(|| Saved::operand(b, round)).transpose()?;
    let has_addend = e.is_some();
    let parents: Vec<&Tensor> = [a, b].into_iter().chain(e).collect();
    let back = ProductBackward {
        a_kept,
        b_kept,
        a_shape: a.shape().to_vec(),
        b_dims: b.dims(),
        dims,
        round,
    };
    let y = Tensor::record_gathering(s, shape, "matmul", &parents, move |g, gathered| {
        // each gradient is added into the one gathered for its operand so
        // far, as its product writes it (the sum autograd would form next):
        // a weight's, the `.grad` of earlier micro-batches
        let ea = back.b_kept.as_ref().and_then(|_| gathered.take(0));
        let eb = back.a_kept.as_ref().and_then(|_| gathered.take(1));
        let (ga, gb) = back.grads(g, ea, eb)?;
        // the addend's gradient: the sum's, g itself
        Ok([ga, gb]
            .into_iter()
            .chain(has_addend.then(|| Some(g.clone())))
            .collect())
    });
    // a sum with an addend is not a 16-bit value
    Ok(if has_addend { y } else { y.with_half(round) })
}

/// A product's backward: what it kept of each operand (each only where the
/// other needs a gradient) and what it was.
struct ProductBackward {
    a_kept: Option<Saved>,
    b_kept: Option<Saved>,
    a_shape: Vec<usize>,
    b_dims: usize,
    dims: MatmulDims,
    round: Option<Format>,
}

impl ProductBackward {
    /// dA (where B was kept) and dB (where A was) from `g`, the gradient of
    /// the output, each with the gradient gathered for its operand so far
    /// (`ea`, `eb`) added in as its product writes it; both as one
    /// primitive (one GPU dispatch) where both are wanted.
    fn grads(
        &self,
        g: &Tensor,
        ea: Option<Tensor>,
        eb: Option<Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let MatmulDims {
            m,
            k,
            n,
            trans_a: ta,
            trans_b: tb,
            ..
        } = self.dims;
        let (a_shape, round) = (&self.a_shape, self.round);
        let gd = g.arg();
        let earlier = ea.map(|e| e.storage());
        let ja = match &self.b_kept {
            None => None,
            Some(b) if !ta => Some(job(gd.clone(), b.arg(), false, !tb, earlier)?), // dA = dC op(B)ᵀ
            Some(b) => Some(job(b.arg(), gd.clone(), tb, true, earlier)?), // dA = (dC op(B)ᵀ)ᵀ = op(B) dCᵀ
        };
        let earlier = eb.map(|e| e.storage());
        let jb = match &self.a_kept {
            None => None,
            Some(a) => {
                // With b shared by the batch, fold the batch into the rows
                // (the same buffers, read as one matrix).
                let folded = self.b_dims == 2 && a_shape.len() > 2;
                let lead: usize = numel(&a_shape[..a_shape.len() - 2]);
                let (a_rows, g_rows) = ([lead * m, k], [lead * m, n]);
                // op(A) = Aᵀ per batch must be materialised before folding.
                let a_t = if folded && ta {
                    Some(a.get()?.transpose(-1, -2)?.storage())
                } else {
                    None
                };
                let a2 = match a_t {
                    Some(s) => Arg {
                        op: Operand::Values(s),
                        shape: &a_rows,
                    },
                    None if folded => Arg {
                        shape: &a_rows,
                        ..a.arg()
                    },
                    None => a.arg(),
                };
                let g2 = match folded {
                    true => Arg {
                        shape: &g_rows,
                        ..gd
                    },
                    false => gd,
                };
                let ta2 = ta && !folded;
                Some(if !tb {
                    job(a2, g2, !ta2, false, earlier)? // dB = op(A)ᵀ dC
                } else {
                    job(g2, a2, true, ta2, earlier)? // dB = (op(A)ᵀ dC)ᵀ = dCᵀ op(A)
                })
            }
        };
        // a rounded product is a 16-bit value (a sum with the earlier
        // gradient is not): an op that rounds the gradient arriving for its
        // output need not round it again
        let half = |j: &Product| if j.addend.is_none() { round } else { None };
        let grad = |s, shape: &[usize], h| {
            Ok::<_, crate::Error>(Tensor::from_storage(s, shape)?.with_half(h))
        };
        Ok(match (ja, jb) {
            (Some((ja, sa)), Some((jb, sb))) => {
                let (ha, hb) = (half(&ja), half(&jb));
                let [x, y] = Operand::matmul_pair([ja, jb], round)?;
                (Some(grad(x, &sa, ha)?), Some(grad(y, &sb, hb)?))
            }
            (ja, jb) => {
                let one = |j: Option<(Product, Vec<usize>)>| {
                    j.map(|(j, shape)| grad(j.run(round)?, &shape, half(&j)))
                        .transpose()
                };
                (one(ja)?, one(jb)?)
            }
        })
    }
}

impl Tensor {
    /// `self @ rhs` (batched over leading axes; a 2-d `rhs` is shared by the
    /// batch). Follows the thread's autocast state.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        matmul_with(self, rhs, false, false, autocast_dtype())
    }
    /// Attention's scores `self @ kᵀ` (before the scale): [`matmul_t`](Self::matmul_t)
    /// at the autocast policy's `attention_scores` format.
    pub fn attention_scores(&self, k: &Tensor) -> Result<Tensor> {
        matmul_with(
            self,
            k,
            false,
            true,
            product_format(OpClass::AttentionScores),
        )
    }
    /// `self @ rhsᵀ` without materialising the transpose (Linear's `x Wᵀ`).
    pub fn matmul_t(&self, rhs: &Tensor) -> Result<Tensor> {
        matmul_with(self, rhs, false, true, autocast_dtype())
    }
    /// `self @ wᵀ` for each of `ws` (2-d weights of one shape): the tensors
    /// [`matmul_t`](Self::matmul_t) gives, each recorded as its own product,
    /// computed as one primitive (`Operand::matmul_shared`: on a GPU one
    /// dispatch when the weights lie side by side, [`Tensor::colocate`]).
    pub fn matmul_t_shared(&self, ws: &[&Tensor]) -> Result<Vec<Tensor>> {
        let Some(w0) = ws.first() else {
            return Ok(Vec::new());
        };
        if ws.iter().any(|w| w.dims() != 2 || w.shape() != w0.shape()) {
            bail!(
                Shape,
                "matmul_t_shared: weights of shapes {:?}",
                ws.iter().map(|w| w.shape()).collect::<Vec<_>>()
            );
        }
        let round = autocast_dtype();
        let (dims, shape) = product_dims(self.shape(), w0.shape(), false, true)?;
        // one product per weight
        let rows = in_rows(dims);
        let storages: Vec<Storage> = ws.iter().map(|w| w.storage()).collect();
        // the copy of `self` backward keeps, written by the product
        let needed = ws.iter().any(|w| w.requires_grad());
        let keep = needed
            .then(|| Saved::to_pack(Keep::operand(self, round)))
            .flatten();
        let (outs, kept) = Operand::Values(self.storage()).matmul_shared(
            &storages.iter().collect::<Vec<_>>(),
            rows,
            round,
            keep,
        )?;
        if let Some((p, changed)) = kept {
            Saved::adopt(self, p, changed)?;
        }
        ws.iter()
            .zip(outs)
            .map(|(w, s)| record(self, w, round, None, s, shape.clone(), dims))
            .collect()
    }
    /// `e + self @ rhsᵀ` (a residual connection around a Linear): the bits
    /// of `e.residual_add(&self.matmul_t(rhs)?)`, its gradients too where nothing else
    /// adds into `self` or `rhs` between that sum and that product (as in
    /// the Llama, whose projections' inputs and weights feed nothing else).
    /// The product adds `e` as it writes its outputs (both devices); `e` of
    /// another shape, or one of the operands itself, takes the composition.
    pub fn matmul_t_add(&self, rhs: &Tensor, e: &Tensor) -> Result<Tensor> {
        if !adds_as_it_writes(&[self], rhs, e) {
            return e.residual_add(&self.matmul_t(rhs)?);
        }
        recorded(self, rhs, false, true, autocast_dtype(), Some(e))
    }

    /// `swiglu(self, up) @ wᵀ`, plus `e` when given (the Llama MLP's down
    /// projection of its gated activation, and the residual): the bits and
    /// gradients of `self.swiglu(&up)?.matmul_t(w)` (or
    /// [`matmul_t_add`](Self::matmul_t_add)). Without grad, or where autograd
    /// keeps 16-bit copies of all three — SwiGLU's output, the gate and up,
    /// under autocast with SwiGLU's output unrounded or rounded as the
    /// product rounds its operands — one primitive writes the product (and
    /// the copies), and SwiGLU's output is never whole in float32 (on a GPU
    /// the product computes it as it loads it: one dispatch for two).
    /// Elsewhere, that composition, the gate and up released before the
    /// product.
    pub fn swiglu_matmul_t(self, up: Tensor, w: &Tensor, e: Option<&Tensor>) -> Result<Tensor> {
        let gate = self;
        let round = autocast_dtype();
        let parents: Vec<&Tensor> = [&gate, &up, w].into_iter().chain(e).collect();
        let recording = is_grad_enabled() && parents.iter().any(|t| t.requires_grad());
        let keeps = |t: &Tensor| Saved::to_pack(Keep::values(t));
        // recorded, every copy backward keeps is 16-bit: the gate's and up's
        // (made here, not before) and SwiGLU's output's
        let keep = match round {
            Some(r) if recording => {
                [&gate, &up, w].iter().all(|t| t.requires_grad())
                    && keeps(&gate) == Some(r)
                    && keeps(&up) == Some(r)
            }
            _ => !recording,
        };
        // SwiGLU's output as the product reads it, whatever the policy stores
        let f = output_format(OpClass::Swiglu, &[&gate, &up]);
        let fused = keep
            && gate.shape() == up.shape()
            && (f.is_none() || f == round)
            && e.is_none_or(|e| adds_as_it_writes(&[&gate, &up], w, e));
        if !fused {
            let h = gate.swiglu(&up)?;
            drop(parents);
            drop((gate, up));
            return match e {
                Some(e) => h.matmul_t_add(w, e),
                None => h.matmul_t(w),
            };
        }
        let (dims, shape) = product_dims(gate.shape(), w.shape(), false, true)?;
        let rows = in_rows(dims);
        let addend = e.map(|e| e.storage());
        let keep = round.filter(|_| recording);
        let (c, kept) = gate.storage().swiglu_matmul(
            &up.storage(),
            &w.storage(),
            rows,
            round,
            addend.as_ref(),
            keep,
        )?;
        // a sum with an addend is not a 16-bit value
        let half = if e.is_some() { None } else { round };
        let Some([(h_words, _), (pg, cg), (pu, cu)]) = kept else {
            return Ok(Tensor::from_storage(c, &shape)?.with_half(half));
        };
        Saved::adopt(&gate, pg, cg)?;
        Saved::adopt(&up, pu, cu)?;
        let [gate_k, up_k] = Saved::all([Keep::values(&gate), Keep::values(&up)])?;
        let back = ProductBackward {
            a_kept: Some(Saved::Half {
                packed: h_words,
                shape: gate.shape().to_vec(),
            }),
            b_kept: Some(Saved::operand(w, round)?),
            a_shape: gate.shape().to_vec(),
            b_dims: w.dims(),
            dims,
            round,
        };
        let has_addend = e.is_some();
        let y =
            Tensor::record_gathering(c, shape, "swiglu matmul", &parents, move |g, gathered| {
                // SwiGLU's output has no other use: nothing gathered for it
                let eb = gathered.take(2);
                let (dh, dw) = back.grads(g, None, eb)?;
                // SwiGLU's output's copy goes before SwiGLU's backward runs,
                // as the product's node would have gone
                drop(back);
                let dh = arrived(&dh.expect("SwiGLU's output's gradient: w was kept"), f)?;
                let (dg, du) = gate_k
                    .arg()
                    .op
                    .swiglu_backward(&up_k.arg().op, &dh.storage())?;
                [dg, du]
                    .into_iter()
                    .map(|s| Tensor::from_storage(s, dh.shape()).map(Some))
                    .chain([Ok(dw)])
                    .chain(has_addend.then(|| Ok(Some(g.clone()))))
                    .collect()
            });
        Ok(y.with_half(half))
    }
}

/// `d`, of a batch of A's matrices times one shared B, as one product over
/// the batch folded into the rows: the same sums.
fn in_rows(d: MatmulDims) -> MatmulDims {
    MatmulDims {
        batch: 1,
        m: d.batch * d.m,
        a_batch_stride: 0,
        ..d
    }
}

/// Whether the product of `a`'s last one (`x`) and `w`ᵀ adds `e` as it
/// writes ([`Tensor::matmul_t_add`]): `e` of the output's shape, none of
/// `a` or `w` itself, and a residual sum the cast policy does not round on
/// its own.
fn adds_as_it_writes(a: &[&Tensor], w: &Tensor, e: &Tensor) -> bool {
    let x = a[a.len() - 1];
    let fits = x.dims() >= 2 && w.dims() == 2 && e.dtype() == x.dtype() && {
        let mut out = x.shape()[..x.dims() - 1].to_vec();
        out.push(w.shape()[0]);
        e.shape() == out.as_slice()
    };
    if !fits || a.iter().chain([&w]).any(|t| t.id() == e.id()) {
        return false;
    }
    let round = autocast_dtype();
    // A residual sum the policy stores in 16 bits is rounded on its own.
    let sum = cast_table().and_then(|t| match t.rule(OpClass::ResidualAdd) {
        Rule::F32 => None,
        Rule::Round(f) => Some(f),
        Rule::Follow => e.half().filter(|&f| Some(f) == round),
    });
    sum.is_none()
}
