"""The project's code imports in one direction: no cycle among its modules, and none among its packages at
any depth (kvpop <-> kvpop_eval, kvpop.cache <-> kvpop.engine, kvpop.serving.engine_model <-> kvpop.serving.process.tritonserver
...), counting every import (top level, inside functions, and under TYPE_CHECKING). Every Python package of the
repository is in the graph: the runtime, the offline packages, the client, the load tests, deploy and the two
Triton models."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import name -> directory. deploy/ is a namespace package (`python -m deploy.load_time`).
PACKAGES = {
    "kvpop": ROOT / "kvpop",
    "kvpop_tasks": ROOT / "kvpop_tasks",
    "kvpop_train": ROOT / "kvpop_train",
    "export": ROOT / "export",
    "kvpop_eval": ROOT / "kvpop_eval",
    "kvpop_client": ROOT / "client" / "kvpop_client",
    "loadtest": ROOT / "loadtest",
    "deploy": ROOT / "deploy",
}
TRITON_MODELS = {f"model_repository.{path.parts[-3]}": path for path in ROOT.glob("model_repository/*/1/model.py")}
NOT_PACKAGES = {"tests", "build", "run", "model_repository", "models", "scorers", "docs", "requirements"}


def module_files() -> dict[str, Path]:
    modules = dict(TRITON_MODELS)
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = [package, *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports (a `from package import name` counts the submodule if it
    is one, else the package)."""
    targets = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def graph() -> dict[str, set[str]]:
    modules = module_files()
    edges = {module: imported(module, path, modules) for module, path in modules.items()}
    # A package's __init__ re-exporting its own submodules is not a dependency of those submodules on it.
    return {module: {target for target in targets if not module.startswith(target + ".")} for module, targets in edges.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def at_depth(module: str, depth: int) -> str:
    """The node a module counts as when packages are looked at `depth` names deep: kvpop.cache.manager at
    depth 2 is kvpop.cache; a shallower module is its own node (kvpop.decoder at depth 3)."""
    return ".".join(module.split(".")[:depth])


def package_graph(edges: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in edges.items():
        source = at_depth(module, depth)
        packages.setdefault(source, set()).update(at_depth(t, depth) for t in targets if at_depth(t, depth) != source)
    return packages


def test_every_python_package_of_the_repository_is_in_the_graph():
    folders = {path.relative_to(ROOT).parts[0] for path in ROOT.glob("*/**/*.py")} - NOT_PACKAGES
    folders = {folder for folder in folders if not folder.startswith(".")}
    assert folders <= {directory.relative_to(ROOT).parts[0] for directory in PACKAGES.values()}, folders
    assert set(TRITON_MODELS) == {"model_repository.kvpop_engine", "model_repository.kvpop_service"}


def test_no_module_imports_itself_back():
    assert cycles(graph()) == []


def test_no_package_imports_itself_back_at_any_depth():
    edges = graph()
    deepest = max(module.count(".") for module in edges) + 1
    for depth in range(1, deepest + 1):
        assert cycles(package_graph(edges, depth)) == [], f"packages {depth} names deep"


def test_the_offline_packages_import_in_one_direction():
    """kvpop_tasks <- kvpop_train <- export <- kvpop_eval; the runtime imports none of them."""
    top = package_graph(graph(), 1)
    order = ["kvpop", "kvpop_tasks", "kvpop_train", "export", "kvpop_eval"]
    for position, package in enumerate(order):
        assert not top.get(package, set()) & set(order[position + 1:]), (package, top.get(package))


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles(package_graph({"p.x.m": {"p.y.n"}, "p.y.n": {"p.x.k"}, "p.x.k": set()}, 2)) == [["p.x", "p.y"]]
