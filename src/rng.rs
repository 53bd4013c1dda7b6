//! A counter-based generator: Philox4x32-10 (Salmon et al., 2011).
//!
//! The whole state is `(seed, offset)`. Draw `i` of a call is a pure function
//! of `(seed, offset + i/4, i%4)`, so the CPU and the GPU (`shaders/dropout.wgsl`)
//! produce the same stream, and saving, replaying and restoring a generator is
//! copying two integers — which is what activation recompute needs to
//! rerun a dropout layer with the same mask.

use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::rc::Rc;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Ten Philox rounds on one 128-bit counter block.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The `i`-th 32-bit draw of a stream at `(seed, offset)`.
#[inline]
pub fn draw_u32(seed: u64, offset: u64, i: u64) -> u32 {
    block(seed, offset.wrapping_add(i / 4))[(i % 4) as usize]
}

/// The four draws of counter block `b` of stream `seed`.
fn block(seed: u64, b: u64) -> [u32; 4] {
    philox4x32(
        [b as u32, (b >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// Draws `0..n` of a stream at `(seed, offset)`, in order: each block's
/// four draws from one Philox call (the same values as [`draw_u32`]).
pub fn draws(seed: u64, offset: u64, n: usize) -> impl Iterator<Item = u32> {
    (0..(n as u64).div_ceil(4))
        .flat_map(move |b| block(seed, offset.wrapping_add(b)))
        .take(n)
}

/// A uniform draw in `[0, 1)` with 24 random bits: `(u >> 8) * 2^-24` (exact).
#[inline]
pub fn uniform01(u: u32) -> f32 {
    (u >> 8) as f32 * 5.960_464_5e-8
}

/// The state of a generator: where its stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// The Philox key: which stream.
    pub seed: u64,
    /// The next unused counter block (each block gives four 32-bit draws).
    pub offset: u64,
}

/// A shared handle to one stream. Clones share the position, so a model's
/// dropout layers and the trainer can hold the same generator.
#[derive(Clone, Debug)]
pub struct Generator {
    state: Rc<Cell<RngState>>,
}

impl Generator {
    /// A new stream for `seed`, at its start (offset 0).
    pub fn new(seed: u64) -> Generator {
        Generator {
            state: Rc::new(Cell::new(RngState { seed, offset: 0 })),
        }
    }
    /// Where the stream is now (save it to replay the draws that follow).
    pub fn state(&self) -> RngState {
        self.state.get()
    }
    /// Moves the stream to `s`, for every handle sharing it.
    pub fn set_state(&self, s: RngState) {
        self.state.set(s)
    }
    /// Reserves `n` draws: returns the state they start at and advances past
    /// them (whole blocks of four, so streams never overlap).
    pub fn reserve(&self, n: usize) -> RngState {
        let s = self.state.get();
        let blocks = (n as u64).div_ceil(4);
        self.state.set(RngState {
            seed: s.seed,
            offset: s.offset.wrapping_add(blocks),
        });
        s
    }
    /// `n` uniform draws in `[0, 1)`, on the host.
    pub fn uniform(&self, n: usize) -> Vec<f32> {
        let s = self.reserve(n);
        draws(s.seed, s.offset, n).map(uniform01).collect()
    }
    /// `n` draws of an approximately standard normal variable: the Irwin–Hall
    /// sum of 12 uniforms minus 6 (exact arithmetic, no transcendental function,
    /// so init is the same bits on every platform). Used for weight init only.
    pub fn normal(&self, n: usize) -> Vec<f32> {
        let s = self.reserve(12 * n);
        let mut u = draws(s.seed, s.offset, 12 * n).map(uniform01);
        (0..n)
            .map(|_| u.by_ref().take(12).fold(-6.0f32, |a, x| a + x))
            .collect()
    }
    /// A uniform integer in `0..n` (sampling, data order), from a 64-bit draw
    /// reduced modulo `n`. Panics if `n` is 0.
    pub fn below(&self, n: usize) -> usize {
        let s = self.reserve(2);
        let hi = draw_u32(s.seed, s.offset, 0) as u64;
        let lo = draw_u32(s.seed, s.offset, 1) as u64;
        (((hi << 32) | lo) % n as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_published_known_answer() {
        // Random123's kat_vectors: philox4x32-10 with zero counter and key.
        assert_eq!(
            philox4x32([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
    }

    #[test]
    fn save_replay_restore() {
        let g = Generator::new(7);
        let saved = g.state();
        let a = g.uniform(10);
        let after = g.state();
        g.set_state(saved);
        assert_eq!(g.uniform(10), a);
        assert_eq!(g.state(), after);
        assert_ne!(g.uniform(10), a);
    }

    /// A stream read block by block gives draw `i` at `(seed, offset + i/4, i%4)`,
    /// as each draw alone: lengths that end inside a block, an offset that
    /// crosses 2^32 blocks, a seed with both halves set.
    #[test]
    fn draws_in_blocks_are_the_single_draws() {
        for (seed, offset) in [(7u64, 0u64), (0x1234_5678_9abc_def0, (1 << 32) - 2)] {
            for n in [0, 1, 3, 4, 9, 17] {
                let blocks: Vec<u32> = draws(seed, offset, n).collect();
                let single: Vec<u32> = (0..n as u64).map(|i| draw_u32(seed, offset, i)).collect();
                assert_eq!(blocks, single, "seed {seed:#x} offset {offset} n {n}");
            }
        }
        // normal: each value the sum of its own twelve uniforms from −6
        let g = Generator::new(11);
        let s = g.state();
        let z = g.normal(5);
        let u: Vec<f32> = (0..60)
            .map(|i| uniform01(draw_u32(s.seed, s.offset, i)))
            .collect();
        let want: Vec<f32> = u
            .chunks(12)
            .map(|c| c.iter().fold(-6.0f32, |a, &x| a + x))
            .collect();
        assert_eq!(z, want);
    }
}
