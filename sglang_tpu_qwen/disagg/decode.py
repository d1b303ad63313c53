"""Decode role: receive a request's state instead of prefilling it, then decode it as a running request.

A request carrying a bootstrap room waits in `transfers` (not in the scheduler's waiting queue) while its
receiver collects the state in host memory; it holds no pages and no slot meanwhile. Each scheduler step
polls: a failed transfer finishes the request with the error (status kept, so the client gets the prefill
server's 4xx); an aborted one cancels its receiver, which tells the prefill server to drop the room; a
complete one is admitted when a DP rank has a running slot and pages for the whole prompt: KV written into
its own pages (its page size), GDN state into its slot, cached_len = prompt length, and the first token
accepted as if sampled here (stop checks, streaming, logprobs). From then on it is an ordinary request:
decode steps, retraction (which re-prefills it locally), the radix cache at finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_tpu_qwen.disagg.layout import StateLayout
from sglang_tpu_qwen.disagg.receiver import Receiver
from sglang_tpu_qwen.engine.io.errors import InvalidRequestError
from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.scheduler.scheduler import Scheduler
from sglang_tpu_qwen.engine.scheduler.scheduler_role import SchedulerRole
from sglang_tpu_qwen.utils.errors import TransferError

logger = logging.getLogger(__name__)

# (bootstrap host, bootstrap port, room, prompt ids) -> a started Receiver
ReceiverFactory = Callable[[str, int, int, list[int]], Receiver]


@dataclass
class DecodeLeg:
    """A request's decode-side transfer: where its state comes from, and the receiver fetching it."""

    host: str
    port: int
    room: int
    receiver: Receiver | None = None
    admitted: bool = False


class DecodeRole(SchedulerRole):
    """Scheduler hooks of a `--disaggregation-mode decode` server (see the module docstring)."""

    mode = "decode"

    def __init__(self, scheduler: Scheduler, layout: StateLayout, make_receiver: ReceiverFactory) -> None:
        self.scheduler = scheduler
        self.layout = layout
        self.make_receiver = make_receiver
        self.transfers: list[Request] = []
        self.transfers_done = 0
        self.transfers_failed = 0
        self.bytes_received = 0
        self.transfer_seconds = 0.0

    # ---- HTTP thread ---------------------------------------------------------------------------
    def attach(self, reqs: list[Request], targets: list[tuple[str | None, int | None, int | None]]) -> None:
        """Mark each request with a complete bootstrap target as a decode leg (its receiver starts when the
        scheduler takes it). A room without host or port is a 400."""
        for r, (host, port, room) in zip(reqs, targets, strict=True):
            if room is None:
                continue
            if not host or port is None:
                raise InvalidRequestError("bootstrap_room needs bootstrap_host and bootstrap_port")
            r.disagg = DecodeLeg(host, int(port), int(room))

    def reject(self, targets: list[tuple[str | None, int | None, int | None]], status: int, message: str) -> None:
        """Nothing to tell anyone: the decode side owns no room."""

    # ---- scheduler thread ----------------------------------------------------------------------
    def intercept(self, reqs: list[Request]) -> list[Request]:
        """Take the decode legs out of the new requests (they wait for their state here); return the rest."""
        keep = []
        for r in reqs:
            leg = r.disagg
            if isinstance(leg, DecodeLeg) and leg.receiver is None and not leg.admitted:
                leg.receiver = self.make_receiver(leg.host, leg.port, leg.room, r.prompt_ids)
                self.transfers.append(r)
            else:
                keep.append(r)
        return keep

    def abort(self, rid: str | None) -> None:
        """Abort waiting transfers of `rid` (all when None); their receivers cancel the rooms."""
        for r in list(self.transfers):
            if rid is None or r.rid == rid or r.rid.startswith(rid + "::"):
                self._drop(r, {"type": "abort", "message": "aborted by the client"})

    def poll(self) -> None:
        """Finish failed / aborted transfers; admit complete ones while memory allows (arrival order)."""
        blocked = False  # once one complete transfer waits for memory, later ones wait too (arrival order)
        for r in list(self.transfers):
            leg: DecodeLeg = r.disagg
            rec = leg.receiver
            assert rec is not None
            if r.aborted:
                self._drop(r, {"type": "abort", "message": "aborted by the client"})
            elif rec.status == "failed":
                err = rec.error or TransferError("transfer failed")
                logger.warning("request %s: transfer of bootstrap_room %d failed: %s", r.rid, leg.room, err.message)
                self.transfers_failed += 1
                self._drop(r, {"type": "abort", "message": err.message, "status_code": err.status})
            elif rec.status == "ready" and not blocked:
                blocked = not self._admit(r)

    def _drop(self, r: Request, reason: dict) -> None:
        self.transfers.remove(r)
        rec = r.disagg.receiver
        if rec is not None and rec.status == "waiting":
            rec.cancel()
        self.scheduler.finish(r, reason)

    def _admit(self, r: Request) -> bool:
        """Pages + slot + state write + first token; False (nothing taken) when memory is short now."""
        s = self.scheduler
        if r.grammar is not None:
            try:
                if not r.grammar.ready():
                    return False
            except InvalidRequestError as e:
                self.transfers.remove(r)
                s.finish(r, {"type": "abort", "message": str(e), "status_code": 400})
                return True
        state = r.disagg.receiver.state
        if state.first_token is None:  # max_new_tokens 0: the prompt's logprobs (prefill side) are the answer
            self.transfers.remove(r)
            self._account(r)
            s.finish(r, {"type": "length", "length": 0})
            return True

        def write(pages: list[int], slot: int) -> None:
            s.runner.state.write_state(pages, state.k, state.v, slot, state.conv, state.rec)

        try:
            if not s.admit_with_state(r, state.num_tokens, write):
                return False
        except Exception as e:  # the scheduler took the memory back
            logger.exception("request %s: writing the transferred state failed", r.rid)
            self.transfers.remove(r)
            self.transfers_failed += 1
            s.finish(r, {"type": "abort", "message": f"writing the transferred state failed: {e!r}",
                         "status_code": 500})
            return True
        self.transfers.remove(r)
        r.disagg.admitted = True
        r.cached_tokens = state.cached_tokens
        r.input_logprobs_done = True  # the prefill server's reply carries them; the router merges
        self._account(r)
        lp = state.logprob if state.logprob is not None else 0.0
        s.accept_token(r, state.first_token, lp, state.top_logprobs, state.top_ids)
        if s.spec is not None and not r.finished:  # the prefill server's drafts: verified from the first step
            r.draft_tokens = state.draft_tokens
        r.disagg.receiver = None  # drop the host copy
        return True

    def _account(self, r: Request) -> None:
        rec = r.disagg.receiver
        self.transfers_done += 1
        self.bytes_received += rec.received_bytes
        self.transfer_seconds += time.monotonic() - rec.started

    @property
    def busy(self) -> bool:
        return bool(self.transfers)

    def stats(self) -> dict[str, Any]:
        return {"mode": self.mode, "transfers_waiting": len(self.transfers), "transfers_done": self.transfers_done,
                "transfers_failed": self.transfers_failed, "bytes_received": self.bytes_received,
                "mean_transfer_s": self.transfer_seconds / self.transfers_done if self.transfers_done else 0.0}

    def shutdown(self) -> None:
        for r in list(self.transfers):
            rec = r.disagg.receiver
            if rec is not None:
                rec.cancel()
