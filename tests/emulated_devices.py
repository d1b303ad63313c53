"""Run a snippet in a fresh Python process that sees ``n`` emulated CPU devices.

JAX fixes its device count when it first starts, so a test that needs a 4-device mesh while the rest of
the session has one runs its serving code in a child process (``--xla_force_host_platform_device_count``)
and reads back one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent


def run_on_devices(code: str, devices: int) -> Any:
    """Run ``code`` (Python that prints ``'RESULT ' + json.dumps(value)``; ``tests/`` is on its path) with
    ``devices`` emulated CPU devices and return ``value``.

    Raises:
        AssertionError: the child failed or printed no result (its output tails in the message).
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + (
        f" --xla_force_host_platform_device_count={devices} --xla_cpu_use_xnnpack=false"
        " --xla_cpu_enable_concurrency_optimized_scheduler=false"))
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); " + code], env=env,
                          capture_output=True, text=True, timeout=900, cwd=_ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])
