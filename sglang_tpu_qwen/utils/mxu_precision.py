"""The precision a Pallas kernel names for its MXU products, by operand dtype.

float32 operands take ``HIGHEST`` (six bfloat16 passes: float32 products; one pass would round them to
bfloat16, ~1e-2 off the reference on the chip). bfloat16 (and narrower) operands take ``DEFAULT``: one pass,
whose products are exact in the float32 accumulator. Named rather than left ``None``: ``None`` follows
``jax_default_matmul_precision``, and under ``highest`` (the TPU suite's engines, tests/tpu/suite.py) Mosaic is
asked for fp32 contract precision on bfloat16 operands, which it refuses ("Bad lhs type").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
ONE_PASS = jax.lax.Precision.DEFAULT


def operand_precision(dtype) -> jax.lax.Precision:
    """``HIGHEST`` for float32 operands, ``DEFAULT`` (one exact pass) for any narrower dtype."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else ONE_PASS
