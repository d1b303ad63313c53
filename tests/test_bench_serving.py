"""bench_serving against the real HTTP server (session fixture `server`): each dataset on a tiny setting."""

from __future__ import annotations

import asyncio
import json

import pytest

from sglang_tpu_qwen.bench.serving import NORMAL_ID_LIMIT, build_sessions, main, parse_args, run, summarize

COMMON = ["--seed", "3", "--disable-tqdm", "--max-concurrency", "4"]


def _check_consistent(m: dict, n: int, output_tokens: int, prompt_tokens: int) -> None:
    assert (m["completed"], m["failed"], m["not_sent"], m["errors"]) == (n, 0, 0, [])
    assert m["total_output_tokens"] == output_tokens  # ignore_eos: every request runs to its max
    assert m["total_input_tokens"] == prompt_tokens
    d = m["duration"]
    assert m["request_throughput"] == pytest.approx(n / d)
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / d)
    assert m["input_throughput"] == pytest.approx(prompt_tokens / d)
    assert m["total_throughput"] == pytest.approx((prompt_tokens + m["total_output_tokens"]) / d)
    assert 0 <= m["cached_tokens"] <= prompt_tokens
    assert m["prefill_tokens_computed"] == prompt_tokens - m["cached_tokens"]
    assert m["cache_hit_rate"] == pytest.approx(m["cached_tokens"] / prompt_tokens)
    for name in ("ttft", "itl"):
        assert 0 < m[f"median_{name}_ms"] <= m[f"p90_{name}_ms"] <= m[f"p99_{name}_ms"] < d * 1000
        assert m[f"mean_{name}_ms"] > 0
    assert m["mean_ttft_ms"] < d * 1000


def test_datasets_are_seeded_and_shaped() -> None:
    args = parse_args(["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3", "--gsp-prompts-per-group",
                       "2", "--gsp-system-prompt-len", "10", "--gsp-question-len", "5", "--seed", "4"])
    sessions = build_sessions(args)
    assert sessions == build_sessions(args) and len(sessions) == 6
    prompts = [s[0].new_ids for s in sessions]
    assert all(len(p) == 15 for p in prompts) and len({tuple(p[:10]) for p in prompts}) == 3
    assert all(0 <= t < NORMAL_ID_LIMIT for p in prompts for t in p)
    args = parse_args(["--dataset-name", "random", "--num-prompts", "20", "--random-input-len", "40",
                       "--random-range-ratio", "0.5"])
    lens = [len(s[0].new_ids) for s in build_sessions(args)]
    assert min(lens) >= 20 and max(lens) <= 40 and len(set(lens)) > 1
    with pytest.raises(ValueError):
        build_sessions(parse_args(["--random-range-ratio", "2"]))


def test_random_dataset_native_backend(server, tmp_path) -> None:
    out = tmp_path / "r.json"
    argv = ["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "5", "--random-input-len", "32",
            "--random-output-len", "4", "--random-range-ratio", "0.5", "--output-file", str(out), *COMMON]
    m = main(argv)
    assert json.loads(out.read_text()) == m
    sessions = build_sessions(parse_args(argv))
    _check_consistent(m, 5, sum(s[0].output_len for s in sessions), sum(len(s[0].new_ids) for s in sessions))


def test_shared_prefix_dataset_oai_backend(server) -> None:
    m = main(["--base-url", server.url, "--backend", "sglang-oai", "--dataset-name", "generated-shared-prefix",
              "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "48",
              "--gsp-question-len", "8", "--gsp-output-len", "4", "--request-rate", "50", *COMMON])
    _check_consistent(m, 4, 4 * 4, 4 * 56)


def test_multi_turn_resends_conversation(server) -> None:
    argv = ["--base-url", server.url, "--dataset-name", "multi-turn", "--mt-num-sessions", "2", "--mt-num-turns", "3",
            "--mt-system-prompt-len", "32", "--mt-turn-input-len", "8", "--mt-turn-output-len", "4", *COMMON]
    args = parse_args(argv)
    results, duration = asyncio.run(run(args, build_sessions(args)))
    # Turn k's prompt = system + k * (user message + 4-token reply) + a new user message.
    assert sorted(r.prompt_len for r in results) == sorted([32 + 8 + k * 12 for k in range(3)] * 2)
    _check_consistent(summarize(results, duration, 6), 6, 6 * 4, 2 * sum(32 + 8 + k * 12 for k in range(3)))
