"""SGLang's /start_profile and /stop_profile: a jax.profiler trace of the scheduler's steps, with step annotations
naming the forward mode, batch size and token count; a second start is a 400; bench_serving --profile."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import httpx
import pytest

from sglang_tpu_qwen.bench import serving
from sglang_tpu_qwen.engine.observability.profiler import ProfileConfig, ProfileError

STEP_NAME = re.compile(r"(EXTEND|DECODE) bs=(\d+) tokens=(\d+)")


def _trace_names(run_dir: Path) -> list[str]:
    """Event names of the Perfetto trace jax.profiler wrote in run_dir (the xplane.pb beside it holds the same)."""
    assert list(run_dir.glob("*.xplane.pb")), list(run_dir.iterdir())
    with gzip.open(run_dir / "perfetto_trace.json.gz") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e.get("name", "") for e in events]


# No client deadline on any request here (timeout=None): each reply comes once the scheduler thread has done
# the work (a step, jax.profiler's start or stop), and how long that takes depends on the machine and on what
# else runs (a /stop_profile took over 120 s late in a loaded suite run; the file alone passes in 22 s). A
# deadline would test the machine's speed, not the server.
WAIT = None


def _generate(url: str, ids: list[int], n: int) -> dict:
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    r = httpx.post(url + "/generate", timeout=WAIT, json={"input_ids": ids, "sampling_params": sp})
    assert r.status_code == 200, r.text
    return r.json()


def test_start_run_stop_writes_annotated_trace(server, tmp_path):
    r = httpx.post(server.url + "/start_profile", json={"output_dir": str(tmp_path), "activities": ["CPU", "GPU"],
                                                        "with_stack": False}, timeout=WAIT)
    assert r.status_code == 200, r.text
    assert str(tmp_path) in r.text
    again = httpx.post(server.url + "/start_profile", timeout=WAIT)
    assert again.status_code == 400 and "already in progress" in again.text
    _generate(server.url, list(range(1000, 1040)), 3)  # one 40-token extend, then decode steps
    r = httpx.post(server.url + "/stop_profile", timeout=WAIT)
    assert r.status_code == 200, r.text
    run_dir = Path(r.text.split("Trace: ")[1].strip())
    assert run_dir.parent == tmp_path / "plugins" / "profile"
    steps = [m.groups() for m in map(STEP_NAME.fullmatch, _trace_names(run_dir)) if m]
    # The 40-token prompt is prefilled in chunks (one ends at the last page boundary, for a snapshot); the first
    # output token comes with the last chunk, the other two from decode steps.
    assert sum(int(t) for mode, b, t in steps if mode == "EXTEND" and b == "1") == 40, steps
    assert steps.count(("DECODE", "1", "1")) == 2, steps
    assert httpx.post(server.url + "/stop_profile", timeout=WAIT).status_code == 400  # nothing runs now


def test_num_steps_stops_by_itself(server, tmp_path):
    # num_steps as a string, as SGLang's bench sends it.
    r = httpx.post(server.url + "/start_profile", timeout=WAIT,
                   json={"output_dir": str(tmp_path), "num_steps": "2", "with_stack": False})
    assert r.status_code == 200, r.text
    _generate(server.url, list(range(2000, 2020)), 6)
    # Stopped after 2 steps without a /stop_profile: a new start is accepted (and stopped again).
    r = httpx.post(server.url + "/start_profile", json={"output_dir": str(tmp_path / "b")}, timeout=WAIT)
    assert r.status_code == 200, r.text
    assert httpx.post(server.url + "/stop_profile", timeout=WAIT).status_code == 200
    runs = sorted((tmp_path / "plugins" / "profile").iterdir())
    assert len(runs) == 1
    steps = [n for n in _trace_names(runs[0]) if STEP_NAME.fullmatch(n)]
    assert len(steps) == 2, steps


def test_bad_profile_requests():
    for body, words in (({"activities": ["CUDA_PROFILER"]}, "not supported"), ({"num_steps": 0}, "positive"),
                        ({"num_steps": "x"}, "whole number"), ({"profile_by_stage": True}, "not supported"),
                        ({"bogus": 1}, "unknown")):
        with pytest.raises(ProfileError, match=words):
            ProfileConfig.from_body(body)
    cfg = ProfileConfig.from_body({"activities": [], "start_step": "3", "with_stack": None})
    assert cfg.activities == ["CPU", "GPU"] and cfg.start_step == 3 and cfg.with_stack is True


def test_bench_serving_profile_flag(server, tmp_path):
    # The same step shapes as above (a 40-token prompt, 3 output tokens): nothing new to compile.
    metrics = serving.main(["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "1",
                            "--random-input-len", "40", "--random-output-len", "3", "--random-range-ratio", "1",
                            "--disable-tqdm", "--profile", "--profile-output-dir", str(tmp_path)])
    assert metrics["completed"] == 1
    runs = list(tmp_path.glob("*/plugins/profile/*"))  # one timestamped dir per run, as SGLang's bench makes
    assert len(runs) == 1
    assert any(STEP_NAME.fullmatch(n) for n in _trace_names(runs[0]))
    assert metrics["profile"]["trace"] == str(runs[0])
