"""Per-instruction HBM traffic from HLO text (sglang_tpu_qwen/tools/hlo_traffic.py), on a hand-written program:
loop bodies count once per trip, a fusion that slices a parameter pays for the slice, an in-place update
pays for the update, a Pallas call for its declared bytes, and a conditional for its cheapest branch. A
computation offloaded to the SparseCore closes with ``}, execution_thread=...``: the loop body after it must
still be found. Compiled TPU HLO names operands bare and offloads work to the SparseCore as async calls:
the operands are read all the same, and an async call is charged once."""

from __future__ import annotations

import pytest

from sglang_tpu_qwen.tools.hlo_traffic import instruction_table, program_traffic

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
    assert ops["ss"].bytes == layer  # an async slice reads the slice, not the array; it writes VMEM (S(1))
    assert ops["f"].count == 6 and ops["f"].bytes == 2 * layer + 4  # one layer's slice read and written
    assert ops["k"].count == 6 and ops["k"].bytes == 5000  # the kernel's declared traffic
    assert ops["up"].bytes == 2 * 8 * 1024 * 2 + 4  # the update (read, written), not the 1.6 MB buffer
    assert "n" in ops and "big" not in ops  # the cheaper branch of the conditional
    assert ops["n"].bytes == 32


# Compiled TPU HLO prints operands as bare names, and offloads collectives, relayouts and gathers to the
# SparseCore as async calls whose result tuple lists what they read and write.
COMPILED = """HloModule c

%gather_sc (g0: bf16[4096,1024], g1: s32[512]) -> bf16[512,1024] {
  %g0 = bf16[4096,1024]{1,0} parameter(0)
  %g1 = s32[512]{0} parameter(1)
  %gs = ((bf16[4096,1024]{1,0}, s32[512]{0}), bf16[512,1024]{1,0}, u32[]) call-start(%g0, %g1), async_execution_thread="sparsecore", to_apply=%gather_inner
  ROOT %gd = bf16[512,1024]{1,0} call-done(%gs)
}, execution_thread="sparsecore"

%gather_inner (h0: bf16[4096,1024], h1: s32[512]) -> bf16[512,1024] {
  %h0 = bf16[4096,1024]{1,0} parameter(0)
  %h1 = s32[512]{0} parameter(1)
  ROOT %gather_offload_custom_fusion.1 = bf16[512,1024]{1,0} custom-call(%h0, %h1), custom_call_target="gather"
}, execution_thread="sparsecore"

%relayout_sc (r0: bf16[4096,1024]) -> bf16[4096,1024] {
  %r0 = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %rc = bf16[4096,1024]{1,0:T(16,128)(2,1)} copy(%r0)
}, execution_thread="sparsecore"

%relayout (r1: bf16[6,1024,1024]) -> bf16[6,1024,1024] {
  %r1 = bf16[6,1024,1024]{2,1,0:T(16,128)(2,1)} parameter(0)
  ROOT %rcp = bf16[6,1024,1024]{2,1,0:T(8,128)(2,1)} copy(%r1)
}

%slice_layer (s0: bf16[6,1024,1024], s1: s32[]) -> bf16[1024,1024] {
  %s0 = bf16[6,1024,1024]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %z0 = s32[] constant(0)
  %lay = bf16[6,1024,1024]{2,1,0:T(8,128)(2,1)} fusion(%s0), kind=kLoop, calls=%relayout
  %sl = bf16[1,1024,1024]{2,1,0} dynamic-slice(%lay, %s1, %z0, %z0), dynamic_slice_sizes={1,1024,1024}
  ROOT %sb = bf16[1024,1024]{1,0} bitcast(%sl)
}

%dot_layer (d0: bf16[8,1024], d1: bf16[6,1024,1024], d2: s32[]) -> bf16[8,1024] {
  %d0 = bf16[8,1024]{1,0} parameter(0)
  %d1 = bf16[6,1024,1024]{2,1,0} parameter(1)
  %d2 = s32[] parameter(2)
  %wl = bf16[1024,1024]{1,0} fusion(%d1, %d2), kind=kLoop, calls=%slice_layer
  ROOT %dd = bf16[8,1024]{1,0} convolution(%d0, %wl), dim_labels=bf_io->bf
}

ENTRY %main (x: bf16[4096,1024], idx: s32[512], xs: bf16[8,1024], stack: bf16[6,1024,1024], li: s32[]) -> bf16[512,1024] {
  %x = bf16[4096,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %idx = s32[512]{0} parameter(1)
  %xs = bf16[8,1024]{1,0} parameter(2)
  %stack = bf16[6,1024,1024]{2,1,0} parameter(3)
  %li = s32[] parameter(4)
  %nd = bf16[8,1024]{1,0} fusion(%xs, %stack, %li), kind=kOutput, calls=%dot_layer
  %cp = bf16[4096,1024]{1,0:T(16,128)(2,1)} copy(%x)
  %rs = ((bf16[4096,1024]{1,0:T(8,128)(2,1)}, token[]), bf16[4096,1024]{1,0:T(16,128)(2,1)}) call-start(%x), async_execution_thread="sparsecore", to_apply=%relayout_sc
  %rd = bf16[4096,1024]{1,0:T(16,128)(2,1)} call-done(%rs)
  %gs2 = ((bf16[4096,1024]{1,0}, s32[512]{0}, token[]), bf16[512,1024]{1,0}) call-start(%rd, %idx), async_execution_thread="sparsecore", to_apply=%gather_sc
  %gd2 = bf16[512,1024]{1,0} call-done(%gs2)
  %pe = (bf16[512,1024]{1,0}, bf16[512,1024]{1,0}, u32[], u32[]) collective-permute-start(%gd2), source_target_pairs={{0,1},{1,0}}
  %pd = bf16[512,1024]{1,0} collective-permute-done(%pe)
  %pf = (bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[512,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%pd)
  %pfd = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} copy-done(%pf)
  %vm = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} multiply(%pfd, %gd2)
  %ss = ((bf16[6,1024,1024]{2,1,0}), bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%stack), slice={[0:1],[0:1024],[0:1024]}
  %sd = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} slice-done(%ss)
  ROOT %sum = bf16[512,1024]{1,0} add(%vm, %gd2)
}
"""


def test_traffic_of_compiled_style_hlo():
    ops = {o.name: o for o in program_traffic(COMPILED)}
    big, rows = 4096 * 1024 * 2, 512 * 1024 * 2
    assert ops["cp"].bytes == 2 * big  # a bare-named operand is read: its shape comes from its definition
    assert ops["rs"].bytes == 2 * big  # an async relayout reads and writes the array once, at its start
    assert ops["gs2"].bytes == 2 * rows + 512 * 4  # a gather reads the rows it gathers, not the whole source
    assert "rd" not in ops and "gd2" not in ops  # the done only waits
    assert ops["pe"].bytes == 2 * rows + 8  # a permute reads its operand, writes its destination (+ 2 u32 contexts)
    # VMEM (S(1)) is not HBM: a prefetch reads its source only, an async slice into VMEM reads its slice,
    # an instruction whose operand or result is in VMEM moves only its HBM side.
    assert ops["pf"].bytes == rows and ops["ss"].bytes == 1024 * 1024 * 2
    assert ops["vm"].bytes == rows and ops["sum"].bytes == 2 * rows
    assert "gs" not in ops and "rc" not in ops  # offloaded computations are charged at their call site
    # A dot's fusion reads one layer of a stacked weight through a nested fusion that relays the stack out
    # and slices it (XLA computes the relayout only where the slice reads it): the layer.
    assert ops["nd"].bytes == 8 * 1024 * 2 + 1024 * 1024 * 2 + 4 + 8 * 1024 * 2


# Collectives: one offloaded to the SparseCore (call-start / call-done) with a fusion scheduled between its start
# and its done, inside a 3-trip loop; one synchronous, with its groups in the iota form.
COLLECTIVES = """HloModule k

%ag_sc (a0: bf16[8,1024], a1: token[]) -> bf16[64,1024] {
  %a0 = bf16[8,1024]{1,0} parameter(0)
  %a1 = token[] parameter(1)
  ROOT %all-gather.1 = bf16[64,1024]{1,0} all-gather(%a0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
}, execution_thread="sparsecore"

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%neg (n0: bf16[256,1024]) -> bf16[256,1024] {
  %n0 = bf16[256,1024]{1,0} parameter(0)
  ROOT %nn = bf16[256,1024]{1,0} negate(%n0)
}

%body (t: (s32[], bf16[8,1024], bf16[256,1024])) -> (s32[], bf16[8,1024], bf16[256,1024]) {
  %t = (s32[], bf16[8,1024]{1,0}, bf16[256,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[8,1024]{1,0} get-tuple-element(%t), index=1
  %w = bf16[256,1024]{1,0} get-tuple-element(%t), index=2
  %tok = token[] after-all()
  %gs = ((bf16[8,1024]{1,0}, token[]), bf16[64,1024]{1,0}) call-start(%x, %tok), async_execution_thread="sparsecore", to_apply=%ag_sc
  %f = bf16[256,1024]{1,0} fusion(%w), kind=kLoop, calls=%neg
  %gd = bf16[64,1024]{1,0} call-done(%gs)
  ROOT %o = (s32[], bf16[8,1024]{1,0}, bf16[256,1024]{1,0}) tuple(%i, %x, %f)
}

%cond (t2: (s32[], bf16[8,1024], bf16[256,1024])) -> pred[] {
  %t2 = (s32[], bf16[8,1024]{1,0}, bf16[256,1024]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%t2), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}

ENTRY %main (p: bf16[8,1024], q: bf16[256,1024], r: f32[64]) -> f32[16] {
  %p = bf16[8,1024]{1,0} parameter(0)
  %q = bf16[256,1024]{1,0} parameter(1)
  %r = f32[64]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,1024]{1,0}, bf16[256,1024]{1,0}) tuple(%zero, %p, %q)
  %loop = (s32[], bf16[8,1024]{1,0}, bf16[256,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %rs = f32[16]{0} reduce-scatter(%r), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
}
"""


def test_collectives_of_a_hand_written_program():
    from sglang_tpu_qwen.tools.hlo_traffic import program_collectives

    cs = {c.name: c for c in program_collectives(COLLECTIVES)}
    assert set(cs) == {"gs", "rs"}  # the collective inside the offloaded computation is its call site's
    ag, rs = cs["gs"], cs["rs"]
    assert ag.kind == "all-gather" and ag.count == 3 and ag.is_async
    assert ag.groups == [list(range(8))] and ag.in_bytes == 8 * 1024 * 2 and ag.out_bytes == 64 * 1024 * 2
    assert ag.overlap_bytes == 2 * 256 * 1024 * 2  # the fusion between start and done reads and writes 512 KiB
    # iota groups: arange(8) as [4, 2], transposed -> [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert rs.kind == "reduce-scatter" and rs.count == 1 and not rs.is_async and rs.overlap_bytes == 0
    assert rs.groups == [[0, 2, 4, 6], [1, 3, 5, 7]] and rs.in_bytes == 256 and rs.out_bytes == 64


def test_planner_charges_in_place_kernels_at_the_chips_stream_rate():
    """The planner's serial time (tools/plan/programs.py) prices each instruction at its own roofline; a kernel
    that updates a pool in place (op_name "fused_gdn") runs at the chip's measured in-place stream rate, any
    other kernel at the HBM peak."""
    from sglang_tpu_qwen.tools.plan.chips import CHIPS
    from sglang_tpu_qwen.tools.plan.programs import traffic

    gdn = HLO.replace('custom_call_target="tpu_custom_call"',
                      'custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/gdn/jit(fused_gdn)/pallas_call"}')
    bw, kernel_s = 1e9, 6 * 5000 / 1e9  # 6 trips of the kernel's 5,000 declared bytes
    base = traffic(gdn, bw, 1e15)["serial_s"]
    for text, charged in ((gdn, 1.0 / 0.5 - 1.0), (HLO, 0.0)):
        assert traffic(text, bw, 1e15, inplace_stream_fraction=0.5)["serial_s"] - traffic(text, bw, 1e15)[
            "serial_s"] == pytest.approx(charged * kernel_s)
    assert base == traffic(HLO, bw, 1e15)["serial_s"]
    v5e = CHIPS["v5e"]
    assert 0.7 <= v5e.inplace_stream_fraction < 0.8 and "measured" in v5e.inplace_stream_source
    assert CHIPS["tpu7x"].inplace_stream_fraction == 1.0  # not measured there: the peak


def test_planner_charges_each_gdn_form_at_the_chips_rate_for_it():
    """The fused GDN kernel's two forms (pallas_calls under the RECURRENT_SCOPE and CHUNKED_SCOPE name scopes)
    run their declared flops at the chip's measured rate for each form (gdn_recurrent_flops_per_s: the VPU;
    gdn_chunked_flops_per_s: a chain of dependent 64 x 64 MXU products), where they can outlast the kernel's
    bytes; each form's rate leaves the other form and other kernels at the MXU peak."""
    from sglang_tpu_qwen.kernels.gdn.kernel import CHUNKED_SCOPE, RECURRENT_SCOPE
    from sglang_tpu_qwen.tools.plan.chips import CHIPS
    from sglang_tpu_qwen.tools.plan.programs import traffic

    def kernel(scope: str) -> str:
        return HLO.replace(
            'custom_call_target="tpu_custom_call", backend_config={"cost_estimate":{"bytes_accessed":"5000"}}',
            'custom_call_target="tpu_custom_call", backend_config={"cost_estimate":{"flops":"6000000",'
            f'"bytes_accessed":"5000"}}}}, metadata={{op_name="jit(step)/jit(fused_gdn)/{scope}/pallas_call"}}')

    recurrent, chunked = kernel(RECURRENT_SCOPE), kernel(CHUNKED_SCOPE)
    assert recurrent != HLO and chunked != HLO
    bw, mxu, vpu, chain = 1e9, 1e15, 1e9, 2e9  # 6 trips of 5,000 bytes (30 us) against 6 x 6 MFLOP (ms at a rate)
    base = traffic(recurrent, bw, mxu)["serial_s"]
    assert traffic(chunked, bw, mxu)["serial_s"] == pytest.approx(base)
    assert traffic(chunked, bw, mxu, gdn_recurrent_flops_per_s=vpu)["serial_s"] == pytest.approx(base)
    assert traffic(recurrent, bw, mxu, gdn_chunked_flops_per_s=chain)["serial_s"] == pytest.approx(base)
    assert traffic(recurrent, bw, mxu, gdn_recurrent_flops_per_s=vpu)["serial_s"] - base == pytest.approx(
        6 * (6e6 / vpu - 5000 / bw))
    assert traffic(chunked, bw, mxu, gdn_chunked_flops_per_s=chain)["serial_s"] - base == pytest.approx(
        6 * (6e6 / chain - 5000 / bw))
    v5e = CHIPS["v5e"]
    assert v5e.gdn_recurrent_flops_per_s and 1e12 < v5e.gdn_recurrent_flops_per_s < 1e13
    assert "schedule" in v5e.gdn_recurrent_source
    assert v5e.gdn_chunked_flops_per_s and 1e12 < v5e.gdn_chunked_flops_per_s < 0.1 * v5e.bf16_flops_per_s
    assert "measured" in v5e.gdn_chunked_source
    # Not measured there: the MXU peak.
    assert CHIPS["tpu7x"].gdn_recurrent_flops_per_s is None and CHIPS["tpu7x"].gdn_chunked_flops_per_s is None


# A jax.lax.ragged_dot as the TPU compiles it (a Mosaic custom call that declares no flops): 4,096 rows over 16
# groups of [2048, 512] weights, operands named bare as in compiled HLO.
RAGGED = """HloModule r

ENTRY %main (x: bf16[4096,2048], w: bf16[16,2048,512], g: s32[17]) -> bf16[4096,512] {
  %x = bf16[4096,2048]{1,0} parameter(0)
  %w = bf16[16,2048,512]{2,1,0} parameter(1)
  %g = s32[17]{0} parameter(2)
  ROOT %rd = bf16[4096,512]{1,0} custom-call(%g, %x, %w), custom_call_target="tpu_custom_call", operand_layout_constraints={s32[17]{0}, bf16[4096,2048]{1,0}, bf16[16,2048,512]{2,1,0}}, metadata={op_name="jit(f)/moe/ragged_dot_general/ragged-dot-none"}
}
"""


def test_planner_charges_ragged_dot_at_the_chips_measured_mxu_share() -> None:
    """A ragged dot's flops (2 M K N, which it does not declare) are charged at the chip's measured share of the
    MXU peak for its rows per group (chips.ChipPeaks.ragged_dot_mxu_fraction: log-linear between measured points,
    the nearest point outside them) and count as declared; without the curve they stay undeclared."""
    from sglang_tpu_qwen.tools.plan.chips import CHIPS
    from sglang_tpu_qwen.tools.plan.programs import traffic

    (op,) = [o for o in program_traffic(RAGGED) if o.opcode == "custom-call"]
    assert op.dot_flops == 2 * 4096 * 2048 * 512 and op.rows_per_group == 4096 / 16
    bw, peak = 1e15, 1e12  # bytes free: the flops bound
    plain = traffic(RAGGED, bw, peak)
    assert plain["declared_flops"] == 0  # left to the caller's undeclared flops at the peak
    charged = traffic(RAGGED, bw, peak, ragged_dot_mxu_fraction=lambda rows: 0.25 if rows == 256 else 1.0)
    assert charged["declared_flops"] == op.dot_flops
    assert charged["serial_s"] == pytest.approx(op.dot_flops / (0.25 * peak))
    v5e, tpu7x = CHIPS["v5e"], CHIPS["tpu7x"]
    pts = v5e.ragged_dot_mxu_points
    assert pts and all(0 < f <= 1 for _, f in pts) and "measured" in v5e.ragged_dot_source
    assert v5e.ragged_dot_mxu_fraction(1) == pts[0][1] and v5e.ragged_dot_mxu_fraction(1e6) == pts[-1][1]
    (r0, f0), (r1, f1) = pts[0], pts[1]
    assert v5e.ragged_dot_mxu_fraction((r0 * r1) ** 0.5) == pytest.approx((f0 + f1) / 2)  # log-linear midpoint
    assert not tpu7x.ragged_dot_mxu_points and tpu7x.ragged_dot_mxu_fraction(256) == 1.0


# kernels/grouped_ffn as the TPU compiles it: 16,384 rows over 128 experts of hidden 2048 and intermediate 512,
# its declared flops (6 M H I) and bytes (every expert's three blocks and the rows in and out).
GROUPED_FFN = """HloModule g

ENTRY %main (o: s32[128], s: s32[128], z: s32[128], c: s32[1], x: bf16[16384,2048], wg: bf16[128,2048,512], wu: bf16[128,2048,512], wd: bf16[128,512,2048]) -> bf16[16384,2048] {
  %o = s32[128]{0} parameter(0)
  %s = s32[128]{0} parameter(1)
  %z = s32[128]{0} parameter(2)
  %c = s32[1]{0} parameter(3)
  %x = bf16[16384,2048]{1,0} parameter(4)
  %wg = bf16[128,2048,512]{2,1,0} parameter(5)
  %wu = bf16[128,2048,512]{2,1,0} parameter(6)
  %wd = bf16[128,512,2048]{2,1,0} parameter(7)
  ROOT %y = bf16[16384,2048]{1,0} custom-call(%o, %s, %z, %c, %x, %wg, %wu, %wd), custom_call_target="tpu_custom_call", operand_layout_constraints={s32[128]{0}, s32[128]{0}, s32[128]{0}, s32[1]{0}, bf16[16384,2048]{1,0}, bf16[128,2048,512]{2,1,0}, bf16[128,2048,512]{2,1,0}, bf16[128,512,2048]{2,1,0}}, backend_config={"cost_estimate":{"flops":"103079215104","bytes_accessed":"939524096"}}, metadata={op_name="jit(step)/moe/grouped_ffn/pallas_call"}
}
"""


def test_planner_charges_grouped_ffn_at_the_chips_measured_mxu_share() -> None:
    """kernels/grouped_ffn's declared flops are charged at the chip's measured share of the MXU peak for its rows
    per expert (chips.ChipPeaks.grouped_ffn_mxu_fraction); without the curve at the peak."""
    from sglang_tpu_qwen.tools.plan.chips import CHIPS
    from sglang_tpu_qwen.tools.plan.programs import traffic

    (op,) = [o for o in program_traffic(GROUPED_FFN) if o.opcode == "custom-call"]
    assert op.rows_per_group == 16384 / 128 and op.flops == 6 * 16384 * 2048 * 512 and op.dot_flops == 0
    bw, peak = 1e15, 1e12  # bytes free: the flops bound
    assert traffic(GROUPED_FFN, bw, peak)["serial_s"] == pytest.approx(op.flops / peak)
    charged = traffic(GROUPED_FFN, bw, peak, ragged_dot_mxu_fraction=lambda rows: 1.0,
                      grouped_ffn_mxu_fraction=lambda rows: 0.25 if rows == 128 else 1.0)
    assert charged["serial_s"] == pytest.approx(op.flops / (0.25 * peak))
    assert charged["declared_flops"] == op.flops
    v5e = CHIPS["v5e"]
    assert "measured" in v5e.grouped_ffn_source and v5e.grouped_ffn_mxu_fraction(128) == 0.316
    assert v5e.grouped_ffn_mxu_fraction(1e6) == v5e.grouped_ffn_mxu_points[-1][1]
    assert CHIPS["tpu7x"].grouped_ffn_mxu_fraction(128) == 1.0


def test_instruction_table_names_every_branch():
    """The traffic counts a conditional's cheapest branch, but a profile may run the other (the MTP commit's
    greedy sampling): the table that names a profile's ops holds every branch's instructions."""
    table = instruction_table(HLO)
    assert {"n", "big", "r", "sel", "loop", "f", "k"} <= set(table)
    assert table["big"][0] == "broadcast" and table["n"][0] == "negate"
    assert not any(t.name in ("big", "r") for t in program_traffic(HLO))  # the dear branch is not charged
