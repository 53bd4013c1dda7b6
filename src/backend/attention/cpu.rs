//! The CPU's attention schedule: each head's whole chain of products and
//! softmax on one thread, its `T × T` scores and probabilities in cache; the
//! heads split over the threads in contiguous groups. The products and the
//! softmax are the batched primitives' own kernels, on one head.

use super::{batched, Arg, Attention, AttentionOps};
use crate::backend::cpu::{CpuStorage, Elem};
use crate::backend::cpu::pool;
use crate::backend::cpu::{cpu_threads, new_vecs, write_exact};
use crate::backend::matmul::cpu::matmul_f32_one_thread;
use crate::backend::reduce::cpu::{softmax_backward_f32_one_thread, softmax_f32_one_thread};
use crate::backend::round::{round_slice, Format};
use crate::backend::{Causal, MatmulDims};
use crate::profile::{self, Product};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use crate::Result;

impl AttentionOps for CpuStorage {
    fn attention(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>) -> Result<Self> {
        let [Some(qb), Some(kb), Some(vb)] = [q, k, v].map(f32s) else {
            return batched::forward(a, q, k, v); // f64 storage
        };
        Ok(f32::wrap(forward(a, (&qb, q.1), (&kb, k.1), (&vb, v.1))))
    }

    fn attention_backward(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>, g: &Self) -> Result<[Self; 3]> {
        let [Some(qb), Some(kb), Some(vb), Some(gb)] = [q, k, v, (g, None)].map(f32s) else {
            return batched::backward(a, q, k, v, g);
        };
        let grads = backward(a, (&qb, q.1), (&kb, k.1), (&vb, v.1), &gb);
        Ok(grads.map(f32::wrap))
    }
}

/// An operand's float32 words, `None` for f64 storage.
fn f32s((x, _): Arg<'_, CpuStorage>) -> Option<std::cell::Ref<'_, Vec<f32>>> {
    match x {
        CpuStorage::F32(b) => Some(b.get()),
        CpuStorage::F64(_) => None,
    }
}

/// An operand as a head's products read it: float32 values, or the words of
/// a 16-bit copy in that format (two values per word).
pub(crate) type Host<'a> = (&'a [f32], Option<Format>);

/// Head `h`'s `len` values of head-major `x`.
fn head((x, half): Host<'_>, h: usize, len: usize) -> Rows<'_> {
    match half {
        None => ((&x[h * len..(h + 1) * len], None), None),
        Some(_) => {
            // a head's values start on a word: `len = T·D` is even (D is)
            assert!(len.is_multiple_of(2), "16-bit heads of an odd length");
            ((&x[h * len / 2..(h + 1) * len / 2], half), None)
        }
    }
}

/// A head's rows as a product reads them, and their stride in values where
/// it is not `D` (token-major heads).
type Rows<'a> = (Host<'a>, Option<usize>);

/// Where head `h`'s row 0 of `v` and `y` starts (in values), and their row
/// stride: head-major `(heads, T, D)`, or token-major `(B, T, H, D)`.
fn place(a: &Attention, h: usize) -> (usize, usize) {
    let (t, d) = (a.t, a.d);
    match a.tokens {
        None => (h * t * d, d),
        Some(hs) => ((h / hs * t * hs + h % hs) * d, hs * d),
    }
}

/// The head whose row is row `r` of all heads' rows laid out token-major as
/// `y` is, `hs` heads a sequence (`place` turned round): r = ((b·t + i)·hs + j)
/// for head b·hs + j.
fn token_row_head(t: usize, hs: usize, r: usize) -> usize {
    r / (t * hs) * hs + r % hs
}

/// Head `h`'s rows of `x` laid out as `v` and `y` are (see [`place`]).
fn value_rows<'a>((x, half): Host<'a>, a: &Attention, h: usize) -> Rows<'a> {
    if a.tokens.is_none() {
        return head((x, half), h, a.t * a.d);
    }
    let (start, stride) = place(a, h);
    match half {
        None => ((&x[start..], None), Some(stride)),
        Some(_) => {
            // rows start on a word: D is even
            assert!(start.is_multiple_of(2), "16-bit rows of an odd length");
            ((&x[start / 2..], half), Some(stride))
        }
    }
}

/// `y (heads, T, D)` — or token-major (see [`Attention::tokens`]) — as
/// [`Attention::forward`] defines it.
fn forward(a: &Attention, q: Host, k: Host, v: Host) -> Vec<f32> {
    let (t, d) = (a.t, a.d);
    let clock = Clock::new(a, &[Part::Scores, Part::Softmax, Part::Pv]);
    let [y] = per_head(a, [true], 2, |h| {
        let p = probs(a, &clock, head(q, h, t * d).0, head(k, h, t * d).0);
        [clock.time(2, || product(a, ((&p, None), None), value_rows(v, a, h), Part::Pv))]
    });
    clock.report();
    y
}

/// `[dq, dk, dv]` as [`Attention::backward`] defines them (`g` and `dv`
/// laid out as `y` and `v`).
fn backward(a: &Attention, q: Host, k: Host, v: Host, g: &[f32]) -> [Vec<f32>; 3] {
    let (t, d) = (a.t, a.d);
    let parts = [
        Part::Scores,
        Part::Softmax,
        Part::Dv,
        Part::Dp,
        Part::SoftmaxBackward,
        Part::Dq,
        Part::Dk,
    ];
    let clock = Clock::new(a, &parts);
    let grads = per_head(a, [false, false, true], 3, |h| {
        let (qh, kh) = (head(q, h, t * d), head(k, h, t * d));
        let (vh, gh) = (value_rows(v, a, h), value_rows((g, None), a, h));
        let p = probs(a, &clock, qh.0, kh.0);
        let dv = clock.time(2, || product(a, ((&p, None), None), gh, Part::Dv));
        let mut dp = clock.time(3, || product(a, gh, vh, Part::Dp));
        stored(a, &mut dp); // the gradient arriving for p, rounded as p is
        let ds = clock.time(4, || softmax_backward_f32_one_thread(&p, &dp, t, a.scale, true));
        drop((p, dp));
        let dq = clock.time(5, || product(a, ((&ds, None), None), kh, Part::Dq));
        let dk = clock.time(6, || product(a, ((&ds, None), None), qh, Part::Dk));
        [dq, dk, dv]
    });
    clock.report();
    grads
}

/// One head's probabilities `(T, T)` (parts 0 and 1 of the clock).
fn probs(a: &Attention, clock: &Clock, q: Host, k: Host) -> Vec<f32> {
    let scores = clock.time(0, || product(a, (q, None), (k, None), Part::Scores));
    clock.time(1, || {
        let mut p = softmax_f32_one_thread(&scores, a.t, a.scale, true);
        stored(a, &mut p);
        p
    })
}

/// A head's `(T, T)` values stored in [`Attention::probs`]: rounded to it.
fn stored(a: &Attention, x: &mut [f32]) {
    if let Some(f) = a.probs {
        round_slice(x, f);
    }
}

/// One head's product `part`.
fn product(a: &Attention, (x, lx): Rows, (y, ly): Rows, part: Part) -> Vec<f32> {
    let d = part.dims(a).expect("a product");
    // the scores' products at the scores' format, the rest at the matmuls'
    let round = match part {
        Part::Scores | Part::Dq | Part::Dk => a.scores,
        _ => a.round,
    };
    matmul_f32_one_thread(x, y, MatmulDims { batch: 1, ..d }, round, [lx, ly])
}

/// A head's parts of one output, in the order of its values.
type Parts<'a, T> = Vec<&'a mut [T]>;

/// `f(h)` (a head's `N` outputs, `(T, D)` each) for every head, written
/// into `N` outputs of all heads — head-major, or laid out as `y` where
/// `like_y` — each head on one thread, contiguous groups of heads per
/// thread. Each head in flight holds up to `squares` float32 `(T, T)`
/// buffers, counted as live memory on the calling thread meanwhile.
fn per_head<const N: usize>(
    a: &Attention,
    like_y: [bool; N],
    squares: usize,
    f: impl Fn(usize) -> [Vec<f32>; N] + Sync,
) -> [Vec<f32>; N] {
    let (heads, t, d) = (a.heads, a.t, a.d);
    let len = t * d;
    if heads == 0 || len == 0 {
        return std::array::from_fn(|_| vec![0.0; heads * len]);
    }
    let threads = if heads * t * t >= pool::SPLIT_VALUES {
        cpu_threads().clamp(1, heads)
    } else {
        1
    };
    let _scratch = crate::memory::Ticket::new(threads * squares * t * t * 4);
    let per = heads.div_ceil(threads);
    // No zero fill: every head's rows are copied in below.
    new_vecs([heads * len; N], |outs, written| {
        // each output's parts, dealt to the heads they belong to: a head's
        // `len` values where the output is head-major, its `t` rows of `d`
        // where it is laid out as `y` and that is token-major
        let mut parts: Vec<[Parts<'_, MaybeUninit<f32>>; N]> =
            (0..heads).map(|_| std::array::from_fn(|_| Vec::new())).collect();
        for (o, (out, &y)) in outs.into_iter().zip(&like_y).enumerate() {
            match a.tokens.filter(|_| y) {
                Some(hs) => out.chunks_exact_mut(d).enumerate().for_each(|(r, row)| parts[token_row_head(t, hs, r)][o].push(row)),
                None => out.chunks_exact_mut(len).enumerate().for_each(|(h, head)| parts[h][o].push(head)),
            }
        }
        // a group of heads, each output's parts written
        let run = |(g, group): (usize, &mut [[Vec<_>; N]])| {
            let mut done: [Vec<&mut [f32]>; N] = std::array::from_fn(|_| Vec::new());
            for (i, head_parts) in group.iter_mut().enumerate() {
                let outputs = f(g * per + i);
                for ((v, head_parts), done) in outputs.iter().zip(head_parts).zip(&mut done) {
                    assert_eq!(v.len(), len, "a head's output");
                    let mut rest = &v[..];
                    let head_parts: Parts<'_, MaybeUninit<f32>> = std::mem::take(head_parts);
                    for part in head_parts {
                        let (now, later) = rest.split_at(part.len());
                        rest = later;
                        done.push(write_exact(part, now.iter().copied()));
                    }
                }
            }
            done
        };
        let groups = parts.chunks_mut(per).enumerate();
        let done: Vec<[Parts<'_, f32>; N]> = if threads > 1 { pool::map(groups, run) } else { groups.map(run).collect() };
        for group in done {
            for (w, parts) in written.iter_mut().zip(group) {
                w.add_all(parts);
            }
        }
    })
}

/// A step of a head's chain.
#[derive(Clone, Copy)]
enum Part {
    /// `q kᵀ` on and below the diagonal.
    Scores,
    Softmax,
    /// `p v`, row `i` summing keys `j ≤ i`.
    Pv,
    /// `pᵀ dy`, key row `j` summing queries `i ≥ j`.
    Dv,
    /// `dy vᵀ` on and below the diagonal.
    Dp,
    SoftmaxBackward,
    /// `ds k`, row `i` summing keys `j ≤ i`.
    Dq,
    /// `dsᵀ q`, key row `j` summing queries `i ≥ j`.
    Dk,
}

impl Part {
    /// The batched product this part is one head of; `None` for the softmax
    /// and its backward.
    fn dims(self, a: &Attention) -> Option<MatmulDims> {
        let (t, d) = (a.t, a.d);
        Some(match self {
            Part::Scores => a.dims((t, d, t), false, true, Causal::Outputs),
            Part::Pv => a.dims((t, t, d), false, false, Causal::TermsUpToRow),
            Part::Dv => a.dims((t, t, d), true, false, Causal::TermsFromRow),
            Part::Dp => a.dims((t, d, t), false, true, Causal::Outputs),
            Part::Dq => a.dims((t, t, d), false, false, Causal::TermsUpToRow),
            Part::Dk => a.dims((t, t, d), true, false, Causal::TermsFromRow),
            Part::Softmax | Part::SoftmaxBackward => return None,
        })
    }

    /// The profile row this part's time goes to.
    fn profiled(self, a: &Attention) -> (&'static str, Option<Product>) {
        match (self, self.dims(a)) {
            (_, Some(d)) => (profile::MATMUL, Some(d.profiled())),
            (Part::SoftmaxBackward, None) => ("softmax backward", None),
            (_, None) => ("softmax", None),
        }
    }
}

/// While a profile runs, the time each part takes over all heads and
/// threads; the call's wall time is shared out in those proportions, each
/// part reported as one call of the batched primitive it stands for.
struct Clock {
    rows: Vec<(&'static str, Option<Product>)>,
    nanos: Vec<AtomicU64>,
    t0: Option<Instant>,
}

impl Clock {
    fn new(a: &Attention, parts: &[Part]) -> Clock {
        let on = profile::timing();
        Clock {
            rows: if on { parts.iter().map(|p| p.profiled(a)).collect() } else { Vec::new() },
            nanos: parts.iter().map(|_| AtomicU64::new(0)).collect(),
            t0: on.then(Instant::now),
        }
    }

    /// `f()`, timed as part `i` while a profile runs.
    fn time<R>(&self, i: usize, f: impl FnOnce() -> R) -> R {
        let Some(_) = self.t0 else { return f() };
        let t = Instant::now();
        let r = f();
        self.nanos[i].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    fn report(self) {
        let Some(t0) = self.t0 else { return };
        let wall = t0.elapsed().as_secs_f64();
        let nanos: Vec<f64> = self.nanos.iter().map(|n| n.load(Ordering::Relaxed) as f64).collect();
        let total: f64 = nanos.iter().sum();
        for ((name, shape), n) in self.rows.into_iter().zip(nanos) {
            let share = if total > 0.0 { n / total } else { 0.0 };
            profile::add(name, shape, Duration::from_secs_f64(wall * share));
        }
    }
}
