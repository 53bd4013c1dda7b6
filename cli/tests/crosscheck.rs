//! The cross-check: the primitive trace and its paths, the snapshot a replay
//! starts from, the device probe, and — with the test-only perturbation hook, which
//! flips one bit (one ulp) of one GPU primitive's output — proof that the
//! sweep, the lockstep trace, the command and a training run's
//! `--crosscheck-every` find a real difference and name the primitive and
//! the call. Shapes are the `tiny` preset's (lavapipe is slow).

#[path = "../../tests/common/mod.rs"]
mod common;
use common::tmpdir;

use std::process::Command;
use tinyllm::backend::Family;
use tinyllm::crosscheck::lockstep::{self, LockstepOptions, Snapshot};
use tinyllm::crosscheck::probe::{self, Status};
use tinyllm::crosscheck::sweep;
use tinyllm::crosscheck::trace;
use tinyllm::precision::Precision;
use tinyllm::train::data::Corpus;
use tinyllm::train::{TrainConfig, TrainOptions, Trainer};
use tinyllm::Device;

const BIN: &str = env!("CARGO_BIN_EXE_tinyllm");

fn tiny(precision: &str) -> TrainConfig {
    TrainConfig::resolve(&TrainOptions {
        preset: Some("tiny".into()),
        device: Some(tinyllm::train::DeviceChoice::Cpu),
        precision: Some(precision.parse().unwrap()),
        ..Default::default()
    })
    .unwrap()
}

fn bits(snap: &[(String, Vec<f32>)]) -> Vec<(String, Vec<u32>)> {
    snap.iter()
        .map(|(n, v)| (n.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

// ------------------------------------------------ trace and snapshot ----

/// A step replayed from a snapshot in a fresh trainer gives the bits of the
/// step the original trainer takes from there; tracing it changes nothing.
#[test]
fn a_snapshot_replays_the_next_step_and_tracing_changes_nothing() {
    let corpus = Corpus::embedded();
    let cfg = tiny("fp16");
    let mut a = Trainer::new(cfg.clone(), Device::Cpu, &corpus).unwrap();
    a.train_step().unwrap();
    a.train_step().unwrap();
    let snap = Snapshot::take(&a).unwrap();
    assert_eq!(snap.step(), 2);
    let la = a.train_step().unwrap().loss;
    assert!(!trace::on(), "the trace is off unless started");

    let mut b = snap.trainer(&cfg, Device::Cpu, &corpus).unwrap();
    trace::start(None);
    let lb = b.train_step();
    let t = trace::finish();
    assert_eq!(la.to_bits(), lb.unwrap().loss.to_bits());
    assert_eq!(bits(&a.snapshot().unwrap()), bits(&b.snapshot().unwrap()));
    assert_eq!(a.model().rng.state(), b.model().rng.state());
    assert_eq!(a.data_rng().state(), b.data_rng().state());
    assert_eq!(b.step(), 3);
    // a whole tiny step traced (~230 primitive calls: each of q, k and v,
    // and gate and up, from one shared-input product; the 16-bit copies
    // autograd keeps made by the products and SwiGLU; RoPE inside
    // attention's calls; SwiGLU inside the down product's; each product's
    // two gradients one call)
    assert!(t.calls.len() > 200, "{} calls", t.calls.len());
}

/// Every primitive call of a step is attributed to the layer that issued it,
/// in its phase: the forward pass, the backward pass (at the path of the
/// forward op that recorded the node), the recomputation of checkpointed
/// blocks, and the optimizer.
#[test]
fn the_trace_names_each_call_by_model_path_and_phase() {
    let corpus = Corpus::embedded();
    let cfg = tiny("bf16");
    let mut t = Trainer::new(cfg, Device::Cpu, &corpus).unwrap();
    trace::start(None);
    let r = t.train_step();
    let tr = trace::finish();
    r.unwrap();
    let has = |phase: &str, site: &str| {
        tr.calls
            .iter()
            .any(|c| c.phase == phase && c.site() == site)
    };
    for (phase, site) in [
        ("forward", "embed_tokens.gather rows"),
        ("forward", "layers.0.input_layernorm.rms norm"),
        ("forward", "layers.0.self_attn.qkv_proj.matmul"),
        ("forward", "layers.0.self_attn.attention"),
        // SwiGLU computed by the down product that reads it
        ("forward", "layers.3.mlp.down_proj.swiglu matmul"),
        ("forward", "lm_head.matmul"),
        ("forward", "loss.cross-entropy"),
        // layers 0 and 1 are checkpointed (tiny's budget): rerun in backward
        ("recompute", "layers.1.self_attn.attention"),
        ("backward", "layers.1.self_attn.attention backward"),
        ("backward", "layers.3.self_attn.attention backward"),
        ("backward", "embed_tokens.scatter-add rows"),
        ("optimizer", "sum of squares"),
        ("optimizer", "params.0.adamw"),
    ] {
        assert!(has(phase, site), "no {phase} call at {site}");
    }
    // no recompute of the last segment (layers 2 and 3 keep their activations)
    assert!(!tr
        .calls
        .iter()
        .any(|c| c.phase == "recompute" && c.path.starts_with("layers.3")));
    // in order: all of the forward before the optimizer
    let first_opt = tr
        .calls
        .iter()
        .position(|c| c.phase == "optimizer")
        .unwrap();
    assert!(tr.calls[first_opt..].iter().all(|c| c.phase == "optimizer"));
}

// ---------------------------------------------------------- the probe ----

/// The probe answers every question on this adapter, agrees with the fma
/// path the backend chose, and finds nothing here that makes results differ.
/// On lavapipe it finds what DEVICES.md records.
#[test]
fn the_probe_on_this_adapter() {
    require_gpu!();
    let p = probe::run().unwrap();
    let keys: Vec<&str> = p.findings.iter().map(|f| f.check).collect();
    for k in [
        "fma_fused",
        "fma_contract",
        "subnormal_load_store",
        "subnormal_add",
        "subnormal_mul",
        "subnormal_fma",
        "subnormal_div",
        "subnormal_rounding",
        "no_contraction",
        "round_to_nearest_even",
        "signed_zero",
        "inf_nan",
        "no_reassociation",
        "native_math",
    ] {
        assert!(keys.contains(&k), "no finding {k}");
    }
    let differs: Vec<_> = p.differing().collect();
    assert!(differs.is_empty(), "{differs:#?}");
    if std::env::var("TINYLLM_GPU_FMA").is_err() {
        assert_eq!(p.fma_fused(), p.fma_path == "native");
    }
    if p.adapter.contains("llvmpipe") {
        let holds = |k: &str| p.findings.iter().find(|f| f.check == k).unwrap().holds;
        assert!(!holds("fma_fused"), "lavapipe's fma is not fused");
        // llvmpipe regroups float constants in WGSL it compiles, and stops
        // once every float operation is marked NoContraction (hardened SPIR-V)
        assert_eq!(
            holds("no_reassociation"),
            p.shaders.starts_with("SPIR-V"),
            "constants regrouped: {}",
            p.shaders
        );
        for k in [
            "fma_contract",
            "subnormal_add",
            "subnormal_mul",
            "subnormal_fma",
            "subnormal_div",
            "no_contraction",
        ] {
            assert!(holds(k), "{k} on lavapipe");
        }
        let fma = p.findings.iter().find(|f| f.check == "fma_fused").unwrap();
        assert_eq!(fma.status, Status::Handled);
        assert_eq!(p.subnormals, "kept", "the start-up probe agrees");
    }
}

// ------------------------------------------------- the perturbation hook ----

/// One flipped bit in one GPU primitive's output: the sweep finds it in that
/// primitive's row alone, one ulp, at that position. An in-place optimizer
/// kernel too.
#[test]
fn the_sweep_names_a_one_ulp_perturbation() {
    require_gpu!();
    for (primitive, element, family) in [
        ("unary silu", 7, Family::Elementwise),
        ("adamw", 0, Family::Update),
    ] {
        let _perturbed = tinyllm::testing::gpu_perturb(primitive, element);
        let rows = sweep::run(&[Device::Gpu], &[family], &mut |_| {}).unwrap();
        let bad: Vec<_> = rows.iter().filter(|r| !r.bit_identical()).collect();
        assert_eq!(bad.len(), 1, "{primitive}: {bad:#?}");
        let r = bad[0];
        assert_eq!(r.primitive, primitive);
        let m = r.first.as_ref().unwrap();
        assert_eq!(m.position, element, "{r:?}");
        assert!(!r.nan_vs_number);
        if primitive == "unary silu" {
            assert_eq!((r.differing, r.max_ulps), (1, 1), "{r:?}");
            assert_eq!(m.inputs.len(), 1, "the input at that position is shown");
        }
    }
    // disarmed: the same family is identical again
    let rows = sweep::run(&[Device::Gpu], &[Family::Elementwise], &mut |_| {}).unwrap();
    assert!(rows.iter().all(|r| r.bit_identical()));
}

fn perturbed_lockstep(primitive: &str, element: usize) -> lockstep::Divergence {
    let _perturbed = tinyllm::testing::gpu_perturb(primitive, element);
    let l = lockstep::run(
        &LockstepOptions {
            preset: "tiny".into(),
            steps: 2,
            precision: Precision::Fp32,
            seed: None,
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(l.identical_steps, 0);
    l.divergence.expect("the perturbation makes step 1 differ")
}

/// The lockstep finds the perturbed step, and the traced replay names the
/// first call whose output differs: the perturbed primitive at the first
/// place the model calls it, with the position and both values.
#[test]
fn the_lockstep_trace_names_the_perturbed_call() {
    require_gpu!();
    let d = perturbed_lockstep("swiglu", 3);
    assert_eq!(d.step, 1);
    assert!(d.buffers_differing > 0, "{d}");
    let c = d.first_call.as_ref().expect("a traced first call");
    // layer 2's: the checkpointed layers 0 and 1 first run without grad,
    // where the down product computes SwiGLU as it reads it
    assert_eq!(c.site, "layers.2.mlp.down_proj.swiglu", "{d}");
    assert_eq!(c.phase, "forward");
    assert_eq!(
        (c.differing, c.max_ulps, c.position),
        (1, 1, Some(3)),
        "{d}"
    );
    assert!(c.gpu_call.is_none(), "the same call on both devices");
    assert!(c.previous.is_some() && c.index > 0);
    let text = d.to_string();
    assert!(text.contains("layers.2.mlp.down_proj.swiglu"), "{text}");
}

/// A perturbation in a backward primitive is attributed to the layer whose forward
/// op recorded the node: softmax's backward of the last block runs first.
#[test]
fn the_lockstep_trace_attributes_backward_calls_to_their_layer() {
    require_gpu!();
    // element 33 of dq, token-major (2 heads of 16 a row): row 1 of the
    // first head (row 0's gradient is exactly 0, and a subnormal there is
    // lost downstream: no divergence)
    let d = perturbed_lockstep("attention backward", 33);
    let c = d.first_call.as_ref().expect("a traced first call");
    assert_eq!(c.site, "layers.3.self_attn.attention backward", "{d}");
    assert_eq!(c.phase, "backward");
    assert_eq!(c.position, Some(33));
}

// ------------------------------------------------------- the binary ----

fn run_bin(args: &[&str], envs: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(BIN);
    c.args(args);
    for (k, v) in envs {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(
        !err.contains("panicked"),
        "the binary panicked on {args:?}:\n{err}"
    );
    (o.status.code().unwrap_or(-1), out, err)
}

/// Every primitive the backend has, as the profile and the trace name them.
const PRIMITIVES: [&str; 47] = [
    "unary neg",
    "unary exp",
    "unary log",
    "unary sqrt",
    "unary rsqrt",
    "unary recip",
    "unary sigmoid",
    "unary silu",
    "unary silu grad",
    "unary abs",
    "unary relu",
    "unary step",
    "unary square",
    "unary add scalar",
    "unary mul scalar",
    "unary div scalar",
    "unary scalar div",
    "unary round",
    "binary add",
    "binary sub",
    "binary mul",
    "binary div",
    "binary maximum",
    "binary eq",
    "reduce sum",
    "reduce max",
    "softmax",
    "softmax backward",
    "sum of squares",
    "matmul",
    "strided copy",
    "concat",
    "gather rows",
    "scatter-add rows",
    "rms norm",
    "rms norm backward",
    "swiglu",
    "swiglu backward",
    "rope",
    "rope backward",
    "cross-entropy",
    "cross-entropy backward",
    "dropout mask",
    "attention",
    "attention backward",
    "pack 16-bit",
    "unpack 16-bit",
];

/// A cross-check report's sweep (its JSON): a row for every primitive,
/// every transpose and format of the matmul and every causal mask, each
/// with cases and none differing.
fn assert_whole_sweep(j: &serde_json::Value) {
    let rows = j["sweep"].as_array().unwrap();
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["primitive"].as_str().unwrap())
        .collect();
    let update = ["finite check + unscale", "scale in place", "adamw", "sgd"];
    for p in PRIMITIVES.iter().chain(&update) {
        assert!(names.contains(p), "the sweep has no row for {p}");
    }
    for r in rows {
        assert_eq!(r["differing"], 0, "{r:#}");
        assert!(r["cases"].as_u64().unwrap() > 0);
    }
    let variants: Vec<&str> = rows
        .iter()
        .filter(|r| r["primitive"] == "matmul")
        .map(|r| r["variant"].as_str().unwrap())
        .collect();
    for f in ["f32", "bf16", "fp16"] {
        for l in ["A·B", "Aᵀ·B", "A·Bᵀ", "Aᵀ·Bᵀ"] {
            assert!(variants.contains(&format!("{f} {l}").as_str()), "{f} {l}");
        }
    }
    for m in ["outputs j ≤ i", "terms p ≤ i", "terms p ≥ i"] {
        assert!(
            variants.contains(&format!("bf16 causal: {m}").as_str()),
            "{m}"
        );
    }
}

/// `tinyllm crosscheck` on this adapter: a 5-step `tiny` lockstep in each
/// precision, all bit-identical, exit status 0; the JSON carries the facts
/// the report prints. The sweep is left out here: `device-check`'s test
/// reads the command's whole sweep.
#[test]
fn the_command_reports_bit_identical_here() {
    require_gpu!();
    let (code, out, err) = run_bin(&["crosscheck", "--json", "--skip-sweep"], &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["exit_code"], 0);
    assert_eq!(j["verdict"]["bit_identical"], true, "{:#}", j["verdict"]);
    assert!(j["sweep"].is_null(), "{:#}", j["sweep"]);
    let ls = j["lockstep"].as_array().unwrap();
    let precisions: Vec<&str> = ls
        .iter()
        .map(|l| l["precision"].as_str().unwrap())
        .collect();
    assert_eq!(precisions, ["fp32", "bf16", "fp16"]);
    for l in ls {
        assert_eq!(
            (
                l["preset"].as_str(),
                l["steps"].as_u64(),
                l["identical_steps"].as_u64()
            ),
            (Some("tiny"), Some(5), Some(5))
        );
        assert!(l["divergence"].is_null());
    }
    // the readable report says the same (probe and lockstep, without the sweep)
    let (code, text, _) = run_bin(
        &[
            "crosscheck",
            "--skip-sweep",
            "--precision",
            "fp32",
            "--steps",
            "1",
        ],
        &[],
    );
    assert_eq!(code, 0, "{text}");
    let adapter = j["probe"]["adapter"].as_str().unwrap();
    for s in [
        "== device probe",
        adapter,
        "fma path",
        "primitive sweep: skipped",
        "fp32  1/1 steps bit-identical",
        "verdict: BIT-IDENTICAL",
    ] {
        assert!(text.contains(s), "the report lacks {s:?}:\n{text}");
    }
    for f in j["probe"]["findings"].as_array().unwrap() {
        assert!(text.contains(f["assumption"].as_str().unwrap()), "{f:#}");
    }
}

/// With the perturbation hook armed through the environment, the command exits 1
/// and names the perturbed primitive (its sweep row) and the first differing
/// call of the lockstep's replay, in the report and in the JSON. The sweep
/// is of the perturbed primitive's family alone (the whole sweep's rows are
/// read by `the_command_reports_bit_identical_here`).
#[test]
fn the_command_exits_1_and_names_the_perturbation() {
    require_gpu!();
    let perturb = [
        ("TINYLLM_GPU_PERTURB", "swiglu#3"),
        ("TINYLLM_SWEEP_ONLY", "fused"),
    ];
    let (code, out, err) = run_bin(
        &["crosscheck", "--precision", "fp32", "--steps", "2"],
        &perturb,
    );
    assert_eq!(code, 1, "{out}\n{err}");
    for s in [
        "verdict: DIFFERS",
        "sweep gpu: swiglu: 5 of 1576 values differ",
        "first divergence at step 1",
        "call #",
        "(forward): layers.2.mlp.down_proj.swiglu",
        "first at [3]",
    ] {
        assert!(out.contains(s), "the report lacks {s:?}:\n{out}");
    }
    // An optimizer kernel in bf16 training (a perturbed silu output would be
    // rounded away by bf16 autocast: no divergence to find): the JSON names
    // the first parameter's AdamW update, in the optimizer phase.
    let (code, out, _) = run_bin(
        &[
            "crosscheck",
            "--skip-sweep",
            "--precision",
            "bf16",
            "--steps",
            "1",
            "--json",
        ],
        &[("TINYLLM_GPU_PERTURB", "adamw#5")],
    );
    assert_eq!(code, 1);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let c = &j["lockstep"][0]["divergence"]["first_call"];
    assert_eq!(c["site"], "params.0.adamw", "{j:#}");
    assert_eq!(c["phase"], "optimizer");
    assert_eq!(c["position"], 5);
    assert_eq!(j["verdict"]["bit_identical"], false);
}

fn train_args(out: &std::path::Path, steps: &str, every: &str) -> Vec<String> {
    [
        "train",
        "--precision",
        "fp32",
        "--preset",
        "tiny",
        "--device",
        "gpu",
        "--plain",
        "--sample-len",
        "0",
        "--eval-every",
        "0",
        "--steps",
        steps,
        "--crosscheck-every",
        every,
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect()
}

/// `train --device gpu --crosscheck-every K`: every K-th step is replayed on
/// the CPU; with a perturbation the run stops at the first checked step that
/// differs, prints the trace report and keeps the state before that step as
/// a checkpoint (with the report beside it); without one it finishes.
#[test]
fn training_with_crosscheck_every_stops_at_the_divergence() {
    require_gpu!();
    let dir = tmpdir("train-crosscheck");
    let a = train_args(&dir.join("good"), "2", "1");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (code, _, err) = run_bin(&a, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("crosscheck: 2 replayed step(s) on the CPU reference, all bit-identical"),
        "{err}"
    );

    // step 1 runs unchecked (its perturbed result carries on), step 2 is checked
    let out = dir.join("bad");
    let a = train_args(&out, "4", "2");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (code, _, err) = run_bin(&a, &[("TINYLLM_GPU_PERTURB", "swiglu#3")]);
    assert_eq!(code, 1, "{err}");
    for s in [
        "training stopped at step 2",
        "the GPU's step 2 differs from the CPU reference's",
        "layers.2.mlp.down_proj.swiglu",
    ] {
        assert!(err.contains(s), "{s:?} missing:\n{err}");
    }
    let kept = out.join("crosscheck-step-2");
    // on the CPU there is nothing to compare: refused before the first step
    let mut a = train_args(&dir.join("cpu"), "2", "1");
    let at = a.iter().position(|s| s == "gpu").unwrap();
    a[at] = "cpu".into();
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let (code, _, err) = run_bin(&a, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("this run is on the cpu: train with --device gpu"),
        "{err}"
    );
    assert!(
        !err.contains("step     1"),
        "refused before training: {err}"
    );
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(kept.join("checkpoint/trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 1, "the state before the diverging step");
    let report = std::fs::read_to_string(kept.join("crosscheck.txt")).unwrap();
    assert!(report.contains("layers.2.mlp.down_proj.swiglu"), "{report}");
    assert!(kept.join("crosscheck.json").is_file());
    // the kept state replays the step: resumed on the CPU it trains on
    let r = [
        "train",
        "--resume",
        kept.to_str().unwrap(),
        "--steps",
        "2",
        "--device",
        "cpu",
        "--plain",
        "--sample-len",
        "0",
    ];
    let (code, _, err) = run_bin(&r, &[]);
    assert_eq!(code, 0, "{err}");
    // a link planted where the kept state would go is refused, its target
    // left empty
    #[cfg(unix)]
    {
        let (linked, victim) = (dir.join("linked"), dir.join("victim"));
        std::fs::create_dir_all(&linked).unwrap();
        std::fs::create_dir_all(&victim).unwrap();
        std::os::unix::fs::symlink(&victim, linked.join("crosscheck-step-2")).unwrap();
        let a = train_args(&linked, "4", "2");
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let (code, _, err) = run_bin(&a, &[("TINYLLM_GPU_PERTURB", "swiglu#3")]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("symbolic link"), "{err}");
        assert!(std::fs::read_dir(&victim).unwrap().next().is_none());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without an adapter the command is an error (exit status 2) with a clear
/// message, not a panic.
#[test]
fn the_command_without_an_adapter_exits_2() {
    // Metal does not exist on Linux (nor GL where no display or EGL is):
    // wgpu finds no adapter at all
    if !cfg!(target_os = "linux") {
        return;
    }
    let (code, out, err) = run_bin(&["crosscheck", "--json"], &[("WGPU_BACKEND", "metal")]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("crosscheck needs a GPU"), "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["exit_code"], 2);
}

/// A lockstep of zero steps would compare nothing and report a pass: the
/// library refuses it, and the command says so before it probes anything
/// (so with no adapter at all).
#[test]
fn zero_lockstep_steps_are_refused() {
    let e = lockstep::run(
        &LockstepOptions {
            preset: "tiny".into(),
            steps: 0,
            precision: Precision::Fp32,
            seed: None,
        },
        &mut |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("at least 1 step"), "{e}");
    let (code, out, err) = run_bin(
        &["crosscheck", "--steps", "0", "--skip-sweep"],
        &[("WGPU_BACKEND", "metal")],
    );
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("at least 1 step"), "{err}");
}

/// `--backend` picks the front end: Vulkan's hardened SPIR-V, whose float
/// controls the probe reports, bit-identical; a backend without an adapter is
/// a clear error (exit 2). (GL, WGSL compiled to GLSL: its sweep and
/// three-precision lockstep are `device-check`'s `gl` part below, which
/// picks it the same way.)
#[test]
fn the_backend_flag_picks_the_front_end() {
    require_gpu!();
    let (code, out, err) = run_bin(
        &[
            "crosscheck",
            "--backend",
            "vulkan",
            "--skip-sweep",
            // one precision: the other tests run the lockstep in all three
            "--precision",
            "fp16",
            "--steps",
            "2",
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    for s in [
        "(Vulkan, ",
        "shaders   SPIR-V passthrough",
        "granted SignedZeroInfNanPreserve32",
        "verdict: BIT-IDENTICAL",
        "fp16  2/2 steps bit-identical",
    ] {
        assert!(out.contains(s), "the report lacks {s:?}:\n{out}");
    }
    let (code, _, err) = run_bin(&["crosscheck", "--backend", "metal", "--skip-sweep"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("no GPU adapter found on the metal backend"),
        "{err}"
    );
}

/// `device-check` writes one report with every part: the cross-check per
/// backend asked (one the machine lacks recorded with its error, not
/// fatal), the benchmarks, and the profiled recipe on the GPU and the CPU.
/// It never writes into a directory that exists.
#[test]
fn device_check_writes_one_report_of_every_part() {
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let dir = tmpdir("device-check");
    let out = dir.join("report");
    let run = || {
        Command::new(BIN)
            .args([
                "device-check",
                "--preset",
                "tiny",
                "--steps",
                "2",
                "--backends",
                "vulkan,metal",
                // generous: the suite's other tests share the machine
                "--part-seconds",
                "1800",
                "--out",
            ])
            .arg(&out)
            .output()
            .unwrap()
    };
    let o = run();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    // the command's whole sweep and the lockstep in every precision
    // bit-identical (lavapipe's GL front end: gpu_parity's
    // gl_front_end_keeps_every_bit)
    let vk = &r["crosscheck"]["vulkan"];
    assert_eq!(vk["exit_code"], 0, "{vk}");
    let report = &vk["report"];
    assert_eq!(report["verdict"]["bit_identical"], true, "{vk}");
    assert_eq!(report["probe"]["backend"], "Vulkan", "{vk}");
    assert_whole_sweep(report);
    let steps: Vec<(&str, u64)> = report["lockstep"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["precision"].as_str().unwrap(),
                l["identical_steps"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(steps, [("fp32", 2), ("bf16", 2), ("fp16", 2)], "{vk}");
    // no Metal on this machine: recorded as an error of that part
    let metal = &r["crosscheck"]["metal"];
    assert_eq!(metal["exit_code"], 2, "{metal}");
    assert!(
        metal["report"]["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{metal}"
    );
    assert_eq!(r["bench"]["exit_code"], 0, "{}", r["bench"]);
    assert!(r["bench"]["report"]["rows"]
        .as_array()
        .is_some_and(|v| !v.is_empty()));
    for device in ["gpu", "cpu"] {
        let p = &r["profile"][device];
        assert_eq!(p["exit_code"], 0, "{p}");
        assert!(p["stdout"].as_str().unwrap().contains("profile"), "{p}");
    }
    // a second run refuses the directory it would overwrite
    let o = run();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));
    let _ = std::fs::remove_dir_all(&dir);
}
