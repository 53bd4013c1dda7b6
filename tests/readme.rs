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
