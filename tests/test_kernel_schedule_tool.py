"""tools/plan/kernel_schedule.py's reading of libtpu's LLO dump (the files a deviceless compile writes; the compile
itself is the Ironwood AOT tests' ground)."""

from __future__ import annotations

from pathlib import Path

from sglang_tpu_qwen.tools.plan.kernel_schedule import read_schedules

# The shape of libtpu's per-bundle utilisation dump: unit names, slots a bundle, then one row per bundle.
UTILIZATION = """== CAPACTIY:
MXU, XLU, VALU, VPOP, EUP, VLOAD, VLOAD:FILL, VSTORE, VSTORE:SPILL, SALU
    4     3     4     2     1     3     3     1     1     2
== UTILIZATION:
0 0 0 0 0 0 0 0 0 2
1 0 4 0 1 3 0 1 0 1
0 3 2 2 0 0 0 0 1 0
"""


def test_reads_bundles_and_unit_ops_per_pallas_call(tmp_path: Path) -> None:
    (tmp_path / "1796614613276090639-gdn_chunked.1-70-final_hlo-static-per-bundle-utilization.txt").write_text(
        UTILIZATION)
    (tmp_path / "1796614613276090639-gdn_chunked.1-72-final_bundles.txt").write_text("not read\n")
    (tmp_path / "17-gdn_recurrent.3-68-final_hlo-static-per-bundle-utilization.txt").write_text(
        UTILIZATION.split("== UTILIZATION:")[0] + "== UTILIZATION:\n0 0 4 0 0 0 0 0 0 0\n")
    got = read_schedules(tmp_path)
    assert set(got) == {"gdn_chunked.1", "gdn_recurrent.3"}
    chunked = got["gdn_chunked.1"]
    assert chunked["bundles"] == 3
    assert chunked["units"]["VALU"] == (6, 4)  # 6 ops against 4 slots a bundle
    assert chunked["units"]["XLU"] == (3, 3)
    assert chunked["units"]["SALU"] == (3, 2)
    assert got["gdn_recurrent.3"] == {"bundles": 1, "units": {**{u: (0, s) for u, (_, s) in chunked["units"].items()},
                                                              "VALU": (4, 4)}}
