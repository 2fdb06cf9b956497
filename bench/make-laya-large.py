#!/usr/bin/env python3
"""Write a randomly initialised Laya checkpoint of the published English
shape (ModernBERT-large encoder, 2-layer decision head, max_len 512,
head_max_len 192) for speed measurements. Speed does not depend on the
weight values; the tokenizer is the tiny fixture's (its ids are a subset
of the 50,368-row embedding table).

    bench/make-laya-large.py OUT_DIR

Needs numpy only. About 0.8 GB of f16 weights.
"""

import json
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "..", "data", "laya", "tiny-modernbert")

D, INTER, LAYERS, HEADS, VOCAB, HEAD_LAYERS, N_ACT = 1024, 2624, 28, 16, 50368, 2, 2


def tensors():
    yield "encoder.embeddings.tok_embeddings.weight", (VOCAB, D)
    yield "encoder.embeddings.norm.weight", (D,)
    for i in range(LAYERS):
        p = "encoder.layers.%d." % i
        if i > 0:
            yield p + "attn_norm.weight", (D,)
        yield p + "attn.Wqkv.weight", (3 * D, D)
        yield p + "attn.Wo.weight", (D, D)
        yield p + "mlp_norm.weight", (D,)
        yield p + "mlp.Wi.weight", (2 * INTER, D)
        yield p + "mlp.Wo.weight", (D, INTER)
    yield "encoder.final_norm.weight", (D,)
    for j in range(HEAD_LAYERS):
        p = "head.layers.%d." % j
        yield p + "self_attn.in_proj_weight", (3 * D, D)
        yield p + "self_attn.in_proj_bias", (3 * D,)
        yield p + "self_attn.out_proj.weight", (D, D)
        yield p + "self_attn.out_proj.bias", (D,)
        yield p + "linear1.weight", (4 * D, D)
        yield p + "linear1.bias", (4 * D,)
        yield p + "linear2.weight", (D, 4 * D)
        yield p + "linear2.bias", (D,)
        for n in ("norm1", "norm2"):
            yield p + n + ".weight", (D,)
            yield p + n + ".bias", (D,)
    yield "type_emb.weight", (3, D)
    yield "scorer.0.weight", (D,)
    yield "scorer.0.bias", (D,)
    yield "scorer.1.weight", (D, D)
    yield "scorer.1.bias", (D,)
    yield "scorer.3.weight", (1, D)
    yield "scorer.3.bias", (1,)
    yield "act_head.0.weight", (256, D + 4)
    yield "act_head.0.bias", (256,)
    yield "act_head.2.weight", (N_ACT, 256)
    yield "act_head.2.bias", (N_ACT,)
    yield "temperature", (3,)


def main():
    out = sys.argv[1]
    os.makedirs(os.path.join(out, "encoder"), exist_ok=True)
    header, offset = {}, 0
    specs = list(tensors())
    for name, shape in specs:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(0)
    tmp = os.path.join(out, "model.safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in specs:
            if len(shape) == 1:
                base = 1.0 if name.endswith("weight") and "norm" in name or name.startswith("scorer.0.w") else 0.0
                a = np.full(shape, base, dtype=np.float32) + 0.02 * rng.standard_normal(shape, dtype=np.float32)
            else:
                a = rng.standard_normal(shape, dtype=np.float32) * (1.0 / np.sqrt(shape[1]))
            f.write(a.astype("<f2").tobytes())
    os.replace(tmp, os.path.join(out, "model.safetensors"))
    enc = {
        "model_type": "modernbert", "vocab_size": VOCAB, "hidden_size": D, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "hidden_activation": "gelu",
        "max_position_embeddings": 8192, "global_attn_every_n_layers": 3, "local_attention": 128,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "norm_eps": 1e-5, "norm_bias": False,
        "attention_bias": False, "mlp_bias": False,
    }
    with open(os.path.join(out, "encoder", "config.json"), "w") as f:
        json.dump(enc, f, indent=2)
    cfg = {"encoder": "answerdotai/ModernBERT-large", "max_len": 512, "head_max_len": 192, "head_layers": HEAD_LAYERS,
           "act_costs": {"ask": 0.05}, "temperature": [1.0, 1.0, 1.0], "temperature_by_options": {}}
    with open(os.path.join(out, "rl_agent_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    shutil.copytree(os.path.join(TINY, "tokenizer"), os.path.join(out, "tokenizer"), dirs_exist_ok=True)
    print(out, "%.0f MB" % (offset / 1e6))


if __name__ == "__main__":
    main()
