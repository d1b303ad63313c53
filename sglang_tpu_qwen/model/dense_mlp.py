"""Dense SwiGLU MLP of the dense Qwen3.5 models (and of Qwen3-Next's ``mlp_only_layers``).

Math follows HF ``Qwen3_5MLP`` / ``Qwen3NextMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.
"""

from __future__ import annotations

from typing import Any

import jax

from sglang_tpu_qwen.kernels.moe_backend import MoeBackend


def dense_mlp(p: dict[str, Any], x: jax.Array, matmul: MoeBackend | None = None) -> jax.Array:
    """SwiGLU MLP.

    Args:
        p: ``{"gate_proj" [H, I], "up_proj" [H, I], "down_proj" [I, H]}`` (docs/internals.md), each dense or a
            :class:`quant.fp8.Fp8Weight` (block FP8, dequantised per tile in the matmul).
        x: ``[..., H]`` normalised hidden states.
        matmul: runs the projections (``MoeBackend.linear``, kernels/moe_backend.py); None: the reference.

    Returns:
        ``[..., H]`` in ``x.dtype``.
    """
    linear = (matmul or MoeBackend()).linear
    return linear(jax.nn.silu(linear(x, p["gate_proj"])) * linear(x, p["up_proj"]), p["down_proj"])
