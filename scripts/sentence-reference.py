#!/usr/bin/env python3
"""Reference embeddings from sentence-transformers, for snug's parity test.

Usage: sentence-reference.py MODEL_DIR TEXTS.txt OUT.json

Reads one text per line, encodes every text with the sentence-transformers
library (the checkpoint's own pipeline: BERT, pooling, normalization), in
float32 on the CPU, and writes {"model": ..., "library": ..., "texts": [...],
"token_ids": [[...], ...], "embeddings": [[...], ...]}.
"""
import json
import sys

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer


def main():
    model_dir, texts_path, out_path = sys.argv[1:4]
    with open(texts_path, encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    torch.set_num_threads(1)
    model = SentenceTransformer(model_dir, device="cpu")
    model.eval()
    vectors = model.encode(texts, batch_size=8, convert_to_numpy=True, normalize_embeddings=False)
    ids = [model.tokenizer(t)["input_ids"] for t in texts]
    out = {
        "model": "all-MiniLM-L6-v2",
        "library": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}",
        "texts": texts,
        "token_ids": ids,
        "embeddings": [[float(x) for x in v] for v in vectors],
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
