"""Start every row's DMAs at once, then wait for them all: the loop of the GDN slot and window copy kernels.

All of a call's copies are in flight together (one queue of descriptors, as many as rows), so the copies overlap
instead of each waiting for the one before it; the waits then drain them in the same order. Each DMA waits on
its own semaphore slot's count, so copies that share a semaphore may complete in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental import pallas as pl


def start_then_wait(rows: int, copies: Callable[[jax.Array], Sequence[Any]],
                    when: Callable[[jax.Array], jax.Array] | None = None) -> None:
    """Inside a Pallas TPU kernel: start the DMAs ``copies(i)`` (``pltpu.make_async_copy`` descriptors) of every
    ``i`` in ``[0, rows)`` where ``when(i)`` (all where None), then wait for each of them.

    ``copies`` is called twice per ``i`` (once to start, once to wait) and must describe the same copies both
    times; ``i`` is a traced int32 scalar."""

    def each(action: str) -> None:
        def row(i: jax.Array, carry: int) -> int:
            def issue() -> None:
                for copy in copies(i):
                    getattr(copy, action)()

            if when is None:
                issue()
            else:
                pl.when(when(i))(issue)
            return carry

        jax.lax.fori_loop(0, rows, row, 0)

    each("start")
    each("wait")
