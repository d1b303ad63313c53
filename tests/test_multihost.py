"""Two JAX processes on loopback (CPU backend, gloo collectives) run the sharded forward (dp2 attention +
ep2 experts over one global mesh) and match the single-process forward.

Each child process owns one CPU device; it builds the global mesh, runs prefill + decode and writes the
gathered hidden states; the parent compares them with ``forward_step`` on one device.
Tolerance: 2e-4 of the largest magnitude (float32; summation order differs, see test_parallel_moe.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

TOL = 2e-4
B, T, PS, PAGES, SLOTS = 4, 6, 4, 16, 6
NEW_PREFILL = np.array([6, 2, 0, 4], np.int32)


def _setup():
    import jax
    import jax.numpy as jnp

    from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict, init_embedded_params
    from sglang_tpu_qwen.model.config import Qwen35MoeConfig

    d = embedded_config_dict()
    d["text_config"].update(vocab_size=512, num_experts=16, num_experts_per_tok=4)
    config = Qwen35MoeConfig.from_hf_dict(d)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init_embedded_params(config))
    rng = np.random.default_rng(0)
    tok_p = rng.integers(1, config.vocab_size, (B, T)).astype(np.int32)
    tok_d = rng.integers(1, config.vocab_size, (B, 1)).astype(np.int32)
    # Two rows per rank; rank-local pages 1..3 / 4..6 and slots 1, 2 (page 0 and slot 0 are trash).
    local_pt = np.array([[1, 2, 3], [4, 5, 6]] * 2, np.int32)
    local_slot = np.array([1, 2, 1, 2], np.int32)
    rank = np.arange(B) // 2
    global_pt = local_pt + (rank * (PAGES // 2))[:, None]
    global_slot = local_slot + rank * (SLOTS // 2)
    steps = [(tok_p, np.zeros(B, np.int32), NEW_PREFILL), (tok_d, NEW_PREFILL, np.ones(B, np.int32))]
    return config, params, steps, (local_pt, local_slot), (global_pt.astype(np.int32), global_slot.astype(np.int32))


def _child(rank: int, addr: str, out: str) -> None:
    from sglang_tpu_qwen.parallel import multihost

    multihost.initialize(2, rank, addr, cpu=True)
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    from sglang_tpu_qwen.model.forward import init_cache
    from sglang_tpu_qwen.model.forward_batch import ForwardBatch
    from sglang_tpu_qwen.parallel import sharding
    from sglang_tpu_qwen.parallel.mesh import make_layout
    from sglang_tpu_qwen.parallel.sharded_forward import make_sharded_forward

    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.process_count() == 2 and len(jax.devices()) == 2
    config, params, steps, (pt, slot), _ = _setup()
    lay = make_layout(2, 2)
    sp = multihost.put_tree(params, sharding.shardings(sharding.param_pspecs(params, lay), lay))
    cache = multihost.put_tree(init_cache(config, PAGES, PS, SLOTS, jnp.float32),
                               sharding.shardings(sharding.cache_pspecs(lay), lay))
    bs = NamedSharding(lay.mesh, sharding.batch_pspec(lay))
    fwd = jax.jit(make_sharded_forward(lay, config, params))
    hs = []
    for tok, pre, new in steps:
        args = [multihost.global_array(a, bs) for a in (tok, pre, new, pt, slot)]
        h, cache = fwd(sp, cache, ForwardBatch.of(*args))
        hs.append(np.asarray(multihost_utils.process_allgather(h, tiled=True)))
    if multihost.is_serving_rank():
        np.savez(out, prefill=hs[0], decode=hs[1])


def test_two_process_forward_matches_single_process(tmp_path):
    import socket

    import jax
    import jax.numpy as jnp

    from sglang_tpu_qwen.model.forward import forward_step, init_cache
    from sglang_tpu_qwen.model.forward_batch import ForwardBatch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "hidden.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(r), f"127.0.0.1:{port}", str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(x[-3000:] for x in logs)

    config, params, steps, _, (gpt, gslot) = _setup()
    got = np.load(out)
    cache = init_cache(config, PAGES, PS, SLOTS, jnp.float32)
    fwd = jax.jit(functools.partial(forward_step, config=config))
    with jax.default_matmul_precision("highest"):
        for name, (tok, pre, new) in zip(("prefill", "decode"), steps, strict=True):
            h, cache = fwd(params, cache, ForwardBatch.of(tok, pre, new, gpt, gslot))
            valid = np.arange(tok.shape[1])[None, :] < new[:, None]
            want = np.asarray(h)[valid]
            err = np.max(np.abs(got[name][valid] - want)) / np.max(np.abs(want))
            print(f"{name}: max error / max |ref| = {err:.2e}")
            assert err < TOL, (name, err)


if __name__ == "__main__":
    _child(int(sys.argv[1]), sys.argv[2], sys.argv[3])
