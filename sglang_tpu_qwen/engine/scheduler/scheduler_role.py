"""SchedulerRole: the hooks a serving role (prefill/decode disaggregation, disagg/) plugs into the scheduler.

The scheduler always has one role; this base class is the plain colocated server (every hook a no-op).
disagg/prefill.py and disagg/decode.py subclass it. All hooks run on the scheduler thread. What a role may
call back is the scheduler's public surface: `finish`, `accept_token`, `admit_with_state`, `requests`,
`wake`, `page_size` and the model runner's device-state operations (`runner.state`: `gather_kv`, `read_gdn`,
`write_state`).
"""

from __future__ import annotations

from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.scheduler.schedule_batch import PickedBatch


class SchedulerRole:
    """No-op hooks; subclasses override what their role needs (see the module docstring)."""

    mode = "null"

    @property
    def busy(self) -> bool:
        """True while the role holds requests outside the scheduler's queues (keeps the loop polling)."""
        return False

    def intercept(self, reqs: list[Request]) -> list[Request]:
        """New requests from the inbox; returns those that go to the waiting queue."""
        return reqs

    def poll(self) -> None:
        """Start of every step: admit or fail what the role holds."""

    def abort(self, rid: str | None) -> None:
        """A client abort of `rid` (every request when None), before the scheduler aborts its own."""

    def after_step(self, batch: PickedBatch) -> None:
        """After a step's tokens were accepted; batch is the step's (its requests' cached_len advanced)."""

    def on_finish(self, r: Request, reason: dict) -> None:
        """r is finishing with `reason`; its pages and slot are still held (freed right after)."""
