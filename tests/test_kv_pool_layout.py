"""KV pool layouts (kernels/ragged_paged_attention/layout.py): the token-major default and the head-major one
store the same logical pool, and everything that reads or writes a pool through its layout gives the same
result under both: the layout's own views and byte counts, the reference attention (one call and a whole
model step), kv_io's token gather and page write (the PD transfer's device side), and the PD state layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_qwen.disagg.layout import StateLayout
from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict, init_embedded_params
from sglang_tpu_qwen.kernels.attention_backend import AttentionBackend
from sglang_tpu_qwen.kernels.dispatch import KernelBackends, page_multiple
from sglang_tpu_qwen.kernels.ragged_paged_attention.head_major import HEAD_MAJOR
from sglang_tpu_qwen.kernels.ragged_paged_attention.kv_quant import FP8_KV_DTYPE
from sglang_tpu_qwen.kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from sglang_tpu_qwen.kernels.ragged_paged_attention.token_major import TOKEN_MAJOR
from sglang_tpu_qwen.memory import kv_io
from sglang_tpu_qwen.model.config import Qwen35MoeConfig
from sglang_tpu_qwen.model.forward import forward_step, init_cache
from sglang_tpu_qwen.model.forward_batch import ForwardBatch

LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR)
DTYPES = (jnp.float32, jnp.bfloat16, FP8_KV_DTYPE)
L, N, PS, NKV, HD = 3, 6, 8, 2, 16


def _view(dtype, seed: int = 0) -> jax.Array:
    """A random logical pool [L, N, PS, NKV, HD] in ``dtype``."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal((L, N, PS, NKV, HD)), jnp.float32).astype(dtype)


def _same(a: jax.Array, b: jax.Array) -> None:
    """Bitwise equal (FP8 compared as bytes)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_layout_views_tokens_pages_and_bytes(layout, dtype) -> None:
    view = _view(dtype)
    pool = layout.stored(view)
    assert pool.shape == layout.pool_shape(L, N, PS, NKV, HD, dtype)
    assert layout.page_size_of(pool, NKV) == PS
    assert layout.logical_shape(pool, NKV) == (L, N, PS, NKV, HD)
    _same(layout.logical(pool, NKV), view)
    assert pool.shape[layout.page_axis] == N
    axis = layout.head_axis(dtype, NKV)
    if axis is not None:
        assert pool.shape[axis] == NKV
    assert L * N * layout.page_bytes(PS, NKV, HD, dtype) == pool.nbytes
    assert layout.page_bytes(PS, NKV, HD, dtype) == PS * layout.token_bytes(NKV, HD, dtype)

    pages, offsets = jnp.asarray([4, 1, 1, 5], jnp.int32), jnp.asarray([7, 0, 3, 2], jnp.int32)
    _same(layout.gather_tokens(pool, pages, offsets, NKV), view[:, pages, offsets])
    read = layout.page_reader(pool, NKV)
    _same(read(2, jnp.asarray([[3, 1]])), view[2, jnp.asarray([[3, 1]])])

    new = _view(dtype, 1)[0, :2, :3]  # [B=2, T=3, NKV, HD]
    tp, to = jnp.asarray([[2, 2, 3], [5, 0, 0]], jnp.int32), jnp.asarray([[6, 7, 0], [1, 2, 3]], jnp.int32)
    _same(layout.logical(layout.write_tokens(pool, 1, new, tp, to), NKV), view.at[1, tp, to].set(new))

    tokens = _view(dtype, 2)[:, :2].reshape(L, 2 * PS, NKV, HD)
    written = layout.write_pages(pool, jnp.asarray([5, 2], jnp.int32), tokens)
    _same(layout.logical(written, NKV), view.at[:, jnp.asarray([5, 2])].set(tokens.reshape(L, 2, PS, NKV, HD)))


def test_layouts_page_rules() -> None:
    with pytest.raises(ValueError, match="multiple of 2"):
        TOKEN_MAJOR.pool_shape(1, 1, 5, 2, 128, FP8_KV_DTYPE)  # FP8 with 2 heads packs 2 tokens a row
    assert HEAD_MAJOR.pool_shape(1, 1, 5, 2, 128, FP8_KV_DTYPE) == (1, 1, 2, 5, 128)
    assert TOKEN_MAJOR.head_axis(FP8_KV_DTYPE, 2) is None and TOKEN_MAJOR.head_axis(jnp.bfloat16, 2) == 3
    assert HEAD_MAJOR.head_axis(FP8_KV_DTYPE, 2) == 2
    assert page_multiple("auto", FP8_KV_DTYPE) == 4 and page_multiple("reference", jnp.bfloat16) == 1
    assert hash(AttentionBackend("reference", HEAD_MAJOR)) == hash(AttentionBackend("reference", HEAD_MAJOR))
    assert AttentionBackend("pallas").layout == HEAD_MAJOR and AttentionBackend().layout == TOKEN_MAJOR
    with pytest.raises(ValueError, match="head_major"):
        AttentionBackend("pallas", TOKEN_MAJOR)  # the Pallas kernel reads the head-major layout only


@pytest.mark.parametrize("dtype", (jnp.float32, FP8_KV_DTYPE), ids=lambda d: jnp.dtype(d).name)
def test_reference_attention_is_the_same_under_both_layouts(dtype) -> None:
    rng = np.random.default_rng(5)
    b, t, nq = 3, 4, 4
    q = jnp.asarray(rng.standard_normal((b, t, nq, HD)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, t, NKV, HD)), jnp.float32) for _ in range(2))
    q_lens = jnp.asarray([4, 1, 0], jnp.int32)
    kv_lens = jnp.asarray([9, 12, 0], jnp.int32)
    page_table = jnp.asarray([[3, 1], [2, 5], [0, 0]], jnp.int32)
    k_view, v_view = _view(dtype, 6), _view(dtype, 7)
    got = {}
    for layout in LAYOUTS:
        out, kc, vc = ragged_paged_attention_reference(
            q, k_new, v_new, layout.stored(k_view), layout.stored(v_view), 1, q_lens, kv_lens, page_table,
            k_scale=0.5, v_scale=2.0, layout=layout)
        got[layout.name] = (out, layout.logical(kc, NKV), layout.logical(vc, NKV))
    for a, b_ in zip(got["token_major"], got["head_major"], strict=True):
        _same(a, b_)


def _tiny_config() -> Qwen35MoeConfig:
    d = embedded_config_dict()
    d["text_config"].update(vocab_size=256, num_hidden_layers=4)
    return Qwen35MoeConfig.from_hf_dict(d)


def test_forward_step_is_the_same_under_both_layouts() -> None:
    """A prefill then a decode step of the whole model (reference attention), one cache per layout."""
    config = _tiny_config()
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init_embedded_params(config))
    ps, pages = 4, np.array([[2, 5, 1], [3, 4, 0]], np.int32)
    prefill = ForwardBatch.of(np.arange(1, 13, dtype=np.int32).reshape(2, 6) % 250, np.zeros(2, np.int32),
                              np.array([6, 5], np.int32), pages, np.array([1, 2], np.int32))
    decode = ForwardBatch.of(np.array([[7], [9]], np.int32), np.array([6, 5], np.int32), np.ones(2, np.int32),
                             pages, np.array([1, 2], np.int32))
    got = {}
    for layout in LAYOUTS:
        backends = KernelBackends(AttentionBackend("reference", layout), platform="cpu")
        step = jax.jit(functools.partial(forward_step, config=config, backends=backends))
        cache = init_cache(config, 6, ps, 3, jnp.float32, kv_layout=layout)
        h1, cache = step(params, cache, prefill)
        h2, cache = step(params, cache, decode)
        got[layout.name] = (h1, h2, layout.logical(cache["k"], config.num_key_value_heads),
                            layout.logical(cache["v"], config.num_key_value_heads), cache["conv"], cache["rec"])
    for a, b in zip(got["token_major"], got["head_major"], strict=True):
        _same(a, b)


@pytest.mark.parametrize("dtype", (jnp.float32, FP8_KV_DTYPE), ids=lambda d: jnp.dtype(d).name)
def test_kv_io_and_pd_layout_are_the_same_under_both_layouts(dtype) -> None:
    """kv_io writes a transferred request's token-major KV into whole pages and gathers it back; the caches
    hold the same logical pages and the PD header's state layout is the same under both layouts."""
    config = _tiny_config()
    nkv, hd, ps = config.num_key_value_heads, config.head_dim, 4
    n_attn, tokens = config.num_attn_layers, 10
    rng = np.random.default_rng(8)
    k, v = (jnp.asarray(rng.standard_normal((n_attn, tokens, nkv, hd)), jnp.float32).astype(dtype)
            for _ in range(2))
    pages = [5, 2, 7]
    got = {}
    for layout in LAYOUTS:
        backends = KernelBackends(AttentionBackend("reference", layout))
        cache = init_cache(config, 8, ps, 3, dtype, kv_layout=layout)
        cache = kv_io.write_kv(cache, layout, pages, k, v)
        gk, gv = kv_io.gather_kv(cache, layout, nkv, pages, 3, tokens)
        _same(gk, k[:, 3:])
        _same(gv, v[:, 3:])
        got[layout.name] = (layout.logical(cache["k"], nkv), layout.logical(cache["v"], nkv),
                            StateLayout.from_cache(config, cache, backends))
    tm, hm = got["token_major"], got["head_major"]
    _same(tm[0], hm[0])
    _same(tm[1], hm[1])
    assert tm[2] == hm[2]
    assert tm[2].kv_token_shape == (n_attn, nkv, hd)
