"""Launch flags: SGLang names parse, unknown flags and bad values exit with a usage error (code 2)."""

from __future__ import annotations

import pytest

from sglang_tpu_qwen.args.server_args import ServerArgs, prepare_server_args


def test_sglang_flag_names_parse():
    args = prepare_server_args(["--model-path", "/m", "--page-size", "32", "--chunked-prefill-size", "256",
                                "--max-running-requests", "7", "--enable-metrics", "--disable-radix-cache",
                                "--mem-fraction-static", "0.5", "--gdn-snapshot-host-gb", "1.5",
                                "--mamba-ssm-dtype", "bfloat16"])
    assert (args.model_path, args.page_size, args.chunked_prefill_size) == ("/m", 32, 256)
    assert (args.max_running_requests, args.enable_metrics, args.disable_radix_cache) == (7, True, True)
    assert (args.mem_fraction_static, args.gdn_snapshot_host_gb, args.mamba_ssm_dtype) == (0.5, 1.5, "bfloat16")
    assert prepare_server_args([]).mamba_ssm_dtype is None  # unset: the checkpoint config decides
    assert ServerArgs().kv_cache_dtype == "auto"
    assert prepare_server_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    assert prepare_server_args(["--kv-cache-dtype", "fp8_e4m3", "--page-size", "4"]).page_size == 4
    with pytest.raises(ValueError, match="needs a --page-size that is a multiple of 4"):
        ServerArgs(kv_cache_dtype="fp8_e4m3", page_size=6)
    assert ServerArgs(page_size=6).page_size == 6  # bf16 / auto pages: any size


@pytest.mark.parametrize("argv", [["--no-such-flag", "1"], ["--page-size", "0"], ["--schedule-policy", "random"],
                                  ["--top-p", "0.5"], ["--mem-fraction-static", "2"],
                                  ["--gdn-snapshot-host-gb", "-1"], ["--kv-cache-dtype", "fp8_e5m2"],
                                  ["--mamba-ssm-dtype", "float16"]])
def test_bad_flags_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        prepare_server_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "flag"), [(["--node-rank", "1"], "--node-rank"),
                                            (["--dist-init-addr", "10.0.0.1:5000"], "--dist-init-addr")])
def test_multihost_flags_are_refused_until_multihost_serving_exists(argv, flag, capsys):
    """Nothing reads --node-rank or --dist-init-addr yet: a host started with them must not come up as an
    unrelated single-host server, so the launch stops with a usage error that names the flag."""
    with pytest.raises(SystemExit) as exc:
        prepare_server_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "multi-host serving is not implemented yet" in err
    assert prepare_server_args(["--node-rank", "0"]).node_rank == 0  # the single host's rank is still accepted


def test_engine_kwargs_refuse_multihost_flags():
    with pytest.raises(ValueError, match="--node-rank is not supported: multi-host serving is not implemented"):
        ServerArgs.from_kwargs(node_rank=1)
    with pytest.raises(ValueError, match="--dist-init-addr is not supported: multi-host serving is not"):
        ServerArgs.from_kwargs(dist_init_addr="10.0.0.1:5000")


def test_chunked_prefill_size_is_split_over_dp_ranks():
    """As SGLang under DP attention: the flag is the step's total, each rank prefills size // dp_size; the
    default follows the device memory as SGLang's table does."""
    args = ServerArgs(dp_size=8, chunked_prefill_size=8192)
    assert args.chunked_prefill_per_rank == 1024
    default = ServerArgs(dp_size=8)
    with pytest.raises(ValueError, match="not resolved"):
        _ = default.chunked_prefill_per_rank
    default.resolve_chunked_prefill_size("tpu", 96 * 2**30)  # an Ironwood TensorCore
    assert (default.chunked_prefill_size, default.chunked_prefill_per_rank) == (8192, 1024)
    for backend, mem, want in (("gpu", 192 * 2**30, 16384), ("gpu", 40 * 2**30, 4096), ("gpu", 16 * 2**30, 2048),
                               ("tpu", None, 8192), ("cpu", None, 512)):
        a = ServerArgs()
        a.resolve_chunked_prefill_size(backend, mem)
        assert (a.chunked_prefill_size, a.chunked_prefill_per_rank) == (want, want), (backend, mem)
    args.resolve_chunked_prefill_size("cpu", None)  # a given size is kept
    assert args.chunked_prefill_size == 8192
    wide = ServerArgs(dp_size=64)
    wide.resolve_chunked_prefill_size("cpu", None)  # the default still leaves each rank its smallest chunk
    assert wide.chunked_prefill_per_rank == 16
    with pytest.raises(ValueError, match="each rank needs at least 16 prompt tokens per step, so at least 128"):
        ServerArgs(dp_size=8, chunked_prefill_size=100)
    with pytest.raises(ValueError, match="cannot be turned off"):
        ServerArgs(chunked_prefill_size=-1)


def test_engine_kwargs_reject_unknown_names():
    with pytest.raises(TypeError, match="bogus_flag"):
        ServerArgs.from_kwargs(bogus_flag=1)


def test_host_tier_default_is_a_capped_share_of_available_host_memory():
    from sglang_tpu_qwen.memory.host_budget import (
        HOST_TIER_CAP_BYTES,
        HOST_TIER_SHARE,
        HostMemoryGuard,
        host_available_bytes,
        resolve_host_tier,
    )
    from sglang_tpu_qwen.memory.host_snapshots import HostSnapshotStore

    small = ServerArgs()
    budget = resolve_host_tier(small, available_bytes=8 * 2**30)
    assert (budget.rule, budget.budget_bytes) == ("default", int(HOST_TIER_SHARE * 8 * 2**30))
    assert small.gdn_snapshot_host_gb == budget.budget_bytes / 2**30
    assert resolve_host_tier(small).rule == "explicit"  # resolved once: a second call keeps the value
    big = ServerArgs()
    assert resolve_host_tier(big, available_bytes=2**50).budget_bytes == HOST_TIER_CAP_BYTES
    off = ServerArgs(gdn_snapshot_host_gb=0)
    assert (resolve_host_tier(off, available_bytes=2**40).budget_bytes, off.gdn_snapshot_host_gb) == (0, 0)
    no_tree = ServerArgs(disable_radix_cache=True)
    assert resolve_host_tier(no_tree).rule == "off" and no_tree.gdn_snapshot_host_gb == 0
    # The live guard: a store that would leave less than the reserve available is refused and counted.
    assert HostMemoryGuard(reserve_bytes=0).allows(1)
    starved = HostSnapshotStore(2**30, guard=HostMemoryGuard(reserve_bytes=host_available_bytes() + 2**40))
    assert not starved.fits(1024) and starved.refused_low_memory == 1


def test_image_flags_parse_as_sglang_and_vllm_spell_them(tmp_path, capsys):
    """--limit-mm-data-per-request takes JSON (SGLang), --allowed-media-domains a list, --allowed-local-media-path
    a directory (vLLM); nonsense is a usage error naming the flag; --help prints (a '%' in a help text once
    broke it)."""
    args = prepare_server_args(["--limit-mm-data-per-request", '{"image": 3, "video": 0}',
                                "--allowed-media-domains", "a.example", "b.example",
                                "--allowed-local-media-path", str(tmp_path), "--max-image-pixels", "1000",
                                "--media-url-max-file-size-mb", "0.5", "--mm-embedding-cache-size-mb", "64",
                                "--mm-max-patches", "4096"])
    assert (args.mm_embedding_cache_size_mb, args.mm_max_patches) == (64.0, 4096)
    assert args.limit_mm_data_per_request == {"image": 3, "video": 0} and args.max_images_per_request == 3
    assert args.allowed_media_domains == ["a.example", "b.example"]
    assert args.allowed_local_media_path == str(tmp_path) and args.max_image_pixels == 1000
    assert ServerArgs().max_images_per_request == 32 and ServerArgs().allowed_media_domains is None
    for argv, fragment in [
        (["--limit-mm-data-per-request", "image=3"], "not JSON"),
        (["--limit-mm-data-per-request", "[3]"], "JSON object"),
        (["--limit-mm-data-per-request", '{"image": -1}'], "image must be an integer >= 0"),
        (["--limit-mm-data-per-request", '{"video": 1}'], "video inputs are not served"),
        (["--allowed-local-media-path", str(tmp_path / "none")], "is not a directory"),
        (["--max-image-pixels", "0"], "--max-image-pixels must be positive"),
        (["--media-url-max-file-size-mb", "0"], "--media-url-max-file-size-mb must be > 0"),
        (["--mm-embedding-cache-size-mb", "-1"], "--mm-embedding-cache-size-mb must be >= 0"),
        (["--mm-max-patches", "0"], "--mm-max-patches must be positive"),
    ]:
        with pytest.raises(SystemExit):
            prepare_server_args(argv)
        assert fragment in capsys.readouterr().err, argv
    with pytest.raises(SystemExit) as done:
        prepare_server_args(["--help"])
    assert done.value.code == 0 and "--allowed-local-media-path" in capsys.readouterr().out


def test_encoder_cache_size_from_the_flag_else_sglang_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """--mm-embedding-cache-size-mb wins; absent, SGLang's SGLANG_VLM_CACHE_SIZE_MB; absent too, the default."""
    from sglang_tpu_qwen.engine.runner.vision_encoder import DEFAULT_CACHE_BYTES
    from sglang_tpu_qwen.engine.runner.vision_setup import encoder_cache_bytes

    monkeypatch.delenv("SGLANG_VLM_CACHE_SIZE_MB", raising=False)
    assert encoder_cache_bytes(ServerArgs()) == DEFAULT_CACHE_BYTES
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "100")
    assert encoder_cache_bytes(ServerArgs()) == 100 << 20
    assert encoder_cache_bytes(ServerArgs(mm_embedding_cache_size_mb=0)) == 0
    for bad in ("lots", "-5"):
        monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", bad)
        with pytest.raises(ValueError, match="SGLANG_VLM_CACHE_SIZE_MB"):
            encoder_cache_bytes(ServerArgs())


def test_page_size_default_follows_where_the_pallas_kernel_runs(monkeypatch) -> None:
    """64 (the page measured fastest on v5e) where the Pallas attention kernel runs on a TPU, 16 elsewhere; a
    given --page-size is kept."""
    import sglang_tpu_qwen.args.server_args as sa

    assert ServerArgs().page_size == sa.DEFAULT_PAGE_SIZE == 16  # this CPU host
    monkeypatch.setattr(sa, "cpu_only_host", lambda: False)
    monkeypatch.setattr(sa, "accelerator_device_files", lambda patterns: ["/dev/accel0"])
    assert ServerArgs().page_size == ServerArgs(attention_backend="pallas").page_size == sa.TPU_PAGE_SIZE == 64
    assert ServerArgs(attention_backend="reference").page_size == 16
    assert ServerArgs(page_size=32).page_size == 32
    monkeypatch.setattr(sa, "accelerator_device_files", lambda patterns: [])  # a GPU or CPU host
    assert ServerArgs().page_size == 16
