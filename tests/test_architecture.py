"""The package import graph: no cycles between kvflow's packages, and each layer imports only layers below
it (docs/architecture.md draws the same picture). Reads the source with `ast`; imports nothing."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvflow"

# bottom to top; a unit may import its own layer and those below it
LAYERS = [
    # __init__: lazy re-exports
    {"__init__", "errors", "config", "platform", "sampling_params", "pooling_params", "structured_output",
     "speculative_config", "lora_request"},
    {"distributed", "request", "spec_decode"},
    {"layers", "models"},
    {"runner"},
    {"executor"},
    {"core"},
    {"tokenizer", "detokenizer", "metrics", "outputs", "request_log"},
    {"output_processor", "engine_process", "engine_router"},
    {"llm", "async_engine"},
    {"server", "bench"},
    {"cli"},
]


def unit_of(module: str) -> str | None:
    """kvflow.core.scheduler -> core; kvflow.llm -> llm; kvflow -> __init__."""
    parts = module.split(".")
    if parts[0] != "kvflow":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        src = unit_of(module)
        targets = graph.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "kvflow":    # submodules, or the package
                names = [f"kvflow.{a.name}" if (ROOT / a.name).exists() or (ROOT / f"{a.name}.py").exists()
                         else "kvflow" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                dst = unit_of(name)
                if dst is not None and dst != src:
                    targets.add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if state.get(v) is None and (cycle := visit(v)):
                return cycle
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if state.get(u) is None and (cycle := visit(u)):
            return cycle
    return None


def test_no_import_cycles_between_packages():
    assert find_cycle(import_graph()) is None


def test_each_layer_imports_only_layers_below():
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    graph = import_graph()
    assert set(graph) <= set(level), f"units missing from LAYERS: {set(graph) - set(level)}"
    upward = [(u, v) for u, vs in graph.items() for v in vs if level[v] > level[u]]
    assert not upward, f"imports that reach up a layer: {sorted(upward)}"


def test_the_checker_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
