"""MTP speculative decoding on the chip gives plain greedy decoding's tokens.

SGLang's launch line for the family (``--speculative-algorithm NEXTN --speculative-num-steps 3
--speculative-eagle-topk 1 --speculative-num-draft-tokens 4``) on the embedded checkpoint plus a random MTP layer
(tests/mtp_checkpoint.py), Pallas kernels, float32, against the same checkpoint without speculation. The plain
engine runs first and is shut down before the speculative one starts. Every decode step drafts and verifies
(``--speculative-draft-policy always``: the adaptive policy follows measured step times, which differ on the
chip). Random MTP weights almost never draft the target's token, so a second test injects drafts from the plain
continuation, corrupted on a fixed schedule so that verify steps accept all drafts, some, or none
(tests/test_speculative.py's ``oracle_drafts``): the accepted-run and rollback paths of the chip's programs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mtp_checkpoint import build_mtp_checkpoint
from test_speculative import oracle_drafts

from .suite import (
    ENGINE_KWARGS,
    GREEDY,
    PALLAS,
    assert_memory_back,
    highest_precision,
    ids,
    output_ids,
    running_engine,
)

# 64-token chunks: the 150-token prompt prefills in three chunks (the MTP layer drafts after each).
KWARGS: dict[str, Any] = dict(ENGINE_KWARGS, **PALLAS, chunked_prefill_size=64, disable_precompile=True)
SPEC: dict[str, Any] = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1,
                            speculative_num_draft_tokens=4, speculative_draft_policy="always")
SP = dict(GREEDY, max_new_tokens=40)
MTP_PROMPTS = [ids(1, 9), ids(2, 70), ids(3, 150)]  # the MTP layer's own drafts
ORACLE_PROMPTS = [ids(4, 13), ids(5, 100), ids(6, 31)]  # injected drafts


@pytest.fixture(scope="module", autouse=True)
def _highest_precision() -> Iterator[None]:
    """Float32 matrix products in full (test_engine_on_chip.py's docstring): at XLA:TPU's default one bfloat16
    pass, a verify step's logits (k + 1 positions a row) and a decode step's differ by ~1e-3, enough to flip a
    greedy choice between two close logits; the promise is about the float32 function."""
    with highest_precision():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded checkpoint plus a random MTP layer."""
    return build_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> dict[str, list[list[int]]]:
    """Plain greedy ids of both prompt sets, from the same checkpoint without speculation."""
    with running_engine(model_path=str(checkpoint), **KWARGS) as eng:
        return {name: output_ids(eng.generate(input_ids=prompts, sampling_params=SP))
                for name, prompts in (("mtp", MTP_PROMPTS), ("oracle", ORACLE_PROMPTS))}


@pytest.fixture(scope="module")
def spec(checkpoint: Path, plain: dict[str, list[list[int]]]) -> Iterator[Any]:
    """The speculative engine (it takes ``plain`` so that the plain engine is gone before it starts)."""
    with running_engine(model_path=str(checkpoint), **SPEC, **KWARGS) as eng:
        assert eng.scheduler.spec is not None
        yield eng
        assert_memory_back(eng)


def _counters(eng: Any) -> dict[str, int]:
    """The engine's speculative counters (verify rows, accepted and drafted tokens) so far."""
    state = eng.get_server_info()["internal_states"][0]
    return {k: state[k] for k in ("spec_verify_rows", "spec_accepted_tokens", "spec_draft_tokens")}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def test_mtp_drafts_give_plain_greedy_ids(spec: Any, plain: dict[str, list[list[int]]]) -> None:
    """The MTP layer's own drafts (rarely accepted), a batch of three with chunked prompts."""
    before = _counters(spec)
    got = output_ids(spec.generate(input_ids=MTP_PROMPTS, sampling_params=SP))
    delta = _delta(before, _counters(spec))
    assert got == plain["mtp"]
    assert delta["spec_verify_rows"] > 0 and delta["spec_draft_tokens"] > 0, delta


def test_accepted_drafts_give_plain_greedy_ids(spec: Any, plain: dict[str, list[list[int]]]) -> None:
    """Drafts accepted whole, in part and not at all (by schedule), across page boundaries."""
    # Keyed as oracle_drafts reads it: (prompt, the request's index in the batch).
    table = {(tuple(p), i): want for i, (p, want) in enumerate(zip(ORACLE_PROMPTS, plain["oracle"], strict=True))}
    before = _counters(spec)
    with oracle_drafts(spec, table):
        got = output_ids(spec.generate(input_ids=ORACLE_PROMPTS, sampling_params=SP))
    delta = _delta(before, _counters(spec))
    assert got == plain["oracle"]
    # 40 tokens in steps of 4, 3 and 1 tokens (the schedule): about 2.7 per verify step.
    rate = delta["spec_accepted_tokens"] / delta["spec_verify_rows"]
    assert 2.0 < rate < 3.5, delta
