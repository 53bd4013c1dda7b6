//! The CPU reference backend. Every primitive follows the canonical algorithm
//! documented on [`Storage`](super::Storage); the GPU kernels are its twins.
//! f64 storage (for gradient checks) uses the same algorithms with platform
//! f64 math — it has no GPU twin, so it needs none of the contract's care.

use super::math::{self, LANES};
use super::round::{self, Format};
use super::{
    AdamWConsts, BinaryLayout, BinaryOp, DType, MatmulDims, ReduceOp, UnaryOp, NORM_CHUNK,
};
use crate::memory::Ticket;
use crate::rng;
use rayon::prelude::*;
use std::cell::{Ref, RefCell, RefMut};
use std::mem::MaybeUninit;

/// A counted host buffer. Interior mutability serves the in-place primitives
/// (optimizer steps, unscaling); everything else builds a new buffer.
#[derive(Debug)]
pub struct Buf<T> {
    data: RefCell<Vec<T>>,
    _ticket: Ticket,
}

impl<T> Buf<T> {
    pub fn new(data: Vec<T>) -> Buf<T> {
        let bytes = data.len() * std::mem::size_of::<T>();
        Buf {
            data: RefCell::new(data),
            _ticket: Ticket::new(bytes),
        }
    }
    pub fn get(&self) -> Ref<'_, Vec<T>> {
        self.data.borrow()
    }
    pub fn get_mut(&self) -> RefMut<'_, Vec<T>> {
        self.data.borrow_mut()
    }
}

#[derive(Debug)]
pub enum CpuStorage {
    F32(Buf<f32>),
    F64(Buf<f64>),
}

/// The scalar type an algorithm runs on: f32 follows the contract through
/// [`math`]; f64 uses the platform's exactly-specified operations.
pub trait Elem: Copy + PartialOrd + std::fmt::Debug + Send + Sync + 'static {
    const NEG_ZERO: Self;
    const ZERO: Self;
    const ONE: Self;
    const NEG_INF: Self;
    fn from_f64(x: f64) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn fma(self, b: Self, c: Self) -> Self;
    fn div(self, o: Self) -> Self;
    /// `a[i].div(b[i])` for a group of lanes at once, where loops over slices
    /// divide (f32: hardware divisions wherever they provably have the
    /// contract's bits, [`math::div_lanes`]).
    #[inline(always)]
    fn div_lanes(a: [Self; LANES], b: [Self; LANES]) -> [Self; LANES] {
        std::array::from_fn(|i| a[i].div(b[i]))
    }
    fn exp(self) -> Self;
    fn log(self) -> Self;
    fn sqrt(self) -> Self;
    fn is_nan(self) -> bool;
    fn is_finite(self) -> bool;
    fn round_to(self, f: Format) -> Self;
    fn wrap(v: Vec<Self>) -> CpuStorage;
}

impl Elem for f32 {
    const NEG_ZERO: f32 = -0.0;
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    const NEG_INF: f32 = f32::NEG_INFINITY;
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    #[inline(always)]
    fn add(self, o: f32) -> f32 {
        self + o
    }
    #[inline(always)]
    fn sub(self, o: f32) -> f32 {
        self - o
    }
    #[inline(always)]
    fn mul(self, o: f32) -> f32 {
        self * o
    }
    #[inline(always)]
    fn fma(self, b: f32, c: f32) -> f32 {
        self.mul_add(b, c)
    }
    #[inline(always)]
    fn div(self, o: f32) -> f32 {
        math::div(self, o)
    }
    #[inline(always)]
    fn div_lanes(a: [f32; LANES], b: [f32; LANES]) -> [f32; LANES] {
        math::div_lanes(a, b)
    }
    #[inline(always)]
    fn exp(self) -> f32 {
        math::exp(self)
    }
    #[inline(always)]
    fn log(self) -> f32 {
        math::log(self)
    }
    #[inline(always)]
    fn sqrt(self) -> f32 {
        math::sqrt(self)
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
    #[inline(always)]
    fn round_to(self, f: Format) -> f32 {
        round::round_f32(self, f)
    }
    fn wrap(v: Vec<f32>) -> CpuStorage {
        CpuStorage::F32(Buf::new(v))
    }
}

impl Elem for f64 {
    const NEG_ZERO: f64 = -0.0;
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    const NEG_INF: f64 = f64::NEG_INFINITY;
    fn from_f64(x: f64) -> f64 {
        x
    }
    fn add(self, o: f64) -> f64 {
        self + o
    }
    fn sub(self, o: f64) -> f64 {
        self - o
    }
    fn mul(self, o: f64) -> f64 {
        self * o
    }
    fn fma(self, b: f64, c: f64) -> f64 {
        self.mul_add(b, c)
    }
    fn div(self, o: f64) -> f64 {
        self / o
    }
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    fn log(self) -> f64 {
        f64::ln(self)
    }
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
    fn round_to(self, f: Format) -> f64 {
        round::round_f64(self, f)
    }
    fn wrap(v: Vec<f64>) -> CpuStorage {
        CpuStorage::F64(Buf::new(v))
    }
}

/// `maximum` as the contract defines it: NaN wins (the first NaN), then the
/// larger, `+0` over `-0`. Branch-free (each case computed, then selected),
/// since in a running max "b > a" is as unpredictable as data.
#[inline(always)]
fn maximum<T: Elem>(a: T, b: T) -> T {
    let r = if b > a { b } else { a };
    // ±0 and ±0: x + y is +0 unless both are −0
    let r = if a == T::ZERO && b == T::ZERO {
        a.add(b)
    } else {
        r
    };
    let r = if b.is_nan() { b } else { r };
    if a.is_nan() {
        a
    } else {
        r
    }
}

/// Folds `R` rows at once, each in its own order (`acc = f(acc, row[i])` for
/// `i` ascending — the contract's sequential reductions), interleaved so that
/// `R` independent dependency chains are in flight instead of one.
#[inline(always)]
fn fold_rows<T: Elem, const R: usize>(rows: [&[T]; R], init: T, f: impl Fn(T, T) -> T) -> [T; R] {
    let n = rows[0].len();
    let mut acc = [init; R];
    #[allow(clippy::needless_range_loop)] // one index across R rows is the point
    for i in 0..n {
        for r in 0..R {
            acc[r] = f(acc[r], rows[r][i]);
        }
    }
    acc
}

/// [`fold_rows`] over the first `lens[r]` elements of each row `r` of a
/// row-major `(lens.len(), n)` buffer, `n > 0`: four rows in lockstep over their
/// common length, then each row's own rest — every row still folded in
/// ascending order.
fn fold_ragged<T: Elem>(
    x: &[T],
    n: usize,
    lens: &[usize],
    init: T,
    f: impl Fn(T, T) -> T + Copy,
) -> Vec<T> {
    assert!(n > 0, "rows of length 0");
    let mut out = Vec::with_capacity(lens.len());
    let mut quads = x.chunks_exact(4 * n).zip(lens.chunks_exact(4));
    for (q, l) in &mut quads {
        let common = l.iter().copied().min().unwrap_or(0);
        let rows: [&[T]; 4] = std::array::from_fn(|r| &q[r * n..r * n + l[r]]);
        let acc = fold_rows(rows.map(|r| &r[..common]), init, f);
        for r in 0..4 {
            out.push(rows[r][common..].iter().fold(acc[r], |a, &v| f(a, v)));
        }
    }
    let done = out.len();
    for (row, &l) in x[done * n..].chunks_exact(n).zip(&lens[done..]) {
        out.push(row[..l].iter().fold(init, |a, &v| f(a, v)));
    }
    out
}

/// `x = f(x)` a group of [`LANES`] at a time, in place; the ragged tail goes
/// through `f` padded with zeros (their results are dropped).
#[inline(always)]
fn for_lanes_mut<T: Elem>(x: &mut [T], f: impl Fn([T; LANES]) -> [T; LANES]) {
    let mut groups = x.chunks_exact_mut(LANES);
    for g in &mut groups {
        let v: [T; LANES] = (&*g).try_into().unwrap();
        g.copy_from_slice(&f(v));
    }
    let tail = groups.into_remainder();
    if !tail.is_empty() {
        let t = tail.len();
        let mut v = [T::ZERO; LANES];
        v[..t].copy_from_slice(tail);
        tail.copy_from_slice(&f(v)[..t]);
    }
}

/// Every unary op as one loop over the slice: the op is matched once, outside,
/// so each arm is a straight-line body the compiler vectorises (the f32 math
/// functions are branch-free for that reason, see [`math`]).
fn unary_t<T: Elem>(x: &[T], op: UnaryOp) -> Vec<T> {
    #[inline(always)]
    fn map<T: Copy>(x: &[T], f: impl Fn(T) -> T) -> Vec<T> {
        x.iter().map(|&v| f(v)).collect()
    }
    /// The ops that divide: a group of lanes at a time, so the division is one
    /// vector operation ([`Elem::div_lanes`]).
    #[inline(always)]
    fn map_lanes<T: Elem>(x: &[T], f: impl Fn([T; LANES]) -> [T; LANES]) -> Vec<T> {
        let mut out = x.to_vec();
        for_lanes_mut(&mut out, f);
        out
    }
    /// σ(x) = 1 / (1 + e^-x) in two passes, each a loop the compiler keeps in
    /// vector registers: the exps, then the divisions a group at a time.
    fn sigmoid<T: Elem>(x: &[T]) -> Vec<T> {
        let mut s = map(x, |v| T::ONE.add(T::NEG_ZERO.sub(v).exp()));
        for_lanes_mut(&mut s, |d| T::div_lanes([T::ONE; LANES], d));
        s
    }
    match op {
        UnaryOp::Neg => map(x, |v| T::NEG_ZERO.sub(v)),
        UnaryOp::Exp => map(x, |v| v.exp()),
        UnaryOp::Log => map(x, |v| v.log()),
        UnaryOp::Sqrt => map(x, |v| v.sqrt()),
        UnaryOp::Rsqrt => map_lanes(x, |v| T::div_lanes([T::ONE; LANES], v.map(T::sqrt))),
        UnaryOp::Recip => map_lanes(x, |v| T::div_lanes([T::ONE; LANES], v)),
        UnaryOp::Sigmoid => sigmoid(x),
        UnaryOp::Silu => {
            let mut s = sigmoid(x);
            s.iter_mut().zip(x).for_each(|(s, &v)| *s = v.mul(*s));
            s
        }
        // s * (1 + x * (1 - s)) = s * fma(x, 1 - s, 1)
        UnaryOp::SiluGrad => {
            let mut s = sigmoid(x);
            s.iter_mut()
                .zip(x)
                .for_each(|(s, &v)| *s = s.mul(v.fma(T::ONE.sub(*s), T::ONE)));
            s
        }
        UnaryOp::Abs => map(x, |v| {
            if v < T::ZERO || (v == T::ZERO && T::ONE.div(v) < T::ZERO) {
                T::NEG_ZERO.sub(v)
            } else {
                v
            }
        }),
        UnaryOp::Relu => map(x, |v| {
            if v > T::ZERO || v.is_nan() {
                v
            } else {
                T::ZERO
            }
        }),
        UnaryOp::Step => map(x, |v| if v > T::ZERO { T::ONE } else { T::ZERO }),
        UnaryOp::Square => map(x, |v| v.mul(v)),
        UnaryOp::AddScalar(c) => {
            let c = T::from_f64(c);
            map(x, |v| v.add(c))
        }
        UnaryOp::MulScalar(c) => {
            let c = T::from_f64(c);
            map(x, |v| v.mul(c))
        }
        UnaryOp::DivScalar(c) => {
            let c = T::from_f64(c);
            map_lanes(x, |v| T::div_lanes(v, [c; LANES]))
        }
        UnaryOp::RDivScalar(c) => {
            let c = T::from_f64(c);
            map(x, |v| c.div(v))
        }
        UnaryOp::Round(f) => map(x, |v| v.round_to(f)),
    }
}

/// A broadcast layout reduced to as few dimensions as possible: size-1
/// dimensions dropped, and a dimension merged into the one inside it wherever
/// both inputs step through the pair as through one (contiguous, or both
/// broadcast). Most layouts end as one or two dimensions, so the innermost
/// run — what [`for_each_run`] hands out — is long.
fn coalesce(layout: &BinaryLayout) -> [Vec<usize>; 3] {
    let (mut shape, mut ls, mut rs) = (Vec::new(), Vec::new(), Vec::new());
    for d in 0..layout.shape.len() {
        let (n, l, r) = (
            layout.shape[d],
            layout.lhs_strides[d],
            layout.rhs_strides[d],
        );
        if n == 1 {
            continue;
        }
        match (shape.last_mut(), ls.last_mut(), rs.last_mut()) {
            (Some(pn), Some(pl), Some(pr)) if *pl == l * n && *pr == r * n => {
                *pn *= n;
                *pl = l;
                *pr = r;
            }
            _ => {
                shape.push(n);
                ls.push(l);
                rs.push(r);
            }
        }
    }
    if shape.is_empty() {
        // one element
        (shape, ls, rs) = (vec![1], vec![0], vec![0]);
    }
    [shape, ls, rs]
}

/// Calls `run(lhs_start, rhs_start, len, lhs_stride, rhs_stride)` for every
/// innermost run of a (non-empty) broadcast layout, in row-major output order.
fn for_each_run(layout: &BinaryLayout, mut run: impl FnMut(usize, usize, usize, usize, usize)) {
    let [shape, ls, rs] = coalesce(layout);
    let inner = shape.len() - 1;
    let runs: usize = shape[..inner].iter().product();
    let mut idx = vec![0usize; inner];
    let (mut li, mut ri) = (0usize, 0usize);
    for _ in 0..runs {
        run(li, ri, shape[inner], ls[inner], rs[inner]);
        // increment the outer multi-index, carrying
        for d in (0..inner).rev() {
            idx[d] += 1;
            li += ls[d];
            ri += rs[d];
            if idx[d] < shape[d] {
                break;
            }
            li -= ls[d] * shape[d];
            ri -= rs[d] * shape[d];
            idx[d] = 0;
        }
    }
}

/// `f` over a broadcast layout; each run is a slice loop (both contiguous, or
/// one side a broadcast scalar) whenever the strides allow.
#[inline(always)]
fn broadcast_map<T: Elem>(
    a: &[T],
    b: &[T],
    layout: &BinaryLayout,
    f: impl Fn(T, T) -> T,
) -> Vec<T> {
    let n: usize = layout.shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    for_each_run(layout, |li, ri, len, lst, rst| match (lst, rst) {
        (1, 1) => out.extend(
            a[li..li + len]
                .iter()
                .zip(&b[ri..ri + len])
                .map(|(&x, &y)| f(x, y)),
        ),
        (1, 0) => {
            let y = b[ri];
            out.extend(a[li..li + len].iter().map(|&x| f(x, y)))
        }
        (0, 1) => {
            let x = a[li];
            out.extend(b[ri..ri + len].iter().map(|&y| f(x, y)))
        }
        _ => out.extend((0..len).map(|t| f(a[li + t * lst], b[ri + t * rst]))),
    });
    out
}

fn binary_t<T: Elem>(a: &[T], b: &[T], op: BinaryOp, layout: &BinaryLayout) -> Vec<T> {
    match op {
        BinaryOp::Add => broadcast_map(a, b, layout, |x, y| x.add(y)),
        BinaryOp::Sub => broadcast_map(a, b, layout, |x, y| x.sub(y)),
        BinaryOp::Mul => broadcast_map(a, b, layout, |x, y| x.mul(y)),
        BinaryOp::Div => broadcast_map(a, b, layout, |x, y| x.div(y)),
        BinaryOp::Maximum => broadcast_map(a, b, layout, maximum),
        BinaryOp::Eq => broadcast_map(a, b, layout, |x, y| if x == y { T::ONE } else { T::ZERO }),
    }
}

fn reduce_t<T: Elem>(x: &[T], op: ReduceOp, outer: usize, r: usize, inner: usize) -> Vec<T> {
    if inner == 1 && r > 0 {
        // Along contiguous rows: each row folded in order, four rows in flight.
        let (x, whole) = (&x[..outer * r], vec![r; outer]);
        return match op {
            ReduceOp::Sum => fold_ragged(x, r, &whole, T::NEG_ZERO, |a, v| a.add(v)),
            ReduceOp::Max => fold_ragged(x, r, &whole, T::NEG_INF, maximum),
        };
    }
    let mut out = vec![
        match op {
            ReduceOp::Sum => T::NEG_ZERO,
            ReduceOp::Max => T::NEG_INF,
        };
        outer * inner
    ];
    for o in 0..outer {
        let acc = &mut out[o * inner..(o + 1) * inner];
        for k in 0..r {
            let row = &x[(o * r + k) * inner..(o * r + k + 1) * inner];
            match op {
                ReduceOp::Sum => acc.iter_mut().zip(row).for_each(|(a, &v)| *a = a.add(v)),
                ReduceOp::Max => acc
                    .iter_mut()
                    .zip(row)
                    .for_each(|(a, &v)| *a = maximum(*a, v)),
            }
        }
    }
    out
}

fn strided_copy_t<T: Elem>(x: &[T], shape: &[usize], strides: &[usize], offset: usize) -> Vec<T> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let layout = BinaryLayout {
        shape: shape.to_vec(),
        lhs_strides: strides.to_vec(),
        rhs_strides: vec![0; shape.len()],
    };
    let x = &x[offset..];
    for_each_run(&layout, |li, _, len, lst, _| {
        if lst == 1 {
            out.extend_from_slice(&x[li..li + len]);
        } else {
            out.extend((0..len).map(|t| x[li + t * lst]));
        }
    });
    out
}

fn concat_t<T: Elem>(parts: &[&[T]], outer: usize, sizes: &[usize], inner: usize) -> Vec<T> {
    let total: usize = sizes.iter().sum();
    let mut out = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for (p, &s) in parts.iter().zip(sizes) {
            out.extend_from_slice(&p[o * s * inner..(o + 1) * s * inner]);
        }
    }
    out
}

/// The row without its trailing run of −inf: whole groups of lanes are
/// skipped with one vector compare each (an element-by-element scan from the
/// end was half the softmax's time), the rest element by element.
fn live_len<T: Elem>(row: &[T]) -> usize {
    let mut end = row.len();
    while end >= LANES
        && row[end - LANES..end]
            .iter()
            .fold(true, |all, &v| all & (v == T::NEG_INF))
    {
        end -= LANES;
    }
    row[..end]
        .iter()
        .rposition(|&v| v != T::NEG_INF)
        .map_or(0, |p| p + 1)
}

fn softmax_t<T: Elem>(x: &[T], rows: usize, n: usize) -> Vec<T> {
    let x = &x[..rows * n];
    let mut out = Vec::with_capacity(rows * n);
    if n == 0 {
        return out;
    }
    // Row maxima and sums are sequential folds (the contract's order); they
    // run four rows at a time. The exps and the divisions are vectorised loops.
    //
    // A causal mask leaves a trailing run of −inf in most rows, which changes
    // neither fold: maximum(m, −inf) = m for every m, so the max of the row
    // before the run is the row's max; and with a finite max m each masked
    // value is exp(−inf − m) = +0, added to a sum that is already ≥ 1 (the
    // max's own exp(0)), and +0 / s = +0. So with a finite max the run's
    // outputs are +0 without computing them and neither fold visits it — bit
    // for bit what the full loops give. `live` is the rest of each row.
    let unmasked: Vec<usize> = x.chunks_exact(n).map(live_len).collect();
    let maxes = fold_ragged(x, n, &unmasked, T::NEG_INF, maximum);
    let live: Vec<usize> = unmasked
        .iter()
        .zip(&maxes)
        .map(|(&l, m)| if m.is_finite() { l } else { n })
        .collect();
    for ((row, &m), &l) in x.chunks_exact(n).zip(&maxes).zip(&live) {
        out.extend(row[..l].iter().map(|&v| v.sub(m).exp()));
        out.extend(std::iter::repeat_n(T::ZERO, n - l));
    }
    let sums = fold_ragged(&out, n, &live, T::NEG_ZERO, |a, y| a.add(y));
    for ((o, &s), &l) in out.chunks_exact_mut(n).zip(&sums).zip(&live) {
        for_lanes_mut(&mut o[..l], |y| T::div_lanes(y, [s; LANES]));
    }
    out
}

fn softmax_backward_t<T: Elem>(y: &[T], g: &[T], rows: usize, n: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(rows * n);
    if n == 0 {
        return out;
    }
    for (yr, gr) in y[..rows * n].chunks_exact(n).zip(g.chunks_exact(n)) {
        let dot = yr
            .iter()
            .zip(gr)
            .fold(T::NEG_ZERO, |a, (&yv, &gv)| gv.fma(yv, a));
        out.extend(yr.iter().zip(gr).map(|(&yv, &gv)| yv.mul(gv.sub(dot))));
    }
    out
}

// ---------------------------------------------------------------- matmul ----

/// Rows of the register tile.
const MR: usize = 6;
/// Columns of the register tile (two AVX2 vectors of f32).
const NR: usize = 16;

thread_local! {
    /// Packed operands of this thread's last matmul, reused so that a training
    /// step's hundreds of products do not each map (and page-fault) fresh memory.
    static PACKED: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The k-range `[kb, kb + kc)` of one operand of one batch, packed into
/// panels of `W` lanes — A into row panels (`W` = MR, `lanes` = m), B into
/// column panels (`W` = NR, `lanes` = n): `buf[panel][p][lane]` (panel stride
/// `kc * W`), lanes past `lanes` zero; then rounded once when `round` is set
/// (one vectorised pass; the zero padding stays zero). One k-block at a time,
/// so the packed block is still in cache when the tiles read it.
///
/// `k_major`: the source's rows run across the lanes, one row per p (Aᵀ, B);
/// otherwise each lane is a row along k (A, Bᵀ).
fn pack<const W: usize>(
    buf: &mut Vec<f32>,
    src: &[f32],
    lanes: usize,
    k: usize,
    (kb, kc): (usize, usize),
    k_major: bool,
    round: Option<Format>,
) {
    // Reused buffer: `resize` fills only growth (and truncates otherwise);
    // every value is overwritten below, so the only zero fill needed is the
    // ragged last panel's padding.
    let panels = lanes.div_ceil(W);
    buf.resize(panels * kc * W, 0.0);
    if k_major {
        // Row p holds the p-th value of every panel, and the block's rows are
        // one contiguous stretch of the source: walk it in order (a sequential
        // read the prefetcher keeps ahead of), scattering each row over the
        // panels with fixed-size copies (vector moves, not memcpy calls).
        // Panel by panel instead strided through the source once per panel:
        // 0.93x of ndarray on the weight gradient 320x4096x904, now ~1.05x.
        for p in 0..kc {
            let row = &src[(kb + p) * lanes..(kb + p + 1) * lanes];
            for pi in 0..panels {
                let l0 = pi * W;
                let dst: &mut [f32; W] = (&mut buf[(pi * kc + p) * W..][..W]).try_into().unwrap();
                if l0 + W <= lanes {
                    *dst = row[l0..l0 + W].try_into().unwrap();
                } else {
                    dst[..lanes - l0].copy_from_slice(&row[l0..]);
                    dst[lanes - l0..].fill(0.0);
                }
            }
        }
    } else {
        for (pi, panel) in buf.chunks_exact_mut(kc * W).enumerate() {
            let l0 = pi * W;
            let real = W.min(lanes - l0);
            // Lane r's row, its stretch [kb, kb + kc).
            let row = |r: usize| &src[(l0 + r) * k + kb..(l0 + r) * k + kb + kc];
            if real == W {
                // Gather the W rows' p-th values into one panel row, reading
                // W streams forward, writing one (vectorised as a transpose).
                let rows: [&[f32]; W] = std::array::from_fn(row);
                for (p, dst) in panel.chunks_exact_mut(W).enumerate().take(kc) {
                    for r in 0..W {
                        dst[r] = rows[r][p];
                    }
                }
            } else {
                panel.fill(0.0);
                for r in 0..real {
                    for (dst, &v) in panel.chunks_exact_mut(W).zip(row(r)) {
                        dst[r] = v;
                    }
                }
            }
        }
    }
    if let Some(f) = round {
        round::round_slice(buf, f);
    }
}

/// Depth of one k-block: an MR×KC slice of A (6 KiB) and a KC×NR slice of B
/// (16 KiB) stay in L1 while a tile is computed.
const KC: usize = 256;

/// Row panels per L2 block of A (MC = 72 rows).
const MC_PANELS: usize = 12;

/// One MR×NR tile of C (row stride `ldc`) over one k-block:
/// `c[r][j] = fma(a[p][r], b[p][j], c[r][j])` for `p` ascending, starting from
/// +0 in the first k-block (`first`: C is not read, it may be uninitialised)
/// and from the running values in C after it. Carrying the sums in C from one
/// k-block to the next keeps every output's sum in the contract's exact order
/// while the blocks stay in cache.
///
/// # Safety
/// `ap` holds `kc * MR` values, `bp` `kc * NR`, and `c` is valid for writes of
/// `MR` rows of `NR` values at stride `ldc` (and for reads unless `first`).
#[inline(always)]
unsafe fn micro_kernel(
    ap: *const f32,
    bp: *const f32,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the target features are enabled at compile time (see
        // .cargo/config.toml); the pointers are valid per this fn's contract.
        micro_kernel_avx2(ap, bp, kc, c, ldc, first)
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let mut acc = [[0.0f32; NR]; MR];
        if !first {
            for (r, row) in acc.iter_mut().enumerate() {
                std::ptr::copy_nonoverlapping(c.add(r * ldc), row.as_mut_ptr(), NR);
            }
        }
        for p in 0..kc {
            for (r, row) in acc.iter_mut().enumerate() {
                let a = *ap.add(p * MR + r);
                for (j, v) in row.iter_mut().enumerate() {
                    *v = a.mul_add(*bp.add(p * NR + j), *v);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(r * ldc), NR);
        }
    }
}

/// The same tile with AVX2: 12 accumulator registers (6 rows × 2 vectors of 8),
/// `_mm256_fmadd_ps` being a fused multiply-add exactly like `f32::mul_add`.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[inline(always)]
unsafe fn micro_kernel_avx2(
    ap: *const f32,
    bp: *const f32,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    if !first {
        for (r, row) in acc.iter_mut().enumerate() {
            row[0] = _mm256_loadu_ps(c.add(r * ldc));
            row[1] = _mm256_loadu_ps(c.add(r * ldc + 8));
        }
    }
    // The next tile down (the caller's next call) starts by loading its C rows,
    // strided, from L2/L3: ask for them now, while this tile computes. A
    // prefetch never faults, so an address past C is harmless.
    for r in MR..2 * MR {
        _mm_prefetch::<_MM_HINT_T0>(c.wrapping_add(r * ldc) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(c.wrapping_add(r * ldc + NR - 1) as *const i8);
    }
    for p in 0..kc {
        let b0 = _mm256_loadu_ps(bp.add(p * NR));
        let b1 = _mm256_loadu_ps(bp.add(p * NR + 8));
        for (r, row) in acc.iter_mut().enumerate() {
            let a = _mm256_broadcast_ss(&*ap.add(p * MR + r));
            row[0] = _mm256_fmadd_ps(a, b0, row[0]);
            row[1] = _mm256_fmadd_ps(a, b1, row[1]);
        }
    }
    for (r, row) in acc.iter().enumerate() {
        _mm256_storeu_ps(c.add(r * ldc), row[0]);
        _mm256_storeu_ps(c.add(r * ldc + 8), row[1]);
    }
}

/// Which k-block a [`tile`] call computes: the first starts every sum from
/// +0; the last (`round` set when the product is rounded) rounds the finished
/// sums while the tile is still in L1, instead of a separate pass over C.
#[derive(Clone, Copy)]
struct KBlock {
    first: bool,
    round: Option<Format>,
}

/// One tile of C at `c` (row stride `ldc`), of which `rows` × `cols` are real:
/// full tiles run the kernel on C itself, edge tiles on a padded copy.
#[allow(clippy::too_many_arguments)]
fn tile(
    ap: &[f32],
    bp: &[f32],
    kc: usize,
    c: &mut [MaybeUninit<f32>],
    ldc: usize,
    rows: usize,
    cols: usize,
    blk: KBlock,
) {
    assert!(ap.len() >= kc * MR && bp.len() >= kc * NR);
    assert!(c.len() >= (rows - 1) * ldc + cols);
    let cp = c.as_mut_ptr() as *mut f32;
    if rows == MR && cols == NR {
        // SAFETY: lengths checked above; C is read only after the first k-block wrote it.
        unsafe { micro_kernel(ap.as_ptr(), bp.as_ptr(), kc, cp, ldc, blk.first) };
        if let Some(f) = blk.round {
            for r in 0..MR {
                // SAFETY: inside `c` (checked above), just written by the kernel.
                round::round_slice(
                    unsafe { std::slice::from_raw_parts_mut(cp.add(r * ldc), NR) },
                    f,
                );
            }
        }
        return;
    }
    let mut t = [0.0f32; MR * NR];
    if !blk.first {
        for r in 0..rows {
            // SAFETY: inside `c` (checked above) and written by an earlier k-block.
            unsafe {
                std::ptr::copy_nonoverlapping(cp.add(r * ldc), t[r * NR..].as_mut_ptr(), cols)
            };
        }
    }
    // SAFETY: `t` is exactly one MR×NR tile; lengths of ap/bp checked above.
    unsafe { micro_kernel(ap.as_ptr(), bp.as_ptr(), kc, t.as_mut_ptr(), NR, blk.first) };
    if let Some(f) = blk.round {
        round::round_slice(&mut t, f);
    }
    for r in 0..rows {
        // SAFETY: inside `c` (checked above).
        unsafe { std::ptr::copy_nonoverlapping(t[r * NR..].as_ptr(), cp.add(r * ldc), cols) };
    }
}

/// One k-block of rows `[r0, r0 + rows)` of one batch's `C`, in `out`
/// (exactly those rows; uninitialised before the first k-block, which starts
/// every sum from +0 and writes it), from the block's packed operands (panel
/// strides `kc * MR` and `kc * NR`). `r0` is a multiple of MR.
fn matmul_block(
    ap: &[f32],
    bp: &[f32],
    kc: usize,
    n: usize,
    r0: usize,
    out: &mut [MaybeUninit<f32>],
    blk: KBlock,
) {
    let rows = out.len() / n;
    let (panel0, row_panels) = (r0 / MR, rows.div_ceil(MR));
    let col_panels = n.div_ceil(NR);
    // Row panels in groups of MC_PANELS: that slice of A (about 72 KiB)
    // stays in L2 while every column panel of B streams past it.
    for ib in (0..row_panels).step_by(MC_PANELS) {
        for pj in 0..col_panels {
            let b_blk = &bp[pj * kc * NR..];
            let cols = NR.min(n - pj * NR);
            for pi in ib..(ib + MC_PANELS).min(row_panels) {
                let a_blk = &ap[(panel0 + pi) * kc * MR..];
                let c = &mut out[pi * MR * n + pj * NR..];
                tile(a_blk, b_blk, kc, c, n, MR.min(rows - pi * MR), cols, blk);
            }
        }
    }
}

/// The cap on a large CPU kernel's threads; 0 = all available cores.
static MATMUL_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Caps the threads a CPU matmul (and AdamW on a large buffer) uses (`None` =
/// all available cores), e.g. to compare with a single-threaded baseline.
/// Results never depend on it: threads split rows, batches or elements, never k.
pub fn set_matmul_threads(threads: Option<usize>) {
    MATMUL_THREADS.store(threads.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

/// Products below this many multiply-adds run on one thread: ~1 ms of one
/// core's work, against the 20–60 µs it takes to wake another core on a VM.
/// (Measured on a 2-vCPU VM: at 2^21 the `small` preset's step was ~20 %
/// *slower* on two threads than on one; at 2^26 it was within run-to-run noise
/// of one thread, and 512×320×904 products gain ~1.3x from the second core.)
const THREADED_MACS: usize = 1 << 26;

/// AdamW buffers from this many elements are split over the threads (~0.5 ms
/// of one core's update).
const THREADED_ELEMS: usize = 1 << 18;

/// The threads a large CPU kernel (matmul, AdamW) uses: the cap set by
/// [`set_matmul_threads`], else all available cores.
fn cpu_threads() -> usize {
    match MATMUL_THREADS.load(std::sync::atomic::Ordering::Relaxed) {
        0 => std::thread::available_parallelism().map_or(1, |t| t.get()),
        t => t,
    }
}

fn matmul_f32(a: &[f32], b: &[f32], d: MatmulDims, round: Option<Format>) -> Vec<f32> {
    let MatmulDims { batch, m, k, n, .. } = d;
    let len = batch * m * n;
    if len == 0 || k == 0 {
        return vec![0.0f32; len]; // empty sums are +0
    }
    // No zero fill: every element is written by its first k-block.
    let mut out_vec = Vec::<f32>::with_capacity(len);
    let out = &mut out_vec.spare_capacity_mut()[..len];
    let threads = if batch * m * n * k >= THREADED_MACS {
        cpu_threads()
    } else {
        1
    };
    // One batch entry, k-block by k-block: pack the block of both operands
    // (rounding each element once), then every tile of C over it — the
    // running sums stay in C between blocks, in the contract's order.
    let one = |bi: usize, c: &mut [MaybeUninit<f32>], threads: usize| {
        let (a, b) = (&a[bi * d.a_batch_stride..], &b[bi * d.b_batch_stride..]);
        PACKED.with_borrow_mut(|(ap, bp)| {
            let mut kb = 0;
            while kb < k {
                let kc = KC.min(k - kb);
                pack::<MR>(ap, a, m, k, (kb, kc), d.trans_a, round);
                pack::<NR>(bp, b, n, k, (kb, kc), !d.trans_b, round);
                let blk = KBlock {
                    first: kb == 0,
                    round: if kb + kc == k { round } else { None },
                };
                if threads == 1 {
                    matmul_block(ap, bp, kc, n, 0, c, blk);
                } else {
                    // Threads split whole row panels only; each output's
                    // k-loop is untouched, so results do not depend on the
                    // thread count.
                    let rows_per_thread = m.div_ceil(MR).div_ceil(threads) * MR;
                    let (ap, bp) = (&*ap, &*bp);
                    c.par_chunks_mut(rows_per_thread * n)
                        .enumerate()
                        .for_each(|(t, chunk)| {
                            matmul_block(ap, bp, kc, n, t * rows_per_thread, chunk, blk)
                        });
                }
                kb += KC;
            }
        })
    };
    if threads > 1 && batch >= threads {
        // Many small products (attention heads): split the batch instead.
        let per = batch.div_ceil(threads);
        out.par_chunks_mut(per * m * n)
            .enumerate()
            .for_each(|(t, chunk)| {
                for (i, c) in chunk.chunks_mut(m * n).enumerate() {
                    one(t * per + i, c, 1);
                }
            });
    } else {
        for (bi, c) in out.chunks_mut(m * n).enumerate() {
            one(bi, c, threads);
        }
    }
    // SAFETY: every batch entry's rows were all written by their first k-block above.
    unsafe { out_vec.set_len(len) };
    out_vec
}

fn matmul_f64(a: &[f64], b: &[f64], d: MatmulDims, round: Option<Format>) -> Vec<f64> {
    let MatmulDims { batch, m, k, n, .. } = d;
    let rd = |v: f64| match round {
        Some(f) => round::round_f64(v, f),
        None => v,
    };
    let mut out = vec![0.0f64; batch * m * n];
    for bi in 0..batch {
        let (ab, bb) = (&a[bi * d.a_batch_stride..], &b[bi * d.b_batch_stride..]);
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f64;
                for p in 0..k {
                    let x = if d.trans_a {
                        ab[p * m + i]
                    } else {
                        ab[i * k + p]
                    };
                    let y = if d.trans_b {
                        bb[j * k + p]
                    } else {
                        bb[p * n + j]
                    };
                    acc = rd(x).mul_add(rd(y), acc);
                }
                out[bi * m * n + i * n + j] = rd(acc);
            }
        }
    }
    out
}

macro_rules! both {
    ($s:expr, $x:ident => $e:expr) => {
        match $s {
            CpuStorage::F32(b) => {
                let $x = &*b.get();
                f32::wrap($e)
            }
            CpuStorage::F64(b) => {
                let $x = &*b.get();
                f64::wrap($e)
            }
        }
    };
}

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(b) => b.get().len(),
            CpuStorage::F64(b) => b.get().len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn to_vec_f32(&self) -> Vec<f32> {
        match self {
            CpuStorage::F32(b) => b.get().clone(),
            CpuStorage::F64(b) => b.get().iter().map(|&x| x as f32).collect(),
        }
    }
    pub fn to_vec_f64(&self) -> Vec<f64> {
        match self {
            CpuStorage::F32(b) => b.get().iter().map(|&x| x as f64).collect(),
            CpuStorage::F64(b) => b.get().clone(),
        }
    }
    /// The f32 buffer (panics on f64: callers check the dtype first).
    pub fn f32s(&self) -> Ref<'_, Vec<f32>> {
        match self {
            CpuStorage::F32(b) => b.get(),
            CpuStorage::F64(_) => panic!("expected f32 storage"),
        }
    }

    pub fn unary(&self, op: UnaryOp) -> CpuStorage {
        both!(self, x => unary_t(x, op))
    }

    pub fn binary(&self, rhs: &CpuStorage, op: BinaryOp, layout: &BinaryLayout) -> CpuStorage {
        match (self, rhs) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                f32::wrap(binary_t(&a.get(), &b.get(), op, layout))
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                f64::wrap(binary_t(&a.get(), &b.get(), op, layout))
            }
            _ => panic!("dtype mismatch (checked by the caller)"),
        }
    }

    pub fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> CpuStorage {
        both!(self, x => reduce_t(x, op, outer, r, inner))
    }

    pub fn matmul(&self, rhs: &CpuStorage, d: MatmulDims, round: Option<Format>) -> CpuStorage {
        match (self, rhs) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                f32::wrap(matmul_f32(&a.get(), &b.get(), d, round))
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                f64::wrap(matmul_f64(&a.get(), &b.get(), d, round))
            }
            _ => panic!("dtype mismatch (checked by the caller)"),
        }
    }

    pub fn strided_copy(&self, shape: &[usize], strides: &[usize], offset: usize) -> CpuStorage {
        both!(self, x => strided_copy_t(x, shape, strides, offset))
    }

    pub fn concat(
        parts: &[&CpuStorage],
        outer: usize,
        sizes: &[usize],
        inner: usize,
    ) -> CpuStorage {
        match parts[0] {
            CpuStorage::F32(_) => {
                let guards: Vec<_> = parts.iter().map(|p| p.f32s()).collect();
                let slices: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
                f32::wrap(concat_t(&slices, outer, sizes, inner))
            }
            CpuStorage::F64(_) => {
                let guards: Vec<_> = parts
                    .iter()
                    .map(|p| match p {
                        CpuStorage::F64(b) => b.get(),
                        _ => panic!("dtype mismatch"),
                    })
                    .collect();
                let slices: Vec<&[f64]> = guards.iter().map(|g| g.as_slice()).collect();
                f64::wrap(concat_t(&slices, outer, sizes, inner))
            }
        }
    }

    pub fn gather_rows(&self, ids: &[u32], d: usize) -> CpuStorage {
        both!(self, x => {
            let mut out = Vec::with_capacity(ids.len() * d);
            for &i in ids {
                out.extend_from_slice(&x[i as usize * d..(i as usize + 1) * d]);
            }
            out
        })
    }

    pub fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize) -> CpuStorage {
        both!(self, g => {
            let mut out = vec![Elem::ZERO; v * d];
            for (n, &i) in ids.iter().enumerate() {
                let row = &mut out[i as usize * d..(i as usize + 1) * d];
                row.iter_mut().zip(&g[n * d..(n + 1) * d]).for_each(|(o, &x)| *o = Elem::add(*o, x));
            }
            out
        })
    }

    pub fn softmax_rows(&self, rows: usize, n: usize) -> CpuStorage {
        both!(self, x => softmax_t(x, rows, n))
    }

    pub fn softmax_rows_backward(&self, g: &CpuStorage, rows: usize, n: usize) -> CpuStorage {
        match (self, g) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => {
                f32::wrap(softmax_backward_t(&y.get(), &g.get(), rows, n))
            }
            (CpuStorage::F64(y), CpuStorage::F64(g)) => {
                f64::wrap(softmax_backward_t(&y.get(), &g.get(), rows, n))
            }
            _ => panic!("dtype mismatch"),
        }
    }

    pub fn dropout_mask(n: usize, p: f32, scale: f32, seed: u64, offset: u64) -> CpuStorage {
        f32::wrap(
            (0..n as u64)
                .map(|i| {
                    if rng::uniform01(rng::draw_u32(seed, offset, i)) >= p {
                        scale
                    } else {
                        0.0
                    }
                })
                .collect(),
        )
    }

    /// `x *= inv_scale` in place; true when every value was finite before.
    pub fn unscale_in_place(&self, inv_scale: f32) -> bool {
        match self {
            CpuStorage::F32(b) => {
                let mut finite = true;
                for x in b.get_mut().iter_mut() {
                    finite &= x.is_finite();
                    *x *= inv_scale;
                }
                finite
            }
            CpuStorage::F64(b) => {
                let mut finite = true;
                for x in b.get_mut().iter_mut() {
                    finite &= x.is_finite();
                    *x *= inv_scale as f64;
                }
                finite
            }
        }
    }

    pub fn chunk_sum_squares(&self) -> Vec<f32> {
        let x = self.to_vec_f32();
        x.chunks(NORM_CHUNK)
            .map(|c| c.iter().fold(-0.0f32, |a, &v| v.mul_add(v, a)))
            .collect()
    }

    pub fn scale_in_place(&self, c: f32) {
        match self {
            CpuStorage::F32(b) => b.get_mut().iter_mut().for_each(|x| *x *= c),
            CpuStorage::F64(b) => b.get_mut().iter_mut().for_each(|x| *x *= c as f64),
        }
    }

    pub fn adamw_step(&self, g: &CpuStorage, m: &CpuStorage, v: &CpuStorage, c: &AdamWConsts) {
        let (mut p, g, mut m, mut v) = (self.f32s_mut(), g.f32s(), m.f32s_mut(), v.f32s_mut());
        let (n, c) = (p.len(), *c);
        // An element-wise update has no order to keep: large buffers are split
        // over the threads in whole groups of lanes.
        let threads = if n >= THREADED_ELEMS {
            cpu_threads()
        } else {
            1
        };
        if threads == 1 {
            return adamw_slices(&mut p, &g, &mut m, &mut v, &c);
        }
        let per = n.div_ceil(threads).next_multiple_of(LANES);
        p.par_chunks_mut(per)
            .zip(g.par_chunks(per))
            .zip(m.par_chunks_mut(per))
            .zip(v.par_chunks_mut(per))
            .for_each(|(((p, g), m), v)| adamw_slices(p, g, m, v, &c));
    }

    pub fn sgd_step(
        &self,
        g: &CpuStorage,
        buf: Option<&CpuStorage>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) {
        let (mut p, g) = (self.f32s_mut(), g.f32s());
        let mut b = buf.map(|b| b.f32s_mut());
        for i in 0..p.len() {
            let mut gi = wd.mul_add(p[i], g[i]);
            if let Some(b) = b.as_mut() {
                b[i] = if first {
                    gi
                } else {
                    momentum.mul_add(b[i], gi)
                };
                gi = b[i];
            }
            p[i] = (-lr).mul_add(gi, p[i]);
        }
    }

    fn f32s_mut(&self) -> RefMut<'_, Vec<f32>> {
        match self {
            CpuStorage::F32(b) => b.get_mut(),
            CpuStorage::F64(_) => panic!("optimizer state must be f32 (the masters)"),
        }
    }
}

/// AdamW over whole slices: groups of LANES elements, so the two divisions per
/// element are one hardware division of a vector each (`math::div_lanes`, the
/// soft division's bits); the ragged tail runs as a group padded with zeros.
fn adamw_slices(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamWConsts) {
    let n = p.len();
    let whole = n - n % LANES;
    for i in (0..whole).step_by(LANES) {
        let r = i..i + LANES;
        adamw_lanes(
            &mut p[r.clone()],
            &g[r.clone()],
            &mut m[r.clone()],
            &mut v[r],
            c,
        );
    }
    if whole < n {
        let t = n - whole;
        let mut lanes = [[0.0f32; LANES]; 4];
        for (l, x) in lanes
            .iter_mut()
            .zip([&p[whole..], &g[whole..], &m[whole..], &v[whole..]])
        {
            l[..t].copy_from_slice(x);
        }
        let [mut pt, gt, mut mt, mut vt] = lanes;
        adamw_lanes(&mut pt, &gt, &mut mt, &mut vt, c);
        p[whole..].copy_from_slice(&pt[..t]);
        m[whole..].copy_from_slice(&mt[..t]);
        v[whole..].copy_from_slice(&vt[..t]);
    }
}

/// One AdamW group (slices of exactly LANES elements), PyTorch's formula:
/// `p1 = p·decay; m = fma(β1, m, (1-β1)·g); v = fma(β2, v, (1-β2)·g²);
/// den = v̂ / sqrt(1-β2^t) + eps` with `v̂ = sqrt(v)`; `p = fma(-step, m / den, p1)`.
#[inline(always)]
fn adamw_lanes(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamWConsts) {
    // Whole groups in registers, stored once at the end: element-wise stores
    // followed by a vector load of the same group stall store forwarding.
    let lanes = |x: &[f32]| -> [f32; LANES] { x.try_into().unwrap() };
    let (p0, g, m0, v0) = (lanes(p), lanes(g), lanes(m), lanes(v));
    let m1: [f32; LANES] = std::array::from_fn(|i| c.beta1.mul_add(m0[i], c.omb1 * g[i]));
    let v1: [f32; LANES] = std::array::from_fn(|i| c.beta2.mul_add(v0[i], c.omb2 * (g[i] * g[i])));
    let vhat = math::div_lanes(v1.map(math::sqrt), [c.bc2_sqrt; LANES]);
    let upd = math::div_lanes(m1, vhat.map(|x| x + c.eps));
    let p1: [f32; LANES] = std::array::from_fn(|i| (-c.step_size).mul_add(upd[i], p0[i] * c.decay));
    p.copy_from_slice(&p1);
    m.copy_from_slice(&m1);
    v.copy_from_slice(&v1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AdamW split over threads (large buffers) against one pass over the
    /// whole buffer, bit for bit: a ragged length past the threshold, three
    /// threads (so the parts are not halves), data with zeros and tiny values
    /// (the division's fallback groups).
    #[test]
    fn threaded_adamw_equals_one_pass_bitwise() {
        let n = THREADED_ELEMS + 13;
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut next = move |scale: f32| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if s & 63 == 0 {
                0.0
            } else if s & 63 == 1 {
                u * 1e-36
            } else {
                u * scale
            }
        };
        let p: Vec<f32> = (0..n).map(|_| next(1.0)).collect();
        let g: Vec<f32> = (0..n).map(|_| next(1e-2)).collect();
        let m: Vec<f32> = (0..n).map(|_| next(1e-3)).collect();
        let v: Vec<f32> = (0..n).map(|_| next(1e-5).abs()).collect();
        let c = crate::bench::adamw_consts();
        let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
        adamw_slices(&mut p1, &g, &mut m1, &mut v1, &c);
        let [ps, gs, ms, vs] = [p, g, m, v].map(|x| CpuStorage::F32(Buf::new(x)));
        set_matmul_threads(Some(3));
        ps.adamw_step(&gs, &ms, &vs, &c);
        set_matmul_threads(None);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&ps.f32s()), bits(&p1));
        assert_eq!(bits(&ms.f32s()), bits(&m1));
        assert_eq!(bits(&vs.f32s()), bits(&v1));
    }

    /// The contract's matmul written as plainly as possible.
    fn naive(a: &[f32], b: &[f32], d: MatmulDims, round: Option<Format>) -> Vec<f32> {
        let rd = |v: f32| round.map_or(v, |f| round::round_f32(v, f));
        let mut out = Vec::new();
        for bi in 0..d.batch {
            for i in 0..d.m {
                for j in 0..d.n {
                    let mut acc = 0.0f32;
                    for p in 0..d.k {
                        let x = if d.trans_a {
                            a[bi * d.a_batch_stride + p * d.m + i]
                        } else {
                            a[bi * d.a_batch_stride + i * d.k + p]
                        };
                        let y = if d.trans_b {
                            b[bi * d.b_batch_stride + j * d.k + p]
                        } else {
                            b[bi * d.b_batch_stride + p * d.n + j]
                        };
                        acc = rd(x).mul_add(rd(y), acc);
                    }
                    out.push(rd(acc));
                }
            }
        }
        out
    }

    #[test]
    fn blocked_threaded_matmul_equals_the_plain_loop_bitwise() {
        let mut seed = 1u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        const { assert!(200 * 600 * 600 >= THREADED_MACS && 4 * 120 * 400 * 400 >= THREADED_MACS) };
        for &(batch, m, k, n) in &[
            (1, 1, 1, 1),
            (2, 7, 3, 5),
            (1, 13, 300, 17),
            (3, 6, 16, 16),
            (1, 70, 600, 33),
            // past the threading threshold (THREADED_MACS = 2^26 multiply-adds):
            // rows split over threads, more than one MC block of rows and more
            // than one k-block; then a batch split
            (1, 200, 600, 600),
            (4, 120, 400, 400),
            (1, 0, 4, 3),
            (1, 4, 0, 3),
        ] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                for round in [None, Some(Format::Bf16), Some(Format::Fp16)] {
                    let bstride = if next() % 2 == 0 { 0 } else { k * n };
                    let a: Vec<f32> = (0..batch * m * k)
                        .map(|_| (next() as f32 / 4e9) - 0.5)
                        .collect();
                    let b: Vec<f32> = (0..(if bstride == 0 { 1 } else { batch }) * k * n)
                        .map(|_| (next() as f32 / 4e9) - 0.5)
                        .collect();
                    let d = MatmulDims {
                        batch,
                        m,
                        k,
                        n,
                        trans_a: ta,
                        trans_b: tb,
                        a_batch_stride: m * k,
                        b_batch_stride: bstride,
                    };
                    let got = matmul_f32(&a, &b, d, round);
                    let want = naive(&a, &b, d, round);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{d:?} {round:?}"
                    );
                }
            }
        }
    }
}
