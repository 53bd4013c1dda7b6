#!/usr/bin/env python3
"""Recomputes the first steps of the committed 2,000-step capstone comparison
and checks their losses against the committed metrics, bit for bit.

    scripts/reproduce_capstone.py --data tinyshakespeare.txt [--steps 3] [--side fp32|mixed|both]
                                  [--bin target/release/tinyllm] [--results results/capstone-2000]

Each side runs the command the committed run was made with (SIDES below:
the full 2,000-step schedule, so the learning rate of every step is the
committed run's) into a scratch directory; once its metrics hold --steps rows the run is stopped with
SIGINT (it saves and exits 130, as a user's Ctrl-C would) and each step's
loss is compared with the committed row's as float32 bits. Exit status 0 when
every compared loss is equal; 1 with the first differing step otherwise.

Only the standard library is needed. A capstone step takes tens of seconds
on a laptop CPU (the float32 side's full batch of 32 x 512 tokens needs
about 3 GiB).
"""

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

# The command each committed side was made with, without --data and --out.
SIDES = {
    side: ["compare", "--preset", "capstone", "--device", "cpu", "--side", side, "--save-every", "10"]
    for side in ("fp32", "mixed")
}


def f32_bits(x):
    """The float32 bits of a loss as metrics.jsonl writes it (the shortest
    decimal that reads back as the same float32)."""
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def losses(path, limit=None):
    """Step -> loss of the first `limit` rows of a metrics file (rows written
    by a resume repeat no step; the last row of a step wins)."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            if "step" in row and "loss" in row:
                out[row["step"]] = row["loss"]
    if limit is not None:
        out = {s: l for s, l in out.items() if s <= limit}
    return out


def run_side(binary, data, side, steps, scratch):
    out = os.path.join(scratch, "run")
    cmd = [binary] + SIDES[side] + ["--data", data, "--out", out, "--plain"]
    metrics = os.path.join(out, side, "metrics.jsonl")
    print(f"{side}: {' '.join(cmd)}", flush=True)
    log = open(os.path.join(scratch, f"{side}.log"), "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while p.poll() is None:
            if os.path.exists(metrics) and len(losses(metrics)) >= steps:
                p.send_signal(signal.SIGINT)
                break
            time.sleep(0.5)
        code = p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    if code not in (0, 130):
        with open(os.path.join(scratch, f"{side}.log")) as f:
            sys.exit(f"{side}: tinyllm exited {code}:\n{f.read()[-4000:]}")
    if not os.path.exists(metrics):
        sys.exit(f"{side}: the run wrote no {metrics}")
    return losses(metrics, steps)


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--data", required=True, help="tinyshakespeare.txt (the committed runs' text)")
    a.add_argument("--steps", type=int, default=3, help="steps to recompute per side (default 3)")
    a.add_argument("--side", choices=["fp32", "mixed", "both"], default="both")
    a.add_argument("--bin", default="target/release/tinyllm")
    a.add_argument("--results", default="results/capstone-2000")
    args = a.parse_args()
    if args.steps < 1:
        sys.exit("--steps must be at least 1")
    if not os.path.isfile(args.bin):
        sys.exit(f"no binary at {args.bin}: build it with `cargo build --release`, or give --bin")
    sides = ["fp32", "mixed"] if args.side == "both" else [args.side]
    ok = True
    for side in sides:
        committed_path = os.path.join(args.results, side, "metrics.jsonl")
        if not os.path.isfile(committed_path):
            sys.exit(f"no committed metrics at {committed_path}")
        committed = losses(committed_path, args.steps)
        if len(committed) < args.steps:
            sys.exit(f"{committed_path} has {len(committed)} of the {args.steps} steps asked")
        scratch = tempfile.mkdtemp(prefix=f"tinyllm-reproduce-{side}-")
        try:
            ours = run_side(args.bin, os.path.abspath(args.data), side, args.steps, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        for step in sorted(committed):
            want, got = committed[step], ours.get(step)
            if got is None or f32_bits(got) != f32_bits(want):
                print(f"{side}: step {step}: committed loss {want}, recomputed {got}: DIFFERS")
                ok = False
                break
            print(f"{side}: step {step}: loss {got} (bits {f32_bits(got):08x}) equal")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
