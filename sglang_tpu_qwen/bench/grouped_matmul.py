"""Grouped-matmul benchmark: the MoE expert FFN's two grouped matmuls, per implementation, on a TPU.

``python -m sglang_tpu_qwen.bench.grouped_matmul [--iters N] [--small] [--only TEXT]``. Times, per case, the
routed experts' SwiGLU FFN on tokens sorted by expert (``group_sizes [E]``): gate/up ``[M, H] x [E, H, 2I]``,
``silu(gate) * up``, then down ``[M, I] x [E, I, H]``, bf16 weights, M = tokens x top_k assignments of a
random routing (top_k distinct experts per token, uniform), so many experts are empty at 8 decode rows.

Implementations (each case prints every one, or why it did not run):

- ``ragged_dot/model``: ``jax.lax.ragged_dot`` in the model's two-product form (``quant/fp8.grouped_swiglu``'s
  dense path: gate and up as two products of separate ``[E, H, I]`` stacks, then down), what serves the steps
  ``moe_backend.ffn_tile_rows`` leaves to it (under 16 and from 33 to 127 routed rows an expert). The reference.
- ``ragged_dot``: ``jax.lax.ragged_dot`` on one ``[E, H, 2I]`` gate/up stack, then down.
- ``megablox (tm,tk,tn)``: JAX's Pallas grouped matmul (``jax.experimental.pallas.ops.tpu.megablox.gmm``) on
  the same stacks, its ``tiling`` swept (the first entry is its default (128, 128, 128)); one tiling is used
  for both products, tk and tn clamped to each product's K and N.
- ``grouped_ffn tm N``: the project's expert-by-expert kernel (kernels/grouped_ffn: one grid step an expert,
  its three weight blocks pipelined, the rows in tiles of N through gate/up, SwiGLU and down on chip; decode
  cases also with tiles of 16 and 32 rows), on the split stacks; what serves dense experts at steps of at least
  ``FFN_KERNEL_MIN_ROWS_PER_EXPERT`` rows an expert (tm 256) and of 16 to 32 (tm 32).
- ``fp8 kernel``: the project's block-FP8 grouped kernels (kernels/fp8_matmul: gate and up with SwiGLU in one
  pass, then down), on the split stacks quantised per 128 x 128 block; 35B-shaped decode cases only, its
  bytes counted at one byte a weight plus the scales, its output checked with ``FP8_TOLERANCE``.
- ``tokamax ...``: tokamax's Mosaic TPU ragged dot (a megablox descendant) when ``tokamax`` imports: its
  public ``tokamax.ragged_dot(implementation="mosaic")`` with its own heuristic tiling (its default
  (128, 128, 128) at these shapes: its tuned table has none of them), and one fixed tiling with 2 or 3
  input buffers.

Rows for the Pallas kernels are padded to a multiple of tm (512 for tokamax); the row tiles past the groups
are not visited.
Off TPU only the ragged_dot rows run (Pallas would be interpreted, which measures nothing) at the ``--small``
shapes, and the rest say so.

Method. All programs are compiled ahead of time (lowered in this thread, compiled in a thread pool) before
anything is timed; each call runs a compiled executable, once untimed, then ``--iters`` times back to back,
``block_until_ready`` at the end (after each call where an output is over 64 MiB, to bound memory). Backend
compiles inside the timed windows are counted (JAX's compile event) and printed: they should be 0.

Cost model, per case: flops ``2 * M * (H * 2I + I * H)``; bytes: the touched experts' weights (the non-empty
groups of this routing) read once plus the activations read and written once (``M * H`` in, ``M * H`` out:
an ideal kernel's traffic, not counting the gate/up product and the SwiGLU that these implementations
round-trip through HBM). GB/s and TFLOP/s are given as fractions of the chip's ``PEAKS``.

Numerics: every output's valid rows against ``ragged_dot/model``'s: the max abs difference must be at most
``TOLERANCE`` times the reference's max abs (all bf16 products with float32 accumulation; rounding the gate/up
product and the output to bf16 differs by about one bf16 ulp, 2^-8 relative, where summation orders differ).

Memory (one 15.75 GiB v5e chip): the 397B shape's 512 experts hold 12.9 GB of bf16 weights per layer, so the
split stacks (the reference) and the fused stack are held one after the other, never together; its prefill
runs on 128 of the 512 experts with 8,192 tokens x top-10, which keeps the 640 rows per expert of 32,768
tokens over 512 experts (the grouped matmul's MXU regime) in 3.2 GB of weights.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.bench.kernels import PEAKS
from sglang_tpu_qwen.kernels.grouped_ffn.kernel import grouped_ffn
from sglang_tpu_qwen.quant.fp8 import quantize

REFERENCE = "ragged_dot/model"
TOLERANCE = 2.0**-6  # of the reference's max abs value (see the module docstring)
PAD_ROWS = 512  # tokamax's rows are padded to a multiple of this (megablox's to its tm)
_SYNC_EACH_BYTES = 64 * 2**20  # outputs larger than this are waited on after each timed call
FP8_IMPL = "fp8 kernel (project, fp8 weights)"
FP8_BLOCK = 128  # the FP8 rows' quantisation block (the releases' 128 x 128)
FP8_TOLERANCE = 2.0**-3  # of the bf16 reference's max abs: e4m3 keeps 3 mantissa bits (2^-4 relative rounding)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE layer's expert stacks: ``E`` experts of hidden ``H`` and intermediate ``I``, top-k routing."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int

    def expert_bytes(self, itemsize: int = 2) -> int:
        """One expert's gate, up and down weights."""
        return 3 * self.hidden * self.inter * itemsize


@dataclasses.dataclass(frozen=True)
class Case:
    """``tokens`` tokens of ``kind`` (decode rows or prefill tokens) through one layer of ``shape``."""

    shape: Shape
    kind: str
    tokens: int
    note: str = ""

    @property
    def assignments(self) -> int:
        """M: the (token, expert) pairs, the grouped matmuls' rows."""
        return self.tokens * self.shape.top_k

    @property
    def label(self) -> str:
        return f"{self.kind} {self.tokens}"


# Qwen3.5 MoE expert shapes (HF config: hidden_size, moe_intermediate_size, num_experts, num_experts_per_tok).
QWEN35_35B = Shape("35B-A3B, 128 experts (the 35B-shaped cut)", 2048, 512, 128, 8)
QWEN35_35B_256 = Shape("35B-A3B, 256 experts (as released)", 2048, 512, 256, 8)
QWEN35_397B = Shape("397B-A17B, 512 experts", 4096, 1024, 512, 10)
QWEN35_397B_PREFILL = Shape("397B-A17B prefill, 128 of its 512 experts", 4096, 1024, 128, 10)
SMALL = Shape("small", 256, 128, 32, 2)

FP8_SHAPES = (QWEN35_35B, SMALL)  # the FP8 kernel's row: decode cases of these shapes

PREFILL_NOTE = "64 x 512 = 8 x 4,096 tokens"  # both prefill mixes are one 32,768-token grouped matmul


def cases(small: bool) -> list[Case]:
    """The cases run, in order (grouped by shape: each shape's weights are allocated once)."""
    if small:
        return [Case(SMALL, "decode", 8), Case(SMALL, "decode", 64), Case(SMALL, "prefill", 256)]
    decode = [8, 64, 256]
    return ([Case(QWEN35_35B, "decode", rows) for rows in decode]
            + [Case(QWEN35_35B, "prefill", 32768, PREFILL_NOTE), Case(QWEN35_35B, "prefill", 4096, "one chunk"),
               Case(QWEN35_35B, "prefill", 2048, "one serving step at the v5e's default chunk")]
            + [Case(QWEN35_35B_256, "decode", rows) for rows in decode]
            + [Case(QWEN35_35B_256, "prefill", 32768, PREFILL_NOTE)]
            + [Case(QWEN35_397B, "decode", rows) for rows in decode]
            + [Case(QWEN35_397B_PREFILL, "prefill", 8192, "640 rows per expert, as 32,768 tokens over 512")])


def routing(case: Case, seed: int = 0) -> np.ndarray:
    """``group_sizes [E]`` int32 of a random routing: each token's top_k distinct experts drawn uniformly."""
    e, k = case.shape.experts, case.shape.top_k
    rng = np.random.default_rng(seed)
    ids = np.argpartition(rng.random((case.tokens, e), dtype=np.float32), k - 1, axis=1)[:, :k]
    return np.bincount(ids.reshape(-1), minlength=e).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Cost:
    """A case's useful work under its routing."""

    touched: int  # non-empty groups
    weight_bytes: float  # the touched experts' gate, up and down weights, read once
    act_bytes: float  # M x H read and M x H written
    flops: float

    @property
    def nbytes(self) -> float:
        return self.weight_bytes + self.act_bytes


def cost(case: Case, group_sizes: np.ndarray, fp8: bool = False) -> Cost:
    """Bytes and flops of ``case`` under ``group_sizes`` (only non-empty groups' weights count): bf16 weights,
    or with ``fp8`` one byte a weight plus a float32 scale per 128 x 128 block; bf16 activations."""
    s = case.shape
    touched = int(np.count_nonzero(group_sizes))
    m = int(np.sum(group_sizes))
    assert m == case.assignments, (m, case.assignments)
    per_expert = s.expert_bytes(1) + 3 * (s.hidden // FP8_BLOCK) * (s.inter // FP8_BLOCK) * 4 if fp8 \
        else s.expert_bytes(2)
    return Cost(touched=touched, weight_bytes=float(touched * per_expert),
                act_bytes=float(2 * m * s.hidden * 2),
                flops=2.0 * m * (s.hidden * 2 * s.inter + s.inter * s.hidden))


# --- the FFN in each implementation -------------------------------------------------------------------------------


def swiglu_fused(h: jax.Array) -> jax.Array:
    """``silu(gate) * up`` of a ``[M, 2I]`` gate/up product (gate first), in its dtype (the model's formula)."""
    i = h.shape[-1] // 2
    return jax.nn.silu(h[:, :i]) * h[:, i:]


def ffn_model_form(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   group_sizes: jax.Array) -> jax.Array:
    """The model's routed-expert FFN today (``model/moe.py`` -> ``quant/fp8.grouped_swiglu`` / ``grouped`` for
    dense stacks): three ``jax.lax.ragged_dot`` calls with ``preferred_element_type`` the input dtype."""

    def rd(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype).astype(x.dtype)

    return rd(jax.nn.silu(rd(xs, w_gate)) * rd(xs, w_up), w_down)


def ffn_fused(matmul: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]) -> Callable[..., jax.Array]:
    """The FFN over a fused ``[E, H, 2I]`` gate/up stack with ``matmul(x, w, group_sizes) -> [M, N]``."""

    def ffn(xs: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return matmul(swiglu_fused(matmul(xs, w_gate_up, group_sizes)), w_down, group_sizes)

    return ffn


def ragged_dot_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype)


def clamp_tiling(tiling: tuple[int, int, int], k: int, n: int) -> tuple[int, int, int]:
    """``(tm, tk, tn)`` with tk and tn no larger than the product's K and N."""
    tm, tk, tn = tiling
    return tm, min(tk, k), min(tn, n)


def megablox_matmul(tiling: tuple[int, int, int], interpret: bool = False) -> Callable[..., jax.Array]:
    """JAX's megablox ``gmm`` with ``tiling`` clamped to the product, bf16 out (float32 accumulation)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    def matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        # Positional: gmm is a custom_vjp whose static arguments are (preferred_element_type, tiling, ...).
        return gmm(x, w, group_sizes, x.dtype, clamp_tiling(tiling, w.shape[1], w.shape[2]), None, None, False,
                   interpret)

    return matmul


def tokamax_available() -> str | None:
    """None when tokamax's Mosaic TPU ragged dot imports, else why not."""
    try:
        import tokamax  # noqa: F401
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means it is not usable here
        return f"{type(e).__name__}: {e}".splitlines()[0][:160]
    # tokamax logs each autotuning-cache miss (every shape here) with the group sizes in full, through absl.
    logging.getLogger("absl").setLevel(logging.ERROR)
    return None


def tokamax_matmul(tiling: tuple[int, int, int] | None, buffers: int = 2) -> Callable[..., jax.Array]:
    """tokamax's Mosaic TPU ragged dot: its public API with its heuristic tiling (``tiling`` None), else its
    op with ``tiling`` (clamped) and ``buffers`` input buffers."""
    import tokamax
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

    def matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
        if tiling is None:
            return tokamax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype, implementation="mosaic")
        tm, tk_, tn = clamp_tiling(tiling, w.shape[1], w.shape[2])
        op = tk.PallasMosaicTpuRaggedDot(config=tk.Config(tile_m=tm, tile_k=tk_, tile_n=tn,
                                                          input_buffer_count=buffers))
        return op(x, w, group_sizes=group_sizes, preferred_element_type=x.dtype)

    return matmul


def ffn_fp8(interpret: bool = False) -> Callable[..., jax.Array]:
    """The project's block-FP8 grouped kernels (kernels/fp8_matmul, what ``quant/fp8`` runs on TPU for FP8
    weights): gate and up with SwiGLU in one pass, then down; their default tiles."""
    from sglang_tpu_qwen.kernels.fp8_matmul.kernel import fp8_grouped_matmul, fp8_grouped_swiglu

    def ffn(xs: jax.Array, qg: jax.Array, sg: jax.Array, qu: jax.Array, su: jax.Array, qd: jax.Array,
            sd: jax.Array, group_sizes: jax.Array) -> jax.Array:
        act = fp8_grouped_swiglu(xs, qg, sg, qu, su, group_sizes, interpret=interpret)
        return fp8_grouped_matmul(act, qd, sd, group_sizes, interpret=interpret)

    return ffn


@jax.jit
def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[E, K, N]`` -> (float8_e4m3fn ``[E, K, N]``, float32 scales ``[E, K / b, N / b]``) in ``FP8_BLOCK``
    square blocks: the server's own quantisation (``quant.fp8.quantize``, the FP8 releases' format)."""
    w8 = quantize(w, (FP8_BLOCK, FP8_BLOCK))
    return w8.q, w8.scale


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation: ``fn(xs, *weights, group_sizes) -> [rows, H]`` over the ``form`` stacks ("split":
    gate, up, down; "fp8": the split stacks block-quantised, each as (q, scale); "fused": gate_up, down), its
    rows padded to a multiple of ``pad``; or ``skip`` (why not)."""

    name: str
    form: str
    fn: Callable[..., jax.Array] | None
    pad: int = 1
    skip: str = ""


# megablox tilings swept (tm, tk, tn); tk, tn clamped per product. Decode: large weight tiles (few grid steps
# per expert, each one DMA of 1-4 MiB), tm 128-256. Prefill: larger tm for MXU reuse. Every one fits v5e's
# default 16 MiB of scoped VMEM at these shapes (checked by a deviceless compile for v5e).
MEGABLOX_DEFAULT = (128, 128, 128)
DECODE_TILINGS = [(128, 512, 1024), (128, 2048, 1024), (256, 1024, 2048)]
PREFILL_TILINGS = [(512, 1024, 1024), (256, 2048, 1024), (512, 512, 2048), (1024, 512, 1024)]
# A serving step's few rows an expert (~128 at 2,048 tokens of the 35B layout): a row tile past them multiplies
# padding, a tile that straddles two groups runs twice; smaller row tiles waste less of either.
STEP_TILINGS = [(64, 2048, 512), (128, 2048, 512)]
STEP_TOKENS = 2048  # cases of at most this many tokens also sweep STEP_TILINGS
GROUPED_FFN_TILES = (128, 256)  # row tiles of the project's expert-by-expert kernel (kernels/grouped_ffn)
# Decode cases also try small tiles: a decode step's few rows an expert moved a whole 128-row tile in and out per
# expert (a sixth of the expert's 6 MB of weights at the 35B layout), which a 16-row tile does not.
GROUPED_FFN_DECODE_TILES = (16, 32)
TOKAMAX_TILING = {"decode": (128, 2048, 1024), "prefill": (512, 1024, 1024)}


def impls(case: Case, on_tpu: bool) -> list[Impl]:
    """Every implementation of ``case``, reference first (skipped ones say why)."""
    out = [Impl(REFERENCE, "split", ffn_model_form), Impl("ragged_dot", "fused", ffn_fused(ragged_dot_matmul))]
    tilings = [MEGABLOX_DEFAULT] + (DECODE_TILINGS if case.kind == "decode" else PREFILL_TILINGS
                                    + (STEP_TILINGS if case.tokens <= STEP_TOKENS else []))
    not_tpu = "not a TPU: Pallas would run in the interpreter, which measures nothing"
    if not on_tpu:
        out.append(Impl(f"megablox ({len(tilings)} tilings)", "fused", None, skip=not_tpu))
    for t in tilings if on_tpu else []:
        name = f"megablox {t}" + (" default" if t == MEGABLOX_DEFAULT else "")
        out.append(Impl(name, "fused", ffn_fused(megablox_matmul(t)), t[0]))
    for tm in (GROUPED_FFN_DECODE_TILES if case.kind == "decode" else ()) + GROUPED_FFN_TILES:
        name = f"grouped_ffn tm {tm} (project)"
        out.append(Impl(name, "split", functools.partial(grouped_ffn, tm=tm)) if on_tpu
                   else Impl(name, "split", None, skip=not_tpu))
    if case.kind == "decode" and case.shape in FP8_SHAPES:
        out.append(Impl(FP8_IMPL, "fp8", ffn_fp8()) if on_tpu else Impl(FP8_IMPL, "fp8", None, skip=not_tpu))
    why = tokamax_available()
    tk_tiling = TOKAMAX_TILING[case.kind]
    for name, tiling, buffers in [("tokamax heuristic", None, 2), (f"tokamax {tk_tiling} x2", tk_tiling, 2),
                                  (f"tokamax {tk_tiling} x3", tk_tiling, 3)]:
        if why or not on_tpu:
            out.append(Impl(name, "fused", None, skip=f"not importable ({why})" if why else not_tpu))
            break  # one line says why
        out.append(Impl(name, "fused", ffn_fused(tokamax_matmul(tiling, buffers)), PAD_ROWS))
    return out


# --- inputs ------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "col_offset", "cols"))
def fill(seed: jax.Array, scale: jax.Array, *, shape: tuple[int, ...], dtype: Any = jnp.bfloat16, col_offset: int = 0,
         cols: int | None = None) -> jax.Array:
    """Pseudo-random values in ``[-scale, scale)`` hashed on the device from each element's index (one fused
    loop: no host transfer, no temporaries). Element ``[..., c]`` of a fill with ``col_offset`` o equals
    element ``[..., c + o]`` of the same seed's fill over ``cols`` columns: the split gate and up stacks are
    the two halves of the fused gate/up stack."""
    cols = cols or shape[-1]
    nd = len(shape)
    idx = jax.lax.broadcasted_iota(jnp.uint32, shape, nd - 1) + jnp.uint32(col_offset)
    stride = cols
    for d in reversed(range(nd - 1)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    h = idx ^ (seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B9))
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    u = (h >> 8).astype(jnp.float32) * (2.0**-23) - 1.0
    return (u * scale).astype(dtype)


def weights(shape: Shape, form: str) -> dict[str, jax.Array]:
    """The expert stacks of ``form`` (see :class:`Impl`) on the device, bf16 entries ~ 1/sqrt(fan_in); "fp8"
    holds (q, scale) pairs of the "split" stacks."""
    if form == "fp8":
        out: dict[str, Any] = weights(shape, "split")
        for name in ("gate", "up", "down"):
            bf16 = out.pop(name)
            out[name] = quantize_blocks(bf16)
            bf16.delete()
        return out
    h, i, e = shape.hidden, shape.inter, shape.experts
    up_scale, down_scale = np.float32(np.sqrt(3.0 / h)), np.float32(np.sqrt(3.0 / i))
    out = {"down": fill(jnp.uint32(3), down_scale, shape=(e, i, h))}
    if form == "split":
        out["gate"] = fill(jnp.uint32(2), up_scale, shape=(e, h, i), cols=2 * i)
        out["up"] = fill(jnp.uint32(2), up_scale, shape=(e, h, i), col_offset=i, cols=2 * i)
    else:
        out["gate_up"] = fill(jnp.uint32(2), up_scale, shape=(e, h, 2 * i))
    return out


def weight_args(form: str, w: dict[str, Any]) -> tuple[jax.Array, ...]:
    if form == "fp8":
        return (*w["gate"], *w["up"], *w["down"])
    return (w["gate"], w["up"], w["down"]) if form == "split" else (w["gate_up"], w["down"])


def weight_specs(shape: Shape, form: str) -> tuple[jax.ShapeDtypeStruct, ...]:
    h, i, e = shape.hidden, shape.inter, shape.experts
    bf = jnp.bfloat16
    if form == "fp8":
        def pair(k: int, n: int) -> tuple[jax.ShapeDtypeStruct, ...]:
            return (jax.ShapeDtypeStruct((e, k, n), jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((e, k // FP8_BLOCK, n // FP8_BLOCK), jnp.float32))
        return (*pair(h, i), *pair(h, i), *pair(i, h))
    if form == "split":
        return (jax.ShapeDtypeStruct((e, h, i), bf),) * 2 + (jax.ShapeDtypeStruct((e, i, h), bf),)
    return jax.ShapeDtypeStruct((e, h, 2 * i), bf), jax.ShapeDtypeStruct((e, i, h), bf)


def padded_rows(case: Case, pad: int) -> int:
    return -(-case.assignments // pad) * pad


def activations(case: Case, rows: int) -> jax.Array:
    """``xs [rows, H]`` bf16: the sorted token rows (any values: the routing is in ``group_sizes``), rows
    past M zero."""
    m, hdim = case.assignments, case.shape.hidden
    xs = fill(jnp.uint32(1), np.float32(1.0), shape=(m, hdim))
    return xs if rows == m else jnp.pad(xs, ((0, rows - m), (0, 0)))


@functools.partial(jax.jit, static_argnames=("m",))
def max_errors(out: jax.Array, ref: jax.Array, *, m: int) -> tuple[jax.Array, jax.Array]:
    """(max |out - ref|, max |ref|) over the first ``m`` rows, in float32 (NaN if out has a NaN)."""
    a, b = out[:m].astype(jnp.float32), ref[:m].astype(jnp.float32)
    diff = jnp.abs(a - b)
    return jnp.where(jnp.all(jnp.isfinite(a)), jnp.max(diff), jnp.nan), jnp.max(jnp.abs(b))


# --- compile and time --------------------------------------------------------------------------------------------


class CompileCounter:
    """Within the context, counts JAX backend compiles (its ``/jax/core/compile/backend_compile_duration``
    event)."""

    def __init__(self) -> None:
        self.count = 0

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if event.endswith("backend_compile_duration"):
            self.count += 1

    def __enter__(self) -> CompileCounter:
        self._listener = self._on_event
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)


def compile_all(jobs: list[tuple[Any, Callable[..., jax.Array], tuple]], workers: int) -> dict[Any, Any]:
    """``{key: compiled executable or the exception}`` for ``(key, fn, arg specs)``: each lowered here in turn
    and compiled in a pool of ``workers`` threads (XLA and Mosaic compile without the GIL)."""
    out: dict[Any, Any] = {}
    futures = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for key, fn, specs in jobs:
            try:
                lowered = jax.jit(fn).lower(*specs)
            except Exception as e:  # noqa: BLE001 - reported as that implementation's row
                out[key] = e
                continue
            futures[pool.submit(lowered.compile)] = key
        for fut in concurrent.futures.as_completed(futures):
            try:
                out[futures[fut]] = fut.result()
            except Exception as e:  # noqa: BLE001 - reported as that implementation's row (e.g. VMEM OOM)
                out[futures[fut]] = e
    return out


def time_call(fn: Callable[..., jax.Array], args: tuple, iters: int, sync_each: bool,
              counter: CompileCounter) -> tuple[float, jax.Array, int]:
    """(seconds per call, the untimed first call's output, backend compiles during the timed calls): one
    untimed call, then ``iters`` timed."""
    first = fn(*args)
    jax.block_until_ready(first)
    before = counter.count
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
        if sync_each:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters, first, counter.count - before


def why_failed(e: BaseException) -> str:
    """An exception as one short line (its first two lines, at most 220 characters), for a skipped row."""
    text = f"{type(e).__name__}: {e}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " / ".join(lines[:2])[:220]


def rate_columns(secs: float, nbytes: float, flops: float, peaks: tuple[float, float] | None) -> str:
    """A timed call's columns: us, GB/s, TFLOP/s and, with the chip's ``(flops/s, bytes/s)`` peaks, their
    fractions."""
    line = f"{secs * 1e6:>10.1f} us{nbytes / secs / 1e9:>8.1f} GB/s{flops / secs / 1e12:>8.2f} TFLOP/s"
    if peaks:
        line += f"{nbytes / secs / peaks[1]:>7.1%} HBM{flops / secs / peaks[0]:>7.1%} MXU"
    return line


def fmt_row(head: str, secs: float, c: Cost, peaks: tuple[float, float] | None, err: str) -> str:
    return f"{head}{rate_columns(secs, c.nbytes, c.flops, peaks)}  {err}"


def summary_line(case: Case, c: Cost, results: list[tuple[str, float]], peaks: tuple[float, float] | None,
                 c_fp8: Cost) -> str:
    """One case's fastest bf16 implementation, megablox's best tiling and default, the model's form today and
    the FP8 kernel (against its own bytes)."""
    def frac(secs: float, c: Cost = c) -> str:
        return f" ({c.nbytes / secs / peaks[1]:.0%} HBM, {c.flops / secs / peaks[0]:.0%} MXU)" if peaks else ""

    times = dict(results)
    bf16 = [r for r in results if r[0] != FP8_IMPL]
    if not bf16:
        return f"{case.shape.name[:16]:<17}{case.label:<14} no bf16 implementation ran"
    best = min(bf16, key=lambda r: r[1])
    line = f"{case.shape.name[:16]:<17}{case.label:<14} fastest {best[0]} {best[1] * 1e6:.1f} us{frac(best[1])}"
    mb = [r for r in results if r[0].startswith("megablox")]
    if mb:
        mb_best = min(mb, key=lambda r: r[1])
        line += f"; megablox best {mb_best[0][len('megablox '):]} {mb_best[1] * 1e6:.1f} us"
        default = [t for n, t in mb if n.endswith("default")]
        line += f", default {default[0] * 1e6:.1f} us" if default else ""
    if REFERENCE in times:
        line += f"; {REFERENCE} {times[REFERENCE] * 1e6:.1f} us{frac(times[REFERENCE])}"
    if FP8_IMPL in times:
        line += f"; fp8 kernel {times[FP8_IMPL] * 1e6:.1f} us{frac(times[FP8_IMPL], c_fp8)}"
    return line


def main(argv: list[str] | None = None) -> None:
    """Run every case and print one line per (case, implementation), then a summary per case."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="small shapes (default off TPU)")
    ap.add_argument("--only", default="", help="run the cases whose shape name or label contains this text")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="compile threads")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    on_tpu = jax.default_backend() == "tpu"
    small = args.small or not on_tpu
    peaks = PEAKS.get(dev.device_kind) if on_tpu else None
    peak_text = f"{peaks[0] / 1e12:.0f} TFLOP/s, {peaks[1] / 1e9:.0f} GB/s" if peaks else "unknown"
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, bf16 weights, "
          f"peaks {peak_text}; tolerance {TOLERANCE:.4f} x max|ref|"
          + ("" if on_tpu else "; not a TPU: ragged_dot only, small shapes"), flush=True)
    why = tokamax_available()
    print("tokamax: " + (f"not importable ({why})" if why else "importable"), flush=True)
    with CompileCounter() as counter:
        run(args, on_tpu, small, peaks, counter)


def run(args: argparse.Namespace, on_tpu: bool, small: bool, peaks: tuple[float, float] | None,
        counter: CompileCounter) -> None:
    """Compile every case's programs, then time and check them shape by shape; print the rows and a summary."""
    todo = [c for c in cases(small) if args.only in c.shape.name or args.only in c.label]
    plans = {}
    for i, case in enumerate(todo):
        gs = routing(case, seed=case.tokens * 1000 + case.shape.experts)  # the same routing whatever --only picks
        plans[i] = (case, gs, cost(case, gs), impls(case, on_tpu))

    # Compile everything first (in parallel), so that nothing compiles between timed calls.
    t0 = time.perf_counter()
    jobs = []
    for i, (case, _gs, _c, imps) in plans.items():
        for imp in imps:
            if imp.fn is None:
                continue
            xs = jax.ShapeDtypeStruct((padded_rows(case, imp.pad), case.shape.hidden), jnp.bfloat16)
            gs_spec = jax.ShapeDtypeStruct((case.shape.experts,), jnp.int32)
            jobs.append(((i, imp.name), imp.fn, (xs, *weight_specs(case.shape, imp.form), gs_spec)))
    executables = compile_all(jobs, args.workers)
    failed = sum(isinstance(v, BaseException) for v in executables.values())
    print(f"compiled {len(jobs) - failed} programs ({failed} failed) in {time.perf_counter() - t0:.1f} s with "
          f"{args.workers} threads", flush=True)

    timed_compiles = 0
    summary = []
    for shape in dict.fromkeys(case.shape for case, *_ in plans.values()):
        ids = [i for i, p in plans.items() if p[0].shape == shape]
        print(f"== {shape.name}: hidden {shape.hidden}, moe inter {shape.inter}, {shape.experts} experts, "
              f"top-{shape.top_k}", flush=True)
        for i in ids:
            case, _gs, c, _imps = plans[i]
            print(f"-- {case.label} ({case.assignments} rows{', ' + case.note if case.note else ''}): "
                  f"{c.touched} of {shape.experts} experts touched, weights {c.weight_bytes / 1e6:.1f} MB"
                  f" + activations {c.act_bytes / 1e6:.1f} MB, {c.flops / 1e9:.2f} GFLOP", flush=True)
        refs: dict[int, jax.Array] = {}
        results: dict[int, list[tuple[str, float]]] = {i: [] for i in ids}
        # The split stacks (the reference) first, then the fused stack: never both (397B: 12.9 GB each).
        used = {imp.form for i in ids for imp in plans[i][3] if imp.fn is not None}
        forms = [f for f in ("split", "fp8", "fused") if f in used]
        for form in forms:
            w = weights(shape, form)
            for i in ids:
                case, gs, c, imps = plans[i]
                gs_dev = jnp.asarray(gs)
                xs_by_rows: dict[int, jax.Array] = {}
                for imp in imps:
                    head = f"{case.label:<14}{imp.name:<36}"
                    if imp.fn is None:  # said once, in the first phase, whatever its form
                        if form == forms[0]:
                            print(f"{head}skipped: {imp.skip}", flush=True)
                        continue
                    if imp.form != form:
                        continue
                    exe = executables[(i, imp.name)]
                    if isinstance(exe, BaseException):
                        print(f"{head}failed to compile: {why_failed(exe)}", flush=True)
                        continue
                    rows = padded_rows(case, imp.pad)
                    if rows not in xs_by_rows:
                        xs_by_rows[rows] = activations(case, rows)
                    call_args = (xs_by_rows[rows], *weight_args(form, w), gs_dev)
                    try:
                        secs, out, compiles = time_call(exe, call_args, args.iters,
                                                        rows * shape.hidden * 2 > _SYNC_EACH_BYTES, counter)
                    except Exception as e:  # noqa: BLE001 - e.g. out of device memory: reported, not hidden
                        print(f"{head}failed to run: {why_failed(e)}", flush=True)
                        continue
                    timed_compiles += compiles
                    tol = FP8_TOLERANCE if form == "fp8" else TOLERANCE
                    if imp.name == REFERENCE:
                        refs[i] = out
                        err_text = "reference"
                    elif i not in refs:
                        err_text = f"unchecked: {REFERENCE} did not run"
                    else:
                        err, ref_max = (float(v) for v in max_errors(out, refs[i], m=case.assignments))
                        ok = err <= tol * ref_max
                        err_text = (f"max abs err {err:.2e} of max {ref_max:.2f} (tol {tol:.4f}x): "
                                    f"{'ok' if ok else 'MISMATCH'}")
                    del out
                    own = cost(case, gs, fp8=True) if form == "fp8" else c
                    print(fmt_row(head, secs, own, peaks, err_text), flush=True)
                    results[i].append((imp.name, secs))
                xs_by_rows.clear()
            for arr in jax.tree.leaves(w):
                arr.delete()
            del w
        refs.clear()
        for i in ids:
            case, _gs, c, _imps = plans[i]
            if results[i]:
                summary.append(summary_line(case, c, results[i], peaks, cost(case, plans[i][1], fp8=True)))
    print("== summary (time per FFN call; fractions of the chip's peaks)")
    for line in summary:
        print(line)
    print(f"compiles inside timed windows: {timed_compiles}; backend compiles in all: {counter.count}")


if __name__ == "__main__":
    main()
