"""The package's imports run one way: no module imports itself back through others, and each layer imports only
the layers below it (README's "How the code is laid out"). Read from the source, function-local imports included
(they run too, only later); `if TYPE_CHECKING:` blocks excluded (they never run)."""

import ast
from pathlib import Path

import torch_hybrid_moe

ROOT = Path(torch_hybrid_moe.__file__).parent
PACKAGE = ROOT.name
# Bottom first; a module may import its own layer and the ones before it.
LAYERS = (
    ("errors", "cost_model", "ops"),
    ("policies", "profiling"),
    ("config",),
    ("runtime",),
    ("model_patches", "compile_passes"),
    ("loading", "gguf_checkpoint", "prepared", "traces", "tiny_models", "embedded", "generation"),
    ("simulator", "planning", "cli", "__main__"),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports, with the subpackages whose __init__ each import runs (not the root's,
    which Python runs before anything else)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        for node in ast.iter_child_nodes(stack.pop()):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
                module = ".".join(p for p in (base, node.module or "") if p)
                targets.update([module, *(f"{module}.{a.name}" for a in node.names)])
            stack.append(node)
    found = set()
    for target in targets:
        parts = target.split(".")
        for end in range(2, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                found.add(prefix)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_downwards():
    rank = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    graph = _graph()
    unplaced = {m.split(".")[1] for m in graph if m != PACKAGE} - set(rank)
    assert not unplaced, f"place {sorted(unplaced)} in LAYERS"
    upward = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m != PACKAGE
        for t in targets
        if rank[t.split(".")[1]] > rank[m.split(".")[1]]
    ]
    assert not upward, "imports against the layers: " + "; ".join(sorted(upward))


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The checks themselves, on made-up modules: they must be able to fail."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    source = tmp_path / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..config import C\n"
        "def f():\n    from ..runtime.registry import get_layer\n"
    )
    modules = {
        f"{PACKAGE}.ops.x": source,
        f"{PACKAGE}.config": ROOT,
        f"{PACKAGE}.runtime": ROOT,
        f"{PACKAGE}.runtime.registry": ROOT,
    }
    assert _imports(f"{PACKAGE}.ops.x", source, modules) == {f"{PACKAGE}.runtime", f"{PACKAGE}.runtime.registry"}
