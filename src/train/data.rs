//! Text to batches: a byte-level tokenizer, a corpus (the embedded default or
//! any UTF-8 file), a seeded train/validation split, and batches drawn from a
//! [`Generator`] whose `(seed, offset)` state is the data position a
//! checkpoint saves.

use crate::rng::Generator;
use crate::train::sha256::Sha256;
use crate::train::step::MicroBatch;
use crate::{bail, Result};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Bytes are tokens: id = byte value, vocabulary 256. Any UTF-8 text encodes;
/// decoding replaces an incomplete sequence (a sample cut mid-character) with U+FFFD.
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// The vocabulary size: one id per byte value.
    pub const VOCAB: usize = 256;
    /// The ids of `text`'s UTF-8 bytes, one per byte.
    pub fn encode(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }
    /// The text of `ids`, one byte each (an id above 255 is read as 255);
    /// bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().map(|&i| i.min(255) as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The largest training or evaluation text, in bytes (a larger file is
/// refused before it is read).
pub const MAX_CORPUS_BYTES: u64 = 2 << 30;

/// A tokenized text and where it came from.
pub struct Corpus {
    /// `"embedded"` or the file's path.
    pub name: String,
    /// The text's bytes, which are its tokens (one byte each in memory, shared
    /// with the [`Dataset`] built from it; batches widen them to `u32` ids).
    pub tokens: Arc<Vec<u8>>,
    /// SHA-256 of the text (hex): a resumed run must see the same data.
    pub fingerprint: String,
}

impl Corpus {
    /// A corpus of `text` under `name`, fingerprinted by its SHA-256. Nothing
    /// is checked (an empty or short text fails later, in [`Dataset::new`]).
    pub fn from_text(name: &str, text: &str) -> Corpus {
        Corpus::from_bytes(name, text.as_bytes().to_vec())
    }

    fn from_bytes(name: &str, bytes: Vec<u8>) -> Corpus {
        Corpus {
            name: name.to_string(),
            fingerprint: Sha256::digest_hex(&bytes),
            tokens: Arc::new(bytes),
        }
    }

    /// The embedded default corpus (`train::corpus`).
    pub fn embedded() -> Corpus {
        Corpus::from_text("embedded", super::corpus::default_text())
    }

    /// A UTF-8 text file of at most [`MAX_CORPUS_BYTES`]; every failure names
    /// the file. Only a regular file is read (a device such as `/dev/zero`
    /// never ends, a FIFO without a writer blocks forever), and never more
    /// than the limit, even if the file grows while it is read.
    pub fn from_file(path: &Path) -> Result<Corpus> {
        let shown = path.display();
        let io = |e| crate::Error::io(format!("cannot read corpus {shown}"), e);
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            bail!(
                Data,
                "corpus {shown} is not a regular file ({}): give a UTF-8 text file",
                file_kind(&meta)
            );
        }
        let too_large = |n: u64| {
            crate::Error::data(format!(
                "corpus {shown} is {n} bytes, more than tinyllm reads ({} MiB at most): cut it down or split it",
                MAX_CORPUS_BYTES >> 20
            ))
        };
        if meta.len() > MAX_CORPUS_BYTES {
            return Err(too_large(meta.len()));
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_CORPUS_BYTES + 1).read_to_end(&mut bytes))
            .map_err(io)?;
        if bytes.len() as u64 > MAX_CORPUS_BYTES {
            return Err(too_large(bytes.len() as u64));
        }
        if bytes.is_empty() {
            bail!(
                Data,
                "corpus {shown} is empty: give a UTF-8 text file with some text in it"
            );
        }
        std::str::from_utf8(&bytes).map_err(|e| {
            crate::Error::data(format!(
                "corpus {shown} is not UTF-8 text (invalid byte at offset {}); convert it to UTF-8 first",
                e.valid_up_to()
            ))
        })?;
        if let Some(at) = bytes.iter().position(|&b| b == 0) {
            bail!(Data, "corpus {shown} looks like a binary file (a NUL byte at offset {at}): give a UTF-8 text file");
        }
        Ok(Corpus::from_bytes(&shown.to_string(), bytes))
    }

    /// `Some(path)` → the file, `None` → the embedded corpus.
    pub fn load(path: Option<&PathBuf>) -> Result<Corpus> {
        match path {
            Some(p) => Corpus::from_file(p),
            None => Ok(Corpus::embedded()),
        }
    }
}

/// What kind of file system entry `meta` is, in words.
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// `rows` sequences of `t` tokens and their next-token targets (row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The input token ids, `rows × t`, row-major.
    pub ids: Vec<u32>,
    /// The next token after each input, `rows × t`, row-major.
    pub targets: Vec<u32>,
    /// Sequences in the batch.
    pub rows: usize,
    /// Tokens per sequence (the model's context).
    pub t: usize,
}

impl MicroBatch for Batch {
    fn rows(&self) -> usize {
        self.rows
    }
}

impl Batch {
    /// Consecutive micro-batches of at most `micro` rows (the last may be
    /// smaller; accumulation weights each by its rows).
    pub fn split(&self, micro: usize) -> Vec<Batch> {
        let micro = micro.max(1);
        (0..self.rows)
            .step_by(micro)
            .map(|r0| {
                let r1 = (r0 + micro).min(self.rows);
                Batch {
                    ids: self.ids[r0 * self.t..r1 * self.t].to_vec(),
                    targets: self.targets[r0 * self.t..r1 * self.t].to_vec(),
                    rows: r1 - r0,
                    t: self.t,
                }
            })
            .collect()
    }
}

/// A contiguous run of tokens `[start, start + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The index of the piece's first token in the corpus.
    pub start: usize,
    /// Tokens in the piece.
    pub len: usize,
}

/// The corpus cut into pieces, shuffled with the seed, the first tenth (at
/// least one piece) held out for validation. Windows never cross a piece, so
/// no training window overlaps a validation one.
pub struct Dataset {
    /// The corpus's bytes (shared, not copied).
    pub tokens: Arc<Vec<u8>>,
    /// Tokens per window (the model's context).
    pub context: usize,
    /// The training pieces, in corpus order.
    pub train: Vec<Piece>,
    /// The held-out validation pieces, in corpus order.
    pub val: Vec<Piece>,
    /// Cumulative count of training windows per piece (for uniform sampling).
    cum: Vec<usize>,
}

impl Dataset {
    /// Cuts `corpus` into pieces (a twentieth of the text each, capped at
    /// 4096 tokens but never shorter than one window of `context + 1`; the
    /// last takes the remainder) and splits them with `seed`. An error when `context` is 0 or the corpus holds fewer than two
    /// pieces (it needs at least `2 · (context + 1)` bytes).
    pub fn new(corpus: &Corpus, context: usize, seed: u64) -> Result<Dataset> {
        if context == 0 {
            bail!(Data, "context must be at least 1 token");
        }
        let n = corpus.tokens.len();
        let w = context + 1; // a window: t inputs and the next token
        let piece = w.max((n / 20).min(4096));
        let count = n / piece;
        if count < 2 {
            bail!(Data,
                "corpus {} is too short: {n} bytes, but a context of {context} needs at least {} (one window of {w} for training and one for validation)",
                corpus.name,
                2 * w
            );
        }
        let mut pieces: Vec<Piece> = (0..count)
            .map(|i| Piece {
                start: i * piece,
                len: if i + 1 == count { n - i * piece } else { piece },
            })
            .collect();
        // Fisher–Yates with the split's own stream (independent of the batch order).
        let g = Generator::new(seed ^ SPLIT_KEY);
        for i in (1..pieces.len()).rev() {
            let j = g.below(i + 1);
            pieces.swap(i, j);
        }
        let n_val = (count / 10).max(1);
        let mut val = pieces[..n_val].to_vec();
        let mut train = pieces[n_val..].to_vec();
        val.sort_by_key(|p| p.start);
        train.sort_by_key(|p| p.start);
        let mut cum = Vec::with_capacity(train.len());
        let mut acc = 0;
        for p in &train {
            acc += p.len - context; // window starts s with s + context + 1 <= len
            cum.push(acc);
        }
        Ok(Dataset {
            tokens: Arc::clone(&corpus.tokens),
            context,
            train,
            val,
            cum,
        })
    }

    fn window(&self, s: usize) -> (&[u8], &[u8]) {
        let t = self.context;
        (&self.tokens[s..s + t], &self.tokens[s + 1..s + t + 1])
    }

    /// `rows` training windows drawn uniformly from `gen` (its state is the data
    /// position). The draw does not depend on how the batch is split later.
    pub fn sample_batch(&self, gen: &Generator, rows: usize) -> Batch {
        let total = *self.cum.last().expect("at least one training piece");
        let mut ids = Vec::with_capacity(rows * self.context);
        let mut targets = Vec::with_capacity(rows * self.context);
        for _ in 0..rows {
            let k = gen.below(total);
            let pi = self.cum.partition_point(|&c| c <= k);
            let before = if pi == 0 { 0 } else { self.cum[pi - 1] };
            let s = self.train[pi].start + (k - before);
            let (x, y) = self.window(s);
            ids.extend(x.iter().map(|&b| u32::from(b)));
            targets.extend(y.iter().map(|&b| u32::from(b)));
        }
        Batch {
            ids,
            targets,
            rows,
            t: self.context,
        }
    }

    /// Up to `max_rows` validation windows: non-overlapping windows of every
    /// validation piece, thinned evenly. Deterministic, the same every call.
    pub fn val_batch(&self, max_rows: usize) -> Batch {
        let t = self.context;
        let starts: Vec<usize> = self
            .val
            .iter()
            .flat_map(|p| (0..(p.len - 1) / t).map(move |i| p.start + i * t))
            .collect();
        let take = starts.len().min(max_rows.max(1));
        let mut ids = Vec::with_capacity(take * t);
        let mut targets = Vec::with_capacity(take * t);
        for i in 0..take {
            let (x, y) = self.window(starts[i * starts.len() / take]);
            ids.extend(x.iter().map(|&b| u32::from(b)));
            targets.extend(y.iter().map(|&b| u32::from(b)));
        }
        Batch {
            ids,
            targets,
            rows: take,
            t,
        }
    }
}

/// The split stream's key, xored into the seed (any fixed constant).
const SPLIT_KEY: u64 = 0xda7a_5917;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_roundtrip() {
        let s = "héllo, wörld";
        assert_eq!(ByteTokenizer::decode(&ByteTokenizer::encode(s)), s);
    }
}
