//! Memory accounting: live and peak bytes of every tensor storage, CPU and GPU.
//!
//! Every storage buffer holds a [`Ticket`] for its size; creating one adds to
//! the live count (and raises the peak), dropping it subtracts. Counters are
//! per thread, like grad mode and autocast: tensors are `Rc`-based and die on the
//! thread that made them, and parallel tests cannot disturb each other's
//! figures. Pooled GPU buffers that hold no tensor are not counted as live;
//! [`gpu_pool_bytes`](crate::backend::gpu_pool_bytes) reports them separately.

use std::cell::Cell;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

/// A snapshot of this thread's storage bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemStats {
    pub live: usize,
    pub peak: usize,
}

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

/// Starts a new peak measurement from the current live count.
pub fn reset_peak() {
    PEAK.with(|p| p.set(LIVE.with(Cell::get)));
}

/// Held by a storage buffer for as long as it exists.
#[derive(Debug)]
pub struct Ticket {
    bytes: usize,
}

impl Ticket {
    pub fn new(bytes: usize) -> Ticket {
        LIVE.with(|l| {
            let now = l.get() + bytes;
            l.set(now);
            PEAK.with(|p| p.set(p.get().max(now)));
        });
        Ticket { bytes }
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        LIVE.with(|l| l.set(l.get().saturating_sub(self.bytes)));
    }
}
