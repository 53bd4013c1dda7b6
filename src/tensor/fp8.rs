//! fp8 with per-tensor delayed scaling: the recipe's state (amax
//! histories, scales) and the scope that turns it on for the Linear layers
//! of this thread. The ops that read it live in [`ops::fp8`](crate::ops::fp8).
//!
//! ## The recipe ("hybrid", delayed scaling)
//! Every fp8 matrix product `x Wᵀ` has three scaled tensors: its input `x`
//! and weight `W`, cast to E4M3 in forward, and the gradient of its output,
//! cast to E5M2 in backward. A cast with scale `s` is `q = rd(v·s)`, the
//! product reading `q/s`; `s` is a power of two, so `v·s` and `q/s` are exact
//! (no bits are lost or invented by scaling, only by `rd`).
//!
//! The scale is *delayed*: a step uses the scales computed after the steps
//! before it. During a step each tensor's amax (`max |v|`, a device
//! reduction) is recorded; after the optimizer step it is appended to the
//! tensor's history (the last `history` amaxes), and the new scale is
//! `2^(floor(log2(fmax / a)) − margin)`, `a` the history's `max` (or its most
//! recent entry), `fmax` the format's largest value. An amax of zero or a
//! non-finite one keeps the scale it had (there is nothing to fit, or the
//! value is not trusted); a fresh tensor starts at scale 1. The exponent is
//! clamped to ±[`MAX_EXP`] so `q/s` stays a normal f32 (a device that flushes
//! subnormals computes the same).
//!
//! A value whose scaled magnitude exceeds `fmax` saturates to ±`fmax` (in
//! both formats: E5M2's rounding alone would give inf, which would make the
//! whole step's gradients non-finite); each is counted (a device reduction
//! as well) and the step reports the count.
//!
//! Tensors are keyed by the Linear's weight: the first product a weight
//! feeds in a run gets the next slot, so a run that builds the same model
//! visits them in the same order, and the state saved by index resumes.

use crate::backend::round::Fp8;
use crate::backend::{BinaryLayout, BinaryOp, Storage};
use crate::{bail, Result};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// The largest |exponent| of a scale: `q/s` for the smallest fp8 subnormal
/// (2^-16) times 2^`MAX_EXP` stays a normal f32.
pub const MAX_EXP: i32 = 100;

/// How a history of amaxes becomes the amax a scale is fitted to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AmaxReduction {
    /// The largest amax in the history.
    Max,
    /// The latest amax.
    MostRecent,
}

impl std::str::FromStr for AmaxReduction {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "max" => Ok(AmaxReduction::Max),
            "most_recent" => Ok(AmaxReduction::MostRecent),
            _ => bail!(
                Config,
                "unknown amax reduction {s:?}: expected max or most_recent"
            ),
        }
    }
}

/// The recipe's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fp8Config {
    /// How many amaxes each history keeps (at least 1).
    pub history: usize,
    /// How the history is reduced.
    pub reduction: AmaxReduction,
    /// Powers of two of headroom below the format's maximum.
    pub margin: u32,
}

impl Default for Fp8Config {
    fn default() -> Self {
        Fp8Config {
            history: 16,
            reduction: AmaxReduction::Max,
            margin: 0,
        }
    }
}

/// One scaled tensor: its history (oldest first) and its scale, both as f32
/// bits so a checkpoint resumes them exactly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScaledTensor {
    /// The format the tensor is cast to.
    pub format: Fp8,
    /// The recorded amaxes, oldest first, as f32 bits.
    pub history: Vec<u32>,
    /// The scale, as f32 bits.
    pub scale: u32,
}

impl ScaledTensor {
    fn new(format: Fp8) -> ScaledTensor {
        ScaledTensor {
            format,
            history: Vec::new(),
            scale: 1f32.to_bits(),
        }
    }
    /// The scale the next cast uses.
    pub fn scale(&self) -> f32 {
        f32::from_bits(self.scale)
    }
}

/// The history reduced per `reduction` (`None` when empty).
pub fn reduce_history(history: &[f32], reduction: AmaxReduction) -> Option<f32> {
    match reduction {
        // f32::max ignores a NaN entry; an inf one wins and keeps the scale
        AmaxReduction::Max => history.iter().copied().reduce(f32::max),
        AmaxReduction::MostRecent => history.last().copied(),
    }
}

/// The power of two `2^(floor(log2(fmax / amax)) − margin)`, exponent
/// clamped to ±[`MAX_EXP`]; `prev` when `amax` is zero or not finite.
pub fn scale_for(amax: f32, fmax: f32, margin: u32, prev: f32) -> f32 {
    if !(amax > 0.0 && amax.is_finite()) {
        return prev;
    }
    // fmax / amax in f64 cannot round across a power of two (two 24-bit
    // significands' quotient is at least 2^-48 relatively away from one), so
    // its exponent field is floor(log2) exactly.
    let ratio = fmax as f64 / amax as f64;
    let e = ((ratio.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let e = (e - margin as i32).clamp(-MAX_EXP, MAX_EXP);
    f32::from_bits(((e + 127) as u32) << 23)
}

/// What a step recorded for one tensor, on the device: the running max of
/// its amaxes and the running count of its saturations.
#[derive(Default)]
struct Pending {
    amax: Option<Storage>,
    saturated: Option<Storage>,
}

/// The whole recipe's state: settings, every tensor's history and scale,
/// and what the current step recorded.
pub struct DelayedScaling {
    config: Fp8Config,
    /// Three per product, in slot order: input, weight, output gradient.
    tensors: Vec<ScaledTensor>,
    /// Weight id → product slot (rebuilt by a run, not saved).
    slots: HashMap<usize, usize>,
    pending: Vec<Pending>,
    saturated_total: u64,
}

/// The role of a scaled tensor in its product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The product's input, E4M3.
    Input = 0,
    /// The weight, E4M3.
    Weight = 1,
    /// The gradient of the output, E5M2 (the hybrid recipe).
    Grad = 2,
}

impl Role {
    /// The format the role is cast to.
    pub fn format(self) -> Fp8 {
        match self {
            Role::Input | Role::Weight => Fp8::E4M3,
            Role::Grad => Fp8::E5M2,
        }
    }
}

/// The serialisable part of [`DelayedScaling`]: settings, histories, scales.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fp8State {
    /// The settings.
    pub config: Fp8Config,
    /// Every scaled tensor, three per product in slot order.
    pub tensors: Vec<ScaledTensor>,
    /// Saturated values counted since the run began.
    #[serde(default)]
    pub saturated_total: u64,
}

/// What [`DelayedScaling::update`] found in the step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fp8Report {
    /// Values whose scaled magnitude exceeded their format's maximum.
    pub saturated: u64,
}

impl DelayedScaling {
    /// A fresh recipe; errors on a history of 0.
    pub fn new(config: Fp8Config) -> Result<DelayedScaling> {
        if config.history == 0 {
            bail!(Config, "--amax-history must be at least 1, got 0");
        }
        Ok(DelayedScaling {
            config,
            tensors: Vec::new(),
            slots: HashMap::new(),
            pending: Vec::new(),
            saturated_total: 0,
        })
    }

    /// The settings.
    pub fn config(&self) -> Fp8Config {
        self.config
    }

    /// Every scaled tensor, three per product in slot order.
    pub fn tensors(&self) -> &[ScaledTensor] {
        &self.tensors
    }

    /// Saturated values counted since the run began.
    pub fn saturated_total(&self) -> u64 {
        self.saturated_total
    }

    /// The product slot of the weight with id `key`, assigned on first use.
    pub fn slot(&mut self, key: usize) -> usize {
        let next = self.slots.len();
        let slot = *self.slots.entry(key).or_insert(next);
        while self.tensors.len() < 3 * (slot + 1) {
            let role = [Role::Input, Role::Weight, Role::Grad][self.tensors.len() % 3];
            self.tensors.push(ScaledTensor::new(role.format()));
            self.pending.push(Pending::default());
        }
        slot
    }

    /// The scale of `role` in product `slot`.
    pub fn scale(&self, slot: usize, role: Role) -> f32 {
        self.tensors[3 * slot + role as usize].scale()
    }

    /// Adds one cast's amax and saturation count (1-element device values)
    /// to what the step recorded for `role` in `slot`: the max of the
    /// amaxes, the sum of the counts.
    pub fn record(
        &mut self,
        slot: usize,
        role: Role,
        amax: Storage,
        saturated: Storage,
    ) -> Result<()> {
        let one = BinaryLayout::flat(1);
        let p = &mut self.pending[3 * slot + role as usize];
        p.amax = Some(match p.amax.take() {
            Some(a) => a.binary(&amax, BinaryOp::Maximum, &one)?,
            None => amax,
        });
        p.saturated = Some(match p.saturated.take() {
            Some(c) => c.binary(&saturated, BinaryOp::Add, &one)?,
            None => saturated,
        });
        Ok(())
    }

    /// After the optimizer step: every tensor's recorded amax joins its
    /// history, and its scale is fitted to the reduced history.
    pub fn update(&mut self) -> Result<Fp8Report> {
        let mut report = Fp8Report::default();
        let (len, reduction, margin) = (
            self.config.history,
            self.config.reduction,
            self.config.margin,
        );
        for (t, p) in self.tensors.iter_mut().zip(&mut self.pending) {
            let Some(amax) = p.amax.take() else { continue };
            if let Some(c) = p.saturated.take() {
                report.saturated += c.to_vec_f32()?[0] as u64;
            }
            t.history.push(amax.to_vec_f32()?[0].to_bits());
            if t.history.len() > len {
                t.history.drain(..t.history.len() - len);
            }
            let history: Vec<f32> = t.history.iter().map(|&b| f32::from_bits(b)).collect();
            if let Some(a) = reduce_history(&history, reduction) {
                t.scale = scale_for(a, t.format.max(), margin, t.scale()).to_bits();
            }
        }
        self.saturated_total += report.saturated;
        Ok(report)
    }

    /// Drops what the current step recorded (a step that did not finish).
    pub fn discard_pending(&mut self) {
        for p in &mut self.pending {
            *p = Pending::default();
        }
    }

    /// The settings, histories and scales, for a checkpoint.
    pub fn state(&self) -> Fp8State {
        Fp8State {
            config: self.config,
            tensors: self.tensors.clone(),
            saturated_total: self.saturated_total,
        }
    }

    /// A recipe resumed from `state`: products get their slots again as a run
    /// first visits them, in the order they were saved.
    pub fn from_state(state: &Fp8State) -> Result<DelayedScaling> {
        let mut d = DelayedScaling::new(state.config)?;
        if !state.tensors.len().is_multiple_of(3) {
            bail!(
                Config,
                "fp8 state: {} scaled tensors, not three per product",
                state.tensors.len()
            );
        }
        d.tensors = state.tensors.clone();
        d.pending = d.tensors.iter().map(|_| Pending::default()).collect();
        d.saturated_total = state.saturated_total;
        Ok(d)
    }
}

thread_local! {
    static ACTIVE: RefCell<Vec<Rc<RefCell<DelayedScaling>>>> = const { RefCell::new(Vec::new()) };
}

/// While alive, the Linear layers on this thread run their products in fp8
/// with `recipe`'s scales (see the module docs).
#[must_use = "fp8 ends when the guard is dropped"]
pub struct Fp8Guard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for Fp8Guard {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().pop());
    }
}

/// Turns fp8 on for this thread's Linear layers until the guard drops.
pub fn fp8_scope(recipe: &Rc<RefCell<DelayedScaling>>) -> Fp8Guard {
    ACTIVE.with(|a| a.borrow_mut().push(recipe.clone()));
    Fp8Guard {
        _not_send: std::marker::PhantomData,
    }
}

/// The recipe in force on this thread, if any.
pub fn active() -> Option<Rc<RefCell<DelayedScaling>>> {
    ACTIVE.with(|a| a.borrow().last().cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_is_the_power_of_two_below_the_ratio() {
        // 448 / 3 = 149.3: 2^7
        assert_eq!(scale_for(3.0, 448.0, 0, 1.0), 128.0);
        assert_eq!(scale_for(3.0, 448.0, 2, 1.0), 32.0);
        // an exact power-of-two ratio keeps its exponent
        assert_eq!(scale_for(448.0 / 4.0, 448.0, 0, 1.0), 4.0);
        assert_eq!(scale_for(1000.0, 448.0, 0, 1.0), 0.25);
        // nothing to fit: the previous scale
        assert_eq!(scale_for(0.0, 448.0, 0, 8.0), 8.0);
        assert_eq!(scale_for(f32::INFINITY, 448.0, 0, 8.0), 8.0);
        assert_eq!(scale_for(f32::NAN, 448.0, 0, 8.0), 8.0);
        // clamped
        assert_eq!(scale_for(1e-38, 448.0, 0, 1.0), 2f32.powi(MAX_EXP));
    }

    #[test]
    fn history_reductions() {
        let h = [8.0, 1.0];
        assert_eq!(reduce_history(&h, AmaxReduction::Max), Some(8.0));
        assert_eq!(reduce_history(&h, AmaxReduction::MostRecent), Some(1.0));
        assert_eq!(reduce_history(&[], AmaxReduction::Max), None);
    }

    #[test]
    fn a_history_of_zero_is_refused_naming_the_flag() {
        let e = DelayedScaling::new(Fp8Config {
            history: 0,
            ..Default::default()
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("--amax-history"), "{e}");
    }
}
