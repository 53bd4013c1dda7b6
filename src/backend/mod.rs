//! The backend: a closed, small set of primitives over contiguous row-major
//! buffers, each implemented three times under one numerics contract — the
//! executable spec (plain Rust, the oracle), the fast CPU kernels and the GPU
//! (wgpu/WGSL) — so all three give the same bits.
//!
//! The code is organised **by primitive family**. Each family is one folder
//! holding everything about its primitives side by side:
//!
//! * `mod.rs` — the contract (the exact algorithm and order, in the doc
//!   comments), the family's trait (one method per primitive, implemented by
//!   every device, so the compiler keeps them in step) and the [`Storage`]
//!   methods that dispatch to it;
//! * `spec.rs` — the executable spec ([`spec`]): the contract written out
//!   plainly, scalar and single-threaded, the oracle the other two are held
//!   to (the sweep and the parity suite compare both with it, bit for bit);
//! * `cpu.rs` — the fast CPU kernels (SIMD, threads);
//! * `gpu.rs` — the launcher: `#[repr(C)]` parameter structs mirroring the
//!   WGSL ones (checked against naga's reflection), grid sizes, passes;
//! * `shaders/<family>.wgsl` (at the top of the repository) — the GPU twin.
//!
//! | family | primitives |
//! |---|---|
//! | [`elementwise`] | unary ops (incl. the bf16/fp16 cast), broadcasting binary ops |
//! | [`reduce`] | sum/max over an axis, softmax and its backward, sums of squares |
//! | [`matmul`] | batched products with transposes and autocast rounding |
//! | [`attention`] | causal attention's products and softmax, scheduled per device (per head on the CPU) |
//! | [`copy`] | strided copies (views), concatenation, row gather and scatter-add |
//! | [`update`] | in-place AdamW, SGD, scaling, the loss scaler's finite check |
//! | [`dropout`] | Philox dropout masks |
//! | [`fused`] | RMSNorm, SwiGLU, RoPE, softmax cross-entropy, each way: the compositions' bits |
//! | [`pack`] | 16-bit storage of bf16/fp16 values (saved activations), packed and widened exactly |
//!
//! Shared ground below the families: [`cpu`] (host buffers, lanes, threads),
//! [`gpu`] (device context, buffer pool, pipeline cache), [`math`] (the math
//! library, Rust and WGSL twins) and [`round`] (bf16/fp16 rounding, twins).
//!
//! Every primitive's output passes through `observed` before it is returned:
//! a running primitive trace (the cross-check's) records it, and in the
//! crate's own tests the `perturb` hook may change it by one ulp.
//!
//! [`Storage`] is an enum over the three devices (CPU, GPU, spec),
//! dispatched in one place, the [`on_device!`] macro: autograd sits above it
//! and never looks inside. f64 storage exists on the CPU only (for
//! finite-difference gradient checks).

pub mod cpu;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod math;
pub mod round;
pub mod spec;

pub mod attention;
pub mod copy;
pub mod dropout;
#[cfg(feature = "test-hooks")]
pub mod perturb;
pub mod elementwise;
pub mod fused;
#[cfg(all(feature = "gpu", any(test, feature = "test-hooks")))]
pub mod launches;
pub mod matmul;
pub mod update;
pub mod pack;
pub mod reduce;

pub use elementwise::{BinaryOp, UnaryOp};
pub use matmul::{Causal, MatmulDims, Operand, Product, TokenMajor};
pub use update::{AdamWConsts, AdamWItem};
pub use reduce::ReduceOp;

use crate::{bail, Result};
use cpu::CpuStorage;
use spec::SpecStorage;
#[cfg(feature = "gpu")]
use gpu::GpuStorage;
use std::rc::Rc;

/// Element type of a storage buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float: every tensor on the GPU, and the default on the CPU.
    F32,
    /// 64-bit IEEE float, CPU only (for finite-difference gradient checks).
    F64,
}

impl DType {
    /// Bytes per element: 4 for `F32`, 8 for `F64`.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }
}

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The fast CPU kernels (host memory), held to the spec bit for bit.
    Cpu,
    /// The wgpu backend (the device is created on first use). In a build
    /// without the `gpu` feature, asking for it is an error.
    Gpu,
    /// The executable spec: every primitive as its contract states it,
    /// scalar and single-threaded — the oracle the other two are checked
    /// against. Slow; for checking, not for training.
    Spec,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
            Device::Spec => "spec",
        })
    }
}

/// How two inputs broadcast to an output (and how a strided view reads its
/// source): element strides per output dimension, 0 for a broadcast
/// dimension. At most [`MAX_DIMS`] dimensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BinaryLayout {
    /// The output's shape.
    pub shape: Vec<usize>,
    /// The left input's element stride per output dimension (0: broadcast).
    pub lhs_strides: Vec<usize>,
    /// The right input's element stride per output dimension (0: broadcast).
    pub rhs_strides: Vec<usize>,
}

impl BinaryLayout {
    /// Two dense buffers of `n` elements, element by element.
    pub fn flat(n: usize) -> BinaryLayout {
        BinaryLayout {
            shape: vec![n],
            lhs_strides: vec![1],
            rhs_strides: vec![1],
        }
    }
}

impl std::fmt::Display for BinaryLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "shape {:?} strides {:?} and {:?}",
            self.shape, self.lhs_strides, self.rhs_strides
        )
    }
}

/// The most dimensions a broadcast or strided view may have.
pub const MAX_DIMS: usize = 6;

/// A tensor's buffer: a cheap, shared handle.
#[derive(Clone)]
pub enum Storage {
    Cpu(Rc<CpuStorage>),
    #[cfg(feature = "gpu")]
    Gpu(Rc<GpuStorage>),
    Spec(Rc<SpecStorage>),
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Storage({}, {:?}, {} elems)",
            self.device(),
            self.dtype(),
            self.len()
        )
    }
}

/// What a device implementation returns, lifted to what [`Storage`] returns:
/// a device buffer becomes a `Storage`, everything else passes through.
pub trait Lift {
    type Out;
    fn lift(self) -> Self::Out;
}

impl Lift for CpuStorage {
    type Out = Storage;
    fn lift(self) -> Storage {
        Storage::Cpu(Rc::new(self))
    }
}

#[cfg(feature = "gpu")]
impl Lift for GpuStorage {
    type Out = Storage;
    fn lift(self) -> Storage {
        Storage::Gpu(Rc::new(self))
    }
}

impl Lift for SpecStorage {
    type Out = Storage;
    fn lift(self) -> Storage {
        Storage::Spec(Rc::new(self))
    }
}

macro_rules! lift_as_is {
    ($($t:ty),*) => { $(impl Lift for $t { type Out = $t; fn lift(self) -> $t { self } })* };
}
lift_as_is!((), bool, usize, Vec<f32>, Vec<f64>, Vec<Storage>, Vec<(Storage, Option<usize>)>);

/// Primitives with several outputs (some optional) lift each one.
impl<A: Lift> Lift for Option<A> {
    type Out = Option<A::Out>;
    fn lift(self) -> Self::Out {
        self.map(Lift::lift)
    }
}

impl<A: Lift, const N: usize> Lift for [A; N] {
    type Out = [A::Out; N];
    fn lift(self) -> Self::Out {
        self.map(Lift::lift)
    }
}

impl<A: Lift, B: Lift> Lift for (A, B) {
    type Out = (A::Out, B::Out);
    fn lift(self) -> Self::Out {
        (self.0.lift(), self.1.lift())
    }
}

impl<A: Lift, B: Lift, C: Lift> Lift for (A, B, C) {
    type Out = (A::Out, B::Out, C::Out);
    fn lift(self) -> Self::Out {
        (self.0.lift(), self.1.lift(), self.2.lift())
    }
}

/// The one place where a primitive goes to a device. Three forms:
///
/// * `on_device!([a, b] => |x, y| x.prim(y, ..))` — every argument is a
///   `&Storage`; they must share a device and dtype; `x`, `y` are the device
///   buffers, and the body (a family trait method) runs on that device;
/// * `on_device!(slice parts => |xs| ..)` — a non-empty `&[&Storage]`, `xs`
///   a `Vec` of device buffers;
/// * `on_device!(device d => |S| S::prim(..))` — no input buffer: `S` names
///   the device's storage type.
///
/// The body returns `Result<T>`; the macro's value is `T` lifted by [`Lift`].
macro_rules! on_device {
    ([$($arg:expr),+] => |$($x:ident),+| $body:expr) => {{
        let args: &[&$crate::backend::Storage] = &[$($arg),+];
        $crate::backend::check_same(args)?;
        match args[0] {
            $crate::backend::Storage::Cpu(_) => {
                let [$($x),+] = [$($arg),+].map(|s: &$crate::backend::Storage| s.cpu());
                $crate::backend::Lift::lift($body?)
            }
            #[cfg(feature = "gpu")]
            $crate::backend::Storage::Gpu(_) => {
                let [$($x),+] = [$($arg),+].map(|s: &$crate::backend::Storage| s.gpu());
                $crate::backend::Lift::lift($body?)
            }
            $crate::backend::Storage::Spec(_) => {
                let [$($x),+] = [$($arg),+].map(|s: &$crate::backend::Storage| s.spec());
                $crate::backend::Lift::lift($body?)
            }
        }
    }};
    (slice $parts:expr => |$xs:ident| $body:expr) => {{
        let parts: &[&$crate::backend::Storage] = $parts;
        $crate::backend::check_same(parts)?;
        match parts[0] {
            $crate::backend::Storage::Cpu(_) => {
                let $xs: Vec<_> = parts.iter().map(|s| s.cpu()).collect();
                $crate::backend::Lift::lift($body?)
            }
            #[cfg(feature = "gpu")]
            $crate::backend::Storage::Gpu(_) => {
                let $xs: Vec<_> = parts.iter().map(|s| s.gpu()).collect();
                $crate::backend::Lift::lift($body?)
            }
            $crate::backend::Storage::Spec(_) => {
                let $xs: Vec<_> = parts.iter().map(|s| s.spec()).collect();
                $crate::backend::Lift::lift($body?)
            }
        }
    }};
    (device $dev:expr => |$s:ident| $body:expr) => {{
        match $dev {
            $crate::backend::Device::Cpu => {
                type $s = $crate::backend::cpu::CpuStorage;
                $crate::backend::Lift::lift($body?)
            }
            #[cfg(feature = "gpu")]
            $crate::backend::Device::Gpu => {
                type $s = $crate::backend::gpu::GpuStorage;
                $crate::backend::Lift::lift($body?)
            }
            #[cfg(not(feature = "gpu"))]
            $crate::backend::Device::Gpu => return Err($crate::backend::no_gpu()),
            $crate::backend::Device::Spec => {
                type $s = $crate::backend::spec::SpecStorage;
                $crate::backend::Lift::lift($body?)
            }
        }
    }};
}
pub(crate) use on_device;

/// A primitive's call, everything around it in one place: its profile
/// scope, the device check and dispatch (any of [`on_device!`]'s forms), and
/// [`observed`] on what it produced. Three forms:
///
/// * `primitive!(name, describe, <dispatch>)` — `name` a `&'static str`,
///   `describe` a closure giving the call's shapes and parameters (run only
///   while a trace records); the outputs observed are the storages in the
///   value ([`Outputs`]);
/// * `primitive!(writes [a, b], name, describe, <dispatch>)` — an in-place
///   primitive: the buffers it wrote are observed;
/// * `primitive!(profile scope, name, describe, <dispatch>)` — with its own
///   profile scope (the products', which count their multiply-adds).
///
/// The value is the dispatch's.
macro_rules! primitive {
    (writes [$($w:expr),+], $name:expr, $describe:expr, $($dispatch:tt)+) => {{
        let name: &'static str = $name;
        let mut _prof = $crate::profile::scope(name);
        let out = $crate::backend::on_device!($($dispatch)+);
        _prof.moved(|| $crate::backend::traffic(name, $crate::backend::reads!($($dispatch)+), &[$($w),+]));
        $crate::backend::observed(name, $describe, &[$($w),+])?;
        out
    }};
    (profile $prof:expr, $name:expr, $describe:expr, $($dispatch:tt)+) => {{
        let mut _prof = $prof;
        let out = $crate::backend::on_device!($($dispatch)+);
        let outs = $crate::backend::Outputs::storages(&out);
        _prof.moved(|| $crate::backend::traffic($name, $crate::backend::reads!($($dispatch)+), &outs));
        $crate::backend::observed($name, $describe, &outs)?;
        out
    }};
    ($name:expr, $describe:expr, $($dispatch:tt)+) => {{
        let name: &'static str = $name;
        $crate::backend::primitive!(profile $crate::profile::scope(name), name, $describe, $($dispatch)+)
    }};
}
pub(crate) use primitive;

/// The buffers a dispatch of [`on_device!`] reads (its arguments), for the
/// profile's [roofline](crate::roofline).
macro_rules! reads {
    ([$($arg:expr),+] => $($rest:tt)+) => { &[$($arg),+] };
    (slice $parts:expr => $($rest:tt)+) => { $parts };
    (device $dev:expr => $($rest:tt)+) => { &[] };
}
pub(crate) use reads;

/// What a call of the primitive `name` moves, by the roofline's model
/// ([`crate::roofline`]): each buffer it reads and each it writes once, as
/// stored; a kernel that reads only a part of its input
/// ([`reads_as_written`](crate::roofline::Cost::reads_as_written)) reads
/// as much as it writes.
pub(crate) fn traffic(name: &str, reads: &[&Storage], writes: &[&Storage]) -> crate::profile::Traffic {
    let bytes = |s: &[&Storage]| s.iter().map(|s| (s.len() * s.dtype().size()) as f64).sum::<f64>();
    let written = bytes(writes);
    let read = match crate::roofline::cost(name).reads_as_written {
        true => written,
        false => bytes(reads),
    };
    let elements = reads.iter().chain(writes).map(|s| s.len()).max().unwrap_or(0);
    crate::profile::Traffic {
        bytes: read + written,
        elements: elements as f64,
    }
}

/// The storages in a primitive's value, in order (what [`observed`] sees).
pub(crate) trait Outputs {
    fn storages(&self) -> Vec<&Storage>;
}

impl Outputs for Storage {
    fn storages(&self) -> Vec<&Storage> {
        vec![self]
    }
}

macro_rules! no_outputs {
    ($($t:ty),*) => { $(impl Outputs for $t { fn storages(&self) -> Vec<&Storage> { Vec::new() } })* };
}
no_outputs!((), bool, usize);

impl<A: Outputs> Outputs for Option<A> {
    fn storages(&self) -> Vec<&Storage> {
        self.iter().flat_map(Outputs::storages).collect()
    }
}

impl<A: Outputs, const N: usize> Outputs for [A; N] {
    fn storages(&self) -> Vec<&Storage> {
        self.iter().flat_map(Outputs::storages).collect()
    }
}

impl<A: Outputs, B: Outputs> Outputs for (A, B) {
    fn storages(&self) -> Vec<&Storage> {
        let mut v = self.0.storages();
        v.extend(self.1.storages());
        v
    }
}

/// Declares an enum of operations from one table, one row per variant, and
/// derives from that table everything that lists the variants, so adding a
/// variant cannot leave one of the lists behind:
///
/// * the enum itself (attributes and variant docs pass through);
/// * `ALL`: one value of each variant, in table order. A variant with an
///   argument names its sample arguments in `[..]` and appears once per
///   sample (a row with an argument and no samples, or samples and no
///   argument, does not compile);
/// * `code()`: the variant's position in the table, so the codes are `0..n`,
///   dense and distinct by construction (the WGSL constants are generated
///   from them);
/// * `name()`: the row's name.
///
/// ```text
/// op_enum! {
///     /// Elementwise functions of one input.
///     #[derive(Clone, Copy, Debug, PartialEq)]
///     pub enum UnaryOp {
///         Neg => "unary neg",
///         AddScalar(f64) [0.75] => "unary add scalar",
///         Round(Format) [Format::Bf16, Format::Fp16] => "unary round",
///     }
/// }
/// ```
macro_rules! op_enum {
    (
        $(#[$m:meta])*
        $vis:vis enum $E:ident {
            $(
                $(#[$vm:meta])*
                $V:ident $(($T:ty))? $([$($s:expr),+ $(,)?])? => $name:literal
            ),+ $(,)?
        }
    ) => {
        $(#[$m])*
        $vis enum $E {
            $( $(#[$vm])* $V $(($T))? ),+
        }

        impl $E {
            /// One value of each variant, in code order (a variant with an
            /// argument once per sample argument): what the parity tests and
            /// the cross-check sweep run.
            pub const ALL: [
                $E;
                $crate::backend::op_enum!(@all [] $($E::$V [$($($s),+)?])+).len()
            ] = $crate::backend::op_enum!(@all [] $($E::$V [$($($s),+)?])+);

            /// The variant's position in the declaration, `0..n` (the WGSL
            /// constants are generated from it).
            pub const fn code(self) -> u32 {
                #[allow(dead_code)]
                enum Code { $($V),+ }
                match self {
                    $( $E::$V { .. } => Code::$V as u32, )+
                }
            }

            /// A fixed name per variant (arguments left out), for the profile
            /// and the reports.
            pub const fn name(self) -> &'static str {
                match self {
                    $( $E::$V { .. } => $name, )+
                }
            }
        }
    };
    // ALL, one row at a time: a bare variant, or the variant once per sample
    (@all [$($a:expr),*]) => { [$($a),*] };
    (@all [$($a:expr),*] $V:path [] $($rest:tt)*) => {
        $crate::backend::op_enum!(@all [$($a,)* $V] $($rest)*)
    };
    (@all [$($a:expr),*] $V:path [$($s:expr),+] $($rest:tt)*) => {
        $crate::backend::op_enum!(@all [$($a,)* $($V($s)),+] $($rest)*)
    };
}
pub(crate) use op_enum;

/// Test of an `op_enum!` table, from its `ALL`: the codes come in order,
/// each of `0..n` present, a variant's samples side by side under one code
/// and one name, and the names distinct.
#[cfg(test)]
pub(crate) fn check_op_table<E: Copy + std::fmt::Debug>(
    all: &[E],
    code: fn(E) -> u32,
    name: fn(E) -> &'static str,
) {
    let codes: Vec<u32> = all.iter().map(|&op| code(op)).collect();
    let names: Vec<&str> = all.iter().map(|&op| name(op)).collect();
    let n = *codes.last().expect("ALL is empty") as usize + 1;
    assert!(codes.windows(2).all(|w| w[0] <= w[1]), "ALL out of code order: {all:?}");
    for c in 0..n as u32 {
        let at: Vec<usize> = (0..all.len()).filter(|&i| codes[i] == c).collect();
        assert!(!at.is_empty(), "code {c} missing from ALL: {all:?}");
        assert!(at.iter().all(|&i| names[i] == names[at[0]]), "code {c}: names {names:?}");
    }
    let mut distinct = names.clone();
    distinct.dedup();
    let mut sorted = distinct.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), distinct.len(), "two codes share a name: {names:?}");
    assert_eq!(distinct.len(), n, "{names:?}");
}

/// The error of a build without the GPU backend asked for the GPU.
#[cfg(not(feature = "gpu"))]
pub(crate) fn no_gpu() -> crate::Error {
    crate::Error::device(
        "this build of tinyllm has no GPU backend (the `gpu` feature is off): use the CPU",
    )
}

/// The adapter's name and API, e.g. `llvmpipe (LLVM 19.1.7, 256 bits) (Vulkan)`.
pub(crate) fn adapter_name() -> Result<String> {
    #[cfg(feature = "gpu")]
    return gpu::adapter_name();
    #[cfg(not(feature = "gpu"))]
    Err(no_gpu())
}

/// On the GPU, the peak bytes of its tensor buffers, pooled ones included
/// (see [`gpu::device_peak_bytes`]); `None` on the CPU.
pub(crate) fn device_peak_bytes(device: Device) -> Option<usize> {
    match device {
        Device::Cpu | Device::Spec => None,
        #[cfg(feature = "gpu")]
        Device::Gpu => gpu::device_peak_bytes(),
        #[cfg(not(feature = "gpu"))]
        Device::Gpu => None,
    }
}

/// Releases the GPU's pooled buffers and restarts its peak (no-op without one).
pub(crate) fn restart_device_peak() {
    #[cfg(feature = "gpu")]
    gpu::restart_device_peak();
}

op_enum! {
    /// The primitive families, one folder each under `src/backend/`: the one
    /// list the shader checks (`gpu_families`), the cross-check's sweep and
    /// the parity tests derive theirs from (each through an exhaustive match,
    /// so a new family that one of them forgets does not compile, or fails a
    /// test). The name is the folder's (and its shader file's).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Family {
        /// Unary ops (incl. the bf16/fp16 cast), broadcasting binary ops.
        Elementwise => "elementwise",
        /// Sum/max over an axis, softmax and its backward, sums of squares.
        Reduce => "reduce",
        /// Batched products with transposes and autocast rounding.
        Matmul => "matmul",
        /// Causal attention's products and softmax, scheduled per device.
        Attention => "attention",
        /// Strided copies, concatenation, row gather and scatter-add.
        Copy => "copy",
        /// In-place AdamW, SGD, scaling, the loss scaler's finite check.
        Update => "update",
        /// Philox dropout masks.
        Dropout => "dropout",
        /// RMSNorm, SwiGLU, RoPE, softmax cross-entropy, each way.
        Fused => "fused",
        /// 16-bit storage of bf16/fp16 values (saved activations).
        Pack => "pack",
    }
}

impl Family {
    /// The family's GPU twin: its shaders (`shaders/<name>.wgsl`).
    #[cfg(feature = "gpu")]
    pub fn shaders(self) -> &'static gpu::pipelines::Family {
        match self {
            Family::Elementwise => &elementwise::gpu::FAMILY,
            Family::Reduce => &reduce::gpu::FAMILY,
            Family::Matmul => &matmul::gpu::FAMILY,
            Family::Attention => &attention::gpu::FAMILY,
            Family::Copy => &copy::gpu::FAMILY,
            Family::Update => &update::gpu::FAMILY,
            Family::Dropout => &dropout::gpu::FAMILY,
            Family::Fused => &fused::gpu::FAMILY,
            Family::Pack => &pack::gpu::FAMILY,
        }
    }
}

/// Every shader module (for validation and the parameter-layout check): the
/// probe's, then each [`Family`]'s GPU twin in [`Family::ALL`]'s order.
#[cfg(all(feature = "gpu", any(test, feature = "test-hooks")))]
pub fn gpu_families() -> Vec<&'static gpu::pipelines::Family> {
    std::iter::once(&gpu::probe_ops::FAMILY)
        .chain(Family::ALL.iter().map(|f| f.shaders()))
        .collect()
}

/// What every primitive does with its output before returning it: the
/// test-only [`perturb`] hook may change it by one ulp, and a running
/// [trace](crate::trace) records it (read back and hashed).
/// Neither is on outside a cross-check: then this is one thread-local read
/// (the hook is not even compiled into a build without `test-hooks`).
pub(crate) fn observed(
    name: &'static str,
    args: impl FnOnce() -> String,
    outs: &[&Storage],
) -> Result<()> {
    #[cfg(feature = "test-hooks")]
    perturb::perturb(name, outs)?;
    if crate::trace::on() {
        let mut values = Vec::new();
        for o in outs {
            values.extend(o.to_vec_f32()?);
        }
        crate::trace::record(name, args(), values);
    }
    Ok(())
}

/// [`observed`] for a primitive whose result is a host value (a flag, a
/// sum) beside any buffers it updated in place (`outs`).
pub(crate) fn observed_value(
    name: &'static str,
    args: impl FnOnce() -> String,
    outs: &[&Storage],
    on_gpu: bool,
    value: f32,
) -> Result<f32> {
    #[cfg(feature = "test-hooks")]
    let value = perturb::perturb_value(name, outs, on_gpu, value)?;
    let _ = on_gpu;
    if crate::trace::on() {
        let mut values = Vec::new();
        for o in outs {
            values.extend(o.to_vec_f32()?);
        }
        values.push(value);
        crate::trace::record(name, args(), values);
    }
    Ok(value)
}

/// Every buffer on one device with one dtype (and at least one buffer).
pub fn check_same(args: &[&Storage]) -> Result<()> {
    let Some(first) = args.first() else {
        bail!(Internal, "a primitive called with no buffers");
    };
    for a in &args[1..] {
        if a.device() != first.device() {
            bail!(
                Device,
                "tensors on different devices ({} and {})",
                first.device(),
                a.device()
            );
        }
        if a.dtype() != first.dtype() {
            bail!(
                DType,
                "tensors of different dtypes ({:?} and {:?})",
                first.dtype(),
                a.dtype()
            );
        }
    }
    Ok(())
}

impl Storage {
    pub fn from_f32(data: Vec<f32>, device: Device) -> Result<Storage> {
        Ok(match device {
            Device::Cpu => CpuStorage::from_f32(data).lift(),
            #[cfg(feature = "gpu")]
            Device::Gpu => GpuStorage::upload(&data)?.lift(),
            #[cfg(not(feature = "gpu"))]
            Device::Gpu => return Err(no_gpu()),
            Device::Spec => SpecStorage::new(data).lift(),
        })
    }
    pub fn from_f64(data: Vec<f64>, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(CpuStorage::from_f64(data).lift()),
            Device::Gpu | Device::Spec => {
                bail!(DType, "f64 tensors live on the CPU only (the {device} backend is f32)")
            }
        }
    }
    /// `n` copies of `value`.
    pub fn full(n: usize, value: f64, dtype: DType, device: Device) -> Result<Storage> {
        match (device, dtype) {
            (Device::Cpu | Device::Spec, DType::F32) => Self::from_f32(vec![value as f32; n], device),
            (Device::Cpu, DType::F64) => Self::from_f64(vec![value; n], device),
            #[cfg(feature = "gpu")]
            (Device::Gpu, DType::F32) => Ok(GpuStorage::full(n, value as f32)?.lift()),
            #[cfg(not(feature = "gpu"))]
            (Device::Gpu, DType::F32) => Err(no_gpu()),
            (Device::Gpu | Device::Spec, DType::F64) => bail!(DType, "f64 tensors live on the CPU only"),
        }
    }
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            #[cfg(feature = "gpu")]
            Storage::Gpu(_) => Device::Gpu,
            Storage::Spec(_) => Device::Spec,
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            #[cfg(feature = "gpu")]
            Storage::Gpu(_) => DType::F32,
            Storage::Spec(_) => DType::F32,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            #[cfg(feature = "gpu")]
            Storage::Gpu(g) => g.len(),
            Storage::Spec(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The CPU buffer (the caller has checked the device).
    pub fn cpu(&self) -> &CpuStorage {
        match self {
            Storage::Cpu(s) => s,
            #[cfg(feature = "gpu")]
            Storage::Gpu(_) => unreachable!("a GPU buffer where the CPU was checked"),
            Storage::Spec(_) => unreachable!("a spec buffer where the CPU was checked"),
        }
    }
    /// The GPU buffer (the caller has checked the device).
    #[cfg(feature = "gpu")]
    pub fn gpu(&self) -> &GpuStorage {
        match self {
            Storage::Gpu(g) => g,
            _ => unreachable!("another device's buffer where the GPU was checked"),
        }
    }
    /// The spec device's buffer (the caller has checked the device).
    pub fn spec(&self) -> &SpecStorage {
        match self {
            Storage::Spec(s) => s,
            _ => unreachable!("another device's buffer where the spec was checked"),
        }
    }
    /// Whether the buffer is shared with another handle (in-place updates
    /// must not touch a buffer someone else still reads).
    pub fn is_shared(&self) -> bool {
        match self {
            Storage::Cpu(c) => Rc::strong_count(c) > 1,
            #[cfg(feature = "gpu")]
            Storage::Gpu(g) => Rc::strong_count(g) > 1,
            Storage::Spec(s) => Rc::strong_count(s) > 1,
        }
    }
    /// The values as f32 (f64 storage is narrowed). Reads the GPU back.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        match self {
            Storage::Cpu(s) => Ok(s.to_vec_f32()),
            #[cfg(feature = "gpu")]
            Storage::Gpu(g) => g.download(),
            Storage::Spec(s) => Ok(s.get().clone()),
        }
    }
    /// The values as f64 (f32 storage is widened exactly). Reads the GPU back.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        match self {
            Storage::Cpu(s) => Ok(s.to_vec_f64()),
            #[cfg(feature = "gpu")]
            Storage::Gpu(g) => Ok(g.download()?.into_iter().map(f64::from).collect()),
            Storage::Spec(s) => Ok(s.get().iter().map(|&x| f64::from(x)).collect()),
        }
    }
    /// A copy on `device`.
    pub fn to_device(&self, device: Device) -> Result<Storage> {
        if self.device() == device {
            return Ok(self.clone());
        }
        match self.dtype() {
            DType::F32 => Storage::from_f32(self.to_vec_f32()?, device),
            DType::F64 => bail!(DType, "f64 tensors live on the CPU only"),
        }
    }
    /// The values of `xs` (one device, one type) again, laid side by side
    /// in one buffer where that lets one dispatch read them all (a GPU: views
    /// of one buffer, see [`GpuStorage::colocated`], unless they would not
    /// fit one binding); elsewhere `xs` themselves. `each_step`: see
    /// [`GpuStorage::colocated`].
    pub fn colocate(xs: &[&Storage], each_step: bool) -> Result<Vec<Storage>> {
        if xs.is_empty() {
            return Ok(Vec::new());
        }
        check_same(xs)?;
        match xs[0] {
            #[cfg(feature = "gpu")]
            Storage::Gpu(_) => {
                let ds: Vec<&GpuStorage> = xs.iter().map(|s| s.gpu()).collect();
                Ok(match GpuStorage::colocated(&ds, each_step)? {
                    Some(views) => views.into_iter().map(Lift::lift).collect(),
                    None => xs.iter().map(|&s| s.clone()).collect(),
                })
            }
            _ => {
                let _ = each_step; // nothing moves off a GPU
                Ok(xs.iter().map(|&s| s.clone()).collect())
            }
        }
    }
    /// Zeros shaped like each of `xs` (one device, f32), laid out as
    /// [`colocate`](Storage::colocate) would lay them out.
    pub fn zeros_laid_out(xs: &[&Storage]) -> Result<Vec<Storage>> {
        match xs.first() {
            #[cfg(feature = "gpu")]
            Some(Storage::Gpu(_)) => {
                check_same(xs)?;
                let lens: Vec<usize> = xs.iter().map(|x| x.len()).collect();
                Ok(GpuStorage::zeros_laid_out(&lens)?.into_iter().map(Lift::lift).collect())
            }
            _ => xs.iter().map(|x| Storage::from_f32(vec![0.0; x.len()], x.device())).collect(),
        }
    }
    /// Whether `xs` lie as [`colocate`](Storage::colocate) lays them out
    /// (always, where it leaves them be).
    pub fn side_by_side(xs: &[&Storage]) -> bool {
        match xs.first() {
            #[cfg(feature = "gpu")]
            Some(Storage::Gpu(_)) => {
                let ds: Option<Vec<&GpuStorage>> = xs
                    .iter()
                    .map(|s| match s {
                        Storage::Gpu(g) => Some(&**g),
                        _ => None,
                    })
                    .collect();
                ds.is_some_and(|ds| GpuStorage::laid_out(&ds))
            }
            _ => true,
        }
    }
    /// A copy with another element type (CPU only for f64).
    pub fn to_dtype(&self, dtype: DType) -> Result<Storage> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        match dtype {
            DType::F32 => Storage::from_f32(self.to_vec_f32()?, self.device()),
            DType::F64 => Storage::from_f64(self.to_vec_f64()?, self.device()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Family;

    #[test]
    fn the_family_table_is_consistent() {
        super::check_op_table(&Family::ALL, Family::code, Family::name);
    }

    /// Every folder under `src/backend/` but the ground below the families
    /// is a [`Family`], and every family a folder: the list cannot miss one.
    #[test]
    fn every_family_folder_is_listed() {
        const GROUND: [&str; 4] = ["cpu", "gpu", "math", "round"];
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/backend");
        let mut folders: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !GROUND.contains(&n.as_str()))
            .collect();
        folders.sort();
        let mut listed: Vec<String> = Family::ALL.iter().map(|f| f.name().to_string()).collect();
        listed.sort();
        assert_eq!(folders, listed);
    }

    /// A family's shaders are named as the family, in `shaders/<name>.wgsl`.
    #[cfg(feature = "gpu")]
    #[test]
    fn each_gpu_twin_is_named_as_its_family() {
        for f in Family::ALL {
            assert_eq!(f.shaders().name, f.name());
            let file = format!("{}/shaders/{}.wgsl", env!("CARGO_MANIFEST_DIR"), f.name());
            assert!(std::path::Path::new(&file).is_file(), "{file}");
        }
    }
}
