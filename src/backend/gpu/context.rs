//! The process-wide GPU context: adapter and device selection, the pending
//! command batch, the buffer pool, the pipeline cache, and error capture.
//!
//! Created lazily on first use (a `OnceLock`). Creation never panics: with no
//! adapter, every GPU call returns the same clear [`Error`].
//!
//! ## Batched submission
//! Dispatches are recorded into one pending `CommandEncoder` and submitted
//! together, only when needed: before a readback, when the pending dispatches'
//! parameters fill [`MAX_PENDING_SLOTS`] slots (one each; a few for the
//! optimizer's), or on an explicit [`Context::flush`]. Consecutive dispatches
//! share one compute pass (wgpu orders a pass's dispatches like separate
//! passes: each is its own usage scope); a copy or an upload ends the pass,
//! and the next dispatch opens another, so copies stay in order with them.
//!
//! Per-dispatch parameters are packed into one persistent params buffer (a
//! 256-byte slot per dispatch of the batch), bound with a dynamic offset and
//! written with `queue.write_buffer` just before the submit — wgpu runs queued
//! writes before the command buffers of the same submit and after every earlier
//! submit, which is exactly the order we need. Because the params no longer
//! change a dispatch's bindings, its bind group (kernel + buffers and offsets) is cached
//! and reused across dispatches and steps; an entry is dropped when one of its
//! pooled buffers is released (a pooled buffer taken again is the same buffer,
//! so its entries stay valid), and only pooled buffers' bind groups are cached
//! (a one-off buffer's would keep it alive). Tensor uploads never use
//! `write_buffer` on a pooled buffer (a pending dispatch might still read its
//! old contents): they go through a fresh mapped-at-creation staging buffer
//! and a `copy_buffer_to_buffer` recorded in the pending encoder, in order.

use super::arith::{self, ArithFindings};
use super::pipelines::{self, Kernel};
use super::spirv::{self, FloatControls};
use bytemuck::Pod;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex, OnceLock};

/// Params slots of the dispatches recorded before a submit is forced (one a
/// dispatch, a few for the optimizer's tables; a C1 training step fills
/// fewer: one submit).
pub const MAX_PENDING_SLOTS: usize = 1024;
/// Cached bind groups kept at most; past it the cache starts again (a bound
/// on what many distinct buffer combinations can hold).
const MAX_BIND_GROUPS: usize = 8192;
/// Bytes of a params slot (a multiple of every device's storage offset alignment).
const SLOT: u64 = 256;

pub struct Context {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// The kernels' `fma_c` is the device's `fma` (else `fma_soft`): see
    /// [`arith::native_fma`].
    pub native_fma: bool,
    /// What the start-up probe found of the device's `fma` and subnormals.
    pub arith: ArithFindings,
    /// Elements per invocation of the optimizer kernels (update.wgsl's
    /// `PER_LANE` override), chosen per adapter: see [`update_per_lane`].
    pub update_per_lane: u32,
    /// How kernels reach the driver (see [`Shaders`]).
    pub shaders: Shaders,
    slot: u64,
    pending: Mutex<Pending>,
    /// The batch's parameters, one slot per dispatch (binding 0, dynamic offset).
    params_buf: wgpu::Buffer,
    pipelines: Mutex<HashMap<Kernel, Pipeline>>,
    bind_groups: Mutex<BindGroups>,
    pub(super) pool: Mutex<super::buffers::Pool>,
    /// The compiled pipelines on disk, where asked for (see [`cache`](super::cache)).
    disk_cache: Option<super::cache::DiskCache>,
    /// The first device error seen (validation, out of memory, device lost).
    error: Arc<Mutex<Option<String>>>,
}

pub use super::passthrough::Shaders;

/// The float controls a Vulkan adapter grants for 32-bit floats (none below
/// Vulkan 1.2, where `SPV_KHR_float_controls` is not core), or `None` when
/// the adapter is not a Vulkan one.
#[cfg(any(target_os = "linux", target_os = "windows", target_os = "android", target_os = "freebsd"))]
fn vulkan_float_controls(adapter: &wgpu::Adapter) -> Option<FloatControls> {
    use ash::vk;
    // SAFETY: the hal adapter is only read (its instance and physical device
    // handles) while `adapter` keeps it alive, and the query writes only the
    // structs passed to it.
    unsafe {
        let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
        let instance = hal.shared_instance().raw_instance();
        let pd = hal.raw_physical_device();
        if instance.get_physical_device_properties(pd).api_version < vk::API_VERSION_1_2 {
            return Some(FloatControls::default());
        }
        let mut fc = vk::PhysicalDeviceFloatControlsProperties::default();
        let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut fc);
        instance.get_physical_device_properties2(pd, &mut p2);
        Some(FloatControls {
            signed_zero_inf_nan_preserve: fc.shader_signed_zero_inf_nan_preserve_float32 == vk::TRUE,
            rounding_mode_rte: fc.shader_rounding_mode_rte_float32 == vk::TRUE,
            denorm_preserve: fc.shader_denorm_preserve_float32 == vk::TRUE,
        })
    }
}

#[cfg(not(any(target_os = "linux", target_os = "windows", target_os = "android", target_os = "freebsd")))]
fn vulkan_float_controls(_: &wgpu::Adapter) -> Option<FloatControls> {
    None
}

/// The path the kernels take on `adapter`, and the features it needs. An
/// adapter without passthrough gets WGSL, and the reason names the feature.
fn choose_shaders(adapter: &wgpu::Adapter) -> (Shaders, wgpu::Features) {
    let passthrough = adapter.features().contains(wgpu::Features::PASSTHROUGH_SHADERS);
    let wgsl = |why: &'static str| (Shaders::Wgsl { why }, wgpu::Features::empty());
    let shaders = match adapter.get_info().backend {
        wgpu::Backend::Vulkan if !passthrough => {
            return wgsl("the Vulkan adapter lacks the feature PASSTHROUGH_SHADERS: no hardened SPIR-V")
        }
        wgpu::Backend::Vulkan => match vulkan_float_controls(adapter) {
            Some(granted) => Shaders::Spirv { requested: FloatControls::ALL, granted },
            None => return wgsl("the Vulkan adapter could not be queried"),
        },
        wgpu::Backend::Metal if !passthrough => {
            return wgsl("the Metal adapter lacks the feature PASSTHROUGH_SHADERS: no safe-math MSL, Metal's default fast math")
        }
        wgpu::Backend::Metal => Shaders::Msl,
        wgpu::Backend::Dx12 if !passthrough => {
            return wgsl("the DX12 adapter lacks the feature PASSTHROUGH_SHADERS: no precise HLSL")
        }
        wgpu::Backend::Dx12 => Shaders::Hlsl,
        wgpu::Backend::Gl => return wgsl("GL: WGSL to GLSL by wgpu, which can ask the driver for no exact float semantics"),
        _ => return wgsl("no hardened path for this backend"),
    };
    (shaders, wgpu::Features::PASSTHROUGH_SHADERS)
}

/// A compiled kernel and its bind-group layout (binding 0 with a dynamic offset).
#[derive(Clone)]
struct Pipeline {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

#[derive(Default)]
struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    /// The open compute pass of the encoder, if any (ended before a copy).
    pass: Option<wgpu::ComputePass<'static>>,
    /// The kernel the open pass has set last (no `set_pipeline` repeats).
    bound: Option<Kernel>,
    params: Vec<u8>,
    /// Params slots taken by the pending dispatches (most take one).
    slots: usize,
}

/// The bind-group cache: per kernel and buffers (see the module docs).
#[derive(Default)]
struct BindGroups {
    /// Buffers of the pool: only these may appear in a cached bind group.
    pooled: std::collections::HashSet<wgpu::Buffer>,
    groups: HashMap<(Kernel, Vec<(wgpu::Buffer, u64)>), wgpu::BindGroup>,
}

/// A binding: a buffer from a byte offset to its end (a tensor's view of a
/// shared buffer, see [`GpuStorage`](super::GpuStorage)). A kernel indexes
/// from the offset.
#[derive(Clone, Copy)]
pub struct Bind<'a> {
    pub buf: &'a wgpu::Buffer,
    pub offset: u64,
}

impl<'a> From<&'a wgpu::Buffer> for Bind<'a> {
    /// The whole buffer.
    fn from(buf: &'a wgpu::Buffer) -> Bind<'a> {
        Bind { buf, offset: 0 }
    }
}

static CONTEXT: OnceLock<std::result::Result<Context, String>> = OnceLock::new();

/// The one backend asked for ([`use_backend`](super::use_backend)), if any.
pub(super) static PREFERRED: OnceLock<super::Backend> = OnceLock::new();

/// The global context, created on first use.
/// Mesa's Vulkan device-select layer connects to Wayland to find the display
/// GPU and, with no session (`XDG_RUNTIME_DIR` unset), prints `error:
/// XDG_RUNTIME_DIR is invalid or not set in the environment` at every
/// instance — read as an error of the program using this library. With no
/// Wayland or X11 session and no `MESA_VK_DEVICE_SELECT` it has nothing to
/// select by (adapters are picked in [`Context::create`] anyway), so it is
/// switched off with its own variable, `NODEVICE_SELECT=1`, before the one
/// instance is created. A user's own setting of it is kept.
fn quiet_device_select() {
    let unset = |v: &str| std::env::var_os(v).is_none();
    if ["XDG_RUNTIME_DIR", "WAYLAND_DISPLAY", "DISPLAY", "MESA_VK_DEVICE_SELECT", "NODEVICE_SELECT"]
        .iter()
        .all(|v| unset(v))
    {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

pub fn ctx() -> Result<&'static Context> {
    match CONTEXT.get_or_init(Context::create) {
        Ok(c) => {
            c.check()?;
            Ok(c)
        }
        Err(e) => Err(Error::device(e.clone())),
    }
}

/// The global context if it exists already (Drop impls must not create one).
pub fn ctx_if_created() -> Option<&'static Context> {
    CONTEXT.get().and_then(|r| r.as_ref().ok())
}

fn type_rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

fn backend_rank(b: wgpu::Backend) -> u32 {
    match b {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        _ => 1,
    }
}

impl Context {
    fn create() -> std::result::Result<Context, String> {
        // wgpu may panic inside a broken driver stack; that must not take the
        // caller down with it — it becomes the "no adapter" error instead.
        match std::panic::catch_unwind(Self::create_inner) {
            Ok(r) => r,
            Err(_) => Err(
                "GPU initialisation failed (wgpu panicked while probing adapters); \
                 install mesa-vulkan-drivers for a software device (lavapipe)"
                    .to_string(),
            ),
        }
    }

    fn create_inner() -> std::result::Result<Context, String> {
        // The backend asked for, else the default ones (Vulkan, Metal, DX12,
        // GL), which wgpu's WGPU_BACKEND variable may narrow.
        let preferred = PREFERRED.get();
        let backends = match preferred {
            Some(b) => b.wgpu(),
            None => wgpu::Backends::from_env().unwrap_or(wgpu::Backends::all()),
        };
        quiet_device_select();
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backends;
        let instance = wgpu::Instance::new(desc);
        let mut adapters = pollster::block_on(instance.enumerate_adapters(backends));
        let names = |a: &[wgpu::Adapter]| {
            a.iter()
                .map(|a| {
                    let i = a.get_info();
                    format!("{} ({:?}, {:?})", i.name, i.backend, i.device_type)
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let (true, Some(b)) = (adapters.is_empty(), preferred) {
            return Err(format!(
                "no GPU adapter found on the {} backend (asked for with --backend {})",
                b.name(),
                b.name()
            ));
        }
        if adapters.is_empty() {
            return Err(
                "no GPU adapter found: wgpu found no Vulkan, Metal, DX12 or GL device; \
                 install mesa-vulkan-drivers for a software device (lavapipe), \
                 or run on the CPU backend"
                    .to_string(),
            );
        }
        let adapter = if let Ok(want) = std::env::var("TINYLLM_ADAPTER") {
            let w = want.to_lowercase();
            let pos = adapters
                .iter()
                .position(|a| a.get_info().name.to_lowercase().contains(&w))
                .ok_or_else(|| {
                    format!(
                        "no GPU adapter found: TINYLLM_ADAPTER={want:?} matches none of: {}",
                        names(&adapters)
                    )
                })?;
            adapters.swap_remove(pos)
        } else {
            // A real GPU first (discrete, integrated, ...), software last; native
            // backends before GL.
            adapters.sort_by_key(|a| {
                let i = a.get_info();
                (type_rank(i.device_type), backend_rank(i.backend))
            });
            adapters.swap_remove(0)
        };
        let info = adapter.get_info();
        // Ask for everything the adapter offers (large storage buffers above all).
        let limits = adapter.limits();
        let (shaders, features) = match std::env::var("TINYLLM_GPU_SHADERS").as_deref() {
            Ok("wgsl") => (Shaders::Wgsl { why: "TINYLLM_GPU_SHADERS=wgsl" }, wgpu::Features::empty()),
            _ => choose_shaders(&adapter),
        };
        let features = features | super::cache::feature(&adapter);
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("tinyllm"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| {
            format!(
                "could not create a device on GPU adapter {:?}: {e}",
                info.name
            )
        })?;

        let error: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let e2 = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = e2.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(format!("GPU error: {e}"));
            }
        }));
        let e3 = error.clone();
        device.set_device_lost_callback(move |reason, msg| {
            let mut slot = e3.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(format!("GPU device lost ({reason:?}): {msg}"));
            }
        });
        // a kernel reads its parameters as a storage or a uniform buffer
        // (a uniform one leaves all eight storage bindings to its data)
        let slot = SLOT
            .max(limits.min_storage_buffer_offset_alignment as u64)
            .max(limits.min_uniform_buffer_offset_alignment as u64);
        let params_buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: slot * MAX_PENDING_SLOTS as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let found = probe_arith(&device, &queue, shaders)?;
        let forced = match std::env::var("TINYLLM_GPU_FMA").as_deref() {
            Ok("soft") => Some(false),
            Ok("native") => Some(true),
            _ => None,
        };
        // HLSL has no f32 fma (a precise `mad` is unfused): fma_soft there.
        let native_fma = arith::native_fma(found, forced) && shaders != Shaders::Hlsl;
        let shaders = match shaders {
            Shaders::Msl if !super::passthrough::metal_takes_safe_math(&device) => {
                Shaders::Wgsl { why: super::msl::OLDER_METAL }
            }
            s => s,
        };
        if let Some(e) = &*error.lock().unwrap_or_else(|p| p.into_inner()) {
            return Err(format!(
                "GPU adapter {:?} failed its start-up probe: {e}",
                info.name
            ));
        }
        let disk_cache = super::cache::DiskCache::open(&device, &info);
        Ok(Context {
            update_per_lane: update_per_lane(&info),
            shaders,
            device,
            queue,
            info,
            limits,
            native_fma,
            arith: found,
            slot,
            pending: Mutex::new(Pending::default()),
            params_buf,
            pipelines: Mutex::new(HashMap::new()),
            bind_groups: Mutex::new(BindGroups::default()),
            pool: Mutex::new(super::buffers::Pool::default()),
            disk_cache,
            error,
        })
    }

    /// Fails with the first device error, if one happened.
    pub fn check(&self) -> Result<()> {
        match &*self.error.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(Error::device(e.clone())),
            None => Ok(()),
        }
    }

    /// The largest buffer a kernel can bind.
    pub fn max_binding(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    fn pipeline(&self, k: &Kernel) -> Result<Pipeline> {
        if let Some(p) = self.pipelines.lock().unwrap().get(k) {
            return Ok(p.clone());
        }
        let (family, entry) = (k.family, k.entry);
        // Validation errors of shader/pipeline creation are caught in a scope
        // (on this thread, synchronously) and become an Error, not a panic.
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let p = match self.shaders {
            Shaders::Wgsl { .. } => self.wgsl_pipeline(k),
            _ => self.passthrough_pipeline(k),
        };
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(Error::device(format!(
                "GPU kernel {}::{entry} failed to compile: {e}",
                family.name
            )));
        }
        let p = p?;
        self.pipelines.lock().unwrap().insert(*k, p.clone());
        Ok(p)
    }

    /// The bind-group and pipeline layouts of a kernel using `bindings`:
    /// binding 0 (the parameters) at a dynamic offset into the params buffer.
    fn layouts(&self, bindings: &[spirv::Binding]) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        let entries: Vec<wgpu::BindGroupLayoutEntry> = bindings
            .iter()
            .map(|b| wgpu::BindGroupLayoutEntry {
                binding: b.binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match b.storage {
                        Some(read_only) => wgpu::BufferBindingType::Storage { read_only },
                        None => wgpu::BufferBindingType::Uniform,
                    },
                    has_dynamic_offset: b.binding == 0,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let bgl = self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: None, entries: &entries });
        let layout = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: None,
            bind_group_layouts: &[Some(&bgl)],
            immediate_size: 0,
        });
        (bgl, layout)
    }

    /// `k` as the backend compiles WGSL, from naga's IR with the kernel's
    /// constants resolved and the branches they decide taken
    /// ([`prune`](super::prune)), its layout from naga's reflection.
    fn wgsl_pipeline(&self, k: &Kernel) -> Result<Pipeline> {
        let src = pipelines::compose(k.family, self.native_fma);
        let lowered = spirv::lower(&src, k.entry, &k.constants(), "WGSL")?;
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(k.entry),
            source: wgpu::ShaderSource::Naga(std::borrow::Cow::Owned(lowered.module)),
        });
        let (bgl, layout) = self.layouts(&lowered.bindings);
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(k.entry),
                layout: Some(&layout),
                module: &module,
                entry_point: Some(k.entry),
                compilation_options: compilation_options(),
                cache: self.disk_cache.as_ref().map(|c| c.for_new_pipeline()),
            });
        Ok(Pipeline { pipeline, layout: bgl })
    }

    /// `k` hardened for the context's path (see [`passthrough`](super::passthrough)),
    /// its bind-group layout from naga's reflection.
    fn passthrough_pipeline(&self, k: &Kernel) -> Result<Pipeline> {
        let (module, bindings) = super::passthrough::module(&self.device, self.shaders, self.native_fma, k)?;
        let (bgl, layout) = self.layouts(&bindings);
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(k.entry),
            layout: Some(&layout),
            module: &module,
            entry_point: Some(k.entry),
            compilation_options: compilation_options(),
            cache: self.disk_cache.as_ref().map(|c| c.for_new_pipeline()),
        });
        Ok(Pipeline { pipeline, layout: bgl })
    }

    /// The bind group of `k` over `bufs` (bindings 1, 2, ...) and the params
    /// buffer (binding 0, its offset given at dispatch): from the cache when
    /// every buffer is pooled.
    /// `window`: the bytes binding 0 spans (one kernel always has the same).
    fn bind_group(&self, k: &Kernel, p: &Pipeline, bufs: &[Bind], window: u64) -> wgpu::BindGroup {
        let create = || {
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.params_buf,
                    offset: 0,
                    size: wgpu::BufferSize::new(window),
                }),
            }];
            for (i, b) in bufs.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: b.buf,
                        offset: b.offset,
                        size: None,
                    }),
                });
            }
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &p.layout,
                entries: &entries,
            })
        };
        let mut cache = self.bind_groups.lock().unwrap();
        if !bufs.iter().all(|b| cache.pooled.contains(b.buf)) {
            return create();
        }
        let key = (*k, bufs.iter().map(|b| (b.buf.clone(), b.offset)).collect::<Vec<_>>());
        if let Some(bg) = cache.groups.get(&key) {
            return bg.clone();
        }
        if cache.groups.len() >= MAX_BIND_GROUPS {
            cache.groups.clear();
        }
        let bg = create();
        cache.groups.insert(key, bg.clone());
        bg
    }

    /// A pool buffer was created: bind groups over it may be cached.
    pub(super) fn pooled(&self, buf: &wgpu::Buffer) {
        self.bind_groups.lock().unwrap().pooled.insert(buf.clone());
    }

    /// Pool buffers are being released: drop the cached bind groups that hold
    /// them (else the cache would keep them alive).
    pub(super) fn released(&self, bufs: &[wgpu::Buffer]) {
        if bufs.is_empty() {
            return;
        }
        let mut cache = self.bind_groups.lock().unwrap();
        for b in bufs {
            cache.pooled.remove(b);
        }
        cache.groups.retain(|(_, held), _| !held.iter().any(|(h, _)| bufs.contains(h)));
    }

    /// Records one dispatch of `k` over `groups` workgroups. `params` (the
    /// kernel's parameter struct) fill binding 0; `bufs` are bindings 1, 2, ...
    pub fn dispatch<P: Pod>(
        &self,
        k: &Kernel,
        params: &P,
        bufs: &[Bind],
        groups: (u32, u32, u32),
    ) -> Result<()> {
        if groups.0 == 0 || groups.1 == 0 || groups.2 == 0 {
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::bytes_of(params);
        // params past one slot take consecutive slots (the optimizer's
        // per-parameter tables), bound as one window
        let window = (bytes.len() as u64).div_ceil(self.slot).max(1);
        let pipeline = self.pipeline(k)?;
        let bg = self.bind_group(k, &pipeline, bufs, window * self.slot);
        let mut pend = self.pending.lock().unwrap();
        if pend.slots as u64 + window > MAX_PENDING_SLOTS as u64 {
            self.submit(&mut pend);
        }
        self.ensure_encoder(&mut pend);
        let slot = pend.slots as u64;
        pend.slots += window as usize;
        crate::profile::note_gpu(crate::profile::GpuEvent::Dispatch);
        let off = (slot * self.slot) as usize;
        pend.params.resize(off, 0);
        pend.params.extend_from_slice(bytes);
        if pend.pass.is_none() {
            let pass = pend
                .encoder
                .as_mut()
                .unwrap()
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: None,
                })
                .forget_lifetime();
            pend.pass = Some(pass);
            pend.bound = None;
        }
        let set = pend.bound.as_ref() != Some(k);
        pend.bound = Some(*k);
        let pass = pend.pass.as_mut().unwrap();
        if set {
            pass.set_pipeline(&pipeline.pipeline);
        }
        pass.set_bind_group(0, &bg, &[(slot * self.slot) as u32]);
        pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        Ok(())
    }

    /// The pending encoder, its compute pass ended: what a copy records into.
    fn encoder<'p>(&self, pend: &'p mut Pending) -> &'p mut wgpu::CommandEncoder {
        pend.pass = None;
        self.ensure_encoder(pend);
        pend.encoder.as_mut().unwrap()
    }

    fn ensure_encoder(&self, pend: &mut Pending) {
        if pend.encoder.is_none() {
            pend.encoder = Some(
                self.device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }),
            );
        }
    }

    fn submit(&self, pend: &mut Pending) {
        pend.pass = None;
        if let Some(enc) = pend.encoder.take() {
            if !pend.params.is_empty() {
                let mut bytes = std::mem::take(&mut pend.params);
                bytes.resize(bytes.len().next_multiple_of(4), 0);
                self.queue.write_buffer(&self.params_buf, 0, &bytes);
            }
            self.queue.submit([enc.finish()]);
            crate::profile::note_gpu(crate::profile::GpuEvent::Submit);
        }
        pend.params.clear();
        pend.slots = 0;
    }

    /// Submits everything recorded so far.
    pub fn flush(&self) -> Result<()> {
        let mut pend = self.pending.lock().unwrap();
        self.submit(&mut pend);
        drop(pend);
        self.check()
    }

    /// Submits everything recorded so far and waits for the device to finish it.
    pub fn sync(&self) -> Result<()> {
        self.flush()?;
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::device(format!("GPU sync failed: {e}")))?;
        self.check()
    }

    /// Records a copy of the first `bytes` of `src` into `dst`, in order with
    /// the pending dispatches.
    pub fn copy(&self, src: Bind, dst: Bind, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let mut pend = self.pending.lock().unwrap();
        self.encoder(&mut pend).copy_buffer_to_buffer(
            src.buf,
            src.offset,
            dst.buf,
            dst.offset,
            bytes.next_multiple_of(4),
        );
        Ok(())
    }

    /// Records a copy of `data` into `dst` (in order with pending dispatches).
    pub fn upload(&self, dst: Bind, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let size = (data.len() as u64).next_multiple_of(4);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("upload"),
            size,
            usage: wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        {
            let mut view = staging
                .slice(..)
                .get_mapped_range_mut()
                .expect("a buffer mapped at creation");
            view.slice(..data.len()).copy_from_slice(data);
        }
        staging.unmap();
        let mut pend = self.pending.lock().unwrap();
        self.encoder(&mut pend)
            .copy_buffer_to_buffer(&staging, 0, dst.buf, dst.offset, size);
        Ok(())
    }

    /// A fresh (unpooled) storage buffer holding `data` (index lists, CSR).
    pub fn buffer_with(&self, data: &[u8]) -> wgpu::Buffer {
        let size = (data.len() as u64).next_multiple_of(4).max(4);
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("indices"),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        {
            let mut view = b
                .slice(..)
                .get_mapped_range_mut()
                .expect("mapped at creation");
            view.slice(..data.len()).copy_from_slice(data);
        }
        b.unmap();
        b
    }

    /// Copies the first `bytes` of `src` to the host: submits everything
    /// pending plus the copy, then maps a staging buffer and waits.
    pub fn read(&self, src: Bind, bytes: u64) -> Result<Vec<u8>> {
        Ok(self.read_many(&[(src, bytes)])?.remove(0))
    }

    /// The first `bytes` of each buffer, copied into one staging buffer and
    /// mapped once: one GPU sync for all of them.
    pub fn read_many(&self, parts: &[(Bind, u64)]) -> Result<Vec<Vec<u8>>> {
        // each part at a 4-byte aligned offset (wgpu's copy alignment)
        let sizes: Vec<u64> = parts.iter().map(|&(_, b)| b.next_multiple_of(4)).collect();
        let size: u64 = sizes.iter().sum();
        if size == 0 {
            return Ok(vec![Vec::new(); parts.len()]);
        }
        crate::profile::note_gpu(crate::profile::GpuEvent::Readback);
        // A readback ends a step's first use of its kernels: keep them.
        if let Some(c) = &self.disk_cache {
            c.save_if_dirty();
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        {
            let mut pend = self.pending.lock().unwrap();
            let enc = self.encoder(&mut pend);
            let mut at = 0;
            for (&(src, _), &n) in parts.iter().zip(&sizes) {
                if n > 0 {
                    enc.copy_buffer_to_buffer(src.buf, src.offset, &staging, at, n);
                }
                at += n;
            }
            self.submit(&mut pend);
        }
        self.check()?;
        let (tx, rx) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::device(format!("GPU readback failed: {e}")))?;
        self.check()?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(Error::device(format!("GPU readback failed: {e}"))),
            Err(_) => {
                return Err(Error::device(
                    "GPU readback failed: the map callback never ran",
                ))
            }
        }
        let out = {
            let all = staging
                .get_mapped_range(..)
                .map_err(|e| Error::device(format!("GPU readback failed: {e}")))?;
            let mut at = 0;
            parts
                .iter()
                .zip(&sizes)
                .map(|(&(_, b), &n)| {
                    let v = all[at as usize..(at + b) as usize].to_vec();
                    at += n;
                    v
                })
                .collect()
        };
        staging.unmap();
        Ok(out)
    }
}

/// Elements per invocation of the elementwise optimizer kernels, per adapter.
///
/// A software device (lavapipe: `DeviceType::Cpu`) runs each workgroup as a
/// task on a thread pool, so scheduling, not memory, limits a kernel with one
/// element per lane: many elements per lane there. A real GPU wants the
/// opposite — tens of thousands of lanes in flight to hide memory latency — so
/// a few elements per lane.
fn update_per_lane(info: &wgpu::AdapterInfo) -> u32 {
    match info.device_type {
        wgpu::DeviceType::Cpu => 256,
        _ => 4,
    }
}

/// Runs the device's own WGSL `fma`, `*` and `+` on the start-up probe's
/// cases ([`arith::fused_fma_cases`], [`arith::subnormal_cases`]) and
/// compares with the contract's results (Rust's `f32::mul_add` is always a
/// true fma): whether `fma` is fused, and whether subnormals survive.
fn probe_arith(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    shaders: Shaders,
) -> std::result::Result<ArithFindings, String> {
    let (fused, sub) = (arith::fused_fma_cases(), arith::subnormal_cases());
    let mut data: Vec<f32> = Vec::new();
    for t in fused.iter().chain(&sub) {
        data.extend_from_slice(&[t[0], t[1], t[2], 0.0, 0.0, 0.0]);
    }
    let buf = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("arithmetic probe"),
        size: (data.len() * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: true,
    });
    {
        let mut view = buf
            .slice(..)
            .get_mapped_range_mut()
            .expect("mapped at creation");
        view.slice(..).copy_from_slice(bytemuck::cast_slice(&data));
    }
    buf.unmap();
    // the tests' adversarial compiler rewrites the probe as it rewrites the
    // kernels (the probe is what must see a flushing compiler)
    #[cfg(any(test, feature = "test-hooks"))]
    let pipeline = match (shaders, super::adversary::active()) {
        (Shaders::Spirv { granted, .. }, Ok(Some(_))) => {
            super::passthrough::adversarial_probe(device, granted).map_err(|e| e.to_string())?
        }
        _ => wgsl_probe(device),
    };
    #[cfg(not(any(test, feature = "test-hooks")))]
    let pipeline = {
        let _ = shaders;
        wgsl_probe(device)
    };
    let bg = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: buf.as_entire_binding(),
        }],
    });
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("arithmetic probe readback"),
        size: (data.len() * 4) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: None,
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    enc.copy_buffer_to_buffer(&buf, 0, &staging, 0, (data.len() * 4) as u64);
    queue.submit([enc.finish()]);
    let (tx, rx) = mpsc::channel();
    staging.map_async(wgpu::MapMode::Read, .., move |r| {
        let _ = tx.send(r);
    });
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| format!("GPU arithmetic probe failed: {e}"))?;
    match rx.recv() {
        Ok(Ok(())) => {}
        _ => return Err("GPU arithmetic probe failed: could not read the result back".to_string()),
    }
    let got: Vec<f32> =
        bytemuck::pod_collect_to_vec(&staging.get_mapped_range(..).map_err(|e| e.to_string())?);
    staging.unmap();
    let results: Vec<[f32; 3]> = got
        .chunks_exact(6)
        .map(|c| [c[3], c[4], c[5]])
        .collect();
    Ok(arith::findings(&fused, &sub, &results))
}

/// How wgpu compiles a kernel: workgroup memory is not zeroed first. Every
/// kernel writes what it reads, and a zeroing prologue writes each element
/// through its own store, which llvmpipe turns into thousands of blocks in
/// a barrier kernel (and which a GPU would run at every workgroup's start).
fn compilation_options() -> wgpu::PipelineCompilationOptions<'static> {
    wgpu::PipelineCompilationOptions {
        zero_initialize_workgroup_memory: false,
        ..Default::default()
    }
}

/// The start-up probe's kernel as WGSL the backend compiles.
fn wgsl_probe(device: &wgpu::Device) -> wgpu::ComputePipeline {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("arithmetic probe"),
        source: wgpu::ShaderSource::Wgsl(arith::ARITH_PROBE.into()),
    });
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("arithmetic probe"),
        layout: None,
        module: &module,
        entry_point: Some("probe"),
        compilation_options: Default::default(),
        cache: None,
    })
}
