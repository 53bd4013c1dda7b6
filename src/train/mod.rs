//! The trainer: text → batches → mixed-precision steps → metrics, plots and
//! checkpoints; plus `compare` (float32 against mixed precision), `eval` and
//! `generate`.
//!
//! * [`data`] — byte tokenizer, corpus loading, seeded split and batch order;
//!   `corpus` — the embedded default text;
//! * [`config`] — flags resolved against a preset's recipe and validated;
//! * [`plan`] — the memory plan: the bytes a step needs, checked before a run;
//!   [`budget`] — the micro-batch, recompute policy and checkpoint budget
//!   that fit `--memory-budget` and recompute the least;
//! * [`step`] — one optimizer step: scale → backward → accumulate → unscale
//!   → clip → step ([`train_step_mixed`](step::train_step_mixed));
//! * [`trainer`] — the loop around it: reporting, evaluation, saving, and
//!   stopping cleanly (`interrupt`: Ctrl-C / SIGTERM / SIGHUP); `outdir` — the
//!   output directory's lock and what may be replaced in it;
//! * [`infer`] — validation loss, `eval` of a text, `generate`;
//! * [`checkpoint`] — Hugging Face-named safetensors, atomic writes, a SHA-256
//!   manifest (`sha256`) verified before anything loads; for a loop of
//!   your own, [`save_model`] / [`load_model`] (a Hugging Face model folder,
//!   the files [`hf`] describes beside the weights) and
//!   [`TrainState::builder`] (a resumable checkpoint's state, checked);
//! * [`continuation`] — a run's full training state (weights, AdamW moments,
//!   schedule, scaler, the next batches) in one safetensors file that
//!   `scripts/continue_in_pytorch.py` continues in PyTorch;
//! * `metrics`, `plot` — `metrics.jsonl` and the SVG loss curves;
//!   [`provenance`] — the build and device of every process of a run;
//! * [`compare`] — float32 against bf16 + accumulation + recompute;
//! * `fault` — test-only fault injection (`TINYLLM_FAULT`, with the
//!   `test-hooks` feature).

mod bar;
pub mod budget;
pub mod checkpoint;
pub mod compare;
pub mod config;
pub mod continuation;
pub mod data;
pub(crate) mod fault;
pub mod hf;
pub mod host;
pub mod infer;
pub mod plan;
pub mod provenance;
pub mod step;
pub mod trainer;
cli_internal!(corpus, interrupt, metrics, outdir, plot, sha256);

pub use checkpoint::{load_model, save_model, TrainState, TrainStateBuilder};
pub use config::{DeviceChoice, TrainConfig, TrainOptions};
pub use host::{HostAdamW, HostState};
pub use trainer::{run, run_checked, Progress, RunSummary, Start, StepCheck, Trainer};
