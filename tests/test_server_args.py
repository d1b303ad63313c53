"""Launch flags: SGLang names parse, unknown flags and bad values exit with a usage error (code 2)."""

from __future__ import annotations

import pytest

from sglang_tpu_qwen.server_args import ServerArgs, prepare_server_args


def test_sglang_flag_names_parse():
    args = prepare_server_args(["--model-path", "/m", "--page-size", "32", "--chunked-prefill-size", "256",
                                "--max-running-requests", "7", "--enable-metrics", "--disable-radix-cache",
                                "--mem-fraction-static", "0.5", "--gdn-snapshot-host-gb", "1.5"])
    assert (args.model_path, args.page_size, args.chunked_prefill_size) == ("/m", 32, 256)
    assert (args.max_running_requests, args.enable_metrics, args.disable_radix_cache) == (7, True, True)
    assert (args.mem_fraction_static, args.gdn_snapshot_host_gb) == (0.5, 1.5)


@pytest.mark.parametrize("argv", [["--no-such-flag", "1"], ["--page-size", "0"], ["--schedule-policy", "random"],
                                  ["--top-p", "0.5"], ["--mem-fraction-static", "2"]])
def test_bad_flags_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        prepare_server_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_engine_kwargs_reject_unknown_names():
    with pytest.raises(TypeError, match="bogus_flag"):
        ServerArgs.from_kwargs(bogus_flag=1)
