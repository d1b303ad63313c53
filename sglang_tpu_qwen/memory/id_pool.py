"""Free list of ids for a device pool: KV cache pages, or GDN state slots (host-side bookkeeping only)."""

from __future__ import annotations


class IdPool:
    """Hands out ids in [start, size); by default id 0 is reserved as the trash target padded rows write to.

    Used for the KV page pool (one id = one page of every attention layer) and the GDN slot pool
    (one id = the conv + recurrent state of every GDN layer for one request). Every id handed out
    must come back through `free`, so `num_free == num_usable` when the server is idle.
    """

    def __init__(self, size: int, what: str = "id", start: int = 1) -> None:
        if size - start < 1:
            raise ValueError(f"a {what} pool needs at least 1 usable entry in [{start}, {size})")
        self.size = size
        self.start = start
        self.what = what
        # LIFO: recently freed ids are reused first, which keeps the touched memory small.
        self._free: list[int] = list(range(size - 1, start - 1, -1))
        self._in_use: set[int] = set()

    @property
    def num_usable(self) -> int:
        """Ids that can ever be handed out."""
        return self.size - self.start

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` ids, or None (nothing taken) when fewer than `n` are free."""
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._in_use.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Return ids; raises ValueError on an id that is not in use (a double free)."""
        for i in ids:
            if i not in self._in_use:
                raise ValueError(f"{self.what} {i} freed twice or never allocated")
            self._in_use.remove(i)
            self._free.append(i)
