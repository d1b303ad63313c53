"""Per-instruction HBM traffic from HLO text (sglang_tpu_qwen/hlo_traffic.py), on a hand-written program:
loop bodies count once per trip, a fusion that slices a parameter pays for the slice, an in-place update
pays for the update, a Pallas call for its declared bytes, and a conditional for its cheapest branch. A
computation offloaded to the SparseCore closes with ``}, execution_thread=...``: the loop body after it must
still be found."""

from __future__ import annotations

from sglang_tpu_qwen.hlo_traffic import program_traffic

# ruff: noqa: E501 (HLO instructions are one line each)

HLO = """HloModule m

%sliced (p0: bf16[6,1024,1024], p1: s32[]) -> bf16[1024,1024] {
  %p0 = bf16[6,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,1024,1024}
  ROOT %b = bf16[1024,1024]{1,0} bitcast(%ds)
}

%dus (q0: bf16[100,8,1024], q1: bf16[1,8,1024], q2: s32[]) -> bf16[100,8,1024] {
  %q0 = bf16[100,8,1024]{2,1,0} parameter(0)
  %q1 = bf16[1,8,1024]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = bf16[100,8,1024]{2,1,0} dynamic-update-slice(%q0, %q1, %q2, %z, %z)
}

%cheap (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(f32[4]{0} %a)
}

%dear (a2: f32[4]) -> f32[4] {
  %a2 = f32[4]{0} parameter(0)
  %big = f32[1000000]{0} broadcast(f32[4]{0} %a2), dimensions={}
  ROOT %r = f32[4]{0} slice(%big), slice={[0:4]}
}

%offloaded (c0: bf16[64]) -> bf16[64] {
  %c0 = bf16[64]{0} parameter(0)
  ROOT %cp = bf16[64]{0} copy(%c0)
}, execution_thread="sparsecore"

%body (t: (s32[], bf16[6,1024,1024], bf16[100,8,1024])) -> (s32[], bf16[6,1024,1024], bf16[100,8,1024]) {
  %t = (s32[], bf16[6,1024,1024]{2,1,0}, bf16[100,8,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = bf16[6,1024,1024]{2,1,0} get-tuple-element(%t), index=1
  %kv = bf16[100,8,1024]{2,1,0} get-tuple-element(%t), index=2
  %f = bf16[1024,1024]{1,0} fusion(bf16[6,1024,1024]{2,1,0} %w, s32[] %i), kind=kLoop, calls=%sliced
  %k = bf16[1,8,1024]{2,1,0} custom-call(bf16[1024,1024]{1,0} %f, bf16[100,8,1024]{2,1,0} %kv), custom_call_target="tpu_custom_call", backend_config={"cost_estimate":{"bytes_accessed":"5000"}}
  %up = bf16[100,8,1024]{2,1,0} fusion(bf16[100,8,1024]{2,1,0} %kv, bf16[1,8,1024]{2,1,0} %k, s32[] %i), kind=kLoop, calls=%dus
  %ss = ((bf16[6,1024,1024]{2,1,0}), bf16[1,1024,1024]{2,1,0:S(1)}, s32[]) slice-start(%w), slice={[0:1], [0:1024], [0:1024]}
  %sd = bf16[1,1024,1024]{2,1,0:S(1)} slice-done(%ss)
  ROOT %o = (s32[], bf16[6,1024,1024]{2,1,0}, bf16[100,8,1024]{2,1,0}) tuple(%i, %w, %up)
}

%cond (t2: (s32[], bf16[6,1024,1024], bf16[100,8,1024])) -> pred[] {
  %t2 = (s32[], bf16[6,1024,1024]{2,1,0}, bf16[100,8,1024]{2,1,0}) parameter(0)
  %j = s32[] get-tuple-element(%t2), index=0
  %six = s32[] constant(6)
  ROOT %lt = pred[] compare(%j, %six), direction=LT
}

ENTRY %main (w0: bf16[6,1024,1024], kv0: bf16[100,8,1024], p: s32[], v: f32[4]) -> f32[4] {
  %w0 = bf16[6,1024,1024]{2,1,0} parameter(0)
  %kv0 = bf16[100,8,1024]{2,1,0} parameter(1)
  %p = s32[] parameter(2)
  %v = f32[4]{0} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[6,1024,1024]{2,1,0}, bf16[100,8,1024]{2,1,0}) tuple(%zero, %w0, %kv0)
  %loop = (s32[], bf16[6,1024,1024]{2,1,0}, bf16[100,8,1024]{2,1,0}) while(%init), condition=%cond, body=%body
  ROOT %sel = f32[4]{0} conditional(%p, %v, %v), branch_computations={%dear, %cheap}
}
"""


def test_traffic_of_a_hand_written_program():
    ops = {o.name: o for o in program_traffic(HLO)}
    layer = 1024 * 1024 * 2
    assert "cp" not in ops  # the offloaded computation is not called here
    assert ops["ss"].bytes == 2 * layer  # an async slice moves the slice, not the array it slices
    assert ops["f"].count == 6 and ops["f"].bytes == 2 * layer + 4  # one layer's slice read and written
    assert ops["k"].count == 6 and ops["k"].bytes == 5000  # the kernel's declared traffic
    assert ops["up"].bytes == 2 * 8 * 1024 * 2 + 4  # the update (read, written), not the 1.6 MB buffer
    assert "n" in ops and "big" not in ops  # the cheaper branch of the conditional
    assert ops["n"].bytes == 32
