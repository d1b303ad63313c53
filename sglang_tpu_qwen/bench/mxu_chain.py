"""MXU chain benchmark: how long a dependent matrix product takes on the chip, by size and by how many
independent chains run side by side in one Pallas kernel.

``python -m sglang_tpu_qwen.bench.mxu_chain [--products 16] [--steps 256] [--iters 10] [--small]``

Why: the fused GDN kernel's chunked form (kernels/gdn/kernel.py) is a chain of dependent 64 x 64 products per
(value head, chunk): the chunk inverse's ten, then W, U and the outputs. On the v5e it ran ~18 us a grid step
where its static schedule said ~6 us (docs/performance.md, "Prefill on TPU v5e"), at 2% of MXU peak. Two
questions decide how to restructure it, and this answers them on the chip:

- does a dependent 64 x 64 product take about as long as a 128 x 128 one (the MXU is 128 x 128 on the v5e):
  then two value heads packed block-diagonally into one 128 x 128 product halve the chain's time;
- do independent chains in one basic block overlap (``chains`` of them, straight-line code): then grouping
  more heads a grid step pays, else it does not.

Method: one ``pallas_call`` of ``--steps`` grid steps; each step reads the same ``[chains, n, n]`` block (its
index never changes, so Pallas copies it in once) and multiplies each chain ``--products`` times by a fixed
``[n, n]`` matrix, each product using the last one's result (float32 results; ``bf16``: one MXU pass over
bfloat16-rounded operands as the kernel's bf16 model runs; ``f32``: ``HIGHEST``, six passes). Timed: ``--iters``
calls after a warm one (no compilation inside), per call ``block_until_ready``. Printed per (dtype, n, chains):
us a grid step, ns a product in one chain (the step / products), and flops as a share of the bf16 peak.
Off a TPU it runs in Pallas interpret mode at ``--small`` sizes and says the times mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_qwen.bench.kernels import PEAKS

SIZES = (64, 128, 256)
CHAINS = (1, 2, 4, 8)


def _chain_kernel(x_ref, m_ref, o_ref, *, products: int, chains: int, bf16: bool) -> None:
    m = m_ref[...]
    xs = [x_ref[c] for c in range(chains)]
    for _ in range(products):  # straight-line: the scheduler sees every chain's products at once
        if bf16:
            xs = [jax.lax.dot(x.astype(jnp.bfloat16), m.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
                  for x in xs]
        else:
            xs = [jax.lax.dot(x, m, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
                  for x in xs]
    for c in range(chains):
        o_ref[c] = xs[c]


@functools.partial(jax.jit, static_argnames=("products", "steps", "bf16", "interpret"))
def mxu_chain(x: jax.Array, m: jax.Array, *, products: int, steps: int, bf16: bool,
              interpret: bool = False) -> jax.Array:
    """``steps`` grid steps, each multiplying every chain of ``x [chains, n, n]`` float32 by ``m [n, n]``
    float32 ``products`` times in a row; returns the ``[chains, n, n]`` float32 result of the last step (every
    step computes the same: the block never changes)."""
    chains, n, _ = x.shape
    return pl.pallas_call(
        functools.partial(_chain_kernel, products=products, chains=chains, bf16=bf16),
        grid=(steps,),
        in_specs=[pl.BlockSpec((chains, n, n), lambda i: (0, 0, 0)), pl.BlockSpec((n, n), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((chains, n, n), lambda i: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(x, m)


def chain_inputs(n: int, chains: int) -> tuple[jax.Array, jax.Array]:
    """``x [chains, n, n]`` of O(1) values and ``m = 0.99 I`` (products stay bounded; the MXU does the same work
    whatever the values)."""
    x = np.random.default_rng(0).standard_normal((chains, n, n)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(0.99 * np.eye(n, dtype=np.float32))


def main(argv: list[str] | None = None) -> None:
    """Time every (dtype, size, chains) and print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--products", type=int, default=16, help="dependent products per chain a grid step")
    ap.add_argument("--steps", type=int, default=256, help="grid steps a call")
    ap.add_argument("--iters", type=int, default=10, help="timed calls")
    ap.add_argument("--small", action="store_true", help="small sizes and counts (default off TPU)")
    args = ap.parse_args(argv)
    on_tpu = jax.default_backend() == "tpu"
    small = args.small or not on_tpu
    sizes, chain_counts = ((8, 16), (1, 2)) if small else (SIZES, CHAINS)
    products, steps, iters = (2, 2, 1) if small else (args.products, args.steps, args.iters)
    dev = jax.devices()[0]
    peaks = PEAKS.get(dev.device_kind) if on_tpu else None
    print(f"device: {dev.device_kind} ({jax.default_backend()}); {products} dependent products a chain, {steps} grid "
          f"steps a call, {iters} timed calls"
          + ("" if on_tpu else "; not a TPU: Pallas interpret mode, the times mean nothing"), flush=True)
    for bf16 in (True, False):
        for n in sizes:
            for chains in chain_counts:
                x, m = chain_inputs(n, chains)
                fn = functools.partial(mxu_chain, products=products, steps=steps, bf16=bf16, interpret=not on_tpu)
                out = jax.block_until_ready(fn(x, m))  # compile and warm
                if not np.all(np.isfinite(np.asarray(out))):
                    raise RuntimeError(f"non-finite chain result at n={n}, chains={chains}")
                t0 = time.perf_counter()
                for _ in range(iters):
                    jax.block_until_ready(fn(x, m))
                step = (time.perf_counter() - t0) / iters / steps
                flops = 2.0 * n**3 * products * chains
                line = (f"{'bf16' if bf16 else 'f32 ':<5} n {n:>4}  chains {chains}  {step * 1e6:8.2f} us a step  "
                        f"{step / products * 1e9:8.0f} ns a product in a chain")
                if peaks:
                    line += f"  {flops / step / peaks[0]:6.1%} of bf16 peak"
                print(line, flush=True)


if __name__ == "__main__":
    main()
