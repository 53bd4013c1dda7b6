#!/usr/bin/env python3
"""Writes what the capstone models learned, as RESULTS.md shows it: the
held-out loss over training in nats/byte and bits/byte for both sides, the
final models' held-out figures from `tinyllm eval`, and a sample from each
with a fixed seed, prompt and temperature.

    scripts/capstone_report.py --run RUN [--results results/capstone-2000]
                               [--bin target/release/tinyllm]

RUN is the comparison's --out (holding fp32/ and mixed/ with their
checkpoints); the held-out curve is read from the metrics under --results
(the committed copies) or, without them, from RUN. Markdown goes to stdout.
Run it where the text the run recorded (its --data) is found: eval reads
the held-out windows from there.
The tokenizer is bytes, so nats/token is nats/byte; Tiny Shakespeare is
ASCII, so it is also nats/char, the unit of nanoGPT's character-level anchor.

Only the standard library is needed.
"""

import argparse
import json
import math
import os
import subprocess
import sys

SIDES = (("fp32", "float32, batch 32 x 512"), ("mixed", "C1: bf16, 4 x 8, checkpointed"))
PROMPT = "ROMEO:"
SAMPLE = ["--prompt", PROMPT, "--len", "400", "--temperature", "0.8", "--top-k", "40", "--seed", "0"]
# nanoGPT's character-level Shakespeare (10.65M parameters, context 256,
# 5,000 iterations of 64 sequences): validation loss 1.4697 nats/char on
# the last tenth of the text.
ANCHOR = 1.4697


def held_out(path):
    """Step -> validation loss (nats/byte) of a metrics file; the last row of
    a step wins (a resume repeats none)."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                if "val_loss" in row:
                    out[row["step"]] = row["val_loss"]
    return out


def bits(nats):
    return nats / math.log(2)


def run(binary, args):
    p = subprocess.run([binary] + args, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join([binary] + args)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return p.stdout


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--run", required=True, help="the comparison's --out")
    a.add_argument("--results", default="results/capstone-2000")
    a.add_argument("--bin", default="target/release/tinyllm")
    a.add_argument("--every", type=int, default=200, help="steps between rows of the curve")
    args = a.parse_args()
    if not os.path.isfile(args.bin):
        sys.exit(f"no binary at {args.bin}: build it with `cargo build --release`, or give --bin")
    curves = {}
    for side, _ in SIDES:
        for root in (args.results, args.run):
            path = os.path.join(root, side, "metrics.jsonl")
            if os.path.isfile(path):
                curves[side] = held_out(path)
                break
        else:
            sys.exit(f"no metrics for the {side} side under {args.results} or {args.run}")
    steps = sorted(set(curves["fp32"]) & set(curves["mixed"]))
    rows = [s for s in steps if s % args.every == 0 or s == steps[-1]]
    print("| step | float32 nats/byte | bits/byte | C1 nats/byte | bits/byte |")
    print("|---:|---:|---:|---:|---:|")
    for s in rows:
        f, m = curves["fp32"][s], curves["mixed"][s]
        print(f"| {s} | {f:.4f} | {bits(f):.4f} | {m:.4f} | {bits(m):.4f} |")
    print()
    for side, what in SIDES:
        ckpt = os.path.join(args.run, side)
        # without --data, eval reads the held-out windows of the text the run
        # recorded (with it, every window of a file: not the held-out figure)
        cmd = ["eval", "--checkpoint", ckpt]
        print(f"`tinyllm {' '.join(cmd)}` ({what}):")
        print("```")
        print(run(args.bin, cmd).strip())
        print("```")
    print(f"\nnanoGPT's character-level anchor: {ANCHOR} nats/char ({bits(ANCHOR):.4f} bits/char).\n")
    for side, what in SIDES:
        cmd = ["generate", "--checkpoint", os.path.join(args.run, side)] + SAMPLE
        print(f"`tinyllm {' '.join(cmd)}` ({what}):")
        print("```")
        print(run(args.bin, cmd).rstrip())
        print("```")


if __name__ == "__main__":
    main()
