"""sglang-tpu-qwen: an SGLang-compatible serving runtime for the Qwen3.5 MoE family, in JAX."""

from __future__ import annotations

from typing import Any

from sglang_tpu_qwen.utils.host_allocator import configure_host_allocator, quiet_libtpu_without_accelerator

__all__ = ["Engine"]

# Before anything imports JAX: XLA:CPU's threads pick their malloc arena on their first allocation.
configure_host_allocator()
# Before anything loads libtpu: on a host without a TPU its TPU VM lookups would print errors that look fatal.
quiet_libtpu_without_accelerator()


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. for radix_cache or the CLI) must not import JAX.
    if name == "Engine":
        from sglang_tpu_qwen.engine.engine import Engine

        return Engine
    raise AttributeError(name)
