"""Which implementation runs each kernel: the Pallas TPU kernel or the model's pure-jnp reference.

``--attention-backend`` / ``--gdn-backend`` take ``auto | pallas | reference``. ``auto`` is ``pallas`` on a
TPU backend and ``reference`` elsewhere. ``pallas`` on a non-TPU backend runs the kernels in Pallas TPU
interpret mode (``pltpu.InterpretParams()``): exact but slow, for tests on CPU. Given the model config,
``resolve_backends`` checks it against what the kernels support before anything is compiled: an explicit
``pallas`` for an unsupported layout is a startup error naming the config fields, ``auto`` falls back to
the reference with a warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from sglang_tpu_qwen.kernels.gdn.kernel import fused_gdn
from sglang_tpu_qwen.kernels.ragged_paged_attention.kernel import ragged_paged_attention

logger = logging.getLogger(__name__)

CHOICES = ("auto", "pallas", "reference")


@dataclass(frozen=True)
class KernelBackends:
    """Resolved backends (hashable: it is static configuration of the jitted step).

    Attributes:
        attention: ``"pallas"`` or ``"reference"``.
        gdn: ``"pallas"`` or ``"reference"``.
        interpret: run the Pallas kernels in interpret mode (set when the JAX backend is not a TPU).
        platform: the JAX platform the program is compiled for ("cpu", "tpu", "gpu"). On "cpu" the
            reference path takes the forms XLA:CPU runs fastest: the recurrent GDN form at prefill too
            (``model.gated_deltanet.gdn_mix``) and dense experts (``model.moe.all_experts``).
    """

    attention: str = "reference"
    gdn: str = "reference"
    interpret: bool = False
    platform: str = "tpu"

    @property
    def xla_cpu(self) -> bool:
        """The program runs on XLA:CPU (the reference forms above)."""
        return self.platform == "cpu"


def gdn_pallas_unsupported(config: Any) -> str | None:
    """Why the fused Pallas GDN kernel cannot run this model's Gated DeltaNet head layout, or None when it can.

    The kernel reads each key-head group's v channels as whole (r * dv)-wide blocks of the conv output, so
    linear_num_value_heads must be a multiple of linear_num_key_heads (r = Hv / Hk) and the q/k channels
    (2 * Hk * dk) a multiple of r * dv (``kernels/gdn/kernel.py``). The message names the config fields.
    """
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    if not config.num_gdn_layers:
        return None
    if hv % hk:
        return (f"linear_num_value_heads ({hv}) is not a multiple of linear_num_key_heads ({hk})")
    r = hv // hk
    if (2 * hk * dk) % (r * dv):
        return (f"2 * linear_num_key_heads * linear_key_head_dim (2 * {hk} * {dk} = {2 * hk * dk}) is not a multiple "
                f"of (linear_num_value_heads / linear_num_key_heads) * linear_value_head_dim ({r} * {dv} = {r * dv})")
    return None


def resolve_backends(attention: str = "auto", gdn: str = "auto", platform: str | None = None,
                     config: Any = None) -> KernelBackends:
    """Resolve the two flags for a JAX platform and, when given, a model config.

    Args:
        attention, gdn: ``auto``, ``pallas`` or ``reference``.
        platform: ``jax.default_backend()`` when None.
        config: the model's Qwen35MoeConfig; checked against what the Pallas kernels support. ``auto`` falls
            back to the reference with a warning; an explicit ``pallas`` is refused.

    Returns:
        The resolved :class:`KernelBackends`.

    Raises:
        ValueError: for a value outside :data:`CHOICES`, or ``pallas`` chosen for a model config the kernel
            cannot run (the message names the config fields and values).
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
    why = gdn_pallas_unsupported(config) if config is not None and resolved.gdn == "pallas" else None
    if why is not None:
        if gdn == "pallas":
            raise ValueError(f"--gdn-backend pallas cannot run this model: {why}. Use --gdn-backend reference "
                             "(or auto, which falls back to it).")
        logger.warning("fused GDN kernel cannot run this model (%s); using the reference GDN", why)
        resolved = KernelBackends(resolved.attention, "reference")
    uses_pallas = "pallas" in (resolved.attention, resolved.gdn)
    return KernelBackends(resolved.attention, resolved.gdn, interpret=uses_pallas and not on_tpu, platform=platform)


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
