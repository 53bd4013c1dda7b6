//! The CPU reference of the reductions.

use super::{ReduceOp, ReduceOps, NORM_CHUNK};
use crate::backend::cpu::pool;
use crate::backend::cpu::{
    both, both2, cpu_threads, fill, fold_ragged, for_lanes_mut, maximum, new_vec, simd, write_exact,
    write_lanes, write_zeros, CpuStorage, Elem,
};
use crate::backend::cpu::simd::LANES;
use crate::Result;
use std::cell::Ref;
use std::mem::MaybeUninit;

impl ReduceOps for CpuStorage {
    fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<CpuStorage> {
        Ok(both!(self, x => reduce_t(x, op, outer, r, inner)))
    }

    fn softmax_rows(&self, rows: usize, n: usize, scale: f32, causal: bool) -> Result<CpuStorage> {
        if let CpuStorage::F32(x) = self {
            let x = &*x.get();
            return Ok(f32::wrap(by_row_blocks(rows, n, |r0, k, out| {
                softmax_f32(&x[r0 * n..(r0 + k) * n], r0, n, scale, causal, out)
            })));
        }
        Ok(both!(self, x => by_row_blocks(rows, n, |r0, k, out| {
            softmax_t(&x[r0 * n..(r0 + k) * n], r0, n, scale, causal, SOFTMAX_BLOCK_ELEMS, out)
        })))
    }

    fn softmax_rows_backward(
        &self,
        g: &CpuStorage,
        rows: usize,
        n: usize,
        scale: f32,
    ) -> Result<CpuStorage> {
        if let (CpuStorage::F32(y), CpuStorage::F32(g)) = (self, g) {
            let (y, g) = (&*y.get(), &*g.get());
            return Ok(f32::wrap(by_row_blocks(rows, n, |r0, k, out| {
                let span = r0 * n..(r0 + k) * n;
                softmax_backward_f32(&y[span.clone()], &g[span], k, n, scale, false, out)
            })));
        }
        Ok(both2!(self, g, y, g => by_row_blocks(rows, n, |r0, k, out| {
            let span = r0 * n..(r0 + k) * n;
            softmax_backward_t(&y[span.clone()], &g[span], k, n, scale, false, out)
        })))
    }

    fn chunk_sum_squares(bufs: &[&CpuStorage]) -> Result<Vec<f32>> {
        // f32 buffers read in place (no copy of every gradient), f64 ones narrowed
        let narrowed: Vec<Vec<f32>> = bufs
            .iter()
            .map(|b| match b {
                CpuStorage::F32(_) => Vec::new(),
                other => other.to_vec_f32(),
            })
            .collect();
        let held: Vec<Option<Ref<'_, Vec<f32>>>> = bufs
            .iter()
            .map(|b| match b {
                CpuStorage::F32(v) => Some(v.get()),
                CpuStorage::F64(_) => None,
            })
            .collect();
        let pieces = held.iter().zip(&narrowed).flat_map(|(h, own)| h.as_deref().unwrap_or(own).chunks(SQUARES_PIECE));
        Ok(pool::map(pieces, chunk_sums_of_squares).concat())
    }
}

/// Values per part of the chunked sums of squares handed to a thread: whole
/// chunks, so every buffer's chunks are the same however it is cut.
pub(crate) const SQUARES_PIECE: usize = 64 * NORM_CHUNK;

simd::multiversion! {
    /// Each [`NORM_CHUNK`] values' `fma(v, v, acc)` from −0 in order. Eight
    /// chunks' folds run side by side (one fold alone waits on every fma's
    /// latency), each in its own order.
    pub(crate) fn chunk_sums_of_squares(b: &[f32]) -> Vec<f32> {
        const SIDE: usize = 8;
        let mut sums = Vec::with_capacity(b.len().div_ceil(NORM_CHUNK));
        let mut groups = b.chunks_exact(SIDE * NORM_CHUNK);
        for g in &mut groups {
            let c: [&[f32]; SIDE] = std::array::from_fn(|j| &g[j * NORM_CHUNK..(j + 1) * NORM_CHUNK]);
            let mut acc = [-0.0f32; SIDE];
            for i in 0..NORM_CHUNK {
                for (a, cj) in acc.iter_mut().zip(&c) {
                    *a = cj[i].mul_add(cj[i], *a);
                }
            }
            sums.extend(acc);
        }
        let rest = groups.remainder().chunks(NORM_CHUNK);
        sums.extend(rest.map(|c| c.iter().fold(-0.0f32, |a, &v| v.mul_add(v, a))));
        sums
    }
}

/// The `(rows, n)` output of `f(first_row, rows, out)`, which writes every
/// value of its rows' `out` and hands it back: one block of whole rows per
/// thread (from [`pool::SPLIT_VALUES`] values; each row is independent of the
/// others, so the bits do not depend on the split), each written in place.
fn by_row_blocks<T: Elem>(
    rows: usize,
    n: usize,
    f: impl for<'o> Fn(usize, usize, &'o mut [MaybeUninit<T>]) -> &'o mut [T] + Sync,
) -> Vec<T> {
    let len = rows * n;
    let threads = cpu_threads();
    new_vec(len, |out, written| {
        if len < pool::SPLIT_VALUES || rows < 2 || threads == 1 {
            written.add(f(0, rows, out));
        } else {
            let per = rows.div_ceil(threads);
            written.add_all(pool::map(out.chunks_mut(per * n).enumerate(), |(b, o)| f(b * per, o.len() / n, o)));
        }
    })
}

simd::multiversion! {
    fn reduce_t<T: Elem>(x: &[T], op: ReduceOp, outer: usize, r: usize, inner: usize) -> Vec<T> {
        if inner == 1 && r > 0 {
            // Along contiguous rows: each row folded in order, four rows in flight.
            let (x, whole) = (&x[..outer * r], vec![r; outer]);
            return match op {
                ReduceOp::Sum => fold_ragged(x, r, &whole, T::NEG_ZERO, |a, v| a.add(v)),
                // a max in lanes: the same value, NaN-ness and zero sign as
                // the ascending fold (see `max_by_lanes`), without its chain
                // of dependent steps (an fp8 amax is one row of a whole tensor)
                ReduceOp::Max => x.chunks_exact(r).map(max_by_lanes).collect(),
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
}

/// The f32 softmax of rows `first_row ..` (`n` wide) into `out`: the
/// AVX2 kernel where the CPU has it, else [`softmax_t`].
fn softmax_f32<'o>(
    x: &[f32],
    first_row: usize,
    n: usize,
    scale: f32,
    causal: bool,
    out: &'o mut [MaybeUninit<f32>],
) -> &'o mut [f32] {
    #[cfg(target_arch = "x86_64")]
    if simd::level() >= simd::Level::Avx2 {
        // SAFETY: the level is only Avx2 or above where the CPU has AVX2 and FMA.
        let wide = simd::level() == simd::Level::Avx512;
        // SAFETY: the level is only Avx2 or above where the CPU has AVX2 and
        // FMA, and Avx512 where it also has AVX-512F.
        return unsafe { avx2::softmax_f32(x, first_row, n, scale, causal, SOFTMAX_BLOCK_ELEMS, out, wide) };
    }
    softmax_t(x, first_row, n, scale, causal, SOFTMAX_BLOCK_ELEMS, out)
}

/// The f32 softmax backward of `rows` rows (`n` wide) into `out`: the AVX2
/// kernel where the CPU has it, else [`softmax_backward_t`].
fn softmax_backward_f32<'o>(
    y: &[f32],
    g: &[f32],
    rows: usize,
    n: usize,
    scale: f32,
    causal: bool,
    out: &'o mut [MaybeUninit<f32>],
) -> &'o mut [f32] {
    #[cfg(target_arch = "x86_64")]
    if simd::level() >= simd::Level::Avx2 {
        // SAFETY: the level is only Avx2 or above where the CPU has AVX2 and FMA.
        return unsafe { avx2::softmax_backward_f32(y, g, rows, n, scale, causal, out) };
    }
    softmax_backward_t(y, g, rows, n, scale, causal, out)
}

/// [`ReduceOps::softmax_rows`] of f32 rows on the calling thread, for a
/// caller that runs one head per thread itself (attention).
pub(crate) fn softmax_f32_one_thread(x: &[f32], n: usize, scale: f32, causal: bool) -> Vec<f32> {
    new_vec(x.len(), |out, written| written.add(softmax_f32(x, 0, n, scale, causal, out)))
}

/// [`ReduceOps::softmax_rows_backward`] of f32 rows on the calling thread;
/// `causal` as [`softmax_backward_t`] takes it.
pub(crate) fn softmax_backward_f32_one_thread(y: &[f32], g: &[f32], n: usize, scale: f32, causal: bool) -> Vec<f32> {
    new_vec(y.len(), |out, written| written.add(softmax_backward_f32(y, g, y.len() / n, n, scale, causal, out)))
}

/// Values per row block of a softmax (64 KiB of f32 in, as much out).
const SOFTMAX_BLOCK_ELEMS: usize = 1 << 14;

/// The row without its trailing run of −inf: whole groups of lanes are
/// skipped with one vector compare each (an element-by-element scan from the
/// end was half the softmax's time), the rest element by element.
#[inline(always)]
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

/// The row's largest value by [`maximum`], folded lane by lane. The order
/// of a max changes nothing but which NaN wins when there are several (the
/// zeros' sign too is order-free: −0 only when every zero is −0): a softmax
/// only feeds its row max to `exp`, which returns the one canonical NaN for
/// any NaN, so its outputs are the sequential fold's bit for bit; and a
/// reduction's contract promises a NaN, not which one.
#[inline(always)]
fn max_by_lanes<T: Elem>(row: &[T]) -> T {
    // four vectors of lanes: four dependency chains in flight
    let mut acc = [T::NEG_INF; 4 * LANES];
    let mut groups = row.chunks_exact(4 * LANES);
    for g in &mut groups {
        for (a, &v) in acc.iter_mut().zip(g) {
            *a = maximum(*a, v);
        }
    }
    // The rest a vector of lanes at a time, padded with −inf (which leaves
    // a max as it was); then four vectors of maxima halved to one, then one.
    for c in groups.remainder().chunks(LANES) {
        let mut v = [T::NEG_INF; LANES];
        v[..c.len()].copy_from_slice(c);
        for (a, x) in acc.iter_mut().zip(v) {
            *a = maximum(*a, x);
        }
    }
    let (lo, hi) = acc.split_at_mut(2 * LANES);
    for (a, &b) in lo.iter_mut().zip(hi.iter()) {
        *a = maximum(*a, b);
    }
    let (lo, hi) = lo.split_at_mut(LANES);
    for (a, &b) in lo.iter_mut().zip(hi.iter()) {
        *a = maximum(*a, b);
    }
    lo.iter().fold(T::NEG_INF, |a, &v| maximum(a, v))
}

simd::multiversion! {
    /// The softmax of the rows of `x` (`n` wide) into `out`, the same
    /// length; they are rows `first_row ..` of the whole (which places the
    /// causal mask), taken in blocks of about `block_elems` values.
    fn softmax_t<'o, T: Elem>(
        x: &[T],
        first_row: usize,
        n: usize,
        scale: f32,
        causal: bool,
        block_elems: usize,
        out: &'o mut [MaybeUninit<T>],
    ) -> &'o mut [T] {
        assert_eq!(x.len(), out.len());
        let s = T::from_f64(scale as f64);
        let scaled = |v: T| if scale == 1.0 { v } else { v.mul(s) };
        // With `causal` row r may use its first `i + 1 = r mod n + 1` keys; the
        // rest are −inf (`lim`).
        let lim = |r: usize| if causal { (first_row + r) % n + 1 } else { n };
        if n == 0 {
            return write_exact(out, []);
        }
        // Row sums are sequential folds (the contract's order), four rows at a
        // time; row maxima fold by lanes (`max_by_lanes`: the same outputs). The
        // exps and the divisions are vector operations a group of lanes at a time.
        //
        // A causal mask leaves a trailing run of −inf in most rows, which changes
        // neither fold: maximum(m, −inf) = m for every m, so the max of the row
        // before the run is the row's max; and with a finite max m each masked
        // value is exp(−inf − m) = +0, added to a sum that is already ≥ 1 (the
        // max's own exp(0)), and +0 / s = +0. So with a finite max the run's
        // outputs are +0 without computing them and neither fold visits it — bit
        // for bit what the full loops give. `live` is the rest of each row.
        //
        // The max of the scaled values is the scaled max of the raw ones:
        // multiplying by a positive scale and rounding is monotone, so it
        // keeps the order (and maps −inf and NaN to themselves).
        // Row blocks of ~64 KiB: each block's passes (max, exps, sums,
        // divisions) run while it is in cache, instead of each pass streaming
        // the whole tensor through memory. Rows are independent, so the bits
        // are the same.
        let block = (block_elems / n).max(1);
        fill(out, |out, written| {
            for (b, (xb, ob)) in x.chunks(block * n).zip(out.chunks_mut(block * n)).enumerate() {
                let r0 = b * block;
                let unmasked: Vec<usize> = xb
                    .chunks_exact(n)
                    .enumerate()
                    .map(|(r, row)| live_len(&row[..lim(r0 + r)]))
                    .collect();
                let maxes: Vec<T> = xb
                    .chunks_exact(n)
                    .zip(&unmasked)
                    .map(|(row, &l)| scaled(max_by_lanes(&row[..l])))
                    .collect();
                let live: Vec<usize> = unmasked
                    .iter()
                    .zip(&maxes)
                    .map(|(&l, m)| if m.is_finite() { l } else { n })
                    .collect();
                let ob = fill(ob, |ob, rows_written| {
                    let rows_out = ob.chunks_exact_mut(n);
                    for (r, ((row, o), (&m, &l))) in xb.chunks_exact(n).zip(rows_out).zip(maxes.iter().zip(&live)).enumerate() {
                        // a non-finite max computes the whole row: the masked keys as −inf
                        let k = l.min(lim(r0 + r));
                        let (exps, rest) = o.split_at_mut(k);
                        // two loops, not a branch in one: each stays a vectorised exp
                        rows_written.add(if scale == 1.0 {
                            write_lanes(exps, &row[..k], |g| T::exp_lanes(g.map(|v| v.sub(m))))
                        } else {
                            write_lanes(exps, &row[..k], |g| T::exp_lanes(g.map(|v| v.mul(s).sub(m))))
                        });
                        let (masked, zeros) = rest.split_at_mut(l - k);
                        if l > k {
                            // a non-finite max: the masked keys' exp (not worked out for other rows)
                            rows_written.add(write_exact(masked, std::iter::repeat_n(T::NEG_INF.sub(m).exp(), l - k)));
                        }
                        rows_written.add(write_zeros(zeros));
                    }
                });
                let sums = fold_ragged(ob, n, &live, T::NEG_ZERO, |a, y| a.add(y));
                for ((o, &s), &l) in ob.chunks_exact_mut(n).zip(&sums).zip(&live) {
                    for_lanes_mut(&mut o[..l], |y| T::div_lanes(y, [s; LANES]));
                }
                written.add(ob);
            }
        })
    }
}

/// Keys row `r` of a softmax backward works out: all `n`, or with `causal`
/// those up to its place on the diagonal.
#[inline(always)]
fn backward_live(r: usize, n: usize, causal: bool) -> usize {
    if causal {
        r % n + 1
    } else {
        n
    }
}

simd::multiversion! {
    /// The softmax backward of the rows of `y` (the forward's output) and
    /// `g`, `n` wide, into `out`.
    ///
    /// `causal`: the rows are the probabilities of causally masked rows (row
    /// `r` keeps keys `j ≤ r % n`) whose `y` and `g` are +0 wherever the mask
    /// is — as one attention head's are. Each row's dot then stops at the
    /// diagonal: the masked terms are `fma(+0, +0, dot)`, which only turn a
    /// −0 sum into +0, so one `+ 0` stands for all of them and the dot keeps
    /// its bits. The outputs above the diagonal, which the head's causal
    /// products never read, are written as +0.
    fn softmax_backward_t<'o, T: Elem>(
        y: &[T],
        g: &[T],
        rows: usize,
        n: usize,
        scale: f32,
        causal: bool,
        out: &'o mut [MaybeUninit<T>],
    ) -> &'o mut [T] {
        let s = T::from_f64(scale as f64);
        assert_eq!(out.len(), rows * n);
        if n == 0 {
            return write_exact(out, []);
        }
        fill(out, |out, written| {
            let rows_out = out.chunks_exact_mut(n);
            for (r, ((yr, gr), o)) in y[..rows * n].chunks_exact(n).zip(g.chunks_exact(n)).zip(rows_out).enumerate() {
                let live = backward_live(r, n, causal);
                let (yr, gr) = (&yr[..live], &gr[..live]);
                let mut dot = yr.iter().zip(gr).fold(T::NEG_ZERO, |a, (&yv, &gv)| gv.fma(yv, a));
                if live < n {
                    dot = dot.add(T::ZERO);
                }
                let (o, masked) = o.split_at_mut(live);
                written.add(if scale == 1.0 {
                    write_exact(o, yr.iter().zip(gr).map(|(&yv, &gv)| yv.mul(gv.sub(dot))))
                } else {
                    write_exact(o, yr.iter().zip(gr).map(|(&yv, &gv)| yv.mul(gv.sub(dot)).mul(s)))
                });
                written.add(write_zeros(masked));
            }
        })
    }
}

/// The f32 softmax on AVX2 vectors: [`softmax_t`]'s passes in its order,
/// with its exps and divisions as vector intrinsics (the generic loops pass
/// each group through arrays on the stack, which is much slower).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use crate::backend::cpu::assume_init_mut;
    use crate::backend::cpu::simd::{first_lanes, row_sums_avx2, transpose8};
    use crate::backend::math::avx2::{div, exp};
    use std::arch::x86_64::*;

    /// The row's largest value, or NaN if it holds one. Which of ±0 it
    /// returns for a zero maximum is unspecified: the softmax subtracts it
    /// from values and exponentiates, and `exp(+0) = exp(−0)`.
    #[target_feature(enable = "avx2,fma")]
    fn row_max(row: &[f32]) -> f32 {
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let (mut m, mut nan) = ([ninf; 4], _mm256_setzero_ps());
        let mut take = |i: usize, v: __m256| {
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            m[i] = _mm256_max_ps(m[i], v);
        };
        let mut groups = row.chunks_exact(4 * LANES);
        for g in &mut groups {
            for (i, c) in g.chunks_exact(LANES).enumerate() {
                // SAFETY: `c` holds LANES values.
                take(i, unsafe { _mm256_loadu_ps(c.as_ptr()) });
            }
        }
        for c in groups.remainder().chunks(LANES) {
            let mut v = [f32::NEG_INFINITY; LANES];
            v[..c.len()].copy_from_slice(c);
            // SAFETY: `v` holds LANES values.
            take(0, unsafe { _mm256_loadu_ps(v.as_ptr()) });
        }
        if _mm256_movemask_ps(nan) != 0 {
            return f32::NAN;
        }
        let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
        let mut v = [0.0f32; LANES];
        // SAFETY: `v` holds LANES values.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), m) };
        v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
    }

    /// `out[i] = f(x[i])` a vector at a time, `out` handed back written;
    /// the ragged tail goes through `f` padded with zeros (their results
    /// dropped).
    #[target_feature(enable = "avx2,fma")]
    fn map_lanes<'o>(out: &'o mut [MaybeUninit<f32>], x: &[f32], f: impl Fn(__m256) -> __m256) -> &'o mut [f32] {
        assert_eq!(out.len(), x.len());
        let mut groups = out.chunks_exact_mut(LANES);
        let mut inputs = x.chunks_exact(LANES);
        for (o, v) in (&mut groups).zip(&mut inputs) {
            // SAFETY: `v` and `o` hold LANES values each.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().cast(), f(_mm256_loadu_ps(v.as_ptr()))) };
        }
        let (tail, rest) = (groups.into_remainder(), inputs.remainder());
        if !tail.is_empty() {
            let mut v = [0.0f32; LANES];
            v[..rest.len()].copy_from_slice(rest);
            // SAFETY: `v` holds LANES values.
            unsafe { _mm256_storeu_ps(v.as_mut_ptr(), f(_mm256_loadu_ps(v.as_ptr()))) };
            write_exact(tail, v);
        }
        // SAFETY: the loop stored every whole group of LANES values and
        // write_exact the tail after them, so every value of `out` is written.
        unsafe { assume_init_mut(out) }
    }

    /// `x[i] = f(x[i])` in place, as [`map_lanes`].
    #[target_feature(enable = "avx2,fma")]
    fn map_lanes_mut(x: &mut [f32], f: impl Fn(__m256) -> __m256) {
        let mut groups = x.chunks_exact_mut(LANES);
        for g in &mut groups {
            // SAFETY: `g` holds LANES values.
            unsafe { _mm256_storeu_ps(g.as_mut_ptr(), f(_mm256_loadu_ps(g.as_ptr()))) };
        }
        let tail = groups.into_remainder();
        if !tail.is_empty() {
            let mut v = [0.0f32; LANES];
            v[..tail.len()].copy_from_slice(tail);
            // SAFETY: `v` holds LANES values.
            unsafe { _mm256_storeu_ps(v.as_mut_ptr(), f(_mm256_loadu_ps(v.as_ptr()))) };
            let t = tail.len();
            tail.copy_from_slice(&v[..t]);
        }
    }

    /// [`softmax_t`] for f32, bit for bit; its exps and divisions on 16
    /// lanes when `wide`.
    ///
    /// # Safety
    /// With `wide`, the CPU has AVX-512F.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn softmax_f32<'o>(
        x: &[f32],
        first_row: usize,
        n: usize,
        scale: f32,
        causal: bool,
        block_elems: usize,
        out: &'o mut [MaybeUninit<f32>],
        wide: bool,
    ) -> &'o mut [f32] {
        assert_eq!(x.len(), out.len());
        if n == 0 {
            return write_exact(out, []);
        }
        let lim = |r: usize| if causal { (first_row + r) % n + 1 } else { n };
        let sv = _mm256_set1_ps(scale);
        let block = (block_elems / n).max(1);
        fill(out, |out, written| {
            for (b, (xb, ob)) in x.chunks(block * n).zip(out.chunks_mut(block * n)).enumerate() {
                let r0 = b * block;
                let mut live = Vec::with_capacity(xb.len() / n);
                let ob = fill(ob, |ob, rows_written| {
                    for (r, (row, o)) in xb.chunks_exact(n).zip(ob.chunks_exact_mut(n)).enumerate() {
                        let unmasked = live_len(&row[..lim(r0 + r)]);
                        // SAFETY: `wide` only where the CPU has AVX-512F (the caller's promise).
                        let m = if wide { unsafe { wide_row_max(&row[..unmasked]) } } else { row_max(&row[..unmasked]) };
                        let m = if scale == 1.0 { m } else { m * scale };
                        // a non-finite max computes the whole row: the masked keys as −inf
                        let l = if m.is_finite() { unmasked } else { n };
                        let k = l.min(lim(r0 + r));
                        let (exps, rest) = o.split_at_mut(k);
                        let mv = _mm256_set1_ps(m);
                        rows_written.add(if wide {
                            // SAFETY: `wide` only where the CPU has AVX-512F (the caller's promise).
                            unsafe { wide_exps(exps, &row[..k], scale, m) }
                        } else if scale == 1.0 {
                            map_lanes(exps, &row[..k], |v| exp(_mm256_sub_ps(v, mv)))
                        } else {
                            map_lanes(exps, &row[..k], |v| exp(_mm256_sub_ps(_mm256_mul_ps(v, sv), mv)))
                        });
                        let (masked, zeros) = rest.split_at_mut(l - k);
                        if l > k {
                            // a non-finite max: the masked keys' exp (not worked out for other rows)
                            let e = crate::backend::math::exp(f32::NEG_INFINITY - m);
                            rows_written.add(write_exact(masked, std::iter::repeat_n(e, l - k)));
                        }
                        rows_written.add(write_zeros(zeros));
                        live.push(l);
                    }
                });
                let sums = row_sums_avx2::<false>(ob, n, &live);
                for ((o, &s), &l) in ob.chunks_exact_mut(n).zip(&sums).zip(&live) {
                    if wide {
                        // SAFETY: as above.
                        unsafe { wide_divs(&mut o[..l], s) };
                    } else {
                        let sv = _mm256_set1_ps(s);
                        map_lanes_mut(&mut o[..l], |y| div(y, sv));
                    }
                }
                written.add(ob);
            }
        })
    }

    /// [`row_max`] on 16 lanes, the ragged end masked (−inf past it).
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn wide_row_max(row: &[f32]) -> f32 {
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let (mut m, mut nan) = ([ninf; 4], 0 as __mmask16);
        let mut take = |i: usize, v: __m512| {
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            m[i] = _mm512_max_ps(m[i], v);
        };
        let mut groups = row.chunks_exact(64);
        for g in &mut groups {
            for (i, c) in g.chunks_exact(16).enumerate() {
                // SAFETY: `c` holds 16 values.
                take(i, unsafe { _mm512_loadu_ps(c.as_ptr()) });
            }
        }
        for c in groups.remainder().chunks(16) {
            // SAFETY: the mask's lanes lie inside `c`.
            take(0, unsafe { _mm512_mask_loadu_ps(ninf, first_lanes(c.len()), c.as_ptr()) });
        }
        if nan != 0 {
            return f32::NAN;
        }
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])))
    }

    /// The exp pass of [`softmax_f32`] on 16 lanes: `out[i] = exp(x[i] − m)`,
    /// or `exp(x[i] · scale − m)`, `out` handed back written; the ragged
    /// end's lanes masked.
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn wide_exps<'o>(out: &'o mut [MaybeUninit<f32>], x: &[f32], scale: f32, m: f32) -> &'o mut [f32] {
        use crate::backend::math::avx512;
        assert_eq!(out.len(), x.len());
        let (sv, mv) = (_mm512_set1_ps(scale), _mm512_set1_ps(m));
        let f = |v: __m512| {
            let v = if scale == 1.0 { v } else { _mm512_mul_ps(v, sv) };
            avx512::exp(_mm512_sub_ps(v, mv))
        };
        let o = out.as_mut_ptr().cast::<f32>();
        for i in (0..x.len()).step_by(16) {
            let k = first_lanes(x.len() - i);
            // SAFETY: the mask's lanes lie inside `x` and `out` (equal lengths).
            unsafe { _mm512_mask_storeu_ps(o.add(i), k, f(_mm512_maskz_loadu_ps(k, x.as_ptr().add(i)))) };
        }
        // SAFETY: the stores above cover 0..len: one for each 16 values,
        // masked to those that remain at the end.
        unsafe { assume_init_mut(out) }
    }

    /// The division pass of [`softmax_f32`] on 16 lanes: `x[i] = x[i] / s`;
    /// the ragged end's lanes masked.
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn wide_divs(x: &mut [f32], s: f32) {
        use crate::backend::math::avx512;
        let sv = _mm512_set1_ps(s);
        let p = x.as_mut_ptr();
        for i in (0..x.len()).step_by(16) {
            let k = first_lanes(x.len() - i);
            // SAFETY: the mask's lanes lie inside `x`.
            unsafe { _mm512_mask_storeu_ps(p.add(i), k, avx512::div(_mm512_maskz_loadu_ps(k, p.add(i)), sv)) };
        }
    }

    /// [`softmax_backward_t`] for f32, bit for bit. Each row's dot is one
    /// chain of fused multiply-adds in term order; one chain at a time waits
    /// out each fma's latency, so eight rows run at once, one per lane of a
    /// vector (their terms transposed eight by eight), each lane still its
    /// own row's chain in order. With `causal` the eight rows' vector terms
    /// end where the last of them stops; the masked terms it takes for the
    /// others are the +0 products the full row would add.
    #[target_feature(enable = "avx2,fma")]
    pub fn softmax_backward_f32<'o>(
        y: &[f32],
        g: &[f32],
        rows: usize,
        n: usize,
        scale: f32,
        causal: bool,
        out: &'o mut [MaybeUninit<f32>],
    ) -> &'o mut [f32] {
        assert_eq!(out.len(), rows * n);
        assert!(y.len() >= rows * n && g.len() >= rows * n);
        if n == 0 {
            return write_exact(out, []);
        }
        let live = |r: usize| backward_live(r, n, causal);
        // row r's terms [from, live) after `a`, then its masked ones (+ 0)
        let chain = |r: usize, from: usize, a: f32| {
            let end = live(r).max(from);
            let d = (from..end).fold(a, |a, j| g[r * n + j].mul_add(y[r * n + j], a));
            if end < n {
                d + 0.0
            } else {
                d
            }
        };
        let mut dots = vec![0.0f32; rows];
        for (b, d) in dots.chunks_exact_mut(LANES).enumerate() {
            let r0 = b * LANES;
            let last = (r0..r0 + LANES).map(live).max().unwrap_or(n);
            let mut acc = _mm256_set1_ps(-0.0);
            let mut j = 0;
            while j + LANES <= last {
                let load = |x: &[f32]| {
                    transpose8(std::array::from_fn(|i| {
                        // SAFETY: rows r0 .. r0 + 8 hold the values j .. j + 8 (asserted above).
                        unsafe { _mm256_loadu_ps(x.as_ptr().add((r0 + i) * n + j)) }
                    }))
                };
                let (yc, gc) = (load(y), load(g));
                for q in 0..LANES {
                    acc = _mm256_fmadd_ps(gc[q], yc[q], acc);
                }
                j += LANES;
            }
            // SAFETY: `d` holds LANES values.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), acc) };
            for (i, d) in d.iter_mut().enumerate() {
                *d = chain(r0 + i, j, *d);
            }
        }
        let whole = rows / LANES * LANES;
        for (r, d) in dots.iter_mut().enumerate().skip(whole) {
            *d = chain(r, 0, -0.0);
        }
        let s = scale;
        fill(out, |out, written| {
            let rows_out = y.chunks_exact(n).zip(g.chunks_exact(n)).zip(out.chunks_exact_mut(n)).zip(&dots);
            for (r, (((yr, gr), o), &dot)) in rows_out.enumerate() {
                let l = live(r);
                let (yr, gr) = (&yr[..l], &gr[..l]);
                let (o, masked) = o.split_at_mut(l);
                written.add(if scale == 1.0 {
                    write_exact(o, yr.iter().zip(gr).map(|(&yv, &gv)| yv * (gv - dot)))
                } else {
                    write_exact(o, yr.iter().zip(gr).map(|(&yv, &gv)| yv * (gv - dot) * s))
                });
                written.add(write_zeros(masked));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::{new_vec, set_cpu_threads};
    use crate::backend::{Device, Storage};
    use std::mem::MaybeUninit;

    type SoftmaxF32 = for<'o> fn(&[f32], usize, usize, f32, bool, usize, &'o mut [MaybeUninit<f32>]) -> &'o mut [f32];

    /// The chunked sums of squares — eight chunks side by side, buffers cut
    /// into parts for the threads — against each chunk folded alone, bit for
    /// bit: buffers of less than eight chunks, exactly eight, several parts
    /// with a ragged end; one thread and three.
    #[test]
    fn chunked_sums_of_squares_are_each_chunks_own_fold() {
        use super::super::NORM_CHUNK;
        use super::{chunk_sums_of_squares, SQUARES_PIECE};
        let lens = [3 * NORM_CHUNK + 5, 8 * NORM_CHUNK, 0, 2 * SQUARES_PIECE + 9 * NORM_CHUNK + 17, 1];
        let bufs: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(b, &n)| (0..n).map(|i| ((i * 7 + b) as f32 * 0.013).sin() * 1e3).collect())
            .collect();
        let want: Vec<u32> = bufs
            .iter()
            .flat_map(|b| b.chunks(NORM_CHUNK).map(|c| c.iter().fold(-0.0f32, |a, &v| v.mul_add(v, a)).to_bits()))
            .collect();
        for b in &bufs {
            let one: Vec<u32> = b.chunks(NORM_CHUNK).map(|c| c.iter().fold(-0.0f32, |a, &v| v.mul_add(v, a)).to_bits()).collect();
            assert_eq!(chunk_sums_of_squares(b).iter().map(|v| v.to_bits()).collect::<Vec<_>>(), one);
        }
        let st: Vec<Storage> = bufs.iter().map(|b| Storage::from_f32(b.clone(), Device::Cpu).unwrap()).collect();
        let refs: Vec<&Storage> = st.iter().collect();
        for threads in [1, 3] {
            set_cpu_threads(Some(threads));
            let cpu: Vec<_> = refs.iter().map(|s| s.cpu()).collect();
            let got = super::ReduceOps::chunk_sum_squares(&cpu).unwrap();
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{threads} threads");
        }
        set_cpu_threads(None);
    }
    type SoftmaxBackwardF32 =
        for<'o> fn(&[f32], &[f32], usize, usize, f32, bool, &'o mut [MaybeUninit<f32>]) -> &'o mut [f32];

    /// Every f32 softmax this CPU can run: the generic loops, and the AVX2
    /// kernel where the CPU has it (the dispatch prefers it for f32).
    fn f32_softmaxes() -> Vec<(&'static str, SoftmaxF32)> {
        let mut k: Vec<(&'static str, SoftmaxF32)> = vec![("generic", super::softmax_t::<f32>)];
        #[cfg(target_arch = "x86_64")]
        if super::simd::available().contains(&super::simd::Level::Avx2) {
            // SAFETY: only listed where the CPU has AVX2 and FMA.
            k.push(("avx2", |x, r0, n, s, c, b, o| unsafe { super::avx2::softmax_f32(x, r0, n, s, c, b, o, false) }));
            if super::simd::available().contains(&super::simd::Level::Avx512) {
                // SAFETY: only listed where the CPU has AVX-512F too.
                k.push(("avx512", |x, r0, n, s, c, b, o| unsafe { super::avx2::softmax_f32(x, r0, n, s, c, b, o, true) }));
            }
        }
        k
    }

    /// Softmax rows split over threads give the one-thread bits: the causal
    /// mask follows each block's first row, the last block is ragged.
    #[test]
    fn threaded_softmax_gives_the_one_thread_bits() {
        let (rows, n) = (2 * 1025 + 3, 512); // above pool::SPLIT_VALUES
        let gen = crate::Generator::new(5);
        let st = |v: Vec<f32>| Storage::from_f32(v, Device::Cpu).unwrap();
        let x = st(gen.uniform(rows * n).iter().map(|u| (u - 0.5) * 40.0).collect());
        let g = st(gen.uniform(rows * n));
        let bits = |s: Storage| -> Vec<u32> {
            s.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let run = || {
            let y = x.softmax_rows(rows, n, 0.125, true).unwrap();
            let dx = y.softmax_rows_backward(&g, rows, n, 0.125).unwrap();
            (bits(y), bits(dx))
        };
        set_cpu_threads(Some(1));
        let one = run();
        set_cpu_threads(Some(3));
        let three = run();
        set_cpu_threads(None);
        assert!(one.0 == three.0, "forward differs with threads");
        assert!(one.1 == three.1, "backward differs with threads");
    }

    /// The kernels against the contract written out plainly, one row at a
    /// time: every fold in order (the maximum too), `exp`, the contract's
    /// division. Rows of both zeros, NaN early and late, ±inf, underflowing
    /// exps; more rows than the folds take in lockstep, and a remainder.
    #[test]
    fn softmax_kernels_follow_the_plain_contract() {
        use crate::backend::cpu::{maximum, Elem};
        let (rows, n) = (8 * 3 + 5, 77);
        let gen = crate::Generator::new(21);
        let mut x: Vec<f32> = gen.uniform(rows * n).iter().map(|u| (u - 0.5) * 60.0).collect();
        let g: Vec<f32> = gen.uniform(rows * n).iter().map(|u| u - 0.5).collect();
        for j in 0..n {
            x[2 * n + j] = [-0.0, -2.0, 0.0][j % 3];
            x[3 * n + j] = -95.0 - j as f32;
        }
        x[5 * n + 1] = f32::NAN;
        x[13 * n + n - 1] = f32::NAN;
        x[17 * n + 40] = f32::INFINITY;
        x[26 * n..27 * n].fill(f32::NEG_INFINITY);
        for (scale, causal) in [(1.0f32, false), (0.125, true), (0.3, false)] {
            let (mut want_y, mut want_dx) = (Vec::new(), Vec::new());
            for (r, (xr, gr)) in x.chunks(n).zip(g.chunks(n)).enumerate() {
                let lim = if causal { r % n + 1 } else { n };
                let scaled = |v: f32| if scale == 1.0 { v } else { v * scale };
                let v = |j: usize| if j < lim { scaled(xr[j]) } else { f32::NEG_INFINITY };
                let m = (0..n).fold(f32::NEG_INFINITY, |a, j| maximum(a, v(j)));
                let e: Vec<f32> = (0..n).map(|j| Elem::exp(v(j) - m)).collect();
                let sum = e.iter().fold(-0.0f32, |a, &y| a + y);
                let y: Vec<f32> = e.iter().map(|&y| Elem::div(y, sum)).collect();
                let dot = y.iter().zip(gr).fold(-0.0f32, |a, (&yv, &gv)| gv.mul_add(yv, a));
                want_dx.extend(y.iter().zip(gr).map(|(&yv, &gv)| scaled(yv * (gv - dot))));
                want_y.extend(y);
            }
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            // NaN rows: any quiet NaN is the contract's (its payload is free)
            let canon = |v: Vec<u32>| -> Vec<u32> {
                v.into_iter().map(|b| if f32::from_bits(b).is_nan() { 0x7fc0_0000 } else { b }).collect()
            };
            for (name, softmax) in f32_softmaxes() {
                let y = new_vec(rows * n, |o, w| w.add(softmax(&x, 0, n, scale, causal, super::SOFTMAX_BLOCK_ELEMS, o)));
                let at = format!("{name}, scale {scale} causal {causal}");
                assert!(canon(bits(&y)) == canon(bits(&want_y)), "forward, {at}");
                for (back, backward) in f32_softmax_backwards() {
                    let dx = new_vec(rows * n, |o, w| w.add(backward(&y, &g, rows, n, scale, false, o)));
                    assert!(canon(bits(&dx)) == canon(bits(&want_dx)), "backward {back}, {at}");
                }
            }
        }
    }

    /// Every f32 softmax backward this CPU can run, as [`f32_softmaxes`].
    fn f32_softmax_backwards() -> Vec<(&'static str, SoftmaxBackwardF32)> {
        let mut k: Vec<(&'static str, SoftmaxBackwardF32)> = vec![("generic", super::softmax_backward_t::<f32>)];
        #[cfg(target_arch = "x86_64")]
        if super::simd::available().contains(&super::simd::Level::Avx2) {
            // SAFETY: only listed where the CPU has AVX2 and FMA.
            k.push(("avx2", |y, g, r, n, s, c, o| unsafe { super::avx2::softmax_backward_f32(y, g, r, n, s, c, o) }));
        }
        k
    }

    /// A causal backward — one attention head's: `y` a causal softmax's
    /// output, `g` +0 above the diagonal — stops each row's dot at the
    /// diagonal and gives the full rows' bits on and below it (+0 above):
    /// rows whose sums end as −0 and as +0, NaN rows, several heads' rows,
    /// rows outside the eight-row groups, and `n` not a multiple of eight.
    #[test]
    fn causal_backward_gives_the_full_rows_bits_below_the_diagonal() {
        let gen = crate::Generator::new(33);
        for n in [40, 37] {
            let rows = 2 * n;
            let mut x: Vec<f32> = gen.uniform(rows * n).iter().map(|u| (u - 0.5) * 30.0).collect();
            x[3 * n + 1] = f32::NAN;
            x[n + 9] = f32::INFINITY;
            let mut g: Vec<f32> = gen.uniform(rows * n).iter().map(|u| u - 0.5).collect();
            for r in 0..rows {
                for j in 0..n {
                    if j > r % n {
                        g[r * n + j] = 0.0;
                    }
                }
            }
            // rows whose dot is a sum of −0 terms (their g is −0 on and below
            // the diagonal): the full row turns it +0, and so must the stop —
            // inside an eight-row group (its vector terms take masked ones),
            // last in a group (they take none) and outside the groups (row 72
            // with n = 37)
            for r in [5, 7, n + 2, 2 * n - 2] {
                g[r * n..r * n + r % n + 1].fill(-0.0);
            }
            let canon = |v: &[f32]| -> Vec<u32> {
                v.iter().map(|v| if v.is_nan() { 0x7fc0_0000 } else { v.to_bits() }).collect()
            };
            let y = new_vec(rows * n, |o, w| w.add(super::softmax_t(&x, 0, n, 0.125, true, super::SOFTMAX_BLOCK_ELEMS, o)));
            for (name, backward) in f32_softmax_backwards() {
                let run = |causal: bool| canon(&new_vec(rows * n, |o, w| w.add(backward(&y, &g, rows, n, 0.125, causal, o))));
                let (full, stopped) = (run(false), run(true));
                for r in 0..rows {
                    let (keep, row) = (r % n + 1, r * n);
                    assert!(
                        stopped[row..row + keep] == full[row..row + keep],
                        "{name}, n {n}: row {r} on and below the diagonal"
                    );
                    assert!(stopped[row + keep..row + n].iter().all(|&b| b == 0), "{name}: row {r} above");
                }
                // the −0 rows' gradients are ±0 with the dot's sign: the case is real
                let r = n + 2;
                assert_eq!(full[r * n] >> 31, 1, "{name}: the −0 row's first gradient is −0");
            }
        }
    }

    /// The softmax in row blocks gives the bits of one pass over all rows:
    /// blocks that split a head (the causal mask must follow each block's
    /// rows), a ragged last block, non-finite rows, a causal offset.
    #[test]
    fn blocked_softmax_gives_the_one_block_bits() {
        let (rows, n) = (3 * 300 + 7, 300);
        let gen = crate::Generator::new(9);
        let mut x: Vec<f32> = gen.uniform(rows * n).iter().map(|u| (u - 0.5) * 40.0).collect();
        x[5 * n + 2] = f32::INFINITY;
        x[400 * n + 7] = f32::NAN;
        x[700 * n..701 * n].fill(f32::NEG_INFINITY);
        for (name, softmax) in f32_softmaxes() {
            let soft = |first_row, scale, causal, block| -> Vec<u32> {
                let y = new_vec(rows * n, |o, w| w.add(softmax(&x, first_row, n, scale, causal, block, o)));
                y.iter().map(|v| v.to_bits()).collect()
            };
            for (first_row, scale, causal) in [(0, 0.125, true), (17, 1.0, true), (0, 0.5, false)] {
                let whole = soft(first_row, scale, causal, usize::MAX);
                for block in [super::SOFTMAX_BLOCK_ELEMS, 1, 7 * n + 1] {
                    let blocked = soft(first_row, scale, causal, block);
                    assert!(blocked == whole, "{name}: block {block}, first row {first_row}, causal {causal}");
                }
            }
        }
    }
}
