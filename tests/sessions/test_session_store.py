"""Session state, checkpoints and the tiered store, on synthetic caches (no model)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kvpop.cache import SlotCache
from kvpop.cache.snapshot import capture_state, restore_cache
from kvpop.model_spec import ModelSpec
from kvpop.policies import make_policy
from kvpop.sessions import (
    COLD, HOT, WARM, CheckpointError, InvalidSessionId, SessionKey, SessionStore, TierLimits,
    read_checkpoint, validate_session_id, write_checkpoint,
)
from kvpop.sessions.checkpoint import encode_checkpoint

SPEC = ModelSpec("LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=4,
                 vocab_size=16, dtype="float32", max_position_embeddings=4096)
FINGERPRINT = "f" * 64


def feed(cache: SlotCache, new_tokens: int, rng: np.random.Generator) -> None:
    L, Hkv, Hq, D = SPEC.num_layers, SPEC.num_kv_heads, SPEC.num_attention_heads, SPEC.head_dim
    key = rng.standard_normal((L, Hkv, new_tokens, D), dtype=np.float32)
    attention = rng.random((L, Hq, new_tokens, cache.capacity), dtype=np.float32)
    chunk = np.tril(rng.random((L, Hq, new_tokens, new_tokens), dtype=np.float32))
    cache.append(key, -key, attention, chunk)


def make_state(policy: str = "h2o", tokens: int = 40, budget: int | None = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    cache = SlotCache(SPEC, make_policy(policy, window=4, sinks=2, seed=3), budget)
    for chunk in (7, 1, 1, tokens - 9):
        feed(cache, chunk, rng)
    history = rng.integers(0, SPEC.vocab_size, tokens).tolist()
    return cache, capture_state(cache, history, FINGERPRINT, {"policy": policy, "budget": budget})


def assert_same_cache(a: SlotCache, b: SlotCache) -> None:
    assert (a.length, a.tokens_seen, a.budget) == (b.length, b.tokens_seen, b.budget)
    for name in ("key", "value", "position"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.statistics.keys() == b.statistics.keys()
    for name in a.statistics:
        np.testing.assert_array_equal(a.statistics[name], b.statistics[name])


# -- ids --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hostile", [
    "", "a" * 129, "../../etc/passwd", "a b", "a\x00b", "a\nb", "ünïcode", "\\windows", "id;rm -rf", 5, None, b"bytes",
])
def test_hostile_session_ids_are_refused(hostile):
    with pytest.raises(InvalidSessionId):
        validate_session_id(hostile)
    assert issubclass(InvalidSessionId, ValueError)


def test_session_keys_are_keyed_hashes_that_never_contain_the_id():
    secret = b"s" * 32
    key = SessionKey.of("user-42:chat.1", secret)
    assert len(key.digest) == 64 and all(c in "0123456789abcdef" for c in key.digest)
    assert key == SessionKey.of("user-42:chat.1", secret)
    assert key != SessionKey.of("user-42:chat.2", secret)
    assert key != SessionKey.of("user-42:chat.1", b"t" * 32)  # unpredictable without the secret
    assert validate_session_id("a" * 128)


# -- state ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy,budget", [("full", None), ("streaming", 16), ("h2o", 16), ("tova", 16), ("random", 16), ("kvpop", 16)])
def test_restored_cache_continues_exactly_like_the_original(policy, budget):
    original, state = make_state(policy, budget=budget)
    restored = restore_cache(state, SPEC, make_policy(policy, window=4, sinks=2, seed=3))
    assert_same_cache(original, restored)
    for chunk in (1, 5, 1):  # both go on the same way, the policy's state (rng, scores) included
        rng_a, rng_b = np.random.default_rng(chunk), np.random.default_rng(chunk)
        feed(original, chunk, rng_a)
        feed(restored, chunk, rng_b)
        assert_same_cache(original, restored)


def test_restoring_twice_never_shares_arrays():
    _, state = make_state("h2o")
    first = restore_cache(state, SPEC, make_policy("h2o", window=4))
    first.key[:] = 0
    first.statistics["accumulated_attention"][:] = 0
    second = restore_cache(state, SPEC, make_policy("h2o", window=4))
    assert second.key.any() and second.statistics["accumulated_attention"].any()


def test_reuse_needs_the_prompt_to_start_with_the_history_and_add_a_token():
    _, state = make_state("full", budget=None)
    history = state.tokens.tolist()
    assert state.reusable_for(history + [1])
    assert not state.reusable_for(history)  # nothing new to feed
    assert not state.reusable_for([(history[0] + 1) % 16] + history[1:] + [1])
    assert not state.reusable_for(history[:-1])


def test_state_of_another_shape_or_policy_is_refused_at_restore():
    _, state = make_state("h2o")
    with pytest.raises(ValueError, match="statistics"):
        restore_cache(state, SPEC, make_policy("streaming"))
    other = ModelSpec("LlamaForCausalLM", num_layers=3, num_attention_heads=4, num_kv_heads=2, head_dim=4,
                      vocab_size=16, dtype="float32", max_position_embeddings=4096)
    with pytest.raises(ValueError, match="does not fit"):
        restore_cache(state, other, make_policy("h2o"))


# -- checkpoints ------------------------------------------------------------------------------------

def test_checkpoint_round_trip_is_exact_and_not_pickle(tmp_path):
    original, state = make_state("random")
    path = tmp_path / "s.safetensors"
    write_checkpoint(path, state, owner="me")
    assert b"\x80\x04" not in path.read_bytes()[:2]  # no pickle protocol header
    (header_length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert json.loads(path.read_bytes()[8 : 8 + header_length])["__metadata__"]["fingerprint"] == FINGERPRINT
    loaded = read_checkpoint(path, owner="me", fingerprint=FINGERPRINT)
    assert_same_cache(original, restore_cache(loaded, SPEC, make_policy("random", seed=3)))
    np.testing.assert_array_equal(loaded.tokens, state.tokens)
    assert [p for p in tmp_path.iterdir()] == [path]  # no temporary left behind


@pytest.mark.parametrize("damage,message", [
    (lambda data: data[: len(data) // 2], "truncated|corrupt"),
    (lambda data: data[:-10], "truncated|corrupt"),  # header intact, tensors cut short
    (lambda data: data + b"\0" * 10, "truncated|corrupt"),  # bytes beyond the last tensor
    (lambda data: data[:5], "truncated"),
    (lambda data: b"", "truncated"),
    (lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]), "checksum"),
    (lambda data: struct.pack("<Q", 1 << 40) + data[8:], "truncated"),
    (lambda data: data[:8] + b"[" + data[9:], "corrupt|not a KVpop"),
    (lambda data: os.urandom(len(data)), "truncated|corrupt|not a KVpop"),
])
def test_corrupt_and_truncated_checkpoints_are_refused_clearly(tmp_path, damage, message):
    _, state = make_state()
    path = tmp_path / "s.safetensors"
    write_checkpoint(path, state, owner="me")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(path, owner="me", fingerprint=FINGERPRINT)


def test_foreign_and_other_sessions_checkpoints_are_refused(tmp_path):
    _, state = make_state()
    path = tmp_path / "s.safetensors"
    write_checkpoint(path, state, owner="me")
    with pytest.raises(CheckpointError, match="another model"):
        read_checkpoint(path, owner="me", fingerprint="0" * 64)
    with pytest.raises(CheckpointError, match="another session"):
        read_checkpoint(path, owner="someone-else", fingerprint=FINGERPRINT)
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(3, np.float32)}, str(path))  # a valid safetensors file, not ours
    with pytest.raises(CheckpointError, match="not a KVpop"):
        read_checkpoint(path, owner="me", fingerprint=FINGERPRINT)


# -- the tiered store -------------------------------------------------------------------------------

def store(tmp_path: Path, hot: int, warm: int, **options) -> SessionStore:
    options.setdefault("cold_dir", tmp_path / "cold")
    return SessionStore(TierLimits(hot_bytes=hot, warm_bytes=warm, **options), FINGERPRINT)


def test_least_recently_used_sessions_move_down_and_come_back_up(tmp_path):
    _, state = make_state()
    size = state.nbytes
    sessions = store(tmp_path, hot=2 * size, warm=2 * size)
    for name in "abcde":
        sessions.put(name, state)
    assert [sessions.tier_of(name) for name in "abcde"] == [COLD, WARM, WARM, HOT, HOT]
    assert sessions.flush(timeout=30)  # checkpoints are written by the store's writer thread
    assert sessions.stats() == {HOT: {"entries": 2, "bytes": 2 * size}, WARM: {"entries": 2, "bytes": 2 * size},
                                COLD: {"entries": 5, "bytes": sessions.stats()[COLD]["bytes"]}}  # write-through
    assert sessions.get("b") is not None  # warm -> hot; d (least recent in hot) goes to warm
    assert [sessions.tier_of(name) for name in "abcde"] == [COLD, HOT, WARM, WARM, HOT]
    restored = sessions.get("a")  # cold -> hot
    np.testing.assert_array_equal(restored.key, state.key)
    assert sessions.tier_of("a") == HOT and sessions.tier_of("e") == WARM and sessions.tier_of("c") == COLD
    assert sessions.counters.hits == {HOT: 0, WARM: 1, COLD: 1} and sessions.counters.promotions == 2
    assert len(sessions.take_restore_seconds()) == 1
    assert sessions.get("never") is None and sessions.counters.lookups == 3


def test_without_write_through_a_session_reaches_disk_only_when_demoted(tmp_path):
    _, state = make_state()
    sessions = store(tmp_path, hot=state.nbytes, warm=0, write_through=False)
    sessions.put("a", state)
    assert sessions.stats()[COLD]["entries"] == 0
    sessions.put("b", state)  # a: hot -> warm (limit 0) -> disk
    assert sessions.tier_of("a") == COLD and sessions.flush(timeout=30) and sessions.stats()[COLD]["entries"] == 1
    assert sessions.get("a") is not None


def test_checkpoints_survive_a_new_store_on_the_same_directory(tmp_path):
    _, state = make_state("kvpop")
    first = store(tmp_path, hot=1 << 30, warm=0)
    first.put("chat-1", state)
    assert first.close()  # model finalize: every pending checkpoint is on disk before it returns
    reopened = store(tmp_path, hot=1 << 30, warm=0)  # a restarted server: same secret file, cold hit
    loaded = reopened.get("chat-1")
    assert loaded is not None and reopened.counters.hits[COLD] == 1
    np.testing.assert_array_equal(loaded.value, state.value)
    assert oct((tmp_path / "cold" / "session.key").stat().st_mode & 0o777) == "0o600"
    assert all("chat-1" not in path.name for path in (tmp_path / "cold").iterdir())


def test_corrupt_or_foreign_checkpoint_is_treated_as_missing(tmp_path):
    _, state = make_state()
    sessions = store(tmp_path, hot=0, warm=0)
    sessions.put("a", state)
    sessions.put("b", state)
    sessions.flush()
    [path_a] = [p for p in (tmp_path / "cold").glob("*.safetensors") if p.name.startswith(sessions.key("a"))]
    path_a.write_bytes(path_a.read_bytes()[:100])
    assert sessions.get("a") is None and not path_a.exists()
    foreign = SessionStore(TierLimits(0, 0, cold_dir=tmp_path / "cold"), "0" * 64)
    assert foreign.get("b") is None and foreign.counters.checkpoints_rejected == 1


def test_one_session_cannot_read_another_by_renaming_files(tmp_path):
    _, state = make_state()
    sessions = store(tmp_path, hot=0, warm=0)
    sessions.put("victim", state)
    sessions.flush()
    cold = tmp_path / "cold"
    os.replace(cold / f"{sessions.key('victim')}.safetensors", cold / f"{sessions.key('attacker')}.safetensors")
    assert sessions.get("attacker") is None and sessions.counters.checkpoints_rejected == 1


def test_cold_tier_drops_the_oldest_past_its_size_and_expired_ones(tmp_path):
    now = [1000.0]
    _, state = make_state()
    file_bytes = len(encode_checkpoint(state, owner="x" * 64))
    sessions = store(tmp_path, hot=0, warm=0, cold_bytes=3 * file_bytes, cold_ttl_s=100.0)
    sessions.clock = lambda: now[0]
    for age, name in enumerate("abcd"):
        sessions.put(name, state)
        sessions.flush()
        path = tmp_path / "cold" / f"{sessions.key(name)}.safetensors"
        if path.exists():
            os.utime(path, (900.0 + age, 900.0 + age))
    assert [sessions.tier_of(name) for name in "abcd"] == [None, COLD, COLD, COLD]
    now[0] = 900.0 + 2 + 100.5  # b and c expired, d not yet
    sessions.sweep()
    assert [sessions.tier_of(name) for name in "abcd"] == [None, None, None, COLD]
    assert sessions.counters.cold_removed == 3


def test_remove_forgets_everywhere_and_hostile_ids_never_touch_the_disk(tmp_path):
    _, state = make_state()
    sessions = store(tmp_path, hot=1 << 30, warm=0)
    sessions.put("a", state)
    assert sessions.remove("a") and sessions.tier_of("a") is None and not sessions.remove("a")
    for hostile in ("../../x", "", "a" * 500):
        with pytest.raises(InvalidSessionId):
            sessions.get(hostile)
        with pytest.raises(InvalidSessionId):
            sessions.put(hostile, state)
    assert sorted(p.name for p in (tmp_path / "cold").iterdir()) == ["session.key"]


def test_a_state_larger_than_hot_goes_to_warm_and_no_disk_means_dropped(tmp_path):
    _, state = make_state()
    sessions = store(tmp_path, hot=state.nbytes - 1, warm=state.nbytes, cold_dir=None)
    sessions.put("a", state)
    assert sessions.tier_of("a") == WARM
    sessions.put("b", state)
    assert sessions.tier_of("a") is None and sessions.tier_of("b") == WARM


def test_a_changed_checkpoint_wins_over_the_memory_copy(tmp_path):
    _, state = make_state()
    _, newer = make_state(seed=5)
    first = store(tmp_path, hot=1 << 30, warm=0)
    second = store(tmp_path, hot=1 << 30, warm=0)  # another instance on the same directory
    first.put("a", state)
    first.flush()
    assert second.get("a") is not None
    path = tmp_path / "cold" / f"{first.key('a')}.safetensors"
    os.utime(path, ns=(path.stat().st_mtime_ns - 10**9,) * 2)  # coarse file-system clocks
    second.put("a", newer)
    second.flush()
    np.testing.assert_array_equal(first.get("a").tokens, newer.tokens)
    path.write_bytes(path.read_bytes()[:100])  # damaged on disk: refused, not served from memory
    assert first.get("a") is None and first.counters.checkpoints_rejected == 1
