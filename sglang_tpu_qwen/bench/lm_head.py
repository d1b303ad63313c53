"""Greedy lm_head benchmark: the vocabulary product and its argmax, by weight layout and kernel, on a TPU.

``python -m sglang_tpu_qwen.bench.lm_head [--rows 1,8,64,256] [--hidden 2048] [--vocab 248320] [--iters N]``.
Every greedy decode step, every MTP draft and a verify step's sampling read the whole lm_head once: on the v5e
the 35B-shaped checkpoint's 1.02 GB of it took 1.53 ms at 64 rows (81% of HBM peak; the 64-row MTP cycle has
four of them, 6.2 of its 19.1 ms) where the MoE's ``ragged_dot`` reads its experts at 84-88%. Implementations
(one line each per row count, or why it did not run):

- ``[V, H] served``: ``model.forward.compute_logits`` then ``sampler.greedy_ids`` on the HF layout, what the
  sampling program and the drafts run (XLA fuses the argmax into the product). The reference.
- ``[H, V]``: the same product and argmax on the transposed weight (the vocabulary on lanes).
- ``[V, H] logits`` / ``[H, V] logits``: the products alone, float32 logits written out.
- ``pallas tv N``: a Pallas kernel (:func:`greedy_lm_head`) streaming the ``[V, H]`` weight in blocks of N
  vocabulary rows (double-buffered: this JAX's TPU pipeline takes no deeper buffering) through the MXU, keeping
  each row's running maximum and its id on chip: the weight is the only large read and nothing is written back
  but the ids.

Rows are padded to a multiple of 8 (the float32 sublane tile) for the kernel; hidden states are random normal,
weights random normal scaled by ``H^-0.5``. Cost per call: the weight read once plus the hidden rows (and the
``[N, V]`` float32 logits written, for the logits-only lines); flops ``2 N H V``; GB/s and TFLOP/s as fractions
of the chip's peaks (``bench.kernels.PEAKS``).

Method: every program compiled ahead of time (``bench.grouped_matmul.compile_all``), then each timed as one
untimed call and ``--iters`` back to back (``grouped_matmul.time_call``); backend compiles inside the timed windows
are counted and printed (0 expected). Numerics: a row's id must reach the served float32 logits' maximum within
``TOLERANCE`` times the row's largest absolute logit (summation orders differ between the forms, so a near-tie may
pick another id of the same value); the line prints the rows that do not, and the ids that differ from the
served ones.

Off a TPU the kernel runs in Pallas interpret mode at ``--small`` shapes (a check of the harness and the kernel's
arithmetic, not a timing).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.bench.grouped_matmul import CompileCounter, compile_all, rate_columns, time_call, why_failed
from sglang_tpu_qwen.bench.kernels import PEAKS
from sglang_tpu_qwen.engine.runner.sampler import greedy_ids
from sglang_tpu_qwen.model.forward import compute_logits

REFERENCE = "[V, H] served"
TOLERANCE = 2.0**-10  # of the row's largest |logit|: float32 sums of bf16 products in another order
ROW_TILE = 8  # the kernel's rows are padded to a multiple of the float32 sublane tile
# Vocabulary rows a block of the kernel's variants on a TPU (divisors of 248,320 = 1,940 x 128): 5 / 10 MiB blocks
# of the 35B's weight.
KERNEL_BLOCKS = (1280, 2560)
SMALL = {"hidden": 256, "vocab": 2560, "rows": (1, 8, 16), "blocks": (640, 1280)}


def _greedy_kernel(x_ref, w_ref, ids_ref, best_ref, *, tv: int) -> None:
    # One grid step: a [tv, H] block of the weight; the running maximum per row and its id stay in the resident
    # output blocks (lane-replicated [rows, 128], the ids as the lowest id of the maximum, as jnp.argmax).
    v = pl.program_id(0)
    logits = jax.lax.dot_general(x_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [rows, tv]
    block_max = jnp.max(logits, axis=1, keepdims=True)
    col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    block_id = jnp.min(jnp.where(logits == block_max, col, tv), axis=1, keepdims=True) + v * tv
    lanes = ids_ref.shape

    @pl.when(v == 0)
    def _first():
        best_ref[...] = jnp.broadcast_to(block_max, lanes)
        ids_ref[...] = jnp.broadcast_to(block_id, lanes)

    @pl.when(v > 0)
    def _later():
        better = jnp.broadcast_to(block_max, lanes) > best_ref[...]  # strictly: an earlier block keeps a tie
        best_ref[...] = jnp.where(better, jnp.broadcast_to(block_max, lanes), best_ref[...])
        ids_ref[...] = jnp.where(better, jnp.broadcast_to(block_id, lanes), ids_ref[...])


@functools.partial(jax.jit, static_argnames=("tv", "interpret"))
def greedy_lm_head(hidden: jax.Array, weight: jax.Array, *, tv: int, interpret: bool = False) -> jax.Array:
    """Greedy ids of ``hidden @ weight^T`` without writing the logits (a benchmark candidate).

    Args:
        hidden: ``[N, H]`` bfloat16, N a multiple of 8.
        weight: ``[V, H]`` bfloat16 (HF layout), V a multiple of ``tv``.
        tv: vocabulary rows a grid step (a multiple of 128).
        interpret: Pallas TPU interpret mode (CPU).

    Returns:
        ``[N]`` int32: per row the lowest id of the largest float32 logit (``jnp.argmax``'s tie rule).

    Raises:
        ValueError: when V is not a multiple of ``tv`` or N of 8.
    """
    n, h = hidden.shape
    v = weight.shape[0]
    if v % tv or n % ROW_TILE:
        raise ValueError(f"vocab {v} must be a multiple of tv {tv} and rows {n} of {ROW_TILE}")
    block_bytes = tv * h * weight.dtype.itemsize
    ids, _ = pl.pallas_call(
        functools.partial(_greedy_kernel, tv=tv),
        grid=(v // tv,),
        in_specs=[pl.BlockSpec((n, h), lambda i: (0, 0)), pl.BlockSpec((tv, h), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((n, 128), lambda i: (0, 0)), pl.BlockSpec((n, 128), lambda i: (0, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, 128), jnp.int32), jax.ShapeDtypeStruct((n, 128), jnp.float32)],
        # Two weight blocks plus the [N, tv] float32 logits and their temporaries; Mosaic's default scoped VMEM
        # is 16 MiB.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=2 * block_bytes + 4 * n * tv * 4 + (8 << 20)),
        cost_estimate=pl.CostEstimate(flops=2 * n * h * v, transcendentals=0,
                                      bytes_accessed=v * h * weight.dtype.itemsize + n * h * hidden.dtype.itemsize),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(hidden, weight)
    return ids[:, 0]


def logits_vh(hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """The served product: ``model.forward.compute_logits`` with ``weight [V, H]`` as the (untied) lm_head."""
    return compute_logits({"lm_head": weight}, hidden, config=SimpleNamespace(tie_word_embeddings=False))


def served(hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """What the sampling program runs: ``compute_logits`` (``[V, H]`` lm_head) then ``greedy_ids``."""
    return greedy_ids(logits_vh(hidden, weight))


def logits_hv(hidden: jax.Array, weight_t: jax.Array) -> jax.Array:
    """The same product from the transposed ``[H, V]`` weight: ``[N, V]`` float32."""
    return jnp.einsum("nh,hv->nv", hidden, weight_t, preferred_element_type=jnp.float32)


def transposed(hidden: jax.Array, weight_t: jax.Array) -> jax.Array:
    """Greedy ids from the ``[H, V]`` weight."""
    return greedy_ids(logits_hv(hidden, weight_t))


@dataclass(frozen=True)
class Impl:
    """One implementation: ``fn(hidden, weight)``; ``layout`` ``"vh"`` or ``"hv"`` (which weight it reads);
    ``ids``: it returns ids (else logits, unchecked); ``pad``: rows padded to a multiple of 8."""

    name: str
    fn: Callable[[jax.Array, jax.Array], jax.Array]
    layout: str
    ids: bool = True
    pad: bool = False


def impls(blocks: tuple[int, ...], interpret: bool) -> list[Impl]:
    out = [Impl(REFERENCE, served, "vh"), Impl("[H, V]", transposed, "hv"),
           Impl("[V, H] logits", logits_vh, "vh", ids=False), Impl("[H, V] logits", logits_hv, "hv", ids=False)]
    for tv in blocks:
        out.append(Impl(f"pallas tv {tv}", functools.partial(greedy_lm_head, tv=tv, interpret=interpret), "vh",
                        pad=True))
    return out


def padded(rows: int, pad: bool) -> int:
    return -(-rows // ROW_TILE) * ROW_TILE if pad else rows


def check_ids(ids: jax.Array, ref_logits: jax.Array, ref_ids: jax.Array) -> dict[str, int]:
    """``bad_rows``: rows whose id is outside the vocabulary or whose served logit is below the row's maximum by
    more than ``TOLERANCE`` x its largest |logit|; ``ids_differ``: ids that are not the served ones (a near-tie
    may differ and still be right)."""
    inside = (ids >= 0) & (ids < ref_logits.shape[1])
    reached = jnp.take_along_axis(ref_logits, jnp.where(inside, ids, 0)[:, None], axis=1)[:, 0]
    tol = TOLERANCE * jnp.max(jnp.abs(ref_logits), axis=1)
    right = inside & (reached >= jnp.max(ref_logits, axis=1) - tol)
    return {"bad_rows": int(jnp.sum(~right)), "ids_differ": int(jnp.sum(ids != ref_ids))}


def main(argv: list[str] | None = None) -> list[dict]:
    """Time every implementation at every row count; print a line each and a summary per row count. Returns the
    lines as dicts (``rows``, ``impl``, ``us``, ``hbm``, ``compiles``, ``bad_rows`` and ``ids_differ`` for the ids,
    or ``skipped``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,256", help="comma-separated row counts")
    ap.add_argument("--hidden", type=int, default=2048, help="H (the 35B-A3B's; the 397B's is 4096)")
    ap.add_argument("--vocab", type=int, default=248320, help="V (the Qwen3.5 family's)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="small shapes (default off TPU)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="compile threads")
    args = ap.parse_args(argv)
    on_tpu = jax.default_backend() == "tpu"
    small = args.small or not on_tpu
    h, v = (SMALL["hidden"], SMALL["vocab"]) if small else (args.hidden, args.vocab)
    rows_list = SMALL["rows"] if small else tuple(int(r) for r in args.rows.split(","))
    dev = jax.devices()[0]
    peaks = PEAKS.get(dev.device_kind) if on_tpu else None
    weight_bytes = v * h * 2
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}; lm_head [{v}, {h}] bf16 "
          f"({weight_bytes / 1e9:.3f} GB); peaks "
          + (f"{peaks[0] / 1e12:.0f} TFLOP/s, {peaks[1] / 1e9:.0f} GB/s" if peaks else "unknown")
          + ("" if on_tpu else "; not a TPU: interpret mode, small shapes, times mean nothing"), flush=True)
    todo = [(rows, imp) for rows in rows_list
            for imp in impls(SMALL["blocks"] if small else KERNEL_BLOCKS, interpret=not on_tpu)]
    t0 = time.perf_counter()
    specs = {"vh": jax.ShapeDtypeStruct((v, h), jnp.bfloat16), "hv": jax.ShapeDtypeStruct((h, v), jnp.bfloat16)}
    executables = compile_all([((rows, imp.name), imp.fn, (jax.ShapeDtypeStruct((padded(rows, imp.pad), h),
                                                                                jnp.bfloat16), specs[imp.layout]))
                               for rows, imp in todo], args.workers)
    print(f"compiled {len(todo)} programs in {time.perf_counter() - t0:.1f} s", flush=True)

    key = jax.random.key(0)
    weight = (jax.random.normal(key, (v, h), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
    weights = {"vh": weight, "hv": jnp.asarray(weight.T)}
    results: list[dict] = []
    with CompileCounter() as counter:
        for rows in rows_list:
            hidden = jax.random.normal(jax.random.fold_in(key, rows), (padded(rows, True), h), jnp.bfloat16)
            ref_logits = logits_vh(hidden[:rows], weights["vh"])
            ref_ids = served(hidden[:rows], weights["vh"])
            nbytes, flops = weight_bytes + rows * h * 2, 2 * rows * h * v
            print(f"-- {rows} rows: {nbytes / 1e9:.3f} GB, {flops / 1e9:.1f} GFLOP", flush=True)
            for imp in (imp for r, imp in todo if r == rows):
                head = f"{rows:<6}{imp.name:<22}"
                exe = executables[(rows, imp.name)]
                if isinstance(exe, BaseException):
                    print(f"{head}skipped: {why_failed(exe)}", flush=True)
                    results.append({"rows": rows, "impl": imp.name, "skipped": why_failed(exe)})
                    continue
                secs, out, compiles = time_call(exe, (hidden[: padded(rows, imp.pad)], weights[imp.layout]),
                                                args.iters, False, counter)
                moved = nbytes + (0 if imp.ids else rows * v * 4)  # the logits-only forms write them
                line = {"rows": rows, "impl": imp.name, "us": secs * 1e6, "compiles": compiles,
                        "hbm": moved / secs / peaks[1] if peaks else None}
                text = head + rate_columns(secs, moved, flops, peaks)
                if imp.ids:
                    line |= check_ids(out[:rows], ref_logits, ref_ids)
                    text += (f"  ids: {line['ids_differ']} differ from served, {line['bad_rows']} below the max"
                             + (" (ok)" if line["bad_rows"] == 0 else " (WRONG)"))
                print(text, flush=True)
                results.append(line)
    timed = [r for r in results if "us" in r]
    for rows in rows_list:
        ref = next((r for r in timed if r["rows"] == rows and r["impl"] == REFERENCE), None)
        others = [r for r in timed if r["rows"] == rows and r["impl"] != REFERENCE and "logits" not in r["impl"]]
        if ref and others:
            best = min(others, key=lambda r: r["us"])
            print(f"summary {rows} rows: served {ref['us']:.1f} us; fastest other {best['impl']} {best['us']:.1f} us "
                  f"({ref['us'] / best['us']:.3f}x)", flush=True)
    print(f"compiles inside timed windows: {sum(r['compiles'] for r in timed)}", flush=True)
    return results


if __name__ == "__main__":
    main()
