"""Deviceless AOT compile of both Pallas kernels for one device of an Ironwood (tpu7x:2x2x1) topology.

Needs ``libtpu`` (the ``test`` extra) but no TPU: ``jax.experimental.topologies`` describes the chips and
Mosaic compiles the kernels for them, so a block shape Mosaic rejects or a kernel that exceeds on-chip memory
fails here. Shapes are Qwen3.5-397B's: attention 32 query / 2 KV heads x 256, page size 256 (bf16 cache);
GDN 16 key heads and 64 value heads x 128, conv kernel 4 (fp32 state). Prints each compiled memory use.
"""

from __future__ import annotations

import functools
import os

# libtpu takes /tmp/libtpu_lockfile in every process that loads it; concurrent test processes (pytest-xdist,
# another suite) would then fail to build the topology. Must be set before libtpu loads.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from conftest import record  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict  # noqa: E402
from sglang_tpu_qwen.engine.runner.compilation import persistent_cache_off  # noqa: E402
from sglang_tpu_qwen.kernels.fp8_matmul.kernel import (  # noqa: E402
    fp8_grouped_matmul_scatter_add,
    fp8_grouped_swiglu,
)
from sglang_tpu_qwen.kernels.gdn import conv_pool  # noqa: E402
from sglang_tpu_qwen.kernels.gdn.kernel import fused_gdn  # noqa: E402
from sglang_tpu_qwen.kernels.greedy_head.kernel import greedy_lm_head  # noqa: E402
from sglang_tpu_qwen.kernels.moe_backend import MoeBackend  # noqa: E402
from sglang_tpu_qwen.kernels.ragged_paged_attention.block_sizes import block_sizes_for  # noqa: E402
from sglang_tpu_qwen.kernels.ragged_paged_attention.head_major import HEAD_MAJOR  # noqa: E402
from sglang_tpu_qwen.kernels.ragged_paged_attention.kernel import ragged_paged_attention  # noqa: E402
from sglang_tpu_qwen.model.config import Qwen35MoeConfig  # noqa: E402
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from sglang_tpu_qwen.model.gated_deltanet import gdn_layer_pooled  # noqa: E402
from sglang_tpu_qwen.model.param_layout import param_specs  # noqa: E402
from sglang_tpu_qwen.quant.fp8 import fp8_specs  # noqa: E402

topologies = pytest.importorskip("jax.experimental.topologies")

NQ, NKV, HD, PAGE = 32, 2, 256, 256
HK, HV, DK, DV, KCONV = 16, 64, 128, 128, 4


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    """Deviceless executables cannot be loaded back from the persistent cache (engine/runner/compilation.py)."""
    with persistent_cache_off():
        yield


@pytest.fixture(scope="module")
def device():
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name="tpu7x:2x2x1")
    except Exception as e:  # noqa: BLE001 - any failure means libtpu is missing or too old
        pytest.skip(f"no TPU topology support (install the test extra's libtpu): {e}")
    assert len(topo.devices) == 8  # 4 chips x 2 TensorCores
    return topo.devices[0]


def _spec(shape, dtype, dev):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))


def _report(name: str, compiled, in_place: bool = True) -> None:
    mem = compiled.memory_analysis()
    record("Pallas kernels compiled for Ironwood (tpu7x:2x2x1, one device)",
           f"{name}: args {mem.argument_size_in_bytes / 2**20:.1f} MiB, out {mem.output_size_in_bytes / 2**20:.1f} "
           f"MiB, temp {mem.temp_size_in_bytes / 2**20:.1f} MiB, alias {mem.alias_size_in_bytes / 2**20:.1f} MiB")
    assert (mem.alias_size_in_bytes > 0) == in_place  # the caches / states are updated in place
    # No copy of a cache or state pool around the kernel (a relayout would show up here as GiBs; a gather of write
    # blocks straight from the pool made one of 963 MiB). The attention kernel's writes hold each row's touched
    # tile-aligned blocks (16 bf16 / 32 FP8 tokens of every head) a few times per pool.
    assert mem.temp_size_in_bytes < 128 * 2**20


# FP8 pools are stored packed ([L, N, page / 2, 4, 256] for 2 KV heads; token_major.py): with the second-minor
# dim 2 XLA's default layout for a float8 pool was {4,2,3,1,0:T(32,128)} while Mosaic asks for the row-major
# T(4,128), and XLA copied both pools into the kernel's layout and back on every call (1920 MiB of temporaries
# at these shapes). The temp bound in _report fails if that copy comes back.
@pytest.mark.parametrize(("batch", "tokens", "kv_dtype"),
                         [(64, 1, jnp.bfloat16), (4, 256, jnp.bfloat16), (64, 1, jnp.float8_e4m3fn),
                          (4, 256, jnp.float8_e4m3fn)],
                         ids=["decode", "prefill", "decode-fp8", "prefill-fp8"])
def test_ragged_paged_attention_compiles_for_ironwood(device, batch: int, tokens: int, kv_dtype) -> None:
    """Head-major bf16 pages, and FP8 pages (--kv-cache-dtype fp8_e4m3: in-kernel upcast, scales from SMEM,
    traced as the model passes them), the new tokens written a tile-aligned block at a time by an in-place copy,
    aliased in place at half the cache bytes for FP8, with no copy of either pool (the temp bound in _report)."""
    layers, pages, pages_per_seq = 15, 256, 16
    fn = functools.partial(ragged_paged_attention, block_sizes=block_sizes_for("TPU7x"))
    fp8 = kv_dtype == jnp.float8_e4m3fn
    args = [
        _spec((batch, tokens, NQ, HD), jnp.bfloat16, device),
        _spec((batch, tokens, NKV, HD), jnp.bfloat16, device),
        _spec((batch, tokens, NKV, HD), jnp.bfloat16, device),
        _spec(HEAD_MAJOR.pool_shape(layers, pages, PAGE, NKV, HD, kv_dtype), kv_dtype, device),
        _spec(HEAD_MAJOR.pool_shape(layers, pages, PAGE, NKV, HD, kv_dtype), kv_dtype, device),
        _spec((), jnp.int32, device),
        _spec((batch,), jnp.int32, device),
        _spec((batch,), jnp.int32, device),
        _spec((batch, pages_per_seq), jnp.int32, device),
    ]
    if fp8:
        scaled = fn
        fn = lambda *a: scaled(*a[:-2], k_scale=a[-2], v_scale=a[-1])  # noqa: E731
        args += [_spec((), jnp.float32, device), _spec((), jnp.float32, device)]
    compiled = jax.jit(fn, donate_argnums=(3, 4)).lower(*args).compile()
    cache_bytes = 2 * layers * pages * PAGE * NKV * HD * jnp.dtype(kv_dtype).itemsize
    assert compiled.memory_analysis().alias_size_in_bytes == cache_bytes  # FP8: half the bf16 pool, in place
    _report(f"ragged_paged_attention[{batch}x{tokens}, {jnp.dtype(kv_dtype).name} pages]", compiled)


@pytest.mark.parametrize(("batch", "tokens"), [(16, 1), (2, 256)], ids=["decode", "prefill"])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fused_gdn_compiles_for_ironwood(device, batch: int, tokens: int, state_dtype) -> None:
    layers, slots = 45, 33
    conv_dim = 2 * HK * DK + HV * DV
    # The serving form: the gated output norm fused (gate and norm weight the last two arguments).
    def fn(*args):
        *args, gate, weight = args
        return fused_gdn(*args, num_k_heads=HK, head_k_dim=DK, head_v_dim=DV, gate=gate, norm_weight=weight)

    compiled = jax.jit(fn, donate_argnums=(4, 5)).lower(
        _spec((batch, tokens, conv_dim), jnp.bfloat16, device),
        _spec((conv_dim, KCONV), jnp.bfloat16, device),
        _spec((batch, tokens, HV), jnp.float32, device),
        _spec((batch, tokens, HV), jnp.float32, device),
        _spec(conv_pool.pool_shape(layers, slots, conv_dim, KCONV - 1), state_dtype, device),
        _spec((layers, slots, HV, DK, DV), state_dtype, device),
        _spec((), jnp.int32, device),
        _spec((batch,), jnp.int32, device),
        _spec((batch,), jnp.int32, device),
        _spec((batch,), jnp.bool_, device),
        _spec((batch, tokens, HV * DV), jnp.bfloat16, device),
        _spec((DV,), jnp.bfloat16, device),
    ).compile()
    _report(f"fused_gdn[{batch}x{tokens}, state {jnp.dtype(state_dtype).name}]", compiled)


@pytest.mark.parametrize("rows", [64 * 10, 61440], ids=["decode", "prefill"])
def test_fp8_scatter_add_compiles_for_ironwood(device, rows: int) -> None:
    """The EP MoE down projection with the combine fused (Qwen3.5-397B: 64 local experts of a 512-expert
    layer stack on ep8, intermediate 1024, hidden 4096; prefill: a 1.5x chunk of 8 ranks x 4096 tokens x 10
    pairs / 8), summing into the [8 * 4096, 4096 / 128, 128] accumulator in place."""
    layers, e_local, inter, hidden = 15, 64, 1024, 4096
    acc_rows = 8 * (rows // 10 if rows < 4096 else 4096)
    compiled = jax.jit(fp8_grouped_matmul_scatter_add, donate_argnums=(5,)).lower(
        _spec((rows, inter), jnp.bfloat16, device),
        _spec((layers, e_local, inter, hidden), jnp.float8_e4m3fn, device),
        _spec((e_local, inter // 128, hidden // 128), jnp.float32, device),
        _spec((e_local,), jnp.int32, device),
        _spec((rows,), jnp.int32, device),
        _spec((acc_rows, hidden // 128, 128), jnp.bfloat16, device),
        _spec((), jnp.int32, device),
    ).compile()
    _report(f"fp8_grouped_matmul_scatter_add[{rows} rows -> {acc_rows}]", compiled)
    # The first chunk's form: a new accumulator, first rows overwritten, untouched rows zeroed by the kernel.
    fresh = functools.partial(fp8_grouped_matmul_scatter_add, num_rows=acc_rows)
    compiled = jax.jit(lambda x, q, s, g, d, lay, o, z: fresh(x, q, s, g, d, None, lay, o, z)).lower(
        _spec((rows, inter), jnp.bfloat16, device),
        _spec((layers, e_local, inter, hidden), jnp.float8_e4m3fn, device),
        _spec((e_local, inter // 128, hidden // 128), jnp.float32, device),
        _spec((e_local,), jnp.int32, device),
        _spec((rows,), jnp.int32, device),
        _spec((), jnp.int32, device),
        _spec((rows,), jnp.bool_, device),
        _spec((acc_rows,), jnp.int32, device),
    ).compile()
    _report(f"fp8_grouped_matmul_scatter_add[{rows} rows -> new {acc_rows}, zeroing]", compiled, in_place=False)


@pytest.mark.parametrize("rows", [64 * 10, 61440], ids=["decode", "prefill"])
def test_fp8_swiglu_row_gather_compiles_for_ironwood(device, rows: int) -> None:
    """The EP MoE gate/up projection reading its (token, expert) rows from the all-gathered tokens by DMA
    (Qwen3.5-397B on ep8: 64 local experts, hidden 4096, intermediate 1024; the same row counts as above)."""
    layers, e_local, inter, hidden = 15, 64, 1024, 4096
    src_rows = 8 * (rows // 10 if rows < 4096 else 4096)
    fn = functools.partial(fp8_grouped_swiglu, block=(128, 128))
    compiled = jax.jit(fn).lower(
        _spec((src_rows, hidden // 128, 128), jnp.bfloat16, device),
        _spec((layers, e_local, hidden, inter), jnp.float8_e4m3fn, device),
        _spec((e_local, hidden // 128, inter // 128), jnp.float32, device),
        _spec((layers, e_local, hidden, inter), jnp.float8_e4m3fn, device),
        _spec((e_local, hidden // 128, inter // 128), jnp.float32, device),
        _spec((e_local,), jnp.int32, device),
        _spec((), jnp.int32, device),
        _spec((rows,), jnp.float32, device),
        _spec((rows,), jnp.int32, device),
    ).compile()
    mem = compiled.memory_analysis()
    record("Pallas kernels compiled for Ironwood (tpu7x:2x2x1, one device)",
           f"fp8_grouped_swiglu[{rows} rows gathered from {src_rows}]: args {mem.argument_size_in_bytes / 2**20:.1f}"
           f" MiB, out {mem.output_size_in_bytes / 2**20:.1f} MiB, temp {mem.temp_size_in_bytes / 2**20:.1f} MiB")
    assert mem.temp_size_in_bytes < 64 * 2**20  # no gathered copy of the rows


# The released GDN layouts, one per distinct (key heads, value heads, dk, dv, hidden): (Hk, Hv, dk, dv, hidden,
# GDN layers). Qwen3-Next-80B-A3B has 35B-A3B's layout (16 / 32 heads of 128, hidden 2048).
RELEASED_GDN = {
    "397b-a17b": (16, 64, 128, 128, 4096, 45), "122b-a10b": (16, 64, 128, 128, 3072, 36),
    "35b-a3b+next-80b": (16, 32, 128, 128, 2048, 30), "27b": (16, 48, 128, 128, 5120, 48),
    "9b": (16, 32, 128, 128, 4096, 24), "4b": (16, 32, 128, 128, 2560, 24),
    "2b": (16, 16, 128, 128, 2048, 18), "0.8b": (16, 16, 128, 128, 1024, 18),
}


@pytest.mark.parametrize("layout", RELEASED_GDN.values(), ids=RELEASED_GDN.keys())
def test_gdn_layer_compiles_for_ironwood(device, layout) -> None:
    """The model's GDN layer (FP8 projections, the fused kernel with its output norm, out_proj) of each released
    head layout, as one DP rank runs it under the planner's plan on tpu7x:2x2x1 (dp 8, 64 requests): one
    program holding a decode step (8 rows) and a prefill chunk (1024 tokens, the rank's share of the default
    8192), so both kernel forms compile. State pools fp32, 8 slots + the trash slot, updated in place."""
    import time

    hk, hv, dk, dv, hidden, n_gdn = layout
    d = embedded_config_dict()
    d["text_config"].update(hidden_size=hidden, linear_num_key_heads=hk, linear_num_value_heads=hv,
                            linear_key_head_dim=dk, linear_value_head_dim=dv)
    config = Qwen35MoeConfig.from_hf_dict(d)
    params = fp8_specs(param_specs(config, stacked=False)["layers"][0]["gdn"])
    slots, km1 = 9, config.linear_conv_kernel_dim - 1

    def on_dev(tree):
        return jax.tree.map(lambda x: _spec(x.shape, x.dtype, device), tree)

    def batch(mode, rows, tokens):
        i32 = jnp.int32
        return ForwardBatch(mode, _spec((rows, tokens), i32, device), _spec((rows,), i32, device),
                            _spec((rows,), i32, device), _spec((rows, 1), i32, device), _spec((rows,), i32, device))

    fp8_kernel = MoeBackend("pallas")  # the FP8 projections in the Pallas grouped matmul, as the server runs them

    def step(p, x_dec, b_dec, x_pre, b_pre, conv, rec):
        y_dec, conv, rec = gdn_layer_pooled(p, x_dec, b_dec, conv, rec, 0, config, fused_gdn, fp8_kernel)
        y_pre, conv, rec = gdn_layer_pooled(p, x_pre, b_pre, conv, rec, 1, config, fused_gdn, fp8_kernel)
        return y_dec, y_pre, conv, rec

    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(5, 6)).lower(
        on_dev(params),
        _spec((8, 1, hidden), jnp.bfloat16, device), batch(ForwardMode.DECODE, 8, 1),
        _spec((1, 1024, hidden), jnp.bfloat16, device), batch(ForwardMode.EXTEND, 1, 1024),
        _spec(conv_pool.pool_shape(n_gdn, slots, config.gdn_conv_dim, km1), jnp.float32, device),
        _spec((n_gdn, slots, hv, dk, dv), jnp.float32, device),
    ).compile()
    secs = time.perf_counter() - start
    mem = compiled.memory_analysis()
    record("Pallas kernels compiled for Ironwood (tpu7x:2x2x1, one device)",
           f"gdn_layer[Hk {hk}, Hv {hv}, dk {dk}, dv {dv}, hidden {hidden}; decode 8x1 + prefill 1x1024]: compiled "
           f"in {secs:.1f} s, args {mem.argument_size_in_bytes / 2**20:.1f} MiB, temp "
           f"{mem.temp_size_in_bytes / 2**20:.1f} MiB, alias {mem.alias_size_in_bytes / 2**20:.1f} MiB")
    # Both state pools updated in place (aliased, not copied), and temporaries no more than the chunk's
    # activations (the projections' outputs are ~50 KiB per token at these sizes).
    pools = n_gdn * slots * (km1 * config.gdn_conv_dim + hv * dk * dv) * 4
    assert mem.alias_size_in_bytes >= pools
    assert mem.temp_size_in_bytes < 1024 * 128 * 2**10


@pytest.mark.parametrize("rows", [64, 1024], ids=["decode", "verify"])
def test_greedy_lm_head_compiles_for_ironwood(device, rows: int) -> None:
    """kernels/greedy_head at the 397B's lm_head (bfloat16 [248,320, 4,096]): 64 decode rows, and a verify step's
    4 tokens of 256 requests (its blocks shrink to keep the logits small)."""
    v, h = 248320, 4096
    compiled = jax.jit(greedy_lm_head).lower(_spec((rows, h), jnp.bfloat16, device),
                                             _spec((v, h), jnp.bfloat16, device)).compile()
    _report(f"greedy_lm_head[{rows} rows]", compiled, in_place=False)


def test_kernels_compile_under_highest_default_precision(device) -> None:
    """The TPU suite compiles its engines under ``jax_default_matmul_precision`` ``highest``: a bfloat16 product
    inside a kernel that leaves its precision to that default asks Mosaic for fp32 contract precision on bf16
    operands, which it refuses ("Bad lhs type"). The GDN kernel's MXU broadcasts and the greedy lm_head name
    theirs."""
    conv_dim, batch = 2 * HK * DK + HV * DV, 16

    def fn(*args):
        *args, gate, weight = args
        return fused_gdn(*args, num_k_heads=HK, head_k_dim=DK, head_v_dim=DV, gate=gate, norm_weight=weight)

    with jax.default_matmul_precision("highest"):
        jax.jit(fn, donate_argnums=(4, 5)).lower(
            _spec((batch, 1, conv_dim), jnp.bfloat16, device), _spec((conv_dim, KCONV), jnp.bfloat16, device),
            _spec((batch, 1, HV), jnp.float32, device), _spec((batch, 1, HV), jnp.float32, device),
            _spec(conv_pool.pool_shape(2, 17, conv_dim, KCONV - 1), jnp.float32, device),
            _spec((2, 17, HV, DK, DV), jnp.float32, device), _spec((), jnp.int32, device),
            _spec((batch,), jnp.int32, device), _spec((batch,), jnp.int32, device),
            _spec((batch,), jnp.bool_, device), _spec((batch, 1, HV * DV), jnp.bfloat16, device),
            _spec((DV,), jnp.bfloat16, device)).compile()
        jax.jit(greedy_lm_head).lower(_spec((8, 512), jnp.bfloat16, device),
                                      _spec((2560, 512), jnp.bfloat16, device)).compile()
