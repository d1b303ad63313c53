"""GDN slot operations (memory/gdn_state.py) on a cache split over 8 data-parallel ranks equal the same
operations on one device, slot for slot: copies within ranks, NaN fill, a host write and reads, and the host
tier's asynchronous demotion (a pending device copy, its source slot overwritten right after, written back).

8 CPU devices need XLA_FLAGS before JAX starts, so the check runs in a child process (this file as a
script), which prints "OK" after comparing every slot of both caches exactly (copies move bytes; nothing
is computed).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_ranked_slot_ops_match_single_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + (
        " --xla_force_host_platform_device_count=8 --xla_cpu_use_xnnpack=false"
        " --xla_cpu_enable_concurrency_optimized_scheduler=false")
    env["JAX_PLATFORMS"] = "cpu"
    env["PJRT_NPROC"] = "16"
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "OK", proc.stdout[-2000:]


def _main() -> None:
    import jax
    import numpy as np

    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
    from sglang_tpu_qwen.memory import gdn_state
    from sglang_tpu_qwen.model.config import load_config
    from sglang_tpu_qwen.model.forward import init_cache
    from sglang_tpu_qwen.parallel.mesh import make_layout
    from sglang_tpu_qwen.parallel.sharding import shard_cache

    cfg = load_config(str(ensure_embedded_model()))
    ranks, per_rank = 8, 6
    rng = np.random.default_rng(0)
    base = init_cache(cfg, ranks * 2, 4, ranks * per_rank, np.float32, np.float32)
    base = {k: jax.numpy.asarray(rng.standard_normal(v.shape).astype(np.float32)) for k, v in base.items()}
    host = {k: np.asarray(v) for k, v in base.items()}
    plain = {k: jax.numpy.array(v) for k, v in host.items()}
    split = shard_cache({k: jax.numpy.array(v) for k, v in host.items()}, make_layout(ranks, ranks))

    def g(rank: int, local: int) -> int:
        return rank * per_rank + local

    pairs = [(g(0, 1), g(0, 4)), (g(3, 2), g(3, 5)), (g(3, 1), g(3, 4)), (g(7, 3), g(7, 1))]
    nan_slots = [g(1, 2), g(5, 3), g(5, 4)]
    conv, rec = gdn_state.read_slot(plain, g(2, 1))
    for name, cache in (("plain", plain), ("split", split)):
        cache = gdn_state.copy_slots(cache, pairs)
        cache = gdn_state.fill_nan(cache, nan_slots)
        cache = gdn_state.write_slot(cache, g(6, 5), conv, rec)
        # Demotion without waiting, the slot reused at once (NaN here), then a promotion from the pending copy.
        pending = gdn_state.read_slot_async(cache, g(4, 2))
        cache = gdn_state.fill_nan(cache, [g(4, 2)])
        cache = gdn_state.write_slot(cache, g(1, 3), *pending)
        if name == "plain":
            plain = cache
        else:
            split = cache
    assert split["conv"].sharding.spec == jax.sharding.PartitionSpec(None, ("data", "expert")), split["conv"].sharding
    taps = cfg.linear_conv_kernel_dim - 1
    for key in ("conv", "rec"):
        want = np.asarray(plain[key])
        got = np.asarray(split[key])
        np.testing.assert_array_equal(got, want)  # NaNs compare equal here
        # Slot-indexed views: the conv pool holds K-1 rows per slot (kernels/gdn/conv_pool.py).
        if key == "conv":
            want = want.reshape(want.shape[0], -1, taps, want.shape[2] * want.shape[3])
            host[key] = host[key].reshape(want.shape)
        expect = host[key].copy()
        for s, d in pairs:
            expect[:, d] = host[key][:, s]
        expect[:, nan_slots] = np.nan
        expect[:, g(6, 5)] = host[key][:, g(2, 1)]
        expect[:, g(1, 3)] = host[key][:, g(4, 2)]
        expect[:, g(4, 2)] = np.nan
        np.testing.assert_array_equal(want, expect)
    for slot in (g(0, 4), g(6, 5), g(7, 1)):
        for a, b in zip(gdn_state.read_slot(split, slot), gdn_state.read_slot(plain, slot), strict=True):
            np.testing.assert_array_equal(a, b)
    print("OK")


if __name__ == "__main__":
    _main()
