"""Prometheus metrics of one engine instance, exported on Triton's metrics port.

Built on `pb_utils.MetricFamily`; the module is passed in so this file does not import Triton and the
worker can run without metrics (`NullMetrics`) in unit tests and offline tools.
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass
from typing import Any

from kvpop.request import FinishReason, Tier
from kvpop.serving.contract import ErrorKind

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64]
COMPRESSION_BUCKETS = [0.0, 0.25, 0.5, 0.75, 0.875, 0.9375, 0.97, 0.99]
FINISH_REASONS = tuple(FinishReason)
SESSION_TIERS = tuple(Tier)
RESTORE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
STEP_GAUGE_INTERVAL = 0.1  # seconds between sets of the per-step gauges while requests run (each is an IPC round trip)
SESSION_STATS_INTERVAL = 1.0  # seconds between reads of the store's tiers (the cold one is a directory scan)


@dataclass(frozen=True)
class SequenceCounts:
    """Where an instance's requests are, each in exactly one place; active = prefilling + decoding."""

    queued: int  # not started: waiting for KV memory (at most max_queue_size), or for a place in the running batch
    prefilling: int  # in the running batch, prompt being fed (no token yet)
    decoding: int  # in the running batch, generating

    @property
    def active(self) -> int:
        """The running batch: at most max_running_sequences."""
        return self.prefilling + self.decoding


class NullMetrics:
    """Metrics that go nowhere (no Triton process to export them)."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


class ServiceMetrics:
    def __init__(self, pb_utils: Any, model: str, instance: str, kv_capacity_bytes: int, policies: list[str]) -> None:
        labels = {"model": model, "instance": instance}
        # A MetricFamily must outlive its metrics: keep every family for the life of this object.
        self._families: list[Any] = []

        def family(name: str, description: str, kind: str):
            metric_family = pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))
            self._families.append(metric_family)
            return metric_family

        def gauge(name: str, description: str):
            return family(name, description, "GAUGE").Metric(labels=labels)

        def counter(name: str, description: str):
            return family(name, description, "COUNTER")

        def histogram(name: str, description: str, buckets: list[float]):
            return family(name, description, "HISTOGRAM").Metric(labels=labels, buckets=buckets)

        self.kv_bytes_in_use = gauge("kvpop_kv_bytes_in_use", "KV cache bytes held by running sequences")
        self.kv_bytes_reserved = gauge("kvpop_kv_bytes_reserved", "KV pool bytes reserved by admission")
        self.kv_bytes_capacity = gauge("kvpop_kv_bytes_capacity", "KV pool size of this instance in bytes")
        self.sequences = {
            "active": gauge("kvpop_active_sequences",
                            "sequences in the running batch, prefilling or decoding (at most max_running_sequences)"),
            "queued": gauge("kvpop_queued_sequences",
                            "requests not started: waiting for KV memory or for a place in the running batch"),
            "prefilling": gauge("kvpop_prefilling_sequences", "sequences in the running batch whose prompt is being fed"),
            "decoding": gauge("kvpop_decoding_sequences", "sequences in the running batch generating tokens"),
        }
        prompt = counter("kvpop_prompt_tokens_total", "prompt tokens processed")
        generated = counter("kvpop_generated_tokens_total", "tokens generated")
        self.prompt_tokens = prompt.Metric(labels=labels)
        self.generated_tokens = generated.Metric(labels=labels)
        evicted = counter("kvpop_evicted_tokens_total", "tokens evicted from the cache (per head), by policy")
        self.evicted = {policy: evicted.Metric(labels={**labels, "policy": policy}) for policy in policies}
        requests = counter("kvpop_requests_total", "finished requests by finish reason")
        self.requests = {reason: requests.Metric(labels={**labels, "finish_reason": reason}) for reason in FINISH_REASONS}
        rejected = counter("kvpop_rejected_requests_total", "requests refused, by reason")
        self.rejected = {reason: rejected.Metric(labels={**labels, "reason": reason}) for reason in map(str, ErrorKind)}
        self.degraded = counter("kvpop_degraded_requests_total", "requests admitted at a reduced KV budget").Metric(labels=labels)
        self.compression = histogram("kvpop_compression_ratio", "achieved compression per request (1 - cached/seen)", COMPRESSION_BUCKETS)
        self.ttft = histogram("kvpop_time_to_first_token_seconds", "time from arrival to the first token", LATENCY_BUCKETS)
        self.tpot = histogram("kvpop_time_per_output_token_seconds", "mean time per generated token after the first", TOKEN_LATENCY_BUCKETS)
        self.latency = histogram("kvpop_request_latency_seconds", "time from arrival to the last token", LATENCY_BUCKETS)
        self.batch_size = histogram("kvpop_batch_size", "sequences decoded together per engine step", BATCH_BUCKETS)
        self.kv_bytes_capacity.set(kv_capacity_bytes)

        session_prompt = counter("kvpop_session_prompt_tokens_total", "prompt tokens of requests with a session_id")
        session_reused = counter("kvpop_session_tokens_reused_total", "prompt tokens taken from a saved session (not computed)")
        self.session_prompt_tokens = session_prompt.Metric(labels=labels)
        self.session_tokens_reused = session_reused.Metric(labels=labels)
        self.session_hit_ratio = gauge("kvpop_session_hit_ratio", "session prompt tokens reused / session prompt tokens, since start")
        lookups = counter("kvpop_session_lookups_total", "session state lookups")
        hits = counter("kvpop_session_hits_total", "session state found, by tier")
        self.session_counters = {
            "lookups": lookups.Metric(labels=labels),
            "promotions": counter("kvpop_session_promotions_total", "sessions moved up to the hot tier").Metric(labels=labels),
            "demotions": counter("kvpop_session_demotions_total", "sessions moved down a tier").Metric(labels=labels),
            "checkpoints_written": counter("kvpop_session_checkpoints_written_total", "session checkpoints written").Metric(labels=labels),
            "checkpoints_rejected": counter("kvpop_session_checkpoints_rejected_total", "corrupt, truncated or foreign checkpoints refused").Metric(labels=labels),
            "checkpoints_failed": counter("kvpop_session_checkpoint_failures_total", "session checkpoint writes that failed (disk full, permissions)").Metric(labels=labels),
            "cold_removed": counter("kvpop_session_checkpoints_removed_total", "checkpoints deleted past the size limit or TTL").Metric(labels=labels),
        }
        self.session_hits = {tier: hits.Metric(labels={**labels, "tier": tier}) for tier in SESSION_TIERS}
        tier_bytes = family("kvpop_session_bytes", "bytes of saved sessions, by tier", "GAUGE")
        tier_entries = family("kvpop_session_entries", "saved sessions, by tier", "GAUGE")
        self.session_bytes = {tier: tier_bytes.Metric(labels={**labels, "tier": tier}) for tier in SESSION_TIERS}
        self.session_entries = {tier: tier_entries.Metric(labels={**labels, "tier": tier}) for tier in SESSION_TIERS}
        self.session_restore = histogram("kvpop_session_restore_seconds", "time to read a session checkpoint from disk", RESTORE_BUCKETS)
        self.session_checkpoint_queue = gauge("kvpop_session_checkpoint_queue", "session checkpoint writes pending on the store's writer thread")
        self.prefix_lookups = counter("kvpop_prefix_lookups_total", "requests whose prompt was looked up among the warm prefixes").Metric(labels=labels)
        self.prefix_hits = counter("kvpop_prefix_hits_total", "requests that started from a warm prefix's cache").Metric(labels=labels)
        self.prefix_tokens_reused = counter("kvpop_prefix_tokens_reused_total", "prompt tokens taken from a warm prefix (not computed)").Metric(labels=labels)
        self.prefix_hit_ratio = gauge("kvpop_prefix_hit_ratio", "warm prefix tokens reused / prompt tokens of the requests looked up, since start")
        self._prefix_prompt = self._prefix_reused = 0
        self._session_seen: dict[str, int] = {}
        self._session_prompt = self._session_reused = 0
        self._session_stats_at = 0.0
        self._step_gauges_at = 0.0
        self._step_counts = SequenceCounts(0, 0, 0)  # as last set

    def observe_step(self, batch_size: int, kv_bytes_in_use: int, kv_bytes_reserved: int, sequences: SequenceCounts) -> None:
        if batch_size:
            self.batch_size.observe(batch_size)
        now = time.monotonic()
        unchanged = sequences == self._step_counts
        if unchanged and any(astuple(sequences)) and now - self._step_gauges_at < STEP_GAUGE_INTERVAL:
            return  # busy, nothing joined, moved or left: at most every 100 ms; changes and idleness: at once
        self._step_gauges_at, self._step_counts = now, sequences
        self.kv_bytes_in_use.set(kv_bytes_in_use)
        self.kv_bytes_reserved.set(kv_bytes_reserved)
        for name, gauge in self.sequences.items():
            gauge.set(getattr(sequences, name))  # `active` is a property: the sum of two of them

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_finished(self, result, latency: float, time_per_token: float | None, prompt_tokens: int) -> None:
        self.requests[result.finish_reason].increment(1)
        self.prompt_tokens.increment(prompt_tokens)
        self.generated_tokens.increment(len(result.output_ids))
        if result.policy in self.evicted:
            self.evicted[result.policy].increment(result.tokens_evicted)
        self.compression.observe(result.compression)
        self.latency.observe(latency)
        if time_per_token is not None:
            self.tpot.observe(time_per_token)

    def observe_cancelled_in_queue(self) -> None:
        """A request whose client left while it waited for KV memory: it finished, cancelled, never started."""
        self.requests[FinishReason.CANCELLED].increment(1)

    def observe_session_turn(self, prompt_tokens: int, tokens_reused: int) -> None:
        self.session_prompt_tokens.increment(prompt_tokens)
        self.session_tokens_reused.increment(tokens_reused)
        self._session_prompt += prompt_tokens
        self._session_reused += tokens_reused
        self.session_hit_ratio.set(self._session_reused / self._session_prompt if self._session_prompt else 0.0)

    def observe_prefix_lookup(self, prompt_tokens: int, tokens_reused: int) -> None:
        self.prefix_lookups.increment(1)
        if tokens_reused:
            self.prefix_hits.increment(1)
            self.prefix_tokens_reused.increment(tokens_reused)
        self._prefix_prompt += prompt_tokens
        self._prefix_reused += tokens_reused
        self.prefix_hit_ratio.set(self._prefix_reused / self._prefix_prompt)

    def observe_sessions(self, store) -> None:
        """The store's tiers and counters (at most once per SESSION_STATS_INTERVAL)."""
        now = time.monotonic()
        if now - self._session_stats_at < SESSION_STATS_INTERVAL:
            return
        self._session_stats_at = now
        for tier, stats in store.stats().items():
            self.session_bytes[tier].set(stats["bytes"])
            self.session_entries[tier].set(stats["entries"])
        counters = store.counters
        totals = {name: getattr(counters, name) for name in self.session_counters}
        totals.update({f"hits.{tier}": counters.hits[tier] for tier in SESSION_TIERS})
        for name, total in totals.items():
            delta = total - self._session_seen.get(name, 0)
            if delta > 0:
                metric = self.session_hits[name[5:]] if name.startswith("hits.") else self.session_counters[name]
                metric.increment(delta)
            self._session_seen[name] = total
        for seconds in store.take_restore_seconds():
            self.session_restore.observe(seconds)

    def observe_checkpoint_queue(self, pending: int) -> None:
        """Set by the session store whenever a checkpoint write is queued or ends (any thread)."""
        self.session_checkpoint_queue.set(pending)

    def observe_rejected(self, reason: str) -> None:
        self.rejected[reason].increment(1)

    def observe_degraded(self) -> None:
        self.degraded.increment(1)
