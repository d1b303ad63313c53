"""Build a ``--speculative-token-map`` from text: the ``--size`` most frequent token ids of a corpus.

``python -m sglang_tpu_qwen.tools.token_map --model-path DIR --size 32768 -o hot.json corpus.txt [more.jsonl]``

FR-Spec (Zhao et al., 2025) ranks the vocabulary by token frequency on a corpus like the served traffic and
drafts among the top ids only. This counts the ids the model's own tokenizer gives each input (a ``.txt`` file
is one document per line; a ``.jsonl`` file takes each object's ``"text"``, or its chat ``"messages"``'
contents), keeps the ``size`` most frequent (ties by the lower id), adds the tokenizer's EOS ids and special
tokens (a draft of the end of a turn is a frequent right guess), and writes them as a sorted JSON list, the
format ``engine/runner/token_map.py`` reads beside SGLang's torch file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer

_BATCH = 256  # documents per encode_batch call


def documents(path: Path) -> Iterator[str]:
    """The texts of one input file: a ``.jsonl`` file's ``"text"`` fields or chat ``"messages"`` contents, else
    the file's non-empty lines. Raises ValueError for a ``.jsonl`` line that is not a JSON object."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                yield line.rstrip("\n")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object")
            if isinstance(obj.get("text"), str):
                yield obj["text"]
            for m in obj.get("messages") or ():
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    yield m["content"]


def count_tokens(tokenizer: Tokenizer, texts: Iterable[str]) -> Counter[int]:
    """How often each token id occurs in ``texts`` as ``tokenizer`` encodes them."""
    counts: Counter[int] = Counter()
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == _BATCH:
            for ids in tokenizer.encode_batch(batch):
                counts.update(ids)
            batch = []
    for ids in tokenizer.encode_batch(batch) if batch else ():
        counts.update(ids)
    return counts


def hot_ids(counts: Counter[int], size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` most frequent ids of ``counts`` (ties by the lower id) plus ``always``, sorted.

    Raises ValueError when ``size`` is not positive or ``counts`` is empty."""
    if size <= 0:
        raise ValueError(f"--size must be positive, got {size}")
    if not counts:
        raise ValueError("no tokens in the input")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return sorted({i for i, _ in ranked} | set(always))


def main(argv: list[str] | None = None) -> None:
    """Count the inputs' tokens and write the map; prints how much of the corpus's tokens it covers."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", type=Path, help=".txt (a document a line) or .jsonl files")
    ap.add_argument("--model-path", default=None,
                    help="the checkpoint whose tokenizer counts (default: the embedded model)")
    ap.add_argument("--size", type=int, default=32768, help="most frequent ids kept (default 32768)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="the JSON list to write")
    a = ap.parse_args(argv)
    if a.model_path is None:
        from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model

        a.model_path = str(ensure_embedded_model())
    tokenizer = Tokenizer(a.model_path)
    try:
        counts = count_tokens(tokenizer, (t for p in a.inputs for t in documents(p)))
        ids = hot_ids(counts, a.size, (*tokenizer.eos_token_ids, *tokenizer.special_token_ids))
    except (OSError, ValueError) as e:
        ap.error(str(e))
    a.output.write_text(json.dumps(ids))
    total, kept = sum(counts.values()), set(ids)
    covered = sum(c for i, c in counts.items() if i in kept)
    print(f"{len(ids)} ids of {tokenizer.vocab_size} written to {a.output}: {covered / total:.2%} of the "
          f"{total} tokens counted ({len(counts)} distinct)", file=sys.stderr)


if __name__ == "__main__":
    main()
