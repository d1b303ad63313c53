"""Chip models: peak compute and HBM, the inter-chip interconnect (ICI), and the cost of one collective.

Each figure carries its source, or is marked as an assumption with the range the planner's sensitivity
figures use (``low`` = the fast end, ``high`` = the slow end).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Figure:
    """A value with its provenance: ``source`` (public, cited) or ``assumption`` with a ``low``..``high``
    range (the planner reports collective time at both ends)."""

    value: float
    unit: str
    source: str = ""
    assumption: str = ""
    low: float | None = None
    high: float | None = None

    def at(self, end: str) -> float:
        """The value at ``end``: "central", "low" or "high" (sourced figures have no range: the value)."""
        if end == "low" and self.low is not None:
            return self.low
        if end == "high" and self.high is not None:
            return self.high
        return self.value


@dataclasses.dataclass(frozen=True)
class IciModel:
    """How a collective's bytes and latency are charged (chips.py :func:`collective_time`).

    ``link_bytes_per_s``: one ICI link, one direction. ``links_per_neighbour``: links between two adjacent
    chips of the slice. ``d2d_bytes_per_s``: between the two TensorCores of one chip, one direction.
    ``latency_s``: fixed cost of one collective (launch, barrier, SparseCore offload). ``hop_latency_s``: per
    chip-to-chip hop on the longest path of a group."""

    chip_bidir_bytes_per_s: Figure
    links_per_chip: Figure
    links_per_neighbour: Figure
    d2d_bytes_per_s: Figure
    latency_s: Figure
    hop_latency_s: Figure
    topology: str

    def link_bytes_per_s(self, end: str = "central") -> float:
        """One link, one direction: the chip's bidirectional ICI bandwidth over its links, halved. The fast
        end pairs the fewest links per chip (each link faster), the slow end the most."""
        links = {"low": self.links_per_chip.low, "high": self.links_per_chip.high}.get(end) or self.links_per_chip.value
        return self.chip_bidir_bytes_per_s.value / links / 2


@dataclasses.dataclass(frozen=True)
class ChipPeaks:
    """Per-chip peak figures and where they come from."""

    name: str
    devices_per_chip: int
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    source: str
    ici: IciModel | None = None
    # The share of ``hbm_bytes_per_s`` a Pallas kernel reaches when it streams a pool's blocks in and writes
    # them back in place (the GDN recurrent state at decode): reads and writes share the HBM, and on the v5e
    # such a stream stays well under peak however the copies are sized or queued. 1.0 where not measured.
    inplace_stream_fraction: float = 1.0
    inplace_stream_source: str = "not measured on this chip: peak assumed"
    # The rate at which the fused GDN kernel's recurrent form (decode, a speculative verify's k + 1 tokens) runs
    # the flops it declares, per device (one TensorCore runs a kernel): token by token on the VPU, in float32, not
    # on the MXU. None: charged at the device's MXU peak.
    gdn_recurrent_flops_per_s: float | None = None
    gdn_recurrent_source: str = "not measured on this chip: the MXU peak"
    # The same for the kernel's chunked form (prefill): its declared flops (6 dk dv a token and value head, the
    # state products) per second, measured. The chunk's 64 x 64 products (the WY inverse, the in-chunk
    # attention) are a chain of dependent MXU ops it does not declare. None: the MXU peak.
    gdn_chunked_flops_per_s: float | None = None
    gdn_chunked_source: str = "not measured on this chip: the MXU peak"
    # ``jax.lax.ragged_dot`` (the bf16 MoE grouped matmul) as a share of ``bf16_flops_per_s`` against the rows per
    # group, measured: ``((rows per group, fraction), ...)`` ascending. Empty: the peak.
    ragged_dot_mxu_points: tuple[tuple[float, float], ...] = ()
    ragged_dot_source: str = "not measured on this chip: the MXU peak"

    # The same for kernels/grouped_ffn (prefill and verify-sized steps' dense experts: gate, up and down in one
    # kernel; measured with 256-row tiles, so points under 128 rows an expert read the first) against
    # its rows per expert; its declared flops (``6 M H I``) are charged at that share.
    grouped_ffn_mxu_points: tuple[tuple[float, float], ...] = ()
    grouped_ffn_source: str = "not measured on this chip: the MXU peak"

    def ragged_dot_mxu_fraction(self, rows_per_group: float) -> float:
        """The share of the bf16 peak a ragged dot of ``rows_per_group`` rows per group reaches: linear in
        ``log(rows)`` between the measured points, the nearest point's outside them (not extrapolated); 1.0 where
        nothing was measured."""
        return _log_linear(self.ragged_dot_mxu_points, rows_per_group)

    def grouped_ffn_mxu_fraction(self, rows_per_expert: float) -> float:
        """The share of the bf16 peak kernels/grouped_ffn reaches at ``rows_per_expert``, as
        :meth:`ragged_dot_mxu_fraction` reads its points."""
        return _log_linear(self.grouped_ffn_mxu_points, rows_per_expert)


def _log_linear(pts: tuple[tuple[float, float], ...], x: float) -> float:
    """``pts`` ``((x, y), ...)`` ascending in x, read at ``x``: linear in ``log(x)`` between points, the nearest
    point's y outside them; 1.0 without points."""
    if not pts:
        return 1.0
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return pts[-1][1]


TPU7X_ICI = IciModel(
    chip_bidir_bytes_per_s=Figure(
        1.2e12, "B/s", source="Google's Ironwood announcement (blog.google, Apr 2025): ICI 1.2 TB/s bidirectional "
        "per chip, 1.5x Trillium"),
    links_per_chip=Figure(
        6, "links", assumption="a 3D torus like v5p's (TPU7x docs: 'shares many similarities with TPU v5p'): 6 ports; "
        "4 at the fast end (150 GB/s per link and direction), 6 at the slow end (100 GB/s)", low=4, high=6),
    links_per_neighbour=Figure(
        1, "links", assumption="a 2x2x1 slice is a mesh (v5p docs: full torus wraparound from one cube up): one "
        "link to each of a chip's 2 neighbours; 2 at the fast end (twin links)", low=2, high=1),
    d2d_bytes_per_s=Figure(
        400e9, "B/s", assumption="die-to-die between a chip's two TensorCores, one direction: not public; "
        "200-1000 GB/s",
        low=1000e9, high=200e9),
    latency_s=Figure(
        5e-6, "s", assumption="fixed cost of one SparseCore-offloaded collective (launch, barrier): not published for "
        "Ironwood; 2-10 us (third-party write-ups quote < 10 us for a small all-reduce)", low=2e-6, high=10e-6),
    hop_latency_s=Figure(
        1e-6, "s", assumption="per chip-to-chip hop: ~1 us (the JAX scaling book's order of magnitude for ICI); "
        "0.5-2 us", low=0.5e-6, high=2e-6),
    topology="2D/3D mesh of chips, 2 TensorCores (JAX devices) per chip; mesh distances between chip coordinates",
)

CHIPS = {
    "tpu7x": ChipPeaks(
        name="TPU7x (Ironwood)", devices_per_chip=2, hbm_bytes=192 * 2**30, hbm_bytes_per_s=7380e9,
        bf16_flops_per_s=2307e12, fp8_flops_per_s=4614e12,
        source="Google Cloud TPU7x docs (docs.cloud.google.com/tpu/docs/tpu7x): per chip 2307 TFLOP/s BF16, "
               "4614 TFLOP/s FP8, 192 GiB HBM, 7380 GB/s HBM, 2 TensorCores",
        ici=TPU7X_ICI,
    ),
    # The chip the project measures on (DESIGN.md section 9): its plans are set beside its measurements
    # (bench/decode_step.py) before the same model's Ironwood figures are believed.
    "v5e": ChipPeaks(
        name="TPU v5e", devices_per_chip=1, hbm_bytes=16 * 2**30, hbm_bytes_per_s=819e9,
        bf16_flops_per_s=197e12, fp8_flops_per_s=197e12,
        source="Google Cloud TPU v5e docs (docs.cloud.google.com/tpu/docs/v5e): per chip 197 TFLOP/s BF16, "
               "393 TOP/s Int8, 16 GB HBM2 at 819 GB/s (a later revision of the page says 800 GiB/s), one "
               "TensorCore; no FP8 MXU, so FP8 weights run at the BF16 peak. JAX reports 15.75 GiB of it usable",
        inplace_stream_fraction=0.74,
        inplace_stream_source="measured on the chip (bench/kernels.py, 'state copy' rows, 2026-12-06): a Pallas "
                              "kernel that only copies 64 rows' float32 GDN states in place, 1 MiB blocks, runs at "
                              "74-77% of 819 GB/s; dev sweeps of 0.25-16 MiB blocks and 2-8 copies in flight gave "
                              "the same, reads alone 76-81%, writes alone 62-72%",
        gdn_recurrent_flops_per_s=1.89e12,
        gdn_recurrent_source="measured on the chip, 2026-12-08 (bench/kernels.py --sections gdn-verify, 35B layout): "
                             "a verify's 4 tokens over 64 rows' float32 state (805 MFLOP declared) in 426.2 us with "
                             "each head's state in registers between tokens (446.7 us stored to VMEM every token, "
                             "557 us with the k and q lane broadcasts on the XLU), its state read at 315 GB/s: the "
                             "VPU work bounds it. The deviceless v5e schedule of its 2 MiB grid step: 7,084 bundles "
                             "(7,706 with the per-token stores, 9,037 before the MXU broadcasts)",
        gdn_chunked_flops_per_s=9.3e12,
        gdn_chunked_source="measured on the chip, 2026-12-07 (bench/kernels.py --sections gdn-prefill, 35B layout, "
                           "bf16, 16 chunk chains a grid step): a 2,048-token step's chunked form (6.44 GFLOP "
                           "declared) in 0.693 ms at 32 x 64 (the 64 x 512 prefill's steps), 0.670 at 8 x 256, "
                           "0.635 at 1 x 2,048; 4.7% of the bf16 peak. It was 8.1 with 8 chains a step and 3.68 "
                           "before the chunks' products were emitted breadth first",
        ragged_dot_mxu_points=((128, 0.26), (256, 0.32), (2048, 0.64)),
        ragged_dot_source="measured on the chip, 2026-12-06, bf16 at the 35B-A3B's expert shapes (128 experts, "
                          "hidden 2048, intermediate 512), gate/up then down: 128 rows a group from the 64 x 512 "
                          "prefill profile (150.4 ms of ragged_dot over 19 steps of 2,048 tokens x 4 layers, 7.84 "
                          "TFLOP), 256 and 2,048 from bench/grouped_matmul.py (4,096 and 32,768 tokens a call). "
                          "Decode rows (a few a group) read their bytes at 78-88% of HBM peak: bytes bound them",
        grouped_ffn_mxu_points=((128, 0.316), (256, 0.324), (1024, 0.672), (2048, 0.761)),
        grouped_ffn_source="measured on the chip, 2026-12-07 (bench/grouped_matmul.py, bf16, row tiles of 256): "
                           "the 35B-A3B's experts (hidden 2048, intermediate 512) at 2,048 / 4,096 / 32,768 tokens "
                           "x top-8 over 128 experts in 1,654 / 3,230 / 11,004 us, and over 256 experts at 32,768 "
                           "tokens (1,024 rows an expert) in 12,466 us",
    ),
}  # fmt: skip
# JAX's ``device_kind`` of each chip's devices -> its key in CHIPS (benchmarks take the peaks of the chip they run
# on from here).
DEVICE_KINDS = {"TPU7x": "tpu7x", "TPU v5 lite": "v5e"}


def collective_time(kind: str, in_bytes: float, out_bytes: float, group_chips: list[tuple[int, ...]],
                    ici: IciModel, end: str = "central") -> dict[str, float]:
    """Seconds and ICI bytes of one collective over one replica group, per device.

    ``group_chips``: the chip coordinates of the group's devices (one entry per device; two devices of one
    chip share coordinates). With ``c`` chips of ``d`` devices each (``g = c * d``):
    - all-gather (result ``B = out_bytes``): each chip takes in ``d * (c - 1) / c * B`` over ICI, each device
      ``(d - 1) / d * B`` from its sibling core;
    - reduce-scatter (operand ``B = in_bytes``): the same amounts sent; all-reduce: twice a reduce-scatter;
    - all-to-all (``B = in_bytes``): as an all-gather of ``B``, times the group's mean hop count;
    - collective-permute: ``in_bytes`` over one link.
    ICI bytes move over the chip's links to its neighbours in the group (a bandwidth-optimal ring or torus
    algorithm), time = latency + hops * hop latency + ICI bytes / (links * link bandwidth) + sibling bytes /
    die-to-die bandwidth. Returns ``{"s", "ici_bytes_per_chip", "d2d_bytes"}``.
    """
    chips = sorted(set(group_chips))
    c = len(chips)
    d = max(1, len(group_chips) // max(c, 1))
    dist = [sum(abs(a - b) for a, b in zip(x, y, strict=True)) for x in chips for y in chips if x != y]
    hops = max(dist, default=0)
    mean_hops = sum(dist) / len(dist) if dist else 0.0
    neighbours = 0 if c == 1 else max(1, min(2 * len(chips[0]), sum(1 for h in dist if h == 1) // c))
    b = out_bytes if kind == "all-gather" else in_bytes
    factor = {"all-reduce": 2.0, "all-to-all": max(mean_hops, 1.0)}.get(kind, 1.0)
    if kind == "collective-permute":
        ici_b, d2d_b = (b if c > 1 else 0.0), (0.0 if c > 1 else b)
    else:
        ici_b = factor * d * (c - 1) / c * b if c > 1 else 0.0
        d2d_b = factor * (d - 1) / d * b
    link_bw = ici.link_bytes_per_s(end) * ici.links_per_neighbour.at(end) * max(neighbours, 1)
    t = ici.latency_s.at(end) + hops * ici.hop_latency_s.at(end)
    t += ici_b / link_bw + d2d_b / ici.d2d_bytes_per_s.at(end)
    return {"s": t, "ici_bytes_per_chip": ici_b, "d2d_bytes": d2d_b}
