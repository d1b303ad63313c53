"""How many long sessions one host serves and keeps: the capacity table of a model on a TPU slice.

``python -m sglang_tpu_qwen.tools.plan.capacity [--model-config qwen3.5-397b-a17b] [--topology tpu7x:2x2x1]
[--session-tokens 100000] [--fp8] [--json out.json]``

Arithmetic over the served layout, no compile: attention data-parallel over every device (each device one DP
rank with its own KV pages and GDN slots, ``memory_accounting.cache_units`` at each cache dtype), experts split
``ep`` ways (``programs.weight_bytes_per_device``, the planner's per-device weights). Per device:

- budget = HBM per device x ``--mem-fraction-static`` (the server's rule: the rest is left to the step's
  temporaries) - weights;
- a session of ``S`` tokens holds ``ceil(S / page_size)`` KV pages and one GDN state (a running slot, or a
  snapshot slot when idle);
- concurrent sessions = budget // (pages + one state), over all devices;
- idle sessions cached in HBM at ``R`` running sessions = (budget - R running sessions) // (pages + one state);
- host (the server's host tier holds GDN states; HiCache would hold KV pages too): host memory x
  ``--host-fraction`` // one state, and // (pages + one state) for whole sessions.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import jax.numpy as jnp

from sglang_tpu_qwen.engine.runner.memory_accounting import cache_units
from sglang_tpu_qwen.engine.runner.memory_split import GB as GIB
from sglang_tpu_qwen.engine.runner.sizing import STATE_DTYPES, resolve_kv_dtype
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.param_layout import param_specs
from sglang_tpu_qwen.quant.fp8 import fp8_specs
from sglang_tpu_qwen.tools.plan.chips import CHIPS, Figure
from sglang_tpu_qwen.tools.plan.models import load_model_config
from sglang_tpu_qwen.tools.plan.programs import weight_bytes_per_device

# Host RAM of one VM (one host) per chip family, and its chips.
HOST_RAM = {
    "tpu7x": (Figure(960e9, "B", source="Google Cloud TPU7x docs (docs.cloud.google.com/tpu/docs/tpu7x), system "
                     "architecture table: RAM 960 GB and 224 vCPUs per 4-chip VM"), 4),
}  # fmt: skip
# The table's columns: every --mamba-ssm-dtype, and the --kv-cache-dtype choices of an accelerator (auto = bf16).
KV_DTYPES = {name: resolve_kv_dtype(name, jnp.bfloat16) for name in ("bfloat16", "fp8_e4m3")}


def weights_per_device(config: Qwen35MoeConfig, ep: int, *, fp8: bool, block: tuple[int, int] = (128, 128),
                       dtype: Any = jnp.bfloat16) -> int:
    """Bytes of weights on one device: the replicated weights plus 1/ep of the expert stacks, at ``dtype``
    (block-FP8 with ``block`` [in, out] where ``fp8``) — the planner's ``memory_per_device`` weights."""
    specs = param_specs(config, dtype)
    if fp8:
        specs = fp8_specs(specs, block)
    rep, exp = weight_bytes_per_device(specs, ep)
    return rep + exp


def capacity_row(config: Qwen35MoeConfig, *, kv_dtype: Any, state_dtype: Any, page_size: int,
                 session_tokens: int, hbm_per_device: float, mem_fraction_static: float, weight_bytes: int,
                 devices: int, running_per_host: int, host_bytes: float) -> dict[str, Any]:
    """One row of the table (sizes in bytes, counts per host = all ``devices``).

    ``hbm_per_device``: HBM of one device (bytes); ``weight_bytes``: weights on one device;
    ``running_per_host``: sessions running while the idle ones are counted; ``host_bytes``: host memory the
    tier may use. Returns ``{"kv_per_token", "state", "session_kv", "budget_per_device", "concurrent",
    "idle_hbm", "idle_states_host", "idle_sessions_host"}`` ("idle_hbm" 0 when the running sessions do not
    fit).

    Raises:
        ValueError: the weights leave no budget, or sizes are not positive.
    """
    if min(page_size, session_tokens, devices) <= 0 or running_per_host < 0:
        raise ValueError("page_size, session_tokens and devices must be positive, running_per_host >= 0")
    units = cache_units(config, page_size, kv_dtype, state_dtype)
    budget = int(hbm_per_device * mem_fraction_static) - weight_bytes
    if budget <= 0:
        raise ValueError(f"weights {weight_bytes / GIB:.1f} GiB leave nothing of {hbm_per_device / GIB:.1f} GiB x "
                         f"{mem_fraction_static}")
    session_kv = math.ceil(session_tokens / page_size) * units.kv_per_page
    per_session = session_kv + units.gdn_per_slot
    running_dev = math.ceil(running_per_host / devices)
    left = budget - running_dev * per_session
    return {
        "kv_per_token": units.kv_per_token, "state": units.gdn_per_slot, "session_kv": session_kv,
        "budget_per_device": budget, "concurrent": devices * (budget // per_session),
        "idle_hbm": devices * (left // per_session) if left > 0 else 0,
        "idle_states_host": int(host_bytes // units.gdn_per_slot),
        "idle_sessions_host": int(host_bytes // per_session),
    }


def capacity_table(config: Qwen35MoeConfig, topology: str = "tpu7x:2x2x1", *, fp8: bool = True,
                   page_size: int = 16, session_tokens: int = 100_000, mem_fraction_static: float = 0.8,
                   running_per_host: int = 32, host_fraction: float = 0.5) -> dict[str, Any]:
    """Every (GDN state dtype, KV dtype) row for ``config`` on one host of ``topology`` (dp = ep = every
    device: the server's layout). ``host_fraction``: share of the host RAM given to the tier (an assumption:
    the rest holds the process, the checkpoint pages being loaded, the OS).

    Raises:
        ValueError: unknown chip family or no host-RAM figure for it; a topology beyond one host.
    """
    family, shape = topology.split(":")
    if family not in CHIPS or family not in HOST_RAM:
        raise ValueError(f"no chip / host figures for {family!r}; known: {sorted(HOST_RAM)}")
    chip = CHIPS[family]
    ram, chips_per_host = HOST_RAM[family]
    chips = math.prod(int(v) for v in shape.split("x"))
    if chips != chips_per_host:
        raise ValueError(f"{topology} is {chips} chips; one {family} host has {chips_per_host}")
    devices = chips * chip.devices_per_chip
    weights = weights_per_device(config, devices, fp8=fp8)
    hbm_dev = chip.hbm_bytes / chip.devices_per_chip
    host = ram.value * host_fraction
    rows = [{"state_dtype": s, "kv_dtype": k,
             **capacity_row(config, kv_dtype=kd, state_dtype=sd, page_size=page_size, session_tokens=session_tokens,
                            hbm_per_device=hbm_dev, mem_fraction_static=mem_fraction_static, weight_bytes=weights,
                            devices=devices, running_per_host=running_per_host, host_bytes=host)}
            for s, sd in STATE_DTYPES.items() for k, kd in KV_DTYPES.items()]
    return {"topology": topology, "devices": devices, "fp8_weights": fp8, "page_size": page_size,
            "session_tokens": session_tokens, "mem_fraction_static": mem_fraction_static,
            "weights_per_device": weights, "hbm_per_device": hbm_dev, "running_per_host": running_per_host,
            "host_ram": ram.value, "host_ram_source": ram.source, "host_fraction": host_fraction, "rows": rows}


def format_table(t: dict[str, Any]) -> str:
    """The table as Markdown (sizes in MiB / GiB)."""
    mib = 1 << 20
    head = (f"{t['topology']}, {t['devices']} devices, weights {t['weights_per_device'] / GIB:.1f} GiB per device, "
            f"budget {t['rows'][0]['budget_per_device'] / GIB:.1f} GiB per device (HBM x {t['mem_fraction_static']}"
            f" - weights), {t['session_tokens']:,}-token sessions, page {t['page_size']}, host tier "
            f"{t['host_fraction']:.0%} of {t['host_ram'] / 1e9:.0f} GB")
    lines = [head, "",
             "| GDN state | KV | KV per token | GDN state | session KV | concurrent sessions | idle sessions in HBM "
             f"at {t['running_per_host']} running | idle GDN states on host | idle sessions on host (with KV) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in t["rows"]:
        lines.append(f"| {r['state_dtype']} | {r['kv_dtype']} | {r['kv_per_token'] / 1024:.0f} KiB | "
                     f"{r['state'] / mib:.0f} MiB | {r['session_kv'] / GIB:.2f} GiB | {r['concurrent']} | "
                     f"{r['idle_hbm']} | {r['idle_states_host']:,} | {r['idle_sessions_host']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, print the table (Markdown) and return it."""
    ap = argparse.ArgumentParser(prog="python -m sglang_tpu_qwen.tools.plan.capacity",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default="qwen3.5-397b-a17b", help="config.json path or built-in name")
    ap.add_argument("--topology", default="tpu7x:2x2x1")
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="bf16 weights instead of block-FP8")
    ap.add_argument("--page-size", type=int, default=16, help="server flag (default the server's)")
    ap.add_argument("--session-tokens", type=int, default=100_000)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8, help="server flag (default the server's)")
    ap.add_argument("--running", type=int, default=32, help="running sessions per host while idle ones are counted")
    ap.add_argument("--host-fraction", type=float, default=0.5, help="share of host RAM for the host tier")
    ap.add_argument("--json", help="also write the table here")
    a = ap.parse_args(argv)
    t = capacity_table(load_model_config(a.model_config), a.topology, fp8=a.fp8, page_size=a.page_size,
                       session_tokens=a.session_tokens, mem_fraction_static=a.mem_fraction_static,
                       running_per_host=a.running, host_fraction=a.host_fraction)
    print(format_table(t))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(t, f, indent=1)
    return t


if __name__ == "__main__":
    main()
