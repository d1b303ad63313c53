"""tools/token_map.py: a --speculative-token-map from a corpus's most frequent token ids, read back by the
server's loader (engine/runner/token_map.py)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
from sglang_tpu_qwen.engine.runner.token_map import load_token_map
from sglang_tpu_qwen.tokenizer.tokenizer import Tokenizer
from sglang_tpu_qwen.tools import token_map


def test_hot_ids_ranks_by_count_then_id() -> None:
    counts = Counter({5: 3, 9: 3, 2: 1, 7: 2})
    assert token_map.hot_ids(counts, 2) == [5, 9]
    assert token_map.hot_ids(counts, 3, always=[100]) == [5, 7, 9, 100]
    with pytest.raises(ValueError, match="positive"):
        token_map.hot_ids(counts, 0)
    with pytest.raises(ValueError, match="no tokens"):
        token_map.hot_ids(Counter(), 4)


def test_builds_a_map_the_server_loads(tmp_path: Any, capsys: Any) -> None:
    """A .txt and a .jsonl corpus (text and chat messages): the map holds the most frequent ids and the EOS and
    special ids, sorted, and loads as the server loads it."""
    model = ensure_embedded_model()
    tok = Tokenizer(model)
    (tmp_path / "a.txt").write_text("the cat sat on the mat\nthe dog sat\n\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "the end"}) + "\n"
                                      + json.dumps({"messages": [{"role": "user", "content": "the cat"}]}) + "\n")
    out = tmp_path / "hot.json"
    token_map.main([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--model-path", str(model), "--size", "3",
                    "-o", str(out)])
    counts = Counter(i for t in ["the cat sat on the mat", "the dog sat", "the end", "the cat"] for i in tok.encode(t))
    top3 = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]]
    ids = json.loads(out.read_text())
    assert ids == sorted(set(top3) | set(tok.eos_token_ids) | set(tok.special_token_ids))
    assert load_token_map(str(out), tok.vocab_size).tolist() == ids
    assert "written to" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n")
    with pytest.raises(SystemExit):
        token_map.main([str(tmp_path / "bad.jsonl"), "--model-path", str(model), "-o", str(out)])
