"""Per-instruction HBM traffic of a compiled XLA program, from its HLO text (the planner's excess list).

XLA's cost analysis gives one total ("bytes accessed"); to name what moves more bytes than it must, this
module walks the scheduled computations (the entry, while bodies times their known trip counts,
the cheapest branch of each conditional: the expected path, e.g. the expert-parallel fast path or
sampling with its optional features off) and charges each top-level instruction (a fusion, a custom call, a copy, a
collective ...) the bytes of its operands and its result, with the same two corrections XLA's own
analysis makes: an operand that a fusion only slices (``dynamic-slice``, ``slice``, ``gather``) costs the
slices, and a fusion whose root updates a buffer in place (``dynamic-update-slice``, ``scatter``) costs the
update, not the buffer. Custom calls (Pallas kernels) are charged the traffic they declare
(``pl.CostEstimate``, as XLA does), else the caller's figure, else their operand and result bytes. Work XLA
offloads to the SparseCore (collectives, relayouts, row gathers) is an async ``call-start`` /
``call-done`` pair, charged once at the start (what it reads and writes; a gather the rows it gathers).
Compiled TPU HLO names operands without their shapes; each takes the shape of the instruction defining it.
Only HBM counts: a buffer XLA placed in VMEM (layout ``S(1)``) is read and written on chip.
The figures are an estimate for ranking, not a replacement for the total.

``program_collectives`` lists the program's collectives (those offloaded to the SparseCore at their call
sites) with their replica groups, bytes and executions, and the work the schedule places between an
asynchronous one's start and its done: what the planner charges over the ICI (tools/plan/collectives.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from sglang_tpu_qwen.kernels.grouped_ffn import SCOPE as GROUPED_FFN  # op_name scope of its pallas_call

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "s4": 0.5, "u4": 0.5,
}  # fmt: skip
# dtype[dims] and its layout, if printed ({minor_to_major:tiling...S(memory space)}).
_SHAPE = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\](\{[^}]*\})?")
_OFF_HBM = re.compile(r"S\([1-9]\d*\)")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "iota", "copy-done", "all-gather-done", "all-reduce-done",
    "collective-permute-done", "async-done", "send-done", "recv-done", "opt-barrier", "slice-done", "call-done",
})  # fmt: skip
_SLICING = ("dynamic-slice", "slice", "gather")
_IN_PLACE = ("dynamic-update-slice", "scatter")


def shape_bytes(text: str, hbm_only: bool = True) -> float:
    """Bytes of every ``dtype[dims]`` in ``text`` (a shape or a tuple of shapes). With ``hbm_only`` a shape
    whose layout names a memory space other than 0 (``S(1)``: VMEM, where XLA's memory-space assignment puts
    buffers it prefetches or keeps on chip; ``S(2)``: SMEM) is not HBM traffic and counts 0."""
    return sum(_DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x)
               for d, dims, layout in _SHAPE.findall(text) if not (hbm_only and _OFF_HBM.search(layout)))


@dataclasses.dataclass
class _Instr:
    name: str
    opcode: str
    result: str
    operands: list[str]  # operand texts, "dtype[dims]{layout} %name"
    attrs: str
    root: bool


@dataclasses.dataclass
class OpTraffic:
    """One top-level instruction: ``bytes`` per execution, ``count`` executions per program run."""

    name: str
    opcode: str
    op_name: str
    bytes: float
    count: int
    flops: float = 0.0  # declared by a custom call (``pl.CostEstimate``); 0 for XLA's own instructions
    # A ``jax.lax.ragged_dot`` (which declares no flops): its ``2 M K N`` of lhs [M, K] x groups [G, K, N], and
    # its rows per group ``M / G``; kernels/grouped_ffn's call: its rows per expert (it declares its flops).
    dot_flops: float = 0.0
    rows_per_group: float = 0.0

    @property
    def total(self) -> float:
        return self.bytes * self.count


def _split_operands(s: str) -> tuple[list[str], str]:
    """``"a, b(c, d), e), attrs"`` -> (["a", "b(c, d)", "e"], "attrs"): operands up to the closing paren."""
    depth, cur, out = 0, [], []
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                if "".join(cur).strip():
                    out.append("".join(cur).strip())
                return out, s[i + 1 :]
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    return out, ""


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """Computations (name -> instructions) and the entry's name. Each instruction's operand texts get their
    shapes: compiled TPU HLO prints operands as bare names (``fusion(%a, %b)``), so a bare name is given
    the result shape of the instruction that defines it (names are unique in a module)."""
    comps: dict[str, list[_Instr]] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m and not line.startswith((" ", "\t")):
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if line.startswith("}"):  # also "}, execution_thread=..." (computations offloaded to the SparseCore)
            cur = None
            continue
        m = _INSTR.match(line)
        if m:
            operands, attrs = _split_operands(m.group(5))
            comps[cur].append(_Instr(m.group(2), m.group(4), m.group(3), operands, attrs, bool(m.group(1))))
    results = {ins.name: ins.result for instrs in comps.values() for ins in instrs}
    for instrs in comps.values():
        for ins in instrs:
            ins.operands = [_typed(op, results) for op in ins.operands]
    return comps, entry


def _typed(operand: str, results: dict[str, str]) -> str:
    """``"%name"`` -> ``"dtype[dims]{layout} %name"`` from the defining instruction; typed operands as given."""
    if not operand.startswith("%"):
        return operand
    name = operand[1:].strip()
    return f"{results[name]} {operand}" if name in results else operand


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(key + r"=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _params(fused: list[_Instr]) -> dict[int, str]:
    """Parameter number -> instruction name in a fused computation."""
    out: dict[int, str] = {}
    for f in fused:
        if f.opcode == "parameter":
            m = re.match(r"\s*(\d+)", f.operands[0] if f.operands else "")
            if m:
                out[int(m.group(1))] = f.name
    return out


def _refs(ins: _Instr) -> list[str]:
    return [op.split("%")[-1].strip() if "%" in op else op.strip() for op in ins.operands]


_PASS_THROUGH = ("copy", "bitcast", "reshape", "transpose")


def _is_copy_fusion(ins: _Instr, comps: dict[str, list[_Instr]]) -> bool:
    """A nested fusion of one operand whose root only moves it (a relayout: XLA's ``copy_fusion``)."""
    if ins.opcode != "fusion" or len(ins.operands) != 1:
        return False
    inner = comps.get(_attr(ins.attrs, "calls") or "", [])
    root = next((f for f in inner if f.root), None)
    return root is not None and root.opcode in _PASS_THROUGH and all(
        f.opcode in (*_PASS_THROUGH, "parameter") for f in inner)


def _sliced_read(pname: str, fused: list[_Instr], comps: dict[str, list[_Instr]], depth: int = 4) -> float | None:
    """Bytes a fused computation reads of its parameter ``pname`` when every use only slices it (directly,
    or as the operand of a nested fusion that only slices it: XLA nests the slice of a stacked layer's
    weights in the fusion of the dot using it); None when some use reads the whole operand."""
    uses = [f for f in fused if pname in _refs(f)]
    if not uses:
        return None
    total = 0.0
    for u in uses:
        refs = _refs(u)
        if refs.count(pname) != 1:
            return None
        if u.opcode in _SLICING and refs[0] == pname:
            total += shape_bytes(u.result)
            continue
        if depth and (u.opcode in _PASS_THROUGH or _is_copy_fusion(u, comps)):
            # A relayout or bitcast inside the fusion is computed only where its result is read.
            read = _sliced_read(u.name, fused, comps, depth - 1)
            if read is None:
                return None
            total += read
            continue
        inner = comps.get(_attr(u.attrs, "calls") or "", []) if u.opcode == "fusion" and depth else []
        inner_param = _params(inner).get(refs.index(pname))
        read = _sliced_read(inner_param, inner, comps, depth - 1) if inner_param else None
        if read is None:
            return None
        total += read
    return total


def _fusion_bytes(ins: _Instr, fused: list[_Instr], comps: dict[str, list[_Instr]]) -> float:
    """Bytes of a fusion: operands (sliced ones: their slices) + result (in-place: the update)."""
    params = _params(fused)
    root = next((f for f in fused if f.root), None)
    in_place_buf = None
    if root is not None and root.opcode in _IN_PLACE and root.operands:
        in_place_buf = _refs(root)[0]
    total = 0.0
    for i, op in enumerate(ins.operands):
        pname = params.get(i)
        if pname is not None and pname == in_place_buf:
            continue  # the buffer updated in place: only the update moves
        sliced = _sliced_read(pname, fused, comps) if pname is not None else None
        total += sliced if sliced is not None else shape_bytes(op.split("%")[0])
    if in_place_buf is not None and root is not None and len(root.operands) > 1:
        upd = root.operands[1] if root.opcode == "dynamic-update-slice" else root.operands[-1]
        name = upd.split("%")[-1].strip()
        src = next((f for f in fused if f.name == name), None)
        total += shape_bytes(src.result) if src is not None else shape_bytes(upd.split("%")[0])
    else:
        total += shape_bytes(ins.result)
    return total


def _trip_count(ins: _Instr, comps: dict[str, list[_Instr]]) -> int:
    """``known_trip_count`` of a while, else the largest integer constant its condition compares with
    (``jax.lax.scan`` / ``fori_loop`` count from 0 to N), else 1."""
    m = re.search(r'known_trip_count[^0-9]*"n":"?(\d+)', ins.attrs)
    if m:
        return int(m.group(1))
    consts = [int(c) for f in comps.get(_attr(ins.attrs, "condition") or "", []) if f.opcode == "constant"
              for c in re.findall(r"^\s*(-?\d+)\s*$", f.operands[0] if f.operands else "")]
    return max([c for c in consts if c > 0], default=1)


def _instr_bytes(ins: _Instr, comps: dict[str, list[_Instr]]) -> float:
    if ins.opcode in _FREE:
        return 0.0
    if ins.opcode == "fusion":
        return _fusion_bytes(ins, comps.get(_attr(ins.attrs, "calls") or "", []), comps)
    if ins.opcode == "custom-call" and (est := re.search(r'"bytes_accessed":"?(\d+)', ins.attrs)):
        return float(est.group(1))
    if ins.opcode in ("slice", "dynamic-slice", "gather"):
        return 2 * shape_bytes(ins.result)
    if ins.opcode == "call-start":
        return _async_call_bytes(ins, comps)
    if ins.opcode in ("collective-permute-start", "all-gather-start"):
        return shape_bytes(ins.result)  # (operand, destination, contexts): read once, written once
    if ins.opcode in ("slice-start", "copy-start"):
        parts, _ = _split_operands(ins.result.strip()[1:])
        if len(parts) < 2:
            return 0.0
        if ins.opcode == "copy-start":  # (destination, source, context): each side costs where it is HBM
            return shape_bytes(parts[0]) + shape_bytes(parts[1])
        # ((operand), destination, context): the destination's bytes are read from the operand (in HBM; the
        # rest of it does not move) and written (free into VMEM, where XLA puts its prefetches).
        return shape_bytes(parts[1], hbm_only=False) + shape_bytes(parts[1])
    return sum(shape_bytes(op.split("%")[0]) for op in ins.operands) + shape_bytes(ins.result)


def _async_call_bytes(ins: _Instr, comps: dict[str, list[_Instr]]) -> float:
    """An async call (work offloaded to the SparseCore: collectives, relayouts, gathers) is charged at its
    start; its ``call-done`` only waits. The start's result lists the operands it reads and the outputs it
    writes, ``((operands...), outputs..., context)``. A gather reads only the rows it gathers: its source
    (operand 0) costs the output's bytes, not the whole array."""
    parts, _ = _split_operands(ins.result.strip()[1:])
    if not parts:
        return shape_bytes(ins.result)
    inputs, _ = _split_operands(parts[0].strip()[1:]) if parts[0].strip().startswith("(") else ([parts[0]], "")
    outputs = sum(shape_bytes(p) for p in parts[1:])
    if _gathers(_attr(ins.attrs, "to_apply") or "", comps) and inputs:
        return outputs + sum(shape_bytes(p) for p in inputs[1:]) + outputs
    return sum(shape_bytes(p) for p in inputs) + outputs


def _gathers(name: str, comps: dict[str, list[_Instr]], depth: int = 4) -> bool:
    """Computation ``name``, or one it calls, gathers rows (a ``gather``, or XLA's SparseCore gather offload)."""
    for c in comps.get(name, []):
        if c.opcode == "gather" or "gather_offload" in c.name:
            return True
        callee = _attr(c.attrs, "to_apply") or _attr(c.attrs, "calls")
        if depth and callee and _gathers(callee, comps, depth - 1):
            return True
    return False


def _local_bytes(name: str, comps: dict[str, list[_Instr]]) -> float:
    """Bytes of one computation's own top-level instructions plus those of its loops (times their trip
    counts) and the cheapest branch of its conditionals."""
    total = 0.0
    for ins in comps.get(name, []):
        total += _instr_bytes(ins, comps)
        if ins.opcode == "while":
            body = _attr(ins.attrs, "body")
            total += _trip_count(ins, comps) * (_local_bytes(body, comps) if body else 0.0)
        elif ins.opcode == "conditional":
            names = re.findall(r"%([\w.\-]+)", ins.attrs.split("branch_computations=")[-1].split("}")[0]) \
                if "branch_computations=" in ins.attrs else []
            if names:
                total += min(_local_bytes(n, comps) for n in names)
    return total


def _walk(comps: dict[str, list[_Instr]], entry: str, all_branches: bool = False) -> tuple[dict[str, int], list[str]]:
    """Executions per program run of each computation reached from ``entry`` (while bodies times their trip
    counts, the cheapest branch of a conditional, or with ``all_branches`` every branch once, called
    computations), and the order they were reached in. Computations offloaded to the SparseCore are not walked:
    their call sites are charged."""
    counts: dict[str, int] = defaultdict(int)
    counts[entry] = 1
    order = [entry]
    seen = {entry}
    i = 0
    while i < len(order):
        c = order[i]
        i += 1
        for ins in comps.get(c, []):
            called: list[tuple[str, int]] = []
            if ins.opcode == "while":
                trips = _trip_count(ins, comps)
                for key in ("body", "condition"):
                    name = _attr(ins.attrs, key)
                    if name:
                        called.append((name, trips))
            elif ins.opcode == "conditional":
                names = re.findall(r"%([\w.\-]+)", ins.attrs.split("branch_computations=")[-1].split("}")[0]) \
                    if "branch_computations=" in ins.attrs else []
                names += [n for key in ("true_computation", "false_computation") if (n := _attr(ins.attrs, key))]
                if names and all_branches:
                    called += [(n, 1) for n in names]
                elif names:  # the cheapest branch: the expected path (fast paths, optional work skipped)
                    called.append((min(names, key=lambda n: _local_bytes(n, comps)), 1))
            elif ins.opcode == "call":
                name = _attr(ins.attrs, "to_apply")
                if name:
                    called.append((name, 1))
            for name, mult in called:
                counts[name] += counts[c] * mult
                if name not in seen and name in comps:
                    seen.add(name)
                    order.append(name)
    return counts, order


RAGGED_DOT = "ragged_dot_general"  # op_name of jax.lax.ragged_dot's custom call


def program_traffic(text: str, custom_call_bytes: dict[str, float] | None = None,
                    ragged_dot_fraction: float = 1.0) -> list[OpTraffic]:
    """Every top-level instruction of the compiled HLO ``text`` with its bytes and execution count.

    ``custom_call_bytes``: bytes per execution of custom calls whose ``op_name`` metadata contains the key
    (their operand sizes would count whole buffers a kernel only indexes, e.g. the KV cache).
    ``ragged_dot_fraction``: the share of a ``jax.lax.ragged_dot``'s expert weights (its largest operand) it
    reads: the TPU lowering skips groups with no rows (on the v5e, 8 decode rows of the 35B layout touching 57
    of 256 experts ran at 79% of HBM peak counted on those 57 alone: bench/grouped_matmul.py).
    """
    comps, entry = _parse(text)
    counts, order = _walk(comps, entry)
    out: list[OpTraffic] = []
    for c in order:
        for ins in comps.get(c, []):
            if ins.opcode in _FREE:
                continue
            m = re.search(r'op_name="([^"]*)"', ins.attrs)
            op_name = m.group(1) if m else ""
            if ins.opcode == "custom-call" and custom_call_bytes and any(k in op_name for k in custom_call_bytes):
                b = next(v for k, v in custom_call_bytes.items() if k in op_name)
            else:
                b = _instr_bytes(ins, comps)
            dot_flops = rows_per_group = 0.0
            if ins.opcode == "custom-call" and RAGGED_DOT in op_name:
                if ragged_dot_fraction < 1.0:
                    weights = max((shape_bytes(op.split("%")[0]) for op in ins.operands), default=0.0)
                    b -= (1.0 - ragged_dot_fraction) * weights
                dot_flops, rows_per_group = _ragged_dot_shape(ins)
            elif ins.opcode == "custom-call" and GROUPED_FFN in op_name:
                rows_per_group = _grouped_ffn_rows(ins)
            out.append(OpTraffic(ins.name, ins.opcode, op_name, b, counts[c], _declared_flops(ins), dot_flops,
                                 rows_per_group))
    return out


def instruction_table(text: str) -> dict[str, tuple[str, str]]:
    """Every instruction of the computations the compiled HLO ``text`` can run (the entry and what it reaches,
    every branch of a conditional: a profile may run the branch :func:`program_traffic` does not count, as the MTP
    commit's greedy sampling), free ones too (``while``, ``tuple``, ``copy-done``: a profile's host plane gives them
    self time): ``{name: (opcode, op_name metadata)}``."""
    comps, entry = _parse(text)
    _, order = _walk(comps, entry, all_branches=True)
    out: dict[str, tuple[str, str]] = {}
    for c in order:
        for ins in comps.get(c, []):
            m = re.search(r'op_name="([^"]*)"', ins.attrs)
            out[ins.name] = (ins.opcode, m.group(1) if m else "")
    return out


def _ragged_dot_shape(ins: _Instr) -> tuple[float, float]:
    """``(2 M K N, M / G)`` of a ragged dot custom call: result ``[M, N]``, its only 3-D operand the groups'
    ``[G, K, N]`` weights; ``(0, 0)`` where the shapes are not that."""
    result = _SHAPE.findall(ins.result)
    stacks = [dims for op in ins.operands for _, dims, _ in _SHAPE.findall(op.split("%")[0]) if dims.count(",") == 2]
    if len(result) != 1 or len(stacks) != 1 or result[0][1].count(",") != 1:
        return 0.0, 0.0
    m, n = (int(x) for x in result[0][1].split(","))
    g, k, n_w = (int(x) for x in stacks[0].split(","))
    return (2.0 * m * k * n, m / g) if n_w == n and g else (0.0, 0.0)


def _grouped_ffn_rows(ins: _Instr) -> float:
    """``M / E`` of kernels/grouped_ffn's custom call: its only 2-D operand the rows ``[M, H]``, its first 3-D
    operand the gate stack ``[E, H, I]``; 0 where the shapes are not that."""
    dims = [d for op in ins.operands for _, d, _ in _SHAPE.findall(op.split("%")[0])]
    rows = [int(d.split(",")[0]) for d in dims if d.count(",") == 1]
    stacks = [int(d.split(",")[0]) for d in dims if d.count(",") == 2]
    return rows[0] / stacks[0] if len(rows) == 1 and stacks and stacks[0] else 0.0


def _declared_flops(ins: _Instr) -> float:
    m = re.search(r'"flops":"?(\d+)', ins.attrs) if ins.opcode == "custom-call" else None
    return float(m.group(1)) if m else 0.0


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@dataclasses.dataclass
class Collective:
    """One collective of a compiled program, per execution: ``count`` executions per program run.

    ``kind``: one of :data:`COLLECTIVES`; ``groups``: its replica groups (global device ids, the mesh's
    flattened order), empty for a collective-permute (``pairs`` instead); ``in_bytes`` / ``out_bytes``: one
    device's operand and result (all memory spaces). ``is_async``: started and awaited apart (a SparseCore
    ``call-start`` / ``call-done`` or an ``*-start`` / ``*-done`` pair); ``overlap_bytes`` / ``overlap_flops``:
    HBM bytes and declared kernel flops of the work the schedule places between its start and its done
    (loops included, other collectives not), the compute it can hide behind; 0 for a synchronous one."""

    name: str
    kind: str
    groups: list[list[int]]
    pairs: list[tuple[int, int]]
    in_bytes: float
    out_bytes: float
    count: int
    is_async: bool
    overlap_bytes: float
    overlap_flops: float


def _replica_groups(attrs: str) -> list[list[int]]:
    """``replica_groups={{0,1},{2,3}}`` or the iota form ``[G,S]<=[dims]T(perm)`` -> lists of device ids."""
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if not m:
        return []
    g, size = int(m.group(1)), int(m.group(2))
    dims = [int(x) for x in m.group(3).split(",")]
    ids = list(range(math.prod(dims)))
    if m.group(4):  # transpose the iota of shape dims by perm, row-major
        perm = [int(x) for x in m.group(4).split(",")]
        strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
        tdims = [dims[p] for p in perm]
        ids = []
        for flat in range(math.prod(tdims)):
            idx, rem = [], flat
            for d in reversed(tdims):
                idx.append(rem % d)
                rem //= d
            idx.reverse()
            ids.append(sum(idx[j] * strides[perm[j]] for j in range(len(perm))))
    return [ids[i * size:(i + 1) * size] for i in range(g)]


def _pairs(attrs: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)", m.group(1) + "}")] if m else []


def _collective_of(ins: _Instr, comps: dict[str, list[_Instr]]) -> _Instr | None:
    """The collective instruction ``ins`` is or starts: itself (sync or ``*-start``), or the collective inside
    the computation a SparseCore ``call-start`` runs."""
    base = ins.opcode.removesuffix("-start")
    if base in COLLECTIVES:
        return ins
    if ins.opcode == "call-start":
        return next((f for f in comps.get(_attr(ins.attrs, "to_apply") or "", [])
                     if f.opcode.removesuffix("-start") in COLLECTIVES), None)
    return None


def program_collectives(text: str) -> list[Collective]:
    """Every collective the compiled HLO ``text`` runs (top level, loop bodies, offloaded to the SparseCore),
    with its groups, bytes, executions and the work scheduled between its start and its done."""
    comps, entry = _parse(text)
    counts, order = _walk(comps, entry)
    out: list[Collective] = []
    for c in order:
        instrs = comps.get(c, [])
        for i, ins in enumerate(instrs):
            coll = _collective_of(ins, comps)
            if coll is None or ins.opcode.endswith("-done"):
                continue
            kind = coll.opcode.removesuffix("-start")
            is_async = ins.opcode.endswith("-start")
            ob = of = 0.0
            if is_async:
                j = next((j for j in range(i + 1, len(instrs))
                          if instrs[j].opcode.endswith("-done") and ins.name in _refs(instrs[j])), len(instrs))
                for mid in instrs[i + 1:j]:
                    if _collective_of(mid, comps) is not None or mid.opcode.endswith("-done"):
                        continue
                    ob += _instr_bytes(mid, comps)
                    of += _declared_flops(mid)
                    if mid.opcode == "while" and (body := _attr(mid.attrs, "body")):
                        ob += _trip_count(mid, comps) * _local_bytes(body, comps)
            in_b = sum(shape_bytes(op.split("%")[0], hbm_only=False) for op in coll.operands
                       if "token[]" not in op)
            res = coll.result
            if coll is ins and is_async:  # an *-start's result is (operand, destination, ...): the destination
                parts, _ = _split_operands(res.strip()[1:])
                res = parts[1] if len(parts) > 1 else res
            out.append(Collective(ins.name, kind, _replica_groups(coll.attrs), _pairs(coll.attrs), in_b,
                                  shape_bytes(res, hbm_only=False), counts[c], is_async, ob, of))
    return out
