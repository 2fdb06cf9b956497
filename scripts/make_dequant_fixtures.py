#!/usr/bin/env python3
"""Write the dequantization fixtures snug's tests compare against.

For each tensor type, blocks are taken from the real models where one has a
tensor of that type, plus random blocks with adversarial scales (zero,
negative, subnormal, the largest f16) for every type. The expected f32
values come from the `gguf` Python package's own dequantizer, an
implementation independent of snug's.

Usage: python3 scripts/make_dequant_fixtures.py MODEL_DIR OUT_DIR [MORE.gguf ...]
(needs `pip install gguf==0.19.0 numpy`). MORE files are searched after the
real models, for types none of them holds: files that llama.cpp's
`llama-quantize --allow-requantize` wrote from the real models (for
example Qwen2.5-Coder-1.5B as Q2_K, SmolLM2 as IQ4_NL, IQ4_XS, and Q8_0
with `--tensor-type ffn_up=mxfp4`), so those blocks come from llama.cpp's
own quantizer.
"""
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
]
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
         "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
# Byte offsets of the f16 scale fields in each block; these get finite
# values so the random blocks exercise arithmetic, not NaN propagation.
SCALE_OFFSETS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0],
    # MXFP4's scale is one E8M0 byte: every value is a power of two, so
    # random bytes already cover its whole range (subnormal ones included).
    "MXFP4": [],
}
REAL_BLOCKS = 24
RANDOM_BLOCKS = 24
ADVERSARIAL_SCALES = [0.0, -0.0, 65504.0, -65504.0, 6e-8, -3e-5, 1.0, -1.0, 0.5, 2.0**-14]


def finite_f16(rng, n):
    v = rng.standard_normal(n).astype(np.float32) * np.float32(0.05)
    return v.astype(np.float16)


def random_blocks(name, rng):
    qt = T[name]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(RANDOM_BLOCKS, size), dtype=np.uint8)
    # Scalar types: many elements, with zeros, extremes, subnormals, infinities.
    special = np.array([0.0, -0.0, 65504.0, -65504.0, 6e-8, -6e-8, 1e-6, np.inf, -np.inf], dtype=np.float32)
    if name == "F32":
        f = np.concatenate([rng.standard_normal(256).astype(np.float32) * 10, special, np.float32([1e-40, 3.4e38])])
        raw = f.astype("<f4").view(np.uint8).reshape(-1, 4)
    elif name == "F16":
        f = np.concatenate([finite_f16(rng, 256), special.astype(np.float16)])
        raw = f.view(np.uint8).reshape(-1, 2)
    elif name == "BF16":
        f = np.concatenate([rng.standard_normal(256).astype(np.float32), special, np.float32([1e-40, 3.4e38])])
        raw = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1, 2)
    else:
        for i in range(RANDOM_BLOCKS):
            for off in SCALE_OFFSETS[name]:
                if i < len(ADVERSARIAL_SCALES):
                    s = np.float16(ADVERSARIAL_SCALES[(i + off) % len(ADVERSARIAL_SCALES)])
                else:
                    s = finite_f16(rng, 1)[0]
                raw[i, off:off + 2] = np.frombuffer(s.tobytes(), dtype=np.uint8)
        if name.endswith("_K") or name == "IQ4_XS":
            raw[0, :] = 0  # an all-zero block
    return raw


def real_blocks(name, model_dir, more):
    qt = T[name]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    for path in [Path(model_dir) / m for m in MODELS] + [Path(m) for m in more]:
        m = path.name
        r = gguf.GGUFReader(str(path))
        for t in r.tensors:
            if t.tensor_type == qt:
                data = np.asarray(t.data).view(np.uint8).reshape(-1)
                n = min(REAL_BLOCKS, data.size // size)
                return data[: n * size].reshape(n, size), f"{m}:{t.name}"
    return None, None


def main():
    model_dir, out, more = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261130)
    manifest = {"generator": f"gguf {gguf.__version__ if hasattr(gguf, '__version__') else '0.19.0'} dequantize", "types": {}}
    for name in TYPES:
        qt = T[name]
        block, size = gguf.GGML_QUANT_SIZES[qt]
        parts, sources = [], []
        real, src = real_blocks(name, model_dir, more)
        if real is not None:
            parts.append(real)
            sources.append(f"{real.shape[0]} blocks of {src}")
        rnd = random_blocks(name, rng)
        parts.append(rnd)
        sources.append(f"{rnd.shape[0]} random blocks")
        raw = np.concatenate(parts).astype(np.uint8)
        values = gguf.quants.dequantize(raw.reshape(-1), qt).astype(np.float32).reshape(-1)
        assert values.size == raw.shape[0] * block
        (out / f"{name.lower()}.blocks").write_bytes(raw.tobytes())
        (out / f"{name.lower()}.f32").write_bytes(values.astype("<f4").tobytes())
        manifest["types"][name.lower()] = {"blocks": int(raw.shape[0]), "sources": sources}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
