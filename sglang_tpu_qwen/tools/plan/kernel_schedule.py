"""The static schedule of the fused GDN kernel, compiled deviceless for a TPU: bundles and unit utilisation.

``python -m sglang_tpu_qwen.tools.plan.kernel_schedule [--rows 32] [--tokens 64] [--topology v5e:1x1] [--layout 35b]
[--no-commit]``

Compiles ``fused_gdn`` (the serving form: output norm fused in the chunked form) for one device of a deviceless
topology with libtpu's LLO dump on, then reads the dump of each Pallas call: its final bundle count (the
statically scheduled VLIW instruction words of one pass through its code, loop bodies once) and, per unit, the
operations it issues against the unit's slots a bundle. A unit near 100% busy bounds the schedule; none near it
means the dependency chain does (each op waits for the last). Needs libtpu (the ``test`` extra), no TPU.

What the chip adds (DMA waits, pipeline bubbles between grid steps, bank conflicts) is not in a static
schedule: compare a grid step's bundles at the chip's clock with a measured kernel call divided by its grid
steps (docs/performance.md, "Prefill on TPU v5e").
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

# Layouts (key heads, value heads, key dim, value dim, conv kernel) of the released models.
LAYOUTS = {"35b": (16, 32, 128, 128, 4), "397b": (16, 64, 128, 128, 4)}


def read_schedules(dump_dir: Path) -> dict[str, dict]:
    """Per Pallas call in an LLO dump directory: ``bundles`` and ``units`` ({unit: (ops, slots a bundle)}).

    Reads the ``*-final_hlo-static-per-bundle-utilization.txt`` files libtpu writes with
    ``--xla_jf_dump_llo_text`` (one row per bundle); the call's name is the dump's HLO instruction name
    (``gdn_chunked.1``)."""
    out: dict[str, dict] = {}
    for path in dump_dir.glob("*-final_hlo-static-per-bundle-utilization.txt"):
        name = re.sub(r"^\d+-(.+)-\d+-final_hlo-static-per-bundle-utilization\.txt$", r"\1", path.name)
        lines = path.read_text().splitlines()
        units = [u.strip() for u in lines[1].split(",")]
        slots = [int(x) for x in lines[2].split()]
        rows = [[int(x) for x in line.split()] for line in lines[4:] if line.strip()[:1].isdigit()]
        ops = [sum(r[i] for r in rows) for i in range(len(units))]
        out[name] = {"bundles": len(rows), "units": dict(zip(units, zip(ops, slots, strict=True), strict=True))}
    return out


def compile_gdn(rows: int, tokens: int, topology: str, layout: tuple[int, ...], commit: bool = True) -> None:
    """Compile the serving ``fused_gdn`` for ``rows x tokens`` (bf16 inputs, float32 state) deviceless;
    ``commit=False``: a speculative verify step's call (the state read, not written)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from sglang_tpu_qwen.engine.runner.compilation import persistent_cache_off
    from sglang_tpu_qwen.kernels.gdn import conv_pool
    from sglang_tpu_qwen.kernels.gdn.kernel import fused_gdn
    from sglang_tpu_qwen.tools.plan.build import topology_devices

    hk, hv, dk, dv, k = layout
    dev = topology_devices(topology)[0]

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))

    def fn(*args):
        *args, gate, weight = args
        return fused_gdn(*args, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv, gate=gate, norm_weight=weight,
                         commit=commit)

    conv_dim, slots = 2 * hk * dk + hv * dv, rows + 1
    with persistent_cache_off():
        jax.jit(fn, donate_argnums=(4, 5)).lower(
            spec((rows, tokens, conv_dim), jnp.bfloat16), spec((conv_dim, k), jnp.bfloat16),
            spec((rows, tokens, hv), jnp.float32), spec((rows, tokens, hv), jnp.float32),
            spec(conv_pool.pool_shape(1, slots, conv_dim, k - 1), jnp.float32),
            spec((1, slots, hv, dk, dv), jnp.float32), spec((), jnp.int32), spec((rows,), jnp.int32),
            spec((rows,), jnp.int32), spec((rows,), jnp.bool_), spec((rows, tokens, hv * dv), jnp.bfloat16),
            spec((dv,), jnp.bfloat16)).compile()


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Parse flags, compile with the dump on, print and return :func:`read_schedules` of the Pallas calls.

    libtpu reads ``LIBTPU_INIT_ARGS`` once, when the first TPU backend or topology loads it: run this in a fresh
    process (importing JAX does not load libtpu; a compile or a topology before this call does)."""
    p = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.tools.plan.kernel_schedule",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="Tokens a row (over 8: the chunked form).")
    p.add_argument("--topology", default="v5e:1x1")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="35b")
    p.add_argument("--no-commit", action="store_true", help="A speculative verify step's call (commit=False).")
    ns = p.parse_args(argv)
    dump = Path(tempfile.mkdtemp(prefix="llo-"))
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "")
                                      + f" --xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true")
    compile_gdn(ns.rows, ns.tokens, ns.topology, LAYOUTS[ns.layout], commit=not ns.no_commit)
    schedules = {n: s for n, s in read_schedules(dump).items() if n.startswith("gdn_")}
    for name, s in sorted(schedules.items()):
        busy = ", ".join(f"{u} {ops / slots / s['bundles']:.0%}" for u, (ops, slots) in s["units"].items())
        print(f"{name}: {s['bundles']} bundles; busy: {busy}")
    print(f"(LLO dump in {dump})")
    return schedules


if __name__ == "__main__":
    main()
