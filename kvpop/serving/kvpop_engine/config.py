"""Service tunables, read from `parameters` in config.pbtxt and validated when the model loads.

A misconfigured model must fail at load time with a message naming the parameter, not at the first
request. A policy's own settings (parameters named `<policy>_<setting>`, e.g. kvpop_scorer) are the
policy's (kvpop.policies.registry.policy_settings); this module only hands them over.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvpop.engine import EngineConfig
from kvpop.policies import registry

# How a plain `text_input` reaches an instruction-tuned model (one whose tokenizer has a chat template).
# Such a model ends a bare question at once (SmolLM2: "What is the capital of France?" -> <|im_end|>),
# so by default the text is its user turn; a request parameter `raw_prompt: true` sends it as is
# (completion), as `never` does for every request. A model without a chat template always gets it raw.
TEXT_INPUT_CHAT = ("auto", "never")


@dataclass(frozen=True)
class ServiceConfig:
    default_policy: str = "full"  # eviction policy when a request names none
    default_kv_budget: int = 512  # slots per head for a bounded policy when a request names no budget
    max_prompt_tokens: int = 4096  # longer prompts are rejected with an invalid-argument error
    max_output_tokens: int = 1024  # upper bound for a request's max_tokens
    default_max_tokens: int = 64
    max_running_sequences: int = 16  # sequences decoded together in one engine step (in-flight batch)
    prefill_chunk_tokens: int = 256  # prompt tokens per prefill call (a bounded cache: at most max(budget, the next))
    min_prefill_chunk_tokens: int = 64  # a bounded cache's prefill chunks hold at least this many tokens (or the whole prompt)
    # A bounded cache whose policy reads no attention (kvpop with a learned scorer, streaming, random) prefills
    # a prompt of up to this many tokens whole, then evicts (Engine whole_prompt_tokens); 0: evict while prefilling
    whole_prompt_tokens: int = 4096
    max_step_tokens: int = 0  # prompt tokens fed per engine step beside the decodes (0: one chunk)
    prefill_pacing: float = 0.0  # prompt work per step beside decodes, in measured decode steps' time (0: off; kvpop.engine.prefill_pacer)
    ort_threads: int = 0  # onnxruntime intra-op threads (0: onnxruntime's default)
    kv_pool_mb: int = 1024  # KV memory per instance for all running sequences (admission control)
    min_kv_budget: int = 64  # when the pool is tight, bounded requests may be degraded down to this
    max_queue_size: int = 64  # requests waiting for KV memory; beyond this they are rejected (overloaded)
    session_hot_mb: int = 128  # finished sessions kept in the KV pool (part of kv_pool_mb); 0: none
    session_warm_mb: int = 1024  # more sessions kept in host memory
    session_cold_mb: int = 8192  # session checkpoints on disk; the oldest beyond this are deleted
    session_ttl_s: float = 86400.0  # checkpoints unused this long are deleted
    # checkpoint directory: relative to the model's folder in the state directory (kvpop.serving.process.state_dir,
    # `--state-dir`), never the model repository; an absolute path as is; "": no disk tier
    session_dir: str = "sessions"
    text_input_chat: str = "auto"  # auto: a model with a chat template answers text_input as one user message; never: raw
    warm_prefixes: str = ""  # JSON list of prompt beginnings (strings or message lists) prefilled at load
    warm_prefix_policies: str = ""  # comma-separated policies to prefill them for besides default_policy
    # each policy's settings object, by policy name (kvpop: kvpop.policies.kvpop.settings.KVpopSettings)
    policy_settings: Mapping[str, Any] = field(default_factory=lambda: registry.policy_settings({}))

    def __post_init__(self) -> None:
        for name in ("default_kv_budget", "max_prompt_tokens", "max_output_tokens", "default_max_tokens",
                     "max_running_sequences", "prefill_chunk_tokens", "min_prefill_chunk_tokens", "kv_pool_mb",
                     "min_kv_budget"):
            if getattr(self, name) <= 0:
                raise ValueError(f"parameter {name} must be > 0, got {getattr(self, name)}")
        if (self.ort_threads < 0 or self.max_queue_size < 0 or self.max_step_tokens < 0 or not self.prefill_pacing >= 0
                or self.whole_prompt_tokens < 0):
            raise ValueError(
                f"parameters ort_threads, max_queue_size, max_step_tokens, prefill_pacing and whole_prompt_tokens must "
                f"be >= 0, got {self.ort_threads}, {self.max_queue_size}, {self.max_step_tokens}, {self.prefill_pacing}, "
                f"{self.whole_prompt_tokens}"
            )
        if min(self.session_hot_mb, self.session_warm_mb, self.session_cold_mb) < 0 or self.session_ttl_s <= 0:
            raise ValueError("parameters session_hot_mb, session_warm_mb, session_cold_mb must be >= 0, session_ttl_s > 0")
        if self.session_hot_mb >= self.kv_pool_mb:
            raise ValueError(f"parameter session_hot_mb ({self.session_hot_mb}) must leave room in kv_pool_mb ({self.kv_pool_mb})")
        if self.min_kv_budget > self.default_kv_budget:
            raise ValueError(f"parameter min_kv_budget ({self.min_kv_budget}) exceeds default_kv_budget ({self.default_kv_budget})")
        if self.default_max_tokens > self.max_output_tokens:
            raise ValueError(
                f"parameter default_max_tokens ({self.default_max_tokens}) exceeds max_output_tokens "
                f"({self.max_output_tokens})"
            )
        if self.text_input_chat not in TEXT_INPUT_CHAT:
            raise ValueError(f"parameter text_input_chat {self.text_input_chat!r} is not one of {list(TEXT_INPUT_CHAT)}")
        if self.default_policy not in registry.POLICIES:
            raise ValueError(f"parameter default_policy {self.default_policy!r} is not one of {sorted(registry.POLICIES)}")
        from kvpop.serving.kvpop_engine.warm_prefixes import parse_warm_prefixes, warm_policies

        parse_warm_prefixes(self.warm_prefixes)
        unknown = [name for name in warm_policies(self.default_policy, self.warm_prefix_policies) if name not in registry.POLICIES]
        if unknown:
            raise ValueError(f"parameter warm_prefix_policies names unknown policies {unknown}; known: {sorted(registry.POLICIES)}")

    def engine_config(self) -> EngineConfig:
        """The engine's configuration these parameters make (an evaluation builds the service's engine from it)."""
        return EngineConfig(
            max_batch_size=self.max_running_sequences,
            prefill_chunk=self.prefill_chunk_tokens,
            min_bounded_chunk=self.min_prefill_chunk_tokens,
            whole_prompt_tokens=self.whole_prompt_tokens,
            max_step_tokens=self.max_step_tokens or None,
            prefill_pacing=self.prefill_pacing or None,
            min_kv_budget=self.min_kv_budget,
            max_queue_size=self.max_queue_size,
        )

    @property
    def kv_pool_bytes(self) -> int:
        """The instance's KV pool (`kv_pool_mb`): what its admission reserves from, its metrics' capacity."""
        return self.kv_pool_mb * 2**20

    @classmethod
    def from_model_config(cls, model_config: dict[str, Any]) -> "ServiceConfig":
        """Build from Triton's model config dict; unknown parameter names are an error (typos)."""
        raw = {key: value.get("string_value", "") for key, value in (model_config.get("parameters") or {}).items()}
        own = registry.settings_parameters()
        known = {option.name for option in fields(cls) if option.name != "policy_settings"}
        unknown = sorted(set(raw) - known - set(own))
        if unknown:
            raise ValueError(f"unknown parameters {unknown}; known: {sorted(known | set(own))}")
        values: dict[str, Any] = {"policy_settings": registry.policy_settings({key: raw.pop(key) for key in own if key in raw})}
        for name, text in raw.items():
            kind = type(getattr(cls, name))
            try:
                values[name] = kind(text) if kind is not str else text
            except ValueError:
                raise ValueError(f"parameter {name} must be {kind.__name__}, got {text!r}") from None
        return cls(**values)
