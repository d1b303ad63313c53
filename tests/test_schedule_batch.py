"""ScheduleBatch.build: a PickedBatch laid out as one ForwardBatch of host arrays, without a model.

The serving tests (test_engine.py, test_prefix_cache.py, ...) check that the tokens come out right; these
check the layout itself: rows, padding, finishing rows first, and a token in flight read from the previous
step's row.
"""

from __future__ import annotations

import numpy as np

from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.io.sampling_params import SamplingParams
from sglang_tpu_qwen.engine.runner.buckets import BucketSet
from sglang_tpu_qwen.engine.scheduler.schedule_batch import PickedBatch, ScheduleBatch
from sglang_tpu_qwen.model.forward_batch import ForwardBatch, ForwardMode

VOCAB = 64
EOS = {2}


def _buckets() -> BucketSet:
    return BucketSet.build(max_running_requests=4, chunked_prefill_size=64, context_length=256, kv_tokens=512,
                           page_size=16)


def _request(rid: str, prompt: list[int], pages: list[int], slot: int, cached_len: int = 0) -> Request:
    # The detokenizer is not read when laying out a batch.
    r = Request(rid=rid, index=0, prompt_ids=prompt, params=SamplingParams(max_new_tokens=4), max_new_tokens=4,
                seed=0, sink=lambda _: None, detokenizer=None)  # type: ignore[arg-type]
    r.pages, r.slot, r.cached_len = pages, slot, cached_len
    return r


def test_extend_batch_lays_finishing_rows_first_and_pads_with_zeros():
    mid = _request("mid", list(range(10, 50)), pages=[3, 4, 5], slot=1)  # 40 tokens, 16 fed now
    last = _request("last", list(range(60, 80)), pages=[6, 7], slot=2, cached_len=16)  # its last 4 fed now
    picked = PickedBatch(ForwardMode.EXTEND, [mid, last], [16, 4])
    batch = ScheduleBatch.build(picked, _buckets(), EOS, VOCAB)

    assert batch.reqs == [last, mid] and batch.extend_lens == [4, 16]  # the row that samples comes first
    assert batch.rows == [0, 1] and batch.finishing == [0] and batch.sampling_reqs == [last]
    f = batch.forward
    assert isinstance(f, ForwardBatch) and f.mode is ForwardMode.EXTEND and batch.is_extend
    assert f.batch_size == batch.batch_size >= 2 and f.num_tokens >= 16
    assert all(a.dtype == np.int32 for a in (f.input_ids, f.prefix_lens, f.extend_lens, f.page_table, f.slot_ids,
                                            f.token_src))
    assert f.input_ids[0, :4].tolist() == list(range(76, 80)) and not f.input_ids[0, 4:].any()
    assert f.input_ids[1, :16].tolist() == list(range(10, 26)) and not f.input_ids[1, 16:].any()
    assert f.prefix_lens[:2].tolist() == [16, 0] and f.extend_lens[:2].tolist() == [4, 16]
    assert f.page_table[0, :2].tolist() == [6, 7] and f.page_table[1, :3].tolist() == [3, 4, 5]
    assert f.slot_ids[:2].tolist() == [2, 1] and (f.token_src == -1).all()
    # Padding rows: nothing fed, page 0 / slot 0 (the trash targets).
    for a in (f.input_ids, f.prefix_lens, f.extend_lens, f.page_table, f.slot_ids):
        assert not a[2:].any()
    assert batch.sampling is not None and len(batch.sampling.temperature) == _buckets().decode_bucket(1).batch


def test_decode_row_with_a_token_in_flight_reads_the_previous_steps_row():
    a = _request("a", [5, 6, 7], pages=[1], slot=1)
    b = _request("b", [8, 9], pages=[2], slot=2)
    buckets = _buckets()
    prev = ScheduleBatch.build(PickedBatch(ForwardMode.EXTEND, [a, b], [3, 2]), buckets, EOS, VOCAB)
    for r, n in zip(prev.reqs, prev.extend_lens, strict=True):  # what Scheduler.launch does
        r.cached_len += n
    b.tokens_in_flight = 1  # b's sampled token is still on the device
    a.append_token(11)  # a's was read
    step = ScheduleBatch.build(PickedBatch(ForwardMode.DECODE, [a, b], [1, 1]), buckets, EOS, VOCAB, prev)

    f = step.forward
    assert f.mode is ForwardMode.DECODE and f.num_tokens == 1 and step.finishing == [0, 1]
    assert f.input_ids[:2, 0].tolist() == [11, 0] and f.prefix_lens[:2].tolist() == [3, 2]
    assert f.token_src[:2].tolist() == [-1, prev.rows[prev.reqs.index(b)]]


def test_picked_batch_idle_and_only():
    a = _request("a", [5, 6, 7], pages=[1], slot=1)
    b = _request("b", [8, 9], pages=[2], slot=2)
    idle = PickedBatch.idle()
    assert idle.mode is ForwardMode.IDLE and not idle and idle.num_extend_tokens == 0
    picked = PickedBatch(ForwardMode.EXTEND, [a, b], [3, 2])
    assert len(picked) == 2 and picked.num_extend_tokens == 5
    alone = picked.only(1)
    assert alone.mode is ForwardMode.EXTEND and alone.reqs == [b] and alone.extend_lens == [2]
