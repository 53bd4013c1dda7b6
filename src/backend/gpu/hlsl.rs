//! HLSL with the contract written into it (DX12). naga's HLSL, as wgpu
//! writes it for DX12, leaves every float operation free to be contracted or
//! regrouped by the compiler (DXC, or FXC) and writes WGSL's `fma` as `mad`,
//! which HLSL defines as fused or not at the implementation's choice. HLSL
//! forbids both only for values stored to a `precise` variable, so on DX12
//! the backend writes each kernel's HLSL itself (naga: WGSL → IR with
//! override constants resolved → HLSL for that one entry point) with:
//!
//! * the result of every float operation (arithmetic, conversion, math
//!   function) named in the IR, so naga stores it in a local of its own
//!   instead of writing it inline into a larger expression;
//! * every float local of every function declared `precise` (see
//!   [`make_precise`]): each operation is then evaluated on its own, rounded
//!   as written, never fused into a `mad` nor regrouped.
//!
//! HLSL has no single-precision fma (`fma` is double only) and a `precise`
//! `mad` is a multiply then an add (DXIL's FMad is unfused when precise), so
//! on this path the contract's `fma_c` is always the integer emulation
//! `fma_soft`: the context never composes the kernels with the device's
//! `fma` for DX12.
//!
//! What HLSL cannot say: the denormal mode. DXC's `-denorm preserve` is a
//! compiler option wgpu does not pass, and Direct3D's default lets a driver
//! flush f32 subnormals in arithmetic; the start-up probe reports whether
//! they survive. The text goes to wgpu's HLSL passthrough, which compiles it
//! with the device's shader model and binds the bind group as wgpu-hal's
//! root signature lays it out: per kind, in binding order, space 0 —
//! uniform buffers `b0, b1, …`, read-only storage `t0, …`, read-write
//! storage `u0, …` — which is the binding map given to naga here.

use super::spirv::{lower, Binding};
use crate::{Error, Result};

/// The prefix of the names given to float operations' results.
const NAME: &str = "fop";

/// One kernel's HLSL, with what the pipeline layout and the passthrough need.
#[derive(Clone, Debug)]
#[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))] // counts for the tests
pub struct Hlsl {
    pub source: String,
    pub bindings: Vec<Binding>,
    pub workgroup_size: [u32; 3],
    /// Float operations given a local of their own.
    pub named: usize,
    /// Declarations made `precise`.
    pub precise: usize,
}

/// The register of each binding: `b`, `t` or `u` and the number, counted per
/// kind in binding order (wgpu-hal's DX12 root signature).
pub fn registers(bindings: &[Binding]) -> Vec<(char, u32)> {
    let mut next = [0u32; 3];
    bindings
        .iter()
        .map(|b| {
            let (kind, i) = match b.storage {
                None => ('b', 0),
                Some(true) => ('t', 1),
                Some(false) => ('u', 2),
            };
            next[i] += 1;
            (kind, next[i] - 1)
        })
        .collect()
}

/// `entry` of the WGSL `src` with its override `constants` as HLSL with
/// every float operation `precise` (see the module docs).
pub fn compile(src: &str, entry: &str, constants: &[(&str, f64)]) -> Result<Hlsl> {
    let mut l = lower(src, entry, constants, "HLSL")?;
    let named = name_float_operations(&mut l.module, &l.info);
    let text = write(&l, entry)?;
    let (source, precise) = make_precise(&text);
    Ok(Hlsl { source, bindings: l.bindings, workgroup_size: l.workgroup_size, named, precise })
}

/// naga's HLSL for the lowered kernel, with the register map of [`registers`].
fn write(l: &super::spirv::Lowered, entry: &str) -> Result<String> {
    use naga::back::hlsl;
    let fail = |what: String| Error::internal(format!("compiling kernel {entry} to HLSL: {what}"));
    let mut binding_map = hlsl::BindingMap::default();
    for (b, (_, register)) in l.bindings.iter().zip(registers(&l.bindings)) {
        let target = hlsl::BindTarget { space: 0, register, ..Default::default() };
        binding_map.insert(naga::ResourceBinding { group: 0, binding: b.binding }, target);
    }
    // wgpu-hal gives every pipeline layout three root constants after the
    // bind groups' uniform buffers, in the next `b` register: in a compute
    // pass, the dispatch's workgroup counts (`num_workgroups`). Without the
    // binding naga would write `num_workgroups` as `SV_GroupID`.
    let cbvs = registers(&l.bindings).iter().filter(|r| r.0 == 'b').count() as u32;
    let options = hlsl::Options {
        // the lowest model DX12 runs; DXC compiles it for any newer one
        shader_model: hlsl::ShaderModel::V5_1,
        binding_map,
        special_constants_binding: Some(hlsl::BindTarget { space: 0, register: cbvs, ..Default::default() }),
        fake_missing_bindings: false,
        zero_initialize_workgroup_memory: false,
        restrict_indexing: true,
        force_loop_bounding: true,
        ..Default::default()
    };
    let pipeline = hlsl::PipelineOptions { entry_point: Some((naga::ShaderStage::Compute, entry.to_string())) };
    let mut text = String::new();
    let info = hlsl::Writer::new(&mut text, &options, &pipeline)
        .write(&l.module, &l.info, None)
        .map_err(|e| fail(format!("{e}")))?;
    match info.entry_point_names.first() {
        Some(Ok(name)) if name == entry => Ok(text),
        other => Err(fail(format!("naga named the entry point {other:?}"))),
    }
}

/// Names the result of every float operation of every function (those not
/// named already), so naga's writer gives each a local declaration instead
/// of nesting it in another expression. Returns how many it named.
fn name_float_operations(module: &mut naga::Module, info: &naga::valid::ModuleInfo) -> usize {
    let types = module.types.clone();
    let mut n = 0;
    let mut visit = |f: &mut naga::Function, fi: &naga::valid::FunctionInfo| {
        let handles: Vec<_> = f
            .expressions
            .iter()
            .filter(|&(h, e)| is_float_operation(e) && is_float(fi[h].ty.inner_with(&types)))
            .map(|(h, _)| h)
            .collect();
        for h in handles {
            if !f.named_expressions.contains_key(&h) {
                f.named_expressions.insert(h, format!("{NAME}{n}"));
                n += 1;
            }
        }
    };
    let functions: Vec<_> = module.functions.iter().map(|(h, _)| h).collect();
    for h in functions {
        visit(&mut module.functions[h], &info[h]);
    }
    for (i, ep) in module.entry_points.iter_mut().enumerate() {
        visit(&mut ep.function, info.get_entry_point(i));
    }
    n
}

/// An expression that computes a float: arithmetic, a conversion, a math
/// function (its type is checked apart).
fn is_float_operation(e: &naga::Expression) -> bool {
    use naga::{BinaryOperator as B, Expression as E};
    match e {
        E::Binary { op, .. } => matches!(op, B::Add | B::Subtract | B::Multiply | B::Divide | B::Modulo),
        E::Unary { op, .. } => *op == naga::UnaryOperator::Negate,
        E::Math { .. } | E::As { .. } => true,
        _ => false,
    }
}

fn is_float(t: &naga::TypeInner) -> bool {
    let s = match t {
        naga::TypeInner::Scalar(s) => s,
        naga::TypeInner::Vector { scalar, .. } => scalar,
        _ => return false,
    };
    s.kind == naga::ScalarKind::Float
}

/// The float types naga writes for locals.
const FLOAT_TYPES: [&str; 4] = ["float", "float2", "float3", "float4"];

/// Whether `line` declares a local of a float type (`float x = …;`,
/// `const float2 v = …;`, `float a[4] = …;`), with or without `precise`.
fn declares_float(line: &str) -> bool {
    let t = line.trim_start();
    let t = t.strip_prefix("precise ").unwrap_or(t);
    let t = t.strip_prefix("const ").unwrap_or(t);
    let Some((ty, rest)) = t.split_once(' ') else { return false };
    if !FLOAT_TYPES.contains(&ty) {
        return false;
    }
    let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
    let after = rest[name.len()..].trim_start();
    !name.is_empty() && (after.starts_with('=') || after.starts_with(';') || after.starts_with('['))
}

/// Every float local declared inside a function body made `precise`
/// (struct members, constants and parameters are left as they are).
/// Returns the text and the number of declarations changed.
pub fn make_precise(text: &str) -> (String, usize) {
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    let mut n = 0;
    for (line, in_body) in with_scope(text) {
        let t = line.trim_start();
        if in_body && declares_float(line) && !t.starts_with("precise ") {
            out.push_str(&line[..line.len() - t.len()]);
            out.push_str("precise ");
            out.push_str(t);
            n += 1;
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    (out, n)
}

/// Each line with whether it lies inside a function body: naga writes a
/// function's signature, then `{` alone on a line at column 0, and `}` at
/// column 0 to close it; structs open with `struct Name {`.
fn with_scope(text: &str) -> impl Iterator<Item = (&str, bool)> {
    let mut in_body = false;
    text.lines().map(move |line| {
        let opened = line == "{";
        if opened {
            in_body = true;
        } else if line.starts_with('}') {
            in_body = false;
        }
        (line, in_body && !opened)
    })
}

/// What a reviewer of the text can hold it to: every float local of every
/// function `precise`, every `mad` inside a `precise` declaration, and every
/// named float operation's local `precise`. An error names the first line
/// that breaks it.
#[cfg(any(test, feature = "test-hooks"))]
pub fn check(text: &str) -> std::result::Result<(), String> {
    for (k, (line, in_body)) in with_scope(text).enumerate() {
        let t = line.trim_start();
        let precise = t.starts_with("precise ");
        if in_body && declares_float(line) && !precise {
            return Err(format!("line {}: a float local not precise: {t}", k + 1));
        }
        if t.contains("mad(") && !precise {
            return Err(format!("line {}: a mad outside a precise declaration: {t}", k + 1));
        }
        if !in_body && t.contains("mad(") {
            return Err(format!("line {}: a mad outside a function body: {t}", k + 1));
        }
    }
    Ok(())
}
