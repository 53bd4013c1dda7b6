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
use crate::backend::Operand;
use crate::{bail, Result};

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

/// A tensor kept for backward.
pub(crate) enum Saved {
    /// Shared with the forward pass (no copy).
    Full(Tensor),
    /// A 16-bit copy.
    Half { packed: Packed, shape: Vec<usize> },
}

impl Saved {
    /// Keeps `t` for a backward that reads its values: in 16 bits when `t`
    /// is known to hold only values of a 16-bit format.
    pub(crate) fn keep(t: &Tensor) -> Result<Saved> {
        match t.half() {
            Some(f) if !t.is_leaf() => Saved::half(t, f, true),
            _ => Ok(Saved::Full(t.detach())),
        }
    }

    /// Keeps `t` for a backward that reads it only as an operand of products
    /// rounded to `round`: its rounded values, in 16 bits (`t` as it is when
    /// nothing rounds, or `t` is a leaf).
    pub(crate) fn operand(t: &Tensor, round: Option<Format>) -> Result<Saved> {
        match round {
            Some(f) if !t.is_leaf() => Saved::half(t, f, t.half() == Some(f)),
            _ => Ok(Saved::Full(t.detach())),
        }
    }

    /// Keeps an op's own output `t` for its backward: in 16 bits when the op
    /// stored it in a 16-bit format (`t.half()`: a cast policy's), shared
    /// as it is otherwise.
    pub(crate) fn output(t: &Tensor) -> Result<Saved> {
        match t.half() {
            Some(f) => Saved::half(t, f, true),
            None => Ok(Saved::Full(t.clone())),
        }
    }

    fn half(t: &Tensor, f: Format, exact: bool) -> Result<Saved> {
        // Nothing is recorded without grad mode: the closure holding this is
        // dropped at once, so a copy would be wasted.
        if !super::is_grad_enabled() {
            return Ok(Saved::Full(t.detach()));
        }
        #[cfg(feature = "test-hooks")]
        if saved_float32_only() {
            return Ok(Saved::Full(t.detach()));
        }
        let cell = t.0.packed.borrow().clone();
        let cached = cell.borrow().clone().filter(|p| p.format() == f);
        let packed = match cached {
            Some(p) => p,
            None => {
                let (p, changed) = t.storage().pack(f)?;
                if exact && changed.unwrap_or(0) > 0 {
                    bail!(
                        Numerical,
                        "a tensor {:?} marked as holding {f} values has {} that are not: \
                         16-bit storage would lose them",
                        t.shape(),
                        changed.unwrap_or(0)
                    );
                }
                *cell.borrow_mut() = Some(p.clone());
                p
            }
        };
        Ok(Saved::Half {
            packed,
            shape: t.shape().to_vec(),
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
