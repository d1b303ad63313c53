"""Prometheus metrics of the serving engine, named like SGLang's (`sglang:` prefix).

Each `Metrics` owns its own `CollectorRegistry`, so several engines (or tests) in one process never
collide on metric names. The scheduler feeds the request counters, histograms and usage gauges as it runs;
the prefix-cache, snapshot and PD transfer figures are read at scrape time from the counters their owners
keep anyway (`watch`), so those modules need no metrics code. The HTTP server exposes `render()` on
`/metrics`; launch/grafana/ holds a dashboard over these names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sglang_tpu_qwen.engine.runner import compilation

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
      sglang:num_aborted_requests_total (SGLang's name: requests that finished aborted, by the client or a
      failure),
      sglang:jit_compilations_total (XLA programs built in this process, persistent-cache loads included;
      engine/runner/compilation.py);
    and, once `watch` is called, the scrape-time figures of `EngineStateCollector` (request counts, pool use).

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
        self.num_aborted = Counter("sglang:num_aborted_requests", "Requests that finished aborted.", registry=r)
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

    def on_request_finish(self, prompt_tokens: int, completion_tokens: int, e2e_s: float,
                          aborted: bool = False) -> None:
        """Count the tokens of a finished request (and whether it was aborted); record its end-to-end latency
        (seconds)."""
        if aborted:
            self.num_aborted.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(e2e_s)

    def watch(self, memory_usage: Callable[[], dict[str, Any]],
              disagg_stats: Callable[[], dict[str, Any] | None],
              request_counts: Callable[[], tuple[int, int]] = lambda: (0, 0),
              spec_stats: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        """Export the request counts, pool use, prefix-cache, snapshot and PD transfer figures, read at each
        scrape (so they are current after a /flush_cache or an abort on an idle server).

        Args:
          memory_usage: `Scheduler.memory_usage` (pool sizes and prefix-cache stats summed over DP ranks).
          disagg_stats: the PD role's `stats()`, or None when the server is not disaggregated.
          request_counts: (running, waiting) requests now.
          spec_stats: speculative decoding's counters (`SpecDecoder.info`), or None when it is off.
        """
        self.registry.register(EngineStateCollector(memory_usage, disagg_stats, request_counts, spec_stats))

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _JitCompilations:
    """Collector of sglang:jit_compilations, read from the process-wide counter at scrape time."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("sglang:jit_compilations",
                                  "XLA compilations in this process (persistent-cache loads included).",
                                  value=compilation.jit_compilations())


class EngineStateCollector:
    """Scrape-time metrics from the engine's own counters (a prometheus_client custom collector).

    SGLang's names where SGLang has the figure:
      sglang:num_running_reqs, sglang:num_queue_reqs  gauges, requests decoding / waiting for admission
      sglang:token_usage              gauge, KV pages in use / KV pages (0-1)
      sglang:mamba_usage              gauge, GDN state slots in use / slots (0-1; SGLang's name for SSM state)
      sglang:cache_hit_rate           gauge, prefix-cache hit tokens / looked-up tokens since start (0-1)
      sglang:cached_tokens_total      counter{cache_source="device"}, prompt tokens served from the prefix cache
      sglang:evicted_tokens_total     counter, KV token slots freed by prefix-cache eviction
      sglang:hicache_host_mamba_used_states  gauge, GDN snapshots held in the host tier
      sglang:num_transfer_failed_reqs_total  counter, PD transfers that failed (decode side)
      sglang:spec_accept_length       gauge, tokens per request per verify step since start (speculative decoding)
    ours, where SGLang has none:
      sglang:kv_pages_used, sglang:kv_pages_total    gauges, KV pages in use (requests + prefix cache) / in the pool
      sglang:gdn_slots_used, sglang:gdn_slots_total  gauges, GDN state slots in use / in the pool
      sglang:gdn_snapshot_hits_total{tier="device"|"host"}  counter, admissions restoring a GDN snapshot
      sglang:gdn_snapshot_evictions_total   counter, snapshots the tree gave up (device ones may move to host)
      sglang:gdn_snapshots_cached           gauge, snapshots the prefix cache holds (device and host)
      sglang:gdn_snapshot_slots_total       gauge, device slots reserved for snapshots
      sglang:gdn_snapshot_host_bytes        gauge, bytes of the host tier in use
      sglang:gdn_snapshot_host_budget_bytes gauge, --gdn-snapshot-host-gb in bytes
      sglang:gdn_snapshot_host_refused_total counter, demotions refused because the host ran low on memory
      sglang:num_transfer_done_reqs_total{role="prefill"|"decode"}  counter, PD transfers completed
      sglang:kv_transfer_bytes_total        counter, KV + GDN state bytes received by a PD decode server
      sglang:spec_verify_rows_total         counter, requests x verify steps (speculative decoding)
      sglang:spec_accepted_tokens_total     counter, tokens those verify rows produced (accepted drafts + 1 each)
      sglang:spec_draft_tokens_total        counter, draft tokens the verify rows fed
    Every name is always exported (0 without a prefix cache or PD), so a dashboard never shows "no data" for
    a feature that is merely off.
    """

    def __init__(self, memory_usage: Callable[[], dict[str, Any]],
                 disagg_stats: Callable[[], dict[str, Any] | None],
                 request_counts: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 spec_stats: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self._memory_usage = memory_usage
        self._disagg_stats = disagg_stats
        self._request_counts = request_counts
        self._spec_stats = spec_stats

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: the engine may not be fully built yet

    def collect(self) -> Iterator[Metric]:
        m = self._memory_usage()
        pd = self._disagg_stats() or {}

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def ratio(used: float, total: float) -> float:
            return used / total if total else 0.0

        kv_total, slots_total = m.get("kv_pages_total", 0), m.get("gdn_slots_total", 0)
        running, waiting = self._request_counts()
        yield gauge("sglang:num_running_reqs", "Requests decoding now.", running)
        yield gauge("sglang:num_queue_reqs", "Requests waiting for admission.", waiting)
        yield gauge("sglang:kv_pages_used", "KV pages in use (requests + prefix cache).",
                    kv_total - m.get("kv_pages_free", 0))
        yield gauge("sglang:kv_pages_total", "KV pages in the pool.", kv_total)
        yield gauge("sglang:gdn_slots_used", "GDN state slots in use.", slots_total - m.get("gdn_slots_free", 0))
        yield gauge("sglang:gdn_slots_total", "GDN state slots in the pool.", slots_total)
        yield gauge("sglang:token_usage", "KV pages in use / KV pages.",
                    ratio(kv_total - m.get("kv_pages_free", 0), kv_total))
        yield gauge("sglang:mamba_usage", "GDN state slots in use / slots.",
                    ratio(slots_total - m.get("gdn_slots_free", 0), slots_total))
        yield gauge("sglang:cache_hit_rate", "Prefix-cache hit tokens / looked-up tokens since start.",
                    ratio(m.get("cache_hit_tokens", 0), m.get("cache_query_tokens", 0)))
        cached = CounterMetricFamily("sglang:cached_tokens", "Prompt tokens served from the prefix cache.",
                                     labels=["cache_source"])
        cached.add_metric(["device"], m.get("cache_hit_tokens", 0))
        yield cached
        yield counter("sglang:evicted_tokens", "KV token slots freed by prefix-cache eviction.",
                      m.get("evicted_pages", 0) * m.get("page_size", 0))
        hits = CounterMetricFamily("sglang:gdn_snapshot_hits", "Admissions whose GDN state came from a snapshot.",
                                   labels=["tier"])
        hits.add_metric(["device"], m.get("snapshot_hits_device", 0))
        hits.add_metric(["host"], m.get("snapshot_hits_host", 0))
        yield hits
        yield counter("sglang:gdn_snapshot_evictions", "GDN snapshots evicted from the prefix cache.",
                      m.get("evicted_snapshots", 0))
        yield gauge("sglang:gdn_snapshots_cached", "GDN snapshots held by the prefix cache (device + host).",
                    m.get("cached_snapshots", 0))
        yield gauge("sglang:gdn_snapshot_slots_total", "Device GDN slots reserved for snapshots.",
                    m.get("snapshot_slots_total", 0))
        yield gauge("sglang:hicache_host_mamba_used_states", "GDN snapshots held in the host tier.",
                    m.get("host_snapshots", 0))
        yield gauge("sglang:gdn_snapshot_host_bytes", "Host-tier bytes in use by GDN snapshots.",
                    m.get("host_snapshot_bytes", 0))
        yield gauge("sglang:gdn_snapshot_host_budget_bytes", "Host-tier budget for GDN snapshots (bytes).",
                    m.get("host_snapshot_budget_bytes", 0))
        yield counter("sglang:gdn_snapshot_host_refused", "GDN snapshot demotions refused: host memory low.",
                      m.get("host_snapshot_refused_low_memory", 0))
        done = CounterMetricFamily("sglang:num_transfer_done_reqs", "PD transfers completed.", labels=["role"])
        for role in ("prefill", "decode"):
            done.add_metric([role], pd.get("transfers_done", 0) if pd.get("mode") == role else 0)
        yield done
        yield counter("sglang:num_transfer_failed_reqs", "PD transfers that failed (decode side).",
                      pd.get("transfers_failed", 0))
        yield counter("sglang:kv_transfer_bytes", "KV + GDN state bytes received over PD transfers.",
                      pd.get("bytes_received", 0))
        spec = self._spec_stats() or {}
        yield gauge("sglang:spec_accept_length", "Speculative decoding: tokens per request per verify step.",
                    spec.get("avg_spec_accept_length", 0.0))
        yield counter("sglang:spec_verify_rows", "Speculative decoding: requests x verify steps.",
                      spec.get("spec_verify_rows", 0))
        yield counter("sglang:spec_accepted_tokens", "Speculative decoding: tokens the verify rows produced.",
                      spec.get("spec_accepted_tokens", 0))
        yield counter("sglang:spec_draft_tokens", "Speculative decoding: draft tokens the verify rows fed.",
                      spec.get("spec_draft_tokens", 0))
