"""Block-FP8 weights kept in FP8 in device memory and dequantised right before the matmul.

Format of the Qwen3 / DeepSeek-V3 FP8 releases: a weight is stored as float8_e4m3fn with one float32
scale per 128 x 128 block (``weight_scale_inv``, which multiplies despite its name). Our matrices are
``[in, out]`` (``[E, in, out]`` for expert stacks), so blocks tile the last two dims.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

BLOCK = (128, 128)
# Leaves the FP8 releases quantise (linear layers); embeddings, lm_head, router, gates, norms, conv and
# the small GDN a/b projections stay in the compute dtype.
QUANTISED_LEAVES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
    "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down",
})  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Weight:
    """A block-quantised matrix (or stack of matrices).

    Attributes:
        q: ``[..., R, C]`` float8_e4m3fn.
        scale: ``[..., ceil(R / block[0]), ceil(C / block[1])]`` float32; ``w = q * scale`` blockwise (the
            last block of a row or column may be partial).
        block: static (not a pytree child): the block size ``[rows, cols]`` in this ``[in, out]`` layout,
            the checkpoint's ``weight_block_size`` transposed (128 x 128 for the Qwen releases).
    """

    q: Any
    scale: Any
    block: tuple[int, int] = dataclasses.field(default=BLOCK, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)


def quantize(w: jax.Array, block: tuple[int, int] = BLOCK) -> Fp8Weight:
    """Blockwise absmax quantisation to e4m3 (max 448). ``w``: ``[..., R, C]`` with R, C multiples of block."""
    *lead, r, c = w.shape
    blocks = w.astype(jnp.float32).reshape(*lead, r // block[0], block[0], c // block[1], block[1])
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    q = (blocks / scale[..., :, None, :, None]).reshape(w.shape).astype(jnp.float8_e4m3fn)
    return Fp8Weight(q=q, scale=scale, block=block)


def dequantize(w: Fp8Weight, dtype: Any, block: tuple[int, int] | None = None) -> jax.Array:
    """``[..., R, C]`` in ``dtype``: each block of ``w.q`` times its scale (partial edge blocks included).

    ``block`` defaults to ``w.block``."""
    b0, b1 = w.block if block is None else block
    s = jnp.repeat(jnp.repeat(w.scale.astype(jnp.float32), b0, axis=-2), b1, axis=-1)
    r, c = w.q.shape[-2:]
    return (w.q.astype(jnp.float32) * s[..., :r, :c]).astype(dtype)


def _eligible(name: str, shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    return name in QUANTISED_LEAVES and shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0


def _leaf_name(path: tuple[Any, ...]) -> str:
    return str(getattr(path[-1], "key", "")) if path else ""


def quantize_params(params: Any, block: tuple[int, int] = BLOCK) -> Any:
    """Replace every eligible linear weight (``QUANTISED_LEAVES``, dims divisible by the block) by an
    :class:`Fp8Weight`; other leaves are kept."""

    def f(path: tuple[Any, ...], x: jax.Array) -> Any:
        return quantize(x, block) if _eligible(_leaf_name(path), x.shape, block) else x

    return jax.tree_util.tree_map_with_path(f, params)


def fp8_specs(specs: Any, block: tuple[int, int] = BLOCK) -> Any:
    """``ShapeDtypeStruct`` pytree -> the same with eligible leaves as abstract :class:`Fp8Weight`."""

    def f(path: tuple[Any, ...], s: jax.ShapeDtypeStruct) -> Any:
        if not _eligible(_leaf_name(path), s.shape, block):
            return s
        *lead, r, c = s.shape
        return Fp8Weight(
            q=jax.ShapeDtypeStruct(s.shape, jnp.float8_e4m3fn),
            scale=jax.ShapeDtypeStruct((*lead, -(-r // block[0]), -(-c // block[1])), jnp.float32),
            block=block,
        )

    return jax.tree_util.tree_map_with_path(f, specs)


def dequantize_tree(tree: Any, dtype: Any) -> Any:
    """Every :class:`Fp8Weight` in ``tree`` -> a dense array in ``dtype``; other leaves unchanged."""
    return jax.tree.map(
        lambda x: dequantize(x, dtype) if isinstance(x, Fp8Weight) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Fp8Weight),
    )
