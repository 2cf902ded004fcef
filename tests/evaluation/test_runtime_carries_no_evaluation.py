"""The installed runtime package and the image carry the runtime only: no kvpop_eval, kvpop_train, tests."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
DEV_PACKAGES = ("kvpop_eval", "kvpop_train", "tests", "export")


def test_pyproject_packages_the_runtime_only():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(ROOT), include=include)
    assert "kvpop" in packages and "kvpop.serving" in packages
    assert all(name == "kvpop" or name.startswith("kvpop.") for name in packages), packages


def test_the_image_copies_the_runtime_only():
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    sources = {word for line in dockerfile.splitlines() if line.startswith("COPY ") for word in line.split()[1:-1]}
    assert "kvpop" in sources
    assert not sources & set(DEV_PACKAGES), sources


def test_no_runtime_module_imports_evaluation_or_training():
    offenders = []
    for path in (ROOT / "kvpop").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in names
                          if re.match(r"(kvpop_eval|kvpop_train)(\.|$)", name)]
    assert not offenders, offenders
