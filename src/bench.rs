//! Kernel benchmarks: the GPU matmul (f32 and under bf16/fp16 rounding) and the
//! fused optimizer kernels (finite check + unscale, AdamW), each with the
//! baseline it is judged against, measured in the same run:
//!
//! * a matmul against the CPU baseline (ndarray's `dot`, i.e. matrixmultiply's
//!   sgemm, single-threaded, f32, same shape and layout) — `ratio` is GFLOP/s
//!   over the baseline's GFLOP/s;
//! * a bandwidth kernel against the device's own buffer copy
//!   (`copy_buffer_to_buffer`) — `ratio` is GB/s over the copy's GB/s;
//! * attention (forward and backward, bf16) against the batched composition
//!   of the matmul and softmax kernels it stands for, on the same device —
//!   `ratio` is the composition's time over the kernels';
//! * every row also gives `vs_copy`: its bytes moved (inputs read once, output
//!   written once) per second over the copy's, a roofline hint.
//!
//! Timing is wall clock around `record; gpu::sync()`, so each figure includes
//! one submit and one wait (small for the shapes here). Used by `tinyllm bench`
//! ([`run_gpu`]) and by `benches/kernels.rs` (the same cases, via criterion).

use crate::backend::{gpu, AdamWConsts, MatmulDims, Storage};
use crate::{Device, Format, Result};
use serde::Serialize;
use std::time::Instant;

/// What to run and for how long.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Large shapes too (1024³, the capstone's full-batch products); the
    /// default set keeps a run on a software adapter (lavapipe) to about a
    /// minute. Default: `TINYLLM_BENCH_FULL=1` in the environment.
    pub full: bool,
    /// Measure each case for at least this long (after one warm-up call).
    pub min_time_s: f64,
    /// Also time f32 matmuls (slow where the device's fma is not fused and the
    /// integer emulation runs).
    pub f32_matmul: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            full: std::env::var("TINYLLM_BENCH_FULL").is_ok_and(|v| v == "1"),
            min_time_s: 0.5,
            f32_matmul: true,
        }
    }
}

/// One measured case.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    /// e.g. `matmul 512x512x512` or `adamw 4M`
    pub case: String,
    /// `f32`, `bf16`, `fp16`
    pub precision: String,
    /// Seconds per call (median).
    pub seconds: f64,
    /// Arithmetic rate (matmuls only: 2·batch·m·n·k per call).
    pub gflops: Option<f64>,
    /// Bytes moved per second: every input read once, every output written once.
    pub gbps: f64,
    /// What `ratio` compares with.
    pub baseline: String,
    /// The baseline's figure (GFLOP/s for matmuls, GB/s for bandwidth kernels).
    pub baseline_value: f64,
    /// This row's figure over the baseline's (higher is better).
    pub ratio: f64,
    /// `gbps` over the device buffer copy's GB/s.
    pub vs_copy: f64,
}

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Adapter name and API, e.g. `llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan)`.
    pub adapter: String,
    /// `native` (the device's fma is exactly fused) or `soft` (integer emulation).
    pub fma: String,
    /// The device buffer copy, GB/s (read + write counted).
    pub copy_gbps: f64,
    /// The measured cases: the buffer copy, the matmuls, then the optimizer kernels.
    pub rows: Vec<BenchRow>,
}

impl BenchReport {
    /// A plain-text table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "adapter: {}\nfma: {}    device buffer copy: {:.2} GB/s\n",
            self.adapter, self.fma, self.copy_gbps
        );
        s += &format!(
            "{:<34} {:<5} {:>10} {:>9} {:>9}  {:<34} {:>9} {:>7}\n",
            "case", "prec", "ms/call", "GFLOP/s", "GB/s", "baseline", "ratio", "vs copy"
        );
        for r in &self.rows {
            s += &format!(
                "{:<34} {:<5} {:>10.3} {:>9} {:>9.2}  {:<34} {:>8.2}x {:>7.3}\n",
                r.case,
                r.precision,
                r.seconds * 1e3,
                r.gflops.map_or("-".to_string(), |g| format!("{g:.2}")),
                r.gbps,
                format!("{} ({:.2})", r.baseline, r.baseline_value),
                r.ratio,
                r.vs_copy
            );
        }
        s
    }

    /// The report as pretty-printed JSON (the fields above, `rows` as an array).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report serialises")
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.table())
    }
}

/// A matmul shape to benchmark.
#[derive(Clone, Debug)]
pub struct MatmulCase {
    /// A label such as `square 512` or `mlp dW 320x512x904 tA`.
    pub name: String,
    /// The product's batch, `m`, `k`, `n`, transposes and batch strides.
    pub dims: MatmulDims,
}

impl MatmulCase {
    fn new(name: &str, batch: usize, m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Self {
        MatmulCase {
            name: name.to_string(),
            dims: MatmulDims {
                batch,
                m,
                k,
                n,
                trans_a: ta,
                trans_b: tb,
                a_batch_stride: m * k,
                b_batch_stride: k * n,
                causal: Default::default(),
                tokens: Default::default(),
            },
        }
    }
    /// Floating-point operations per call: `2·batch·m·k·n`.
    pub fn flops(&self) -> f64 {
        let d = &self.dims;
        2.0 * (d.batch * d.m * d.n * d.k) as f64
    }
    /// Bytes moved per call: both operands read once and the output written
    /// once, 4 bytes an element.
    pub fn bytes(&self) -> f64 {
        let d = &self.dims;
        4.0 * (d.batch * (d.m * d.k + d.k * d.n + d.m * d.n)) as f64
    }
    /// Deterministic operands in [-0.5, 0.5).
    pub fn operands(&self) -> (Vec<f32>, Vec<f32>) {
        let d = &self.dims;
        let fill = |len: usize, mul: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i.wrapping_mul(mul)) % 1021) as f32 / 1021.0 - 0.5)
                .collect()
        };
        (
            fill(d.batch * d.m * d.k, 7919),
            fill(d.batch * d.k * d.n, 104_729),
        )
    }
}

/// The capstone model's shapes as `(C, heads, hidden, context)`:
/// `LlamaConfig::preset("capstone")`'s C = 320, 5 heads of 64, MLP hidden 904,
/// context 512.
pub const CAPSTONE: (usize, usize, usize, usize) = (320, 5, 904, 512);

/// The benchmark's matmul shapes. `full` adds 1024³ and the capstone products
/// at 8 sequences x 512 tokens; the default uses one sequence.
pub fn matmul_cases(full: bool) -> Vec<MatmulCase> {
    let (c, heads, hidden, t) = CAPSTONE;
    let hd = c / heads;
    let seqs = if full { 8 } else { 1 };
    let tok = seqs * t;
    let mut v = vec![
        MatmulCase::new("square 256", 1, 256, 256, 256, false, false),
        MatmulCase::new("square 512", 1, 512, 512, 512, false, false),
    ];
    if full {
        v.push(MatmulCase::new(
            "square 1024",
            1,
            1024,
            1024,
            1024,
            false,
            false,
        ));
    }
    v.extend([
        // x @ W_up: (tokens, C) @ (C, hidden)
        MatmulCase::new(
            &format!("mlp up {tok}x{c}x{hidden}"),
            1,
            tok,
            c,
            hidden,
            false,
            false,
        ),
        // dW_up = x^T @ dy: (C, tokens) @ (tokens, hidden), k = tokens
        MatmulCase::new(
            &format!("mlp dW {c}x{tok}x{hidden} tA"),
            1,
            c,
            tok,
            hidden,
            true,
            false,
        ),
        // scores q @ k^T per (sequence, head): (T, hd) @ (hd, T)
        MatmulCase::new(
            &format!("attn qk^T {}x({t}x{hd}x{t}) tB", seqs * heads),
            seqs * heads,
            t,
            hd,
            t,
            false,
            true,
        ),
        // p @ v: (T, T) @ (T, hd)
        MatmulCase::new(
            &format!("attn pv {}x({t}x{t}x{hd})", seqs * heads),
            seqs * heads,
            t,
            t,
            hd,
            false,
            false,
        ),
    ]);
    v
}

/// Median seconds per call of `f` (which must finish its work, e.g. end with
/// `gpu::sync()`): one warm-up call, then calls until `min_time_s` has passed
/// (at least 3, at most 1000).
pub fn time_median(min_time_s: f64, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 3 || (start.elapsed().as_secs_f64() < min_time_s && times.len() < 1000) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// ndarray's `dot` (matrixmultiply sgemm, one thread, f32) on the case's
/// shape and layouts: the CPU baseline. Returns the product, batch by batch.
pub fn ndarray_dot(case: &MatmulCase, a: &[f32], b: &[f32]) -> Vec<ndarray::Array2<f32>> {
    use ndarray::ArrayView2;
    let d = &case.dims;
    (0..d.batch)
        .map(|bi| {
            let ab = &a[bi * d.a_batch_stride..][..d.m * d.k];
            let bb = &b[bi * d.b_batch_stride..][..d.k * d.n];
            let av = if d.trans_a {
                ArrayView2::from_shape((d.k, d.m), ab)
                    .unwrap()
                    .reversed_axes()
            } else {
                ArrayView2::from_shape((d.m, d.k), ab).unwrap()
            };
            let bv = if d.trans_b {
                ArrayView2::from_shape((d.n, d.k), bb)
                    .unwrap()
                    .reversed_axes()
            } else {
                ArrayView2::from_shape((d.k, d.n), bb).unwrap()
            };
            av.dot(&bv)
        })
        .collect()
}

fn prec_name(f: Option<Format>) -> &'static str {
    match f {
        None => "f32",
        Some(Format::Bf16) => "bf16",
        Some(Format::Fp16) => "fp16",
    }
}

fn gpu_buf(s: &Storage) -> &gpu::GpuStorage {
    match s {
        Storage::Gpu(g) => g,
        _ => unreachable!("a GPU storage"),
    }
}

/// Elements of each buffer in the bandwidth cases: 4M (16 MiB of f32), or
/// 16M (64 MiB) with `full`.
pub fn bandwidth_elems(full: bool) -> usize {
    if full {
        16 << 20
    } else {
        4 << 20
    }
}

/// AdamW constants of a typical step (lr 3e-4, wd 0.1, betas 0.9/0.95, step 10).
pub fn adamw_consts() -> AdamWConsts {
    let (lr, wd, b1, b2, t) = (3e-4f64, 0.1f64, 0.9f64, 0.95f64, 10i32);
    AdamWConsts {
        decay: (1.0 - lr * wd) as f32,
        beta1: b1 as f32,
        omb1: (1.0 - b1) as f32,
        beta2: b2 as f32,
        omb2: (1.0 - b2) as f32,
        step_size: (lr / (1.0 - b1.powi(t))) as f32,
        bc2_sqrt: (1.0 - b2.powi(t)).sqrt() as f32,
        eps: 1e-8,
        grad_scale: None,
    }
}

/// GB/s of a device buffer copy of `n` f32s (read + write counted).
pub fn gpu_copy_gbps(n: usize, min_time_s: f64) -> Result<f64> {
    let src = Storage::from_f32(vec![1.0; n], Device::Gpu)?;
    let dst = Storage::from_f32(vec![0.0; n], Device::Gpu)?;
    let s = time_median(min_time_s, || {
        gpu::buffer_copy(gpu_buf(&src), gpu_buf(&dst))?;
        gpu::sync()
    })?;
    Ok(8.0 * n as f64 / s / 1e9)
}

/// Runs the GPU kernel benchmarks on the adapter the backend picks (or
/// `TINYLLM_ADAPTER`), with their baselines, and returns the report.
pub fn run_gpu(opts: &BenchOptions) -> Result<BenchReport> {
    let adapter = gpu::adapter_name()?;
    let fma = gpu::fma_mode()?.to_string();
    let nbw = bandwidth_elems(opts.full);
    let copy_gbps = gpu_copy_gbps(nbw, opts.min_time_s)?;
    let mut rows = Vec::new();
    rows.push(BenchRow {
        case: format!("buffer copy {}M", nbw >> 20),
        precision: "f32".into(),
        seconds: 8.0 * nbw as f64 / copy_gbps / 1e9,
        gflops: None,
        gbps: copy_gbps,
        baseline: "buffer copy".into(),
        baseline_value: copy_gbps,
        ratio: 1.0,
        vs_copy: 1.0,
    });

    for case in matmul_cases(opts.full) {
        let (a, b) = case.operands();
        let dot_s = time_median(opts.min_time_s, || {
            std::hint::black_box(ndarray_dot(&case, &a, &b));
            Ok(())
        })?;
        let dot_gflops = case.flops() / dot_s / 1e9;
        let ag = Storage::from_f32(a, Device::Gpu)?;
        let bg = Storage::from_f32(b, Device::Gpu)?;
        let mut fmts = vec![Some(Format::Bf16), Some(Format::Fp16)];
        // f32 through the integer fma emulation is slow: keep the
        // default run short by timing it on the small squares only.
        let small = case.flops() <= 2.0 * 512f64.powi(3);
        if opts.f32_matmul && (fma == "native" || opts.full || small) {
            fmts.insert(0, None);
        }
        for f in fmts {
            let s = time_median(opts.min_time_s, || {
                let c = ag.matmul(&bg, case.dims, f)?;
                gpu::sync()?;
                drop(c);
                Ok(())
            })?;
            let gflops = case.flops() / s / 1e9;
            let gbps = case.bytes() / s / 1e9;
            rows.push(BenchRow {
                case: format!("matmul {}", case.name),
                precision: prec_name(f).into(),
                seconds: s,
                gflops: Some(gflops),
                gbps,
                baseline: "ndarray dot f32 (CPU, 1 thread)".into(),
                baseline_value: dot_gflops,
                ratio: gflops / dot_gflops,
                vs_copy: gbps / copy_gbps,
            });
        }
    }

    rows.push(attention_row(opts, copy_gbps)?);

    // The loss scaler's fused finite check + unscale: reads and writes every
    // gradient element once (8 bytes), plus one 4-byte flag read back.
    let g = Storage::from_f32(
        (0..nbw).map(|i| (i % 1000) as f32 * 1e-3).collect(),
        Device::Gpu,
    )?;
    let s = time_median(opts.min_time_s, || {
        // 1.0: the values stay the same call after call
        Storage::finite_check_unscale(&[&g], 1.0).map(|_| ())
    })?;
    let gbps = 8.0 * nbw as f64 / s / 1e9;
    rows.push(bandwidth_row(
        format!("finite check + unscale {}M", nbw >> 20),
        s,
        gbps,
        copy_gbps,
    ));

    // AdamW: reads p, g, m, v and writes p, m, v (28 bytes per element).
    let p = Storage::from_f32(vec![0.5; nbw], Device::Gpu)?;
    let m = Storage::from_f32(vec![0.0; nbw], Device::Gpu)?;
    let v = Storage::from_f32(vec![0.0; nbw], Device::Gpu)?;
    let k = adamw_consts();
    let s = time_median(opts.min_time_s, || {
        p.adamw_step(&g, &m, &v, &k)?;
        gpu::sync()
    })?;
    let gbps = 28.0 * nbw as f64 / s / 1e9;
    rows.push(bandwidth_row(
        format!("adamw step {}M", nbw >> 20),
        s,
        gbps,
        copy_gbps,
    ));

    Ok(BenchReport {
        adapter,
        fma,
        copy_gbps,
        rows,
    })
}

/// One sequence's heads at the capstone's head width (8 × T × 40, T 512 with
/// `full`, else 256), bf16 as C1 runs them: forward and backward by the
/// attention kernels, and by the composition, the same bits.
fn attention_row(opts: &BenchOptions, copy_gbps: f64) -> Result<BenchRow> {
    use crate::backend::attention::{batched, Attention};
    use crate::backend::Operand;
    let (heads, t, d) = (8, if opts.full { 512 } else { 256 }, 40);
    let a = Attention {
        heads,
        t,
        d,
        scale: 1.0 / (d as f32).sqrt(),
        round: Some(Format::Bf16),
        scores: Some(Format::Bf16),
        probs: None,
        tokens: None,
    };
    let n = heads * t * d;
    let vals = |seed: usize| {
        (0..n)
            .map(|i| ((i * 7919 + seed) % 2003) as f32 / 2003.0 - 0.5)
            .collect::<Vec<f32>>()
    };
    let [q, k, v, g] = [1, 2, 3, 4].map(|s| Storage::from_f32(vals(s), Device::Gpu));
    let [q, k, v, g] = [q?, k?, v?, g?];
    let ops = [&q, &k, &v].map(|s| Operand::Values(s.clone()));
    let kernels = time_median(opts.min_time_s, || {
        let y = a.forward(&ops[0], &ops[1], &ops[2])?;
        let grads = a.backward(&ops[0], &ops[1], &ops[2], &g)?;
        gpu::sync()?;
        drop((y, grads));
        Ok(())
    })?;
    let [qg, kg, vg, gg] = [&q, &k, &v, &g].map(gpu_buf);
    let composition = time_median(opts.min_time_s, || {
        let y = batched::forward(&a, (qg, None), (kg, None), (vg, None))?;
        let grads = batched::backward(&a, (qg, None), (kg, None), (vg, None), gg)?;
        gpu::sync()?;
        drop((y, grads));
        Ok(())
    })?;
    let flops = a.flops(false) + a.flops(true);
    // q, k, v and dy read, y, dq, dk and dv written
    let gbps = 8.0 * 4.0 * n as f64 / kernels / 1e9;
    Ok(BenchRow {
        case: format!("attention fwd+bwd {heads}x{t}x{d}"),
        precision: "bf16".into(),
        seconds: kernels,
        gflops: Some(flops / kernels / 1e9),
        gbps,
        baseline: "its composition (same device)".into(),
        baseline_value: flops / composition / 1e9,
        ratio: composition / kernels,
        vs_copy: gbps / copy_gbps,
    })
}

fn bandwidth_row(case: String, s: f64, gbps: f64, copy_gbps: f64) -> BenchRow {
    BenchRow {
        case,
        precision: "f32".into(),
        seconds: s,
        gflops: None,
        gbps,
        baseline: "buffer copy".into(),
        baseline_value: copy_gbps,
        ratio: gbps / copy_gbps,
        vs_copy: gbps / copy_gbps,
    }
}
