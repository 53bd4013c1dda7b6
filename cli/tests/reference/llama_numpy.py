#!/usr/bin/env python3
"""An independent reference for tinyllm's Llama: Hugging Face's `LlamaForCausalLM`
forward pass written from its definition in numpy (float64), reading and writing
the Hugging Face folder format itself (safetensors + config.json). No torch, no
transformers, nothing of tinyllm's.

    llama_numpy.py logits DIR --ids 1,2,3[,...] [--batch B] [--mutate M]
        prints {"shape": [B*T, V], "logits": [...]} (row-major, float64) for the
        ids cut into B sequences of equal length
    llama_numpy.py write DIR --hidden C --layers L --heads H --intermediate F
                   --context T [--vocab 256] [--rms-eps E] [--rope-theta R]
                   [--seed S] [--std SD]
        writes DIR/model.safetensors (float32) and DIR/config.json: random weights
        (matrices N(0, SD^2), norm gains 1 + N(0, 0.1^2))

`--mutate` breaks the reference on purpose, to show that a comparison against it
can fail: `rotate_half` swaps the two halves rotate_half returns, `eps` adds eps
outside the square root, `weight` changes one weight by 1 %.

The forward pass (transformers' modeling_llama.py):
  x = embed_tokens[ids]
  per layer:
    h = RMSNorm(x) = weight * x / sqrt(mean(x^2) + eps)     (over the last axis)
    q, k, v = h Wq^T, h Wk^T, h Wv^T                        (nn.Linear: W is (out, in))
      split into heads: (B, T, H, D) -> (B, H, T, D)
    RoPE: inv_freq[i] = 1 / theta^(2i / D), i < D/2; emb = cat(freqs, freqs);
      q = q cos + rotate_half(q) sin, rotate_half(x) = cat(-x2, x1)   (x1, x2 the halves)
    attention: softmax(q k^T / sqrt(D), causal mask) v -> (B, T, H*D) -> Wo
    x = x + attention
    x = x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))   (post_attention_layernorm)
  logits = lm_head(RMSNorm(x))                              (model.norm)
"""
import argparse
import json
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        if t["dtype"] not in DTYPES:
            sys.exit(f"{path}: tensor {name} has dtype {t['dtype']} (this reference reads F32, F64, F16)")
        a = np.frombuffer(data[begin:end], dtype=np.dtype(DTYPES[t["dtype"]]).newbyteorder("<"))
        out[name] = a.reshape(t["shape"]).astype(np.float64)
    return out


def write_safetensors(path, tensors):
    """tensors: a list of (name, float32 array), written in that order."""
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors:
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def rms_norm(x, w, eps, mutate):
    ms = np.mean(x * x, axis=-1, keepdims=True)
    if mutate == "eps":
        return w * x / (np.sqrt(ms) + eps)
    return w * x / np.sqrt(ms + eps)


def rotate_half(x, mutate):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if mutate == "rotate_half":
        return np.concatenate([x1, -x2], axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(cfg, w, ids, mutate=None):
    """ids: (B, T) ints -> logits (B, T, V), float64."""
    c, h = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", h)
    assert kv == h, "grouped-query attention is not part of this reference"
    d = cfg.get("head_dim") or c // h
    eps, theta = cfg.get("rms_norm_eps", 1e-6), cfg.get("rope_theta", 10000.0)
    assert cfg.get("rope_scaling") is None, "RoPE scaling is not part of this reference"
    b, t = ids.shape
    x = w["model.embed_tokens.weight"][ids]  # (B, T, C)
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # (D/2,)
    freqs = np.outer(np.arange(t, dtype=np.float64), inv_freq)  # (T, D/2)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, D)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.triu(np.ones((t, t), dtype=bool), k=1)  # True above the diagonal: the future
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        n1 = rms_norm(x, w[p + "input_layernorm.weight"], eps, mutate)

        def heads(name):
            y = n1 @ w[p + f"self_attn.{name}.weight"].T  # (B, T, H*D)
            return y.reshape(b, t, h, d).transpose(0, 2, 1, 3)  # (B, H, T, D)

        q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
        q = q * cos + rotate_half(q, mutate) * sin
        k = k * cos + rotate_half(k, mutate) * sin
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)  # (B, H, T, T)
        s = np.where(mask, -np.inf, s)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        a = (s / s.sum(axis=-1, keepdims=True)) @ v  # (B, H, T, D)
        a = a.transpose(0, 2, 1, 3).reshape(b, t, h * d)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        n2 = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps, mutate)
        g = silu(n2 @ w[p + "mlp.gate_proj.weight"].T)
        u = n2 @ w[p + "mlp.up_proj.weight"].T
        x = x + (g * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps, mutate)
    return x @ w["lm_head.weight"].T


def cmd_logits(a):
    with open(f"{a.dir}/config.json") as f:
        cfg = json.load(f)
    w = read_safetensors(f"{a.dir}/model.safetensors")
    if a.mutate == "weight":
        name = "model.layers.0.self_attn.q_proj.weight"
        w[name] = w[name].copy()
        w[name][0, 0] += 0.01 * max(abs(w[name][0, 0]), np.abs(w[name]).mean())
    ids = np.array([int(s) for s in a.ids.split(",")], dtype=np.int64)
    if len(ids) % a.batch:
        sys.exit(f"{len(ids)} ids do not split into {a.batch} sequences")
    logits = forward(cfg, w, ids.reshape(a.batch, -1), a.mutate)
    v = logits.shape[-1]
    json.dump({"shape": [len(ids), v], "logits": logits.reshape(-1).tolist()}, sys.stdout)


def cmd_write(a):
    import os

    os.makedirs(a.dir, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    c, f_, v = a.hidden, a.intermediate, a.vocab
    mat = lambda o, i: rng.normal(0.0, a.std, size=(o, i))
    gain = lambda: 1.0 + rng.normal(0.0, 0.1, size=(c,))
    ts = [("model.embed_tokens.weight", rng.normal(0.0, 1.0, size=(v, c)))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        ts += [
            (p + "input_layernorm.weight", gain()),
            (p + "self_attn.q_proj.weight", mat(c, c)),
            (p + "self_attn.k_proj.weight", mat(c, c)),
            (p + "self_attn.v_proj.weight", mat(c, c)),
            (p + "self_attn.o_proj.weight", mat(c, c)),
            (p + "post_attention_layernorm.weight", gain()),
            (p + "mlp.gate_proj.weight", mat(f_, c)),
            (p + "mlp.up_proj.weight", mat(f_, c)),
            (p + "mlp.down_proj.weight", mat(c, f_)),
        ]
    ts += [("model.norm.weight", gain()), ("lm_head.weight", mat(v, c))]
    write_safetensors(f"{a.dir}/model.safetensors", [(n, x.astype(np.float32)) for n, x in ts])
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": v,
        "hidden_size": c,
        "intermediate_size": f_,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.heads,
        "max_position_embeddings": a.context,
        "rms_norm_eps": a.rms_eps,
        "rope_theta": a.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    with open(f"{a.dir}/config.json", "w") as f:
        json.dump(cfg, f, indent=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits")
    lg.add_argument("dir")
    lg.add_argument("--ids", required=True)
    lg.add_argument("--batch", type=int, default=1)
    lg.add_argument("--mutate", choices=["rotate_half", "eps", "weight"])
    wr = sub.add_parser("write")
    wr.add_argument("dir")
    for k in ["hidden", "layers", "heads", "intermediate", "context"]:
        wr.add_argument("--" + k, type=int, required=True)
    wr.add_argument("--vocab", type=int, default=256)
    wr.add_argument("--rms-eps", type=float, default=1e-5)
    wr.add_argument("--rope-theta", type=float, default=10000.0)
    wr.add_argument("--seed", type=int, default=0)
    wr.add_argument("--std", type=float, default=0.2)
    a = ap.parse_args()
    {"logits": cmd_logits, "write": cmd_write}[a.cmd](a)


if __name__ == "__main__":
    main()
