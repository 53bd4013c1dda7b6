//! The primitive sweep: every backend primitive run on the executable spec
//! ([`Device::Spec`]) and on each device asked for — the fast CPU kernels, the
//! GPU — over random inputs and the hard cases (`cases`),
//! each device's outputs compared with the spec's bit for bit (a NaN equals a
//! NaN of any payload). What the parity suite checks in CI, shipped in the
//! library so it runs on the user's adapter (the parity tests run these very
//! families).
//!
//! A [`Row`] per primitive, variant (a matmul's format and layout, a causal
//! mask, a rounding format) and device: cases run, cases whose every output
//! was identical to the spec's, values compared and differing, the largest
//! difference in ulps, and the first differing case (its shapes and
//! parameters, the position, both values in hex, and the inputs there when
//! they line up with the output).
//!
//! Shapes are small (a software adapter is slow) but cross every kernel's
//! workgroup and tile sizes raggedly, and the loops that a device may cap
//! (lavapipe stops a shader loop after 65,535 iterations) run past the cap.

use super::hex;
use crate::backend::attention::{Attention, Rotary};
use crate::backend::round::{Format, Fp8};
use crate::backend::{
    AdamWConsts, AdamWItem, BinaryLayout, BinaryOp, Causal, Device, MatmulDims, Operand, Product,
    ReduceOp, Storage, TokenMajor, UnaryOp,
};
use crate::crosscheck::cases::{adversarial, diff, specials, Rng};
use crate::Result;
use serde::Serialize;

/// The primitive families (the backend's one list), which the sweep runs.
pub use crate::backend::Family;

/// The sweep's part for a primitive family in words, for progress lines
/// (`reductions and softmax`, `dropout masks`, …). The parts are the
/// backend's own [`Family`] list: a new family must be given its part here
/// (and its cases in [`run`]) before the crate compiles.
pub fn words(f: Family) -> &'static str {
    match f {
        // rounding to bf16 and fp16 (a unary op) included
        Family::Elementwise => "elementwise and rounding",
        // including one longer than a device's loop cap, the chunked sum of
        // squares, softmax (plain, scaled, causally masked) and its backward
        Family::Reduce => "reductions and softmax",
        // every layout and format, with and without a causal mask
        Family::Matmul => "matmul",
        // forward and backward, head-major and token-major, every format
        Family::Attention => "attention",
        // strided copies, concatenation, row gathers and scatter-adds
        Family::Copy => "copies, gather and scatter",
        // AdamW, SGD, and the loss scaler's finite check, unscaling and scaling
        Family::Update => "in-place updates and the finite check",
        Family::Dropout => "dropout masks",
        // RMSNorm, SwiGLU, RoPE, softmax cross-entropy, forward and backward
        Family::Fused => "fused transformer primitives",
        Family::Pack => "16-bit storage",
    }
}

/// The first output that differed in a row.
#[derive(Clone, Debug, Serialize)]
pub struct Mismatch {
    /// The case: shapes and parameters.
    pub case: String,
    /// Position in the case's output (outputs concatenated in order).
    pub position: usize,
    /// The spec's value, as an f32 bit pattern in hex (`-` where its output
    /// was shorter).
    pub spec: String,
    /// The device's value, as an f32 bit pattern in hex (`-` where its
    /// output was shorter).
    pub device: String,
    /// The inputs at that position, where they line up with the output.
    pub inputs: Vec<String>,
}

/// One primitive (and variant) over all its cases.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The primitive, as the profile and the trace name it.
    pub primitive: &'static str,
    /// The variant (format, layout, mask); empty for none.
    pub variant: String,
    /// The device held to the spec: `cpu` or `gpu`.
    pub device: &'static str,
    /// Cases run.
    pub cases: usize,
    /// Cases whose every output value was identical.
    pub identical: usize,
    /// Output values compared, over all cases (the longer output's length
    /// where the two differ).
    pub values: usize,
    /// Output values that differed, over all cases (a missing value counts).
    pub differing: usize,
    /// The largest difference between two numbers, in ulps.
    pub max_ulps: u64,
    /// Whether a NaN stood against a number (no ulp distance).
    pub nan_vs_number: bool,
    /// The first differing output of the first case that differed.
    pub first: Option<Mismatch>,
}

impl Row {
    /// `gpu: matmul [bf16 Aᵀ·B]`.
    pub fn label(&self) -> String {
        if self.variant.is_empty() {
            format!("{}: {}", self.device, self.primitive)
        } else {
            format!("{}: {} [{}]", self.device, self.primitive, self.variant)
        }
    }
    /// Whether every value of every case was identical.
    pub fn bit_identical(&self) -> bool {
        self.differing == 0
    }
}

/// The rows, filled case by case.
struct Sweep {
    /// The devices held to the spec.
    devices: Vec<Device>,
    rows: Vec<Row>,
}

fn up(data: &[f32], d: Device) -> Result<Storage> {
    Storage::from_f32(data.to_vec(), d)
}

/// `data` on `d` as a product's operand: its values, or kept in 16-bit
/// storage of `half` (as autograd keeps a rounded operand).
fn operand(data: &[f32], half: Option<Format>, d: Device) -> Result<Operand> {
    let s = up(data, d)?;
    Ok(match half {
        Some(f) => Operand::Half(s.pack(f)?.0),
        None => Operand::Values(s),
    })
}

impl Sweep {
    fn row(&mut self, primitive: &'static str, variant: &str, device: Device) -> &mut Row {
        let device = device_name(device);
        let at = self
            .rows
            .iter()
            .position(|r| r.primitive == primitive && r.variant == variant && r.device == device);
        let i = at.unwrap_or_else(|| {
            self.rows.push(Row {
                primitive,
                variant: variant.to_string(),
                device,
                cases: 0,
                identical: 0,
                values: 0,
                differing: 0,
                max_ulps: 0,
                nan_vs_number: false,
                first: None,
            });
            self.rows.len() - 1
        });
        &mut self.rows[i]
    }

    /// Runs one case on the spec and on every device, and records each
    /// device's comparison in its row. `inputs` are shown beside a mismatch
    /// when they have the output's length.
    fn check(
        &mut self,
        primitive: &'static str,
        variant: &str,
        case: String,
        inputs: &[&[f32]],
        run: impl Fn(Device) -> Result<Vec<f32>>,
    ) -> Result<()> {
        let spec = run(Device::Spec)?;
        for device in self.devices.clone() {
            let out = run(device)?;
            self.record(
                primitive,
                variant,
                device,
                case.clone(),
                inputs,
                &spec,
                &out,
            );
        }
        Ok(())
    }

    /// One device's outputs `out` against the spec's.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        primitive: &'static str,
        variant: &str,
        device: Device,
        case: String,
        inputs: &[&[f32]],
        spec: &[f32],
        out: &[f32],
    ) {
        let row = self.row(primitive, variant, device);
        row.cases += 1;
        row.values += spec.len().max(out.len());
        let d = diff(spec, out);
        row.max_ulps = row.max_ulps.max(d.max_ulps);
        row.nan_vs_number |= d.nan_vs_number;
        if d.differing == 0 {
            row.identical += 1;
            return;
        }
        row.differing += d.differing;
        if row.first.is_none() {
            let at = d.first.unwrap_or(spec.len().min(out.len()));
            let val = |v: &[f32]| v.get(at).map_or("-".to_string(), |&x| hex(x));
            row.first = Some(Mismatch {
                case,
                position: at,
                spec: val(spec),
                device: val(out),
                inputs: inputs
                    .iter()
                    .filter(|x| x.len() == spec.len())
                    .map(|x| hex(x[at]))
                    .collect(),
            });
        }
    }
}

/// The name a row gives its device.
fn device_name(d: Device) -> &'static str {
    match d {
        Device::Cpu => "cpu",
        Device::Gpu => "gpu",
        Device::Spec => "spec",
    }
}

/// Runs the sweep's `families` (all of [`Family::ALL`] for the command) on
/// the spec and each of `devices` (`Cpu`, `Gpu`: the GPU needs an adapter),
/// every device held to the spec, telling `progress` as each family begins.
pub fn run(
    devices: &[Device],
    families: &[Family],
    progress: &mut dyn FnMut(Family),
) -> Result<Vec<Row>> {
    let mut sw = Sweep {
        devices: devices.to_vec(),
        rows: Vec::new(),
    };
    for &f in families {
        progress(f);
        match f {
            Family::Elementwise => {
                unary(&mut sw)?;
                binary(&mut sw)?;
                rounding(&mut sw)?;
            }
            Family::Reduce => {
                reduce(&mut sw)?;
                softmax(&mut sw)?;
            }
            Family::Matmul => matmul(&mut sw)?,
            Family::Attention => attention(&mut sw)?,
            Family::Copy => copy(&mut sw)?,
            Family::Update => update(&mut sw)?,
            Family::Dropout => dropout(&mut sw)?,
            Family::Fused => fused(&mut sw)?,
            Family::Pack => pack(&mut sw)?,
        }
    }
    Ok(sw.rows)
}

// ------------------------------------------------------- elementwise ----

fn unary_variant(op: UnaryOp) -> &'static str {
    match op {
        UnaryOp::Round(f) => f.name(),
        UnaryOp::RoundFp8(f) => f.name(),
        _ => "",
    }
}

fn unary(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut x = adversarial(&mut rng, 1500);
    x.extend(specials());
    // exp/log/sigmoid territory: dense sweeps around the interesting ranges
    for i in 0..200u32 {
        x.push(-110.0 + i as f32 * 1.0037);
        x.push(f32::from_bits(0x0000_1000 + i * 0x0003_0001)); // subnormals
    }
    // every op (the enum's own list), plus more scalars for the scalar ops
    let mut ops = UnaryOp::ALL.to_vec();
    ops.extend([
        UnaryOp::AddScalar(0.1),
        UnaryOp::AddScalar(-1e-40),
        UnaryOp::MulScalar(-3.0),
        UnaryOp::MulScalar(1e-30),
        UnaryOp::DivScalar(7.0),
        UnaryOp::DivScalar(1e-39),
        UnaryOp::DivScalar(0.0),
        UnaryOp::RDivScalar(1.0),
        UnaryOp::RDivScalar(-3e38),
    ]);
    for op in ops {
        let case = format!("{op:?} on {} values", x.len());
        sw.check(op.name(), unary_variant(op), case, &[&x], |d| {
            up(&x, d)?.unary(op)?.to_vec_f32()
        })?;
    }
    // the empty tensor and a single element
    for data in [vec![], vec![-0.0f32]] {
        for op in [UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Round(Format::Fp16)] {
            let case = format!("{op:?} on {data:?}");
            sw.check(op.name(), unary_variant(op), case, &[&data], |d| {
                up(&data, d)?.unary(op)?.to_vec_f32()
            })?;
        }
    }
    Ok(())
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![0; shape.len()];
    let mut acc = 1;
    for d in (0..shape.len()).rev() {
        st[d] = acc;
        acc *= shape[d];
    }
    st
}

/// Strides of `part` within a tensor of `full` shape (0 where broadcast).
fn broadcast_strides(part: &[usize], full: &[usize]) -> Vec<usize> {
    let pad = full.len() - part.len();
    let own = contiguous_strides(part);
    (0..full.len())
        .map(|d| {
            if d < pad || part[d - pad] == 1 {
                0
            } else {
                own[d - pad]
            }
        })
        .collect()
}

fn binary_case(
    sw: &mut Sweep,
    a: &[f32],
    b: &[f32],
    op: BinaryOp,
    layout: &BinaryLayout,
    what: &str,
) -> Result<()> {
    let case = format!("{op:?} {what}: {layout}");
    sw.check(op.name(), "", case, &[a, b], |d| {
        up(a, d)?.binary(&up(b, d)?, op, layout)?.to_vec_f32()
    })
}

fn binary(sw: &mut Sweep) -> Result<()> {
    // every op with broadcasting: (lhs shape, rhs shape) -> the elementwise max
    let mut rng = Rng(42);
    let cases: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![257], vec![257]),
        (vec![3, 1, 5], vec![1, 4, 5]),
        (vec![4, 6], vec![6]),
        (vec![4, 6], vec![4, 1]),
        (vec![5], vec![1]),
        (vec![], vec![]),
        (vec![2, 1, 3, 1, 2, 3], vec![1, 2, 1, 2, 2, 1]),
        (vec![1, 1], vec![3, 7]),
        (vec![0, 3], vec![1, 3]),
    ];
    for (ls, rs) in cases {
        let nd = ls.len().max(rs.len());
        let pad = |s: &[usize]| {
            let mut v = vec![1; nd - s.len()];
            v.extend_from_slice(s);
            v
        };
        let (lp, rp) = (pad(&ls), pad(&rs));
        // numpy broadcasting: a size-1 dimension takes the other's size (even 0)
        let shape: Vec<usize> = (0..nd)
            .map(|d| if lp[d] == 1 { rp[d] } else { lp[d] })
            .collect();
        let layout = BinaryLayout {
            shape: shape.clone(),
            lhs_strides: broadcast_strides(&lp, &shape),
            rhs_strides: broadcast_strides(&rp, &shape),
        };
        let a = adversarial(&mut rng, ls.iter().product());
        let mut b = adversarial(&mut rng, rs.iter().product());
        // equal pairs matter for Eq, Maximum(±0) and x - x
        for (i, v) in b.iter_mut().enumerate() {
            if i % 5 == 0 && i < a.len() {
                *v = if i % 10 == 0 { a[i] } else { -a[i] };
            }
        }
        for op in BinaryOp::ALL {
            binary_case(sw, &a, &b, op, &layout, &format!("{ls:?} with {rs:?}"))?;
        }
    }
    // every (special, special) pair, contiguous
    let sp = specials();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for &x in &sp {
        for &y in &sp {
            a.push(x);
            b.push(y);
        }
    }
    for op in BinaryOp::ALL {
        binary_case(
            sw,
            &a,
            &b,
            op,
            &BinaryLayout::flat(a.len()),
            "special pairs",
        )?;
    }
    // random operands of every exponent: the crate's division, not the device's
    let mut rng = Rng(7);
    let a: Vec<f32> = (0..4000).map(|_| rng.bits()).collect();
    let b: Vec<f32> = (0..4000)
        .map(|i| {
            if i % 3 == 0 {
                rng.moderate()
            } else {
                rng.bits()
            }
        })
        .collect();
    binary_case(
        sw,
        &a,
        &b,
        BinaryOp::Div,
        &BinaryLayout::flat(a.len()),
        "random bits",
    )
}

/// The rounding sweep's inputs: every f32 exponent with mantissas at and
/// around both formats' ties, the fp16 overflow boundary bit by bit, and the
/// fp16 subnormal range (`k · 2^-25`: odd `k` are ties) with neighbours.
pub fn rounding_inputs() -> Vec<f32> {
    let mut x = Vec::new();
    let mantissas: [u32; 16] = [
        0, 1, 0x7fff, 0x8000, 0x8001, 0x1_8000, 0x1_7fff, 0x0fff, 0x1000, 0x1001, 0x3000, 0x2fff,
        0x7f_ffff, 0x7f_8000, 0x7f_f000, 0x40_0000,
    ];
    for e in 0..=255u32 {
        for &m in &mantissas {
            for s in [0u32, 0x8000_0000] {
                x.push(f32::from_bits(s | (e << 23) | m));
            }
        }
    }
    // around 65504 / 65520 (fp16 overflow) bit by bit
    for b in 0x477f_e000u32..0x4780_0010 {
        if b % 7 == 0 || (0x477f_efe0..0x477f_f020).contains(&b) {
            x.push(f32::from_bits(b));
            x.push(-f32::from_bits(b));
        }
    }
    for k in 0..2100u32 {
        let v = k as f32 * 2f32.powi(-25);
        x.push(v);
        x.push(f32::from_bits(v.to_bits() + 1));
        x.push(-v);
    }
    x
}

/// Every value of both fp8 formats with its neighbours one f32 ulp away and
/// the midpoints to the next value with theirs (every tie and boundary),
/// through the saturation and overflow edges, signed.
pub fn fp8_rounding_inputs() -> Vec<f32> {
    let mut x = Vec::new();
    // (mantissa bits, exponent bias) of E4M3 and E5M2, every 8-bit pattern
    for (m, bias) in [(3u32, 7i32), (2, 15)] {
        let value = |p: u32| -> f32 {
            let (e, f) = ((p >> m) as i32, (p & ((1 << m) - 1)) as f32);
            let scale = 2f32.powi(1 - bias - m as i32);
            if e == 0 {
                f * scale
            } else {
                (f + (1 << m) as f32) * 2f32.powi(e - 1) * scale
            }
        };
        for p in 0..(1u32 << (7 - m)) << m {
            let (v, next) = (value(p), value(p + 1));
            let mid = (v + next) / 2.0;
            for y in [v, mid] {
                for z in [
                    y,
                    f32::from_bits(y.to_bits() + 1),
                    f32::from_bits(y.to_bits().saturating_sub(1)),
                ] {
                    x.push(z);
                    x.push(-z);
                }
            }
        }
    }
    x
}

fn rounding(sw: &mut Sweep) -> Result<()> {
    let x8 = fp8_rounding_inputs();
    for f in [Fp8::E4M3, Fp8::E5M2] {
        let op = UnaryOp::RoundFp8(f);
        let case = format!("stratified: {} values around every tie and edge", x8.len());
        sw.check(op.name(), f.name(), case, &[&x8], |d| {
            up(&x8, d)?.unary(op)?.to_vec_f32()
        })?;
    }
    let x = rounding_inputs();
    for f in [Format::Bf16, Format::Fp16] {
        let op = UnaryOp::Round(f);
        let case = format!(
            "stratified: {} values around every tie and boundary",
            x.len()
        );
        sw.check(op.name(), f.name(), case, &[&x], |d| {
            up(&x, d)?.unary(op)?.to_vec_f32()
        })?;
    }
    Ok(())
}

// ----------------------------------------------------------- reduction ----

fn reduce(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(3);
    let shapes = [
        (1, 1, 1),
        (1, 37, 1),
        (3, 5, 7),
        (2, 1, 9),
        (4, 0, 3),
        (1, 300, 2),
        (7, 3, 1),
        (0, 4, 4),
    ];
    for (o, r, i) in shapes {
        for mode in 0..3 {
            let x: Vec<f32> = (0..o * r * i)
                .map(|_| match mode {
                    0 => rng.moderate(),
                    1 => [0.0, -0.0, 1e-45, -1e-45][rng.below(4)], // signed zeros, subnormals
                    _ => adversarial(&mut rng, 1)[0],
                })
                .collect();
            for op in ReduceOp::ALL {
                let case = format!("({o}, {r}, {i}) values of kind {mode}");
                sw.check(op.name(), "", case, &[], |d| {
                    up(&x, d)?.reduce(op, o, r, i)?.to_vec_f32()
                })?;
            }
        }
    }
    // a reduction longer than lavapipe's 65,535 loop iterations (run in passes)
    let n = 70_001;
    let mut rng = Rng(91);
    let x: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
    for op in ReduceOp::ALL {
        sw.check(
            op.name(),
            "",
            format!("(1, {n}, 1): past a 65,535-iteration loop cap"),
            &[],
            |d| up(&x, d)?.reduce(op, 1, n, 1)?.to_vec_f32(),
        )?;
    }
    // sums of squares in chunks: tiny squares underflow, big ones do not,
    // subnormal squares, an empty buffer
    let mut rng = Rng(5);
    let a: Vec<f32> = (0..3000).map(|_| rng.moderate()).collect();
    let b: Vec<f32> = vec![1e-30, 3.0e19];
    let e: Vec<f32> = vec![];
    let dd: Vec<f32> = (0..1025).map(|_| rng.unif(-1e-20, 1e-20)).collect();
    // long enough for the CPU's chunks-abreast loop (8 chunks at a time)
    let long: Vec<f32> = (0..20 * 1024 + 77).map(|_| rng.moderate()).collect();
    for (what, bufs) in [
        ("4 buffers", vec![&a, &b, &e, &dd]),
        ("subnormal squares", vec![&dd]),
        ("a long buffer", vec![&long, &a]),
    ] {
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        sw.check(
            "sum of squares",
            "",
            format!("{what} of lengths {lens:?}"),
            &[],
            |d| {
                let st: Vec<Storage> = bufs.iter().map(|b| up(b, d)).collect::<Result<_>>()?;
                let refs: Vec<&Storage> = st.iter().collect();
                Ok(vec![Storage::sum_squares(&refs)?])
            },
        )?;
    }
    Ok(())
}

// ------------------------------------------------------------- softmax ----

/// Softmax over `(rows, n)` of `x` with `(scale, causal)`, and its backward
/// with upstream `gr` when given.
fn softmax_case(
    sw: &mut Sweep,
    what: &str,
    x: &[f32],
    gr: Option<&[f32]>,
    (rows, n): (usize, usize),
    (scale, causal): (f32, bool),
) -> Result<()> {
    let case = format!("{what}: rows {rows} n {n} scale {scale} causal {causal}");
    sw.check("softmax", "", case.clone(), &[x], |d| {
        up(x, d)?.softmax_rows(rows, n, scale, causal)?.to_vec_f32()
    })?;
    let Some(gr) = gr else { return Ok(()) };
    // backward from each device's own forward (identical, or the row above says so)
    sw.check("softmax backward", "", case, &[], |d| {
        let y = up(x, d)?.softmax_rows(rows, n, scale, causal)?;
        y.softmax_rows_backward(&up(gr, d)?, rows, n, scale)?
            .to_vec_f32()
    })
}

/// Rows with trailing −inf (a causal mask's shape) of every tail length, −inf
/// in the middle, a whole −inf row, +inf and NaN maxima with −inf tails:
/// `(values, rows, n)`.
pub fn masked_softmax_rows() -> (Vec<f32>, usize, usize) {
    let mut rng = Rng(13);
    let n = 11;
    let mut x = Vec::new();
    for i in 0..n {
        // row i: the causal mask of query i (entries past i are −inf)
        x.extend((0..n).map(|j| {
            if j > i {
                f32::NEG_INFINITY
            } else {
                rng.unif(-30.0, 30.0)
            }
        }));
    }
    let mut mid = vec![f32::NEG_INFINITY; n];
    (mid[0], mid[3], mid[5]) = (-1.0, 2.0, -0.0);
    x.extend(mid);
    x.extend(vec![f32::NEG_INFINITY; n]);
    let mut inf = vec![f32::NEG_INFINITY; n];
    (inf[0], inf[1]) = (f32::INFINITY, 3.0);
    x.extend(inf);
    let mut nan = vec![f32::NEG_INFINITY; n];
    (nan[0], nan[2]) = (1.0, f32::NAN);
    x.extend(nan);
    let rows = x.len() / n;
    (x, rows, n)
}

fn softmax(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(11);
    // the last two: more than one 64-row block of the staged (hardware)
    // kernels, causal queries wrapping inside a block, columns past a stage
    for (rows, n) in [
        (1, 1),
        (5, 13),
        (3, 64),
        (2, 257),
        (4, 2),
        (19, 70),
        (150, 37),
        (67, 16),
    ] {
        let mut x: Vec<f32> = (0..rows * n).map(|_| rng.unif(-20.0, 20.0)).collect();
        // rows with tiny exponentials (subnormal e^x), -inf, NaN, ±0, all-equal
        if rows >= 3 {
            for j in 0..n {
                x[j] = -90.0 - 0.37 * j as f32;
                x[n + j] = if j % 3 == 0 { f32::NEG_INFINITY } else { -0.0 };
            }
            x[2 * n] = f32::NAN;
        }
        if rows >= 4 {
            for j in 0..n {
                x[3 * n + j] = 1.5;
            }
        }
        // past the first eight rows: a max of both zeros, a late NaN
        if rows >= 12 {
            for j in 0..n {
                x[10 * n + j] = [-0.0, -1.0, 0.0, -3.0][j % 4];
            }
            x[11 * n + n - 1] = f32::NAN;
        }
        let gr: Vec<f32> = (0..rows * n).map(|_| rng.moderate()).collect();
        // plain, scaled, and attention's scaled + causal (masked keys are −inf
        // whatever they hold, so the NaN and −inf rows also meet the mask)
        for (scale, causal) in [(1.0, false), (0.125, false), (0.125, true), (0.3, true)] {
            let what = "random, tiny, −inf, NaN, equal rows";
            softmax_case(sw, what, &x, Some(&gr), (rows, n), (scale, causal))?;
        }
    }
    let (x, rows, n) = masked_softmax_rows();
    softmax_case(
        sw,
        "causally masked rows",
        &x,
        None,
        (rows, n),
        (1.0, false),
    )
}

// ---------------------------------------------------------------- matmul ----

fn layout_name(ta: bool, tb: bool) -> &'static str {
    match (ta, tb) {
        (false, false) => "A·B",
        (true, false) => "Aᵀ·B",
        (false, true) => "A·Bᵀ",
        (true, true) => "Aᵀ·Bᵀ",
    }
}

/// A matmul's row: its format and layout, or its causal mask.
fn matmul_variant(d: &MatmulDims, round: Option<Format>) -> String {
    let fmt = round.map_or("f32", Format::name);
    match d.causal {
        Causal::No => format!("{fmt} {}", layout_name(d.trans_a, d.trans_b)),
        Causal::Outputs => format!("{fmt} causal: outputs j ≤ i"),
        Causal::TermsUpToRow => format!("{fmt} causal: terms p ≤ i"),
        Causal::TermsFromRow => format!("{fmt} causal: terms p ≥ i"),
    }
}

fn matmul_case(
    sw: &mut Sweep,
    variant: Option<&str>,
    a: &[f32],
    b: &[f32],
    dims: MatmulDims,
    round: Option<Format>,
    what: &str,
) -> Result<()> {
    let v = variant.map_or_else(|| matmul_variant(&dims, round), str::to_string);
    let case = format!("{what}{}", dims.describe(round));
    sw.check("matmul", &v, case, &[], |d| {
        up(a, d)?.matmul(&up(b, d)?, dims, round)?.to_vec_f32()
    })
}

#[allow(clippy::too_many_arguments)]
fn dims(
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
    a_bs: usize,
    b_bs: usize,
    causal: Causal,
) -> MatmulDims {
    MatmulDims {
        batch,
        m,
        k,
        n,
        trans_a: ta,
        trans_b: tb,
        a_batch_stride: a_bs,
        b_batch_stride: b_bs,
        causal,
        tokens: Default::default(),
    }
}

/// Every format and layout over `shapes` (batch, m, k, n, A broadcast, B
/// broadcast), moderate operands with a special planted every `every`-th of A.
fn matmul_layouts(
    sw: &mut Sweep,
    rng: &mut Rng,
    shapes: &[(usize, usize, usize, usize, bool, bool)],
    every: (usize, usize),
    what: &str,
) -> Result<()> {
    let sp = specials();
    for &(batch, m, k, n, bca, bcb) in shapes {
        for ta in [false, true] {
            for tb in [false, true] {
                for round in [None, Some(Format::Bf16), Some(Format::Fp16)] {
                    let na = if bca { 1 } else { batch };
                    let nb = if bcb { 1 } else { batch };
                    let mut a: Vec<f32> = (0..na * m * k).map(|_| rng.moderate()).collect();
                    let b: Vec<f32> = (0..nb * k * n).map(|_| rng.moderate()).collect();
                    for (i, v) in a.iter_mut().enumerate() {
                        if i % every.0 == every.1 {
                            *v = sp[i % sp.len()];
                        }
                    }
                    let d = dims(
                        batch,
                        m,
                        k,
                        n,
                        ta,
                        tb,
                        if bca { 0 } else { m * k },
                        if bcb { 0 } else { k * n },
                        Causal::No,
                    );
                    matmul_case(sw, None, &a, &b, d, round, what)?;
                }
            }
        }
    }
    Ok(())
}

fn matmul(sw: &mut Sweep) -> Result<()> {
    // every layout and format on small shapes (empty, single, broadcast)
    let mut rng = Rng(0xfeed);
    let shapes = [
        (1, 1, 1, 1, false, false),
        (1, 5, 7, 3, false, false),
        (2, 33, 17, 35, false, false),
        (3, 4, 9, 1, true, false),
        (2, 1, 9, 6, false, true),
        (1, 6, 0, 5, false, false),
        (2, 8, 64, 8, false, false),
        (1, 37, 3, 1, false, false),
        (1, 0, 4, 3, false, false),
    ];
    matmul_layouts(sw, &mut rng, &shapes, (11, 3), "small: ")?;
    // the kernel's tiles crossed raggedly, a long k, broadcasting
    let mut rng = Rng(0x7a11);
    let shapes = [
        (1, 65, 300, 71, false, false),
        (2, 9, 1031, 130, false, true),
        (1, 130, 5, 7, true, false),
        (3, 64, 64, 64, false, false),
        (1, 1, 777, 129, false, false),
        (1, 127, 2, 1, false, false),
        // past a guarded product's pass (matmul/gpu.rs GUARD_PASS)
        (1, 9, 4099, 10, false, false),
        // past an unguarded one's (PASS), and one pass of it would pass the cap
        (1, 3, 13_200, 5, false, false),
    ];
    matmul_layouts(sw, &mut rng, &shapes, (97, 5), "ragged tiles: ")?;
    matmul_causal(sw)?;
    matmul_half(sw)?;
    matmul_added(sw)?;
    matmul_tokens(sw)?;
    matmul_shared(sw)?;
    matmul_pair(sw)?;
    matmul_keeping_a(sw)?;
    swiglu_matmul(sw)?;
    matmul_bits(sw)?;
    matmul_outside_normal_range(sw)
}

/// Causal products (attention's): outputs past the diagonal +0, each row's
/// terms cut at the diagonal — skipped, not added as zeros, so the inf and
/// NaN planted in the skipped part must not reach the result.
fn matmul_causal(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0xca5a1);
    for (batch, t, w) in [(1, 1, 1), (2, 7, 5), (1, 70, 9), (2, 300, 4)] {
        for (causal, layout) in [
            (Causal::Outputs, (false, true)),
            (Causal::TermsUpToRow, (false, false)),
            (Causal::TermsFromRow, (true, false)),
        ] {
            let (m, k, n) = if causal == Causal::Outputs {
                (t, w, t)
            } else {
                (t, t, w)
            };
            for (ta, tb) in [layout, (true, true)] {
                for round in [None, Some(Format::Bf16)] {
                    let mut a: Vec<f32> = (0..batch * m * k).map(|_| rng.moderate()).collect();
                    let mut b: Vec<f32> = (0..batch * k * n).map(|_| rng.moderate()).collect();
                    let planted = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.0, -0.0, 1e-40];
                    for (i, v) in a.iter_mut().chain(b.iter_mut()).enumerate() {
                        if i % 13 == 5 {
                            *v = planted[i % planted.len()];
                        }
                    }
                    let d = dims(batch, m, k, n, ta, tb, m * k, k * n, causal);
                    matmul_case(sw, None, &a, &b, d, round, "")?;
                }
            }
        }
    }
    Ok(())
}

/// Products reading 16-bit operands (the copies autograd keeps for
/// backward), packed on each device: A, B or both in 16 bits; odd sizes, so
/// rows and batches start in the middle of a word; the specials among the
/// values.
fn matmul_half(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0x16b17);
    let sp = specials();
    for (batch, m, k, n, causal) in [
        (1, 3, 5, 7, Causal::No),
        (3, 7, 9, 5, Causal::No),
        (2, 33, 17, 35, Causal::No),
        (2, 19, 7, 19, Causal::Outputs),
        (2, 19, 19, 7, Causal::TermsUpToRow),
    ] {
        for fmt in [Format::Bf16, Format::Fp16] {
            for (ha, hb) in [(true, false), (false, true), (true, true)] {
                for (ta, tb) in [(false, false), (true, false), (false, true)] {
                    let mut a: Vec<f32> = (0..batch * m * k).map(|_| rng.moderate()).collect();
                    let b: Vec<f32> = (0..batch * k * n).map(|_| rng.moderate()).collect();
                    for (i, v) in a.iter_mut().enumerate() {
                        if i % 7 == 3 {
                            *v = sp[i % sp.len()];
                        }
                    }
                    let d = dims(batch, m, k, n, ta, tb, m * k, k * n, causal);
                    let which = match (ha, hb) {
                        (true, false) => "A",
                        (false, true) => "B",
                        _ => "A and B",
                    };
                    let case = format!("{which} in 16 bits: {}", d.describe(Some(fmt)));
                    let variant = format!("{fmt} operands read from 16-bit storage");
                    sw.check("matmul", &variant, case, &[], |dev| {
                        operand(&a, ha.then_some(fmt), dev)?
                            .matmul(&operand(&b, hb.then_some(fmt), dev)?, d, Some(fmt))?
                            .to_vec_f32()
                    })?;
                }
            }
        }
    }
    Ok(())
}

/// Products over token-major operands (attention's `v`, `y` and their
/// gradients, read and written in place: [`TokenMajor`]): every layout, each
/// operand and the output token-major alone and together, f32 and bf16,
/// 16-bit operands, an addend, and attention's three masked products.
fn matmul_tokens(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0x70ce);
    let sp = specials();
    let marks = [
        [true, false, false],
        [false, true, false],
        [false, false, true],
        [false, true, true],
        [true, true, false],
        [true, true, true],
    ];
    let mut case = |sw: &mut Sweep,
                    (seqs, h): (usize, usize),
                    (m, k, n): (usize, usize, usize),
                    d: MatmulDims,
                    halves: [Option<Format>; 2],
                    round: Option<Format>,
                    added: bool|
     -> Result<()> {
        let batch = seqs * h;
        let mut a: Vec<f32> = (0..batch * m * k).map(|_| rng.moderate()).collect();
        let b: Vec<f32> = (0..batch * k * n).map(|_| rng.moderate()).collect();
        let e: Vec<f32> = (0..batch * m * n).map(|_| rng.moderate()).collect();
        for (i, v) in a.iter_mut().enumerate() {
            if i % 11 == 4 {
                *v = sp[i % sp.len()];
            }
        }
        let half = |f: Option<Format>| f.map_or(String::new(), |f| format!(", {f} storage"));
        let what = format!(
            "{}{}{}{}",
            if added { "e + " } else { "" },
            d.describe(round),
            half(halves[0]).replace("storage", "A"),
            half(halves[1]).replace("storage", "B")
        );
        let variant = format!("{} token-major", round.map_or("f32", Format::name));
        sw.check("matmul", &variant, what, &[], |dev| {
            let (x, y) = (operand(&a, halves[0], dev)?, operand(&b, halves[1], dev)?);
            match added {
                true => x.matmul_add(&y, d, round, &up(&e, dev)?),
                false => x.matmul(&y, d, round),
            }?
            .to_vec_f32()
        })
    };
    let place = |d: MatmulDims, h: usize, [a, b, c]: [bool; 3]| MatmulDims {
        tokens: TokenMajor { heads: h, a, b, c },
        ..d
    };
    for (seqs, h, (m, k, n)) in [(1, 2, (5, 3, 4)), (2, 3, (7, 4, 9)), (2, 2, (33, 9, 70))] {
        let batch = seqs * h;
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for mark in marks {
                for round in [None, Some(Format::Bf16)] {
                    let d = dims(batch, m, k, n, ta, tb, m * k, k * n, Causal::No);
                    case(
                        sw,
                        (seqs, h),
                        (m, k, n),
                        place(d, h, mark),
                        [None; 2],
                        round,
                        false,
                    )?;
                }
            }
        }
    }
    // attention's products as the batched composition asks for them: y = p v,
    // dv = pᵀ dy, dp = dy vᵀ (v in 16 bits, as autograd keeps it)
    for (seqs, h, t, w) in [(2, 3, 19, 4), (1, 2, 70, 8)] {
        let batch = seqs * h;
        for fmt in [None, Some(Format::Bf16)] {
            let up_to = dims(
                batch,
                t,
                t,
                w,
                false,
                false,
                t * t,
                t * w,
                Causal::TermsUpToRow,
            );
            let from = dims(
                batch,
                t,
                t,
                w,
                true,
                false,
                t * t,
                t * w,
                Causal::TermsFromRow,
            );
            let outputs = dims(batch, t, w, t, false, true, t * w, w * t, Causal::Outputs);
            for (d, mkn, mark, half_b) in [
                (up_to, (t, t, w), [false, true, true], fmt),
                (from, (t, t, w), [false, true, true], None),
                (outputs, (t, w, t), [true, true, false], fmt),
            ] {
                case(
                    sw,
                    (seqs, h),
                    mkn,
                    place(d, h, mark),
                    [None, half_b],
                    fmt,
                    false,
                )?;
            }
        }
    }
    // an addend laid out as the token-major output
    for round in [None, Some(Format::Bf16)] {
        let d = dims(6, 7, 5, 9, false, false, 35, 45, Causal::No);
        case(
            sw,
            (2, 3),
            (7, 5, 9),
            place(d, 3, [true, false, true]),
            [None; 2],
            round,
            true,
        )?;
        case(
            sw,
            (2, 3),
            (7, 5, 9),
            place(d, 3, [false, true, false]),
            [None; 2],
            round,
            true,
        )?;
    }
    Ok(())
}

/// Products with an addend (`e + c` per output: gradient accumulation and
/// residual sums written by the product): every layout, f32 and bf16, a k
/// long enough for two passes of the GPU's loop; specials in the addend,
/// 16-bit A on some.
fn matmul_added(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0xadd);
    let sp = specials();
    for (batch, m, k, n, bcb) in [
        (1, 5, 7, 3, false),
        (2, 33, 17, 35, false),
        (3, 65, 30, 71, true),
        (1, 2, 16_500, 3, false),
    ] {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for round in [None, Some(Format::Bf16)] {
                let nb = if bcb { 1 } else { batch };
                let a: Vec<f32> = (0..batch * m * k).map(|_| rng.moderate()).collect();
                let b: Vec<f32> = (0..nb * k * n).map(|_| rng.moderate()).collect();
                let mut e: Vec<f32> = (0..batch * m * n).map(|_| rng.moderate()).collect();
                for (i, v) in e.iter_mut().enumerate() {
                    if i % 5 == 2 {
                        *v = sp[i % sp.len()];
                    }
                }
                let d = dims(
                    batch,
                    m,
                    k,
                    n,
                    ta,
                    tb,
                    m * k,
                    if bcb { 0 } else { k * n },
                    Causal::No,
                );
                let half = round.filter(|_| m % 2 == 1);
                let variant = format!("{} with an addend", round.map_or("f32", Format::name));
                let case = format!(
                    "e + {}{}",
                    d.describe(round),
                    if half.is_some() { ", A in 16 bits" } else { "" }
                );
                sw.check("matmul", &variant, case, &[], |dev| {
                    operand(&a, half, dev)?
                        .matmul_add(&Operand::Values(up(&b, dev)?), d, round, &up(&e, dev)?)?
                        .to_vec_f32()
                })?;
            }
        }
    }
    Ok(())
}

/// One A times several weights, `x Wᵢᵀ` (a Llama's q, k and v, its gate
/// and up): each output the product's own bits. The weights laid side by
/// side (on a GPU one dispatch for up to three, each writing its own
/// buffer) or apart (one product each); ragged shapes; four weights (two
/// dispatches).
fn matmul_shared(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0x5a3ed);
    let sp = specials();
    for (count, m, k, n, together) in [
        (3, 8, 33, 16, true),
        (2, 64, 64, 64, true),
        (3, 9, 17, 35, true),
        (4, 9, 17, 35, true),
        (3, 8, 33, 16, false),
        (1, 8, 5, 8, true),
    ] {
        let mut x: Vec<f32> = (0..m * k).map(|_| rng.moderate()).collect();
        for (i, v) in x.iter_mut().enumerate() {
            if i % 13 == 4 {
                *v = sp[i % sp.len()];
            }
        }
        let ws: Vec<Vec<f32>> = (0..count)
            .map(|_| (0..n * k).map(|_| rng.moderate()).collect())
            .collect();
        let d = dims(1, m, k, n, false, true, 0, 0, Causal::No);
        for round in [None, Some(Format::Bf16), Some(Format::Fp16)] {
            let variant = format!("{} x·Wᵢᵀ, one A", round.map_or("f32", Format::name));
            let case = format!(
                "{count} weights {}, {}",
                if together { "side by side" } else { "apart" },
                d.describe(round)
            );
            sw.check("matmul", &variant, case, &[], |dev| {
                let ws = ws.iter().map(|w| up(w, dev)).collect::<Result<Vec<_>>>()?;
                let refs: Vec<&Storage> = ws.iter().collect();
                let ws = if together {
                    Storage::colocate(&refs, false)?
                } else {
                    ws.clone()
                };
                let mut out = Vec::new();
                // A kept in 16 bits as the product reads it (autograd's copy)
                let (ys, kept) = Operand::Values(up(&x, dev)?).matmul_shared(
                    &ws.iter().collect::<Vec<_>>(),
                    d,
                    round,
                    round,
                )?;
                for y in ys {
                    out.extend(y.to_vec_f32()?);
                }
                if let Some((p, _)) = kept {
                    out.extend(word_halves(p.words().to_vec_f32()?));
                }
                Ok(out)
            })?;
        }
    }
    Ok(())
}

/// Two products over one A, `A·B₀` and `Aᵀ·B₁` (a product's two gradients
/// from dC: dX = dC·W and dW = dCᵀ·X), each its own bits: on a GPU one
/// dispatch. A batch folded into the rows, ragged and unequal widths,
/// either addend, B₁ in 16 bits, and pairs run apart: B₁ in B₀'s buffer,
/// and a long `k` past a guarded product's pass.
fn matmul_pair(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0x9a12);
    let sp = specials();
    for (batch, m, k, n0, n1, adds, same) in [
        (1, 8, 5, 8, 8, (false, false), false),
        (2, 33, 17, 35, 35, (true, true), false),
        (3, 65, 30, 71, 9, (false, true), false),
        (1, 9, 70, 3, 130, (true, false), false),
        (1, 12, 12, 12, 12, (false, true), true),
        (1, 4100, 3, 2, 3, (true, true), false),
    ] {
        let rows = batch * m;
        let mut a: Vec<f32> = (0..rows * k).map(|_| rng.moderate()).collect();
        for (i, v) in a.iter_mut().enumerate() {
            if i % 11 == 3 {
                *v = sp[i % sp.len()];
            }
        }
        let b0: Vec<f32> = (0..k * n0).map(|_| rng.moderate()).collect();
        let b1: Vec<f32> = match same {
            true => b0.clone(),
            false => (0..rows * n1).map(|_| rng.moderate()).collect(),
        };
        let e0: Vec<f32> = (0..rows * n0).map(|_| rng.moderate()).collect();
        let e1: Vec<f32> = (0..k * n1).map(|_| rng.moderate()).collect();
        let d0 = dims(batch, m, k, n0, false, false, m * k, 0, Causal::No);
        let d1 = dims(1, k, rows, n1, true, false, 0, 0, Causal::No);
        for round in [None, Some(Format::Bf16), Some(Format::Fp16)] {
            // B₁ kept in 16 bits as autograd keeps an activation (not when
            // it is B₀'s buffer)
            let half = round.filter(|_| !same);
            let variant = format!(
                "{} A·B₀ and Aᵀ·B₁, one A",
                round.map_or("f32", Format::name)
            );
            let case = format!(
                "{}{} and {}{}{}{}",
                if adds.0 { "e₀ + " } else { "" },
                d0.describe(round),
                if adds.1 { "e₁ + " } else { "" },
                d1.describe(round),
                if half.is_some() {
                    ", B₁ in 16 bits"
                } else {
                    ""
                },
                if same { ", B₁ in B₀'s buffer" } else { "" },
            );
            sw.check("matmul", &variant, case, &[], |dev| {
                let a = up(&a, dev)?;
                let b0 = up(&b0, dev)?;
                let b1 = match same {
                    true => Operand::Values(b0.clone()),
                    false => operand(&b1, half, dev)?,
                };
                let jobs = [
                    Product {
                        a: Operand::Values(a.clone()),
                        b: Operand::Values(b0),
                        dims: d0,
                        addend: adds.0.then(|| up(&e0, dev)).transpose()?,
                    },
                    Product {
                        a: Operand::Values(a),
                        b: b1,
                        dims: d1,
                        addend: adds.1.then(|| up(&e1, dev)).transpose()?,
                    },
                ];
                let [x, y] = Operand::matmul_pair(jobs, round)?;
                let mut out = x.to_vec_f32()?;
                out.extend(y.to_vec_f32()?);
                Ok(out)
            })?;
        }
    }
    Ok(())
}

/// A product that also keeps A in 16 bits (autograd's copy of an
/// activation, on a GPU written by the product's own dispatch): the
/// product's bits and pack's words. Odd `k` (words across rows), row blocks
/// past 64 (and across them), dense and broadcast batches, an odd count
/// (a last word half used), an addend, and a transposed A (packed apart).
fn matmul_keeping_a(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0x4ee9);
    for (batch, m, k, n, a_bs, b_bs, ta, add) in [
        (1, 8, 5, 8, 40, 0, false, false),
        (1, 130, 7, 9, 910, 0, false, false),
        (3, 65, 33, 17, 65 * 33, 0, false, true),
        (3, 9, 17, 35, 0, 17 * 35, false, false),
        (3, 5, 3, 4, 15, 12, false, false),
        (2, 9, 5, 6, 45, 30, true, false),
    ] {
        let count = if a_bs == 0 { m * k } else { batch * m * k };
        let a = adversarial(&mut rng, count);
        let b: Vec<f32> = (0..(if b_bs == 0 { 1 } else { batch }) * k * n)
            .map(|_| rng.moderate())
            .collect();
        let e: Vec<f32> = (0..batch * m * n).map(|_| rng.moderate()).collect();
        let d = dims(batch, m, k, n, ta, false, a_bs, b_bs, Causal::No);
        for fmt in [Format::Bf16, Format::Fp16] {
            let case = format!(
                "{}{}, A kept",
                if add { "e + " } else { "" },
                d.describe(Some(fmt))
            );
            sw.check("matmul", &format!("{fmt} keeping A"), case, &[], |dev| {
                let e = up(&e, dev)?;
                let (c, (p, _)) = up(&a, dev)?.matmul_keeping_a(
                    &up(&b, dev)?,
                    d,
                    Some(fmt),
                    add.then_some(&e),
                    fmt,
                )?;
                let mut out = c.to_vec_f32()?;
                out.extend(word_halves(p.words().to_vec_f32()?));
                Ok(out)
            })?;
        }
    }
    Ok(())
}

/// The product of SwiGLU's output (`Storage::swiglu_matmul`: on a GPU
/// computed as the product loads A), alone and keeping the three 16-bit
/// copies autograd keeps: the product's bits and pack's words of the output,
/// the gate and up. The gate spans sigmoid's overflow and specials; odd `k`
/// (words across rows), row blocks past 64, an odd count, an addend; and a
/// long `k` (finite gates) with tiny weights among B, so that every bf16
/// chain runs again on a device whose fma is not fused (lavapipe's loop
/// cap, passes).
fn swiglu_matmul(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(0x5e1d);
    for (m, k, n, add, long) in [
        (8, 5, 8, false, false),
        (130, 7, 9, true, false),
        (65, 33, 17, false, false),
        (3, 3, 70, true, false),
        (3, 5000, 3, false, true),
    ] {
        let sp = specials();
        let gate: Vec<f32> = (0..m * k)
            .map(|i| match i % 13 {
                5 if !long => sp[rng.below(sp.len())],
                3 => rng.unif(-100.0, 100.0),
                _ => rng.unif(-12.0, 12.0),
            })
            .collect();
        let upv: Vec<f32> = (0..m * k).map(|_| rng.moderate()).collect();
        let w: Vec<f32> = (0..k * n)
            .map(|i| {
                if long && i % 3 == 0 {
                    1e-36
                } else {
                    rng.moderate()
                }
            })
            .collect();
        let e: Vec<f32> = (0..m * n).map(|_| rng.moderate()).collect();
        let d = dims(1, m, k, n, false, true, 0, 0, Causal::No);
        for (round, keep) in [
            (None, None),
            (Some(Format::Bf16), None),
            (Some(Format::Bf16), Some(Format::Bf16)),
            (Some(Format::Fp16), Some(Format::Fp16)),
        ] {
            let plus = if add { "e + " } else { "" };
            let case = format!("{plus}swiglu(g, u)·Wᵀ, {}", d.describe(round));
            let variant = match keep {
                Some(f) => format!("swiglu A, keeping {f}"),
                None => "swiglu A".to_string(),
            };
            sw.check("matmul", &variant, case, &[&gate, &upv], |dev| {
                let e = up(&e, dev)?;
                let (c, kept) = up(&gate, dev)?.swiglu_matmul(
                    &up(&upv, dev)?,
                    &up(&w, dev)?,
                    d,
                    round,
                    add.then_some(&e),
                    keep,
                )?;
                let mut out = c.to_vec_f32()?;
                // SwiGLU's output's words as values (a NaN's sign and payload
                // are the arithmetic's, which the contract leaves open), the
                // gate's and up's as patterns
                for (i, (p, _)) in kept.into_iter().flatten().enumerate() {
                    match i {
                        0 => out.extend(p.unpack()?.to_vec_f32()?),
                        _ => out.extend(word_halves(p.words().to_vec_f32()?)),
                    }
                }
                Ok(out)
            })?;
        }
    }
    Ok(())
}

/// `fma(a, b, c)` alone, as a batched `(1, 2) @ (2, 1)` with A = [c, a] and
/// B = [1, b] (`fma(a, b, fma(c, 1, +0))`): `(A, B)` for triples built to
/// stress the single rounding (near-total cancellation, ties, subnormal
/// results, overflow, specials), and `f32::mul_add`'s answers.
pub fn fma_triples(n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng(0x5eed);
    let sp = specials();
    let (mut a, mut b, mut want) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let x = if i % 7 == 0 {
            sp[rng.below(sp.len())]
        } else {
            rng.moderate()
        };
        let y = match i % 5 {
            0 => f32::from_bits(rng.next() as u32 & 0xbfff_ffff), // any small-ish exponent
            1 => sp[rng.below(sp.len())],
            _ => rng.moderate(),
        };
        let c = match i % 6 {
            // cancel the rounded product: only the product's rounding error survives
            0 | 1 => -(x * y),
            2 => -(x * y) * (1.0 + 2f32.powi(-20)),
            3 => rng.bits(),
            4 => sp[rng.below(sp.len())],
            _ => rng.moderate() * 2f32.powi(rng.below(60) as i32 - 30),
        };
        let c = if c == 0.0 { 0.0 } else { c }; // -0 would become +0 in the first step
        a.extend_from_slice(&[c, x]);
        b.extend_from_slice(&[1.0, y]);
        want.push(x.mul_add(y, c));
    }
    (a, b, want)
}

fn matmul_bits(sw: &mut Sweep) -> Result<()> {
    let n = 20_000;
    let (a, b, _) = fma_triples(n);
    let d = dims(n, 1, 2, 1, false, false, 2, 2, Causal::No);
    matmul_case(
        sw,
        Some("f32 fma triples"),
        &a,
        &b,
        d,
        None,
        "(c, a)·(1, b) = fma(a, b, c): ",
    )?;
    // short k with operands of every bit pattern: one or two general fmas
    // each, on specials, subnormals, overflow and ties
    let mut rng = Rng(0xabcdef);
    let sp = specials();
    for k in [1usize, 2, 3] {
        let (m, n) = (40, 40);
        let mut pick = |i: usize| match i % 3 {
            0 => rng.bits(),
            1 => sp[rng.below(sp.len())],
            _ => {
                // exponents near the subnormal and overflow edges
                let e = [0u32, 1, 2, 60, 63, 64, 65, 190, 191, 192, 253, 254][rng.below(12)];
                f32::from_bits((rng.next() as u32 & 0x807f_ffff) | (e << 23))
            }
        };
        let a: Vec<f32> = (0..m * k).map(&mut pick).collect();
        let b: Vec<f32> = (0..k * n).map(&mut pick).collect();
        let d = dims(1, m, k, n, false, false, 0, 0, Causal::No);
        matmul_case(sw, None, &a, &b, d, None, "random bits: ")?;
    }
    // k longer than lavapipe's 65,535 loop iterations (run in passes)
    let k = 70_001;
    let mut rng = Rng(91);
    let a: Vec<f32> = (0..k).map(|_| rng.moderate()).collect();
    let b: Vec<f32> = (0..2 * k).map(|_| rng.moderate()).collect();
    for round in [None, Some(Format::Bf16)] {
        let d = dims(1, 1, k, 2, false, false, 0, 0, Causal::No);
        matmul_case(
            sw,
            None,
            &a,
            &b,
            d,
            round,
            "past a 65,535-iteration loop cap: ",
        )?;
    }
    Ok(())
}

/// bf16 products outside f32's normal range, which a device's fma rounds
/// once only when it is fused: where it is not, the kernels track the
/// magnitudes of the operands a chain reads and, where some product may leave
/// the range, run the chain again with the exact `fma_c` (`matmul.wgsl`).
/// Identical on every device, like every other row.
fn matmul_outside_normal_range(sw: &mut Sweep) -> Result<()> {
    use crate::backend::round::round_f64;
    let p2 = |k: i32| 2f32.powi(k);
    let variant = "bf16, products outside f32's normal range";
    // (c, x, y): the output is bf16(fma(x, y, c)); an unfused fma rounds x·y
    // to inf first
    let mut triples = vec![
        (-1.5 * p2(127), p2(64), p2(64)), // x·y = 2^128 overflows; the sum is 2^126
        (-1.5 * p2(127), 1.5 * p2(63), p2(64)), // 1.5·2^127 − 1.5·2^127 = 0 exactly
        (-p2(127), 1.25 * p2(64), 1.25 * p2(63)),
    ];
    // random bf16 products just past f32's largest, brought back by c
    let mut rng = Rng(0xb16);
    while triples.len() < 64 {
        let bf =
            |rng: &mut Rng, e: u32| f32::from_bits(((rng.next() as u32) & 0x807f_0000) | (e << 23));
        let ex = 190 + rng.below(64) as u32;
        let (x, y) = (bf(&mut rng, ex), bf(&mut rng, 382 - ex));
        let u = 0.5 + 0.25 * rng.unif(0.0, 1.0) as f64;
        let c = round_f64(-(x as f64) * (y as f64) * u, Format::Bf16) as f32;
        if c.is_finite() && x.is_finite() && y.is_finite() {
            triples.push((c, x, y));
        }
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for &(c, x, y) in &triples {
        a.extend_from_slice(&[c, x]);
        b.extend_from_slice(&[1.0, y]);
    }
    let n = triples.len();
    let d = dims(n, 1, 2, 1, false, false, 2, 2, Causal::No);
    matmul_case(
        sw,
        Some(variant),
        &a,
        &b,
        d,
        Some(Format::Bf16),
        "(c, a)·(1, b) = fma(a, b, c): ",
    )?;
    // a product below f32's normal range at a bf16 tie: 2^-125 + 2^-133 is
    // halfway between two bf16 values, and x·y = 2^-149 + 2^-156 decides the
    // side only if it is not rounded to 2^-149 first
    let (a, b) = (
        [p2(-125), p2(-133), 1.0078125 * p2(-75)],
        [1.0, 1.0, p2(-74)],
    );
    let d = dims(1, 1, 3, 1, false, false, 3, 3, Causal::No);
    matmul_case(
        sw,
        Some(variant),
        &a,
        &b,
        d,
        Some(Format::Bf16),
        "(c, t, x)·(1, 1, y) = fma(x, y, c + t): ",
    )?;
    Ok(())
}

// ------------------------------------------------------------ attention ----

/// Causal attention as one primitive per direction: the CPU's per-head chain
/// against the spec's batched composition, head-major and token-major,
/// ragged lengths, in f32 and under both autocast formats, and under cast
/// policies that give the scores and the probabilities formats of their own.
fn attention(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(53);
    let (bf, fp) = (Some(Format::Bf16), Some(Format::Fp16));
    // (the products with v, the scores' products, the probabilities)
    let formats = [
        (None, None, None),
        (bf, bf, None),
        (fp, fp, None),
        (fp, bf, bf),
        (None, None, fp),
    ];
    // (heads, T, D, token-major heads, the factors of q and k, of v and of
    // dy): in the last three, some of the scores' products pass f32's largest
    // value, some of p v's fall among its subnormals, and some of dy vᵀ's and
    // ds k's pass the largest value, where a device whose fma is not fused
    // runs a bf16 chain again with the exact fma
    let shapes = [
        (3, 13, 8, None, [1.0, 1.0, 1.0]),
        (4, 33, 16, Some(2), [1.0, 1.0, 1.0]),
        (1, 70, 5, None, [1.0, 1.0, 1.0]),
        (2, 9, 6, None, [8.6e17, 1.0, 1.0]),
        (2, 9, 6, None, [0.1, 1e-40, 1.0]),
        (2, 9, 6, None, [1.0, 8.6e17, 8.6e17]),
    ];
    for (heads, t, d, tokens, factors) in shapes {
        for (round, scores, probs) in formats {
            let n = heads * t * d;
            let [qk, vf, gf] = factors;
            let [q, k, v, g]: [Vec<f32>; 4] = std::array::from_fn(|i| {
                let f = [qk, qk, vf, gf][i];
                (0..n).map(|_| rng.moderate() * f).collect()
            });
            let mut case = format!("heads {heads} t {t} d {d} tokens {tokens:?}");
            if factors != [1.0; 3] {
                case += &format!(" q, k x{qk:e} v x{vf:e} dy x{gf:e}");
            }
            let a = Attention {
                heads,
                t,
                d,
                scale: 1.0 / (d as f32).sqrt(),
                round,
                scores,
                probs,
                tokens,
            };
            attention_case(sw, &a, [&q, &k, &v, &g], None, &case)?;
            // q, k and v as autograd keeps them: 16-bit words, read widened
            if round.is_some() && round == scores && probs.is_none() {
                attention_case(sw, &a, [&q, &k, &v, &g], round, &case)?;
            }
        }
    }
    // RoPE inside attention (q and k token-major like v, rotated as they
    // are read and rotated back in their gradients): under bf16 products, and
    // float32 ones with the rotated values rounded on their own, the tables
    // side by side (as the model lays them out: a GPU rotates as it reads)
    let (heads, t, d, h) = (4, 33, 16, 2);
    let (cos, sin) = crate::nn::llama::rope_tables(t, d, 10000.0);
    let [q, k, v, g]: [Vec<f32>; 4] =
        std::array::from_fn(|_| (0..heads * t * d).map(|_| rng.moderate()).collect());
    for (round, rope) in [(bf, None), (None, fp)] {
        let a = Attention {
            heads,
            t,
            d,
            scale: 1.0 / (d as f32).sqrt(),
            round,
            scores: round,
            probs: None,
            tokens: Some(h),
        };
        let r = Rotary { round: rope };
        rope_attention_case(sw, &a, r, [&q, &k, &v, &g], [&cos, &sin])?;
    }
    // Rows past a software device's loop cap in the GPU's attention kernels
    // (80 keys of 2,560), where it runs the composition instead.
    let (t, d) = (80, 2560);
    let [q, k, v, g]: [Vec<f32>; 4] =
        std::array::from_fn(|_| (0..t * d).map(|_| rng.moderate()).collect());
    let long = Attention {
        heads: 1,
        t,
        d,
        scale: 1.0 / (d as f32).sqrt(),
        round: bf,
        scores: bf,
        probs: None,
        tokens: None,
    };
    attention_case(
        sw,
        &long,
        [&q, &k, &v, &g],
        None,
        "heads 1 t 80 d 2560 tokens None",
    )?;
    // Planted (one head, T 2, D 2): chains whose first product is in range
    // and whose second passes f32's largest value the other way, so the exact
    // sum is in range and an unfused fma's infinite — dy vᵀ's, and ds k's
    // (equal scores, p = 1/2; dp 0 and 8.485 give ds ±1.5 against keys 2e38
    // and 3e38).
    let planted: [(&str, [[f32; 4]; 4]); 2] = [
        (
            "dy vᵀ past the range",
            [
                [0.0; 4],
                [0.0; 4],
                [2e19, 2e19, 2e19, 2e19],
                [-1.5e19, 2e19, -1.5e19, 2e19],
            ],
        ),
        (
            "ds k past the range",
            [
                [0.0, 1.0, 0.0, 1.0],
                [2e38, 1.0, 3e38, 1.0],
                [0.0, 0.0, 8.485, 0.0],
                [1.0, 0.0, 1.0, 0.0],
            ],
        ),
    ];
    for (case, [q, k, v, g]) in planted {
        for (round, scores, probs) in formats {
            let a = Attention {
                heads: 1,
                t: 2,
                d: 2,
                scale: 1.0 / 2f32.sqrt(),
                round,
                scores,
                probs,
                tokens: None,
            };
            attention_case(sw, &a, [&q, &k, &v, &g], None, case)?;
        }
    }
    Ok(())
}

/// One attention case each way: `[q, k, v, dy]`, q, k and v read as values
/// or kept in `half`'s 16 bits.
fn attention_case(
    sw: &mut Sweep,
    a: &Attention,
    [q, k, v, g]: [&[f32]; 4],
    half: Option<Format>,
    case: &str,
) -> Result<()> {
    let f = |x: Option<Format>| x.map_or("f32", Format::name);
    let mut variant = f(a.round).to_string();
    if a.scores != a.round || a.probs.is_some() {
        variant += &format!(" scores {} probs {}", f(a.scores), f(a.probs));
    }
    if a.tokens.is_some() {
        variant += " token-major";
    }
    if half.is_some() {
        variant += " kept 16-bit";
    }
    let ops = |dev: Device| -> Result<[Operand; 3]> {
        Ok([
            operand(q, half, dev)?,
            operand(k, half, dev)?,
            operand(v, half, dev)?,
        ])
    };
    sw.check("attention", &variant, case.to_string(), &[], |dev| {
        let [q, k, v] = ops(dev)?;
        a.forward(&q, &k, &v)?.to_vec_f32()
    })?;
    // the forward also making the 16-bit copies autograd keeps (on a GPU
    // written by its dispatch where D is even), widened back
    if let (None, Some(fq), Some(fv)) = (half, a.scores, a.round) {
        let keeping = format!("{variant} keeping q, k, v");
        sw.check("attention", &keeping, case.to_string(), &[], |dev| {
            let (y, words) =
                a.forward_keeping(&up(q, dev)?, &up(k, dev)?, &up(v, dev)?, [fq, fv])?;
            let mut out = y.to_vec_f32()?;
            for (w, _) in words {
                out.extend(w.unpack()?.to_vec_f32()?);
            }
            Ok(out)
        })?;
    }
    sw.check(
        "attention backward",
        &variant,
        case.to_string(),
        &[],
        |dev| {
            let [q, k, v] = ops(dev)?;
            let mut out = Vec::new();
            for s in a.backward(&q, &k, &v, &up(g, dev)?)? {
                out.extend(s.to_vec_f32()?);
            }
            Ok(out)
        },
    )
}

/// Attention with RoPE each way (`[q, k, v, dy]`, `tables` cos and sin, laid
/// side by side): the forward, the forward keeping what backward reads (the
/// rotated q and k as the scores' products read them, v's 16-bit copy), and
/// the backward from those.
fn rope_attention_case(
    sw: &mut Sweep,
    a: &Attention,
    r: Rotary,
    [q, k, v, g]: [&[f32]; 4],
    [cos, sin]: [&[f32]; 2],
) -> Result<()> {
    let f = |x: Option<Format>| x.map_or("f32", Format::name);
    let keep = Some((a.scores, a.round));
    let variant = format!("{} rope {}", f(a.round), f(r.round));
    let case = format!(
        "heads {} t {} d {} tokens {:?}",
        a.heads, a.t, a.d, a.tokens
    );
    let tables = |dev: Device| -> Result<[Storage; 2]> {
        let mut cs = Storage::colocate(&[&up(cos, dev)?, &up(sin, dev)?], false)?.into_iter();
        match (cs.next(), cs.next()) {
            (Some(c), Some(s)) => Ok([c, s]),
            _ => crate::bail!(Device, "colocate: two tables in, fewer out"),
        }
    };
    let forward = |dev: Device, keep| {
        let [c, s] = tables(dev)?;
        a.forward_rope(
            r,
            [&up(q, dev)?, &up(k, dev)?, &up(v, dev)?],
            [&c, &s],
            keep,
        )
    };
    sw.check("attention", &variant, case.clone(), &[], |dev| {
        forward(dev, None)?.0.to_vec_f32()
    })?;
    let keeping = format!("{variant} keeping q, k, v");
    sw.check("attention", &keeping, case.clone(), &[], |dev| {
        let (y, kept) = forward(dev, keep)?;
        let mut out = y.to_vec_f32()?;
        let Some((qk, vw)) = kept else {
            crate::bail!(Device, "a keeping forward kept nothing");
        };
        for op in qk {
            out.extend(match op {
                Operand::Values(s) => s.to_vec_f32()?,
                Operand::Half(p) => p.unpack()?.to_vec_f32()?,
            });
        }
        if let Some((w, _)) = vw {
            out.extend(w.unpack()?.to_vec_f32()?);
        }
        Ok(out)
    })?;
    sw.check("attention backward", &variant, case, &[], |dev| {
        let (_, kept) = forward(dev, keep)?;
        let Some(([kq, kk], vw)) = kept else {
            crate::bail!(Device, "a keeping forward kept nothing");
        };
        let kv = match vw {
            Some((w, _)) => Operand::Half(w),
            None => Operand::Values(up(v, dev)?),
        };
        let [c, s] = tables(dev)?;
        let mut out = Vec::new();
        for s in a.backward_rope(r, [&kq, &kk, &kv], &up(g, dev)?, [&c, &s])? {
            out.extend(s.to_vec_f32()?);
        }
        Ok(out)
    })
}

// ----------------------------------------------------------- data moves ----

fn copy(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(17);
    let x = adversarial(&mut rng, 720);
    // (shape, strides, offset): whole, transpose, slices, permute, expand
    let cases: Vec<(Vec<usize>, Vec<usize>, usize)> = vec![
        (vec![720], vec![1], 0),
        (vec![6, 120], vec![120, 1], 0),
        (vec![120, 6], vec![1, 120], 0),
        (vec![3, 4], vec![20, 2], 7),
        (vec![2, 3, 4, 5], vec![1, 2, 6, 24], 0),
        (vec![4, 5], vec![0, 1], 100),
        (vec![2, 2, 2, 2, 2, 2], vec![1, 2, 4, 8, 16, 32], 5),
        (vec![1, 1, 1], vec![0, 0, 0], 719),
        (vec![0, 5], vec![5, 1], 0),
        (vec![], vec![], 3),
    ];
    for (shape, strides, off) in cases {
        let case = format!("shape {shape:?} strides {strides:?} offset {off}");
        sw.check("strided copy", "", case, &[], |d| {
            up(&x, d)?.strided_copy(&shape, &strides, off)?.to_vec_f32()
        })?;
    }
    let mut rng = Rng(23);
    for (outer, sizes, inner) in [
        (3usize, vec![2usize, 0, 5, 1], 4usize),
        (1, vec![7], 1),
        (5, vec![1, 1], 3),
    ] {
        let parts: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&s| adversarial(&mut rng, outer * s * inner))
            .collect();
        let case = format!("({outer}, {sizes:?}, {inner})");
        sw.check("concat", "", case, &[], |d| {
            let st: Vec<Storage> = parts.iter().map(|p| up(p, d)).collect::<Result<_>>()?;
            let refs: Vec<&Storage> = st.iter().collect();
            Storage::concat(&refs, outer, &sizes, inner)?.to_vec_f32()
        })?;
    }
    // repeated ids, unused rows, out of order
    let mut rng = Rng(29);
    let (v, dd) = (11, 6);
    let table = adversarial(&mut rng, v * dd);
    let ids: Vec<u32> = vec![3, 0, 3, 10, 7, 3, 0, 5, 5, 5, 1, 3];
    sw.check(
        "gather rows",
        "",
        format!("{} ids from ({v}, {dd})", ids.len()),
        &[],
        |d| up(&table, d)?.gather_rows(&ids, dd)?.to_vec_f32(),
    )?;
    // gradients whose sums depend on order (cancellation, mixed magnitudes)
    let mut grad = Vec::new();
    for i in 0..ids.len() * dd {
        grad.push(match i % 4 {
            0 => rng.moderate() * 1e8,
            1 => rng.moderate(),
            2 => [-0.0, 1e-45, f32::INFINITY, -1e-40][rng.below(4)],
            _ => rng.moderate() * 1e-8,
        });
    }
    sw.check(
        "scatter-add rows",
        "",
        format!("{} ids into ({v}, {dd})", ids.len()),
        &[],
        |d| {
            up(&grad, d)?
                .scatter_add_rows(&ids, v, dd, None)?
                .to_vec_f32()
        },
    )?;
    sw.check(
        "scatter-add rows",
        "",
        "no ids into (3, 2)".into(),
        &[],
        |d| up(&[], d)?.scatter_add_rows(&[], 3, 2, None)?.to_vec_f32(),
    )?;
    // one row gathered 70,001 times: its gradient sums every one, past a loop cap
    let n = 70_001;
    let mut rng = Rng(91);
    let x: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
    let ids = vec![1u32; n];
    sw.check(
        "scatter-add rows",
        "",
        format!("{n} ids all into row 1 of (3, 1)"),
        &[],
        |d| up(&x, d)?.scatter_add_rows(&ids, 3, 1, None)?.to_vec_f32(),
    )?;
    // added to an earlier gradient (accumulation), in one pass and past it
    let earlier: Vec<f32> = (0..3).map(|_| rng.moderate() * 1e3).collect();
    sw.check(
        "scatter-add rows",
        "adding",
        format!("{n} ids all into row 1 of (3, 1)"),
        &[],
        |d| {
            up(&x, d)?
                .scatter_add_rows(&ids, 3, 1, Some(&up(&earlier, d)?))?
                .to_vec_f32()
        },
    )?;
    let earlier: Vec<f32> = (0..v * dd).map(|_| rng.moderate()).collect();
    let ids: Vec<u32> = (0..grad.len() / dd).map(|i| (i * 5 % v) as u32).collect();
    sw.check(
        "scatter-add rows",
        "adding",
        format!("{} ids into ({v}, {dd})", ids.len()),
        &[],
        |d| {
            up(&grad, d)?
                .scatter_add_rows(&ids, v, dd, Some(&up(&earlier, d)?))?
                .to_vec_f32()
        },
    )
}

// ------------------------------------------------------- 16-bit storage ----

/// 16-bit words as their halves' patterns, so NaN payloads count.
fn word_halves(v: Vec<f32>) -> Vec<f32> {
    v.iter()
        .flat_map(|x| [(x.to_bits() & 0xffff) as f32, (x.to_bits() >> 16) as f32])
        .collect()
}

fn pack(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(37);
    // 16-bit storage: packing rounds (an odd count of adversarial values),
    // and every pattern of each format survives the round trip. Words and
    // values are compared as their 16-bit halves, so NaN payloads count.
    let halves = word_halves;
    let x = adversarial(&mut rng, 721);
    for fmt in [Format::Bf16, Format::Fp16] {
        sw.check("pack 16-bit", fmt.name(), "721 values".into(), &[], |d| {
            Ok(halves(up(&x, d)?.pack(fmt)?.0.words().to_vec_f32()?))
        })?;
        // several buffers at once (attention's q, k and v): odd, one-value
        // and empty ones, more than a GPU dispatch takes
        let lens = [721, 1, 64, 0, 5];
        sw.check(
            "pack 16-bit",
            fmt.name(),
            format!("{} buffers at once, {lens:?} values", lens.len()),
            &[],
            |d| {
                let xs = lens
                    .iter()
                    .map(|&n| up(&x[..n], d))
                    .collect::<Result<Vec<_>>>()?;
                let mut words = Vec::new();
                for (p, _) in Storage::pack_many(&xs.iter().collect::<Vec<_>>(), fmt)? {
                    words.extend(halves(p.words().to_vec_f32()?));
                }
                Ok(words)
            },
        )?;
        let every: Vec<f32> = (0..=0xffff)
            .map(|h| f32::from_bits(crate::backend::pack::widen_bits(h, fmt)))
            .collect();
        sw.check(
            "unpack 16-bit",
            fmt.name(),
            "every pattern".into(),
            &[],
            |d| Ok(halves(up(&every, d)?.pack(fmt)?.0.unpack()?.to_vec_f32()?)),
        )?;
        // a permute of the packed values (attention's token-major v, odd
        // sizes: rows start mid-word), and a view from an odd offset
        let (b, t, h, dh) = (2, 7, 3, 5);
        let v: Vec<f32> = (0..b * t * h * dh + 1).map(|i| x[i % x.len()]).collect();
        for (shape, strides, offset, case) in [
            (
                [b, h, t, dh],
                [t * h * dh, dh, h * dh, 1],
                0,
                "(2, 7, 3, 5) token-major as head-major",
            ),
            (
                [1, 1, 2 * t, h],
                [0, 0, h * dh, 1],
                1,
                "rows of a (14, 15) view from value 1",
            ),
        ] {
            sw.check(
                "unpack 16-bit",
                fmt.name(),
                format!("strided: {case}"),
                &[],
                |d| {
                    let p = up(&v, d)?.pack(fmt)?.0;
                    Ok(halves(
                        p.unpack_strided(&shape, &strides, offset)?.to_vec_f32()?,
                    ))
                },
            )?;
        }
    }
    Ok(())
}

// ------------------------------------------------------------ randomness ----

fn dropout(sw: &mut Sweep) -> Result<()> {
    for (n, p, scale, seed, offset) in [
        (1001usize, 0.1f32, 1.0 / 0.9f32, 0u64, 0u64),
        (7, 0.5, 2.0, 0xdead_beef_1234_5678, 0xffff_fffe), // the 64-bit counter carries
        (4096, 0.0, 1.0, 1, 0xffff_ffff_ffff_fff0),        // and wraps
        (33, 1.0, 3.0, u64::MAX, 12345),
        (0, 0.3, 1.0, 5, 5),
    ] {
        let case = format!("n {n} p {p} scale {scale} seed {seed:#x} offset {offset:#x}");
        sw.check("dropout mask", "", case, &[], |d| {
            Storage::dropout_mask(n, p, scale, seed, offset, d)?.to_vec_f32()
        })?;
    }
    Ok(())
}

// ------------------------------------------- in-place updates & scaler ----

/// Length of the optimizer kernels' buffers: two full workgroups and a ragged
/// third at lavapipe's 256 elements per lane (many on a real GPU).
pub const N_UPDATE: usize = 2 * 64 * 256 + 77;

fn update(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(31);
    let inv = 2f32.powi(-16);
    // the flag and the unscaled values: finite buffers, then an inf, a NaN in
    // the last element of the last (partial) workgroup, an inf past the first
    // workgroup, an inf only in the last buffer
    let finite: Vec<Vec<f32>> = vec![
        (0..N_UPDATE).map(|_| rng.moderate() * 1e4).collect(),
        vec![f32::MAX, -f32::MAX, 1e-45, -0.0, 3e-39],
        vec![],
    ];
    let mut with_inf = finite.clone();
    with_inf[1][2] = f32::NEG_INFINITY;
    let mut with_nan = finite.clone();
    with_nan[0][N_UPDATE - 1] = f32::NAN;
    let mut mid_inf = finite.clone();
    mid_inf[0][16384 + 64 * 7 + 5] = f32::INFINITY;
    let mut only_last = finite.clone();
    only_last.push(vec![1.0, 2.0, f32::INFINITY]);
    // more buffers than one dispatch takes (update.wgsl: six), empty ones
    // among them, chunks of one buffer on both sides of a dispatch's end
    let many: Vec<Vec<f32>> = [3000usize, 0, 7, 1, 2049, 0, 5000, 64, 9, 0, 3, 1500]
        .iter()
        .map(|&n| (0..n).map(|_| rng.moderate() * 1e3).collect())
        .collect();
    let mut many_inf = many.clone();
    many_inf[8][4] = f32::INFINITY;
    // more than one dispatch takes side by side (update.wgsl: SLOTS)
    let past_slots: Vec<Vec<f32>> = (0..130usize)
        .map(|i| (0..(i * 7) % 11).map(|_| rng.moderate() * 1e3).collect())
        .collect();
    // each set apart, and laid side by side in one buffer (as the trainer
    // lays gradients out: one dispatch takes them all)
    for (what, bufs, side_by_side) in [
        ("finite", finite.clone(), false),
        ("an inf", with_inf, false),
        ("a NaN at the end", with_nan, false),
        ("an inf past the first workgroup", mid_inf, false),
        ("an inf in the last buffer", only_last.clone(), false),
        ("twelve buffers", many.clone(), false),
        (
            "twelve buffers, an inf in the ninth",
            many_inf.clone(),
            false,
        ),
        ("side by side", finite, true),
        ("side by side, an inf in the last buffer", only_last, true),
        ("twelve buffers side by side", many, true),
        (
            "twelve buffers side by side, an inf in the ninth",
            many_inf,
            true,
        ),
        ("130 buffers side by side", past_slots, true),
    ] {
        let lens: Vec<usize> = bufs.iter().map(Vec::len).collect();
        let case =
            format!("{what}: buffers {lens:?} times 2^-16 (output: the flag, the sum of squares when finite, then the values)");
        sw.check("finite check + unscale", "", case, &[], |d| {
            let st: Vec<Storage> = bufs.iter().map(|b| up(b, d)).collect::<Result<_>>()?;
            let st = match side_by_side {
                true => Storage::colocate(&st.iter().collect::<Vec<_>>(), true)?,
                false => st,
            };
            let refs: Vec<&Storage> = st.iter().collect();
            let check = Storage::finite_check_unscale_reading(&refs, inv, &[])?;
            let mut out = vec![check.finite as u8 as f32];
            out.extend(check.sum_squares);
            for s in &st {
                out.extend(s.to_vec_f32()?);
            }
            Ok(out)
        })?;
    }
    let mut rng = Rng(37);
    let x = adversarial(&mut rng, N_UPDATE);
    for c in [0.5f32, 0.3, 1e-30, -7.0] {
        sw.check(
            "scale in place",
            "",
            format!("n {N_UPDATE} times {c:e}"),
            &[&x],
            |d| {
                let s = up(&x, d)?;
                s.scale_in_place(c)?;
                s.to_vec_f32()
            },
        )?;
    }
    adamw(sw)?;
    sgd(sw)
}

fn adamw(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(41);
    let n = N_UPDATE;
    let p: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
    let (lr, b1, b2, eps, wd) = (1e-3f64, 0.9f64, 0.999f64, 1e-8f64, 0.01f64);
    let steps: Vec<(Vec<f32>, AdamWConsts)> = (1..=4)
        .map(|t| {
            let mut g: Vec<f32> = (0..n).map(|_| rng.moderate() * 1e-3).collect();
            g[0] = 0.0;
            g[1] = 1e-42;
            g[2] = 1e10;
            let c = AdamWConsts {
                decay: (1.0 - lr * wd) as f32,
                beta1: b1 as f32,
                omb1: (1.0 - b1) as f32,
                beta2: b2 as f32,
                omb2: (1.0 - b2) as f32,
                step_size: (lr / (1.0 - b1.powi(t))) as f32,
                bc2_sqrt: (1.0 - b2.powi(t)).sqrt() as f32,
                eps: eps as f32,
                // the last two steps clip, scaling the gradient in the update
                grad_scale: [None, None, Some(0.375_123), Some(1.0 - 1e-7)][t as usize - 1],
            };
            (g, c)
        })
        .collect();
    let case = format!("4 steps on n {n}, 2 clipping (output: p, m, v, g after each step)");
    sw.check("adamw", "", case, &[], |d| {
        let (ps, m, v) = (up(&p, d)?, up(&vec![0.0; n], d)?, up(&vec![0.0; n], d)?);
        let mut out = Vec::new();
        for (g, c) in &steps {
            let g = up(g, d)?;
            ps.adamw_step(&g, &m, &v, c)?;
            for s in [&ps, &m, &v, &g] {
                out.extend(s.to_vec_f32()?);
            }
        }
        Ok(out)
    })?;
    // several parameters at once, laid out alike (on a GPU five a dispatch):
    // odd, one-element and empty ones, each at its own step (its own step
    // size and bias correction), clipping or not
    let lens = [5usize, 300, 1, 0, 64, 7];
    for (clip, grads_apart) in [(None, false), (Some(0.375_123f32), false), (None, true)] {
        let laid = match grads_apart {
            true => "the gradients apart",
            false => "the gradients laid out alike",
        };
        let case = format!(
            "{} parameters {lens:?} at steps 1..6 at once, {laid}, clip {clip:?} (output: p, m, v, g)",
            lens.len()
        );
        sw.check("adamw", "", case, &[], |d| {
            // values from p (a second moment's squared), laid side by side
            let fill = |k: usize, square: bool| -> Result<Vec<Storage>> {
                let vs: Vec<Storage> = lens
                    .iter()
                    .map(|&n| {
                        up(
                            &p[k..k + n]
                                .iter()
                                .map(|&x| if square { x * x } else { x })
                                .collect::<Vec<_>>(),
                            d,
                        )
                    })
                    .collect::<Result<_>>()?;
                Storage::colocate(&vs.iter().collect::<Vec<_>>(), false)
            };
            let (ps, ms, vs) = (fill(0, false)?, fill(1, false)?, fill(2, true)?);
            let gs: Vec<Storage> = lens
                .iter()
                .map(|&n| up(&steps[1].0[3..3 + n], d))
                .collect::<Result<_>>()?;
            let gs = match grads_apart {
                true => gs,
                false => Storage::colocate(&gs.iter().collect::<Vec<_>>(), true)?,
            };
            let items: Vec<AdamWItem<'_, Storage>> = (0..lens.len())
                .map(|i| AdamWItem {
                    p: &ps[i],
                    g: &gs[i],
                    m: &ms[i],
                    v: &vs[i],
                    c: AdamWConsts {
                        step_size: (lr / (1.0 - b1.powi(i as i32 + 1))) as f32,
                        bc2_sqrt: (1.0 - b2.powi(i as i32 + 1)).sqrt() as f32,
                        grad_scale: clip,
                        ..steps[0].1
                    },
                })
                .collect();
            Storage::adamw_many(&items, |_| None::<()>)?;
            let mut out = Vec::new();
            for s in [&ps, &ms, &vs, &gs] {
                for x in s {
                    out.extend(x.to_vec_f32()?);
                }
            }
            Ok(out)
        })?;
    }
    Ok(())
}

fn sgd(sw: &mut Sweep) -> Result<()> {
    let mut rng = Rng(43);
    let n = 513;
    for momentum in [None, Some(0.9f32)] {
        let p: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
        let grads: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..n).map(|_| rng.moderate()).collect())
            .collect();
        let case = format!(
            "3 steps on n {n}, momentum {momentum:?} (output: p and the buffer after each)"
        );
        sw.check("sgd", "", case, &[], |d| {
            let (ps, buf) = (up(&p, d)?, up(&vec![0.0; n], d)?);
            let mut out = Vec::new();
            for (step, g) in grads.iter().enumerate() {
                let g = up(g, d)?;
                let first = step == 0;
                match momentum {
                    None => ps.sgd_step(&g, None, 0.1, 0.0, 1e-4, first)?,
                    Some(mu) => ps.sgd_step(&g, Some(&buf), 0.1, mu, 1e-4, first)?,
                }
                out.extend(ps.to_vec_f32()?);
                out.extend(buf.to_vec_f32()?);
            }
            Ok(out)
        })?;
    }
    Ok(())
}

// ------------------------------------------------- fused transformer ops ----

/// `rows × d` values: every third row adversarial (±0, subnormals, ±inf,
/// NaN, any bit pattern), the rest moderate.
fn fused_rows(rng: &mut Rng, rows: usize, d: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| {
            if r % 3 == 1 {
                adversarial(rng, d)
            } else {
                (0..d).map(|_| rng.moderate()).collect()
            }
        })
        .collect()
}

/// RMSNorm, SwiGLU, RoPE and softmax cross-entropy, forward and backward,
/// over row lengths off and on the 64-wide workgroup and odd row counts.
fn fused(sw: &mut Sweep) -> Result<()> {
    // more rows than one pass folds (a GPU folds the weight's gradient in
    // passes of its own, after a dispatch of the rows alone)
    let (rows, d) = (crate::backend::gpu::LOOP_PASS + 64, 2);
    let mut rng = Rng(41);
    // moderate values: the adversarial ones are the short cases' (here their
    // subnormal sums would only repeat what a flushing device is known to do)
    let x: Vec<f32> = (0..rows * d).map(|_| rng.moderate()).collect();
    let (w, g): (Vec<f32>, Vec<f32>) = (
        (0..d).map(|_| rng.moderate()).collect(),
        (0..rows * d).map(|_| rng.moderate()).collect(),
    );
    sw.check(
        "rms norm backward",
        "",
        format!("rows {rows} d {d}"),
        &[&x],
        |dev| {
            let (xs, ws, gs) = (up(&x, dev)?, up(&w, dev)?, up(&g, dev)?);
            let (_, r) = xs.rms_norm(&ws, rows, d, 1e-5)?;
            let (a, b) =
                xs.rms_norm_backward(&ws, &r, &gs, None, None, &[rows / 64, 64], d, true, true)?;
            let mut v = a.expect("asked").to_vec_f32()?;
            v.extend(b.expect("asked").to_vec_f32()?);
            Ok(v)
        },
    )?;
    let mut rng = Rng(43);
    let cat = |parts: Vec<Storage>| -> Result<Vec<f32>> {
        let mut v = Vec::new();
        for p in parts {
            v.extend(p.to_vec_f32()?);
        }
        Ok(v)
    };
    for (rows, d) in [(1, 1), (5, 13), (3, 64), (7, 130), (12, 34)] {
        let case = format!("rows {rows} d {d}");
        let x = fused_rows(&mut rng, rows, d);
        let w: Vec<f32> = (0..d).map(|_| rng.moderate()).collect();
        let g: Vec<f32> = (0..rows * d).map(|_| rng.moderate()).collect();
        sw.check("rms norm", "", case.clone(), &[&x], |dev| {
            let (y, r) = up(&x, dev)?.rms_norm(&up(&w, dev)?, rows, d, 1e-5)?;
            cat(vec![y, r])
        })?;
        let e: Vec<f32> = (0..rows * d).map(|_| rng.moderate()).collect();
        sw.check("rms norm backward", "", case.clone(), &[&x], |dev| {
            let xs = up(&x, dev)?;
            let ws = up(&w, dev)?;
            let (_, r) = xs.rms_norm(&ws, rows, d, 1e-5)?;
            let gs = up(&g, dev)?;
            // alone, and added into earlier gradients
            let (a, b) = xs.rms_norm_backward(&ws, &r, &gs, None, None, &[rows], d, true, true)?;
            let (ex, ew) = (up(&e, dev)?, up(&e[..d], dev)?);
            let (c, f) =
                xs.rms_norm_backward(&ws, &r, &gs, Some(&ex), Some(&ew), &[rows], d, true, true)?;
            // each side alone (a GPU binds a spare for the other's output),
            // the weight's folded in nested blocks where the rows split
            let (h, _) =
                xs.rms_norm_backward(&ws, &r, &gs, Some(&ex), None, &[rows], d, true, false)?;
            let lead = if rows % 4 == 0 {
                vec![rows / 4, 2, 2]
            } else {
                vec![rows]
            };
            let (_, k) =
                xs.rms_norm_backward(&ws, &r, &gs, None, Some(&ew), &lead, d, false, true)?;
            cat([a, b, c, f, h, k].into_iter().flatten().collect())
        })?;
        let gate = fused_rows(&mut rng, rows, d);
        sw.check("swiglu", "", case.clone(), &[&gate, &x], |dev| {
            up(&gate, dev)?.swiglu(&up(&x, dev)?)?.to_vec_f32()
        })?;
        // keeping the gate and up in 16 bits (autograd's copies, written by
        // the same dispatch on a GPU): all of them, and one value short (a
        // last word half used)
        for fmt in [Format::Bf16, Format::Fp16] {
            for n in [rows * d, rows * d - 1] {
                let variant = format!("{fmt}, keeping gate and up");
                sw.check(
                    "swiglu",
                    &variant,
                    format!("{case}, {n} values"),
                    &[&gate, &x],
                    |dev| {
                        let (y, [(wg, _), (wu, _)]) =
                            up(&gate[..n], dev)?.swiglu_keeping(&up(&x[..n], dev)?, fmt)?;
                        let mut out = y.to_vec_f32()?;
                        out.extend(word_halves(wg.words().to_vec_f32()?));
                        out.extend(word_halves(wu.words().to_vec_f32()?));
                        Ok(out)
                    },
                )?;
            }
        }
        sw.check("swiglu backward", "", case.clone(), &[&gate, &x], |dev| {
            let (a, b) = up(&gate, dev)?.swiglu_backward(&up(&x, dev)?, &up(&g, dev)?)?;
            cat(vec![a, b])
        })?;
        // the gate, up or both read from 16-bit storage (as autograd keeps them)
        for fmt in [Format::Bf16, Format::Fp16] {
            for (hg, hu) in [(true, false), (false, true), (true, true)] {
                let which = match (hg, hu) {
                    (true, false) => "gate",
                    (false, true) => "up",
                    _ => "gate and up",
                };
                let variant = format!("{fmt} operands read from 16-bit storage");
                sw.check(
                    "swiglu backward",
                    &variant,
                    format!("{which} in 16 bits: {case}"),
                    &[],
                    |dev| {
                        let (a, b) = operand(&gate, hg.then_some(fmt), dev)?.swiglu_backward(
                            &operand(&x, hu.then_some(fmt), dev)?,
                            &up(&g, dev)?,
                        )?;
                        cat(vec![a, b])
                    },
                )?;
            }
        }
        if d % 2 == 0 {
            let t = if rows % 3 == 0 { 3 } else { 1 }; // rows are whole blocks of t positions
            let (cos, sin): (Vec<f32>, Vec<f32>) = (0..t * d)
                .map(|i| ((i as f32 * 0.37).cos(), (i as f32 * 0.37).sin()))
                .unzip();
            // one head, and rows permuted between two heads' layouts
            for heads in [1, 2].into_iter().filter(|h| rows % (t * h) == 0) {
                let variant = if heads == 1 {
                    String::new()
                } else {
                    format!("{heads} heads")
                };
                // the inputs line up with the outputs only where no rows move
                let (xs, gs): (&[&[f32]], &[&[f32]]) = match heads {
                    1 => (&[&x], &[&g]),
                    _ => (&[], &[]),
                };
                sw.check("rope", &variant, case.clone(), xs, |dev| {
                    up(&x, dev)?
                        .rope(&up(&cos, dev)?, &up(&sin, dev)?, t, d, heads)?
                        .to_vec_f32()
                })?;
                sw.check("rope backward", &variant, case.clone(), gs, |dev| {
                    up(&g, dev)?
                        .rope_backward(&up(&cos, dev)?, &up(&sin, dev)?, t, d, heads)?
                        .to_vec_f32()
                })?;
                // two at once (attention's q and k), x and g rotated
                sw.check("rope", &variant, format!("{case}, a pair"), &[], |dev| {
                    let (a, b) = up(&x, dev)?.rope_pair(
                        &up(&g, dev)?,
                        &up(&cos, dev)?,
                        &up(&sin, dev)?,
                        t,
                        d,
                        heads,
                    )?;
                    cat(vec![a, b])
                })?;
                sw.check(
                    "rope backward",
                    &variant,
                    format!("{case}, a pair"),
                    &[],
                    |dev| {
                        let (a, b) = up(&g, dev)?.rope_backward_pair(
                            &up(&x, dev)?,
                            &up(&cos, dev)?,
                            &up(&sin, dev)?,
                            t,
                            d,
                            heads,
                        )?;
                        cat(vec![a, b])
                    },
                )?;
            }
        }
        let targets: Vec<u32> = (0..rows).map(|r| ((r * 7) % d) as u32).collect();
        let logits: Vec<f32> = (0..rows * d).map(|_| rng.unif(-20.0, 20.0)).collect();
        sw.check("cross-entropy", "", case.clone(), &[], |dev| {
            let (l, s) = up(&logits, dev)?.cross_entropy(&targets, d)?;
            cat(vec![l, s])
        })?;
        // with the logits' 16-bit copy (on a GPU written by the rows'
        // dispatch where a row is whole words), widened back
        for fmt in [Format::Bf16, Format::Fp16] {
            let variant = format!("{fmt}, keeping the logits");
            sw.check("cross-entropy", &variant, case.clone(), &[], |dev| {
                let (l, s, (w, _)) = up(&logits, dev)?.cross_entropy_keeping(&targets, d, fmt)?;
                cat(vec![l, s, w.unpack()?])
            })?;
        }
        sw.check(
            "cross-entropy backward",
            "",
            case.clone(),
            &[&logits],
            |dev| {
                let xs = up(&logits, dev)?;
                let (_, s) = xs.cross_entropy(&targets, d)?;
                xs.cross_entropy_backward(&targets, &s, &up(&[0.75], dev)?, d)?
                    .to_vec_f32()
            },
        )?;
        // the logits read as autograd keeps a rounded product's output
        for fmt in [Format::Bf16, Format::Fp16] {
            let variant = format!("{fmt}, kept 16-bit");
            sw.check(
                "cross-entropy backward",
                &variant,
                case.clone(),
                &[&logits],
                |dev| {
                    let (_, s) = up(&logits, dev)?.cross_entropy(&targets, d)?;
                    operand(&logits, Some(fmt), dev)?
                        .cross_entropy_backward(&targets, &s, &up(&[0.75], dev)?, d)?
                        .to_vec_f32()
                },
            )?;
        }
    }
    Ok(())
}
