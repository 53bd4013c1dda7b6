//! `metrics.jsonl`: one JSON object per optimizer step.

use crate::Result;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One step's record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// The optimizer step (1-based).
    pub step: usize,
    /// NaN or ±inf on a skipped fp16 step: written as `null` (JSON has no
    /// NaN), read back as NaN.
    #[serde(deserialize_with = "f32_or_nan")]
    pub loss: f32,
    /// The validation loss, on the steps that evaluated (left out of the
    /// line otherwise).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f32>,
    /// The learning rate of this step.
    #[serde(deserialize_with = "f32_or_nan")]
    pub lr: f32,
    /// The loss scale after the step (1 without a loss scaler, i.e. except
    /// in fp16).
    #[serde(deserialize_with = "f32_or_nan")]
    pub scale: f32,
    /// True when the loss scaler skipped the update (non-finite gradients).
    pub skipped: bool,
    /// The global gradient norm before clipping, when clipping is on.
    pub grad_norm: Option<f32>,
    /// fp8 runs: values whose scaled magnitude exceeded their format's
    /// maximum in the step (saturated).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub fp8_saturated: Option<u64>,
    /// Training tokens per second of this step alone.
    pub tokens_per_s: f64,
    /// The step's peak of tensor bytes (see [`crate::memory`]).
    pub peak_bytes: usize,
    /// The peak of the step's forward passes alone (tensor bytes; see
    /// [`crate::memory::Phase`]).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub forward_peak_bytes: Option<usize>,
    /// The peak of the step's backward passes alone.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub backward_peak_bytes: Option<usize>,
    /// Training tokens seen through this step (steps × tokens per step).
    #[serde(default)]
    pub tokens: usize,
    /// Wall seconds of the run through this step, summed over resumes (the
    /// time between an interruption and its resume not counted).
    #[serde(default)]
    pub elapsed_s: f64,
    /// The process's resident high-water mark after this step (bytes), where
    /// the platform reports it; a resumed run's peak is the largest of these.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub process_peak_bytes: Option<usize>,
    /// On the GPU: the peak bytes of its tensor buffers (pooled ones
    /// included) through this step of this process.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub device_peak_bytes: Option<usize>,
    /// The first step of a process that resumed the run from a checkpoint.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub resumed: bool,
    /// The run's identity (see [`TrainState::run_id`](super::checkpoint::TrainState::run_id)).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub run: Option<String>,
    /// The build and device, on the first step of each process of the run.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub provenance: Option<crate::train::provenance::Provenance>,
}

fn f32_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN))
}

/// Appends records to `DIR/metrics.jsonl`, flushing each line.
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
}

impl MetricsLog {
    /// Opens the log; lines of steps after `keep_through` (a resumed run's
    /// checkpoint step) are dropped, so a resumed run does not repeat steps.
    pub fn open(dir: &Path, keep_through: usize) -> Result<MetricsLog> {
        let path = dir.join("metrics.jsonl");
        let kept: Vec<String> = if keep_through > 0 && path.exists() {
            std::fs::read_to_string(&path)
                .map_err(|e| crate::Error::io(format!("cannot read {}", path.display()), e))?
                .lines()
                .filter(|l| {
                    serde_json::from_str::<StepMetrics>(l).is_ok_and(|m| m.step <= keep_through)
                })
                .map(str::to_string)
                .collect()
        } else {
            vec![]
        };
        // Rewritten atomically: a crash here must not lose the kept history.
        let text: String = kept.iter().map(|l| format!("{l}\n")).collect();
        crate::train::checkpoint::write_atomic(dir, "metrics.jsonl", text.as_bytes())?;
        let file = crate::train::outdir::open_append(&path)
            .map_err(|e| crate::Error::io(format!("cannot write {}", path.display()), e))?;
        Ok(MetricsLog { path, file })
    }
    /// Appends `m` as one line and flushes it. An I/O error names the step
    /// and the file.
    pub fn append(&mut self, m: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(m).map_err(|e| crate::Error::data(e.to_string()))?;
        crate::train::fault::io_point("fail:metrics.jsonl", m.step)
            .and_then(|()| writeln!(self.file, "{line}"))
            .and_then(|()| self.file.flush())
            .map_err(|e| {
                crate::Error::io(
                    format!("cannot append step {} to {}", m.step, self.path.display()),
                    e,
                )
            })
    }
    /// The log file, `DIR/metrics.jsonl`.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Every record in a log file, in order (blank lines skipped). An error
    /// when the file cannot be read or a line is not a record.
    pub fn read(path: &Path) -> Result<Vec<StepMetrics>> {
        std::fs::read_to_string(path)
            .map_err(|e| crate::Error::io(format!("cannot read {}", path.display()), e))?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l)
                    .map_err(|e| crate::Error::data(format!("{}: {e}", path.display())))
            })
            .collect()
    }
}
