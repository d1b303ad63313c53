"""Memory accounting (engine/runner/memory_accounting.py, memory_split.py): GDN slots and KV pages split what the
weights leave by --mamba-full-memory-ratio, from the dtypes in use; /get_server_info reports memory_usage per
device as SGLang does, and the split."""

from __future__ import annotations

import math

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENGINE_KWARGS, tiny_hybrid_config

from sglang_tpu_qwen.args.server_args import ServerArgs
from sglang_tpu_qwen.engine.runner import memory_accounting, sampler
from sglang_tpu_qwen.engine.runner.memory_accounting import GB, cache_units
from sglang_tpu_qwen.engine.runner.memory_split import split_memory
from sglang_tpu_qwen.engine.runner.sizing import RunnerSizing, resolve_state_dtype, sampling_input_bytes

_config = tiny_hybrid_config


def test_state_dtype_from_the_flag_else_the_checkpoint() -> None:
    """--mamba-ssm-dtype wins; unset, the config's mamba_ssm_dtype (Qwen3.5 releases: float32); absent, float32."""
    assert resolve_state_dtype(None, _config()) == jnp.float32
    assert resolve_state_dtype(None, _config(mamba_ssm_dtype="bfloat16")) == jnp.bfloat16
    assert resolve_state_dtype("float32", _config(mamba_ssm_dtype="bfloat16")) == jnp.float32
    assert resolve_state_dtype("bfloat16", _config(mamba_ssm_dtype="float32")) == jnp.bfloat16
    with pytest.raises(ValueError, match="the checkpoint's mamba_ssm_dtype must be one of float32, bfloat16"):
        resolve_state_dtype(None, _config(mamba_ssm_dtype="float16"))


@pytest.mark.parametrize("kv_dtype, state_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16),
                                                   (jnp.float8_e4m3fn, jnp.float32)])
def test_cache_units_follow_the_dtypes(kv_dtype, state_dtype) -> None:
    c = _config()
    u = cache_units(c, 16, kv_dtype, state_dtype)
    kv_item, st_item = jnp.dtype(kv_dtype).itemsize, jnp.dtype(state_dtype).itemsize
    # K and V of 1 attention layer, 16 tokens, 2 heads x 16; conv [conv_dim, K-1] + rec [Hv, dk, dv] x 3 GDN layers.
    assert u.kv_per_page == 2 * 1 * 16 * 2 * 16 * kv_item
    conv_dim = 2 * 2 * 8 + 4 * 6
    assert u.gdn_per_slot == 3 * (conv_dim * 3 + 4 * 8 * 6) * st_item
    assert u.kv_per_token == u.kv_per_page // 16


class _Device:
    """A device that reports a memory limit (the accelerators do; XLA:CPU does not)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": self.limit}


MIB = 1 << 20
UNITS = dict(page_bytes=MIB, slot_bytes=3 * MIB, page_size=64)
# 100 MiB device x 0.8 - 20 MiB weights: a 60 MiB budget, 4 running requests per rank.
ON_DEVICE = dict(UNITS, running_slots=4, device_limit=100 * MIB, weight_bytes=20 * MIB, mem_fraction_static=0.8,
                 ratio=0.9)


def test_ratio_splits_the_budget() -> None:
    """State : KV = r: the state slots get floor(60 MiB x 0.9 / 1.9 / 3 MiB) = 9 (trash + 4 running + 4
    snapshots), the KV pool the 33 MiB they leave: 33 pages, one the trash page."""
    split = split_memory(**ON_DEVICE)
    assert (split.rule, split.budget) == ("ratio", 60 * MIB)
    assert (split.num_slots, split.snapshot_slots, split.num_pages, split.kv_tokens) == (9, 4, 33, 32 * 64)
    assert split.state_bytes + split.kv_bytes <= split.budget
    fig = split.as_dict()
    assert fig["snapshot_slots_bytes"] == 4 * 3 * MIB and fig["kv_pool_bytes"] == 33 * MIB
    assert fig["mamba_full_memory_ratio"] == 0.9 and fig["running_slots"] == 4
    assert fig["vision_encoder_bytes"] == 0
    # A vision encoder of 19 MiB leaves a 41 MiB budget: floor(41 x 0.9 / 1.9 / 3) = 6 slots, 23 pages.
    vl = split_memory(**ON_DEVICE, vision_bytes=19 * MIB)
    assert (vl.budget, vl.num_slots, vl.num_pages) == (41 * MIB, 6, 23)
    assert vl.as_dict()["vision_encoder_bytes"] == 19 * MIB and "vision encoder 0.019 GiB" in vl.describe()
    # The sampling programs' resident inputs come out of the budget the same way.
    sl = split_memory(**ON_DEVICE, sampling_bytes=19 * MIB)
    assert (sl.budget, sl.num_slots, sl.num_pages) == (41 * MIB, 6, 23)
    assert sl.as_dict()["sampling_input_bytes"] == 19 * MIB and "sampling inputs 0.019 GiB" in sl.describe()
    assert sl.device_bytes == split.device_bytes - split.state_bytes - split.kv_bytes + sl.state_bytes \
        + sl.kv_bytes + 19 * MIB
    # Without a device limit the budget is nominal: the encoder changes nothing but the report.
    nominal = {**ON_DEVICE, "device_limit": None}
    assert split_memory(**nominal, vision_bytes=19 * MIB).num_pages == split_memory(**nominal).num_pages


def test_overrides_and_limits_of_the_split() -> None:
    # --max-gdn-snapshots 2: 1 + 4 + 2 slots, 60 - 21 MiB of pages; --max-mamba-cache-size 10 (running included).
    assert split_memory(**ON_DEVICE, max_snapshots=2).num_pages == 39
    s = split_memory(**ON_DEVICE, max_mamba_cache_size=10)
    assert (s.rule, s.snapshot_slots, s.num_pages) == ("--max-mamba-cache-size", 6, 27)
    # A small ratio's share (5.45 MiB) holds fewer slots than the running requests: no snapshots, the running
    # slots come out of the KV share.
    s = split_memory(**{**ON_DEVICE, "ratio": 0.1})
    assert (s.snapshot_slots, s.num_pages) == (0, 45)
    assert split_memory(**ON_DEVICE, snapshots=False).snapshot_slots == 0
    # --max-total-tokens on a device: KV as given (10 pages + trash), the state slots get what is left (49 MiB).
    s = split_memory(**ON_DEVICE, max_total_tokens=640)
    assert (s.rule, s.num_pages, s.num_slots, s.over_budget) == ("after the KV pool", 11, 16, 0)
    s = split_memory(**ON_DEVICE, max_total_tokens=64 * 50)  # 51 MiB of KV + 5 running slots: 6 MiB over
    assert (s.snapshot_slots, s.over_budget, s.as_dict()["over_budget_bytes"]) == (0, 6 * MIB, 6 * MIB)
    # No device limit (CPU): the default KV pool and r times its bytes for the state slots.
    s = split_memory(**{**ON_DEVICE, "device_limit": None})
    assert (s.rule, s.num_pages, s.num_slots) == ("ratio of the KV pool", 1025, int(0.9 * 1025 * MIB) // (3 * MIB))
    s = split_memory(**{**ON_DEVICE, "device_limit": None}, max_total_tokens=640)
    assert (s.num_pages, s.num_slots) == (11, max(5, int(0.9 * 11 * MIB) // (3 * MIB)))


def test_split_errors() -> None:
    with pytest.raises(ValueError, match=r"not enough device memory for the KV pool: .* 25 GDN slots"):
        split_memory(**ON_DEVICE, max_snapshots=20)
    with pytest.raises(ValueError, match=r"does not hold the weights"):
        split_memory(**{**ON_DEVICE, "weight_bytes": 90 * MIB})
    with pytest.raises(ValueError, match=r"and the vision encoder \(0.06 GB: lower --mm-embedding-cache-size-mb"):
        split_memory(**ON_DEVICE, vision_bytes=60 * MIB)
    with pytest.raises(ValueError, match=r"vision encoder 0.05 GB - 9 GDN slots"):
        split_memory(**ON_DEVICE, vision_bytes=50 * MIB, max_snapshots=4)
    with pytest.raises(ValueError, match=r"fewer than the 4 running requests"):
        split_memory(**ON_DEVICE, max_mamba_cache_size=3)
    for bad, msg in ((dict(mamba_full_memory_ratio=0.0), "must be > 0"),
                     (dict(mamba_full_memory_ratio=-1.0), "must be > 0"),
                     (dict(max_gdn_snapshots=-1), "must be >= 0"),
                     (dict(max_mamba_cache_size=-4), "must hold at least the 32 running"),
                     (dict(max_gdn_snapshots=4, max_mamba_cache_size=64), "not both"),
                     (dict(max_total_tokens=-16), "must be positive")):
        with pytest.raises(ValueError, match=msg):
            ServerArgs(**bad)


def test_runner_sizing_uses_the_split() -> None:
    """RunnerSizing.build on a device that reports a limit: the slot and page counts are the split's for the
    config's real unit sizes."""
    c = _config()
    args = ServerArgs(max_running_requests=8, dp_size=2, page_size=16, chunked_prefill_size=64)
    units = cache_units(c, 16, jnp.float32, jnp.float32)
    sizing = RunnerSizing.build(c, args, jnp.float32, {_Device(4 * MIB): MIB})
    # Sampling batches 1 and 4 per rank (8 requests over 2 ranks): their resident inputs leave the budget.
    sampling = 5 * sampler.unused_row_bytes(c.vocab_size)
    assert sizing.split.sampling_bytes == sampling_input_bytes(c.vocab_size, args) == sampling
    budget = int(4 * MIB * 0.8) - MIB - sampling
    slots = int(budget * 0.9 / 1.9) // units.gdn_per_slot
    assert sizing.num_slots == slots and sizing.num_snapshot_slots == slots - 5
    assert sizing.num_pages == (budget - slots * units.gdn_per_slot) // units.kv_per_page
    args.mamba_ssm_dtype = "bfloat16"
    bf16 = RunnerSizing.build(c, args, jnp.float32, {_Device(4 * MIB): MIB})
    assert bf16.units.gdn_per_slot * 2 == units.gdn_per_slot and bf16.num_slots in (2 * slots, 2 * slots + 1)


def test_sampling_inputs_of_mtp_verify_rows() -> None:
    """256 running requests with MTP (3 drafts): sampling batches 1, 4 ... 256 and the verify steps' 4 x (1, 4 ...
    256) rows, 10 distinct sizes (2,045 rows): 1.96 GiB at the release's vocabulary. A v5e run of this setup
    failed to load its 1,024-row sampling program when these tables were not counted."""
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1,
                speculative_num_draft_tokens=4)
    vocab = 248320
    row = sampler.unused_row_bytes(vocab)
    assert sampling_input_bytes(vocab, ServerArgs(max_running_requests=256, **spec)) == 2045 * row
    assert sampling_input_bytes(vocab, ServerArgs(max_running_requests=256)) == 509 * row
    assert 1.9 * GB < 2045 * row < 2.0 * GB


def test_engine_memory_usage(engine) -> None:
    """The session engine (one device): weight = the parameter bytes, kvcache = its pool at its dtype."""
    runner = engine.runner
    (usage,) = runner.memory_usage
    leaves = jax.tree.leaves(runner.params)
    assert usage["weight_bytes"] == sum(x.nbytes for x in leaves) > 0
    assert math.isclose(usage["weight"], usage["weight_bytes"] / GB, rel_tol=1e-4)
    kv = runner.cache["k"].nbytes + runner.cache["v"].nbytes
    assert kv == runner.sizing.num_pages * runner.sizing.units.kv_per_page
    assert math.isclose(usage["kvcache"], kv / GB, rel_tol=1e-4)
    state = runner.cache["conv"].nbytes + runner.cache["rec"].nbytes
    assert state == runner.sizing.num_slots * runner.sizing.units.gdn_per_slot
    assert usage["token_capacity"] == (runner.sizing.num_pages - 1) * runner.sizing.page_size
    info = engine.get_server_info()
    assert info["internal_states"] == [{"memory_usage": usage}]
    assert np.dtype(runner.cache["k"].dtype) == np.dtype(runner.dtype) == np.dtype(runner.kv_dtype)  # auto
    assert (info["kv_cache_dtype"], usage["kv_cache_dtype"]) == ("auto", np.dtype(runner.dtype).name)
    # The embedded checkpoint is text-only: no vision encoder, nothing of the budget taken for one.
    assert runner.vision_encoder is None and info["vision_encoder"] is None
    assert usage["vision_encoder"] == 0 and info["memory_split"]["vision_encoder_bytes"] == 0
    # unused_row_bytes counts what the executor keeps resident for a sampling batch size.
    b = runner.programs.sample_batches()[-1]
    resident = sum(x.nbytes for x in runner.executor.unused_inputs(b))
    assert resident == b * sampler.unused_row_bytes(runner.config.vocab_size)


def test_server_info_shows_memory_usage(server) -> None:
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    usage = info["internal_states"][0]["memory_usage"]
    assert {"weight", "kvcache", "token_capacity"} <= usage.keys() and usage["weight"] > 0
    assert usage == memory_accounting.memory_usage(server.engine.runner.params, server.engine.runner.cache,
                                                   usage["token_capacity"])[0]
    # The split: no device limit on CPU, so the KV pool is the default one; the session engine's
    # --max-gdn-snapshots (conftest.ENGINE_KWARGS) sizes the state pool: the trash slot, the running slots and
    # its snapshot slots. (Without it r times the KV pool's bytes: test_overrides_and_limits_of_the_split.)
    split, sizing = info["memory_split"], server.engine.runner.sizing
    cache = server.engine.runner.cache
    assert split["rule"] == "--max-gdn-snapshots" and split["mamba_full_memory_ratio"] == 0.9
    assert split["kv_pool_tokens"] == usage["token_capacity"] == sizing.kv_tokens
    assert split["kv_pool_bytes"] == cache["k"].nbytes + cache["v"].nbytes
    assert split["state_pool_bytes"] == cache["conv"].nbytes + cache["rec"].nbytes
    assert split["running_slots"] == sizing.max_running_per_rank
    assert split["snapshot_slots"] == sizing.num_snapshot_slots == ENGINE_KWARGS["max_gdn_snapshots"]
    assert split["snapshot_slots_bytes"] == sizing.num_snapshot_slots * sizing.units.gdn_per_slot
    assert split["state_pool_bytes"] == (1 + split["running_slots"] + split["snapshot_slots"]) * split[
        "state_slot_bytes"]


def test_kv_cache_dtype_resolves_and_fp8_pool_holds_twice_the_tokens() -> None:
    from sglang_tpu_qwen.engine.runner.sizing import resolve_kv_dtype

    assert resolve_kv_dtype("auto", jnp.float32) == jnp.float32  # auto: the compute dtype, unchanged
    assert resolve_kv_dtype("bf16", jnp.float32) == resolve_kv_dtype("bfloat16", jnp.float32) == jnp.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", jnp.bfloat16) == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        resolve_kv_dtype("fp8_e5m2", jnp.bfloat16)
    c = _config()
    args = ServerArgs(max_running_requests=8, page_size=16, chunked_prefill_size=64)
    bf16 = RunnerSizing.build(c, args, jnp.bfloat16, {_Device(8 * MIB): MIB}).kv_tokens
    fp8 = RunnerSizing.build(c, args, jnp.float8_e4m3fn, {_Device(8 * MIB): MIB}).kv_tokens
    assert abs(fp8 - 2 * bf16) <= 2 * 16  # the same bytes, twice the tokens (page rounding aside)
