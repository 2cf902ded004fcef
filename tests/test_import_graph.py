"""The project's modules import each other in one direction: no cycle among the modules of kvpop/,
export/ and client/, counting every import (top level, inside functions, and under TYPE_CHECKING),
and none among kvpop's subpackages (cache, policies, sessions, engine, serving...)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvpop": ROOT / "kvpop", "export": ROOT / "export", "kvpop_client": ROOT / "client" / "kvpop_client"}


def module_files() -> dict[str, Path]:
    modules = {}
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


def package_of(module: str) -> str:
    """kvpop.cache.manager -> kvpop.cache; kvpop.decoder -> kvpop.decoder (a top-level module is its own node)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_module_imports_itself_back():
    assert cycles(graph()) == []


def test_no_subpackage_imports_itself_back():
    packages: dict[str, set[str]] = {}
    for module, targets in graph().items():
        if not module.startswith("kvpop."):
            continue
        source = package_of(module)
        packages.setdefault(source, set()).update(package_of(t) for t in targets if t.startswith("kvpop.") and package_of(t) != source)
    assert cycles(packages) == []


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
