//! Activation checkpointing: trading compute for memory by recomputing
//! segments of the forward pass during backward, and the schedule that picks
//! the segments for a memory budget.
//!
//! A checkpointed segment runs under `no_grad` — none of its intermediate values
//! are recorded — and becomes ONE graph node whose parents are its tensor
//! arguments and its parameters. When backward reaches the node, it reruns the
//! segment with grad on from fresh leaf copies of the arguments, with every
//! random generator set back to where it stood and under the autocast state of
//! the forward pass, backpropagates the upstream gradient through the rerun
//! (parameter gradients accumulate directly), and hands the arguments'
//! gradients on. Same operations on the same values: the gradients equal a
//! plain run's bit for bit.
//!
//! What a model recomputes is a [`Recompute`] policy (`--recompute`): whole
//! blocks on a checkpoint schedule ([`checkpoint_sequential`]), only each
//! attention's core (Megatron-LM's selective recomputation: the matmul
//! outputs q, k, v are kept, the `H·T²` scores, probabilities and dropout
//! masks are not), both, or nothing.

use crate::module::Layer;
use crate::rng::Generator;
use crate::tensor::autocast::{autocast, cast_table, OpClass, Scope};
use crate::tensor::saved::Saved;
use crate::tensor::{is_grad_enabled, no_grad, set_grad_enabled};
use crate::{bail, Error, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::rc::Rc;

/// What the backward pass recomputes instead of keeping (`tinyllm train
/// --recompute none|attention|blocks|both`). Every policy gives the same
/// losses and gradients, bit for bit; they differ in the memory they hold
/// and the forward work they repeat.
///
/// * `None`: every activation is kept.
/// * `Attention`: each attention's core — scores, softmax, dropout,
///   probabilities · V — is recomputed in backward from the kept q, k and v,
///   replaying the same dropout mask; every matmul output is kept
///   (Megatron-LM's selective recomputation). Without dropout the fused
///   attention op already keeps only q, k and v and recomputes its
///   probabilities inside its backward primitive, so there this policy
///   changes nothing.
/// * `Blocks`: whole blocks on the schedule of a checkpoint budget
///   ([`checkpoint_sequential`]).
/// * `Both`: blocks, and inside each rerun block the attention core.
///
/// ```
/// use tinyllm::recompute::Recompute;
/// let p: Recompute = "both".parse()?;
/// assert!(p.blocks() && p.attention());
/// assert_eq!(Recompute::new(false, true), Recompute::Attention);
/// assert!("sometimes".parse::<Recompute>().unwrap_err().to_string().contains("none, attention, blocks or both"));
/// # Ok::<(), tinyllm::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Nothing recomputed.
    #[default]
    None,
    /// The attention core only.
    Attention,
    /// Whole blocks (activation checkpointing).
    Blocks,
    /// Blocks and the attention core.
    Both,
}

impl Recompute {
    /// Every policy, from least to most recomputation.
    pub const ALL: [Recompute; 4] = [
        Recompute::None,
        Recompute::Attention,
        Recompute::Blocks,
        Recompute::Both,
    ];

    /// The policy that recomputes `blocks` and/or the `attention` core.
    pub fn new(blocks: bool, attention: bool) -> Recompute {
        match (blocks, attention) {
            (false, false) => Recompute::None,
            (false, true) => Recompute::Attention,
            (true, false) => Recompute::Blocks,
            (true, true) => Recompute::Both,
        }
    }

    /// Whether whole blocks are checkpointed.
    pub fn blocks(self) -> bool {
        matches!(self, Recompute::Blocks | Recompute::Both)
    }

    /// Whether the attention core is recomputed.
    pub fn attention(self) -> bool {
        matches!(self, Recompute::Attention | Recompute::Both)
    }

    /// The name `--recompute` takes: `none`, `attention`, `blocks` or `both`.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Attention => "attention",
            Recompute::Blocks => "blocks",
            Recompute::Both => "both",
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Recompute {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Recompute::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                Error::config(format!(
                    "unknown recompute policy {s:?}: expected none, attention, blocks or both"
                ))
            })
    }
}

/// Peak activation memory of a schedule over `n` layers, in layer units:
/// `P = (k − 1) + max_j s_j`, where `schedule` holds the `k` segments' start
/// indices (ascending, the first 0) and `s_j` is segment `j`'s length — one
/// stored input per segment boundary plus the longest segment rerun at once.
pub fn schedule_peak(schedule: &[usize], n: usize) -> usize {
    let k = schedule.len();
    let max_seg = (0..k)
        .map(|j| schedule.get(j + 1).copied().unwrap_or(n) - schedule[j])
        .max()
        .unwrap_or(0);
    k.saturating_sub(1) + max_seg
}

/// The schedule with the fewest segments whose peak fits `budget` (sizes as
/// equal as possible, larger first), as segment start indices. `budget >= n`
/// gives `[0]`. Too small a budget is an error naming the smallest achievable peak.
pub fn checkpoint_schedule(n_layers: usize, budget: usize) -> Result<Vec<usize>> {
    if n_layers == 0 {
        bail!(Config, "checkpoint_schedule: no layers");
    }
    let mut best = usize::MAX;
    for k in 1..=n_layers {
        let peak = (k - 1) + n_layers.div_ceil(k);
        best = best.min(peak);
        if peak <= budget {
            let (q, r) = (n_layers / k, n_layers % k);
            let mut starts = Vec::with_capacity(k);
            let mut at = 0;
            for j in 0..k {
                starts.push(at);
                at += q + usize::from(j < r);
            }
            return Ok(starts);
        }
    }
    bail!(Config, "a memory budget of {budget} layer(s) is too small for {n_layers} layers: the smallest achievable peak is {best}")
}

/// The smallest checkpoint budget `n` layers can have: the lowest peak of
/// activation memory any checkpoint schedule reaches, in layer units (the
/// saved inputs of all segments but one, plus the layers of the largest
/// segment). It is the default of `tinyllm train --checkpoint-activations`,
/// the most memory checkpointing can save.
///
/// ```
/// use tinyllm::recompute::{budget_range, min_ckpt_budget};
/// assert_eq!(min_ckpt_budget(4), 3); // [0, 2]: one saved input + 2 layers
/// assert_eq!(min_ckpt_budget(8), 5);
/// assert_eq!(budget_range(4), 3..=4);
/// ```
pub fn min_ckpt_budget(n: usize) -> usize {
    (1..=n).map(|k| (k - 1) + n.div_ceil(k)).min().unwrap_or(1)
}

/// The checkpoint budgets a stack of `n_layers` layers can run with:
/// `min_ckpt_budget(n_layers)..=n_layers`. The largest, `n_layers`, is one
/// segment: every layer's activations kept, nothing recomputed.
pub fn budget_range(n_layers: usize) -> std::ops::RangeInclusive<usize> {
    min_ckpt_budget(n_layers)..=n_layers
}

/// Checks that `budget` is in [`budget_range`]`(n_layers)`. The error
/// ([`crate::Error::Config`]) names the valid range and, for
/// too small a budget, the smallest achievable peak.
pub fn check_budget(n_layers: usize, budget: usize) -> Result<()> {
    if n_layers == 0 {
        bail!(Config, "activation checkpointing: no layers");
    }
    let range = budget_range(n_layers);
    if budget < *range.start() {
        bail!(Config,
            "a memory budget of {budget} layer(s) is too small for {n_layers} layers: the smallest achievable peak is {} (budgets for {n_layers} layers: {}..={n_layers})",
            range.start(),
            range.start()
        );
    }
    if budget > n_layers {
        bail!(Config,
            "a memory budget of {budget} layers is more than the {n_layers} layers there are: budgets for {n_layers} layers are {}..={n_layers} ({n_layers}: every activation kept, nothing recomputed)",
            range.start()
        );
    }
    Ok(())
}

/// Runs `f(args)` without recording its inside, as one node that recomputes
/// it during backward (see the module docs). `params` are the trainable
/// tensors `f` reads (leaves: their gradients accumulate directly during the
/// rerun); `rngs` the generators it draws from, replayed so the rerun draws
/// the same values. Non-tensor arguments are captured by the closure. Under
/// `no_grad` it simply runs `f`. Returns `f`'s output; errors are `f`'s
/// (during backward, the rerun's).
///
/// The gradients are the same bits as without checkpointing:
///
/// ```
/// use tinyllm::recompute::checkpoint;
/// use tinyllm::{Device, Tensor};
/// let w = Tensor::from_vec(vec![0.5, -1.0, 2.0, 0.25], &[2, 2], Device::Cpu)?.requires_grad_(true);
/// let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu)?.requires_grad_(true);
/// let f = {
///     let w = w.clone();
///     move |a: &[Tensor]| a[0].matmul(&w)?.silu()?.matmul(&w)
/// };
///
/// // plain: every intermediate value is kept for backward
/// f(&[x.clone()])?.sum_all()?.backward()?;
/// let (gw, gx) = (w.grad().unwrap().to_vec_f32()?, x.grad().unwrap().to_vec_f32()?);
/// w.zero_grad();
/// x.zero_grad();
///
/// // checkpointed: only `x` is kept; `f` runs again during backward
/// checkpoint(f, &[x.clone()], &[w.clone()], &[])?.sum_all()?.backward()?;
/// assert_eq!(w.grad().unwrap().to_vec_f32()?, gw);
/// assert_eq!(x.grad().unwrap().to_vec_f32()?, gx);
/// # Ok::<(), tinyllm::Error>(())
/// ```
pub fn checkpoint<F>(f: F, args: &[Tensor], params: &[Tensor], rngs: &[Generator]) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + 'static,
{
    recorded(f, args, params, rngs, Rerun::Segment)
}

/// What a checkpoint node reruns: how it keeps its arguments, and the
/// profile's name for the rerun's time.
#[derive(Clone, Copy)]
pub(crate) enum Rerun {
    /// Any function: its arguments kept as they are.
    Segment,
    /// An attention core (`(q, k, v) -> y`, no parameters): it reads its
    /// arguments only as operands of products, so they are kept as the
    /// products read them — rounded, in 16 bits, under autocast — as the
    /// plain forward pass's products keep them.
    AttentionCore,
}

impl Rerun {
    fn name(self) -> &'static str {
        match self {
            Rerun::Segment => "checkpointed segments",
            Rerun::AttentionCore => "attention core",
        }
    }
}

/// Runs an attention core `f(&[q, k, v])` as one node that keeps only q, k
/// and v (as its products read them) and reruns `f` during backward with
/// `rng` replayed, so the rerun's dropout mask is the forward pass's: the
/// attention half of [`Recompute::Attention`]. `f` must read its arguments
/// only as operands of matrix products (a product rounds its operands under
/// autocast, and rounding twice is rounding once: the rerun computes the
/// same bits from the kept 16-bit copies).
pub(crate) fn recompute_attention<F>(f: F, qkv: &[Tensor; 3], rng: &Generator) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + 'static,
{
    recorded(f, qkv, &[], std::slice::from_ref(rng), Rerun::AttentionCore)
}

/// [`checkpoint`] with its arguments kept as `how` says.
fn recorded<F>(
    f: F,
    args: &[Tensor],
    params: &[Tensor],
    rngs: &[Generator],
    how: Rerun,
) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + 'static,
{
    if !is_grad_enabled() {
        return f(args);
    }
    let before: Vec<_> = rngs.iter().map(|g| g.state()).collect();
    // the whole cast policy, replayed by the rerun
    let precision = cast_table();
    let out = {
        let _ng = no_grad();
        f(args)?
    };
    let n_params = params.len();
    let parents: Vec<&Tensor> = args.iter().chain(params.iter()).collect();
    let kept = args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let s = match how {
                Rerun::Segment => Saved::Full(a.detach().with_half(a.half())),
                // q and k as the scores' product reads them, v as p v does
                Rerun::AttentionCore => {
                    let class = [
                        OpClass::AttentionScores,
                        OpClass::AttentionScores,
                        OpClass::Matmul,
                    ][i.min(2)];
                    Saved::operand(a, precision.and_then(|t| t.product(class)))?
                }
            };
            Ok((s, a.requires_grad()))
        })
        .collect::<Result<Vec<_>>>()?;
    let rngs0 = rngs.to_vec();
    let held = out.half();
    Ok(Tensor::record(
        out.storage(),
        out.shape().to_vec(),
        "checkpoint",
        &parents,
        move |g| {
            // Replay the random streams from where the forward pass began; keep
            // where they had got to, to restore after the rerun.
            let reached: Vec<_> = rngs0.iter().map(|r| r.state()).collect();
            for (r, s) in rngs0.iter().zip(&before) {
                r.set_state(*s);
            }
            // Fresh leaves: the rerun's backward must stop here, not run into the
            // outer graph. One leaf per position, so a tensor passed twice gets one
            // gradient per use.
            let leaves = kept
                .iter()
                .map(|(s, rg)| {
                    let t = s.get()?;
                    Ok(t.detach().requires_grad_(*rg).with_half(t.half()))
                })
                .collect::<Result<Vec<Tensor>>>()?;
            drop(kept);
            let rerun = {
                let _gm = set_grad_enabled(true);
                let _ac = autocast(Scope::table(precision));
                let _traced = crate::trace::phase("recompute");
                let _timed = crate::profile::recompute(how.name());
                f(&leaves)
            };
            for (r, s) in rngs0.iter().zip(&reached) {
                r.set_state(*s);
            }
            let rerun = rerun?;
            if rerun.requires_grad() {
                rerun.backward_with(g)?;
            }
            // The parameters' gradients were accumulated by the rerun's backward:
            // they get `None` here.
            let mut grads: Vec<Option<Tensor>> = leaves.iter().map(|l| l.grad()).collect();
            grads.resize(n_params + leaves.len(), None);
            Ok(grads)
        },
    )
    // what is known of the values (a policy may `follow` it) is the output's
    .with_half(held))
}

/// The parameters of a run of layers.
fn params_of(layers: &[Rc<dyn Layer>]) -> Vec<Tensor> {
    layers.iter().flat_map(|l| l.parameters()).collect()
}

/// Runs `layers` on `x`, checkpointing every segment of
/// `checkpoint_schedule(layers.len(), mem_budget_layers)` but the last, which
/// runs normally (checkpointing it would only run it twice). `rngs` are the
/// generators the layers draw from (dropout), replayed on recompute. Errors
/// if there are no layers or the budget is below the smallest achievable peak
/// (see [`checkpoint_schedule`]), or if a layer errors.
pub fn checkpoint_sequential(
    layers: &[Rc<dyn Layer>],
    x: &Tensor,
    mem_budget_layers: usize,
    rngs: &[Generator],
) -> Result<Tensor> {
    let sched = checkpoint_schedule(layers.len(), mem_budget_layers)?;
    recompute_segments(layers, x, &sched, rngs)
}

/// [`checkpoint_sequential`] over any schedule: the segments start at
/// `starts` (ascending, the first 0, each a layer's index), every segment
/// but the last checkpointed. Errors on a schedule that does not split
/// `layers` so, or if a layer errors.
pub fn recompute_segments(
    layers: &[Rc<dyn Layer>],
    x: &Tensor,
    starts: &[usize],
    rngs: &[Generator],
) -> Result<Tensor> {
    let ascending = starts.windows(2).all(|w| w[0] < w[1]);
    if starts.first() != Some(&0) || !ascending || starts.last().is_some_and(|&s| s >= layers.len())
    {
        bail!(
            Config,
            "recomputed segments start at {starts:?}: they must ascend from 0 below {} layers",
            layers.len()
        );
    }
    let mut h = x.clone();
    for (j, &start) in starts.iter().enumerate() {
        let end = starts.get(j + 1).copied().unwrap_or(layers.len());
        let seg: Vec<Rc<dyn Layer>> = layers[start..end].to_vec();
        if j + 1 == starts.len() {
            for l in &seg {
                h = l.forward(&h)?;
            }
        } else {
            let params = params_of(&seg);
            h = checkpoint(
                move |a: &[Tensor]| {
                    let mut t = a[0].clone();
                    for l in &seg {
                        t = l.forward(&t)?;
                    }
                    Ok(t)
                },
                &[h],
                &params,
                rngs,
            )?;
        }
    }
    Ok(h)
}
