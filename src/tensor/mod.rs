//! `Tensor`: a value on a device, a shape, and — when it takes part in
//! autograd — a graph node. Host-side reverse mode, backend-agnostic: nothing
//! here looks inside the backend's `Storage`.

pub mod autocast;
pub mod autograd;
pub mod fp8;
pub(crate) mod saved;
pub mod shape;

use crate::backend::pack::Packed;
use crate::backend::round::Format;
use crate::backend::{DType, Device, Storage};
use crate::rng::Generator;
use crate::{bail, Result};
use autograd::{Node, Vjp};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use autograd::{is_grad_enabled, no_grad, set_grad_enabled, GradModeGuard};

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// A tensor's place in the graph, without its values. Graph nodes link to
/// their parents through this, so recording an op never keeps a parent's
/// buffer alive: only what a backward closure explicitly saves stays.
pub(crate) struct Meta {
    pub(crate) id: usize,
    pub(crate) shape: Vec<usize>,
    pub(crate) requires_grad: Cell<bool>,
    pub(crate) is_leaf: bool,
    pub(crate) grad: RefCell<Option<Tensor>>,
    pub(crate) node: RefCell<Option<Node>>,
}

impl Meta {
    /// Adds `g` into `.grad` (never overwrites). The first
    /// contribution is stored as is, unless its buffer is shared: `.grad` is
    /// updated in place later (unscaling, clipping), so it must own its buffer.
    pub(crate) fn accumulate_grad(&self, g: Tensor) -> Result<()> {
        let _ng = no_grad();
        let prev = self.grad.borrow().clone();
        let new = match prev {
            Some(prev) => prev.add(&g)?,
            None if g.shares_storage() => g.copy()?,
            None => g.detach(),
        };
        *self.grad.borrow_mut() = Some(new);
        Ok(())
    }
}

pub(crate) struct Inner {
    pub(crate) meta: Rc<Meta>,
    storage: RefCell<Storage>,
    /// Every value is a value of this 16-bit format (an op result that was
    /// rounded: a matmul under autocast, a cast), so it can be kept for
    /// backward in 16 bits without loss.
    half: Cell<Option<Format>>,
    /// The 16-bit copy made when autograd first saved these values that
    /// way, shared by every op that saves them — through any reshape, which
    /// shares the cell with the storage (see [`saved`]).
    packed: RefCell<Rc<RefCell<Option<Packed>>>>,
}

/// A shared handle: clones refer to the same tensor (and the same `.grad`).
///
/// Arithmetic works on references and, like every op, returns a `Result` (a
/// shape mismatch is an error, not a panic):
///
/// ```
/// use tinyllm::{Device, Tensor};
/// let a = Tensor::from_vec(vec![1.0, 2.0], &[2], Device::Cpu)?;
/// let y = (&(&a * &a)? + 1.0)?; // a² + 1, through the same ops as a.mul(&a)?.add_scalar(1.0)?
/// assert_eq!(y.to_vec_f32()?, vec![2.0, 5.0]);
/// # Ok::<(), tinyllm::Error>(())
/// ```
///
/// Handles are `Rc`-based, so a tensor stays on the thread that made it
/// (`!Send`); threads each build their own (grad mode, autocast and memory
/// counters are per thread too).
#[derive(Clone)]
pub struct Tensor(pub(crate) Rc<Inner>);

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?}, {}, {:?}",
            self.shape(),
            self.device(),
            self.dtype()
        )?;
        if self.numel() <= 16 {
            if let Ok(v) = self.to_vec_f64() {
                write!(f, ", {v:?}")?;
            }
        }
        write!(f, ")")
    }
}

impl Tensor {
    fn make(
        storage: Storage,
        shape: Vec<usize>,
        requires_grad: bool,
        node: Option<Node>,
    ) -> Tensor {
        debug_assert_eq!(storage.len(), shape::numel(&shape));
        Tensor(Rc::new(Inner {
            meta: Rc::new(Meta {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                shape,
                requires_grad: Cell::new(requires_grad),
                is_leaf: node.is_none(),
                grad: RefCell::new(None),
                node: RefCell::new(node),
            }),
            storage: RefCell::new(storage),
            half: Cell::new(None),
            packed: RefCell::new(Rc::new(RefCell::new(None))),
        }))
    }

    /// Records that every value is a value of `fmt` (nothing when `None`):
    /// the op that made `self` rounded its output to it.
    pub(crate) fn with_half(self, fmt: Option<Format>) -> Tensor {
        self.0.half.set(fmt);
        self
    }

    /// For a view sharing `src`'s buffer (a reshape): what is known about
    /// the values, and their 16-bit copy, are `src`'s.
    pub(crate) fn same_values_as(self, src: &Tensor) -> Tensor {
        self.0.half.set(src.half());
        *self.0.packed.borrow_mut() = src.0.packed.borrow().clone();
        self
    }

    /// The 16-bit format all values are known to belong to, if any.
    pub(crate) fn half(&self) -> Option<Format> {
        self.0.half.get()
    }

    /// A constant (leaf, no grad) over an existing storage.
    pub(crate) fn from_storage(storage: Storage, shape: &[usize]) -> Result<Tensor> {
        if storage.len() != shape::numel(shape) {
            bail!(
                Shape,
                "{} values do not fill a tensor of shape {shape:?}",
                storage.len()
            );
        }
        Ok(Tensor::make(storage, shape.to_vec(), false, None))
    }

    /// The result of a differentiable op — the extension point for ops of
    /// your own. `value` is the forward result
    /// (computed by any ops, typically under [`no_grad`]); a
    /// graph node with `vjp` is recorded only when grad mode is on and some
    /// parent requires grad, otherwise the result is a constant. `vjp` maps the
    /// upstream gradient to one gradient per parent (`None`: no gradient).
    ///
    /// ```
    /// use tinyllm::{Device, Tensor};
    /// # fn main() -> tinyllm::Result<()> {
    /// // y = 3x, written as a custom op whose backward is 3g
    /// let x = Tensor::from_vec(vec![1.0, 2.0], &[2], Device::Cpu)?.requires_grad_(true);
    /// let value = { let _ng = tinyllm::no_grad(); x.mul_scalar(3.0)? };
    /// let y = Tensor::from_op(&value, "triple", &[&x], |g| Ok(vec![Some(g.mul_scalar(3.0)?)]));
    /// y.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec_f32()?, vec![3.0, 3.0]);
    /// # Ok(()) }
    /// ```
    pub fn from_op(
        value: &Tensor,
        name: &'static str,
        parents: &[&Tensor],
        vjp: impl FnOnce(&Tensor) -> Result<Vec<Option<Tensor>>> + 'static,
    ) -> Tensor {
        Tensor::record(value.storage(), value.shape().to_vec(), name, parents, vjp)
    }

    /// [`from_op`](Self::from_op) over a storage: how every op in the crate
    /// records itself.
    pub(crate) fn record(
        storage: Storage,
        shape: Vec<usize>,
        name: &'static str,
        parents: &[&Tensor],
        vjp: impl FnOnce(&Tensor) -> Result<Vec<Option<Tensor>>> + 'static,
    ) -> Tensor {
        Tensor::record_gathering(storage, shape, name, parents, move |g, _| vjp(g))
    }

    /// [`Tensor::record`] for a backward that may take its parents'
    /// gradients gathered so far and add its own into them (see [`Vjp`]).
    pub(crate) fn record_gathering(
        storage: Storage,
        shape: Vec<usize>,
        name: &'static str,
        parents: &[&Tensor],
        vjp: impl FnOnce(&Tensor, &mut autograd::Gathered) -> Result<Vec<Option<Tensor>>> + 'static,
    ) -> Tensor {
        if is_grad_enabled() && parents.iter().any(|p| p.requires_grad()) {
            let node = Node {
                name,
                parents: parents.iter().map(|&p| p.0.meta.clone()).collect(),
                vjp: Box::new(vjp) as Vjp,
                joint: None,
                site: crate::trace::site(),
            };
            Tensor::make(storage, shape, true, Some(node))
        } else {
            Tensor::make(storage, shape, false, None)
        }
    }

    /// A constant f32 tensor (a leaf that does not require grad) of `shape`
    /// from row-major `data`, uploaded to `device`.
    ///
    /// Errors if `data.len()` is not the product of `shape`, or if the GPU
    /// cannot be reached for [`Device::Gpu`].
    pub fn from_vec(data: Vec<f32>, shape: &[usize], device: Device) -> Result<Tensor> {
        if data.len() != shape::numel(shape) {
            bail!(
                Shape,
                "{} values do not fill a tensor of shape {shape:?}",
                data.len()
            );
        }
        Tensor::from_storage(Storage::from_f32(data, device)?, shape)
    }

    /// A constant f64 tensor of `shape` from row-major `data`. f64 tensors live on
    /// the CPU only: [`Device::Gpu`] is an error, as is a length that does not
    /// fill `shape`.
    pub fn from_vec_f64(data: Vec<f64>, shape: &[usize], device: Device) -> Result<Tensor> {
        if data.len() != shape::numel(shape) {
            bail!(
                Shape,
                "{} values do not fill a tensor of shape {shape:?}",
                data.len()
            );
        }
        Tensor::from_storage(Storage::from_f64(data, device)?, shape)
    }

    /// From an ndarray array (f32, any dimension) onto `device`.
    #[cfg(feature = "ndarray")]
    pub fn from_ndarray(a: &ndarray::ArrayD<f32>, device: Device) -> Result<Tensor> {
        let shape = a.shape().to_vec();
        Tensor::from_vec(a.iter().copied().collect(), &shape, device)
    }

    /// The values as an ndarray array (f32).
    #[cfg(feature = "ndarray")]
    pub fn to_ndarray(&self) -> Result<ndarray::ArrayD<f32>> {
        ndarray::ArrayD::from_shape_vec(self.shape().to_vec(), self.to_vec_f32()?)
            .map_err(|e| crate::Error::shape(e.to_string()))
    }

    /// A constant tensor of `shape` with every element `value` (rounded to f32
    /// for [`DType::F32`]). Errors for an f64 tensor on the GPU.
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::from_storage(
            Storage::full(shape::numel(shape), value, dtype, device)?,
            shape,
        )
    }
    /// A constant tensor of zeros; see [`full`](Self::full).
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype, device)
    }
    /// A constant tensor of ones; see [`full`](Self::full).
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }
    /// A 0-dimensional f32 tensor.
    pub fn scalar(v: f32, device: Device) -> Result<Tensor> {
        Tensor::from_vec(vec![v], &[], device)
    }
    /// Normal(0, std²) entries drawn on the host from `gen` (same bits on every device).
    pub fn randn(shape: &[usize], std: f32, gen: &Generator, device: Device) -> Result<Tensor> {
        let v = gen
            .normal(shape::numel(shape))
            .into_iter()
            .map(|x| x * std)
            .collect();
        Tensor::from_vec(v, shape, device)
    }
    /// Uniform(-bound, bound) entries drawn on the host from `gen`.
    pub fn uniform(shape: &[usize], bound: f32, gen: &Generator, device: Device) -> Result<Tensor> {
        let v = gen
            .uniform(shape::numel(shape))
            .into_iter()
            .map(|u| (2.0 * u - 1.0) * bound)
            .collect();
        Tensor::from_vec(v, shape, device)
    }
    /// A tensor like `self` filled with `value`.
    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        Tensor::full(self.shape(), value, self.dtype(), self.device())
    }
    /// A tensor of zeros with `self`'s shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        self.full_like(0.0)
    }
    /// A tensor of ones with `self`'s shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        self.full_like(1.0)
    }

    /// A process-wide unique id, assigned at creation (clones share it; every
    /// op result gets a new one).
    pub fn id(&self) -> usize {
        self.0.meta.id
    }
    /// The size of each dimension, outermost first (empty for a 0-d tensor).
    pub fn shape(&self) -> &[usize] {
        &self.0.meta.shape
    }
    /// The number of dimensions (0 for a scalar).
    pub fn dims(&self) -> usize {
        self.0.meta.shape.len()
    }
    /// The number of elements (the product of the shape; 1 for a scalar).
    pub fn numel(&self) -> usize {
        shape::numel(&self.0.meta.shape)
    }
    /// Where the values live.
    pub fn device(&self) -> Device {
        self.0.storage.borrow().device()
    }
    /// The element type: always [`DType::F32`] on the GPU.
    pub fn dtype(&self) -> DType {
        self.0.storage.borrow().dtype()
    }
    /// The storage handle (shared, not copied).
    pub(crate) fn storage(&self) -> Storage {
        self.0.storage.borrow().clone()
    }
    /// Replaces the values of a leaf with those of `values` (same shape; it
    /// is moved to this tensor's device and dtype): loading weights. The
    /// graph, `.grad` and `requires_grad` are untouched.
    pub fn assign(&self, values: &Tensor) -> Result<()> {
        if values.shape() != self.shape() {
            bail!(
                Shape,
                "assign: values of shape {:?} for a tensor of shape {:?}",
                values.shape(),
                self.shape()
            );
        }
        let s = values
            .storage()
            .to_device(self.device())?
            .to_dtype(self.dtype())?;
        self.set_storage(s)
    }

    /// Whether `self` and `other` are the same tensor (not equal values: the
    /// same node).
    pub(crate) fn same(&self, other: &Tensor) -> bool {
        Rc::ptr_eq(&self.0, &other.0)
    }

    /// Lays the values of `ts` (leaves of one device and type) side by side
    /// where the device gains from it: on a GPU, as views of one buffer,
    /// weights one product reads all of ([`matmul_t_shared`](Tensor::matmul_t_shared)).
    /// Values, `.grad` and the graph are untouched.
    pub fn colocate(ts: &[&Tensor]) -> Result<()> {
        Tensor::colocate_with(ts, false)
    }

    /// [`colocate`](Tensor::colocate) for values laid out afresh every step
    /// (an optimizer's gradients): their old buffers go back to the pool,
    /// where the next step's take them, and the one they are copied into is
    /// released when they go.
    pub fn colocate_each_step(ts: &[&Tensor]) -> Result<()> {
        Tensor::colocate_with(ts, true)
    }

    fn colocate_with(ts: &[&Tensor], each_step: bool) -> Result<()> {
        let storages: Vec<Storage> = ts.iter().map(|t| t.storage()).collect();
        let placed = Storage::colocate(&storages.iter().collect::<Vec<_>>(), each_step)?;
        for (t, s) in ts.iter().zip(placed) {
            t.set_storage(s)?;
        }
        Ok(())
    }

    /// Zeros of each of `ts`' shapes (f32, on their device), laid out as
    /// [`colocate`](Tensor::colocate) would lay them out: an optimizer's
    /// moments beside its parameters.
    pub fn zeros_laid_out(ts: &[&Tensor]) -> Result<Vec<Tensor>> {
        let storages: Vec<Storage> = ts.iter().map(|t| t.storage()).collect();
        let zeros = Storage::zeros_laid_out(&storages.iter().collect::<Vec<_>>())?;
        ts.iter()
            .zip(zeros)
            .map(|(t, z)| Tensor::from_storage(z, t.shape()))
            .collect()
    }

    /// Whether `ts` are as [`colocate`](Tensor::colocate) lays them out.
    pub fn side_by_side(ts: &[&Tensor]) -> bool {
        let storages: Vec<Storage> = ts.iter().map(|t| t.storage()).collect();
        Storage::side_by_side(&storages.iter().collect::<Vec<_>>())
    }

    /// Replaces the values of a leaf in place (loading a checkpoint, tests).
    pub(crate) fn set_storage(&self, s: Storage) -> Result<()> {
        if s.len() != self.numel() || s.dtype() != self.dtype() {
            bail!(
                Shape,
                "set_storage: {} {:?} values for a {:?} {:?} tensor",
                s.len(),
                s.dtype(),
                self.shape(),
                self.dtype()
            );
        }
        *self.0.storage.borrow_mut() = s;
        Ok(())
    }
    /// The values in row-major order as f32 (f64 values are rounded). Reads a
    /// GPU tensor back to the host, waiting for pending work.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        self.storage().to_vec_f32()
    }
    /// The values in row-major order as f64 (f32 values are widened exactly).
    /// Reads a GPU tensor back to the host, waiting for pending work.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        self.storage().to_vec_f64()
    }
    /// The single value of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            bail!(Shape, "item() of a tensor with {} elements", self.numel());
        }
        Ok(self.to_vec_f64()?[0])
    }
    /// A copy on `device`, differentiable (the gradient moves back).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let from = self.device();
        let s = self.storage().to_device(device)?;
        Ok(Tensor::record(
            s,
            self.shape().to_vec(),
            "to_device",
            &[self],
            move |g| Ok(vec![Some(g.to_device(from)?)]),
        ))
    }
    /// A copy with another dtype (f32 ↔ f64, CPU), differentiable.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let from = self.dtype();
        let s = self.storage().to_dtype(dtype)?;
        Ok(Tensor::record(
            s,
            self.shape().to_vec(),
            "to_dtype",
            &[self],
            move |g| Ok(vec![Some(g.to_dtype(from)?)]),
        ))
    }
    /// A new leaf sharing the values, outside any graph.
    pub fn detach(&self) -> Tensor {
        Tensor::make(self.storage(), self.shape().to_vec(), false, None)
    }
    pub(crate) fn shares_storage(&self) -> bool {
        let s = self.0.storage.borrow();
        Rc::strong_count(&self.0) > 1 || s.is_shared()
    }
    /// A constant copy with its own buffer, on the same device.
    pub fn copy(&self) -> Result<Tensor> {
        let s = self.storage().strided_copy(
            self.shape(),
            &shape::contiguous_strides(self.shape()),
            0,
        )?;
        Tensor::from_storage(s, self.shape())
    }
    /// A new leaf with its own copy of the values.
    pub fn deep_clone(&self) -> Result<Tensor> {
        let s = self.storage();
        let copy = match s.dtype() {
            DType::F32 => Storage::from_f32(s.to_vec_f32()?, s.device())?,
            DType::F64 => Storage::from_f64(s.to_vec_f64()?, s.device())?,
        };
        Tensor::from_storage(copy, self.shape())
    }

    /// Whether gradients flow to this tensor: a leaf marked with
    /// [`requires_grad_`](Self::requires_grad_), or an op result recorded in the graph.
    pub fn requires_grad(&self) -> bool {
        self.0.meta.requires_grad.get()
    }
    /// Marks a leaf as trainable (builder style).
    ///
    /// # Panics
    ///
    /// If `self` is not a leaf (an op's recorded result).
    pub fn requires_grad_(self, on: bool) -> Tensor {
        assert!(self.0.meta.is_leaf, "requires_grad_ on a non-leaf tensor");
        self.0.meta.requires_grad.set(on);
        self
    }
    /// Whether the tensor was created directly (from data, or by an op with no
    /// graph recorded) rather than recorded as an op's result; only leaves keep a
    /// `.grad`.
    pub fn is_leaf(&self) -> bool {
        self.0.meta.is_leaf
    }
    /// The accumulated gradient of a leaf.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.meta.grad.borrow().clone()
    }
    /// Replaces the accumulated gradient (`None` clears it).
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.0.meta.grad.borrow_mut() = g;
    }
    /// Clears the accumulated gradient (sets it to `None`); the next backward
    /// starts afresh.
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }
    /// Backpropagates from a one-element tensor (seed 1): every leaf that
    /// requires grad and was reached gets `d self / d leaf` *added* to its
    /// [`grad`](Self::grad). The graph is consumed as it goes (saved values are
    /// freed), so a second backward over the same forward pass is an error.
    ///
    /// Errors if `self` has more than one element (use
    /// [`backward_with`](Self::backward_with)) or does not require grad.
    ///
    /// ```
    /// use tinyllm::{Device, Tensor};
    /// // y = sum(x * x + 2x), so dy/dx = 2x + 2
    /// let x = Tensor::from_vec(vec![1.0, -3.0], &[2], Device::Cpu)?.requires_grad_(true);
    /// let y = x.mul(&x)?.add(&x.mul_scalar(2.0)?)?.sum_all()?;
    /// y.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec_f32()?, vec![4.0, -4.0]);
    /// # Ok::<(), tinyllm::Error>(())
    /// ```
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            bail!(
                Shape,
                "backward() needs a one-element tensor (shape {:?}); use backward_with(seed)",
                self.shape()
            );
        }
        let seed = self.ones_like()?;
        autograd::backward(self, seed)
    }
    /// Backpropagates with an explicit seed gradient of this tensor's shape
    /// (the vector in the vector-Jacobian product). Errors if the seed's shape
    /// differs or `self` does not require grad.
    pub fn backward_with(&self, seed: &Tensor) -> Result<()> {
        autograd::backward(self, seed.detach())
    }
}
