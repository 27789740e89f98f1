"""The import graph: no cycles between kvflow's packages nor between any two of its modules, each layer imports only
layers below it, and inside the server each surface imports only the shared tiers below it, never another surface
(docs/architecture.md draws the same picture). Reads the source with `ast`; imports nothing."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvflow"

# bottom to top; a unit may import its own layer and those below it
LAYERS = [
    # __init__: lazy re-exports
    {"__init__", "errors", "config", "platform", "sampling_params", "pooling_params", "structured_output",
     "speculative_config", "lora_request", "beam_search"},
    {"distributed", "request", "spec_decode"},
    {"kernels"},                # the native CPU backend: C kernels, their build, torch ops, weight formats, the plan
    {"layers", "models"},
    {"runner"},
    {"executor"},
    {"core"},
    {"tokenizer", "detokenizer", "metrics", "outputs", "request_log", "scoring"},
    {"output_processor", "engine_process", "engine_router"},
    {"llm", "async_engine"},
    {"server", "bench"},
    {"ray"},
    {"cli"},
]


def unit_of(module: str) -> str | None:
    """kvflow.core.scheduler -> core; kvflow.llm -> llm; kvflow -> __init__."""
    parts = module.split(".")
    if parts[0] != "kvflow":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")


def imported_modules(path: Path) -> set[str]:
    """The kvflow modules a file imports (at its top or inside a function), each as the module it names:
    `from kvflow.a import b` is kvflow.a.b when b is a module, else kvflow.a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            names = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] == "kvflow")
    return found


def is_module(name: str) -> bool:
    rel = ROOT.parent.joinpath(*name.split("."))
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


def module_graph() -> dict[str, set[str]]:
    """Every module of kvflow -> the kvflow modules it imports."""
    return {module_name(path): imported_modules(path) - {module_name(path)} for path in ROOT.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Between units (a package or a top-level module of kvflow)."""
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        src = unit_of(module)
        graph.setdefault(src, set()).update(dst for dst in map(unit_of, targets) if dst is not None and dst != src)
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


# inside kvflow/server, bottom to top: the shared pieces, the serving seam every surface adapts onto, the surfaces
# (a package per API, and the operator's view), and the modules that mount and start them
SERVER_TIERS = [
    {"common"},
    {"serving"},
    {"openai", "embeddings", "score", "responses", "messages", "batch", "observe"},
    {"app", "cli", "run_batch", "testing", "__init__"},
]
SURFACES = SERVER_TIERS[2]


def server_part(module: str) -> str | None:
    """kvflow.server.batch.worker -> batch; kvflow.server.app -> app; kvflow.server -> __init__."""
    parts = module.split(".")
    if parts[:2] != ["kvflow", "server"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def test_no_import_cycles_between_modules():
    """No two modules import each other, even through a chain, even by imports inside functions."""
    assert find_cycle(module_graph()) is None


def test_server_surfaces_import_only_the_tiers_below():
    tier = {part: i for i, parts in enumerate(SERVER_TIERS) for part in parts}
    server_modules = {m: t for m, t in module_graph().items() if server_part(m) is not None}
    assert {server_part(m) for m in server_modules} <= set(tier), \
        f"server parts missing from SERVER_TIERS: {({server_part(m) for m in server_modules}) - set(tier)}"
    wrong = []
    for module, targets in server_modules.items():
        src = server_part(module)
        for dst in filter(None, map(server_part, targets)):
            if dst == src:
                continue
            if tier[dst] > tier[src] or (src in SURFACES and dst in SURFACES):
                wrong.append((module, dst))
    assert not wrong, f"server imports that reach a surface beside or a tier above: {sorted(wrong)}"


def test_the_checker_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def model_families() -> set[str]:
    """The modules of kvflow.models that define a model family (a `...ForCausalLM` class)."""
    return {module_name(path) for path in (ROOT / "models").glob("*.py")
            if any(isinstance(node, ast.ClassDef) and node.name.endswith("ForCausalLM")
                   for node in ast.walk(ast.parse(path.read_text())))}


def test_runner_imports_no_model_family():
    """Each family describes its own layers (`native_decoder()`); the runner never knows a family by type."""
    families = model_families()
    assert {"kvflow.models.llama", "kvflow.models.gemma3", "kvflow.models.moe"} <= families
    reached = {(m, t) for m, targets in module_graph().items() if unit_of(m) == "runner" for t in targets
               if t in families}
    assert not reached, f"runner modules importing a model family: {sorted(reached)}"
