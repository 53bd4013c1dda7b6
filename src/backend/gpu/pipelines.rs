//! Kernel families, how their WGSL is composed, and what identifies one
//! compiled pipeline. Nothing here knows the device: the [`context`](super::context)
//! compiles what this describes.
//!
//! Each primitive family (`backend/<family>/`) declares one [`Family`]: its
//! WGSL source (`shaders/<family>.wgsl` at the top of the repository,
//! included with `include_str!`), the constants generated from its Rust enums
//! (op codes: one source), its entry points and its parameter structs. WGSL
//! has no includes, so every family gets `shaders/grid.wgsl` (its
//! invocations' linear index) prepended, and a family that uses the math
//! library the prelude too: the `fma_c` selector, `shaders/math.wgsl`, the
//! format codes and `shaders/round.wgsl`.
//!
//! `fma_c` is the contract's fused multiply-add: the device's `fma` when a
//! probe at start-up shows it is exactly fused, else `fma_soft` (math.wgsl,
//! integer emulation). On Mesa's lavapipe `fma` is not fused.

use crate::backend::{math, round};

/// `grid_index`, the linear index of an invocation in a 1-D grid (see
/// [`grid1d`](super::grid1d)), written once for every family.
pub const GRID_WGSL: &str = include_str!("../../../shaders/grid.wgsl");

/// The byte layout of a `#[repr(C)]` parameter struct and the name of its
/// WGSL twin, so a test can hold the two against naga's reflection.
#[derive(Debug)]
#[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
pub struct ParamsLayout {
    pub wgsl: &'static str,
    pub size: usize,
    pub fields: &'static [(&'static str, usize)],
}

/// One family's shaders (`entries` and `params` are for the tests).
#[derive(Debug)]
#[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
pub struct Family {
    pub name: &'static str,
    pub sources: &'static [&'static str],
    /// Whether the math prelude goes in front.
    pub needs_math: bool,
    /// WGSL constants generated from the family's Rust enums.
    pub consts: fn() -> String,
    pub entries: &'static [&'static str],
    pub params: &'static [ParamsLayout],
}

/// No generated constants.
pub fn no_consts() -> String {
    String::new()
}

/// Values for a kernel's `override` constants (unused slots have no name).
pub type Overrides = [(&'static str, u32); 12];

/// One pipeline: a family's entry point with its override constants.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    pub family: &'static Family,
    pub entry: &'static str,
    pub overrides: Overrides,
}

impl Kernel {
    pub const fn new(family: &'static Family, entry: &'static str) -> Kernel {
        Kernel {
            family,
            entry,
            overrides: [("", 0); 12],
        }
    }
    /// The same entry point with `name = value` set (at most twelve).
    pub const fn with(mut self, name: &'static str, value: u32) -> Kernel {
        let mut i = 0;
        while i < self.overrides.len() && !self.overrides[i].0.is_empty() {
            i += 1;
        }
        self.overrides[i] = (name, value);
        self
    }
    /// The override constants as wgpu takes them.
    pub fn constants(&self) -> Vec<(&'static str, f64)> {
        self.overrides
            .iter()
            .filter(|(n, _)| !n.is_empty())
            .map(|&(n, v)| (n, v as f64))
            .collect()
    }
    fn key(&self) -> (&'static str, &'static str, Overrides) {
        (self.family.name, self.entry, self.overrides)
    }
}

impl PartialEq for Kernel {
    fn eq(&self, o: &Kernel) -> bool {
        self.key() == o.key()
    }
}
impl Eq for Kernel {}
impl std::hash::Hash for Kernel {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.key().hash(h)
    }
}

/// The math prelude, with `fma_c` bound to the device's `fma` (`native_fma`)
/// or to the integer emulation.
pub fn prelude(native_fma: bool) -> String {
    let sel = if native_fma {
        "// fma_c: the device's fma, probed to be exactly fused\n\
         fn fma_c(a: f32, b: f32, c: f32) -> f32 { return fma(a, b, c); }"
    } else {
        "// fma_c: the device's fma is not fused (probed): integer emulation\n\
         fn fma_c(a: f32, b: f32, c: f32) -> f32 { return fma_soft(a, b, c); }"
    };
    format!(
        "{sel}\n{}\n{}{}{}\n",
        math::MATH_WGSL,
        round::wgsl_consts(),
        round::wgsl_fp8_consts(),
        round::CAST_WGSL
    )
}

/// The full source of a family as the backend compiles it.
pub fn compose(f: &Family, native_fma: bool) -> String {
    let mut s = String::from(GRID_WGSL);
    if f.needs_math {
        s.push_str(&prelude(native_fma));
    }
    s.push_str(&(f.consts)());
    for src in f.sources {
        s.push_str(src);
        s.push('\n');
    }
    s
}

/// `gpu_params! { /// doc  pub struct Name { field: u32, .. } }`: a
/// `#[repr(C)]` [`bytemuck::Pod`] struct mirroring the WGSL struct `Name`,
/// with its [`ParamsLayout`] as `Name::LAYOUT`.
macro_rules! gpu_params {
    ($(#[$m:meta])* $vis:vis struct $name:ident { $($f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name { $(pub $f: $t),* }
        impl $name {
            pub const LAYOUT: $crate::backend::gpu::pipelines::ParamsLayout =
                $crate::backend::gpu::pipelines::ParamsLayout {
                    wgsl: stringify!($name),
                    size: std::mem::size_of::<$name>(),
                    fields: &[$((stringify!($f), std::mem::offset_of!($name, $f))),*],
                };
        }
    };
}
pub(crate) use gpu_params;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family as composed for both fma variants (and the start-up probe)
    /// parses and validates with naga, and every entry point exists.
    #[test]
    fn every_shader_validates_with_naga() {
        let mut sources = vec![(
            "arithmetic probe".to_string(),
            crate::backend::gpu::arith::ARITH_PROBE.to_string(),
            vec!["probe"],
        )];
        for f in crate::backend::gpu_families() {
            for native in [false, true] {
                sources.push((
                    format!("{} (native fma: {native})", f.name),
                    compose(f, native),
                    f.entries.to_vec(),
                ));
            }
        }
        for (label, src, entries) in sources {
            let module = naga::front::wgsl::parse_str(&src)
                .unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(&src)));
            naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{label}: {e:?}"));
            for e in entries {
                assert!(
                    module.entry_points.iter().any(|ep| ep.name == e),
                    "{label}: no entry point {e}"
                );
            }
        }
    }

    use naga::{Expression as E, Statement as S};
    use std::collections::HashSet;

    /// Every statement of `block`, those of nested blocks included.
    fn statements<'a>(block: &'a naga::Block, out: &mut Vec<&'a naga::Statement>) {
        for st in block.iter() {
            out.push(st);
            match st {
                S::Block(b) => statements(b, out),
                S::If { accept, reject, .. } => {
                    statements(accept, out);
                    statements(reject, out);
                }
                S::Switch { cases, .. } => cases.iter().for_each(|c| statements(&c.body, out)),
                S::Loop { body, continuing, .. } => {
                    statements(body, out);
                    statements(continuing, out);
                }
                _ => {}
            }
        }
    }

    /// The functions of `module`, entry points included, by name.
    fn functions(module: &naga::Module) -> Vec<(String, &naga::Function)> {
        let named = |f: &naga::Function| f.name.clone().unwrap_or_default();
        module
            .functions
            .iter()
            .map(|(_, f)| (named(f), f))
            .chain(module.entry_points.iter().map(|ep| (ep.name.clone(), &ep.function)))
            .collect()
    }

    /// Whether `h` in `arena` is a constant infinity or NaN: a float literal,
    /// the bitcast of an integer literal (or of a named constant) to f32, a
    /// named constant holding one, a select between such, or the result of a
    /// call to one of `returners`.
    fn nonfinite(
        module: &naga::Module,
        arena: &naga::Arena<naga::Expression>,
        h: naga::Handle<naga::Expression>,
        returners: &HashSet<naga::Handle<naga::Function>>,
    ) -> bool {
        let bits = |h: naga::Handle<naga::Expression>| -> Option<u32> {
            let lit = |e: &naga::Expression| match *e {
                E::Literal(naga::Literal::U32(b)) => Some(b),
                E::Literal(naga::Literal::I32(i)) => Some(i as u32),
                E::Literal(naga::Literal::AbstractInt(i)) => Some(i as u32),
                _ => None,
            };
            match arena[h] {
                E::Constant(c) => lit(&module.global_expressions[module.constants[c].init]),
                ref e => lit(e),
            }
        };
        match arena[h] {
            E::Literal(naga::Literal::F32(v)) => !v.is_finite(),
            E::As { expr, kind: naga::ScalarKind::Float, convert: None } => {
                bits(expr).is_some_and(|b| !f32::from_bits(b).is_finite())
            }
            E::Constant(c) => {
                let init = module.constants[c].init;
                nonfinite(module, &module.global_expressions, init, returners)
            }
            E::Select { accept, reject, .. } => {
                nonfinite(module, arena, accept, returners) || nonfinite(module, arena, reject, returners)
            }
            E::CallResult(f) => returners.contains(&f),
            _ => false,
        }
    }

    /// Where `module` computes with a constant infinity or NaN: as an operand
    /// of arithmetic, a comparison or a built-in, a call's argument, or a
    /// local variable's value (a starting value or a mask) — through a
    /// function that returns one, too. Returning one or storing one to a
    /// buffer is no computation. The math prelude's functions (`prelude`:
    /// `m_exp`, `m_div`, `fma_soft`, …) return IEEE special results, inf for
    /// an overflow, NaN for an invalid operation, as bit patterns; their
    /// callers are not held to account for those (finite inputs that
    /// overflow are not the identities and masks this guards against).
    fn constant_nonfinite_uses(module: &naga::Module, prelude_fns: &HashSet<String>) -> Vec<String> {
        let mut returners = HashSet::new();
        loop {
            let before = returners.len();
            for (h, f) in module.functions.iter() {
                if prelude_fns.contains(f.name.as_deref().unwrap_or_default()) {
                    continue;
                }
                let mut st = Vec::new();
                statements(&f.body, &mut st);
                if st.iter().any(|s| {
                    matches!(s, S::Return { value: Some(v) } if nonfinite(module, &f.expressions, *v, &returners))
                }) {
                    returners.insert(h);
                }
            }
            if returners.len() == before {
                break;
            }
        }
        let mut found = Vec::new();
        for (name, f) in functions(module) {
            let bad = |h| nonfinite(module, &f.expressions, h, &returners);
            for (h, e) in f.expressions.iter() {
                let operands: Vec<naga::Handle<naga::Expression>> = match *e {
                    E::Binary { left, right, .. } => vec![left, right],
                    E::Unary { expr, .. } | E::Relational { argument: expr, .. } => vec![expr],
                    E::Math { arg, arg1, arg2, arg3, .. } => [Some(arg), arg1, arg2, arg3].into_iter().flatten().collect(),
                    _ => vec![],
                };
                if operands.into_iter().any(bad) {
                    found.push(format!("{name}: {:?} computes with a constant inf/NaN", f.expressions[h]));
                }
            }
            let mut st = Vec::new();
            statements(&f.body, &mut st);
            for s in st {
                match s {
                    S::Call { function, arguments, .. } if arguments.iter().any(|&a| bad(a)) => {
                        let callee = module.functions[*function].name.clone().unwrap_or_default();
                        found.push(format!("{name}: calls {callee} with a constant inf/NaN"));
                    }
                    S::Store { pointer, value } if bad(*value) => {
                        let mut p = *pointer;
                        while let E::Access { base, .. } | E::AccessIndex { base, .. } = f.expressions[p] {
                            p = base;
                        }
                        if matches!(f.expressions[p], E::LocalVariable(_)) {
                            found.push(format!("{name}: a local variable holds a constant inf/NaN"));
                        }
                    }
                    _ => {}
                }
            }
            for (_, v) in f.local_variables.iter() {
                if v.init.is_some_and(bad) {
                    found.push(format!("{name}: local {:?} starts from a constant inf/NaN", v.name));
                }
            }
        }
        found
    }

    /// The names of the math prelude's functions.
    fn prelude_functions() -> HashSet<String> {
        let module = naga::front::wgsl::parse_str(&prelude(false)).expect("the prelude parses");
        functions(&module).into_iter().map(|(n, _)| n).chain(["fma_c".to_string()]).collect()
    }

    /// No kernel computes with a constant infinity or NaN (a shader compiler
    /// may assume there are none and fold such arithmetic away): maxima start
    /// from a loaded value, masked softmax keys are +0 directly, an empty max
    /// is stored as bits. The check itself finds the patterns it is for.
    #[test]
    fn no_kernel_computes_with_a_constant_infinity() {
        let prelude_fns = prelude_functions();
        let mut found = Vec::new();
        for f in crate::backend::gpu_families() {
            let module = naga::front::wgsl::parse_str(&compose(f, false)).expect("parses");
            found.extend(constant_nonfinite_uses(&module, &prelude_fns).into_iter().map(|v| format!("{}: {v}", f.name)));
        }
        assert!(found.is_empty(), "{found:#?}");
        // the former patterns: a max from -inf, a masked value returned as -inf
        let old = "
            @group(0) @binding(0) var<storage, read_write> y: array<f32>;
            fn masked(x: f32, j: u32) -> f32 {
                if j > 3u { return bitcast<f32>(0xff800000u); }
                return x;
            }
            fn big(a: f32, b: f32) -> f32 { return select(a, b, b > a); }
            @compute @workgroup_size(1)
            fn k() {
                var m = bitcast<f32>(0xff800000u);
                for (var j = 0u; j < 8u; j++) { m = big(m, y[j]); }
                y[0] = exp(masked(y[1], 5u) - m);
                y[1] = bitcast<f32>(0xff800000u);
            }";
        let module = naga::front::wgsl::parse_str(old).expect("parses");
        let caught = constant_nonfinite_uses(&module, &prelude_fns);
        assert_eq!(caught.len(), 2, "{caught:#?}");
    }

    /// `frexp_abs` and `scale2` (the exponents in and out of the math
    /// library) take no float arithmetic: every operation in them is on
    /// integers, so a device that flushes subnormals cannot change them.
    #[test]
    fn exponent_steps_take_no_float_arithmetic() {
        let module = naga::front::wgsl::parse_str(&prelude(false)).expect("parses");
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
            .validate(&module)
            .expect("validates");
        let mut checked = 0;
        for (h, f) in module.functions.iter() {
            let name = f.name.as_deref().unwrap_or_default();
            if !["frexp_abs", "scale2"].contains(&name) {
                continue;
            }
            let float = |e: naga::Handle<naga::Expression>| info[h][e].ty.inner_with(&module.types).scalar_kind() == Some(naga::ScalarKind::Float);
            for (e, x) in f.expressions.iter() {
                let arithmetic = match *x {
                    E::Binary { left, .. } => float(left),
                    E::Unary { expr, .. } => float(expr),
                    E::Math { arg, .. } => float(arg),
                    _ => false,
                };
                assert!(!arithmetic, "{name}: float arithmetic {x:?} ({e:?})");
                checked += 1;
            }
        }
        assert!(checked > 40, "{checked} expressions");
    }

    /// The selectors of every `case` in a WGSL source (comments left out).
    fn case_labels(src: &str) -> Vec<String> {
        let code: Vec<&str> = src.lines().map(|l| l.split("//").next().unwrap_or("")).collect();
        let mut labels = Vec::new();
        for part in code.join("\n").split("case ").skip(1) {
            let sel = part.split(':').next().unwrap_or("");
            labels.extend(sel.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()));
        }
        labels
    }

    /// Every op-code constant a family generates (`const U_EXP: u32 = 1u;`)
    /// is a `case` of a switch in the family's sources: an op added on the
    /// Rust side and not in the shader fails here, not as a NaN (or a zero)
    /// from the switch's default at run time.
    #[test]
    fn every_generated_op_code_has_a_wgsl_case() {
        let mut checked = 0;
        for f in crate::backend::gpu_families() {
            let cases = case_labels(&f.sources.join("\n"));
            for line in (f.consts)().lines() {
                let Some(rest) = line.strip_prefix("const ") else { continue };
                let name = rest.split(':').next().unwrap().trim();
                assert!(
                    cases.iter().any(|c| c == name),
                    "{}: no `case {name}:` in its WGSL (cases: {cases:?})",
                    f.name
                );
                checked += 1;
            }
        }
        // the probe's 15, elementwise's 18 + 6, reduce's 2
        assert!(checked >= 41, "only {checked} op codes checked");
    }

    /// Each `#[repr(C)]` parameter struct has its WGSL twin's size and the
    /// same fields at the same offsets, as naga lays the WGSL struct out.
    #[test]
    fn params_structs_mirror_their_wgsl_twins() {
        let mut checked = 0;
        for f in crate::backend::gpu_families() {
            let src = compose(f, false);
            let module = naga::front::wgsl::parse_str(&src).expect("parses");
            for p in f.params {
                let ty = module
                    .types
                    .iter()
                    .find(|(_, t)| t.name.as_deref() == Some(p.wgsl))
                    .unwrap_or_else(|| panic!("{}: no WGSL struct {}", f.name, p.wgsl))
                    .1;
                let naga::TypeInner::Struct { members, span } = &ty.inner else {
                    panic!("{} is not a struct", p.wgsl)
                };
                assert_eq!(*span as usize, p.size, "{}: size", p.wgsl);
                let wgsl: Vec<(String, usize)> = members
                    .iter()
                    .map(|m| (m.name.clone().unwrap_or_default(), m.offset as usize))
                    .collect();
                let rust: Vec<(String, usize)> =
                    p.fields.iter().map(|&(n, o)| (n.to_string(), o)).collect();
                assert_eq!(wgsl, rust, "{}: fields and offsets", p.wgsl);
                checked += 1;
            }
        }
        assert!(checked >= 10, "only {checked} parameter structs checked");
    }
}
