//! `metrics.jsonl`: one JSON object per optimizer step.

use crate::Result;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One step's record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    /// NaN or ±inf on a skipped fp16 step: written as `null` (JSON has no
    /// NaN), read back as NaN.
    #[serde(deserialize_with = "f32_or_nan")]
    pub loss: f32,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f32>,
    #[serde(deserialize_with = "f32_or_nan")]
    pub lr: f32,
    #[serde(deserialize_with = "f32_or_nan")]
    pub scale: f32,
    pub skipped: bool,
    pub grad_norm: Option<f32>,
    pub tokens_per_s: f64,
    pub peak_bytes: usize,
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
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| crate::Error::io(format!("cannot write {}", path.display()), e))?;
        Ok(MetricsLog { path, file })
    }
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
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Every record in a log file.
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
