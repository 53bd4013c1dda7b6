//! Every pitfall mutant still finds its code: each `@@ find` block of
//! `mutants/*.mutant` occurs exactly once in `src/` and `shaders/` (line by line, leading and
//! trailing whitespace ignored — the rule `mutants/apply.py` applies them by).
//! Whether the tests kill them is `mutants/run.sh`'s job; this keeps an
//! ordinary edit from silently turning a mutant into an error.

use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if matches!(p.extension().and_then(|x| x.to_str()), Some("rs" | "wgsl")) {
            out.push(p);
        }
    }
}

/// The find blocks of one mutant, in order, each as trimmed lines.
fn find_blocks(text: &str) -> Vec<Vec<String>> {
    let (mut blocks, mut cur, mut in_find) = (Vec::new(), Vec::new(), false);
    for line in text.lines() {
        match line.trim_end() {
            "@@ find" => in_find = true,
            "@@ replace" => {
                blocks.push(std::mem::take(&mut cur));
                in_find = false;
            }
            l if in_find => cur.push(l.trim().to_string()),
            _ => {}
        }
    }
    blocks
}

#[test]
fn every_mutant_finds_its_code_exactly_once() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    sources(&root.join("shaders"), &mut files);
    let texts: Vec<(PathBuf, Vec<String>)> = files
        .into_iter()
        .map(|p| {
            let lines = std::fs::read_to_string(&p)
                .unwrap()
                .lines()
                .map(|l| l.trim().to_string())
                .collect();
            (p, lines)
        })
        .collect();
    let mut mutants: Vec<PathBuf> = std::fs::read_dir(root.join("mutants"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "mutant"))
        .collect();
    mutants.sort();
    assert!(mutants.len() >= 24, "the 24 pitfall mutants, at least");
    let mut problems = Vec::new();
    for m in &mutants {
        let blocks = find_blocks(&std::fs::read_to_string(m).unwrap());
        if blocks.is_empty() || blocks.iter().any(|b| b.is_empty()) {
            problems.push(format!("{}: no non-empty find block", m.display()));
        }
        // A later block may only exist after an earlier one is applied; the
        // mutants written so far all find their blocks in the unmutated tree.
        for b in &blocks {
            let hits: usize = texts
                .iter()
                .map(|(_, lines)| lines.windows(b.len().max(1)).filter(|w| w == b).count())
                .sum();
            if hits != 1 {
                problems.push(format!(
                    "{}: a find block occurs {hits} times:\n{}",
                    m.display(),
                    b.join("\n")
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}
