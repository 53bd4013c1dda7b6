//! The memory plan: bytes for weights, gradients, optimizer state
//! and activations, given the model, the micro-batch, the precision and the
//! checkpoint schedule — printed before a run, beside the measured peak
//! ([`crate::memory`]) after it.
//!
//! **Parameters.** AdamW keeps 16 bytes per parameter whatever the precision:
//! float32 is 4 (weights) + 4 (grads) + 8 (moments); on bf16 hardware it is
//! 2 (weights) + 2 (grads) + 4 (float32 master) + 8 (moments). This crate
//! *emulates* bf16 (16-bit values in float32 slots), so it stores 4 + 4 + 8.
//!
//! **Activations.** Each op keeps alive only what its backward reads (the
//! graph itself holds no values; reshapes share their input's buffer), and
//! keeps it *as* backward reads it: under autocast a tensor that backward
//! reads only as an operand of a rounded product, or whose values are all
//! 16-bit values (a rounded matmul output), is kept in 16 bits
//! (two values per 32-bit word); everything else in float32. Counting what this
//! crate's Llama forward pass keeps, per sequence of `T` tokens (`C` width,
//! `F` MLP width, `H` heads, `V` vocabulary):
//!
//! * one block: `2·T·C + 2·T` float32 values — the block input and the
//!   mid-block residual (kept by the norms), each norm's `1/rms` — and
//!   `6·T·C + 3·T·F` values kept as the products read them: each norm's output
//!   (read by the projections), q and k after RoPE and v (read by attention,
//!   which recomputes its probabilities in backward instead of keeping
//!   them), the attention output (read by `o_proj`), and the SwiGLU's gate and
//!   up projections and its product. Dropout takes attention through the
//!   composition and adds `2·H·T² + 2·T·C` float32 values (the softmax
//!   output, the masks) and `H·T²` read by a product (the dropped weights);
//! * the final norm, LM head and loss: `T·C + 3·T` float32 (the last block's
//!   output; the norm's `1/rms` and each row's max and sum of exps, which the
//!   fused cross-entropy keeps) and `T·C + T·V` read as products read them
//!   (the norm's output, the logits).
//!
//! Under a cast policy other than `matmuls` ([`Kept16`]) the same values are
//! counted, each in 16 bits where the policy keeps it so: what products
//! read follows the `matmul` and `attention_scores` entries, the
//! composition's probabilities `attention_probs`, and the block inputs and
//! mid-block sums the norms keep follow `embedding` (the first block's
//! input) and `residual_add` (`pure` keeps the stream in 16 bits). Where
//! the stream is 16-bit, the block at work also holds its input and its
//! mid-block sum in their float32 slots beside the 16-bit copies (below).
//!
//! With every Linear in fp8 (`--fp8`), each product keeps the 16-bit copies
//! of its own E4M3 operands: its weight's, where a plain product keeps the
//! weight itself (a leaf), and its input's, one per product where a plain
//! block's q, k and v projections share one and gate and up another
//! (`3·T·C` values a sequence more, and `4·C² + 3·C·F` a block and `V·C`
//! the head, at 2 bytes each). See [`fp8_block_copies`]; backward's working
//! set has `8·F` bytes a token more (an E5M2 cast's temporaries).
//!
//! With attention recomputation ([`Recompute::Attention`]) the dropout
//! composition keeps only q, k and v (as the products read them, as above):
//! its `2·H·T²` float32 and `H·T²` product-read values are recomputed in
//! backward instead, one block's at a time (see the working sets below).
//! Without dropout the fused attention keeps only q, k and v anyway: the
//! policy changes no byte there.
//!
//! For the capstone (`T` = 512) that is 84.2 MiB of activations for one
//! sequence in float32 and 47.4 MiB under bf16 or fp16 autocast (44 % less).
//!
//! With checkpointing on a schedule of `k` segments the forward
//! pass keeps the `k − 1` checkpointed segments' inputs (`T·C` float32 each) and the
//! activations of one segment at a time: the largest, `max_j s_j` blocks.
//! **Working sets and the two phases' peaks.** Each phase holds the
//! parameters, the moments, the gradients accumulated from earlier
//! micro-batches and the activations, plus what it has in flight (per
//! token unless said: `N` tokens in the micro-batch):
//!
//! * forward, under a policy that rounds the matmuls: the larger of the
//!   last block's MLP, whose float32 outputs live beside their 16-bit copies
//!   (`10·F + 8·C` bytes, before the head's kept values exist; `8·C` more
//!   where the stream is 16-bit: the block's input and mid-block sum in
//!   float32 beside their 16-bit copies), and the logits' float32 slots
//!   beside their 16-bit copy (`4·V`); nothing worth counting in float32;
//! * backward: the last block's float32 input gradients (`4·(F + C + H)`),
//!   and under a rounding policy the float32 slots of the 16-bit gradients
//!   (`2·F + 2·C + 2·V`, and the stream's `8·C` where it is 16-bit: with
//!   checkpointing the peak is in a rerun segment's backward; without, the
//!   plan is `6·C` per token above the measured peak there). Each weight
//!   gradient goes into the accumulated one as soon as the last node that
//!   feeds it has run, so none waits in flight; in a step's first
//!   micro-batch, whose peak is at the first block, that block's and the
//!   head's are in flight beside those made (`4·(C·F + V·C + C)` bytes);
//! * or backward's start, the loss's backward, every activation still held: the
//!   logits' float32 gradient (`4·V`) beside the logits widened from their
//!   16-bit copy under a rounding policy (`4·V`) — the peak of models whose
//!   vocabulary outweighs a block's widths (`tiny`);
//! * with dropout, either phase's peak may instead be at an attention core
//!   (per sequence, in units of `U = 4·H·T²` bytes): forward makes the
//!   dropped probabilities in float32 beside their 16-bit copy (`U`), and
//!   backward their gradient (`U`, with a 16-bit copy, `U/2`) beside the
//!   probabilities' (`U`); recomputed, the core holds again what it would
//!   have kept. By then backward has freed the head's values and the
//!   block's after its core, so the core's working set is that much less.
//!
//! These terms are what the tuned kernels allocate, measured at the
//! capstone's widths (exact there from 256 tokens per micro-batch; within a
//! few percent at the smaller presets), and the GPU allocates the same
//! tensors. A step's first micro-batch holds no gradient in forward and,
//! in backward, those it has made ([`MemoryPlan::accumulating`]).

use crate::nn::llama::LlamaConfig;
use crate::precision::{CastTable, OpClass, Precision, Rule};
use crate::recompute::{checkpoint_schedule, Recompute};
use crate::train::config::TrainConfig;
use crate::Result;

/// Planned bytes of one training step.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemoryPlan {
    /// The model's parameter count.
    pub params: usize,
    /// Bytes of float32 weights.
    pub weights: usize,
    /// Bytes of float32 gradients.
    pub grads: usize,
    /// Bytes of AdamW's two float32 moments.
    pub optimizer: usize,
    /// Activations held at the end of one micro-batch's forward pass.
    pub activations: usize,
    /// Bytes in flight during forward beyond the activations it keeps (see
    /// the module docs).
    #[serde(default)]
    pub forward_working: usize,
    /// Bytes in flight during backward beyond the activations and the
    /// gradients (see the module docs).
    pub backward_working: usize,
    /// The peak of activation memory in layer units: with checkpointing, the
    /// saved inputs of all segments but one plus the layers of the largest
    /// segment; `n_layers` without checkpointing.
    pub layer_units: usize,
    /// The forward phase's planned peak: weights, gradients (accumulated
    /// from earlier micro-batches), moments, activations and the forward
    /// working set.
    #[serde(default)]
    pub forward_peak: usize,
    /// The backward phase's: the same with the backward working set.
    #[serde(default)]
    pub backward_peak: usize,
    /// The backward phase's peak in a step's first micro-batch, which holds
    /// no gradients but those it makes (see [`MemoryPlan::accumulating`]).
    #[serde(default)]
    pub first_backward_peak: usize,
    /// The planned peak of the step: the larger of the two.
    pub total: usize,
}

/// Values kept for backward, by how they are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kept {
    /// Always float32.
    pub wide: usize,
    /// Read by rounded products or rounded already: 16 bits under autocast.
    pub narrow: usize,
}

impl Kept {
    /// Bytes under `precision`: 2 per narrow value with a 16-bit format, else 4.
    pub fn bytes(self, precision: Precision) -> usize {
        let narrow = if precision.format().is_some() { 2 } else { 4 };
        4 * self.wide + narrow * self.narrow
    }
}

/// Which of the values the plan counts a cast policy keeps in 16 bits (see
/// the module docs): those read only by rounded products (`products`:
/// the matmuls'; `scores`: attention's q and k), the attention
/// probabilities the dropout composition's softmax keeps (`probs`), and
/// the residual stream the norms keep (`embedding`: the first block's
/// input; `stream`: every later sum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kept16 {
    /// Values read only as operands of the `matmul` class's products.
    pub products: bool,
    /// q and k, read only by the scores' products.
    pub scores: bool,
    /// The dropout composition's probabilities, kept by its softmax.
    pub probs: bool,
    /// The embedding's rows, the first block's input.
    pub embedding: bool,
    /// The residual sums, every later block's input and the final norm's.
    pub stream: bool,
}

impl Kept16 {
    /// What `table` (`None`: float32) keeps in 16 bits, in a model with
    /// dropout or without (its residual sums add a float32 dropout output,
    /// so `follow` keeps them float32).
    pub fn of(table: Option<CastTable>, dropout: bool) -> Kept16 {
        let Some(t) = table else {
            return Kept16 {
                products: false,
                scores: false,
                probs: false,
                embedding: false,
                stream: false,
            };
        };
        let matmul = t.product(OpClass::Matmul);
        let scores = t.product(OpClass::AttentionScores);
        // the embedding's input is its float32 table: `follow` is float32
        let embedding = t.output_of(OpClass::Embedding, &[None]);
        let stream = match t.rule(OpClass::ResidualAdd) {
            Rule::F32 => false,
            Rule::Round(_) => true,
            // the stream stays in the embedding's format while every sum
            // adds a product of that format to it
            Rule::Follow => !dropout && embedding.is_some() && embedding == matmul,
        };
        Kept16 {
            products: matmul.is_some(),
            scores: scores.is_some(),
            probs: t.output_of(OpClass::AttentionProbs, &[scores]).is_some(),
            embedding: embedding.is_some(),
            stream,
        }
    }

    /// What autocast at `precision` (the `matmuls` policy) keeps in 16 bits.
    pub fn matmuls(precision: Precision) -> Kept16 {
        Kept16::of(precision.format().map(CastTable::matmuls), false)
    }
}

impl Kept {
    /// `n` values into `wide` or, when `narrow`, into `narrow`.
    fn add(&mut self, n: usize, narrow: bool) {
        match narrow {
            true => self.narrow += n,
            false => self.wide += n,
        }
    }

    /// Bytes with every `narrow` value in 16 bits.
    pub fn bytes16(self) -> usize {
        4 * self.wide + 2 * self.narrow
    }
}

/// The values one block keeps for one sequence (see the module docs).
pub fn block_values(cfg: &LlamaConfig, t: usize) -> Kept {
    block_values_with(cfg, t, false)
}

/// [`block_values`] when the attention core is recomputed in backward
/// (`attention_recompute`) or kept.
pub fn block_values_with(cfg: &LlamaConfig, t: usize, attention_recompute: bool) -> Kept {
    block_values_kept(
        cfg,
        t,
        attention_recompute,
        Kept16::matmuls(Precision::Bf16),
        false,
    )
}

/// [`block_values_with`] split by what `k16` keeps in 16 bits: `narrow`
/// counts only those (`first`: the first block, whose input is the
/// embedding's rows).
pub fn block_values_kept(
    cfg: &LlamaConfig,
    t: usize,
    attention_recompute: bool,
    k16: Kept16,
    first: bool,
) -> Kept {
    let (c, f) = (cfg.d_model, cfg.hidden);
    let mut k = Kept {
        wide: 2 * t,
        narrow: 0,
    }; // the norms' 1/rms
       // the block input and the mid-block sum, kept by the norms as they are
    k.add(t * c, if first { k16.embedding } else { k16.stream });
    k.add(t * c, k16.stream);
    // the norms' outputs, v, the attention output, the gate and up
    // projections and their SwiGLU product: read by products (the gate and
    // up are kept by the SwiGLU, 16-bit when a rounded product made them)
    k.add(4 * t * c + 3 * t * f, k16.products);
    k.add(2 * t * c, k16.scores); // q and k after RoPE
    if cfg.dropout > 0.0 {
        // the residual branches' masks
        k.wide += 2 * t * c;
        if !attention_recompute {
            let core = attention_core_kept(cfg, t, k16);
            k.wide += core.wide;
            k.narrow += core.narrow;
        }
    }
    k
}

/// The values the dropout composition of one block's attention keeps for
/// one sequence beyond q, k and v: the softmax output and the mask
/// (`2·H·T²` float32) and the dropped probabilities (`H·T²`, read by a
/// product). None without dropout (the fused op keeps none).
pub fn attention_core_values(cfg: &LlamaConfig, t: usize) -> Kept {
    attention_core_kept(cfg, t, Kept16::matmuls(Precision::Bf16))
}

/// [`attention_core_values`] split by what `k16` keeps in 16 bits.
pub fn attention_core_kept(cfg: &LlamaConfig, t: usize, k16: Kept16) -> Kept {
    let ht2 = cfg.n_heads * t * t;
    let mut k = Kept { wide: 0, narrow: 0 };
    if cfg.dropout > 0.0 {
        k.add(ht2, k16.probs); // the softmax's output
        k.add(ht2, false); // the mask
        k.add(ht2, k16.products); // the dropped probabilities
    }
    k
}

/// The values the embedding, final norm, head and loss keep for one sequence.
pub fn head_values(cfg: &LlamaConfig, t: usize) -> Kept {
    head_kept(cfg, t, Kept16::matmuls(Precision::Bf16))
}

/// [`head_values`] split by what `k16` keeps in 16 bits.
pub fn head_kept(cfg: &LlamaConfig, t: usize, k16: Kept16) -> Kept {
    let c = cfg.d_model;
    // the final norm's 1/rms, each row's max and sum of exps
    let mut k = Kept {
        wide: 3 * t,
        narrow: 0,
    };
    let last = match cfg.n_layers {
        0 => k16.embedding,
        _ => k16.stream,
    };
    k.add(t * c, last); // the last block's output, kept by the final norm
    k.add(t * c + t * cfg.vocab_size, k16.products); // the norm's output, the logits
    k
}

/// Bytes the forward pass has in flight for `n` tokens beyond the values it
/// keeps (see the module docs): under a policy that rounds the matmuls,
/// the larger of the last block's MLP (`10·F + 8·C` per token, before the
/// head's kept values exist) and the logits' float32 slots beside their
/// 16-bit copies (`4·V`); in float32 nothing worth counting.
fn forward_working(cfg: &LlamaConfig, n: usize, k16: Kept16) -> usize {
    if !k16.products {
        return 0;
    }
    let (c, f, v) = (cfg.d_model, cfg.hidden, cfg.vocab_size);
    let head = head_kept(cfg, 1, k16).bytes16();
    n * (4 * v).max((10 * f + 8 * c + stream_slots(cfg, k16)).saturating_sub(head))
}

/// Per token, the float32 slots of the residual stream beside the 16-bit
/// copies the norms keep, under a policy that keeps the stream in 16 bits
/// (`pure`): the block input and the mid-block sum of the block at work are
/// live in float32 (`8·C` bytes) as well as counted in 16 bits.
fn stream_slots(cfg: &LlamaConfig, k16: Kept16) -> usize {
    if k16.stream {
        8 * cfg.d_model
    } else {
        0
    }
}

/// The weight gradients a step's first micro-batch has in flight beside
/// those it has made when its backward peaks, at the first block: the
/// block's `C·F`, with the head's `V·C` and a norm's `C` (float32).
fn gradients_in_flight(cfg: &LlamaConfig) -> usize {
    let (c, f, v) = (cfg.d_model, cfg.hidden, cfg.vocab_size);
    4 * (c * f + v * c + c)
}

/// Bytes the backward pass of `rows` sequences of `t` tokens has in flight
/// beyond the activations and the gradients (see the module docs): the
/// last block's float32 input gradients (`F + C + H` per token), and under
/// a rounding policy the float32 slots of the MLP's 16-bit gradients
/// (`2·F + 2·C + 2·V`) and, where the stream is 16-bit, its float32 slots
/// ([`stream_slots`]). Weight gradients are not in flight there: each goes
/// into the accumulated one as soon as the last node feeding it has run.
fn backward_working(cfg: &LlamaConfig, rows: usize, t: usize, k16: Kept16) -> usize {
    let (c, f, h, v) = (cfg.d_model, cfg.hidden, cfg.n_heads, cfg.vocab_size);
    let n = rows * t;
    let mut w = 4 * n * (f + c + h);
    if k16.products {
        w += n * (2 * f + 2 * c + 2 * v + stream_slots(cfg, k16));
    }
    w
}

/// Bytes the loss's backward has in flight for `n` tokens, every activation
/// still held: the logits' gradient in float32 (`4·V`), beside the logits
/// widened from their 16-bit copy under a policy that rounds the products
/// (`4·V` more), and the loss and its seed gradient (8 bytes). The peak of
/// narrow models, whose vocabulary outweighs a block's widths.
fn loss_working(cfg: &LlamaConfig, n: usize, k16: Kept16) -> usize {
    let per_token = if k16.products { 8 } else { 4 } * cfg.vocab_size;
    n * per_token + 8
}

/// The values a block keeps after its attention core, for one sequence:
/// the core's output (read by `o_proj`), the mid-block sum and the second
/// norm's `1/rms` and output, the MLP's gate, up and product, and with
/// dropout the residual branches' masks. Backward frees them before it
/// reaches the core.
fn after_core_kept(cfg: &LlamaConfig, t: usize, k16: Kept16) -> Kept {
    let (c, f) = (cfg.d_model, cfg.hidden);
    let mut k = Kept { wide: t, narrow: 0 };
    if cfg.dropout > 0.0 {
        k.wide += 2 * t * c;
    }
    k.add(t * c, k16.stream);
    k.add(2 * t * c + 3 * t * f, k16.products);
    k
}

/// Bytes the dropout composition of one block's attention has in flight
/// for one sequence beyond what the step keeps, at its peak in forward and
/// in backward, and what backward has freed by then (the head's values
/// and the block's after its core, [`after_core_kept`]). In units of
/// `U = 4·H·T²` (float32 scores): forward makes the dropped probabilities in
/// float32 beside their 16-bit copy (`U` under a policy that rounds
/// products); backward makes their gradient (`U`, and its 16-bit copy,
/// `U/2`, under such a policy) beside the probabilities' (`U`). Recomputed,
/// the core also holds what it would otherwise keep, made again. None
/// without dropout.
fn attention_core_flight(
    cfg: &LlamaConfig,
    t: usize,
    k16: Kept16,
    recompute: bool,
) -> (usize, usize, usize) {
    if cfg.dropout <= 0.0 {
        return (0, 0, 0);
    }
    let u = 4 * cfg.n_heads * t * t;
    let rounded = if k16.products { u } else { 0 };
    let kept = match recompute {
        true => attention_core_kept(cfg, t, k16).bytes16(),
        false => 0,
    };
    let freed = head_kept(cfg, t, k16).bytes16() + after_core_kept(cfg, t, k16).bytes16();
    (kept + rounded, kept + 2 * u + rounded / 2, freed)
}

/// What an fp8 run keeps beyond [`block_values_kept`] for `n` tokens, per
/// block and for the head, in bytes. Each Linear's product keeps the 16-bit
/// copies of its own E4M3 operands (bf16 autocast; fp8 values are bf16
/// values): its weight's copy, where a plain product keeps the weight itself
/// (a leaf, no copy), and its input's copy. The q, k and v projections read
/// one norm output and the gate and up projections the other, each cast with
/// its own scale: three copies of the first and two of the second where a
/// plain block keeps one of each (`3·C` per token more). Backward has
/// `8·F` bytes a token more in flight (see [`memory_plan_policy`]).
pub fn fp8_block_copies(cfg: &LlamaConfig, n: usize) -> (usize, usize) {
    let (c, f, v) = (cfg.d_model, cfg.hidden, cfg.vocab_size);
    (2 * (4 * c * c + 3 * c * f) + 2 * 3 * c * n, 2 * v * c)
}

/// The planned bytes of one training step with micro-batches of `rows`
/// sequences of `t` tokens, and activation checkpointing at `ckpt_budget`
/// layer units (`None`: off). The precision changes the activations (16-bit
/// storage of what products read), not the parameters' 16 bytes each. An
/// error when the budget
/// is below the smallest peak any checkpoint schedule of the model's layers
/// reaches, or the model has no layers.
pub fn memory_plan(
    cfg: &LlamaConfig,
    rows: usize,
    t: usize,
    precision: Precision,
    ckpt_budget: Option<usize>,
) -> Result<MemoryPlan> {
    memory_plan_with(cfg, rows, t, precision, ckpt_budget, false)
}

/// The plan of a [`Recompute`] policy: [`memory_plan`] with the blocks
/// checkpointed at `ckpt_budget` (the policy's blocks; `None` for `none` and
/// `attention`) and the attention core recomputed when `attention_recompute`.
/// A policy with blocks and no budget is planned at the smallest budget
/// ([`min_ckpt_budget`](crate::recompute::min_ckpt_budget)), as `train` runs it.
pub fn policy_plan(
    cfg: &LlamaConfig,
    rows: usize,
    t: usize,
    precision: Precision,
    policy: Recompute,
    ckpt_budget: Option<usize>,
) -> Result<MemoryPlan> {
    let budget = policy
        .blocks()
        .then(|| ckpt_budget.unwrap_or_else(|| crate::recompute::min_ckpt_budget(cfg.n_layers)));
    memory_plan_with(cfg, rows, t, precision, budget, policy.attention())
}

/// [`memory_plan`] with the attention core recomputed in backward
/// (`attention_recompute`) or kept: recomputed, the core's values leave the
/// activations and one block's worth of them joins the backward working set.
pub fn memory_plan_with(
    cfg: &LlamaConfig,
    rows: usize,
    t: usize,
    precision: Precision,
    ckpt_budget: Option<usize>,
    attention_recompute: bool,
) -> Result<MemoryPlan> {
    let table = precision.format().map(CastTable::matmuls);
    memory_plan_policy(cfg, rows, t, table, ckpt_budget, attention_recompute, false)
}

/// [`memory_plan_with`] under the cast policy `table` (`None`: float32):
/// the values it keeps in 16 bits ([`Kept16`]) at 2 bytes each; with `fp8`,
/// the Linear layers' products in fp8 ([`fp8_block_copies`]).
pub fn memory_plan_policy(
    cfg: &LlamaConfig,
    rows: usize,
    t: usize,
    table: Option<CastTable>,
    ckpt_budget: Option<usize>,
    attention_recompute: bool,
    fp8: bool,
) -> Result<MemoryPlan> {
    let n = cfg.num_params();
    let f32b = 4;
    let k16 = Kept16::of(table, cfg.dropout > 0.0);
    let (fp8_block, fp8_head) = match fp8 {
        true => fp8_block_copies(cfg, rows * t),
        false => (0, 0),
    };
    let block = |first: bool| {
        block_values_kept(cfg, t, attention_recompute, k16, first).bytes16() * rows + fp8_block
    };
    // the blocks a segment of layers [a, b) holds: the first one's input is
    // the embedding's rows
    let segment = |a: usize, b: usize| (a..b).map(|l| block(l == 0)).sum::<usize>();
    // segment starts; one segment (`[0]`) without checkpointing
    let schedule = match ckpt_budget {
        Some(b) => checkpoint_schedule(cfg.n_layers, b)?,
        None => vec![0],
    };
    let (layers, k) = (cfg.n_layers, schedule.len());
    let end = |j: usize| schedule.get(j + 1).copied().unwrap_or(layers);
    let held = (0..k)
        .map(|j| segment(schedule[j], end(j)))
        .max()
        .unwrap_or(0);
    let input = rows * t * cfg.d_model * f32b;
    let head = head_kept(cfg, t, k16).bytes16() * rows + fp8_head;
    let activations = held + (k - 1) * input + head;
    // the working sets: the MLP's and the head's, or the attention core's
    // (with dropout) where that is larger
    let (core_fwd, core_bwd, freed) = attention_core_flight(cfg, t, k16, attention_recompute);
    let core = |flight: usize| rows * flight.saturating_sub(freed);
    // fp8: the E5M2 cast of an MLP gradient holds two float32 temporaries
    // of its width beside it (`ops::fp8::quantize`)
    let bwd = backward_working(cfg, rows, t, k16) + if fp8 { 8 * cfg.hidden * rows * t } else { 0 };
    let at_loss = loss_working(cfg, rows * t, k16);
    let backward_working = bwd.max(at_loss).max(core(core_bwd));
    // a step's first micro-batch peaks making the first block's gradients:
    // its weight gradients, with the head's, are in flight beside the made ones
    let first_working = (bwd + gradients_in_flight(cfg))
        .max(at_loss)
        .max(core(core_bwd));
    // A step's first micro-batch holds only the gradients its backward has
    // made: from the start (every activation, no gradient) it walks down the
    // blocks, the last segment's as kept and each checkpointed one rerun,
    // freeing a block's activations as it makes the block's gradients.
    let (c, f, v) = (cfg.d_model, cfg.hidden, cfg.vocab_size);
    let block_grads = f32b * (4 * c * c + 3 * c * f + 2 * c);
    let head_grads = f32b * (v * c + c); // the LM head's and the final norm's
    let mut first = (k - 1) * input + segment(schedule[k - 1], layers) + head;
    for (j, &s) in schedule.iter().enumerate() {
        for b in s..end(j) {
            let made = head_grads + (layers - 1 - b) * block_grads;
            first = first.max(j * input + segment(s, b + 1) + made);
        }
    }
    let fixed = 3 * n * f32b; // weights and moments
    let with_grads = fixed + n * f32b + activations;
    let forward_working = forward_working(cfg, rows * t, k16).max(core(core_fwd));
    Ok(MemoryPlan {
        params: n,
        weights: n * f32b,
        grads: n * f32b,
        optimizer: 2 * n * f32b,
        activations,
        forward_working,
        backward_working,
        layer_units: crate::recompute::schedule_peak(&schedule, layers),
        forward_peak: with_grads + forward_working,
        backward_peak: with_grads + backward_working,
        first_backward_peak: fixed + first + first_working,
        total: with_grads + forward_working.max(backward_working),
    })
}

impl TrainConfig {
    /// The memory plan of one micro-batch's step under this recipe (its
    /// precision and recompute policy).
    pub fn memory_plan(&self) -> Result<MemoryPlan> {
        Ok(memory_plan_policy(
            &self.model,
            self.micro_batch,
            self.model.context,
            self.cast_table(),
            self.ckpt_budget,
            self.recompute_attention,
            self.fp8.is_some(),
        )?
        .accumulating(self.accum))
    }

    /// The cast policy's table of every step (`None`: a float32 run).
    pub fn cast_table(&self) -> Option<CastTable> {
        self.precision.format().map(|_| self.cast_policy().table())
    }
}

/// Bytes of the largest single tensor one micro-batch of `rows` sequences of
/// `t` tokens allocates (logits, attention weights, the MLP's hidden
/// activations, or the embedding table): on a GPU it must fit in one buffer.
pub fn largest_tensor(cfg: &LlamaConfig, rows: usize, t: usize) -> usize {
    let per_row = [t * cfg.vocab_size, cfg.n_heads * t * t, t * cfg.hidden];
    let biggest = per_row.iter().max().copied().unwrap_or(0);
    4 * (rows.saturating_mul(biggest)).max(cfg.vocab_size * cfg.d_model)
}

/// Bytes the host can still give this process: `MemAvailable` from
/// `/proc/meminfo`, lowered to what a cgroup memory limit leaves (v2
/// `memory.max` − `memory.current`, v1 `memory.limit_in_bytes` −
/// `memory.usage_in_bytes`). `None` where neither is known.
pub fn host_available() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let mem = read("/proc/meminfo").and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    });
    [mem, cgroup_left()].into_iter().flatten().min()
}

/// What this process's cgroup memory limit leaves, if it has one.
fn cgroup_left() -> Option<u64> {
    let num = |p: String| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in groups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        // The path as the process sees it, else the namespace's root.
        let (root, limit, usage) = match ctrl {
            "" => ("/sys/fs/cgroup", "memory.max", "memory.current"),
            c if c.split(',').any(|c| c == "memory") => (
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            ),
            _ => continue,
        };
        for dir in [format!("{root}{path}"), root.to_string()] {
            // "max" (v2) or a huge number (v1) is no limit.
            if let (Some(l), Some(u)) =
                (num(format!("{dir}/{limit}")), num(format!("{dir}/{usage}")))
            {
                if l < 1 << 60 {
                    return Some(l.saturating_sub(u));
                }
                break;
            }
        }
    }
    None
}

/// Where a run's memory comes from, and how much of it there is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryLimit {
    /// The host's RAM (the CPU backend, or a software GPU adapter), bytes available.
    Host(u64),
    /// A GPU adapter's largest buffer, in bytes.
    GpuBuffer(u64),
}

/// Refuses a run that cannot fit before anything is allocated for it: the
/// planned peak of micro-batches of `cfg.micro_batch` against host memory, or
/// its largest tensor against a GPU's buffer limit. The error shows the plan
/// and what would fit: a smaller `--micro-batch` (the batch is kept, as more
/// accumulated micro-batches) or `--checkpoint-activations`.
pub fn admit(cfg: &TrainConfig, limit: MemoryLimit) -> Result<()> {
    let t = cfg.model.context;
    let need = |rows: usize, ckpt: Option<usize>| -> Result<usize> {
        Ok(match limit {
            MemoryLimit::Host(_) => {
                memory_plan_policy(
                    &cfg.model,
                    rows,
                    t,
                    cfg.cast_table(),
                    ckpt,
                    cfg.recompute_attention,
                    cfg.fp8.is_some(),
                )?
                .accumulating(cfg.batch.div_ceil(rows))
                .total
            }
            MemoryLimit::GpuBuffer(_) => largest_tensor(&cfg.model, rows, t),
        })
    };
    let (have, what) = match limit {
        MemoryLimit::Host(b) => (
            b,
            "available host memory (MemAvailable and any cgroup limit)",
        ),
        MemoryLimit::GpuBuffer(b) => (b, "the largest buffer the GPU adapter allows"),
    };
    let needed = need(cfg.micro_batch, cfg.ckpt_budget)?;
    if needed as u64 <= have {
        return Ok(());
    }
    let plan = cfg.memory_plan()?;
    let ckpt = cfg
        .ckpt_budget
        .or(Some(crate::recompute::min_ckpt_budget(cfg.model.n_layers)));
    let mut fix = Vec::new();
    if cfg.ckpt_budget.is_none() && need(cfg.micro_batch, ckpt)? as u64 <= have {
        fix.push(format!(
            "--checkpoint-activations (plans {})",
            mib(need(cfg.micro_batch, ckpt)?)
        ));
    }
    let mut m = cfg.micro_batch / 2;
    while m >= 1 {
        let n = need(m, ckpt)?;
        if n as u64 <= have {
            let with = if cfg.ckpt_budget.is_none() {
                " --checkpoint-activations"
            } else {
                ""
            };
            fix.push(format!(
                "--micro-batch {m}{with} (plans {}; the batch of {} stays, as {} accumulated micro-batches)",
                mib(n),
                cfg.batch,
                cfg.batch.div_ceil(m)
            ));
            break;
        }
        m /= 2;
    }
    let advice = if fix.is_empty() {
        format!(
            "even one sequence per micro-batch with activation checkpointing needs {}: use a smaller --preset",
            mib(need(1, ckpt)?)
        )
    } else {
        format!("try {}", fix.join(", or "))
    };
    let what_needs = match limit {
        MemoryLimit::Host(_) => format!("its planned peak is {}", mib(needed)),
        MemoryLimit::GpuBuffer(_) => format!("its largest tensor is {}", mib(needed)),
    };
    let msg = format!(
        "this run does not fit in memory: {what_needs}, but {what} is {}; {advice}.\n{}",
        mib(have as usize),
        plan.describe(cfg, t)
    );
    Err(match limit {
        MemoryLimit::Host(_) => crate::Error::config(msg),
        MemoryLimit::GpuBuffer(_) => crate::Error::device(msg),
    })
}

/// What `device` can give: host memory for the CPU; a GPU's buffer limit,
/// and host memory too for a software adapter (its buffers are host
/// memory). A hardware GPU's total memory is not known to wgpu.
pub fn memory_limits(device: crate::Device) -> Result<Vec<MemoryLimit>> {
    let host = MemoryLimit::Host(host_available().unwrap_or(u64::MAX));
    Ok(match device {
        crate::Device::Cpu | crate::Device::Spec => vec![host],
        #[cfg(not(feature = "gpu"))]
        crate::Device::Gpu => return Err(crate::backend::no_gpu()),
        #[cfg(feature = "gpu")]
        crate::Device::Gpu => {
            let c = crate::backend::gpu::context::ctx()?;
            let buffer = MemoryLimit::GpuBuffer(c.max_binding());
            if c.info.device_type == wgpu::DeviceType::Cpu {
                vec![host, buffer]
            } else {
                vec![buffer]
            }
        }
    })
}

/// Bytes a forward pass without a graph (evaluation, sampling) holds at its
/// peak besides the weights, for `rows` sequences of `t` tokens: a block's
/// float32 values at once (its input, norm, q, k, v, attention output, the
/// MLP's three `F`-wide values; the attention's scores, probabilities and
/// their masked copy, `3·H·T²`), then the logits and the loss's softmax.
pub fn inference_bytes(cfg: &LlamaConfig, rows: usize, t: usize) -> u64 {
    let (c, f, h, v) = (
        cfg.d_model as u64,
        cfg.hidden as u64,
        cfg.n_heads as u64,
        cfg.vocab_size as u64,
    );
    let (rows, t) = (rows as u64, t as u64);
    let block = 6 * t * c + 3 * t * f + 3 * h * t * t;
    let head = 2 * t * v + t * c;
    rows.saturating_mul(4 * block.max(head))
}

/// Refuses a forward pass without a graph that cannot fit (`what`: `eval`,
/// `generate`) before it allocates anything: [`inference_bytes`] against the
/// host's available memory, its largest tensor against a GPU's buffer limit.
/// The error names the model's context, the bytes and the limit.
pub fn admit_inference(
    cfg: &LlamaConfig,
    rows: usize,
    t: usize,
    device: crate::Device,
    what: &str,
) -> Result<()> {
    for limit in memory_limits(device)? {
        let (need, have, of) = match limit {
            MemoryLimit::Host(b) => (
                inference_bytes(cfg, rows, t),
                b,
                "available host memory (MemAvailable and any cgroup limit)",
            ),
            MemoryLimit::GpuBuffer(b) => (
                largest_tensor(cfg, rows, t) as u64,
                b,
                "the largest buffer the GPU adapter allows",
            ),
        };
        if need > have {
            let msg = format!(
                "{what}: {rows} sequence(s) of {t} tokens (the model's context is {}) need {} at once besides the weights, but {of} is {}; this model cannot run that context on this machine",
                cfg.context,
                mib(need.min(usize::MAX as u64) as usize),
                mib(have.min(usize::MAX as u64) as usize)
            );
            return Err(match limit {
                MemoryLimit::Host(_) => crate::Error::config(msg),
                MemoryLimit::GpuBuffer(_) => crate::Error::device(msg),
            });
        }
    }
    Ok(())
}

/// `b` bytes in MiB with one decimal, e.g. `79.1 MiB`.
pub(crate) fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

impl MemoryPlan {
    /// The plan of a step of `accum` micro-batches. Every step starts
    /// without gradients (they are dropped after the update), so only the
    /// micro-batches after the first run with them whole. With one
    /// micro-batch the forward pass holds none and backward holds those it
    /// has made: its peak is at its start (every activation, no gradient)
    /// when activations outweigh gradients, near its end (the first block's
    /// activations beside every later block's gradients) when they do not.
    pub fn accumulating(self, accum: usize) -> MemoryPlan {
        if accum > 1 {
            return self;
        }
        let (forward_peak, backward_peak) =
            (self.forward_peak - self.grads, self.first_backward_peak);
        MemoryPlan {
            forward_peak,
            backward_peak,
            total: forward_peak.max(backward_peak),
            ..self
        }
    }

    /// The plan of `cfg`'s run at context `t`, as a few lines for its start.
    pub fn describe(&self, cfg: &TrainConfig, t: usize) -> String {
        let rows = cfg.micro_batch;
        let mut ck = match cfg.ckpt_budget {
            Some(b) => format!(
                "checkpointing (budget {b}, peak {} layer units)",
                self.layer_units
            ),
            None => "no checkpointing".into(),
        };
        if cfg.recompute_attention {
            ck.push_str(", attention core recomputed");
        }
        format!(
            "memory plan ({} params, micro-batch {rows}×{t} tokens, {}, {ck}):\n  \
             weights {}  grads {}  AdamW moments {}  activations {}  working sets: forward {}, backward {}\n  \
             planned peak {} (forward {}, backward {})",
            self.params,
            cfg.recipe_label(),
            mib(self.weights),
            mib(self.grads),
            mib(self.optimizer),
            mib(self.activations),
            mib(self.forward_working),
            mib(self.backward_working),
            mib(self.total),
            mib(self.forward_peak),
            mib(self.backward_peak)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpointing_and_micro_batches_lower_the_plan() {
        let cfg = LlamaConfig::preset("capstone").unwrap();
        let full = memory_plan(&cfg, 32, 512, Precision::Fp32, None).unwrap();
        let mixed = memory_plan(&cfg, 8, 512, Precision::Bf16, Some(5)).unwrap();
        // AdamW: 16 bytes per parameter either way (emulated bf16).
        assert_eq!(
            full.weights + full.grads + full.optimizer,
            16 * cfg.num_params()
        );
        assert_eq!(
            mixed.weights + mixed.grads + mixed.optimizer,
            16 * cfg.num_params()
        );
        assert!(mixed.activations * 4 < full.activations);
        assert_eq!(mixed.layer_units, 5);
        // One 512-token sequence through the 8 blocks, as this forward pass
        // keeps it: 2·T·C + 2·T = 328,704 float32 values per block and
        // 6·T·C + 3·T·F = 2,371,584 kept as products read them.
        let k = block_values(&cfg, 512);
        assert_eq!(k.bytes(Precision::Fp32) * 8, 86_409_216);
        assert_eq!(k.bytes(Precision::Bf16) * 8, 48_463_872);
        assert_eq!(k.bytes(Precision::Fp16), k.bytes(Precision::Bf16));
        // 16-bit storage alone: the C1 micro-batch keeps ≥ 40 % less than
        // the same recipe in float32.
        let c1 = |p| memory_plan(&cfg, 8, 512, p, Some(5)).unwrap().activations as f64;
        assert!(c1(Precision::Bf16) <= 0.6 * c1(Precision::Fp32));
    }

    #[test]
    fn the_plan_names_the_recipe_it_plans() {
        use crate::train::config::TrainOptions;
        for (policy, fp8, want) in [
            (None, false, ", bf16, "),
            (Some("torch"), false, ", bf16 (cast policy torch), "),
            (None, true, ", bf16 + fp8 linears, "),
        ] {
            let cfg = TrainConfig::resolve(&TrainOptions {
                preset: Some("tiny".into()),
                precision: Some(Precision::Bf16),
                cast_policy: policy.map(str::to_string),
                fp8: Some(fp8),
                ..Default::default()
            })
            .unwrap();
            let line = cfg.memory_plan().unwrap().describe(&cfg, cfg.model.context);
            assert!(line.contains(want), "{line}");
        }
    }

    #[test]
    fn admission_refuses_what_does_not_fit_and_says_what_would() {
        use crate::train::config::TrainOptions;
        let cfg = TrainConfig::resolve(&TrainOptions {
            preset: Some("small".into()),
            batch: Some(64),
            micro_batch: Some(64),
            checkpoint_activations: Some(false),
            ..Default::default()
        })
        .unwrap();
        let t = cfg.model.context;
        let full = memory_plan(&cfg.model, 64, t, cfg.precision, None)
            .unwrap()
            .total as u64;
        assert!(admit(&cfg, MemoryLimit::Host(full)).is_ok());
        let e = admit(&cfg, MemoryLimit::Host(full / 4))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("planned peak is 193.2 MiB")
                && e.contains("try --micro-batch 16 --checkpoint-activations (plans 41.7 MiB")
                && e.contains("memory plan ("),
            "{e}"
        );
        let ck = crate::recompute::min_ckpt_budget(cfg.model.n_layers);
        let with_ck = memory_plan(&cfg.model, 64, t, cfg.precision, Some(ck))
            .unwrap()
            .total;
        let e = admit(&cfg, MemoryLimit::Host(with_ck as u64))
            .unwrap_err()
            .to_string();
        assert!(e.contains("try --checkpoint-activations (plans"), "{e}");
        let e = admit(&cfg, MemoryLimit::Host(1 << 20))
            .unwrap_err()
            .to_string();
        assert!(e.contains("use a smaller --preset"), "{e}");
        let big = largest_tensor(&cfg.model, 64, t) as u64;
        assert!(admit(&cfg, MemoryLimit::GpuBuffer(big)).is_ok());
        let e = admit(&cfg, MemoryLimit::GpuBuffer(big / 2)).unwrap_err();
        assert!(matches!(e, crate::Error::Device(_)), "{e}");
        assert!(e.to_string().contains("--micro-batch 32"), "{e}");
    }

    /// The plan's activation count is what the forward pass really holds,
    /// in each precision, and with every Linear in fp8 (beside the amaxes the
    /// recipe records: the 16-bit copies of each product's own operands).
    #[test]
    fn planned_activations_match_the_measured_ones() {
        use crate::nn::llama::Llama;
        use crate::precision::{autocast, fp8_scope, DelayedScaling, Fp8Config};
        use crate::{memory, Device};
        use std::{cell::RefCell, rc::Rc};
        let runs = [
            (Precision::Fp32, false),
            (Precision::Bf16, false),
            (Precision::Fp16, false),
            (Precision::Bf16, true),
        ];
        for (precision, fp8) in runs {
            for dropout in [0.0, 0.1] {
                let mut cfg = LlamaConfig::preset("tiny").unwrap();
                cfg.dropout = dropout;
                let m = Llama::new(&cfg, 0, Device::Cpu).unwrap();
                let (b, t) = (3, cfg.context);
                let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % 256) as u32).collect();
                let recipe = Rc::new(RefCell::new(
                    DelayedScaling::new(Fp8Config::default()).unwrap(),
                ));
                let base = memory::live_bytes();
                let loss = {
                    let _ac = autocast(precision.format());
                    let _f = fp8.then(|| fp8_scope(&recipe));
                    let logits = m.forward(&ids, b, t).unwrap();
                    crate::ops::cross_entropy(&logits, &ids).unwrap()
                };
                let held = memory::live_bytes() - base;
                let table = precision.format().map(CastTable::matmuls);
                let plan = memory_plan_policy(&cfg, b, t, table, None, false, fp8).unwrap();
                // each fp8 Linear's input's and weight's amax and saturation count
                let recorded = if fp8 {
                    4 * 4 * (7 * cfg.n_layers + 1)
                } else {
                    0
                };
                // The loss value itself (4 bytes) is the other thing the plan leaves out.
                assert_eq!(
                    held,
                    plan.activations + 4 + recorded,
                    "{} fp8 {fp8} dropout {dropout}",
                    precision.name()
                );
                drop(loss);
            }
        }
    }
}
