//! The autocast state: which cast policy, if any, the ops on this thread
//! follow — the format each op class stores its output in (matmuls also
//! round their operands). It lives here, below the ops that read it;
//! [`precision`](crate::precision) builds the user-facing scope on it.
//!
//! The state is a stack of the live scopes, innermost last; the innermost
//! one's policy applies. A guard removes its own scope, wherever it sits, so
//! guards dropped out of order (the outer one first, say by moving it into a
//! `drop` call) still leave, once all are gone, autocast as it was before them.
//!
//! ## Cast policies
//! A [`CastTable`] gives each [`OpClass`] a [`Rule`]: keep its output in
//! float32, store it in bf16 or fp16, or follow its inputs. What storing in
//! a format means is the same for every class, the emulated storage
//! conversion of `cast`: the op's output is rounded to the format (and is
//! what the op's backward reads of it), and the gradient that arrives for
//! that output is rounded to the format too (a 16-bit tensor's gradient is a
//! 16-bit tensor). A matmul-like class (`matmul`, `attention_scores`) also
//! rounds its operands, today's `cast(cast(a) @ cast(b))`. The built-ins:
//!
//! | class | `matmuls` | `torch` | `pure` |
//! |---|---|---|---|
//! | `matmul` | low | low | low |
//! | `attention_scores` | low | low | low |
//! | `attention_probs` | f32 | f32 | low |
//! | `softmax` | f32 | f32 | low |
//! | `rms_norm` | f32 | f32 | low |
//! | `swiglu` | f32 | follow | low |
//! | `rope` | f32 | follow | low |
//! | `residual_add` | f32 | follow | low |
//! | `cross_entropy` | f32 | f32 | low |
//! | `embedding` | f32 | f32 | low |
//!
//! `torch` is what `torch.autocast` does on a CUDA device: matrix products
//! (the q·kᵀ scores included) are on its lower-precision list; softmax, the
//! norms and the losses are on its float32 list (`softmax`, `layer_norm`,
//! `cross_entropy`; Hugging Face's `LlamaRMSNorm` upcasts to float32 itself);
//! the embedding is on neither list and runs in its float32 weight's dtype;
//! everything else (SiLU·up, RoPE's `x·cos + rotate_half(x)·sin`, the
//! residual add) runs in the dtype its inputs promote to — bf16 when every
//! activation input is bf16, float32 as soon as one is (the residual stream,
//! fed by the float32 embedding, stays float32). RoPE's tables are constants
//! cast to the input's dtype (Hugging Face does `cos.to(x.dtype)`), so only
//! `x` counts. `pure` stores every output in the low format: the pure-bf16
//! run the spec warns stalls.

use crate::backend::round::Format;
use crate::{bail, Result, Tensor};
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

/// The classes of op a [`CastTable`] gives a rule to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Every matrix product but attention's scores: `Linear`, the LM head,
    /// `Tensor::matmul`, attention's `p·v` (operands and output).
    Matmul,
    /// Attention's `q·kᵀ` product (operands and output).
    AttentionScores,
    /// Attention's probabilities, the causal softmax of the scores.
    AttentionProbs,
    /// `Tensor::softmax` and `Tensor::causal_softmax` outside attention.
    Softmax,
    /// `Tensor::rms_norm`.
    RmsNorm,
    /// `Tensor::swiglu`.
    Swiglu,
    /// `Tensor::rope` and `Tensor::rope_heads`.
    Rope,
    /// The model's residual sums (`Tensor::residual_add`, `matmul_t_add`).
    ResidualAdd,
    /// `cross_entropy`'s loss.
    CrossEntropy,
    /// The token embedding's rows (`nn::Embedding`).
    Embedding,
}

impl OpClass {
    /// Every class, in table order.
    pub const ALL: [OpClass; 10] = [
        OpClass::Matmul,
        OpClass::AttentionScores,
        OpClass::AttentionProbs,
        OpClass::Softmax,
        OpClass::RmsNorm,
        OpClass::Swiglu,
        OpClass::Rope,
        OpClass::ResidualAdd,
        OpClass::CrossEntropy,
        OpClass::Embedding,
    ];

    /// The class's name in a policy file (`"matmul"`, `"attention_scores"`, …).
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Matmul => "matmul",
            OpClass::AttentionScores => "attention_scores",
            OpClass::AttentionProbs => "attention_probs",
            OpClass::Softmax => "softmax",
            OpClass::RmsNorm => "rms_norm",
            OpClass::Swiglu => "swiglu",
            OpClass::Rope => "rope",
            OpClass::ResidualAdd => "residual_add",
            OpClass::CrossEntropy => "cross_entropy",
            OpClass::Embedding => "embedding",
        }
    }

    /// Whether the class rounds its operands too: it has no inputs' format to
    /// follow, its rule is a format.
    fn is_product(self) -> bool {
        matches!(self, OpClass::Matmul | OpClass::AttentionScores)
    }
}

impl std::str::FromStr for OpClass {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<OpClass> {
        match OpClass::ALL.into_iter().find(|c| c.name() == s) {
            Some(c) => Ok(c),
            None => bail!(
                Config,
                "unknown op {s:?}: expected one of {}",
                OpClass::ALL.map(OpClass::name).join(", ")
            ),
        }
    }
}

/// What a policy does with an op class's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rule {
    /// Kept in float32.
    F32,
    /// Stored in a 16-bit format.
    Round(Format),
    /// Stored in the format every activation input of the op holds, when
    /// they all hold the same one; float32 otherwise (type promotion).
    Follow,
}

impl Rule {
    /// The rule's name in a policy file: `"f32"`, `"bf16"`, `"fp16"`, `"follow"`.
    pub fn name(self) -> &'static str {
        match self {
            Rule::F32 => "f32",
            Rule::Round(f) => f.name(),
            Rule::Follow => "follow",
        }
    }
}

impl std::str::FromStr for Rule {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Rule> {
        match s {
            "f32" | "fp32" | "float32" => Ok(Rule::F32),
            "follow" => Ok(Rule::Follow),
            _ => match s.parse::<Format>() {
                Ok(f) => Ok(Rule::Round(f)),
                Err(_) => bail!(
                    Config,
                    "unknown format {s:?}: expected f32, bf16, fp16 or follow"
                ),
            },
        }
    }
}

/// A rule per [`OpClass`]: what autocast applies (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CastTable([Rule; 10]);

impl CastTable {
    /// Every output in float32: autocast off.
    pub fn f32() -> CastTable {
        CastTable([Rule::F32; 10])
    }

    /// `matmuls`: the products (attention's scores among them) in `low`,
    /// everything else float32 — `autocast(low)`.
    pub fn matmuls(low: Format) -> CastTable {
        CastTable::f32()
            .with(OpClass::Matmul, Rule::Round(low))
            .with(OpClass::AttentionScores, Rule::Round(low))
    }

    /// `torch`: `torch.autocast` on a GPU (see the module docs' table).
    pub fn torch(low: Format) -> CastTable {
        CastTable::matmuls(low)
            .with(OpClass::Swiglu, Rule::Follow)
            .with(OpClass::Rope, Rule::Follow)
            .with(OpClass::ResidualAdd, Rule::Follow)
    }

    /// `pure`: every output stored in `low`.
    pub fn pure(low: Format) -> CastTable {
        CastTable([Rule::Round(low); 10])
    }

    /// The rule for `class`.
    pub fn rule(&self, class: OpClass) -> Rule {
        self.0[class as usize]
    }

    /// This table with `class`'s rule set to `rule`. Panics on `Follow` for a
    /// product class; [`try_with`](Self::try_with) returns that as an error.
    pub fn with(self, class: OpClass, rule: Rule) -> CastTable {
        self.try_with(class, rule)
            .expect("a product's rule is a format")
    }

    /// [`with`](Self::with), an error where the rule cannot apply: a product
    /// (`matmul`, `attention_scores`) rounds its operands to its format, so
    /// its rule is `f32`, `bf16` or `fp16`, never `follow`.
    pub fn try_with(mut self, class: OpClass, rule: Rule) -> Result<CastTable> {
        if class.is_product() && rule == Rule::Follow {
            bail!(
                Config,
                "op {:?} rounds its operands: its format is f32, bf16 or fp16, not follow",
                class.name()
            );
        }
        self.0[class as usize] = rule;
        Ok(self)
    }

    /// The format a product of `class` rounds its operands and output to
    /// (`None` for float32). `class` must be a product class.
    pub fn product(&self, class: OpClass) -> Option<Format> {
        match self.rule(class) {
            Rule::Round(f) => Some(f),
            _ => None,
        }
    }

    /// The format an op of `class` stores its output in, given its
    /// activation inputs (which `Follow` reads); `None`: float32.
    pub fn output(&self, class: OpClass, inputs: &[&Tensor]) -> Option<Format> {
        let held: Vec<Option<Format>> = inputs.iter().map(|t| t.half()).collect();
        self.output_of(class, &held)
    }

    /// [`output`](Self::output) from the formats the inputs hold (`None`:
    /// float32 values).
    pub fn output_of(&self, class: OpClass, held: &[Option<Format>]) -> Option<Format> {
        match self.rule(class) {
            Rule::F32 => None,
            Rule::Round(f) => Some(f),
            Rule::Follow => {
                let f = (*held.first()?)?;
                held.iter().all(|&h| h == Some(f)).then_some(f)
            }
        }
    }
}

/// A named [`CastTable`]: a built-in (`matmuls`, `torch`, `pure`) or one
/// the user wrote. In a file (and a checkpoint) it is JSON,
/// `{"name": "mine", "ops": {"matmul": "bf16", "softmax": "f32", …}}`, each
/// op a class name and each value `f32`, `bf16`, `fp16` or `follow`; an op
/// left out is `f32`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CastPolicy {
    name: String,
    table: CastTable,
}

impl CastPolicy {
    /// A policy called `name` with `table`.
    pub fn new(name: impl Into<String>, table: CastTable) -> CastPolicy {
        CastPolicy {
            name: name.into(),
            table,
        }
    }

    /// The built-in `name` (`matmuls`, `torch`, `pure`) with `low` as its
    /// 16-bit format.
    pub fn builtin(name: &str, low: Format) -> Result<CastPolicy> {
        let table = match name {
            "matmuls" => CastTable::matmuls(low),
            "torch" => CastTable::torch(low),
            "pure" => CastTable::pure(low),
            _ => bail!(
                Config,
                "unknown cast policy {name:?}: expected matmuls, torch, pure or a .json file"
            ),
        };
        Ok(CastPolicy::new(name, table))
    }

    /// Whether `name` is a built-in's.
    pub fn is_builtin(name: &str) -> bool {
        matches!(name, "matmuls" | "torch" | "pure")
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its table.
    pub fn table(&self) -> CastTable {
        self.table
    }

    /// Parses the JSON form (see the type's docs); `default_name` names it
    /// when the JSON has no `"name"`. Errors ([`Error::Config`](crate::Error))
    /// name the offending key or value.
    pub fn from_json(text: &str, default_name: &str) -> Result<CastPolicy> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| crate::Error::config(format!("malformed JSON: {e}")))?;
        CastPolicy::from_value(&v, default_name)
    }

    fn from_value(v: &serde_json::Value, default_name: &str) -> Result<CastPolicy> {
        let Some(obj) = v.as_object() else {
            bail!(
                Config,
                "a cast policy is a JSON object with \"ops\", got {v}"
            );
        };
        if let Some(k) = obj.keys().find(|k| !matches!(k.as_str(), "name" | "ops")) {
            bail!(
                Config,
                "unknown key {k:?}: a cast policy has \"name\" and \"ops\""
            );
        }
        let name = match obj.get("name") {
            None => default_name.to_string(),
            Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
            Some(n) => bail!(Config, "\"name\" must be a non-empty string, got {n}"),
        };
        let Some(ops) = obj.get("ops").and_then(|o| o.as_object()) else {
            bail!(
                Config,
                "a cast policy needs \"ops\": an object from op to format"
            );
        };
        let mut table = CastTable::f32();
        for (op, rule) in ops {
            let class: OpClass = op.parse()?;
            let Some(rule) = rule.as_str() else {
                bail!(Config, "op {op:?}: the format must be a string, got {rule}");
            };
            let rule: Rule = rule
                .parse()
                .map_err(|e: crate::Error| e.context(format!("op {op:?}")))?;
            table = table.try_with(class, rule)?;
        }
        Ok(CastPolicy::new(name, table))
    }

    /// The JSON form, every op listed.
    pub fn to_json(&self) -> serde_json::Value {
        let ops: serde_json::Map<String, serde_json::Value> = OpClass::ALL
            .iter()
            .map(|&c| (c.name().to_string(), self.table.rule(c).name().into()))
            .collect();
        serde_json::json!({ "name": self.name, "ops": ops })
    }
}

impl serde::Serialize for CastPolicy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for CastPolicy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        CastPolicy::from_value(&v, "unnamed").map_err(serde::de::Error::custom)
    }
}

thread_local! {
    /// The innermost live scope's table: what every op reads.
    static AUTOCAST: Cell<Option<CastTable>> = const { Cell::new(None) };
    /// The live scopes, innermost last: (the guard's id, its table).
    static SCOPES: RefCell<Vec<(u64, Option<CastTable>)>> = const { RefCell::new(Vec::new()) };
    /// The next guard's id.
    static NEXT_ID: Cell<u64> = const { Cell::new(0) };
}

/// The format every matmul on this thread rounds to right now, if any (the
/// policy's `matmul` entry).
pub fn autocast_dtype() -> Option<Format> {
    cast_table().and_then(|t| t.product(OpClass::Matmul))
}

/// The table of the innermost live scope on this thread (`None`: no
/// autocast, or a float32 scope).
pub fn cast_table() -> Option<CastTable> {
    AUTOCAST.with(Cell::get)
}

/// The format an op of `class` stores its output in under this thread's
/// policy (see [`CastTable::output`]); `None`: float32.
pub(crate) fn output_format(class: OpClass, inputs: &[&Tensor]) -> Option<Format> {
    cast_table().and_then(|t| t.output(class, inputs))
}

/// The format a product of `class` rounds to under this thread's policy.
pub(crate) fn product_format(class: OpClass) -> Option<Format> {
    cast_table().and_then(|t| t.product(class))
}

/// What [`autocast`] opens a scope with: a format (the `matmuls` policy at
/// that format), `None` (float32), a [`CastTable`] or a [`CastPolicy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scope(Option<CastTable>);

impl From<Format> for Scope {
    fn from(f: Format) -> Scope {
        Scope(Some(CastTable::matmuls(f)))
    }
}

impl From<Option<Format>> for Scope {
    fn from(f: Option<Format>) -> Scope {
        Scope(f.map(CastTable::matmuls))
    }
}

impl From<CastTable> for Scope {
    fn from(t: CastTable) -> Scope {
        Scope(Some(t))
    }
}

impl From<&CastPolicy> for Scope {
    fn from(p: &CastPolicy) -> Scope {
        Scope(Some(p.table))
    }
}

impl Scope {
    /// The scope of a table, or of float32 (`None`).
    pub fn table(t: Option<CastTable>) -> Scope {
        Scope(t)
    }
}

/// While alive, the ops on this thread follow the scope's policy: every
/// matmul (`Tensor::matmul`, `Linear`, attention; CPU and GPU) computes
/// `cast(cast(a) @ cast(b))` with f32 accumulation at the policy's matmul
/// format, and every other op class stores its output as the policy says.
/// Dropping it ends its own scope — also while unwinding from a
/// panic, and also when an enclosing guard was dropped first — so guards nest
/// and the innermost live policy applies. It stays on the thread that made it
/// (not `Send`): the state it changes is that thread's.
#[must_use = "autocast ends when the guard is dropped: bind it to a named variable, or use autocast_scope"]
pub struct AutocastGuard {
    id: u64,
    _this_thread: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        SCOPES.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(i) = s.iter().rposition(|&(id, _)| id == self.id) {
                s.remove(i);
            }
            AUTOCAST.with(|a| a.set(s.last().and_then(|&(_, f)| f)));
        });
    }
}

/// Enters an autocast scope with `scope`: a format (the `matmuls` policy at
/// it), a [`CastPolicy`] or [`CastTable`], or `None` (a float32 scope that
/// switches an enclosing autocast off). The scope lasts as long as the
/// returned [`AutocastGuard`]; it covers this thread only. Bind the guard to a
/// named variable (`let _bf16 = …`): `let _ = autocast(…)` drops it at once,
/// an empty scope. [`autocast_scope`] takes the work as a closure instead and
/// cannot be misused that way.
///
/// ```
/// use tinyllm::precision::{autocast, cast};
/// use tinyllm::{Device, Format, Tensor};
/// let a = Tensor::from_vec(vec![1.001, 2.0, -3.3, 0.7], &[2, 2], Device::Cpu)?;
/// let b = Tensor::from_vec(vec![0.3, 5.5, -1.1, 0.01], &[2, 2], Device::Cpu)?;
/// let bf = |t: &Tensor| cast(t, Format::Bf16);
/// // what a bf16 matmul means: cast(cast(a) @ cast(b)), accumulated in f32
/// let want = bf(&bf(&a)?.matmul(&bf(&b)?)?)?;
/// let got = {
///     let _bf16 = autocast(Format::Bf16);
///     a.matmul(&b)?
/// };
/// assert_eq!(got.to_vec_f32()?, want.to_vec_f32()?);
/// // outside the scope, matmuls are float32 again
/// assert_ne!(a.matmul(&b)?.to_vec_f32()?, want.to_vec_f32()?);
/// # Ok::<(), tinyllm::Error>(())
/// ```
///
/// A guard left unused is a warning (an error where `unused_must_use` is
/// denied), and `let _ = autocast(…)` is rejected where the
/// `let_underscore_drop` lint is denied:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// tinyllm::precision::autocast(tinyllm::Format::Bf16); // the scope ends here
/// ```
///
/// ```compile_fail
/// #![deny(let_underscore_drop)]
/// let _ = tinyllm::precision::autocast(tinyllm::Format::Bf16); // so does this one
/// ```
#[must_use = "autocast ends when the guard is dropped: bind it to a named variable, or use autocast_scope"]
pub fn autocast(scope: impl Into<Scope>) -> AutocastGuard {
    let fmt = scope.into().0;
    let id = NEXT_ID.with(|n| n.replace(n.get() + 1));
    SCOPES.with(|s| s.borrow_mut().push((id, fmt)));
    AUTOCAST.with(|a| a.set(fmt));
    AutocastGuard {
        id,
        _this_thread: PhantomData,
    }
}

/// Runs `f` in an autocast scope with `scope` (or, with `None`, in float32) and
/// returns its result: [`autocast`] with the scope's extent written as a
/// closure, so it cannot end early. The enclosing state is back when `f`
/// returns or panics.
///
/// ```
/// use tinyllm::precision::{autocast_dtype, autocast_scope};
/// use tinyllm::Format;
/// let inside = autocast_scope(Format::Bf16, autocast_dtype);
/// assert_eq!(inside, Some(Format::Bf16));
/// assert_eq!(autocast_dtype(), None);
/// ```
pub fn autocast_scope<R>(scope: impl Into<Scope>, f: impl FnOnce() -> R) -> R {
    let _scope = autocast(scope);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards dropped outer first: the inner format holds while the inner
    /// guard lives, and nothing is left switched on once both are gone.
    #[test]
    fn guards_dropped_out_of_order_leave_nothing_on() {
        assert_eq!(autocast_dtype(), None);
        let outer = autocast(Format::Bf16);
        let inner = autocast(Format::Fp16);
        drop(outer);
        assert_eq!(
            autocast_dtype(),
            Some(Format::Fp16),
            "the inner scope is still live"
        );
        drop(inner);
        assert_eq!(autocast_dtype(), None, "a format left switched on");

        // Three deep, the middle one first: the others keep their order.
        let a = autocast(Format::Bf16);
        let b = autocast(None);
        let c = autocast(Format::Fp16);
        drop(b);
        assert_eq!(autocast_dtype(), Some(Format::Fp16));
        drop(c);
        assert_eq!(
            autocast_dtype(),
            Some(Format::Bf16),
            "back to the outermost"
        );
        drop(a);
        assert_eq!(autocast_dtype(), None);
    }

    /// The closure form applies its format inside, nests, returns the
    /// closure's value and restores the state, also after a panic.
    #[test]
    fn autocast_scope_covers_exactly_its_closure() {
        let seen = autocast_scope(Format::Bf16, || {
            let inner = autocast_scope(Format::Fp16, autocast_dtype);
            let off = autocast_scope(None, autocast_dtype);
            (autocast_dtype(), inner, off)
        });
        assert_eq!(seen, (Some(Format::Bf16), Some(Format::Fp16), None));
        assert_eq!(autocast_dtype(), None);
        let r = std::panic::catch_unwind(|| {
            autocast_scope(Format::Fp16, || {
                panic!("intentional panic inside autocast_scope")
            })
        });
        assert!(r.is_err());
        assert_eq!(autocast_dtype(), None);
    }

    /// The built-ins are the documented tables; `autocast(fmt)` is `matmuls`
    /// at fmt, and the matmul format is what `autocast_dtype` reports.
    #[test]
    fn builtins_and_scopes() {
        let m = CastTable::matmuls(Format::Bf16);
        assert_eq!(Scope::from(Format::Bf16), Scope::from(m));
        assert_eq!(Scope::from(None::<Format>), Scope::table(None));
        let t = CastPolicy::builtin("torch", Format::Fp16).unwrap().table();
        for c in OpClass::ALL {
            let want = match c {
                OpClass::Matmul | OpClass::AttentionScores => Rule::Round(Format::Fp16),
                OpClass::Swiglu | OpClass::Rope | OpClass::ResidualAdd => Rule::Follow,
                _ => Rule::F32,
            };
            assert_eq!(t.rule(c), want, "torch {}", c.name());
            assert_eq!(
                CastTable::pure(Format::Bf16).rule(c),
                Rule::Round(Format::Bf16)
            );
        }
        let _p = autocast(t);
        assert_eq!(autocast_dtype(), Some(Format::Fp16));
        assert_eq!(cast_table(), Some(t));
        drop(_p);
        assert_eq!(cast_table(), None);
        assert!(CastPolicy::builtin("nope", Format::Bf16).is_err());
    }

    /// A policy file round-trips through its JSON form; bad input is an
    /// error that names what is wrong.
    #[test]
    fn policy_json() {
        let p = CastPolicy::from_json(
            r#"{"name": "mine", "ops": {"matmul": "bf16", "rope": "follow", "softmax": "fp16"}}"#,
            "file",
        )
        .unwrap();
        assert_eq!(p.name(), "mine");
        assert_eq!(p.table().rule(OpClass::Matmul), Rule::Round(Format::Bf16));
        assert_eq!(p.table().rule(OpClass::Rope), Rule::Follow);
        assert_eq!(p.table().rule(OpClass::Softmax), Rule::Round(Format::Fp16));
        assert_eq!(p.table().rule(OpClass::RmsNorm), Rule::F32);
        let back = CastPolicy::from_json(&p.to_json().to_string(), "x").unwrap();
        assert_eq!(back, p);
        let unnamed = CastPolicy::from_json(r#"{"ops": {}}"#, "stem").unwrap();
        assert_eq!(
            (unnamed.name(), unnamed.table()),
            ("stem", CastTable::f32())
        );
        for (bad, says) in [
            (
                r#"{"ops": {"layernorm": "bf16"}}"#,
                "unknown op \"layernorm\"",
            ),
            (r#"{"ops": {"matmul": "fp8"}}"#, "unknown format \"fp8\""),
            (r#"{"ops": {"matmul": "follow"}}"#, "not follow"),
            (r#"{"ops": {"matmul": 16}}"#, "must be a string"),
            (
                r#"{"ops": {"matmul": "bf16"}, "extra": 1}"#,
                "unknown key \"extra\"",
            ),
            (r#"{"name": "x"}"#, "needs \"ops\""),
            (r#"{"ops": {"matmul": "bf16""#, "malformed JSON"),
            ("[1]", "JSON object"),
        ] {
            let e = CastPolicy::from_json(bad, "f").unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
