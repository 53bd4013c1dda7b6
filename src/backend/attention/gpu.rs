//! The GPU's attention: the batched composition ([`batched`]) of its
//! products and softmax, all heads in each dispatch.

use super::{batched, Arg, Attention, AttentionOps};
use crate::backend::gpu::GpuStorage;
use crate::Result;

impl AttentionOps for GpuStorage {
    fn attention(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>) -> Result<Self> {
        batched::forward(a, q, k, v)
    }
    fn attention_backward(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>, g: &Self) -> Result<[Self; 3]> {
        batched::backward(a, q, k, v, g)
    }
}
