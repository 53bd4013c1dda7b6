//! An opt-in wall-clock profile of the backend primitives, per thread.
//!
//! Every backend `Storage` primitive opens a `scope` named
//! after what it computes; while a profile is running ([`start`]) the scope
//! adds its elapsed time to that name, and [`take`] returns the table. When no
//! profile runs a scope is one thread-local flag read, nothing else.
//!
//! On the CPU the times are the work itself. On the GPU they are the host's
//! time to record the kernels (the device runs asynchronously), so a GPU
//! profile shows host overhead, not kernel time.
//!
//! `tinyllm train --profile` prints it for the training steps after the
//! run's first (a warm-up that touches the step's memory for the first time,
//! left out as the tokens/s figures leave it out); it is how the share of the
//! step spent outside matrix products is measured (BENCHMARKS.md).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::roofline::{Peak, Roofline, WorkRow};

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    /// Open [`pause`] guards (minus open [`unpause`] guards).
    static PAUSED: Cell<i32> = const { Cell::new(0) };
    /// Wall time inside [`unpause`] guards while a profile runs.
    static WALL: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    /// GPU work recorded inside [`unpause`] guards while a profile runs.
    static GPU: Cell<GpuCounters> = Cell::new(GpuCounters::default());
    /// Training steps counted ([`step`]) while a profile runs.
    static STEPS: Cell<usize> = const { Cell::new(0) };
    /// The wall time of steps left out ([`leave_out`]) while a profile runs.
    static LEFT_OUT: Cell<Option<Duration>> = const { Cell::new(None) };
    /// Dispatches counted by the scopes closed so far, nested ones included:
    /// what makes each scope's count its own, without its inner scopes'.
    static CLAIMED: Cell<u64> = const { Cell::new(0) };
    /// Dispatches recorded by this thread (the scopes' counts: exact even
    /// while other threads use the GPU).
    static OWN_DISPATCHES: Cell<u64> = const { Cell::new(0) };
    static TABLE: RefCell<HashMap<&'static str, (u64, Duration, u64)>> = RefCell::new(HashMap::new());
    static PRODUCTS: RefCell<HashMap<Product, (u64, Duration)>> = RefCell::new(HashMap::new());
    /// Forward reruns inside backward, by what they recompute ([`recompute`]).
    static RECOMPUTE: RefCell<HashMap<&'static str, (u64, Duration)>> = RefCell::new(HashMap::new());
    /// Each primitive's own calls, time, FLOPs and bytes ([`Scope`]s only),
    /// for the [roofline](crate::roofline).
    static WORK: RefCell<HashMap<&'static str, WorkRow>> = RefCell::new(HashMap::new());
}

/// A matrix product's shape: `batch` products of (m×k)·(k×n), operands
/// transposed as stored. The profile times the products per shape too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Product {
    /// The number of products (1 for a plain matrix product).
    pub batch: usize,
    /// Rows of the output (and of the first operand as used).
    pub m: usize,
    /// The inner (summed) dimension.
    pub k: usize,
    /// Columns of the output (and of the second operand as used).
    pub n: usize,
    /// Whether the first operand is stored `(k×m)` and read transposed.
    pub trans_a: bool,
    /// Whether the second operand is stored `(n×k)` and read transposed.
    pub trans_b: bool,
    /// The multiply-adds of one batch entry actually done: `m·k·n`, or about
    /// half of it for a causal product.
    pub macs: usize,
}

impl Product {
    /// Floating-point operations done (a multiply-add is two).
    pub fn flops(&self) -> f64 {
        2.0 * (self.batch * self.macs) as f64
    }
}

impl std::fmt::Display for Product {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = |on: bool| if on { "ᵀ" } else { "" };
        let b = if self.batch > 1 {
            format!("{}× ", self.batch)
        } else {
            String::new()
        };
        write!(
            f,
            "{b}({}×{}){} · ({}×{}){}{}",
            self.m,
            self.k,
            t(self.trans_a),
            self.k,
            self.n,
            t(self.trans_b),
            if self.macs < self.m * self.k * self.n {
                " causal"
            } else {
                ""
            }
        )
    }
}

/// Kernel dispatches recorded, queue submits and host readbacks, since the
/// process started (all threads): what `--profile` reports per step.
static DISPATCHES: AtomicU64 = AtomicU64::new(0);
static SUBMITS: AtomicU64 = AtomicU64::new(0);
static READBACKS: AtomicU64 = AtomicU64::new(0);

/// What the GPU context reports to [`note_gpu`].
pub(crate) enum GpuEvent {
    Dispatch,
    Submit,
    Readback,
}

/// Counts one GPU event (the GPU context calls it; always on: one atomic add).
pub(crate) fn note_gpu(e: GpuEvent) {
    if let GpuEvent::Dispatch = e {
        OWN_DISPATCHES.with(|d| d.set(d.get() + 1));
    }
    match e {
        GpuEvent::Dispatch => &DISPATCHES,
        GpuEvent::Submit => &SUBMITS,
        GpuEvent::Readback => &READBACKS,
    }
    .fetch_add(1, Ordering::Relaxed);
}

/// The GPU work counters so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCounters {
    /// Compute-kernel dispatches recorded.
    pub dispatches: u64,
    /// Command buffers submitted to the device queue.
    pub submits: u64,
    /// Reads of device memory back to the host (each waits for the device).
    pub readbacks: u64,
}

impl GpuCounters {
    /// The counts so far.
    pub fn now() -> GpuCounters {
        GpuCounters {
            dispatches: DISPATCHES.load(Ordering::Relaxed),
            submits: SUBMITS.load(Ordering::Relaxed),
            readbacks: READBACKS.load(Ordering::Relaxed),
        }
    }

    /// The work done since `earlier`.
    pub fn since(self, earlier: GpuCounters) -> GpuCounters {
        self.zip(earlier, |a, b| a - b)
    }

    /// Both counts together.
    pub fn plus(self, other: GpuCounters) -> GpuCounters {
        self.zip(other, |a, b| a + b)
    }

    fn zip(self, o: GpuCounters, f: impl Fn(u64, u64) -> u64) -> GpuCounters {
        GpuCounters {
            dispatches: f(self.dispatches, o.dispatches),
            submits: f(self.submits, o.submits),
            readbacks: f(self.readbacks, o.readbacks),
        }
    }
}

/// The scope name of the matrix products, the denominator's other half in
/// [`Profile::matmul`].
pub const MATMUL: &str = "matmul";

/// Starts (or restarts, emptying the table) this thread's profile.
pub fn start() {
    TABLE.with_borrow_mut(HashMap::clear);
    PRODUCTS.with_borrow_mut(HashMap::clear);
    RECOMPUTE.with_borrow_mut(HashMap::clear);
    WORK.with_borrow_mut(HashMap::clear);
    WALL.with(|w| w.set(Duration::ZERO));
    GPU.with(|g| g.set(GpuCounters::default()));
    STEPS.with(|n| n.set(0));
    LEFT_OUT.with(|w| w.set(None));
    ON.with(|on| on.set(true));
}

/// Stops this thread's profile and returns it (`None` if none was running).
pub fn take() -> Option<Profile> {
    if !ON.with(|on| on.replace(false)) {
        return None;
    }
    let mut rows: Vec<Row> = TABLE.with_borrow_mut(|t| {
        t.drain()
            .map(|(name, (calls, time, dispatches))| Row {
                name,
                calls,
                time,
                dispatches,
            })
            .collect()
    });
    rows.sort_by(|a, b| b.time.cmp(&a.time).then(a.name.cmp(b.name)));
    let mut products: Vec<ProductRow> = PRODUCTS.with_borrow_mut(|t| {
        t.drain()
            .map(|(shape, (calls, time))| ProductRow { shape, calls, time })
            .collect()
    });
    products.sort_by_key(|p| std::cmp::Reverse(p.time));
    let mut recompute: Vec<RecomputeRow> = RECOMPUTE.with_borrow_mut(|t| {
        t.drain()
            .map(|(what, (calls, time))| RecomputeRow { what, calls, time })
            .collect()
    });
    recompute.sort_by(|a, b| b.time.cmp(&a.time).then(a.what.cmp(b.what)));
    let mut work: Vec<WorkRow> = WORK.with_borrow_mut(|t| t.drain().map(|(_, w)| w).collect());
    work.sort_by(|a, b| b.flops.total_cmp(&a.flops).then(a.name.cmp(b.name)));
    let wall = WALL.with(Cell::get);
    let gpu = GPU.with(Cell::get);
    Some(Profile {
        rows,
        products,
        recompute,
        work,
        gpu: (gpu.dispatches > 0).then_some(gpu),
        wall: (wall > Duration::ZERO).then_some(wall),
        steps: STEPS.with(Cell::get),
        left_out: LEFT_OUT.with(Cell::get),
    })
}

/// Stops counting until the guard drops (the profile keeps running): a
/// caller that wants only some of its work in the profile pauses around the
/// rest, or pauses everything and [`unpause`]s the part it wants.
pub fn pause() -> Pause {
    PAUSED.with(|p| p.set(p.get() + 1));
    Pause(1, None)
}

/// Counts again inside a [`pause`] until the guard drops; the guard's own wall
/// time is the profile's [`Profile::wall`] (the denominator that includes
/// everything between the primitives: graph bookkeeping, allocation).
pub fn unpause() -> Pause {
    PAUSED.with(|p| p.set(p.get() - 1));
    Pause(
        -1,
        ON.with(Cell::get)
            .then(|| (Instant::now(), GpuCounters::now())),
    )
}

/// [`unpause`] around one training step, counted in [`Profile::steps`].
pub fn step() -> Pause {
    if ON.with(Cell::get) {
        STEPS.with(|n| n.set(n.get() + 1));
    }
    unpause()
}

/// Records that a training step of `wall` time ran outside the profile (a
/// run's warm-up step), for [`Profile::left_out`].
pub fn leave_out(wall: Duration) {
    if ON.with(Cell::get) {
        LEFT_OUT.with(|w| w.set(Some(w.get().unwrap_or_default() + wall)));
    }
}

/// A guard from [`pause`] or [`unpause`]: dropping it undoes that call
/// (guards nest).
#[must_use]
pub struct Pause(i32, Option<(Instant, GpuCounters)>);

impl Drop for Pause {
    fn drop(&mut self) {
        PAUSED.with(|p| p.set(p.get() - self.0));
        if let Some((t0, g0)) = self.1 {
            WALL.with(|w| w.set(w.get() + t0.elapsed()));
            let d = GpuCounters::now().since(g0);
            GPU.with(|g| g.set(g.get().plus(d)));
        }
    }
}

/// Times the enclosing primitive under `name` while a profile runs.
#[must_use]
pub(crate) fn scope(name: &'static str) -> Scope {
    let on = timing();
    Scope {
        name,
        product: None,
        flops: None,
        traffic: Traffic::default(),
        t0: on.then(|| {
            (
                Instant::now(),
                OWN_DISPATCHES.with(Cell::get),
                CLAIMED.with(Cell::get),
            )
        }),
    }
}

/// Whether a profile times this thread's primitives now.
pub(crate) fn timing() -> bool {
    ON.with(Cell::get) && PAUSED.with(Cell::get) <= 0
}

/// Adds one call of `time` to `name` (and to `shape`'s row), for a primitive
/// its caller timed in parts: attention's schedule on the CPU, whose parts
/// run interleaved on several threads (`attention::cpu`).
pub(crate) fn add(name: &'static str, shape: Option<Product>, time: Duration) {
    if !timing() {
        return;
    }
    TABLE.with_borrow_mut(|t| {
        let e = t.entry(name).or_default();
        e.0 += 1;
        e.1 += time;
    });
    if let Some(p) = shape {
        PRODUCTS.with_borrow_mut(|t| {
            let e = t.entry(p).or_default();
            e.0 += 1;
            e.1 += time;
        });
    }
}

/// Times a forward rerun inside backward (a checkpointed segment, an
/// attention core: `what`) while a profile runs, until the guard drops. The
/// primitives it calls keep their own rows; this is the rerun's wall time,
/// the price of the memory recomputation saves.
#[must_use]
pub(crate) fn recompute(what: &'static str) -> Recomputing {
    Recomputing(what, timing().then(Instant::now))
}

/// The guard of [`recompute`].
pub(crate) struct Recomputing(&'static str, Option<Instant>);

impl Drop for Recomputing {
    fn drop(&mut self) {
        if let Some(t0) = self.1 {
            let dt = t0.elapsed();
            RECOMPUTE.with_borrow_mut(|t| {
                let e = t.entry(self.0).or_default();
                e.0 += 1;
                e.1 += dt;
            });
        }
    }
}

/// [`scope`] for a matrix product, also timed per shape.
#[must_use]
pub(crate) fn product_scope(shape: Product) -> Scope {
    let mut s = scope(MATMUL);
    s.product = Some(shape);
    s
}

/// [`scope`] for a primitive that counts its own FLOPs (attention: its
/// products and softmax, from its shapes).
#[must_use]
pub(crate) fn scope_with_flops(name: &'static str, flops: impl FnOnce() -> f64) -> Scope {
    let mut s = scope(name);
    if s.t0.is_some() {
        s.flops = Some(flops());
    }
    s
}

/// What one call moves: the bytes it reads and writes (each buffer once, as
/// stored), and the elements of its largest buffer (what a per-element FLOP
/// count applies to). See [`crate::roofline`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Traffic {
    pub bytes: f64,
    pub elements: f64,
}

pub(crate) struct Scope {
    name: &'static str,
    product: Option<Product>,
    /// FLOPs the call counted itself ([`scope_with_flops`]).
    flops: Option<f64>,
    /// What the call moved ([`Scope::moved`]).
    traffic: Traffic,
    /// When it opened, the dispatch count then, and [`CLAIMED`] then.
    t0: Option<(Instant, u64, u64)>,
}

impl Scope {
    /// Records what the call moved (`traffic` runs only while the profile
    /// counts this scope).
    pub(crate) fn moved(&mut self, traffic: impl FnOnce() -> Traffic) {
        if self.t0.is_some() {
            self.traffic = traffic();
        }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some((t0, d0, c0)) = self.t0 {
            let dt = t0.elapsed();
            let cost = crate::roofline::cost(self.name);
            let flops = self
                .flops
                .or(self.product.map(|p| p.flops()))
                .unwrap_or(cost.flops_per_element * self.traffic.elements);
            WORK.with_borrow_mut(|t| {
                let e = t.entry(self.name).or_insert_with(|| WorkRow {
                    name: self.name,
                    calls: 0,
                    flops: 0.0,
                    bytes: 0.0,
                    time: Duration::ZERO,
                });
                e.calls += 1;
                e.time += dt;
                e.flops += flops;
                e.bytes += self.traffic.bytes;
            });
            // This scope's dispatches, less those of scopes closed inside it.
            let all = OWN_DISPATCHES.with(Cell::get) - d0;
            let inner = CLAIMED.with(Cell::get) - c0;
            CLAIMED.with(|c| c.set(c0 + all));
            TABLE.with_borrow_mut(|t| {
                let e = t.entry(self.name).or_default();
                e.0 += 1;
                e.1 += dt;
                e.2 += all - inner;
            });
            if let Some(p) = self.product {
                PRODUCTS.with_borrow_mut(|t| {
                    let e = t.entry(p).or_default();
                    e.0 += 1;
                    e.1 += dt;
                });
            }
        }
    }
}

/// One primitive's calls and total time.
#[derive(Clone, Debug)]
pub struct Row {
    /// The primitive's scope name (e.g. `"matmul"`, `"adamw"`).
    pub name: &'static str,
    /// How many times it ran while the profile counted.
    pub calls: u64,
    /// The total wall time of those calls.
    pub time: Duration,
    /// The GPU kernels those calls dispatched (not counting primitives
    /// called inside them, which have their own rows).
    pub dispatches: u64,
}

/// One product shape's calls and total time.
#[derive(Clone, Debug)]
pub struct ProductRow {
    /// The products' shape.
    pub shape: Product,
    /// How many products of this shape ran while the profile counted.
    pub calls: u64,
    /// Their total wall time.
    pub time: Duration,
}

impl ProductRow {
    /// The rate the products of this shape ran at, in GFLOP/s.
    pub fn gflops(&self) -> f64 {
        self.shape.flops() * self.calls as f64 / self.time.as_secs_f64().max(1e-12) / 1e9
    }
}

/// The forward reruns of one kind inside backward (timed by the
/// crate's recompute guard).
#[derive(Clone, Debug)]
pub struct RecomputeRow {
    /// What was rerun: `"checkpointed segments"` (whole blocks) or
    /// `"attention core"` (selective recomputation).
    pub what: &'static str,
    /// How many reruns.
    pub calls: u64,
    /// Their total wall time (the primitives inside are in the rows too).
    pub time: Duration,
}

/// A finished profile: rows by descending time.
#[derive(Clone, Debug)]
pub struct Profile {
    /// One row per primitive, by descending time.
    pub rows: Vec<Row>,
    /// The matrix products by shape, by descending time.
    pub products: Vec<ProductRow>,
    /// The forward reruns inside backward by kind, by descending time
    /// (empty when nothing was recomputed).
    pub recompute: Vec<RecomputeRow>,
    /// Each primitive's FLOPs and bytes, by descending FLOPs (the
    /// [roofline](crate::roofline)'s input).
    pub work: Vec<WorkRow>,
    /// Wall time inside [`unpause`] guards (a trainer's steps), if any.
    pub wall: Option<Duration>,
    /// GPU dispatches, submits and readbacks inside those guards, if any
    /// (counted across threads: run one profile at a time).
    pub gpu: Option<GpuCounters>,
    /// The training steps in the profile ([`step`]).
    pub steps: usize,
    /// The wall time of training steps left out of it ([`leave_out`]), if any.
    pub left_out: Option<Duration>,
}

impl Profile {
    /// Total time inside primitives.
    pub fn total(&self) -> Duration {
        self.rows.iter().map(|r| r.time).sum()
    }

    /// The roofline of this profile's work on `device` (its name in the
    /// messages) against `peak`: what `tinyllm train --profile` prints
    /// after the table.
    pub fn roofline(&self, device: &str, peak: Peak) -> Roofline {
        Roofline {
            classes: crate::roofline::classes(&self.work),
            steps: self.steps,
            wall: self.wall,
            gpu: self.gpu.is_some(),
            device: device.to_string(),
            peak,
        }
    }

    /// Time in the matrix products (the `matmul` scope).
    pub fn matmul(&self) -> Duration {
        self.rows
            .iter()
            .filter(|r| r.name == MATMUL)
            .map(|r| r.time)
            .sum()
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let total = self.total().as_secs_f64().max(1e-12);
        // The GPU's dispatches per primitive, when it did any.
        let col = |d: u64| match self.gpu {
            Some(_) => format!(" {d:>10}"),
            None => String::new(),
        };
        let head = if self.gpu.is_some() {
            " dispatches"
        } else {
            ""
        };
        writeln!(
            f,
            "{:<28} {:>9} {:>11} {:>7}{head}",
            "primitive", "calls", "ms", "share"
        )?;
        for r in &self.rows {
            let s = r.time.as_secs_f64();
            writeln!(
                f,
                "{:<28} {:>9} {:>11.1} {:>6.1}%{}",
                r.name,
                r.calls,
                s * 1e3,
                100.0 * s / total,
                col(r.dispatches)
            )?;
        }
        write!(
            f,
            "{:<28} {:>9} {:>11.1}",
            "all primitives",
            self.rows.iter().map(|r| r.calls).sum::<u64>(),
            total * 1e3,
        )?;
        if self.gpu.is_some() {
            let all = col(self.rows.iter().map(|r| r.dispatches).sum());
            write!(f, " {:>7}{all}", "")?;
        }
        let mm = self.matmul().as_secs_f64();
        if let Some(g) = self.gpu {
            write!(
                f,
                "\nGPU work: {} dispatches, {} queue submits, {} readbacks",
                g.dispatches, g.submits, g.readbacks
            )?;
            let inside: u64 = self.rows.iter().map(|r| r.dispatches).sum();
            if let Some(outside) = g.dispatches.checked_sub(inside).filter(|&d| d > 0) {
                write!(f, " ({outside} dispatches outside the primitives)")?;
            }
        }
        if !self.products.is_empty() {
            write!(
                f,
                "\n{:<40} {:>6} {:>11} {:>8}",
                "matmul by shape", "calls", "ms", "GFLOP/s"
            )?;
            for p in &self.products {
                write!(
                    f,
                    "\n{:<40} {:>6} {:>11.1} {:>8.1}",
                    p.shape.to_string(),
                    p.calls,
                    p.time.as_secs_f64() * 1e3,
                    p.gflops()
                )?;
            }
            let flops: f64 = self
                .products
                .iter()
                .map(|p| p.shape.flops() * p.calls as f64)
                .sum();
            write!(
                f,
                "\nall products: {:.1} GFLOP/s",
                flops / mm.max(1e-12) / 1e9
            )?;
        }
        if !self.recompute.is_empty() {
            let parts: Vec<String> = self
                .recompute
                .iter()
                .map(|r| {
                    let s = r.time.as_secs_f64();
                    let share = self.wall.map_or(String::new(), |w| {
                        format!(
                            " ({:.1}% of the steps)",
                            100.0 * s / w.as_secs_f64().max(1e-12)
                        )
                    });
                    format!("{} {} reruns {:.1} ms{share}", r.what, r.calls, s * 1e3)
                })
                .collect();
            write!(
                f,
                "\nrecomputed in backward (wall time; its primitives are in the rows above): {}",
                parts.join(", ")
            )?;
        }
        match self.wall {
            Some(w) => {
                let w = w.as_secs_f64().max(1e-12);
                write!(
                    f,
                    "\nwall time of the steps {:.1} ms: matmul {:.1}%, everything else {:.1}% \
                     (other primitives {:.1}%, between primitives {:.1}%)",
                    w * 1e3,
                    100.0 * mm / w,
                    100.0 * (1.0 - mm / w),
                    100.0 * (total - mm) / w,
                    100.0 * (1.0 - total / w)
                )
            }
            None => write!(
                f,
                "\nmatmul {:.1}% of the primitives' time",
                100.0 * mm / total
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_count_only_while_a_profile_runs() {
        drop(scope("before"));
        start();
        for _ in 0..3 {
            let _s = scope("matmul");
            std::thread::sleep(Duration::from_millis(2));
        }
        drop(scope("unary exp"));
        {
            let _p = pause();
            drop(scope("paused"));
            let _u = unpause();
            drop(scope("unary exp"));
            std::thread::sleep(Duration::from_millis(3));
        }
        let p = take().unwrap();
        assert!(p.wall.unwrap() >= Duration::from_millis(3));
        assert!(take().is_none(), "take stops the profile");
        drop(scope("after"));
        assert_eq!(p.rows.len(), 2, "{p:?}");
        assert_eq!((p.rows[0].name, p.rows[0].calls), ("matmul", 3));
        assert_eq!((p.rows[1].name, p.rows[1].calls), ("unary exp", 2));
        assert!(p.matmul() >= Duration::from_millis(6));
        assert!(p.matmul() <= p.total());
        assert!(p.to_string().contains("matmul"));
    }

    /// The roofline's model, call by call: a product class's FLOPs are
    /// `2·m·n·k` per call summed (a 16-bit operand read at 2 bytes a value),
    /// and an elementwise call moves its inputs and output once each.
    #[test]
    fn the_roofline_counts_products_and_elementwise_bytes() {
        use crate::backend::elementwise::{BinaryOp, UnaryOp};
        use crate::backend::{BinaryLayout, Causal, Device, MatmulDims, Operand, Storage};
        use crate::roofline::{classes, Class};
        let values = |n: usize| {
            Storage::from_f32((0..n).map(|i| i as f32 * 0.25).collect(), Device::Cpu).unwrap()
        };
        let dims = |batch, m, k, n| MatmulDims {
            batch,
            m,
            k,
            n,
            trans_a: false,
            trans_b: false,
            a_batch_stride: m * k,
            b_batch_stride: k * n,
            causal: Causal::No,
            tokens: Default::default(),
        };
        let (a, b) = (values(3 * 5), values(5 * 4));
        let (a2, b2) = (values(2 * 2 * 7), values(2 * 7 * 6));
        let (x, bias) = (values(6), values(3));
        let (half, _) = a.pack(crate::Format::Bf16).unwrap();
        start();
        a.matmul(&b, dims(1, 3, 5, 4), None).unwrap();
        a2.matmul(&b2, dims(2, 2, 7, 6), None).unwrap();
        Operand::Half(half)
            .matmul(&Operand::Values(b.clone()), dims(1, 3, 5, 4), None)
            .unwrap();
        let layout = BinaryLayout {
            shape: vec![2, 3],
            lhs_strides: vec![3, 1],
            rhs_strides: vec![0, 1],
        };
        x.binary(&bias, BinaryOp::Add, &layout).unwrap();
        values(10).unary(UnaryOp::Exp).unwrap();
        let p = take().unwrap();

        let mm = classes(&p.work)
            .into_iter()
            .find(|c| c.class == Class::Matmul)
            .unwrap();
        assert_eq!(mm.calls, 3);
        assert_eq!(
            mm.flops,
            (2 * 3 * 4 * 5 + 2 * (2 * 2 * 6 * 7) + 2 * 3 * 4 * 5) as f64
        );
        // f32 operands and outputs at 4 bytes; the 16-bit copy of a: 15 values
        // in 8 words, 32 bytes.
        let f32s = (15 + 20 + 12) + (28 + 84 + 24) + (20 + 12);
        assert_eq!(mm.bytes, (4 * f32s + 32) as f64);
        let row = |name| p.work.iter().find(|w| w.name == name).unwrap();
        // (2×3) + a broadcast row of 3: 6 + 3 values read, 6 written
        assert_eq!(
            (row("binary add").bytes, row("binary add").flops),
            (4.0 * 15.0, 6.0)
        );
        assert_eq!(
            (row("unary exp").bytes, row("unary exp").flops),
            (80.0, 10.0)
        );
        assert!(p
            .roofline("cpu", Default::default())
            .to_string()
            .contains("no peak known for the cpu device"));
    }

    #[test]
    fn each_scope_counts_its_own_dispatches() {
        let dispatch = |n: usize| (0..n).for_each(|_| note_gpu(GpuEvent::Dispatch));
        start();
        {
            let _outer = scope("outer");
            dispatch(2);
            {
                let _inner = scope("inner");
                dispatch(3);
                drop(scope("innermost"));
                let _deepest = scope("innermost");
                dispatch(4);
            }
            dispatch(1);
        }
        dispatch(5); // outside every primitive
        let p = take().unwrap();
        let count = |name| p.rows.iter().find(|r| r.name == name).map(|r| r.dispatches);
        assert_eq!(count("outer"), Some(3));
        assert_eq!(count("inner"), Some(3));
        assert_eq!(count("innermost"), Some(4));
    }
}
