//! MSL with the contract written into it (Metal). wgpu compiles WGSL for
//! Metal with Apple's default math mode — fast on Intel and AMD Macs,
//! relaxed on Apple silicon — under which the compiler may contract `a·b + c`
//! into an fma, regroup sums, flush subnormals and assume no inf or NaN. On
//! Metal the backend therefore writes each kernel's MSL itself (naga: WGSL →
//! IR with override constants resolved → MSL for that one entry point) and
//! puts [`PRELUDE`] in front:
//!
//! * `#pragma METAL fp math_mode(safe)`: IEEE semantics for inf, NaN and
//!   signed zero, no reassociation;
//! * `#pragma METAL fp contract(off)`: no fusing of a product into a sum;
//!
//! both from MSL 3.2 (macOS 15, iOS 18). An older Metal compiler would only
//! warn about an unknown pragma and keep fast math, so the prelude stops the
//! compile there instead (`#error` below MSL 3.2) and the context, which
//! compiles [`guard_kernel`] once at start-up, falls back to WGSL (Metal's
//! default fast math) and says so.
//!
//! The text is handed to wgpu's MSL passthrough, which (wgpu 30) binds the
//! bind group's buffers at Metal buffer indices 0, 1, … in binding order and
//! nothing else: no buffer-size table and no threadgroup-memory lengths. So
//! the MSL here reads no buffer sizes (runtime-sized arrays unchecked: the
//! launchers size every dispatch to its buffers, as on every backend) and
//! declares workgroup memory inside the kernel rather than as arguments.

use super::spirv::{lower, Binding};
use crate::{Error, Result};

/// The first lines of every kernel's MSL: safe math and no contraction, or
/// no compile at all.
pub const PRELUDE: &str = "\
// tinyllm: the numerics contract needs safe math and no contraction, which
// MSL 3.2 (macOS 15 / iOS 18) lets the source ask for; an older compiler
// would ignore the pragmas and keep fast math, so it must not compile this.
#if __METAL_VERSION__ < 320
#error \"tinyllm: the kernels need MSL 3.2 (macOS 15 / iOS 18) for #pragma METAL fp math_mode(safe)\"
#endif
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
";

/// A kernel that compiles exactly when [`PRELUDE`] does: the start-up check
/// that this OS's Metal compiler takes the pragmas.
pub fn guard_kernel() -> String {
    format!("{PRELUDE}#include <metal_stdlib>\nkernel void {GUARD_ENTRY}() {{}}\n")
}

/// The entry point of [`guard_kernel`].
pub const GUARD_ENTRY: &str = "tinyllm_msl_guard";

/// Why a backend that cannot take the pragmas runs WGSL instead.
pub const OLDER_METAL: &str = "Metal's compiler here is older than MSL 3.2 (macOS 15 / iOS 18), \
     which `#pragma METAL fp math_mode(safe)` needs: WGSL under Metal's default fast math";

/// One kernel's MSL, with what the pipeline layout and the passthrough need.
#[derive(Clone, Debug)]
pub struct Msl {
    pub source: String,
    /// The bindings, in order: binding `bindings[i]` is Metal buffer `i`.
    pub bindings: Vec<Binding>,
    pub workgroup_size: [u32; 3],
}

/// `entry` of the WGSL `src` with its override `constants` as MSL with
/// [`PRELUDE`] (see the module docs).
pub fn compile(src: &str, entry: &str, constants: &[(&str, f64)]) -> Result<Msl> {
    let fail = |what: String| Error::internal(format!("compiling kernel {entry} to MSL: {what}"));
    let l = lower(src, entry, constants, "MSL")?;
    use naga::back::msl;
    let mut resources = msl::BindingMap::default();
    for (slot, b) in l.bindings.iter().enumerate() {
        let target = msl::BindTarget {
            buffer: Some(u8::try_from(slot).map_err(|_| fail("more than 255 bindings".into()))?),
            mutable: b.storage == Some(false),
            ..Default::default()
        };
        resources.insert(naga::ResourceBinding { group: 0, binding: b.binding }, target);
    }
    // naga insists on a slot for the buffer-size table of runtime-sized
    // arrays even when no check reads it; the parameter is taken out below.
    let sizes = u8::try_from(l.bindings.len()).map_err(|_| fail("too many bindings".into()))?;
    let options = msl::Options {
        lang_version: (3, 2),
        per_entry_point_map: [(
            entry.to_string(),
            msl::EntryPointResources { resources, immediates_buffer: None, sizes_buffer: Some(sizes) },
        )]
        .into(),
        fake_missing_bindings: false,
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: naga::proc::BoundsCheckPolicy::Restrict,
            // a clamp would read the size table wgpu's passthrough never binds
            buffer: naga::proc::BoundsCheckPolicy::Unchecked,
            image_load: naga::proc::BoundsCheckPolicy::Restrict,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        zero_initialize_workgroup_memory: false,
        force_loop_bounding: true,
        ..Default::default()
    };
    let pipeline = msl::PipelineOptions {
        entry_point: Some((naga::ShaderStage::Compute, entry.to_string())),
        ..Default::default()
    };
    let (text, info) = msl::write_string(&l.module, &l.info, &options, &pipeline).map_err(|e| fail(format!("{e}")))?;
    match info.entry_point_names.first() {
        Some(Ok(name)) if name == entry => {}
        other => return Err(fail(format!("naga named the entry point {other:?}"))),
    }
    let source = format!("{PRELUDE}{}", fit_passthrough(&text).map_err(fail)?);
    Ok(Msl { source, bindings: l.bindings, workgroup_size: l.workgroup_size })
}

/// Takes out of naga's kernel signature what wgpu's passthrough does not
/// bind: the buffer-size table (a constant of zeros instead, which nothing
/// reads with unchecked buffer access; naga still threads it through helper
/// functions) and threadgroup memory passed as arguments (declared at the top
/// of the kernel body instead, where Metal sizes it itself).
fn fit_passthrough(text: &str) -> std::result::Result<String, String> {
    let mut out: Vec<String> = Vec::new();
    let (mut kernel_at, mut in_signature, mut sizes) = (None, false, false);
    let (mut args, mut body) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("kernel void ") || t.contains("]] kernel void ") {
            kernel_at = Some(out.len());
            in_signature = true;
            out.push(line.to_string());
            continue;
        }
        if !in_signature {
            out.push(line.to_string());
            continue;
        }
        if t.starts_with(") {") {
            in_signature = false;
            // naga writes one argument a line, each after the first led by ", "
            for (k, a) in args.drain(..).enumerate() {
                out.push(format!("{}{a}", if k == 0 { "  " } else { ", " }));
            }
            out.push(line.to_string());
            out.append(&mut body);
            continue;
        }
        let arg = t.strip_prefix(", ").unwrap_or(t).trim().to_string();
        if arg.starts_with("constant _mslBufferSizes& _buffer_sizes") {
            sizes = true;
            body.push(format!("    constant _mslBufferSizes& _buffer_sizes = {NO_SIZES};"));
        } else if let Some(decl) = arg.strip_prefix("threadgroup ") {
            // `threadgroup T& name` → `threadgroup T name;`
            let decl = decl.split(" [[").next().unwrap_or(decl).replacen("& ", " ", 1);
            body.push(format!("    threadgroup {decl};"));
        } else {
            args.push(arg);
        }
    }
    if let (true, Some(at)) = (sizes, kernel_at) {
        out.insert(at, format!("constant _mslBufferSizes {NO_SIZES} = {{}};"));
    }
    let text = out.join("\n") + "\n";
    if text.contains("_buffer_sizes.") {
        return Err("the MSL reads buffer sizes, which wgpu's passthrough does not bind".into());
    }
    if text.contains("[[threadgroup(") {
        return Err("threadgroup memory left as an argument".into());
    }
    Ok(text)
}

/// The zero buffer-size table handed to naga's helpers.
const NO_SIZES: &str = "tinyllm_no_sizes";

