//! The README's claims, checked against the code: the presets table against
//! the presets, every `cargo run` line against the CLI's own help, every
//! example it names against `examples/`.

use tinyllm::train::{TrainConfig, TrainOptions};

const README: &str = include_str!("../../README.md");

fn number(s: &str) -> usize {
    s.trim()
        .replace(',', "")
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {s:?}"))
}

#[test]
fn the_presets_table_is_the_presets() {
    let rows: Vec<Vec<&str>> = README
        .lines()
        .skip_while(|l| !l.starts_with("| `--preset`"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.trim_matches('|').split('|').map(str::trim).collect())
        .collect();
    assert_eq!(rows.len(), 3, "three presets in the table");
    for r in rows {
        let name = r[0]
            .trim_matches('`')
            .trim_end_matches(" (default)")
            .trim_matches('`');
        let cfg = TrainConfig::resolve(&TrainOptions {
            preset: Some(name.into()),
            device: Some(tinyllm::train::DeviceChoice::Cpu),
            ..Default::default()
        })
        .unwrap();
        let m = &cfg.model;
        assert_eq!(number(r[1]), m.num_params(), "{name}: parameters");
        assert_eq!(
            r[2],
            format!("{} × {} ({})", m.n_layers, m.d_model, m.n_heads),
            "{name}: layers × width (heads)"
        );
        assert_eq!(number(r[3]), m.context, "{name}: context");
        let recipe = format!(
            "{} steps, batch {} = {} × {}, {}, {}",
            cfg.steps,
            cfg.batch,
            cfg.accum,
            cfg.micro_batch,
            cfg.precision.name(),
            if cfg.ckpt_budget.is_some() {
                "checkpointing"
            } else {
                "no checkpointing"
            }
        );
        let said = r[4].replace(',', "");
        assert_eq!(said, recipe.replace(',', ""), "{name}: recipe");
    }
    // the default preset is the one marked so
    let default = TrainConfig::resolve(&TrainOptions::default()).unwrap();
    assert!(README.contains(&format!("| `{}` (default) |", default.preset)));
}

/// Every `cargo run --release -- CMD --flag …` line names a subcommand and
/// flags that its `--help` lists.
#[test]
fn every_command_line_uses_flags_the_cli_has() {
    let bin = env!("CARGO_BIN_EXE_tinyllm");
    let mut checked = 0;
    for line in README.lines() {
        let Some(rest) = line.trim().strip_prefix("cargo run --release -- ") else {
            continue;
        };
        let args: Vec<&str> = rest.split('#').next().unwrap().split_whitespace().collect();
        let cmd = args[0];
        let help = std::process::Command::new(bin)
            .args([cmd, "--help"])
            .output()
            .unwrap();
        assert!(help.status.success(), "`{line}`: no subcommand {cmd}");
        let help = String::from_utf8_lossy(&help.stdout);
        for flag in args.iter().filter(|a| a.starts_with("--")) {
            assert!(
                help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                "`{line}`: `tinyllm {cmd}` has no {flag}"
            );
        }
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} command lines found");
}

#[test]
fn every_example_named_exists() {
    let names: Vec<&str> = README
        .lines()
        .filter_map(|l| l.trim().strip_prefix("cargo run --release --example "))
        .map(|r| r.split_whitespace().next().unwrap())
        .collect();
    assert!(names.len() >= 4, "{names:?}");
    for n in names {
        let path = format!("{}/../examples/{n}.rs", env!("CARGO_MANIFEST_DIR"));
        assert!(std::path::Path::new(&path).exists(), "README names {path}");
    }
}

/// A command line's words, as a shell splits them (double quotes only).
fn words(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted, mut any) = (Vec::new(), String::new(), false, false);
    for c in line.chars() {
        match c {
            '"' => (quoted, any) = (!quoted, true),
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            c => (cur, any) = (cur + &c.to_string(), true),
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// `n` steps of a README line, cut for the test: a hundredth, at least one
/// (300 and 600 become 3 and 6, so a resume still finishes and an extension
/// still extends).
fn cut(n: &str) -> String {
    number(n).div_ceil(100).to_string()
}

/// Every `cargo run --release -- …` line of the README, run one after
/// another in one fresh directory, as a new user types them: each must
/// succeed (exit status 0; `crosscheck` then means bit-identical). Step
/// counts are cut to a hundredth (a line without one runs 2 steps, the
/// capstone's and a GPU line's 1: a capstone step is 32 × 512 tokens), `train` skips its closing sample
/// (`--sample-len 0`), a line the README repeats runs once, and `crosscheck`
/// and `bench` do not run: `crosscheck.rs` runs the command with the
/// README's flags (the whole sweep with `--json`, `--skip-sweep` with
/// `--steps` and `--precision`, `--backend gl`) and checks what it reports,
/// and its device check runs `bench --json` (their flags are checked here
/// against `--help`, as every line's are). The files the lines name
/// (`input.txt`, `my.txt`) are the embedded corpus. Lines without `--out`
/// each make a new run directory with `runs/latest` at the newest, and
/// `--resume runs/latest` continues the first. The GPU lines run in
/// [`every_gpu_command_runs`].
#[test]
fn every_command_runs_in_order() {
    let ran = run_lines(false);
    assert!(ran >= 14, "only {ran} command lines ran");
}

/// The README's GPU lines, as [`every_command_runs_in_order`] runs the
/// others, beside them in a fresh directory of their own: they read nothing
/// the others write, and lavapipe compiles their kernels on one core while
/// the CPU lines use both. They need an adapter (CI has lavapipe).
#[test]
fn every_gpu_command_runs() {
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let ran = run_lines(true);
    assert!(ran >= 1, "only {ran} GPU command lines ran");
}

/// Runs the README's lines that name the GPU (`gpu`) or those that do not,
/// in order, in a fresh directory; returns how many ran.
fn run_lines(gpu: bool) -> usize {
    let bin = env!("CARGO_BIN_EXE_tinyllm");
    let cwd =
        std::env::temp_dir().join(format!("tinyllm-readme-order-{gpu}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cwd);
    std::fs::create_dir_all(&cwd).unwrap();
    let text = tinyllm::train::data::Corpus::embedded();
    for name in ["input.txt", "my.txt"] {
        std::fs::write(cwd.join(name), text.tokens.as_slice()).unwrap();
    }
    let run = |args: &[String]| {
        let o = std::process::Command::new(bin)
            .current_dir(&cwd)
            .args(args)
            .env_remove("CARGO")
            .output()
            .unwrap();
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(
            o.status.success(),
            "tinyllm {args:?}: exit {:?}\n{out}\n{err}",
            o.status.code()
        );
    };
    let mut fresh = 0;
    let mut ran = 0;
    let mut seen = std::collections::HashSet::new();
    for line in README.lines() {
        let Some(rest) = line.trim().strip_prefix("cargo run --release -- ") else {
            continue;
        };
        let rest = rest.split('#').next().unwrap().trim();
        if !seen.insert(rest) {
            continue;
        }
        let mut args = words(rest);
        let cmd = args[0].clone();
        let on_gpu = args.iter().any(|a| a == "gpu");
        if ["bench", "crosscheck"].contains(&cmd.as_str()) || on_gpu != gpu {
            continue;
        }
        let capstone = args
            .windows(2)
            .any(|w| w[0] == "--preset" && w[1] == "capstone");
        match args.iter().position(|a| a == "--steps") {
            Some(i) => args[i + 1] = cut(&args[i + 1]),
            None if ["train", "compare"].contains(&cmd.as_str()) => args.extend([
                "--steps".into(),
                if capstone || on_gpu { "1" } else { "2" }.into(),
            ]),
            None => {}
        }
        if let Some(i) = args.iter().position(|a| a == "--crosscheck-every") {
            args[i + 1] = "1".into();
        }
        if cmd == "train" {
            args.extend(["--sample-len".into(), "0".into()]);
        }
        let t = std::time::Instant::now();
        run(&args);
        eprintln!(
            "{:>6.1} s  tinyllm {}",
            t.elapsed().as_secs_f64(),
            args.join(" ")
        );
        ran += 1;
        if cmd == "train" && !args.iter().any(|a| a == "--out" || a == "--resume") {
            fresh += 1;
            let latest = std::fs::read_link(cwd.join("runs/latest")).unwrap();
            let dirs = std::fs::read_dir(cwd.join("runs"))
                .unwrap()
                .filter(|e| {
                    let e = e.as_ref().unwrap();
                    e.file_type().unwrap().is_dir()
                        && e.file_name().to_string_lossy().starts_with("20")
                })
                .count();
            assert_eq!(dirs, fresh, "one new run directory per line without --out");
            assert!(cwd.join("runs").join(&latest).join("checkpoint").is_dir());
            if fresh == 1 && !gpu {
                let resume = [
                    "train",
                    "--resume",
                    "runs/latest",
                    "--steps",
                    "3",
                    "--sample-len",
                    "0",
                ];
                run(&resume.map(String::from));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&cwd);
    ran
}
