//! The wgpu backend: every primitive of [`Storage`](super::Storage) as a WGSL
//! kernel (`shaders/*.wgsl`) that follows the CPU reference's canonical
//! algorithm expression for expression, so results agree bit for bit.
//!
//! * [`context`]: the lazily created device, batched submission, readback, errors;
//! * [`pool`]: storage buffers recycled by size class;
//! * [`pipelines`]: shader sources, their composition, the kernel catalogue.
//!
//! Tensors stay on the device; the host reads back only what it must (a
//! download, the loss scaler's finite flag, norm partials).
//!
//! The contract's fused multiply-add is `fma_c` in WGSL: the device's `fma`
//! when a start-up probe shows it is exactly fused, otherwise an integer
//! emulation (`shaders/fma.wgsl`). Lavapipe's `fma` is not fused, so there the
//! emulation is used (about 4x slower matmuls, bit-exact). `TINYLLM_GPU_FMA=soft`
//! or `=native` overrides the probe; `TINYLLM_ADAPTER=<substring>` picks an adapter.

pub mod context;
pub mod pipelines;
pub mod pool;

use super::round::Format;
use super::{
    AdamWConsts, BinaryLayout, BinaryOp, MatmulDims, ReduceOp, UnaryOp, MAX_DIMS, NORM_CHUNK,
};
use crate::memory::Ticket;
use crate::{bail, Result};
use context::{ctx, ctx_if_created, Context};
use pipelines::Kernel;

/// A tensor's buffer on the GPU: f32 elements in a pooled storage buffer.
pub struct GpuStorage {
    buf: Option<wgpu::Buffer>,
    class: u64,
    len: usize,
    _ticket: Ticket,
}

/// Bytes held by pooled GPU buffers that back no tensor right now.
pub fn gpu_pool_bytes() -> usize {
    ctx_if_created()
        .map(|c| c.pool.lock().unwrap().free_bytes() as usize)
        .unwrap_or(0)
}

/// The adapter's name when a GPU device can be created.
pub fn adapter_name() -> Result<String> {
    let c = ctx()?;
    Ok(format!("{} ({:?})", c.info.name, c.info.backend))
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
pub fn buffer_copy(src: &GpuStorage, dst: &GpuStorage) -> Result<()> {
    if src.len != dst.len {
        bail!(
            Shape,
            "buffer copy of {} elements into {} elements",
            src.len,
            dst.len
        );
    }
    ctx()?.copy(src.buf(), dst.buf(), src.len as u64 * 4)
}

/// Whether kernels use the device's own `fma` ("native", probed to be exactly
/// fused) or the integer emulation of `shaders/fma.wgsl` ("soft").
pub fn fma_mode() -> Result<&'static str> {
    Ok(if ctx()?.native_fma { "native" } else { "soft" })
}

/// `(label, composed source, entry points)` of every shader as the backend
/// compiles it, in both fma variants, plus the fma probe: for validation
/// without a GPU (tests/shaders_validate.rs).
pub fn shader_sources() -> Vec<(String, String, Vec<&'static str>)> {
    let mut out = Vec::new();
    for native in [false, true] {
        for f in pipelines::FAMILIES.iter() {
            let entries = Kernel::ALL
                .iter()
                .map(|k| k.family_and_entry())
                .filter(|(fam, _)| fam.name == f.name)
                .map(|(_, e)| e)
                .collect();
            let label = format!(
                "{} (fma {})",
                f.name,
                if native { "native" } else { "soft" }
            );
            out.push((label, pipelines::compose(*f, native), entries));
        }
    }
    out.push((
        "fma probe".to_string(),
        pipelines::FMA_PROBE.to_string(),
        vec!["probe"],
    ));
    out
}

fn u32_of(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| {
        crate::Error::device(format!(
            "{what} = {x} is too large for the GPU backend (32-bit indices)"
        ))
    })
}

/// Output columns of one matmul workgroup (matmul.wgsl: one per invocation).
const MATMUL_COLS: usize = 64;
/// Output rows of one matmul workgroup (matmul.wgsl `ROWS`).
const MATMUL_ROWS: usize = 64;

fn fmt_code(f: Option<Format>) -> u32 {
    match f {
        None => 0,
        Some(Format::Bf16) => 1,
        Some(Format::Fp16) => 2,
    }
}

/// Workgroups for `threads` invocations of a 64-wide 1-D kernel. Past 65535
/// groups per dimension the grid becomes 2-D; kernels recompute the linear id
/// as `(wg.y * groups.x + wg.x) * 64 + lane` and bounds-check it.
fn grid1d(threads: usize) -> (u32, u32, u32) {
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

/// Pads a shape and its strides on the left to [`MAX_DIMS`] (size 1, stride 0).
fn pad6(shape: &[usize], strides: &[&[usize]]) -> Result<Vec<[u32; MAX_DIMS]>> {
    let nd = shape.len();
    if nd > MAX_DIMS {
        bail!(Shape, "{nd} dimensions: at most {MAX_DIMS} are supported");
    }
    let mut out = vec![[1u32; MAX_DIMS]];
    for (d, &s) in shape.iter().enumerate() {
        out[0][MAX_DIMS - nd + d] = u32_of(s, "dimension")?;
    }
    for st in strides {
        let mut a = [0u32; MAX_DIMS];
        for (d, &s) in st.iter().enumerate() {
            a[MAX_DIMS - nd + d] = u32_of(s, "stride")?;
        }
        out.push(a);
    }
    Ok(out)
}

fn bits(x: f32) -> u32 {
    x.to_bits()
}

impl Drop for GpuStorage {
    fn drop(&mut self) {
        if let (Some(b), Some(c)) = (self.buf.take(), ctx_if_created()) {
            c.pool.lock().unwrap().put(self.class, b);
        }
    }
}

/// Longest loop one dispatch runs per invocation. Lavapipe (llvmpipe) stops
/// a shader silently after 65,535 loop iterations in all; reductions, matmul's
/// k and scatter rows longer than this run as several passes that carry their
/// running values through memory, in the same order.
const LOOP_PASS: usize = 16_384;

/// Softmax rows run as one fused loop nest per row; on a device that caps
/// shader loops (lavapipe) a row that long would be cut short silently, so it
/// is refused instead.
fn check_row_loops(c: &Context, what: &str, iterations: usize) -> Result<()> {
    if c.info.name.contains("llvmpipe") && iterations > 60_000 {
        bail!(Device,
            "{what} over rows of {} elements exceeds the loop limit of this software device ({}: 65,535 shader loop iterations)",
            iterations / if what == "softmax" { 3 } else { 2 },
            c.info.name
        );
    }
    Ok(())
}

impl GpuStorage {
    /// An uninitialised buffer of `len` f32s (from the pool when possible).
    fn alloc(c: &Context, len: usize) -> Result<GpuStorage> {
        let bytes = (len as u64) * 4;
        let class = pool::size_class(bytes.max(4));
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
            None => c.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("tensor"),
                size: class,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        };
        Ok(GpuStorage {
            buf: Some(buf),
            class,
            len,
            _ticket: Ticket::new(len * 4),
        })
    }

    fn buf(&self) -> &wgpu::Buffer {
        self.buf.as_ref().expect("a live GPU tensor has a buffer")
    }

    pub fn upload(data: &[f32]) -> Result<Self> {
        let c = ctx()?;
        let s = Self::alloc(c, data.len())?;
        c.upload(s.buf(), bytemuck::cast_slice(data))?;
        Ok(s)
    }
    pub fn full(n: usize, v: f32) -> Result<Self> {
        // Allocate on the device first: a size the device refuses is an error
        // before any host memory is spent on it.
        let c = ctx()?;
        let s = Self::alloc(c, n)?;
        c.upload(s.buf(), bytemuck::cast_slice(&vec![v; n]))?;
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
        let bytes = ctx()?.read(self.buf(), self.len as u64 * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// `y = f(x)` (elementwise.wgsl `unary`).
    pub fn unary(&self, op: UnaryOp) -> Result<Self> {
        let c = ctx()?;
        let n = self.len;
        let out = Self::alloc(c, n)?;
        let (code, scalar, fmt) = match op {
            UnaryOp::Neg => (0, 0.0, 0),
            UnaryOp::Exp => (1, 0.0, 0),
            UnaryOp::Log => (2, 0.0, 0),
            UnaryOp::Sqrt => (3, 0.0, 0),
            UnaryOp::Rsqrt => (4, 0.0, 0),
            UnaryOp::Recip => (5, 0.0, 0),
            UnaryOp::Sigmoid => (6, 0.0, 0),
            UnaryOp::Silu => (7, 0.0, 0),
            UnaryOp::SiluGrad => (8, 0.0, 0),
            UnaryOp::Abs => (9, 0.0, 0),
            UnaryOp::Relu => (10, 0.0, 0),
            UnaryOp::Step => (11, 0.0, 0),
            UnaryOp::Square => (12, 0.0, 0),
            // scalars narrowed to f32 once, on the host, like the CPU's T::from_f64
            UnaryOp::AddScalar(s) => (13, s as f32, 0),
            UnaryOp::MulScalar(s) => (14, s as f32, 0),
            UnaryOp::DivScalar(s) => (15, s as f32, 0),
            UnaryOp::RDivScalar(s) => (16, s as f32, 0),
            UnaryOp::Round(f) => (17, 0.0, fmt_code(Some(f))),
        };
        c.dispatch(
            Kernel::Unary,
            &[n as u32, code, bits(scalar), fmt],
            &[self.buf(), out.buf()],
            grid1d(n),
        )?;
        Ok(out)
    }

    /// `y[i] = lhs[li] op rhs[ri]` over a broadcast layout (elementwise.wgsl `binary`).
    pub fn binary(&self, rhs: &Self, op: BinaryOp, layout: &BinaryLayout) -> Result<Self> {
        let c = ctx()?;
        let n: usize = layout.shape.iter().product();
        let out = Self::alloc(c, n)?;
        let code = match op {
            BinaryOp::Add => 0,
            BinaryOp::Sub => 1,
            BinaryOp::Mul => 2,
            BinaryOp::Div => 3,
            BinaryOp::Maximum => 4,
            BinaryOp::Eq => 5,
        };
        let p6 = pad6(&layout.shape, &[&layout.lhs_strides, &layout.rhs_strides])?;
        let mut params = vec![n as u32, code, 0, 0];
        for a in &p6 {
            params.extend_from_slice(a);
        }
        c.dispatch(
            Kernel::Binary,
            &params,
            &[self.buf(), rhs.buf(), out.buf()],
            grid1d(n),
        )?;
        Ok(out)
    }

    /// `(outer, r, inner) -> (outer, inner)`, ascending (reduce.wgsl `reduce`).
    pub fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<Self> {
        let c = ctx()?;
        let n = outer * inner;
        let out = Self::alloc(c, n)?;
        let code = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
        };
        // Passes of at most LOOP_PASS steps each (see reduce.wgsl); at least one.
        let mut k0 = 0;
        loop {
            let k1 = (k0 + LOOP_PASS).min(r);
            c.dispatch(
                Kernel::Reduce,
                &[
                    u32_of(outer, "outer")?,
                    u32_of(r, "r")?,
                    u32_of(inner, "inner")?,
                    code,
                    k0 as u32,
                    k1 as u32,
                ],
                &[self.buf(), out.buf()],
                grid1d(n),
            )?;
            k0 = k1;
            if k0 >= r {
                break;
            }
        }
        Ok(out)
    }

    /// Batched matmul under the contract (matmul.wgsl).
    pub fn matmul(&self, rhs: &Self, d: MatmulDims, round: Option<Format>) -> Result<Self> {
        let c = ctx()?;
        let n_out = d.batch * d.m * d.n;
        let out = Self::alloc(c, n_out)?;
        if n_out == 0 {
            return Ok(out);
        }
        let gx = d.n.div_ceil(MATMUL_COLS);
        let gy = d.m.div_ceil(MATMUL_ROWS);
        if gx > 65535 || gy > 65535 {
            bail!(
                Device,
                "matmul of {}x{} outputs per batch is too large for one GPU dispatch",
                d.m,
                d.n
            );
        }
        let kernel = Kernel::Matmul {
            fmt: fmt_code(round) as u8,
            trans_a: d.trans_a,
            trans_b: d.trans_b,
        };
        let mut b0 = 0usize;
        while b0 < d.batch {
            let nb = (d.batch - b0).min(65535);
            // k in passes of at most LOOP_PASS steps (see matmul.wgsl); at least one.
            let mut p0 = 0usize;
            loop {
                let p1 = (p0 + LOOP_PASS).min(d.k);
                let params = [
                    u32_of(d.m, "m")?,
                    u32_of(d.k, "k")?,
                    u32_of(d.n, "n")?,
                    d.trans_a as u32,
                    d.trans_b as u32,
                    u32_of(d.a_batch_stride, "batch stride")?,
                    u32_of(d.b_batch_stride, "batch stride")?,
                    fmt_code(round),
                    b0 as u32,
                    p0 as u32,
                    p1 as u32,
                    (p1 == d.k) as u32,
                ];
                c.dispatch(
                    kernel,
                    &params,
                    &[self.buf(), rhs.buf(), out.buf()],
                    (gx as u32, gy as u32, nb as u32),
                )?;
                p0 = p1;
                if p0 >= d.k {
                    break;
                }
            }
            b0 += nb;
        }
        Ok(out)
    }

    /// A strided view gathered into a contiguous buffer (copy.wgsl `strided_copy`).
    pub fn strided_copy(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Self> {
        let c = ctx()?;
        let n: usize = shape.iter().product();
        let out = Self::alloc(c, n)?;
        let p6 = pad6(shape, &[strides])?;
        let mut params = vec![n as u32, u32_of(offset, "offset")?, 0, 0];
        for a in &p6 {
            params.extend_from_slice(a);
        }
        c.dispatch(
            Kernel::StridedCopy,
            &params,
            &[self.buf(), out.buf()],
            grid1d(n),
        )?;
        Ok(out)
    }

    /// `(outer, sizes[i], inner)` parts concatenated on the middle axis: one
    /// copy dispatch per part (copy.wgsl `concat_part`).
    pub fn concat(parts: &[&Self], outer: usize, sizes: &[usize], inner: usize) -> Result<Self> {
        let c = ctx()?;
        let total: usize = sizes.iter().sum();
        let out = Self::alloc(c, outer * total * inner)?;
        let mut dst = 0usize;
        for (p, &s) in parts.iter().zip(sizes) {
            let seg = s * inner;
            c.dispatch(
                Kernel::ConcatPart,
                &[
                    u32_of(outer, "outer")?,
                    u32_of(seg, "segment")?,
                    u32_of(total * inner, "row")?,
                    u32_of(dst * inner, "offset")?,
                ],
                &[p.buf(), out.buf()],
                grid1d(outer * seg),
            )?;
            dst += s;
        }
        Ok(out)
    }

    /// Embedding rows `table[ids[i]]` (gather.wgsl `gather_rows`).
    pub fn gather_rows(&self, ids: &[u32], d: usize) -> Result<Self> {
        let c = ctx()?;
        let n = ids.len() * d;
        let out = Self::alloc(c, n)?;
        if n == 0 {
            return Ok(out);
        }
        let idb = c.buffer_with(bytemuck::cast_slice(ids));
        c.dispatch(
            Kernel::GatherRows,
            &[u32_of(ids.len(), "ids")?, u32_of(d, "d")?],
            &[self.buf(), &idb, out.buf()],
            grid1d(n),
        )?;
        Ok(out)
    }

    /// Scatter-add rows into `(v, d)` without float atomics: the host builds,
    /// per output row, the ascending list of source rows (CSR), and each output
    /// element sums its list in order (gather.wgsl `scatter_add_rows`).
    pub fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize) -> Result<Self> {
        let c = ctx()?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= v) {
            bail!(Shape, "index {bad} out of range for {v} rows");
        }
        let out = Self::alloc(c, v * d)?;
        if v * d == 0 {
            return Ok(out);
        }
        // Counting sort of i by ids[i]: stable, so each row's list ascends.
        let mut rowptr = vec![0u32; v + 1];
        for &i in ids {
            rowptr[i as usize + 1] += 1;
        }
        for r in 0..v {
            rowptr[r + 1] += rowptr[r];
        }
        let mut fill = rowptr.clone();
        let mut list = vec![0u32; ids.len()];
        for (i, &r) in ids.iter().enumerate() {
            list[fill[r as usize] as usize] = i as u32;
            fill[r as usize] += 1;
        }
        let rp = c.buffer_with(bytemuck::cast_slice(&rowptr));
        let ls = c.buffer_with(bytemuck::cast_slice(&list));
        // Rows with more contributions than LOOP_PASS take several passes (gather.wgsl).
        let longest = (0..v)
            .map(|r| (rowptr[r + 1] - rowptr[r]) as usize)
            .max()
            .unwrap_or(0);
        let mut skip = 0;
        loop {
            c.dispatch(
                Kernel::ScatterAddRows,
                &[
                    u32_of(v, "v")?,
                    u32_of(d, "d")?,
                    skip as u32,
                    LOOP_PASS as u32,
                ],
                &[self.buf(), &rp, &ls, out.buf()],
                grid1d(v * d),
            )?;
            skip += LOOP_PASS;
            if skip >= longest {
                break;
            }
        }
        Ok(out)
    }

    /// Row softmax, one invocation per row (reduce.wgsl `softmax_rows`).
    pub fn softmax_rows(&self, rows: usize, n: usize) -> Result<Self> {
        let c = ctx()?;
        check_row_loops(c, "softmax", 3 * n)?;
        let out = Self::alloc(c, rows * n)?;
        if n == 0 {
            return Ok(out);
        }
        c.dispatch(
            Kernel::Softmax,
            &[u32_of(rows, "rows")?, u32_of(n, "n")?],
            &[self.buf(), out.buf()],
            grid1d(rows),
        )?;
        Ok(out)
    }

    /// Softmax backward from its output (reduce.wgsl `softmax_rows_backward`).
    pub fn softmax_rows_backward(&self, g: &Self, rows: usize, n: usize) -> Result<Self> {
        let c = ctx()?;
        check_row_loops(c, "softmax backward", 2 * n)?;
        let out = Self::alloc(c, rows * n)?;
        if n == 0 {
            return Ok(out);
        }
        c.dispatch(
            Kernel::SoftmaxBackward,
            &[u32_of(rows, "rows")?, u32_of(n, "n")?],
            &[self.buf(), g.buf(), out.buf()],
            grid1d(rows),
        )?;
        Ok(out)
    }

    /// A dropout mask from the Philox stream at `(seed, offset)` (rng.wgsl).
    pub fn dropout_mask(n: usize, p: f32, scale: f32, seed: u64, offset: u64) -> Result<Self> {
        let c = ctx()?;
        let out = Self::alloc(c, n)?;
        let params = [
            u32_of(n, "n")?,
            bits(p),
            bits(scale),
            seed as u32,
            (seed >> 32) as u32,
            offset as u32,
            (offset >> 32) as u32,
        ];
        c.dispatch(
            Kernel::DropoutMask,
            &params,
            &[out.buf()],
            grid1d(n.div_ceil(4)),
        )?;
        Ok(out)
    }

    /// Multiplies every buffer by `inv_scale` in place and reports whether all
    /// values were finite before: one kernel per buffer, all OR-ing into ONE
    /// 4-byte flag, read back once (optim.wgsl `finite_check_unscale`).
    pub fn finite_check_unscale(bufs: &[&Self], inv_scale: f32) -> Result<bool> {
        let c = ctx()?;
        if bufs.iter().all(|b| b.len == 0) {
            return Ok(true);
        }
        // A fresh buffer is zero-initialised by wgpu.
        let flag = c.buffer_with(&[0u8; 4]);
        for b in bufs {
            if b.len == 0 {
                continue;
            }
            c.dispatch(
                Kernel::FiniteCheckUnscale,
                &[b.len as u32, bits(inv_scale)],
                &[b.buf(), &flag],
                grid1d(b.len.div_ceil(c.optim_per_lane as usize)),
            )?;
        }
        let v = c.read(&flag, 4)?;
        Ok(u32::from_le_bytes([v[0], v[1], v[2], v[3]]) == 0)
    }

    /// Partial sums of squares over chunks of [`NORM_CHUNK`] of every buffer,
    /// concatenated in buffer order (reduce.wgsl `chunk_sum_squares`), with one
    /// readback for all of them; the host adds them in order.
    pub fn chunk_sum_squares(bufs: &[&Self]) -> Result<Vec<f32>> {
        let total: usize = bufs.iter().map(|b| b.len.div_ceil(NORM_CHUNK)).sum();
        if total == 0 {
            return Ok(Vec::new());
        }
        let c = ctx()?;
        // Every buffer's partials land in one device buffer, read back once.
        let partials = Self::alloc(c, total)?;
        let mut offset = 0usize;
        for b in bufs {
            let chunks = b.len.div_ceil(NORM_CHUNK);
            if chunks == 0 {
                continue;
            }
            c.dispatch(
                Kernel::ChunkSumSquares,
                &[
                    u32_of(b.len, "n")?,
                    NORM_CHUNK as u32,
                    u32_of(offset, "offset")?,
                ],
                &[b.buf(), partials.buf()],
                grid1d(chunks),
            )?;
            offset += chunks;
        }
        partials.download()
    }

    /// `x *= c` in place (optim.wgsl `scale_in_place`).
    pub fn scale_in_place(&self, c: f32) -> Result<()> {
        let cx = ctx()?;
        cx.dispatch(
            Kernel::ScaleInPlace,
            &[self.len as u32, bits(c)],
            &[self.buf()],
            grid1d(self.len.div_ceil(cx.optim_per_lane as usize)),
        )
    }

    /// Fused AdamW, in place on `self`, `m`, `v` (optim.wgsl `adamw_step`).
    pub fn adamw_step(&self, g: &Self, m: &Self, v: &Self, k: &AdamWConsts) -> Result<()> {
        let c = ctx()?;
        if g.len != self.len || m.len != self.len || v.len != self.len {
            bail!(
                Shape,
                "AdamW: parameter, gradient and moments must have the same length"
            );
        }
        let params = [
            self.len as u32,
            bits(k.decay),
            bits(k.beta1),
            bits(k.omb1),
            bits(k.beta2),
            bits(k.omb2),
            bits(k.step_size),
            bits(k.bc2_sqrt),
            bits(k.eps),
        ];
        c.dispatch(
            Kernel::AdamW,
            &params,
            &[self.buf(), g.buf(), m.buf(), v.buf()],
            grid1d(self.len.div_ceil(c.optim_per_lane as usize)),
        )
    }

    /// SGD with optional momentum, in place (optim.wgsl `sgd_step` / `sgd_momentum_step`).
    pub fn sgd_step(
        &self,
        g: &Self,
        buf: Option<&Self>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) -> Result<()> {
        let c = ctx()?;
        if g.len != self.len || buf.is_some_and(|b| b.len != self.len) {
            bail!(
                Shape,
                "SGD: parameter, gradient and momentum buffer must have the same length"
            );
        }
        let params = [
            self.len as u32,
            bits(lr),
            bits(momentum),
            bits(wd),
            first as u32,
        ];
        match buf {
            None => c.dispatch(
                Kernel::Sgd,
                &params,
                &[self.buf(), g.buf()],
                grid1d(self.len),
            ),
            Some(b) => c.dispatch(
                Kernel::SgdMomentum,
                &params,
                &[self.buf(), g.buf(), b.buf()],
                grid1d(self.len),
            ),
        }
    }
}
