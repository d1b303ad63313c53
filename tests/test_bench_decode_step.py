"""The decode-step benchmark's pure parts (bench/decode_step.py): its roofline bytes are the planner's account
(tools/plan/step_bytes.py) and come out as the issue counted them for the 35B-shaped checkpoint; the planner's v5e
decode step holds the same bytes; the profile's breakdown of a synthetic TPU trace and of a real CPU trace. The
speculative draft + verify cycle (issue 43): its roofline is the planner's verify step, part by part, and the
issue's ~11 GB on the 35B-shaped checkpoint; replayed on a CPU engine with an MTP layer it compiles nothing in its
timed windows and dispatches exactly the programs a served verify step does.

Nothing here builds the 35B-shaped checkpoint: its runner is abstract (shapes only)."""

from __future__ import annotations

import importlib.util
import math
import os

# The deviceless v5e compile loads libtpu beside other processes (see test_kernels_aot_ironwood.py).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import ENGINE_KWARGS, record  # noqa: E402
from mtp_checkpoint import build_mtp_checkpoint  # noqa: E402

from sglang_tpu_qwen.args.server_args import ServerArgs  # noqa: E402
from sglang_tpu_qwen.bench import decode_step  # noqa: E402
from sglang_tpu_qwen.embedded.checkpoint import embedded_config_dict  # noqa: E402
from sglang_tpu_qwen.embedded.shaped_35b import shaped_35b_config_dict  # noqa: E402
from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner  # noqa: E402
from sglang_tpu_qwen.model.config import Qwen35MoeConfig  # noqa: E402
from sglang_tpu_qwen.model.param_layout import param_specs  # noqa: E402
from sglang_tpu_qwen.parallel.sharding import EXPERT_LEAVES  # noqa: E402

V5E_HBM = 16 * 2**30
ROWS, CONTEXT, PAGE = 64, decode_step.DEFAULT_CONTEXT, 64
# The speculative flags: 3 drafts, 4 tokens verified per row.
STEPS = 3
SPEC_FLAGS: dict[str, Any] = dict(speculative_algorithm="NEXTN", speculative_num_steps=STEPS,
                                  speculative_eagle_topk=1, speculative_num_draft_tokens=STEPS + 1)


def _tpu_runner(config_dict: dict, rows: int = ROWS, devices: list | None = None, **extra: Any) -> ModelRunner:
    """The server's runner for ``config_dict`` on abstract weights with the TPU's kernels and dtypes, flagged as
    the planner flags it (tools/plan/build.py ``plan``); ``extra``: more server flags (speculation)."""
    args = ServerArgs(max_running_requests=rows, context_length=CONTEXT, page_size=PAGE,
                      max_total_tokens=rows * CONTEXT, **extra)
    args.resolve_chunked_prefill_size("tpu", V5E_HBM)
    return ModelRunner.abstract(Qwen35MoeConfig.from_hf_dict(config_dict), args, devices, platform="tpu",
                                device_memory_bytes=V5E_HBM if devices is not None else None)


def test_35b_shaped_roofline_bytes_by_part() -> None:
    """64 rows x 576 on the 35B-shaped checkpoint, bf16, f32 GDN state: each part of the benchmark's roofline
    (the planner's account) equals the arithmetic from the config, and the whole is the issue's ~5.3 GB (lm_head
    1.02 GB + ~126 of 128 experts 3.16 GB + dense 0.28 GB + GDN state 0.80 GB + KV 0.08 GB; the issue left out the
    conv state's 0.04 GB)."""
    cd = shaped_35b_config_dict()
    c = Qwen35MoeConfig.from_hf_dict(cd)
    runner = _tpu_runner(cd)
    bucket, parts = decode_step.roofline_parts(runner, ROWS, CONTEXT)
    assert bucket.batch == ROWS and runner.dtype == jax.numpy.bfloat16
    h, e, k = c.hidden_size, c.num_experts, c.num_experts_per_tok
    moe_layers = sum(t == "moe" for t in c.mlp_types)
    gdn_layers, attn_layers = c.num_gdn_layers, c.num_attn_layers
    assert (moe_layers, gdn_layers, attn_layers, e, k) == (4, 3, 1, 128, 8)
    touched = e * (1 - (1 - k / e) ** ROWS)
    specs = param_specs(c)
    dense = sum(math.prod(x.shape) * x.dtype.itemsize for path, x in jax.tree_util.tree_leaves_with_path(specs)
                if not ({getattr(p, "key", None) for p in path} & (EXPERT_LEAVES | {"embed", "lm_head"})))
    conv_dim, taps = c.gdn_conv_dim, c.linear_conv_kernel_dim - 1
    state = runner.sizing.state_dtype.itemsize
    kv_token = 2 * attn_layers * c.num_key_value_heads * c.head_dim * 2
    want = {
        "lm_head": c.vocab_size * h * 2,
        "dense": dense,
        "embedding_rows": ROWS * h * 2,
        "experts": moe_layers * 3 * h * c.moe_intermediate_size * 2 * touched,
        "kv_read": ROWS * CONTEXT * kv_token,
        "kv_write": ROWS * kv_token,
        "gdn_recurrent": 2 * ROWS * gdn_layers * c.linear_num_value_heads * c.linear_key_head_dim
        * c.linear_value_head_dim * state,
        "gdn_conv": 2 * ROWS * gdn_layers * conv_dim * taps * runner.cache["conv"].dtype.itemsize,
        "draft": 0,
    }
    assert parts == pytest.approx(want, rel=1e-12)
    assert state == 4 and 125.5 < touched < 126.5
    total = sum(parts.values())
    assert 5.3e9 < total < 5.45e9
    record("Decode step roofline: 35B-shaped, 64 x 576", ", ".join(f"{p} {v / 1e9:.3f} GB" for p, v in parts.items()
                                                                   if v) + f"; total {total / 1e9:.3f} GB, "
           f"{total / 819e9 * 1e3:.2f} ms at 819 GB/s")


def _v5e_devices() -> list:
    """The deviceless v5e:1x1 topology's devices; skips the test where libtpu does not know the chip."""
    from sglang_tpu_qwen.tools.plan.build import topology_devices

    try:
        return topology_devices("v5e:1x1")
    except Exception as e:  # a libtpu that does not know the chip
        pytest.skip(f"no deviceless v5e topology: {e}")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_planned_v5e_step_holds_the_benchmarks_bytes() -> None:
    """The planner's decode step on one v5e chip (the deviceless compile the benchmark runs after its engine) is
    held against exactly the benchmark's roofline bytes, part by part, and plans a positive step with no
    collectives; shown for the embedded model (a quick compile), the 35B-shaped checkpoint goes the same way."""
    rows = 8
    cd = embedded_config_dict()
    devices = _v5e_devices()
    runner = _tpu_runner(cd, rows, devices)
    _, parts = decode_step.roofline_parts(runner, rows, CONTEXT)
    info = {"page_size": PAGE, "kv_cache_dtype": "auto", "mamba_ssm_dtype": runner.sizing.state_dtype.name}
    planned = decode_step.plan_rows(info, runner.config, "v5e", rows, CONTEXT)
    assert planned["min_bytes_parts"] == pytest.approx(parts, rel=1e-12)
    assert planned["min_bytes"] == pytest.approx(sum(parts.values()), rel=1e-12)
    assert planned["kernels"]["attention"] == "pallas" and planned["kernels"]["gdn"] == "pallas"
    assert planned["planned_s"] >= planned["serial_s"] > 0 and planned["bucket_rows"] == rows
    # The profile's categories on the chip's own HLO: the model's named scopes reach the op_name of a fresh compile.
    from sglang_tpu_qwen.engine.runner.compilation import persistent_cache_off

    with persistent_cache_off():
        text = runner.lower_forward(runner.buckets.decode_bucket(rows)).compile().as_text()
    (table,) = decode_step.op_table([("forward", text)]).values()
    cats = {decode_step.categorize(name, op.opcode, op.op_name, "jit_forward_program") for name, op in table.items()}
    assert {"attention kernel (Pallas)", "GDN kernel (Pallas)", "GDN conv windows (DMA)",
            "MoE grouped matmul (ragged_dot / FP8 kernel)", "MoE routing (top-k, sort, gather / scatter)",
            "attention (XLA: projections, RoPE, norms, KV write)", "GDN (XLA: projections, gates, state layout)",
            "copies"} <= cats, cats
    record("Decode step roofline: the planner on v5e:1x1",
           f"embedded model, {rows} x {CONTEXT}: least bytes {planned['min_bytes'] / 1e6:.1f} MB (= the benchmark's), "
           f"planned {planned['planned_s'] * 1e3:.3f} ms, HLO bytes / least {planned['bytes_ratio']:.2f}")


def _synthetic_tpu_trace() -> object:
    """A trace as a TPU writes it: a device plane whose XLA Ops line holds, inside one XLA Modules event per step,
    a while op enclosing its body's ops (so nested time must count once). Two steps of 1.0 ms each."""
    from jax.profiler import ProfileData

    # Two ops named as the v5e names them: the whole instruction text, the name before " = ".
    ops = {1: "while.3", 2: "ragged_paged_attention.7",
           3: "fused_gdn = (bf16[64,1,4096]{2,1,0}) custom-call(s32[1]{0} %constant.7), "
              "custom_call_target=tpu_custom_call", 4: "ragged-dot-none.2", 5: "copy.9",
           6: "fusion.13 = f32[64,248320]{1,0} fusion(bf16[64,2048]{1,0} %copy-done, bf16[248320,2048]{1,0} %w), "
              "kind=kOutput", 7: "fusion.40", 8: "fusion.99"}
    meta = "\n".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for i, n in ops.items())
    events, modules = [], []
    for step in range(2):
        t0 = step * 2_000_000_000  # ps
        modules.append(f"events {{ metadata_id: 20 offset_ps: {t0} duration_ps: 800000000 }}")
        modules.append(f"events {{ metadata_id: 21 offset_ps: {t0 + 800000000} duration_ps: 200000000 }}")
        body = [(1, 0, 600), (2, 0, 200), (3, 200, 150), (4, 350, 150), (5, 500, 100), (7, 600, 200),
                (6, 800, 150), (8, 950, 50)]  # (op, start us, us): the while holds ops 2-5
        events += [f"events {{ metadata_id: {op} offset_ps: {t0 + s * 10**6} duration_ps: {d * 10**6} }}"
                   for op, s, d in body]
    text = (f'planes {{ id: 1 name: "/device:TPU:0" '
            f'lines {{ id: 1 name: "XLA Modules" timestamp_ns: 0 {" ".join(modules)} }} '
            f'lines {{ id: 2 name: "XLA Ops" timestamp_ns: 0 {" ".join(events)} }} '
            f'{meta} event_metadata {{ key: 20 value {{ id: 20 name: "jit_forward_program(7)" }} }} '
            f'event_metadata {{ key: 21 value {{ id: 21 name: "jit_sample_program(8)" }} }} }} '
            f'planes {{ id: 2 name: "/host:CPU" }}')
    return ProfileData.from_text_proto(text)


def test_profile_of_a_synthetic_tpu_trace() -> None:
    """Self times (a while op's body counted once), each op's program from the XLA Modules event around it, its
    op_name from the compiled programs' table, the categories and the top ops, per step."""
    info = decode_step.OpInfo
    table = {
        "jit_forward_program": {
            "ragged_paged_attention.7": info("custom-call", "jit(forward_program)/attention/jit(ragged_paged_attention)"
                                                            "/pallas_call"),
            "fused_gdn": info("custom-call", "jit(forward_program)/gdn/jit(fused_gdn)/pallas_call"),
            "ragged-dot-none.2": info("custom-call", "jit(forward_program)/moe/ragged_dot_general/ragged-dot-none"),
            "copy.9": info("copy", "param_leaves[18]"),
            "fusion.40": info("fusion", "jit(forward_program)/while/body/closed_call/moe/gather"),
        },
        "jit_sample_program": {"fusion.13": info("fusion", "jit(sample_program)/lm_head/nh,vh->nv/dot_general"),
                               "fusion.99": info("fusion", "jit(sample_program)/argmax")},
    }
    prof = decode_step.aggregate_profile(_synthetic_tpu_trace(), table, steps=2)
    assert prof["source"] == "device" and prof["plane"] == "/device:TPU:0"
    assert prof["total_ms_per_step"] == pytest.approx(1.0) and prof["modules_ms_per_step"] == pytest.approx(1.0)
    cats = {c["category"]: c["ms_per_step"] for c in prof["categories"]}
    assert cats == pytest.approx({
        "attention kernel (Pallas)": 0.2, "GDN kernel (Pallas)": 0.15, "MoE grouped matmul (ragged_dot / FP8 kernel)":
        0.15, "copies": 0.1, "MoE routing (top-k, sort, gather / scatter)": 0.2, "lm_head": 0.15, "sampling": 0.05,
        decode_step.OTHER: 0.0})
    assert sum(c["share"] for c in prof["categories"]) == pytest.approx(1.0)
    top = prof["top_ops"]
    assert [o["op"] for o in top[:2]] == ["ragged_paged_attention.7", "fusion.40"]
    assert {o["module"] for o in top} == {"jit_forward_program", "jit_sample_program"}
    assert all(o["count"] == 1 for o in top)
    # Per program: its ops' self time and its XLA Modules events' span, per step.
    programs = {p["module"]: p for p in prof["programs"]}
    assert set(programs) == {"jit_forward_program", "jit_sample_program"}
    assert programs["jit_forward_program"]["ms_per_step"] == pytest.approx(0.8)
    assert programs["jit_sample_program"]["ms_per_step"] == pytest.approx(0.2)
    assert programs["jit_sample_program"]["span_ms_per_step"] == pytest.approx(0.2)
    assert programs["jit_forward_program"]["runs_per_step"] == 1
    text = decode_step.format_profile({**prof, "rows": 64, "context": 576, "trace": "t.xplane.pb"})
    assert "device plane /device:TPU:0" in text and "| lm_head | 0.150 | 15.0% |" in text
    assert "| jit_forward_program | 0.800 | 80.0% | 0.800 | 1 |" in text


def test_profile_of_a_cpu_engine_uses_the_host_plane(engine, tmp_path) -> None:
    """On the CPU the trace has no device plane: the profile says so and groups the host plane's XLA ops, each
    found in the engine's compiled decode and sampling programs. (Their op_name metadata is whatever the
    persistent cache held: the named scopes are checked on a fresh compile below.)"""
    prof = decode_step.profile_step(engine.runner, rows=4, context=40, steps=2, out_dir=tmp_path)
    assert prof["source"] == "host" and prof["rows"] == 4 and prof["total_ms_per_step"] > 0
    assert prof["trace"].endswith(".xplane.pb")
    assert {o["module"] for o in prof["top_ops"]} <= {"jit_forward_program", "jit_sample_program",
                                                      "jit_keep_sampled"}
    assert "sampling" in {c["category"] for c in prof["categories"]}
    assert all(o["opcode"] for o in prof["top_ops"])  # every top op found in the compiled programs' table
    assert "no device plane in the trace" in decode_step.format_profile(prof)


def test_flags() -> None:
    """Defaults: the 35B-shaped checkpoint, rows 8 / 64 / 256 at 576, running requests for the largest; "embedded"
    is the embedded model; a given --max-running-requests stays."""
    ns, args = decode_step.parse_args([])
    assert ns.row_counts == [8, 64, 256] and ns.context == 576 and args.max_running_requests == 256
    assert args.model_path == "shaped-35b"
    ns, args = decode_step.parse_args(["--model-path", "embedded", "--rows", "4,2", "--max-running-requests", "8"])
    assert args.model_path is None and ns.row_counts == [2, 4] and args.max_running_requests == 8
    assert ns.cycle_program_iters == 5
    with pytest.raises(SystemExit):
        decode_step.parse_args(["--rows", "0"])
    with pytest.raises(SystemExit):
        decode_step.parse_args(["--cycle-program-iters", "-1"])


def test_replayed_rows_route_like_a_batch(engine) -> None:
    """The replayed decode step's rows carry distinct token ids (decode_timer.replay_batch), so their hidden
    states, and so their MoE routings, differ: on one input every row took the same top-k experts and the step
    read k experts' weights (the first v5e run). Checked on the greedy ids the step samples."""
    from sglang_tpu_qwen.bench.decode_timer import replay_batch

    runner = engine.runner
    batch, sampling = replay_batch(runner, rows=4, context=40)
    assert batch.token_src is None and len(set(batch.input_ids[:, 0].tolist())) == batch.input_ids.shape[0]
    with runner.side_steps():
        out = runner.sample(runner.forward(batch), sampling)
    tokens = np.asarray(out.tokens)[: batch.input_ids.shape[0]]
    assert len(set(tokens.tolist())) > len(tokens) // 2, tokens


# ---- the speculative draft + verify cycle (issue 43) -----------------------------------------------------------
def test_35b_shaped_cycle_roofline_bytes_by_part() -> None:
    """64 rows x 576 on the 35B-shaped checkpoint, 3 drafts, 4 tokens verified: the cycle's roofline is the
    verify forward over 4 tokens a row (the decode step's weights, the experts 256 tokens touch, 4 tokens' KV
    and embedding rows, the GDN states read by the verify, read and written again by the commit, plus the decode
    snapshot of 1/64 of the rows at accept length 1) and the draft: 3 MTP-layer passes, each reading the MTP
    layer's weights (its experts as its tokens route: 256, then 64, then 64) and the 1.02 GB lm_head, and its one
    attention layer's KV. The whole is the issue's "about 11 GB"."""
    cd = shaped_35b_config_dict()
    c = Qwen35MoeConfig.from_hf_dict(cd)
    runner = _tpu_runner(cd, **SPEC_FLAGS)
    _, plain = decode_step.roofline_parts(runner, ROWS, CONTEXT)
    bucket, parts = decode_step.cycle_roofline_parts(runner, ROWS, CONTEXT)
    assert bucket.batch == ROWS and runner.spec_steps == STEPS
    n = STEPS + 1
    e, k = c.num_experts, c.num_experts_per_tok
    active = lambda tokens: 1 - (1 - k / e) ** tokens  # noqa: E731
    kv_token = plain["kv_write"] / ROWS
    per_pass = plain["gdn_recurrent"] / 2, plain["gdn_conv"] / 2
    assert parts["lm_head"] == plain["lm_head"] and parts["dense"] == plain["dense"]
    assert parts["embedding_rows"] == pytest.approx(n * plain["embedding_rows"], rel=1e-12)
    assert parts["experts"] == pytest.approx(plain["experts"] / active(ROWS) * active(ROWS * n), rel=1e-12)
    assert parts["kv_read"] == pytest.approx(ROWS * (CONTEXT - 1 + n) * kv_token, rel=1e-12)
    assert parts["kv_write"] == pytest.approx(ROWS * n * kv_token, rel=1e-12)
    assert parts["gdn_recurrent"] == pytest.approx(per_pass[0] * (3 + 1 / PAGE), rel=1e-12)
    assert parts["gdn_conv"] == pytest.approx(per_pass[1] * (3 + 1 / PAGE), rel=1e-12)
    mtp = param_specs(c, mtp=True)["mtp"]
    leaves = jax.tree_util.tree_leaves_with_path(mtp)
    nbytes = lambda x: math.prod(x.shape) * x.dtype.itemsize  # noqa: E731
    mtp_experts = sum(nbytes(x) for path, x in leaves if {getattr(p, "key", None) for p in path} & EXPERT_LEAVES)
    mtp_rest = sum(nbytes(x) for _, x in leaves) - mtp_experts
    kv_layer = kv_token / c.num_attn_layers
    draft = sum(mtp_rest + parts["lm_head"] + mtp_experts * active(ROWS * fed)
                + ROWS * (CONTEXT - 1 + n + i + fed) * kv_layer for i, fed in enumerate((n, 1, 1)))
    assert parts["draft"] == pytest.approx(draft, rel=1e-12)
    assert 0.8e9 < mtp_rest + mtp_experts < 0.95e9  # the "~0.88 GB" MTP layer
    # --speculative-token-map: each pass reads only the map's rows of the lm_head.
    runner.draft_vocab = np.arange(32768, dtype=np.int32)
    try:
        _, hot = decode_step.cycle_roofline_parts(runner, ROWS, CONTEXT)
    finally:
        runner.draft_vocab = None
    assert parts["draft"] - hot["draft"] == pytest.approx(3 * parts["lm_head"] * (1 - 32768 / c.vocab_size),
                                                          rel=1e-12)
    total = sum(parts.values())
    assert 10.5e9 < total < 12e9
    # By program: the verify forward reads the GDN states once; the commit samples (the lm_head), reads and
    # writes the states again plus the decode snapshots (1/64 of the rows at accept length 1) and drafts.
    by_program = decode_step.cycle_program_bytes(runner, ROWS, parts)
    assert list(by_program) == ["verify", "commit"]
    assert sum(by_program.values()) == pytest.approx(total, rel=1e-12)
    assert by_program["commit"] == pytest.approx(
        parts["lm_head"] + parts["draft"] + sum(per_pass) * (2 + 1 / PAGE), rel=1e-12)
    assert by_program["verify"] == pytest.approx(
        parts["dense"] + parts["experts"] + parts["kv_read"] + parts["kv_write"] + parts["embedding_rows"]
        + sum(per_pass), rel=1e-12)
    record("MTP cycle roofline: 35B-shaped, 64 x 576, 3 drafts", ", ".join(
        f"{p} {v / 1e9:.3f} GB" for p, v in parts.items() if v) + f"; total {total / 1e9:.3f} GB, "
        f"{total / 819e9 * 1e3:.2f} ms at 819 GB/s; plain step {sum(plain.values()) / 1e9:.3f} GB")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_planned_v5e_verify_step_holds_the_cycles_bytes() -> None:
    """The planner's verify step on one v5e chip (the benchmark's deviceless plan with the speculative flags)
    is held against exactly the cycle's roofline bytes, part by part (embedded model with an MTP layer, 8 rows)."""
    rows = 8
    cd = embedded_config_dict()
    devices = _v5e_devices()
    runner = _tpu_runner(cd, rows, devices, **SPEC_FLAGS)
    _, parts = decode_step.cycle_roofline_parts(runner, rows, CONTEXT)
    # The engine's KV pool (settle_engine's kv_tokens), larger than rows x context: the plan compiles it.
    info = {"page_size": PAGE, "kv_cache_dtype": "auto", "mamba_ssm_dtype": runner.sizing.state_dtype.name,
            "kv_tokens": 8 * rows * CONTEXT}
    planned = decode_step.plan_rows(info, runner.config, "v5e", rows, CONTEXT, STEPS + 1, 1.0)
    verify = planned["verify"]
    assert verify["min_bytes_parts"] == pytest.approx(parts, rel=1e-12)
    assert verify["min_bytes"] == pytest.approx(sum(parts.values()), rel=1e-12)
    assert verify["planned_s"] > planned["planned_s"] > 0 and verify["bucket_rows"] == rows
    # Each program planned alone, against its share of the roofline; they add up to the step.
    programs = {p["program"]: p for p in verify["programs"]}
    assert list(programs) == ["verify", "commit"]
    by_program = decode_step.cycle_program_bytes(runner, rows, parts)
    assert {k: p["min_bytes"] for k, p in programs.items()} == pytest.approx(by_program, rel=1e-12)
    assert sum(p["serial_s"] for p in programs.values()) == pytest.approx(verify["serial_s"], rel=1e-6)
    # The commit's snapshot copy (kernels/gdn/slot_copy.py) declares every row's state; it is charged the rows
    # that take a snapshot (1/64 at accept length 1): the commit (its greedy branch planned from the greedy
    # program) moves about its least bytes, not 2x.
    assert programs["commit"]["hlo_bytes"] < 1.3 * programs["commit"]["min_bytes"]
    assert [p["program"] for p in planned["programs"]] == ["forward", "sample"]
    record("MTP cycle roofline: the planner on v5e:1x1",
           f"embedded model + MTP layer, {rows} x {CONTEXT}: least bytes {verify['min_bytes'] / 1e6:.1f} MB (= the "
           f"benchmark's), planned {verify['planned_s'] * 1e3:.3f} ms ({verify['planned_s'] / planned['planned_s']:.2f}"
           " plain steps)")


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The embedded checkpoint plus a random MTP layer, speculating with the issue's flags; the engine flags of
    test_speculative.py (the persistent compilation cache then holds the same programs)."""
    from sglang_tpu_qwen.engine.engine import Engine

    path = build_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))
    eng = Engine(model_path=str(path), speculative_draft_policy="always",
                 **dict(ENGINE_KWARGS, chunked_prefill_size=64), **SPEC_FLAGS)
    try:
        yield eng
    finally:
        eng.shutdown()


CPU_ROWS, CPU_CONTEXT = 2, 40


def test_replayed_rows_own_their_gdn_slots(engine, spec_engine) -> None:
    """Every replayed row, decode and verify, has its own running GDN slot (decode_timer.replay_rows_layout), as
    serving's rows do, and the bucket's padding rows the trash slot 0: on one shared slot the GDN kernel's
    pipeline, which does not fetch again or write back a state block whose index repeats between grid steps, read
    and wrote one state for a whole short step (v5e, the 64-row MTP cycle: the commit's GDN calls took 0.196 ms
    each where distinct slots take 0.598)."""
    from sglang_tpu_qwen.bench.decode_timer import replay_batch, verify_replay_batch

    for rows, batch, sizing in ((3, replay_batch(engine.runner, rows=3, context=40)[0], engine.runner.sizing),
                                (2, verify_replay_batch(spec_engine.runner, 2, 40)[0], spec_engine.runner.sizing)):
        slots = np.asarray(batch.slot_ids).tolist()
        real, padding = slots[:rows], slots[rows:]
        assert len(set(real)) == rows and all(1 <= s < sizing.num_running_slots for s in real), slots
        assert all(s == 0 for s in padding), slots


def test_cycle_replay_on_a_cpu_engine(spec_engine) -> None:
    """The benchmark's measurement (``measure``, as the command runs it) on a CPU engine with an MTP layer: the
    plain step and the cycle each compile nothing in their timed windows, take positive device and dispatch
    time, and the cycle's bytes are its roofline parts; one greedy cycle dispatches two programs, verify and
    commit (which samples the B x 4 positions, commits and drafts); the replay's accept length is in [1, 4] and
    its rows feed distinct ids; the tables render."""
    ns, _ = decode_step.parse_args(["--model-path", "embedded", "--rows", str(CPU_ROWS), "--context",
                                    str(CPU_CONTEXT), "--iters", "2", "--windows", "2", "--no-plan",
                                    "--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(STEPS),
                                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
                                    str(STEPS + 1), "--cycle-program-iters", "1"])
    assert ns.speculative_draft_policy == "always"
    result = decode_step.measure(spec_engine, ns)
    (plain,), (cycle,) = result["rows"], result["cycles"]
    b, n = cycle["bucket_rows"], STEPS + 1
    assert plain["compilations"] == 0 and cycle["compilations"] == 0
    assert plain["device_s"] > 0 and plain["dispatch_s"] > 0 and cycle["device_s"] > 0 and cycle["dispatch_s"] > 0
    assert cycle["over_plain"] == pytest.approx(cycle["device_s"] / plain["device_s"])
    _, parts = decode_step.cycle_roofline_parts(spec_engine.runner, CPU_ROWS, CPU_CONTEXT)
    assert cycle["bytes"] == parts and cycle["bytes_total"] == pytest.approx(sum(parts.values()))
    assert parts["draft"] > 0 and cycle["measured_over_roofline"] == pytest.approx(1 / cycle["roofline_over_measured"])
    assert cycle["programs"] == [str(k) for k in [("verify", b), ("commit", b)]]
    assert plain["programs"] == [str(k) for k in [("forward", spec_engine.runner.buckets.decode_bucket(b)),
                                                  ("sample", "greedy", b), ("keep_sampled", b)]]
    assert 1.0 <= cycle["accept_length_replay"] <= n
    assert cycle["distinct_sampled"] > b * n // 2
    # Each program alone, in dispatch order, against its share of the roofline.
    alone = cycle["alone"]
    assert [a["program"] for a in alone] == ["verify", "commit"]
    assert all(a["device_s"] > 0 for a in alone) and cycle["alone_s"] == pytest.approx(sum(a["device_s"]
                                                                                             for a in alone))
    assert sum(a["min_bytes"] for a in alone) == pytest.approx(cycle["bytes_total"])
    text = decode_step.format_table(result)
    assert "MTP cycle (3 drafts, 4 tokens verified per row" in text and f"| {CPU_ROWS} ({b}) |" in text
    assert f"| {CPU_ROWS} ({b}) | commit |" in text and "sum alone" in text
    record("MTP cycle replay: CPU, embedded + MTP layer", f"{CPU_ROWS} rows x {CPU_CONTEXT}: cycle "
           f"{cycle['device_s'] * 1e3:.1f} ms ({cycle['over_plain']:.2f} plain steps), dispatch "
           f"{cycle['dispatch_s'] * 1e3:.2f} ms, {len(cycle['programs'])} programs, 0 compilations")


def test_profile_of_a_cpu_cycle(spec_engine, tmp_path) -> None:
    """``--profile`` of a speculative engine also profiles the draft + verify cycle: on the CPU the host plane's
    XLA ops, each in one of the cycle's programs (per program too), per cycle."""
    prof = decode_step.profile_cycle(spec_engine.runner, rows=CPU_ROWS, context=CPU_CONTEXT, cycles=2,
                                     out_dir=tmp_path)
    assert prof["source"] == "host" and prof["unit"] == "cycle" and prof["total_ms_per_step"] > 0
    modules = {p["module"] for p in prof["programs"]}
    assert modules == {"jit_verify", "jit_commit"}, modules
    assert sum(p["share"] for p in prof["programs"]) == pytest.approx(1.0)
    text = decode_step.format_profile(prof)
    assert "replayed draft + verify cycles" in text and "| program | ops ms / cycle |" in text


def test_cycle_programs_alone_are_the_served_calls(spec_engine) -> None:
    """Each program timed alone (decode_timer.time_cycle_programs) is one of the cycle's programs, through the
    runner calls the served verify step makes (ModelRunner.verify, ModelRunner.commit)."""
    from sglang_tpu_qwen.bench.decode_timer import recorded_programs, time_cycle_programs, time_verify_cycle

    runner = spec_engine.runner
    with recorded_programs(runner) as cycle:
        time_verify_cycle(runner, CPU_ROWS, CPU_CONTEXT, iters=1, windows=1, warmup=0)
    with recorded_programs(runner) as alone:
        times = time_cycle_programs(runner, CPU_ROWS, CPU_CONTEXT, iters=1, windows=1, warmup=0)
    assert list(times) == ["verify", "commit"]
    assert all(t.step_s > 0 for t in times.values())
    assert alone == [cycle[0], *cycle]  # one untimed verify (the commit's inputs), then each program alone


def test_cycle_replays_the_served_programs(spec_engine) -> None:
    """Served greedy requests that decode together dispatch, for each verify step, exactly the replayed cycle's
    programs in the same order (verify at launch, then the commit once the step before is read): the replay
    measures what serves."""
    from sglang_tpu_qwen.bench.decode_timer import recorded_programs, time_verify_cycle

    runner = spec_engine.runner
    with recorded_programs(runner) as cycle:
        time_verify_cycle(runner, CPU_ROWS, CPU_CONTEXT, iters=1, windows=1, warmup=0)
    prompts = [np.random.default_rng(i).integers(1000, 200000, size=30).tolist() for i in range(CPU_ROWS)]
    with recorded_programs(runner) as served:
        outs = spec_engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                                        "ignore_eos": True})
    assert all(len(o["output_ids"]) == 12 for o in outs)
    starts = [i for i, key in enumerate(served) if key == cycle[0]]
    assert len(starts) >= 3, served  # several verify steps of the replayed bucket
    for i in starts:
        assert served[i : i + len(cycle)] == cycle, served[i : i + len(cycle) + 2]
