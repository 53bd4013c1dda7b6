//! The MSL (Metal) and HLSL (DX12) the backend writes for every shipped
//! kernel, checked as text. No Metal or DX12 device runs them in this suite:
//! what is held here is what a reader of the text can hold it to — the
//! contract's guards present, the bindings where wgpu-hal's layout puts
//! them — and a committed snapshot of two kernels, so a change of the
//! generated code (a naga update, a kernel edit) shows up in review.
//!
//! `TINYLLM_BLESS=1 cargo test --release --test shader_text` rewrites the
//! snapshots in `tests/snapshots/`; review their diff before committing it.
#![cfg(feature = "gpu")]

use tinyllm::backend::gpu::spirv::Binding;
use tinyllm::backend::gpu::{hlsl, msl, pipelines::compose};
use tinyllm::backend::gpu_families;

/// Every entry point of every family, as the context composes it: for MSL
/// with either `fma_c` (the start-up probe chooses on Metal), for HLSL with
/// the integer emulation only (the context never composes HLSL otherwise).
fn every_kernel(natives: &[bool]) -> Vec<(String, String, &'static str)> {
    let mut out = Vec::new();
    for f in gpu_families() {
        for &native in natives {
            let src = compose(f, native);
            for e in f.entries {
                out.push((
                    format!("{}::{e} (native fma {native})", f.name),
                    src.clone(),
                    *e,
                ));
            }
        }
    }
    out
}

/// The Metal buffer index, address space and constness of each `[[buffer(i)]]`
/// argument of the kernel's signature.
fn msl_buffers(text: &str) -> Vec<(usize, bool, bool)> {
    let mut v: Vec<(usize, bool, bool)> = text
        .lines()
        .filter_map(|l| {
            let (arg, rest) = l.split_once("[[buffer(")?;
            let slot = rest.split(')').next()?.parse().ok()?;
            let arg = arg.trim_start_matches([',', ' ']);
            Some((slot, arg.starts_with("constant "), arg.contains(" const&")))
        })
        .collect();
    v.sort();
    v
}

#[test]
fn msl_asks_for_safe_math_and_binds_as_the_layout() {
    let mut n = 0;
    for (label, src, entry) in every_kernel(&[false, true]) {
        let m = msl::compile(&src, entry, &[]).unwrap_or_else(|e| panic!("{label}: {e}"));
        let t = &m.source;
        // the guard and the pragmas come before anything naga writes
        assert!(t.starts_with(msl::PRELUDE), "{label}: no prelude");
        // each a line of its own before the first include (the #error's
        // message names the pragma too: a substring would not do)
        let head: Vec<&str> = t
            .lines()
            .take_while(|l| !l.starts_with("#include"))
            .collect();
        for p in [
            "#pragma METAL fp math_mode(safe)",
            "#pragma METAL fp contract(off)",
            "#if __METAL_VERSION__ < 320",
        ] {
            assert!(head.contains(&p), "{label}: {p} missing or late");
        }
        assert!(
            !t.contains("fast::") && !t.contains("math_mode(fast)"),
            "{label}: fast math asked for"
        );
        // wgpu's passthrough binds buffers 0, 1, ... in binding order and
        // nothing else: no buffer-size table, no threadgroup arguments. A
        // kernel leaves out a buffer that only the arms its constants
        // pruned read; the others keep their slots.
        let want: Vec<(usize, bool, bool)> = m
            .bindings
            .iter()
            .enumerate()
            .map(|(i, b)| (i, b.storage.is_none(), b.storage == Some(true)))
            .collect();
        let got = msl_buffers(t);
        assert!(
            !got.is_empty() && got.iter().all(|b| want.contains(b)),
            "{label}: buffer arguments {got:?}, layout {want:?}"
        );
        assert!(
            !t.contains("_buffer_sizes.") && !t.contains("[[threadgroup("),
            "{label}"
        );
        assert!(
            t.contains(&format!(" kernel void {entry}(")),
            "{label}: entry point renamed"
        );
        n += 1;
    }
    assert!(n >= 50, "only {n} kernels");
    // the start-up check compiles the same prelude
    let g = msl::guard_kernel();
    assert!(
        g.starts_with(msl::PRELUDE) && g.contains(&format!("kernel void {}()", msl::GUARD_ENTRY)),
        "{g}"
    );
}

/// An HLSL register: its kind (`b`, `t`, `u`) and number.
type Register = (char, u32);

/// Each `register(...)` in the text, the special constants apart.
fn hlsl_registers(text: &str) -> (Vec<Register>, Option<Register>) {
    let mut regs = Vec::new();
    let mut special = None;
    for l in text.lines() {
        let Some((decl, rest)) = l.split_once("register(") else {
            continue;
        };
        let kind = rest.chars().next().unwrap();
        let num: u32 = rest[1..].split(')').next().unwrap().parse().unwrap();
        assert!(
            !rest.contains("space") || rest.contains("space0"),
            "a register space other than 0: {l}"
        );
        if decl.contains("_NagaConstants") {
            special = Some((kind, num));
        } else {
            regs.push((kind, num));
        }
    }
    regs.sort();
    (regs, special)
}

#[test]
fn hlsl_makes_every_float_operation_precise_and_binds_as_the_layout() {
    let mut n = 0;
    for (label, src, entry) in every_kernel(&[false]) {
        let h = hlsl::compile(&src, entry, &[]).unwrap_or_else(|e| panic!("{label}: {e}"));
        let t = &h.source;
        hlsl::check(t).unwrap_or_else(|e| panic!("{label}: {e}"));
        // every named float operation has its own precise local
        let named = t
            .lines()
            .filter(|l| {
                let d = l.trim_start().strip_prefix("precise ").unwrap_or("");
                let d = d.strip_prefix("const ").unwrap_or(d);
                d.split(' ')
                    .nth(1)
                    .is_some_and(|name| name.starts_with("fop"))
            })
            .count();
        assert_eq!(
            named, h.named,
            "{label}: float operations named vs. precise locals"
        );
        assert!(h.precise >= h.named, "{label}");
        let mut want = hlsl::registers(&h.bindings);
        want.sort();
        let (got, special) = hlsl_registers(t);
        assert_eq!(got, want, "{label}: registers");
        let cbvs = want.iter().filter(|r| r.0 == 'b').count() as u32;
        assert_eq!(
            special,
            Some(('b', cbvs)),
            "{label}: num_workgroups' root constants"
        );
        assert!(
            t.contains(&format!("void {entry}(")),
            "{label}: entry point renamed"
        );
        n += 1;
    }
    assert!(n >= 25, "only {n} kernels");
}

/// The checks above can fail: the same text without `precise`, or with a
/// bare `mad`, is refused.
#[test]
fn hlsl_check_refuses_what_naga_writes_alone() {
    let f = gpu_families()[1];
    let h = hlsl::compile(&compose(f, false), f.entries[0], &[]).unwrap();
    assert!(
        h.named > 10 && h.precise > h.named,
        "{} named, {} precise",
        h.named,
        h.precise
    );
    let plain = h.source.replace("precise ", "");
    assert!(hlsl::check(&plain).is_err());
    let bare_mad = format!(
        "{}\nfloat f(float a)\n{{\n    return mad(a, a, a);\n}}\n",
        h.source
    );
    assert!(hlsl::check(&bare_mad).unwrap_err().contains("mad"));
    let (again, n) = hlsl::make_precise(&plain);
    assert_eq!(n, h.precise);
    assert_eq!(again, h.source);
}

/// Workgroup memory (no shipped kernel has it yet) is declared in the kernel
/// body, where Metal sizes it, not passed as an argument wgpu's passthrough
/// would leave unsized.
#[test]
fn msl_workgroup_memory_lives_in_the_kernel() {
    let src = "
@group(0) @binding(0) var<storage, read_write> y: array<f32>;
var<workgroup> tile: array<f32, 64>;
@compute @workgroup_size(64)
fn k(@builtin(local_invocation_index) lane: u32) {
    tile[lane] = y[lane] * 2.0;
    workgroupBarrier();
    y[lane] = tile[63u - lane] + 1.0;
}
";
    let m = msl::compile(src, "k", &[]).unwrap();
    assert!(!m.source.contains("[[threadgroup("), "{}", m.source);
    let body = m.source.split(" kernel void k(").nth(1).unwrap();
    let open = body.find(") {").unwrap();
    assert!(body[open..].contains("threadgroup type_"), "{}", m.source);
    assert_eq!(msl_buffers(&m.source), vec![(0, false, false)]);
}

/// Two kernels' MSL and HLSL, held against the committed text.
#[test]
fn snapshots_of_the_generated_text() {
    let bless = std::env::var("TINYLLM_BLESS").as_deref() == Ok("1");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots");
    let mut stale = Vec::new();
    // one with the math library and rounding, one plain index kernel
    for (family, entry) in [("elementwise", "binary"), ("copy", "gather_rows")] {
        let f = gpu_families()
            .into_iter()
            .find(|f| f.name == family)
            .unwrap();
        let src = compose(f, false);
        let texts = [
            ("metal", msl::compile(&src, entry, &[]).unwrap().source),
            ("hlsl", hlsl::compile(&src, entry, &[]).unwrap().source),
        ];
        for (ext, text) in texts {
            let path = dir.join(format!("{family}_{entry}.{ext}"));
            if bless {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &text).unwrap();
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                stale.push(path.display().to_string());
            }
        }
    }
    assert!(
        stale.is_empty(),
        "the generated text differs from {stale:?}: if the change is meant, rerun with TINYLLM_BLESS=1 and review the diff"
    );
}

#[test]
fn bindings_are_sorted_and_distinct() {
    for (label, src, entry) in every_kernel(&[false]) {
        let b: Vec<Binding> = msl::compile(&src, entry, &[]).unwrap().bindings;
        assert!(b.windows(2).all(|w| w[0].binding < w[1].binding), "{label}");
    }
}
