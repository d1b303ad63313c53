"""The package's folders import downward only, and no two folders import each other (docs/internals.md).

Parses every module of sglang_tpu_qwen with `ast` (nothing is imported) and checks each
`import sglang_tpu_qwen...` / `from sglang_tpu_qwen... import ...` statement, including those inside
functions and under TYPE_CHECKING, against LAYERS. A module belongs to the folder that holds it: the unit
of this test is the folder (a package directory), never a single module. Relative imports are not used.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sglang_tpu_qwen"

# Top to bottom: a folder may import from its own folder or any folder on a lower line, never from a folder
# above it; folders on one line do not import each other. "" is the package root (the entry points).
LAYERS: list[tuple[str, ...]] = [
    ("",),  # entry points: launch_server, the bench_* shims
    ("bench",),  # benchmarks (a measured step beside the planner's plan of it: bench/decode_step.py)
    ("tools.plan",),  # the planner (deviceless AOT compile, its chip, routing and collective models)
    ("tools",),  # HLO traffic, weight manifests
    ("server", "disagg"),  # HTTP: FastAPI app, OpenAI routes, SSE; PD roles, composed onto an engine by the launcher
    ("multimodal",),  # image inputs: references to bytes, decoding, preprocessing, prompt pad expansion
    ("engine",),  # Engine: the in-process API
    ("engine.scheduler",),  # scheduler, policy, ScheduleBatch, output processor, failures, prefix cache
    ("engine.observability",),  # metrics, health, profiler
    ("engine.io",),  # requests, sampling params, engine errors
    ("engine.runner",),  # ModelRunner: program table, device state, step executor, sampling programs
    ("embedded",),  # the embedded default checkpoint (built from code)
    ("grammar",),  # constrained decoding (per-request matchers, token bitmasks)
    ("memory", "radix_cache"),  # id pools, GDN slot operations, host snapshots; the radix tree
    ("parallel",),  # the model over a mesh: DP attention, EP MoE, sharding, collectives
    ("model.vision",),  # the vision tower: config, weights, host-side grid arrays, the tower's math
    ("model",),  # Qwen3.5 config, layers, the one forward, weight loading
    ("args",),  # ServerArgs (names of the chat parsers come from parsers/; page-size rules from kernels/)
    ("kernels",),  # the backend per layer kind and platform (dispatch): its kernel and its pool layout
    ("quant",),  # FP8 block-quantised weight types
    # Pallas kernels + jnp references
    ("kernels.fp8_matmul", "kernels.gdn", "kernels.greedy_head", "kernels.grouped_ffn",
     "kernels.ragged_paged_attention"),
    ("parsers",),  # reasoning and tool-call parsers
    ("tokenizer",),
    ("utils",),  # exception types, shape helpers, process settings: any folder may use them
]


def _folder_of(module: str, is_package: bool) -> str:
    parts = module.split(".") if module else []
    return ".".join(parts if is_package else parts[:-1])


def _layer_of(folder: str) -> int:
    for i, folders in enumerate(LAYERS):
        if folder in folders:
            return i
    raise AssertionError(f"folder {folder!r} is in no layer: add it to LAYERS")


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, whether it is a package's __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """Modules of the package imported by the file at path (a `from m import x` of submodule m.x counts x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def folder_graph() -> dict[str, set[str]]:
    """folder -> the other folders its modules import (a package importing only its own parent is dropped:
    Python imports every parent package implicitly)."""
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        src = _folder_of(mod, is_pkg)
        deps = graph.setdefault(src, set())
        for dep in _imports(path, known):
            dst = _folder_of(dep, mods[dep][1])
            if dst != src and not (mods[dep][1] and src.startswith(dst + ".") if dst else False):
                deps.add(dst)
    return graph


def test_every_folder_has_a_layer() -> None:
    for folder in folder_graph():
        _layer_of(folder)


def test_folders_import_down() -> None:
    upward = [f"{a or '(root)'} (layer {_layer_of(a)}) imports {b or '(root)'} (layer {_layer_of(b)})"
              for a, deps in folder_graph().items() for b in sorted(deps) if _layer_of(b) <= _layer_of(a)]
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_no_folder_cycles() -> None:
    """No folder imports a folder that imports it back, directly or through others."""
    graph = folder_graph()
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
    assert not cycles, "folder cycles:\n" + "\n".join(cycles)
