//! Kernel benchmarks (criterion), each case with its baseline measured in the
//! same run, then a summary table of ratios.
//!
//! ```text
//! cargo bench --bench kernels                      # default set, a few minutes on lavapipe
//! TINYLLM_BENCH_FULL=1 cargo bench --bench kernels # + 1024³ and the capstone's full-batch shapes
//! cargo bench --bench kernels -- cpu_mm            # a criterion filter (summary shows what ran)
//! ```
//!
//! Groups (the id after the group is `what`):
//! * `cpu_mm_<case>`: `ndarray_dot` (matrixmultiply sgemm, f32, 1 thread — the
//!   baseline), ours (`Storage::matmul` on the CPU) in f32/bf16/fp16 on 1 thread
//!   (`t1`) and bf16 on all cores (`tall`);
//! * `gpu_mm_<case>`: the GPU kernel in f32/bf16/fp16 (`record; sync`); f32 runs
//!   on the small squares only unless full (the integer fma emulation is slow);
//! * `gpu_bw_<n>m` / `cpu_bw_<n>m`: device buffer copy (the baseline), in-place scale (the
//!   simplest kernel with the same traffic: the ceiling of the next), fused finite check +
//!   unscale, fused AdamW, as bytes/s;
//! * `train_step_<preset>_<device>`: one full optimizer step (forward, backward,
//!   AdamW) as tokens/s: float32 with the whole batch at once (the baseline) vs
//!   bf16 + micro-batches + accumulation + activation recompute. The `small`
//!   preset on the CPU; on the GPU the `tiny` preset unless full (lavapipe is slow).
//!
//! The summary reads criterion's medians back from
//! `target/criterion/<group>/<id>/new/estimates.json`, then measures the CPU
//! matmul ratios once more as *paired* ratios (ours and ndarray called
//! alternately, median of the per-pair ratios), which drifting load on a shared
//! machine cannot bias, and the GPU kernel's autocast time over its f32 time the
//! same way (for the cases whose f32 ran). On a device whose `fma` is emulated
//! (`fma: soft`) that f32 is the emulation; `TINYLLM_GPU_FMA=native` times the
//! device's own `fma` instead (timing only: its bits are not the contract's
//! there) — the comparison a fused-fma GPU makes.

use criterion::{BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tinyllm::backend::{gpu, Storage};
use tinyllm::bench::{adamw_consts, bandwidth_elems, matmul_cases, ndarray_dot, MatmulCase};
use tinyllm::set_cpu_threads;
use tinyllm::train::config::{TrainConfig, TrainOptions};
use tinyllm::train::data::Corpus;
use tinyllm::train::trainer::Trainer;
use tinyllm::{Device, Format};

fn out_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => PathBuf::from(t).join("criterion"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target/criterion"),
    }
}

fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect::<String>()
        .split('_')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("_")
}

fn prec(f: Option<Format>) -> &'static str {
    match f {
        None => "f32",
        Some(Format::Bf16) => "bf16",
        Some(Format::Fp16) => "fp16",
    }
}

fn gpu_of(s: &Storage) -> &gpu::GpuStorage {
    match s {
        Storage::Gpu(g) => g,
        _ => unreachable!(),
    }
}

/// When this run started: results older than it are an earlier run's.
static STARTED: std::sync::OnceLock<std::time::SystemTime> = std::sync::OnceLock::new();

/// Criterion's median for `group/id` in seconds, if that benchmark ran in
/// this run (criterion keeps earlier runs' files; a filtered run must not
/// report them as its own).
fn median_s(group: &str, id: &str) -> Option<f64> {
    let p = out_dir().join(group).join(id).join("new/estimates.json");
    let written = std::fs::metadata(&p).ok()?.modified().ok()?;
    if written < *STARTED.get()? {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    Some(v["median"]["point_estimate"].as_f64()? * 1e-9)
}

fn cpu_matmul_group(c: &mut Criterion, case: &MatmulCase) {
    let (a, b) = case.operands();
    let ac = Storage::from_f32(a.clone(), Device::Cpu).unwrap();
    let bc = Storage::from_f32(b.clone(), Device::Cpu).unwrap();
    let mut g = c.benchmark_group(format!("cpu_mm_{}", slug(&case.name)));
    g.throughput(Throughput::Elements(case.flops() as u64)); // "elem/s" = FLOP/s
    g.bench_function("ndarray_dot", |bn| {
        bn.iter(|| black_box(ndarray_dot(case, &a, &b)))
    });
    for (f, threads) in [
        (None, Some(1)),
        (Some(Format::Bf16), Some(1)),
        (Some(Format::Fp16), Some(1)),
        (Some(Format::Bf16), None),
    ] {
        let id = format!(
            "ours_{}_{}",
            prec(f),
            if threads.is_some() { "t1" } else { "tall" }
        );
        g.bench_function(&id, |bn| {
            set_cpu_threads(threads);
            bn.iter(|| black_box(ac.matmul(&bc, case.dims, f).unwrap()));
            set_cpu_threads(None);
        });
    }
    g.finish();
}

/// Paired ratios `ndarray time / our time` (one thread each), for f32, bf16
/// and fp16: the two are called alternately and each pair's ratio is taken,
/// then the median over the pairs. Criterion measures one function after the
/// other, so load that drifts between them (a shared machine) moves its
/// ratios; within a pair both calls see the same load.
/// The median over alternating pairs of `time(b) / time(a)`: load that drifts
/// on a shared machine moves sequential measurements, not a pair. About 1.5 s
/// of pairs, at least 15.
fn paired(a: &mut dyn FnMut(), b: &mut dyn FnMut()) -> f64 {
    let time = |f: &mut dyn FnMut()| {
        let t = std::time::Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    a();
    b();
    let one = time(a) + time(b);
    let pairs = ((1.5 / one) as usize).clamp(15, 401);
    let mut r: Vec<f64> = (0..pairs)
        .map(|i| {
            // alternate which goes first
            let (ta, tb) = if i % 2 == 0 {
                let ta = time(a);
                (ta, time(b))
            } else {
                let tb = time(b);
                (time(a), tb)
            };
            tb / ta
        })
        .collect();
    r.sort_by(|x, y| x.total_cmp(y));
    r[r.len() / 2]
}

/// ndarray's time over ours, paired, one thread each, per precision.
fn paired_ratios(case: &MatmulCase) -> [f64; 3] {
    let (a, b) = case.operands();
    let ac = Storage::from_f32(a.clone(), Device::Cpu).unwrap();
    let bc = Storage::from_f32(b.clone(), Device::Cpu).unwrap();
    set_cpu_threads(Some(1));
    let out = [None, Some(Format::Bf16), Some(Format::Fp16)].map(|fmt| {
        let mut ours = || drop(black_box(ac.matmul(&bc, case.dims, fmt).unwrap()));
        let mut dot = || drop(black_box(ndarray_dot(case, &a, &b)));
        paired(&mut ours, &mut dot)
    });
    set_cpu_threads(None);
    out
}

/// The GPU kernel's time under bf16 and fp16 autocast over its f32 time,
/// paired: what autocast costs on this adapter.
fn gpu_autocast_cost(case: &MatmulCase) -> [f64; 2] {
    let (a, b) = case.operands();
    let ag = Storage::from_f32(a, Device::Gpu).unwrap();
    let bg = Storage::from_f32(b, Device::Gpu).unwrap();
    let run = |f: Option<Format>| {
        drop(black_box(ag.matmul(&bg, case.dims, f).unwrap()));
        gpu::sync().unwrap();
    };
    [Format::Bf16, Format::Fp16].map(|f| paired(&mut || run(None), &mut || run(Some(f))))
}

fn gpu_matmul_group(c: &mut Criterion, case: &MatmulCase, full: bool) {
    let (a, b) = case.operands();
    let ag = Storage::from_f32(a, Device::Gpu).unwrap();
    let bg = Storage::from_f32(b, Device::Gpu).unwrap();
    let mut g = c.benchmark_group(format!("gpu_mm_{}", slug(&case.name)));
    g.throughput(Throughput::Elements(case.flops() as u64));
    let slow_f32 = gpu::fma_mode().unwrap() == "soft";
    let small = case.flops() <= 2.0 * 512f64.powi(3);
    for f in [None, Some(Format::Bf16), Some(Format::Fp16)] {
        if f.is_none() && slow_f32 && !small && !full {
            continue;
        }
        g.bench_function(BenchmarkId::from_parameter(prec(f)), |bn| {
            bn.iter(|| {
                let out = ag.matmul(&bg, case.dims, f).unwrap();
                gpu::sync().unwrap();
                out
            })
        });
    }
    g.finish();
}

fn bandwidth_groups(c: &mut Criterion, n: usize, have_gpu: bool) {
    let k = adamw_consts();
    for dev in [Device::Gpu, Device::Cpu] {
        if dev == Device::Gpu && !have_gpu {
            continue;
        }
        // the size is in the name so a summary never mixes runs of different sizes
        let name = format!(
            "{}_bw_{}m",
            if dev == Device::Gpu { "gpu" } else { "cpu" },
            n >> 20
        );
        let sync = || {
            if dev == Device::Gpu {
                gpu::sync().unwrap()
            }
        };
        let grad: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
        let src = Storage::from_f32(grad.clone(), dev).unwrap();
        let dst = Storage::from_f32(vec![0.0; n], dev).unwrap();
        let p = Storage::from_f32(vec![0.5; n], dev).unwrap();
        let m = Storage::from_f32(vec![0.0; n], dev).unwrap();
        let v = Storage::from_f32(vec![0.0; n], dev).unwrap();
        let mut g = c.benchmark_group(&name);
        g.throughput(Throughput::Bytes(8 * n as u64));
        match dev {
            Device::Gpu => g.bench_function("copy", |bn| {
                bn.iter(|| {
                    gpu::buffer_copy(gpu_of(&src), gpu_of(&dst)).unwrap();
                    sync()
                })
            }),
            Device::Cpu | Device::Spec => {
                let mut d = vec![0.0f32; n];
                g.bench_function("copy", |bn| {
                    bn.iter(|| {
                        d.copy_from_slice(&grad);
                        black_box(&d);
                    })
                })
            }
        };
        g.bench_function("finite_unscale", |bn| {
            bn.iter(|| Storage::finite_check_unscale(&[&src], 1.0).unwrap())
        });
        // The same traffic as the finite check through the simplest kernel
        // there is (x *= c in place): what an in-place pass costs on this
        // device before any checking — the ceiling the finite check can reach.
        g.bench_function("scale", |bn| {
            bn.iter(|| {
                src.scale_in_place(1.0).unwrap();
                sync()
            })
        });
        g.throughput(Throughput::Bytes(28 * n as u64));
        g.bench_function("adamw", |bn| {
            bn.iter(|| {
                p.adamw_step(&src, &m, &v, &k).unwrap();
                sync()
            })
        });
        g.finish();
    }
}

/// The two recipes MS-L11 compares, as trainer options: the same batch of
/// sequences, once whole in float32, once as the `train` default (bf16,
/// micro-batches with accumulation, activation recompute).
fn recipes(preset: &str, dev: Device) -> [(&'static str, TrainOptions); 2] {
    let mixed = TrainOptions {
        preset: Some(preset.into()),
        device: Some(if dev == Device::Gpu {
            tinyllm::train::DeviceChoice::Gpu
        } else {
            tinyllm::train::DeviceChoice::Cpu
        }),
        ..Default::default()
    };
    let batch = TrainConfig::resolve(&mixed).unwrap().batch;
    let fp32 = TrainOptions {
        precision: Some(tinyllm::precision::Precision::Fp32),
        batch: Some(batch),
        micro_batch: Some(batch),
        checkpoint_activations: Some(false),
        ..mixed.clone()
    };
    [("fp32_full_batch", fp32), ("bf16_accum_ckpt", mixed)]
}

fn train_step_group(c: &mut Criterion, preset: &str, dev: Device) {
    let name = format!(
        "train_step_{preset}_{}",
        if dev == Device::Gpu { "gpu" } else { "cpu" }
    );
    let mut g = c.benchmark_group(&name);
    for (id, opts) in recipes(preset, dev) {
        let cfg = TrainConfig::resolve(&opts).unwrap();
        let tokens = cfg.batch * cfg.model.context;
        let mut tr = Trainer::new(cfg, dev, &Corpus::embedded()).unwrap();
        g.throughput(Throughput::Elements(tokens as u64));
        let mut ran = false;
        g.bench_function(id, |bn| {
            ran = true;
            bn.iter(|| tr.train_step().unwrap())
        });
        if !ran || dev == Device::Gpu {
            continue; // filtered out; or a GPU profile: the host's recording, not the kernels
        }
        // Then the profile behind "share of the step outside matmul": a few
        // more steps with every primitive timed (tinyllm::profile).
        tinyllm::profile::start();
        for _ in 0..PROFILED_STEPS {
            let _on = tinyllm::profile::unpause();
            tr.train_step().unwrap();
        }
        let p = tinyllm::profile::take().unwrap();
        let share = 1.0 - p.matmul().as_secs_f64() / p.wall.unwrap().as_secs_f64();
        PROFILES.lock().unwrap().push((name.clone(), id, share, p));
    }
    g.finish();
}

/// Steps timed primitive by primitive after each CPU train-step benchmark.
const PROFILED_STEPS: usize = 8;

/// (group, recipe, non-matmul share of the step, profile) of the train-step groups.
#[allow(clippy::type_complexity)]
static PROFILES: std::sync::Mutex<Vec<(String, &'static str, f64, tinyllm::profile::Profile)>> =
    std::sync::Mutex::new(Vec::new());

fn train_step_summary(steps: &[(&str, Device)]) {
    println!(
        "\n{:<24} {:<18} {:>10} {:>10}  {:>14}",
        "train step", "recipe", "ms", "tokens/s", "vs fp32 batch"
    );
    for &(preset, dev) in steps {
        let grp = format!(
            "train_step_{preset}_{}",
            if dev == Device::Gpu { "gpu" } else { "cpu" }
        );
        let mut base = None;
        for (id, opts) in recipes(preset, dev) {
            let cfg = TrainConfig::resolve(&opts).unwrap();
            let tokens = (cfg.batch * cfg.model.context) as f64;
            if let Some(s) = median_s(&grp, id) {
                let tps = tokens / s;
                let base_tps = *base.get_or_insert(tps);
                println!(
                    "{grp:<24} {id:<18} {:>10.1} {:>10.0}  {:>13.2}x",
                    s * 1e3,
                    tps,
                    tps / base_tps
                );
            }
        }
    }
    for (grp, id, share, p) in PROFILES.lock().unwrap().iter() {
        println!(
            "\nprofile of {PROFILED_STEPS} steps, {grp} {id}: outside matmul {:.1}% of the step\n{p}",
            100.0 * share
        );
    }
}

/// Paired ratios for the cases whose CPU matmul group ran (a filter may
/// have left some or all out).
/// A table of paired ratios, one row per case whose criterion `group/id` ran
/// in this run: `row(case)` gives one ratio per column.
fn paired_table(
    cases: &[MatmulCase],
    (group, id): (&str, &str),
    cols: &[&str],
    note: &str,
    row: impl Fn(&MatmulCase) -> Vec<f64>,
) {
    let ran: Vec<&MatmulCase> = cases
        .iter()
        .filter(|k| median_s(&format!("{group}_{}", slug(&k.name)), id).is_some())
        .collect();
    if ran.is_empty() {
        return;
    }
    let head: String = cols.iter().map(|c| format!(" {c:>10}")).collect();
    println!("\n{:<30}{head}   ({note})", "case");
    for case in ran {
        let cells: String = row(case).iter().map(|r| format!(" {r:>9.3}x")).collect();
        println!("{:<30}{cells}", case.name);
    }
}

fn paired_summary(cases: &[MatmulCase]) {
    paired_table(
        cases,
        ("cpu_mm", "ndarray_dot"),
        &["f32", "bf16", "fp16"],
        "paired: ndarray time / ours, median over alternating pairs, 1 thread",
        |case| paired_ratios(case).to_vec(),
    );
}

fn gpu_paired_summary(cases: &[MatmulCase]) {
    let note = format!(
        "paired: GPU autocast time / f32 time, fma {}",
        gpu::fma_mode().unwrap_or("?")
    );
    paired_table(cases, ("gpu_mm", "f32"), &["bf16", "fp16"], &note, |case| {
        gpu_autocast_cost(case).to_vec()
    });
}

fn summary(cases: &[MatmulCase], n: usize) {
    println!("\n==== summary (criterion medians of this run; ratios are within the run) ====");
    if let Ok(a) = gpu::adapter_name() {
        println!("adapter: {a}, fma: {}", gpu::fma_mode().unwrap_or("?"));
    }
    println!(
        "{:<30} {:<16} {:>10} {:>9}  {:>10}",
        "case", "what", "ms", "GFLOP/s", "vs dot"
    );
    for case in cases {
        let cg = format!("cpu_mm_{}", slug(&case.name));
        let gg = format!("gpu_mm_{}", slug(&case.name));
        let base = median_s(&cg, "ndarray_dot");
        let mut ids: Vec<(String, String)> = [
            "ndarray_dot",
            "ours_f32_t1",
            "ours_bf16_t1",
            "ours_fp16_t1",
            "ours_bf16_tall",
        ]
        .iter()
        .map(|i| (cg.clone(), i.to_string()))
        .collect();
        ids.extend(
            ["f32", "bf16", "fp16"]
                .iter()
                .map(|i| (gg.clone(), i.to_string())),
        );
        for (grp, id) in ids {
            if let Some(s) = median_s(&grp, &id) {
                let what = if grp.starts_with("gpu") {
                    format!("gpu_{id}")
                } else {
                    id
                };
                let ratio = base.map_or("-".into(), |b| format!("{:.2}x", b / s));
                println!(
                    "{:<30} {:<16} {:>10.2} {:>9.2}  {:>10}",
                    case.name,
                    what,
                    s * 1e3,
                    case.flops() / s / 1e9,
                    ratio
                );
            }
        }
    }
    println!(
        "\n{:<8} {:<16} {:>10} {:>9}  {:>10}",
        "device", "kernel", "ms", "GB/s", "vs copy"
    );
    for grp in ["gpu", "cpu"].map(|d| format!("{d}_bw_{}m", n >> 20)) {
        let grp = grp.as_str();
        let base = median_s(grp, "copy").map(|s| 8.0 * n as f64 / s);
        for (id, bytes) in [
            ("copy", 8.0),
            ("scale", 8.0),
            ("finite_unscale", 8.0),
            ("adamw", 28.0),
        ] {
            if let Some(s) = median_s(grp, id) {
                let bw = bytes * n as f64 / s;
                println!(
                    "{:<8} {:<16} {:>10.3} {:>9.2}  {:>10}",
                    &grp[..3],
                    id,
                    s * 1e3,
                    bw / 1e9,
                    base.map_or("-".into(), |b| format!("{:.2}x", bw / b))
                );
            }
        }
    }
}

fn main() {
    STARTED.set(std::time::SystemTime::now()).unwrap();
    // As the tinyllm binary does: freed buffers stay with the process.
    let _ = tinyllm::memory::keep_freed_host_memory();
    let full = std::env::var("TINYLLM_BENCH_FULL").is_ok_and(|v| v == "1");
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(if full { 5 } else { 2 }))
        .output_directory(&out_dir())
        .configure_from_args();
    let cases = matmul_cases(full);
    let have_gpu = gpu::adapter_name().is_ok();
    if !have_gpu {
        eprintln!("no GPU adapter: GPU groups skipped");
    }
    for case in &cases {
        cpu_matmul_group(&mut c, case);
        if have_gpu {
            gpu_matmul_group(&mut c, case, full);
        }
    }
    let n = bandwidth_elems(full);
    bandwidth_groups(&mut c, n, have_gpu);
    let mut steps = vec![("small", Device::Cpu)];
    if have_gpu {
        steps.push((if full { "small" } else { "tiny" }, Device::Gpu));
    }
    for &(preset, dev) in &steps {
        train_step_group(&mut c, preset, dev);
    }
    c.final_summary();
    summary(&cases, n);
    paired_summary(&cases);
    if have_gpu {
        gpu_paired_summary(&cases);
    }
    train_step_summary(&steps);
}
