"""The soak benchmark (sglang_tpu_qwen/bench/soak.py), briefly, against the session's real server: mixed traffic
with disconnects, aborts and JSON-schema constraints ends with no error, no leaked page or slot and no invalid
constrained answer."""

from __future__ import annotations

import json

from sglang_tpu_qwen.bench import soak


def test_short_soak_is_clean(server, capsys):
    status = soak.main(["--base-url", server.url, "--clients", "6", "--duration", "4", "--seed", "3"])
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] >= 6 and report["idle"] and report["flushed"]
    assert status == 0, report
    assert report["errors"] == report["leaked_pages"] == report["leaked_slots"] == report["invalid_constrained"] == 0
