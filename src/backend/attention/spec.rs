//! The spec of attention: its contract, the composition ([`batched`]) of the
//! spec's own products and softmax.

#![forbid(unsafe_code)]

use super::{batched, Arg, Attention, AttentionOps};
use crate::backend::spec::SpecStorage;
use crate::Result;

impl AttentionOps for SpecStorage {
    fn attention(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>) -> Result<Self> {
        batched::forward(a, q, k, v)
    }
    fn attention_backward(a: &Attention, q: Arg<Self>, k: Arg<Self>, v: Arg<Self>, g: &Self) -> Result<[Self; 3]> {
        batched::backward(a, q, k, v, g)
    }
}
