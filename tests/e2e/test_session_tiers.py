"""More sessions than fit in memory, against a real server of its own with tiny tiers (1 MiB hot in
a 2 MiB KV pool, 1 MiB warm): the tier limits hold, the least recently used sessions leave memory
for their disk checkpoints, and the oldest one comes back from disk and continues exactly as the
whole history would (greedy, policy full). A checkpoint from another model is refused cleanly."""

from __future__ import annotations

import time

import numpy as np
import pytest

from e2e.conftest import checkpoint_dir, wait_for_checkpoint

pytestmark = pytest.mark.server
MIB = 2**20
SESSIONS = 7
PROMPT = 800  # tokens: a session is ~0.5 MiB of the tiny model's cache and metadata, so 2 fit in a 1 MiB tier
REPLY = 8


def prompt_of(index: int, length: int = PROMPT) -> list[int]:
    return np.random.default_rng(900 + index).integers(3, 250, length).tolist()


@pytest.fixture(scope="module")
def tiered(tmp_path_factory, tiny_onnx_model_dir):
    from kvpop.serving.process.tritonserver import TritonServer, free_port
    from kvpop_client import KVpopClient

    from e2e.conftest import TEST_ENGINE_PARAMETERS
    from export.repository import assemble_model_repository

    parameters = {**TEST_ENGINE_PARAMETERS, "kv_pool_mb": "2", "session_hot_mb": "1", "session_warm_mb": "1",
                  "max_prompt_tokens": "1024", "max_queue_size": "4"}
    root = assemble_model_repository(tmp_path_factory.mktemp("tiers"), tiny_onnx_model_dir, parameters)
    log_file = root / "triton.log"
    server = TritonServer(model_repository=root, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), address="127.0.0.1", model_config_name="cpu", log_file=log_file,
                          state_dir=tmp_path_factory.mktemp("tiers-state"))
    with server, KVpopClient(server.grpc_url, "grpc") as client:

        def metric(name: str, **labels: str) -> float:
            import re

            total = 0.0
            for key, value in KVpopClient.metrics(server.metrics_url).items():
                metric_name, _, label_text = key.partition("{")
                found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
                if metric_name == name and all(found.get(k) == v for k, v in labels.items()):
                    total += value
            return total

        def refresh() -> None:
            time.sleep(1.1)  # the store's tiers are read into the metrics at most once a second, on a step
            client.generate([1, 2], max_tokens=1)  # answered before its step reads the store: so a second
            client.generate([1, 2], max_tokens=1)  # request, which the one engine thread steps after it

        yield server, client, metric, refresh


def test_more_sessions_than_fit_in_memory_spill_to_disk_and_the_oldest_comes_back_exactly(tiered):
    server, client, metric, refresh = tiered
    demotions = metric("kvpop_session_demotions_total")
    first = {index: client.generate(prompt_of(index), max_tokens=REPLY, ignore_eos=True, session_id=f"tier-{index}")
             for index in range(SESSIONS)}
    refresh()
    hot, warm = metric("kvpop_session_bytes", tier="hot"), metric("kvpop_session_bytes", tier="warm")
    in_memory = metric("kvpop_session_entries", tier="hot") + metric("kvpop_session_entries", tier="warm")
    assert 0 < hot <= 1 * MIB and 0 < warm <= 1 * MIB, (hot, warm)
    assert 2 <= in_memory < SESSIONS, in_memory  # a couple fit in memory, not all
    assert metric("kvpop_session_entries", tier="cold") >= SESSIONS  # every turn is checkpointed
    warm_entries = metric("kvpop_session_entries", tier="warm")
    # each session in warm left hot once; each one only on disk left hot and then warm
    assert metric("kvpop_session_demotions_total") - demotions >= warm_entries + 2 * (SESSIONS - in_memory)
    sessions_dir = checkpoint_dir(server)
    assert len(list(sessions_dir.glob("*.safetensors"))) >= SESSIONS

    # The oldest session is only on disk now: continuing it reads the checkpoint (a cold hit) and
    # gives the same tokens as sending the whole history with no session.
    cold_hits, restores = metric("kvpop_session_hits_total", tier="cold"), metric("kvpop_session_restore_seconds_count")
    prompt = prompt_of(0) + first[0].output_ids + [7, 8, 9]
    resumed = client.generate(prompt, max_tokens=REPLY, ignore_eos=True, session_id="tier-0")
    whole = client.generate(prompt, max_tokens=REPLY, ignore_eos=True)
    assert resumed.output_ids == whole.output_ids
    assert resumed.tokens_reused == PROMPT + REPLY - 1 and whole.tokens_reused == 0
    refresh()
    assert metric("kvpop_session_hits_total", tier="cold") == cold_hits + 1
    assert metric("kvpop_session_restore_seconds_count") == restores + 1
    assert metric("kvpop_session_bytes", tier="hot") <= 1 * MIB and metric("kvpop_session_bytes", tier="warm") <= 1 * MIB


def test_a_checkpoint_from_another_model_is_refused_and_the_server_stays_up(tiered):
    from dataclasses import replace

    from kvpop.sessions.checkpoint import _header_metadata, read_checkpoint, write_checkpoint

    server, client, metric, refresh = tiered
    first = client.generate(prompt_of(50, 40), max_tokens=4, ignore_eos=True, session_id="foreign")
    sessions_dir = checkpoint_dir(server)
    path = wait_for_checkpoint(sessions_dir, "foreign", 40 + 3)
    fingerprint = _header_metadata(path.read_bytes())["fingerprint"]
    state = read_checkpoint(path, owner=path.stem, fingerprint=fingerprint)
    time.sleep(0.01)
    write_checkpoint(path, replace(state, fingerprint="another-model-" + fingerprint[14:]), owner=path.stem)
    rejected = metric("kvpop_session_checkpoints_rejected_total")
    prompt = prompt_of(50, 40) + first.output_ids + [9]
    follow = client.generate(prompt, max_tokens=4, ignore_eos=True, session_id="foreign")
    assert follow.finish_reason == "length" and follow.tokens_reused == 0  # treated as missing: a cold prefill
    assert follow.output_ids == client.generate(prompt, max_tokens=4, ignore_eos=True).output_ids
    refresh()
    assert metric("kvpop_session_checkpoints_rejected_total") == rejected + 1
    again = client.generate(prompt + follow.output_ids + [3], max_tokens=4, ignore_eos=True, session_id="foreign")
    assert again.tokens_reused == len(prompt) + 3  # the refused file was replaced by this server's own
