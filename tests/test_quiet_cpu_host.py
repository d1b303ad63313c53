"""No libtpu noise on a CPU machine: with libtpu installed (the test extra), the planner and a plain Engine start
print none of libtpu's TPU VM lookup errors (the package's `__init__` defaults TPU_ACCELERATOR_TYPE and
TPU_WORKER_HOSTNAMES on a host without accelerator device files: utils/host_allocator.py), and the Engine logs
its platform line. Fresh processes, since libtpu reads its environment once, when it loads."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import ENGINE_KWARGS

from sglang_tpu_qwen.utils import host_allocator

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed: nothing to hush"),
    pytest.mark.skipif(bool(host_allocator.accelerator_device_files()), reason="a host with an accelerator"),
]

NOISE = ("Failed to find host bounds", "unexpected worker hostname", "could not determine TPU")

ENGINE_START = f"""
import logging
logging.basicConfig(level=logging.INFO)
from sglang_tpu_qwen import Engine
engine = Engine(**{dict(ENGINE_KWARGS, max_running_requests=1, enable_metrics=False, grammar_backend="none")!r})
engine.shutdown()
"""


def _fresh_env() -> dict[str, str]:
    """This environment without the variables the fix sets or that would keep JAX off libtpu."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "XLA_FLAGS", *host_allocator.QUIET_LIBTPU_ENV)}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # other processes (tests, tools) may hold libtpu's lockfile
    return env


def _run(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, *args], env=_fresh_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for noise in NOISE:
        assert noise not in proc.stderr, proc.stderr[-4000:]
    return proc.stderr


def test_planner_is_quiet() -> None:
    # The smallest compile that loads libtpu for a deviceless tpu7x topology: a dense 0.8B model's decode step.
    _run(["-m", "sglang_tpu_qwen.tools.plan", "--model-config", "qwen3.5-0.8b", "--topology", "tpu7x:2x2x1",
          "--dp", "8", "--ep", "8", "--max-running-requests", "8", "--context-length", "1024", "--steps", "decode"])


def test_engine_start_is_quiet_and_logs_its_platform() -> None:
    stderr = _run(["-c", ENGINE_START])
    assert "JAX platform cpu: 1 device (cpu)" in stderr, stderr[-4000:]
    assert "TPU is present" not in stderr  # no device file here: JAX on the CPU is expected
