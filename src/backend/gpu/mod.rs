//! The GPU side's shared ground: tensor buffers on the device ([`GpuStorage`],
//! recycled by size class in the [`pool`]), the process-wide [`context`]
//! (device, batched submission, readback, errors), the [`pipelines`]
//! description (families, composition, kernels), the cross-check's device
//! [`probe`] kernel, and grid helpers. Each primitive's launcher lives in its
//! family's `gpu.rs`; its kernels in `shaders/<family>.wgsl`.
//!
//! Tensors stay on the device; the host reads back only what it must (a
//! download, the loss scaler's finite flag, norm partials).
//!
//! The contract's fused multiply-add is `fma_c` in WGSL: the device's `fma`
//! when a start-up probe ([`arith`]) shows it is exactly fused, otherwise an
//! integer emulation (`shaders/math.wgsl`). Lavapipe's `fma` is not fused, so
//! there the emulation is used (slower matmuls, the same bits). The probe
//! also asks, apart, whether f32 subnormals survive `*`, `+` and `fma`; a
//! fused `fma` is kept whatever the answer (see [`arith`]).
//! `TINYLLM_GPU_FMA=soft` or `=native` overrides the choice;
//! `TINYLLM_ADAPTER=<substring>` picks an adapter.
//!
//! Kernels reach the driver with the contract written into them where the
//! backend allows ([`context::Shaders`]): hardened SPIR-V on Vulkan
//! ([`spirv`]), MSL with safe math on Metal ([`msl`]), HLSL with `precise`
//! on DX12 ([`hlsl`]), each passed through to wgpu; GL (and
//! `TINYLLM_GPU_SHADERS=wgsl`) gets plain WGSL (as naga's IR). On every path a
//! kernel's pipeline constants are resolved and the branches they decide
//! taken before the driver sees it ([`prune`]). The tests hold the kernels to
//! the contract without that help too: `adversary` (test-only) rewrites them
//! as a contracting, regrouping, flushing or fast-math compiler may.

#[cfg(any(test, feature = "test-hooks"))]
pub mod adversary;
pub mod arith;
pub mod context;
pub mod pipelines;
pub mod prune;
pub mod buffers;
pub mod cache;
pub mod hlsl;
pub mod msl;
mod passthrough;
pub mod probe_ops;
pub mod spirv;
pub mod variant;

use super::MAX_DIMS;
use crate::memory::Ticket;
use crate::{bail, Result};
use context::{ctx, ctx_if_created, Context};

/// A tensor's buffer on the GPU: `len` f32 elements of a pooled storage
/// buffer, from element `offset`. Most tensors own their buffer (offset 0);
/// tensors laid out together are views of one ([`GpuStorage::colocated`]),
/// so that one binding reads them all (a product batched over weights side
/// by side). The buffer goes back to the pool
/// when its last view is dropped.
pub struct GpuStorage {
    block: std::sync::Arc<Block>,
    offset: usize,
    len: usize,
}

/// A pooled buffer and the memory it counts for.
struct Block {
    buf: Option<wgpu::Buffer>,
    class: u64,
    _ticket: Ticket,
    /// Released, not pooled, when its last view goes: its values were laid
    /// out elsewhere ([`GpuStorage::colocated`]), and nothing of its size
    /// is likely to be asked for again.
    retired: std::sync::atomic::AtomicBool,
}

pub use context::Bind;

/// Bytes held by pooled GPU buffers that back no tensor right now.
pub fn gpu_pool_bytes() -> usize {
    ctx_if_created()
        .map(|c| c.pool.lock().unwrap().free_bytes() as usize)
        .unwrap_or(0)
}

/// The peak of the bytes the device has held for tensor buffers (backing a
/// tensor or pooled for reuse) since the last [`restart_device_peak`];
/// `None` before the GPU is first used.
pub fn device_peak_bytes() -> Option<usize> {
    ctx_if_created().map(|c| c.pool.lock().unwrap().held_bytes().1 as usize)
}

/// Releases the pooled buffers and restarts [`device_peak_bytes`] from the
/// tensors alive now (a comparison's second side starts clean).
pub fn restart_device_peak() {
    if let Some(c) = ctx_if_created() {
        let gone = c.pool.lock().unwrap().release_and_restart_peak();
        c.released(&gone);
    }
}

/// What the GPU backend runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterInfo {
    /// The adapter's name as the driver reports it, e.g.
    /// `llvmpipe (LLVM 15.0.6, 256 bits)`.
    pub name: String,
    /// Vulkan, Metal, Dx12 or Gl.
    pub backend: String,
    /// The driver's name (may be empty).
    pub driver: String,
    /// The driver's version and build details (may be empty).
    pub driver_info: String,
    /// A CPU-based software implementation (Mesa's lavapipe, SwiftShader).
    pub software: bool,
    /// "native" when the kernels use the device's `fma` (it is exactly
    /// fused, or `TINYLLM_GPU_FMA=native`), else "soft" (emulated).
    pub fma: &'static str,
    /// How the kernels reach the driver: hardened SPIR-V with the float
    /// controls requested and granted, or WGSL and why.
    pub shaders: String,
    /// The start-up probe found the device's `fma` fused (on normal operands).
    pub fma_fused: bool,
    /// "kept" when f32 subnormals survived `*`, `+` and `fma` in the start-up
    /// probe, else "flushed".
    pub subnormals: &'static str,
}

/// A graphics API the GPU backend can run on (wgpu's backends). Lavapipe is
/// reachable through two of them — Vulkan and, through Mesa's GL, GL — and
/// the adapter's name does not tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Vulkan (Linux, Windows, Android): kernels as hardened SPIR-V.
    Vulkan,
    /// OpenGL (ES), through wgpu's GLSL: a second shader front end.
    Gl,
    /// Metal (macOS, iOS).
    Metal,
    /// Direct3D 12 (Windows).
    Dx12,
}

impl Backend {
    /// As `--backend` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Vulkan => "vulkan",
            Backend::Gl => "gl",
            Backend::Metal => "metal",
            Backend::Dx12 => "dx12",
        }
    }
    pub(crate) fn wgpu(self) -> wgpu::Backends {
        match self {
            Backend::Vulkan => wgpu::Backends::VULKAN,
            Backend::Gl => wgpu::Backends::GL,
            Backend::Metal => wgpu::Backends::METAL,
            Backend::Dx12 => wgpu::Backends::DX12,
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Backend> {
        match s {
            "vulkan" => Ok(Backend::Vulkan),
            "gl" => Ok(Backend::Gl),
            "metal" => Ok(Backend::Metal),
            "dx12" => Ok(Backend::Dx12),
            _ => crate::bail!(Config, "unknown GPU backend {s:?}: expected vulkan, gl, metal or dx12"),
        }
    }
}

/// Runs the GPU backend on `backend` only (else every backend wgpu offers,
/// or those `WGPU_BACKEND` names). Must come before the first GPU use: an
/// error once the device exists.
pub fn use_backend(backend: Backend) -> Result<()> {
    if context::PREFERRED.set(backend).is_err() || context::ctx_if_created().is_some() {
        crate::bail!(Config, "the GPU backend is chosen before the GPU is first used");
    }
    Ok(())
}

/// The adapter the GPU backend uses, creating the device on first call.
pub fn adapter() -> Result<AdapterInfo> {
    let c = ctx()?;
    Ok(AdapterInfo {
        name: c.info.name.clone(),
        backend: format!("{:?}", c.info.backend),
        driver: c.info.driver.clone(),
        driver_info: c.info.driver_info.clone(),
        software: c.info.device_type == wgpu::DeviceType::Cpu,
        fma: if c.native_fma { "native" } else { "soft" },
        shaders: c.shaders.describe(),
        fma_fused: c.arith.fma_fused,
        subnormals: if c.arith.subnormals_kept { "kept" } else { "flushed" },
    })
}

/// The adapter's name and backend, e.g. `llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan)`.
pub fn adapter_name() -> Result<String> {
    let a = adapter()?;
    Ok(format!("{} ({})", a.name, a.backend))
}

/// Submits all recorded GPU work (it is otherwise submitted lazily).
pub fn flush() -> Result<()> {
    ctx()?.flush()
}

/// Submits all recorded GPU work and blocks until the device has finished it
/// (for timing: a kernel's wall time is `record; sync()`).
pub fn sync() -> Result<()> {
    ctx()?.sync()
}

/// Records a device-side copy of `src` into `dst` (`copy_buffer_to_buffer`, in
/// order with pending dispatches); both must hold the same number of elements.
/// The benchmarks' bandwidth baseline.
#[cfg(any(feature = "cli", feature = "test-hooks"))]
pub fn buffer_copy(src: &GpuStorage, dst: &GpuStorage) -> Result<()> {
    if src.len != dst.len {
        bail!(
            Shape,
            "buffer copy of {} elements into {} elements",
            src.len,
            dst.len
        );
    }
    ctx()?.copy(src.bind(), dst.bind(), src.len as u64 * 4)
}

/// Elements between the starts of views of one buffer are a multiple of this
/// (the device's binding-offset alignment, in f32s).
fn view_align(c: &Context) -> usize {
    (c.device.limits().min_storage_buffer_offset_alignment as usize / 4).max(1)
}

/// Whether kernels use the device's own `fma` ("native", probed to be exactly
/// fused) or the integer emulation of `shaders/math.wgsl` ("soft"); the choice is
/// [`arith::native_fma`]'s. For the benchmarks' report.
#[cfg(any(feature = "cli", feature = "test-hooks"))]
pub fn fma_mode() -> Result<&'static str> {
    Ok(adapter()?.fma)
}

/// `x` as a kernel's 32-bit index, or an error naming `what`.
pub fn u32_of(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| {
        crate::Error::device(format!(
            "{what} = {x} is too large for the GPU backend (32-bit indices)"
        ))
    })
}

/// Workgroups for `threads` invocations of a 64-wide 1-D kernel. Past 65535
/// groups per dimension the grid becomes 2-D; kernels recompute the linear id
/// with `grid_index` (`grid.wgsl`) and bounds-check it.
pub fn grid1d(threads: usize) -> (u32, u32, u32) {
    let groups = threads.div_ceil(64);
    if groups == 0 {
        return (0, 1, 1);
    }
    if groups <= 65535 {
        (groups as u32, 1, 1)
    } else {
        (65535, groups.div_ceil(65535) as u32, 1)
    }
}

/// A shape padded on the left to [`MAX_DIMS`] (size 1), and strides padded
/// with 0, as the kernels' fixed-size arrays.
pub fn pad6(shape: &[usize], strides: &[usize]) -> Result<([u32; MAX_DIMS], [u32; MAX_DIMS])> {
    let nd = shape.len();
    if nd > MAX_DIMS {
        bail!(Shape, "{nd} dimensions: at most {MAX_DIMS} are supported");
    }
    let (mut sh, mut st) = ([1u32; MAX_DIMS], [0u32; MAX_DIMS]);
    for d in 0..nd {
        sh[MAX_DIMS - nd + d] = u32_of(shape[d], "dimension")?;
        st[MAX_DIMS - nd + d] = u32_of(strides[d], "stride")?;
    }
    Ok((sh, st))
}

/// Longest loop one dispatch runs per invocation. Lavapipe (llvmpipe) stops
/// a shader silently after 65,535 loop iterations in all; reductions, matmul's
/// k and scatter rows longer than this run as several passes that carry their
/// running values through memory, in the same order.
pub const LOOP_PASS: usize = 16_384;

impl Drop for Block {
    fn drop(&mut self) {
        if let (Some(b), Some(c)) = (self.buf.take(), ctx_if_created()) {
            let mut pool = c.pool.lock().unwrap();
            let gone = match self.retired.load(std::sync::atomic::Ordering::Relaxed) {
                true => Some(pool.discard(self.class, b)),
                false => pool.put(self.class, b),
            };
            drop(pool);
            if let Some(b) = gone {
                c.released(&[b]);
            }
        }
    }
}

impl GpuStorage {
    /// An uninitialised buffer of `len` f32s (from the pool when possible).
    pub fn alloc(c: &Context, len: usize) -> Result<GpuStorage> {
        let block = std::sync::Arc::new(Block::alloc(c, len)?);
        Ok(GpuStorage {
            block,
            offset: 0,
            len,
        })
    }

    /// Where views of `lens` elements start when laid out in order, each at
    /// the binding alignment, and the elements they span.
    fn layout(c: &Context, lens: &[usize]) -> (Vec<usize>, usize) {
        let align = view_align(c);
        let mut at = 0usize;
        let starts = lens
            .iter()
            .map(|&n| {
                let start = at;
                at = at.saturating_add(n.next_multiple_of(align));
                start
            })
            .collect();
        (starts, at)
    }

    /// Uninitialised views of one buffer, of `lens` elements each, in order,
    /// each from the first multiple of the binding alignment after the
    /// previous one (views of one length are evenly spaced); `None` when
    /// they would not fit one binding.
    pub(crate) fn views(c: &Context, lens: &[usize]) -> Result<Option<Vec<GpuStorage>>> {
        let (starts, total) = GpuStorage::layout(c, lens);
        if (total as u64).saturating_mul(4) > c.max_binding() {
            return Ok(None);
        }
        let block = std::sync::Arc::new(Block::alloc(c, total)?);
        Ok(Some(
            lens.iter()
                .zip(starts)
                .map(|(&len, offset)| GpuStorage {
                    block: block.clone(),
                    offset,
                    len,
                })
                .collect(),
        ))
    }

    /// Copies of `xs` laid out as [`views`](Self::views) lays them out,
    /// copied on the device; `None` when they would not fit one binding:
    /// they stay as they are. Laid out once (`each_step` false: parameters,
    /// moments), `xs`' buffers are released when their last views go:
    /// nothing of their sizes is likely to be asked for again. Laid out
    /// afresh each step (an optimizer's gradients), they go back to the pool,
    /// where the next step's gradients take them, and the new buffer is
    /// released when its views go.
    pub fn colocated(xs: &[&GpuStorage], each_step: bool) -> Result<Option<Vec<GpuStorage>>> {
        let c = ctx()?;
        let lens: Vec<usize> = xs.iter().map(|x| x.len).collect();
        let Some(views) = GpuStorage::views(c, &lens)? else {
            return Ok(None);
        };
        for (x, v) in xs.iter().zip(&views) {
            c.copy(x.bind(), v.bind(), x.len as u64 * 4)?;
            let released = if each_step { &v.block } else { &x.block };
            released.retired.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(Some(views))
    }

    /// Zeros of `lens` elements, laid out as [`colocated`](Self::colocated)
    /// lays views of those lengths out (apart when they would not fit one
    /// binding).
    pub fn zeros_laid_out(lens: &[usize]) -> Result<Vec<GpuStorage>> {
        let c = ctx()?;
        let Some(views) = GpuStorage::views(c, lens)? else {
            return lens.iter().map(|&n| GpuStorage::full(n, 0.0)).collect();
        };
        // one upload over the buffer, from the first view (at its start)
        if let (Some(first), Some(last)) = (views.first(), views.last()) {
            let span = last.offset + last.len;
            c.upload(first.bind(), bytemuck::cast_slice(&vec![0f32; span]))?;
        }
        Ok(views)
    }

    /// Whether `xs` lie as [`colocated`](Self::colocated) lays them out.
    pub fn laid_out(xs: &[&GpuStorage]) -> bool {
        let Some(first) = xs.first() else { return true };
        let Ok(c) = ctx() else { return false };
        let lens: Vec<usize> = xs.iter().map(|x| x.len).collect();
        let (starts, _) = GpuStorage::layout(c, &lens);
        xs.iter().zip(starts).all(|(x, start)| {
            std::sync::Arc::ptr_eq(&x.block, &first.block) && x.offset == first.offset + start
        })
    }

    /// Whether `self` and `other` are views of one buffer.
    pub fn same_buffer(&self, other: &GpuStorage) -> bool {
        std::sync::Arc::ptr_eq(&self.block, &other.block)
    }

    /// The elements from `base`'s first to `self`'s first, when both are
    /// views of one buffer and `self` does not start before `base`.
    pub fn offset_from(&self, base: &GpuStorage) -> Option<usize> {
        if !std::sync::Arc::ptr_eq(&self.block, &base.block) {
            return None;
        }
        self.offset.checked_sub(base.offset)
    }

    /// The stride of `views` when they are views of one buffer, in order, an
    /// equal (nonzero) number of elements apart.
    pub fn spaced(views: &[&GpuStorage]) -> Option<usize> {
        let (first, rest) = views.split_first()?;
        let stride = rest.first()?.offset_from(first)?;
        let even = views
            .iter()
            .enumerate()
            .all(|(i, v)| v.offset_from(first) == Some(i * stride));
        (even && stride > 0).then_some(stride)
    }

    /// `self` and `other` through one binding where they are views of one
    /// buffer: the binding (from the earlier of the two), and where each
    /// starts in it (in f32s).
    pub fn one_binding<'a>(&'a self, other: &'a GpuStorage) -> Option<(Bind<'a>, usize, usize)> {
        if !std::sync::Arc::ptr_eq(&self.block, &other.block) {
            return None;
        }
        let base = if self.offset <= other.offset { self } else { other };
        Some((base.bind(), self.offset - base.offset, other.offset - base.offset))
    }

    /// The tensor's binding: its buffer from its first element.
    pub fn bind(&self) -> Bind<'_> {
        Bind {
            buf: self.block.buf.as_ref().expect("a live GPU tensor has a buffer"),
            offset: self.offset as u64 * 4,
        }
    }
}

impl Block {
    fn alloc(c: &Context, len: usize) -> Result<Block> {
        let bytes = (len as u64) * 4;
        let class = buffers::size_class(bytes.max(4));
        if class > c.max_binding() {
            bail!(
                Device,
                "a GPU tensor of {len} elements ({bytes} bytes) exceeds this device's largest \
                 storage binding ({} bytes, adapter {:?})",
                c.max_binding(),
                c.info.name
            );
        }
        u32_of(len, "tensor length")?;
        let pooled = c.pool.lock().unwrap().take(class);
        let buf = match pooled {
            Some(b) => b,
            None => {
                c.pool.lock().unwrap().created(class);
                let b = c.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("tensor"),
                    size: class,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                c.pooled(&b);
                b
            }
        };
        Ok(Block {
            buf: Some(buf),
            class,
            _ticket: Ticket::new(len * 4),
            retired: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

impl GpuStorage {
    pub fn upload(data: &[f32]) -> Result<Self> {
        let c = ctx()?;
        let s = Self::alloc(c, data.len())?;
        c.upload(s.bind(), bytemuck::cast_slice(data))?;
        Ok(s)
    }
    pub fn full(n: usize, v: f32) -> Result<Self> {
        // Allocate on the device first: a size the device refuses is an error
        // before any host memory is spent on it.
        let c = ctx()?;
        let s = Self::alloc(c, n)?;
        c.upload(s.bind(), bytemuck::cast_slice(&vec![v; n]))?;
        Ok(s)
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn download(&self) -> Result<Vec<f32>> {
        if self.len == 0 {
            return Ok(Vec::new());
        }
        let bytes = ctx()?.read(self.bind(), self.len as u64 * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}
