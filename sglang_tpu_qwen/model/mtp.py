"""The multi-token-prediction (MTP) layer of Qwen3.5: the draft model of speculative decoding (NEXTN).

Every Qwen3.5 release ships one MTP layer (``mtp_num_hidden_layers: 1``; tensors ``mtp.*``, loaded by
model/weights.py with ``mtp=True`` into ``params["mtp"]``). At position ``p`` it reads the target's final-norm
hidden state ``h_p`` and the embedding of the next token ``x_{p+1}`` and predicts ``x_{p+2}``::

    e = rms_norm(embed(x_{p+1}), pre_fc_norm_embedding)
    z = fc([e ; rms_norm(h_p, pre_fc_norm_hidden)])             fc: [2H, H], embedding half first
    z = decoder_layer(z)                                         full attention at position p, MoE or dense MLP
    logits = lm_head(rms_norm(z, norm))                          the target's lm_head (and embeddings)

Run recursively (``z`` as the next step's ``h``) it drafts several tokens. Source of the math: SGLang's and
vLLM's ``qwen3_5_mtp.py`` (``Qwen3_5MultiTokenPredictor``); the decoder layer is HF ``Qwen3_5MoeDecoderLayer``
(model/forward.py ``decoder_layer``, the same function the target's layers run). The layer's KV lives in the
paged pool after the target's attention layers (``init_cache(..., mtp_layers=1)``), on the same pages.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from sglang_tpu_qwen.kernels.dispatch import KernelBackends
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward import Cache, Params, decoder_layer, embed_tokens, rope_tables
from sglang_tpu_qwen.model.forward_batch import ForwardBatch
from sglang_tpu_qwen.model.norms import rms_norm


def mtp_forward(
    params: Params,
    cache: Cache,
    batch: ForwardBatch,
    hidden: jax.Array,
    *,
    config: Qwen35MoeConfig,
    moe_fn: Callable[..., jax.Array] | None = None,
    backends: KernelBackends | None = None,
) -> tuple[jax.Array, Cache]:
    """Run the MTP layer over a step's tokens, writing its KV at the step's positions.

    Args:
        params: the parameter pytree with ``params["mtp"]`` (model/param_layout.py ``param_specs(mtp=True)``);
            reads ``embed`` too.
        cache: ``init_cache(..., mtp_layers=1)``: the MTP layer's KV is attention layer ``config.num_attn_layers``
            of ``cache["k"]`` / ``cache["v"]``; the GDN pools are passed through untouched.
        batch: the step (model/forward_batch.py). ``input_ids[b, t]`` is the token AFTER position
            ``prefix_lens[b] + t`` (the target's input shifted left by one), and the layer runs at that position.
        hidden: ``[B, T, H]`` the target's final-norm hidden states at those positions (or the previous MTP
            step's output, drafting recursively).
        config, moe_fn, backends: as model/forward.py ``forward_step``.

    Returns:
        ``(hidden [B, T, H] after mtp.norm in the compute dtype, cache)``: ``compute_logits`` of it gives the
        draft distribution of the token two after each position.
    """
    p = params["mtp"]
    eps = config.rms_norm_eps
    linear = (backends or KernelBackends()).moe.linear
    e = rms_norm(embed_tokens(params["embed"], batch, config), p["pre_fc_norm_embedding"], eps)
    z = linear(jnp.concatenate([e, rms_norm(hidden.astype(e.dtype), p["pre_fc_norm_hidden"], eps)], axis=-1),
               p["fc"])
    pools = (cache["k"], cache["v"], cache["conv"], cache["rec"])
    z, (k, v, _, _), _ = decoder_layer(p["layer"], "full_attention", z, pools, config.num_attn_layers, batch=batch,
                                    rope=rope_tables(batch, config), config=config, backends=backends, moe_fn=moe_fn)
    return rms_norm(z, p["norm"], eps), {**cache, "k": k, "v": v}

