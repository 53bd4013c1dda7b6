//! Causal self-attention as one op: `y = softmax(q kᵀ · scale + mask) v`,
//! forward and backward side by side, with every product leaving out the
//! masked half (`Causal` matmuls) — about half of attention's arithmetic.
//!
//! It runs the composition `q.matmul_t(k)?.causal_softmax(scale)?.matmul(v)`
//! primitive for primitive (scheduled per device by the backend's
//! `attention` family: the GPU batches all heads into
//! each primitive, the CPU runs each head's chain in cache): the same
//! products over the same terms in the same
//! order (rounded alike under autocast), the same fused softmax and softmax
//! backward. What it leaves out are products by the probabilities' masked
//! entries, which are exactly +0, and the scores and `dP` entries past the
//! diagonal, which the softmax and its backward never use; so for finite
//! inputs its values and gradients are the composition's bit for bit — the one
//! exception being a zero's sign where a sum underflows to −0 before a masked
//! term (the composition then adds a ±0 the fused op skips).
//!
//! For backward it keeps q, k and v — as the products read them: rounded, in
//! 16 bits, under autocast — and recomputes the probabilities from them with
//! the forward's primitives (the composition keeps the probabilities too).
//! With RoPE inside (`causal_attention_rope`) it keeps the rotated q and k
//! the same way, and no rotated copy exists besides.

use crate::backend::attention::{Attention, Rotary};
use crate::backend::{Operand, Storage};
use crate::tensor::autocast::{autocast_dtype, cast_table, output_format, product_format, OpClass};
use crate::tensor::is_grad_enabled;
use crate::tensor::saved::{Keep, Saved};
use crate::tensor::shape::numel;
use crate::{bail, Result, Tensor};

impl Tensor {
    /// Causal self-attention `softmax(q kᵀ · scale + mask) v` for
    /// `q = self, k, v: (.., T, D) -> (.., T, D)`: position `i` attends to
    /// keys `j ≤ i`. Follows the thread's autocast state like the matmuls it
    /// replaces. `scale > 0` (usually `1/√D`).
    pub fn causal_attention(&self, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        let q = self;
        if q.dims() < 2 || k.shape() != q.shape() || v.shape() != q.shape() {
            bail!(
                Shape,
                "causal_attention needs q, k, v of one shape (.., T, D), got {:?}, {:?}, {:?}",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        q.attention(k, v, scale, None)
    }

    /// [`causal_attention`](Self::causal_attention) with the values and the
    /// output token-major, as projections write and read them: `q = self, k:
    /// (B, H, T, D)`, `v: (B, T, H, D) -> (B, T, H, D)`. Bit for bit
    /// `q.causal_attention(k, &v.permute(&[0, 2, 1, 3])?, scale)?.permute(&[0,
    /// 2, 1, 3])`; every device reads `v` and writes `y` (and their
    /// gradients) in place of those permutes.
    pub fn causal_attention_tokens(&self, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        let q = self;
        let qs = q.shape();
        if q.dims() != 4 || k.shape() != qs || v.shape() != [qs[0], qs[2], qs[1], qs[3]] {
            bail!(
                Shape,
                "causal_attention_tokens needs q, k of shape (B, H, T, D) and v of shape (B, T, H, D), got {:?}, {:?}, {:?}",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        q.attention(k, v, scale, Some(qs[1]))
    }

    /// The op over checked shapes; `tokens` as [`Attention::tokens`].
    fn attention(
        &self,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        tokens: Option<usize>,
    ) -> Result<Tensor> {
        let q = self;
        let r = q.dims();
        let att = plan(
            numel(&q.shape()[..r - 2]),
            (q.shape()[r - 2], q.shape()[r - 1]),
            scale,
            tokens,
        )?;
        let (round, scores) = (att.round, att.scores);
        let recorded = is_grad_enabled() && [q, k, v].iter().any(|t| t.requires_grad());
        // q and k as the scores' products read them, v as p v does: the
        // copies backward keeps, written by the forward's own primitive
        // where none is made yet (of three tensors, each its own copy)
        let to_pack = [(q, scores), (k, scores), (v, round)]
            .map(|(t, f)| Saved::to_pack(Keep::operand(t, f)));
        let apart = q.id() != k.id() && k.id() != v.id() && q.id() != v.id();
        let y = match to_pack {
            [Some(fq), Some(fk), Some(fv)] if recorded && apart && fq == fk => {
                let (y, [wq, wk, wv]) =
                    att.forward_keeping(&q.storage(), &k.storage(), &v.storage(), [fq, fv])?;
                for (t, (w, changed)) in [q, k, v].into_iter().zip([wq, wk, wv]) {
                    Saved::adopt(t, w, changed)?;
                }
                y
            }
            _ => att.forward(&q.arg().op, &k.arg().op, &Operand::Values(v.storage()))?,
        };
        // Backward recomputes p rather than keeping it (H·T² values, more
        // than q, k and v together): the same primitives on the same
        // operands, so the same bits.
        let kept = if recorded {
            // q and k as the scores' products read them, v as p v does
            Some(Saved::all([
                Keep::operand(q, scores),
                Keep::operand(k, scores),
                Keep::operand(v, round),
            ])?)
        } else {
            None
        };
        let (shape, v_shape) = (q.shape().to_vec(), v.shape().to_vec());
        let y = Tensor::record(
            y,
            v_shape.clone(),
            "causal_attention",
            &[q, k, v],
            move |g| {
                // q, k and v as the products read them: 16-bit copies under autocast
                let [qk, kk, vk] = operands(&kept);
                let [dq, dk, dv] = att.backward(&qk, &kk, &vk, &g.storage())?;
                let wrap = |st: Storage, shape: &[usize]| Tensor::from_storage(st, shape);
                // each a rounded product's output
                Ok(vec![
                    Some(wrap(dq, &shape)?.with_half(scores)),
                    Some(wrap(dk, &shape)?.with_half(scores)),
                    Some(wrap(dv, &v_shape)?.with_half(round)),
                ])
            },
        );
        Ok(y.with_half(round))
    }

    /// RoPE, then [`causal_attention_tokens`](Self::causal_attention_tokens),
    /// as one op: `q = self, k, v: (B, T, H·D) -> (B, T, H, D)`, as the
    /// projections write them, `cos, sin: (T, D)`. Bit for bit
    /// `let (q, k) = q.rope_heads_pair(k, cos, sin, heads)?;` then
    /// `q.causal_attention_tokens(&k, &v.reshape(&[B, T, H, D])?, scale)`,
    /// forward and backward. The rotated q and k exist only as backward
    /// keeps them (a GPU rotates as it reads, and back before it stores
    /// their gradients: no dispatch of RoPE's own either way).
    pub fn causal_attention_rope(
        &self,
        k: &Tensor,
        v: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        heads: usize,
        scale: f64,
    ) -> Result<Tensor> {
        let q = self;
        let s = q.shape();
        if s.len() != 3
            || k.shape() != s
            || v.shape() != s
            || heads == 0
            || !s[2].is_multiple_of(heads)
        {
            bail!(
                Shape,
                "causal_attention_rope needs q, k, v of one shape (B, T, H·D) with H = {heads}, got {:?}, {:?}, {:?}",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        let (b, t, d) = (s[0], s[1], s[2] / heads);
        let fr = output_format(OpClass::Rope, &[q]);
        if fr != output_format(OpClass::Rope, &[k]) {
            // stored apart: the composition, node by node
            let (q, k) = q.rope_heads_pair(k, cos, sin, heads)?;
            return q.causal_attention_tokens(&k, &v.reshape(&[b, t, heads, d])?, scale);
        }
        check_tables(cos, sin, t, d)?;
        let att = plan(b * heads, (t, d), scale, Some(heads))?;
        let (round, scores) = (att.round, att.scores);
        let r = Rotary { round: fr };
        let recorded = is_grad_enabled() && [q, k, v].iter().any(|t| t.requires_grad());
        // the rotated q and k as the scores' products read them, v as p v
        // does: what backward keeps
        let keep = recorded.then(|| {
            (
                scores.filter(|_| Saved::halves()),
                Saved::to_pack(Keep::operand(v, round)),
            )
        });
        let (c, sn) = (cos.storage(), sin.storage());
        let (y, kept) = att.forward_rope(
            r,
            [&q.storage(), &k.storage(), &v.storage()],
            [&c, &sn],
            keep,
        )?;
        let kept = match kept {
            Some(([wq, wk], wv)) => {
                if let Some((w, changed)) = wv {
                    Saved::adopt(v, w, changed)?;
                }
                let rows = [b, heads, t, d];
                let [sv] = Saved::all([Keep::operand(v, round)])?;
                Some([
                    Saved::of_operand(wq, &rows)?,
                    Saved::of_operand(wk, &rows)?,
                    sv,
                ])
            }
            None => None,
        };
        let shape = s.to_vec();
        let y = Tensor::record(
            y,
            vec![b, t, heads, d],
            "causal_attention_rope",
            &[q, k, v],
            move |g| {
                let [qk, kk, vk] = operands(&kept);
                let [dq, dk, dv] =
                    att.backward_rope(r, [&qk, &kk, &vk], &g.storage(), [&c, &sn])?;
                let wrap = |st: Storage| Tensor::from_storage(st, &shape);
                Ok(vec![
                    Some(wrap(dq)?),
                    Some(wrap(dk)?),
                    Some(wrap(dv)?.with_half(round)),
                ])
            },
        );
        Ok(y.with_half(round))
    }
}

/// What a recorded attention kept, as its backward's products read it.
fn operands(kept: &Option<[Saved; 3]>) -> [Operand; 3] {
    kept.as_ref()
        .expect("a recorded attention keeps its operands")
        .each_ref()
        .map(|t| t.arg().op)
}

/// The attention of `heads` heads of `(t, d)` rows under this thread's
/// policy; errors on a scale that is not positive and finite.
fn plan(
    heads: usize,
    (t, d): (usize, usize),
    scale: f64,
    tokens: Option<usize>,
) -> Result<Attention> {
    let s = scale as f32;
    if !(s > 0.0 && s.is_finite()) {
        bail!(
            Numerical,
            "causal_attention: the scale must be positive and finite (got {scale})"
        );
    }
    Ok(Attention {
        heads,
        t,
        d,
        scale: s,
        round: autocast_dtype(),
        scores: product_format(OpClass::AttentionScores),
        // the softmax's input is the scores, as their product stores them
        probs: cast_table().and_then(|t| {
            t.output_of(
                OpClass::AttentionProbs,
                &[t.product(OpClass::AttentionScores)],
            )
        }),
        tokens,
    })
}

/// RoPE's tables: `(t, d)` constants, d even.
fn check_tables(cos: &Tensor, sin: &Tensor, t: usize, d: usize) -> Result<()> {
    if cos.shape() != [t, d] || sin.shape() != [t, d] || !d.is_multiple_of(2) {
        bail!(
            Shape,
            "causal_attention_rope: tables of ({t}, {d}) (positions, an even head dimension) needed, got cos {:?} and sin {:?}",
            cos.shape(),
            sin.shape()
        );
    }
    if cos.requires_grad() || sin.requires_grad() {
        bail!(
            Shape,
            "causal_attention_rope: the cos/sin tables are constants (no gradient flows to them)"
        );
    }
    Ok(())
}
