//! The Llama: token embedding, `n_layers` pre-norm blocks (RMSNorm, causal
//! multi-head attention with rotary position embeddings, RMSNorm, SwiGLU MLP),
//! a final RMSNorm and an untied LM head — the Hugging Face `LlamaForCausalLM`
//! layout, so a checkpoint's tensors carry HF's names and shapes.
//!
//! Every block is a [`Layer`] `x: (B,T,C) -> (B,T,C)`, so the stack can run
//! through [`checkpoint_sequential`] with a memory budget in layer units: a
//! setting of the model ([`Llama::set_recompute`]), checked when it is set.
//! Independently, each attention's core can be recomputed in backward
//! instead of kept ([`Llama::set_attention_recompute`]); together the two
//! settings are the model's [`Recompute`] policy.
//!
//! Saving and loading: [`save_model`](crate::train::save_model) writes a
//! Hugging Face folder, [`load_model`](crate::train::load_model) reads one.

use crate::backend::Device;
use crate::nn::{Embedding, Layer, Linear, Module, RmsNorm};
use crate::ops::dropout;
use crate::recompute::{
    budget_range, check_budget, checkpoint_sequential, recompute_attention, Recompute,
};
use crate::rng::Generator;
use crate::trace;
use crate::{bail, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::rc::Rc;

/// The architecture (everything a checkpoint's `config.json` must agree on).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `V`, the number of token ids (256 for the byte-level presets).
    pub vocab_size: usize,
    /// `C`, the residual width.
    pub d_model: usize,
    /// The number of decoder blocks.
    pub n_layers: usize,
    /// Attention heads per block; `d_model / n_heads` is the head width, which
    /// must be even.
    pub n_heads: usize,
    /// The SwiGLU MLP's inner width.
    pub hidden: usize,
    /// The longest sequence (RoPE tables are built for it).
    pub context: usize,
    /// Every RMSNorm's `eps` (`1e-5` in the presets).
    pub rms_eps: f64,
    /// RoPE's base `theta` (`10000` in the presets).
    pub rope_theta: f64,
    /// Residual and attention dropout probability (0 = off).
    pub dropout: f32,
}

impl LlamaConfig {
    /// A named preset:
    ///
    /// | preset     | C   | layers | heads | hidden | context | parameters |
    /// |------------|-----|--------|-------|--------|---------|------------|
    /// | `capstone` | 320 | 8      | 5     | 904    | 512     | 10,388,800 |
    /// | `small`    | 128 | 4      | 4     | 352    | 128     |    869,504 |
    /// | `tiny`     | 32  | 4      | 2     | 64     | 16      |     57,632 |
    ///
    /// All are byte-level (vocabulary 256), with `rms_eps` 1e-5, `rope_theta`
    /// 10000 and no dropout. `capstone` is the largest; its hidden width 904 (a
    /// multiple of 8 near 2.8·C) lands the count at 10.4M. Any other name is an
    /// [`Error::Config`](crate::Error::Config).
    pub fn preset(name: &str) -> Result<LlamaConfig> {
        let base = |d, l, h, f, t| LlamaConfig {
            vocab_size: 256,
            d_model: d,
            n_layers: l,
            n_heads: h,
            hidden: f,
            context: t,
            rms_eps: 1e-5,
            rope_theta: 10000.0,
            dropout: 0.0,
        };
        Ok(match name {
            "capstone" => base(320, 8, 5, 904, 512),
            "small" => base(128, 4, 4, 352, 128),
            "tiny" => base(32, 4, 2, 64, 16),
            _ => bail!(
                Config,
                "unknown preset {name:?}: expected capstone, small or tiny"
            ),
        })
    }

    /// `D = d_model / n_heads`, the width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Checks that the architecture can be built: every size at least 1,
    /// `d_model` split into `n_heads` heads of an even width, `dropout` in `[0, 1)`,
    /// `rms_eps` and `rope_theta` positive. Errors with
    /// [`Error::Config`](crate::Error::Config) naming the first problem.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if c.vocab_size == 0
            || c.d_model == 0
            || c.n_layers == 0
            || c.n_heads == 0
            || c.hidden == 0
            || c.context == 0
        {
            bail!(
                Config,
                "model config: every size must be at least 1 ({c:?})"
            );
        }
        if !c.d_model.is_multiple_of(c.n_heads) || !c.head_dim().is_multiple_of(2) {
            bail!(Config,
                "model config: d_model {} must split into {} heads of an even width (RoPE rotates pairs)",
                c.d_model,
                c.n_heads
            );
        }
        if !(0.0..1.0).contains(&c.dropout) {
            bail!(
                Config,
                "model config: dropout must be in [0, 1), got {}",
                c.dropout
            );
        }
        if c.rms_eps.is_nan() || c.rms_eps <= 0.0 || c.rope_theta.is_nan() || c.rope_theta <= 0.0 {
            bail!(
                Config,
                "model config: rms_eps and rope_theta must be positive"
            );
        }
        Ok(())
    }

    /// The exact number of trainable parameters.
    pub fn num_params(&self) -> usize {
        let (v, c, f) = (self.vocab_size, self.d_model, self.hidden);
        let block = 4 * c * c + 3 * c * f + 2 * c;
        2 * v * c + self.n_layers * block + c
    }

    /// A Hugging Face `LlamaConfig` (`config.json`) describing this model.
    pub fn to_hf_json(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "intermediate_size": self.hidden,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_heads,
            "head_dim": self.head_dim(),
            "max_position_embeddings": self.context,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "attention_dropout": self.dropout,
            "tie_word_embeddings": false,
            "torch_dtype": "float32",
            "bos_token_id": null,
            "eos_token_id": null,
            "tinyllm_dropout": self.dropout,
        })
    }

    /// Reads a Hugging Face `config.json` written by [`to_hf_json`](Self::to_hf_json)
    /// (or any plain Llama config without grouped-query attention).
    /// `rms_norm_eps`, `rope_theta` and the dropout default to Hugging Face's
    /// `LlamaConfig` defaults, `1e-6`, `10000` and 0, when absent. Errors
    /// ([`Error::Config`](crate::Error::Config)) on a missing or non-numeric
    /// size, another `model_type`, grouped-query attention, tied embeddings,
    /// an inconsistent `head_dim`, anything this Llama does not compute (a
    /// `hidden_act` other than `silu`, `rope_scaling`, attention or MLP
    /// biases), or a config [`validate`](Self::validate) rejects.
    pub fn from_hf_json(v: &serde_json::Value) -> Result<LlamaConfig> {
        let num = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| {
                    crate::Error::config(format!("config.json: missing or invalid {k:?}"))
                })
        };
        // Optional numbers: absent takes the default, anything but a number is
        // an error (a typo must not silently become the default).
        for k in [
            "rms_norm_eps",
            "rope_theta",
            "attention_dropout",
            "tinyllm_dropout",
        ] {
            if let Some(x) = v.get(k).filter(|x| !x.is_number()) {
                bail!(Config, "config.json: {k:?} must be a number, got {x}");
            }
        }
        let flt = |k: &str, d: f64| v.get(k).and_then(|x| x.as_f64()).unwrap_or(d);
        if let Some(t) = v.get("model_type").and_then(|x| x.as_str()) {
            if t != "llama" {
                bail!(Config, "config.json: model_type {t:?} is not \"llama\"");
            }
        }
        let n_heads = num("num_attention_heads")?;
        if let Ok(kv) = num("num_key_value_heads") {
            if kv != n_heads {
                bail!(Config, "config.json: grouped-query attention ({kv} key/value heads for {n_heads} heads) is not supported");
            }
        }
        // What would change the function: refused, never ignored.
        if let Some(act) = v.get("hidden_act").filter(|a| !a.is_null()) {
            if act.as_str() != Some("silu") {
                bail!(
                    Config,
                    "config.json: hidden_act {act} is not supported (this Llama's MLP is SwiGLU: \"silu\")"
                );
            }
        }
        if let Some(rs) = v.get("rope_scaling").filter(|x| !x.is_null()) {
            bail!(
                Config,
                "config.json: rope_scaling {rs} is not supported (plain RoPE only)"
            );
        }
        for k in ["attention_bias", "mlp_bias"] {
            if v.get(k).and_then(|x| x.as_bool()) == Some(true) {
                bail!(
                    Config,
                    "config.json: {k} is true; this Llama's projections have no bias"
                );
            }
        }
        if v.get("tie_word_embeddings").and_then(|x| x.as_bool()) == Some(true) {
            bail!(
                Config,
                "config.json: tied embeddings are not supported (this Llama has its own lm_head)"
            );
        }
        let cfg = LlamaConfig {
            vocab_size: num("vocab_size")?,
            d_model: num("hidden_size")?,
            n_layers: num("num_hidden_layers")?,
            n_heads,
            hidden: num("intermediate_size")?,
            context: num("max_position_embeddings")?,
            rms_eps: flt("rms_norm_eps", 1e-6),
            rope_theta: flt("rope_theta", 10000.0),
            dropout: flt("tinyllm_dropout", flt("attention_dropout", 0.0)) as f32,
        };
        if let Ok(hd) = num("head_dim") {
            if cfg.n_heads * hd != cfg.d_model {
                bail!(
                    Config,
                    "config.json: head_dim {hd} × {} heads ≠ hidden_size {}",
                    cfg.n_heads,
                    cfg.d_model
                );
            }
        }
        cfg.validate().map_err(|e| e.context("config.json"))?;
        Ok(cfg)
    }
}

// ------------------------------------------------------------------ RoPE ----

/// Rotary tables `cos, sin: (context, head_dim)` in Hugging Face's layout:
/// angle `θ[t, i] = t · theta^(−2i/D)` for `i < D/2`, repeated for the second
/// half (`emb = cat(freqs, freqs)`). Computed once on the host in f64 and
/// rounded to f32, so every device gets the same bits.
pub fn rope_tables(context: usize, head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(context * head_dim);
    let mut sin = Vec::with_capacity(context * head_dim);
    for t in 0..context {
        for j in 0..head_dim {
            let i = j % half;
            let inv_freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let a = t as f64 * inv_freq;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

pub use crate::ops::fused::reference::rotate_half;

/// `x · cos + rotate_half(x) · sin`: `x: (.., T, D)`, `cos, sin: (T, D)` —
/// one fused primitive each way (`Tensor::rope`), the composition's bits
/// ([`reference::rope`](crate::ops::fused::reference::rope)).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.rope(cos, sin)
}

/// The rotary tables on a device, shared by every block.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// The tables of [`rope_tables`] for `cfg`'s context, head width and theta,
    /// on `device`.
    pub fn new(cfg: &LlamaConfig, device: Device) -> Result<Rope> {
        let (c, s) = rope_tables(cfg.context, cfg.head_dim(), cfg.rope_theta);
        let shape = [cfg.context, cfg.head_dim()];
        let (cos, sin) = (
            Tensor::from_vec(c, &shape, device)?,
            Tensor::from_vec(s, &shape, device)?,
        );
        // side by side, so that a GPU kernel reads both through one binding
        Tensor::colocate(&[&cos, &sin])?;
        Ok(Rope { cos, sin })
    }
    /// The first `t` rows of both tables.
    fn first(&self, t: usize) -> Result<(Tensor, Tensor)> {
        if t == self.cos.shape()[0] {
            return Ok((self.cos.clone(), self.sin.clone()));
        }
        Ok((self.cos.narrow(0, 0, t)?, self.sin.narrow(0, 0, t)?))
    }
}

// ---------------------------------------------------------------- blocks ----

/// Causal multi-head self-attention with RoPE on queries and keys.
pub struct Attention {
    /// The query projection, weight `(C, C)`.
    pub q_proj: Linear,
    /// The key projection, weight `(C, C)`.
    pub k_proj: Linear,
    /// The value projection, weight `(C, C)`.
    pub v_proj: Linear,
    /// The output projection, weight `(C, C)`.
    pub o_proj: Linear,
    n_heads: usize,
    rope: Rc<Rope>,
    dropout: f32,
    rng: Generator,
    training: std::cell::Cell<bool>,
    /// Whether the core (scores → softmax → dropout → · V) is recomputed in
    /// backward from q, k and v instead of kept ([`Llama::set_attention_recompute`]).
    recompute: std::cell::Cell<bool>,
}

impl Attention {
    /// `x: (B,T,C) -> (B,T,C)`, plus `residual` if given (a sum the output
    /// projection forms as it writes).
    fn forward(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        let y = self.heads(x)?;
        let _traced = trace::path("o_proj");
        match residual {
            Some(r) => self.o_proj.forward_add(&y, r),
            None => self.o_proj.forward(&y),
        }
    }

    /// The heads' outputs side by side, `(B,T,C)`: the output projection's input.
    fn heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let (h, d) = (self.n_heads, c / self.n_heads);
        let (cos, sin) = self.rope.first(t)?;
        // the three projections as one product (one dispatch on a GPU)
        let [q, k, v] = {
            let _traced = trace::path("qkv_proj");
            Linear::forward_shared(x, [&self.q_proj, &self.k_proj, &self.v_proj])?
        };
        // (B,T,H,D) = softmax(q kᵀ / √D, future positions masked) v, q and k
        // rotated by RoPE
        let scale = 1.0 / (d as f64).sqrt();
        let y = if self.dropout > 0.0 && self.training.get() {
            // q and k: (B,T,C) -> (B,H,T,D) rotated together, the permute
            // inside the RoPE
            let (q, k) = {
                let _traced = trace::path("rope");
                q.rope_heads_pair(&k, &cos, &sin, h)?
            };
            // v: (B,T,C) -> (B,T,H,D), token-major like the attention's output
            let v = v.reshape(&[b, t, h, d])?;
            // dropout acts on the probabilities themselves: the composition,
            // which keeps the probabilities, the mask and the dropped
            // probabilities (3·H·T² values) unless recomputed
            let (p, rng) = (self.dropout, self.rng.clone());
            let core = move |a: &[Tensor]| {
                let scores = a[0].attention_scores(&a[1])?.attention_probs(scale)?;
                let heads = a[2].permute(&[0, 2, 1, 3])?;
                dropout(&scores, p, &rng, true)?
                    .matmul(&heads)?
                    .permute(&[0, 2, 1, 3])
            };
            if self.recompute.get() {
                // Selective recomputation: one node keeping q, k and v; its
                // backward reruns the core with the dropout stream replayed.
                recompute_attention(core, &[q, k, v], &self.rng)?
            } else {
                core(&[q, k, v])?
            }
        } else {
            // The fused op keeps only the rotated q and k and v and
            // recomputes its probabilities in backward whatever the policy.
            q.causal_attention_rope(&k, &v, &cos, &sin, h, scale)?
        };
        // (B,T,H,D) -> (B,T,C)
        y.reshape(&[b, t, c])
    }
}

/// SwiGLU: `down(silu(gate(x)) · up(x))`, the product one fused primitive
/// each way (`Tensor::swiglu`).
pub struct Mlp {
    /// The gate projection (through SiLU), weight `(hidden, C)`.
    pub gate_proj: Linear,
    /// The up projection, weight `(hidden, C)`.
    pub up_proj: Linear,
    /// The down projection back to the residual width, weight `(C, hidden)`.
    pub down_proj: Linear,
}

impl Mlp {
    /// `x: (B,T,C) -> (B,T,C)`, plus `residual` if given (a sum the down
    /// projection forms as it writes). The down projection reads
    /// `silu(gate(x)) · up(x)` as one primitive with its product where it can
    /// ([`Linear::forward_gated`]).
    fn forward(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        let [g, u] = {
            let _traced = trace::path("gate_up_proj");
            Linear::forward_shared(x, [&self.gate_proj, &self.up_proj])?
        };
        let _traced = trace::path("down_proj");
        self.down_proj.forward_gated(g, u, residual)
    }
}

/// One pre-norm decoder block: `x + attn(norm(x))`, then `h + mlp(norm(h))`.
pub struct Block {
    /// The norm before attention.
    pub input_layernorm: RmsNorm,
    /// Causal self-attention.
    pub self_attn: Attention,
    /// The norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// The SwiGLU MLP.
    pub mlp: Mlp,
    /// The block's place in the stack (`layers.{index}` in a trace's paths).
    index: usize,
}

impl Block {
    /// `(HF name suffix, tensor)` in [`Module::parameters`] order.
    pub fn named_parameters(&self) -> Vec<(&'static str, Tensor)> {
        let a = &self.self_attn;
        vec![
            (
                "input_layernorm.weight",
                self.input_layernorm.weight.clone(),
            ),
            ("self_attn.q_proj.weight", a.q_proj.weight.clone()),
            ("self_attn.k_proj.weight", a.k_proj.weight.clone()),
            ("self_attn.v_proj.weight", a.v_proj.weight.clone()),
            ("self_attn.o_proj.weight", a.o_proj.weight.clone()),
            (
                "post_attention_layernorm.weight",
                self.post_attention_layernorm.weight.clone(),
            ),
            ("mlp.gate_proj.weight", self.mlp.gate_proj.weight.clone()),
            ("mlp.up_proj.weight", self.mlp.up_proj.weight.clone()),
            ("mlp.down_proj.weight", self.mlp.down_proj.weight.clone()),
        ]
    }
}

impl Module for Block {
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }
    fn set_training(&self, on: bool) {
        self.self_attn.training.set(on);
    }
}

impl Layer for Block {
    /// `x: (B,T,C) -> (B,T,C)`
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dims() != 3 {
            bail!(Shape, "a Llama block takes (B,T,C), got {:?}", x.shape());
        }
        let _traced = trace::path_with(|| format!("layers.{}", self.index));
        // each sub-layer under its Hugging Face name, in a trace
        let part = |name: &str, f: &dyn Fn() -> Result<Tensor>| {
            let _traced = trace::path(name);
            f()
        };
        let a = &self.self_attn;
        let train = a.training.get();
        let n1 = part("input_layernorm", &|| self.input_layernorm.forward(x))?;
        // the residual sums formed by the projections that end each branch,
        // unless dropout acts between
        let drops = train && a.dropout > 0.0;
        let h = if drops {
            let att = part("self_attn", &|| a.forward(&n1, None))?;
            x.residual_add(&dropout(&att, a.dropout, &a.rng, train)?)?
        } else {
            part("self_attn", &|| a.forward(&n1, Some(x)))?
        };
        let n2 = part("post_attention_layernorm", &|| {
            self.post_attention_layernorm.forward(&h)
        })?;
        if drops {
            let m = part("mlp", &|| self.mlp.forward(&n2, None))?;
            h.residual_add(&dropout(&m, a.dropout, &a.rng, train)?)
        } else {
            part("mlp", &|| self.mlp.forward(&n2, Some(&h)))
        }
    }
}

// ----------------------------------------------------------------- model ----

/// The whole model. Parameters are float32 masters on `device`.
pub struct Llama {
    /// The architecture the model was built from.
    pub cfg: LlamaConfig,
    /// The token embedding, `(V, C)`.
    pub embed_tokens: Embedding,
    /// The `n_layers` decoder blocks, first applied first.
    pub layers: Vec<Rc<Block>>,
    /// The final RMSNorm, before the LM head.
    pub norm: RmsNorm,
    /// The LM head, weight `(V, C)` (not tied to the embedding).
    pub lm_head: Linear,
    /// The dropout stream (shared by every block; replayed by checkpointing).
    pub rng: Generator,
    device: Device,
    /// The activation-checkpointing budget of every forward pass (`None`:
    /// off); always in [`budget_range`] of the layer count.
    recompute: Option<usize>,
    /// Whether every block's attention core is recomputed in backward.
    attention_recompute: bool,
}

impl Llama {
    /// Builds the model `cfg` describes, in training mode, its parameters on
    /// `device`. Hugging Face's init: every matrix Normal(0, 0.02²), norms at 1.
    /// All draws come from `Generator::new(seed)` in parameter order, so the same
    /// seed gives the same bits on every device. The dropout stream
    /// [`rng`](Self::rng) is seeded from `seed` too.
    ///
    /// Errors if [`LlamaConfig::validate`] rejects `cfg`, or if `device`
    /// cannot be reached.
    ///
    /// ```
    /// use tinyllm::nn::llama::{Llama, LlamaConfig};
    /// use tinyllm::Device;
    /// let cfg = LlamaConfig::preset("tiny")?;
    /// let model = Llama::new(&cfg, 0, Device::Cpu)?;
    /// // 2 sequences of 8 byte tokens -> one row of 256 logits per token
    /// let ids: Vec<u32> = b"hello, world! hi".iter().map(|&b| b as u32).collect();
    /// let logits = model.forward(&ids, 2, 8)?;
    /// assert_eq!(logits.shape(), &[16, 256]);
    /// assert!(logits.to_vec_f32()?.iter().all(|x| x.is_finite()));
    /// # Ok::<(), tinyllm::Error>(())
    /// ```
    pub fn new(cfg: &LlamaConfig, seed: u64, device: Device) -> Result<Llama> {
        cfg.validate()?;
        let gen = Generator::new(seed);
        let rng = Generator::new(seed ^ 0x5eed_d80b_0000_0000);
        let std = 0.02;
        let (c, f) = (cfg.d_model, cfg.hidden);
        let rope = Rc::new(Rope::new(cfg, device)?);
        let embed_tokens = Embedding::new(cfg.vocab_size, c, std, &gen, device)?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for index in 0..cfg.n_layers {
            let input_layernorm = RmsNorm::new(c, cfg.rms_eps, device)?;
            let self_attn = Attention {
                q_proj: Linear::normal(c, c, std, &gen, device)?,
                k_proj: Linear::normal(c, c, std, &gen, device)?,
                v_proj: Linear::normal(c, c, std, &gen, device)?,
                o_proj: Linear::normal(c, c, std, &gen, device)?,
                n_heads: cfg.n_heads,
                rope: rope.clone(),
                dropout: cfg.dropout,
                rng: rng.clone(),
                training: std::cell::Cell::new(true),
                recompute: std::cell::Cell::new(false),
            };
            let post_attention_layernorm = RmsNorm::new(c, cfg.rms_eps, device)?;
            let mlp = Mlp {
                gate_proj: Linear::normal(c, f, std, &gen, device)?,
                up_proj: Linear::normal(c, f, std, &gen, device)?,
                down_proj: Linear::normal(f, c, std, &gen, device)?,
            };
            layers.push(Rc::new(Block {
                input_layernorm,
                self_attn,
                post_attention_layernorm,
                mlp,
                index,
            }));
        }
        let norm = RmsNorm::new(c, cfg.rms_eps, device)?;
        let lm_head = Linear::normal(c, cfg.vocab_size, std, &gen, device)?;
        let model = Llama {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rng,
            device,
            recompute: None,
            attention_recompute: false,
        };
        // side by side in parameter order, as AdamW lays them out (and the
        // projections that share an input read them): laid out here, before
        // training, the copy adds nothing to a step's peak
        let params = model.parameters();
        Tensor::colocate(&params.iter().collect::<Vec<_>>())?;
        Ok(model)
    }

    /// Where the parameters live.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Turns activation checkpointing on for every later forward pass that
    /// records a graph, with a memory budget of `budget` layers of
    /// activations (`None`: off, every activation kept). The blocks then run
    /// through [`checkpoint_sequential`] on the schedule
    /// [`checkpoint_schedule`](crate::recompute::checkpoint_schedule)`(n_layers, budget)`:
    /// the gradients are the same bits, the peak memory lower, the forward
    /// pass of all but the last segment run twice.
    ///
    /// The budget must be in [`recompute_budgets`](Self::recompute_budgets),
    /// `min_ckpt_budget(n_layers)..=n_layers`; anything else is an
    /// [`Error::Config`](crate::Error::Config) naming that range, and the
    /// setting is left as it was.
    ///
    /// ```
    /// use tinyllm::nn::llama::{Llama, LlamaConfig};
    /// use tinyllm::Device;
    /// let mut model = Llama::new(&LlamaConfig::preset("tiny")?, 0, Device::Cpu)?;
    /// assert_eq!(model.recompute_budgets(), 3..=4); // 4 layers
    /// let e = model.set_recompute(Some(2)).unwrap_err();
    /// assert!(e.to_string().contains("3..=4"), "{e}");
    /// model.set_recompute(Some(3))?; // segments [0, 2): 3 layers of activations at the peak
    /// assert_eq!(model.recompute(), Some(3));
    /// # Ok::<(), tinyllm::Error>(())
    /// ```
    pub fn set_recompute(&mut self, budget: Option<usize>) -> Result<()> {
        if let Some(b) = budget {
            check_budget(self.cfg.n_layers, b).map_err(|e| e.context("Llama::set_recompute"))?;
        }
        self.recompute = budget;
        Ok(())
    }

    /// [`set_recompute`](Self::set_recompute), builder style:
    /// `Llama::new(&cfg, seed, device)?.with_recompute(Some(3))?`.
    pub fn with_recompute(mut self, budget: Option<usize>) -> Result<Llama> {
        self.set_recompute(budget)?;
        Ok(self)
    }

    /// The activation-checkpointing budget (`None`: off).
    pub fn recompute(&self) -> Option<usize> {
        self.recompute
    }

    /// The budgets [`set_recompute`](Self::set_recompute) accepts for this
    /// model: [`min_ckpt_budget`](crate::recompute::min_ckpt_budget)`(n_layers)..=n_layers`.
    pub fn recompute_budgets(&self) -> std::ops::RangeInclusive<usize> {
        budget_range(self.cfg.n_layers)
    }

    /// Turns selective recomputation of every block's attention core on or
    /// off for later forward passes that record a graph (Megatron-LM's
    /// selective recomputation; independent of the block checkpointing of
    /// [`set_recompute`](Self::set_recompute), with which it combines).
    ///
    /// On, each attention keeps its matmul outputs q, k and v and not the
    /// `H·T²` values of its core — scores, softmax probabilities, dropout mask,
    /// dropped probabilities; backward reruns the core from q, k and v with
    /// the dropout stream [`rng`](Self::rng) set back, so the mask is the
    /// forward pass's, and restored afterwards. The losses and gradients are
    /// the same bits. Without dropout (or in evaluation) the attention runs
    /// as one fused op that keeps only q, k and v and recomputes its
    /// probabilities in backward anyway, so the setting changes nothing there.
    ///
    /// ```
    /// use tinyllm::nn::llama::{Llama, LlamaConfig};
    /// use tinyllm::recompute::Recompute;
    /// use tinyllm::Device;
    /// let model = Llama::new(&LlamaConfig::preset("tiny")?, 0, Device::Cpu)?
    ///     .with_recompute(Some(3))?
    ///     .with_attention_recompute(true);
    /// assert_eq!(model.recompute_policy(), Recompute::Both);
    /// # Ok::<(), tinyllm::Error>(())
    /// ```
    pub fn set_attention_recompute(&mut self, on: bool) {
        for l in &self.layers {
            l.self_attn.recompute.set(on);
        }
        self.attention_recompute = on;
    }

    /// [`set_attention_recompute`](Self::set_attention_recompute), builder style.
    pub fn with_attention_recompute(mut self, on: bool) -> Llama {
        self.set_attention_recompute(on);
        self
    }

    /// Whether the attention core is recomputed in backward.
    pub fn attention_recompute(&self) -> bool {
        self.attention_recompute
    }

    /// The recompute policy the two settings make: blocks when a checkpoint
    /// budget is set ([`recompute`](Self::recompute)), attention when
    /// [`attention_recompute`](Self::attention_recompute) is on.
    pub fn recompute_policy(&self) -> Recompute {
        Recompute::new(self.recompute.is_some(), self.attention_recompute)
    }

    /// Every parameter with its Hugging Face `LlamaForCausalLM` name, in
    /// [`Module::parameters`] order.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            self.embed_tokens.weight.clone(),
        )];
        for (i, b) in self.layers.iter().enumerate() {
            for (n, t) in b.named_parameters() {
                out.push((format!("model.layers.{i}.{n}"), t));
            }
        }
        out.push(("model.norm.weight".into(), self.norm.weight.clone()));
        out.push(("lm_head.weight".into(), self.lm_head.weight.clone()));
        out
    }

    /// The expected shape of every named parameter (for validating checkpoints).
    pub fn expected_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.shape().to_vec()))
            .collect()
    }

    /// Logits for `ids`, `b` sequences of `t` tokens each (row-major):
    /// `ids: (B·T) -> logits (B·T, V)`. With a checkpoint budget set
    /// ([`set_recompute`](Self::set_recompute)), the blocks run through
    /// [`checkpoint_sequential`] with that many layers of activations.
    /// Errors if `ids.len() != b·t`, `b` or `t` is 0, `t` exceeds the context,
    /// or an id is not below `vocab_size`.
    pub fn forward(&self, ids: &[u32], b: usize, t: usize) -> Result<Tensor> {
        if ids.len() != b * t || b == 0 || t == 0 {
            bail!(
                Shape,
                "Llama::forward: {} ids are not {b} sequences of {t}",
                ids.len()
            );
        }
        if t > self.cfg.context {
            bail!(
                Shape,
                "Llama::forward: sequence of {t} tokens is longer than the context {}",
                self.cfg.context
            );
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.cfg.vocab_size) {
            bail!(
                Index,
                "Llama::forward: token id {bad} outside the vocabulary of {}",
                self.cfg.vocab_size
            );
        }
        let c = self.cfg.d_model;
        let x = {
            let _traced = trace::path("embed_tokens");
            self.embed_tokens.forward(ids)?.reshape(&[b, t, c])?
        };
        let x = match self.recompute {
            Some(budget) => {
                let layers: Vec<Rc<dyn Layer>> = self
                    .layers
                    .iter()
                    .map(|l| l.clone() as Rc<dyn Layer>)
                    .collect();
                checkpoint_sequential(&layers, &x, budget, std::slice::from_ref(&self.rng))?
            }
            None => {
                let mut h = x;
                for l in &self.layers {
                    h = l.forward(&h)?;
                }
                h
            }
        };
        let x = {
            let _traced = trace::path("norm");
            self.norm.forward(&x)?
        };
        let _traced = trace::path("lm_head");
        self.lm_head.forward(&x.reshape(&[b * t, c])?)
    }
}

impl Module for Llama {
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }
    fn set_training(&self, on: bool) {
        self.layers.iter().for_each(|l| l.set_training(on));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_parameter_counts() {
        for (name, n) in [
            ("capstone", 10_388_800),
            ("small", 869_504),
            ("tiny", 57_632),
        ] {
            let cfg = LlamaConfig::preset(name).unwrap();
            assert_eq!(cfg.num_params(), n, "{name}");
        }
        let m = Llama::new(&LlamaConfig::preset("tiny").unwrap(), 0, Device::Cpu).unwrap();
        let counted: usize = m.parameters().iter().map(|p| p.numel()).sum();
        assert_eq!(counted, 57_632);
    }

    #[test]
    fn hf_config_roundtrip() {
        let cfg = LlamaConfig::preset("capstone").unwrap();
        assert_eq!(LlamaConfig::from_hf_json(&cfg.to_hf_json()).unwrap(), cfg);
    }
}
