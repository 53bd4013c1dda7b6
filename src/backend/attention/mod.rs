//! Causal self-attention's products and softmax over many heads: one
//! schedule per device of the same primitives.
//!
//! The contract is the composition, head by head (`Tensor::causal_attention`
//! states it): `p = causal_softmax(q kᵀ · scale)` and `y = p v`, backward
//! `dv = pᵀ dy`, `dp = dy vᵀ`, `ds = softmax_backward(p, dp) · scale`,
//! `dq = ds k`, `dk = dsᵀ q`, each product with its `Causal` mode and the
//! autocast rounding of [`matmul`](crate::backend::matmul), the softmax and
//! its backward those of [`reduce`](crate::backend::reduce). Heads share
//! nothing, so the order they run in changes no bit.
//!
//! * The GPU runs the batched primitives over all heads at once: a few
//!   dispatches per call.
//! * The CPU runs one head's whole chain at a time on one thread, the heads
//!   split over the threads ([`cpu`]): a head's `T × T` scores and
//!   probabilities stay in cache instead of streaming `H · T²` values through
//!   memory between primitives.
//!
//! A running [trace](crate::trace) records the batched primitives
//! one by one, so while one runs the CPU takes the GPU's schedule; the tests
//! hold the two schedules to the same bits.

pub(crate) mod cpu;

use crate::backend::cpu::{Buf, Elem};
use crate::backend::round::Format;
use crate::backend::{Causal, CpuStorage, Lift, MatmulDims, Operand, Storage};
use crate::{bail, Result};

/// Attention over `heads` heads of `(t, d)` queries, keys and values.
#[derive(Clone, Copy, Debug)]
pub struct Attention {
    pub heads: usize,
    pub t: usize,
    pub d: usize,
    /// The scores' scale (`> 0`, finite).
    pub scale: f32,
    /// Autocast's rounding of every product.
    pub round: Option<Format>,
    /// `Some(h)`: `v`, `y` and their gradients are token-major `(B, T, h,
    /// D)` (`heads = B·h`) instead of `(heads, T, D)` — read and written in
    /// place of the permutes around attention. Only the CPU's per-head
    /// schedule takes it (see [`per_head`]).
    pub tokens: Option<usize>,
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
        }
    }

    /// `p (heads, T, T)`: the causal softmax of `q kᵀ`, on and below the
    /// diagonal.
    fn probs(&self, q: &Operand, k: &Operand) -> Result<Storage> {
        let (t, d) = (self.t, self.d);
        let scores = q.matmul(k, self.dims((t, d, t), false, true, Causal::Outputs), self.round)?;
        scores.softmax_rows(self.heads * t, t, self.scale, true)
    }

    /// `y (heads, T, D) = p v`, row `i` summing keys `j ≤ i`.
    pub fn forward(&self, q: &Operand, k: &Operand, v: &Operand) -> Result<Storage> {
        if let Some([q, k, v]) = on_cpu([q, k, v]) {
            let (qb, kb, vb) = (q.0.get(), k.0.get(), v.0.get());
            let y = cpu::forward(self, (&qb, q.1), (&kb, k.1), (&vb, v.1));
            return Ok(f32::wrap(y).lift());
        }
        self.batched()?;
        let (t, d) = (self.t, self.d);
        let p = self.probs(q, k)?;
        Operand::Values(p).matmul(v, self.dims((t, t, d), false, false, Causal::TermsUpToRow), self.round)
    }

    /// The batched schedule takes head-major operands only.
    fn batched(&self) -> Result<()> {
        if self.tokens.is_some() {
            bail!(Shape, "attention: token-major values only in the CPU's per-head schedule");
        }
        Ok(())
    }

    /// `[dq, dk, dv]` from the operands as the forward's products read them
    /// and the gradient `g` of `y`; `p` is recomputed, not kept.
    pub fn backward(&self, q: &Operand, k: &Operand, v: &Operand, g: &Storage) -> Result<[Storage; 3]> {
        let go = Operand::Values(g.clone());
        if let Some([q, k, v, g]) = on_cpu([q, k, v, &go]) {
            let (qb, kb, vb, gb) = (q.0.get(), k.0.get(), v.0.get(), g.0.get());
            let grads = cpu::backward(self, (&qb, q.1), (&kb, k.1), (&vb, v.1), &gb);
            return Ok(grads.map(|x| f32::wrap(x).lift()));
        }
        self.batched()?;
        let (t, d, round) = (self.t, self.d, self.round);
        let p = self.probs(q, k)?;
        // dv = pᵀ dy: key row j sums queries i ≥ j
        let dv = p.matmul(g, self.dims((t, t, d), true, false, Causal::TermsFromRow), round)?;
        // dp = dy vᵀ on and below the diagonal; ds = softmax backward · scale
        let dp = go.matmul(v, self.dims((t, d, t), false, true, Causal::Outputs), round)?;
        let ds = p.softmax_rows_backward(&dp, self.heads * t, t, self.scale)?;
        drop((dp, p));
        // dq = ds k: row i sums keys j ≤ i; dk = dsᵀ q: key row j sums queries i ≥ j
        let ds = Operand::Values(ds);
        let dq = ds.matmul(k, self.dims((t, t, d), false, false, Causal::TermsUpToRow), round)?;
        let dk = ds.matmul(q, self.dims((t, t, d), true, false, Causal::TermsFromRow), round)?;
        Ok([dq, dk, dv])
    }
}

/// Whether attention over these operands runs the CPU's per-head schedule
/// (which also takes token-major values).
pub fn per_head(ops: &[&Operand; 3]) -> bool {
    on_cpu(*ops).is_some()
}

/// The operands' host buffers when all are float32 words on the CPU and no
/// trace runs (see the module docs), with their 16-bit formats.
fn on_cpu<const N: usize>(ops: [&Operand; N]) -> Option<[(&Buf<f32>, Option<Format>); N]> {
    if crate::trace::on() {
        return None;
    }
    let mut out = Vec::with_capacity(N);
    for op in ops {
        let (s, half) = op.parts();
        match s {
            Storage::Cpu(c) => match &**c {
                CpuStorage::F32(b) => out.push((b, half)),
                CpuStorage::F64(_) => return None,
            },
            #[cfg(feature = "gpu")]
            Storage::Gpu(_) => return None,
        }
    }
    out.try_into().ok()
}
