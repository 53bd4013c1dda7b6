//! The hardened kernels handed to the driver as they are (wgpu's
//! passthrough): hardened SPIR-V on Vulkan ([`spirv`]), MSL with safe math on
//! Metal ([`msl`]), HLSL with `precise` on DX12 ([`hlsl`]). Each comes with
//! the bindings naga's reflection found, from which the context builds the
//! explicit bind-group layout a passthrough module needs.

use super::pipelines::{self, Kernel};
use super::spirv::{self, Binding, FloatControls};
use super::{hlsl, msl};
use crate::{Error, Result};

/// How the kernels reach the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shaders {
    /// Hardened SPIR-V, passed through (Vulkan; see [`spirv`]): every float
    /// operation `NoContraction`, and the float-control modes the device
    /// `granted` of the ones the contract `requested` ([`FloatControls::ALL`]).
    Spirv { requested: FloatControls, granted: FloatControls },
    /// MSL with safe math and no contraction, passed through (Metal, MSL 3.2;
    /// see [`msl`]).
    Msl,
    /// HLSL with every float operation `precise`, passed through (DX12; see
    /// [`hlsl`]); `fma_c` is the integer emulation there.
    Hlsl,
    /// WGSL, compiled by wgpu for the backend: nothing forbids a driver to
    /// contract, flush or assume no inf/NaN (`why` not hardened).
    Wgsl { why: &'static str },
}

impl Shaders {
    /// One line for a report.
    pub fn describe(&self) -> String {
        match self {
            Shaders::Spirv { requested, granted } => format!(
                "SPIR-V passthrough: NoContraction on every float operation; float controls requested {}, granted {}",
                requested.names().join(" "),
                match granted.names() {
                    g if g.is_empty() => "none".to_string(),
                    g => g.join(" "),
                }
            ),
            Shaders::Msl => "MSL passthrough: #pragma METAL fp math_mode(safe) and fp contract(off) (MSL 3.2)".to_string(),
            Shaders::Hlsl => "HLSL passthrough: every float operation precise; fma_c the integer emulation \
                 (HLSL has no f32 fma); subnormals as the driver's default denormal mode leaves them"
                .to_string(),
            Shaders::Wgsl { why } => format!("WGSL compiled by the backend, not hardened ({why})"),
        }
    }
}

/// `k` compiled for the path `shaders`, with the contract's `fma_c` the
/// device's `fma` or not (`native_fma`), as a passthrough module on `device`,
/// with its bindings.
pub(super) fn module(
    device: &wgpu::Device,
    shaders: Shaders,
    native_fma: bool,
    k: &Kernel,
) -> Result<(wgpu::ShaderModule, Vec<Binding>)> {
    let src = pipelines::compose(k.family, native_fma);
    let constants = k.constants();
    let entry = |size: [u32; 3]| {
        vec![wgpu::PassthroughShaderEntryPoint { name: k.entry.into(), workgroup_size: (size[0], size[1], size[2]) }]
    };
    let desc = match shaders {
        Shaders::Spirv { granted, .. } => {
            let s = spirv::compile(&src, k.entry, &constants, granted)?;
            if s.hardened.modes != granted {
                return Err(Error::internal(format!("kernel {}: the float controls were not declared", k.entry)));
            }
            let d = wgpu::ShaderModuleDescriptorPassthrough {
                label: Some(k.entry),
                entry_points: entry(s.workgroup_size).into(),
                spirv: Some(s.words.into()),
                ..Default::default()
            };
            (d, s.bindings)
        }
        Shaders::Msl => {
            let m = msl::compile(&src, k.entry, &constants)?;
            let d = wgpu::ShaderModuleDescriptorPassthrough {
                label: Some(k.entry),
                entry_points: entry(m.workgroup_size).into(),
                msl: Some(m.source.into()),
                ..Default::default()
            };
            (d, m.bindings)
        }
        Shaders::Hlsl => {
            let h = hlsl::compile(&src, k.entry, &constants)?;
            let d = wgpu::ShaderModuleDescriptorPassthrough {
                label: Some(k.entry),
                entry_points: entry(h.workgroup_size).into(),
                hlsl: Some(h.source.into()),
                ..Default::default()
            };
            (d, h.bindings)
        }
        Shaders::Wgsl { .. } => return Err(Error::internal("a passthrough module on the WGSL path")),
    };
    // SAFETY: the module is naga's own output for this one entry point (naga
    // validated the IR), hardened as the module docs of `spirv`, `msl` and
    // `hlsl` say — SPIR-V that spirv-val accepts with only the float modes the
    // device grants, MSL and HLSL whose bindings tests hold against the
    // layout wgpu-hal gives the reflected bindings — and the layout passed
    // with it is built from the same reflection.
    let module = unsafe { device.create_shader_module_passthrough(desc.0) };
    Ok((module, desc.1))
}

/// Whether this OS's Metal compiler takes [`msl::PRELUDE`] (MSL 3.2): the
/// guard kernel compiles.
pub(super) fn metal_takes_safe_math(device: &wgpu::Device) -> bool {
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let source = msl::guard_kernel();
    // SAFETY: an empty kernel; if the compiler rejects it, wgpu reports a
    // validation error (caught here), never undefined behaviour.
    let _module = unsafe {
        device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
            label: Some(msl::GUARD_ENTRY),
            entry_points: vec![wgpu::PassthroughShaderEntryPoint { name: msl::GUARD_ENTRY.into(), workgroup_size: (1, 1, 1) }]
                .into(),
            msl: Some(source.into()),
            ..Default::default()
        })
    };
    pollster::block_on(scope.pop()).is_none()
}

/// The start-up probe's kernel ([`ARITH_PROBE`](super::arith::ARITH_PROBE))
/// as hardened SPIR-V with the tests' adversarial rewrite
/// ([`adversary`](super::adversary)), passed through with its one binding
/// (a read-write storage buffer) laid out explicitly.
#[cfg(any(test, feature = "test-hooks"))]
pub(super) fn adversarial_probe(device: &wgpu::Device, granted: FloatControls) -> Result<wgpu::ComputePipeline> {
    let s = spirv::compile(super::arith::ARITH_PROBE, "probe", &[], granted)?;
    let size = s.workgroup_size;
    // SAFETY: as in `module`: naga's own output for the one entry point,
    // hardened, with the layout built below from the same reflection (one
    // read-write storage buffer at binding 0).
    let module = unsafe {
        device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
            label: Some("arithmetic probe"),
            entry_points: vec![wgpu::PassthroughShaderEntryPoint { name: "probe".into(), workgroup_size: (size[0], size[1], size[2]) }]
                .into(),
            spirv: Some(s.words.into()),
            ..Default::default()
        })
    };
    let bgl = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: None,
        entries: &[wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only: false },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        }],
    });
    let layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: None,
        bind_group_layouts: &[Some(&bgl)],
        immediate_size: 0,
    });
    Ok(device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("arithmetic probe"),
        layout: Some(&layout),
        module: &module,
        entry_point: Some("probe"),
        compilation_options: Default::default(),
        cache: None,
    }))
}
