"""The MoE backend: which kernel runs the routed experts' grouped matmuls, and the rows it reads and writes.

``MoeBackend(name, interpret)`` is what ``kernels.dispatch.resolve_backends`` returns for
``--moe-runner-backend``. Its methods are the matmuls the model calls with a dense ``[G, K, N]`` expert stack
or a block-FP8 :class:`~sglang_tpu_qwen.quant.fp8.Fp8Weight` (quant/fp8.py):

- ``"pallas"``: an FP8 weight goes to the Pallas block-FP8 grouped matmul (kernels/fp8_matmul/kernel.py),
  which reads each weight tile once as FP8 and scales the partial products per block in VMEM; the gate/up
  projections run in one pass with SwiGLU in its epilogue, and the expert-parallel down projection adds each
  row's product into its token's HBM row in place.
- ``"reference"``: an FP8 weight is dequantised in XLA, then ``jax.lax.ragged_dot`` (the formula of
  kernels/fp8_matmul/reference.py), with the same float32 epilogue.

Dense (bf16 / float32) weights go to ``ragged_dot`` under either, but for the routed experts' FFN at prefill
steps and verify-sized steps under ``pallas`` (:meth:`MoeBackend.ffn`, :func:`ffn_tile_rows`: kernels/grouped_ffn).
A block-FP8 linear layer (the attention, GDN, dense MLP, shared expert and MTP projections) is one group of the
same kernel, so :meth:`MoeBackend.linear` follows the same backend. The layout the backend owns is the row layout
of the token rows its kernels gather from and add into (:meth:`MoeBackend.kernel_rows`). On a non-TPU platform
``pallas`` runs the kernels in Pallas TPU interpret mode (``interpret``; tests on CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
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
from sglang_tpu_qwen.kernels.grouped_ffn import kernel as grouped_ffn_kernel
from sglang_tpu_qwen.quant.fp8 import Fp8Weight, LayerSlice

# Backend names: "pallas" runs FP8 weights in kernels/fp8_matmul; "reference" dequantises them in XLA.
NAMES = ("pallas", "reference")
# Steps of at least this many routed rows an expert on average (2,048 tokens at top-8 over 128 experts) run dense
# experts through kernels/grouped_ffn. On the v5e (35B-A3B's experts over 128, 2026-12-07, bench.grouped_matmul)
# it took 1,654 / 3,230 / 11,004 us at 128 / 256 / 2,048 rows an expert against ragged_dot's 2,035 / 3,271 /
# 12,998 us, but 1,332 against 1,135 us at 4 (64 decode tokens): one grid step an expert costs more than
# ragged_dot when each expert has a few rows (16 to 32 an expert: the small tile below).
FFN_KERNEL_MIN_ROWS_PER_EXPERT = 128
# grouped_ffn's row tile at those steps (128 rows: 1,910 us at 2,048 tokens).
FFN_KERNEL_TILE_ROWS = 256
# Steps of SMALL_MIN to SMALL_MAX rows an expert (a speculative verify of 64 requests x 4 tokens, a decode step of
# 256 requests: 2,048 rows over 128 experts, 16 an expert) run grouped_ffn with a row tile of SMALL_TILE. On the
# v5e (35B-A3B's experts, 2026-12-07, bench.grouped_matmul) at 16 rows an expert: tile 32 1,207 us, tile 16 1,391,
# ragged_dot 1,247; at 4 (64 decode tokens) tile 32 1,136 against ragged_dot's 1,131, so fewer rows keep
# ragged_dot, as do 32 to 128 an expert (not measured).
FFN_KERNEL_SMALL_MIN_ROWS_PER_EXPERT = 16
FFN_KERNEL_SMALL_MAX_ROWS_PER_EXPERT = 32
FFN_KERNEL_SMALL_TILE_ROWS = 32
# Its VMEM blocks must leave a single-device Ironwood's 64 MiB a margin (a mesh's expert-parallel MoE,
# parallel/expert_parallel.py, does not come here): the 397B's experts (24 MiB of weights an expert,
# double-buffered) do not fit and keep the two products.
FFN_KERNEL_MAX_VMEM = 24 << 20


def ffn_tile_rows(rows: int, experts: int, min_rows_per_expert: int = FFN_KERNEL_MIN_ROWS_PER_EXPERT) -> int | None:
    """grouped_ffn's row tile for ``rows`` routed rows over ``experts`` by their mean rows an expert:
    :data:`FFN_KERNEL_TILE_ROWS` from ``min_rows_per_expert``, :data:`FFN_KERNEL_SMALL_TILE_ROWS` from
    :data:`FFN_KERNEL_SMALL_MIN_ROWS_PER_EXPERT` to :data:`FFN_KERNEL_SMALL_MAX_ROWS_PER_EXPERT`, else None (the
    two ``ragged_dot`` products)."""
    mean = rows / max(experts, 1)
    if mean >= min_rows_per_expert:
        return FFN_KERNEL_TILE_ROWS
    if FFN_KERNEL_SMALL_MIN_ROWS_PER_EXPERT <= mean <= FFN_KERNEL_SMALL_MAX_ROWS_PER_EXPERT:
        return FFN_KERNEL_SMALL_TILE_ROWS
    return None


@dataclass(frozen=True)
class MoeBackend:
    """A resolved MoE backend (hashable: static configuration of the jitted step).

    Attributes:
        name: one of :data:`NAMES`.
        interpret: run the Pallas kernels in Pallas TPU interpret mode (a non-TPU platform).
        ffn_kernel_min_rows_per_expert: the fewest routed rows an expert on average (the step's rows over the
            stack's experts) that send a step through kernels/grouped_ffn with the large tile (:meth:`ffn`;
            16 to 32 an expert take the small tile regardless, :func:`ffn_tile_rows`).

    Raises:
        ValueError: an unknown ``name``.
    """

    name: str = "reference"
    interpret: bool = False
    ffn_kernel_min_rows_per_expert: int = FFN_KERNEL_MIN_ROWS_PER_EXPERT

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"unknown MoE backend {self.name!r}; known: {', '.join(NAMES)}")

    @property
    def uses_pallas(self) -> bool:
        """FP8 weights go to the Pallas kernels (else they are dequantised in XLA)."""
        return self.name == "pallas"

    def kernel_rows(self, w: Any, n: int) -> tuple[int, ...]:
        """Trailing shape of the rows :meth:`grouped_scatter_add` adds into and :meth:`grouped_swiglu` gathers
        from (``row_ids``) for weight ``w`` and row width ``n``: ``(n // 128, 128)`` where the Pallas kernel is
        their consumer (an :class:`Fp8Weight` under ``pallas``, 128 dividing n), the layout in which it
        addresses one row per DMA (Mosaic slices HBM only at tile boundaries of the two minor dims); else
        ``(n,)``. ``[R, n]`` and ``[R, n // 128, 128]`` differ in TPU memory: converting between them is a
        relayout, so an array is created in the one its consumer reads."""
        return (n // 128, 128) if self.uses_pallas and isinstance(w, Fp8Weight) and n % 128 == 0 else (n,)

    def grouped(
        self,
        x: jax.Array,
        w: Any,
        group_sizes: jax.Array,
        *,
        out_dtype: Any = None,
        expected_rows: int | None = None,
        zero_tail: bool = True,
    ) -> jax.Array:
        """``jax.lax.ragged_dot(x, w, group_sizes)`` for a dense ``[G, K, N]`` stack or an :class:`Fp8Weight`.

        Args:
            x: ``[M, K]`` rows sorted by group; w: ``[G, K, N]`` dense or FP8; group_sizes: ``[G]`` int32
                (sum <= M).
            out_dtype: result dtype (f32 accumulation either way); default ``x.dtype``.
            expected_rows: the Pallas kernel only, for XLA's cost model: rows the groups are expected to cover
                (default M).
            zero_tail: False: rows past the groups may hold anything (the caller drops them; the kernel then
                skips a pass over the output that zeroes them).

        Returns:
            ``[M, N]`` in ``out_dtype``; rows past ``sum(group_sizes)`` are 0 (``zero_tail``) or undefined.
        """
        out_dtype = out_dtype or x.dtype
        if not isinstance(w, Fp8Weight):
            return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=out_dtype).astype(out_dtype)
        return self._fp8_grouped(x, w, group_sizes, out_dtype, expected_rows, zero_tail)

    def ffn(self, x: jax.Array, w_gate: Any, w_up: Any, w_down: Any, group_sizes: jax.Array, *,
            expected_rows: int | None = None) -> jax.Array:
        """The routed experts' SwiGLU FFN of rows sorted by group: :meth:`grouped` of :meth:`grouped_swiglu`.

        Under ``pallas``, steps of at least ``ffn_kernel_min_rows_per_expert`` rows an expert of dense stacks in
        x's dtype (H a multiple of 128, the blocks within :data:`FFN_KERNEL_MAX_VMEM`) run kernels/grouped_ffn:
        one touched expert a grid step, its weights streamed under the previous expert's products, no ``[M, I]``
        activation in HBM; so do steps of 16 to 32 rows an expert, with a 32-row tile (:func:`ffn_tile_rows`: a
        64-request verify, a 256-request decode step). Other steps (smaller decode steps, short chunks) and
        other weights run the two products.
        The two agree within float32 rounding at float32 (a row's sums in another order; the kernel at
        ``HIGHEST``) and within bf16 rounding at bf16 (the kernel rounds SiLU's product once, the two products
        round the sigmoid too), so a row's MoE output depends on its step's size at the last bits, as the GDN's
        chunked and recurrent forms do: a speculative verify step (k + 1 tokens a request) may cross the small
        tile's bound where a decode step of the same requests does not, so at bf16 their greedy tokens can
        differ at a near-tie (docs/performance.md, "MoE grouped matmul on TPU v5e").

        Args:
            x: ``[M, H]`` rows sorted by group; w_gate, w_up: ``[G, H, I]``; w_down: ``[G, I, H]``, dense or FP8;
                group_sizes: ``[G]`` int32.
            expected_rows: as :meth:`grouped`.

        Returns:
            ``[M, H]`` in x's dtype; rows past the groups undefined under the kernel, 0 otherwise.
        """
        weights = (w_gate, w_up, w_down)
        m, h = x.shape
        tm = ffn_tile_rows(m, group_sizes.shape[0], self.ffn_kernel_min_rows_per_expert)
        if (self.uses_pallas and tm and h % 128 == 0
                and all(not isinstance(w, Fp8Weight) and w.dtype == x.dtype for w in weights)
                and grouped_ffn_kernel.vmem_bytes(h, w_gate.shape[2], x.dtype, tm) <= FFN_KERNEL_MAX_VMEM):
            return grouped_ffn_kernel.grouped_ffn(x, *weights, group_sizes, tm=tm, interpret=self.interpret)
        act = self.grouped_swiglu(x, w_gate, w_up, group_sizes, expected_rows=expected_rows)
        return self.grouped(act, w_down, group_sizes, expected_rows=expected_rows)

    def grouped_swiglu(
        self,
        x: jax.Array,
        w_gate: Any,
        w_up: Any,
        group_sizes: jax.Array,
        row_scale: jax.Array | None = None,
        *,
        row_ids: jax.Array | None = None,
        expected_rows: int | None = None,
        zero_tail: bool = True,
    ) -> jax.Array:
        """An expert's SwiGLU activations ``silu(x @ w_gate) * (x @ w_up)`` per group, times ``row_scale``.

        Dense stacks: two :meth:`grouped` products and the activation in ``x.dtype`` (the model's formula).
        :class:`Fp8Weight` stacks: under ``pallas`` one kernel pass reads each x tile once for both weights and
        applies the activation and the row scale to the float32 accumulators (kernels/fp8_matmul); under
        ``reference`` the same float32 epilogue on XLA's products of the dequantised weights.

        Args:
            x: ``[M, K]`` rows sorted by group; or, with ``row_ids``, the ``[S, *kernel_rows(w_gate, K)]`` rows
                they index (gathered inside the kernel under ``pallas``: no ``[M, K]`` copy is written; by XLA
                otherwise).
            w_gate, w_up: ``[G, K, N]`` (both dense or both FP8); group_sizes: ``[G]`` int32.
            row_scale: ``[M]`` float32 (e.g. routing weights) or None.
            row_ids: ``[M]`` int32 rows of ``x``, or None.
            expected_rows, zero_tail: as :meth:`grouped`.

        Returns:
            ``[M, N]`` in ``x.dtype``; rows past the groups 0 (``zero_tail``) or undefined.
        """
        k_dim = w_gate.shape[-2]
        fp8 = isinstance(w_gate, Fp8Weight)
        if row_ids is not None and not (self.uses_pallas and fp8 and x.shape[1:] == (k_dim // 128, 128)):
            # Gathered in XLA, from either row layout (the kernel gathers 128-lane tiled rows only).
            x, row_ids = x.reshape(x.shape[0], k_dim)[row_ids], None
        if not fp8:
            mm = functools.partial(self.grouped, group_sizes=group_sizes, expected_rows=expected_rows,
                                   zero_tail=zero_tail)
            act = jax.nn.silu(mm(x, w_gate)) * mm(x, w_up)
            return act if row_scale is None else act * row_scale[:, None].astype(act.dtype)
        (qg, layer), (qu, _) = _stack_and_layer(w_gate), _stack_and_layer(w_up)
        if self.uses_pallas:
            return fp8_grouped_swiglu(x, qg, w_gate.scale, qu, w_up.scale, group_sizes, layer, row_scale, row_ids,
                                      block=w_gate.block, interpret=self.interpret, expected_rows=expected_rows,
                                      zero_tail=zero_tail)
        product = functools.partial(_dequantized_ragged_dot, x, group_sizes=group_sizes, layer=layer,
                                    block=w_gate.block, out_dtype=jnp.float32)
        act = jax.nn.silu(product(qg, w_gate.scale)) * product(qu, w_up.scale)
        return (act if row_scale is None else act * row_scale.astype(jnp.float32)[:, None]).astype(x.dtype)

    def grouped_scatter_add(
        self,
        x: jax.Array,
        w: Any,
        group_sizes: jax.Array,
        dest: jax.Array,
        acc: jax.Array | None,
        overwrite: jax.Array | None = None,
        zero_rows: jax.Array | None = None,
        *,
        num_rows: int | None = None,
        expected_rows: int | None = None,
        expected_overwrites: int = 0,
        expected_zero_rows: int = 0,
    ) -> jax.Array:
        """``acc[dest[r]] += grouped(x, w, group_sizes)[r]`` for the rows the groups cover (``=`` where
        ``overwrite[r]``): an expert's down projection summed into its tokens' rows (the MoE combine) without
        an ``[M, N]`` product in between.

        Under ``pallas`` an :class:`Fp8Weight` goes to the kernel, which adds each row's product into its HBM
        row in place (when ``acc`` is in :meth:`kernel_rows` layout); otherwise (and for dense weights) the
        product is computed and scatter-added in XLA. Each product is rounded to ``acc.dtype`` before its add,
        on both paths.

        Args:
            x: ``[M, K]`` rows sorted by group; w: ``[G, K, N]`` dense or FP8; group_sizes: ``[G]`` int32.
            dest: ``[M]`` int32 row of ``acc`` for each x row, distinct within a group.
            acc: ``[R, *kernel_rows(w, N)]`` accumulator, or None for a new one of ``num_rows`` rows in
                ``x.dtype`` whose rows are zero where nothing is added: the kernel writes it without zeroing it
                first (each destination's first row must then be marked in ``overwrite``, and the rows no row
                reaches listed in ``zero_rows``); XLA starts from zeros.
            overwrite: ``[M]`` bool or None, set only on a destination's first covered row (in row order): that
                row's product replaces ``acc[dest[r]]`` and the kernel does not read it (the caller's first
                write into a zeroed row).
            zero_rows: ``[Z]`` int32 or None, with ``acc`` None: the rows no covered row reaches (-1 entries
                skipped), which the kernel zeroes.
            num_rows: R when ``acc`` is None.
            expected_rows, expected_overwrites, expected_zero_rows: the kernel only, for XLA's cost model: rows
                the groups are expected to cover, how many of them overwrite, and real entries of ``zero_rows``.

        Returns:
            The updated ``acc`` (or the new one), ``[R, *kernel_rows(w, N)]``, same dtype.

        Raises:
            ValueError: ``acc`` and ``num_rows`` both None.
        """
        n = w.shape[-1]
        if acc is None:
            if num_rows is None:
                raise ValueError("a new accumulator (acc None) needs num_rows")
            r, acc_shape, acc_dtype = num_rows, (num_rows, *self.kernel_rows(w, n)), x.dtype
        else:
            r, acc_shape, acc_dtype = acc.shape[0], acc.shape, acc.dtype

        def xla(product: jax.Array) -> jax.Array:
            covered = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
            flat = (jnp.zeros(acc_shape, acc_dtype) if acc is None else acc).reshape(r, n)
            if overwrite is not None:  # on first rows only: clearing beforehand equals replacing
                flat = flat.at[jnp.where(covered & overwrite, dest, r)].set(0, mode="drop")
            flat = flat.at[jnp.where(covered, dest, r)].add(product.astype(acc_dtype), mode="drop")
            return flat.reshape(acc_shape)

        if not isinstance(w, Fp8Weight):
            return xla(self.grouped(x, w, group_sizes, out_dtype=acc_dtype, zero_tail=False))
        q, layer = _stack_and_layer(w)
        # The kernel addresses rows of 128-lane tiles only (kernel_rows).
        if self.uses_pallas and acc_shape[1:] == (n // 128, 128):
            return fp8_grouped_matmul_scatter_add(
                x, q, w.scale, group_sizes, dest, acc, layer, overwrite, zero_rows if acc is None else None,
                num_rows=r, block=w.block, interpret=self.interpret, expected_rows=expected_rows,
                expected_overwrites=expected_overwrites, expected_zero_rows=expected_zero_rows)
        return xla(_dequantized_ragged_dot(x, q, w.scale, group_sizes, layer, w.block, acc_dtype))

    def linear(self, x: jax.Array, w: Any) -> jax.Array:
        """``x @ w`` for ``x [..., K]`` and a dense ``[K, N]`` matrix or an :class:`Fp8Weight` (one group of
        :meth:`grouped`; under ``pallas`` with the tiles of ``kernels.fp8_matmul.kernel.linear_tiles``, which
        read the weight the fewest times). Returns ``[..., N]`` in ``x.dtype``."""
        if not isinstance(w, Fp8Weight):
            return x @ w
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        q = LayerSlice(w.q.stack[:, None], w.q.index) if isinstance(w.q, LayerSlice) else w.q[None]
        one = Fp8Weight(q=q, scale=w.scale[None], block=w.block)
        # One group covering every row: nothing past it to zero. Tiles by the fewest HBM bytes (linear_tiles):
        # at a 1024-token prefill one row tile, so each weight is read once instead of once per 128-row tile.
        n = w.shape[-1]
        tiles = linear_tiles(flat.shape[0], k, n, jnp.dtype(x.dtype).itemsize) if self.uses_pallas else None
        out = self._fp8_grouped(flat, one, jnp.full((1,), flat.shape[0], jnp.int32), x.dtype, None,
                                zero_tail=False, tiles=tiles)
        return out.reshape(*lead, n)

    def _fp8_grouped(self, x: jax.Array, w: Fp8Weight, group_sizes: jax.Array, out_dtype: Any,
                     expected_rows: int | None, zero_tail: bool, tiles: dict[str, int] | None = None) -> jax.Array:
        """:meth:`grouped` of an :class:`Fp8Weight`: the kernel (``tiles`` its tm / tk / tn) or XLA."""
        q, layer = _stack_and_layer(w)
        if self.uses_pallas:
            out = fp8_grouped_matmul(x, q, w.scale, group_sizes, layer, block=w.block, interpret=self.interpret,
                                     expected_rows=expected_rows, zero_tail=zero_tail, **(tiles or {}))
        else:
            out = _dequantized_ragged_dot(x, q, w.scale, group_sizes, layer, w.block, out_dtype)
        return out.astype(out_dtype)


def _stack_and_layer(w: Fp8Weight) -> tuple[jax.Array, Any]:
    """(FP8 operand, layer index or None): a LayerSlice's whole stack and its index (the kernel reads that
    layer in place), else ``w.q`` itself."""
    return (w.q.stack, w.q.index) if isinstance(w.q, LayerSlice) else (w.q, None)


def _dequantized_ragged_dot(x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, layer: Any,
                            block: tuple[int, int], out_dtype: Any) -> jax.Array:
    """The reference: layer ``layer`` of the stack ``q`` (or ``q`` when None) dequantised in XLA, then
    ``ragged_dot`` accumulating in ``out_dtype``. ``[M, K]`` x ``[G, K, N]`` -> ``[M, N]`` in ``out_dtype``."""
    if layer is not None:
        q = jax.lax.dynamic_index_in_dim(q, layer, keepdims=False)
    dense = dequantize_blocks(q, scale, block, x.dtype)
    return jax.lax.ragged_dot(x, dense, group_sizes, preferred_element_type=out_dtype)
