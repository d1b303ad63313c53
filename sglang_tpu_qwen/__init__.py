"""sglang-tpu-qwen: an SGLang-compatible serving runtime for the Qwen3.5 MoE family, in JAX."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. for radix_cache or the CLI) must not import JAX.
    if name == "Engine":
        from sglang_tpu_qwen.engine.engine import Engine

        return Engine
    raise AttributeError(name)
