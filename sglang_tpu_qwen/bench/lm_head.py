"""Greedy lm_head benchmark: the vocabulary product and its argmax, by weight layout and kernel, on a TPU.

``python -m sglang_tpu_qwen.bench.lm_head [--rows 1,8,64,256] [--hidden 2048] [--vocab 248320] [--iters N]``.
Every greedy decode step, every MTP draft and a verify step's sampling read the whole lm_head once: on the v5e
the 35B-shaped checkpoint's 1.02 GB of it took 1.53 ms at 64 rows in XLA's fused product and argmax (81% of HBM
peak; the 64-row MTP cycle has four of them) where the MoE's ``ragged_dot`` reads its experts at 84-88%.
Implementations (one line each per row count, or why it did not run):

- ``[V, H] xla``: ``kernels/greedy_head/reference.py`` on the HF layout (XLA fuses the argmax into the product):
  ``--sampling-backend reference``. The reference of the id checks.
- ``[H, V]``: the same product and argmax on the transposed weight (the vocabulary on lanes).
- ``[V, H] logits`` / ``[H, V] logits``: the products alone, float32 logits written out.
- ``pallas tv N``: kernels/greedy_head (``--sampling-backend pallas``, what a TPU serves: tv 1,280 up to 128
  rows, 2,560 from 129 to 256 where that block is at most 10 MiB, ``block_vocab``) streaming the ``[V, H]``
  weight in blocks of N vocabulary rows (double-buffered: this JAX's TPU pipeline takes no deeper buffering)
  through the MXU, keeping each row's running maximum and its id on chip: the weight is the only large read and
  nothing is written back but the ids.

Hidden states are random normal, weights random normal scaled by ``H^-0.5``. Cost per call: the weight read once
plus the hidden rows (and the ``[N, V]`` float32 logits written, for the logits-only lines); flops ``2 N H V``;
GB/s and TFLOP/s as fractions of the chip's peaks (``bench.kernels.PEAKS``).

Method: every program compiled ahead of time (``bench.grouped_matmul.compile_all``), then each timed as one
untimed call and ``--iters`` back to back (``grouped_matmul.time_call``); backend compiles inside the timed windows
are counted and printed (0 expected). Numerics: a row's id must reach the reference's float32 logits' maximum
within ``TOLERANCE`` times the row's largest absolute logit (summation orders differ between the forms, so a
near-tie may pick another id of the same value); the line prints the rows that do not, and the ids that differ
from the reference's.

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

from sglang_tpu_qwen.bench.grouped_matmul import CompileCounter, compile_all, rate_columns, time_call, why_failed
from sglang_tpu_qwen.bench.kernels import PEAKS
from sglang_tpu_qwen.engine.runner.sampler import greedy_ids
from sglang_tpu_qwen.kernels.greedy_head.kernel import BLOCK_VOCAB, greedy_lm_head
from sglang_tpu_qwen.kernels.greedy_head.reference import greedy_lm_head_reference
from sglang_tpu_qwen.model.forward import compute_logits

REFERENCE = "[V, H] xla"
TOLERANCE = 2.0**-10  # of the row's largest |logit|: float32 sums of bf16 products in another order
# Vocabulary rows a block of the kernel's variants on a TPU (divisors of 248,320 = 1,940 x 128): 5 / 10 MiB blocks
# of the 35B's weight; the first is what serving runs up to 256 rows (kernels/greedy_head/kernel.py).
KERNEL_BLOCKS = (BLOCK_VOCAB, 2 * BLOCK_VOCAB)
SMALL = {"hidden": 256, "vocab": 2560, "rows": (1, 8, 16), "blocks": (640, 1280)}


def logits_vh(hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """XLA's product: ``model.forward.compute_logits`` with ``weight [V, H]`` as the (untied) lm_head."""
    return compute_logits({"lm_head": weight}, hidden, config=SimpleNamespace(tie_word_embeddings=False))


def logits_hv(hidden: jax.Array, weight_t: jax.Array) -> jax.Array:
    """The same product from the transposed ``[H, V]`` weight: ``[N, V]`` float32."""
    return jnp.einsum("nh,hv->nv", hidden, weight_t, preferred_element_type=jnp.float32)


def transposed(hidden: jax.Array, weight_t: jax.Array) -> jax.Array:
    """Greedy ids from the ``[H, V]`` weight."""
    return greedy_ids(logits_hv(hidden, weight_t))


@dataclass(frozen=True)
class Impl:
    """One implementation: ``fn(hidden, weight)``; ``layout`` ``"vh"`` or ``"hv"`` (which weight it reads);
    ``ids``: it returns ids (else logits, unchecked)."""

    name: str
    fn: Callable[[jax.Array, jax.Array], jax.Array]
    layout: str
    ids: bool = True


def impls(blocks: tuple[int, ...], interpret: bool) -> list[Impl]:
    out = [Impl(REFERENCE, greedy_lm_head_reference, "vh"), Impl("[H, V]", transposed, "hv"),
           Impl("[V, H] logits", logits_vh, "vh", ids=False), Impl("[H, V] logits", logits_hv, "hv", ids=False)]
    for tv in blocks:
        out.append(Impl(f"pallas tv {tv}", functools.partial(greedy_lm_head, tv=tv, interpret=interpret), "vh"))
    return out


def check_ids(ids: jax.Array, ref_logits: jax.Array, ref_ids: jax.Array) -> dict[str, int]:
    """``bad_rows``: rows whose id is outside the vocabulary or whose reference logit is below the row's maximum
    by more than ``TOLERANCE`` x its largest |logit|; ``ids_differ``: ids that are not the reference's (a near-tie
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
    executables = compile_all([((rows, imp.name), imp.fn, (jax.ShapeDtypeStruct((rows, h),
                                                                                jnp.bfloat16), specs[imp.layout]))
                               for rows, imp in todo], args.workers)
    print(f"compiled {len(todo)} programs in {time.perf_counter() - t0:.1f} s", flush=True)

    key = jax.random.key(0)
    weight = (jax.random.normal(key, (v, h), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
    weights = {"vh": weight, "hv": jnp.asarray(weight.T)}
    results: list[dict] = []
    with CompileCounter() as counter:
        for rows in rows_list:
            hidden = jax.random.normal(jax.random.fold_in(key, rows), (rows, h), jnp.bfloat16)
            ref_logits = logits_vh(hidden, weights["vh"])
            ref_ids = greedy_lm_head_reference(hidden, weights["vh"])
            nbytes, flops = weight_bytes + rows * h * 2, 2 * rows * h * v
            print(f"-- {rows} rows: {nbytes / 1e9:.3f} GB, {flops / 1e9:.1f} GFLOP", flush=True)
            for imp in (imp for r, imp in todo if r == rows):
                head = f"{rows:<6}{imp.name:<22}"
                exe = executables[(rows, imp.name)]
                if isinstance(exe, BaseException):
                    print(f"{head}skipped: {why_failed(exe)}", flush=True)
                    results.append({"rows": rows, "impl": imp.name, "skipped": why_failed(exe)})
                    continue
                secs, out, compiles = time_call(exe, (hidden, weights[imp.layout]),
                                                args.iters, False, counter)
                moved = nbytes + (0 if imp.ids else rows * v * 4)  # the logits-only forms write them
                line = {"rows": rows, "impl": imp.name, "us": secs * 1e6, "compiles": compiles,
                        "hbm": moved / secs / peaks[1] if peaks else None}
                text = head + rate_columns(secs, moved, flops, peaks)
                if imp.ids:
                    line |= check_ids(out, ref_logits, ref_ids)
                    text += (f"  ids: {line['ids_differ']} differ from xla, {line['bad_rows']} below the max"
                             + (" (ok)" if line["bad_rows"] == 0 else " (WRONG)"))
                print(text, flush=True)
                results.append(line)
    timed = [r for r in results if "us" in r]
    for rows in rows_list:
        ref = next((r for r in timed if r["rows"] == rows and r["impl"] == REFERENCE), None)
        others = [r for r in timed if r["rows"] == rows and r["impl"] != REFERENCE and "logits" not in r["impl"]]
        if ref and others:
            best = min(others, key=lambda r: r["us"])
            print(f"summary {rows} rows: xla {ref['us']:.1f} us; fastest other {best['impl']} {best['us']:.1f} us "
                  f"({ref['us'] / best['us']:.3f}x)", flush=True)
    print(f"compiles inside timed windows: {sum(r['compiles'] for r in timed)}", flush=True)
    return results


if __name__ == "__main__":
    main()
