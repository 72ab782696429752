"""The most frequent token ids of a corpus, for ``dspark_draft_vocab``.

    python tools/draft_vocab.py --size 32768 --tokenizer /models/Qwen3-8B \
        --corpus traffic.txt --out draft_vocab.json
    vllm serve ... --speculative-config '{..., "dspark_draft_vocab": "draft_vocab.json"}'

Counts the tokens of each corpus file: a text file, tokenised with ``--tokenizer`` (a
model directory or name transformers can load), or a JSON list of token-id lists or of
``{"prompt_token_ids": [...]}`` (the embedded pair's held-out prompts), read as it is.
Writes the ``--size`` most frequent ids (ties to the lower id) as ``{"token_ids": [...]}``,
which the option reads, with how much of the corpus they cover beside how much the first
``--size`` ids cover (what ``dspark_draft_vocab: N`` keeps). A greedy draft can only be
accepted where the target's token is in the set, so the coverage of the text a server
generates bounds the share of drafts the set can still get right.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def count_tokens(paths: list[Path], tokenizer: str | None) -> Counter:
    counts: Counter = Counter()
    encoder = None
    for path in paths:
        text = path.read_text()
        if path.suffix == ".json":
            for item in json.loads(text):
                counts.update(item["prompt_token_ids"] if isinstance(item, dict) else item)
            continue
        if encoder is None:
            if tokenizer is None:
                raise SystemExit(f"{path}: a text corpus needs --tokenizer")
            from transformers import AutoTokenizer

            encoder = AutoTokenizer.from_pretrained(tokenizer)
        counts.update(encoder.encode(text, add_special_tokens=False))
    return counts


def most_frequent(counts: Counter, size: int) -> list[int]:
    """The ``size`` most frequent ids, ties to the lower id, in increasing id order."""
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    return sorted(ranked[:size])


def coverage(counts: Counter, ids: set[int] | range) -> float:
    total = sum(counts.values())
    return sum(n for token, n in counts.items() if token in ids) / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, required=True, help="ids to keep")
    parser.add_argument("--corpus", type=Path, nargs="+", required=True)
    parser.add_argument("--tokenizer", help="for text files: a model directory or name")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    counts = count_tokens(args.corpus, args.tokenizer)
    ids = most_frequent(counts, args.size)
    record = {
        "token_ids": ids,
        "size": len(ids),
        "tokens_counted": sum(counts.values()),
        "distinct_tokens": len(counts),
        "coverage": round(coverage(counts, set(ids)), 4),
        "first_ids_coverage": round(coverage(counts, range(args.size)), 4),
        "corpus": [str(path) for path in args.corpus],
        "tokenizer": args.tokenizer,
    }
    args.out.write_text(json.dumps(record) + "\n")
    summary = {key: value for key, value in record.items() if key != "token_ids"}
    print(json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
