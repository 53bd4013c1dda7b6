//! Memory accounting: live and peak bytes of every tensor storage, CPU and GPU.
//!
//! Every storage buffer holds a [`Ticket`] for its size; creating one adds to
//! the live count (and raises the peak), dropping it subtracts. Counters are
//! per thread, like grad mode and autocast: tensors are `Rc`-based and die on the
//! thread that made them, and parallel tests cannot disturb each other's
//! figures. Pooled GPU buffers that hold no tensor are not counted as live;
//! `gpu::pool_bytes` (in builds with the `gpu` feature) reports them separately.

use std::cell::Cell;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    /// The phase allocations count towards, and each phase's peak since the
    /// last [`reset_peak`] (0 for a phase not entered since).
    static PHASE: Cell<Phase> = const { Cell::new(Phase::Update) };
    static PHASE_PEAKS: Cell<[usize; 3]> = const { Cell::new([0; 3]) };
}

/// The parts of a training step whose peaks are measured apart, as the
/// memory plan predicts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The micro-batches' forward passes and losses.
    Forward,
    /// Their backward passes, recomputation included.
    Backward,
    /// Everything else: unscaling, clipping, the optimizer (and, outside a
    /// step, whatever runs).
    Update,
}

/// Peaks of one step's phases, in tensor bytes (0: not entered).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhasePeaks {
    /// [`Phase::Forward`]'s peak.
    pub forward: usize,
    /// [`Phase::Backward`]'s peak.
    pub backward: usize,
    /// [`Phase::Update`]'s peak.
    pub update: usize,
}

/// From now on this thread's allocations count towards `phase`'s peak, which
/// starts from the bytes live now if it is lower.
pub fn enter(phase: Phase) {
    PHASE.with(|p| p.set(phase));
    raise_phase_peak(LIVE.with(Cell::get));
}

fn raise_phase_peak(now: usize) {
    let i = PHASE.with(Cell::get) as usize;
    PHASE_PEAKS.with(|p| {
        let mut peaks = p.get();
        peaks[i] = peaks[i].max(now);
        p.set(peaks);
    });
}

/// Each phase's peak since the last [`reset_peak`].
pub fn phase_peaks() -> PhasePeaks {
    let [forward, backward, update] = PHASE_PEAKS.with(Cell::get);
    PhasePeaks {
        forward,
        backward,
        update,
    }
}

/// A snapshot of this thread's storage bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemStats {
    /// Bytes held by tensor storage at the snapshot ([`live_bytes`]).
    pub live: usize,
    /// The highest live count since the last [`reset_peak`] ([`peak_bytes`]).
    pub peak: usize,
}

/// This thread's live and peak storage bytes, read together.
pub fn stats() -> MemStats {
    MemStats {
        live: LIVE.with(Cell::get),
        peak: PEAK.with(Cell::get),
    }
}

/// Bytes held by tensor storage right now.
pub fn live_bytes() -> usize {
    LIVE.with(Cell::get)
}

/// The highest live count since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.with(Cell::get)
}

/// Starts a new peak measurement from the current live count; the phase
/// peaks start again from 0, the current phase's from the live count.
pub fn reset_peak() {
    let live = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(live));
    PHASE_PEAKS.with(|p| p.set([0; 3]));
    raise_phase_peak(live);
}

/// Held by a storage buffer for as long as it exists.
#[derive(Debug)]
pub struct Ticket {
    bytes: usize,
}

impl Ticket {
    /// Counts `bytes` as live on this thread (raising the peak if need be)
    /// until the ticket is dropped.
    pub fn new(bytes: usize) -> Ticket {
        LIVE.with(|l| {
            let now = l.get() + bytes;
            l.set(now);
            PEAK.with(|p| p.set(p.get().max(now)));
            raise_phase_peak(now);
        });
        Ticket { bytes }
    }
    /// The bytes this ticket counts.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        LIVE.with(|l| l.set(l.get().saturating_sub(self.bytes)));
    }
}

/// Asks the C allocator (glibc's malloc) to keep freed memory for reuse.
///
/// A training step frees and re-allocates the same few hundred activation and
/// gradient buffers, many above glibc's mmap threshold. By default each such
/// buffer is a fresh `mmap`, so every step page-faults and zero-fills its
/// memory again. With `mmap` off for the heap (`M_MMAP_MAX` = 0), one arena
/// for every thread (`M_ARENA_MAX` = 1: glibc deletes a thread arena's 64 MiB
/// heaps as they empty, so the kernels' worker threads faulted their buffers
/// back in every step) and trimming off (`M_TRIM_THRESHOLD` = -1), the heap
/// keeps its pages and the next step's buffers come back warm. The process's resident size then stays near its peak,
/// which is what the crate's own counters ([`peak_bytes`]) report anyway.
///
/// Process-wide, so it is the application's call: the `tinyllm` binary and the
/// benchmarks make it; the library never does. Returns whether glibc took both
/// settings (a no-op, `false`, off glibc).
pub fn keep_freed_host_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_MAX: i32 = -4;
        const M_ARENA_MAX: i32 = -8;
        // SAFETY: mallopt only changes allocator tuning; these are documented
        // glibc parameters and these values are valid for them.
        unsafe {
            mallopt(M_MMAP_MAX, 0) == 1
                && mallopt(M_TRIM_THRESHOLD, -1) == 1
                && mallopt(M_ARENA_MAX, 1) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// The process's resident-memory high-water mark in bytes (Linux `VmHWM`):
/// everything the machine saw this process hold — tensors, the allocator's
/// slack and caches, packing buffers, the GPU driver's host memory. `None`
/// where the platform does not say.
pub fn process_peak_rss() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Hands the allocator's free memory back to the system and restarts the
/// process's resident high-water mark from what it holds now, so that
/// [`process_peak_rss`] afterwards measures what follows (one side of a
/// comparison, not the run before it). Returns whether the restart took
/// (Linux only).
pub fn restart_process_peak() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: malloc_trim only returns free heap pages to the kernel.
        unsafe { malloc_trim(0) };
    }
    // "5" resets the peak resident size (Linux 4.0+, documented in proc(5)).
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::{enter, phase_peaks, reset_peak, Phase, PhasePeaks, Ticket};

    /// Each phase keeps its own peak: what was live when it was entered, or
    /// more; a phase not entered since the reset reads 0.
    #[test]
    fn each_phase_keeps_its_own_peak() {
        let held = Ticket::new(1000);
        enter(Phase::Update);
        reset_peak();
        enter(Phase::Forward);
        let a = Ticket::new(300);
        drop(a);
        let b = Ticket::new(100);
        enter(Phase::Backward);
        let c = Ticket::new(50);
        drop((b, c));
        enter(Phase::Update);
        let p = phase_peaks();
        let base = super::live_bytes() - 1000;
        assert_eq!(
            p,
            PhasePeaks {
                forward: base + 1300,
                backward: base + 1150,
                update: base + 1000,
            }
        );
        reset_peak();
        assert_eq!(phase_peaks().forward, 0);
        drop(held);
    }

    /// A fresh high-water mark sees a large allocation made after it, and
    /// not one freed before it.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn the_process_peak_restarts_and_sees_what_follows() {
        // what the process holds now (the other tests' memory included)
        assert!(super::restart_process_peak());
        let base = super::process_peak_rss().unwrap();
        let big = vec![1u8; 256 << 20];
        std::hint::black_box(&big);
        drop(big);
        assert!(super::restart_process_peak());
        let before = super::process_peak_rss().unwrap();
        let touched = vec![1u8; 64 << 20];
        std::hint::black_box(&touched);
        let after = super::process_peak_rss().unwrap();
        assert!(after >= before + (60 << 20), "{before} -> {after}");
        assert!(
            before < base + (128 << 20),
            "the freed 256 MiB still counts: {base} -> {before}"
        );
    }

    /// mallopt reports a setting it refuses only through its return value:
    /// the call must say that both took.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_allocator_settings() {
        assert!(super::keep_freed_host_memory());
    }
}
