"""The service behind the Triton engine model: tokenizer + engine worker + request parsing.

Kept free of `triton_python_backend_utils` so it runs (and is tested) without Triton;
`model_repository/kvpop_engine/1/model.py` only adapts Triton requests and response senders to it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvpop.cache.prefix_cache import PrefixCache
from kvpop.cache.reservations import KVReservations
from kvpop.decoder import DecoderStep
from kvpop.engine import Engine
from kvpop.policies import POLICIES, load_policy_assets, policy_defaults
from kvpop.serving.kvpop_engine.config import ServiceConfig
from kvpop.serving.process.drain import DrainSignal
from kvpop.serving.kvpop_engine.parse import InvalidRequestError, parse_request, request_cache_config
from kvpop.serving.kvpop_engine.warm_prefixes import parse_warm_prefixes, prefix_token_ids, warm_policies
from kvpop.serving.kvpop_engine.worker import EngineWorker, ResponseChannel
from kvpop.sessions import SessionStore, TierLimits, model_fingerprint

TOKENIZER_DIRNAME = "tokenizer"


@dataclass(frozen=True)
class Placement:
    """Where this model instance runs: config.pbtxt gives one instance per GPU."""

    device: str  # "cpu" or "cuda"
    device_id: int = 0

    @classmethod
    def from_triton_args(cls, args: dict[str, Any]) -> "Placement":
        kind = str(args.get("model_instance_kind", "CPU")).upper()
        return cls("cuda" if kind == "GPU" else "cpu", int(args.get("model_instance_device_id", 0) or 0))

    @property
    def label(self) -> str:
        return f"{self.device}:{self.device_id}"


class KVpopEngineModel:
    def __init__(self, model_dir: Path, config: ServiceConfig, placement: Placement = Placement("cpu"), metrics=None,
                 state_dir: Path | None = None):
        from transformers import AutoTokenizer

        self.config = config
        self.placement = placement
        self.decoder = DecoderStep(model_dir, placement.device, placement.device_id, threads=config.ort_threads or None)
        self.tokenizer = AutoTokenizer.from_pretrained(Path(model_dir) / TOKENIZER_DIRNAME)
        self.policy_assets = load_policy_assets(model_dir)
        # every request's policy options, by policy name: the deployment's settings on this model's assets
        self.policy_options = policy_defaults(config.policy_settings, self.policy_assets)
        self.reservations = KVReservations(config.kv_pool_bytes, self.decoder.spec)  # outlives engine restarts
        self.sessions = self._session_store(Path(model_dir), config, state_dir)
        self.prefixes = PrefixCache()
        self._warm_prefixes()
        self.sessions.on_queue_change = getattr(metrics, "observe_checkpoint_queue", None)
        self.worker = EngineWorker(self._new_engine, self.tokenizer, metrics, drain=DrainSignal()).start()
        self._ids = itertools.count()

    def _new_engine(self) -> Engine:
        return Engine(self.decoder, self.config.engine_config(), tokenizer=self.tokenizer, policy_assets=self.policy_assets,
                      sessions=self.sessions, prefixes=self.prefixes, reservations=self.reservations)

    def _warm_prefixes(self) -> None:
        """Prefill the configured warm prefixes (before the worker starts: the engine is not shared)."""
        config = self.config
        prompts = [prefix_token_ids(prefix, self.tokenizer) for prefix in parse_warm_prefixes(config.warm_prefixes)]
        too_long = [len(ids) for ids in prompts if len(ids) >= config.max_prompt_tokens]
        if too_long:
            raise ValueError(f"parameter warm_prefixes: prefixes of {too_long} tokens; max_prompt_tokens is {config.max_prompt_tokens}")
        if not prompts:
            return
        engine = self._new_engine()
        for policy in warm_policies(config.default_policy, config.warm_prefix_policies):
            cache = request_cache_config(policy, None, None, config, self.policy_options)
            for ids in prompts:
                engine.warm_prefix(ids, cache)

    @staticmethod
    def _session_store(model_dir: Path, config: ServiceConfig, state_dir: Path | None) -> SessionStore:
        """One store per instance, outliving engine restarts; instances of a model share its disk tier.

        `session_dir` is resolved against the model's state directory (`state_dir`), never the model
        repository, which may be read-only; without one there is no disk tier."""
        cold_dir = (Path(state_dir) / config.session_dir) if config.session_dir and state_dir else None
        limits = TierLimits(
            hot_bytes=config.session_hot_mb * 2**20, warm_bytes=config.session_warm_mb * 2**20, cold_dir=cold_dir,
            cold_bytes=config.session_cold_mb * 2**20, cold_ttl_s=config.session_ttl_s,
        )
        return SessionStore(limits, model_fingerprint(model_dir))

    @staticmethod
    def policies() -> list[str]:
        return list(POLICIES)

    def submit(
        self,
        get_input: Callable[[str], np.ndarray | None],
        parameters: dict,
        channel: ResponseChannel,
        client_request_id: str = "",
    ) -> None:
        """Parse and queue one request; its responses go to `channel`. Raises InvalidRequestError or
        OverloadedError for this request alone."""
        # Client ids are neither unique nor trusted: the engine gets its own.
        request_id = f"{next(self._ids)}:{client_request_id[:64]}"
        parsed = parse_request(
            request_id, get_input, parameters, self.tokenizer, self.decoder.spec.vocab_size, self.config, self.policy_options
        )
        self.worker.submit(parsed, channel)

    def shutdown(self) -> None:
        """Stop the engine, then write every session checkpoint still queued (the last turns')."""
        self.worker.stop()
        self.sessions.close()


__all__ = ["InvalidRequestError", "KVpopEngineModel", "Placement", "ServiceConfig"]
