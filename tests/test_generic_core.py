"""The generic core names no concrete eviction policy: the request and its cache configuration, the cache
manager, the engine, the sessions and the serving layer reach a policy only through the registry
(kvpop.policies, kvpop.policies.registry) and the `EvictionPolicy` contract (kvpop.policies.base). Checked on
every import (top level, in functions, under TYPE_CHECKING) with `ast`, as tests/test_import_graph.py does."""

from __future__ import annotations

import ast
import pickle
from dataclasses import fields
from pathlib import Path

KVPOP = Path(__file__).resolve().parents[1] / "kvpop"
GENERIC = ["request.py", "cache", "engine", "sessions", "serving", "openai_api"]
# What the core may import of kvpop.policies: the package (which re-exports the registry), the registry, the contract.
ALLOWED = {"kvpop.policies", "kvpop.policies.registry", "kvpop.policies.base"}


def policy_imports(path: Path) -> set[str]:
    """The kvpop.policies modules (and names imported from them) that `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("kvpop.policies")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvpop.policies"):
            found.add(node.module)
            # `from kvpop.policies import kvpop` names a concrete policy's module as well
            found |= {f"{node.module}.{alias.name}" for alias in node.names if (KVPOP.parent / node.module.replace(".", "/") / alias.name).exists()
                      or (KVPOP.parent / node.module.replace(".", "/") / f"{alias.name}.py").exists()}
    return found


def test_the_core_imports_no_concrete_policy():
    files = [path for entry in GENERIC for path in ((KVPOP / entry).rglob("*.py") if (KVPOP / entry).is_dir() else [KVPOP / entry])]
    assert len(files) > 20
    offenders = {str(path.relative_to(KVPOP.parent)): sorted(policy_imports(path) - ALLOWED) for path in files}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_cache_config_carries_the_policy_options_object_and_no_policy_field():
    from kvpop.policies.registry import options_type
    from kvpop.request import CacheConfig

    assert [field.name for field in fields(CacheConfig)] == ["policy", "budget", "compression", "options"]
    assert not hasattr(CacheConfig, "learned_scorer")
    config = CacheConfig(policy="kvpop", budget=16, options={"scorer": "mlstm", "window": 8, "seed": 3})
    assert isinstance(config.options, options_type("kvpop"))  # seed is the random policy's: dropped
    assert (config.options.scorer, config.options.window, config.options.sinks) == ("mlstm", 8, 4)
    assert pickle.loads(pickle.dumps(config)) == config  # a configuration crosses to a spawned process


def test_service_settings_name_no_policy():
    from kvpop.serving.kvpop_engine.config import ServiceConfig

    assert [field.name for field in fields(ServiceConfig) if field.name.startswith("kvpop")] == []
