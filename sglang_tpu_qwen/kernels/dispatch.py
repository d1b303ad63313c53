"""Which implementation runs each kernel: the Pallas TPU kernel or the model's pure-jnp reference.

``--attention-backend`` / ``--gdn-backend`` take ``auto | pallas | reference``. ``auto`` is ``pallas`` on a
TPU backend and ``reference`` elsewhere. ``pallas`` on a non-TPU backend runs the kernels in Pallas TPU
interpret mode (``pltpu.InterpretParams()``): exact but slow, for tests on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax

from sglang_tpu_qwen.kernels.gdn.kernel import fused_gdn
from sglang_tpu_qwen.kernels.ragged_paged_attention.kernel import ragged_paged_attention

CHOICES = ("auto", "pallas", "reference")


@dataclass(frozen=True)
class KernelBackends:
    """Resolved backends (hashable: it is static configuration of the jitted step).

    Attributes:
        attention: ``"pallas"`` or ``"reference"``.
        gdn: ``"pallas"`` or ``"reference"``.
        interpret: run the Pallas kernels in interpret mode (set when the JAX backend is not a TPU).
    """

    attention: str = "reference"
    gdn: str = "reference"
    interpret: bool = False


def resolve_backends(attention: str = "auto", gdn: str = "auto", platform: str | None = None) -> KernelBackends:
    """Resolve the two flags for a JAX platform.

    Args:
        attention, gdn: ``auto``, ``pallas`` or ``reference``.
        platform: ``jax.default_backend()`` when None.

    Returns:
        The resolved :class:`KernelBackends`.

    Raises:
        ValueError: for a value outside :data:`CHOICES`.
    """
    platform = platform or jax.default_backend()
    on_tpu = platform == "tpu"

    def one(name: str, flag: str) -> str:
        if flag not in CHOICES:
            raise ValueError(f"--{name}-backend must be one of {', '.join(CHOICES)}; got {flag!r}")
        if flag == "auto":
            return "pallas" if on_tpu else "reference"
        return flag

    resolved = KernelBackends(attention=one("attention", attention), gdn=one("gdn", gdn))
    uses_pallas = "pallas" in (resolved.attention, resolved.gdn)
    return KernelBackends(resolved.attention, resolved.gdn, interpret=uses_pallas and not on_tpu)


def attention_kernel(backends: KernelBackends) -> Callable | None:
    """The Pallas ragged paged attention (``model.attention.attention_layer``'s ``core``), or None for the
    model's reference path. Signature: ``(q, k_new, v_new, k_cache, v_cache, layer, q_lens, kv_lens,
    page_table) -> (out, k_cache, v_cache)``."""
    if backends.attention != "pallas":
        return None
    return functools.partial(ragged_paged_attention, interpret=backends.interpret)


def gdn_kernel(backends: KernelBackends) -> Callable | None:
    """The fused Pallas GDN (``fused_gdn`` with ``interpret`` bound), or None for the model's reference path."""
    if backends.gdn != "pallas":
        return None
    return functools.partial(fused_gdn, interpret=backends.interpret)
