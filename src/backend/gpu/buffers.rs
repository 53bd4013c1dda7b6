//! Storage buffers recycled by size class.
//!
//! Allocating a GPU buffer is slow (and on some drivers, fragmenting), and a
//! training step frees and re-creates the same shapes every time. A dropped
//! tensor's buffer goes back to a free list keyed by its size class; the next
//! request for that class takes it. Pooled buffers hold no tensor, so they are
//! not counted as live memory; [`gpu_pool_bytes`](super::gpu_pool_bytes)
//! reports them.

use std::collections::HashMap;

/// Pooled-but-free bytes kept at most; beyond it freed buffers are released.
const MAX_POOLED: u64 = 1 << 30;

#[derive(Default)]
pub struct Pool {
    free: HashMap<u64, Vec<wgpu::Buffer>>,
    free_bytes: u64,
    /// Bytes of every tensor buffer alive on the device: backing a tensor
    /// or pooled. What the device holds for tensors.
    held: u64,
    /// The most `held` has been since the last [`Pool::restart_peak`].
    peak: u64,
}

/// The size class of a request: at least 256 bytes, then 8 classes per power of
/// two (at most 12.5% slack).
pub fn size_class(bytes: u64) -> u64 {
    if bytes <= 256 {
        return 256;
    }
    let p = bytes.next_power_of_two();
    let step = p / 8;
    bytes.next_multiple_of(step)
}

impl Pool {
    pub fn take(&mut self, class: u64) -> Option<wgpu::Buffer> {
        let b = self.free.get_mut(&class)?.pop()?;
        self.free_bytes -= class;
        Some(b)
    }

    /// A buffer of `class` bytes was created.
    pub fn created(&mut self, class: u64) {
        self.held += class;
        self.peak = self.peak.max(self.held);
    }

    /// Takes `buf` back, or returns it when the pool is full: the caller
    /// releases it (dropping the handle, once the context has forgotten it).
    #[must_use]
    pub fn put(&mut self, class: u64, buf: wgpu::Buffer) -> Option<wgpu::Buffer> {
        if self.free_bytes + class > MAX_POOLED {
            self.held -= class;
            return Some(buf); // dropping the handle releases it (once the GPU is done with it)
        }
        self.free_bytes += class;
        self.free.entry(class).or_default().push(buf);
        None
    }

    /// A buffer of `class` bytes no tensor needs any more and the pool
    /// should not keep (replaced by a copy laid out elsewhere): returned for
    /// the caller to release.
    #[must_use]
    pub fn discard(&mut self, class: u64, buf: wgpu::Buffer) -> wgpu::Buffer {
        self.held -= class;
        buf
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Tensor buffer bytes on the device now and at their peak.
    pub fn held_bytes(&self) -> (u64, u64) {
        (self.held, self.peak)
    }

    /// Releases every pooled buffer and starts the peak again from what
    /// the tensors alive now hold.
    /// Returns the buffers, for the caller to release.
    #[must_use]
    pub fn release_and_restart_peak(&mut self) -> Vec<wgpu::Buffer> {
        self.held -= self.free_bytes;
        let out = self.free.drain().flat_map(|(_, v)| v).collect();
        self.free_bytes = 0;
        self.peak = self.held;
        out
    }
}
