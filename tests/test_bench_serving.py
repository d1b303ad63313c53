"""bench_serving against the real HTTP server (session fixture `server`): each dataset on a tiny setting; agent
traces in lock-step, their cached tokens checked against the server's own hit counter."""

from __future__ import annotations

import asyncio
import json

import httpx
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


def test_agent_traces_in_lockstep_and_server_counts(server) -> None:
    argv = ["--base-url", server.url, "--dataset-name", "agent", "--mt-num-sessions", "3", "--mt-num-turns", "3",
            "--mt-system-prompt-len", "24", "--mt-turn-input-len", "6", "--mt-turn-output-len", "3",
            "--agent-tool-result-len", "20", "--agent-tool-result-range-ratio", "0.5", "--mt-lockstep", *COMMON]
    args = parse_args(argv)
    sessions = build_sessions(args)
    assert sessions == build_sessions(args) and len(sessions) == 3
    # Turn 0: the shared system prompt + the task; later turns: a tool result of 10..20 tokens.
    assert len({tuple(s[0].new_ids[:24]) for s in sessions}) == 1 and all(len(s[0].new_ids) == 30 for s in sessions)
    tools = [len(t.new_ids) for s in sessions for t in s[1:]]
    assert min(tools) >= 10 and max(tools) <= 20 and len(set(tools)) > 1
    # Turn k's prompt: the task, then for each earlier turn the 3-token reply and the next tool result.
    want = [[30 + sum(3 + len(t.new_ids) for t in s[1:k + 1]) for s in sessions] for k in range(3)]
    info = server.url + "/get_server_info"
    hits0 = httpx.get(info, timeout=30).json()["memory"]["cache_hit_tokens"]
    results, duration = asyncio.run(run(args, sessions))
    # Lock-step: results arrive wave by wave (turn k of every session before any turn k + 1).
    assert [sorted(r.prompt_len for r in results[3 * k:3 * k + 3]) for k in range(3)] == [sorted(w) for w in want]
    m = summarize(results, duration, 9)
    _check_consistent(m, 9, 9 * 3, sum(map(sum, want)))
    # The usage fields' cached tokens are the server's own hit counter over the run; later turns hit.
    assert m["cached_tokens"] == httpx.get(info, timeout=30).json()["memory"]["cache_hit_tokens"] - hits0
    assert m["cached_tokens"] >= sum(want[1])
