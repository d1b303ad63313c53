"""The startup benchmark (bench/startup.py): its flags, its --runs plumbing and one in-process run on the CPU.

A cold run through the subprocesses compiles every program (about a minute on 2 cores even with tiny limits),
so it is not run here; the in-process run uses the session engine's flags, whose programs the persistent
compilation cache usually holds already.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ENGINE_KWARGS

from sglang_tpu_qwen.bench import startup


def test_concurrent_raises_max_running_requests_unless_given() -> None:
    _, args = startup.parse_args(["--concurrent", "64"])
    assert args.max_running_requests == 64
    _, args = startup.parse_args(["--concurrent", "64", "--max-running-requests", "16"])
    assert args.max_running_requests == 16
    ns, args = startup.parse_args(["--runs", "cold,warm", "--compilation-cache-dir", "/x"])
    assert ns.runs == "cold,warm" and args.compilation_cache_dir == "/x" and args.max_running_requests == 32


@pytest.mark.parametrize("runs", ["warm,cold", "cold,cold", "hot"])
def test_bad_runs_are_usage_errors(runs: str) -> None:
    with pytest.raises(SystemExit) as e:
        startup.parse_args(["--runs", runs])
    assert e.value.code == 2


def test_subprocess_argv_drops_the_parents_flags() -> None:
    argv = ["--runs", "cold,warm", "--concurrent", "4", "--output-json", "o.json", "--runs=warm", "--page-size", "8"]
    assert startup._without_runs(argv) == ["--concurrent", "4", "--page-size", "8"]


def test_cold_run_refuses_a_non_empty_cache(tmp_path: Path) -> None:
    (tmp_path / "entry").write_text("x")
    ns, _ = startup.parse_args(["--runs", "cold", "--compilation-cache-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="not empty"):
        startup.run_sequence(["--runs", "cold"], ns, None)


def test_one_run_in_process_reports_startup_and_throughput() -> None:
    flags = {**ENGINE_KWARGS, "grammar_backend": "none"}
    argv = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    ns, args = startup.parse_args([*argv, "--first-reply-tokens", "3", "--concurrent", "2", "--input-len", "8",
                                   "--output-len", "3"])
    result = startup.run_once(ns, args)
    assert result["platform"] == "cpu" and result["ready_s"] > 0 and result["first_reply_tokens"] == 3
    assert result["precompile"] is None  # disable_precompile: the programs compile at first use
    assert result["weight_load_s"] is not None and result["weight_load_s"] < result["ready_s"]
    conc = result["concurrent"]
    assert conc["requests"] == 2 and conc["output_tokens"] == 6 and conc["finish_reasons"] == ["length"]
    assert 1 <= conc["peak_running"] <= 2
    table = startup.format_markdown([result]).splitlines()
    assert table[0].startswith("| model | device | cache | ready (s)") and "not precompiled" in table[2]
    assert table[4].startswith("| model | device | requests") and "| 8 / 3 |" in table[6]
