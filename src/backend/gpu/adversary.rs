//! Test-only (compiled for the crate's tests and the `test-hooks` feature):
//! an adversarial shader compiler. WGSL lets a driver's compiler contract,
//! regroup, flush subnormals and assume no inf or NaN; the hardened SPIR-V
//! forbids it ([`spirv`](super::spirv)), but a Metal compiler in fast math, a
//! D3D driver or an older Mesa may not listen. This module does to naga's IR
//! of each kernel what such a compiler is allowed to do, before the IR is
//! written to SPIR-V, so the parity tests can show on lavapipe that the
//! kernels' own guards (`sep()`, explicit `fma_c`, integer exponent steps, no
//! constant infinities) keep the bits without any help from the driver:
//!
//! * [`Adversary::Contract`]: every float product feeding an add or a
//!   subtract directly becomes one fused multiply-add — Mesa's NIR and DXC
//!   contract `a*b + c` unless told not to, and Metal's fast math does.
//!   The fused operation is the prelude's exact `fma_soft` (lavapipe's own
//!   `fma` is not fused, so it would change nothing there);
//! * [`Adversary::Regroup`]: sums and products re-associated,
//!   `(a+b)+c → a+(b+c)`, `a+(b+c) → (a+b)+c`, the same for `*`, and pairs of
//!   constants folded (`(x+c1)-c2 → x+(c1-c2)`) — fast math's reassociation;
//! * [`Adversary::Flush`]: subnormals flushed to a zero of the same sign on
//!   the input and the output of every float arithmetic operation and
//!   comparison, as Direct3D mandates and Mesa's AMD and Intel drivers do by
//!   default. Loads, stores, `select` and `bitcast` move bits as they are
//!   (as on every GPU): a loaded value is flushed where arithmetic first
//!   reads it. The start-up probe runs through it too, so it is what
//!   `ArithFindings::subnormals_kept` sees;
//! * [`Adversary::Fold`]: arithmetic on a constant inf or NaN folded as a
//!   compiler that assumes there are none may (`x - inf → x`,
//!   `-inf - m → -m`, `max(x, -inf) → x`, a comparison with a constant NaN
//!   false, with an infinity as if the other side were finite, `x != x`
//!   false) — Metal's fast math, LLVM's `nnan ninf`.
//!
//! Chosen for a process with `TINYLLM_GPU_ADVERSARY=contract|regroup|flush|fold`
//! (read once; the context's pipelines and its start-up probe are
//! process-wide), on the Vulkan path (hardened SPIR-V) only. A build without
//! the hooks has none of this.

use crate::{Error, Result};
use naga::{
    Arena, BinaryOperator as B, Block, Expression as E, Handle, Literal, MathFunction as M, ScalarKind, Span,
    Statement as S, TypeInner,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// One kind of rewrite (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Adversary {
    Contract,
    Regroup,
    Flush,
    Fold,
}

impl Adversary {
    pub const ALL: [Adversary; 4] = [Adversary::Contract, Adversary::Regroup, Adversary::Flush, Adversary::Fold];

    /// The name `TINYLLM_GPU_ADVERSARY` takes.
    pub fn name(self) -> &'static str {
        match self {
            Adversary::Contract => "contract",
            Adversary::Regroup => "regroup",
            Adversary::Flush => "flush",
            Adversary::Fold => "fold",
        }
    }
}

impl std::str::FromStr for Adversary {
    type Err = Error;
    fn from_str(s: &str) -> Result<Adversary> {
        Adversary::ALL.into_iter().find(|a| a.name() == s.trim()).ok_or_else(|| {
            Error::config(format!("TINYLLM_GPU_ADVERSARY={s:?}: not one of contract, regroup, flush, fold"))
        })
    }
}

/// The variable that chooses the rewrite for the process.
pub const VAR: &str = "TINYLLM_GPU_ADVERSARY";

/// The rewrite this process's kernels get, if any (`TINYLLM_GPU_ADVERSARY`).
pub fn active() -> Result<Option<Adversary>> {
    static A: OnceLock<std::result::Result<Option<Adversary>, String>> = OnceLock::new();
    A.get_or_init(|| match std::env::var(VAR) {
        Ok(s) if !s.trim().is_empty() => s.parse().map(Some).map_err(|e: Error| e.to_string()),
        _ => Ok(None),
    })
    .clone()
    .map_err(Error::config)
}

/// What a rewrite did to a module.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rewrites {
    /// Operations rewritten.
    pub sites: usize,
    /// Products feeding an add that could not be contracted: in a module
    /// without `fma_soft`, or in a function that cannot call it (naga wants
    /// callees first). None in the shipped kernels, whose prelude helpers
    /// before `fma_soft` are integer code.
    pub skipped: usize,
}

static SITES: AtomicUsize = AtomicUsize::new(0);

/// Operations rewritten in this process so far (a test's proof that its
/// rewrite had something to act on).
pub fn sites() -> usize {
    SITES.load(Ordering::Relaxed)
}

/// The name of the exact fused multiply-add the contraction calls.
const FUSED: &str = "fma_soft";

/// Rewrites every function of `module` (entry points included) with `a`
/// and validates the result; returns its new analysis and what was done.
pub fn rewrite(
    module: &mut naga::Module,
    info: &naga::valid::ModuleInfo,
    a: Adversary,
) -> Result<(naga::valid::ModuleInfo, Rewrites)> {
    let fused = module.functions.iter().find(|(_, f)| f.name.as_deref() == Some(FUSED)).map(|(h, _)| h);
    let consts: HashMap<Handle<naga::Constant>, Literal> = module
        .constants
        .iter()
        .filter_map(|(h, c)| match module.global_expressions[c.init] {
            E::Literal(l) => Some((h, l)),
            _ => None,
        })
        .collect();
    let mut done = Rewrites::default();
    let handles: Vec<Handle<naga::Function>> = module.functions.iter().map(|(h, _)| h).collect();
    for h in handles {
        // the fused operation itself and whatever precedes it (its helpers,
        // integer code) may not call it
        let callable = match fused {
            Some(f) => f < h,
            None => false,
        };
        if a == Adversary::Contract && Some(h) == fused {
            continue;
        }
        let mut f = module.functions[h].clone();
        let d = rewrite_function(&consts, &mut module.types, &mut f, &info[h], a, fused.filter(|_| callable))?;
        module.functions[h] = f;
        done.sites += d.sites;
        done.skipped += d.skipped;
    }
    for i in 0..module.entry_points.len() {
        let mut f = module.entry_points[i].function.clone();
        let d = rewrite_function(&consts, &mut module.types, &mut f, info.get_entry_point(i), a, fused)?;
        module.entry_points[i].function = f;
        done.sites += d.sites;
        done.skipped += d.skipped;
    }
    let mut validator = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::default());
    let info = validator
        .validate(module)
        .map_err(|e| Error::internal(format!("the {} rewrite made an invalid module: {e:?}", a.name())))?;
    SITES.fetch_add(done.sites, Ordering::Relaxed);
    Ok((info, done))
}

/// What replaces an emitted expression: more expressions evaluated in
/// order, or a call to the fused multiply-add.
enum Item {
    Emit(Handle<E>),
    Call { function: Handle<naga::Function>, arguments: Vec<Handle<E>>, result: Handle<E> },
}

/// A function's expressions rebuilt in a new arena: every old expression is
/// copied (its operands mapped) or replaced by what a rule builds, in the
/// same order, so operands always precede their users.
struct Builder {
    new: Arena<E>,
    map: Vec<Handle<E>>,
    cur: Vec<Item>,
    span: Span,
}

impl Builder {
    fn m(&self, old: Handle<E>) -> Handle<E> {
        self.map[old.index()]
    }
    /// An expression evaluated here (emitted).
    fn emit(&mut self, e: E) -> Handle<E> {
        let h = self.new.append(e, self.span);
        self.cur.push(Item::Emit(h));
        h
    }
    /// A literal (needs no emission).
    fn lit(&mut self, l: Literal) -> Handle<E> {
        self.new.append(E::Literal(l), self.span)
    }
    fn call(&mut self, function: Handle<naga::Function>, arguments: Vec<Handle<E>>) -> Handle<E> {
        let result = self.new.append(E::CallResult(function), self.span);
        self.cur.push(Item::Call { function, arguments, result });
        result
    }
    /// A splat of a u32 literal to `size`, or the literal itself.
    fn u32s(&mut self, v: u32, size: Option<naga::VectorSize>) -> Handle<E> {
        let l = self.lit(Literal::U32(v));
        match size {
            Some(size) => self.emit(E::Splat { size, value: l }),
            None => l,
        }
    }
    /// `x` (new, f32 or a vector of them) with subnormals flushed to a zero
    /// of the same sign: integer operations on its bits.
    fn ftz(&mut self, x: Handle<E>, size: Option<naga::VectorSize>) -> Handle<E> {
        let bits = self.emit(E::As { expr: x, kind: ScalarKind::Uint, convert: None });
        let exp_mask = self.u32s(0x7f80_0000, size);
        let exp = self.emit(E::Binary { op: B::And, left: bits, right: exp_mask });
        let zero = self.u32s(0, size);
        let tiny = self.emit(E::Binary { op: B::Equal, left: exp, right: zero });
        let sign_mask = self.u32s(0x8000_0000, size);
        let sign = self.emit(E::Binary { op: B::And, left: bits, right: sign_mask });
        let sel = self.emit(E::Select { condition: tiny, accept: sign, reject: bits });
        self.emit(E::As { expr: sel, kind: ScalarKind::Float, convert: None })
    }
}

/// The old expression `e` with its operands mapped by `m`.
fn remap(e: &E, m: &dyn Fn(Handle<E>) -> Handle<E>) -> Result<E> {
    let o = |h: &Option<Handle<E>>| h.map(m);
    Ok(match *e {
        E::Literal(_)
        | E::Constant(_)
        | E::Override(_)
        | E::ZeroValue(_)
        | E::FunctionArgument(_)
        | E::GlobalVariable(_)
        | E::LocalVariable(_)
        | E::CallResult(_)
        | E::AtomicResult { .. }
        | E::WorkGroupUniformLoadResult { .. }
        | E::SubgroupBallotResult
        | E::SubgroupOperationResult { .. }
        | E::RayQueryProceedResult => e.clone(),
        E::Compose { ty, ref components } => E::Compose { ty, components: components.iter().map(|&c| m(c)).collect() },
        E::Access { base, index } => E::Access { base: m(base), index: m(index) },
        E::AccessIndex { base, index } => E::AccessIndex { base: m(base), index },
        E::Splat { size, value } => E::Splat { size, value: m(value) },
        E::Swizzle { size, vector, pattern } => E::Swizzle { size, vector: m(vector), pattern },
        E::Load { pointer } => E::Load { pointer: m(pointer) },
        E::Unary { op, expr } => E::Unary { op, expr: m(expr) },
        E::Binary { op, left, right } => E::Binary { op, left: m(left), right: m(right) },
        E::Select { condition, accept, reject } => E::Select { condition: m(condition), accept: m(accept), reject: m(reject) },
        E::Derivative { axis, ctrl, expr } => E::Derivative { axis, ctrl, expr: m(expr) },
        E::Relational { fun, argument } => E::Relational { fun, argument: m(argument) },
        E::Math { fun, arg, arg1, arg2, arg3 } => E::Math { fun, arg: m(arg), arg1: o(&arg1), arg2: o(&arg2), arg3: o(&arg3) },
        E::As { expr, kind, convert } => E::As { expr: m(expr), kind, convert },
        E::ArrayLength(a) => E::ArrayLength(m(a)),
        ref other => return Err(Error::internal(format!("the adversarial rewrite does not know {other:?}"))),
    })
}

/// The old statements of `block` with their expressions mapped, each old
/// `Emit` replaced by what its expressions became.
fn remap_block(block: &Block, m: &dyn Fn(Handle<E>) -> Handle<E>, items: &mut [Vec<Item>]) -> Result<Block> {
    let mut out = Block::new();
    for (st, span) in block.span_iter() {
        let span = *span;
        let o = |h: &Option<Handle<E>>| h.map(m);
        let st = match *st {
            S::Emit(ref range) => {
                // runs of consecutive new handles, calls between them
                let mut run: Option<(Handle<E>, Handle<E>)> = None;
                let flush = |run: &mut Option<(Handle<E>, Handle<E>)>, out: &mut Block| {
                    if let Some((a, b)) = run.take() {
                        out.push(S::Emit(naga::Range::new_from_bounds(a, b)), span);
                    }
                };
                for h in range.clone() {
                    for item in std::mem::take(&mut items[h.index()]) {
                        match item {
                            Item::Emit(x) => match run {
                                Some((a, b)) if b.index() + 1 == x.index() => run = Some((a, x)),
                                _ => {
                                    flush(&mut run, &mut out);
                                    run = Some((x, x));
                                }
                            },
                            Item::Call { function, arguments, result } => {
                                flush(&mut run, &mut out);
                                out.push(S::Call { function, arguments, result: Some(result) }, span);
                            }
                        }
                    }
                }
                flush(&mut run, &mut out);
                continue;
            }
            S::Block(ref b) => S::Block(remap_block(b, m, items)?),
            S::If { condition, ref accept, ref reject } => S::If {
                condition: m(condition),
                accept: remap_block(accept, m, items)?,
                reject: remap_block(reject, m, items)?,
            },
            S::Switch { selector, ref cases } => S::Switch {
                selector: m(selector),
                cases: cases
                    .iter()
                    .map(|c| {
                        Ok(naga::SwitchCase { value: c.value, body: remap_block(&c.body, m, items)?, fall_through: c.fall_through })
                    })
                    .collect::<Result<_>>()?,
            },
            S::Loop { ref body, ref continuing, break_if } => S::Loop {
                body: remap_block(body, m, items)?,
                continuing: remap_block(continuing, m, items)?,
                break_if: o(&break_if),
            },
            S::Break | S::Continue | S::Kill | S::ControlBarrier(_) | S::MemoryBarrier(_) => st.clone(),
            S::Return { value } => S::Return { value: o(&value) },
            S::Store { pointer, value } => S::Store { pointer: m(pointer), value: m(value) },
            S::Atomic { pointer, fun, value, result } => S::Atomic {
                pointer: m(pointer),
                fun: match fun {
                    naga::AtomicFunction::Exchange { compare } => naga::AtomicFunction::Exchange { compare: o(&compare) },
                    f => f,
                },
                value: m(value),
                result: o(&result),
            },
            S::WorkGroupUniformLoad { pointer, result } => S::WorkGroupUniformLoad { pointer: m(pointer), result: m(result) },
            S::Call { function, ref arguments, result } => {
                S::Call { function, arguments: arguments.iter().map(|&a| m(a)).collect(), result: o(&result) }
            }
            ref other => return Err(Error::internal(format!("the adversarial rewrite does not know {other:?}"))),
        };
        out.push(st, span);
    }
    Ok(out)
}

/// The old expressions of `block` that some `Emit` evaluates.
fn emitted(block: &Block, out: &mut Vec<bool>) {
    for st in block.iter() {
        match st {
            S::Emit(r) => r.clone().for_each(|h| out[h.index()] = true),
            S::Block(b) => emitted(b, out),
            S::If { accept, reject, .. } => {
                emitted(accept, out);
                emitted(reject, out);
            }
            S::Switch { cases, .. } => cases.iter().for_each(|c| emitted(&c.body, out)),
            S::Loop { body, continuing, .. } => {
                emitted(body, out);
                emitted(continuing, out);
            }
            _ => {}
        }
    }
}

/// What a rule sees of the old function.
struct Old<'a> {
    exprs: &'a Arena<E>,
    info: &'a naga::valid::FunctionInfo,
    types: &'a naga::UniqueArena<naga::Type>,
    /// The literal values of the module's constants.
    consts: &'a HashMap<Handle<naga::Constant>, Literal>,
}

impl Old<'_> {
    fn inner(&self, h: Handle<E>) -> &TypeInner {
        self.info[h].ty.inner_with(self.types)
    }
    /// `Some(size)` for an f32 vector, `Some(None)` for an f32, else `None`.
    fn f32_shape(&self, h: Handle<E>) -> Option<Option<naga::VectorSize>> {
        match *self.inner(h) {
            TypeInner::Scalar(naga::Scalar::F32) => Some(None),
            TypeInner::Vector { size, scalar: naga::Scalar::F32 } => Some(Some(size)),
            _ => None,
        }
    }
    /// The value of a constant f32 operand: a literal, a named constant, or
    /// the bitcast of an integer one.
    fn constant(&self, h: Handle<E>) -> Option<f32> {
        let lit = |l: Literal| match l {
            Literal::F32(v) => Some(v),
            _ => None,
        };
        let bits = |l: Literal| match l {
            Literal::U32(b) => Some(f32::from_bits(b)),
            Literal::I32(i) => Some(f32::from_bits(i as u32)),
            _ => None,
        };
        match self.exprs[h] {
            E::Literal(l) => lit(l),
            E::Constant(c) => self.consts.get(&c).copied().and_then(lit),
            E::As { expr, kind: ScalarKind::Float, convert: None } => match self.exprs[expr] {
                E::Literal(l) => bits(l),
                E::Constant(c) => self.consts.get(&c).copied().and_then(bits),
                _ => None,
            },
            _ => None,
        }
    }
}

fn rewrite_function(
    consts: &HashMap<Handle<naga::Constant>, Literal>,
    types: &mut naga::UniqueArena<naga::Type>,
    f: &mut naga::Function,
    info: &naga::valid::FunctionInfo,
    a: Adversary,
    fused: Option<Handle<naga::Function>>,
) -> Result<Rewrites> {
    let n = f.expressions.len();
    let mut is_emitted = vec![false; n];
    emitted(&f.body, &mut is_emitted);
    let type_snapshot = types.clone();
    let old = Old { exprs: &f.expressions, info, types: &type_snapshot, consts };
    let mut b = Builder { new: Arena::new(), map: Vec::with_capacity(n), cur: Vec::new(), span: Span::UNDEFINED };
    let mut items: Vec<Vec<Item>> = Vec::with_capacity(n);
    // old expressions whose new value is already flushed (Flush)
    let mut flushed = vec![false; n];
    let mut done = Rewrites::default();
    for (h, e) in f.expressions.iter() {
        b.span = f.expressions.get_span(h);
        let mut new = None;
        if is_emitted[h.index()] {
            new = match a {
                Adversary::Contract => contract(&mut b, &old, h, fused, types, &mut done)?,
                Adversary::Regroup => regroup(&mut b, &old, h),
                Adversary::Flush => flush(&mut b, &old, h, &mut flushed),
                Adversary::Fold => fold(&mut b, &old, h),
            };
        }
        let new = match new {
            Some(x) => {
                done.sites += 1;
                x
            }
            None => {
                let map = &b.map;
                let copy = remap(e, &|o| map[o.index()])?;
                if is_emitted[h.index()] {
                    b.emit(copy)
                } else {
                    b.new.append(copy, b.span)
                }
            }
        };
        b.map.push(new);
        items.push(std::mem::take(&mut b.cur));
    }
    let map = std::mem::take(&mut b.map);
    let m = |o: Handle<E>| map[o.index()];
    let body = remap_block(&f.body, &m, &mut items)?;
    for (_, v) in f.local_variables.iter_mut() {
        v.init = v.init.map(m);
    }
    f.named_expressions = std::mem::take(&mut f.named_expressions).into_iter().map(|(h, s)| (m(h), s)).collect();
    f.expressions = b.new;
    f.body = body;
    Ok(done)
}

/// `a*b ± c` and `c ± a*b` (f32 or f32 vectors) as one exact fused
/// multiply-add: `fma(a, b, ±c)`, `fma(±a, b, c)`.
fn contract(
    b: &mut Builder,
    old: &Old,
    h: Handle<E>,
    fused: Option<Handle<naga::Function>>,
    types: &mut naga::UniqueArena<naga::Type>,
    done: &mut Rewrites,
) -> Result<Option<Handle<E>>> {
    let E::Binary { op: op @ (B::Add | B::Subtract), left, right } = old.exprs[h] else { return Ok(None) };
    let Some(shape) = old.f32_shape(h) else { return Ok(None) };
    let product = |x: Handle<E>| match old.exprs[x] {
        E::Binary { op: B::Multiply, left, right } if old.f32_shape(left).is_some() && old.f32_shape(right).is_some() => {
            Some((left, right))
        }
        _ => None,
    };
    // the left product first, as a compiler folding left to right would
    let (pa, pb, c, negate_c, negate_a) = match (product(left), product(right)) {
        (Some((pa, pb)), _) => (pa, pb, right, op == B::Subtract, false),
        (None, Some((pa, pb))) => (pa, pb, left, false, op == B::Subtract),
        _ => return Ok(None),
    };
    let Some(fused) = fused else {
        done.skipped += 1;
        return Ok(None);
    };
    let neg = |b: &mut Builder, x: Handle<E>, yes: bool| if yes { b.emit(E::Unary { op: naga::UnaryOperator::Negate, expr: x }) } else { x };
    let (na, nb, nc) = (b.m(pa), b.m(pb), b.m(c));
    let na = neg(b, na, negate_a);
    let nc = neg(b, nc, negate_c);
    let Some(size) = shape else {
        return Ok(Some(b.call(fused, vec![na, nb, nc])));
    };
    // a vector: one fused operation per component (a scalar operand is
    // every component's)
    let comps = size as u32;
    let mut parts = Vec::new();
    for i in 0..comps {
        let comp = |b: &mut Builder, x: Handle<E>, old_x: Handle<E>| {
            if old.f32_shape(old_x) == Some(None) {
                x
            } else {
                b.emit(E::AccessIndex { base: x, index: i })
            }
        };
        let ai = comp(b, na, pa);
        let bi = comp(b, nb, pb);
        let ci = comp(b, nc, c);
        parts.push(b.call(fused, vec![ai, bi, ci]));
    }
    let ty = types.insert(
        naga::Type { name: None, inner: TypeInner::Vector { size, scalar: naga::Scalar::F32 } },
        Span::UNDEFINED,
    );
    Ok(Some(b.emit(E::Compose { ty, components: parts })))
}

/// `(a+b)+c → a+(b+c)`, `a+(b+c) → (a+b)+c`, the same for `*`, all three
/// operands of the result's type; a pair of constants folded on the host
/// (`(x ± c1) ± c2 → x ± (c1 ∘ c2)`), as fast math regroups.
fn regroup(b: &mut Builder, old: &Old, h: Handle<E>) -> Option<Handle<E>> {
    let E::Binary { op, left, right } = old.exprs[h] else { return None };
    let shape = old.f32_shape(h)?;
    let same = |x: Handle<E>| old.f32_shape(x) == Some(shape);
    let inner = |x: Handle<E>| match old.exprs[x] {
        E::Binary { op, left, right } if same(x) && same(left) && same(right) => Some((op, left, right)),
        _ => None,
    };
    // constants: (x ± c1) ± c2 and (x * c1) * c2, the constants folded
    if shape.is_none() {
        if let (Some(c2), Some((iop, x, c1))) = (old.constant(right), inner(left)) {
            if let Some(c1) = old.constant(c1) {
                let folded = match (iop, op) {
                    (B::Add, B::Add) | (B::Subtract, B::Subtract) => Some((iop, c1 + c2)),
                    (B::Add, B::Subtract) => Some((B::Add, c1 - c2)),
                    (B::Subtract, B::Add) => Some((B::Subtract, c1 - c2)),
                    (B::Multiply, B::Multiply) => Some((B::Multiply, c1 * c2)),
                    _ => None,
                };
                if let Some((nop, c)) = folded {
                    let x = b.m(x);
                    let c = b.lit(Literal::F32(c));
                    return Some(b.emit(E::Binary { op: nop, left: x, right: c }));
                }
            }
        }
    }
    if !matches!(op, B::Add | B::Multiply) || !same(left) || !same(right) {
        return None;
    }
    if let Some((_, x, y)) = inner(left).filter(|&(iop, _, _)| iop == op) {
        let (x, y, z) = (b.m(x), b.m(y), b.m(right));
        let yz = b.emit(E::Binary { op, left: y, right: z });
        return Some(b.emit(E::Binary { op, left: x, right: yz }));
    }
    if let Some((_, y, z)) = inner(right).filter(|&(iop, _, _)| iop == op) {
        let (x, y, z) = (b.m(left), b.m(y), b.m(z));
        let xy = b.emit(E::Binary { op, left: x, right: y });
        return Some(b.emit(E::Binary { op, left: xy, right: z }));
    }
    None
}

/// Float arithmetic and comparisons with their f32 inputs and results
/// flushed (see the module docs); `flushed` marks the old expressions whose
/// new value needs no flushing again.
fn flush(b: &mut Builder, old: &Old, h: Handle<E>, flushed: &mut [bool]) -> Option<Handle<E>> {
    let arith = |o: B| matches!(o, B::Add | B::Subtract | B::Multiply | B::Divide | B::Modulo);
    let compare = |o: B| matches!(o, B::Less | B::LessEqual | B::Greater | B::GreaterEqual | B::Equal | B::NotEqual);
    let operands: Vec<Handle<E>> = match old.exprs[h] {
        E::Binary { op, left, right } if arith(op) || compare(op) => vec![left, right],
        E::Unary { op: naga::UnaryOperator::Negate, expr } => vec![expr],
        E::Math { arg, arg1, arg2, arg3, .. } => [Some(arg), arg1, arg2, arg3].into_iter().flatten().collect(),
        _ => return None,
    };
    let result = old.f32_shape(h);
    if result.is_none() && !operands.iter().any(|&o| old.f32_shape(o).is_some()) {
        return None;
    }
    let mut new_ops = Vec::new();
    for &o in &operands {
        let x = b.m(o);
        new_ops.push(match old.f32_shape(o) {
            Some(_) if flushed[o.index()] => x,
            Some(_) if old.constant(o).is_some_and(|v| v == 0.0 || v.abs() >= f32::MIN_POSITIVE || !v.is_finite()) => x,
            Some(size) => b.ftz(x, size),
            None => x,
        });
    }
    let at = |i: usize| new_ops[i];
    let op = match old.exprs[h] {
        E::Binary { op, .. } => E::Binary { op, left: at(0), right: at(1) },
        E::Unary { op, .. } => E::Unary { op, expr: at(0) },
        E::Math { fun, .. } => E::Math {
            fun,
            arg: at(0),
            arg1: new_ops.get(1).copied(),
            arg2: new_ops.get(2).copied(),
            arg3: new_ops.get(3).copied(),
        },
        _ => unreachable!(),
    };
    let x = b.emit(op);
    Some(match result {
        Some(size) => {
            flushed[h.index()] = true;
            b.ftz(x, size)
        }
        None => x,
    })
}

/// Arithmetic on a constant inf or NaN, and NaN tests, folded as a compiler
/// that assumes neither occurs may fold them (see the module docs).
fn fold(b: &mut Builder, old: &Old, h: Handle<E>) -> Option<Handle<E>> {
    let special = |x: Handle<E>| old.constant(x).filter(|v| !v.is_finite());
    match old.exprs[h] {
        E::Binary { op, left, right } if old.f32_shape(left) == Some(None) && old.f32_shape(right) == Some(None) => {
            let (l, r) = (special(left), special(right));
            match op {
                B::Add | B::Subtract | B::Multiply | B::Divide | B::Modulo => match (l, r) {
                    // the constant assumed away: the other operand
                    (None, Some(_)) => Some(b.m(left)),
                    (Some(_), None) if op == B::Subtract => {
                        let x = b.m(right);
                        Some(b.emit(E::Unary { op: naga::UnaryOperator::Negate, expr: x }))
                    }
                    (Some(_), None) => Some(b.m(right)),
                    _ => None,
                },
                B::Less | B::LessEqual | B::Greater | B::GreaterEqual | B::Equal | B::NotEqual => {
                    if left == right {
                        // x == x: true, x != x: false, with no NaN
                        let v = matches!(op, B::Equal | B::LessEqual | B::GreaterEqual);
                        return Some(b.lit(Literal::Bool(v)));
                    }
                    // `x op c` with the constant on the right
                    let (c, op) = match (l, r) {
                        (None, Some(c)) => (c, op),
                        (Some(c), None) => (
                            c,
                            match op {
                                B::Less => B::Greater,
                                B::LessEqual => B::GreaterEqual,
                                B::Greater => B::Less,
                                B::GreaterEqual => B::LessEqual,
                                o => o,
                            },
                        ),
                        _ => return None,
                    };
                    let v = if c.is_nan() {
                        false
                    } else {
                        // x finite: below +inf, above -inf
                        let below = c > 0.0;
                        match op {
                            B::Less | B::LessEqual => below,
                            B::Greater | B::GreaterEqual => !below,
                            B::Equal => false,
                            _ => true,
                        }
                    };
                    Some(b.lit(Literal::Bool(v)))
                }
                _ => None,
            }
        }
        E::Math { fun: M::Max | M::Min, arg, arg1: Some(arg1), .. } if old.f32_shape(h) == Some(None) => {
            match (special(arg), special(arg1)) {
                (None, Some(_)) => Some(b.m(arg)),
                (Some(_), None) => Some(b.m(arg1)),
                _ => None,
            }
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::pipelines::compose;
    use crate::backend::gpu::spirv::{lower, write};

    /// `entry` of `src` rewritten by `a`: the SPIR-V words and what was done.
    fn rewritten(src: &str, entry: &str, a: Adversary) -> (Vec<u32>, Rewrites) {
        let mut l = lower(src, entry, &[], "SPIR-V").unwrap_or_else(|e| panic!("{entry}: {e}"));
        let (info, done) = rewrite(&mut l.module, &l.info, a).unwrap_or_else(|e| panic!("{entry}: {e}"));
        (write(&l.module, &info, entry).unwrap_or_else(|e| panic!("{entry}: {e}")), done)
    }

    const SAMPLE: &str = "
        @group(0) @binding(0) var<storage, read_write> y: array<f32>;
        @group(0) @binding(1) var<storage, read> z: u32;
        fn sep(p: f32, zero: u32) -> f32 { return bitcast<f32>(bitcast<u32>(p) | zero); }
        fn fma_soft(a: f32, b: f32, c: f32) -> f32 { return fma(a, b, c); }
        @compute @workgroup_size(1)
        fn k() {
            y[0] = y[1] * y[2] + y[3];
            y[4] = sep(y[1] * y[2], z) + y[3];
            y[5] = (y[1] + y[2]) + y[3];
            y[6] = (y[1] + 0.5) - 0.25;
            y[7] = y[1] - bitcast<f32>(0x7f800000u);
            let t = y[1];
            y[8] = select(0.0, 1.0, t != t);
            let v = vec4<f32>(y[1], y[2], y[3], y[4]);
            let w = v * y[5] + v;
            y[9] = w.x;
        }";

    /// Each rewrite finds what it is for in a sample and nothing behind
    /// `sep()`; the module it makes validates and writes.
    #[test]
    fn each_rewrite_finds_its_patterns() {
        let count = |a| rewritten(SAMPLE, "k", a).1;
        // y[0]'s product and the vector's (sep hides y[4]'s)
        assert_eq!(count(Adversary::Contract), Rewrites { sites: 2, skipped: 0 });
        // (y1+y2)+y3 and the two constants
        assert_eq!(count(Adversary::Regroup).sites, 2);
        // x - inf and x != x
        assert_eq!(count(Adversary::Fold).sites, 2);
        // every float operation and comparison (the constant ones too)
        assert!(count(Adversary::Flush).sites >= 9, "{:?}", count(Adversary::Flush));
    }

    /// Every kernel of every family, for both fma variants, rewritten by each
    /// adversary, is a module naga validates and writes to SPIR-V; `spirv-val`
    /// accepts it where installed (required with `TINYLLM_REQUIRE_SPIRV_VAL=1`).
    /// Contraction reaches every site it finds (none is in a function that
    /// cannot call the fused operation).
    #[test]
    fn every_kernel_rewrites_to_valid_spirv() {
        let have = std::process::Command::new("spirv-val").arg("--version").output().is_ok();
        assert!(
            have || std::env::var("TINYLLM_REQUIRE_SPIRV_VAL").as_deref() != Ok("1"),
            "spirv-val is required (TINYLLM_REQUIRE_SPIRV_VAL=1) but not installed"
        );
        let dir = std::env::temp_dir().join(format!("tinyllm-adversary-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for a in Adversary::ALL {
            let mut total = Rewrites::default();
            for f in crate::backend::gpu_families() {
                for native in [false, true] {
                    let src = compose(f, native);
                    for e in f.entries {
                        let (words, done) = rewritten(&src, e, a);
                        total.sites += done.sites;
                        if done.sites > 0 && !native && a != Adversary::Flush {
                            eprintln!("{}: {}::{e}: {done:?}", a.name(), f.name);
                        }
                        total.skipped += done.skipped;
                        if have && !native {
                            let path = dir.join("k.spv");
                            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                            std::fs::write(&path, bytes).unwrap();
                            let o = std::process::Command::new("spirv-val")
                                .args(["--target-env", "vulkan1.1"])
                                .arg(&path)
                                .output()
                                .unwrap();
                            assert!(o.status.success(), "{} {}::{e}: {}", a.name(), f.name, String::from_utf8_lossy(&o.stderr));
                        }
                    }
                }
            }
            eprintln!("{}: {total:?}", a.name());
            assert_eq!(total.skipped, 0, "{}", a.name());
            if a != Adversary::Fold {
                assert!(total.sites > 0, "{}: nothing rewritten", a.name());
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn names_parse() {
        for a in Adversary::ALL {
            assert_eq!(a.name().parse::<Adversary>().unwrap(), a);
        }
        assert!("fast".parse::<Adversary>().is_err());
    }
}
