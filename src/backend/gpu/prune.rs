//! The branches a kernel's pipeline constants decide, taken before any
//! driver sees the kernel.
//!
//! A family's kernels are written once for every format and flag, each
//! choice an `override` constant (`if (FMT == 1u) { .. }`). naga folds each
//! such condition to a boolean literal when it resolves the constants, but
//! keeps both arms, so a driver receives every variant's code in every
//! pipeline and must compile it before it can see what is dead (on
//! lavapipe, most of a pipeline's creation time: docs/benchmarks-log.md).
//! Only code that can never run is removed; what runs is the same IR, so no
//! bit moves (the sweep and the lockstep hold every kernel to the CPU).

use naga::{Block, Expression, Function, Handle, Literal, Module, Statement};

/// Replaces, in every function of `module`, each `if` whose condition is a
/// boolean constant with the arm it takes, then drops what only the other
/// arms used (their expressions, and names of them). Returns how many
/// branches were decided.
pub fn constant_branches(module: &mut Module) -> usize {
    let globals = &module.global_expressions;
    let constants = &module.constants;
    // a condition's value where it is a literal or a named constant
    let known = |f: &Function, h| match f.expressions[h] {
        Expression::Literal(Literal::Bool(b)) => Some(b),
        Expression::Constant(c) => match globals[constants[c].init] {
            Expression::Literal(Literal::Bool(b)) => Some(b),
            _ => None,
        },
        _ => None,
    };
    let functions = module.functions.iter_mut().map(|(_, f)| f);
    let mut taken = 0;
    for f in functions.chain(module.entry_points.iter_mut().map(|ep| &mut ep.function)) {
        let mut body = std::mem::take(&mut f.body);
        let mut dropped = Vec::new();
        taken += block(&mut body, &|h| known(f, h), &mut dropped);
        f.body = body;
        // a name keeps an expression alive; the dropped arms' go with them
        for h in dropped {
            f.named_expressions.shift_remove(&h);
        }
    }
    if taken > 0 {
        naga::compact::compact(module, naga::compact::KeepUnused::Yes);
    }
    taken
}

/// [`constant_branches`] within `b` and the blocks nested in it; the
/// expressions the dropped arms evaluated go to `dropped`.
fn block(b: &mut Block, known: &dyn Fn(Handle<Expression>) -> Option<bool>, dropped: &mut Vec<Handle<Expression>>) -> usize {
    let mut taken = 0;
    for s in b.iter_mut() {
        if let Statement::If { condition, accept, reject } = s {
            if let Some(v) = known(*condition) {
                let (arm, other) = if v { (accept, reject) } else { (reject, accept) };
                evaluated(other, dropped);
                *s = Statement::Block(std::mem::take(arm));
                taken += 1;
            }
        }
        taken += match s {
            Statement::Block(inner) => block(inner, known, dropped),
            Statement::If { accept, reject, .. } => block(accept, known, dropped) + block(reject, known, dropped),
            Statement::Loop { body, continuing, .. } => block(body, known, dropped) + block(continuing, known, dropped),
            Statement::Switch { cases, .. } => cases.iter_mut().map(|c| block(&mut c.body, known, dropped)).sum(),
            _ => 0,
        };
    }
    taken
}

/// The expressions `b` evaluates: its emitted ranges and the results of its
/// statements, nested blocks included.
fn evaluated(b: &Block, out: &mut Vec<Handle<Expression>>) {
    for s in b.iter() {
        match s {
            Statement::Emit(range) => out.extend(range.clone()),
            Statement::Call { result: Some(r), .. } | Statement::Atomic { result: Some(r), .. } => out.push(*r),
            Statement::WorkGroupUniformLoad { result, .. }
            | Statement::SubgroupBallot { result, .. }
            | Statement::SubgroupGather { result, .. }
            | Statement::SubgroupCollectiveOperation { result, .. } => out.push(*result),
            Statement::Block(inner) => evaluated(inner, out),
            Statement::If { accept, reject, .. } => {
                evaluated(accept, out);
                evaluated(reject, out);
            }
            Statement::Loop { body, continuing, .. } => {
                evaluated(body, out);
                evaluated(continuing, out);
            }
            Statement::Switch { cases, .. } => cases.iter().for_each(|c| evaluated(&c.body, out)),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use naga::{Block, Module, Statement};

    /// One branch on a pipeline constant (with a named value in each arm)
    /// and one on a runtime value.
    const SRC: &str = "
        override F: u32 = 0u;
        @group(0) @binding(0) var<storage, read_write> o: array<u32>;
        @compute @workgroup_size(1)
        fn k(@builtin(global_invocation_id) g: vec3<u32>) {
            var x = g.x;
            if F == 1u {
                let y = x * 3u;
                x = y;
            } else {
                let z = x + 2u;
                x = z;
            }
            if x > 5u {
                x = 0u;
            }
            o[0] = x;
        }";

    /// The `if` statements in `b` and the blocks in it.
    fn ifs(b: &Block) -> usize {
        b.iter()
            .map(|s| match s {
                Statement::If { accept, reject, .. } => 1 + ifs(accept) + ifs(reject),
                Statement::Block(inner) => ifs(inner),
                _ => 0,
            })
            .sum()
    }

    /// `SRC` with `F = f`, pruned: the module and how many branches went.
    fn pruned(f: f64) -> (Module, usize) {
        let module = naga::front::wgsl::parse_str(SRC).unwrap();
        let flags = naga::valid::ValidationFlags::all();
        let mut v = naga::valid::Validator::new(flags, naga::valid::Capabilities::default());
        let info = v.validate(&module).unwrap();
        let pc = naga::back::PipelineConstants::from([("F".to_string(), f)]);
        let stage = Some((naga::ShaderStage::Compute, "k"));
        let (m, _) = naga::back::pipeline_constants::process_overrides(&module, &info, stage, &pc).unwrap();
        let mut m = m.into_owned();
        let n = super::constant_branches(&mut m);
        // still a module every backend takes
        v.validate(&m).unwrap();
        (m, n)
    }

    #[test]
    fn the_constant_decides_and_the_runtime_branch_stays() {
        use naga::BinaryOperator::{Add, Multiply};
        for (f, taken, gone, gone_op) in [(1.0, Multiply, "z", Add), (0.0, Add, "y", Multiply)] {
            let (m, n) = pruned(f);
            assert_eq!(n, 1);
            let k = &m.entry_points[0].function;
            assert_eq!(ifs(&k.body), 1, "F = {f}: the runtime branch alone is left");
            let names: Vec<&str> = k.named_expressions.values().map(String::as_str).collect();
            assert!(!names.contains(&gone), "F = {f}: {names:?}");
            // the taken arm's arithmetic is there, the other's is gone
            let has = |want| {
                k.expressions
                    .iter()
                    .any(|(_, e)| matches!(e, naga::Expression::Binary { op, .. } if *op == want))
            };
            assert!(has(taken) && !has(gone_op), "F = {f}");
        }
    }
}
