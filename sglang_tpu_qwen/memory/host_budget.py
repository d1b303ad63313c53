"""How much host memory the GDN snapshot host tier may hold: the default rule and a live low-memory guard.

Default (`--gdn-snapshot-host-gb` not given): HOST_TIER_SHARE of the host memory available at start (the
kernel's MemAvailable, read through psutil), at most HOST_TIER_CAP_BYTES. An explicit value overrides it;
0 turns the tier off. SGLang's HiCache sizes its host pool as a ratio of the device pool (`--hicache-ratio`)
or in GB (`--hicache-size`); a GDN snapshot pool has no device-side size to scale here (the tree evicts
snapshots by score), so the default follows the host instead.

The budget is a cap on the bytes the tier stores, not an allocation: nothing is reserved at start, and
memory is used only as snapshots are demoted. Several servers on one machine each take their own share of
what was available when they started, so together they could claim more than the host has; the guard
below therefore refuses a demotion (the snapshot is dropped and its prefix recomputed on the next hit)
whenever it would leave less than HOST_RESERVE_SHARE of the machine's memory available, whatever the
budget says.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from sglang_tpu_qwen.args.server_args import ServerArgs

logger = logging.getLogger(__name__)

HOST_TIER_SHARE = 0.25  # of MemAvailable at start
HOST_TIER_CAP_BYTES = 128 * 2**30  # per server; a TPU host has hundreds of GB
HOST_RESERVE_SHARE = 0.10  # of total host memory: no demotion below this much available


def host_available_bytes() -> int:
    """Host memory available now (bytes): Linux MemAvailable (free + reclaimable cache), psutil elsewhere."""
    return int(psutil.virtual_memory().available)


def default_host_tier_bytes(available_bytes: int) -> int:
    """The default budget for `available_bytes` free at start: min(HOST_TIER_SHARE x available, cap)."""
    return max(0, min(int(HOST_TIER_SHARE * available_bytes), HOST_TIER_CAP_BYTES))


@dataclass(frozen=True)
class HostTierBudget:
    """The host tier's budget as resolved at start (reported in the log and /get_server_info).

    budget_bytes: over all DP ranks (each rank stores at most budget_bytes // dp). rule: "default",
    "explicit" or "off" (--disable-radix-cache: no tree to hold host snapshots). available_bytes_at_start:
    MemAvailable when the default was computed (None for an explicit value).
    """

    budget_bytes: int
    rule: str
    available_bytes_at_start: int | None
    share: float = HOST_TIER_SHARE
    cap_bytes: int = HOST_TIER_CAP_BYTES
    reserve_share: float = HOST_RESERVE_SHARE

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_host_tier(args: ServerArgs, available_bytes: int | None = None) -> HostTierBudget:
    """Fill in --gdn-snapshot-host-gb's default (GiB, as the rest of the flag's users read it) and log it.

    Called once by the Engine before the runner is built; a value already set (explicit, or a second call)
    is kept. `available_bytes`: host memory available (default: read now).
    """
    if args.disable_radix_cache:
        if args.gdn_snapshot_host_gb is None:
            args.gdn_snapshot_host_gb = 0.0
        return HostTierBudget(0, "off", None)
    if args.gdn_snapshot_host_gb is not None:
        budget = HostTierBudget(int(args.gdn_snapshot_host_gb * 2**30), "explicit", None)
    else:
        avail = host_available_bytes() if available_bytes is None else available_bytes
        budget = HostTierBudget(default_host_tier_bytes(avail), "default", avail)
        args.gdn_snapshot_host_gb = budget.budget_bytes / 2**30
    if budget.rule == "default":
        logger.info("GDN snapshot host tier: %.2f GiB (default: %.0f%% of the %.1f GiB available at start, at most "
                    "%d GiB; a cap on stored snapshots, not an allocation)", budget.budget_bytes / 2**30,
                    100 * HOST_TIER_SHARE, budget.available_bytes_at_start / 2**30, HOST_TIER_CAP_BYTES // 2**30)
    else:
        logger.info("GDN snapshot host tier: %s", f"{budget.budget_bytes / 2**30:.2f} GiB (--gdn-snapshot-host-gb)"
                    if budget.budget_bytes else "off (--gdn-snapshot-host-gb 0)")
    return budget


class HostMemoryGuard:
    """Refuses host-tier stores that would leave less than `reserve_bytes` of host memory available.

    The default reserve is HOST_RESERVE_SHARE of the machine's total memory. Reads MemAvailable on each
    call (~tens of microseconds, once per demoted snapshot).
    """

    def __init__(self, reserve_bytes: int | None = None) -> None:
        self.reserve_bytes = (int(HOST_RESERVE_SHARE * psutil.virtual_memory().total)
                              if reserve_bytes is None else reserve_bytes)

    def allows(self, nbytes: int) -> bool:
        """Whether storing `nbytes` more keeps the host's available memory at or above the reserve."""
        return host_available_bytes() - nbytes >= self.reserve_bytes
