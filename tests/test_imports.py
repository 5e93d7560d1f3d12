"""minscope's modules import each other without a cycle: what a module imports when it is
loaded (its module-level imports, `if TYPE_CHECKING:` blocks included: a cycle the interpreter
never runs is still one a reader walks) never leads back to it. Imports inside functions
(deferred, e.g. of a heavy optional package) are not counted."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minscope"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_time_imports(path: Path, modules: set[str], text: str | None = None) -> set[str]:
    """The package modules that loading `path` (its source: `text`, or the file's) imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, todo = set(), list(ast.parse(path.read_text() if text is None else text).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:        # `from . import x` imports the module x
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            todo += list(ast.iter_child_nodes(node))
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None."""
    state = {}                                   # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None
    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_an_import_under_type_checking_counts():
    text = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .toy_models import ToyModels\n"
    assert load_time_imports(PACKAGE / "toy_fidelity.py", {"minscope.toy_models"}, text) == {"minscope.toy_models"}


def test_the_package_has_no_import_cycle():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: load_time_imports(path, set(paths)) for name, path in paths.items()}
    assert graph["minscope.runner"] >= {"minscope.loop", "minscope.real_args", "minscope.real_models"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
