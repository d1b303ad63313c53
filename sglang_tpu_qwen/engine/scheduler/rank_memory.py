"""RankMemory: the KV pages, GDN running slots and prefix cache of one data-parallel attention rank.

With `--dp-size N` every rank owns a contiguous block of the global page and slot ids (the device cache
is split over the mesh's batch axes the same way, parallel/sharding.py), so the scheduler keeps one free
list per rank and a request only ever holds ids of the rank it was admitted to. With dp = 1 there is a
single rank owning everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner
from sglang_tpu_qwen.engine.scheduler.prefix_cache import PrefixCache
from sglang_tpu_qwen.memory.id_pool import IdPool


@dataclass
class RankMemory:
    """One DP rank's pools (global ids) and its radix tree (None with --disable-radix-cache)."""

    rank: int
    kv_pool: IdPool
    slot_pool: IdPool
    prefix_cache: PrefixCache | None
    max_running: int
    page_size: int

    @classmethod
    def build(cls, runner: ModelRunner, args: ServerArgs, rank: int) -> RankMemory:
        """Pools over rank `rank`'s id blocks: pages [base+1, base+num_pages), running slots
        [base+1, base+num_running_slots); the prefix cache takes the rank's snapshot slots."""
        sizing = runner.sizing
        page_base, slot_base = sizing.page_base(rank), sizing.slot_base(rank)
        kv_pool = IdPool(page_base + sizing.num_pages, "page", start=page_base + 1)
        slot_pool = IdPool(slot_base + sizing.num_running_slots, "slot", start=slot_base + 1)
        prefix_cache = None if args.disable_radix_cache else PrefixCache(
            runner, kv_pool, sizing.page_size, int((args.gdn_snapshot_host_gb or 0) * 2**30) // sizing.dp,
            args.debug_nan_fill_freed_slots, slot_base=slot_base)
        return cls(rank, kv_pool, slot_pool, prefix_cache, sizing.max_running_per_rank, sizing.page_size)

    def usage(self) -> dict[str, Any]:
        """Pool usage of this rank (KV pages held by the prefix cache are not free until evicted)."""
        out: dict[str, Any] = {
            "kv_pages_total": self.kv_pool.num_usable,
            "kv_pages_free": self.kv_pool.num_free,
            "gdn_slots_total": self.slot_pool.num_usable,
            "gdn_slots_free": self.slot_pool.num_free,
            "page_size": self.page_size,
            "radix_cache": self.prefix_cache is not None,
        }
        if self.prefix_cache is not None:
            out.update(self.prefix_cache.stats())
        return out
