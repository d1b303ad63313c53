"""The attention backend: which kernel runs the model's paged attention and which KV pool layout it reads.

``AttentionBackend(name, layout, interpret)`` is what ``kernels.dispatch.resolve_backends`` returns for
``--attention-backend``. ``name`` picks the kernel from :data:`KERNELS` (None: the model's jnp reference,
which runs on any layout); ``layout`` is the :class:`KVPoolLayout` every reader of ``cache["k"]`` /
``cache["v"]`` asks (``init_cache``, the attention layer, memory/kv_io.py, disagg/layout.py, the sharding,
memory accounting). A new attention kernel is one entry of :data:`KERNELS` and :data:`LAYOUTS`. The Pallas kernel
reads head-major pages (kernels/ragged_paged_attention/kernel.py); the reference defaults to token-major.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from sglang_tpu_qwen.kernels.ragged_paged_attention.head_major import HEAD_MAJOR
from sglang_tpu_qwen.kernels.ragged_paged_attention.kernel import ragged_paged_attention
from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout
from sglang_tpu_qwen.kernels.ragged_paged_attention.token_major import TOKEN_MAJOR

# name -> kernel with the signature of ``ragged_paged_attention_reference`` (kernels/ragged_paged_attention):
# ``(q, k_new, v_new, k_cache, v_cache, layer, q_lens, kv_lens, page_table, *, k_scale, v_scale, interpret)
# -> (out, k_cache, v_cache)``; None for the reference.
KERNELS: dict[str, Callable | None] = {"pallas": ragged_paged_attention, "reference": None}
# name -> the layout its kernel reads; the reference reads any and defaults to token-major (XLA scatters one
# token into it in place; into a head-major pool XLA's per-token scatter copies the pool, head_major.py).
LAYOUTS: dict[str, KVPoolLayout] = {"pallas": HEAD_MAJOR, "reference": TOKEN_MAJOR}


@dataclass(frozen=True)
class AttentionBackend:
    """A resolved attention backend (hashable: static configuration of the jitted step).

    Attributes:
        name: a key of :data:`KERNELS` (``"pallas"``, ``"reference"``).
        layout: the KV pool layout (kernels/ragged_paged_attention/layout.py); default (None) the one of
            :data:`LAYOUTS` for ``name``: head-major for the Pallas kernel, token-major for the reference.
        interpret: run the kernel in Pallas TPU interpret mode (a non-TPU platform).

    Raises:
        ValueError: an unknown ``name``, or a layout its kernel does not read.
    """

    name: str = "reference"
    layout: KVPoolLayout | None = None
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.name not in KERNELS:
            raise ValueError(f"unknown attention backend {self.name!r}; known: {', '.join(KERNELS)}")
        if self.layout is None:
            object.__setattr__(self, "layout", LAYOUTS[self.name])  # frozen: the default, set once
        elif KERNELS[self.name] is not None and self.layout != LAYOUTS[self.name]:
            raise ValueError(f"the {self.name} attention kernel reads the {LAYOUTS[self.name].name} KV layout, "
                             f"not {self.layout.name}")

    @property
    def kernel(self) -> Callable | None:
        """The kernel with ``interpret`` bound, or None for the model's jnp reference (on ``layout``)."""
        fn = KERNELS[self.name]
        return None if fn is None else functools.partial(fn, interpret=self.interpret)
