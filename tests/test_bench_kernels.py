"""bench.kernels on the CPU: its sections run apart (a chip call of 10 minutes holds one or two of them), each
prints its rows, and an unknown section is refused before anything runs."""

import pytest

from sglang_tpu_qwen.bench import kernels


def test_one_section_prints_only_its_rows(capsys):
    kernels.main(["--sections", "gdn-verify", "--iters", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("fused_gdn")]
    # Off a TPU only the jnp reference runs: one verify row (no commit) and one commit row.
    assert [line.split()[1] for line in rows] == ["verify", "commit"]
    assert all("reference" in line for line in rows)
    assert "-- GDN verify steps" in out
    assert "-- GDN decode" not in out and "-- GDN prefill" not in out and "ragged_paged_attention" not in out


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as err:
        kernels.main(["--sections", "gdn-verify,attention"])
    assert err.value.code == 2
    assert "unknown section(s) ['attention']" in capsys.readouterr().err
