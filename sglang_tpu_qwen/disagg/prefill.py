"""Prefill role: run the prompt, sample the first token, hand the request's state to the outbox.

The scheduler runs a request that carries a bootstrap room like any other (its own radix cache, chunked
prefill, retraction), limited to one new token. The hooks below copy its state out:
- after each prefill chunk, the KV of the prompt tokens computed so far (token-major) goes to the room,
  so the decode side receives while the rest of the prompt is still running;
- when the first token is sampled, the remaining KV, the GDN state of the request's slot (all GDN layers)
  and the first token (+ logprobs) close the room; then the scheduler frees pages and slot as usual;
- an aborted or failed request closes its room with an error; a room the decode side cancels aborts its
  request (`poll`).
All hooks run on the scheduler thread, before the memory they read is released.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sglang_tpu_qwen.disagg.layout import PROTOCOL_VERSION, StateLayout, prompt_digest
from sglang_tpu_qwen.disagg.outbox import Outbox
from sglang_tpu_qwen.disagg.wire import Message
from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.scheduler.schedule_batch import PickedBatch
from sglang_tpu_qwen.engine.scheduler.scheduler import Scheduler
from sglang_tpu_qwen.engine.scheduler.scheduler_role import SchedulerRole
from sglang_tpu_qwen.utils.errors import TransferError

logger = logging.getLogger(__name__)


@dataclass
class PrefillLeg:
    """A request's prefill-side transfer: its room and how many prompt tokens' KV are in the outbox."""

    room: int
    exported: int = 0
    opened: bool = True  # False: the decode side cancelled the room before the request arrived
    closed: bool = False


class PrefillRole(SchedulerRole):
    """Scheduler hooks of a `--disaggregation-mode prefill` server (see the module docstring)."""

    mode = "prefill"

    def __init__(self, scheduler: Scheduler, outbox: Outbox, layout: StateLayout) -> None:
        self.scheduler = scheduler
        self.outbox = outbox
        self.layout = layout
        self.transfers_started = 0
        self.transfers_done = 0

    # ---- HTTP thread ---------------------------------------------------------------------------
    def attach(self, reqs: list[Request], targets: list[tuple[str | None, int | None, int | None]]) -> None:
        """Make each request with a room a prefill leg: open its room, limit it to one new token.

        targets[i] = (bootstrap_host, bootstrap_port, bootstrap_room) of reqs[i]. Raises TransferError (400)
        when a room is already in use.
        """
        opened: list[int] = []
        try:
            for r, (_, _, room) in zip(reqs, targets, strict=True):
                if room is None:
                    continue
                header = Message({"kind": "header", "version": PROTOCOL_VERSION, "layout": self.layout.to_json(),
                                  "num_tokens": len(r.prompt_ids), "prompt_digest": prompt_digest(r.prompt_ids),
                                  "source_page_size": self.scheduler.page_size, "rid": r.rid})
                ok = self.outbox.open(room, header, r.rid)
                if ok:
                    opened.append(room)
                r.disagg = PrefillLeg(room, opened=ok)
                r.max_new_tokens = min(r.max_new_tokens, 1)
        except TransferError as e:  # a room in use: this call is refused; close the rooms it opened
            for room in opened:
                self.outbox.fail(room, e.status, e.message)
            raise
        self.transfers_started += len(opened)

    def reject(self, targets: list[tuple[str | None, int | None, int | None]], status: int, message: str) -> None:
        """A request refused before it became Requests (bad input): tell each room's decode side why."""
        for _, _, room in targets:
            if room is not None:
                self.outbox.fail(room, status, message)

    # ---- scheduler thread ----------------------------------------------------------------------
    def intercept(self, reqs: list[Request]) -> list[Request]:
        """New requests: those whose room was cancelled before they arrived are finished at once."""
        keep = []
        for r in reqs:
            leg = r.disagg
            if isinstance(leg, PrefillLeg) and not leg.opened:
                leg.closed = True
                self.scheduler.finish(r, {"type": "abort", "message": "cancelled by the decode server"})
            else:
                keep.append(r)
        return keep

    def poll(self) -> None:
        """Abort the requests whose rooms the decode side cancelled (or that timed out)."""
        rooms = self.outbox.take_cancelled()
        if not rooms:
            return
        for r in self.scheduler.requests():
            leg = r.disagg
            if isinstance(leg, PrefillLeg) and leg.room in rooms and not r.finished:
                leg.closed = True
                self.scheduler.finish(r, {"type": "abort", "message": "cancelled by the decode server"})

    def after_step(self, batch: PickedBatch) -> None:
        """Stream the KV each prefill leg computed in this step (prompt tokens only)."""
        for r in batch.reqs:
            leg = r.disagg
            if isinstance(leg, PrefillLeg) and not leg.closed and not r.finished:
                self._export_kv(r, leg, min(r.cached_len, len(r.prompt_ids)))

    def on_finish(self, r: Request, reason: dict) -> None:
        """Close the room: the whole state and the first token, or the error (before the memory is freed)."""
        leg = r.disagg
        if not isinstance(leg, PrefillLeg) or leg.closed:
            return
        leg.closed = True
        if reason.get("type") == "abort" or r.slot is None or r.cached_len < len(r.prompt_ids):
            status = int(reason.get("status_code") or 500)
            self.outbox.fail(leg.room, status, str(reason.get("message") or "the prefill server aborted the request"))
            return
        self._export_kv(r, leg, len(r.prompt_ids))
        conv, rec = self.scheduler.runner.state.read_gdn(r.slot)
        if not self.outbox.put(leg.room, Message({"kind": "gdn"}, [conv, rec])):
            return
        first = r.output_ids[0] if r.output_ids else None
        lp = top_lp = top_ids = None
        if first is not None and r.return_logprob and r.output_token_logprobs:
            lp = r.output_token_logprobs[0][0]
            if r.top_logprobs_num and r.output_top_logprobs and r.output_top_logprobs[0]:
                top_lp = [t[0] for t in r.output_top_logprobs[0]]
                top_ids = [t[1] for t in r.output_top_logprobs[0]]
        # Speculative decoding: the MTP layer's drafts after the first token (its KV for the prompt went with
        # the pages), so the decode server verifies drafts from its first step.
        done = {"kind": "done", "first_token": first, "logprob": lp, "top_logprobs": top_lp, "top_ids": top_ids,
                "cached_tokens": r.cached_tokens or 0, "draft_tokens": list(r.draft_tokens)}
        if self.outbox.put(leg.room, Message(done)):
            self.transfers_done += 1

    def _export_kv(self, r: Request, leg: PrefillLeg, upto: int) -> None:
        if upto <= leg.exported:
            return
        k, v = self.scheduler.runner.state.gather_kv(r.pages, leg.exported, upto)
        if self.outbox.put(leg.room, Message({"kind": "kv", "start": leg.exported, "end": upto}, [k, v])):
            leg.exported = upto
        else:  # cancelled or timed out meanwhile: poll() aborts the request
            leg.closed = True

    def stats(self) -> dict[str, Any]:
        return {"mode": self.mode, "transfers_started": self.transfers_started,
                "transfers_done": self.transfers_done, **self.outbox.stats()}

    def shutdown(self) -> None:
        self.outbox.close()
