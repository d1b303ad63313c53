"""Collectives of a compiled step charged over the ICI: bytes, latency, and which are hidden behind compute.

Every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute the compiled HLO runs
(tools/hlo_traffic.py ``program_collectives``: loop bodies times their trips, SparseCore offloads included) is
charged :func:`chips.collective_time` on its largest replica group. An asynchronous one (started and
awaited apart) is overlapped with the work the schedule puts between its start and its done, up to that
work's own time (its HBM bytes at the device's bandwidth, or its declared kernel flops at the device's peak,
whichever is longer); the rest of it is exposed. A synchronous one is exposed whole. Exposed time adds to the
step; overlapped time does not.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sglang_tpu_qwen.tools import hlo_traffic
from sglang_tpu_qwen.tools.plan.chips import ChipPeaks, collective_time


def charge(hlo_texts: list[str], chip_of: list[tuple[int, ...]], chip: ChipPeaks) -> dict[str, Any]:
    """Collective time of the programs a step runs one after another on one device, from their compiled HLO
    ``hlo_texts``.

    ``chip_of``: chip coordinates of each global device id (the mesh's flattened order, which the HLO's
    replica groups index). Returns ``{"exposed", "overlapped", "total"}`` seconds (central figures),
    ``"exposed_low"`` / ``"exposed_high"`` (the chip model's fast and slow ends), ``"count"``, ``"ici_bytes_per_chip"``,
    and ``"by_kind"``: per (kind, group size, bytes) the count, seconds each and how much of it is exposed.
    All zero for programs without collectives (one device), on any chip.

    Raises:
        ValueError: a collective on a chip without an ICI model (``chip.ici`` None).
    """
    bw = chip.hbm_bytes_per_s / chip.devices_per_chip
    peak = chip.bf16_flops_per_s / chip.devices_per_chip
    out: dict[str, Any] = {"exposed": 0.0, "overlapped": 0.0, "total": 0.0, "exposed_low": 0.0, "exposed_high": 0.0,
                           "count": 0, "ici_bytes_per_chip": 0.0}
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "s_each": 0.0, "exposed_s": 0.0})
    for c in (c for text in hlo_texts for c in hlo_traffic.program_collectives(text)):
        if chip.ici is None:  # a chip planned alone (v5e): its programs have no collective to charge
            raise ValueError(f"{chip.name}: no ICI model for the program's {c.kind}")
        groups = c.groups or [[a, b] for a, b in c.pairs[:1]] or [[0]]
        group = max(groups, key=len)
        coords = [chip_of[i] for i in group if i < len(chip_of)]
        hide = max(c.overlap_bytes / bw, c.overlap_flops / peak) if c.is_async else 0.0
        t = {end: collective_time(c.kind, c.in_bytes, c.out_bytes, coords, chip.ici, end)
             for end in ("central", "low", "high")}
        exposed = max(0.0, t["central"]["s"] - hide)
        out["total"] += c.count * t["central"]["s"]
        out["exposed"] += c.count * exposed
        out["overlapped"] += c.count * (t["central"]["s"] - exposed)
        out["exposed_low"] += c.count * max(0.0, t["low"]["s"] - hide)
        out["exposed_high"] += c.count * max(0.0, t["high"]["s"] - hide)
        out["count"] += c.count
        out["ici_bytes_per_chip"] += c.count * t["central"]["ici_bytes_per_chip"]
        key = f"{c.kind} x{len(group)} {int(c.in_bytes)}->{int(c.out_bytes)} B"
        by_kind[key]["count"] += c.count
        by_kind[key]["s_each"] = t["central"]["s"]
        by_kind[key]["exposed_s"] += c.count * exposed
    out["by_kind"] = dict(by_kind)
    return out
