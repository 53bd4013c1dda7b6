//! The threads of the large CPU kernels: one worker per core after the first,
//! started at the first parallel call. A worker that finishes a job spins on
//! the job counter for a while before it sleeps ([`cpu_spin`]: a training
//! step hands out parallel regions in quick succession, and waking a sleeping
//! thread can cost more than a region itself).
//!
//! A job is `tasks` calls of one closure, taken in turn by the caller and the
//! workers. One job runs at a time: a call made while another thread's job is
//! in flight, or from inside a task, runs its tasks itself, in order. The
//! kernels split their work the same way whichever thread runs a part, so no
//! result depends on it.
//!
//! The closure is borrowed, and the workers outlive it: they reach it through
//! a pointer whose lifetime is erased. What keeps that sound is [`Posted`],
//! which closes the job and waits for every call that started before it lets
//! the borrow end — when the caller's part returns and when it unwinds alike.

use super::{cpu_spin, cpu_threads};
use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

/// A pass over fewer values than this runs on one thread: its parts would
/// take about as long as handing them out (a few microseconds).
pub const SPLIT_VALUES: usize = 1 << 15;

/// Runs `f(item)` for every item, spread over the pool's threads and the
/// caller; returns when all have finished. A panic in any of them is raised
/// here once every item has been run.
pub fn each<T: Send>(items: impl IntoIterator<Item = T>, f: impl Fn(T) + Sync) {
    map(items, f);
}

/// [`each`], returning the results in the items' order.
pub fn map<T: Send, R: Send>(items: impl IntoIterator<Item = T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let slots: Vec<Mutex<(Option<T>, Option<R>)>> = items.into_iter().map(|t| Mutex::new((Some(t), None))).collect();
    let one = |i: usize| {
        let item = lock(&slots[i]).0.take().expect("each item is taken once");
        let r = f(item);
        lock(&slots[i]).1 = Some(r);
    };
    run(slots.len(), &one);
    slots
        .into_iter()
        .map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner()).1.expect("every item ran"))
        .collect()
}

/// Runs `f(i)` for `i` in `0..tasks` (see [`each`]) on at most
/// [`cpu_threads`] threads.
pub fn run(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    let pool = pool();
    let helpers = cpu_threads().min(tasks).saturating_sub(1);
    let busy = match pool.as_ref().filter(|_| helpers > 0 && !IN_TASK.get()) {
        Some(p) => p.busy.try_lock().ok().map(|g| (p, g)),
        None => None,
    };
    let Some((pool, busy)) = busy else {
        let _inside = InTask::enter();
        let mut panic = None;
        for i in 0..tasks {
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                panic.get_or_insert(p);
            }
        }
        return panic.map_or((), |p| resume_unwind(p));
    };
    let job = Arc::new(Job {
        f: (&f as *const &(dyn Fn(usize) + Sync)).cast(),
        tasks,
        seats: AtomicUsize::new(helpers),
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panic: Mutex::new(None),
    });
    // Posted before the workers can see the job, dropped before `f`'s borrow
    // (and this frame, which holds the `&dyn` that `job.f` points at) ends.
    let posted = Posted { pool, job: job.clone(), _busy: busy };
    *lock(&pool.job) = Some(job.clone());
    pool.generation.fetch_add(1, Ordering::Release);
    if *lock(&pool.sleepers) > 0 {
        pool.wake.notify_all();
    }
    job.work();
    drop(posted);
    let panic = lock(&job.panic).take();
    if let Some(p) = panic {
        resume_unwind(p);
    }
}

struct Job {
    /// Where the caller of [`run`] holds its `&(dyn Fn(usize) + Sync)`: a
    /// thin pointer without its lifetime, read only by [`Job::work`] for a
    /// task it has claimed (see [`Posted`]).
    f: *const (),
    tasks: usize,
    /// How many more workers may join.
    seats: AtomicUsize,
    /// The next task to claim; [`Posted`] closes the job by setting it to
    /// `tasks`.
    next: AtomicUsize,
    /// How many claimed tasks have finished (returned or panicked).
    done: AtomicUsize,
    /// The first panic of a task, raised in the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `f` is the only field that is not Send and Sync by itself. It
// points at a `&(dyn Fn(usize) + Sync)`: calling that closure from several
// threads at once is what `Sync` allows, and a `&T` with `T: Sync` may be
// read from any thread. When it may be read is `Posted`'s to ensure.
unsafe impl Send for Job {}
// SAFETY: as for Send.
unsafe impl Sync for Job {}

impl Job {
    /// Takes tasks until none is left; each finished one counts in `done`.
    fn work(&self) {
        let _inside = InTask::enter();
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            // counts the task even if what follows unwinds
            let _done = Done(&self.done);
            // SAFETY: task `i < tasks` was claimed before the job was closed
            // (a claim after `Posted` closes it gets a number past the last),
            // so `Posted` waits for `_done` before the caller's frame, and
            // the borrow of the closure in it, can end: the `&dyn` `f`
            // points at is still there, and so is the closure.
            let f = unsafe { *self.f.cast::<&(dyn Fn(usize) + Sync)>() };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                lock(&self.panic).get_or_insert(p);
            }
        }
    }
}

/// Adds one to a job's `done` when dropped: once a claimed task has run, or
/// is unwinding.
struct Done<'a>(&'a AtomicUsize);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// A job handed to the workers; dropping it closes the job and waits until
/// every task claimed before has finished, so that no worker reads the
/// caller's closure afterwards. [`run`] drops it before it returns, and on
/// the way out if anything in it panics; only then does it release `busy`
/// (the next job may be posted).
struct Posted<'p> {
    pool: &'static Pool,
    job: Arc<Job>,
    _busy: MutexGuard<'p, ()>,
}

impl Drop for Posted<'_> {
    fn drop(&mut self) {
        let job = &self.job;
        // No task starts after this: a claim now gets `tasks` or more.
        let claimed = job.next.swap(job.tasks, Ordering::AcqRel).min(job.tasks);
        let mut spins = 0u32;
        while job.done.load(Ordering::Acquire) < claimed {
            pause(&mut spins);
        }
        *lock(&self.pool.job) = None;
    }
}

struct Pool {
    /// Held by the thread whose job is in flight.
    busy: Mutex<()>,
    job: Mutex<Option<Arc<Job>>>,
    /// Counts the jobs handed out; a worker watches it for the next.
    generation: AtomicU64,
    sleepers: Mutex<usize>,
    wake: Condvar,
}

impl Pool {
    fn new() -> Pool {
        Pool {
            busy: Mutex::new(()),
            job: Mutex::new(None),
            generation: AtomicU64::new(0),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
        }
    }
}

thread_local! {
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as running tasks until dropped (a nested call runs inline).
struct InTask(bool);

impl InTask {
    fn enter() -> InTask {
        InTask(IN_TASK.replace(true))
    }
}

impl Drop for InTask {
    fn drop(&mut self) {
        IN_TASK.set(self.0);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The pool, started on first use; `None` on a one-core machine or where no
/// thread could be started.
fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<&'static Pool>> = OnceLock::new();
    *POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        if cores < 2 {
            return None;
        }
        let pool: &'static Pool = Box::leak(Box::new(Pool::new()));
        let started = (1..cores)
            .filter(|w| {
                let spawned = std::thread::Builder::new()
                    .name(format!("tinyllm-cpu-{w}"))
                    .spawn(move || worker(pool));
                spawned.is_ok()
            })
            .count();
        (started > 0).then_some(pool)
    })
}

fn worker(pool: &'static Pool) {
    let mut seen = 0;
    loop {
        seen = next_generation(pool, seen);
        let job = lock(&pool.job).clone();
        if let Some(job) = job {
            let seat = job.seats.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| s.checked_sub(1));
            if seat.is_ok() {
                job.work();
            }
        }
    }
}

/// One round of a busy wait: a pause instruction at first, then a yield, so
/// that with more runnable threads than cores (tests in parallel) the wait
/// gives way to them.
fn pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if *spins < 2048 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// Waits until the generation differs from `seen` — spinning for
/// [`cpu_spin`] (read as it goes: a change takes effect at once), then
/// asleep — and returns it.
fn next_generation(pool: &Pool, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    while !cpu_spin().is_zero() {
        let g = pool.generation.load(Ordering::Acquire);
        if g != seen {
            return g;
        }
        pause(&mut spins);
        if spins.is_multiple_of(256) && start.elapsed() > cpu_spin() {
            break;
        }
    }
    let mut sleepers = lock(&pool.sleepers);
    *sleepers += 1;
    loop {
        let g = pool.generation.load(Ordering::Acquire);
        if g != seen {
            *sleepers -= 1;
            return g;
        }
        sleepers = pool.wake.wait(sleepers).unwrap_or_else(|e| e.into_inner());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_once_and_nested_calls_run_inline() {
        let hits: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..200 {
            each(0..37, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                // a nested call from inside a task
                let inner = AtomicUsize::new(0);
                each(0..3, |_| {
                    inner.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(inner.load(Ordering::Relaxed), 3);
            });
        }
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 200));
    }

    #[test]
    fn a_panicking_task_panics_the_caller_after_the_others_ran() {
        // on the threads, and on the caller alone
        for threads in [2, 1] {
            crate::backend::cpu::set_cpu_threads(Some(threads));
            let ran = AtomicUsize::new(0);
            let r = catch_unwind(AssertUnwindSafe(|| {
                each(0..8, |i| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    assert!(i != 5, "task {i} fails");
                })
            }));
            let message = r.expect_err("the caller panics").downcast::<String>().map(|m| *m);
            assert_eq!(message.ok().as_deref(), Some("task 5 fails"), "the task's own panic");
            assert_eq!(ran.load(Ordering::Relaxed), 8, "{threads} threads");
        }
        crate::backend::cpu::set_cpu_threads(None);
        // the pool still works afterwards
        let n = AtomicUsize::new(0);
        each(0..4, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 4);
    }

    /// A task that panics while other threads are inside theirs: the caller
    /// raises the panic only once they are done with the closure, which is
    /// still there for them (its borrow outlasts every call).
    #[test]
    fn a_panic_waits_for_the_other_tasks_to_finish_with_the_closure() {
        crate::backend::cpu::set_cpu_threads(Some(4));
        for _ in 0..20 {
            let running = AtomicUsize::new(0);
            let values: Vec<usize> = (0..64).collect();
            let r = catch_unwind(AssertUnwindSafe(|| {
                run(16, &|i| {
                    running.fetch_add(1, Ordering::SeqCst);
                    if i == 0 {
                        panic!("the first task fails");
                    }
                    std::thread::sleep(std::time::Duration::from_micros(200));
                    assert_eq!(values.iter().sum::<usize>(), 63 * 64 / 2);
                    running.fetch_sub(1, Ordering::SeqCst);
                })
            }));
            assert!(r.is_err());
            // every task but the failed one left before the caller went on
            assert_eq!(running.load(Ordering::SeqCst), 1);
        }
        crate::backend::cpu::set_cpu_threads(None);
    }

    /// The spin setting takes effect: an idle worker (here watching a pool of
    /// its own) that would watch for a minute is still awake after 100 ms;
    /// with the spin set to zero it goes to sleep at once, and a new job wakes
    /// it.
    #[test]
    fn with_the_spin_off_an_idle_worker_sleeps() {
        use crate::backend::cpu::{cpu_spin, set_cpu_spin};
        use std::time::Duration;
        let pool: &'static Pool = Box::leak(Box::new(Pool::new()));
        let asleep = || *lock(&pool.sleepers);
        set_cpu_spin(Some(Duration::from_secs(60)));
        assert_eq!(cpu_spin(), Duration::from_secs(60));
        let watcher = std::thread::spawn(move || next_generation(pool, 0));
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(asleep(), 0, "a worker slept while it should spin");
        set_cpu_spin(Some(Duration::ZERO));
        let deadline = Instant::now() + Duration::from_secs(20);
        while asleep() == 0 {
            assert!(Instant::now() < deadline, "with the spin off the worker never slept");
            std::thread::sleep(Duration::from_millis(1));
        }
        // a new job, posted as `run` posts one
        pool.generation.fetch_add(1, Ordering::Release);
        if *lock(&pool.sleepers) > 0 {
            pool.wake.notify_all();
        }
        assert_eq!(watcher.join().unwrap(), 1);
        assert_eq!(asleep(), 0);
        set_cpu_spin(None);
        assert_eq!(cpu_spin(), Duration::from_millis(2));
    }
}
