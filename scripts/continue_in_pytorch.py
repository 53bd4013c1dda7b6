#!/usr/bin/env python3
"""Continues a tinyllm run in PyTorch, from the file `tinyllm export` writes.

    tinyllm export --checkpoint RUN --batches K --out run.continue.safetensors
    torchrun --nproc_per_node 2 scripts/continue_in_pytorch.py \\
        run.continue.safetensors --out RUN-torch [--steps N] [--json FILE]

The file (docs/continue-in-pytorch.md) holds the weights under Hugging Face
names, AdamW's moments and step counts, the learning-rate schedule, the clip
and the run's next K batches. This script checks all of it first (format
version, every moment, every shape: a clear error naming what is wrong,
exit status 2), then builds `transformers.LlamaForCausalLM` and
`torch.optim.AdamW` with that state, and trains N steps (default K, at most
K) in float32 on those batches: data-parallel under torchrun (DDP, the gloo
backend by default, so CPUs work; --device cuda puts each process on its
GPU, with nccl), each process taking its share of every
batch's rows and the loss weighted so the gradients are the full batch's
mean, exactly as tinyllm's step (clip, then AdamW at the step's rate).

It writes --out as a Hugging Face folder (`model.safetensors`,
`config.json`) that `tinyllm eval --checkpoint` and `tinyllm generate
--checkpoint` load, plus `continuation.safetensors`: the state after the
last step, in the export's format (the unused batches kept), which this
script continues from again. Each step's loss is printed; --json writes them
as {"first_step": S, "losses": [...]}.

Needs torch, transformers and safetensors (none of them is needed by
tinyllm itself). Without torchrun it runs as one process.
"""

import argparse
import json
import os
import sys

FORMAT = "tinyllm-continue-1"
META_KEY = "tinyllm_continue"
CONTINUATION_FILE = "continuation.safetensors"


class Bad(Exception):
    """An input this script refuses; the message says what and why."""


def fail(msg, code=2):
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"continue_in_pytorch: error: {msg}", file=sys.stderr)
    sys.exit(code)


def read_meta(path):
    """The export's metadata, its version checked before anything else."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            md = f.metadata() or {}
    except FileNotFoundError:
        raise Bad(f"{path}: no such file")
    except Exception as e:  # safetensors raises its own error types
        raise Bad(f"{path}: not a safetensors file ({e})")
    if META_KEY not in md:
        raise Bad(f"{path}: no {META_KEY!r} metadata: not a tinyllm continuation "
                  "file (`tinyllm export` writes one)")
    try:
        meta = json.loads(md[META_KEY])
    except json.JSONDecodeError as e:
        raise Bad(f"{path}: the {META_KEY} metadata is not JSON ({e})")
    if meta.get("format") != FORMAT:
        raise Bad(f"{path}: continuation format {meta.get('format')!r}, this script reads "
                  f"{FORMAT!r} (a file from another version; export it again with the "
                  "matching tinyllm)")
    return meta


def check(path, meta, tensors, model):
    """Every weight, moment and batch is there, float32/int64, of its shape."""
    import torch

    want = {n: tuple(p.shape) for n, p in model.named_parameters()}
    listed = set(meta["params"])
    if listed != set(want) or len(listed) != len(meta["params"]):
        odd = sorted(listed - set(want)) or sorted(set(want) - listed) or meta["params"]
        raise Bad(f"{path}: the metadata's parameters do not match LlamaForCausalLM of its "
                  f"config (first difference: {odd[0]!r}; shape or config mismatch)")

    def tensor(name, what, shape, dtype):
        if name not in tensors:
            raise Bad(f"{path}: missing {what} {name!r}")
        t = tensors[name]
        if t.dtype != dtype:
            raise Bad(f"{path}: {what} {name!r} is {t.dtype}, expected {dtype}")
        if tuple(t.shape) != shape:
            raise Bad(f"{path}: {what} {name!r} has shape {tuple(t.shape)}, the model its "
                      f"config describes expects {shape} (shape mismatch)")
        return t

    steps = meta["optimizer"]["steps"]
    for name in steps:
        if name not in want:
            raise Bad(f"{path}: a step count for {name!r}, which is no parameter of the model")
    for name, shape in want.items():
        tensor(name, "weight", shape, torch.float32)
        if name in steps:
            for m in ("exp_avg", "exp_avg_sq"):
                tensor(f"{name}.{m}", "AdamW moment", shape, torch.float32)
    d = meta["data"]
    vocab = int(meta["model"]["vocab_size"])
    for i in range(meta["batches"]):
        for part in ("input_ids", "labels"):
            name = f"batch.{i}.{part}"
            t = tensor(name, "batch tensor", (d["batch"], d["context"]), torch.int64)
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
                raise Bad(f"{path}: batch tensor {name!r} holds ids outside 0..{vocab - 1}")
    if len(d["positions"]) != meta["batches"] + 1:
        raise Bad(f"{path}: the data gives {len(d['positions'])} positions for "
                  f"{meta['batches']} batches (one before each, one after the last)")
    if len(meta["schedule"]["lrs"]) != meta["batches"]:
        raise Bad(f"{path}: the schedule gives {len(meta['schedule']['lrs'])} rates for "
                  f"{meta['batches']} batches")


def build(meta):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_dict(dict(meta["model"]))
    # Eager attention: the plain softmax(QKᵀ/√d)·V that tinyllm computes.
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", help="the file `tinyllm export` (or this script) wrote")
    ap.add_argument("--out", required=True, help="the folder to write")
    ap.add_argument("--steps", type=int, help="steps to train (default: every batch in the file)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu (default) or cuda: each process on GPU LOCAL_RANK")
    ap.add_argument("--backend", help="torch.distributed backend (default: gloo on the CPU, "
                    "nccl with --device cuda)")
    ap.add_argument("--json", help="write the losses here as JSON")
    a = ap.parse_args()
    try:
        import torch
        from safetensors.torch import load_file
    except ImportError as e:
        fail(f"needs torch, transformers and safetensors ({e})")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        meta = read_meta(a.export)
        torch.manual_seed(0)
        model = build(meta)
        tensors = load_file(a.export)
        check(a.export, meta, tensors, model)
        k = meta["batches"]
        n = k if a.steps is None else a.steps
        if not 1 <= n <= k:
            raise Bad(f"--steps {n}: the file holds {k} batches (1..={k} steps; export more "
                      "with tinyllm export --batches)")
        if world > meta["data"]["batch"]:
            raise Bad(f"{world} processes for batches of {meta['data']['batch']} rows: each "
                      "process needs at least one row (fewer processes)")
        prev = os.path.join(a.out, CONTINUATION_FILE)
        if os.path.exists(prev):
            other = read_meta(prev)
            if other.get("run_id") != meta["run_id"]:
                raise Bad(f"{a.out} holds a continuation of run {other.get('run_id')!r}, "
                          f"not of run {meta['run_id']!r} (a file from another run); give "
                          "another --out")
        elif os.path.exists(a.out) and os.listdir(a.out):
            raise Bad(f"{a.out} exists and holds no {CONTINUATION_FILE}: not written by this "
                      "script; give another --out")
    except Bad as e:
        fail(str(e))
    if meta["precision"] != "fp32":
        article = "an" if meta["precision"].startswith("f") else "a"
        print(f"note: {article} {meta['precision']} run continues here in float32: losses "
              "agree to that precision, not to float32's", file=sys.stderr)
    if float(meta["model"].get("tinyllm_dropout", 0.0)) > 0:
        print("note: tinyllm's residual dropout has no LlamaForCausalLM counterpart; "
              "continuing without it", file=sys.stderr)

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(a.backend or ("nccl" if a.device == "cuda" else "gloo"))
    with torch.no_grad():
        model.load_state_dict({nm: tensors[nm] for nm in meta["params"]}, strict=True)
    model.train()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(f"cuda:{local}" if a.device == "cuda" else "cpu")
    model.to(dev)
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        # The weights are identical on every rank (the same file); DDP
        # averages the gradients over the ranks in backward.
        net = DistributedDataParallel(model, device_ids=[local] if a.device == "cuda" else None)

    o = meta["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=meta["schedule"]["lrs"][0],
                            betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                            weight_decay=o["weight_decay"], foreach=False)
    for name, p in model.named_parameters():
        if name in o["steps"]:
            opt.state[p] = {
                "step": torch.tensor(float(o["steps"][name]), dtype=torch.float32),
                "exp_avg": tensors[f"{name}.exp_avg"].to(dev, copy=True),
                "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(dev, copy=True),
            }

    rows, t = meta["data"]["batch"], meta["data"]["context"]
    lo, hi = rank * rows // world, (rank + 1) * rows // world
    losses = []
    for i in range(n):
        ids = tensors[f"batch.{i}.input_ids"][lo:hi].to(dev)
        labels = tensors[f"batch.{i}.labels"][lo:hi].to(dev)
        for g in opt.param_groups:
            g["lr"] = meta["schedule"]["lrs"][i]
        opt.zero_grad(set_to_none=True)
        logits = net(input_ids=ids).logits
        part = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum")
        # DDP averages the ranks' gradients: weighting each rank's sum by
        # world / (rows·t) makes that average the full batch's mean.
        (part * (world / (rows * t))).backward()
        total = part.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        loss = total.item() / (rows * t)
        if meta["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), meta["clip"])
        opt.step()
        losses.append(loss)
        if rank == 0:
            print(f"step {meta['step'] + i + 1}: loss {loss:.7f} (lr {g['lr']:.6g})", flush=True)

    if rank == 0:
        save(a.out, meta, model, opt, tensors, n)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"first_step": meta["step"] + 1, "losses": losses,
                           "processes": world}, f)
        print(f"wrote {a.out}: model.safetensors and config.json (tinyllm eval/generate "
              f"--checkpoint {a.out}), {CONTINUATION_FILE} at step {meta['step'] + n}")
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def replace(path, write):
    """`write(tmp)`, then the temporary file renamed to `path`: a file is
    whole or as it was, also when --out is where the input came from."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save(out, meta, model, opt, tensors, n):
    """The Hugging Face folder, and the continuation after `n` steps."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
               if k in meta["params"]}
    replace(os.path.join(out, "model.safetensors"),
            lambda p: save_file(weights, p, metadata={"format": "pt"}))

    def config(p):
        with open(p, "w") as f:
            json.dump(meta["model"], f, indent=2)

    replace(os.path.join(out, "config.json"), config)
    state = dict(weights)
    steps = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p)
        if st:
            state[f"{name}.exp_avg"] = st["exp_avg"].cpu().contiguous()
            state[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].cpu().contiguous()
            steps[name] = int(st["step"].item())
    k = meta["batches"]
    for j, i in enumerate(range(n, k)):
        for part in ("input_ids", "labels"):
            state[f"batch.{j}.{part}"] = tensors[f"batch.{i}.{part}"].contiguous()
    nxt = dict(meta)
    nxt["step"] = meta["step"] + n
    nxt["batches"] = k - n
    nxt["optimizer"] = dict(meta["optimizer"], steps=steps)
    nxt["schedule"] = dict(meta["schedule"], lrs=meta["schedule"]["lrs"][n:])
    # Where the data stands after the batches used: a resumed tinyllm run
    # (tinyllm import) draws its next batch from there.
    nxt["data"] = dict(meta["data"], positions=meta["data"]["positions"][n:])
    nxt["written_by"] = "scripts/continue_in_pytorch.py"
    replace(os.path.join(out, CONTINUATION_FILE),
            lambda p: save_file(state, p, metadata={"format": "pt", META_KEY: json.dumps(nxt)}))


if __name__ == "__main__":
    main()
