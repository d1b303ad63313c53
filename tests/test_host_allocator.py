"""The host allocator settings (sglang_tpu_qwen/utils/host_allocator.py): a CPU step's large buffers are reused
instead of being faulted in page by page on every call. Counted in minor page faults, not timed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang_tpu_qwen.utils import host_allocator

# A fresh process per setting: glibc's settings and XLA's threads are per process. The 64 MiB result
# is above glibc's largest mmap threshold (32 MiB), so by default every call maps fresh pages.
PROBE = """
import resource, sys
import sglang_tpu_qwen
from sglang_tpu_qwen.utils import host_allocator
import jax, jax.numpy as jnp
x = jnp.ones(16 * 1024 * 1024, jnp.float32)
f = jax.jit(lambda x: x * 2.0)
def call():
    y = f(x)
    y.block_until_ready()
    y.delete()  # freed now, not whenever the runtime gets to it
for _ in range(10):
    call()
faults = []
for _ in range(40):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    call()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(host_allocator.configure_host_allocator(), min(faults))
"""


def _probe(**env: str) -> tuple[bool, float]:
    """(settings applied, fewest minor page faults of one call over 40 calls)."""
    full = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    configured, faults = out.stdout.split()[-2:]
    return configured == "True", float(faults)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc settings")
def test_large_step_buffers_stop_faulting() -> None:
    configured, faults = _probe(**{host_allocator.OPT_IN_ENV: "1"})
    assert configured
    default_configured, default_faults = _probe(**{host_allocator.OPT_IN_ENV: "0"})
    assert not default_configured
    pages = 64 * 1024 * 1024 // 4096
    # Default glibc: the 16,384 pages of each fresh result are faulted in again on every call. With the
    # settings calls reuse freed memory; a call faults the whole result only where the heap grew, because
    # XLA's threads carved small blocks out of the freed one between two calls. How often that happens
    # depends on the load: on a loaded 2-core machine up to 10 calls in a row grew the heap, after 3
    # warm-up calls; with 10 warm-up calls, 0 to 3 of 40 calls did (six runs, three busy loops beside).
    assert default_faults > pages / 2, default_faults
    assert faults < pages / 20, faults


def test_cpu_only_host_follows_jax_platforms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_allocator.cpu_only_host()
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    assert not host_allocator.cpu_only_host()
    monkeypatch.setenv("JAX_PLATFORMS", "")
    monkeypatch.setattr(host_allocator.glob, "glob", lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    assert not host_allocator.cpu_only_host()
    monkeypatch.setattr(host_allocator.glob, "glob", lambda pattern: [])
    assert host_allocator.cpu_only_host()


def test_entry_points_pick_the_cpu_only_without_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert not host_allocator.run_jax_on_cpu_without_accelerator()
    assert os.environ["JAX_PLATFORMS"] == "tpu"  # the user's choice stands
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(host_allocator.glob, "glob", lambda pattern: ["/dev/vfio/0"] if "vfio" in pattern else [])
    assert not host_allocator.run_jax_on_cpu_without_accelerator()
    assert "JAX_PLATFORMS" not in os.environ  # a TPU host: JAX chooses
    monkeypatch.setattr(host_allocator.glob, "glob", lambda pattern: [])
    assert host_allocator.run_jax_on_cpu_without_accelerator()
    assert os.environ["JAX_PLATFORMS"] == "cpu"
