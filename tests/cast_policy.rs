//! Per-op cast policies: every entry honoured, bit for bit, by every device
//! and both attention schedules; each entry changes the bits it should.

mod common;
use common::*;
use tinyllm::nn::llama::{Llama, LlamaConfig};
use tinyllm::nn::Module;
use tinyllm::precision::{autocast, cast, CastPolicy, CastTable, OpClass, Rule};
use tinyllm::recompute::{min_ckpt_budget, Recompute};
use tinyllm::Format;

/// The built-ins at bf16, and a policy of our own that mixes the formats:
/// fp16 matmuls, bf16 scores, fp16 probabilities, elementwise ops following.
fn policies() -> Vec<CastPolicy> {
    let mut v: Vec<CastPolicy> = ["matmuls", "torch", "pure"]
        .iter()
        .map(|n| CastPolicy::builtin(n, Format::Bf16).unwrap())
        .collect();
    let mixed = CastTable::torch(Format::Fp16)
        .with(OpClass::AttentionScores, Rule::Round(Format::Bf16))
        .with(OpClass::AttentionProbs, Rule::Round(Format::Fp16))
        .with(OpClass::RmsNorm, Rule::Round(Format::Bf16))
        .with(OpClass::Embedding, Rule::Round(Format::Bf16));
    v.push(CastPolicy::new("mixed", mixed));
    v
}

/// A tiny Llama (2 layers) under `table`: the loss and every gradient's bits,
/// from one forward and backward pass over two sequences of 16 tokens, with
/// dropout (the attention composition) or without (the fused attention).
fn llama_bits(dev: Device, table: CastTable, dropout: f32) -> Vec<Vec<u32>> {
    llama_bits_recomputed(dev, table, dropout, 2, Recompute::None)
}

/// [`llama_bits`] of a Llama of `layers` with `recompute` (blocks at the
/// smallest budget).
fn llama_bits_recomputed(
    dev: Device,
    table: CastTable,
    dropout: f32,
    layers: usize,
    recompute: Recompute,
) -> Vec<Vec<u32>> {
    let mut cfg = LlamaConfig::preset("tiny").unwrap();
    cfg.n_layers = layers;
    cfg.dropout = dropout;
    let (rows, t) = (2, 16);
    let ids: Vec<u32> = (0..rows * t).map(|i| ((i * 37 + 5) % 256) as u32).collect();
    let budget = recompute.blocks().then(|| min_ckpt_budget(cfg.n_layers));
    let m = Llama::new(&cfg, 7, dev)
        .unwrap()
        .with_recompute(budget)
        .unwrap()
        .with_attention_recompute(recompute.attention());
    let loss = {
        let _ac = autocast(table);
        let logits = m.forward(&ids, rows, t).unwrap();
        tinyllm::ops::cross_entropy(&logits, &ids).unwrap()
    };
    loss.backward().unwrap();
    let mut out = vec![bits(&vals(&loss))];
    out.extend(m.parameters().iter().map(|p| bits(&grad(p))));
    out
}

/// The device each device is held to: the CPU to the spec, the others to
/// the CPU.
fn reference(dev: Device) -> Device {
    match dev {
        Device::Cpu => Device::Spec,
        _ => Device::Cpu,
    }
}

// Every policy, with the fused attention and with the composition (dropout
// on): the loss and every gradient of a tiny Llama on this device equal the
// reference device's, bit for bit.
device_test!(every_policy_is_bitwise_across_devices, |dev| {
    for p in policies() {
        for dropout in [0.0, 0.1] {
            let (got, want) = (
                llama_bits(dev, p.table(), dropout),
                llama_bits(reference(dev), p.table(), dropout),
            );
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    a == b,
                    "policy {}, dropout {dropout}: tensor {i} (0: the loss) differs on {dev:?} from {:?}",
                    p.name(),
                    reference(dev)
                );
            }
        }
    }
});

// Each entry is read: a float32 table with one class stored in bf16
// changes the loss or a gradient of the tiny Llama (every class the model
// runs), with the fused attention and with the composition; `pure` and the
// mixed policy change `matmuls`' bits. (Otherwise the checks above could
// pass with every entry ignored.) `torch` gives `matmuls`' bits here: the
// ops it lets follow their inputs (SwiGLU, RoPE) feed only products that
// round their operands, and the gradients arriving for them come out of
// such products, already rounded; the residual sums follow the float32
// stream. (torch.autocast's eager elementwise ops differ by the roundings
// between their steps, which these fused ops do not have.) The host reads
// the entries, whatever the device: on the GPU, the test above holds every
// policy's bits to the CPU's, `pure` among them (every class rounded), so
// the GPU is not run again here (its twenty-odd tables cost minutes of
// pipeline compiles on lavapipe).
#[test]
fn each_entry_changes_the_bits() {
    for dev in [Device::Spec, Device::Cpu] {
        each_entry_changes_the_bits_on(dev);
    }
}

fn each_entry_changes_the_bits_on(dev: Device) {
    let base = CastTable::f32();
    for dropout in [0.0, 0.1] {
        let plain = llama_bits(dev, base, dropout);
        for c in OpClass::ALL {
            if c == OpClass::Softmax {
                continue; // the Llama has none outside attention
            }
            let table = base.with(c, Rule::Round(Format::Bf16));
            assert!(
                llama_bits(dev, table, dropout) != plain,
                "{} (dropout {dropout}): nothing changed against float32",
                c.name()
            );
        }
        let matmuls = llama_bits(dev, CastTable::matmuls(Format::Bf16), dropout);
        for p in policies().into_iter().skip(1) {
            let same = llama_bits(dev, p.table(), dropout) == matmuls;
            assert_eq!(same, p.name() == "torch", "{} against matmuls", p.name());
        }
        // follow with float32 inputs rounds nothing: the residual stream
        // (from the float32 embedding) stays float32
        let follow = CastTable::matmuls(Format::Bf16).with(OpClass::ResidualAdd, Rule::Follow);
        assert!(
            llama_bits(dev, follow, dropout) == matmuls,
            "residual_add follow"
        );
    }
}

/// `y = f(x)` and the gradients of `inputs` for `sum(y · w)`, under `table`.
fn op_bits(
    table: Option<CastTable>,
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<Vec<Vec<u32>>> {
    let y = {
        let _ac = autocast(tinyllm::precision::Scope::table(table));
        f(inputs)?
    };
    let w = Tensor::from_vec(randv(y.numel(), 99, 1.0), y.shape(), y.device())?;
    y.mul(&w)?.sum_all()?.backward()?;
    let mut out = vec![bits(&vals(&y))];
    for x in inputs {
        out.push(bits(&grad(x)));
        x.zero_grad();
    }
    Ok(out)
}

// An op whose output a policy stores in a format is the float32 op followed
// by the storage conversion `cast` (forward rounded, the arriving gradient
// rounded), bit for bit, for every op class that reads its inputs, not its
// output, in backward; in float32 it is the op itself.
device_test!(a_stored_output_is_the_op_then_a_cast, |dev| {
    let x = |n: usize, shape: &[usize], seed| param(&randv(n, seed, 2.0), shape, dev);
    let (b, t, c, h) = (2, 6, 8, 2);
    let d = c / h;
    let (cos, sin) = tinyllm::nn::llama::rope_tables(t, d, 10000.0);
    let (cos, sin) = (
        Tensor::from_vec(cos, &[t, d], dev)?,
        Tensor::from_vec(sin, &[t, d], dev)?,
    );
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % 11) as u32).collect();
    type Op<'a> = Box<dyn Fn(&[Tensor]) -> Result<Tensor> + 'a>;
    let cases: Vec<(OpClass, Vec<Tensor>, Op)> = vec![
        (
            OpClass::RmsNorm,
            vec![x(b * t * c, &[b, t, c], 1), x(c, &[c], 2)],
            Box::new(|a: &[Tensor]| a[0].rms_norm(&a[1], 1e-5)),
        ),
        (
            OpClass::Swiglu,
            vec![x(b * t * c, &[b, t, c], 3), x(b * t * c, &[b, t, c], 4)],
            Box::new(|a: &[Tensor]| a[0].swiglu(&a[1])),
        ),
        (
            OpClass::Rope,
            vec![x(b * t * c, &[b, t, c], 5)],
            Box::new(|a: &[Tensor]| a[0].rope_heads(&cos, &sin, h)),
        ),
        (
            OpClass::ResidualAdd,
            vec![x(b * t * c, &[b, t, c], 6), x(b * t * c, &[b, t, c], 7)],
            Box::new(|a: &[Tensor]| a[0].residual_add(&a[1])),
        ),
        (
            OpClass::CrossEntropy,
            vec![x(b * t * 11, &[b * t, 11], 8)],
            Box::new(|a: &[Tensor]| tinyllm::ops::cross_entropy(&a[0], &ids)),
        ),
        (
            OpClass::Embedding,
            vec![x(11 * c, &[11, c], 9)],
            Box::new(|a: &[Tensor]| {
                tinyllm::nn::Embedding {
                    weight: a[0].clone(),
                }
                .forward(&ids)
            }),
        ),
    ];
    for (class, inputs, f) in &cases {
        for fmt in [Format::Bf16, Format::Fp16] {
            let table = CastTable::f32().with(*class, Rule::Round(fmt));
            let got = op_bits(Some(table), inputs, f)?;
            let want = op_bits(None, inputs, &|a| cast(&f(a)?, fmt))?;
            assert!(got == want, "{} at {fmt}", class.name());
            assert!(
                got != op_bits(None, inputs, f)?,
                "{} at {fmt}: rounding changed nothing",
                class.name()
            );
        }
        // float32, and `follow` of float32 inputs: the op itself
        let plain = op_bits(None, inputs, f)?;
        for rule in [Rule::F32, Rule::Follow] {
            let table = CastTable::pure(Format::Bf16).with(*class, rule);
            assert!(
                op_bits(Some(table), inputs, f)? == plain,
                "{} {}",
                class.name(),
                rule.name()
            );
        }
    }
    // `follow` of inputs that hold one format: stored in it
    let (g, u) = (x(64, &[64], 11), x(64, &[64], 12));
    let swiglu = |a: &[Tensor]| cast(&a[0], Format::Fp16)?.swiglu(&cast(&a[1], Format::Fp16)?);
    let follow = CastTable::f32().with(OpClass::Swiglu, Rule::Follow);
    let got = op_bits(Some(follow), &[g.clone(), u.clone()], &swiglu)?;
    let want = op_bits(None, &[g, u], &|a| cast(&swiglu(a)?, Format::Fp16))?;
    assert!(got == want, "swiglu follows fp16 inputs");
});

// The softmax classes store the probabilities rounded and their backward
// reads them as stored: `softmax` (outside attention) and `attention_probs`
// (attention's causal softmax) each round their own op only.
device_test!(softmax_entries_round_the_probabilities, |dev| {
    let x = param(&randv(4 * 9, 21, 3.0), &[4, 9], dev);
    let s = param(&randv(2 * 7 * 7, 22, 3.0), &[2, 7, 7], dev);
    for (class, fmt) in [
        (OpClass::Softmax, Format::Bf16),
        (OpClass::AttentionProbs, Format::Fp16),
    ] {
        let table = CastTable::f32().with(class, Rule::Round(fmt));
        let on = |f: &dyn Fn() -> Result<Tensor>| -> Result<Vec<u32>> {
            let _ac = autocast(table);
            Ok(bits(&vals(&f()?)))
        };
        let (y, y_att) = (on(&|| x.softmax())?, on(&|| s.attention_probs(0.5))?);
        let rounded = |t: Tensor| bits(&vals(&tinyllm::precision::round_to(&t, fmt).unwrap()));
        let (plain, plain_att) = (x.softmax()?, s.attention_probs(0.5)?);
        match class {
            OpClass::Softmax => {
                assert_eq!(y, rounded(plain));
                assert_eq!(
                    y_att,
                    bits(&vals(&plain_att)),
                    "attention's is another entry"
                );
            }
            _ => {
                assert_eq!(y_att, rounded(plain_att));
                assert_eq!(y, bits(&vals(&plain)), "softmax is another entry");
            }
        }
    }
});

/// q, k, v `(2, 3, t, 8)` under `table`: the fused attention's output and
/// gradients against the composition it stands for.
fn attention_under(dev: Device, t: usize, table: CastTable, what: &str) -> Result<()> {
    let shape = [2, 3, t, 8];
    let n = 2 * 3 * t * 8;
    let (q0, k0, v0, w) = (
        randv(n, 31, 2.0),
        randv(n, 32, 2.0),
        randv(n, 33, 1.0),
        randv(n, 34, 1.0),
    );
    type Attn = dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;
    let run = |f: &Attn| -> Result<Vec<Vec<u32>>> {
        let _ac = autocast(table);
        let (q, k, v) = (
            param(&q0, &shape, dev),
            param(&k0, &shape, dev),
            param(&v0, &shape, dev),
        );
        let y = f(&q, &k, &v)?;
        y.mul(&Tensor::from_vec(w.clone(), y.shape(), dev)?)?
            .sum_all()?
            .backward()?;
        Ok(vec![
            bits(&vals(&y)),
            bits(&grad(&q)),
            bits(&grad(&k)),
            bits(&grad(&v)),
        ])
    };
    let fused = run(&|q, k, v| q.causal_attention(k, v, 0.35))?;
    let composed = run(&|q, k, v| q.attention_scores(k)?.attention_probs(0.35)?.matmul(v))?;
    for (i, name) in ["y", "dq", "dk", "dv"].iter().enumerate() {
        assert!(fused[i] == composed[i], "{what}, T {t}: {name} differs");
    }
    Ok(())
}

// The fused attention (on the CPU its per-head schedule, elsewhere the
// batched one) is the composition of the scores' product, the
// probabilities' softmax and the product with v under every policy, each
// at its own entry's format.
device_test!(attention_is_its_composition_under_every_policy, |dev| {
    let lengths: &[usize] = if dev == Device::Cpu {
        &[5, 40]
    } else {
        &[5, 13]
    };
    let mut tables: Vec<(String, CastTable)> = policies()
        .into_iter()
        .map(|p| (p.name().to_string(), p.table()))
        .collect();
    tables.push((
        "probs follow the scores".into(),
        CastTable::matmuls(Format::Fp16)
            .with(OpClass::AttentionScores, Rule::Round(Format::Bf16))
            .with(OpClass::AttentionProbs, Rule::Follow),
    ));
    tables.push((
        "f32 products, bf16 probabilities".into(),
        CastTable::f32().with(OpClass::AttentionProbs, Rule::Round(Format::Bf16)),
    ));
    for &t in lengths {
        for (what, table) in &tables {
            attention_under(dev, t, *table, what)?;
        }
    }
});

// The memory plan of each policy against what a tiny Llama's forward pass
// really holds (exactly: the plan counts every activation, each in 16 bits
// where the policy keeps it so), with and without dropout and block
// checkpointing; `pure` holds the least, `torch` what `matmuls` holds.
device_test!(the_plan_counts_what_each_policy_keeps, |dev| {
    use tinyllm::memory;
    use tinyllm::recompute::min_ckpt_budget;
    use tinyllm::train::plan::memory_plan_policy;
    let follow_stream = CastTable::matmuls(Format::Bf16)
        .with(OpClass::Embedding, Rule::Round(Format::Bf16))
        .with(OpClass::ResidualAdd, Rule::Follow);
    let mut tables: Vec<(String, Option<CastTable>)> = policies()
        .into_iter()
        .map(|p| (p.name().to_string(), Some(p.table())))
        .collect();
    tables.push(("float32".into(), None));
    tables.push((
        "stream follows a bf16 embedding".into(),
        Some(follow_stream),
    ));
    for dropout in [0.0, 0.1] {
        let mut cfg = LlamaConfig::preset("tiny")?;
        cfg.n_layers = 3;
        cfg.dropout = dropout;
        let (rows, t) = (2, 16);
        let ids: Vec<u32> = (0..rows * t).map(|i| ((i * 37 + 5) % 256) as u32).collect();
        for budget in [None, Some(min_ckpt_budget(3))] {
            let mut held_of = std::collections::HashMap::new();
            for (what, table) in &tables {
                let m = Llama::new(&cfg, 7, dev)?.with_recompute(budget)?;
                let base = memory::live_bytes();
                let loss = {
                    let _ac = autocast(tinyllm::precision::Scope::table(*table));
                    let logits = m.forward(&ids, rows, t)?;
                    tinyllm::ops::cross_entropy(&logits, &ids)?
                };
                let held = memory::live_bytes() - base;
                let plan = memory_plan_policy(&cfg, rows, t, *table, budget, false, false)?;
                // the loss value itself (4 bytes) is the only thing the plan leaves out
                assert_eq!(
                    held,
                    plan.activations + 4,
                    "{what}, dropout {dropout}, budget {budget:?}: activations held after forward"
                );
                loss.backward()?;
                held_of.insert(what.clone(), held);
            }
            let h = |w: &str| held_of[w];
            assert!(
                h("pure") < h("matmuls") && h("matmuls") < h("float32"),
                "{held_of:?}"
            );
            assert_eq!(h("torch"), h("matmuls"), "torch keeps what matmuls keeps");
            if dropout == 0.0 {
                assert!(
                    h("stream follows a bf16 embedding") < h("matmuls"),
                    "{held_of:?}"
                );
            }
        }
    }
});

// Recomputation replays the cast policy: the attention core rerun from q, k
// and v (kept at the scores' and the matmuls' formats) and the checkpointed
// blocks rerun under the forward pass's whole table (`follow` reading what
// the rerun's inputs hold) give the plain run's loss and gradients, bit for
// bit, under every policy, with dropout on and off.
device_test!(recompute_keeps_every_bit_under_every_policy, |dev| {
    let mut tables: Vec<(String, CastTable)> = policies()
        .into_iter()
        .map(|p| (p.name().to_string(), p.table()))
        .collect();
    tables.push((
        "stream follows a bf16 embedding".into(),
        CastTable::matmuls(Format::Bf16)
            .with(OpClass::Embedding, Rule::Round(Format::Bf16))
            .with(OpClass::ResidualAdd, Rule::Follow)
            .with(OpClass::AttentionScores, Rule::Round(Format::Fp16))
            .with(OpClass::AttentionProbs, Rule::Follow),
    ));
    for (what, table) in &tables {
        for dropout in [0.0, 0.1] {
            let plain = llama_bits_recomputed(dev, *table, dropout, 4, Recompute::None);
            for r in [Recompute::Attention, Recompute::Blocks, Recompute::Both] {
                let got = llama_bits_recomputed(dev, *table, dropout, 4, r);
                assert!(
                    got == plain,
                    "{what}, dropout {dropout}: recompute {} changed the bits",
                    r.name()
                );
            }
        }
    }
});
