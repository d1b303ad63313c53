"""What the compiled programs need beyond their arguments: XLA's own memory analysis of each program.

A step program's arguments (weights, KV pages, GDN slots) are counted by the memory split
(engine/runner/memory_split.py); what it allocates while it runs (activations, the MoE dispatch buffers, the
[B, V] logits of a sampling program) is not, and on a device with a memory limit it must fit beside them. XLA
reports it per compiled program (``Compiled.memory_analysis().temp_size_in_bytes``), so the runner reads it
instead of guessing:

* before the pools are allocated, ``probe_temporaries`` compiles the programs most likely to be the largest
  (per kind, the largest shape) against a minimal pool, and the split reserves their largest temporaries
  (``split_memory(temporaries=...)``);
* after precompile, ``measure`` reads every compiled program of the set: the startup log and
  ``/get_server_info`` report the largest, and a program whose temporaries exceed what the split reserved is
  a startup error, never an out-of-memory at the first request.

A program that updates the pools in place has temporaries that do not grow with the pools. One that copies a
pool (a layout XLA picks for the parameter that differs from what a kernel or fusion asks for: pool dims
under the TPU's (8, 128) tile, kernels/ragged_paged_attention/token_major.py) has temporaries of the pool's
size; ``measure``'s ratio to the pool bytes shows it (tests/test_program_memory.py checks it on a deviceless
TPU compile).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Temporaries of a set of compiled programs.

    Attributes:
        temp_bytes: the largest program's temporaries, bytes per device (0 when XLA reported none).
        largest: that program's key (None for an empty set).
        programs: how many programs were read.
        pool_bytes: the KV and GDN pools' bytes per device the programs were compiled against (0: unknown).
    """

    temp_bytes: int
    largest: tuple | None
    programs: int
    pool_bytes: int = 0

    @property
    def pool_ratio(self) -> float | None:
        """temp_bytes / pool_bytes (None without pool bytes): about 1 or more means a program copies a pool."""
        return self.temp_bytes / self.pool_bytes if self.pool_bytes else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able figures for /get_server_info (bytes per device)."""
        return {"max_temp_bytes": self.temp_bytes, "largest_program": repr(self.largest), "programs": self.programs,
                "pool_bytes": self.pool_bytes, "temp_to_pool_ratio": self.pool_ratio}

    def describe(self) -> str:
        """One log line."""
        ratio = f", {100 * self.pool_ratio:.2f}% of the pools' {self.pool_bytes / 2**30:.3f} GiB" \
            if self.pool_ratio is not None else ""
        return (f"compiled programs' temporaries: largest {self.temp_bytes / 2**30:.3f} GiB per device "
                f"({self.largest}){ratio}; {self.programs} programs read")


def temp_bytes(compiled: Any) -> int:
    """``compiled.memory_analysis().temp_size_in_bytes`` (0 where the backend reports no analysis)."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):  # backends without the analysis
        return 0
    return int(getattr(stats, "temp_size_in_bytes", 0) or 0) if stats is not None else 0


def measure(compiled: Iterable[tuple[tuple, Any]], pool_bytes: int = 0) -> ProgramMemory:
    """The largest temporaries among ``(key, compiled program)`` pairs; ``pool_bytes``: the pools they take."""
    best: tuple[int, tuple | None] = (0, None)
    count = 0
    for key, prog in compiled:
        count += 1
        best = max(best, (temp_bytes(prog), key), key=lambda x: x[0])
    return ProgramMemory(temp_bytes=best[0], largest=best[1], programs=count, pool_bytes=pool_bytes)


def largest_keys(keys: list[tuple]) -> list[tuple]:
    """Per program kind (``key[0]``), the key of the largest shape: the programs whose temporaries bound the
    set's (a program's activations grow with its rows and tokens). Forward programs count batch x tokens, the
    rest the product of their first two integers (the batch, times the tokens where a key has them: draft).
    Sampling programs are one kind per sampling kind (greedy, sample)."""
    def size(key: tuple) -> int:
        bucket = key[1] if len(key) > 1 else None
        if hasattr(bucket, "batch") and hasattr(bucket, "tokens"):
            return bucket.batch * bucket.tokens
        ints = [v for v in key[1:] if isinstance(v, int)]
        return ints[0] * (ints[1] if len(ints) > 1 else 1) if ints else 0

    best: dict[Any, tuple] = {}
    for key in keys:
        kind = key[0] if key[0] != "sample" else key[:2]
        if kind not in best or size(key) > size(best[kind]):
            best[kind] = key
    return list(best.values())


def probe_temporaries(lower: Callable[[tuple], Any], keys: list[tuple]) -> ProgramMemory:
    """Compile ``largest_keys(keys)`` with ``lower(key)`` (programs built on a minimal pool: their temporaries
    are the served programs' when nothing copies a pool) and return the largest temporaries."""
    picked = largest_keys(keys)
    result = measure((key, lower(key).compile()) for key in picked)
    logger.info("probe of %d programs before sizing the pools: %s", len(picked), result.describe())
    return result
