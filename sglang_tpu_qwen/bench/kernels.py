"""Kernel benchmark: Pallas kernels against their jnp references over a sweep of batch mixes.

``python -m sglang_tpu_qwen.bench.kernels [--iters N] [--small] [--sections mixes,gdn-decode,gdn-verify,gdn-prefill]``
(the whole sweep takes over the 10 minutes of one device call: ``launch/tpu_bench.sh`` runs ``mixes`` and the GDN
sections as two steps). On a TPU it times the ragged paged
attention and the fused GDN kernel and their references per batch mix (decodes only, prefills only, mixed)
and prints time per call, achieved bytes/s and flops/s, and their fraction of the device's peak. Off TPU it
runs the references only (the Pallas kernels would run in the interpreter, which measures nothing) and says
so; ``--small`` (the default off TPU) shrinks the shapes so that finishes quickly. This is a benchmark,
not a test.

Cost model (analytic, counts useful work only). Attention: flops ``4 * nq * hd * sum(visible keys per
query)`` (QK^T and PV); bytes: the K/V pages read once per sequence plus q, out and the new K/V. Each
implementation reads its own pool layout (the kernel head-major, the reference token-major) at the server's
TPU page size.
GDN: flops ``tokens * Hv * 6 * dk * dv`` (state decay, read, write and the output read per token) plus, chunked,
chunk-local ``tokens * Hv * 2 * C * (dk + dv)``; bytes: each sequence's recurrent state read and written
once plus inputs and outputs. Steps longer than the recurrent form's run a third implementation, ``xla``: the
chunked form as batched XLA products (kernels/gdn/parallel_chunks.py), the kernel's alternative for prefill;
a speculative verify's 4-token steps (without commit: the state read once; on a TPU also with a decode step's
grid steps of 1 MiB of state, ``pallas@1024``) and their commit get rows of their own; a last section times the
XLA form against the kernel at the 35B-shaped serving prefill steps, the kernel also with one key head a grid
step (``pallas-1kh``: its key heads not grouped, ``kernel.chunk_heads``), with 8 and 32 chunk chains a step
(``pallas-8``, ``pallas-32``; the default is 16) and with chunks of 128 tokens (``pallas-c128``). Each GDN
decode layout also gets a ``state copy`` row: the same state blocks copied in place by a kernel that computes
nothing, the rate such a stream reaches on the chip.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.args.server_args import TPU_PAGE_SIZE
from sglang_tpu_qwen.kernels.gdn import conv_pool
from sglang_tpu_qwen.kernels.gdn.kernel import (
    CHUNK_SIZE,
    DECODE_STATE_BYTES,
    RECURRENT_MAX_T,
    decode_heads,
    fused_gdn,
)
from sglang_tpu_qwen.kernels.gdn.parallel_chunks import fused_gdn_parallel
from sglang_tpu_qwen.kernels.gdn.reference import fused_gdn_reference
from sglang_tpu_qwen.kernels.ragged_paged_attention.head_major import HEAD_MAJOR
from sglang_tpu_qwen.kernels.ragged_paged_attention.kernel import ragged_paged_attention
from sglang_tpu_qwen.kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

# Per JAX device (bf16 dense flop/s, HBM bytes/s). On TPU7x a device is one TensorCore, half a chip.
PEAKS: dict[str, tuple[float, float]] = {
    "TPU7x": (2307e12 / 2, 7.37e12 / 2),
    "TPU v6 lite": (918e12, 1.64e12),
    "TPU v5p": (459e12, 2.76e12),
    "TPU v5 lite": (197e12, 0.819e12),
}


SHAPES = "Qwen3.5 (attention 16 / 2 heads of 256, GDN the 397B's)"


@dataclass(frozen=True)
class Mix:
    """One batch mix: per-row cached prefix and new tokens, padded to ``T``."""

    name: str
    prefix: tuple[int, ...]
    new: tuple[int, ...]

    @property
    def t(self) -> int:
        return max(self.new)


def _mixes(small: bool) -> list[Mix]:
    if small:
        return [Mix("decode", (60,) * 8, (1,) * 8), Mix("prefill", (0, 0), (64, 40)),
                Mix("mixed", (30, 0, 61, 7), (1, 32, 1, 20))]
    # The decode issue's shapes: decode 64 x 2,048, 128 x 1,024 and 32 x 8,192; prefill 4 x 512 and 8 x 4,096.
    return [Mix("decode", (2047,) * 64, (1,) * 64), Mix("decode", (1023,) * 128, (1,) * 128),
            Mix("decode", (8191,) * 32, (1,) * 32), Mix("prefill", (0,) * 4, (512,) * 4),
            Mix("prefill", (0,) * 8, (4096,) * 8), Mix("mixed", (4095, 1024, 0, 2047) * 4, (1, 256, 256, 1) * 4)]


def _time(fn: Callable, args: tuple, donate: tuple[int, ...], iters: int) -> float:
    """Seconds per call; donated outputs are fed back as the next call's inputs."""
    args = list(args)
    for j in donate:  # keep the caller's arrays alive for the next implementation
        args[j] = jnp.array(args[j], copy=True)
    out = fn(*args)
    jax.block_until_ready(out)
    for i, j in enumerate(donate):
        args[j] = out[i + 1]
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
        for i, j in enumerate(donate):
            args[j] = out[i + 1]
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _attention_case(mix: Mix, small: bool, dtype) -> tuple[tuple, float, float]:
    nq, nkv, hd, page = (4, 2, 64, 16) if small else (16, 2, 256, TPU_PAGE_SIZE)  # 35B-A3B / 122B attention
    rng = np.random.default_rng(0)
    b, t = len(mix.new), mix.t
    kv = np.asarray(mix.prefix) + np.asarray(mix.new)
    cols = int(-(-kv.max() // page))
    pages = b * cols + 1
    table = (1 + np.arange(b * cols, dtype=np.int32)).reshape(b, cols)
    args = (jnp.asarray(rng.standard_normal((b, t, nq, hd)), dtype),
            jnp.asarray(rng.standard_normal((b, t, nkv, hd)), dtype),
            jnp.asarray(rng.standard_normal((b, t, nkv, hd)), dtype),
            jnp.zeros((1, pages, page, nkv, hd), dtype), jnp.zeros((1, pages, page, nkv, hd), dtype),
            jnp.int32(0), jnp.asarray(mix.new, jnp.int32), jnp.asarray(kv, jnp.int32), jnp.asarray(table))
    item = jnp.dtype(dtype).itemsize
    visible = sum(n * p + n * (n + 1) // 2 for p, n in zip(mix.prefix, mix.new, strict=True))
    flops = 4.0 * nq * hd * visible
    tokens = sum(mix.new)
    nbytes = item * (2 * nkv * hd * float(kv.sum()) + tokens * (2 * nq * hd + 2 * nkv * hd))
    return args, flops, nbytes


# The sweep's parts, selectable with --sections.
SECTIONS = ("mixes", "gdn-decode", "gdn-verify", "gdn-prefill")
# GDN head layouts (Hk, Hv, dk, dv) of the decode-layout section: the released 397B-A17B's and 35B-A3B's.
GDN_LAYOUTS = {"397B": (16, 64, 128, 128), "35B": (16, 32, 128, 128)}


def _gdn_case(mix: Mix, small: bool, dtype, heads: tuple[int, int, int, int] = GDN_LAYOUTS["397B"],
              state_dtype=jnp.float32) -> tuple[tuple, dict, float, float]:
    hk, hv, dk, dv = (2, 4, 32, 32) if small else heads
    conv_dim = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(0)
    b, t = len(mix.new), mix.t
    lens = np.asarray(mix.new, np.int32)
    valid = (np.arange(t)[None, :] < lens[:, None])[..., None]
    args = (jnp.asarray(rng.standard_normal((b, t, conv_dim)) * valid, dtype),
            jnp.asarray(rng.standard_normal((conv_dim, 4)) * 0.5, dtype),
            jnp.asarray(-rng.uniform(0, 0.5, (b, t, hv)) * valid, jnp.float32),
            jnp.asarray(rng.uniform(0, 1, (b, t, hv)) * valid, jnp.float32),
            jnp.zeros(conv_pool.pool_shape(1, b + 1, conv_dim, 3), jnp.float32),
            jnp.zeros((1, b + 1, hv, dk, dv), state_dtype),
            jnp.int32(0), jnp.arange(1, b + 1, dtype=jnp.int32), jnp.asarray(lens),
            jnp.asarray(np.asarray(mix.prefix) == 0))
    dims = dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    tokens = float(lens.sum())
    # One yardstick for every chunked variant: the chunk-local products counted at the default 64-token chunk.
    flops = tokens * hv * (6 * dk * dv + (2 * CHUNK_SIZE * (dk + dv) if t > RECURRENT_MAX_T else 0))
    state_bytes = jnp.dtype(state_dtype).itemsize
    nbytes = 2 * b * hv * dk * dv * state_bytes + tokens * (conv_dim * jnp.dtype(dtype).itemsize + hv * dv * 4)
    return args, dims, flops, nbytes


# The chunked form's variants timed beside the default (16 chunk chains a step): one key head a grid step, 8 and
# 32 chains a step, chunks of 128 tokens.
GDN_VARIANTS = {"pallas-1kh": {"chunk_chains": 1}, "pallas-8": {"chunk_chains": 8}, "pallas-32": {"chunk_chains": 32},
                "pallas-c128": {"chunk_size": 128}}


def _gdn_fn(impl: str, dims: dict) -> Callable:
    """The fused GDN kernel (``pallas``; its chunked form's :data:`GDN_VARIANTS`; ``pallas@N``: its recurrent
    form with grid steps of up to N KiB of state, not ``DECODE_STATE_BYTES`` / ``SHORT_STATE_BYTES``), its jitted
    jnp reference (``reference``) or the XLA parallel-chunk form (``xla``, kernels/gdn/parallel_chunks.py), pools
    donated, with the head ``dims`` bound."""
    if impl.startswith("pallas@"):
        return functools.partial(fused_gdn, **dims, decode_state_bytes=int(impl[len("pallas@"):]) * 1024)
    if impl.startswith("pallas"):
        return functools.partial(fused_gdn, **dims, **GDN_VARIANTS.get(impl, {}))
    fn = fused_gdn_parallel if impl == "xla" else fused_gdn_reference
    return functools.partial(jax.jit(fn, static_argnames=(*dims, "commit"), donate_argnums=(4, 5)), **dims)


def _row(kernel: str, mix: str, impl: str, secs: float, flops: float, nbytes: float,
         peaks: tuple[float, float] | None) -> str:
    line = (f"{kernel:<24}{mix:<15}{impl:<11}{secs * 1e6:>11.1f} us{flops / secs / 1e12:>10.2f} TFLOP/s"
            f"{nbytes / secs / 1e9:>10.1f} GB/s")
    if peaks:
        line += f"   {flops / secs / peaks[0]:6.1%} of peak flops, {nbytes / secs / peaks[1]:6.1%} of peak HBM"
    return line


def main(argv: list[str] | None = None) -> None:
    """Run the sweep and print one line per (kernel, batch mix, implementation)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="small shapes (default off TPU)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (the whole sweep overruns one 10-minute "
                         "device call)")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        ap.error(f"unknown section(s) {sorted(sections - set(SECTIONS))}; choose from {SECTIONS}")
    dev = jax.devices()[0]
    on_tpu = jax.default_backend() == "tpu"
    small = args.small or not on_tpu
    peaks = PEAKS.get(dev.device_kind) if on_tpu else None
    dtype = jnp.bfloat16 if on_tpu else jnp.float32
    print(f"device: {dev.device_kind} ({jax.default_backend()}), shapes: {'small' if small else SHAPES}"
          + ("" if on_tpu else "; not a TPU: running the jnp references only (Pallas would be interpreted)"))
    impls = [("reference", False)] + ([("pallas", True)] if on_tpu else [])
    for mix in _mixes(small) if "mixes" in sections else ():
        att_args, att_flops, att_bytes = _attention_case(mix, small, dtype)
        gdn_args, dims, gdn_flops, gdn_bytes = _gdn_case(mix, small, dtype)
        print(f"-- {mix.name}: {len(mix.new)} rows, {max(mix.prefix) + max(mix.new)} longest context", flush=True)
        for impl, pallas in impls:
            att = ragged_paged_attention if pallas else jax.jit(ragged_paged_attention_reference,
                                                                 donate_argnums=(3, 4))
            # Each backend's own pool layout (kernels/attention_backend.py): head-major for the kernel.
            pools = tuple(HEAD_MAJOR.stored(c) for c in att_args[3:5]) if pallas else att_args[3:5]
            secs = _time(att, (*att_args[:3], *pools, *att_args[5:]), (3, 4), args.iters)
            print(_row("ragged_paged_attention", mix.name, impl, secs, att_flops, att_bytes, peaks))
            secs = _time(_gdn_fn(impl, dims), gdn_args, (4, 5), args.iters)
            print(_row("fused_gdn", mix.name, impl, secs, gdn_flops, gdn_bytes, peaks))
        if mix.t > RECURRENT_MAX_T:  # the chunked form: the XLA candidate beside the kernel
            secs = _time(_gdn_fn("xla", dims), gdn_args, (4, 5), args.iters)
            print(_row("fused_gdn", mix.name, "xla", secs, gdn_flops, gdn_bytes, peaks))
    rows = 8 if small else 64
    if "gdn-decode" in sections:
        _gdn_decode_section(rows, small, dtype, impls, peaks, on_tpu, args.iters)
    if "gdn-verify" in sections:
        _gdn_verify_section(rows, small, dtype, impls, peaks, on_tpu, args.iters)
    if "gdn-prefill" in sections:
        _gdn_prefill_section(small, dtype, peaks, on_tpu, args.iters)


def _gdn_decode_section(rows: int, small: bool, dtype, impls: list, peaks, on_tpu: bool, iters: int) -> None:
    # GDN decode per released layout and --mamba-ssm-dtype: the state read and written once is the traffic.
    print(f"-- GDN decode, {rows} rows, per layout and state dtype", flush=True)
    mix = Mix("decode", (100,) * rows, (1,) * rows)
    for name, heads in ({"small": GDN_LAYOUTS["397B"]} if small else GDN_LAYOUTS).items():
        for state_dtype in (jnp.float32, jnp.bfloat16):
            gdn_args, dims, gdn_flops, gdn_bytes = _gdn_case(mix, small, dtype, heads, state_dtype)
            label = f"{name}/{jnp.dtype(state_dtype).name}"
            for impl, _ in impls:
                secs = _time(_gdn_fn(impl, dims), gdn_args, (4, 5), iters)
                print(_row("fused_gdn", label, impl, secs, gdn_flops, gdn_bytes, peaks))
            if on_tpu:  # the ceiling: the same state blocks copied in place, nothing computed
                pool, slots = gdn_args[5], gdn_args[7]
                per_step = heads[1] // heads[0] * decode_heads(heads[0], heads[1] // heads[0], heads[2], heads[3],
                                                               pool.dtype.itemsize, DECODE_STATE_BYTES)
                copy_bytes = 2 * rows * pool[0, 0].nbytes
                secs = _time(functools.partial(_state_copy_step, heads=per_step), (pool, slots), (0,), iters)
                print(_row("state copy", label, "pallas", secs, 0.0, copy_bytes, peaks))


def _gdn_verify_section(rows: int, small: bool, dtype, impls: list, peaks, on_tpu: bool, iters: int) -> None:
    # A speculative verify's GDN step (4 tokens a row, the recurrent form, 35B layout) without commit (the state
    # read once) and its commit (read and written): the kernel against the state bytes, beside the decode rows'
    # state copy above; its deviceless schedule puts the lane broadcasts of k and q (XLU) first.
    print(f"-- GDN verify steps, {rows} rows x 4 tokens, 35B layout: verify (no commit) and commit", flush=True)
    mix = Mix("verify", (100,) * rows, (4,) * rows)
    gdn_args, dims, gdn_flops, gdn_bytes = _gdn_case(mix, small, dtype, GDN_LAYOUTS["35B"])
    state_once = rows * gdn_args[5][0, 0].nbytes
    # On a TPU both also with the decode step's 1 MiB of state a grid step (kernel.SHORT_STATE_BYTES, 2 MiB, a
    # whole row of the 35B layout, is theirs): a grid step's fixed cost is what the larger block saves.
    sweep = ["pallas@1024"] if on_tpu else []
    for commit in (False, True):
        for impl in [name for name, _ in impls] + sweep:
            fn = functools.partial(_gdn_fn(impl, dims), commit=commit)
            secs = _time(fn, gdn_args, (4, 5), iters)
            print(_row("fused_gdn", f"{'commit' if commit else 'verify'} {rows}x4", impl, secs, gdn_flops,
                       gdn_bytes - (0 if commit else state_once), peaks))


def _gdn_prefill_section(small: bool, dtype, peaks, on_tpu: bool, iters: int) -> None:
    # GDN prefill as the 35B-shaped checkpoint's serving steps cut 2,048 tokens (issue 44's prefill profile: 32
    # rows x 64 and 8 x 256): the kernel's chunked form against the XLA parallel-chunk candidate.
    print("-- GDN prefill steps, 35B layout: the chunked form", flush=True)
    for rows, new in ((4, 16), (1, 64)) if small else ((32, 64), (8, 256), (1, 2048)):
        mix = Mix("prefill", (0,) * rows, (new,) * rows)
        gdn_args, dims, gdn_flops, gdn_bytes = _gdn_case(mix, small, dtype, GDN_LAYOUTS["35B"])
        for impl in ("xla", "pallas", *GDN_VARIANTS) if on_tpu else ("xla",):
            secs = _time(_gdn_fn(impl, dims), gdn_args, (4, 5), iters)
            print(_row("fused_gdn", f"{rows}x{new}", impl, secs, gdn_flops, gdn_bytes, peaks))


def _state_copy_step(pool: jax.Array, slots: jax.Array, *, heads: int) -> tuple[None, jax.Array]:
    return None, state_copy(pool, slots, heads=heads)  # _time feeds output 1 back as argument 0


@functools.partial(jax.jit, static_argnames=("heads",), donate_argnums=(0,))
def state_copy(pool: jax.Array, slots: jax.Array, *, heads: int) -> jax.Array:
    """Copy the recurrent states of ``slots [B]`` (int32) in ``pool [1, S, Hv, dk, dv]`` onto themselves, in
    blocks of ``heads`` value heads as the fused GDN kernel's decode moves them, and compute nothing: the
    HBM rate an in-place state stream reaches on the chip (tools/plan/chips.py ``inplace_stream_fraction``).
    Returns the pool (donated, aliased)."""
    _, _, hv, dk, dv = pool.shape
    spec = pl.BlockSpec((None, None, heads, dk, dv), lambda b, h, slot: (0, slot[b], h, 0, 0))

    def kernel(_slot_ref, src, dst):
        dst[...] = src[...]

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={1: 0},
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(slots.shape[0], hv // heads),
                                               in_specs=[spec], out_specs=spec),
    )(slots, pool)


if __name__ == "__main__":
    main()
