"""The package's imports point down its layers, and no module imports itself back (no cycles).

Parses every module of sglang_tpu_qwen with `ast` (nothing is imported) and checks each
`import sglang_tpu_qwen...` / `from sglang_tpu_qwen... import ...` statement, including those inside
functions and under TYPE_CHECKING, against LAYERS. Relative imports are not used in the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sglang_tpu_qwen"

# Top to bottom; a module may import from its own layer or any layer below, never above. A module's layer
# is that of the longest prefix listed (module paths relative to sglang_tpu_qwen, "" = the package).
LAYERS: list[tuple[str, ...]] = [
    # entry points: CLIs, benchmarks, the planner, the colocated PD launcher
    ("", "launch_server", "bench_offline_throughput", "bench_serving", "bench", "plan", "disagg.colocated"),
    ("server",),  # HTTP: FastAPI app, OpenAI API, error mapping
    ("engine.engine",),  # the in-process API (sgl.Engine shape); wires the PD role into the scheduler
    ("disagg",),  # prefill/decode roles: the hooks of engine/scheduler_role.py
    ("engine",),  # scheduler, policy, batch, output processor, model runner, requests
    ("grammar",),  # constrained decoding (per-request matchers, token bitmasks)
    ("memory", "radix_cache"),  # id pools, GDN slot operations, host snapshots, the radix tree
    # the model's layers composed over a mesh; the kernels' pure-jnp oracles written with the model's math
    ("parallel.sharded_forward", "parallel.scan_forward", "parallel.expert_parallel",
     "kernels.gdn.reference", "kernels.ragged_paged_attention.reference"),
    ("model",),  # Qwen3.5-MoE config, weights, forward
    ("kernels", "parallel"),  # Pallas kernels and their dispatch; mesh, sharding, FP8 leaves
    ("server_args",),  # flags (names of the chat parsers come from parsers/)
    ("parsers",),  # reasoning and tool-call parsers
    ("tokenizer",),
    ("errors", "utils", "host_allocator"),  # exception types, small helpers, process settings: any layer may use
]


def _layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".") or p == "") and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(path: Path, known: set[str], runtime_only: bool = False) -> set[str]:
    """Modules of the package imported by the file at path (a `from m import x` of submodule m.x counts x).

    runtime_only: leave out imports under `if TYPE_CHECKING:`.
    """
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name == "sglang_tpu_qwen" or name.startswith("sglang_tpu_qwen."):
                mod = name.removeprefix("sglang_tpu_qwen").removeprefix(".")
                if mod in known:
                    found.add(mod)
    return found


def _graph(runtime_only: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, known, runtime_only) - {m} for m, p in mods.items()}


def test_every_module_has_a_layer() -> None:
    for m in _modules():
        _layer_of(m)


def test_imports_point_down() -> None:
    upward = [f"{a} (layer {_layer_of(a)}) imports {b} (layer {_layer_of(b)})"
              for a, deps in _graph().items() for b in sorted(deps) if _layer_of(b) < _layer_of(a)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    """No module imports (at run time) a module that imports it back, directly or through others."""
    graph = _graph(runtime_only=True)
    # A package's __init__ importing its own submodules is not a cycle of meaning; the parent package of
    # every module is imported implicitly, so drop parent -> child edges.
    graph = {a: {b for b in deps if not b.startswith(a + ".") and a != ""} for a, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d):], d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
