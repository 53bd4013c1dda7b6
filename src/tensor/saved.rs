//! What an op keeps for its backward: the tensor as it is, or — when every
//! value it holds (or every value backward reads of it) is a bf16 or fp16
//! value — its 16-bit copy, widened exactly when backward reads it.
//!
//! Two ways in, by what backward reads:
//! * [`Saved::keep`]: backward reads the values themselves. Kept in 16 bits
//!   when the op that made the tensor rounded it (a matmul under autocast, a
//!   cast: [`Tensor::half`]); the CPU reference checks that packing changed
//!   no value and errors if it did.
//! * [`Saved::operand`]: backward reads the tensor only as an operand of a
//!   product that rounds its operands to `fmt` (a matmul under autocast).
//!   Rounding twice is rounding once, so keeping the rounded values changes
//!   no bit of what backward computes.
//!
//! Leaves (weights, inputs) are never copied: they are shared with whoever
//! made them and cost nothing to keep. The 16-bit copy is made once per
//! tensor and shared by every op that saves it (q, k and v all save the
//! norm's output).

use super::Tensor;
use crate::backend::pack::Packed;
use crate::backend::round::Format;
use crate::backend::{Operand, Storage};
use crate::{bail, Result};
use std::rc::Rc;

/// An operand of a matrix product (`ops::matmul::product`): a buffer (values,
/// or a 16-bit copy) and the shape it holds.
#[derive(Clone)]
pub(crate) struct Arg<'a> {
    pub op: Operand,
    pub shape: &'a [usize],
}

impl Tensor {
    /// This tensor as an operand of a matrix product.
    pub(crate) fn arg(&self) -> Arg<'_> {
        Arg {
            op: Operand::Values(self.storage()),
            shape: self.shape(),
        }
    }
}

/// `t`'s 16-bit copy in format `f`, if made.
fn cached(t: &Tensor, f: Format) -> Option<Packed> {
    let cell = t.0.packed.borrow().clone();
    let p = cell.borrow().clone().filter(|p| p.format() == f);
    p
}

/// A tensor kept for backward.
pub(crate) enum Saved {
    /// Shared with the forward pass (no copy).
    Full(Tensor),
    /// A 16-bit copy.
    Half { packed: Packed, shape: Vec<usize> },
}

/// How one tensor is to be kept: shared, or a 16-bit copy of format `f`
/// (`exact`: `t` claims to hold only `f`'s values, and the CPU checks it).
pub(crate) enum Keep<'a> {
    Shared(&'a Tensor),
    Half(&'a Tensor, Format, bool),
}

impl Keep<'_> {
    /// For a backward that reads `t`'s values: in 16 bits when `t` is known
    /// to hold only values of a 16-bit format.
    pub(crate) fn values(t: &Tensor) -> Keep<'_> {
        match t.half() {
            Some(f) if !t.is_leaf() => Keep::Half(t, f, true),
            _ => Keep::Shared(t),
        }
    }

    /// For a backward that reads `t` only as an operand of products rounded
    /// to `round`: its rounded values, in 16 bits (`t` as it is when nothing
    /// rounds, or `t` is a leaf).
    pub(crate) fn operand(t: &Tensor, round: Option<Format>) -> Keep<'_> {
        match round {
            Some(f) if !t.is_leaf() => Keep::Half(t, f, t.half() == Some(f)),
            _ => Keep::Shared(t),
        }
    }
}

impl Saved {
    /// Keeps `t` for a backward that reads its values ([`Keep::values`]).
    pub(crate) fn keep(t: &Tensor) -> Result<Saved> {
        Saved::one(Keep::values(t))
    }

    /// Keeps `t` for a backward that reads it only as an operand of products
    /// rounded to `round` ([`Keep::operand`]).
    pub(crate) fn operand(t: &Tensor, round: Option<Format>) -> Result<Saved> {
        Saved::one(Keep::operand(t, round))
    }

    /// Keeps an op's own output `t` for its backward: in 16 bits when the op
    /// stored it in a 16-bit format (`t.half()`: a cast policy's), shared
    /// as it is otherwise.
    pub(crate) fn output(t: &Tensor) -> Result<Saved> {
        Saved::one(match t.half() {
            Some(f) => Keep::Half(t, f, true),
            None => Keep::Shared(t),
        })
    }

    /// The format keeping `k` would pack its tensor into, where that copy is
    /// still to be made: the op reading the tensor can write it as it goes
    /// (`Storage::matmul_keeping_a`, `Storage::swiglu_keeping`) and hand it
    /// over ([`adopt`](Saved::adopt)) before it keeps the tensor.
    pub(crate) fn to_pack(k: Keep) -> Option<Format> {
        let halves = Saved::halves();
        match k {
            Keep::Half(t, f, _) if halves && cached(t, f).is_none() => Some(f),
            _ => None,
        }
    }

    /// Takes `p`, `t` packed (with the count of values its rounding changed,
    /// where the device counts), as `t`'s 16-bit copy; an error where `t`
    /// claims to hold only `p`'s format's values and some changed.
    pub(crate) fn adopt(t: &Tensor, p: Packed, changed: Option<usize>) -> Result<()> {
        let exact = t.half() == Some(p.format());
        Saved::adopt_claimed(t, p, changed, exact)
    }

    /// [`adopt`](Saved::adopt), `exact` saying whether `t` claims to hold
    /// only values of `p`'s format.
    fn adopt_claimed(t: &Tensor, p: Packed, changed: Option<usize>, exact: bool) -> Result<()> {
        let f = p.format();
        if exact && changed.unwrap_or(0) > 0 {
            bail!(
                Numerical,
                "a tensor {:?} marked as holding {f} values has {} that are not: \
                 16-bit storage would lose them",
                t.shape(),
                changed.unwrap_or(0)
            );
        }
        let cell = t.0.packed.borrow().clone();
        *cell.borrow_mut() = Some(p);
        Ok(())
    }

    fn one(k: Keep) -> Result<Saved> {
        let [s] = Saved::all([k])?;
        Ok(s)
    }

    /// Keeps several tensors at once, as [`keep`](Saved::keep) and
    /// [`operand`](Saved::operand) keep each one: the 16-bit copies not
    /// made before are packed together (on a GPU, a few to a dispatch).
    pub(crate) fn all<const N: usize>(ks: [Keep; N]) -> Result<[Saved; N]> {
        // Nothing is recorded without grad mode: the closure holding these
        // is dropped at once, so a copy would be wasted.
        let halves = Saved::halves();
        // the tensors to pack, each once, by format
        let mut todo: Vec<(&Tensor, Format, bool)> = Vec::new();
        for k in &ks {
            if let (true, Keep::Half(t, f, exact)) = (halves, k) {
                let seen = todo
                    .iter()
                    .any(|(u, g, _)| Rc::ptr_eq(&u.0, &t.0) && g == f);
                if !seen && cached(t, *f).is_none() {
                    todo.push((t, *f, *exact));
                }
            }
        }
        for f in [Format::Bf16, Format::Fp16] {
            let group: Vec<_> = todo.iter().filter(|(_, g, _)| *g == f).collect();
            let storages: Vec<_> = group.iter().map(|(t, ..)| t.storage()).collect();
            let packed = Storage::pack_many(&storages.iter().collect::<Vec<_>>(), f)?;
            for ((t, _, exact), (p, changed)) in group.into_iter().zip(packed) {
                Saved::adopt_claimed(t, p, changed, *exact)?;
            }
        }
        Ok(ks.map(|k| match k {
            Keep::Half(t, f, _) if halves => Saved::Half {
                packed: cached(t, f).expect("packed above"),
                shape: t.shape().to_vec(),
            },
            Keep::Half(t, ..) | Keep::Shared(t) => Saved::Full(t.detach()),
        }))
    }

    /// Whether autograd keeps 16-bit copies now (grad mode on, no test hook
    /// keeping every saved tensor in float32).
    pub(crate) fn halves() -> bool {
        super::is_grad_enabled() && !saved_float32_only()
    }

    /// An operand an op wrote for its own backward (values, or 16-bit
    /// words), holding `shape`.
    pub(crate) fn of_operand(op: Operand, shape: &[usize]) -> Result<Saved> {
        Ok(match op {
            Operand::Values(s) => Saved::Full(Tensor::from_storage(s, shape)?),
            Operand::Half(packed) => Saved::Half {
                packed,
                shape: shape.to_vec(),
            },
        })
    }

    /// The kept values as a product reads them: the tensor's buffer, or the
    /// 16-bit copy (widened by the product itself, never written out).
    pub(crate) fn arg(&self) -> Arg<'_> {
        match self {
            Saved::Full(t) => t.arg(),
            Saved::Half { packed, shape } => Arg {
                op: Operand::Half(packed.clone()),
                shape,
            },
        }
    }

    /// The kept values as a float32 tensor (a constant).
    pub(crate) fn get(&self) -> Result<Tensor> {
        match self {
            Saved::Full(t) => Ok(t.clone()),
            Saved::Half { packed, shape } => {
                Ok(Tensor::from_storage(packed.unpack()?, shape)?.with_half(Some(packed.format())))
            }
        }
    }
}

// A test hook, reached through `testing`: while on, every saved tensor stays
// in float32 (the reference 16-bit saved activations must match bit for bit).
#[cfg(feature = "test-hooks")]
thread_local! {
    static SAVED_FLOAT32: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, autograd keeps every saved tensor in float32 on this thread.
#[cfg(feature = "test-hooks")]
pub struct SavedFloat32 {
    prev: bool,
}

#[cfg(feature = "test-hooks")]
impl Drop for SavedFloat32 {
    fn drop(&mut self) {
        SAVED_FLOAT32.with(|w| w.set(self.prev));
    }
}

/// Keeps every tensor autograd saves in float32 on this thread until the
/// guard drops: the reference that 16-bit saved activations must match bit
/// for bit.
#[cfg(feature = "test-hooks")]
pub fn saved_in_float32() -> SavedFloat32 {
    SavedFloat32 {
        prev: SAVED_FLOAT32.with(|w| w.replace(true)),
    }
}

/// Whether [`saved_in_float32`] is in force on this thread.
#[cfg(feature = "test-hooks")]
fn saved_float32_only() -> bool {
    SAVED_FLOAT32.with(std::cell::Cell::get)
}

#[cfg(not(feature = "test-hooks"))]
fn saved_float32_only() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    /// A tensor claimed to hold bf16 values that does not is refused, not
    /// packed with a loss; a true claim packs into half the bytes and
    /// widens to the same bits.
    #[test]
    fn a_false_claim_of_16_bit_values_is_an_error() {
        let w = Tensor::from_vec(vec![1.0, 1.0 + 2f32.powi(-10), -3.5], &[3], Device::Cpu)
            .unwrap()
            .requires_grad_(true);
        let lie = w.mul_scalar(1.0).unwrap().with_half(Some(Format::Bf16));
        let e = Saved::keep(&lie).err().expect("packing a non-bf16 value");
        assert!(e.to_string().contains("1 that are not"), "{e}");

        let truth = crate::precision::cast(&w, Format::Bf16).unwrap();
        let kept = Saved::keep(&truth).unwrap();
        let Saved::Half { packed, .. } = &kept else {
            panic!("a cast's output is kept in 16 bits")
        };
        assert_eq!(packed.bytes(), 4 * 2); // three values in two words
        let back = kept.get().unwrap().to_vec_f32().unwrap();
        let want = truth.to_vec_f32().unwrap();
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // A leaf is shared, never copied.
        assert!(matches!(Saved::keep(&w).unwrap(), Saved::Full(_)));
    }
}
