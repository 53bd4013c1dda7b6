//! The CPU reference backend. Every primitive follows the canonical algorithm
//! documented on [`Storage`](super::Storage); the GPU kernels are its twins.
//! f64 storage (for gradient checks) uses the same algorithms with platform
//! f64 math — it has no GPU twin, so it needs none of the contract's care.

use super::math;
use super::round::{self, Format};
use super::{
    AdamWConsts, BinaryLayout, BinaryOp, DType, MatmulDims, ReduceOp, UnaryOp, NORM_CHUNK,
};
use crate::memory::Ticket;
use crate::rng;
use std::cell::{Ref, RefCell, RefMut};

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
    fn div(self, o: f32) -> f32 {
        math::div(self, o)
    }
    fn exp(self) -> f32 {
        math::exp(self)
    }
    fn log(self) -> f32 {
        math::log(self)
    }
    fn sqrt(self) -> f32 {
        math::sqrt(self)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
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

/// `maximum` as the contract defines it: NaN wins, then the larger, `+0` over `-0`.
#[inline]
fn maximum<T: Elem>(a: T, b: T) -> T {
    if a.is_nan() {
        a
    } else if b.is_nan() || b > a {
        b
    } else if a == b && a == T::ZERO && b == T::ZERO {
        // ±0: prefer +0 (x + y on ±0 is +0 unless both are −0)
        a.add(b)
    } else {
        a
    }
}

fn unary_elem<T: Elem>(x: T, op: UnaryOp) -> T {
    match op {
        UnaryOp::Neg => T::NEG_ZERO.sub(x),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.log(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => T::ONE.div(x.sqrt()),
        UnaryOp::Recip => T::ONE.div(x),
        UnaryOp::Sigmoid => T::ONE.div(T::ONE.add(T::NEG_ZERO.sub(x).exp())),
        UnaryOp::Silu => x.mul(T::ONE.div(T::ONE.add(T::NEG_ZERO.sub(x).exp()))),
        UnaryOp::SiluGrad => {
            let s = T::ONE.div(T::ONE.add(T::NEG_ZERO.sub(x).exp()));
            // s * (1 + x * (1 - s)) = s * fma(x, 1 - s, 1)
            s.mul(x.fma(T::ONE.sub(s), T::ONE))
        }
        UnaryOp::Abs => {
            if x < T::ZERO || (x == T::ZERO && T::ONE.div(x) < T::ZERO) {
                T::NEG_ZERO.sub(x)
            } else {
                x
            }
        }
        UnaryOp::Relu => {
            if x > T::ZERO {
                x
            } else if x.is_nan() {
                x
            } else {
                T::ZERO
            }
        }
        UnaryOp::Step => {
            if x > T::ZERO {
                T::ONE
            } else {
                T::ZERO
            }
        }
        UnaryOp::Square => x.mul(x),
        UnaryOp::AddScalar(c) => x.add(T::from_f64(c)),
        UnaryOp::MulScalar(c) => x.mul(T::from_f64(c)),
        UnaryOp::DivScalar(c) => x.div(T::from_f64(c)),
        UnaryOp::RDivScalar(c) => T::from_f64(c).div(x),
        UnaryOp::Round(f) => x.round_to(f),
    }
}

#[inline]
fn binary_elem<T: Elem>(a: T, b: T, op: BinaryOp) -> T {
    match op {
        BinaryOp::Add => a.add(b),
        BinaryOp::Sub => a.sub(b),
        BinaryOp::Mul => a.mul(b),
        BinaryOp::Div => a.div(b),
        BinaryOp::Maximum => maximum(a, b),
        BinaryOp::Eq => {
            if a == b {
                T::ONE
            } else {
                T::ZERO
            }
        }
    }
}

/// Calls `f(out_index, lhs_index, rhs_index)` over a broadcast layout, row-major.
fn for_each_broadcast(layout: &BinaryLayout, mut f: impl FnMut(usize, usize, usize)) {
    let nd = layout.shape.len();
    let n: usize = layout.shape.iter().product();
    if n == 0 {
        return;
    }
    let mut idx = vec![0usize; nd];
    let (mut li, mut ri) = (0usize, 0usize);
    for o in 0..n {
        f(o, li, ri);
        // increment the multi-index, carrying
        for d in (0..nd).rev() {
            idx[d] += 1;
            li += layout.lhs_strides[d];
            ri += layout.rhs_strides[d];
            if idx[d] < layout.shape[d] {
                break;
            }
            li -= layout.lhs_strides[d] * layout.shape[d];
            ri -= layout.rhs_strides[d] * layout.shape[d];
            idx[d] = 0;
        }
    }
}

fn binary_t<T: Elem>(a: &[T], b: &[T], op: BinaryOp, layout: &BinaryLayout) -> Vec<T> {
    let n: usize = layout.shape.iter().product();
    // Fast path: same shape, both contiguous.
    if a.len() == n
        && b.len() == n
        && is_contiguous(&layout.shape, &layout.lhs_strides)
        && is_contiguous(&layout.shape, &layout.rhs_strides)
    {
        return a
            .iter()
            .zip(b)
            .map(|(&x, &y)| binary_elem(x, y, op))
            .collect();
    }
    let mut out = Vec::with_capacity(n);
    for_each_broadcast(layout, |_, li, ri| out.push(binary_elem(a[li], b[ri], op)));
    out
}

pub(crate) fn is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
    let mut expect = 1;
    for d in (0..shape.len()).rev() {
        if shape[d] != 1 && strides[d] != expect {
            return false;
        }
        expect *= shape[d];
    }
    true
}

fn reduce_t<T: Elem>(x: &[T], op: ReduceOp, outer: usize, r: usize, inner: usize) -> Vec<T> {
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
    let layout = BinaryLayout {
        shape: shape.to_vec(),
        lhs_strides: strides.to_vec(),
        rhs_strides: vec![0; shape.len()],
    };
    for_each_broadcast(&layout, |_, li, _| out.push(x[offset + li]));
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

fn softmax_t<T: Elem>(x: &[T], rows: usize, n: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; rows * n];
    for r in 0..rows {
        let row = &x[r * n..(r + 1) * n];
        let m = row.iter().fold(T::NEG_INF, |a, &v| maximum(a, v));
        let o = &mut out[r * n..(r + 1) * n];
        let mut s = T::NEG_ZERO;
        for (y, &v) in o.iter_mut().zip(row) {
            *y = v.sub(m).exp();
            s = s.add(*y);
        }
        for y in o.iter_mut() {
            *y = y.div(s);
        }
    }
    out
}

fn softmax_backward_t<T: Elem>(y: &[T], g: &[T], rows: usize, n: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; rows * n];
    for r in 0..rows {
        let (yr, gr) = (&y[r * n..(r + 1) * n], &g[r * n..(r + 1) * n]);
        let dot = yr
            .iter()
            .zip(gr)
            .fold(T::NEG_ZERO, |a, (&yv, &gv)| gv.fma(yv, a));
        for ((o, &yv), &gv) in out[r * n..(r + 1) * n].iter_mut().zip(yr).zip(gr) {
            *o = yv.mul(gv.sub(dot));
        }
    }
    out
}

// ---------------------------------------------------------------- matmul ----

/// Rows of the register tile.
const MR: usize = 6;
/// Columns of the register tile (two AVX2 vectors of f32).
const NR: usize = 16;

/// Packs `op(A)` (m, k) of one batch into row panels of MR: `ap[panel][p][r]`,
/// rounding each element once when `round` is set; rows past `m` are zero.
fn pack_a(a: &[f32], m: usize, k: usize, trans: bool, round: Option<Format>) -> Vec<f32> {
    let panels = m.div_ceil(MR);
    let mut ap = vec![0.0f32; panels * k * MR];
    for i in 0..m {
        let (pi, r) = (i / MR, i % MR);
        let base = pi * k * MR + r;
        for p in 0..k {
            let v = if trans { a[p * m + i] } else { a[i * k + p] };
            ap[base + p * MR] = match round {
                Some(f) => round::round_f32(v, f),
                None => v,
            };
        }
    }
    ap
}

/// Packs `op(B)` (k, n) of one batch into column panels of NR: `bp[panel][p][c]`.
fn pack_b(b: &[f32], k: usize, n: usize, trans: bool, round: Option<Format>) -> Vec<f32> {
    let panels = n.div_ceil(NR);
    let mut bp = vec![0.0f32; panels * k * NR];
    for p in 0..k {
        for j in 0..n {
            let v = if trans { b[j * k + p] } else { b[p * n + j] };
            let (pj, c) = (j / NR, j % NR);
            bp[pj * k * NR + p * NR + c] = match round {
                Some(f) => round::round_f32(v, f),
                None => v,
            };
        }
    }
    bp
}

/// Depth of one k-block: an MR×KC slice of A (6 KiB) and a KC×NR slice of B
/// (16 KiB) stay in L1 while a tile is computed.
const KC: usize = 256;

/// Row panels per L2 block of A (MC = 72 rows).
const MC_PANELS: usize = 12;

/// One MR×NR tile over one k-block: `acc[r][c] = fma(a[p][r], b[p][c], acc[r][c])`
/// for `p` ascending, starting from the running values in `acc`. Carrying the
/// accumulators from one k-block to the next keeps every output's sum in the
/// contract's exact order while the blocks stay in cache.
#[inline(always)]
fn micro_kernel(ap: &[f32], bp: &[f32], kc: usize, acc: &mut [[f32; NR]; MR]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the target features are enabled at compile time (see
        // .cargo/config.toml); loads stay inside the slices, checked below.
        assert!(ap.len() >= kc * MR && bp.len() >= kc * NR);
        unsafe { micro_kernel_avx2(ap.as_ptr(), bp.as_ptr(), kc, acc) };
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    for p in 0..kc {
        let b: &[f32; NR] = bp[p * NR..p * NR + NR].try_into().unwrap();
        let a: &[f32; MR] = ap[p * MR..p * MR + MR].try_into().unwrap();
        for r in 0..MR {
            for c in 0..NR {
                acc[r][c] = a[r].mul_add(b[c], acc[r][c]);
            }
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
unsafe fn micro_kernel_avx2(ap: *const f32, bp: *const f32, kc: usize, acc: &mut [[f32; NR]; MR]) {
    use std::arch::x86_64::*;
    let mut c = [[_mm256_setzero_ps(); 2]; MR];
    for r in 0..MR {
        c[r][0] = _mm256_loadu_ps(acc[r].as_ptr());
        c[r][1] = _mm256_loadu_ps(acc[r].as_ptr().add(8));
    }
    for p in 0..kc {
        let b0 = _mm256_loadu_ps(bp.add(p * NR));
        let b1 = _mm256_loadu_ps(bp.add(p * NR + 8));
        for r in 0..MR {
            let a = _mm256_broadcast_ss(&*ap.add(p * MR + r));
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
        }
    }
    for r in 0..MR {
        _mm256_storeu_ps(acc[r].as_mut_ptr(), c[r][0]);
        _mm256_storeu_ps(acc[r].as_mut_ptr().add(8), c[r][1]);
    }
}

/// Computes the rows `[r0, r0 + rows)` of one batch's `C` (`out` holds exactly
/// those rows) from packed operands.
fn matmul_rows(
    ap: &[f32],
    bp: &[f32],
    k: usize,
    n: usize,
    r0: usize,
    out: &mut [f32],
    round: Option<Format>,
) {
    let rows = out.len() / n;
    let (p0, p1) = (r0 / MR, (r0 + rows).div_ceil(MR));
    let col_panels = n.div_ceil(NR);
    // Running accumulators of every tile this thread owns, carried across k-blocks.
    let mut accs = vec![[[0.0f32; NR]; MR]; (p1 - p0) * col_panels];
    let mut kb = 0;
    while kb < k {
        let kc = KC.min(k - kb);
        // Row panels in groups of MC_PANELS: that slice of A (about 72 KiB)
        // stays in L2 while every column panel of B streams past it.
        for ib in (p0..p1).step_by(MC_PANELS) {
            for pj in 0..col_panels {
                let b_blk = &bp[pj * k * NR + kb * NR..];
                for pi in ib..(ib + MC_PANELS).min(p1) {
                    let a_blk = &ap[pi * k * MR + kb * MR..];
                    micro_kernel(a_blk, b_blk, kc, &mut accs[(pi - p0) * col_panels + pj]);
                }
            }
        }
        kb += KC;
    }
    for pi in p0..p1 {
        for pj in 0..col_panels {
            let acc = &accs[(pi - p0) * col_panels + pj];
            for (r, acc_row) in acc.iter().enumerate() {
                let i = pi * MR + r;
                if i < r0 || i >= r0 + rows {
                    continue;
                }
                for (cc, &v) in acc_row.iter().enumerate() {
                    let j = pj * NR + cc;
                    if j >= n {
                        break;
                    }
                    out[(i - r0) * n + j] = match round {
                        Some(f) => round::round_f32(v, f),
                        None => v,
                    };
                }
            }
        }
    }
}

/// Threads of a large CPU matmul; 0 = all available cores.
static MATMUL_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Caps the threads a CPU matmul uses (`None` = all available cores), e.g. to
/// compare with a single-threaded baseline. Results never depend on it: threads
/// split rows or batches, never k.
pub fn set_matmul_threads(threads: Option<usize>) {
    MATMUL_THREADS.store(threads.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

fn matmul_f32(a: &[f32], b: &[f32], d: MatmulDims, round: Option<Format>) -> Vec<f32> {
    let MatmulDims { batch, m, k, n, .. } = d;
    let mut out = vec![0.0f32; batch * m * n];
    if m == 0 || n == 0 || batch == 0 {
        return out;
    }
    let threads = if batch * m * n * k >= 1 << 18 {
        match MATMUL_THREADS.load(std::sync::atomic::Ordering::Relaxed) {
            0 => std::thread::available_parallelism()
                .map(|t| t.get())
                .unwrap_or(1),
            t => t,
        }
    } else {
        1
    };
    // One batch entry: pack (rounding each operand element once), multiply.
    let one = |bi: usize, c: &mut [f32], threads: usize| {
        let ap = pack_a(&a[bi * d.a_batch_stride..], m, k, d.trans_a, round);
        let bp = pack_b(&b[bi * d.b_batch_stride..], k, n, d.trans_b, round);
        if threads == 1 {
            matmul_rows(&ap, &bp, k, n, 0, c, round);
            return;
        }
        // Threads split whole row panels only; each output's k-loop is
        // untouched, so results do not depend on the thread count.
        let rows_per_thread = m.div_ceil(MR).div_ceil(threads) * MR;
        std::thread::scope(|s| {
            for (t, chunk) in c.chunks_mut(rows_per_thread * n).enumerate() {
                let (ap, bp) = (&ap, &bp);
                s.spawn(move || matmul_rows(ap, bp, k, n, t * rows_per_thread, chunk, round));
            }
        });
    };
    if threads > 1 && batch >= threads {
        // Many small products (attention heads): split the batch instead.
        let per = batch.div_ceil(threads);
        std::thread::scope(|s| {
            for (t, chunk) in out.chunks_mut(per * m * n).enumerate() {
                let one = &one;
                s.spawn(move || {
                    for (i, c) in chunk.chunks_mut(m * n).enumerate() {
                        one(t * per + i, c, 1);
                    }
                });
            }
        });
    } else {
        for (bi, c) in out.chunks_mut(m * n).enumerate() {
            one(bi, c, threads);
        }
    }
    out
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
        both!(self, x => x.iter().map(|&v| unary_elem(v, op)).collect())
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
        for i in 0..p.len() {
            let gi = g[i];
            let p1 = p[i] * c.decay;
            let mi = c.beta1.mul_add(m[i], c.omb1 * gi);
            let vi = c.beta2.mul_add(v[i], c.omb2 * (gi * gi));
            let den = math::div(math::sqrt(vi), c.bc2_sqrt) + c.eps;
            p[i] = (-c.step_size).mul_add(math::div(mi, den), p1);
            m[i] = mi;
            v[i] = vi;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
        for &(batch, m, k, n) in &[
            (1, 1, 1, 1),
            (2, 7, 3, 5),
            (1, 13, 300, 17),
            (3, 6, 16, 16),
            (1, 70, 600, 33),
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
