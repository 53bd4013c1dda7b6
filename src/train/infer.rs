//! A model without a graph: validation loss, evaluation of a text, sampling.
//! Each runs with dropout off and puts the model back in training mode when
//! it is done, also when it fails ([`EvalMode`]).

use crate::module::Module;
use crate::nn::llama::Llama;
use crate::ops::cross_entropy;
use crate::precision::{autocast, CastTable, Precision, Scope};
use crate::rng::Generator;
use crate::train::data::{Batch, ByteTokenizer, Corpus};
use crate::{bail, Result};
use std::ops::ControlFlow;

/// Dropout off while alive; back to training mode when dropped (on every
/// path out: a return, an error, a panic).
pub struct EvalMode<'a>(&'a dyn Module);

impl<'a> EvalMode<'a> {
    /// Turns `model`'s dropout off until the guard is dropped.
    pub fn new(model: &'a dyn Module) -> EvalMode<'a> {
        model.set_training(false);
        EvalMode(model)
    }
}

impl Drop for EvalMode<'_> {
    fn drop(&mut self) {
        self.0.set_training(true);
    }
}

/// Mean cross-entropy of `batch` under `precision`, without a graph, in chunks
/// of `chunk` rows (weighted by rows). Dropout is off while it runs.
pub fn evaluate(model: &Llama, batch: &Batch, precision: Precision, chunk: usize) -> Result<f32> {
    evaluate_under(
        model,
        batch,
        precision.format().map(CastTable::matmuls),
        chunk,
    )
}

/// [`evaluate`] under the cast policy `table` (`None`: float32): a run's
/// validation in its own recipe.
pub fn evaluate_under(
    model: &Llama,
    batch: &Batch,
    table: Option<CastTable>,
    chunk: usize,
) -> Result<f32> {
    let _ng = crate::no_grad();
    let _ac = autocast(Scope::table(table));
    let _eval = EvalMode::new(model);
    let mut total = 0.0f64;
    for mb in batch.split(chunk) {
        let logits = model.forward(&mb.ids, mb.rows, mb.t)?;
        total += cross_entropy(&logits, &mb.targets)?.item()? * mb.rows as f64;
    }
    Ok((total / batch.rows as f64) as f32)
}

/// Windows per chunk of [`eval_text`].
const EVAL_CHUNK: usize = 8;

/// Mean cross-entropy of `model` over a text: every full window of the
/// model's context, non-overlapping (a shorter text is one window), in chunks
/// of 8 windows built as they are needed, so memory does not grow with the
/// text. Calls `progress(windows done, windows)` after each chunk. Returns the
/// loss and the number of tokens scored.
pub fn eval_text(
    model: &Llama,
    corpus: &Corpus,
    precision: Precision,
    mut progress: impl FnMut(usize, usize),
) -> Result<(f32, usize)> {
    let toks = &corpus.tokens;
    if toks.len() < 2 {
        bail!(
            Data,
            "{}: need at least 2 bytes of text to evaluate",
            corpus.name
        );
    }
    let t = model.cfg.context.min(toks.len() - 1);
    let windows = (toks.len() - 1) / t;
    let rows = EVAL_CHUNK.min(windows);
    crate::train::plan::admit_inference(&model.cfg, rows, t, model.device(), "eval")?;
    let _ng = crate::no_grad();
    let _ac = autocast(precision.format());
    let _eval = EvalMode::new(model);
    let mut total = 0.0f64;
    for w0 in (0..windows).step_by(EVAL_CHUNK) {
        let rows = EVAL_CHUNK.min(windows - w0);
        let span = &toks[w0 * t..(w0 + rows) * t + 1];
        let ids: Vec<u32> = span[..rows * t].iter().map(|&b| u32::from(b)).collect();
        let targets: Vec<u32> = span[1..].iter().map(|&b| u32::from(b)).collect();
        let logits = model.forward(&ids, rows, t)?;
        total += cross_entropy(&logits, &targets)?.item()? * rows as f64;
        progress(w0 + rows, windows);
    }
    Ok(((total / windows as f64) as f32, windows * t))
}

/// A checkpoint's loss on its own held-out windows.
#[derive(Clone, Debug)]
pub struct HeldOut {
    /// Mean cross-entropy (nats/byte), the model in float32.
    pub loss: f32,
    /// Windows evaluated (of `context` tokens each).
    pub windows: usize,
    /// The text the windows were cut from (`"embedded"` or its path).
    pub corpus: String,
}

/// The checkpoint in `dir` on the validation windows of the text it was
/// trained on: the same split (context, seed) and rows as its runs'
/// validation loss, evaluated in float32 on `device`. The text is `text`
/// when given (the training text wherever it is now), else found where the
/// run's config says; either way it must be the same by its SHA-256. An
/// error says so when it is not, when the recorded file is gone, and when
/// `dir` holds a model without its training state (a model folder: evaluate
/// a text with [`eval_text`]).
pub fn heldout(
    dir: &std::path::Path,
    device: crate::Device,
    text: Option<Corpus>,
) -> Result<HeldOut> {
    let ck = crate::train::checkpoint::Verified::open_model(dir)?;
    let st = ck.train_state()?;
    let model = crate::train::checkpoint::load_model(dir, device)?;
    let corpus = match (text, st.config.data.as_ref()) {
        (Some(c), _) => c,
        (None, Some(p)) if !p.exists() => bail!(
            Data,
            "{}: the checkpoint was trained on {}, which is no longer there; give --data with that text where it is now (the same text by SHA-256 {}) to cut its held-out windows again",
            dir.display(),
            p.display(),
            st.data_fingerprint
        ),
        (None, recorded) => Corpus::load(recorded)?,
    };
    if corpus.fingerprint != st.data_fingerprint {
        bail!(
            Data,
            "{}: the checkpoint was trained on {} (SHA-256 {}), but {} holds other text, so its held-out windows cannot be cut again; give --data with the training text, or any other file to evaluate all of it",
            dir.display(),
            st.data_name,
            st.data_fingerprint,
            corpus.name
        );
    }
    let data = crate::train::data::Dataset::new(&corpus, model.cfg.context, st.config.seed)?;
    let batch = data.val_batch(st.config.eval_rows);
    crate::train::plan::admit_inference(&model.cfg, batch.rows.min(8), batch.t, device, "eval")?;
    Ok(HeldOut {
        // chunks of 8 rows whatever the run's micro-batch: the same sum for every run
        loss: evaluate(&model, &batch, Precision::Fp32, 8)?,
        windows: batch.rows,
        corpus: corpus.name,
    })
}

/// Samples `n` tokens after `prompt`: temperature (0 = greedy), top-k (0 =
/// all), drawing from `gen`. Each step feeds the last `context` tokens.
/// Greedy decoding never repeats a run of [`NO_REPEAT`] tokens already in
/// the context (it takes the best token that does not): plain argmax on a
/// small model falls into a loop ("the the the …") it can never leave.
pub fn generate(
    model: &Llama,
    prompt: &[u32],
    n: usize,
    temperature: f32,
    top_k: usize,
    gen: &Generator,
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(n);
    generate_with(model, prompt, n, temperature, top_k, gen, |id| {
        out.push(id);
        ControlFlow::Continue(())
    })?;
    Ok(out)
}

/// [`generate`], handing each token to `each` as soon as it is drawn;
/// `ControlFlow::Break` stops early (a reader that went away).
pub fn generate_with(
    model: &Llama,
    prompt: &[u32],
    n: usize,
    temperature: f32,
    top_k: usize,
    gen: &Generator,
    mut each: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<()> {
    let longest = model.cfg.context.min(prompt.len().max(1).saturating_add(n));
    crate::train::plan::admit_inference(&model.cfg, 1, longest, model.device(), "generate")?;
    let _ng = crate::no_grad();
    let _eval = EvalMode::new(model);
    let mut ids: Vec<u32> = if prompt.is_empty() {
        vec![b'\n' as u32]
    } else {
        prompt.to_vec()
    };
    let v = model.cfg.vocab_size;
    for _ in 0..n {
        let start = ids.len().saturating_sub(model.cfg.context);
        let window = &ids[start..];
        let logits = model.forward(window, 1, window.len())?;
        let last = logits.narrow(0, window.len() - 1, 1)?.to_vec_f32()?;
        let next = if temperature <= 0.0 {
            greedy_without_repeats(&last[..v], window, NO_REPEAT)
        } else {
            sample_logits(&last[..v], temperature, top_k, gen)
        };
        ids.push(next);
        if each(next).is_break() {
            break;
        }
    }
    Ok(())
}

/// Greedy decoding's repetition guard: the length of a token run that may
/// not occur twice in the context.
pub const NO_REPEAT: usize = 8;

/// The most likely token that does not complete a run of `n` tokens already
/// in `history` (its last `n − 1` tokens followed by the token); the plain
/// argmax when every token would (or `n < 2`).
pub fn greedy_without_repeats(logits: &[f32], history: &[u32], n: usize) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if n < 2 || history.len() < n - 1 {
        return order[0] as u32;
    }
    let tail = &history[history.len() - (n - 1)..];
    // the tokens that followed an earlier occurrence of `tail`
    let banned: Vec<u32> = history
        .windows(n)
        .filter(|w| &w[..n - 1] == tail)
        .map(|w| w[n - 1])
        .collect();
    order
        .iter()
        .map(|&i| i as u32)
        .find(|t| !banned.contains(t))
        .unwrap_or(order[0] as u32)
}

/// One draw from softmax(logits / temperature) restricted to the top k.
pub fn sample_logits(logits: &[f32], temperature: f32, top_k: usize, gen: &Generator) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if temperature <= 0.0 {
        return order[0] as u32;
    }
    let k = if top_k == 0 {
        logits.len()
    } else {
        top_k.min(logits.len())
    };
    let top = &order[..k];
    let m = logits[top[0]] as f64;
    let w: Vec<f64> = top
        .iter()
        .map(|&i| ((logits[i] as f64 - m) / temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let u = gen.uniform(1)[0] as f64 * total;
    let mut acc = 0.0;
    for (j, &wi) in w.iter().enumerate() {
        acc += wi;
        if u < acc {
            return top[j] as u32;
        }
    }
    top[k - 1] as u32
}

/// A sample from a trained model, as text (the prompt included).
pub fn sample_text(
    model: &Llama,
    prompt: &str,
    n: usize,
    temperature: f32,
    top_k: usize,
    seed: u64,
) -> Result<String> {
    let ids = ByteTokenizer::encode(prompt);
    let out = generate(model, &ids, n, temperature, top_k, &Generator::new(seed))?;
    Ok(format!("{prompt}{}", ByteTokenizer::decode(&out)))
}

/// Bytes to text as they arrive: complete UTF-8 sequences come out at once,
/// an invalid byte as U+FFFD, an incomplete tail waits for the next byte (or
/// [`finish`](Self::finish)): the same text as decoding all bytes at the end.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// The text that byte `b` completes (often empty, in a multi-byte character).
    pub fn push(&mut self, b: u8) -> String {
        self.pending.push(b);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let ok = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..ok]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete sequence at the end: wait for more.
                        None => {
                            self.pending.drain(..ok);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..ok + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is left: an incomplete sequence, as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::greedy_without_repeats;

    #[test]
    fn greedy_skips_the_token_that_would_repeat_a_run() {
        let logits = [0.0, 3.0, 2.0, 1.0]; // argmax 1, then 2
                                           // "1 2 3 1 2" + 3 would repeat the run "1 2 3" (n = 3): 3 is banned, but
                                           // 1 (the argmax) is not
        assert_eq!(greedy_without_repeats(&logits, &[1, 2, 3, 1, 2], 3), 1);
        // "3 1 1 3 1" + 1 would repeat "3 1 1": the argmax 1 is banned, 2 next
        assert_eq!(greedy_without_repeats(&logits, &[3, 1, 1, 3, 1], 3), 2);
        // short history or n < 2: the plain argmax
        assert_eq!(greedy_without_repeats(&logits, &[1], 3), 1);
        assert_eq!(greedy_without_repeats(&logits, &[1, 1, 1], 1), 1);
    }

    use super::Utf8Stream;

    /// Streaming gives exactly `from_utf8_lossy` of all the bytes, whatever
    /// mix of ASCII, multi-byte characters, stray and cut-off bytes arrives.
    #[test]
    fn utf8_stream_equals_lossy_decoding_of_the_whole() {
        let pieces: [&[u8]; 8] = [
            b"ab",
            "é".as_bytes(),
            "€".as_bytes(),
            "😀".as_bytes(),
            &[0xff],
            &[0xe2, 0x82],
            &[0xf0, 0x9f],
            &[0x80],
        ];
        let gen = crate::rng::Generator::new(7);
        for _ in 0..500 {
            let bytes: Vec<u8> = (0..gen.below(12))
                .flat_map(|_| pieces[gen.below(pieces.len())].iter().copied())
                .collect();
            let mut s = Utf8Stream::default();
            let mut got: String = bytes.iter().map(|&b| s.push(b)).collect();
            got.push_str(&s.finish());
            assert_eq!(got, String::from_utf8_lossy(&bytes), "{bytes:x?}");
        }
    }
}
