//! The backend: a closed, small set of primitives over contiguous row-major
//! buffers, implemented twice — [`cpu`] (the reference) and [`gpu`] (wgpu/WGSL).
//!
//! [`Storage`] is an enum dispatched here, in one place; autograd sits above
//! and never looks inside it. Every primitive has ONE canonical algorithm (its
//! doc comment states it) that both implementations follow exactly, which is
//! what makes GPU results equal the CPU reference bit for bit.
//!
//! f64 storage exists on the CPU only (for finite-difference gradient checks).

pub mod cpu;
pub mod gpu;
pub mod math;
pub mod round;

use crate::{bail, Result};
use round::Format;
use std::rc::Rc;

pub use gpu::gpu_pool_bytes;

/// Element type of a storage buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
}

impl DType {
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
    Cpu,
    Gpu,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        })
    }
}

/// Elementwise functions of one input. Scalars are f64 and narrowed to the
/// storage type once, on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Sigmoid,
    Silu,
    /// d silu / dx = s (1 + x (1 - s)), s = sigmoid(x)
    SiluGrad,
    Abs,
    Relu,
    /// 1 where x > 0, else 0 (relu's derivative)
    Step,
    Square,
    AddScalar(f64),
    MulScalar(f64),
    /// `x / c` through the crate's division
    DivScalar(f64),
    /// `c / x` through the crate's division
    RDivScalar(f64),
    Round(Format),
}

impl UnaryOp {
    /// A fixed name per op (scalar arguments left out), for the profile.
    pub fn name(&self) -> &'static str {
        match self {
            UnaryOp::Neg => "unary neg",
            UnaryOp::Exp => "unary exp",
            UnaryOp::Log => "unary log",
            UnaryOp::Sqrt => "unary sqrt",
            UnaryOp::Rsqrt => "unary rsqrt",
            UnaryOp::Recip => "unary recip",
            UnaryOp::Sigmoid => "unary sigmoid",
            UnaryOp::Silu => "unary silu",
            UnaryOp::SiluGrad => "unary silu grad",
            UnaryOp::Abs => "unary abs",
            UnaryOp::Relu => "unary relu",
            UnaryOp::Step => "unary step",
            UnaryOp::Square => "unary square",
            UnaryOp::AddScalar(_) => "unary add scalar",
            UnaryOp::MulScalar(_) => "unary mul scalar",
            UnaryOp::DivScalar(_) => "unary div scalar",
            UnaryOp::RDivScalar(_) => "unary scalar div",
            UnaryOp::Round(_) => "unary round",
        }
    }
}

/// Elementwise functions of two inputs (with broadcasting, see [`BinaryLayout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    /// NaN if either is NaN, else the larger (`+0` over `-0`)
    Maximum,
    /// 1.0 where equal (IEEE: NaN ≠ NaN, +0 = -0), else 0.0
    Eq,
}

impl BinaryOp {
    /// A fixed name per op, for the profile.
    pub fn name(&self) -> &'static str {
        match self {
            BinaryOp::Add => "binary add",
            BinaryOp::Sub => "binary sub",
            BinaryOp::Mul => "binary mul",
            BinaryOp::Div => "binary div",
            BinaryOp::Maximum => "binary maximum",
            BinaryOp::Eq => "binary eq",
        }
    }
}

/// How two inputs broadcast to an output: element strides per output
/// dimension, 0 for a broadcast dimension. At most [`MAX_DIMS`] dimensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BinaryLayout {
    pub shape: Vec<usize>,
    pub lhs_strides: Vec<usize>,
    pub rhs_strides: Vec<usize>,
}

pub const MAX_DIMS: usize = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// `acc = -0.0; for r ascending: acc = acc + x` (−0 is the exact identity)
    Sum,
    /// `acc = -inf; for r ascending: acc = maximum(acc, x)` (NaN propagates)
    Max,
}

/// A batched matmul `C[b] = op(A[b]) @ op(B[b])`, `op(A)` of shape (m, k),
/// `op(B)` of shape (k, n). `trans_a` means A is stored (k, m); `trans_b`, B
/// stored (n, k). A batch stride of 0 broadcasts one matrix over the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a_batch_stride: usize,
    pub b_batch_stride: usize,
}

/// Hyper-parameters of one AdamW update, narrowed to f32 on the host so both
/// backends use the same constants (see [`Storage::adamw_step`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConsts {
    /// `1 - lr * weight_decay`
    pub decay: f32,
    pub beta1: f32,
    /// `1 - beta1`
    pub omb1: f32,
    pub beta2: f32,
    /// `1 - beta2`
    pub omb2: f32,
    /// `lr / (1 - beta1^t)`
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`
    pub bc2_sqrt: f32,
    pub eps: f32,
}

/// Number of elements each partial sum of [`Storage::sum_squares`] covers.
pub const NORM_CHUNK: usize = 1024;

/// A tensor's buffer: a cheap, shared handle.
#[derive(Clone)]
pub enum Storage {
    Cpu(Rc<cpu::CpuStorage>),
    Gpu(Rc<gpu::GpuStorage>),
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

macro_rules! dispatch {
    ($self:expr, $s:ident => $cpu:expr, $g:ident => $gpu:expr) => {
        match $self {
            Storage::Cpu($s) => $cpu,
            Storage::Gpu($g) => $gpu,
        }
    };
}

fn same_device(a: &Storage, b: &Storage) -> Result<()> {
    if a.device() != b.device() {
        bail!(
            Shape,
            "tensors on different devices ({} and {})",
            a.device(),
            b.device()
        );
    }
    if a.dtype() != b.dtype() {
        bail!(
            Shape,
            "tensors of different dtypes ({:?} and {:?})",
            a.dtype(),
            b.dtype()
        );
    }
    Ok(())
}

impl Storage {
    pub fn from_f32(data: Vec<f32>, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(Rc::new(cpu::CpuStorage::F32(cpu::Buf::new(
                data,
            ))))),
            Device::Gpu => Ok(Storage::Gpu(Rc::new(gpu::GpuStorage::upload(&data)?))),
        }
    }
    pub fn from_f64(data: Vec<f64>, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(Rc::new(cpu::CpuStorage::F64(cpu::Buf::new(
                data,
            ))))),
            Device::Gpu => bail!(
                Shape,
                "f64 tensors live on the CPU only (the GPU backend is f32)"
            ),
        }
    }
    /// `n` copies of `value`.
    pub fn full(n: usize, value: f64, dtype: DType, device: Device) -> Result<Storage> {
        match (device, dtype) {
            (Device::Cpu, DType::F32) => Self::from_f32(vec![value as f32; n], device),
            (Device::Cpu, DType::F64) => Self::from_f64(vec![value; n], device),
            (Device::Gpu, DType::F32) => Ok(Storage::Gpu(Rc::new(gpu::GpuStorage::full(
                n,
                value as f32,
            )?))),
            (Device::Gpu, DType::F64) => bail!(Shape, "f64 tensors live on the CPU only"),
        }
    }
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Gpu(_) => Device::Gpu,
        }
    }
    pub fn dtype(&self) -> DType {
        dispatch!(self, s => s.dtype(), _g => DType::F32)
    }
    pub fn len(&self) -> usize {
        dispatch!(self, s => s.len(), g => g.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The values as f32 (f64 storage is narrowed). Reads the GPU back.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        dispatch!(self, s => Ok(s.to_vec_f32()), g => g.download())
    }
    /// The values as f64 (f32 storage is widened exactly). Reads the GPU back.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        dispatch!(self, s => Ok(s.to_vec_f64()), g => Ok(g.download()?.into_iter().map(f64::from).collect()))
    }
    /// A copy on `device`.
    pub fn to_device(&self, device: Device) -> Result<Storage> {
        if self.device() == device {
            return Ok(self.clone());
        }
        match self.dtype() {
            DType::F32 => Storage::from_f32(self.to_vec_f32()?, device),
            DType::F64 => bail!(Shape, "f64 tensors live on the CPU only"),
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

    /// `y = f(x)` elementwise; see [`UnaryOp`] and [`math`] for each `f`.
    pub fn unary(&self, op: UnaryOp) -> Result<Storage> {
        let _prof = crate::profile::scope(op.name());
        dispatch!(self, s => Ok(Storage::Cpu(Rc::new(s.unary(op)))), g => Ok(Storage::Gpu(Rc::new(g.unary(op)?))))
    }

    /// `y[i] = lhs[li] op rhs[ri]` over `layout.shape` (row-major), `li`/`ri`
    /// from the broadcast strides.
    pub fn binary(&self, rhs: &Storage, op: BinaryOp, layout: &BinaryLayout) -> Result<Storage> {
        let _prof = crate::profile::scope(op.name());
        same_device(self, rhs)?;
        if layout.shape.len() > MAX_DIMS {
            bail!(
                Shape,
                "binary op on {} dimensions: at most {MAX_DIMS} are supported",
                layout.shape.len()
            );
        }
        match (self, rhs) {
            (Storage::Cpu(a), Storage::Cpu(b)) => {
                Ok(Storage::Cpu(Rc::new(a.binary(b, op, layout))))
            }
            (Storage::Gpu(a), Storage::Gpu(b)) => {
                Ok(Storage::Gpu(Rc::new(a.binary(b, op, layout)?)))
            }
            _ => unreachable!(),
        }
    }

    /// Reduces the middle axis of an `(outer, r, inner)` view to `(outer, inner)`
    /// in ascending order (see [`ReduceOp`]).
    pub fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<Storage> {
        let _prof = crate::profile::scope(match op {
            ReduceOp::Sum => "reduce sum",
            ReduceOp::Max => "reduce max",
        });
        debug_assert_eq!(outer * r * inner, self.len());
        dispatch!(self, s => Ok(Storage::Cpu(Rc::new(s.reduce(op, outer, r, inner)))),
                  g => Ok(Storage::Gpu(Rc::new(g.reduce(op, outer, r, inner)?))))
    }

    /// Matmul under the contract: `acc = +0.0; for p in 0..k ascending: acc =
    /// fma(a[i,p], b[p,j], acc)`. With `round = Some(fmt)` both operands are
    /// rounded to `fmt` as they are read and the output is rounded once.
    pub fn matmul(
        &self,
        rhs: &Storage,
        dims: MatmulDims,
        round: Option<Format>,
    ) -> Result<Storage> {
        let _prof = crate::profile::scope(crate::profile::MATMUL);
        same_device(self, rhs)?;
        match (self, rhs) {
            (Storage::Cpu(a), Storage::Cpu(b)) => {
                Ok(Storage::Cpu(Rc::new(a.matmul(b, dims, round))))
            }
            (Storage::Gpu(a), Storage::Gpu(b)) => {
                Ok(Storage::Gpu(Rc::new(a.matmul(b, dims, round)?)))
            }
            _ => unreachable!(),
        }
    }

    /// Gathers a strided view into a new contiguous buffer: output element at
    /// multi-index `idx` (row-major over `shape`) reads `src[offset + Σ idx·strides]`.
    /// Transpose, permute, slice and broadcast-expand are all this one primitive.
    pub fn strided_copy(
        &self,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Storage> {
        let _prof = crate::profile::scope("strided copy");
        if shape.len() > MAX_DIMS {
            bail!(
                Shape,
                "view with {} dimensions: at most {MAX_DIMS} are supported",
                shape.len()
            );
        }
        dispatch!(self, s => Ok(Storage::Cpu(Rc::new(s.strided_copy(shape, strides, offset)))),
                  g => Ok(Storage::Gpu(Rc::new(g.strided_copy(shape, strides, offset)?))))
    }

    /// Concatenates `(outer, sizes[i], inner)` views along the middle axis.
    pub fn concat(
        parts: &[&Storage],
        outer: usize,
        sizes: &[usize],
        inner: usize,
    ) -> Result<Storage> {
        let _prof = crate::profile::scope("concat");
        let first = parts
            .first()
            .ok_or_else(|| crate::Error::shape("concat of no tensors"))?;
        for p in parts {
            same_device(first, p)?;
        }
        match first {
            Storage::Cpu(_) => {
                let cs: Vec<&cpu::CpuStorage> = parts
                    .iter()
                    .map(|p| match p {
                        Storage::Cpu(c) => &**c,
                        _ => unreachable!(),
                    })
                    .collect();
                Ok(Storage::Cpu(Rc::new(cpu::CpuStorage::concat(
                    &cs, outer, sizes, inner,
                ))))
            }
            Storage::Gpu(_) => {
                let gs: Vec<&gpu::GpuStorage> = parts
                    .iter()
                    .map(|p| match p {
                        Storage::Gpu(g) => &**g,
                        _ => unreachable!(),
                    })
                    .collect();
                Ok(Storage::Gpu(Rc::new(gpu::GpuStorage::concat(
                    &gs, outer, sizes, inner,
                )?)))
            }
        }
    }

    /// Embedding lookup: `self` is a table `(v, d)`; returns `(ids.len(), d)`
    /// with row `i` = `table[ids[i]]`. Ids are checked on the host.
    pub fn gather_rows(&self, ids: &[u32], d: usize) -> Result<Storage> {
        let _prof = crate::profile::scope("gather rows");
        let v = self.len() / d.max(1);
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= v) {
            bail!(
                Shape,
                "index {bad} out of range for an embedding of {v} rows"
            );
        }
        dispatch!(self, s => Ok(Storage::Cpu(Rc::new(s.gather_rows(ids, d)))),
                  g => Ok(Storage::Gpu(Rc::new(g.gather_rows(ids, d)?))))
    }

    /// The backward of [`gather_rows`](Self::gather_rows): `self` is `(ids.len(), d)`;
    /// returns `(v, d)` where row `r` = `+0.0 + Σ self[i]` over the `i` with
    /// `ids[i] == r`, added in ascending `i`.
    pub fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize) -> Result<Storage> {
        let _prof = crate::profile::scope("scatter-add rows");
        dispatch!(self, s => Ok(Storage::Cpu(Rc::new(s.scatter_add_rows(ids, v, d)))),
                  g => Ok(Storage::Gpu(Rc::new(g.scatter_add_rows(ids, v, d)?))))
    }

    /// Row softmax over the last axis of `(rows, n)`: `m = max row` (the
    /// [`ReduceOp::Max`] order), `e = exp(x - m)`, `s = Σ e` ascending from −0,
    /// `y = div(e, s)`.
    pub fn softmax_rows(&self, rows: usize, n: usize) -> Result<Storage> {
        let _prof = crate::profile::scope("softmax");
        dispatch!(self, s => Ok(Storage::Cpu(Rc::new(s.softmax_rows(rows, n)))),
                  g => Ok(Storage::Gpu(Rc::new(g.softmax_rows(rows, n)?))))
    }

    /// Softmax backward from its output: `dot = Σ g·y` ascending from −0 (as
    /// `fma(g, y, dot)`), `dx = y · (g − dot)`.
    pub fn softmax_rows_backward(&self, grad: &Storage, rows: usize, n: usize) -> Result<Storage> {
        let _prof = crate::profile::scope("softmax backward");
        same_device(self, grad)?;
        match (self, grad) {
            (Storage::Cpu(y), Storage::Cpu(g)) => {
                Ok(Storage::Cpu(Rc::new(y.softmax_rows_backward(g, rows, n))))
            }
            (Storage::Gpu(y), Storage::Gpu(g)) => {
                Ok(Storage::Gpu(Rc::new(y.softmax_rows_backward(g, rows, n)?)))
            }
            _ => unreachable!(),
        }
    }

    /// A dropout mask of `n` elements from the Philox stream at `(seed, offset)`:
    /// element `i` is `scale` when `uniform01(draw_u32(seed, offset, i)) >= p`, else 0.
    pub fn dropout_mask(
        n: usize,
        p: f32,
        scale: f32,
        seed: u64,
        offset: u64,
        device: Device,
    ) -> Result<Storage> {
        let _prof = crate::profile::scope("dropout mask");
        match device {
            Device::Cpu => Ok(Storage::Cpu(Rc::new(cpu::CpuStorage::dropout_mask(
                n, p, scale, seed, offset,
            )))),
            Device::Gpu => Ok(Storage::Gpu(Rc::new(gpu::GpuStorage::dropout_mask(
                n, p, scale, seed, offset,
            )?))),
        }
    }

    /// The loss scaler's fused check: every gradient is multiplied in place by
    /// `inv_scale` (a power of two: exact), and the result says whether every
    /// value of every buffer was finite *before* the multiply. On the GPU this is
    /// one kernel per buffer writing one shared flag, and one 4-byte readback.
    pub fn finite_check_unscale(grads: &[&Storage], inv_scale: f32) -> Result<bool> {
        let _prof = crate::profile::scope("finite check + unscale");
        let mut finite = true;
        let mut gpu_bufs = Vec::new();
        for g in grads {
            match g {
                Storage::Cpu(c) => finite &= c.unscale_in_place(inv_scale),
                Storage::Gpu(b) => gpu_bufs.push(&**b),
            }
        }
        if !gpu_bufs.is_empty() {
            finite &= gpu::GpuStorage::finite_check_unscale(&gpu_bufs, inv_scale)?;
        }
        Ok(finite)
    }

    /// Sum of squares of all elements of all buffers, in the fixed order
    /// `total = Σ_buffers Σ_chunks (Σ_{i in chunk} x_i² by fma, ascending)`,
    /// chunks of [`NORM_CHUNK`] elements, every sum from −0, as f32. Used by
    /// gradient clipping; the host takes the square root.
    pub fn sum_squares(bufs: &[&Storage]) -> Result<f32> {
        let _prof = crate::profile::scope("sum of squares");
        // The GPU buffers' partials come back together, in one readback.
        let gpu_bufs: Vec<&gpu::GpuStorage> = bufs
            .iter()
            .filter_map(|b| match b {
                Storage::Gpu(g) => Some(&**g),
                Storage::Cpu(_) => None,
            })
            .collect();
        let mut gpu_partials = gpu::GpuStorage::chunk_sum_squares(&gpu_bufs)?.into_iter();
        let mut total = -0.0f32;
        for b in bufs {
            let partials = match b {
                Storage::Cpu(s) => s.chunk_sum_squares(),
                Storage::Gpu(g) => gpu_partials
                    .by_ref()
                    .take(g.len().div_ceil(NORM_CHUNK))
                    .collect(),
            };
            for p in partials {
                total += p;
            }
        }
        Ok(total)
    }

    /// In place: `self *= c` (clipping). On both backends `x * c` exactly rounded.
    pub fn scale_in_place(&self, c: f32) -> Result<()> {
        let _prof = crate::profile::scope("scale in place");
        dispatch!(self, s => { s.scale_in_place(c); Ok(()) }, g => g.scale_in_place(c))
    }

    /// In-place AdamW (PyTorch's formula), per element:
    /// ```text
    /// p1 = p * decay
    /// m  = fma(beta1, m, omb1 * g)
    /// v  = fma(beta2, v, omb2 * (g * g))
    /// den = div(sqrt(v), bc2_sqrt) + eps
    /// p  = fma(-step_size, div(m, den), p1)
    /// ```
    pub fn adamw_step(
        &self,
        grad: &Storage,
        m: &Storage,
        v: &Storage,
        c: &AdamWConsts,
    ) -> Result<()> {
        let _prof = crate::profile::scope("adamw");
        match (self, grad, m, v) {
            (Storage::Cpu(p), Storage::Cpu(g), Storage::Cpu(m), Storage::Cpu(v)) => {
                p.adamw_step(g, m, v, c);
                Ok(())
            }
            (Storage::Gpu(p), Storage::Gpu(g), Storage::Gpu(m), Storage::Gpu(v)) => {
                p.adamw_step(g, m, v, c)
            }
            _ => bail!(
                Shape,
                "AdamW: parameter, gradient and moments must share a device"
            ),
        }
    }

    /// In-place SGD with momentum and (coupled) weight decay, PyTorch's formula:
    /// `g' = fma(wd, p, g)`; with momentum `buf = fma(momentum, buf, g')` (the first
    /// step sets `buf = g'`), `g' = buf`; `p = fma(-lr, g', p)`.
    pub fn sgd_step(
        &self,
        grad: &Storage,
        buf: Option<&Storage>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) -> Result<()> {
        let _prof = crate::profile::scope("sgd");
        match (self, grad, buf) {
            (Storage::Cpu(p), Storage::Cpu(g), None) => {
                p.sgd_step(g, None, lr, momentum, wd, first);
                Ok(())
            }
            (Storage::Cpu(p), Storage::Cpu(g), Some(Storage::Cpu(b))) => {
                p.sgd_step(g, Some(b), lr, momentum, wd, first);
                Ok(())
            }
            (Storage::Gpu(p), Storage::Gpu(g), None) => {
                p.sgd_step(g, None, lr, momentum, wd, first)
            }
            (Storage::Gpu(p), Storage::Gpu(g), Some(Storage::Gpu(b))) => {
                p.sgd_step(g, Some(b), lr, momentum, wd, first)
            }
            _ => bail!(
                Shape,
                "SGD: parameter, gradient and momentum buffer must share a device"
            ),
        }
    }
}
