//! The wgpu backend (placeholder: being written; every primitive reports that
//! the GPU backend is unavailable).

use super::round::Format;
use super::{AdamWConsts, BinaryLayout, BinaryOp, MatmulDims, ReduceOp, UnaryOp};
use crate::{bail, Result};

pub struct GpuStorage {
    len: usize,
}

pub fn gpu_pool_bytes() -> usize {
    0
}

/// The adapter's name when a GPU device can be created.
pub fn adapter_name() -> Result<String> {
    bail!("no GPU adapter")
}

#[allow(unused_variables)]
impl GpuStorage {
    pub fn upload(data: &[f32]) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn full(n: usize, v: f32) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn download(&self) -> Result<Vec<f32>> {
        bail!("no GPU adapter")
    }
    pub fn unary(&self, op: UnaryOp) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn binary(&self, rhs: &Self, op: BinaryOp, layout: &BinaryLayout) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn matmul(&self, rhs: &Self, d: MatmulDims, round: Option<Format>) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn strided_copy(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn concat(parts: &[&Self], outer: usize, sizes: &[usize], inner: usize) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn gather_rows(&self, ids: &[u32], d: usize) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn softmax_rows(&self, rows: usize, n: usize) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn softmax_rows_backward(&self, g: &Self, rows: usize, n: usize) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn dropout_mask(n: usize, p: f32, scale: f32, seed: u64, offset: u64) -> Result<Self> {
        bail!("no GPU adapter")
    }
    pub fn finite_check_unscale(bufs: &[&Self], inv_scale: f32) -> Result<bool> {
        bail!("no GPU adapter")
    }
    pub fn chunk_sum_squares(&self) -> Result<Vec<f32>> {
        bail!("no GPU adapter")
    }
    pub fn scale_in_place(&self, c: f32) -> Result<()> {
        bail!("no GPU adapter")
    }
    pub fn adamw_step(&self, g: &Self, m: &Self, v: &Self, c: &AdamWConsts) -> Result<()> {
        bail!("no GPU adapter")
    }
    pub fn sgd_step(
        &self,
        g: &Self,
        buf: Option<&Self>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) -> Result<()> {
        bail!("no GPU adapter")
    }
}
