//! Fused transformer primitives: RMSNorm, SwiGLU, rotary position embedding
//! (RoPE) and softmax cross-entropy, each one primitive per direction.
//!
//! Each replaces a composition of the crate's elementwise, reduction and copy
//! ops (kept as the reference in `ops::fused::reference`) and gives **the
//! composition's bits**: its forward values and the gradients autograd
//! computes through it. So every formula below is the composition's, operation
//! for operation, in its order: each product rounded on its own (never an fma
//! unless written `fma`), each sum a fold from −0 in ascending order, scalars
//! narrowed to the storage type once on the host, division, square root,
//! `exp`, `log` and sigmoid the crate's own ([`math`](super::math)), and
//! `−x` written `−0 − x` like the `neg` op. Where autograd adds several
//! gradient contributions, the order it adds them in is part of the formula.
//!
//! ## Contract
//! Notation: `a·b` is a rounded product, `a + b` a rounded sum; `div`, `sqrt`,
//! `exp`, `log`, `σ(x) = div(1, 1 + exp(−0 − x))` the math library's;
//! `Σ` a fold from −0 in ascending index order.
//!
//! * **`rms_norm`** `x: (rows, d), w: (d) -> y: (rows, d), rstd: (rows)`, per row:
//!   `ss = Σ_j x_j·x_j`, `r = div(1, sqrt(div(ss, d) + eps))`,
//!   `y_j = (x_j·r)·w_j` — the composition
//!   `x.square().mean(-1).add_scalar(eps).rsqrt()`, then `x.mul(r).mul(w)`.
//!   `rstd` is `r`, kept for the backward.
//! * **`rms_norm_backward`** from `x`, `w`, `r`, the upstream `g` and the
//!   gradient `e` autograd has gathered for `x` so far (if any), per row:
//!   `gw_j = g_j·w_j`, `gr = Σ_j gw_j·x_j`,
//!   `gs = div((((gr·r)·r)·r)·(−0.5), d)`; with `dx1_j = gw_j·r` (the
//!   gradient through `x·r`) and `dx2_j = (gs·x_j)·2` (through `x²`),
//!   `dx_j = (e_j + dx1_j) + dx2_j`, or `dx1_j + dx2_j` without `e`: the
//!   order autograd adds the composition's contributions to `x` in (`x·r`'s
//!   node runs before `x²`'s, and whatever consumes the norm's output — a
//!   residual branch, whose gradient is `e` — before both). Adding as it
//!   writes spares two passes over `(rows, d)` buffers and two of autograd's.
//!   `dw_j` is `g_j·(x_j·r)` summed over the leading axes of `x` the way
//!   broadcasting's backward (`sum_to`) sums them: the innermost leading axis
//!   first, each axis a fold from −0, nested (`(B,T,d)`: `Σ_b Σ_t`). Axes of
//!   size 1 change nothing (`−0 + v = v`) and are dropped. With `ew`, the
//!   weight's gradient so far (an earlier micro-batch's), `dw_j` is
//!   `ew_j + Σ…`: the sum gradient accumulation forms next.
//! * **`swiglu`** `gate, up: (n) -> y: (n)`: `y = (gate·σ(gate))·up` — the
//!   composition `gate.silu().mul(up)`.
//! * **`swiglu_matmul`** `gate, up: (.., k)`, `w` and `dims` of a product
//!   reading `y = swiglu(gate, up)` as its A: the bits of `swiglu` followed
//!   by [`Storage::matmul_keeping_a`] of `y` (with an addend if given), and
//!   the 16-bit copies autograd keeps of `y`, `gate` and `up` (a GPU computes
//!   `y` as the product loads it, in one dispatch, and never writes it out).
//! * **`swiglu_backward`** from `gate`, `up`, `g`: with `s = σ(gate)`,
//!   `d_gate = (g·up)·(s·fma(gate, 1 − s, 1))`, `d_up = g·(gate·s)`.
//! * **`rope`** `x: (rows, d)`, `cos, sin: (t, d)`, `d` even, `h = d/2`
//!   (Hugging Face's rotate-half pairs `(j, j + h)`), with `heads` rows per
//!   position: `x`'s rows are token-major `(B, t, heads, d)` (as a
//!   projection writes them) and `y`'s head-major `(B, heads, t, d)` (as
//!   attention reads them) — the permute between the two is the kernel's
//!   indexing, not a pass of its own; with `heads = 1` row `i` is at
//!   position `i mod t` in both. With `c, s` row `p` of the tables, for the
//!   row of position `p`:
//!   `y_j = x_j·c_j + (−0 − x_{j+h})·s_j` for `j < h`,
//!   `y_j = x_j·c_j + x_{j−h}·s_j` for `j ≥ h` — the composition
//!   `x.mul(cos).add(rotate_half(x).mul(sin))`.
//! * **`rope_backward`** from `g`, head-major, to `dx`, token-major (the
//!   tables get no gradient):
//!   `dx_j = ((g_j·c_j) + 0) + g_{j+h}·s_{j+h}` for `j < h`,
//!   `dx_j = ((g_j·c_j) + (−0 − g_{j−h}·s_{j−h})) + 0` for `j ≥ h`: autograd
//!   adds `x`'s three contributions in the order `x·cos`, the second half's
//!   `narrow` (its gradient padded with `+0` in front), the first half's
//!   (padded behind) — and adding a `+0` pad turns a −0 into +0.
//! * **`cross_entropy`** `x: (rows, v)`, `targets: (rows)` ids `< v` ->
//!   `loss: (1)`, `stats: (rows, 2)`, per row: `m = max_j x_j` (`m = x_0`,
//!   then `m = maximum(m, x_j)` for `j = 1..` ascending: never from a constant
//!   −inf, the same bits as `maximum(−inf, x_0) = x_0`; `v ≥ 1`, as every row
//!   has a target), `S = Σ_j exp(x_j − m)`,
//!   `p = (x_t − m) − log(S)`; then `loss = −0 − div(Σ_i p_i, rows)`.
//!   `stats` row `i` is `(m, S)`, kept for the backward. This is the
//!   composition `log_softmax`, gather of the targets, `sum`, `div_scalar`,
//!   `neg`, without the `(rows·v)` index table the gather's backward needs.
//! * **`cross_entropy_backward`** from `x`, `stats` and the loss's upstream
//!   gradient `G` (one element): `G2 = div(−0 − G, rows)`, `a = +0 + G2` (the
//!   gather's scatter-add), `gl = −0 − a`, and per row `gS = div(gl, S)`,
//!   `dx_j = b_j + gS·exp(x_j − m)` with `b_j = a` at the target and `+0`
//!   elsewhere.
//!
//! The GPU twin is `fused.wgsl`. There every product that feeds a sum goes
//! through `sep` (its bits ORed with a runtime zero) and every `+ 0` adds a
//! runtime `+0`, so no shader compiler can contract the product into an fma
//! or fold the `+ 0` away (both legal for WGSL compilers, and both would
//! change bits).

mod cpu;
pub(crate) mod spec;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;

use super::matmul::{Halves, MatmulDims, MatmulOps, Operand};
use super::pack::{KeptCopy, PackOps, Packed};
use super::primitive;
use super::round::Format;
use super::Storage;
use crate::{bail, Result};

/// An output and two inputs kept in 16 bits: their words, and the count of
/// values the rounding changed where the device counts (the CPU).
pub type Kept<S> = (S, [(S, Option<usize>); 2]);

/// The cross-entropy's loss and statistics, and the logits' 16-bit copy
/// with how many values its rounding changed (where the device counts).
pub type CeKept<S> = ((S, S), (S, Option<usize>));

/// [`FusedOps::swiglu_matmul`]'s product, and with a format to keep,
/// the 16-bit copies of SwiGLU's output, the gate and up, each with the
/// count of values its rounding changed where the device counts.
pub type SwigluProduct<S> = (S, Option<[(S, Option<usize>); 3]>);

/// [`FusedOps::swiglu_matmul`] as its two primitives.
pub(crate) fn swiglu_then_product<S: FusedOps + PackOps + MatmulOps>(
    gate: &S,
    up: &S,
    rhs: &S,
    d: MatmulDims,
    round: Option<Format>,
    addend: Option<&S>,
    keep: Option<Format>,
) -> Result<SwigluProduct<S>> {
    let halves = Halves::default();
    let Some(keep) = keep else {
        let y = gate.swiglu(up)?;
        let c = match addend {
            Some(e) => y.matmul_add(rhs, d, halves, round, e)?,
            None => y.matmul(rhs, d, halves, round)?,
        };
        return Ok((c, None));
    };
    let (y, [g, u]) = gate.swiglu_keeping(up, keep)?;
    let (c, kept) = y.matmul_keeping_a(rhs, d, round, addend, keep)?;
    Ok((c, Some([kept, g, u])))
}

/// The two devices' fused primitives (see the module docs for the contract).
/// Lengths are checked by the [`Storage`] methods before these run.
pub trait FusedOps: Sized {
    /// `self` is `x: (rows, d)`; returns `(y, rstd)`.
    fn rms_norm(&self, w: &Self, rows: usize, d: usize, eps: f64) -> Result<(Self, Self)>;
    /// `self` is `x`; returns `(dx, dw)`, the first when `want_dx` (with
    /// `ex`, `x`'s gradient so far, added in), the second when `want_dw`
    /// (with `ew`, the weight's, added in). `spans` are the levels of `dw`'s
    /// nested sum (see [`dw_spans`]).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_backward(
        &self,
        w: &Self,
        rstd: &Self,
        g: &Self,
        ex: Option<&Self>,
        ew: Option<&Self>,
        spans: &[usize],
        d: usize,
        want_dx: bool,
        want_dw: bool,
    ) -> Result<(Option<Self>, Option<Self>)>;
    /// `self` is the gate.
    fn swiglu(&self, up: &Self) -> Result<Self>;
    /// [`swiglu`](Self::swiglu), and the gate and `up` packed to `keep` as
    /// [`PackOps::pack`] packs them (the copies autograd keeps); a GPU
    /// writes them from the same dispatch.
    fn swiglu_keeping(&self, up: &Self, keep: Format) -> Result<Kept<Self>>
    where
        Self: PackOps,
    {
        Ok((self.swiglu(up)?, [self.pack(keep)?, up.pack(keep)?]))
    }
    /// [`swiglu`](Self::swiglu), then the product of its output (A, of
    /// `d`) with `rhs` (plus `addend`); with `keep`, as
    /// [`swiglu_keeping`](Self::swiglu_keeping) and
    /// [`MatmulOps::matmul_keeping_a`]: the product and the three copies,
    /// SwiGLU's output's first. A GPU computes the output as the product
    /// loads it.
    #[allow(clippy::too_many_arguments)]
    fn swiglu_matmul(
        &self,
        up: &Self,
        rhs: &Self,
        d: MatmulDims,
        round: Option<Format>,
        addend: Option<&Self>,
        keep: Option<Format>,
    ) -> Result<SwigluProduct<Self>>
    where
        Self: PackOps + MatmulOps,
    {
        swiglu_then_product(self, up, rhs, d, round, addend, keep)
    }
    /// `self` is the gate; returns `(d_gate, d_up)`. `halves`: the gate
    /// (`a`) and `up` (`b`) kept in 16-bit storage, words of two values each
    /// (see [`Packed`](crate::backend::pack::Packed)), widened as read.
    fn swiglu_backward(&self, up: &Self, g: &Self, halves: Halves) -> Result<(Self, Self)>;
    /// `self` is `x: (B, t, heads, d)`, the tables `(t, d)` -> `(B, heads, t, d)`.
    fn rope(&self, cos: &Self, sin: &Self, t: usize, d: usize, heads: usize) -> Result<Self>;
    /// [`rope`](Self::rope) of `self` and `other` (of one shape); a GPU
    /// rotates both in one dispatch (attention's q and k).
    fn rope_pair(&self, other: &Self, cos: &Self, sin: &Self, (t, d, heads): (usize, usize, usize)) -> Result<(Self, Self)> {
        Ok((self.rope(cos, sin, t, d, heads)?, other.rope(cos, sin, t, d, heads)?))
    }
    /// `self` is the upstream gradient `(B, heads, t, d)` -> `(B, t, heads, d)`.
    fn rope_backward(&self, cos: &Self, sin: &Self, t: usize, d: usize, heads: usize) -> Result<Self>;
    /// [`rope_backward`](Self::rope_backward) of `self` and `other` (of one
    /// shape); a GPU runs both in one dispatch (attention's q and k).
    fn rope_backward_pair(&self, other: &Self, cos: &Self, sin: &Self, (t, d, heads): (usize, usize, usize)) -> Result<(Self, Self)> {
        Ok((self.rope_backward(cos, sin, t, d, heads)?, other.rope_backward(cos, sin, t, d, heads)?))
    }
    /// `self` is `x: (rows, v)`; returns `(loss, stats)`.
    fn cross_entropy(&self, targets: &[u32], v: usize) -> Result<(Self, Self)>;
    /// [`cross_entropy`](Self::cross_entropy), and the logits packed to
    /// `keep` as [`PackOps::pack`] packs them (the copy autograd keeps); a
    /// GPU writes them from the rows' dispatch.
    fn cross_entropy_keeping(&self, targets: &[u32], v: usize, keep: Format) -> Result<CeKept<Self>>
    where
        Self: PackOps,
    {
        Ok((self.cross_entropy(targets, v)?, self.pack(keep)?))
    }
    /// `self` is `x: (rows, v)`; `g` the loss's upstream gradient (one element).
    fn cross_entropy_backward(&self, half: Option<Format>, targets: &[u32], stats: &Self, g: &Self, v: usize) -> Result<Self>;
}

/// The rows each level of `dw`'s nested sum folds, outermost first: level
/// `l` sums over leading axis `l`, one fold covering `a_l·…·a_{L−1}` rows
/// (axes of size 1 dropped; at least one level, the whole set of rows). For
/// `(B,T,d)`: `[B·T, T]` — the fold over `t` within each `b`, then over `b`,
/// the order `sum_to` reduces the leading axes in.
pub fn dw_spans(lead: &[usize]) -> Vec<usize> {
    let mut spans = vec![lead.iter().product::<usize>()];
    let mut inner = spans[0];
    if inner == 0 {
        return spans; // no rows: dw is −0 whatever the levels
    }
    for &a in lead.iter().filter(|&&a| a != 1) {
        inner /= a;
        if inner > 1 {
            spans.push(inner);
        }
    }
    spans
}

fn check_len(what: &str, s: &Storage, want: usize, name: &str) -> Result<()> {
    if s.len() != want {
        bail!(
            Shape,
            "{what}: {name} holds {} values, expected {want}",
            s.len()
        );
    }
    Ok(())
}

/// Every target id is a class (`< v`).
fn check_targets(targets: &[u32], v: usize) -> Result<()> {
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
        bail!(
            Index,
            "cross_entropy: target {t} out of range for {v} classes"
        );
    }
    Ok(())
}

impl Storage {
    /// RMSNorm over the rows of `self: (rows, d)` with weight `w: (d)`;
    /// returns `(y, rstd)` (see the contract).
    pub fn rms_norm(&self, w: &Storage, rows: usize, d: usize, eps: f64) -> Result<(Storage, Storage)> {
        check_len("rms_norm", self, rows * d, "x")?;
        check_len("rms_norm", w, d, "the weight")?;
        let describe = || format!("rows {rows} d {d} eps {eps:e}");
        Ok(primitive!("rms norm", describe, [self, w] => |x, w| x.rms_norm(w, rows, d, eps)))
    }

    /// RMSNorm's backward: `self` is `x: (rows, d)` with leading axes `lead`
    /// (their product is `rows`), `ex` and `ew` the gradients gathered for
    /// `x` and the weight so far. Returns `(dx, dw)` (see the contract; `None`
    /// where not wanted).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_backward(
        &self,
        w: &Storage,
        rstd: &Storage,
        g: &Storage,
        ex: Option<&Storage>,
        ew: Option<&Storage>,
        lead: &[usize],
        d: usize,
        want_dx: bool,
        want_dw: bool,
    ) -> Result<(Option<Storage>, Option<Storage>)> {
        let rows: usize = lead.iter().product();
        check_len("rms_norm backward", self, rows * d, "x")?;
        check_len("rms_norm backward", g, rows * d, "the gradient")?;
        check_len("rms_norm backward", w, d, "the weight")?;
        check_len("rms_norm backward", rstd, rows, "rstd")?;
        let mut parts = vec![self, w, rstd, g];
        // where each earlier gradient sits in `parts`
        let (mut ex_at, mut ew_at) = (None, None);
        if let Some(e) = ex {
            check_len("rms_norm backward", e, rows * d, "x's earlier gradient")?;
            parts.push(e);
            ex_at = Some(parts.len() - 1);
        }
        if let Some(e) = ew {
            check_len("rms_norm backward", e, d, "the weight's earlier gradient")?;
            parts.push(e);
            ew_at = Some(parts.len() - 1);
        }
        let spans = dw_spans(lead);
        Ok(primitive!("rms norm backward", || format!("lead {lead:?} d {d}"), slice &parts => |xs| {
            let (ex, ew) = (ex_at.map(|i| xs[i]), ew_at.map(|i| xs[i]));
            xs[0].rms_norm_backward(xs[1], xs[2], xs[3], ex, ew, &spans, d, want_dx, want_dw)
        }))
    }

    /// SwiGLU `silu(self) · up` elementwise (`self` is the gate).
    pub fn swiglu(&self, up: &Storage) -> Result<Storage> {
        check_len("swiglu", up, self.len(), "up")?;
        Ok(primitive!("swiglu", || format!("n {}", self.len()), [self, up] => |a, b| a.swiglu(b)))
    }

    /// [`swiglu`](Self::swiglu), and the gate and `up` in 16 bits of `keep`
    /// with the counts of [`Storage::pack`], as one primitive (on a GPU one
    /// dispatch).
    pub fn swiglu_keeping(&self, up: &Storage, keep: Format) -> Result<(Storage, [KeptCopy; 2])> {
        check_len("swiglu", up, self.len(), "up")?;
        let n = self.len();
        let (y, words) = primitive!("swiglu", || format!("n {n} keeping {keep}"), [self, up] => |a, b| a.swiglu_keeping(b, keep));
        Ok((y, words.map(|(w, c)| (Packed::new(keep, n, w), c))))
    }

    /// [`swiglu`](Storage::swiglu), then the product of its output with
    /// `rhs` (of `dims`, plus `addend`), as one primitive; with `keep`, also
    /// the 16-bit copies of SwiGLU's output, the gate and up (as
    /// [`swiglu_keeping`](Storage::swiglu_keeping) and
    /// [`matmul_keeping_a`](Storage::matmul_keeping_a) make them).
    pub fn swiglu_matmul(
        &self,
        up: &Storage,
        rhs: &Storage,
        dims: MatmulDims,
        round: Option<Format>,
        addend: Option<&Storage>,
        keep: Option<Format>,
    ) -> Result<(Storage, Option<[KeptCopy; 3]>)> {
        check_len("swiglu", up, self.len(), "up")?;
        let n = self.len();
        if dims.trans_a || dims.tokens.any() || dims.batch * dims.m * dims.k != n {
            bail!(Shape, "swiglu_matmul: {n} values for the product's A ({dims:?})");
        }
        if addend.is_some_and(|e| e.len() != dims.batch * dims.m * dims.n) {
            bail!(Shape, "swiglu_matmul: an addend for {} outputs", dims.batch * dims.m * dims.n);
        }
        let scope = crate::profile::product_scope(dims.profiled());
        let mut parts = vec![self, up, rhs];
        parts.extend(addend);
        let (c, words): SwigluProduct<Storage> = primitive!(profile scope, "swiglu matmul", || dims.describe(round), slice &parts => |ds| {
            ds[0].swiglu_matmul(ds[1], ds[2], dims, round, ds.get(3).copied(), keep)
        });
        let packed = words.zip(keep).map(|(ws, f)| ws.map(|(w, k)| (Packed::new(f, n, w), k)));
        Ok((c, packed))
    }

    /// SwiGLU's backward: `(d_gate, d_up)` from the gate `self`, `up` and the
    /// upstream gradient.
    pub fn swiglu_backward(&self, up: &Storage, g: &Storage) -> Result<(Storage, Storage)> {
        Operand::Values(self.clone()).swiglu_backward(&Operand::Values(up.clone()), g)
    }

    /// RoPE on the rows of `self: (B, t, heads, d)` with the tables `cos,
    /// sin: (t, d)`, into `(B, heads, t, d)` (see the contract; with one head,
    /// row `i` at position `i mod t`).
    pub fn rope(&self, cos: &Storage, sin: &Storage, t: usize, d: usize, heads: usize) -> Result<Storage> {
        check_rope(self, cos, sin, t, d, heads)?;
        let describe = || format!("rows {} t {t} d {d} heads {heads}", self.len() / d.max(1));
        Ok(primitive!("rope", describe, [self, cos, sin] => |x, c, s| x.rope(c, s, t, d, heads)))
    }

    /// [`rope`](Storage::rope) of `self` and `other`, of one shape, as one
    /// primitive.
    pub fn rope_pair(&self, other: &Storage, cos: &Storage, sin: &Storage, t: usize, d: usize, heads: usize) -> Result<(Storage, Storage)> {
        check_rope(self, cos, sin, t, d, heads)?;
        check_len("rope", other, self.len(), "the second input")?;
        let describe = || format!("2 × rows {} t {t} d {d} heads {heads}", self.len() / d.max(1));
        Ok(primitive!("rope", describe, [self, other, cos, sin] => |x, y, c, s| x.rope_pair(y, c, s, (t, d, heads))))
    }

    /// RoPE's backward from the upstream gradient `self: (B, heads, t, d)`,
    /// into `(B, t, heads, d)`.
    pub fn rope_backward(&self, cos: &Storage, sin: &Storage, t: usize, d: usize, heads: usize) -> Result<Storage> {
        check_rope(self, cos, sin, t, d, heads)?;
        let describe = || format!("rows {} t {t} d {d} heads {heads}", self.len() / d.max(1));
        Ok(primitive!("rope backward", describe, [self, cos, sin] => |g, c, s| {
            g.rope_backward(c, s, t, d, heads)
        }))
    }

    /// [`rope_backward`](Self::rope_backward) of `self` and `other` (of one
    /// shape), as one primitive (on a GPU one dispatch for both).
    pub fn rope_backward_pair(&self, other: &Storage, cos: &Storage, sin: &Storage, t: usize, d: usize, heads: usize) -> Result<(Storage, Storage)> {
        check_rope(self, cos, sin, t, d, heads)?;
        check_len("rope backward", other, self.len(), "the second gradient")?;
        let describe = || format!("2 × rows {} t {t} d {d} heads {heads}", self.len() / d.max(1));
        Ok(primitive!("rope backward", describe, [self, other, cos, sin] => |g, h, c, s| {
            g.rope_backward_pair(h, c, s, (t, d, heads))
        }))
    }

    /// Softmax cross-entropy of the rows of `self: (rows, v)` against
    /// `targets` (one id `< v` per row); returns `(loss (1), stats (rows, 2))`.
    pub fn cross_entropy(&self, targets: &[u32], v: usize) -> Result<(Storage, Storage)> {
        check_len("cross_entropy", self, targets.len() * v, "the logits")?;
        check_targets(targets, v)?;
        let describe = || format!("rows {} v {v}", targets.len());
        Ok(primitive!("cross-entropy", describe, [self] => |x| x.cross_entropy(targets, v)))
    }

    /// [`cross_entropy`](Self::cross_entropy), and the logits' 16-bit copy
    /// (`keep`) with how many values its rounding changed, as
    /// [`Storage::pack`] makes it.
    pub fn cross_entropy_keeping(&self, targets: &[u32], v: usize, keep: Format) -> Result<(Storage, Storage, KeptCopy)> {
        check_len("cross_entropy", self, targets.len() * v, "the logits")?;
        check_targets(targets, v)?;
        let describe = || format!("rows {} v {v} keeping {keep}", targets.len());
        let ((loss, stats), (w, changed)) =
            primitive!("cross-entropy", describe, [self] => |x| x.cross_entropy_keeping(targets, v, keep));
        Ok((loss, stats, (Packed::new(keep, self.len(), w), changed)))
    }

    /// Cross-entropy's backward: the logits' gradient `(rows, v)` from the
    /// logits `self`, the forward's `stats` and the loss's upstream gradient `g`.
    pub fn cross_entropy_backward(
        &self,
        targets: &[u32],
        stats: &Storage,
        g: &Storage,
        v: usize,
    ) -> Result<Storage> {
        Operand::Values(self.clone()).cross_entropy_backward(targets, stats, g, v)
    }
}

fn check_rope(x: &Storage, cos: &Storage, sin: &Storage, t: usize, d: usize, heads: usize) -> Result<()> {
    if !d.is_multiple_of(2) {
        bail!(Shape, "rope needs an even last axis (pairs (j, j + d/2)), got {d}");
    }
    if heads == 0 || (t == 0 && !x.is_empty()) || !x.len().is_multiple_of((t * heads * d).max(1)) {
        bail!(
            Shape,
            "rope: {} values are not whole blocks of {t} positions of {heads} heads of {d}",
            x.len()
        );
    }
    check_len("rope", cos, t * d, "the cos table")?;
    check_len("rope", sin, t * d, "the sin table")
}

impl Operand {
    /// SwiGLU's backward with `self` the gate, either operand possibly kept
    /// in 16-bit storage (read as kept, no widened copy written out).
    pub fn swiglu_backward(&self, up: &Operand, g: &Storage) -> Result<(Storage, Storage)> {
        let n = g.len();
        if self.len() != n || up.len() != n {
            bail!(
                Shape,
                "swiglu backward: gate, up and the gradient hold {}, {} and {n} values",
                self.len(),
                up.len()
            );
        }
        let ((a, ha), (b, hb)) = (self.parts(), up.parts());
        let halves = Halves { a: ha, b: hb };
        let describe = || format!("n {n}");
        Ok(primitive!("swiglu backward", describe, [a, b, g] => |a, b, g| a.swiglu_backward(b, g, halves)))
    }

    /// [`Storage::cross_entropy_backward`] with the logits `self` possibly
    /// kept in 16-bit storage (a GPU reads them as kept, no widened copy
    /// written out).
    pub fn cross_entropy_backward(&self, targets: &[u32], stats: &Storage, g: &Storage, v: usize) -> Result<Storage> {
        if self.len() != targets.len() * v {
            bail!(Shape, "cross_entropy backward: the logits hold {} values, expected {}", self.len(), targets.len() * v);
        }
        check_len("cross_entropy backward", stats, 2 * targets.len(), "stats")?;
        check_len("cross_entropy backward", g, 1, "the upstream gradient")?;
        check_targets(targets, v)?;
        let (x, half) = self.parts();
        let describe = || format!("rows {} v {v}", targets.len());
        Ok(primitive!("cross-entropy backward", describe, [x, stats, g] => |x, s, g| {
            x.cross_entropy_backward(half, targets, s, g, v)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::dw_spans;

    #[test]
    fn spans_follow_the_leading_axes_innermost_last() {
        assert_eq!(dw_spans(&[]), vec![1]);
        assert_eq!(dw_spans(&[7]), vec![7]);
        assert_eq!(dw_spans(&[2, 5]), vec![10, 5]);
        assert_eq!(dw_spans(&[2, 1, 5]), vec![10, 5]);
        assert_eq!(dw_spans(&[1, 5]), vec![5]);
        assert_eq!(dw_spans(&[3, 4, 5]), vec![60, 20, 5]);
        assert_eq!(dw_spans(&[5, 1]), vec![5]);
        assert_eq!(dw_spans(&[0, 3]), vec![0]);
    }
}
