"""StepProfiler: `jax.profiler` traces of the scheduler's steps, started and stopped by SGLang's
`/start_profile` and `/stop_profile` routes.

The HTTP thread only files a request (`request_start` / `request_stop`, each answered through a
`concurrent.futures.Future`); the scheduler thread carries it out between two steps (`poll`), so a trace never
begins or ends in the middle of a step and `num_steps` counts whole steps. Each step runs inside
`step(mode, batch_size, num_tokens)`: a `jax.profiler.StepTraceAnnotation("scheduler_step", step_num=...)`
(XProf / TensorBoard's step-time view) around a `TraceAnnotation` named like "EXTEND bs=4 tokens=256" (what
Perfetto shows on the timeline). Host activity comes from JAX's host tracer, device activity from XLA's device
tracer where the platform has one (TPU, GPU).

Output: `<output_dir>/plugins/profile/<timestamp>/` holds `<host>.xplane.pb` (TensorBoard's profile plugin, XProf)
and `perfetto_trace.json.gz` (ui.perfetto.dev); with "MEM" in activities also `memory.prof` (pprof, device
memory at the stop). output_dir: the request's, else --profile-dir, else $SGLANG_TORCH_PROFILER_DIR (as SGLang
reads it), else a temp dir made once per server. The replies name the directory.

Request fields (SGLang's `ProfileReqInput`): output_dir, num_steps, start_step, activities ("CPU": host
runtime events; "GPU" / "TPU": device activity, recorded whenever the platform has a device tracer; "MEM"),
with_stack (Python call stacks, default on as in SGLang), record_shapes, profile_id, profile_prefix,
profile_by_stage / merge_profiles (false only). Errors (ProfileError, a 400): a start while a trace is pending
or running, a stop with none, an unknown activity, a bad number.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from sglang_tpu_qwen.engine.io.errors import InvalidRequestError

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU", "TPU", "MEM")
_IGNORED_FIELDS = ("record_shapes", "profile_id", "profile_stages", "detailed_annotations")


class ProfileError(InvalidRequestError):
    """A profile request that cannot be carried out now (the HTTP layer answers 400 with the message)."""


@dataclass
class ProfileConfig:
    """One /start_profile request, validated. Steps count scheduler steps that ran a batch."""

    output_dir: str | None = None
    num_steps: int | None = None
    start_step: int | None = None
    activities: list[str] = field(default_factory=lambda: ["CPU", "GPU"])
    with_stack: bool = True
    profile_prefix: str | None = None

    @classmethod
    def from_body(cls, body: dict[str, Any] | None) -> ProfileConfig:
        """Parse a request body (SGLang's field names; numbers may come as strings, as SGLang's bench sends
        them). Raises ProfileError naming the bad field."""
        body = dict(body or {})
        known = {"output_dir", "num_steps", "start_step", "activities", "with_stack", "profile_prefix",
                 "profile_by_stage", "merge_profiles", *_IGNORED_FIELDS}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ProfileError(f"unknown profile field(s): {', '.join(unknown)}")
        for name in ("profile_by_stage", "merge_profiles"):
            if body.get(name):
                raise ProfileError(f"{name} is not supported by this server (one process profiles every step)")
        cfg = cls(output_dir=body.get("output_dir") or None, profile_prefix=body.get("profile_prefix") or None)
        for name in ("num_steps", "start_step"):
            value = body.get(name)
            if value is None:
                continue
            try:
                number = int(value)
            except (TypeError, ValueError):
                raise ProfileError(f"{name} must be a whole number, got {value!r}") from None
            if number < (1 if name == "num_steps" else 0) or isinstance(value, bool):
                raise ProfileError(f"{name} must be {'positive' if name == 'num_steps' else '>= 0'}, got {value!r}")
            setattr(cfg, name, number)
        activities = body.get("activities")
        if activities:  # SGLang's bench may send [] meaning "the defaults"
            if not isinstance(activities, list) or not all(isinstance(a, str) for a in activities):
                raise ProfileError("activities must be a list of strings")
            bad = sorted({a for a in activities if a.upper() not in ACTIVITIES})
            if bad:
                raise ProfileError(f"activities {bad} are not supported by this server (JAX): use "
                                   f"{', '.join(ACTIVITIES)}")
            cfg.activities = [a.upper() for a in activities]
        if body.get("with_stack") is not None:
            cfg.with_stack = bool(body["with_stack"])
        return cfg


def default_profile_dir(profile_dir: str | None) -> str | None:
    """--profile-dir, else $SGLANG_TORCH_PROFILER_DIR (SGLang's variable), else None (a temp dir on first use)."""
    return profile_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or None


class StepProfiler:
    """Start/stop requests from any thread; the trace itself on the scheduler thread (see the module docstring).

    Args:
      profile_dir: the server's default output directory (`default_profile_dir`), None for a temp dir.
      wake: wakes the scheduler thread so an idle server acts on a request at once.
    """

    def __init__(self, profile_dir: str | None, wake: Callable[[], None]) -> None:
        self._default_dir = profile_dir
        self._wake = wake
        self._lock = threading.Lock()
        self._pending: list[tuple[str, ProfileConfig | None, Future]] = []
        self._active: ProfileConfig | None = None  # a started or scheduled trace (start_step not reached yet)
        self._tracing = False
        self._dir: Path | None = None
        self._steps_done = 0  # steps inside the current trace
        self.step_count = 0  # steps run since the server started

    # ---- HTTP thread ---------------------------------------------------------------------------
    def request_start(self, cfg: ProfileConfig) -> Future:
        """File a start; the future gets the reply text or a ProfileError. Raises ProfileError at once when a
        trace is already pending or running."""
        with self._lock:
            if self._active is not None or any(kind == "start" for kind, _, _ in self._pending):
                raise ProfileError("Profiling is already in progress. Call /stop_profile first.")
            fut: Future = Future()
            self._pending.append(("start", cfg, fut))
        self._wake()
        return fut

    def request_stop(self) -> Future:
        """File a stop; the future gets the reply text. Raises ProfileError when no trace is pending or running."""
        with self._lock:
            if self._active is None and not any(kind == "start" for kind, _, _ in self._pending):
                raise ProfileError("Profiling is not in progress. Call /start_profile first.")
            fut: Future = Future()
            self._pending.append(("stop", None, fut))
        self._wake()
        return fut

    @property
    def active(self) -> bool:
        """A trace is scheduled or running."""
        return self._active is not None

    # ---- scheduler thread ----------------------------------------------------------------------
    def poll(self) -> None:
        """Carry out the filed requests, in order (called by the scheduler loop, busy or idle)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                kind, cfg, fut = self._pending.pop(0)
                if not fut.set_running_or_notify_cancel():  # its HTTP caller gave up
                    continue
                if kind == "start":  # claimed under the lock: a concurrent request_start sees it
                    self._active = cfg
            try:
                fut.set_result(self._start(cfg) if kind == "start" else self._stop())
            except Exception as e:  # reported to the caller; the server keeps running
                fut.set_exception(e if isinstance(e, ProfileError) else ProfileError(f"profiler: {e}"))

    @contextlib.contextmanager
    def step(self, mode: str, batch_size: int, num_tokens: int) -> Iterator[None]:
        """Wrap one scheduler step: annotate it while tracing; start / stop a trace bounded by start_step /
        num_steps around it. mode: the forward mode ("EXTEND", "DECODE"); num_tokens: new tokens in the step."""
        cfg = self._active
        if cfg is not None and not self._tracing and cfg.start_step is not None and self.step_count >= cfg.start_step:
            try:
                self._begin(cfg)
            except ProfileError:  # never fail the step for the profiler
                logger.exception("profile: the scheduled trace could not start")
                self._active = None
        if not self._tracing:
            self.step_count += 1
            yield
            return
        with jax.profiler.StepTraceAnnotation("scheduler_step", step_num=self.step_count, forward_mode=mode,
                                              batch_size=batch_size, num_tokens=num_tokens):
            with jax.profiler.TraceAnnotation(f"{mode} bs={batch_size} tokens={num_tokens}"):
                yield
        self.step_count += 1
        self._steps_done += 1
        if cfg is not None and cfg.num_steps is not None and self._steps_done >= cfg.num_steps:
            logger.info("profile: %d steps recorded; stopping", self._steps_done)
            self._stop()

    def close(self) -> None:
        """Stop a running trace (server shutdown), so its files are written."""
        if self._tracing:
            self._stop()

    # ---- internals (scheduler thread) ----------------------------------------------------------
    def _output_dir(self, cfg: ProfileConfig) -> Path:
        if cfg.output_dir:
            base = Path(cfg.output_dir).expanduser()
        else:
            if self._default_dir is None:
                self._default_dir = tempfile.mkdtemp(prefix="sglang_tpu_qwen_profile_")
            base = Path(self._default_dir).expanduser()
        return base / cfg.profile_prefix if cfg.profile_prefix else base

    def _start(self, cfg: ProfileConfig | None) -> str:
        assert cfg is not None
        self._dir = self._output_dir(cfg)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._active = cfg
        if cfg.start_step is None or self.step_count >= cfg.start_step:
            try:
                self._begin(cfg)
            except Exception:
                self._active = None
                raise
            when = "now"
        else:
            when = f"at step {cfg.start_step} (now {self.step_count})"
        steps = f" for {cfg.num_steps} steps" if cfg.num_steps else ""
        return f"Start profiling {when}{steps}. Traces will be saved to: {self._dir}\n"

    def _begin(self, cfg: ProfileConfig) -> None:
        opts = jax.profiler.ProfileOptions()
        # Host tracer level 1 records our step annotations only; 2 adds the runtime's host events ("CPU").
        opts.host_tracer_level = 2 if "CPU" in cfg.activities else 1
        opts.python_tracer_level = 1 if cfg.with_stack else 0
        assert self._dir is not None
        try:
            jax.profiler.start_trace(str(self._dir), create_perfetto_trace=True, profiler_options=opts)
        except RuntimeError as e:  # another trace runs in this process (e.g. the other engine of colocated-split)
            raise ProfileError(f"cannot start a trace: {e}") from None
        self._tracing = True
        self._steps_done = 0
        logger.info("profile: tracing into %s (activities %s)", self._dir, ",".join(cfg.activities))

    def _stop(self) -> str:
        cfg, out = self._active, self._dir
        self._active = None
        if not self._tracing:  # scheduled, never begun (start_step not reached)
            return f"Stop profiling: no step ran since the start; nothing was recorded in {out}.\n"
        self._tracing = False
        jax.profiler.stop_trace()
        assert out is not None
        runs = sorted((out / "plugins" / "profile").glob("*"), key=lambda p: p.stat().st_mtime)
        run = runs[-1] if runs else out
        if cfg is not None and "MEM" in cfg.activities:
            jax.profiler.save_device_memory_profile(str(run / "memory.prof"))
        logger.info("profile: %d steps written to %s", self._steps_done, run)
        return f"Stop profiling. {self._steps_done} steps recorded. Trace: {run}\n"
