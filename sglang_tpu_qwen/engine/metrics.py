"""Prometheus metrics of the serving engine, named like SGLang's (`sglang:` prefix).

Each `Metrics` owns its own `CollectorRegistry`, so several engines (or tests) in one process never
collide on metric names. The engine feeds it; the HTTP server exposes `render()` on `/metrics`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sglang_tpu_qwen.engine import compilation

# Bucket edges in seconds; wide enough for a CPU test model and a TPU pod alike.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    """Counters, histograms and gauges of one engine.

    Metric names (Prometheus exposition adds `_total` / `_bucket` / `_sum` / `_count` suffixes):
      sglang:num_requests_total, sglang:prompt_tokens_total, sglang:generation_tokens_total,
      sglang:time_to_first_token_seconds, sglang:inter_token_latency_seconds,
      sglang:e2e_request_latency_seconds (histograms, seconds),
      sglang:num_running_reqs, sglang:num_queue_reqs, sglang:kv_pages_used, sglang:kv_pages_total,
      sglang:gdn_slots_used, sglang:gdn_slots_total (gauges),
      sglang:jit_compilations_total (XLA programs built in this process, persistent-cache loads included;
      engine/compilation.py).

    Args:
      registry: where to register; default a fresh `CollectorRegistry` owned by this instance.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.num_requests = Counter("sglang:num_requests", "Requests started.", registry=r)
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token (s).",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Time between decoded tokens (s).",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Request latency, arrival to finish (s).",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.num_running = Gauge("sglang:num_running_reqs", "Requests decoding now.", registry=r)
        self.num_queue = Gauge("sglang:num_queue_reqs", "Requests waiting for admission.", registry=r)
        self.kv_used = Gauge("sglang:kv_pages_used", "KV pages in use (requests + prefix cache).", registry=r)
        self.kv_total = Gauge("sglang:kv_pages_total", "KV pages in the pool.", registry=r)
        self.slots_used = Gauge("sglang:gdn_slots_used", "GDN state slots in use.", registry=r)
        self.slots_total = Gauge("sglang:gdn_slots_total", "GDN state slots in the pool.", registry=r)
        r.register(_JitCompilations())

    def on_request_start(self) -> None:
        """Count one admitted request."""
        self.num_requests.inc()

    def on_first_token(self, ttft_s: float) -> None:
        """Record the time to first token of one request, in seconds."""
        self.ttft.observe(ttft_s)

    def on_decode_token(self, itl_s: float) -> None:
        """Record the latency between two consecutive output tokens of one request, in seconds."""
        self.itl.observe(itl_s)

    def on_request_finish(self, prompt_tokens: int, completion_tokens: int, e2e_s: float) -> None:
        """Count the tokens of a finished request and record its end-to-end latency (seconds)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(e2e_s)

    def set_usage(
        self, running: int, waiting: int, kv_used: int, kv_total: int, slots_used: int, slots_total: int
    ) -> None:
        """Set the gauges: request counts, KV pages and GDN slots (used and total)."""
        self.num_running.set(running)
        self.num_queue.set(waiting)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)
        self.slots_used.set(slots_used)
        self.slots_total.set(slots_total)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _JitCompilations:
    """Collector of sglang:jit_compilations, read from the process-wide counter at scrape time."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("sglang:jit_compilations",
                                  "XLA compilations in this process (persistent-cache loads included).",
                                  value=compilation.jit_compilations())
