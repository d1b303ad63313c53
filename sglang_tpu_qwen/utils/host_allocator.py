"""Keep freed host memory in the process, so XLA:CPU's per-step buffers do not page-fault every step.

XLA:CPU allocates each program's temporaries and results with the C library's `malloc` on every
execution. glibc serves blocks above 32 MB (and blocks of its per-thread arenas that do not fit their
64 MB heaps) with a fresh `mmap` and returns them with `munmap` on free, so every step's large buffers
(the [B, V] float32 logits of a sampling step are 32 MB at B = 32 for Qwen3.5's vocabulary) are
faulted in page by page again on every step. Measured on the 2-core CPU (`x * 2` over a 32 MB array,
one fresh result per call): 8,193 minor page faults and 11 ms per call, 1.7 ms with the settings below;
the 128-row bfloat16 lm_head screen 58 -> 18 ms.

`configure_host_allocator` sets glibc's own knobs (`mallopt`, the documented interface for this):
no mmap for large blocks (M_MMAP_MAX = 0), no trimming of the heap top (M_TRIM_THRESHOLD 2 GiB - 1),
and one arena for all threads (M_ARENA_MAX = 1; large blocks from a per-thread arena would still be
mmapped). The cost: host memory freed by the process is kept for reuse instead of being returned to the
OS (the resident size stays at its peak). It must run before JAX starts its CPU client, whose threads
pick their arena when they first allocate; the package's `__init__` calls it on first import.

Only on a CPU-only host (`JAX_PLATFORMS` starting with `cpu`, or no TPU/GPU device files): on a TPU or
GPU host the step's buffers live in device memory, and one arena would make the host threads (scheduler,
HTTP server, the runtime's own) wait on one lock for nothing. Costs measured on the CPU: a batch-1
decode step is ~10% slower (the scheduler thread and XLA's threads share the arena's lock), and, why it
is opt-in (`SGLANG_TPU_QWEN_KEEP_HOST_MEMORY=1`), the one arena also serialises XLA's compiler
threads: `launch/serve.sh`'s cold start (54 programs compiled) took 106 s with the settings against 56-74 s
without (two runs; same machine, same hour). Not glibc (musl, macOS): nothing changes.
A library allocator (jemalloc, tcmalloc) would do the same by `LD_PRELOAD`, but it is a system
package the project cannot install with pip; glibc's settings need nothing installed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform

OPT_IN_ENV = "SGLANG_TPU_QWEN_KEEP_HOST_MEMORY"

# mallopt parameters (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int

_configured: bool | None = None

# Device files of the accelerators JAX would use instead of the CPU (TPU VMs: accel or vfio; NVIDIA GPUs).
ACCELERATOR_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")
TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # a TPU VM's chips


# libtpu's environment on a TPU VM (the VM's metadata sets them). Unset, libtpu looks them up on any host it
# initialises on and, finding none, prints "could not determine TPU accelerator type" and "unexpected worker
# hostname". Any type libtpu knows will do on a host without a TPU: the planner's deviceless topology comes from
# its --topology name (a qwen3.5-0.8b decode plan on tpu7x:2x2x1 came out byte-identical with and without
# these, with v5litepod-1 or tpu7x-8, compile time aside).
QUIET_LIBTPU_ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost"}


def accelerator_device_files(patterns: tuple[str, ...] = ACCELERATOR_DEVICE_FILES) -> list[str]:
    """The accelerator device files present on this host (a TPU's /dev/accelN or /dev/vfio/N, /dev/nvidiaN)."""
    return sorted(path for pattern in patterns for path in glob.glob(pattern))


def cpu_only_host() -> bool:
    """Whether JAX will run on the CPU: JAX_PLATFORMS names cpu first, or (unset) no accelerator device
    file exists. Checked without initialising JAX (the settings must precede its client's threads)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not accelerator_device_files()


def quiet_libtpu_without_accelerator() -> list[str]:
    """On a host with no accelerator device file, default libtpu's TPU VM variables (`QUIET_LIBTPU_ENV`) so
    that loading it (JAX choosing a backend, the planner's deviceless topology) prints nothing.

    The package's `__init__` calls it, before anything loads libtpu. Only `os.environ.setdefault`: a value
    the user set wins. Never on a host with a device file (a TPU VM sets its own; a GPU host does not load
    libtpu for its devices). Returns the names it set.
    """
    if accelerator_device_files():
        return []
    names = [name for name in QUIET_LIBTPU_ENV if name not in os.environ]
    for name in names:
        os.environ[name] = QUIET_LIBTPU_ENV[name]
    return names


def configure_host_allocator() -> bool:
    """Apply the settings above once per process.

    Returns True when glibc accepted all three settings (now or on an earlier call), False when nothing
    was changed (the opt-in variable is not 1, not Linux/glibc, not a CPU-only host, or mallopt refused).
    Never raises.
    """
    global _configured
    if _configured is not None:
        return _configured
    _configured = False
    if (os.environ.get(OPT_IN_ENV) != "1" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
            or not cpu_only_host()):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    results = [mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), mallopt(M_ARENA_MAX, 1)]
    _configured = all(r == 1 for r in results)  # mallopt returns 1 on success
    return _configured


def host_memory_kept() -> bool:
    """Whether the settings are in effect in this process (configure_host_allocator ran and glibc took them)."""
    return _configured is True


def run_jax_on_cpu_without_accelerator() -> bool:
    """For entry points (server, benchmarks), before anything imports JAX: on a host with no accelerator
    device file and `JAX_PLATFORMS` unset, set `JAX_PLATFORMS=cpu`.

    Why: the project installs libtpu (jax[tpu]) for the planner's deviceless TPU compiles, and JAX, left to
    choose, initialises it on any host: on a CPU machine that logs errors that look fatal ("could not determine
    TPU accelerator type", "unexpected worker hostname") and takes libtpu's lockfile, so a planner started
    while a CPU server runs fails. Returns True when it set the variable; a non-empty `JAX_PLATFORMS` is left
    alone.
    """
    if os.environ.get("JAX_PLATFORMS", "").strip() or not cpu_only_host():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    return True
