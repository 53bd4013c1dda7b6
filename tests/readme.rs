//! The README's claims, checked against the code: the presets table against
//! the presets, every `cargo run` line against the CLI's own help, every
//! example it names against `examples/`.

use tinyllm::train::{TrainConfig, TrainOptions};

const README: &str = include_str!("../README.md");

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
            device: Some("cpu".into()),
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
        let path = format!("{}/examples/{n}.rs", env!("CARGO_MANIFEST_DIR"));
        assert!(std::path::Path::new(&path).exists(), "README names {path}");
    }
}

/// The README's CPU `train` lines without `--out` or `--resume` run one after
/// another in one directory (as a new user types them), each into a new
/// run directory, with `runs/latest` at the newest; `--resume runs/latest`
/// then continues that one. Steps are cut to 2 (the README's own step
/// counts are what each preset trains).
#[test]
fn the_train_lines_without_out_run_in_order() {
    let bin = env!("CARGO_BIN_EXE_tinyllm");
    let cwd = std::env::temp_dir().join(format!("tinyllm-readme-order-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cwd);
    std::fs::create_dir_all(&cwd).unwrap();
    let lines: Vec<Vec<&str>> = README
        .lines()
        .filter_map(|l| l.trim().strip_prefix("cargo run --release -- train"))
        .map(|r| r.split('#').next().unwrap().split_whitespace().collect())
        // (the GPU line is the crosscheck test's; on lavapipe it takes a minute)
        .filter(|a: &Vec<&str>| !a.iter().any(|f| ["--out", "--resume", "gpu"].contains(f)))
        .collect();
    assert!(lines.len() >= 2, "{lines:?}");
    let run = |args: &[&str], steps: &str| {
        let o = std::process::Command::new(bin)
            .current_dir(&cwd)
            .arg("train")
            .args(args)
            .args(["--steps", steps, "--sample-len", "0", "--plain"])
            .env_remove("CARGO")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "train {args:?}:\n{err}");
    };
    for (i, args) in lines.iter().enumerate() {
        run(args, "2");
        let latest = std::fs::read_link(cwd.join("runs/latest")).unwrap();
        let dirs = std::fs::read_dir(cwd.join("runs"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_type().unwrap().is_dir())
            .count();
        assert_eq!(dirs, i + 1, "one new run directory per line");
        assert!(cwd.join("runs").join(&latest).join("checkpoint").is_dir());
    }
    run(&["--resume", "runs/latest"], "3");
    let _ = std::fs::remove_dir_all(&cwd);
}
