"""The policy registry: the one place that names every eviction policy.

Everything else speaks of a policy by its registered name and hands this module what belongs to it:
  - its options, one object per request (`policy_options`): a frozen dataclass of the policy's own
    dataclass fields (kvpress's habit: a policy's fields are its configuration), made once per policy;
  - its assets, loaded once per exported model (`load_policy_assets`: kvpop's learned scorers), which
    the engine keeps by policy name without looking inside;
  - its settings, a deployment's defaults for every request of that policy (config.pbtxt parameters
    named `<policy>_<setting>`, e.g. kvpop_scorer; `policy_settings`), which turn into options on a
    model's assets (`EvictionPolicy.Settings.options`).
So the request, the cache manager, the engine and the serving layer never name a concrete policy.
"""

from __future__ import annotations

from dataclasses import asdict, field, fields, is_dataclass, make_dataclass
from functools import cache
from pathlib import Path
from typing import Any, Mapping

from kvpop.policies.base import EvictionPolicy
from kvpop.policies.full import FullPolicy
from kvpop.policies.h2o import H2OPolicy
from kvpop.policies.keep_start import KeepStartPolicy
from kvpop.policies.kvpop import KVpopPolicy
from kvpop.policies.random import RandomPolicy
from kvpop.policies.snapkv import SnapKVPolicy
from kvpop.policies.streaming import StreamingPolicy
from kvpop.policies.tova import TOVAPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy
    for policy in (FullPolicy, StreamingPolicy, H2OPolicy, TOVAPolicy, RandomPolicy, KVpopPolicy, KeepStartPolicy, SnapKVPolicy)
}


def policy_class(name: str) -> type[EvictionPolicy]:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; registered: {', '.join(POLICIES)}")
    return POLICIES[name]


@cache
def options_type(name: str) -> type:
    """The frozen dataclass of policy `name`'s options: its init fields, with their defaults. An instance
    pickles as the policy's name and its values (a spawned process rebuilds it through the registry)."""
    policy = policy_class(name)
    specs = [(option.name, option.type, field(default=option.default)) for option in fields(policy) if option.init]

    def reduce(options: Any) -> tuple:
        return policy_options, (name, asdict(options))

    return make_dataclass(f"{policy.__name__}Options", specs, frozen=True, namespace={"__reduce__": reduce})


@cache
def _every_option() -> frozenset[str]:
    return frozenset(option.name for name in POLICIES for option in fields(options_type(name)))


def policy_options(name: str, options: Any = None) -> Any:
    """Policy `name`'s options object for `options`: its own options object as is; a mapping (or another
    policy's options) keeps the keys this policy has, with the rest at its defaults. A key that belongs to
    another registered policy is ignored (a sweep passes `window` to every policy), one that no policy has
    is an error."""
    kind = options_type(name)
    if isinstance(options, kind):
        return options
    given = asdict(options) if is_dataclass(options) else dict(options or {})
    unknown = sorted(set(given) - _every_option())
    if unknown:
        raise ValueError(f"unknown cache options {unknown}; the registered policies have {sorted(_every_option())}")
    own = {option.name for option in fields(kind)}
    return kind(**{key: value for key, value in given.items() if key in own})


def make_policy(name: str, options: Any = None, assets: Mapping[str, Any] | None = None, **keywords: Any) -> EvictionPolicy:
    """A new policy instance of `name` for `options` (`policy_options`; `keywords` add to them); `assets`: the
    model's, by policy name (`load_policy_assets`; None: none loaded, so kvpop knows no learned scorer)."""
    if keywords:
        options = {**(asdict(options) if is_dataclass(options) else dict(options or {})), **keywords}
    return policy_class(name).from_options(policy_options(name, options), (assets or {}).get(name))


def load_policy_assets(model_dir: Path) -> dict[str, Any]:
    """What each policy loads once per exported model (`EvictionPolicy.load_assets`), by policy name."""
    loaded = {name: policy.load_assets(Path(model_dir)) for name, policy in POLICIES.items()}
    return {name: assets for name, assets in loaded.items() if assets is not None}


def prepare_policies(assets: Mapping[str, Any], tokenizer: Any, vocab_size: int) -> None:
    """Let every policy build, once per model, what reading a prompt needs (`EvictionPolicy.prepare`)."""
    for name, policy in POLICIES.items():
        policy.prepare(assets.get(name), tokenizer, vocab_size)


def settings_parameters() -> dict[str, tuple[str, str]]:
    """Deployment parameter name -> (policy, setting) of every policy that has settings (kvpop_scorer -> kvpop, scorer)."""
    return {f"{name}_{setting.name}": (name, setting.name)
            for name, policy in POLICIES.items() if policy.Settings is not None for setting in fields(policy.Settings)}


def policy_settings(parameters: Mapping[str, str]) -> dict[str, Any]:
    """Every policy's settings (those it has), from deployment parameters named `<policy>_<setting>`; the
    settings object checks its values (ValueError naming the parameter)."""
    given: dict[str, dict[str, str]] = {name: {} for name, policy in POLICIES.items() if policy.Settings is not None}
    known = settings_parameters()
    for parameter, value in parameters.items():
        if parameter not in known:
            raise ValueError(f"unknown policy parameter {parameter!r}; known: {sorted(known)}")
        name, setting = known[parameter]
        given[name][setting] = value
    return {name: POLICIES[name].Settings(**values) for name, values in given.items()}


def policy_defaults(settings: Mapping[str, Any], assets: Mapping[str, Any]) -> dict[str, Any]:
    """The options every request of each policy gets on this model (its settings on its assets), by name."""
    return {name: policy_options(name, settings[name].options(assets.get(name))) if name in settings else policy_options(name)
            for name in POLICIES}
