"""What the engine runs on, logged at startup: JAX's platform, the devices (count and kind), and a loud warning
when a TPU is present but JAX runs on the CPU.

A TPU VM that runs the engine on its CPU serves, but orders of magnitude slower, and nothing else says so: JAX
falls back to the CPU when libtpu is missing (installed without the `tpu` extra) or fails to start, or when
`JAX_PLATFORMS=cpu` is set. `platform_warning` names the cause and the fix. The kernels the runner picked are
logged by the runner ("kernels: attention X, gdn Y").

`gather` reads the facts (JAX's backend and devices, the TPU device files, whether libtpu is importable);
`platform_line` and `platform_warning` are pure functions of them, so tests fake a TPU host.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sglang_tpu_qwen.utils.host_allocator import TPU_DEVICE_FILES, accelerator_device_files

# The device files of a TPU (a subset of host_allocator.ACCELERATOR_DEVICE_FILES: not the GPUs').
TPU_INSTALL_FIX = "pip install -e '.[tpu]' (jax[tpu]==0.10.2: the libtpu matching this JAX)"


@dataclasses.dataclass(frozen=True)
class PlatformFacts:
    """What JAX runs on and what the host has.

    backend: `jax.default_backend()` ("cpu", "tpu", "gpu").
    device_kinds: the `device_kind` of each device the engine uses (one entry per device).
    total_devices: every device of the backend (`jax.device_count()`), >= len(device_kinds).
    tpu_device_files: the TPU device files present (`TPU_DEVICE_FILES`).
    libtpu_installed: whether the `libtpu` module is importable.
    jax_platforms: `$JAX_PLATFORMS` as set ("" when unset).
    versions: distribution name -> version, for jax, jaxlib and libtpu where installed.
    """

    backend: str
    device_kinds: tuple[str, ...]
    total_devices: int
    tpu_device_files: tuple[str, ...]
    libtpu_installed: bool
    jax_platforms: str = ""
    versions: tuple[tuple[str, str], ...] = ()


def _versions() -> tuple[tuple[str, str], ...]:
    found = []
    for name in ("jax", "jaxlib", "libtpu"):
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return tuple(found)


def gather(devices: Sequence[Any] | None = None) -> PlatformFacts:
    """The facts of this process; `devices` are the engine's (default: all of the default backend's).
    Initialises JAX's backends if nothing has yet."""
    import jax

    used = list(devices) if devices is not None else jax.devices()
    return PlatformFacts(
        backend=jax.default_backend(), device_kinds=tuple(str(d.device_kind) for d in used),
        total_devices=jax.device_count(), tpu_device_files=tuple(accelerator_device_files(TPU_DEVICE_FILES)),
        libtpu_installed=importlib.util.find_spec("libtpu") is not None,
        jax_platforms=os.environ.get("JAX_PLATFORMS", "").strip(), versions=_versions())


def platform_line(facts: PlatformFacts) -> str:
    """One log line: "JAX platform tpu: 8 devices (TPU7x); jax 0.10.2, jaxlib 0.10.2, libtpu 0.0.42.1"."""
    n = len(facts.device_kinds)
    count = f"{n} device{'s' if n != 1 else ''}"
    if n != facts.total_devices:
        count += f" of {facts.total_devices}"
    by_kind = Counter(facts.device_kinds)
    kinds = next(iter(by_kind)) if len(by_kind) == 1 else ", ".join(f"{kind} x{k}" for kind, k in by_kind.items())
    versions = ", ".join(f"{name} {version}" for name, version in facts.versions)
    return f"JAX platform {facts.backend}: {count} ({kinds})" + (f"; {versions}" if versions else "")


def platform_warning(facts: PlatformFacts) -> str | None:
    """The warning for a TPU host whose JAX runs on the CPU, naming the cause and the fix; None otherwise."""
    if facts.backend != "cpu" or not facts.tpu_device_files:
        return None
    shown = ", ".join(facts.tpu_device_files[:4]) + (", ..." if len(facts.tpu_device_files) > 4 else "")
    first = facts.jax_platforms.split(",")[0].strip().lower()
    if first and first != "tpu":
        cause = (f"JAX_PLATFORMS={facts.jax_platforms} keeps JAX off the TPU: unset it (or set JAX_PLATFORMS=tpu); "
                 f"without libtpu, install it too: {TPU_INSTALL_FIX}")
    elif not facts.libtpu_installed:
        cause = f"libtpu is not installed (installed without the tpu extra?): {TPU_INSTALL_FIX}"
    else:
        cause = ("libtpu is installed but JAX did not start the TPU: another process may hold it "
                 "(/tmp/libtpu_lockfile), or this libtpu does not match jax; see libtpu's errors above, and "
                 f"reinstall with {TPU_INSTALL_FIX}")
    return (f"A TPU is present ({shown}) but JAX runs on the CPU: every step runs on the host CPU, orders of "
            f"magnitude slower. {cause}")


def log_platform(logger: logging.Logger, devices: Sequence[Any] | None = None) -> PlatformFacts:
    """Log `platform_line` (INFO) and `platform_warning` (WARNING, when there is one); return the facts."""
    facts = gather(devices)
    logger.info(platform_line(facts))
    warning = platform_warning(facts)
    if warning:
        logger.warning(warning)
    return facts
