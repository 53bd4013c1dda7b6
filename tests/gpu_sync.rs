//! How often a training step waits for the GPU. Alone in its own test binary:
//! the GPU work counters are process-wide, so no other test may run beside it.

use tinyllm::gpu::GpuCounters;
use tinyllm::nn::{Layer, Linear};
use tinyllm::ops::mse;
use tinyllm::{grad_accumulate, Device, Generator, Tensor};

/// Accumulating k micro-batches reads their losses back once, not k times
/// (each readback is a full GPU sync), and the loss is their weighted sum.
#[test]
fn grad_accumulate_reads_the_losses_back_once() {
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let dev = Device::Gpu;
    let gen = Generator::new(0);
    let model = Linear::new(4, 1, true, &gen, dev).unwrap();
    let x = Tensor::randn(&[16, 4], 1.0, &gen, dev).unwrap();
    let y = x.sum(-1, true).unwrap();
    let micro: Vec<(Tensor, Tensor)> = [(0, 3), (3, 5), (8, 8)]
        .iter()
        .map(|&(at, len)| (x.narrow(0, at, len).unwrap(), y.narrow(0, at, len).unwrap()))
        .collect();
    let loss_fn = |(x, y): &(Tensor, Tensor)| mse(&model.forward(x)?, y);
    let expected: f64 = micro
        .iter()
        .map(|b| b.0.shape()[0] as f64 / 16.0 * loss_fn(b).unwrap().item().unwrap())
        .sum();
    let before = GpuCounters::now();
    let loss = grad_accumulate(&model, &micro, loss_fn, None).unwrap();
    let work = GpuCounters::now().since(before);
    assert_eq!(work.readbacks, 1, "{work:?}");
    assert!(work.dispatches > 0, "{work:?}");
    assert_eq!(loss, expected as f32);
}
