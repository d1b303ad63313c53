"""Block-FP8 weights kept in FP8 in device memory and dequantised per tile inside the matmul.

Format of the Qwen3 / DeepSeek-V3 FP8 releases: a weight is stored as float8_e4m3fn with one float32
scale per 128 x 128 block (``weight_scale_inv``, which multiplies despite its name). Our matrices are
``[in, out]`` (``[E, in, out]`` for expert stacks), so blocks tile the last two dims.

The model's matmuls go through :func:`linear` (``x @ w``) and :func:`grouped` (``ragged_dot``), which take
a dense array or an :class:`Fp8Weight`. On TPU an FP8 weight goes to the Pallas grouped matmul
(kernels/fp8_matmul), which reads each weight tile once as FP8 and scales the partial products per
block in VMEM; elsewhere (CPU tests) it is dequantised and multiplied in XLA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.fp8_matmul.kernel import (
    fp8_grouped_matmul,
    fp8_grouped_matmul_scatter_add,
    fp8_grouped_swiglu,
    linear_tiles,
)
from sglang_tpu_qwen.kernels.fp8_matmul.reference import dequantize_blocks

BLOCK = (128, 128)
# The forward multiplies Fp8Weight leaves directly (linear / grouped below): the loader keeps them FP8.
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


_INTERPRET = [False]


@contextlib.contextmanager
def interpret_kernels() -> Iterator[None]:
    """Within this context (at trace time), FP8 matmuls run the Pallas kernel in interpret mode on any
    platform: tests of the TPU path on CPU, e.g. through the expert-parallel ``shard_map``."""
    _INTERPRET.append(True)
    try:
        yield
    finally:
        _INTERPRET.pop()


def _stack_and_layer(w: Fp8Weight) -> tuple[jax.Array, Any]:
    """(FP8 operand, layer index or None): a LayerSlice's whole stack and its index (the kernel reads that
    layer in place), else ``w.q`` itself."""
    return (w.q.stack, w.q.index) if isinstance(w.q, LayerSlice) else (w.q, None)


def _dequantized_ragged_dot(x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, layer: Any,
                            block: tuple[int, int], out_dtype: Any) -> jax.Array:
    """Off TPU: layer ``layer`` of the stack ``q`` (or ``q`` when None) dequantised in XLA, then ``ragged_dot``
    accumulating in ``out_dtype``. ``[M, K]`` x ``[G, K, N]`` -> ``[M, N]`` in ``out_dtype``."""
    if layer is not None:
        q = jax.lax.dynamic_index_in_dim(q, layer, keepdims=False)
    dense = dequantize_blocks(q, scale, block, x.dtype)
    return jax.lax.ragged_dot(x, dense, group_sizes, preferred_element_type=out_dtype)


def _fp8_grouped(
    x: jax.Array, w: Fp8Weight, group_sizes: jax.Array, out_dtype: Any, interpret: bool, expected_rows: int | None,
    zero_tail: bool = True, tiles: dict[str, int] | None = None,
) -> jax.Array:
    interpret = interpret or _INTERPRET[-1]
    q, layer = _stack_and_layer(w)

    def tpu(x: jax.Array, q: jax.Array, scale: jax.Array, gs: jax.Array, layer: Any) -> jax.Array:
        return fp8_grouped_matmul(x, q, scale, gs, layer, block=w.block, interpret=interpret,
                                  expected_rows=expected_rows, zero_tail=zero_tail, **(tiles or {})).astype(out_dtype)

    def other(x: jax.Array, q: jax.Array, scale: jax.Array, gs: jax.Array, layer: Any) -> jax.Array:
        return _dequantized_ragged_dot(x, q, scale, gs, layer, w.block, out_dtype).astype(out_dtype)

    if interpret:
        return tpu(x, q, w.scale, group_sizes, layer)
    # Chosen when lowering, by the platform compiled for (the deviceless planner compiles for TPU).
    return jax.lax.platform_dependent(x, q, w.scale, group_sizes, layer, tpu=tpu, default=other)


def grouped(
    x: jax.Array,
    w: Any,
    group_sizes: jax.Array,
    *,
    out_dtype: Any = None,
    interpret: bool = False,
    expected_rows: int | None = None,
    zero_tail: bool = True,
) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` for a dense ``[G, K, N]`` stack or an :class:`Fp8Weight`.

    Args:
        x: ``[M, K]`` rows sorted by group; w: ``[G, K, N]``; group_sizes: ``[G]`` int32 (sum <= M).
        out_dtype: result dtype (f32 accumulation either way); default ``x.dtype``.
        interpret: FP8 only: run the Pallas kernel in interpret mode (CPU tests of the TPU path).
        expected_rows: FP8 only, for XLA's cost model: rows the groups are expected to cover (default M).
        zero_tail: False: rows past the groups may hold anything (the caller drops them; the FP8 kernel
            then skips a pass over the output that zeroes them).

    Returns:
        ``[M, N]``; rows past ``sum(group_sizes)`` are 0 (``zero_tail``) or undefined.
    """
    out_dtype = out_dtype or x.dtype
    if isinstance(w, Fp8Weight):
        return _fp8_grouped(x, w, group_sizes, out_dtype, interpret, expected_rows, zero_tail)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=out_dtype).astype(out_dtype)


def grouped_swiglu(
    x: jax.Array,
    w_gate: Any,
    w_up: Any,
    group_sizes: jax.Array,
    row_scale: jax.Array | None = None,
    *,
    row_ids: jax.Array | None = None,
    interpret: bool = False,
    expected_rows: int | None = None,
    zero_tail: bool = True,
) -> jax.Array:
    """An expert's SwiGLU activations ``silu(x @ w_gate) * (x @ w_up)`` per group, times ``row_scale``.

    Dense stacks: two :func:`grouped` products and the activation in ``x.dtype`` (the model's formula).
    :class:`Fp8Weight` stacks: on TPU one Pallas pass reads each x tile once for both weights and applies
    the activation and the row scale to the float32 accumulators (kernels/fp8_matmul); elsewhere the same
    float32 epilogue on XLA's products of the dequantised weights.

    Args:
        x: ``[M, K]`` rows sorted by group; or, with ``row_ids``, the ``[S, *kernel_rows(w_gate, K)]``
            rows they index (gathered inside the FP8 kernel on TPU: no ``[M, K]`` copy is written).
        w_gate, w_up: ``[G, K, N]`` (both dense or both FP8); group_sizes: ``[G]`` int32.
        row_scale: ``[M]`` float32 (e.g. routing weights) or None.
        row_ids: ``[M]`` int32 rows of ``x``, or None.
        interpret, expected_rows, zero_tail: as :func:`grouped`.

    Returns:
        ``[M, N]`` in ``x.dtype``; rows past the groups 0 (``zero_tail``) or undefined.
    """
    k_dim = w_gate.shape[-2]

    def gather(x: jax.Array, ids: jax.Array) -> jax.Array:  # in XLA, from either row layout
        return x.reshape(x.shape[0], k_dim)[ids]

    if row_ids is not None and not (isinstance(w_gate, Fp8Weight) and x.shape[1:] == (k_dim // 128, 128)):
        x, row_ids = gather(x, row_ids), None  # the kernel gathers 128-lane tiled rows only
    if not isinstance(w_gate, Fp8Weight):
        mm = functools.partial(grouped, group_sizes=group_sizes, expected_rows=expected_rows, zero_tail=zero_tail)
        act = jax.nn.silu(mm(x, w_gate)) * mm(x, w_up)
        return act if row_scale is None else act * row_scale[:, None].astype(act.dtype)
    interpret = interpret or _INTERPRET[-1]
    (qg, layer), (qu, _) = _stack_and_layer(w_gate), _stack_and_layer(w_up)

    def tpu(x: jax.Array, qg: jax.Array, sg: jax.Array, qu: jax.Array, su: jax.Array, gs: jax.Array,
            layer: Any, rs: jax.Array | None, ids: jax.Array | None) -> jax.Array:
        return fp8_grouped_swiglu(x, qg, sg, qu, su, gs, layer, rs, ids, block=w_gate.block, interpret=interpret,
                                  expected_rows=expected_rows, zero_tail=zero_tail)

    def other(x: jax.Array, qg: jax.Array, sg: jax.Array, qu: jax.Array, su: jax.Array, gs: jax.Array,
              layer: Any, rs: jax.Array | None, ids: jax.Array | None) -> jax.Array:
        if ids is not None:
            x = gather(x, ids)
        product = functools.partial(_dequantized_ragged_dot, x, group_sizes=gs, layer=layer, block=w_gate.block,
                                    out_dtype=jnp.float32)
        act = jax.nn.silu(product(qg, sg)) * product(qu, su)
        return (act if rs is None else act * rs.astype(jnp.float32)[:, None]).astype(x.dtype)

    args = (x, qg, w_gate.scale, qu, w_up.scale, group_sizes, layer, row_scale, row_ids)
    if interpret:
        return tpu(*args)
    return jax.lax.platform_dependent(*args, tpu=tpu, default=other)


def kernel_rows(w: Any, n: int) -> tuple[int, ...]:
    """Trailing shape of the rows :func:`grouped_scatter_add` adds into and :func:`grouped_swiglu` gathers
    from (``row_ids``) for weight ``w`` and row width ``n``: ``(n // 128, 128)`` for an :class:`Fp8Weight`
    when 128 divides n, the layout in which the Pallas kernel addresses one row per DMA (Mosaic slices HBM
    only at tile boundaries of the two minor dims), else ``(n,)``. ``[R, n]`` and ``[R, n // 128, 128]``
    differ in TPU memory: converting between them is a relayout, so an array stays in one of them."""
    return (n // 128, 128) if isinstance(w, Fp8Weight) and n % 128 == 0 else (n,)


def grouped_scatter_add(
    x: jax.Array,
    w: Any,
    group_sizes: jax.Array,
    dest: jax.Array,
    acc: jax.Array | None,
    overwrite: jax.Array | None = None,
    zero_rows: jax.Array | None = None,
    *,
    num_rows: int | None = None,
    interpret: bool = False,
    expected_rows: int | None = None,
    expected_overwrites: int = 0,
    expected_zero_rows: int = 0,
) -> jax.Array:
    """``acc[dest[r]] += grouped(x, w, group_sizes)[r]`` for the rows the groups cover (``=`` where
    ``overwrite[r]``): an expert's down projection summed into its tokens' rows (the MoE combine) without an
    ``[M, N]`` product in between.

    On TPU an :class:`Fp8Weight` goes to the Pallas kernel, which adds each row's product into its HBM row
    in place; elsewhere (and for dense weights) the product is computed and scatter-added in XLA. Each
    product is rounded to ``acc.dtype`` before its add, on both paths.

    Args:
        x: ``[M, K]`` rows sorted by group; w: ``[G, K, N]`` dense or FP8; group_sizes: ``[G]`` int32.
        dest: ``[M]`` int32 row of ``acc`` for each x row, distinct within a group.
        acc: ``[R, *kernel_rows(w, N)]`` accumulator, or None for a new one of ``num_rows`` rows in
            ``x.dtype`` whose rows are zero where nothing is added: the FP8 kernel writes it without zeroing
            it first (each destination's first row must then be marked in ``overwrite``, and the rows no row
            reaches listed in ``zero_rows``); elsewhere it starts from zeros.
        overwrite: ``[M]`` bool or None, set only on a destination's first covered row (in row order): that
            row's product replaces ``acc[dest[r]]`` and the FP8 kernel does not read it (the caller's first
            write into a zeroed row).
        zero_rows: ``[Z]`` int32 or None, with ``acc`` None: the rows no covered row reaches (-1 entries
            skipped), which the FP8 kernel zeroes.
        num_rows: R when ``acc`` is None.
        interpret: FP8 only: the Pallas kernel in interpret mode (CPU tests of the TPU path).
        expected_rows, expected_overwrites, expected_zero_rows: FP8 only, for XLA's cost model: rows the
            groups are expected to cover, how many of them overwrite, and real entries of ``zero_rows``.

    Returns:
        The updated ``acc``, same shape and dtype.
    """
    n = w.shape[-1]
    if acc is None:
        if num_rows is None:
            raise ValueError("a new accumulator (acc None) needs num_rows")
        r, acc_shape, acc_dtype = num_rows, (num_rows, *kernel_rows(w, n)), x.dtype
    else:
        r, acc_shape, acc_dtype = acc.shape[0], acc.shape, acc.dtype

    def xla(product: jax.Array, acc: jax.Array) -> jax.Array:
        covered = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
        flat = acc.reshape(r, n)
        if overwrite is not None:  # on first rows only: clearing beforehand equals replacing
            flat = flat.at[jnp.where(covered & overwrite, dest, r)].set(0, mode="drop")
        flat = flat.at[jnp.where(covered, dest, r)].add(product.astype(acc.dtype), mode="drop")
        return flat.reshape(acc.shape)

    def start() -> jax.Array:  # the accumulator to add into off the kernel
        return jnp.zeros(acc_shape, acc_dtype) if acc is None else acc

    if not isinstance(w, Fp8Weight):
        return xla(grouped(x, w, group_sizes, out_dtype=acc_dtype, zero_tail=False), start())
    interpret = interpret or _INTERPRET[-1]
    q, layer = _stack_and_layer(w)

    # The accumulator (when given) is the last argument: platform_dependent takes arrays only.
    def tpu(x: jax.Array, q: jax.Array, scale: jax.Array, gs: jax.Array, dest: jax.Array, layer: Any,
            *acc_in: jax.Array) -> jax.Array:
        return fp8_grouped_matmul_scatter_add(x, q, scale, gs, dest, acc_in[0] if acc_in else None, layer, overwrite,
                                              zero_rows if not acc_in else None, num_rows=r, block=w.block,
                                              interpret=interpret, expected_rows=expected_rows,
                                              expected_overwrites=expected_overwrites,
                                              expected_zero_rows=expected_zero_rows)

    def other(x: jax.Array, q: jax.Array, scale: jax.Array, gs: jax.Array, dest: jax.Array, layer: Any,
              *acc_in: jax.Array) -> jax.Array:
        product = _dequantized_ragged_dot(x, q, scale, gs, layer, w.block, acc_dtype)
        return xla(product, acc_in[0] if acc_in else start())

    args = (x, q, w.scale, group_sizes, dest, layer, *([] if acc is None else [acc]))
    if acc_shape[1:] != (n // 128, 128):
        return other(*args)  # the kernel addresses rows of 128-lane tiles only (kernel_rows)
    if interpret:
        return tpu(*args)
    return jax.lax.platform_dependent(*args, tpu=tpu, default=other)


def linear(x: jax.Array, w: Any, *, interpret: bool = False) -> jax.Array:
    """``x @ w`` for ``x [..., K]`` and a dense ``[K, N]`` matrix or an :class:`Fp8Weight` (one group of
    :func:`grouped`). Returns ``[..., N]`` in ``x.dtype``."""
    if not isinstance(w, Fp8Weight):
        return x @ w
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    q = LayerSlice(w.q.stack[:, None], w.q.index) if isinstance(w.q, LayerSlice) else w.q[None]
    one = Fp8Weight(q=q, scale=w.scale[None], block=w.block)
    # One group covering every row: nothing past it to zero. Tiles by the fewest HBM bytes (linear_tiles):
    # at a 1024-token prefill one row tile, so each weight is read once instead of once per 128-row tile.
    n = w.shape[-1]
    tiles = linear_tiles(flat.shape[0], k, n, jnp.dtype(x.dtype).itemsize)
    out = _fp8_grouped(flat, one, jnp.full((1,), flat.shape[0], jnp.int32), x.dtype, interpret, None, zero_tail=False,
                       tiles=tiles)
    return out.reshape(*lead, n)
