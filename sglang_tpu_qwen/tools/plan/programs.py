"""What the planner reads off one compiled program: memory, cost analysis, per-instruction traffic."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.gdn.kernel import CHUNKED_SCOPE, RECURRENT_SCOPE
from sglang_tpu_qwen.kernels.grouped_ffn import SCOPE as GROUPED_FFN
from sglang_tpu_qwen.parallel import sharding
from sglang_tpu_qwen.tools import hlo_traffic

# The attention kernel declares flops for the whole page-table width (an upper bound); the serial time
# charges attention from the analytic count at the step's real context instead.
_ATTENTION_KERNEL = "ragged_paged_attention"
# Kernels that stream a pool's blocks in and write them back in place (chips.ChipPeaks.inplace_stream_fraction).
_INPLACE_KERNELS = ("fused_gdn",)
# The verify commit's snapshot copy (kernels/gdn/slot_copy.py): it declares every row's state, moves the few rows
# that take a snapshot; the planner charges it what the roofline counts.
SNAPSHOT_COPY = "copy_slots"


def nbytes(tree: Any) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of ``tree``."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def weight_bytes_per_device(specs: Any, ep: int) -> tuple[int, int]:
    """``(replicated bytes, expert bytes)`` held by one device (expert stacks split ``ep`` ways)."""
    rep = exp = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(specs):
        n = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        if sharding._key_names(path) & sharding.EXPERT_LEAVES:
            exp += n // ep
        else:
            rep += n
    return rep, exp


def cost(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis: ``flops`` and ``bytes_accessed`` (a custom call in a loop counted once)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, list):  # older jax returns one dict per program
        ca = ca[0]
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def memory(compiled: Any) -> dict[str, int]:
    """Argument / temp / output / alias bytes per device and their ``total``."""
    mem = compiled.memory_analysis()
    out = {"arguments": int(mem.argument_size_in_bytes), "temp": int(mem.temp_size_in_bytes),
           "output": int(mem.output_size_in_bytes), "alias": int(mem.alias_size_in_bytes)}
    out["total"] = out["arguments"] + out["temp"] + out["output"] - out["alias"]
    return out


def traffic(hlo_text: str, bytes_per_s: float, flops_per_s: float, n: int = 3,
            ragged_dot_fraction: float = 1.0, inplace_stream_fraction: float = 1.0,
            custom_call_bytes: dict[str, float] | None = None,
            gdn_recurrent_flops_per_s: float | None = None, gdn_chunked_flops_per_s: float | None = None,
            ragged_dot_mxu_fraction: Callable[[float], float] | None = None,
            grouped_ffn_mxu_fraction: Callable[[float], float] | None = None) -> dict[str, Any]:
    """Per-instruction traffic of a compiled program (tools/hlo_traffic.py: loop bodies times their trip
    counts, Pallas kernels at their declared traffic). XLA's own total counts a custom call inside a loop
    once, so the planner sums per instruction.

    Returns ``bytes`` (HLO bytes), ``kernel_bytes``, ``top_excess`` (the ``n`` largest byte movers outside the
    kernels: the weights, KV and GDN state go through the kernels, so what else moves many bytes is the
    excess to cut), ``declared_flops`` (kernels' declared flops but attention's) and ``serial_s``: each
    instruction at its own roofline, max(bytes / ``bytes_per_s``, declared flops / ``flops_per_s``), summed (a
    TensorCore runs one instruction at a time; memory and compute overlap only within one).
    ``ragged_dot_fraction``: the share of experts a ``jax.lax.ragged_dot`` reads (hlo_traffic.program_traffic).
    ``inplace_stream_fraction``: the share of ``bytes_per_s`` the kernels that update a pool in place reach
    (the fused GDN kernel; chips.ChipPeaks.inplace_stream_fraction). ``custom_call_bytes``: bytes per execution
    of the custom calls whose op_name contains the key, instead of what they declare
    (hlo_traffic.program_traffic). ``gdn_recurrent_flops_per_s``: the rate of the fused GDN kernel's recurrent
    form (op_name scope ``RECURRENT_SCOPE``), whose declared flops run on the VPU
    (chips.ChipPeaks.gdn_recurrent_flops_per_s); None: ``flops_per_s``. ``gdn_chunked_flops_per_s``: the same for
    its chunked form (scope ``CHUNKED_SCOPE``, prefill), whose declared flops undercount the chunk's dependent
    64 x 64 products (chips.ChipPeaks.gdn_chunked_flops_per_s). ``ragged_dot_mxu_fraction``: the share of
    ``flops_per_s`` a ``jax.lax.ragged_dot`` reaches at its rows per group (chips.ChipPeaks.ragged_dot_mxu_fraction):
    its ``2 M K N`` flops, which it does not declare, are then charged at that rate and counted as declared;
    None: they are left to the caller's undeclared flops at the peak. ``grouped_ffn_mxu_fraction``: the same
    share for kernels/grouped_ffn at its rows per expert (chips.ChipPeaks.grouped_ffn_mxu_fraction), its declared
    flops charged at that rate; None: the peak."""
    ops = hlo_traffic.program_traffic(hlo_text, custom_call_bytes, ragged_dot_fraction=ragged_dot_fraction)
    rest = sorted((o for o in ops if o.opcode != "custom-call"), key=lambda o: -o.total)
    declared = serial = 0.0
    gdn_rates = ((RECURRENT_SCOPE, gdn_recurrent_flops_per_s), (CHUNKED_SCOPE, gdn_chunked_flops_per_s))
    for o in ops:
        f = 0.0 if _ATTENTION_KERNEL in o.op_name else o.flops
        rate = next((r for scope, r in gdn_rates if r and scope in o.op_name), flops_per_s)
        if ragged_dot_mxu_fraction and o.dot_flops:
            f, rate = o.dot_flops, flops_per_s * ragged_dot_mxu_fraction(o.rows_per_group)
        elif grouped_ffn_mxu_fraction and GROUPED_FFN in o.op_name and o.rows_per_group:
            rate = flops_per_s * grouped_ffn_mxu_fraction(o.rows_per_group)
        declared += f * o.count
        bw = bytes_per_s * (inplace_stream_fraction if any(k in o.op_name for k in _INPLACE_KERNELS) else 1.0)
        serial += o.count * max(o.bytes / bw, f / rate)
    return {
        "bytes": sum(o.total for o in ops), "kernel_bytes": sum(o.total for o in ops if o.opcode == "custom-call"),
        "top_excess": [{"op": o.name, "opcode": o.opcode, "source": o.op_name[-120:], "bytes": o.total,
                        "count": o.count} for o in rest[:n]],
        "declared_flops": declared, "serial_s": serial,
    }
