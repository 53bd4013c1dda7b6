//! The CPU side's shared ground: counted host buffers ([`CpuStorage`]), the
//! scalar type an algorithm runs on ([`Elem`]), the contract's fold orders,
//! groups of lanes, strided walks, and the threads the large kernels use.
//! Each primitive's CPU reference lives in its family's `cpu.rs`.
//!
//! f64 storage (for gradient checks) uses the same algorithms with platform
//! f64 math — it has no GPU twin, so it needs none of the contract's care.

pub mod pool;
pub mod simd;

use std::mem::MaybeUninit;
use super::math;
use simd::LANES;
use super::round::{self, Format, Fp8};
use super::{BinaryLayout, DType};
use crate::memory::Ticket;
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
    /// `a[i].div(b[i])` for a group of lanes at once, where loops over slices
    /// divide (f32: hardware divisions wherever they provably have the
    /// contract's bits, [`math::div_lanes`]).
    #[inline(always)]
    fn div_lanes(a: [Self; LANES], b: [Self; LANES]) -> [Self; LANES] {
        std::array::from_fn(|i| a[i].div(b[i]))
    }
    fn exp(self) -> Self;
    /// [`Elem::exp`] of each lane.
    #[inline(always)]
    fn exp_lanes(x: [Self; LANES]) -> [Self; LANES] {
        x.map(Self::exp)
    }
    fn log(self) -> Self;
    fn sqrt(self) -> Self;
    fn is_nan(self) -> bool;
    fn is_finite(self) -> bool;
    fn round_to(self, f: Format) -> Self;
    fn round_fp8(self, f: Fp8) -> Self;
    fn wrap(v: Vec<Self>) -> CpuStorage;
    /// The values of a storage of this type (the dispatch has checked the dtype).
    fn view(s: &CpuStorage) -> Ref<'_, Vec<Self>>;
    /// Each of the `rows` rows (`n > 0` wide) of `x` added up in order from
    /// −0, every value first squared (rounded) with `square` — the
    /// [`fold_ragged`] of the row reductions, four rows in lockstep.
    fn row_sums(x: &[Self], n: usize, rows: usize, square: bool) -> Vec<Self> {
        folded_row_sums(x, n, rows, square)
    }
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
    fn exp_lanes(x: [f32; LANES]) -> [f32; LANES] {
        math::exp_lanes(x)
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
    fn round_fp8(self, f: Fp8) -> f32 {
        crate::backend::round::fp8_f32(self, f)
    }
    fn round_to(self, f: Format) -> f32 {
        round::round_f32(self, f)
    }
    fn wrap(v: Vec<f32>) -> CpuStorage {
        CpuStorage::F32(Buf::new(v))
    }
    fn view(s: &CpuStorage) -> Ref<'_, Vec<f32>> {
        s.f32s()
    }
    /// Eight rows a vector with AVX2 (`simd::row_sums_avx2`), the same bits.
    fn row_sums(x: &[f32], n: usize, rows: usize, square: bool) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        if simd::level() != simd::Level::Portable {
            let lens = vec![n; rows];
            // SAFETY: these levels are only set where the CPU reported AVX2 and FMA.
            return unsafe {
                match square {
                    true => simd::row_sums_avx2::<true>(x, n, &lens),
                    false => simd::row_sums_avx2::<false>(x, n, &lens),
                }
            };
        }
        folded_row_sums(x, n, rows, square)
    }
}

/// [`Elem::row_sums`] by [`fold_ragged`].
fn folded_row_sums<T: Elem>(x: &[T], n: usize, rows: usize, square: bool) -> Vec<T> {
    let lens = vec![n; rows];
    match square {
        true => fold_ragged(x, n, &lens, T::NEG_ZERO, |a, v| a.add(v.mul(v))),
        false => fold_ragged(x, n, &lens, T::NEG_ZERO, |a, v| a.add(v)),
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
    fn round_fp8(self, f: Fp8) -> f64 {
        crate::backend::round::fp8_f64(self, f)
    }
    fn round_to(self, f: Format) -> f64 {
        round::round_f64(self, f)
    }
    fn wrap(v: Vec<f64>) -> CpuStorage {
        CpuStorage::F64(Buf::new(v))
    }
    fn view(s: &CpuStorage) -> Ref<'_, Vec<f64>> {
        match s {
            CpuStorage::F64(b) => b.get(),
            CpuStorage::F32(_) => panic!("expected f64 storage"),
        }
    }
}

/// `maximum` as the contract defines it: NaN wins (the first NaN), then the
/// larger, `+0` over `-0`. Branch-free (each case computed, then selected),
/// since in a running max "b > a" is as unpredictable as data.
#[inline(always)]
pub fn maximum<T: Elem>(a: T, b: T) -> T {
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
pub fn fold_rows<T: Elem, const R: usize>(rows: [&[T]; R], init: T, f: impl Fn(T, T) -> T) -> [T; R] {
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
#[inline(always)]
pub fn fold_ragged<T: Elem>(
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

// ---------------------------------------------------------------- outputs ----
//
// The kernels write their outputs once, into buffers that were allocated and
// not zero-filled (a zero fill of a large output is a measurable share of a
// product). What says that every value was written is [`fill`]: a writer hands
// back the values it wrote as `&mut [T]`, which safe code can only make over
// initialised values (`write_exact`, `write_lanes`, `write_zeros`, or a SIMD
// writer's own `assume_init_mut`), and `fill` checks that those parts cover
// the output. [`new_vec`] allocates an output that way; nothing else sets a
// vector's length over values it has not seen written.

/// The parts of an output that a [`fill`] writer has written, in any order:
/// each must lie inside the output, and `fill` checks that they add up to
/// all of it.
pub struct Written<'a, T> {
    /// The output's first address.
    start: usize,
    /// The output's end.
    end: usize,
    /// The bytes of the parts so far.
    bytes: usize,
    _parts: std::marker::PhantomData<&'a mut [T]>,
}

impl<'a, T> Written<'a, T> {
    /// Nothing written yet of `out`.
    fn at(out: &[MaybeUninit<T>]) -> Self {
        // addresses tell parts apart only if values take room
        const { assert!(std::mem::size_of::<T>() > 0, "outputs of a zero-sized type") };
        let start = out.as_ptr() as usize;
        Written { start, end: start + std::mem::size_of_val(out), bytes: 0, _parts: std::marker::PhantomData }
    }

    /// Counts `part`, values of the output, as written; panics if it does not
    /// lie inside the output.
    #[inline(always)]
    pub fn add(&mut self, part: &'a mut [T]) {
        if part.is_empty() {
            return;
        }
        let (at, bytes) = (part.as_ptr() as usize, std::mem::size_of_val(part));
        assert!(at >= self.start && at + bytes <= self.end, "a written part outside the output");
        self.bytes += bytes;
    }

    /// [`Written::add`] of each part.
    #[inline(always)]
    pub fn add_all(&mut self, parts: impl IntoIterator<Item = &'a mut [T]>) {
        for p in parts {
            self.add(p);
        }
    }

    /// Panics unless the parts add up to the whole output.
    fn check(&self) {
        assert!(self.bytes == self.end - self.start, "an output not written in full");
    }
}

// Why a writer's parts prove its output written, for the two places below
// that take them as proof: each part added to a `Written<'a, T>` is a
// `&'a mut [T]`, so its values are initialised (safe code cannot make one
// over uninitialised memory), and it borrows what it covers for all of 'a,
// which outlasts the writer: nothing written after the part was made can have
// undone that. Two such borrows alive for all of 'a cannot overlap (a
// `&mut` into the output's memory can only come from the reborrow the writer
// got: the output is borrowed exclusively, or owned), and `T` is not
// zero-sized, so the parts' address ranges are disjoint; each lies inside the
// output, and together they are as large as the output: they are all of it.

/// `dst` written by `write`, which gets its values to write and adds what it
/// wrote to the [`Written`] (in order, as `&mut [T]`); panics unless those
/// parts are all of `dst`.
#[inline(always)]
pub fn fill<'d, T>(
    dst: &'d mut [MaybeUninit<T>],
    write: impl for<'a> FnOnce(&'a mut [MaybeUninit<T>], &mut Written<'a, T>),
) -> &'d mut [T] {
    let mut written = Written::at(dst);
    write(&mut *dst, &mut written);
    written.check();
    // SAFETY: the parts written are all of `dst` (checked), so every value
    // is initialised (see above).
    unsafe { assume_init_mut(dst) }
}

/// `N` vectors of `lens` values, written in place by `write` together, each
/// as [`fill`] has it (no zero fill first); panics unless each output's parts
/// are all of it.
#[inline(always)]
pub fn new_vecs<T, const N: usize>(
    lens: [usize; N],
    write: impl for<'a> FnOnce([&'a mut [MaybeUninit<T>]; N], &mut [Written<'a, T>; N]),
) -> [Vec<T>; N] {
    let mut vecs = lens.map(Vec::with_capacity);
    let mut i = 0;
    let slots = vecs.each_mut().map(|v| {
        i += 1;
        &mut v.spare_capacity_mut()[..lens[i - 1]]
    });
    let mut written = slots.each_ref().map(|s| Written::at(s));
    write(slots, &mut written);
    for w in &written {
        w.check();
    }
    for (v, n) in vecs.iter_mut().zip(lens) {
        // SAFETY: the capacity is at least `n`, and the parts written are
        // all of the first `n` values (checked), so they are initialised
        // (see above).
        unsafe { v.set_len(n) };
    }
    vecs
}

/// A vector of `n` values written in place by `write`, as [`fill`] has it
/// (no zero fill first).
#[inline(always)]
pub fn new_vec<T>(n: usize, write: impl for<'a> FnOnce(&'a mut [MaybeUninit<T>], &mut Written<'a, T>)) -> Vec<T> {
    let [v] = new_vecs([n], |[out], [written]| write(out, written));
    v
}

/// Writes the first `dst.len()` of `values` into `dst` and returns it
/// initialised, for kernels that write their output once with no zero fill
/// before; panics if `values` runs out first.
#[inline(always)]
pub fn write_exact<T>(dst: &mut [MaybeUninit<T>], values: impl IntoIterator<Item = T>) -> &mut [T] {
    let mut written = 0;
    for (d, v) in dst.iter_mut().zip(values) {
        d.write(v);
        written += 1;
    }
    assert_eq!(written, dst.len(), "too few values for the output");
    // SAFETY: all `dst.len()` elements were written just above.
    unsafe { assume_init_mut(dst) }
}

/// Writes +0 into every element of `dst` (one `memset`: the +0 of both
/// element types, f32 and f64, is all zero bits).
pub fn write_zeros<T: Elem>(dst: &mut [MaybeUninit<T>]) -> &mut [T] {
    // SAFETY: `dst` is valid for `dst.len()` writes, and all-zero bytes are
    // +0 of both element types; so every element is written and valid.
    unsafe {
        std::ptr::write_bytes(dst.as_mut_ptr(), 0, dst.len());
        assume_init_mut(dst)
    }
}

/// `x` as the values written into it.
///
/// # Safety
/// Every element of `x` has been written.
#[inline(always)]
pub unsafe fn assume_init_mut<T>(x: &mut [MaybeUninit<T>]) -> &mut [T] {
    // SAFETY: MaybeUninit<T> has T's layout, and the caller vouches for the values.
    unsafe { &mut *(x as *mut [MaybeUninit<T>] as *mut [T]) }
}

simd::multiversion! {
    /// σ(x) = div(1, 1 + exp(−0 − x)) into `s` (every value written), in two
    /// passes of vector operations: the exps, then the divisions. (Its own
    /// AVX2 copy: its closures must have the features the vector exp needs to
    /// inline; as one pass a group's work is too large to inline at all.)
    pub fn sigmoid_into<'s, T: Elem>(s: &'s mut [MaybeUninit<T>], x: &[T]) -> &'s mut [T] {
        let s = write_lanes(s, x, |v| T::exp_lanes(v.map(|v| T::NEG_ZERO.sub(v))).map(|e| T::ONE.add(e)));
        for_lanes_mut(s, |d| T::div_lanes([T::ONE; LANES], d));
        s
    }
}

/// `dst = f(src)` a group of [`LANES`] at a time; the ragged tail goes
/// through `f` padded with zeros (their results are dropped). Returns `dst`
/// as written.
#[inline(always)]
pub fn write_lanes<'d, T: Elem>(
    dst: &'d mut [MaybeUninit<T>],
    src: &[T],
    f: impl Fn([T; LANES]) -> [T; LANES],
) -> &'d mut [T] {
    assert_eq!(dst.len(), src.len(), "one output per input");
    let mut groups = dst.chunks_exact_mut(LANES);
    let mut inputs = src.chunks_exact(LANES);
    for (g, v) in (&mut groups).zip(&mut inputs) {
        for (d, y) in g.iter_mut().zip(f(v.try_into().unwrap())) {
            d.write(y);
        }
    }
    let (tail, rest) = (groups.into_remainder(), inputs.remainder());
    if !tail.is_empty() {
        let mut v = [T::ZERO; LANES];
        v[..rest.len()].copy_from_slice(rest);
        for (d, y) in tail.iter_mut().zip(f(v)) {
            d.write(y);
        }
    }
    // SAFETY: every element of `dst` was written above.
    unsafe { assume_init_mut(dst) }
}

/// `x = f(x)` a group of [`LANES`] at a time, in place; the ragged tail goes
/// through `f` padded with zeros (their results are dropped).
#[inline(always)]
pub fn for_lanes_mut<T: Elem>(x: &mut [T], f: impl Fn([T; LANES]) -> [T; LANES]) {
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
#[inline(always)]
pub fn for_each_run(layout: &BinaryLayout, mut run: impl FnMut(usize, usize, usize, usize, usize)) {
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

/// A broadcast layout cut along its outermost (coalesced) dimension into at
/// most `parts` pieces for the threads, each `(output start, lhs offset, rhs
/// offset, layout)`: one piece below [`pool::SPLIT_VALUES`] outputs.
pub fn split_layout(layout: &BinaryLayout, parts: usize) -> Vec<(usize, usize, usize, BinaryLayout)> {
    let [shape, ls, rs] = coalesce(layout);
    let n: usize = shape.iter().product();
    let parts = if n < pool::SPLIT_VALUES { 1 } else { parts.clamp(1, shape[0]) };
    let (inner, per) = (n / shape[0], shape[0].div_ceil(parts));
    (0..shape[0])
        .step_by(per)
        .map(|s| {
            let mut piece = shape.clone();
            piece[0] = per.min(shape[0] - s);
            let layout = BinaryLayout {
                shape: piece,
                lhs_strides: ls.clone(),
                rhs_strides: rs.clone(),
            };
            (s * inner, s * ls[0], s * rs[0], layout)
        })
        .collect()
}

/// `out` cut at the pieces' output starts (see [`split_layout`]).
pub fn split_at_starts<'a, T>(
    mut out: &'a mut [T],
    pieces: &[(usize, usize, usize, BinaryLayout)],
) -> Vec<&'a mut [T]> {
    let mut parts = Vec::with_capacity(pieces.len());
    for (i, p) in pieces.iter().enumerate().rev() {
        let (rest, part) = out.split_at_mut(p.0);
        parts.push(part);
        out = rest;
        debug_assert!(i > 0 || out.is_empty());
    }
    parts.reverse();
    parts
}

// --------------------------------------------------------------- threads ----

/// The cap on a large CPU kernel's threads; 0 = all available cores.
static CPU_THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Caps the threads the large CPU kernels (matmul, AdamW) use (`None` =
/// all available cores), e.g. to compare with a single-threaded baseline.
/// Results never depend on it: threads split rows, batches or elements, never k.
pub fn set_cpu_threads(threads: Option<usize>) {
    CPU_THREADS.store(threads.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

/// The threads a large CPU kernel (matmul, AdamW) uses: the cap set by
/// [`set_cpu_threads`], else all available cores.
pub fn cpu_threads() -> usize {
    match CPU_THREADS.load(std::sync::atomic::Ordering::Relaxed) {
        0 => std::thread::available_parallelism().map_or(1, |t| t.get()),
        t => t,
    }
}

/// How long an idle CPU thread watches for the next parallel pass by default.
const DEFAULT_SPIN: std::time::Duration = std::time::Duration::from_millis(2);

/// The idle threads' watch in nanoseconds; `u64::MAX` = [`DEFAULT_SPIN`].
static CPU_SPIN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Sets how long a thread of the CPU kernels keeps watching for the next
/// parallel pass after finishing one, before it sleeps (`None` = the
/// default, 2 ms). A training step hands out passes in quick succession and
/// waking a sleeping thread can cost more than a pass, so the threads spin
/// meanwhile: that burns CPU time in an application that does other work
/// between the library's calls. `Some(Duration::ZERO)` turns the spin off (a
/// thread sleeps as soon as it has nothing to do; the passes then wait for
/// their threads to wake). Takes effect at once, on the threads' next look;
/// results never depend on it.
pub fn set_cpu_spin(spin: Option<std::time::Duration>) {
    let nanos = spin.map_or(u64::MAX, |d| d.as_nanos().min(u64::MAX as u128 - 1) as u64);
    CPU_SPIN.store(nanos, std::sync::atomic::Ordering::Relaxed);
}

/// How long an idle thread of the CPU kernels watches for the next parallel
/// pass before it sleeps: the time set by [`set_cpu_spin`], else 2 ms.
pub fn cpu_spin() -> std::time::Duration {
    match CPU_SPIN.load(std::sync::atomic::Ordering::Relaxed) {
        u64::MAX => DEFAULT_SPIN,
        n => std::time::Duration::from_nanos(n),
    }
}

/// `both!(storage, x => expr)`: `expr` over the f32 or f64 values as `x`,
/// its `Vec` wrapped back into a storage of the same dtype.
macro_rules! both {
    ($s:expr, $x:ident => $e:expr) => {
        match $s {
            $crate::backend::cpu::CpuStorage::F32(b) => {
                let $x = &*b.get();
                <f32 as $crate::backend::cpu::Elem>::wrap($e)
            }
            $crate::backend::cpu::CpuStorage::F64(b) => {
                let $x = &*b.get();
                <f64 as $crate::backend::cpu::Elem>::wrap($e)
            }
        }
    };
}
pub(crate) use both;

/// `both2!(a, b, x, y => expr)`: the same over two buffers of one dtype (the
/// dispatch has checked that they agree).
macro_rules! both2 {
    ($a:expr, $b:expr, $x:ident, $y:ident => $e:expr) => {
        match ($a, $b) {
            ($crate::backend::cpu::CpuStorage::F32(a), $crate::backend::cpu::CpuStorage::F32(b)) => {
                let ($x, $y) = (&*a.get(), &*b.get());
                <f32 as $crate::backend::cpu::Elem>::wrap($e)
            }
            ($crate::backend::cpu::CpuStorage::F64(a), $crate::backend::cpu::CpuStorage::F64(b)) => {
                let ($x, $y) = (&*a.get(), &*b.get());
                <f64 as $crate::backend::cpu::Elem>::wrap($e)
            }
            _ => unreachable!("dtypes checked by the dispatch"),
        }
    };
}
pub(crate) use both2;

impl CpuStorage {
    pub fn from_f32(data: Vec<f32>) -> CpuStorage {
        CpuStorage::F32(Buf::new(data))
    }
    pub fn from_f64(data: Vec<f64>) -> CpuStorage {
        CpuStorage::F64(Buf::new(data))
    }
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
    #[cfg(feature = "test-hooks")]
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
    /// The f32 buffer, writable (the optimizer state and masters are f32).
    pub fn f32s_mut(&self) -> RefMut<'_, Vec<f32>> {
        match self {
            CpuStorage::F32(b) => b.get_mut(),
            CpuStorage::F64(_) => panic!("optimizer state must be f32 (the masters)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::write_exact;
    use std::mem::MaybeUninit;

    /// The output is exactly the values written, and a kernel that runs out
    /// of values panics rather than leave part of its output unwritten.
    #[test]
    fn write_exact_fills_or_refuses() {
        let mut out = [MaybeUninit::<f32>::uninit(); 3];
        assert_eq!(write_exact(&mut out, [1.0, 2.0, 3.0, 4.0]), &[1.0, 2.0, 3.0]);
        let short = std::panic::catch_unwind(|| {
            let mut out = [MaybeUninit::<f32>::uninit(); 3];
            write_exact(&mut out, [1.0, 2.0]).len()
        });
        assert!(short.is_err());
    }
}
