"""Which backend runs each layer kind: the Pallas TPU kernel or the model's pure-jnp reference, with its layout.

``--attention-backend`` / ``--gdn-backend`` / ``--moe-runner-backend`` / ``--sampling-backend`` take
``auto | pallas | reference``;
``--gdn-backend xla-chunked`` runs the fused kernel for decode and short steps and the chunked form (prefill) as
batched XLA products (kernels/gdn/parallel_chunks.py; 11-14% slower than the kernel's on v5e prefills).
``auto`` is ``pallas`` on a TPU backend and ``reference`` elsewhere. ``pallas`` on a non-TPU backend runs the
kernels in Pallas TPU interpret mode (``pltpu.InterpretParams()``): exact but slow, for tests on CPU. Given the
model config, ``resolve_backends`` checks it against what the kernels support before anything is compiled. The
fused GDN kernel runs every head layout the model config accepts (any value heads per key head, any dk and dv);
on a TPU, Mosaic needs dk and dv to be multiples of 128 (every released model's are 128). For another layout on
a TPU, an explicit ``pallas`` is a startup error naming the config fields and ``auto`` uses the reference with
a warning. The MoE backend's Pallas kernel serves block-FP8 weights of any shape (kernels/moe_backend.py);
dense expert weights go to ``ragged_dot`` under either MoE backend.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import jax

from sglang_tpu_qwen.kernels.attention_backend import AttentionBackend
from sglang_tpu_qwen.kernels.gdn_backend import PALLAS as GDN_PALLAS
from sglang_tpu_qwen.kernels.gdn_backend import GdnBackend
from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.kernels.ragged_paged_attention.layout import KVPoolLayout
from sglang_tpu_qwen.kernels.sampling_backend import SamplingBackend

logger = logging.getLogger(__name__)

CHOICES = ("auto", "pallas", "reference")
# --gdn-backend also takes the fused kernel with the XLA chunked form for prefill (kernels/gdn_backend.py).
GDN_CHOICES = (*CHOICES, "xla-chunked")


@dataclass(frozen=True)
class KernelBackends:
    """Resolved backends per layer kind (hashable: it is static configuration of the jitted step).

    Attributes:
        attention: the attention kernel and the KV pool layout (kernels/attention_backend.py).
        gdn: the GDN kernel and the state pools' layout (kernels/gdn_backend.py).
        moe: the kernel of the routed experts' grouped matmuls and of every block-FP8 linear layer, and the
            token rows its expert-parallel kernels read (kernels/moe_backend.py).
        sampling: how greedy rows' tokens come out of the lm_head (kernels/sampling_backend.py).
        platform: the JAX platform the program is compiled for ("cpu", "tpu", "gpu"). On "cpu" the
            reference path takes the forms XLA:CPU runs fastest: the recurrent GDN form at prefill too
            (``model.gated_deltanet.gdn_mix``) and dense experts (``model.moe.all_experts``).
    """

    attention: AttentionBackend = field(default_factory=AttentionBackend)
    gdn: GdnBackend = field(default_factory=GdnBackend)
    moe: MoeBackend = field(default_factory=MoeBackend)
    platform: str = "tpu"
    sampling: SamplingBackend = field(default_factory=SamplingBackend)

    @classmethod
    def of(cls, attention: str = "reference", gdn: str = "reference", interpret: bool = False,
           platform: str = "tpu", moe: str | None = None, sampling: str | None = None) -> KernelBackends:
        """Backends by name, with their default layouts and one ``interpret`` flag for all (as
        :func:`resolve_backends` builds them). ``moe`` / ``sampling`` None: what ``auto`` picks on ``platform``
        (``pallas`` on "tpu", else ``reference``). Raises ValueError for an unknown name."""
        auto = "pallas" if platform == "tpu" else "reference"
        moe, sampling = moe or auto, sampling or auto
        return cls(attention=AttentionBackend(attention, interpret=interpret), gdn=GdnBackend(gdn, interpret=interpret),
                   moe=MoeBackend(moe, interpret=interpret), platform=platform,
                   sampling=SamplingBackend(sampling, interpret=interpret))

    @property
    def xla_cpu(self) -> bool:
        """The program runs on XLA:CPU (the reference forms above)."""
        return self.platform == "cpu"

    @property
    def interpret(self) -> bool:
        """Some Pallas kernel runs in interpret mode (the JAX backend is not a TPU)."""
        return self.attention.interpret or self.gdn.interpret or self.moe.interpret or self.sampling.interpret

    @property
    def kv_layout(self) -> KVPoolLayout:
        """The KV pool layout the attention backend reads (what ``init_cache`` allocates)."""
        return self.attention.layout

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
                     config: Any = None, moe: str = "auto", sampling: str = "auto") -> KernelBackends:
    """Resolve the four flags for a JAX platform and, when given, a model config.

    Args:
        attention, gdn, moe, sampling: ``--attention-backend``, ``--gdn-backend``, ``--moe-runner-backend``,
            ``--sampling-backend``: ``auto``, ``pallas`` or ``reference`` (``--gdn-backend`` also
            ``xla-chunked``).
        platform: ``jax.default_backend()`` when None.
        config: the model's Qwen35MoeConfig; checked against what the Pallas kernels support on ``platform``
            (:func:`gdn_pallas_unsupported`). ``auto`` falls back to the reference with a warning; an explicit
            ``pallas`` is refused.

    Returns:
        The resolved :class:`KernelBackends`, each with its kernel's layout (head-major KV pages for the Pallas
        attention kernel, token-major for the reference; row-tiled token rows for the Pallas MoE kernels).

    Raises:
        ValueError: for a value outside :data:`CHOICES` (the message names the flag), or ``pallas`` chosen for
            a model config the kernel cannot run on ``platform`` (the message names the config fields and
            values).
    """
    platform = platform or jax.default_backend()
    on_tpu = platform == "tpu"

    def one(flag: str, value: str, choices: tuple[str, ...] = CHOICES) -> str:
        if value not in choices:
            raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
        if value == "auto":
            return "pallas" if on_tpu else "reference"
        return value

    attn_name, gdn_name = one("--attention-backend", attention), one("--gdn-backend", gdn, GDN_CHOICES)
    moe_name, sampling_name = one("--moe-runner-backend", moe), one("--sampling-backend", sampling)
    checked = config is not None and gdn_name in GDN_PALLAS
    why = gdn_pallas_unsupported(config, interpret=not on_tpu) if checked else None
    if why is not None:
        if gdn != "auto":
            raise ValueError(f"--gdn-backend {gdn} cannot run this model: {why}. Use --gdn-backend reference "
                             "(or auto, which falls back to it).")
        logger.warning("fused GDN kernel cannot run this model (%s); using the reference GDN", why)
        gdn_name = "reference"
    # Interpret mode off a TPU, for every Pallas kernel alike (the flag was one for the whole step).
    interpret = ("pallas" in (attn_name, moe_name, sampling_name) or gdn_name in GDN_PALLAS) and not on_tpu
    return KernelBackends.of(attn_name, gdn_name, interpret, platform, moe=moe_name, sampling=sampling_name)


def page_multiple(attention: str, kv_dtype: Any) -> int:
    """What ``--page-size`` must be a multiple of for ``--attention-backend attention`` and a ``kv_dtype`` KV
    cache, whatever the platform and the model (a flag check: ``auto`` may resolve to either backend, so the
    least common multiple of both layouts' requirements). Raises ValueError for a value outside :data:`CHOICES`."""
    if attention not in CHOICES:
        raise ValueError(f"--attention-backend must be one of {', '.join(CHOICES)}; got {attention!r}")
    names = ("pallas", "reference") if attention == "auto" else (attention,)
    return math.lcm(*(AttentionBackend(name).layout.page_multiple(kv_dtype) for name in names))
