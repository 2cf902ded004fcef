"""Eviction policies, one per module, registered by name (kvpop.policies.registry).

A new policy: one module with a dataclass subclass of `EvictionPolicy`, added to `POLICIES`; the
test matrix in tests/policies/test_policies.py picks it up and demands a constructed eviction case for it.
"""

from kvpop.policies.base import EvictionPolicy
from kvpop.policies.registry import (
    POLICIES, load_policy_assets, make_policy, policy_defaults, policy_options, policy_settings, prepare_policies,
)

__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "load_policy_assets",
    "make_policy",
    "policy_defaults",
    "policy_options",
    "policy_settings",
    "prepare_policies",
]
