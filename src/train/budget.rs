//! The memory-budget planner (`--memory-budget 2GiB`): for the recipe's
//! batch it chooses the micro-batch size, the recompute policy and the
//! checkpoint budget whose planned peak ([`TrainConfig::memory_plan`]) fits
//! the budget and that recompute the least, or says the smallest budget
//! anything fits in.
//!
//! **Candidates.** Every micro-batch size that divides the batch (micro-batch
//! × accumulated micro-batches = the batch, which stays), every policy of
//! [`Recompute::ALL`], and for `blocks` and `both` every checkpoint budget
//! of [`budget_range`]. A flag given beside `--memory-budget` fixes its part
//! of the choice: `--micro-batch` or `--accum` the micro-batch,
//! `--recompute` (or `--[no-]checkpoint-activations`) the policy,
//! `--ckpt-budget` the checkpoint budget; the planner chooses the rest.
//!
//! **Cost.** What a policy repeats, in FLOPs of the products per optimizer
//! step, counted from the shapes (not timed). A block's forward is
//! `2·(4·C² + 3·C·F)` per token for its projections and `4·T·C` for
//! attention's two products; a checkpointed segment reruns its blocks once.
//! With dropout `attention` and `both` rerun every block's attention core
//! (its two products, `4·T·C` a token) once in backward. `--profile` counts
//! the same reruns and times them; the count leaves out the cores' softmax
//! and dropout work, so it understates their time (RESULTS.md compares the
//! two at the capstone). Without
//! dropout the fused attention recomputes its probabilities in backward
//! whatever the policy, so `attention` costs and saves nothing. The
//! cheapest candidate that fits wins; among equals, the fewest
//! micro-batches (fewer, larger passes), then the least recomputing
//! policy, then the lowest peak.

use crate::recompute::{budget_range, checkpoint_schedule, Recompute};
use crate::train::config::{TrainConfig, TrainOptions};
use crate::Result;

/// One (micro-batch, policy, checkpoint budget) the planner weighed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step (`batch / micro_batch`).
    pub accum: usize,
    /// What backward recomputes.
    pub recompute: Recompute,
    /// The checkpoint budget of `blocks` and `both` (`None` otherwise).
    pub ckpt_budget: Option<usize>,
    /// The planned peak in bytes ([`MemoryPlan::total`](crate::train::plan::MemoryPlan::total)).
    pub peak: usize,
    /// FLOPs recomputed per optimizer step.
    pub flops: f64,
    /// Blocks rerun by checkpointing, of the model's layers.
    pub blocks_rerun: usize,
    /// Attention cores rerun per micro-batch (with dropout only).
    pub cores_rerun: usize,
}

/// The planner's answer: the candidate chosen and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// The budget in bytes.
    pub budget: u64,
    /// The cheapest candidate that fits.
    pub chosen: Candidate,
    /// The smallest-peak candidate among those that recompute less than the
    /// chosen one (none fits): what the budget would need for less recomputation.
    pub cheaper: Option<Candidate>,
    /// FLOPs of one forward pass of the batch, the scale of the cost.
    pub forward_flops: f64,
    /// Candidates weighed, and how many fit.
    pub weighed: usize,
    /// How many fit.
    pub fitting: usize,
    /// The flags that fixed part of the choice, as given.
    pub fixed: Vec<&'static str>,
    /// The model's layers.
    pub layers: usize,
}

/// Parses a size: a number with an optional unit, binary `KiB`, `MiB`,
/// `GiB`, `TiB` or decimal `KB`, `MB`, `GB`, `TB` (case ignored, `B` or no
/// unit: bytes), e.g. `2GiB`, `1.5 GiB`, `512MiB`. Zero, a negative or a
/// malformed size is an error.
///
/// ```
/// use tinyllm::train::budget::parse_size;
/// assert_eq!(parse_size("2GiB")?, 2 << 30);
/// assert_eq!(parse_size("1.5 MiB")?, 3 << 19);
/// assert_eq!(parse_size("1000")?, 1000);
/// assert!(parse_size("0").is_err() && parse_size("abc").is_err());
/// # Ok::<(), tinyllm::Error>(())
/// ```
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => f64::NAN,
    };
    let bytes = num.parse::<f64>().map(|n| n * scale).unwrap_or(f64::NAN);
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        crate::bail!(
            Config,
            "{s:?} is not a size: expected a number with a unit, e.g. 2GiB, 512MiB or 1.5GB (or bytes)"
        );
    }
    if bytes < 1.0 {
        crate::bail!(Config, "{s:?} is no memory at all: give a budget above 0");
    }
    Ok(bytes as u64)
}

/// `b` bytes readably: GiB with two decimals from 1 GiB, MiB with one from
/// 10 MiB and two from 1 MiB, else KiB with one.
pub fn size(b: u64) -> String {
    let (div, dec, unit) = unit_of(b);
    format!("{:.*} {unit}", dec, b as f64 / div)
}

/// The unit [`size`] prints `b` in: its bytes, decimals and name.
fn unit_of(b: u64) -> (f64, usize, &'static str) {
    match b {
        b if b >= 1 << 30 => ((1u64 << 30) as f64, 2, "GiB"),
        b if b >= 10 << 20 => ((1u64 << 20) as f64, 1, "MiB"),
        b if b >= 1 << 20 => ((1u64 << 20) as f64, 2, "MiB"),
        _ => (1024.0, 1, "KiB"),
    }
}

/// FLOPs a forward pass spends per token in one block (`block`) and in one
/// attention core's products (`core`), at context `t`.
fn flops_per_token(cfg: &crate::nn::llama::LlamaConfig, t: usize) -> (f64, f64) {
    let (c, f, t) = (cfg.d_model as f64, cfg.hidden as f64, t as f64);
    let core = 4.0 * t * c;
    (2.0 * (4.0 * c * c + 3.0 * c * f) + core, core)
}

/// The candidate `micro`, `policy`, `ckpt` of the recipe `o` (its batch
/// `batch`), planned and costed; an error where the recipe refuses it.
fn weigh(
    o: &TrainOptions,
    batch: usize,
    micro: usize,
    policy: Recompute,
    ckpt: Option<usize>,
) -> Result<Candidate> {
    let cfg = TrainConfig::resolve(&apply(o, batch, micro, policy, ckpt))?;
    let m = &cfg.model;
    let (block, core) = flops_per_token(m, m.context);
    let tokens = (batch * m.context) as f64;
    let rerun = match cfg.ckpt_budget {
        Some(b) => {
            let s = checkpoint_schedule(m.n_layers, b)?;
            // every segment but the last is rerun
            s.last().copied().unwrap_or(0)
        }
        None => 0,
    };
    let cores = match (m.dropout > 0.0, policy.attention()) {
        // every block's once in backward; a rerun block's forward runs its
        // core again too, counted in `block`
        (true, true) => m.n_layers,
        _ => 0,
    };
    Ok(Candidate {
        micro_batch: cfg.micro_batch,
        accum: cfg.accum,
        recompute: policy,
        ckpt_budget: cfg.ckpt_budget,
        peak: cfg.memory_plan()?.total,
        flops: tokens * (rerun as f64 * block + cores as f64 * core),
        blocks_rerun: rerun,
        cores_rerun: cores,
    })
}

/// `o` with the planner's choice in place of the flags it chooses.
fn apply(
    o: &TrainOptions,
    batch: usize,
    micro: usize,
    policy: Recompute,
    ckpt: Option<usize>,
) -> TrainOptions {
    TrainOptions {
        batch: Some(batch),
        micro_batch: Some(micro),
        accum: None,
        recompute: Some(policy),
        checkpoint_activations: None,
        ckpt_budget: ckpt,
        ..o.clone()
    }
}

/// Chooses for the recipe `o` (resolved as `train` resolves it) the
/// micro-batch size, recompute policy and checkpoint budget that fit
/// `budget` bytes and recompute the least (see the module docs). An error
/// when nothing fits, naming the smallest budget that would and its choice,
/// or when `o` itself is not a valid recipe.
pub fn choose(o: &TrainOptions, budget: u64) -> Result<Choice> {
    let base = TrainConfig::resolve(o)?;
    let batch = base.batch;
    let mut fixed = Vec::new();
    let micros: Vec<usize> = if o.micro_batch.is_some() || o.accum.is_some() {
        fixed.push(if o.micro_batch.is_some() {
            "--micro-batch"
        } else {
            "--accum"
        });
        vec![base.micro_batch]
    } else {
        (1..=batch)
            .rev()
            .filter(|m| batch.is_multiple_of(*m))
            .collect()
    };
    let policies: Vec<Recompute> = match (o.recompute, o.checkpoint_activations) {
        (Some(p), _) => {
            fixed.push("--recompute");
            vec![p]
        }
        (None, Some(c)) => {
            fixed.push(match c {
                true => "--checkpoint-activations",
                false => "--no-checkpoint-activations",
            });
            Recompute::ALL
                .into_iter()
                .filter(|p| p.blocks() == c)
                .collect()
        }
        (None, None) => Recompute::ALL.to_vec(),
    };
    if o.ckpt_budget.is_some() {
        fixed.push("--ckpt-budget");
    }
    let mut all = Vec::new();
    for &m in &micros {
        for &p in &policies {
            let ckpts: Vec<Option<usize>> = match (p.blocks(), o.ckpt_budget) {
                // a fixed --ckpt-budget rules out the policies without blocks
                (false, Some(_)) => vec![],
                (false, None) => vec![None],
                (true, Some(b)) => vec![Some(b)],
                (true, None) => budget_range(base.model.n_layers).map(Some).collect(),
            };
            for ck in ckpts {
                all.push(weigh(o, batch, m, p, ck)?);
            }
        }
    }
    let order = |c: &Candidate| {
        let policy = Recompute::ALL.iter().position(|p| *p == c.recompute);
        (c.accum, policy, c.peak)
    };
    let cheapest = |v: &mut dyn Iterator<Item = Candidate>| {
        v.min_by(|a, b| a.flops.total_cmp(&b.flops).then(order(a).cmp(&order(b))))
    };
    let fits = |c: &Candidate| c.peak as u64 <= budget;
    let Some(chosen) = cheapest(&mut all.iter().copied().filter(fits)) else {
        let least = all.iter().copied().min_by_key(|c| (c.peak, order(c)));
        let fixed_note = match fixed.is_empty() {
            true => String::new(),
            false => format!(" (with {} as given)", fixed.join(", ")),
        };
        return Err(match least {
            Some(c) => crate::Error::config(format!(
                "--memory-budget {}: nothing fits{fixed_note}; the smallest plan is {}, {}: give --memory-budget {} or more",
                size(budget),
                size(c.peak as u64),
                describe(&c),
                // rounded up to what `size` prints
                round_up(c.peak as u64)
            )),
            None => crate::Error::config("--memory-budget: no candidate to weigh"),
        });
    };
    let cheaper = all
        .iter()
        .copied()
        .filter(|c| c.flops < chosen.flops)
        .min_by_key(|c| (c.peak, order(c)));
    let (block, _) = flops_per_token(&base.model, base.model.context);
    let head = 2.0 * (base.model.d_model * base.model.vocab_size) as f64;
    let tokens = (batch * base.model.context) as f64;
    Ok(Choice {
        budget,
        chosen,
        cheaper,
        forward_flops: tokens * (base.model.n_layers as f64 * block + head),
        weighed: all.len(),
        fitting: all.iter().filter(|c| fits(c)).count(),
        fixed,
        layers: base.model.n_layers,
    })
}

/// A budget that holds `b` bytes, as [`size`] would print it rounded up
/// (a flag's value: no space before the unit).
fn round_up(b: u64) -> String {
    let (div, dec, unit) = unit_of(b);
    let step = 10f64.powi(dec as i32);
    format!("{:.*}{unit}", dec, (b as f64 / div * step).ceil() / step)
}

/// `micro-batch 8 (4 per batch), recompute blocks at checkpoint budget 5`.
fn describe(c: &Candidate) -> String {
    let policy = match c.ckpt_budget {
        Some(b) => format!("recompute {} at checkpoint budget {b}", c.recompute),
        None => format!("recompute {}", c.recompute),
    };
    format!(
        "micro-batch {} ({} accumulated), {policy}",
        c.micro_batch, c.accum
    )
}

impl Choice {
    /// `o` with the choice in place of the flags it decides: what `train`
    /// and `compare` then run.
    pub fn apply(&self, o: &TrainOptions) -> TrainOptions {
        let c = &self.chosen;
        apply(
            o,
            c.micro_batch * c.accum,
            c.micro_batch,
            c.recompute,
            c.ckpt_budget,
        )
    }

    /// The choice and why, a few lines for the start of a run.
    pub fn explain(&self) -> String {
        let c = &self.chosen;
        let cost = match c.flops {
            0.0 => "recomputes nothing".to_string(),
            f => {
                let mut what = Vec::new();
                if c.blocks_rerun > 0 {
                    what.push(format!(
                        "{} of {} blocks rerun",
                        c.blocks_rerun, self.layers
                    ));
                }
                if c.cores_rerun > 0 {
                    what.push(format!("{} attention cores rerun", c.cores_rerun));
                }
                format!(
                    "recomputes {:.1} GFLOP a step ({}; {:.0} % of a forward pass)",
                    f / 1e9,
                    what.join(", "),
                    100.0 * f / self.forward_flops
                )
            }
        };
        let fixed = match self.fixed.is_empty() {
            true => String::new(),
            false => format!(", {} as given", self.fixed.join(", ")),
        };
        let why_not = match &self.cheaper {
            Some(d) => format!(
                "; recomputing less needs at least {}: {}",
                size(d.peak as u64),
                describe(d)
            ),
            None => String::new(),
        };
        format!(
            "memory budget {}: {}, planned peak {}\n  why: {} of {} candidates fit{fixed}; this one {cost}, then takes the fewest micro-batches{why_not}",
            size(self.budget),
            describe(c),
            size(c.peak as u64),
            self.fitting,
            self.weighed,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(preset: &str) -> TrainOptions {
        TrainOptions {
            preset: Some(preset.into()),
            ..Default::default()
        }
    }

    /// The plans of every candidate of `o`, for a budget between them.
    fn peaks(o: &TrainOptions) -> Vec<Candidate> {
        let huge = choose(o, u64::MAX).unwrap();
        assert_eq!(huge.fitting, huge.weighed);
        let mut v = Vec::new();
        let batch = TrainConfig::resolve(o).unwrap().batch;
        for m in (1..=batch).filter(|m| batch.is_multiple_of(*m)) {
            for p in Recompute::ALL {
                let ck = p.blocks().then_some(5);
                v.push(weigh(o, batch, m, p, ck).unwrap());
            }
        }
        v
    }

    #[test]
    fn a_roomy_budget_recomputes_nothing_in_one_pass() {
        let c = choose(&opts("capstone"), 64 << 30).unwrap();
        // capstone: a batch of 32
        assert_eq!(
            (c.chosen.micro_batch, c.chosen.accum, c.chosen.recompute),
            (32, 1, Recompute::None)
        );
        assert_eq!(c.chosen.flops, 0.0);
        assert!(
            c.explain().contains("recomputes nothing"),
            "{}",
            c.explain()
        );
        // what it chose is what it runs
        let cfg = TrainConfig::resolve(&c.apply(&opts("capstone"))).unwrap();
        assert_eq!(cfg.memory_plan().unwrap().total, c.chosen.peak);
    }

    #[test]
    fn a_tighter_budget_takes_smaller_micro_batches_before_recomputing() {
        let o = opts("capstone");
        let all = peaks(&o);
        let none = |m: usize| {
            all.iter()
                .find(|c| c.micro_batch == m && c.recompute == Recompute::None)
                .unwrap()
                .peak as u64
        };
        // just under micro-batch 32's plan: micro-batch 16, still nothing rerun
        let c = choose(&o, none(32) - 1).unwrap();
        assert_eq!(
            (c.chosen.micro_batch, c.chosen.recompute),
            (16, Recompute::None)
        );
        // under micro-batch 1's plan without recompute: checkpointing, and
        // the explanation says recomputing less does not fit
        let c = choose(&o, none(1) - 1).unwrap();
        assert!(c.chosen.recompute.blocks(), "{c:?}");
        assert!((c.chosen.peak as u64) < none(1));
        let e = c.explain();
        assert!(
            e.contains("recomputing less needs at least") && e.contains("4 of 8 blocks rerun"),
            "{e}"
        );
    }

    #[test]
    fn attention_recompute_is_chosen_only_where_dropout_makes_it_pay() {
        // without dropout `attention` saves nothing: never chosen over `none`
        let c = choose(&opts("small"), 64 << 30).unwrap();
        assert_eq!(c.chosen.recompute, Recompute::None);
        let mut o = opts("capstone");
        o.dropout = Some(0.1);
        let all = peaks(&o);
        let at = |m: usize, p: Recompute| {
            *all.iter()
                .find(|c| c.micro_batch == m && c.recompute == p)
                .unwrap()
        };
        // with dropout the attention cores are costly to keep and cheap to
        // rerun: at a fixed micro-batch, a budget between the two policies'
        // plans takes `attention`
        let (none, attn) = (at(8, Recompute::None), at(8, Recompute::Attention));
        assert!(attn.peak < none.peak && attn.flops < at(8, Recompute::Blocks).flops);
        o.micro_batch = Some(8);
        let c = choose(&o, none.peak as u64 - 1).unwrap();
        assert_eq!(c.chosen.recompute, Recompute::Attention, "{c:?}");
        assert!(
            c.explain().contains("8 attention cores rerun"),
            "{}",
            c.explain()
        );
    }

    #[test]
    fn nothing_fits_names_the_smallest_budget_that_would() {
        let e = choose(&opts("small"), 1 << 20).unwrap_err().to_string();
        assert!(
            e.contains("--memory-budget 1.00 MiB: nothing fits; the smallest plan is 15.0 MiB")
                && e.contains(
                    "micro-batch 1 (16 accumulated), recompute blocks at checkpoint budget 3"
                )
                && e.contains("or more"),
            "{e}"
        );
        // the budget it names fits
        let named = e.split("give --memory-budget ").nth(1).unwrap();
        let named = parse_size(named.split(' ').next().unwrap()).unwrap();
        assert!(choose(&opts("small"), named).is_ok());
    }

    #[test]
    fn flags_given_fix_their_part_of_the_choice() {
        let mut o = opts("small");
        o.micro_batch = Some(8);
        let c = choose(&o, 64 << 30).unwrap();
        assert_eq!((c.chosen.micro_batch, c.chosen.accum), (8, 2));
        assert!(
            c.explain().contains("--micro-batch as given"),
            "{}",
            c.explain()
        );
        o.recompute = Some(Recompute::Blocks);
        let c = choose(&o, 64 << 30).unwrap();
        assert_eq!(c.chosen.recompute, Recompute::Blocks);
        // without dropout `both` reruns blocks only: no attention core
        let both = TrainOptions {
            recompute: Some(Recompute::Both),
            ckpt_budget: Some(3),
            ..o.clone()
        };
        let e = choose(&both, 64 << 30).unwrap().explain();
        assert!(
            e.contains("2 of 4 blocks rerun") && !e.contains("attention cores"),
            "{e}"
        );
        let e = choose(&o, 1 << 20).unwrap_err().to_string();
        assert!(
            e.contains("(with --micro-batch, --recompute as given)"),
            "{e}"
        );
    }

    #[test]
    fn sizes_parse_and_refuse_clearly() {
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("2 gib").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("300MiB").unwrap(), 300 << 20);
        for bad in ["abc", "", "2XB", "-1GiB", "1e3", "1.2.3MiB"] {
            let e = parse_size(bad).unwrap_err().to_string();
            assert!(e.contains("is not a size"), "{bad}: {e}");
        }
        let e = parse_size("0").unwrap_err().to_string();
        assert!(e.contains("above 0"), "{e}");
        assert_eq!(size(3 << 29), "1.50 GiB");
        assert_eq!(round_up((1 << 30) + 1), "1.01GiB");
        assert_eq!(round_up(5 << 20), "5.00MiB");
        assert_eq!(round_up((20 << 20) + 1), "20.1MiB");
        assert_eq!(size(1536), "1.5 KiB");
    }
}
