"""The Qwen3.5 vision tower in JAX: patches of one or more images -> text-model embeddings.

Math of HF ``Qwen3_5VisionModel`` (transformers ``models/qwen3_5/modeling_qwen3_5.py``; the MoE family's
``Qwen3_5MoeVisionModel`` is the same): the Conv3d patch embedding (kernel = stride = the patch, so a matmul of
each flattened ``[C, T, P, P]`` row), plus the learned position table resampled bilinearly to the image's grid
(``align_corners=True``), ``depth`` pre-LayerNorm blocks of 2-D rotary self-attention restricted to each frame
and a GELU-tanh MLP, then the merger (LayerNorm, ``merge x merge`` neighbouring patches concatenated, a
two-layer exact-GELU MLP into the text model's width). The grid-dependent arrays come from the host
(model/vision/grid.py), so one compiled program serves any images that fit its row count.

Dtypes follow HF run in the same dtype: matmuls in the compute dtype; LayerNorm statistics, the position
interpolation sum, the rotary products and the softmax in float32, each cast back once.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_qwen.kernels.moe_backend import MoeBackend
from sglang_tpu_qwen.model.vision.config import VisionConfig
from sglang_tpu_qwen.model.vision.grid import TowerInputs

LAYER_NORM_EPS = 1e-6  # HF builds every LayerNorm of the tower with eps 1e-6
# Bytes of one attention tile's [heads, rows, N] float32 scores: query rows per tile are the largest power of two
# that keeps them under this (a 16384-row call of the released tower: 128 rows). XLA holds a few such buffers.
SCORE_TILE_BYTES = 128 * 2**20


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS)
    return (y * p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32)).astype(x.dtype)


def _dense(x: jax.Array, p: dict[str, Any], matmul: MoeBackend) -> jax.Array:
    """``x @ w + b`` (w dense ``[in, out]`` or an ``Fp8Weight``, multiplied by ``matmul.linear``)."""
    return matmul.linear(x, p["w"]) + p["b"].astype(x.dtype)


def _activation(name: str, x: jax.Array) -> jax.Array:
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    return jax.nn.silu(x)


def inv_freq(config: VisionConfig) -> np.ndarray:
    """``[head_dim // 4]`` float32 rotary frequencies shared by the row and column axes (HF
    ``Qwen3_5VisionRotaryEmbedding.compute_axial_rope_parameters``)."""
    spatial = config.head_dim // 2
    return (1.0 / (config.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))).astype(np.float32)


def rotary(rope_hw: jax.Array, config: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)``, each ``[N, head_dim]`` float32, for ``rope_hw [N, 2]`` (row, column): the row angles
    then the column angles, the pair repeated to the full head (rotate-half form over the whole head)."""
    freqs = rope_hw.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(config))  # [N, 2, hd/4]
    freqs = freqs.reshape(freqs.shape[0], -1)  # [N, hd/2]: row angles, then column angles
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [N, heads, hd]`` rotated in float32 (HF ``apply_rotary_pos_emb_vision``), back in x's dtype."""
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def tile_rows(n: int, heads: int) -> int:
    """Query rows per attention tile for a call of ``n`` rows: ``n`` when its scores fit ``SCORE_TILE_BYTES`` or
    ``n`` is no multiple of a smaller power of two, else the largest power of two (>= 16) that fits."""
    rows = n
    while rows > 16 and rows % 2 == 0 and heads * rows * n * 4 > SCORE_TILE_BYTES:
        rows //= 2
    return rows


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array) -> jax.Array:
    """Softmax attention of ``q, k, v [N, heads, hd]`` where query i sees key j iff ``segment[i] ==
    segment[j]`` (HF splits the rows by ``cu_seqlens`` and attends per frame: the same thing). Scores and
    softmax in float32; tiles of :func:`tile_rows` query rows bound the scores' memory. Returns ``[N, heads,
    hd]`` in q's dtype."""
    n, heads, hd = q.shape
    scale = hd**-0.5

    def tile(qt: jax.Array, seg_t: jax.Array) -> jax.Array:
        s = jnp.einsum("qhd,khd->hqk", qt, k, preferred_element_type=jnp.float32) * scale
        s = jnp.where((seg_t[:, None] == segment[None, :])[None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("hqk,khd->qhd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)

    rows = tile_rows(n, heads)
    if rows == n:
        return tile(q, segment)
    tiles = n // rows
    out = jax.lax.map(lambda a: tile(*a), (q.reshape(tiles, rows, *q.shape[1:]), segment.reshape(tiles, rows)))
    return out.reshape(q.shape)


def _block(x: jax.Array, p: dict[str, Any], rope: tuple[jax.Array, jax.Array], segment: jax.Array,
           config: VisionConfig, matmul: MoeBackend) -> jax.Array:
    """One ``Qwen3_5VisionBlock``: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""
    n = x.shape[0]
    qkv = _dense(_layer_norm(x, p["norm1"]), p["qkv"], matmul).reshape(n, 3, config.num_heads, config.head_dim)
    q, k = _rotate(qkv[:, 0], *rope), _rotate(qkv[:, 1], *rope)
    attn = _attention(q, k, qkv[:, 2], segment).reshape(n, config.hidden_size)
    x = x + _dense(attn, p["proj"], matmul)
    h = _activation(config.hidden_act, _dense(_layer_norm(x, p["norm2"]), p["fc1"], matmul))
    return x + _dense(h, p["fc2"], matmul)


def vision_tower(params: dict[str, Any], pixel_values: jax.Array, inputs: TowerInputs,
                 config: VisionConfig, matmul: MoeBackend | None = None) -> jax.Array:
    """Embeddings of the images whose patch rows are ``pixel_values``.

    Args:
        params: the tower's pytree (docs/internals.md "Vision tower"; model/vision/weights.py loads it);
            ``blocks`` leaves stacked over ``depth``; dtype of ``params["pos_embed"]`` is the compute dtype.
        pixel_values: ``[N, patch_dim]`` any float dtype: the processor's rows of every image in order, then
            padding rows; ``N`` a multiple of ``merge_unit``.
        inputs: ``grid.tower_inputs(grids, config, N)`` (numpy or device arrays of it).
        config: the tower's config (static).
        matmul: runs the linear layers (``MoeBackend.linear``, kernels/moe_backend.py: block-FP8 weights in the
            Pallas kernel under ``pallas``), static; None: the reference (dense weights: ``x @ w`` either way).

    Returns:
        ``[N // merge_unit, out_hidden_size]`` in the compute dtype: image ``i``'s ``num_tokens`` rows follow
        image ``i - 1``'s (HF's ``pooler_output`` of the same images); rows of padding are garbage.
    """
    dtype = params["pos_embed"].dtype
    matmul = matmul or MoeBackend()
    x = _dense(pixel_values.astype(dtype), params["patch_embed"], matmul)
    table = params["pos_embed"][inputs.pos_index].astype(jnp.float32)  # [N, 4, D]
    x = x + jnp.sum(table * inputs.pos_weight[..., None], axis=1).astype(dtype)
    rope = rotary(inputs.rope_hw, config)
    segment = jnp.asarray(inputs.segment)

    def step(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        return _block(x, p, rope, segment, config, matmul), None

    x, _ = jax.lax.scan(step, x, params["blocks"])
    merger = params["merger"]
    x = _layer_norm(x, merger["norm"]).reshape(-1, config.merge_unit * config.hidden_size)
    x = jax.nn.gelu(_dense(x, merger["fc1"], matmul), approximate=False)  # the merger's nn.GELU() is exact
    return _dense(x, merger["fc2"], matmul)


def activation_rows_bytes(num_rows: int, config: VisionConfig, dtype: Any) -> int:
    """A rough upper bound of one call's live activations over ``num_rows`` patch rows (for memory planning
    where no compiled program reports its own): the residual stream, qkv, the MLP hidden, one attention tile's
    float32 scores (XLA keeps about four buffers of that size: scores, mask, exponentials, probabilities)."""
    item = jnp.dtype(dtype).itemsize
    d = config.hidden_size
    per_row = item * (config.patch_dim + 4 * d + 3 * d + config.intermediate_size) + 4 * 2 * config.head_dim
    scores = 4 * 4 * config.num_heads * tile_rows(num_rows, config.num_heads) * num_rows
    return num_rows * per_row + scores + math.prod((num_rows, d)) * 4
