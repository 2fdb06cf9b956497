#!/usr/bin/env python3
"""Build two tiny, randomly initialised Laya checkpoints and the reference
SDK's answers for them.

snug runs Laya checkpoints natively; the tests in
`crates/snug-engine/tests/laya.rs` hold it to the reference on these files.
Published checkpoints cannot be downloaded everywhere, so the fixture is a
checkpoint of the same format and architecture, only small:

  data/laya/tiny-modernbert/   ModernBERT layout: byte-level BPE tokenizer with
                               [CLS]/[SEP]/[MASK], global RoPE theta 160000 and
                               local 10000, a local window of +-8
  data/laya/tiny-mmbert/       mmBERT layout: metaspace BPE tokenizer with
                               <bos>/<eos>/<mask>, both thetas 160000
  data/laya/reference.json     per checkpoint and request: the SDK's response
                               (or its error), and per question the token ids,
                               mask positions, raw option logits and act logits

Each checkpoint is written by `laya.train.save_checkpoint` (f16 weights, the
published layout) and read back by `laya.Agent` on the CPU in float32, which
is what answers the requests.

Needs torch, transformers (ModernBERT) and laya==0.4.15:
    pip install torch transformers laya==0.4.15
    python3 scripts/make-laya-fixtures.py --out data/laya
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import ModernBertConfig, ModernBertModel, PreTrainedTokenizerFast

import laya
from laya.agent import Agent
from laya.common import DecisionModel, collate_items
from laya.train import save_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
REVIEWS = os.path.join(HERE, "..", "data", "decide", "reviews.jsonl")

EXTRA_TEXT = [
    "I ordered the blue kettle on Monday and it still has not arrived. Where is my parcel?",
    "Please refund the second charge on my card, I was billed twice for one order.",
    "Das Paket kam beschädigt an, und der Kundendienst antwortet nicht.",
    "La livraison était rapide et le produit fonctionne très bien.",
    "Is this a refund request, a delivery question, a complaint or praise?",
    "How urgent is this message, from not urgent at all to extremely urgent?",
    "choice question: score question: noul question: level 0: level 1: level 2:",
    "false: no, the statement does not hold true: yes, the statement holds",
]


def corpus():
    texts = list(EXTRA_TEXT)
    with open(REVIEWS, encoding="utf-8") as f:
        # The set's first edition (its first 180 lines), which the
        # committed tokenizers were trained on.
        for line in list(f)[:180]:
            item = json.loads(line)
            texts.append(item["state"])
            for q in item["questions"].values():
                texts.append(q["instructions"])
    return texts


def modernbert_tokenizer(texts):
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")


def mmbert_tokenizer(texts):
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", cls_token="<bos>",
                                   sep_token="<eos>", pad_token="<pad>", mask_token="<mask>",
                                   bos_token="<bos>", eos_token="<eos>")


def encoder_config(tok, hidden, heads, layers, inter, local_window, global_theta, local_theta, max_pos):
    ids = {name: tok.convert_tokens_to_ids(getattr(tok, name)) for name in ("pad_token", "cls_token", "sep_token")}
    cfg = ModernBertConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=max_pos, global_attn_every_n_layers=3,
        local_attention=local_window, global_rope_theta=global_theta, local_rope_theta=local_theta,
        pad_token_id=ids["pad_token"], cls_token_id=ids["cls_token"], sep_token_id=ids["sep_token"],
        bos_token_id=ids["cls_token"], eos_token_id=ids["sep_token"], hidden_activation="gelu",
        norm_eps=1e-5, norm_bias=False, attention_bias=False, mlp_bias=False,
    )
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters = {
            "full_attention": {"rope_type": "default", "rope_theta": float(global_theta)},
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local_theta)},
        }
    for attr, value in (("global_rope_theta", global_theta), ("local_rope_theta", local_theta)):
        if hasattr(cfg, attr):
            setattr(cfg, attr, float(value))
    return cfg


def randomize(model, seed):
    """Weights of unit-scale activations, so option logits differ by O(1)
    and the probabilities are far from uniform (a standard 0.02 init makes
    every answer nearly uniform, which would make a parity check weak)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "tok_embeddings" in name or "type_emb" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        model.scorer[-1].weight.mul_(3.0)


LONG = " ".join(EXTRA_TEXT * 6)

CASES = [
    {"name": "three-types",
     "state": "The kettle arrived two weeks late and the lid is cracked. I want my money back.",
     "questions": {
         "intent": {"type": "choice", "instructions": "What does the customer want?",
                    "criteria": {"refund": "money back", "replacement": "a new item", "info": None}},
         "urgency": {"type": "score", "instructions": "How urgent is this message?",
                     "criteria": ["not urgent", "a little", "somewhat", "urgent", "extremely urgent"]},
         "angry": {"type": "noul", "instructions": "Is the customer angry?"}}},
    {"name": "list-criteria-and-labels",
     "state": "Great value, works as described, would buy again.",
     "questions": {
         "sentiment": {"type": "choice", "instructions": "Is the review positive or negative?",
                       "criteria": ["positive", "negative"]},
         "stars": {"type": "score", "instructions": "How many stars would this review give?",
                   "criteria": ["zero", "one", "two", "three", "four", "five", "six"]},
         "recommend": {"type": "noul", "instructions": "Does the writer recommend the product?",
                       "criteria": {"true": "they recommend it", "false": "they do not"},
                       "labels": {"false": "B", "true": "A"}}}},
    {"name": "structured-state",
     "state": {"customer": "Ana", "order": 1182, "message": "Where is my parcel? It was due Friday.",
               "tags": ["delivery", "late"]},
     "questions": {
         "topic": {"type": "choice", "instructions": {"task": "route the ticket", "to": "one queue"},
                   "criteria": {"billing": {"covers": ["charges", "refunds"]}, "delivery": 3, "other": ""}},
         "late": {"type": "noul", "instructions": "Is the order late?", "criteria": {"True": "yes", "FALSE": None}}}},
    {"name": "conversation-left-truncation",
     "state": [{"role": "user", "content": t} for t in EXTRA_TEXT * 3],
     "questions": {
         "refund": {"type": "noul", "instructions": "Does the latest message ask for a refund?"},
         "lang": {"type": "choice", "instructions": "Which language is the latest message in?",
                  "criteria": ["English", "German", "French"]}}},
    {"name": "long-state-right-truncation",
     "state": LONG,
     "questions": {
         "topic": {"type": "choice", "instructions": "What is the text mostly about?",
                   "criteria": {"shopping": None, "travel": None, "sport": None, "music": None}},
         "length": {"type": "score", "instructions": "How long is the text?",
                    "criteria": ["short", "medium", "long"]}}},
    {"name": "option-order",
     "state": "Please refund the second charge on my card.",
     "questions": {
         "intent": {"type": "choice", "instructions": "What does the customer want?",
                    "criteria": {"refund": None, "replacement": None, "info": None, "cancel": None},
                    "option_order": [2, 0, 3, 1]},
         "plain": {"type": "choice", "instructions": "What does the customer want?",
                   "criteria": {"refund": None, "replacement": None, "info": None, "cancel": None}}}},
    {"name": "many-options",
     "state": "The parcel came with a cracked lid.",
     "questions": {
         "cause": {"type": "choice", "instructions": "Which department should look at this first?",
                   "criteria": {"dept-%02d" % i: "department number %d of the company's support organisation" % i
                                for i in range(12)}},
         "severity": {"type": "score", "instructions": "How severe is it?",
                      "criteria": ["level %d of severity on the company scale" % i for i in range(8)]}}},
    {"name": "capacity-error",
     "state": "short",
     "max_len": 40, "head_max_len": 192,
     "questions": {
         "cause": {"type": "choice", "instructions": "Which one?",
                   "criteria": {"option number %d" % i: "a long description of option %d" % i for i in range(9)}}}},
    {"name": "budget-overrides",
     "state": LONG,
     "max_len": 64, "head_max_len": 24,
     "questions": {
         "pos": {"type": "noul", "instructions": "Is the text positive about the product overall, all things considered?"},
         "kind": {"type": "choice", "instructions": "What kind of text is it?",
                  "criteria": ["review", "question", "complaint"]}}},
    {"name": "mask-and-unicode",
     "state": "Das Paket kam [MASK] beschädigt <mask> an \u2014 \u00e9t\u00e9 \U0001F600 ok.",
     "questions": {
         "ok": {"type": "noul", "instructions": "Is [MASK] the <mask> item fine?"},
         "one": {"type": "choice", "instructions": "Pick one.", "criteria": ["only"]}}},
    {"name": "min-confidence-number",
     "state": "Great value, works as described.",
     "min_confidence": 0.6,
     "questions": {
         "sentiment": {"type": "choice", "instructions": "Is the review positive or negative?",
                       "criteria": ["positive", "negative", "mixed"]},
         "good": {"type": "noul", "instructions": "Is the review positive?"}}},
    {"name": "min-confidence-map",
     "state": "Great value, works as described.",
     "min_confidence": {"choice:3-5": 0.9, "noul:2": 0.1, "default": 0.5},
     "questions": {
         "sentiment": {"type": "choice", "instructions": "Is the review positive or negative?",
                       "criteria": ["positive", "negative", "mixed"]},
         "good": {"type": "noul", "instructions": "Is the review positive?"},
         "stars": {"type": "score", "instructions": "Stars?", "criteria": ["1", "2", "3", "4", "5", "6"]}}},
    {"name": "no-questions", "state": "anything", "questions": {}},
]


def raw_rows(agent, case):
    ids = list(case["questions"].keys())
    if not ids:
        return {}
    internal = {qid: agent._to_internal(case["questions"][qid]) for qid in ids}
    kw = {k: case[k] for k in ("max_len", "head_max_len") if k in case}
    items = agent._encode_state(case["state"], ids, internal, **kw)
    b = collate_items([items], agent.tok.pad_token_id)
    with torch.no_grad():
        logits, act = agent._forward(b)
    out = {}
    for j, (qid, item) in enumerate(zip(ids, items)):
        k = len(item["markers"])
        out[qid] = {
            "ids": [int(t) for t in item["ids"]],
            "markers": [int(m) for m in item["markers"]],
            "logits": [float(v) for v in logits[j, :k].tolist()],
            "act_logits": [float(v) for v in act[j].tolist()],
        }
    return out


def run_cases(agent):
    results = []
    for case in CASES:
        entry = {"name": case["name"], "request": {k: v for k, v in case.items() if k != "name"}}
        kw = {k: case[k] for k in ("max_len", "head_max_len", "min_confidence") if k in case}
        try:
            entry["response"] = agent.system_one(case["state"], case["questions"], **kw)
            entry["rows"] = raw_rows(agent, case)
        except ValueError as e:
            entry["error"] = str(e)
        results.append(entry)
    return results


def build(kind, out_dir, texts):
    torch.manual_seed(7)
    if kind == "tiny-modernbert":
        tok = modernbert_tokenizer(texts)
        ecfg = encoder_config(tok, hidden=64, heads=2, layers=4, inter=96, local_window=16,
                              global_theta=160000.0, local_theta=10000.0, max_pos=512)
        cfg = {"encoder": "answerdotai/ModernBERT-large", "max_len": 160, "head_max_len": 64,
               "head_layers": 2, "act_costs": {"ask": 0.05}, "amp_dtype": "bf16",
               "temperature": [1.3, 0.8, 2.0],
               "temperature_by_options": {"choice:3-5": 1.7, "score:6-10": 0.7, "choice:11+": 0.1}}
        seed = 11
    else:
        tok = mmbert_tokenizer(texts)
        ecfg = encoder_config(tok, hidden=48, heads=3, layers=4, inter=80, local_window=16,
                              global_theta=160000.0, local_theta=160000.0, max_pos=1024)
        cfg = {"encoder": "jhu-clsp/mmBERT-base", "max_len": 200, "head_max_len": 80,
               "head_layers": 2, "act_costs": {"ask": 0.05}, "amp_dtype": "bf16",
               "temperature": [1.0, 1.0, 1.5], "temperature_by_options": {"noul:2": 2.5}}
        seed = 12
    enc = ModernBertModel(ecfg)
    model = DecisionModel(enc, head_layers=cfg["head_layers"], n_act=len(cfg["act_costs"]) + 1)
    randomize(model, seed)
    model.eval()
    path = os.path.join(out_dir, kind)
    shutil.rmtree(path, ignore_errors=True)
    save_checkpoint(model, tok, cfg, path)
    agent = Agent(path, device="cpu")
    return {"checkpoint": kind, "laya": laya.__version__ if hasattr(laya, "__version__") else "0.4.15",
            "torch": torch.__version__, "cases": run_cases(agent)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "..", "data", "laya"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    texts = corpus()
    reference = {kind: build(kind, args.out, texts) for kind in ("tiny-modernbert", "tiny-mmbert")}
    with open(os.path.join(args.out, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(reference, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for kind, ref in reference.items():
        for case in ref["cases"]:
            print(kind, case["name"], "error" if "error" in case else "ok", file=sys.stderr)


if __name__ == "__main__":
    main()
