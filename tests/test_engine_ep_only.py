"""One DP rank with expert parallelism (--dp-size 1 --ep-size 4, 4 emulated devices): extend steps sample
only the rows that finish their prompt there too (the `head_rows` programs on a mesh), and the greedy
tokens equal those of the single-device engine. Runs in a child process: the device count is fixed when
JAX starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import json
from sglang_tpu_qwen.engine.engine import Engine

prompts = [list(range(100, 100 + n)) for n in (50, 30, 9, 61, 5, 22)]
params = {"temperature": 0, "max_new_tokens": 4}
result = {}
for name, extra in (("one_device", {}), ("dp1_ep4", {"ep_size": 4})):
    eng = Engine(max_total_tokens=1024, page_size=4, max_running_requests=8, chunked_prefill_size=64,
                 disable_precompile=True, **extra)
    try:
        runner = eng.scheduler.runner
        steps = []
        sample = runner.sample

        def spy(step, batch, sample=sample, steps=steps):
            steps.append([step.last.shape[0], batch.temperature.shape[0]])
            return sample(step, batch)

        runner.sample = spy
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        result[name] = {"tokens": [o["output_ids"] for o in outs], "steps": steps,
                        "devices": len(runner.cache["k"].sharding.device_set)}
    finally:
        eng.shutdown()
print("RESULT " + json.dumps(result))
"""


def test_dp1_ep4_samples_finishing_rows_and_matches_one_device() -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + (
        " --xla_force_host_platform_device_count=4 --xla_cpu_use_xnnpack=false"
        " --xla_cpu_enable_concurrency_optimized_scheduler=false"))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parent.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(lines[-1][len("RESULT "):])
    one, ep = got["one_device"], got["dp1_ep4"]
    assert (one["devices"], ep["devices"]) == (1, 4)
    assert ep["tokens"] == one["tokens"]
    assert all(len(t) == 4 for t in ep["tokens"])
    compacted = [s for s in ep["steps"] if s[0] != s[1]]
    assert compacted and all(sampled < fed for fed, sampled in compacted), ep["steps"]
