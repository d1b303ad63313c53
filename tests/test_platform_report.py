"""The startup platform report (engine/platform_report.py) and libtpu's quiet defaults on a CPU-only host
(utils/host_allocator.quiet_libtpu_without_accelerator): a TPU host is faked (device files, backend), none needed."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import pytest

from sglang_tpu_qwen.engine import platform_report
from sglang_tpu_qwen.engine.platform_report import PlatformFacts, platform_line, platform_warning
from sglang_tpu_qwen.utils import host_allocator

TPU_HOST_ON_CPU = PlatformFacts(backend="cpu", device_kinds=("cpu",), total_devices=1,
                                tpu_device_files=("/dev/vfio/0", "/dev/vfio/1"), libtpu_installed=False)


def test_line_names_platform_devices_and_versions() -> None:
    facts = PlatformFacts(backend="tpu", device_kinds=("TPU7x",) * 8, total_devices=8,
                          tpu_device_files=("/dev/vfio/0",), libtpu_installed=True,
                          versions=(("jax", "0.10.2"), ("libtpu", "0.0.42.1")))
    assert platform_line(facts) == "JAX platform tpu: 8 devices (TPU7x); jax 0.10.2, libtpu 0.0.42.1"
    half = dataclasses.replace(facts, device_kinds=("TPU7x",) * 4, versions=())
    assert platform_line(half) == "JAX platform tpu: 4 devices of 8 (TPU7x)"
    assert platform_line(TPU_HOST_ON_CPU) == "JAX platform cpu: 1 device (cpu)"
    assert platform_warning(facts) is None  # on the TPU: nothing to warn about


def test_tpu_present_but_jax_on_cpu_warns_with_the_fix() -> None:
    # libtpu missing (installed without the extra): the fix is the tpu extra.
    warning = platform_warning(TPU_HOST_ON_CPU)
    assert warning is not None
    assert "TPU is present (/dev/vfio/0, /dev/vfio/1) but JAX runs on the CPU" in warning
    assert "libtpu is not installed" in warning and "'.[tpu]'" in warning
    # JAX_PLATFORMS=cpu forced: that variable is the cause.
    forced = platform_warning(dataclasses.replace(TPU_HOST_ON_CPU, libtpu_installed=True, jax_platforms="cpu"))
    assert forced is not None and "JAX_PLATFORMS=cpu keeps JAX off the TPU" in forced
    # libtpu installed, nothing forced, still the CPU: libtpu failed to start.
    failed = platform_warning(dataclasses.replace(TPU_HOST_ON_CPU, libtpu_installed=True))
    assert failed is not None and "did not start the TPU" in failed and "'.[tpu]'" in failed
    # No TPU device file (a CPU machine, or a GPU host): JAX on the CPU is expected.
    assert platform_warning(dataclasses.replace(TPU_HOST_ON_CPU, tpu_device_files=())) is None


def test_log_platform_warns_on_a_faked_tpu_host(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    # Fake a TPU host whose JAX runs on the CPU: the TPU's device files, a missing libtpu, the cpu backend.
    monkeypatch.setattr(host_allocator.glob, "glob", lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(platform_report.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # an earlier entry point in this process may have set it
    logger = logging.getLogger("test_platform_report")
    with caplog.at_level(logging.INFO, logger="test_platform_report"):
        facts = platform_report.log_platform(logger)
    assert facts.backend == "cpu" and facts.tpu_device_files == ("/dev/accel0",)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert infos and infos[0].startswith("JAX platform cpu: ")
    assert len(warnings) == 1 and "libtpu is not installed" in warnings[0] and "'.[tpu]'" in warnings[0]


def test_libtpu_defaults_only_without_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in host_allocator.QUIET_LIBTPU_ENV:
        monkeypatch.delenv(name, raising=False)
    # A TPU VM (or a GPU host): never touched.
    monkeypatch.setattr(host_allocator.glob, "glob", lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    assert host_allocator.quiet_libtpu_without_accelerator() == []
    assert not any(name in os.environ for name in host_allocator.QUIET_LIBTPU_ENV)
    # A CPU-only host: defaults, and a value the user set wins.
    monkeypatch.setattr(host_allocator.glob, "glob", lambda pattern: [])
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-1")
    assert host_allocator.quiet_libtpu_without_accelerator() == ["TPU_WORKER_HOSTNAMES"]
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-1" and os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
