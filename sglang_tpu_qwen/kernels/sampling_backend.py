"""The sampling backend: how a greedy row's token comes out of its hidden state and the lm_head.

``SamplingBackend(name, interpret)`` is what ``kernels.dispatch.resolve_backends`` returns for
``--sampling-backend`` (SGLang's flag; its choices are CUDA samplers). :meth:`SamplingBackend.greedy_ids` serves
the greedy sampling program (every all-greedy decode and verify step) and the MTP drafts:

- ``"pallas"``: a bfloat16 lm_head goes through kernels/greedy_head, one pass over the weight with the running
  maximum on chip and no ``[N, V]`` logits written (7% faster than XLA's fused product and argmax at 64 rows on
  the v5e, 10% at 256); another dtype takes the reference.
- ``"reference"``: XLA's product with float32 accumulation, then ``jnp.argmax`` (kernels/greedy_head/reference.py).

Both give the lowest id of the row's largest float32 logit; the two sum the products in different orders, so a
near-tie may resolve differently. Sampling with temperature, penalties, grammars or logprobs reads the logits and
stays in XLA under both. Off a TPU ``pallas`` runs the kernel in Pallas TPU interpret mode (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.greedy_head.kernel import greedy_lm_head
from sglang_tpu_qwen.kernels.greedy_head.reference import greedy_lm_head_reference

NAMES = ("pallas", "reference")


@dataclass(frozen=True)
class SamplingBackend:
    """A resolved sampling backend (hashable: static configuration of the jitted programs).

    Attributes:
        name: one of :data:`NAMES`.
        interpret: run the Pallas kernel in Pallas TPU interpret mode (a non-TPU platform).

    Raises:
        ValueError: an unknown ``name``.
    """

    name: str = "reference"
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"unknown sampling backend {self.name!r}; known: {', '.join(NAMES)}")

    def uses_kernel(self, hidden: jax.Array, weight: jax.Array) -> bool:
        """The Pallas kernel serves these operands: backend ``pallas`` and both bfloat16 (a float32 lm_head keeps
        XLA's product, whose float32 precision the kernel's does not promise)."""
        return self.name == "pallas" and hidden.dtype == weight.dtype == jnp.bfloat16

    def greedy_ids(self, hidden: jax.Array, weight: jax.Array) -> jax.Array:
        """Greedy ids ``[N]`` int32 of ``hidden [N, H] @ weight [V, H]^T``: per row the lowest id of the largest
        float32 logit (``jnp.argmax``'s rule)."""
        with jax.named_scope("lm_head"):
            if self.uses_kernel(hidden, weight):
                return greedy_lm_head(hidden, weight, interpret=self.interpret)
            return greedy_lm_head_reference(hidden, weight)
