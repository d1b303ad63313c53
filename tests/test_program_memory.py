"""Memory from the compiled programs (engine/runner/program_memory.py), checked deviceless for one TPU v5e chip.

On the chip the embedded default did not start: a step program needed 32 GB of temporaries because XLA's
default layout for a pool whose minor dims are below the TPU's (8, 128) tile (attention head_dim 64, GDN
heads of 32) differs from the layout the Pallas kernel and the GDN fusions use, so it copied the pools into
that layout and back around every step. Here, with ``libtpu`` and no TPU, the server's own runner
(``ModelRunner.abstract``, the constructor the server's goes through) is compiled for ``v5e:1x1``:

* the embedded default runs both Pallas kernels, and its step programs' temporaries are a small fraction of
  the pools (updated in place: donated and aliased);
* the pools are sized after the probed temporaries and fit the chip with them;
* the old embedded dims show the copy (temporaries about the pools' size), so the measure catches it.
"""

from __future__ import annotations

import os

# See test_kernels_aot_ironwood.py: libtpu's lockfile, and the deviceless client's environment.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import copy  # noqa: E402

import pytest  # noqa: E402

from sglang_tpu_qwen.args.server_args import ServerArgs  # noqa: E402
from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict  # noqa: E402
from sglang_tpu_qwen.engine.runner.compilation import persistent_cache_off  # noqa: E402
from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner  # noqa: E402
from sglang_tpu_qwen.engine.runner.program_memory import largest_keys, measure  # noqa: E402
from sglang_tpu_qwen.model.config import Qwen35MoeConfig  # noqa: E402

topologies = pytest.importorskip("jax.experimental.topologies")

V5E_HBM = int(15.75 * 2**30)  # one v5e chip's HBM as JAX reports it (bytes_limit)


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    """Deviceless executables cannot be loaded back from the persistent cache (engine/runner/compilation.py)."""
    with persistent_cache_off():
        yield


@pytest.fixture(scope="module")
def v5e() -> list:
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1", chips_per_host_bounds=(1, 1, 1))
    except Exception as e:  # no libtpu, or one that does not know the chip
        pytest.skip(f"no deviceless v5e topology: {e}")
    return topo.devices


def _runner(config_dict: dict, devices: list, probe: bool = True, **flags) -> ModelRunner:
    args = ServerArgs(**flags)
    args.resolve_chunked_prefill_size("tpu", V5E_HBM)
    return ModelRunner.abstract(Qwen35MoeConfig.from_hf_dict(config_dict), args, devices, platform="tpu",
                                device_memory_bytes=V5E_HBM, probe_temporaries=probe)


def _pool_bytes(runner: ModelRunner) -> int:
    return runner.sizing.split.kv_bytes + runner.sizing.split.state_bytes


def test_default_engine_updates_pools_in_place_and_sizes_them_after_temporaries(v5e) -> None:
    """Default flags on one v5e chip: both Pallas kernels, pools sized after the probed temporaries and within
    the chip with them, and the largest decode and prefill programs (the served shapes, full pools) with
    temporaries under 1% of the pools (the issue asks < 10%), the pools aliased to the outputs."""
    runner = _runner(embedded_config_dict(), v5e)
    assert (runner.backends.attention.name, runner.backends.gdn.name) == ("pallas", "pallas")
    split = runner.sizing.split
    assert runner.probe is not None and split.temporaries == runner.probe.temp_bytes > 0
    assert split.device_bytes <= V5E_HBM and _pool_bytes(runner) > 0.5 * V5E_HBM
    forward = [k for k in runner.program_keys() if k[0] == "forward"]
    decode = max((k for k in forward if k[1].mode == "decode"), key=lambda k: k[1].batch)
    extend = max((k for k in forward if k[1].mode == "extend"), key=lambda k: k[1].batch * k[1].tokens)
    compiled = [(k, runner.programs.lower(k).compile()) for k in (decode, extend)]
    memory = measure(compiled, pool_bytes=_pool_bytes(runner))
    assert memory.programs == 2 and memory.pool_ratio is not None and memory.pool_ratio < 0.01, memory.describe()
    for _, prog in compiled:
        assert prog.memory_analysis().alias_size_in_bytes >= _pool_bytes(runner)  # every pool updated in place


def test_pool_dims_below_the_tile_show_as_pool_sized_temporaries(v5e) -> None:
    """The first chip run's embedded dims (head_dim 64, GDN heads of 32): the decode program copies the pools
    (temporaries over half their bytes), which the measure reports and the runner's precompile refuses."""
    old = copy.deepcopy(embedded_config_dict())
    old["text_config"].update(head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32)
    old["text_config"]["rope_parameters"]["mrope_section"] = [3, 3, 2]
    runner = _runner(old, v5e, probe=False, max_total_tokens=256 * 1024, max_gdn_snapshots=4096)
    decode = next(k for k in runner.program_keys() if k[0] == "forward" and k[1].mode == "decode")
    memory = measure([(decode, runner.programs.lower(decode).compile())], pool_bytes=_pool_bytes(runner))
    assert memory.pool_ratio is not None and memory.pool_ratio > 0.5, memory.describe()


def test_largest_keys_take_the_largest_shape_of_each_kind() -> None:
    """One key per kind: forward buckets by batch x tokens, sampling per kind by batch, the rest by batch."""
    from sglang_tpu_qwen.engine.runner.buckets import StepBucket

    keys = [("forward", StepBucket("decode", 32, 1, 64)), ("forward", StepBucket("extend", 1, 2048, 64)),
            ("forward", StepBucket("extend", 8, 256, 64)), ("sample", "greedy", 4), ("sample", "greedy", 32),
            ("sample", "sample", 8), ("penalty", 32), ("penalty", 1), ("prompt_logprobs",)]
    assert set(largest_keys(keys)) == {("forward", StepBucket("extend", 1, 2048, 64)), ("sample", "greedy", 32),
                                       ("sample", "sample", 8), ("penalty", 32), ("prompt_logprobs",)}
