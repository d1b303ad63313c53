"""The server's runner and the planner's come from one constructor and run the same programs.

The server builds `ModelRunner.from_checkpoint` (the embedded checkpoint read onto the devices); the planner
builds `tools.plan.abstract_runner` (`ModelRunner.abstract`: ShapeDtypeStructs with shardings, nothing read).
From the same config and flags both must size the same pools, enumerate the same program keys and lower the
same forward and sampling programs (identical StableHLO text), and neither may change the ServerArgs. Checked
on one device in this process and on a 4-device mesh (--dp-size 4 --ep-size 4, as the planner's 8 x 8) in a
child process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def compare_runners(**flags: Any) -> dict[str, Any]:
    """Build both runners from one ServerArgs(**flags) and report what they share (JSON-able)."""
    import jax

    from sglang_tpu_qwen.args.server_args import ServerArgs
    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
    from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner
    from sglang_tpu_qwen.engine.runner.sizing import resolve_device_defaults
    from sglang_tpu_qwen.model.config import load_config
    from sglang_tpu_qwen.tools import plan

    path = str(ensure_embedded_model())
    args = ServerArgs(model_path=path, **flags)
    resolve_device_defaults(args)  # as Engine does, once, before the runner
    before = dataclasses.asdict(args)
    server = ModelRunner.from_checkpoint(path, args)
    planner = plan.abstract_runner(load_config(path), args, jax.devices(), fp8=False, block=(128, 128),
                                   platform=jax.default_backend())
    decode = server.buckets.decode_bucket(1)
    batch = decode.batch

    def text(lowered: Any) -> str:
        return lowered.as_text()

    def structure(tree: Any) -> list[tuple[tuple[int, ...], str]]:
        return [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(tree)]

    return {
        "devices": len(server.cache["k"].sharding.device_set),
        "abstract": [server.is_abstract, planner.is_abstract],
        "keys": [len(server.program_keys()), server.program_keys() == planner.program_keys()],
        "sizing_equal": server.sizing == planner.sizing,
        "params_equal": structure(server.params) == structure(planner.params),
        "cache_equal": structure(server.cache) == structure(planner.cache),
        "forward_hlo_equal": text(server.lower_forward(decode)) == text(planner.lower_forward(decode)),
        "sample_hlo_equal": text(server.lower_sample("greedy", batch)) == text(planner.lower_sample("greedy", batch)),
        "args_unchanged": dataclasses.asdict(args) == before,
    }


def _check(got: dict[str, Any], devices: int) -> None:
    assert got["devices"] == devices
    assert got["abstract"] == [False, True]
    n_keys, same_keys = got["keys"]
    assert n_keys >= 5 and same_keys
    for name in ("sizing_equal", "params_equal", "cache_equal", "forward_hlo_equal", "sample_hlo_equal",
                 "args_unchanged"):
        assert got[name], (name, got)


FLAGS = dict(max_total_tokens=512, page_size=16, max_running_requests=4, context_length=256)


def test_server_and_planner_runners_match_on_one_device() -> None:
    _check(compare_runners(**FLAGS), devices=1)


def test_server_and_planner_runners_match_on_a_mesh() -> None:
    child = ("import json, tests.test_runner_constructor as t; "
             "print('RESULT ' + json.dumps(t.compare_runners(dp_size=4, ep_size=4, **t.FLAGS)))")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + (
        " --xla_force_host_platform_device_count=4 --xla_cpu_use_xnnpack=false"
        " --xla_cpu_enable_concurrency_optimized_scheduler=false"))
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    _check(json.loads(lines[-1][len("RESULT "):]), devices=4)
