use tinyllm::train::config::{DeviceChoice, TrainConfig, TrainOptions};
use tinyllm::train::data::Corpus;
use tinyllm::train::Trainer;
use tinyllm::Device;

fn main() {
    let mut cfg = TrainConfig::resolve(&TrainOptions {
        preset: Some("capstone".into()),
        device: Some(DeviceChoice::Gpu),
        precision: Some(tinyllm::precision::Precision::Bf16),
        micro_batch: Some(2),
        accum: Some(4),
        checkpoint_activations: Some(true),
        steps: Some(4),
        ..Default::default()
    })
    .unwrap();
    let m = &mut cfg.model;
    (m.d_model, m.hidden, m.context) = (m.n_heads * 4, 24, 64);
    let mut t = Trainer::new(cfg, Device::Gpu, &Corpus::embedded()).unwrap();
    t.train_step().unwrap();
    tinyllm::profile::start();
    {
        let _g = tinyllm::profile::unpause();
        t.train_step().unwrap();
    }
    let p = tinyllm::profile::take().unwrap();
    let mut rows: Vec<_> = p.rows.iter().filter(|r| r.dispatches > 0).collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.dispatches));
    let total: u64 = rows.iter().map(|r| r.dispatches).sum();
    for r in rows {
        println!("{:>5} {:>5} {}", r.dispatches, r.calls, r.name);
    }
    println!("total {total} {:?}", p.gpu);
}
