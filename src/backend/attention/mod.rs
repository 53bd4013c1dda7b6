//! Causal self-attention's products and softmax over many heads: one
//! schedule per device of the same primitives.
//!
//! ## Contract
//! The composition, head by head (`Tensor::causal_attention` states it):
//! `p = causal_softmax(q kᵀ · scale)` and `y = p v`, backward `dv = pᵀ dy`,
//! `dp = dy vᵀ`, `ds = softmax_backward(p, dp) · scale`, `dq = ds k`,
//! `dk = dsᵀ q`, each product with its `Causal` mode and the autocast
//! rounding of [`matmul`](crate::backend::matmul) (the scores' products
//! `q kᵀ`, `dq`, `dk` at [`Attention::scores`], the others at
//! [`Attention::round`]), the softmax and its
//! backward those of [`reduce`](crate::backend::reduce). With
//! [`Attention::probs`], `p` is stored in that format — rounded to it, and
//! read as rounded by `p v`, `pᵀ dy` and the softmax backward — and `dp`,
//! the gradient arriving for `p`, is rounded to it before the softmax
//! backward. Heads share
//! nothing, so the order they run in changes no bit. Token-major values
//! ([`Attention::tokens`]) are the same computation on `v` permuted to
//! head-major, `y` and the gradients permuted back; the batched composition
//! has its products read and write them in place
//! ([`TokenMajor`](crate::backend::TokenMajor)) instead.
//!
//! With RoPE ([`AttentionOps::attention_rope`]), q and k come in token-major,
//! as the projections write them, and the contract is RoPE's pair into
//! head-major rows (each rotated value stored as the policy stores RoPE's
//! output), then the above; backward, the rotated rows' gradients stored so,
//! then RoPE's backward pair. The GPU rotates as its forward reads q and k
//! and rotates the gradients back in its backward passes; the others run the
//! composition.
//!
//! Attention is one primitive per direction ([`AttentionOps`]), dispatched
//! like every other, so a running [trace](crate::trace) records one entry on
//! every device and never changes which schedule runs:
//!
//! * the spec runs the batched composition ([`batched`]): a few primitives
//!   over all heads at once;
//! * the GPU runs its own kernels (`attention.wgsl`): forward one dispatch,
//!   backward two, each invocation one query's (or one key's) chains in the
//!   composition's orders, `p` and `ds` kept in a scratch between them (the
//!   composition where a row's loops would pass a software device's cap);
//! * the CPU runs one head's whole chain at a time on one thread, the heads
//!   split over the threads ([`cpu`]): a head's `T × T` scores and
//!   probabilities stay in cache instead of streaming `H · T²` values through
//!   memory between primitives, and token-major `v` and `y` are read and
//!   written in place of the permutes.

pub(crate) mod cpu;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;
mod spec;

use crate::backend::copy::CopyOps;
use crate::backend::elementwise::ElementwiseOps;
use crate::backend::fused::FusedOps;
use crate::backend::matmul::{Halves, MatmulOps};
use crate::backend::pack::{KeptCopy, PackOps, Packed};
use crate::backend::reduce::ReduceOps;
use crate::backend::round::Format;
use crate::backend::primitive;
use crate::backend::{Causal, MatmulDims, Operand, Storage, TokenMajor, UnaryOp};
use crate::Result;

/// Attention over `heads` heads of `(t, d)` queries, keys and values.
#[derive(Clone, Copy, Debug)]
pub struct Attention {
    pub heads: usize,
    pub t: usize,
    pub d: usize,
    /// The scores' scale (`> 0`, finite).
    pub scale: f32,
    /// The rounding of the products with `v` and `dy` (`p v`, `pᵀ dy`,
    /// `dy vᵀ`): the policy's `matmul` format.
    pub round: Option<Format>,
    /// The rounding of the scores' products (`q kᵀ`, `ds k`, `dsᵀ q`): the
    /// policy's `attention_scores` format.
    pub scores: Option<Format>,
    /// The format `p` is stored in (and `dp` rounded to): the policy's
    /// `attention_probs` format; `None`, float32.
    pub probs: Option<Format>,
    /// `Some(h)`: `v`, `y` and their gradients are token-major `(B, T, h,
    /// D)` (`heads = B·h`) instead of `(heads, T, D)` — as projections write
    /// and read them.
    pub tokens: Option<usize>,
}

/// An operand as a device holds it: its buffer, and the format of its words
/// when it is a 16-bit copy.
pub type Arg<'a, S> = (&'a S, Option<Format>);

/// `y`, and q's, k's and v's 16-bit words with how many values each
/// rounding changed (where the device counts).
pub type Keeping<S> = (S, [(S, Option<usize>); 3]);

/// RoPE on q and k as attention reads them ([`AttentionOps::attention_rope`]):
/// the format the policy stores the rotated values in (`None`, float32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotary {
    pub round: Option<Format>,
}

/// What [`AttentionOps::attention_rope`] keeps for backward, asked for as
/// `(qk, v)`: the rotated q and k packed to `qk` (float32 values where
/// `None`), and v packed to `v` where `Some`.
pub type RopeKeep = (Option<Format>, Option<Format>);

/// `y`, and where asked ([`RopeKeep`]) the rotated q and k head-major `(heads,
/// T, D)`, then v's words, each with how many values its rounding changed
/// (where the device counts).
pub type RopeOut<S> = (S, Option<([(S, Option<usize>); 2], Option<(S, Option<usize>)>)>);

/// The devices' attention (see the module docs for the contract).
pub trait AttentionOps: Sized {
    /// `y`, laid out as `v` is.
    fn attention(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>) -> Result<Self>;
    /// `[dq, dk, dv]` from the upstream gradient `g` (laid out as `y`).
    fn attention_backward(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>, g: &Self) -> Result<[Self; 3]>;
    /// [`attention`](Self::attention) of float32 `q`, `k` and `v`, and each
    /// packed as [`PackOps::pack`] packs it (`keep`: q's and k's format,
    /// then v's): the copies autograd keeps. A GPU writes them from the
    /// forward's dispatch.
    fn attention_keeping(a: &Attention, q: &Self, k: &Self, v: &Self, keep: [Format; 2]) -> Result<Keeping<Self>>
    where
        Self: PackOps,
    {
        forward_then_pack(a, q, k, v, keep)
    }
    /// [`attention`](Self::attention) of q and k rotated by RoPE: float32 `q`
    /// and `k` token-major like `v` (`a.tokens` is set), `tables` RoPE's cos
    /// and sin `(T, D)`. Bit for bit the composition: `rope_pair` into
    /// head-major rows, each rotated value stored as `r` says, then
    /// attention, then the packs `keep` asks for. A GPU rotates as it reads,
    /// the rotated rows existing only as backward keeps them.
    fn attention_rope(a: &Attention, r: Rotary, q: &Self, k: &Self, v: &Self, tables: [&Self; 2], keep: Option<RopeKeep>) -> Result<RopeOut<Self>>
    where
        Self: PackOps + FusedOps + ElementwiseOps,
    {
        rope_then_attention(a, r, [q, k, v], tables, keep)
    }
    /// [`attention_backward`](Self::attention_backward) of
    /// [`attention_rope`](Self::attention_rope): `q` and `k` rotated as it
    /// kept them; `[dq, dk, dv]`, dq and dk token-major, rotated back after
    /// the rotated values' gradients are stored as `r` says.
    fn attention_rope_backward(a: &Attention, r: Rotary, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>, g: &Self, tables: [&Self; 2]) -> Result<[Self; 3]>
    where
        Self: FusedOps + ElementwiseOps,
    {
        attention_then_rope_backward(a, r, [q, k, v], g, tables)
    }
}

/// [`AttentionOps::attention_rope`] as its composition.
pub(crate) fn rope_then_attention<S: AttentionOps + PackOps + FusedOps + ElementwiseOps>(
    a: &Attention,
    r: Rotary,
    [q, k, v]: [&S; 3],
    tables: [&S; 2],
    keep: Option<RopeKeep>,
) -> Result<RopeOut<S>> {
    let (qr, kr) = rotated(a, r, q, k, tables)?;
    let y = S::attention(a, (&qr, None), (&kr, None), (v, None))?;
    let Some((fqk, fv)) = keep else {
        return Ok((y, None));
    };
    let qk = match fqk {
        Some(f) => {
            let mut packed = S::pack_many(&[&qr, &kr], f)?.into_iter();
            let (Some(wq), Some(wk)) = (packed.next(), packed.next()) else {
                crate::bail!(Device, "pack_many: two buffers and fewer copies");
            };
            [wq, wk]
        }
        None => [(qr, None), (kr, None)],
    };
    Ok((y, Some((qk, fv.map(|f| v.pack(f)).transpose()?))))
}

/// [`AttentionOps::attention_rope_backward`] as its composition.
pub(crate) fn attention_then_rope_backward<S: AttentionOps + FusedOps + ElementwiseOps>(
    a: &Attention,
    r: Rotary,
    [q, k, v]: [Arg<S>; 3],
    g: &S,
    tables: [&S; 2],
) -> Result<[S; 3]> {
    let [dq, dk, dv] = S::attention_backward(a, q, k, v, g)?;
    // rounding twice is rounding once: what the scores' products stored at
    // the policy's format passes as it is
    let (dq, dk) = match r.round {
        Some(f) if a.scores != Some(f) => (dq.unary(UnaryOp::Round(f))?, dk.unary(UnaryOp::Round(f))?),
        _ => (dq, dk),
    };
    let (dq, dk) = dq.rope_backward_pair(&dk, tables[0], tables[1], (a.t, a.d, heads_of(a)?))?;
    Ok([dq, dk, dv])
}

/// The heads per token of an attention over token-major rows.
fn heads_of(a: &Attention) -> Result<usize> {
    match a.tokens {
        Some(h) => Ok(h),
        None => crate::bail!(Shape, "attention with RoPE reads q, k and v token-major"),
    }
}

/// q and k rotated into head-major rows, stored as `r` says.
fn rotated<S: FusedOps + ElementwiseOps>(a: &Attention, r: Rotary, q: &S, k: &S, tables: [&S; 2]) -> Result<(S, S)> {
    let (qr, kr) = q.rope_pair(k, tables[0], tables[1], (a.t, a.d, heads_of(a)?))?;
    match r.round {
        Some(f) => Ok((qr.unary(UnaryOp::Round(f))?, kr.unary(UnaryOp::Round(f))?)),
        None => Ok((qr, kr)),
    }
}

/// [`AttentionOps::attention_keeping`] as the forward, then the packs (q's
/// and k's together).
pub(crate) fn forward_then_pack<S: AttentionOps + PackOps>(
    a: &Attention,
    q: &S,
    k: &S,
    v: &S,
    keep: [Format; 2],
) -> Result<Keeping<S>> {
    let y = S::attention(a, (q, None), (k, None), (v, None))?;
    let mut qk = S::pack_many(&[q, k], keep[0])?.into_iter();
    let (Some(wq), Some(wk)) = (qk.next(), qk.next()) else {
        crate::bail!(Device, "pack_many: two buffers and fewer copies");
    };
    Ok((y, [wq, wk, v.pack(keep[1])?]))
}

impl Attention {
    /// `op(A) @ op(B)` per head, `op(A): (m, k)`, `op(B): (k, n)`.
    fn dims(&self, (m, k, n): (usize, usize, usize), ta: bool, tb: bool, causal: Causal) -> MatmulDims {
        MatmulDims {
            batch: self.heads,
            m,
            k,
            n,
            trans_a: ta,
            trans_b: tb,
            a_batch_stride: m * k,
            b_batch_stride: k * n,
            causal,
            tokens: Default::default(),
        }
    }

    fn describe(&self) -> String {
        let (h, t, d, s) = (self.heads, self.t, self.d, self.scale);
        let fmt = |f: Option<Format>| f.map_or("f32", Format::name);
        // the scores' and probabilities' formats only where a policy sets
        // them apart from the matmuls'
        let mut r = fmt(self.round).to_string();
        if self.scores != self.round {
            r += &format!(" scores {}", fmt(self.scores));
        }
        if let Some(p) = self.probs {
            r += &format!(" probs {p}");
        }
        format!("heads {h} t {t} d {d} scale {s:e} {r} tokens {:?}", self.tokens)
    }

    /// The FLOPs of the contract's composition (the roofline's count): the
    /// causal products' multiply-adds, twice, and the softmax's nominal
    /// per-element count ([`crate::roofline`]) over the `T × T` scores of
    /// each head. Backward reruns the scores and softmax, then four
    /// products and the softmax backward.
    pub(crate) fn flops(&self, backward: bool) -> f64 {
        let (t, d) = (self.t, self.d);
        let product = |mkn: (usize, usize, usize), c: Causal| self.dims(mkn, false, false, c).profiled().flops();
        let scores = product((t, d, t), Causal::Outputs);
        let rows = (self.heads * t * t) as f64;
        let softmax = rows * crate::roofline::SOFTMAX;
        let forward = scores + softmax + product((t, t, d), Causal::TermsUpToRow);
        match backward {
            false => forward,
            true => {
                let ((dv, dp), (dq, dk)) = (
                    (product((t, t, d), Causal::TermsFromRow), product((t, d, t), Causal::Outputs)),
                    (product((t, t, d), Causal::TermsUpToRow), product((t, t, d), Causal::TermsFromRow)),
                );
                scores + softmax + dv + dp + rows * crate::roofline::SOFTMAX_BACKWARD + dq + dk
            }
        }
    }

    /// `y (heads, T, D)` (or token-major, see [`tokens`](Self::tokens)).
    pub fn forward(&self, q: &Operand, k: &Operand, v: &Operand) -> Result<Storage> {
        let ((q, hq), (k, hk), (v, hv)) = (q.parts(), k.parts(), v.parts());
        let scope = crate::profile::scope_with_flops("attention", || self.flops(false));
        Ok(primitive!(profile scope, "attention", || self.describe(), [q, k, v] => |q, k, v| {
            AttentionOps::attention(self, (q, hq), (k, hk), (v, hv))
        }))
    }

    /// [`forward`](Self::forward) of float32 `q`, `k` and `v`, with their
    /// 16-bit copies (`keep`: q's and k's format, then v's) and how many
    /// values each rounding changed, as [`Storage::pack`] makes them.
    pub fn forward_keeping(&self, q: &Storage, k: &Storage, v: &Storage, keep: [Format; 2]) -> Result<(Storage, [KeptCopy; 3])> {
        let scope = crate::profile::scope_with_flops("attention", || self.flops(false));
        let describe = || format!("{} keeping {} {}", self.describe(), keep[0], keep[1]);
        let (y, words) = primitive!(profile scope, "attention", describe, [q, k, v] => |q, k, v| {
            AttentionOps::attention_keeping(self, q, k, v, keep)
        });
        let [(wq, cq), (wk, ck), (wv, cv)] = words;
        Ok((
            y,
            [
                (Packed::new(keep[0], q.len(), wq), cq),
                (Packed::new(keep[0], k.len(), wk), ck),
                (Packed::new(keep[1], v.len(), wv), cv),
            ],
        ))
    }

    /// [`forward`](Self::forward) of float32 `q` and `k` rotated by RoPE as
    /// they are read (q, k and v token-major; `tables` cos and sin), and
    /// where asked what backward keeps: the rotated q and k head-major, as
    /// the scores' products read them, and v's 16-bit copy
    /// ([`AttentionOps::attention_rope`]).
    #[allow(clippy::type_complexity)]
    pub fn forward_rope(
        &self,
        r: Rotary,
        [q, k, v]: [&Storage; 3],
        [cos, sin]: [&Storage; 2],
        keep: Option<RopeKeep>,
    ) -> Result<(Storage, Option<([Operand; 2], Option<KeptCopy>)>)> {
        let scope = crate::profile::scope_with_flops("attention", || self.flops(false));
        let describe = || format!("{} rope {:?} keeping {keep:?}", self.describe(), r.round);
        let (y, kept) = primitive!(profile scope, "attention", describe, [q, k, v, cos, sin] => |q, k, v, c, s| {
            AttentionOps::attention_rope(self, r, q, k, v, [c, s], keep)
        });
        let Some(([(wq, _), (wk, _)], wv)) = kept else {
            return Ok((y, None));
        };
        let fqk = keep.and_then(|k| k.0);
        let operand = |w: Storage, n: usize| match fqk {
            Some(f) => Operand::Half(Packed::new(f, n, w)),
            None => Operand::Values(w),
        };
        let v_words = match (wv, keep.and_then(|k| k.1)) {
            (Some((w, changed)), Some(f)) => Some((Packed::new(f, v.len(), w), changed)),
            _ => None,
        };
        Ok((y, Some(([operand(wq, q.len()), operand(wk, k.len())], v_words))))
    }

    /// [`backward`](Self::backward) of [`forward_rope`](Self::forward_rope):
    /// `q` and `k` as it kept them; dq and dk token-major, of the unrotated
    /// inputs.
    pub fn backward_rope(&self, r: Rotary, [q, k, v]: [&Operand; 3], g: &Storage, [cos, sin]: [&Storage; 2]) -> Result<[Storage; 3]> {
        let ((q, hq), (k, hk), (v, hv)) = (q.parts(), k.parts(), v.parts());
        let scope = crate::profile::scope_with_flops("attention backward", || self.flops(true));
        let describe = || format!("{} rope {:?}", self.describe(), r.round);
        Ok(primitive!(profile scope, "attention backward", describe, [q, k, v, g, cos, sin] => |q, k, v, g, c, s| {
            AttentionOps::attention_rope_backward(self, r, (q, hq), (k, hk), (v, hv), g, [c, s])
        }))
    }

    /// `[dq, dk, dv]` from the operands as the forward's products read them
    /// and the gradient `g` of `y`; `p` is recomputed, not kept.
    pub fn backward(&self, q: &Operand, k: &Operand, v: &Operand, g: &Storage) -> Result<[Storage; 3]> {
        let ((q, hq), (k, hk), (v, hv)) = (q.parts(), k.parts(), v.parts());
        let scope = crate::profile::scope_with_flops("attention backward", || self.flops(true));
        Ok(primitive!(profile scope, "attention backward", || self.describe(), [q, k, v, g] => |q, k, v, g| {
            AttentionOps::attention_backward(self, (q, hq), (k, hk), (v, hv), g)
        }))
    }
}

/// The batched composition on any device with the primitives it needs: the
/// contract itself (the spec runs it, the GPU where its kernels do not fit).
pub mod batched {
    use super::*;

    /// What the composition needs of a device.
    pub trait Device: MatmulOps + ReduceOps + CopyOps + PackOps + ElementwiseOps {}
    impl<S: MatmulOps + ReduceOps + CopyOps + PackOps + ElementwiseOps> Device for S {}

    /// A product with `v` or `dy`, at [`Attention::round`].
    fn product<S: Device>(a: &Attention, x: Arg<S>, y: Arg<S>, dims: MatmulDims) -> Result<S> {
        x.0.matmul(y.0, dims, Halves { a: x.1, b: y.1 }, a.round)
    }

    /// A product of the scores', at [`Attention::scores`].
    fn scores_product<S: Device>(a: &Attention, x: Arg<S>, y: Arg<S>, dims: MatmulDims) -> Result<S> {
        x.0.matmul(y.0, dims, Halves { a: x.1, b: y.1 }, a.scores)
    }

    /// `x` rounded to [`Attention::probs`] (the gradient arriving for `p`).
    fn stored<S: Device>(a: &Attention, x: S) -> Result<S> {
        match a.probs {
            Some(f) => x.unary(UnaryOp::Round(f)),
            None => Ok(x),
        }
    }

    /// `dims` with the operands and output marked `[a, b, c]` read and
    /// written token-major where [`Attention::tokens`] lays `v`, `y` and
    /// their gradients out so: the products read them in place.
    fn tokens(a: &Attention, dims: MatmulDims, [ta, tb, tc]: [bool; 3]) -> MatmulDims {
        let tokens = match a.tokens {
            Some(h) => TokenMajor {
                heads: h,
                a: ta,
                b: tb,
                c: tc,
            },
            None => TokenMajor::default(),
        };
        MatmulDims { tokens, ..dims }
    }

    /// `p (heads, T, T)`: the causal softmax of `q kᵀ`, on and below the
    /// diagonal — in 16 bits (its words, and their format) when
    /// [`Attention::probs`] stores it so: the products read it packed.
    fn probs<S: Device>(a: &Attention, q: Arg<S>, k: Arg<S>) -> Result<(S, Option<Format>)> {
        let t = a.t;
        let scores = scores_product(a, q, k, a.dims((t, a.d, t), false, true, Causal::Outputs))?;
        let p = scores.softmax_rows(a.heads * t, t, a.scale, true)?;
        match a.probs {
            Some(f) => Ok((p.pack(f)?.0, Some(f))),
            None => Ok((p, None)),
        }
    }

    /// `y = p v`, row `i` summing keys `j ≤ i`.
    pub fn forward<S: Device>(a: &Attention, q: Arg<S>, k: Arg<S>, v: Arg<S>) -> Result<S> {
        let (t, d) = (a.t, a.d);
        let (p, pf) = probs(a, q, k)?;
        // y (token-major as v) = p v
        let dims = tokens(a, a.dims((t, t, d), false, false, Causal::TermsUpToRow), [false, true, true]);
        product(a, (&p, pf), v, dims)
    }

    /// `[dq, dk, dv]`.
    pub fn backward<S: Device>(a: &Attention, q: Arg<S>, k: Arg<S>, v: Arg<S>, g: &S) -> Result<[S; 3]> {
        let (t, d) = (a.t, a.d);
        let (p, pf) = probs(a, q, k)?;
        let g = (g, None);
        // dv = pᵀ dy: key row j sums queries i ≥ j (dy and dv token-major as v)
        let dims = tokens(a, a.dims((t, t, d), true, false, Causal::TermsFromRow), [false, true, true]);
        let dv = product(a, (&p, pf), g, dims)?;
        // the softmax backward reads p's values
        let p = match pf {
            Some(f) => p.unpack(f, a.heads * t * t)?,
            None => p,
        };
        // dp = dy vᵀ on and below the diagonal; ds = softmax backward · scale
        let dims = tokens(a, a.dims((t, d, t), false, true, Causal::Outputs), [true, true, false]);
        let dp = stored(a, product(a, g, v, dims)?)?;
        let ds = p.softmax_rows_backward(&dp, a.heads * t, t, a.scale)?;
        drop((dp, p));
        // dq = ds k: row i sums keys j ≤ i; dk = dsᵀ q: key row j sums queries i ≥ j
        let dq = scores_product(a, (&ds, None), k, a.dims((t, t, d), false, false, Causal::TermsUpToRow))?;
        let dk = scores_product(a, (&ds, None), q, a.dims((t, t, d), true, false, Causal::TermsFromRow))?;
        Ok([dq, dk, dv])
    }
}
