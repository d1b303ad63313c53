"""Safe defaults: the api key compared in constant time, no prompt or output text in the logs unless
--log-requests, /metrics open only where --enable-metrics made it, a warning for a public bind without a key."""

from __future__ import annotations

import hmac
import logging
from typing import Any

import httpx
import pytest
from conftest import serve_app

from sglang_tpu_qwen.args.server_args import ServerArgs, prepare_server_args
from sglang_tpu_qwen.launch_server import exposure_warning
from sglang_tpu_qwen.server.app import create_app

MARKER = "Zanzibar quokka violet 4817"


class _WithoutMetrics:
    """The real engine as a server without --enable-metrics sees it (metrics None)."""

    metrics = None

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_api_key_constant_time_and_open_paths(server, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    key = "sk-0123456789"
    with serve_app(create_app(server.engine, api_key=key)) as url:
        for bad in ("Bearer sk-012345678X", "Bearer sk-01234567890", "bearer sk-0123456789", "sk-0123456789", ""):
            r = httpx.get(url + "/get_model_info", headers={"Authorization": bad} if bad else {})
            assert r.status_code == 401, bad
        assert httpx.get(url + "/get_model_info", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert len(calls) == 6 and all(b == f"Bearer {key}".encode() for _, b in calls)
        # Metrics are on in the session engine: /metrics stays open for scrapers, as do the health checks.
        metrics = httpx.get(url + "/metrics")
        assert metrics.status_code == 200 and "sglang:num_requests_total" in metrics.text
        assert httpx.get(url + "/health").status_code == 200
        # Nothing else hides behind an exempt prefix.
        assert httpx.get(url + "/metricsfoo").status_code == 401
        assert httpx.get(url + "/healthz").status_code == 401
    with serve_app(create_app(_WithoutMetrics(server.engine), api_key=key)) as url:
        assert httpx.get(url + "/metrics").status_code == 401  # no --enable-metrics: not an open path
        assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 404


def _traffic(url: str, engine: Any) -> tuple[str, str]:
    """One /generate and one streamed chat completion carrying MARKER; returns both generated texts."""
    r = httpx.post(url + "/generate", timeout=120,
                   json={"text": MARKER, "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    assert r.status_code == 200, r.text
    body = {"model": engine.served_model_name, "messages": [{"role": "user", "content": MARKER}],
            "max_tokens": 6, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in httpx.Response(200, content=line[6:]).json()["choices"]:
                    text += (c.get("delta") or {}).get("content") or ""
    return r.json()["text"], text


def test_no_prompt_or_output_in_logs_by_default(server, caplog):
    assert server.engine.server_args.log_requests is False
    with caplog.at_level(logging.DEBUG):
        out1, out2 = _traffic(server.url, server.engine)
    assert MARKER not in caplog.text
    for out in (out1, out2):
        if len(out.strip()) >= 8:  # long enough not to appear by chance in some other line
            assert out not in caplog.text
    assert "Receive:" not in caplog.text


@pytest.mark.parametrize("level", [0, 2, 3])
def test_log_requests_levels(server, caplog, monkeypatch, level):
    args = server.engine.server_args
    monkeypatch.setattr(args, "log_requests", True)
    monkeypatch.setattr(args, "log_requests_level", level)
    # Longer than the context (a 400), so only its arrival is logged: it shows the level-2 cut.
    long_text = MARKER + " " + "x" * 3000
    with caplog.at_level(logging.INFO, logger="sglang_tpu_qwen.request"):
        r = httpx.post(server.url + "/generate", timeout=120,
                       json={"text": long_text, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
        assert r.status_code == 400, r.text
        out1, _ = _traffic(server.url, server.engine)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "sglang_tpu_qwen.request"]
    receive = [x for x in lines if x.startswith("Receive:")]
    finish = [x for x in lines if x.startswith("Finish:")]
    assert len(receive) == 3 and len(finish) == 2, lines
    assert all("completion_tokens=6" in x for x in finish)
    if level == 0:
        assert not any(MARKER in x or "sampling_params" in x or "output=" in x for x in lines)
    else:
        assert all("sampling_params=" in x for x in receive)
        assert all(MARKER in x for x in receive[:2])
        assert f"output={out1}" in finish[0]
        cut = "more chars)" in receive[0]
        assert cut == (level == 2)  # level 2 cuts at 2048 characters, level 3 logs all of it
        assert ("x" * 3000 in receive[0]) == (level == 3)


def test_public_bind_without_key_warns():
    assert exposure_warning(ServerArgs(host="0.0.0.0")) is not None
    assert "--api-key" in exposure_warning(ServerArgs(host="10.1.2.3"))
    assert exposure_warning(ServerArgs(host="example.internal")) is not None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert exposure_warning(ServerArgs(host=host)) is None, host
    assert exposure_warning(ServerArgs(host="0.0.0.0", api_key="sk")) is None


def test_log_requests_flags():
    args = prepare_server_args(["--log-requests", "--log-requests-level", "3"])
    assert args.log_requests and args.log_requests_level == 3
    assert ServerArgs().log_requests is False and ServerArgs().log_requests_level == 2
    with pytest.raises(SystemExit):
        prepare_server_args(["--log-requests-level", "4"])
