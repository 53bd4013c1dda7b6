#!/usr/bin/env python3
"""Applies one anchored mutant to a source tree.

A mutant file (mutants/NAME.mutant) is:

    # test: <test file stem> <test filter> [more filters]
    # <what the mutant breaks, e.g. the spec's pitfall>
    @@ find
    <lines of the crate as they are>
    @@ replace
    <the lines that take their place>
    (more find/replace pairs)

Each find block must occur exactly once in the whole crate (src/**/*.rs and
shaders/*.wgsl), compared line by line with leading and trailing whitespace ignored:
no file name and no line number, so moving code between files, reformatting
it or editing elsewhere does not break a mutant. A block found nowhere or
more than once is an error (exit 2), never a silent no-op; the test suite
(tests/mutants_anchor.rs) checks that every find block still occurs exactly
once, so an edit that moves a mutant's code fails CI, not the next mutant run.

usage: apply.py MUTANT TREE
"""
import pathlib
import sys


def parse(text):
    pairs, mode, find, repl = [], None, [], []
    for line in text.splitlines():
        if line.rstrip() == "@@ find":
            if mode == "replace":
                pairs.append((find, repl))
            mode, find, repl = "find", [], []
        elif line.rstrip() == "@@ replace":
            mode = "replace"
        elif mode == "find":
            find.append(line)
        elif mode == "replace":
            repl.append(line)
    if mode == "replace":
        pairs.append((find, repl))
    if not pairs or any(not f for f, _ in pairs):
        raise SystemExit("no '@@ find' / '@@ replace' pair with a non-empty find block")
    return pairs


def occurrences(lines, block):
    want = [b.strip() for b in block]
    got = [l.strip() for l in lines]
    n = len(want)
    return [i for i in range(len(got) - n + 1) if got[i : i + n] == want]


def main():
    mutant, tree = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    files = sorted(p for d in ("src", "shaders") for p in (tree / d).rglob("*") if p.suffix in (".rs", ".wgsl"))
    texts = {p: p.read_text().split("\n") for p in files}
    for find, repl in parse(mutant.read_text()):
        hits = [(p, i) for p in files for i in occurrences(texts[p], find)]
        if len(hits) != 1:
            where = ", ".join(f"{p.relative_to(tree)}:{i + 1}" for p, i in hits) or "nowhere"
            print(f"{mutant.name}: find block found {len(hits)} times ({where}):", file=sys.stderr)
            print("\n".join(find), file=sys.stderr)
            sys.exit(2)
        p, i = hits[0]
        texts[p][i : i + len(find)] = repl
        p.write_text("\n".join(texts[p]))
        print(f"{mutant.name}: {p.relative_to(tree)}:{i + 1}")


main()
