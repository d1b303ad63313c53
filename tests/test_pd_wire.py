"""Transfer protocol pieces of disaggregation, without a model: framing, layout checks, rooms, the outbox.

A real bootstrap server (TCP on loopback) serves a real Outbox to a real TcpReceiver; the state is built by
hand, so a layout mismatch, a short transfer or a prefill-side rejection can be produced on purpose.
"""

from __future__ import annotations

import socket
import threading

import ml_dtypes
import numpy as np
import pytest
from conftest import free_port
from pd_harness import wait_for

from sglang_tpu_qwen.disagg.bootstrap_server import BootstrapServer
from sglang_tpu_qwen.disagg.layout import PROTOCOL_VERSION, StateLayout, prompt_digest
from sglang_tpu_qwen.disagg.outbox import Outbox
from sglang_tpu_qwen.disagg.receiver import TcpReceiver
from sglang_tpu_qwen.disagg.roles import targets_for
from sglang_tpu_qwen.disagg.wire import Message, recv_message, send_message
from sglang_tpu_qwen.engine.io.sampling_params import SamplingParams
from sglang_tpu_qwen.utils.errors import TransferError

LAYOUT = StateLayout(fingerprint="abc", kv_dtype="float32", state_dtype="float32", kv_token_shape=(2, 1, 4),
                     conv_shape=(3, 8, 3), rec_shape=(3, 2, 4, 4))


def test_frame_round_trip_keeps_dtypes_and_shapes():
    a, b = socket.socketpair()
    arrays = [np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.ones((5,), ml_dtypes.bfloat16),
              np.zeros((0, 3), np.int32), np.linspace(-448, 448, 12).astype(ml_dtypes.float8_e4m3fn).reshape(2, 6)]
    send_message(a, Message({"kind": "kv", "start": 0, "end": 3}, arrays))
    got = recv_message(b)
    assert got.meta == {"kind": "kv", "start": 0, "end": 3}
    for x, y in zip(arrays, got.arrays, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    a.sendall(b"HTTP/1.1 200 OK\r\n\r\n....")
    with pytest.raises(TransferError, match="not a transfer frame"):
        recv_message(b)


def test_layout_mismatch_names_the_fields():
    other = StateLayout(**{**LAYOUT.__dict__, "kv_dtype": "bfloat16", "rec_shape": (3, 2, 4, 8)})
    with pytest.raises(TransferError) as e:
        LAYOUT.check_matches(other)
    assert "kv_dtype: prefill bfloat16 vs decode float32" in e.value.message
    assert "rec_shape" in e.value.message and "fingerprint" not in e.value.message
    assert StateLayout.from_json(LAYOUT.to_json()) == LAYOUT
    # FP8 pages on one side only (--kv-cache-dtype fp8_e4m3 vs auto): refused, naming the flag.
    fp8 = StateLayout(**{**LAYOUT.__dict__, "kv_dtype": "float8_e4m3fn"})
    with pytest.raises(TransferError) as e:
        StateLayout(**{**LAYOUT.__dict__, "kv_dtype": "bfloat16"}).check_matches(fp8)
    assert "kv_dtype: prefill float8_e4m3fn vs decode bfloat16" in e.value.message
    assert "--kv-cache-dtype" in e.value.message
    # A decode server with another --mamba-ssm-dtype refuses the state rather than converting it.
    bf16_state = StateLayout(**{**LAYOUT.__dict__, "state_dtype": "bfloat16"})
    with pytest.raises(TransferError, match="state_dtype: prefill bfloat16 vs decode float32.*--mamba-ssm-dtype"):
        LAYOUT.check_matches(bf16_state)


def _reqs(ns: list[int]) -> list:
    class R:  # only .params.n is read
        def __init__(self, n: int) -> None:
            self.params = SamplingParams.from_dict({"n": n})

    return [R(n) for n in ns for _ in range(n)]


def test_rooms_per_sequence():
    # One prompt, n = 3, scalar room: room + sample index (SGLang's rule for a scalar room).
    assert [t[2] for t in targets_for(_reqs([3]), "h", 1, 100)] == [100, 101, 102]
    # smg's chat n > 1: a list of n rooms, one per sample.
    assert [t[2] for t in targets_for(_reqs([2]), ["h", "h"], [1, 1], [7, 9])] == [7, 9]
    # A batch of two prompts with n = 2 and one room per prompt: rooms[p] + sample.
    assert [t[2] for t in targets_for(_reqs([2, 2]), "h", 1, [10, 20])] == [10, 11, 20, 21]
    assert targets_for(_reqs([1]), None, None, None) is None
    with pytest.raises(ValueError, match="bootstrap_room has 3 entries"):
        targets_for(_reqs([2, 2]), "h", 1, [1, 2, 3])


def _serve(outbox: Outbox):
    port = free_port()
    return BootstrapServer(outbox, "127.0.0.1", port), port


def _header(prompt: list[int], layout: StateLayout = LAYOUT) -> Message:
    return Message({"kind": "header", "version": PROTOCOL_VERSION, "layout": layout.to_json(),
                    "num_tokens": len(prompt), "prompt_digest": prompt_digest(prompt), "source_page_size": 16})


def _receive(port: int, room: int, prompt: list[int], timeout: float = 10.0) -> TcpReceiver:
    done = threading.Event()
    rec = TcpReceiver("127.0.0.1", port, room, LAYOUT, prompt, timeout, done.set).start()
    assert done.wait(timeout + 5)
    return rec


class ManualClock:
    """Seconds the test sets (`now`): an outbox's timeouts pass when the test advances it, never by waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_streamed_transfer_over_tcp_and_failures():
    # Both outboxes read the test's clock: a room is dropped, and a fetch gives up on a room that does not
    # open, only when the test moves the clock past the timeout, however slowly the machine runs.
    clock = ManualClock()
    outbox = Outbox(timeout_s=60.0, stage_to_host=True, clock=clock)
    server, port = _serve(outbox)
    short = Outbox(timeout_s=0.5, stage_to_host=True, clock=clock)
    short_server, short_port = _serve(short)
    try:
        prompt = list(range(5))
        k = np.random.default_rng(0).standard_normal((2, 5, 1, 4)).astype(np.float32)
        conv, rec = np.ones((3, 8, 3), np.float32), np.full((3, 2, 4, 4), 2.0, np.float32)
        # The receiver connects first and waits for the room: the header and chunks stream to a fetch that is
        # already there.
        done = threading.Event()
        r = TcpReceiver("127.0.0.1", port, 1, LAYOUT, prompt, 10.0, done.set).start()
        wait_for(lambda: outbox.stats()["outbox_fetches_waiting"] == 1, 20, "the receiver to wait for room 1", 0.05)
        assert outbox.open(1, _header(prompt))
        outbox.put(1, Message({"kind": "kv", "start": 0, "end": 3}, [k[:, :3], -k[:, :3]]))
        outbox.put(1, Message({"kind": "kv", "start": 3, "end": 5}, [k[:, 3:], -k[:, 3:]]))
        outbox.put(1, Message({"kind": "gdn"}, [conv, rec]))
        outbox.put(1, Message({"kind": "done", "first_token": 42, "logprob": -0.5, "cached_tokens": 2}))
        assert done.wait(15)
        assert r.status == "ready", r.error
        st = r.state
        assert np.array_equal(st.k, k) and np.array_equal(st.v, -k)
        assert np.array_equal(st.conv, conv) and np.array_equal(st.rec, rec)
        assert (st.first_token, st.logprob, st.cached_tokens) == (42, -0.5, 2)
        assert outbox.stats() == {"outbox_rooms": 0, "outbox_bytes": 0, "outbox_early_cancels": 0,
                                  "outbox_fetches_waiting": 0}

        # The prefill server rejected the request: its status and message reach the decode side.
        outbox.fail(2, 400, "The input (300 tokens) is longer than the model's context length")
        r = _receive(port, 2, prompt)
        assert r.status == "failed" and r.error.status == 400 and "context length" in r.error.message

        # A prefill server with another dtype: rejected at the header, not misread.
        outbox.open(3, _header(prompt, StateLayout(**{**LAYOUT.__dict__, "kv_dtype": "bfloat16"})))
        r = _receive(port, 3, prompt)
        assert r.status == "failed" and "kv_dtype: prefill bfloat16 vs decode float32" in r.error.message

        # Another tokenization of the prompt on the two legs.
        outbox.open(4, _header([9, 9, 9]))
        r = _receive(port, 4, prompt)
        assert r.status == "failed" and r.error.status == 400

        # Nobody fetches: the room is kept until the timeout, then dropped (by this reap or the reaper thread's).
        short.open(5, _header(prompt))
        clock.now += 0.4
        assert short.reap() == [] and short.stats()["outbox_rooms"] == 1
        clock.now += 0.2
        short.reap()
        assert short.stats()["outbox_rooms"] == 0 and 5 in short.take_cancelled()
        # A fetch of a room that never opens fails once the timeout has passed.
        done = threading.Event()
        r = TcpReceiver("127.0.0.1", short_port, 6, LAYOUT, prompt, 10.0, done.set).start()
        wait_for(lambda: short.stats()["outbox_fetches_waiting"] == 1, 20, "the receiver to wait for room 6", 0.05)
        clock.now += 0.6
        assert done.wait(15)
        assert r.status == "failed" and "timed out" in r.error.message

        # The decode side cancels before the prefill opens the room: the prefill leg is refused.
        done = threading.Event()
        r = TcpReceiver("127.0.0.1", port, 7, LAYOUT, prompt, 10.0, done.set).start()
        wait_for(lambda: outbox.stats()["outbox_fetches_waiting"] == 1, 20, "the receiver to wait for room 7", 0.05)
        r.cancel()
        assert done.wait(15) and r.status == "waiting"  # cancelled, not failed
        wait_for(lambda: 7 in outbox.take_cancelled(), 20, "the cancel to reach the prefill side", 0.05)
        # The cancel wakes the waiting fetch; it ends (and leaves the count) when its thread next runs.
        wait_for(lambda: outbox.stats()["outbox_fetches_waiting"] == 0, 20, "the waiting fetch to end", 0.05)
        assert not outbox.open(7, _header(prompt))
    finally:
        for srv, box in ((server, outbox), (short_server, short)):
            srv.shutdown()
            box.close()
