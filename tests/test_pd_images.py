"""Prefill/decode disaggregation with images, behind the real `smg` router: the colocated engine's tokens.

One prefill server and one decode server on the tiny MoE VL checkpoint (tests/vl_checkpoint.py) run as
subprocesses on loopback (tests/pd_harness.py: SMALL pools, the shared compile cache, the memory-invariant
check on). The prefill server encodes the images and runs the prompt; the decode server receives KV + GDN state
and continues from the M-RoPE position offset, which it derives itself from the same request (prompt ids and
image grids: engine/io/request_images.py), never from the wire. The reference is the colocated `vl_engine` of
conftest served over HTTP, so both sides preprocess the same request bodies the same way. The decode server's KV
pool is small, so a running image request is usually retracted there and re-prefilled locally (images encoded
by the decode server); the tokens must match whether or not that happens.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time
from typing import Any

import httpx
import numpy as np
from conftest import free_port, record, serve_app
from pd_harness import SMALL, RouterProc, ServerProc, assert_idle_and_free
from PIL import Image

from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model

PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is in the picture? Describe it briefly."
# 24 new tokens: an image request grows past its admitted pages on the decode server, whose small KV pool
# (DECODE_POOL) then retracts the newest running request; its local re-prefill encodes its images there.
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
DECODE_POOL = ["--max-total-tokens", "96", "--context-length", "64"]  # 6 pages of 16 tokens


def _data_url(seed: int, h: int, w: int) -> str:
    px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _bodies() -> list[dict[str, Any]]:
    """Two different images (of different sizes, so different grids and rope deltas), one of them twice (the
    second time a prefix-cache hit on the prefill server), an image chat turn and a text-only request."""
    one, two = _data_url(1, 24, 16), _data_url(2, 16, 32)
    return [
        {"text": PROMPT, "image_data": one, "sampling_params": GREEDY},
        {"text": PROMPT, "image_data": two, "sampling_params": GREEDY},
        {"text": "Two pictures: <|vision_start|><|image_pad|><|vision_end|> and "
                 "<|vision_start|><|image_pad|><|vision_end|>. Compare.", "image_data": [two, one],
         "sampling_params": GREEDY},
        {"text": "A text-only question about colours, shapes and sizes.", "sampling_params": GREEDY},
    ]


def test_image_requests_through_pd_match_colocated(vl_checkpoint: Any, vl_engine: Any,
                                                   tmp_path_factory: Any) -> None:
    from sglang_tpu_qwen.server.app import create_app

    _, path = vl_checkpoint("moe")
    bodies = _bodies()
    logs = tmp_path_factory.mktemp("pd_images")
    # Both servers start side by side and compile only the programs they run (--disable-precompile; the
    # compilation counter after ready is test_compile.py's business), sharing the persistent compile cache.
    common = [*SMALL, "--model-path", str(path), "--tokenizer-path", str(ensure_embedded_model()),
              "--mm-max-patches", "256", "--mm-embedding-cache-size-mb", "1", "--disable-precompile",
              "--skip-server-warmup"]
    bport = free_port()
    t0 = time.perf_counter()
    prefill = ServerProc.launch(logs, "prefill", [*common, "--disaggregation-mode", "prefill",
                                                  "--disaggregation-bootstrap-port", str(bport)])
    decode = router = None
    try:
        decode = ServerProc.launch(logs, "decode", [*common, *DECODE_POOL, "--disaggregation-mode", "decode"])
        with serve_app(create_app(vl_engine)) as base:  # the reference, while the servers start
            want = []
            for b in bodies:
                r = httpx.post(base + "/generate", json=b, timeout=300)
                assert r.status_code == 200, r.text
                want.append(r.json()["output_ids"])
        assert len({tuple(w) for w in want}) > 1  # the images steer the tokens: a lost image would show
        prefill.wait_ready(240)
        decode.wait_ready(240)
        router = RouterProc.start(logs, prefill, bport, decode)
        started = time.perf_counter() - t0
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: httpx.post(router.url + "/generate", json=b, timeout=300), bodies))
        for r in replies:
            assert r.status_code == 200, r.text
        assert [r.json()["output_ids"] for r in replies] == want
        # The same image request again: the prefill server's radix cache hits past the image, same tokens.
        again = httpx.post(router.url + "/generate", json=bodies[0], timeout=300)
        assert again.status_code == 200, again.text
        assert again.json()["output_ids"] == want[0]
        assert again.json()["meta_info"]["cached_tokens"] > 0
        assert decode.info()["disaggregation"]["transfers_done"] >= len(bodies) + 1
        assert prefill.info()["vision_encoder"]["stats"]["encoded"] >= 2
        assert_idle_and_free(prefill)
        assert_idle_and_free(decode)
        # Whether the decode server retracted depends on how the transfers overlapped (the tokens above must
        # match either way); the figures say what this run exercised.
        retracted = decode.log.read_text(errors="replace").count("retracting request")
        record("pd", f"TCP PD via smg on the VL checkpoint: 4 concurrent requests (2 images, 1 text) + a cached "
                     f"repeat token-identical to colocated; servers + router up {started:.1f} s after launch; "
                     f"decode server: {retracted} retractions, encoder {decode.info()['vision_encoder']['stats']}")
    finally:
        for p in (router, decode, prefill):
            if p is not None:
                p.stop()
