"""Host tier for GDN snapshots: a byte-bounded, LRU-ordered store of evicted snapshots in host memory.

A snapshot evicted from the device snapshot slots moves here (when the --gdn-snapshot-host-gb budget is
above 0, the default: memory/host_budget.py) under a host id, and the radix tree keeps pointing at it; a
later hit uploads it straight into the request's running slot. Host ids live above HOST_ID_BASE so they
can never be mistaken for device slot ids.

Demotion does not wait for the device. An entry arrives as device arrays whose copy to the host has
started (gdn_state.read_slot_async); it stays *pending* until `settle` finds the copy done and keeps only
the host arrays (freeing the device copy). A hit on a pending entry uploads from the device copy, with no
host round trip. Pending entries hold at most MAX_PENDING_BYTES of device memory (Qwen3.5-397B: ~5 fp32
snapshots of ~184 MiB; thousands of the embedded model's): beyond that the oldest is waited for.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import numpy as np

from sglang_tpu_qwen.memory.host_budget import HostMemoryGuard

HOST_ID_BASE = 1 << 30
MAX_PENDING_BYTES = 1 << 30


def is_host_id(snapshot_id: int) -> bool:
    return snapshot_id >= HOST_ID_BASE


class HostSnapshotStore:
    """Snapshots kept in host memory, at most `budget_bytes` in total, least recently used first out.

    Entries are (conv [n_gdn, C, K-1], rec [n_gdn, Hv, dk, dv]) numpy arrays, or device arrays while
    pending. `guard`: refuses stores when the host runs low on memory (default: HostMemoryGuard()).
    """

    def __init__(self, budget_bytes: int, guard: HostMemoryGuard | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.refused_low_memory = 0  # demotions the guard refused
        self._guard = guard if guard is not None or budget_bytes <= 0 else HostMemoryGuard()
        self._data: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
        self._pending: OrderedDict[int, int] = OrderedDict()  # id -> bytes, while its arrays are device arrays
        self._pending_bytes = 0
        self._ids = itertools.count(HOST_ID_BASE)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of nbytes could be stored: within the budget, and the host has memory to spare
        (the guard; a refusal is counted in `refused_low_memory`)."""
        if not 0 < nbytes <= self.budget_bytes:
            return False
        if self._guard is not None and not self._guard.allows(nbytes):
            self.refused_low_memory += 1
            return False
        return True

    def over_budget_ids(self, incoming_bytes: int) -> list[int]:
        """Ids to drop (oldest first) so that `incoming_bytes` more fit in the budget."""
        out, used = [], self.used_bytes
        for hid, (conv, rec) in self._data.items():
            if used + incoming_bytes <= self.budget_bytes:
                break
            out.append(hid)
            used -= conv.nbytes + rec.nbytes
        return out

    def put(self, conv: Any, rec: Any) -> int:
        """Store copies (numpy arrays, or device arrays whose host copy started: pending); returns the new
        host id. With more than MAX_PENDING_BYTES pending, waits for the oldest ones' transfers."""
        hid = next(self._ids)
        nbytes = conv.nbytes + rec.nbytes
        self._data[hid] = (conv, rec)
        self.used_bytes += nbytes
        if not isinstance(conv, np.ndarray):
            self._pending[hid] = nbytes
            self._pending_bytes += nbytes
            while self._pending_bytes > MAX_PENDING_BYTES and len(self._pending) > 1:
                self._to_host(next(iter(self._pending)))
        return hid

    def settle(self) -> None:
        """Keep only the host arrays of pending entries whose device work is done (non-blocking check; the
        host copy, started at demotion, is then normally complete too)."""
        for hid in list(self._pending):
            conv, rec = self._data[hid]
            if conv.is_ready() and rec.is_ready():
                self._to_host(hid)

    def _to_host(self, hid: int) -> None:
        conv, rec = self._data[hid]
        self._data[hid] = (np.asarray(conv), np.asarray(rec))
        self._pending_bytes -= self._pending.pop(hid)

    def get(self, hid: int) -> tuple[Any, Any]:
        """The arrays of a host id, host or (pending) device ones; marks it most recently used. Raises
        KeyError for an unknown id."""
        self._data.move_to_end(hid)
        return self._data[hid]

    def drop(self, hid: int) -> None:
        conv, rec = self._data.pop(hid)
        self._pending_bytes -= self._pending.pop(hid, 0)
        self.used_bytes -= conv.nbytes + rec.nbytes
