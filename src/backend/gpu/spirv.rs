//! SPIR-V with the contract written into it. WGSL lets a compiler contract
//! `a·b + c` into an fma, flush subnormals and assume no inf or NaN, and
//! naga's SPIR-V says nothing to forbid it. On Vulkan the backend therefore
//! compiles each kernel itself (naga: WGSL → IR, override constants
//! resolved, → SPIR-V for that one entry point), then:
//!
//! * decorates the result of every float arithmetic instruction
//!   `NoContraction` (no fusing, no reassociation: each operation is rounded
//!   as written);
//! * declares the float-control execution modes the device grants for 32-bit
//!   floats — `SignedZeroInfNanPreserve`, `RoundingModeRTE`, `DenormPreserve`
//!   (`SPV_KHR_float_controls`) — so a driver may not assume away signed
//!   zeros, infinities, NaN or subnormals, nor round otherwise;
//!
//! and hands the words to the driver unchanged (wgpu's passthrough), with a
//! bind-group layout built from naga's reflection of the entry point.

use crate::{Error, Result};

/// The float-control execution modes for 32-bit floats: what a kernel asks
/// for, or what a device grants (Vulkan's
/// `VkPhysicalDeviceFloatControlsProperties`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FloatControls {
    pub signed_zero_inf_nan_preserve: bool,
    pub rounding_mode_rte: bool,
    pub denorm_preserve: bool,
}

impl FloatControls {
    /// Everything the contract wants.
    pub const ALL: FloatControls = FloatControls {
        signed_zero_inf_nan_preserve: true,
        rounding_mode_rte: true,
        denorm_preserve: true,
    };

    /// The modes set, by their SPIR-V names with the width.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.signed_zero_inf_nan_preserve {
            v.push("SignedZeroInfNanPreserve32");
        }
        if self.rounding_mode_rte {
            v.push("RoundingModeRTE32");
        }
        if self.denorm_preserve {
            v.push("DenormPreserve32");
        }
        v
    }

    fn any(&self) -> bool {
        self.signed_zero_inf_nan_preserve || self.rounding_mode_rte || self.denorm_preserve
    }
}

// SPIR-V opcodes, decorations, capabilities and execution modes used here.
const OP_EXTENSION: u16 = 10;
const OP_EXT_INST_IMPORT: u16 = 11;
const OP_MEMORY_MODEL: u16 = 14;
const OP_ENTRY_POINT: u16 = 15;
const OP_EXECUTION_MODE: u16 = 16;
const OP_CAPABILITY: u16 = 17;
const OP_DECORATE: u16 = 71;
const OP_MEMBER_DECORATE: u16 = 72;
const DECORATION_NO_CONTRACTION: u32 = 42;
/// OpFNegate, OpFAdd, OpFSub, OpFMul, OpFDiv, OpFRem, OpFMod,
/// OpVectorTimesScalar, OpMatrixTimesScalar, OpVectorTimesMatrix,
/// OpMatrixTimesVector, OpMatrixTimesMatrix, OpOuterProduct, OpDot: every
/// instruction whose result is float arithmetic (result id in word 2).
const FLOAT_ARITHMETIC: [u16; 14] = [127, 129, 131, 133, 136, 140, 141, 142, 143, 144, 145, 146, 147, 148];
const CAP_DENORM_PRESERVE: u32 = 4464;
const CAP_SIGNED_ZERO_INF_NAN_PRESERVE: u32 = 4466;
const CAP_ROUNDING_MODE_RTE: u32 = 4467;
const MODE_DENORM_PRESERVE: u32 = 4459;
const MODE_SIGNED_ZERO_INF_NAN_PRESERVE: u32 = 4461;
const MODE_ROUNDING_MODE_RTE: u32 = 4462;

/// One instruction: its opcode and words (the first word included).
fn instructions(words: &[u32]) -> Result<Vec<(u16, std::ops::Range<usize>)>> {
    if words.len() < 5 || words[0] != 0x0723_0203 {
        return Err(Error::internal("SPIR-V: not a module (bad magic number)"));
    }
    let mut out = Vec::new();
    let mut i = 5;
    while i < words.len() {
        let (count, op) = ((words[i] >> 16) as usize, (words[i] & 0xffff) as u16);
        if count == 0 || i + count > words.len() {
            return Err(Error::internal(format!("SPIR-V: a malformed instruction at word {i}")));
        }
        out.push((op, i..i + count));
        i += count;
    }
    Ok(out)
}

fn inst(op: u16, operands: &[u32]) -> Vec<u32> {
    let mut v = vec![((operands.len() as u32 + 1) << 16) | op as u32];
    v.extend_from_slice(operands);
    v
}

/// A literal string operand: UTF-8, NUL-terminated, padded to whole words.
fn string_words(s: &str) -> Vec<u32> {
    let mut b = s.as_bytes().to_vec();
    b.push(0);
    while !b.len().is_multiple_of(4) {
        b.push(0);
    }
    b.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// What [`harden`] did to a module.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hardened {
    /// Float arithmetic results decorated `NoContraction`.
    pub no_contraction: usize,
    /// The execution modes declared on the entry point.
    pub modes: FloatControls,
}

/// Rewrites a one-entry-point module: `NoContraction` on every float
/// arithmetic result, and the execution modes of `modes` (with their
/// capabilities and `SPV_KHR_float_controls`) on the entry point.
pub fn harden(words: &[u32], modes: FloatControls) -> Result<(Vec<u32>, Hardened)> {
    let insts = instructions(words)?;
    let entries: Vec<u32> = insts
        .iter()
        .filter(|(op, _)| *op == OP_ENTRY_POINT)
        .map(|(_, r)| words[r.start + 2])
        .collect();
    let results: Vec<u32> = insts
        .iter()
        .filter(|(op, _)| FLOAT_ARITHMETIC.contains(op))
        .map(|(_, r)| words[r.start + 2])
        .collect();
    // Where each new instruction goes, in the module's logical layout:
    // capabilities after the last capability, the extension after them,
    // execution modes after the entry points' (or the entry points), and
    // decorations after the last annotation.
    let last = |ops: &[u16]| insts.iter().rposition(|(op, _)| ops.contains(op));
    let cap_at = last(&[OP_CAPABILITY]).ok_or_else(|| Error::internal("SPIR-V: no capability"))?;
    let mode_at = last(&[OP_EXECUTION_MODE, OP_ENTRY_POINT])
        .ok_or_else(|| Error::internal("SPIR-V: no entry point"))?;
    let deco_at = last(&[OP_DECORATE, OP_MEMBER_DECORATE])
        .or(last(&[OP_EXECUTION_MODE, OP_ENTRY_POINT]))
        .unwrap_or(mode_at);
    let has_ext = insts.iter().any(|(op, r)| {
        *op == OP_EXTENSION && words[r.start + 1..r.end] == string_words("SPV_KHR_float_controls")[..]
    });
    let mut caps = Vec::new();
    let mut exec = Vec::new();
    for (on, cap, mode) in [
        (modes.signed_zero_inf_nan_preserve, CAP_SIGNED_ZERO_INF_NAN_PRESERVE, MODE_SIGNED_ZERO_INF_NAN_PRESERVE),
        (modes.rounding_mode_rte, CAP_ROUNDING_MODE_RTE, MODE_ROUNDING_MODE_RTE),
        (modes.denorm_preserve, CAP_DENORM_PRESERVE, MODE_DENORM_PRESERVE),
    ] {
        if on {
            caps.extend(inst(OP_CAPABILITY, &[cap]));
            for &e in &entries {
                exec.extend(inst(OP_EXECUTION_MODE, &[e, mode, 32]));
            }
        }
    }
    if modes.any() && !has_ext {
        caps.extend(inst(OP_EXTENSION, &string_words("SPV_KHR_float_controls")));
    }
    let deco: Vec<u32> = results
        .iter()
        .flat_map(|&id| inst(OP_DECORATE, &[id, DECORATION_NO_CONTRACTION]))
        .collect();
    // An OpExtension must follow every capability and precede the imports
    // and the memory model: the capabilities section ends at cap_at, and
    // nothing but extensions may sit between it and the imports.
    debug_assert!(insts[cap_at + 1..]
        .iter()
        .take_while(|(op, _)| ![OP_EXT_INST_IMPORT, OP_MEMORY_MODEL].contains(op))
        .all(|(op, _)| *op == OP_EXTENSION));
    let mut out = words[..5].to_vec();
    for (k, (_, r)) in insts.iter().enumerate() {
        out.extend_from_slice(&words[r.clone()]);
        if k == cap_at {
            out.extend_from_slice(&caps);
        }
        if k == mode_at {
            out.extend_from_slice(&exec);
        }
        if k == deco_at {
            out.extend_from_slice(&deco);
        }
    }
    let done = Hardened {
        no_contraction: results.len(),
        modes: if entries.is_empty() { FloatControls::default() } else { modes },
    };
    Ok((out, done))
}

/// A binding of a kernel, as its bind-group layout needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Binding {
    pub binding: u32,
    /// `Some(read_only)` for a storage buffer, `None` for a uniform buffer.
    pub storage: Option<bool>,
}

/// One kernel compiled: its SPIR-V (hardened), the bindings its entry point
/// uses (group 0), its workgroup size and what [`harden`] did.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub words: Vec<u32>,
    pub bindings: Vec<Binding>,
    pub workgroup_size: [u32; 3],
    pub hardened: Hardened,
}

/// Compiles `entry` of the WGSL `src` with its override `constants` to
/// hardened SPIR-V (see the module docs), for SPIR-V 1.3.
pub fn compile(src: &str, entry: &str, constants: &[(&str, f64)], modes: FloatControls) -> Result<Compiled> {
    let plain = to_spirv(src, entry, constants)?;
    let (words, hardened) = harden(&plain.words, modes)?;
    Ok(Compiled { words, hardened, ..plain })
}

/// One entry point of a WGSL source in naga's IR, override constants
/// resolved: what every backend's writer starts from.
pub(super) struct Lowered {
    pub module: naga::Module,
    pub info: naga::valid::ModuleInfo,
    /// The bindings the entry point uses (group 0), by binding number.
    pub bindings: Vec<Binding>,
    pub workgroup_size: [u32; 3],
}

/// Parses and validates `src`, resolves the override `constants` for
/// `entry`, reflects its bindings and takes the branches the constants
/// decide ([`prune`](super::prune)). `target` names the output in errors.
pub(super) fn lower(src: &str, entry: &str, constants: &[(&str, f64)], target: &str) -> Result<Lowered> {
    let fail = |what: String| Error::internal(format!("compiling kernel {entry} to {target}: {what}"));
    let module = naga::front::wgsl::parse_str(src).map_err(|e| fail(e.emit_to_string(src)))?;
    let mut validator = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::default());
    let info = validator.validate(&module).map_err(|e| fail(format!("{e:?}")))?;
    let mut pc = naga::back::PipelineConstants::default();
    for &(k, v) in constants {
        pc.insert(k.to_string(), v);
    }
    let stage = naga::ShaderStage::Compute;
    let (module, info) = naga::back::pipeline_constants::process_overrides(&module, &info, Some((stage, entry)), &pc)
        .map_err(|e| fail(format!("{e:?}")))?;
    let index = module
        .entry_points
        .iter()
        .position(|e| e.name == entry)
        .ok_or_else(|| fail("no such entry point".into()))?;
    // every binding the kernel declares for its launcher, the ones only a
    // pruned arm reads included (a layout may bind more than a kernel reads)
    let bindings = entry_bindings(&module, &info, index).map_err(fail)?;
    let workgroup_size = module.entry_points[index].workgroup_size;
    // the arms the constants decide against, gone before any driver compiles them
    let mut module = module.into_owned();
    super::prune::constant_branches(&mut module);
    let info = validator.validate(&module).map_err(|e| fail(format!("after pruning: {e:?}")))?;
    Ok(Lowered { module, info, bindings, workgroup_size })
}

/// naga's SPIR-V for `entry` alone, override constants resolved, as naga
/// writes it (nothing added).
fn to_spirv(src: &str, entry: &str, constants: &[(&str, f64)]) -> Result<Compiled> {
    let fail = |what: String| Error::internal(format!("compiling kernel {entry} to SPIR-V: {what}"));
    #[allow(unused_mut)] // mutated by the test-only adversary
    let Lowered { mut module, mut info, bindings, workgroup_size, .. } = lower(src, entry, constants, "SPIR-V")?;
    // the tests' adversarial compiler, where a process asks for it
    #[cfg(any(test, feature = "test-hooks"))]
    if let Some(a) = super::adversary::active()? {
        info = super::adversary::rewrite(&mut module, &info, a).map_err(|e| e.context(format!("kernel {entry}")))?.0;
    }
    let words = write(&module, &info, entry).map_err(fail)?;
    Ok(Compiled { words, bindings, workgroup_size, hardened: Hardened::default() })
}

/// naga's SPIR-V 1.3 for `entry` of a lowered `module`.
pub(super) fn write(module: &naga::Module, info: &naga::valid::ModuleInfo, entry: &str) -> std::result::Result<Vec<u32>, String> {
    let stage = naga::ShaderStage::Compute;
    let options = naga::back::spv::Options {
        lang_version: (1, 3),
        flags: naga::back::spv::WriterFlags::empty(),
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: naga::proc::BoundsCheckPolicy::Restrict,
            buffer: naga::proc::BoundsCheckPolicy::Restrict,
            image_load: naga::proc::BoundsCheckPolicy::Restrict,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        force_loop_bounding: true,
        // every kernel writes the workgroup memory it reads (tests below)
        zero_initialize_workgroup_memory: naga::back::spv::ZeroInitializeWorkgroupMemoryMode::None,
        ..Default::default()
    };
    let pipeline = naga::back::spv::PipelineOptions { shader_stage: stage, entry_point: entry.to_string() };
    naga::back::spv::write_vec(module, info, &options, Some(&pipeline)).map_err(|e| format!("{e}"))
}

/// The group-0 bindings entry point `index` of `module` uses, by number.
fn entry_bindings(
    module: &naga::Module,
    info: &naga::valid::ModuleInfo,
    index: usize,
) -> std::result::Result<Vec<Binding>, String> {
    let uses = info.get_entry_point(index);
    let mut bindings = Vec::new();
    for (h, g) in module.global_variables.iter() {
        let Some(rb) = &g.binding else { continue };
        if uses[h].is_empty() {
            continue;
        }
        if rb.group != 0 {
            return Err(format!("binding group {} (kernels use group 0 only)", rb.group));
        }
        let storage = match g.space {
            naga::AddressSpace::Uniform => None,
            naga::AddressSpace::Storage { access } => Some(!access.contains(naga::StorageAccess::STORE)),
            other => return Err(format!("a binding in address space {other:?}")),
        };
        bindings.push(Binding { binding: rb.binding, storage });
    }
    bindings.sort_by_key(|b| b.binding);
    Ok(bindings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::pipelines::compose;

    /// Each kernel of every family, compiled for both fma variants.
    fn every_kernel(modes: FloatControls) -> Vec<(String, Compiled)> {
        let mut out = Vec::new();
        for f in crate::backend::gpu_families() {
            for native in [false, true] {
                let src = compose(f, native);
                for e in f.entries {
                    let c = compile(&src, e, &[], modes).unwrap_or_else(|e| panic!("{}: {e}", f.name));
                    out.push((format!("{}::{e} (native fma {native})", f.name), c));
                }
            }
        }
        out
    }

    /// Every float arithmetic result of every kernel carries NoContraction,
    /// and the modes asked for are declared once per entry point.
    #[test]
    fn every_float_operation_is_marked_and_the_modes_declared() {
        for (label, c) in every_kernel(FloatControls::ALL) {
            let insts = instructions(&c.words).unwrap();
            let w = &c.words;
            let decorated: std::collections::HashSet<u32> = insts
                .iter()
                .filter(|(op, r)| *op == OP_DECORATE && w[r.start + 2] == DECORATION_NO_CONTRACTION)
                .map(|(_, r)| w[r.start + 1])
                .collect();
            let arith: Vec<u32> = insts
                .iter()
                .filter(|(op, _)| FLOAT_ARITHMETIC.contains(op))
                .map(|(_, r)| w[r.start + 2])
                .collect();
            assert!(arith.iter().all(|id| decorated.contains(id)), "{label}: an undecorated float operation");
            assert_eq!(c.hardened.no_contraction, arith.len(), "{label}");
            let modes: Vec<u32> = insts
                .iter()
                .filter(|(op, _)| *op == OP_EXECUTION_MODE)
                .map(|(_, r)| w[r.start + 2])
                .collect();
            for m in [MODE_SIGNED_ZERO_INF_NAN_PRESERVE, MODE_ROUNDING_MODE_RTE, MODE_DENORM_PRESERVE] {
                assert_eq!(modes.iter().filter(|&&x| x == m).count(), 1, "{label}: mode {m}");
            }
        }
    }

    /// `spirv-val` (SPIRV-Tools) accepts every hardened module, for Vulkan
    /// 1.1 with the float-controls extension. Where `spirv-val` is not
    /// installed the test says so and passes, unless
    /// `TINYLLM_REQUIRE_SPIRV_VAL=1` (CI installs `spirv-tools`).
    #[test]
    fn spirv_val_accepts_every_hardened_module() {
        let have = std::process::Command::new("spirv-val").arg("--version").output().is_ok();
        if !have {
            assert!(
                std::env::var("TINYLLM_REQUIRE_SPIRV_VAL").as_deref() != Ok("1"),
                "spirv-val is required (TINYLLM_REQUIRE_SPIRV_VAL=1) but not installed"
            );
            eprintln!("spirv-val not installed: skipping");
            return;
        }
        let dir = std::env::temp_dir().join(format!("tinyllm-spirv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut checked = 0;
        for (label, c) in every_kernel(FloatControls::ALL) {
            let path = dir.join("k.spv");
            let bytes: Vec<u8> = c.words.iter().flat_map(|w| w.to_le_bytes()).collect();
            std::fs::write(&path, bytes).unwrap();
            let o = std::process::Command::new("spirv-val")
                .args(["--target-env", "vulkan1.1"])
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{label}: spirv-val: {}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            checked += 1;
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(checked >= 40, "only {checked} modules checked");
    }

    /// No kernel has its workgroup memory zeroed for it. naga's polyfill
    /// stores a null constant to each workgroup variable at the entry's
    /// start; llvmpipe lowers that to one store, and a few blocks, per
    /// element, and a barrier kernel's compile time grows far faster than
    /// its blocks (docs/benchmarks-log.md, the twenty-ninth sitting). Every
    /// kernel writes the workgroup memory it reads instead.
    #[test]
    fn no_kernel_zeroes_its_workgroup_memory() {
        use std::collections::HashSet;
        const OP_CONSTANT_NULL: u16 = 46;
        const OP_VARIABLE: u16 = 59;
        const OP_STORE: u16 = 62;
        const STORAGE_WORKGROUP: u32 = 4;
        let mut with_tiles = 0;
        for (label, c) in every_kernel(FloatControls::ALL) {
            let insts = instructions(&c.words).unwrap();
            let w = &c.words;
            let nulls: HashSet<u32> =
                insts.iter().filter(|(op, _)| *op == OP_CONSTANT_NULL).map(|(_, r)| w[r.start + 2]).collect();
            let shared: HashSet<u32> = insts
                .iter()
                .filter(|(op, r)| *op == OP_VARIABLE && w[r.start + 3] == STORAGE_WORKGROUP)
                .map(|(_, r)| w[r.start + 2])
                .collect();
            with_tiles += usize::from(!shared.is_empty());
            let zeroing = insts
                .iter()
                .filter(|(op, r)| *op == OP_STORE && shared.contains(&w[r.start + 1]) && nulls.contains(&w[r.start + 2]))
                .count();
            assert_eq!(zeroing, 0, "{label}: zeroes its workgroup memory");
        }
        assert!(with_tiles >= 8, "only {with_tiles} kernels with workgroup memory");
    }

    /// naga alone writes float operations and no NoContraction at all: the
    /// rewrite is what puts them there (the first test fails without it).
    #[test]
    fn naga_alone_marks_nothing() {
        for f in crate::backend::gpu_families() {
            let src = compose(f, false);
            for e in f.entries {
                let plain = to_spirv(&src, e, &[]).unwrap();
                let insts = instructions(&plain.words).unwrap();
                let w = &plain.words;
                assert!(!insts
                    .iter()
                    .any(|(op, r)| *op == OP_DECORATE && w[r.start + 2] == DECORATION_NO_CONTRACTION));
            }
        }
        let f = crate::backend::gpu_families()[1];
        let plain = to_spirv(&compose(f, false), f.entries[0], &[]).unwrap();
        assert!(harden(&plain.words, FloatControls::ALL).unwrap().1.no_contraction > 0);
    }
}
