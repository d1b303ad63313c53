"""Prefill/decode disaggregation with speculative decoding, behind the real `smg` router: plain tokens.

A prefill and a decode server (subprocesses on loopback, tests/pd_harness.py) both serve the embedded checkpoint
plus a random MTP layer (tests/mtp_checkpoint.py) with SGLang's MTP launch line: the prefill server runs the MTP
layer over the prompt, so its KV travels with the target's in the pages, and sends the drafts it made after the
first token, so the decode server verifies drafts from its first step (no verify row without drafts). The
reference is the session's plain engine on the same target weights.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import numpy as np
from conftest import free_port
from mtp_checkpoint import build_mtp_checkpoint
from pd_harness import SMALL, RouterProc, ServerProc, assert_idle_and_free

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--speculative-draft-policy", "always"]
GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}


def test_pd_with_mtp_on_the_decode_server(engine: Any, tmp_path_factory: Any) -> None:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))
    rng = np.random.default_rng(5)
    bodies = [{"input_ids": rng.integers(1000, 200000, size=n).tolist(), "sampling_params": GREEDY}
              for n in (7, 40, 90)]
    logs = tmp_path_factory.mktemp("pd_spec")
    common = [*SMALL, "--model-path", str(path), *SPEC, "--disable-precompile", "--skip-server-warmup"]
    bport = free_port()
    prefill = ServerProc.launch(logs, "prefill", [*common, "--disaggregation-mode", "prefill",
                                                  "--disaggregation-bootstrap-port", str(bport)])
    decode = router = None
    try:
        decode = ServerProc.launch(logs, "decode", [*common, "--disaggregation-mode", "decode"])
        want = [o["output_ids"] for o in engine.generate(input_ids=[b["input_ids"] for b in bodies],
                                                         sampling_params=GREEDY)]
        prefill.wait_ready(240)
        decode.wait_ready(240)
        router = RouterProc.start(logs, prefill, bport, decode)
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: httpx.post(router.url + "/generate", json=b, timeout=300), bodies))
        for r in replies:
            assert r.status_code == 200, r.text
        assert [r.json()["output_ids"] for r in replies] == want
        state = decode.info()["internal_states"][0]
        assert state["spec_verify_rows"] > 0 and state["spec_draft_tokens"] > 0, state
        assert state["spec_undrafted_rows"] == 0, state  # drafts from the first step: the prefill server's
        assert decode.info()["disaggregation"]["transfers_done"] >= len(bodies)
        assert_idle_and_free(prefill)
        assert_idle_and_free(decode)
    finally:
        for p in (router, decode, prefill):
            if p is not None:
                p.stop()
