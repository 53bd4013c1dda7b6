//! A roofline over a profile (`tinyllm train --profile`): the floating-point work and
//! the memory traffic of every primitive call, by kernel class and for the
//! whole step, set against a device's peak rate and memory bandwidth.
//!
//! The model, per call, from the shapes and storage formats it was given:
//!
//! * **bytes**: every buffer the kernel must read and every buffer it must
//!   write, once each, as stored (a 16-bit copy is 2 bytes a value, a float32
//!   buffer 4). An in-place update reads and writes its buffers. A copy that
//!   reads part of its source (a strided view, gathered rows) reads what it
//!   writes. Host-side integer ids (gathered rows, cross-entropy targets)
//!   are not counted. Caches are assumed perfect: this is the least traffic,
//!   not what a kernel actually moves.
//! * **FLOPs**: a matrix product `2·m·n·k` (a causal one counts only the
//!   multiply-adds it does). Every other kernel counts a nominal number of
//!   operations per element of its largest buffer ([`cost`]): one for each
//!   `+ − × ÷`, comparison, `exp`, `log` or square root in its formula (an
//!   fma is two), as a hardware instruction would count them — not the
//!   crate's own software `exp` and division. Those kernels are
//!   bandwidth-bound by far, so their floors rest on the bytes.
//!
//! The floor of a class, and of the step, is `max(FLOPs / peak, bytes /
//! bandwidth)`: no device can run that work faster. The profile's measured
//! time over the floor is how far from the roof the run is.

use std::time::Duration;

/// The kernel classes a roofline groups the primitives into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Matrix products (`matmul`, `matmul add`).
    Matmul,
    /// Causal self-attention, forward and backward (its products and softmax
    /// together).
    Attention,
    /// Row kernels: softmax, RMSNorm, RoPE, cross-entropy and their backwards.
    Rows,
    /// Elementwise kernels: unary, binary, SwiGLU, dropout masks.
    Elementwise,
    /// Reductions over axes (sum, max).
    Reduction,
    /// Optimizer updates, the loss scaler's finite check and unscale,
    /// clipping's sum of squares and scaling.
    Optimizer,
    /// Copies, gathers, scatters and 16-bit packing (no arithmetic).
    Copy,
    /// A primitive this model does not know (none today; a test keeps it so).
    Other,
}

impl Class {
    /// The class's name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Class::Matmul => "matmul",
            Class::Attention => "attention",
            Class::Rows => "rows (softmax, norm, rope, loss)",
            Class::Elementwise => "elementwise",
            Class::Reduction => "reductions",
            Class::Optimizer => "optimizer, scaler, clip",
            Class::Copy => "copies, gathers, packing",
            Class::Other => "other",
        }
    }
}

/// What the model counts for one primitive, by its profile name.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// The primitive's class.
    pub class: Class,
    /// Nominal FLOPs per element of the call's largest buffer (products and
    /// attention count their own, from their shapes).
    pub flops_per_element: f64,
    /// Whether the kernel reads only as much of its input as it writes (a
    /// strided view, gathered rows) rather than the whole input buffer.
    pub reads_as_written: bool,
}

/// The model's entry for the primitive named `name` (its profile name).
pub fn cost(name: &str) -> Cost {
    let c = |class, flops_per_element| Cost {
        class,
        flops_per_element,
        reads_as_written: false,
    };
    match name {
        "matmul" | "matmul add" => c(Class::Matmul, 0.0),
        "attention" | "attention backward" => c(Class::Attention, 0.0),
        // max, subtract, exp, sum, scale and divide
        "softmax" => c(Class::Rows, SOFTMAX),
        // y·g, the row sum, subtract, ×y, ×scale
        "softmax backward" => c(Class::Rows, SOFTMAX_BACKWARD),
        // square-and-add (an fma), then x · r · w
        "rms norm" => c(Class::Rows, 4.0),
        // g·w, the dot with x (fma), the correction (fma), ×r; dw's fma
        "rms norm backward" => c(Class::Rows, 9.0),
        // x·cos + rotate(x)·sin: a multiply and an fma
        "rope" | "rope backward" => c(Class::Rows, 3.0),
        // max, subtract, exp, sum
        "cross-entropy" => c(Class::Rows, 4.0),
        // subtract the max, exp, ×1/sum, the target's −1, ×g
        "cross-entropy backward" => c(Class::Rows, 5.0),
        // silu(g) = g / (1 + exp(-g)), × up
        "swiglu" => c(Class::Elementwise, 5.0),
        // sigmoid, silu', two products by the upstream gradient
        "swiglu backward" => c(Class::Elementwise, 9.0),
        "dropout mask" => c(Class::Elementwise, 1.0),
        "unary sigmoid" => c(Class::Elementwise, 3.0),
        "unary silu" => c(Class::Elementwise, 4.0),
        "unary silu grad" => c(Class::Elementwise, 7.0),
        // integer rounding of the bit pattern: no float arithmetic
        "unary round" | "unary round fp8" => c(Class::Elementwise, 0.0),
        n if n.starts_with("unary ") || n.starts_with("binary ") => c(Class::Elementwise, 1.0),
        "reduce sum" | "reduce max" => c(Class::Reduction, 1.0),
        // m, v (two fmas and a product each side), √v̂ + ε, ÷, decay, update
        "adamw" => c(Class::Optimizer, 12.0),
        // decay, momentum (fma), update (fma)
        "sgd" => c(Class::Optimizer, 5.0),
        "scale in place" => c(Class::Optimizer, 1.0),
        // ×1/scale, the exponent test, and the square-and-add of the norm
        "finite check + unscale" => c(Class::Optimizer, 3.0),
        "sum of squares" => c(Class::Optimizer, 2.0),
        "strided copy" | "gather rows" => Cost {
            reads_as_written: true,
            ..c(Class::Copy, 0.0)
        },
        "scatter-add rows" => c(Class::Copy, 1.0),
        "concat" | "pack 16-bit" | "unpack 16-bit" => c(Class::Copy, 0.0),
        _ => c(Class::Other, 0.0),
    }
}

/// Softmax's nominal FLOPs per element (attention's softmax counts them too).
pub(crate) const SOFTMAX: f64 = 6.0;
/// Softmax backward's nominal FLOPs per element.
pub(crate) const SOFTMAX_BACKWARD: f64 = 5.0;

/// A laptop GPU's published fp32 peak and memory bandwidth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KnownGpu {
    /// The GPU's name.
    pub name: &'static str,
    /// Lowercase substrings of adapter names that mean this GPU (the
    /// longest match over the table wins: "apple m1 pro" over "apple m1").
    pub matches: &'static [&'static str],
    /// fp32 peak, GFLOP/s (an fma counted as two).
    pub gflops: f64,
    /// Memory bandwidth, GB/s.
    pub gbps: f64,
}

/// Known laptop GPUs. Sources are the vendors' published specifications:
/// Apple's tech-spec and newsroom pages (TFLOPS and unified-memory bandwidth
/// of each chip's largest GPU configuration), Intel ARK and AMD product pages
/// (shader/EU counts, max graphics clock, memory type), NVIDIA's GeForce
/// laptop spec pages (CUDA cores, max boost clock, memory bus and speed).
/// Where a vendor publishes no FLOP figure the peak is ALUs × 2 (fma) ×
/// max clock; bandwidth is bus width × data rate of the memory the vendor
/// lists. Laptops run below these clocks at lower power limits, so a floor
/// from this table is a lower bound, never an expectation.
pub const KNOWN_GPUS: &[KnownGpu] = &[
    // 96 EU × 16 fp32 ops × 1.35 GHz; LPDDR4x-4266, 128-bit
    gpu(
        "Intel Iris Xe (96 EU)",
        &["iris(r) xe", "iris xe"],
        2074.0,
        68.3,
    ),
    // 8 Xe cores (1024 ALUs) × 2 × 1.55 GHz; 64-bit GDDR6 at 14 Gbps
    gpu("Intel Arc A370M", &["a370m"], 3174.0, 112.0),
    // Apple: 2.6 TFLOPS, 68.25 GB/s (8-core GPU)
    gpu("Apple M1", &["apple m1"], 2600.0, 68.25),
    gpu("Apple M1 Pro", &["apple m1 pro"], 5200.0, 200.0),
    gpu("Apple M1 Max", &["apple m1 max"], 10400.0, 400.0),
    // Apple: 3.6 TFLOPS, 100 GB/s (10-core GPU)
    gpu("Apple M2", &["apple m2"], 3600.0, 100.0),
    gpu("Apple M2 Pro", &["apple m2 pro"], 6800.0, 200.0),
    gpu("Apple M2 Max", &["apple m2 max"], 13600.0, 400.0),
    // 10 cores × 128 ALUs × 2 × 1.398 GHz (Apple publishes no TFLOPS); 100 GB/s
    gpu("Apple M3", &["apple m3"], 3579.0, 100.0),
    // 12 CUs × 64 × 2 × 2.4 GHz; LPDDR5-6400, 128-bit
    gpu(
        "AMD Radeon 680M",
        &["radeon 680m", "rembrandt"],
        3686.0,
        102.4,
    ),
    // 12 CUs × 64 × 2 × 2.7 GHz, single issue (AMD's 8.9 TFLOPS counts
    // RDNA 3's dual issue, which only paired instructions reach); LPDDR5x-7500
    gpu(
        "AMD Radeon 780M",
        &["radeon 780m", "phoenix"],
        4147.0,
        120.0,
    ),
    // 2048 CUDA cores × 2 × 1.74 GHz; 128-bit GDDR6 at 12 Gbps
    gpu(
        "NVIDIA RTX 3050 Laptop",
        &["rtx 3050 laptop"],
        7127.0,
        192.0,
    ),
    // 3840 × 2 × 1.703 GHz; 192-bit GDDR6 at 14 Gbps
    gpu(
        "NVIDIA RTX 3060 Laptop",
        &["rtx 3060 laptop"],
        13079.0,
        336.0,
    ),
    // 2560 × 2 × 2.37 GHz; 96-bit GDDR6 at 16 Gbps
    gpu(
        "NVIDIA RTX 4050 Laptop",
        &["rtx 4050 laptop"],
        12134.0,
        192.0,
    ),
    // 3072 × 2 × 2.37 GHz; 128-bit GDDR6 at 16 Gbps
    gpu(
        "NVIDIA RTX 4060 Laptop",
        &["rtx 4060 laptop"],
        14561.0,
        256.0,
    ),
];

const fn gpu(
    name: &'static str,
    matches: &'static [&'static str],
    gflops: f64,
    gbps: f64,
) -> KnownGpu {
    KnownGpu {
        name,
        matches,
        gflops,
        gbps,
    }
}

/// The table's entry for an adapter name (case-insensitive substring; the
/// longest matching substring wins).
pub fn known_gpu(adapter: &str) -> Option<&'static KnownGpu> {
    let a = adapter.to_lowercase();
    KNOWN_GPUS
        .iter()
        .flat_map(|g| g.matches.iter().map(move |m| (m.len(), g, m)))
        .filter(|(_, _, m)| a.contains(**m))
        .max_by_key(|(len, _, _)| *len)
        .map(|(_, g, _)| g)
}

/// The device limits a roofline is drawn against, each with where it came
/// from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Peak {
    /// fp32 peak, GFLOP/s, and its source.
    pub gflops: Option<(f64, String)>,
    /// Memory bandwidth, GB/s, and its source.
    pub gbps: Option<(f64, String)>,
}

impl Peak {
    /// The limits for a run on `adapter` (`None`: the CPU, which has no
    /// table): each flag given overrides the table's figure.
    pub fn resolve(adapter: Option<&str>, gflops: Option<f64>, gbps: Option<f64>) -> Peak {
        let known = adapter.and_then(known_gpu);
        let pick = |flag: Option<f64>, name: &str, table: Option<f64>| match (flag, known, table) {
            (Some(x), _, _) => Some((x, name.to_string())),
            (None, Some(g), Some(x)) => Some((x, format!("table: {}", g.name))),
            _ => None,
        };
        Peak {
            gflops: pick(gflops, "--peak-gflops", known.map(|g| g.gflops)),
            gbps: pick(gbps, "--bandwidth", known.map(|g| g.gbps)),
        }
    }

    /// The floor of `flops` of work moving `bytes`, in seconds, when both
    /// limits are known.
    pub fn floor(&self, flops: f64, bytes: f64) -> Option<f64> {
        let (p, _) = self.gflops.as_ref()?;
        let (b, _) = self.gbps.as_ref()?;
        Some((flops / (p * 1e9)).max(bytes / (b * 1e9)))
    }
}

/// One primitive's work over a profile: its calls' FLOPs and bytes (from
/// their shapes and storage formats) and their own time (not the parts
/// another primitive reports under its name, as the CPU's attention does
/// for its products).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkRow {
    /// The primitive's scope name.
    pub name: &'static str,
    /// Its calls.
    pub calls: u64,
    /// Their FLOPs (a multiply-add is two).
    pub flops: f64,
    /// The bytes they read and wrote, each buffer once, as stored.
    pub bytes: f64,
    /// Their wall time.
    pub time: Duration,
}

/// One class's work over the profiled steps.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassWork {
    /// The class.
    pub class: Class,
    /// Calls of the class's primitives.
    pub calls: u64,
    /// Their FLOPs (model above).
    pub flops: f64,
    /// Their bytes read and written (model above).
    pub bytes: f64,
    /// Their measured time (the primitives' own scopes).
    pub time: Duration,
}

impl ClassWork {
    /// FLOPs per byte.
    pub fn intensity(&self) -> f64 {
        self.flops / self.bytes.max(1.0)
    }
}

/// Work grouped by class, largest FLOPs first.
pub fn classes(work: &[WorkRow]) -> Vec<ClassWork> {
    let mut out: Vec<ClassWork> = Vec::new();
    for w in work {
        let class = cost(w.name).class;
        let i = match out.iter().position(|c| c.class == class) {
            Some(i) => i,
            None => {
                out.push(ClassWork {
                    class,
                    calls: 0,
                    flops: 0.0,
                    bytes: 0.0,
                    time: Duration::ZERO,
                });
                out.len() - 1
            }
        };
        let c = &mut out[i];
        c.calls += w.calls;
        c.flops += w.flops;
        c.bytes += w.bytes;
        c.time += w.time;
    }
    out.sort_by(|a, b| {
        b.flops
            .total_cmp(&a.flops)
            .then(b.bytes.total_cmp(&a.bytes))
    });
    out
}

/// A profile's roofline: what `tinyllm train --profile` prints after the
/// table.
#[derive(Clone, Debug)]
pub struct Roofline {
    /// Work by class over all profiled steps.
    pub classes: Vec<ClassWork>,
    /// Profiled steps (the per-step figures divide by it).
    pub steps: usize,
    /// Wall time of the profiled steps.
    pub wall: Option<Duration>,
    /// Whether the run was on the GPU (its primitive times are the host's
    /// recording time, so only the step's wall time is comparable).
    pub gpu: bool,
    /// The device's name in the messages ("cpu", an adapter's).
    pub device: String,
    /// The limits the floors are drawn against.
    pub peak: Peak,
}

impl Roofline {
    /// FLOPs and bytes of all classes together.
    pub fn total(&self) -> (f64, f64) {
        let f = self.classes.iter().map(|c| c.flops).sum();
        let b = self.classes.iter().map(|c| c.bytes).sum();
        (f, b)
    }

    /// The step's floor and the fraction of it the measured step reaches
    /// (`floor / measured`), when the limits and the wall time are known.
    pub fn step_fraction(&self) -> Option<(f64, f64)> {
        let (f, b) = self.total();
        let per = self.steps.max(1) as f64;
        let floor = self.peak.floor(f / per, b / per)?;
        let measured = self.wall?.as_secs_f64() / per;
        Some((floor, floor / measured.max(1e-12)))
    }
}

impl std::fmt::Display for Roofline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = self.steps.max(1) as f64;
        let floors = self.peak.floor(0.0, 0.0).is_some();
        write!(
            f,
            "roofline per step (FLOPs and bytes each kernel must read and write, from the shapes; \
             16-bit storage 2 bytes a value):\n{:<34} {:>10} {:>10} {:>8}",
            "class", "MFLOP", "MB", "FLOP/B"
        )?;
        // Per-class times are the kernels' own on the CPU; on the GPU they
        // are the host's recording time, so no per-class fraction there.
        let per_class = floors && !self.gpu;
        if floors {
            write!(f, " {:>9}", "floor ms")?;
        }
        if per_class {
            write!(f, " {:>9} {:>8}", "ms", "of floor")?;
        }
        let row =
            |f: &mut std::fmt::Formatter<'_>, name: &str, fl: f64, by: f64, time: Option<f64>| {
                write!(
                    f,
                    "\n{name:<34} {:>10.3} {:>10.3} {:>8.2}",
                    fl / per / 1e6,
                    by / per / 1e6,
                    fl / by.max(1.0)
                )?;
                if let Some(floor) = self.peak.floor(fl / per, by / per) {
                    write!(f, " {:>9.3}", floor * 1e3)?;
                    if let (true, Some(t)) = (per_class, time) {
                        let t = t / per;
                        write!(
                            f,
                            " {:>9.3} {:>7.1}%",
                            t * 1e3,
                            100.0 * floor / t.max(1e-12)
                        )?;
                    }
                }
                Ok(())
            };
        for c in &self.classes {
            row(
                f,
                c.class.name(),
                c.flops,
                c.bytes,
                Some(c.time.as_secs_f64()),
            )?;
        }
        let (fl, by) = self.total();
        row(f, "whole step", fl, by, None)?;
        match (&self.peak.gflops, &self.peak.gbps) {
            (Some((p, ps)), Some((b, bs))) => {
                write!(
                    f,
                    "\npeak {p} GFLOP/s ({ps}), bandwidth {b} GB/s ({bs}): ridge at {:.1} FLOP/B",
                    p / b
                )?;
                if let Some((floor, frac)) = self.step_fraction() {
                    let measured = self.wall.map_or(0.0, |w| w.as_secs_f64()) / per;
                    write!(
                        f,
                        "\nstep floor {:.3} ms (max of FLOPs/peak, bytes/bandwidth); measured {:.1} ms a step: \
                         the step reaches {:.2}% of its roofline floor",
                        floor * 1e3,
                        measured * 1e3,
                        100.0 * frac
                    )?;
                }
                Ok(())
            }
            (p, b) => {
                let missing: Vec<&str> =
                    [(p.is_none(), "--peak-gflops"), (b.is_none(), "--bandwidth")]
                        .into_iter()
                        .filter_map(|(m, n)| m.then_some(n))
                        .collect();
                write!(
                    f,
                    "\nno peak known for the {} device (not in the table of laptop GPUs): give {} for the floor",
                    self.device,
                    missing.join(" and ")
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_primitive_has_a_class() {
        use crate::backend::elementwise::{BinaryOp, UnaryOp};
        use crate::backend::reduce::ReduceOp;
        let names = UnaryOp::ALL.iter().map(|o| o.name());
        let names = names.chain(BinaryOp::ALL.iter().map(|o| o.name()));
        let names = names.chain(ReduceOp::ALL.iter().map(|o| o.name()));
        let others = [
            "matmul",
            "matmul add",
            "attention",
            "attention backward",
            "softmax",
            "softmax backward",
            "rms norm",
            "rms norm backward",
            "rope",
            "rope backward",
            "cross-entropy",
            "cross-entropy backward",
            "swiglu",
            "swiglu backward",
            "dropout mask",
            "adamw",
            "sgd",
            "scale in place",
            "finite check + unscale",
            "sum of squares",
            "strided copy",
            "gather rows",
            "scatter-add rows",
            "concat",
            "pack 16-bit",
            "unpack 16-bit",
        ];
        for n in names.chain(others) {
            assert_ne!(cost(n).class, Class::Other, "{n}");
        }
        assert_eq!(cost("no such primitive").class, Class::Other);
    }

    #[test]
    fn the_table_matches_adapter_names_and_flags_override_it() {
        let g = |a| known_gpu(a).map(|g| g.name);
        assert_eq!(
            g("Intel(R) Iris(R) Xe Graphics (TGL GT2)"),
            Some("Intel Iris Xe (96 EU)")
        );
        assert_eq!(g("Apple M1"), Some("Apple M1"));
        assert_eq!(
            g("APPLE M1 PRO"),
            Some("Apple M1 Pro"),
            "the longest match wins"
        );
        assert_eq!(g("Apple M2 Max"), Some("Apple M2 Max"));
        assert_eq!(
            g("AMD Radeon Graphics (RADV REMBRANDT)"),
            Some("AMD Radeon 680M")
        );
        assert_eq!(
            g("NVIDIA GeForce RTX 4060 Laptop GPU"),
            Some("NVIDIA RTX 4060 Laptop")
        );
        assert_eq!(
            g("NVIDIA GeForce RTX 4060"),
            None,
            "the desktop card is another GPU"
        );
        assert_eq!(g("llvmpipe (LLVM 15.0.6, 256 bits)"), None);

        let m2 = Peak::resolve(Some("Apple M2"), None, None);
        assert_eq!(m2.gflops, Some((3600.0, "table: Apple M2".into())));
        assert_eq!(m2.gbps, Some((100.0, "table: Apple M2".into())));
        let over = Peak::resolve(Some("Apple M2"), None, Some(50.0));
        assert_eq!(over.gflops, m2.gflops);
        assert_eq!(over.gbps, Some((50.0, "--bandwidth".into())));
        assert_eq!(Peak::resolve(None, None, None), Peak::default());
        let lavapipe = Peak::resolve(Some("llvmpipe (LLVM 15.0.6, 256 bits)"), Some(100.0), None);
        assert_eq!(lavapipe.gflops, Some((100.0, "--peak-gflops".into())));
        assert_eq!((&lavapipe.gbps, lavapipe.floor(1.0, 1.0)), (&None, None));
        // 1 GFLOP at 100 GFLOP/s: 10 ms; 1 GB at 50 GB/s: 20 ms — the floor is the larger.
        let both = Peak::resolve(None, Some(100.0), Some(50.0));
        assert_eq!(both.floor(1e9, 1e9), Some(0.02));
        assert_eq!(both.floor(1e10, 1e9), Some(0.1));
    }
}
