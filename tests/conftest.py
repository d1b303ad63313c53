"""Shared fixtures: one real Engine (embedded model, small limits) served over real HTTP.

`engine` builds the Engine once per test session; `server` serves it with uvicorn in a thread on a
free 127.0.0.1 port and yields a `LiveServer` (base `url`, the `engine`). `serve_app(app)` is the
helper both use; other tests may call it to serve another app (e.g. with an api key) over the same
engine.
"""

from __future__ import annotations

import ctypes
import gc
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Small limits keep the suite fast on 2 CPU cores; enable_metrics so /metrics can be checked. Programs compile
# on first use (disable_precompile): the session engine needs few of them; test_compile.py checks precompile.
# Compact JSON for json_schema constraints: the random-weight model prefers whitespace tokens and would pad JSON
# forever. 8 GDN snapshot slots (snapshots past them go to the host tier, on by default): on XLA:CPU a step's cost
# grows with the GDN state pool (its slot writes copy the pool), and the memory rule's default gave 141 slots,
# which made each decode step ~4x slower than with 16 (100 greedy tokens: 19.2 s against 4.9 s of CPU).
ENGINE_KWARGS: dict[str, Any] = dict(max_running_requests=4, context_length=256, enable_metrics=True,
                                     chunked_prefill_size=256, max_prefill_tokens=512, max_gdn_snapshots=8,
                                     constrained_json_disable_any_whitespace=True, disable_precompile=True)


@dataclass
class LiveServer:
    """A running HTTP server: its base URL and the engine behind it."""

    url: str
    engine: Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_app(app: Any, timeout_s: float = 60.0) -> Iterator[str]:
    """Serve a FastAPI app with uvicorn in a daemon thread; yields its base URL, stops it on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


# XLA:CPU maps about three memory regions per compiled kernel (some 3,000 per engine). The suite's one process
# keeps the programs of its session engines, of module-scoped engines and of cached jitted functions alive
# together: about 60,000 maps by the prefix-cache tests, past Linux's default vm.max_map_count of 65,530,
# where an mmap fails inside XLA and the process aborts or hangs in a compile. The limit is raised where the
# suite may (root: CI), else a run that needs it says so up front.
MAX_MAP_COUNT = 262_144
_MAP_COUNT = Path("/proc/sys/vm/max_map_count")


# pytest-xdist (the README's command: two workers, whole files each, in collection order) hands out the longest
# files first, so the two workers end together instead of one running a long file alone at the end. Longest
# first, from a full run's per-file times on the 2-core CI machine; only the order depends on it.
LONGEST_FILES = ("test_speculative.py", "test_plan.py", "test_kernels_gdn.py", "test_kernels_aot_ironwood.py",
                 "test_model_family.py", "test_prefix_cache.py", "test_compile.py", "test_pd_tcp.py",
                 "test_replicas.py", "test_model_reference.py", "test_parallel_moe.py", "test_engine.py",
                 "test_pd_inprocess.py", "test_engine_pallas_backend.py", "test_grammar_strings.py",
                 "test_program_memory.py", "test_fp8_matmul.py", "test_fp8_serving.py", "test_stream_chunks.py",
                 "test_pd_speculative.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config, "workerinput", None) is None:  # one process: the files in their usual order
        return
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_configure(config: pytest.Config) -> None:
    if not _MAP_COUNT.exists() or int(_MAP_COUNT.read_text()) >= MAX_MAP_COUNT:
        return
    try:
        _MAP_COUNT.write_text(str(MAX_MAP_COUNT))
    except OSError:
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"vm.max_map_count is {_MAP_COUNT.read_text().strip()}: the whole suite needs about 70,000 memory "
            f"maps; run `sysctl -w vm.max_map_count={MAX_MAP_COUNT}` as root first"), stacklevel=2)


@pytest.fixture(scope="module", autouse=True)
def _collect_shut_down_engines() -> Iterator[None]:
    """Run the garbage collector after each test file. A shut-down Engine sits in reference cycles until the
    collector runs, and with it its compiled programs, whose XLA:CPU code takes about three memory maps per
    kernel (some 3,000 per engine). Left to the collector's own schedule, several files' engines piled up past
    the kernel's vm.max_map_count (65,530 by default): XLA then aborted or hung mid-suite. The largest count
    seen at a file's end, before collecting, goes to the run's summary."""
    global _PEAK_MAPS
    yield
    maps = Path("/proc/self/maps")
    if maps.exists():
        _PEAK_MAPS = max(_PEAK_MAPS, len(maps.read_bytes().splitlines()))
    gc.collect()
    # Hand the heap's free pages back to the kernel: glibc keeps them after a file's engines and arrays are
    # freed, so a test process's resident size only ever grew, to ~10 GiB by the suite's end (each of the two
    # pytest-xdist workers: past the machine's memory together). After test_engine.py 2.3 GiB -> 1.3 GiB.
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl)
        return None


_LIBC = _glibc()


_PEAK_MAPS = 0


@pytest.fixture(scope="session")
def engine() -> Iterator[Any]:
    """The real Engine with the embedded model (see ENGINE_KWARGS)."""
    from sglang_tpu_qwen.engine.engine import Engine

    eng = Engine(**ENGINE_KWARGS)
    try:
        yield eng
    finally:
        eng.shutdown()


# The low-precision caches, --mamba-ssm-dtype bfloat16 and --kv-cache-dtype fp8_e4m3, with a host snapshot tier
# and 2 device snapshot slots: the colocated reference of the PD test (test_pd_inprocess.py) and the
# bf16 host-tier test (test_prefix_cache.py).
# A near-tie for the bf16 GDN state: the reference's best two tokens within this many nats. 2.5x the largest
# |dlogprob| that bf16 vs f32 state caused on the embedded checkpoint (0.04, test_model_reference.py
# test_bf16_state_tracks_fp32_state): the two tokens can move that much each, in opposite directions.
BF16_TIE_MARGIN = 0.1
BF16_STATE_KWARGS: dict[str, Any] = dict(ENGINE_KWARGS, mamba_ssm_dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
                                         max_gdn_snapshots=2,
                                         gdn_snapshot_host_gb=0.01, debug_nan_fill_freed_slots=True)


def tiny_hybrid_config(**extra: Any) -> Any:
    """A 4-layer Qwen3.5-MoE config (3 GDN layers, 1 attention layer, odd head sizes) for arithmetic over the
    cache layout (memory accounting, the planner's capacity table); nothing is built from it."""
    from sglang_tpu_qwen.model.config import Qwen35MoeConfig

    return Qwen35MoeConfig.from_hf_dict({**extra,
        "model_type": "qwen3_5_moe_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 8,
    })  # fmt: skip

@pytest.fixture(scope="session")
def engine_bf16() -> Iterator[Any]:
    """The real Engine with the embedded model, the GDN state stored in bfloat16 and FP8 KV pages
    (BF16_STATE_KWARGS)."""
    from sglang_tpu_qwen.engine.engine import Engine

    eng = Engine(**BF16_STATE_KWARGS)
    try:
        yield eng
    finally:
        eng.shutdown()


def first_divergence_is_a_tie(got: list[int], meta: dict[str, Any], margin: float) -> int:
    """Compare `got` with a greedy reply (`meta`: its meta_info with output_top_logprobs of >= 2 entries):
    return how many leading tokens agree; a divergence must sit where the reference's best two tokens are
    within `margin` nats (a near-tie that a different rounding of the same numbers may flip), else it fails."""
    want = [int(t[1]) for t in meta["output_token_logprobs"]]
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            top = meta["output_top_logprobs"][i]
            gap = float(top[0][0]) - float(top[1][0])
            assert gap < margin, f"token {i}: {a} vs the reference's {b}, whose lead is {gap:.3f} nats"
            return i
    assert len(got) == len(want), (got, want)
    return len(got)


@pytest.fixture(scope="session")
def vl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """`get(kind="moe")` -> (HF oracle in float32, directory) of tests/vl_checkpoint.py's tiny VL checkpoint of
    `kind` ("moe" or "dense"), each built once per session (~5 s) on first use."""
    from vl_checkpoint import build_vl_checkpoint

    built: dict[str, tuple[Any, Path]] = {}

    def get(kind: str = "moe") -> tuple[Any, Path]:
        if kind not in built:
            built[kind] = build_vl_checkpoint(tmp_path_factory.mktemp(f"vl-{kind}"), kind)
        return built[kind]

    return get


# The VL engine: the tiny MoE VL checkpoint (no tokenizer of its own: the embedded checkpoint's, the same
# vocabulary), one running request and 16-token chunks so the fixed program set is small, precompiled as a
# server starts (vision buckets included); --mm-max-patches 256 is the test preprocessor's largest image.
VL_ENGINE_KWARGS: dict[str, Any] = dict(max_running_requests=1, context_length=64, chunked_prefill_size=16,
                                        max_prefill_tokens=64, mm_max_patches=256, mm_embedding_cache_size_mb=1)


@pytest.fixture(scope="session")
def vl_engine(vl_checkpoint: Callable[[str], tuple[Any, Path]]) -> Iterator[Any]:
    """A real Engine on the tiny MoE VL checkpoint (VL_ENGINE_KWARGS), precompiled."""
    from sglang_tpu_qwen.embedded.checkpoint import ensure_embedded_model
    from sglang_tpu_qwen.engine.engine import Engine

    _, path = vl_checkpoint("moe")
    eng = Engine(model_path=str(path), tokenizer_path=str(ensure_embedded_model()), **VL_ENGINE_KWARGS)
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: Any) -> Iterator[LiveServer]:
    """`create_app(engine)` served over HTTP for the whole session."""
    from sglang_tpu_qwen.server.app import create_app

    with serve_app(create_app(engine)) as url:
        yield LiveServer(url=url, engine=engine)


# Measured figures tests record (errors vs tolerance, compiled memory); shown at the end of every run,
# so CI's log carries them even though pytest captures the output of passing tests.
SUMMARY: dict[str, list[str]] = {}


def record(section: str, line: str) -> None:
    """Print `line` and keep it for the end-of-run summary under `section`."""
    print(line)
    SUMMARY.setdefault(section, []).append(line)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker (the README's command runs two) hands its summary and map count to the controller,
    which prints the run's summary (pytest_testnodedown below)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["summary"] = json.dumps(SUMMARY)
        workeroutput["peak_maps"] = _PEAK_MAPS


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it
def pytest_testnodedown(node: Any, error: Any) -> None:
    global _PEAK_MAPS
    out = getattr(node, "workeroutput", {})
    for section, lines in json.loads(out.get("summary", "{}")).items():
        SUMMARY.setdefault(section, []).extend(lines)
    _PEAK_MAPS = max(_PEAK_MAPS, out.get("peak_maps", 0))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _PEAK_MAPS:
        limit = _MAP_COUNT.read_text().strip()
        line = f"memory maps of a test process at a file's end, at most: {_PEAK_MAPS} (vm.max_map_count: {limit})"
        SUMMARY.setdefault("process", []).append(line)
    for section, lines in SUMMARY.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)
