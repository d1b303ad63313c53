"""Block-FP8 weights kept in FP8 in device memory and dequantised per tile inside the matmul.

Format of the Qwen3 / DeepSeek-V3 FP8 releases: a weight is stored as float8_e4m3fn with one float32
scale per 128 x 128 block (``weight_scale_inv``, which multiplies despite its name). Our matrices are
``[in, out]`` (``[E, in, out]`` for expert stacks), so blocks tile the last two dims.

This module holds the weight types only: :class:`Fp8Weight`, the layer view the forward's scan hands the
matmuls (:class:`LayerSlice`), quantisation, dequantisation and abstract specs. The matmuls that multiply
them (``linear``, ``grouped``, ``grouped_swiglu``, ``grouped_scatter_add``) and the choice of kernel for them
belong to the MoE backend (kernels/moe_backend.py, ``--moe-runner-backend``): the Pallas block-FP8 kernel
(kernels/fp8_matmul) or dequantise-then-matmul in XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.fp8_matmul.reference import dequantize_blocks

BLOCK = (128, 128)
# The forward multiplies Fp8Weight leaves directly (kernels/moe_backend.py): the loader keeps them FP8.
FORWARD_CONSUMES_FP8 = True
# Leaves the FP8 releases quantise (linear layers); embeddings, lm_head, router, gates, norms, conv and
# the small GDN a/b projections stay in the compute dtype.
QUANTISED_LEAVES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
    "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down",
    "gate_proj", "up_proj", "down_proj",  # the dense SwiGLU MLP (model/dense_mlp.py)
    "fc",  # the MTP layer's input projection (model/mtp.py)
})  # fmt: skip


@dataclasses.dataclass
class Fp8Weight:
    """A block-quantised matrix (or stack of matrices); a pytree whose leaves are ``q`` and ``scale``.

    Attributes:
        q: ``[..., R, C]`` float8_e4m3fn, our ``[in, out]`` layout.
        scale: ``[..., ceil(R / b0), ceil(C / b1)]`` float32; ``w = q * scale`` blockwise, edge blocks
            partial. (The checkpoint's ``weight_scale_inv``, transposed with the weight.)
        block: ``(b0, b1)`` static: rows x columns of one block in our layout (the checkpoint's
            ``quantization_config.weight_block_size`` reversed, as the matrix is transposed).
    """

    q: Any
    scale: Any
    block: tuple[int, int] = BLOCK

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self) -> Any:
        return self.q.dtype


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["q", "scale"], meta_fields=["block"])


@dataclasses.dataclass
class LayerSlice:
    """Layer ``index`` of a stacked ``[L, ...]`` array, not yet sliced: the forward puts one in
    ``Fp8Weight.q`` inside its layer scan so the FP8 kernel reads the layer in place (XLA copies a
    dynamically sliced operand of a custom call before the call: the whole layer's weight bytes twice)."""

    stack: Any
    index: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.stack.dtype

    def get(self) -> jax.Array:
        """The sliced layer (a copy where XLA cannot fuse the slice into the consumer)."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, keepdims=False)


jax.tree_util.register_dataclass(LayerSlice, data_fields=["stack", "index"], meta_fields=[])


def split_stacked_fp8(layers: Any) -> tuple[Any, list[Any]]:
    """Stacked layer params -> (the tree to scan over, with each :class:`Fp8Weight`'s ``q`` removed; the
    removed ``q`` stacks in flattening order, None for other leaves). See :func:`join_layer_fp8`."""
    flat, treedef = jax.tree.flatten(layers, is_leaf=lambda x: isinstance(x, Fp8Weight))
    stacks = [x.q if isinstance(x, Fp8Weight) else None for x in flat]
    scanned = [Fp8Weight(None, x.scale, x.block) if isinstance(x, Fp8Weight) else x for x in flat]
    return jax.tree.unflatten(treedef, scanned), stacks


def join_layer_fp8(layer: Any, stacks: list[Any], index: Any) -> Any:
    """Inside the scan: one layer's sliced tree + the ``q`` stacks -> the layer's params with each FP8
    ``q`` a :class:`LayerSlice` of its stack at ``index``."""
    flat, treedef = jax.tree.flatten(layer, is_leaf=lambda x: isinstance(x, Fp8Weight))
    out = [Fp8Weight(LayerSlice(q, index), x.scale, x.block) if q is not None else x
           for x, q in zip(flat, stacks, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    *lead, r, c = shape
    return (*lead, -(-r // block[0]), -(-c // block[1]))


def quantize(w: jax.Array, block: tuple[int, int] = BLOCK) -> Fp8Weight:
    """Blockwise absmax quantisation to e4m3 (max 448). ``w``: ``[..., R, C]``; edge blocks may be partial."""
    *lead, r, c = w.shape
    rb, cb = _scale_shape(w.shape, block)[-2:]
    pad = [(0, 0)] * len(lead) + [(0, rb * block[0] - r), (0, cb * block[1] - c)]
    blocks = jnp.pad(w.astype(jnp.float32), pad).reshape(*lead, rb, block[0], cb, block[1])
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    q = (blocks / scale[..., :, None, :, None]).reshape(*lead, rb * block[0], cb * block[1])
    return Fp8Weight(q=q[..., :r, :c].astype(jnp.float8_e4m3fn), scale=scale, block=block)


def dequantize(w: Fp8Weight, dtype: Any) -> jax.Array:
    """``[..., R, C]`` in ``dtype``: each block of ``w.q`` times its scale (a dense copy: tests and CPU)."""
    return dequantize_blocks(w.q, w.scale, w.block, dtype)


def _eligible(name: str) -> bool:
    return name in QUANTISED_LEAVES


def _leaf_name(path: tuple[Any, ...]) -> str:
    return str(getattr(path[-1], "key", "")) if path else ""


def quantize_params(params: Any, block: tuple[int, int] = BLOCK) -> Any:
    """Replace every linear weight of ``QUANTISED_LEAVES`` by an :class:`Fp8Weight` (what ``--quantization
    fp8`` does to a bf16 checkpoint); other leaves are kept."""

    def f(path: tuple[Any, ...], x: jax.Array) -> Any:
        return quantize(x, block) if _eligible(_leaf_name(path)) else x

    return jax.tree_util.tree_map_with_path(f, params)


def fp8_specs(specs: Any, block: tuple[int, int] = BLOCK) -> Any:
    """``ShapeDtypeStruct`` pytree -> the same with eligible leaves as abstract :class:`Fp8Weight`."""

    def f(path: tuple[Any, ...], s: jax.ShapeDtypeStruct) -> Any:
        if not _eligible(_leaf_name(path)):
            return s
        return Fp8Weight(
            q=jax.ShapeDtypeStruct(s.shape, jnp.float8_e4m3fn),
            scale=jax.ShapeDtypeStruct(_scale_shape(s.shape, block), jnp.float32),
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
