//! Every shader, composed exactly as the GPU backend composes it (math library
//! prepended where needed), parses as WGSL and passes naga's validator, and
//! declares the entry points the backend asks for. No GPU needed.

use tinyllm::backend::gpu::shader_sources;

#[test]
fn every_composed_shader_parses_and_validates() {
    let sources = shader_sources();
    assert!(!sources.is_empty());
    for (name, src, entries) in sources {
        let module = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{name}.wgsl: {}", e.emit_to_string(&src)));
        let mut v = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::default(),
        );
        if let Err(e) = v.validate(&module) {
            panic!("{name}.wgsl fails validation: {}", e.emit_to_string(&src));
        }
        for e in entries {
            assert!(
                module.entry_points.iter().any(|ep| ep.name == e),
                "{name}.wgsl has no entry point {e}"
            );
        }
    }
}

#[test]
fn every_shader_file_is_used() {
    // A file in shaders/ that the backend never composes would go unvalidated.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let used: Vec<String> = shader_sources()
        .iter()
        .map(|(n, _, _)| format!("{}.wgsl", n.split(' ').next().unwrap()))
        .chain(["mathlib.wgsl".into(), "cast.wgsl".into(), "fma.wgsl".into()])
        .collect();
    for f in std::fs::read_dir(dir).unwrap() {
        let f = f.unwrap().file_name().into_string().unwrap();
        if f.ends_with(".wgsl") {
            assert!(used.contains(&f), "shaders/{f} is not part of any kernel");
        }
    }
}
