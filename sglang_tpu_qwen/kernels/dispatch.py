"""Which implementation runs each kernel: the Pallas TPU kernel or the model's pure-jnp reference.

``--attention-backend`` / ``--gdn-backend`` take ``auto | pallas | reference``. ``auto`` is ``pallas`` on a
TPU backend and ``reference`` elsewhere. ``pallas`` on a non-TPU backend runs the kernels in Pallas TPU
interpret mode (``pltpu.InterpretParams()``): exact but slow, for tests on CPU. Given the model config,
``resolve_backends`` checks it against what the kernels support before anything is compiled. The fused GDN
kernel runs every head layout the model config accepts (any value heads per key head, any dk and dv); on a
TPU, Mosaic needs dk and dv to be multiples of 128 (every released model's are 128). For another layout on a
TPU, an explicit ``pallas`` is a startup error naming the config fields and ``auto`` uses the reference with
a warning.
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


def gdn_pallas_unsupported(config: Any, interpret: bool = False) -> str | None:
    """Why the fused Pallas GDN kernel cannot run this model's Gated DeltaNet head layout, or None when it can.

    The kernel takes any value heads per key head and any dk, dv (``kernels/gdn/kernel.py``; the config
    itself rejects value heads that are not a multiple of key heads, as HF's ``repeat_interleave`` does).
    Compiled for a TPU (``interpret`` False), its per-head blocks are ``[tokens, dk]`` and ``[tokens, r * dv]``
    lane windows, which Mosaic tiles only when dk and dv are multiples of 128 (the lane width); in interpret
    mode any size runs. The message names the config fields.
    """
    if not config.num_gdn_layers or interpret:
        return None
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    if dk % 128 or dv % 128:
        return (f"linear_key_head_dim ({dk}) and linear_value_head_dim ({dv}) must be multiples of 128 for the "
                "TPU kernel (Mosaic tiles its per-head blocks in 128-lane units)")
    return None


def resolve_backends(attention: str = "auto", gdn: str = "auto", platform: str | None = None,
                     config: Any = None) -> KernelBackends:
    """Resolve the two flags for a JAX platform and, when given, a model config.

    Args:
        attention, gdn: ``auto``, ``pallas`` or ``reference``.
        platform: ``jax.default_backend()`` when None.
        config: the model's Qwen35MoeConfig; checked against what the Pallas kernels support on ``platform``
            (:func:`gdn_pallas_unsupported`). ``auto`` falls back to the reference with a warning; an explicit
            ``pallas`` is refused.

    Returns:
        The resolved :class:`KernelBackends`.

    Raises:
        ValueError: for a value outside :data:`CHOICES`, or ``pallas`` chosen for a model config the kernel
            cannot run on ``platform`` (the message names the config fields and values).
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
    checked = config is not None and resolved.gdn == "pallas"
    why = gdn_pallas_unsupported(config, interpret=not on_tpu) if checked else None
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
