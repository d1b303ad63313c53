"""The GDN backend: which kernel runs the Gated DeltaNet mixer over the state pools, and how they are stored.

``GdnBackend(name, interpret)`` is what ``kernels.dispatch.resolve_backends`` returns for ``--gdn-backend``:
``"pallas"`` the fused conv1d + gated delta rule kernel (kernels/gdn/kernel.py), ``"xla-chunked"`` that kernel
for decode and short steps and the chunked form as batched XLA products for longer ones
(kernels/gdn/parallel_chunks.py), ``"reference"`` the model's jnp forms. ``state_layout`` is the
:class:`GdnStateLayout` every reader of ``cache["conv"]`` / ``cache["rec"]`` asks (kernels/gdn/state_layout.py);
every backend reads the same one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_tpu_qwen.kernels.gdn.kernel import fused_gdn
from sglang_tpu_qwen.kernels.gdn.parallel_chunks import fused_gdn_xla_chunked
from sglang_tpu_qwen.kernels.gdn.state_layout import GDN_STATE_LAYOUT, GdnStateLayout

# name -> kernel with the signature of ``kernels.gdn.reference`` (``fused_gdn``'s), None for the reference.
KERNELS: dict[str, Callable | None] = {"pallas": fused_gdn, "xla-chunked": fused_gdn_xla_chunked, "reference": None}
# The backends whose steps run the Pallas kernel (interpreted off a TPU, and only for head dims it tiles).
PALLAS = ("pallas", "xla-chunked")


@dataclass(frozen=True)
class GdnBackend:
    """A resolved GDN backend (hashable: static configuration of the jitted step).

    Attributes:
        name: a key of :data:`KERNELS` (``"pallas"``, ``"xla-chunked"``, ``"reference"``).
        state_layout: the conv / recurrent state pools' layout.
        interpret: run the kernel in Pallas TPU interpret mode (a non-TPU platform).

    Raises:
        ValueError: an unknown ``name``.
    """

    name: str = "reference"
    state_layout: GdnStateLayout = field(default=GDN_STATE_LAYOUT)
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.name not in KERNELS:
            raise ValueError(f"unknown GDN backend {self.name!r}; known: {', '.join(KERNELS)}")

    @property
    def kernel(self) -> Callable | None:
        """The fused kernel with ``interpret`` bound, or None for the model's jnp reference."""
        fn = KERNELS[self.name]
        return None if fn is None else functools.partial(fn, interpret=self.interpret)
