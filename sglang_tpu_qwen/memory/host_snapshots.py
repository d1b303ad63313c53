"""Host tier for GDN snapshots: a byte-bounded, LRU-ordered store of evicted snapshots in host memory.

A snapshot evicted from the device snapshot slots moves here (when --gdn-snapshot-host-gb > 0) under a
host id, and the radix tree keeps pointing at it; a later hit uploads it straight into the request's
running slot. Host ids live above HOST_ID_BASE so they can never be mistaken for device slot ids.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

HOST_ID_BASE = 1 << 30


def is_host_id(snapshot_id: int) -> bool:
    return snapshot_id >= HOST_ID_BASE


class HostSnapshotStore:
    """Snapshots kept in host memory, at most `budget_bytes` in total, least recently used first out."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._data: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._ids = itertools.count(HOST_ID_BASE)

    def __len__(self) -> int:
        return len(self._data)

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of nbytes could ever be stored."""
        return 0 < nbytes <= self.budget_bytes

    def over_budget_ids(self, incoming_bytes: int) -> list[int]:
        """Ids to drop (oldest first) so that `incoming_bytes` more fit in the budget."""
        out, used = [], self.used_bytes
        for hid, (conv, rec) in self._data.items():
            if used + incoming_bytes <= self.budget_bytes:
                break
            out.append(hid)
            used -= conv.nbytes + rec.nbytes
        return out

    def put(self, conv: np.ndarray, rec: np.ndarray) -> int:
        """Store host copies (conv [n_gdn, C, K-1], rec [n_gdn, Hv, dk, dv]); returns the new host id."""
        hid = next(self._ids)
        self._data[hid] = (conv, rec)
        self.used_bytes += conv.nbytes + rec.nbytes
        return hid

    def get(self, hid: int) -> tuple[np.ndarray, np.ndarray]:
        """The arrays of a host id (marks it most recently used). Raises KeyError for an unknown id."""
        self._data.move_to_end(hid)
        return self._data[hid]

    def drop(self, hid: int) -> None:
        conv, rec = self._data.pop(hid)
        self.used_bytes -= conv.nbytes + rec.nbytes
