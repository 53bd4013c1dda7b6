//! The cross-check as one command: options, the run, the verdict and the
//! report (text and JSON). Needs the GPU backend.

use super::lockstep::{Lockstep, LockstepOptions};
use super::probe::{Probe, Status};
use super::sweep::Row;
use super::{lockstep, probe, sweep};
use crate::backend::Family;
use crate::precision::Precision;
use crate::{Device, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::time::Instant;

/// What `tinyllm crosscheck` runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// The lockstep's preset (`tiny`, `small` or `capstone`).
    pub preset: String,
    /// Optimizer steps per lockstep run.
    pub steps: usize,
    /// One lockstep run per precision recipe.
    pub precisions: Vec<Precision>,
    /// Whether to run the primitive sweep.
    pub sweep: bool,
    /// The lockstep's seed (`None`: the trainer's default).
    pub seed: Option<u64>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            preset: "tiny".into(),
            steps: 5,
            precisions: vec![Precision::Fp32, Precision::Bf16, Precision::Fp16],
            sweep: true,
            seed: None,
        }
    }
}

/// The conclusion: everything the contract promises on this device gave the
/// reference's bits, or what did not.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    /// True when nothing differs: no probe finding with status
    /// [`Differs`](probe::Status::Differs), no sweep row with differing values
    /// and no lockstep divergence.
    pub bit_identical: bool,
    /// What differs (each line names the part, the primitive or step, and how).
    pub differences: Vec<String>,
}

/// Everything the command found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The version of tinyllm that made the report.
    pub tinyllm: &'static str,
    /// The adapter, its limits and what was measured on it.
    pub probe: Probe,
    /// One row per primitive and variant; `None` when the sweep was skipped.
    pub sweep: Option<Vec<Row>>,
    /// Wall-clock seconds the sweep took (about 0 when skipped).
    pub sweep_seconds: f64,
    /// One lockstep run per precision asked for, in the order asked.
    pub lockstep: Vec<Lockstep>,
    /// Wall-clock seconds all the lockstep runs took together.
    pub lockstep_seconds: f64,
    /// The conclusion drawn from all of the above.
    pub verdict: Verdict,
}

/// The families the command sweeps: all of them. Test-hooks builds take
/// `TINYLLM_SWEEP_ONLY=NAME[,NAME…]` (as [`Family::name`] gives them), so a
/// test of the report's wording sweeps only the family it reads.
fn swept() -> Result<Vec<Family>> {
    #[cfg(feature = "test-hooks")]
    if let Ok(only) = std::env::var("TINYLLM_SWEEP_ONLY") {
        return only
            .split(',')
            .map(|n| {
                Family::ALL
                    .into_iter()
                    .find(|f| f.name() == n.trim())
                    .ok_or_else(|| {
                        crate::Error::config(format!("TINYLLM_SWEEP_ONLY: no family {n:?}"))
                    })
            })
            .collect();
    }
    Ok(Family::ALL.to_vec())
}

/// Runs the probe, the sweep (unless skipped) and a lockstep per precision,
/// telling `progress` what it is doing. An error (no adapter, a device
/// failure) is returned as such: a report is only made of results.
pub fn run(o: &Options, progress: &mut dyn FnMut(&str)) -> Result<Report> {
    // before the probe and the sweep, which take minutes
    lockstep::check_steps(o.steps)?;
    progress("probe: the adapter and what the contract assumes of it");
    let probe = probe::run()?;
    let t = Instant::now();
    let sweep = if o.sweep {
        let mut tell = |f: Family| progress(&format!("sweep: {}", sweep::words(f)));
        Some(sweep::run(
            &[Device::Cpu, Device::Gpu],
            &swept()?,
            &mut tell,
        )?)
    } else {
        None
    };
    let sweep_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut steps = Vec::new();
    for &precision in &o.precisions {
        let lo = LockstepOptions {
            preset: o.preset.clone(),
            steps: o.steps,
            precision,
            seed: o.seed,
        };
        steps.push(lockstep::run(&lo, progress)?);
    }
    let lockstep_seconds = t.elapsed().as_secs_f64();
    let verdict = verdict(&probe, sweep.as_deref(), &steps);
    Ok(Report {
        tinyllm: env!("CARGO_PKG_VERSION"),
        probe,
        sweep,
        sweep_seconds,
        lockstep: steps,
        lockstep_seconds,
        verdict,
    })
}

fn verdict(probe: &Probe, sweep: Option<&[Row]>, steps: &[Lockstep]) -> Verdict {
    let mut differences = Vec::new();
    for f in probe.differing() {
        differences.push(format!("probe {}: {}", f.check, f.consequence));
    }
    for r in sweep.unwrap_or_default() {
        if r.bit_identical() {
            continue;
        }
        let first = r.first.as_ref().map_or(String::new(), |m| {
            format!(
                "; first in {} at [{}]: spec {} {} {}",
                m.case, m.position, m.spec, r.device, m.device
            )
        });
        let line = format!(
            "sweep {}: {} of {} values differ in {} of {} cases{first}",
            r.label(),
            r.differing,
            r.values,
            r.cases - r.identical,
            r.cases
        );
        differences.push(line);
    }
    for l in steps {
        if let Some(d) = &l.divergence {
            let call = d.first_call.as_ref().map_or_else(
                || d.note.clone().unwrap_or_default(),
                |c| format!("first differing call: {c}"),
            );
            differences.push(format!(
                "lockstep {} {}: step {} differs ({} value lists); {call}",
                l.preset, l.precision, d.step, d.buffers_differing
            ));
        }
    }
    Verdict {
        bit_identical: differences.is_empty(),
        differences,
    }
}

impl Report {
    /// 0 when everything is bit-identical, 1 when something differs.
    pub fn exit_code(&self) -> u8 {
        if self.verdict.bit_identical {
            0
        } else {
            1
        }
    }

    /// The report as one JSON value (the same facts as [`text`](Self::text)).
    pub fn json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        v["exit_code"] = self.exit_code().into();
        v
    }

    /// The readable report: probe, sweep table, lockstep, verdict.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let p = &self.probe;
        let _ = writeln!(
            s,
            "tinyllm {} crosscheck: is this GPU bit-exact with the reference (the spec, the CPU)?\n",
            self.tinyllm
        );
        let _ = writeln!(s, "== device probe");
        let _ = writeln!(
            s,
            "adapter   {} ({}, {})",
            p.adapter, p.backend, p.device_type
        );
        let _ = writeln!(s, "driver    {} {}", p.driver, p.driver_info);
        let fma = if p.fma_path == "native" {
            "native (the device's fma, probed fused)"
        } else if p.shaders.starts_with("HLSL") {
            "soft (integer emulation: HLSL has no f32 fma, and a precise mad is unfused)"
        } else {
            "soft (integer emulation: the device's fma is not fused)"
        };
        let _ = writeln!(s, "fma path  {fma}");
        let _ = writeln!(s, "shaders   {}", p.shaders);
        let _ = writeln!(
            s,
            "subnormals {} (start-up probe: *, + and fma; a fused fma is kept either way)",
            p.subnormals
        );
        let limits: Vec<String> = p.limits.iter().map(|(n, v)| format!("{n} {v}")).collect();
        let _ = writeln!(s, "limits    {}", limits.join(", "));
        for f in &p.findings {
            let _ = writeln!(
                s,
                "  {:<8} {} ({} of {} cases as assumed)",
                f.status.name(),
                f.assumption,
                f.cases - f.failed,
                f.cases
            );
            if let Some(c) = &f.first_failure {
                let _ = writeln!(
                    s,
                    "           e.g. {} with ({}) = {}, the contract's {}",
                    c.op,
                    c.operands.join(", "),
                    c.got,
                    c.want
                );
            }
            if f.status != Status::Holds && !f.consequence.is_empty() {
                let _ = writeln!(s, "           → {}", f.consequence);
            }
        }
        let _ = writeln!(s);
        match &self.sweep {
            None => {
                let _ = writeln!(s, "== primitive sweep: skipped (--skip-sweep)\n");
            }
            Some(rows) => {
                let cases: usize = rows.iter().map(|r| r.cases).sum();
                let values: usize = rows.iter().map(|r| r.values).sum();
                let mut pairs: Vec<&str> = rows.iter().map(|r| r.device).collect();
                pairs.sort_unstable();
                pairs.dedup();
                let _ = writeln!(
                    s,
                    "== primitive sweep: {} rows, {cases} cases, {values} values; compared bit for bit: {} ({:.0} s)",
                    rows.len(),
                    pairs.iter().map(|d| format!("{d} vs spec")).collect::<Vec<_>>().join(", "),
                    self.sweep_seconds
                );
                let _ = writeln!(
                    s,
                    "{:<52} {:>6} {:>9} {:>9} {:>9} {:>8}",
                    "device: primitive [variant]",
                    "cases",
                    "identical",
                    "values",
                    "differing",
                    "max ulp"
                );
                for r in rows {
                    let ulp = if r.nan_vs_number {
                        "NaN".to_string()
                    } else if r.bit_identical() {
                        "-".to_string()
                    } else {
                        r.max_ulps.to_string()
                    };
                    let _ = writeln!(
                        s,
                        "{:<52} {:>6} {:>9} {:>9} {:>9} {:>8}",
                        r.label(),
                        r.cases,
                        r.identical,
                        r.values,
                        r.differing,
                        ulp,
                    );
                    if let Some(m) = &r.first {
                        let inputs = if m.inputs.is_empty() {
                            String::new()
                        } else {
                            format!(", inputs {}", m.inputs.join(" "))
                        };
                        let _ = writeln!(
                            s,
                            "    first: {} at [{}]: spec {} {} {}{inputs}",
                            m.case, m.position, m.spec, r.device, m.device
                        );
                    }
                }
                let _ = writeln!(s);
            }
        }
        if let Some(l) = self.lockstep.first() {
            let _ = writeln!(
                s,
                "== training lockstep: preset {}, {} steps per precision, compared after every step ({:.0} s)",
                l.preset, l.steps, self.lockstep_seconds
            );
        }
        for l in &self.lockstep {
            match &l.divergence {
                None => {
                    let _ = writeln!(
                        s,
                        "{:<5} {}/{} steps bit-identical (loss, scale, flags and every weight and moment: {} value lists per step)",
                        l.precision, l.identical_steps, l.steps, l.compared
                    );
                }
                Some(d) => {
                    let _ = writeln!(
                        s,
                        "{:<5} {}/{} steps bit-identical, then:",
                        l.precision, l.identical_steps, l.steps
                    );
                    for line in d.to_string().lines() {
                        let _ = writeln!(s, "      {line}");
                    }
                }
            }
        }
        let v = &self.verdict;
        let _ = writeln!(s);
        if v.bit_identical {
            let _ = writeln!(
                s,
                "verdict: BIT-IDENTICAL: every check gave the reference's bits"
            );
        } else {
            let _ = writeln!(s, "verdict: DIFFERS: {} finding(s)", v.differences.len());
            for d in &v.differences {
                let _ = writeln!(s, "  - {d}");
            }
        }
        s
    }
}
