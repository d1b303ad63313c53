"""How one DP rank's memory is split between GDN state slots and KV pages (SGLang's mamba / full-attention rule).

SGLang (``ModelRunner``'s mamba cache handling) gives a hybrid model's state pool the share
``r / (1 + r)`` of the memory left after the weights, ``r`` = ``--mamba-full-memory-ratio`` (state bytes :
KV bytes, default 0.9), unless ``--max-mamba-cache-size`` fixes the pool's slot count; the KV pool gets the
rest. Its state pool holds the running requests' states and the prefix cache's, as ours does: running slots
first, snapshot slots after them. The rule here, per DP rank (each device holds one rank's pools):

* Budget ``B``. On a device with a memory limit ``M``: ``S - weights - vision - sampling`` (``vision``: the
  vision encoder's ``memory_bytes()``, its weights, encoder cache cap and largest bucket's activations, 0 for a
  text-only checkpoint; SGLang's profile measures what is free after loading the whole model, ViT included;
  ``sampling``: the sampling programs' resident inputs, a [B, V] int32 penalty table per sampling batch size
  among them: 1.96 GiB at 256 running requests with MTP, whose verify steps sample 4 positions a row).
  ``S`` is ``M * --mem-fraction-static`` (SGLang's static memory: weights and pools), unless the ``(1 - f) * M``
  that leaves is less than the step programs' temporaries ``T`` (the largest, read from XLA's analysis of the
  compiled programs: engine/runner/program_memory.py) plus a runtime headroom ``RUNTIME_HEADROOM * M`` (step
  inputs and outputs, sampling tables, the runtime's own): then ``S = M - T - headroom``. Without a
  limit (XLA:CPU) ``B`` is nominal: ``(1 + r)`` times the KV pool (``--max-total-tokens``, else
  DEFAULT_KV_TOKENS_WITHOUT_LIMIT), so the state pool gets ``r`` times the KV pool's bytes.
* State slots ``N`` (the trash slot, ``R`` running, ``S`` snapshots). ``--max-gdn-snapshots S``: ``N = 1 + R +
  S``. Else ``--max-mamba-cache-size C`` (over all DP ranks, like SGLang's): ``N = 1 + C / dp``, at least the
  running requests. Else the ratio: ``N = floor(share / slot bytes)`` with share ``B * r / (1 + r)`` (or, when
  ``--max-total-tokens`` fixes the KV pool on a device with a limit, what ``B`` leaves after it). Running slots
  are always there: when the share holds fewer, there are no snapshots and the running slots come out of the KV
  share. Without the prefix cache (or GDN layers) ``S = 0``.
* KV pages: ``--max-total-tokens``, else (device limit) what ``B`` leaves after the ``N`` slots, at least 4
  pages (ValueError otherwise), else DEFAULT_KV_TOKENS_WITHOUT_LIMIT tokens.
* Fixed sizes (``--max-total-tokens``, the running slots) may exceed ``B``; pools, weights, vision and ``T``
  together beyond ``M`` are ``MemorySplit.check_fits``'s ValueError naming the flags to change: the server's
  runner calls it, so a pool the device cannot hold fails at start, not at the first request.

Everything here is integers and bytes: no JAX, no devices (callers pass the limit and the weights' bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

GB = 1 << 30
# KV pool when the device reports no memory limit (XLA:CPU) and --max-total-tokens is absent.
DEFAULT_KV_TOKENS_WITHOUT_LIMIT = 65536
MIN_KV_PAGES = 4
# Share of device memory kept beyond the programs' temporaries: step inputs and outputs, the sampling tables
# ([B, V] penalty counts), the runtime's own allocations.
RUNTIME_HEADROOM = 0.03


@dataclasses.dataclass(frozen=True)
class MemorySplit:
    """One DP rank's pools and the rule that sized them (``/get_server_info`` ``memory_split``).

    Attributes:
        rule: which rule set the state slots: "ratio" (--mamba-full-memory-ratio of the budget), "ratio of the
            KV pool" (no device limit), "after the KV pool" (--max-total-tokens on a device with a limit),
            "--max-gdn-snapshots", "--max-mamba-cache-size", "running only" (no prefix cache or no GDN layers).
        ratio: --mamba-full-memory-ratio.
        device_limit: bytes the device lets the runtime use (None: no limit, XLA:CPU).
        budget: the bytes the pools share (B above); nominal without a device limit.
        weight_bytes: the weights on the fullest device.
        running_slots: slots of running requests (the trash slot not counted).
        snapshot_slots: GDN snapshot slots of the prefix cache.
        slot_bytes: bytes of one GDN slot (all GDN layers, at the state dtype).
        num_pages: KV pages including the trash page.
        page_bytes: bytes of one KV page (every attention layer's K and V).
        page_size: tokens per page.
        vision_bytes: the vision encoder's bytes taken out of the budget first (0: no vision tower).
        sampling_bytes: the sampling programs' resident "unused" inputs (StepExecutor.unused_inputs: per
            sampling batch size a [B, V] int32 penalty table, the grammar bitmask, bias and ban ids), taken out
            of the budget like the vision encoder (0: none).
        temporaries: the largest compiled program's temporaries the split reserved room for (0: none read).
        static_bytes: S above: weights, vision and pools may take this much (the device limit on a device
            without a limit: 0).
    """

    rule: str
    ratio: float
    device_limit: int | None
    budget: int
    weight_bytes: int
    running_slots: int
    snapshot_slots: int
    slot_bytes: int
    num_pages: int
    page_bytes: int
    page_size: int
    vision_bytes: int = 0
    temporaries: int = 0
    static_bytes: int = 0
    sampling_bytes: int = 0

    @property
    def num_slots(self) -> int:
        """Trash + running + snapshot slots."""
        return 1 + self.running_slots + self.snapshot_slots

    @property
    def kv_tokens(self) -> int:
        """Usable KV tokens (the trash page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def state_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def over_budget(self) -> int:
        """Bytes the pools take beyond the budget on a device with a limit (0 within it): fixed sizes
        (--max-total-tokens, the running slots) may exceed it, eating into the temporaries' room."""
        return max(0, self.state_bytes + self.kv_bytes - self.budget) if self.device_limit else 0

    @property
    def device_bytes(self) -> int:
        """Pools, weights, vision encoder, resident sampling inputs and the programs' temporaries: what the
        device must hold."""
        return (self.state_bytes + self.kv_bytes + self.weight_bytes + self.vision_bytes + self.sampling_bytes
                + self.temporaries)

    def check_fits(self) -> None:
        """Raise ValueError (the figures and the flags to change) when the device cannot hold ``device_bytes``
        (a fixed --max-total-tokens or running-slot count too large); nothing on a device without a limit."""
        if not self.device_limit or self.device_bytes <= self.device_limit:
            return
        raise ValueError(
            f"the pools do not fit the device: KV {self.kv_bytes / GB:.2f} GiB + GDN state "
            f"{self.state_bytes / GB:.2f} GiB + weights {self.weight_bytes / GB:.2f} GiB + vision encoder "
            f"{self.vision_bytes / GB:.2f} GiB + sampling inputs {self.sampling_bytes / GB:.2f} GiB + "
            f"program temporaries {self.temporaries / GB:.2f} GiB = "
            f"{self.device_bytes / GB:.2f} GiB > {self.device_limit / GB:.2f} GiB; lower --max-total-tokens / "
            "--max-running-requests / --max-gdn-snapshots / --max-mamba-cache-size or --chunked-prefill-size")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able figures (bytes, slot and token counts) for /get_server_info and the startup log."""
        return {
            "rule": self.rule, "mamba_full_memory_ratio": self.ratio, "device_limit_bytes": self.device_limit,
            "budget_bytes": self.budget, "weight_bytes": self.weight_bytes, "vision_encoder_bytes": self.vision_bytes,
            "kv_pool_bytes": self.kv_bytes, "kv_pool_tokens": self.kv_tokens, "kv_pages": self.num_pages - 1,
            "running_slots": self.running_slots, "snapshot_slots": self.snapshot_slots,
            "state_slot_bytes": self.slot_bytes, "running_slots_bytes": (1 + self.running_slots) * self.slot_bytes,
            "snapshot_slots_bytes": self.snapshot_slots * self.slot_bytes, "state_pool_bytes": self.state_bytes,
            "over_budget_bytes": self.over_budget, "program_temp_bytes": self.temporaries,
            "static_bytes": self.static_bytes, "sampling_input_bytes": self.sampling_bytes,
        }  # fmt: skip

    def describe(self) -> str:
        """One log line: the split and the rule."""
        limit = f"{self.device_limit / GB:.2f} GiB device" if self.device_limit else "no device limit"
        vision = f", vision encoder {self.vision_bytes / GB:.3f} GiB" if self.vision_bytes else ""
        temps = f", program temporaries {self.temporaries / GB:.3f} GiB" if self.temporaries else ""
        sampling = f", sampling inputs {self.sampling_bytes / GB:.3f} GiB" if self.sampling_bytes else ""
        return (f"memory split per DP rank ({limit}, weights {self.weight_bytes / GB:.3f} GiB{vision}{sampling}"
                f"{temps}, budget {self.budget / GB:.3f} GiB, rule: {self.rule}, --mamba-full-memory-ratio "
                f"{self.ratio}): KV {self.kv_tokens} tokens ({self.kv_bytes / GB:.3f} GiB); GDN state "
                f"{self.running_slots} running + {self.snapshot_slots} snapshot slots "
                f"({self.state_bytes / GB:.3f} GiB, {self.slot_bytes} bytes a slot)"
                + (f"; {self.over_budget / GB:.3f} GiB over the budget (--max-total-tokens and the running slots "
                   "are fixed sizes)" if self.over_budget else ""))


def split_memory(
    *, page_bytes: int, slot_bytes: int, page_size: int, running_slots: int, device_limit: int | None,
    weight_bytes: int, mem_fraction_static: float, ratio: float, max_total_tokens: int | None = None,
    max_mamba_cache_size: int | None = None, max_snapshots: int | None = None, snapshots: bool = True,
    vision_bytes: int = 0, temporaries: int = 0, sampling_bytes: int = 0,
) -> MemorySplit:
    """Split one DP rank's memory between GDN slots and KV pages by the rule in this module's docstring.

    Args:
        page_bytes, slot_bytes: one KV page / one GDN slot at the cache dtypes (memory_accounting.CacheUnits);
            slot_bytes 0 for a model without GDN layers.
        running_slots: running requests of the rank (ceil(--max-running-requests / dp)).
        device_limit: bytes the device may use; None without a limit (XLA:CPU).
        weight_bytes: the weights on the fullest device.
        max_total_tokens: --max-total-tokens (the rank's KV pool), or None.
        max_mamba_cache_size: --max-mamba-cache-size divided over the DP ranks (running + snapshot slots).
        max_snapshots: --max-gdn-snapshots (per rank).
        snapshots: the prefix cache keeps GDN snapshots (radix cache on and GDN layers present).
        vision_bytes: the vision encoder's bytes per device (VisionEncoder.memory_bytes), out of the budget
            before the split; 0 for a text-only checkpoint.
        temporaries: the largest step program's temporaries per device (program_memory.py; 0: not known).
        sampling_bytes: the sampling programs' resident inputs per device (MemorySplit.sampling_bytes), out of
            the budget before the split.
    Raises:
        ValueError: --max-mamba-cache-size under the running requests, no budget left after the weights,
            or fewer than MIN_KV_PAGES KV pages left (the message has the figures and what to change).
            Fixed sizes the device cannot hold are `MemorySplit.check_fits`'s error (the planner reports them).
    """
    kv_fixed = max_total_tokens // page_size + 1 if max_total_tokens else None
    kv_nominal = kv_fixed or DEFAULT_KV_TOKENS_WITHOUT_LIMIT // page_size + 1  # the pool without a device limit
    static = 0
    if device_limit:
        static = int(device_limit * mem_fraction_static)
        need = temporaries + int(RUNTIME_HEADROOM * device_limit)
        if device_limit - static < need:  # --mem-fraction-static leaves too little room for the programs
            static = device_limit - need
        budget = static - weight_bytes - vision_bytes - sampling_bytes
        if budget <= 0:
            vision = (f" and the vision encoder ({vision_bytes / GB:.2f} GB: lower --mm-embedding-cache-size-mb "
                      "or --mm-max-patches)") if vision_bytes else ""
            sampling = (f" and the sampling programs' resident inputs ({sampling_bytes / GB:.2f} GB: lower "
                        "--max-running-requests or give fewer --precompile-bs-paddings)") if sampling_bytes else ""
            raise ValueError(f"not enough device memory: {device_limit / GB:.2f} GB x --mem-fraction-static "
                             f"{mem_fraction_static} (at most the device less {need / GB:.2f} GB of program "
                             f"temporaries and headroom) does not hold the weights ({weight_bytes / GB:.2f} GB)"
                             f"{vision}{sampling}; raise --mem-fraction-static, lower --chunked-prefill-size / "
                             "--max-running-requests (smaller programs) or use more devices")
    else:
        budget = int((1 + ratio) * kv_nominal * page_bytes)
    least = 1 + running_slots
    if not snapshots or slot_bytes == 0:
        rule, num_slots = "running only", least
    elif max_snapshots is not None:
        rule, num_slots = "--max-gdn-snapshots", least + max_snapshots
    elif max_mamba_cache_size is not None:
        if max_mamba_cache_size < running_slots:
            raise ValueError(f"--max-mamba-cache-size holds {max_mamba_cache_size} GDN slots per DP rank, fewer than "
                             f"the {running_slots} running requests per rank (--max-running-requests); raise it")
        rule, num_slots = "--max-mamba-cache-size", 1 + max_mamba_cache_size
    else:
        if not device_limit:
            rule, share = "ratio of the KV pool", budget - kv_nominal * page_bytes
        elif kv_fixed is not None:
            rule, share = "after the KV pool", budget - kv_fixed * page_bytes
        else:
            rule, share = "ratio", int(budget * ratio / (1 + ratio))
        num_slots = max(least, share // slot_bytes)
    if not device_limit:
        num_pages = kv_nominal
    elif kv_fixed is not None:
        num_pages = kv_fixed
    else:
        left = budget - num_slots * slot_bytes
        num_pages = left // page_bytes
        if num_pages - 1 < MIN_KV_PAGES:
            raise ValueError(
                f"not enough device memory for the KV pool: {device_limit / GB:.2f} GB x --mem-fraction-static "
                f"{mem_fraction_static} - weights {weight_bytes / GB:.2f} GB - vision encoder "
                f"{vision_bytes / GB:.2f} GB - {num_slots} GDN slots "
                f"{num_slots * slot_bytes / GB:.2f} GB leaves {max(left, 0) / GB:.3f} GB, under {MIN_KV_PAGES} pages "
                f"of {page_bytes} bytes; raise --mem-fraction-static, lower --max-running-requests / "
                "--max-gdn-snapshots / --max-mamba-cache-size / --mamba-full-memory-ratio, or use more devices")
    return MemorySplit(rule=rule, ratio=ratio, device_limit=device_limit or None, budget=budget,
                       weight_bytes=weight_bytes, running_slots=running_slots, snapshot_slots=num_slots - least,
                       slot_bytes=slot_bytes, num_pages=num_pages, page_bytes=page_bytes, page_size=page_size,
                       vision_bytes=vision_bytes, temporaries=temporaries, static_bytes=static,
                       sampling_bytes=sampling_bytes)
