//! A small transformer block (causal attention + SwiGLU MLP + RMSNorm, with
//! dropout) trained for several AdamW steps under autocast bf16 with the loss
//! scaler: the CPU reference and the GPU must agree on every loss bit at every
//! step and on every bit of the final weights.

mod common;
use common::*;
use tinyllm::nn::{Dropout, Layer, Linear, Module, RmsNorm};
use tinyllm::ops::mse;
use tinyllm::optim::{AdamW, AdamWConfig};
use tinyllm::precision::{DynamicLossScaler, Precision};
use tinyllm::train_step_mixed;
use tinyllm::Generator;

struct Block {
    n1: RmsNorm,
    n2: RmsNorm,
    qkv: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    drop: Dropout,
    heads: usize,
}

impl Block {
    fn new(c: usize, heads: usize, gen: &Generator, dev: Device) -> Result<Block> {
        Ok(Block {
            n1: RmsNorm::new(c, 1e-5, dev)?,
            n2: RmsNorm::new(c, 1e-5, dev)?,
            qkv: Linear::new(c, 3 * c, false, gen, dev)?,
            o: Linear::new(c, c, false, gen, dev)?,
            gate: Linear::new(c, 2 * c, false, gen, dev)?,
            up: Linear::new(c, 2 * c, false, gen, dev)?,
            down: Linear::new(2 * c, c, false, gen, dev)?,
            drop: Dropout::new(0.1, gen)?,
            heads,
        })
    }
}

impl Module for Block {
    fn parameters(&self) -> Vec<Tensor> {
        [
            &self.n1 as &dyn Module,
            &self.n2,
            &self.qkv,
            &self.o,
            &self.gate,
            &self.up,
            &self.down,
        ]
        .iter()
        .flat_map(|m| m.parameters())
        .collect()
    }
}

impl Layer for Block {
    /// x: (b, t, c) -> (b, t, c)
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let (h, hd) = (self.heads, c / self.heads);
        let qkv = self.qkv.forward(&self.n1.forward(x)?)?; // (b, t, 3c)
        let split = |i: usize| -> Result<Tensor> {
            // (b, t, c) -> (b, h, t, hd)
            qkv.narrow(2, i * c, c)?
                .reshape(&[b, t, h, hd])?
                .permute(&[0, 2, 1, 3])
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let scores = q
            .matmul(&k.transpose(-1, -2)?)?
            .mul_scalar(1.0 / (hd as f64).sqrt())?;
        let p = self.drop.forward(&scores.causal_mask()?.softmax()?)?;
        let att = p.matmul(&v)?.permute(&[0, 2, 1, 3])?.reshape(&[b, t, c])?;
        let x = x.add(&self.o.forward(&att)?)?;
        let hn = self.n2.forward(&x)?;
        let mlp = self.down.forward(
            &self
                .gate
                .forward(&hn)?
                .silu()?
                .mul(&self.up.forward(&hn)?)?,
        )?;
        x.add(&mlp)
    }
}

/// Per-step loss bits and final weight bits of a short bf16 run.
fn run(dev: Device) -> Result<(Vec<u32>, Vec<Vec<u32>>)> {
    let gen = Generator::new(11);
    let block = Block::new(16, 2, &gen, dev)?;
    let mut opt = AdamW::new(block.parameters(), AdamWConfig::new(3e-3))?;
    let mut scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 3)?;
    let x = Tensor::from_vec(randv(2 * 6 * 16, 5, 1.0), &[2, 6, 16], dev)?;
    let y = Tensor::from_vec(randv(2 * 6 * 16, 6, 0.5), &[2, 6, 16], dev)?;
    let micro = vec![
        (x.narrow(0, 0, 1)?, y.narrow(0, 0, 1)?),
        (x.narrow(0, 1, 1)?, y.narrow(0, 1, 1)?),
    ];
    let mut losses = Vec::new();
    for _ in 0..5 {
        let r = train_step_mixed(
            &block,
            &micro,
            |(x, y)| mse(&block.forward(x)?, y),
            &mut opt,
            Precision::Bf16,
            Some(&mut scaler),
            Some(1.0),
        )?;
        assert!(!r.skipped);
        losses.push(r.loss.to_bits());
    }
    let weights = block
        .parameters()
        .iter()
        .map(|p| bits(&p.to_vec_f32().unwrap()))
        .collect();
    Ok((losses, weights))
}

#[test]
fn transformer_block_trains_to_the_same_bits_on_cpu_and_gpu() {
    let (cpu_losses, cpu_w) = run(Device::Cpu).unwrap();
    // The run learns (a sanity check that the comparison is not vacuous).
    let l: Vec<f32> = cpu_losses.iter().map(|&b| f32::from_bits(b)).collect();
    assert!(l[4] < l[0], "{l:?}");
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let (gpu_losses, gpu_w) = run(Device::Gpu).unwrap();
    assert_eq!(cpu_losses, gpu_losses, "loss bits at every step");
    for (i, (c, g)) in cpu_w.iter().zip(&gpu_w).enumerate() {
        assert_eq!(c, g, "parameter {i}");
    }
}
