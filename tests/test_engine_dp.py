"""The HTTP server on 8 emulated devices with --dp-size 8 --ep-size 8 (the Ironwood host layout) gives the
same greedy tokens as the single-device engine.

The server runs in a child process (8 CPU devices need XLA_FLAGS before JAX starts); the reference is the
session `engine` of this process (1 device, same embedded weights). Each DP rank owns its own KV pages,
GDN slots and radix tree, so the test also checks that a request sharing a cached prefix goes to the rank
holding it (cached_tokens > 0) and that every page and slot of every rank is free at the end.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.conftest import free_port, record

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a land far away, there lived a " * 6,
    "The quick brown fox jumps over the lazy dog. " * 12,
    "import numpy as np\nimport jax\n",
    "Question: what is the boiling point of water at sea level?\nAnswer:",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
    "Hello!",
    "SGLang serves structured generation programs.",
]
MAX_NEW = 12
SHARED = "You are a helpful assistant. Answer briefly and precisely, and cite sources. " * 3


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Same flags as tests/test_parallel_moe.py: collectives on XLA:CPU's small thread pool must not starve.
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + (
        " --xla_force_host_platform_device_count=8 --xla_cpu_use_xnnpack=false"
        " --xla_cpu_enable_concurrency_optimized_scheduler=false")
    env["JAX_PLATFORMS"] = "cpu"
    env["SGLANG_TPU_QWEN_CHECK_INVARIANTS"] = "1"  # page/slot ownership (per rank) checked every step
    return env


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("dp_server") / "server.log"
    log = open(log_path, "w")  # a file, not a pipe: nobody drains a pipe while the tests run
    cmd = [sys.executable, "-m", "sglang_tpu_qwen.launch_server", "--port", str(port), "--dp-size", "8",
           "--ep-size", "8", "--max-running-requests", "16", "--max-total-tokens", "1024", "--context-length",
           "256", "--chunked-prefill-size", "2048", "--skip-server-warmup", "--log-level", "warning",
           "--max-gdn-snapshots", "8",  # a 1024-token KV pool leaves the ratio rule no room for a snapshot
           "--disable-precompile",  # 8-device programs compile on first use: startup stays within the deadline
           "--grammar-backend", "none"]  # no constrained requests here: skip loading xgrammar (+ torch)
    proc = subprocess.Popen(cmd, env=_child_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _greedy(max_new: int = MAX_NEW) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def test_dp8_ep8_server_matches_single_device(dp_server, engine):
    t0 = time.perf_counter()
    reply = httpx.post(f"{dp_server}/generate", json={"text": PROMPTS, "sampling_params": _greedy()}, timeout=600)
    assert reply.status_code == 200, reply.text
    got = [r["output_ids"] for r in reply.json()]
    record("engine dp8 ep8", f"{len(PROMPTS)} prompts x {MAX_NEW} greedy tokens on 8 emulated devices: "
                             f"{time.perf_counter() - t0:.1f} s incl. compilation")
    want = [r["output_ids"] for r in engine.generate(prompt=PROMPTS, sampling_params=_greedy())]
    assert got == want

    info = httpx.get(f"{dp_server}/get_server_info", timeout=30).json()
    ranks = info["memory"]["dp_ranks"]
    assert len(ranks) == 8
    # 10 requests over 8 ranks of 2 running slots each: the least-loaded rule used every rank.
    assert all(r["cache_query_tokens"] > 0 for r in ranks), ranks


def test_shared_prefix_goes_to_the_rank_that_cached_it(dp_server, engine):
    # A follow-up turn extends the first prompt: its prefix (up to the first prompt's last page boundary,
    # where a GDN snapshot was taken) is cached on the rank that ran the first request only.
    first_text = SHARED + "First question?"
    second_text = first_text + " And a follow-up question about it?"
    first = httpx.post(f"{dp_server}/generate", json={"text": first_text, "sampling_params": _greedy(4)},
                       timeout=300).json()
    second = httpx.post(f"{dp_server}/generate", json={"text": second_text, "sampling_params": _greedy(4)},
                        timeout=300).json()
    assert first["meta_info"]["cached_tokens"] == 0
    boundary = 16 * ((len(engine.tokenizer.encode(first_text)) - 1) // 16)  # page size 16
    assert boundary >= 32
    assert second["meta_info"]["cached_tokens"] >= boundary, second["meta_info"]
    want = engine.generate(prompt=second_text, sampling_params=_greedy(4))
    assert second["output_ids"] == want["output_ids"]


def test_every_rank_frees_its_pages_and_slots(dp_server):
    # Runs after the generation tests (file order): flush the radix trees, then every id is back.
    assert httpx.post(f"{dp_server}/flush_cache", timeout=60).status_code == 200
    mem = httpx.get(f"{dp_server}/get_server_info", timeout=30).json()["memory"]
    for r in mem["dp_ranks"]:
        assert r["kv_pages_free"] == r["kv_pages_total"] and r["gdn_slots_free"] == r["gdn_slots_total"], r
        assert r["snapshot_slots_free"] == r["snapshot_slots_total"], r


def test_each_device_holds_only_its_expert_shard(dp_server, engine):
    """The streaming load put 1/8 of every expert stack and a full copy of everything else on each device:
    per-device weight bytes (memory_usage, from the arrays' addressable_shards) are replicated + experts / 8,
    not more (an expert stack assembled whole on a device would show up here)."""
    import jax

    from sglang_tpu_qwen.parallel.sharding import EXPERT_LEAVES

    params = engine.runner.params  # the same checkpoint and dtype on one device
    expert = sum(x.nbytes for p, x in jax.tree_util.tree_leaves_with_path(params)
                 if {getattr(k, "key", None) for k in p} & EXPERT_LEAVES)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert 0 < expert < total and expert % 8 == 0
    states = httpx.get(f"{dp_server}/get_server_info", timeout=30).json()["internal_states"]
    assert len(states) == 8
    per_device = [s["memory_usage"]["weight_bytes"] for s in states]
    assert per_device == [total - expert + expert // 8] * 8, per_device
    record("engine dp8 ep8", f"weights per device {per_device[0] / 2**20:.1f} MiB of {total / 2**20:.1f} MiB total")
    assert all(s["memory_usage"]["token_capacity"] == 1024 for s in states)


# ---- images on DP ranks: a dp_size=2 engine on the tiny VL checkpoint, in a child with 2 emulated devices ----

# conftest.VL_ENGINE_KWARGS with a running slot per rank and the chunk split over the two ranks.
VL_DP_KWARGS = dict(max_running_requests=2, context_length=64, chunked_prefill_size=32, max_prefill_tokens=64,
                    mm_max_patches=256, mm_embedding_cache_size_mb=1, grammar_backend="none")
VL_PAD, VL_START, VL_END = 248056, 248053, 248054


def vl_image_requests(model_dir: str) -> tuple[list[list[int]], list[Any]]:
    """Four prompts for the VL checkpoint: one image, another image (another size), both, and text only; with
    their ImageItems (the server's preprocessor), one list (or None) per prompt."""
    import numpy as np
    from PIL import Image

    from sglang_tpu_qwen.multimodal.preprocess import ImagePreprocessor

    pre = ImagePreprocessor.from_checkpoint(model_dir, max_patches=256)
    assert pre is not None
    one, two = (pre(Image.fromarray(np.random.default_rng(s).integers(0, 256, (h, w, 3), dtype=np.uint8)))
                for s, h, w in ((1, 24, 16), (2, 16, 32)))
    rng = np.random.default_rng(5)

    def text(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, 240000, n)]

    def img(item: Any) -> list[int]:
        return [VL_START] + [VL_PAD] * item.num_tokens + [VL_END]

    prompts = [text(4) + img(one) + text(20), text(3) + img(two) + text(21), text(2) + img(two) + text(3) + img(one)
               + text(9), text(30)]
    return prompts, [[one], [two], [two, one], None]


def vl_dp_greedy(model_dir: str, num_new: int) -> dict[str, Any]:
    """Greedy tokens of a dp_size=2 Engine on the VL checkpoint for vl_image_requests (one batch), then the first
    prompt again (its cached_tokens). Runs in a child process with 2 emulated devices; JSON-able result."""
    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
    from sglang_tpu_qwen.engine.engine import Engine

    prompts, images = vl_image_requests(model_dir)
    eng = Engine(model_path=model_dir, tokenizer_path=str(ensure_embedded_model()), dp_size=2, ep_size=2,
                 skip_server_warmup=True, disable_precompile=True, **VL_DP_KWARGS)
    sp = {"temperature": 0, "max_new_tokens": num_new, "ignore_eos": True}
    try:
        replies = eng.generate(input_ids=prompts, sampling_params=sp, images=images)
        again = eng.generate(input_ids=prompts[0], sampling_params=sp, images=images[0])
        ranks = eng.get_server_info()["memory"]["dp_ranks"]
        return {"tokens": [r["output_ids"] for r in replies], "again": again["output_ids"],
                "again_cached": again["meta_info"]["cached_tokens"], "ranks_used": sum(
                    r["cache_query_tokens"] > 0 for r in ranks)}
    finally:
        eng.shutdown()


def test_dp2_images_match_single_engine(vl_checkpoint, vl_engine):
    """Image prompts on a dp_size=2 engine (each rank its own requests, positions and image embeddings) give the
    single engine's greedy tokens, and the same image prompt again hits its rank's prefix cache."""
    from emulated_devices import run_on_devices

    _, path = vl_checkpoint("moe")
    t0 = time.perf_counter()
    code = ("import json; from test_engine_dp import vl_dp_greedy; "
            f"print('RESULT ' + json.dumps(vl_dp_greedy({str(path)!r}, 6)))")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        child = pool.submit(run_on_devices, code, 2)
        prompts, images = vl_image_requests(str(path))  # the reference, while the child starts
        sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
        want = [vl_engine.generate(input_ids=p, sampling_params=sp, images=im)["output_ids"]
                for p, im in zip(prompts, images, strict=True)]
        got = child.result()
    assert len({tuple(w) for w in want}) > 1
    record("engine dp2 images", f"4 prompts (2 images, 1 text) + a repeat on dp_size=2: "
                                f"{time.perf_counter() - t0:.1f} s incl. the child's start and compilation")
    assert got["tokens"] == want
    assert got["again"] == want[0]
    assert got["again_cached"] > 0
    assert got["ranks_used"] == 2
