"""Multi-host start-up: one JAX process per host (multi-controller), one global mesh over all of them.

SGLang's ``--nnodes --node-rank --dist-init-addr`` map onto ``jax.distributed.initialize`` (coordinator
``host:port`` served by rank 0). Only rank 0 serves HTTP; every rank runs the same jitted steps on the
global mesh. On the CPU backend the cross-process collectives use gloo
(``jax_cpu_collectives_implementation``), which must be chosen before the backend starts.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np


def initialize(nnodes: int, node_rank: int, dist_init_addr: str | None, *, cpu: bool | None = None) -> None:
    """Join the job (no-op for ``nnodes == 1``). Call before any other JAX use.

    Args:
        nnodes: number of processes (hosts).
        node_rank: this process, ``0 <= node_rank < nnodes``.
        dist_init_addr: ``host:port`` of the coordinator (rank 0 listens there).
        cpu: select gloo CPU collectives; default: when ``JAX_PLATFORMS`` is ``cpu``.

    Raises:
        ValueError: bad rank, or no address with ``nnodes > 1``.
    """
    if nnodes <= 1:
        return
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} outside [0, {nnodes})")
    if not dist_init_addr:
        raise ValueError("--dist-init-addr host:port is required with --nnodes > 1")
    if cpu is None:
        cpu = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=dist_init_addr, num_processes=nnodes, process_id=node_rank)


def is_serving_rank() -> bool:
    """True on the process that serves HTTP (rank 0)."""
    return jax.process_index() == 0


def global_array(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a host value every process holds in full (each process places its shards)."""
    arr = np.asarray(value)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def put_tree(tree: Any, shardings: Any) -> Any:
    """:func:`global_array` over a pytree (``shardings`` has the same structure)."""
    return jax.tree.map(global_array, tree, shardings)
