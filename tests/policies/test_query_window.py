"""Query-aware selection (kvpop.policies.kvpop.query): the prompt's last queries pick a share of the
long-range slots when a whole prompt enters its cache. On the tiny exported model and on small arrays."""

from __future__ import annotations

import numpy as np
import pytest

from kvpop.engine import Engine, EngineConfig
from kvpop.kvtypes import CacheUpdate
from kvpop.policies.kvpop import KVpopPolicy
from kvpop.policies.kvpop.query import QUERY_BONUS
from kvpop.policies.kvpop import query
from kvpop.request import CacheConfig, GenerationRequest, SamplingParams

rng = np.random.default_rng(3)
PROMPT = [0] + [int(token) for token in rng.integers(3, 250, size=79)]  # 80 tokens


class RecordingKVpop(KVpopPolicy):
    """kvpop recording the query attention of every append (what the engine hands the policy)."""

    seen: list = []

    def observe(self, cache, update: CacheUpdate):
        RecordingKVpop.seen.append(None if update.query_attention is None else update.query_attention.copy())
        return super().observe(cache, update)


def run(model_dir, monkeypatch, query_window: int, prefill_chunk: int = 16, prompt=PROMPT, budget: int = 24):
    """One request through the engine (learned mLSTM scorer: the prompt enters whole) with a kvpop cache
    whose policy records what it is handed."""
    from kvpop import policies

    monkeypatch.setitem(policies.POLICIES, "kvpop", RecordingKVpop)
    RecordingKVpop.seen = []
    cache = CacheConfig(policy="kvpop", budget=budget, options=dict(sinks=2, window=4, scorer="mlstm", query_window=query_window))
    engine = Engine.from_model_dir(model_dir, EngineConfig(prefill_chunk=prefill_chunk, whole_prompt_tokens=4096))
    result = engine.generate([GenerationRequest("q", list(prompt), SamplingParams(max_tokens=4, ignore_eos=True), cache)])[0]
    return result, RecordingKVpop.seen


def test_the_policy_gets_the_last_queries_attention_of_the_whole_prompt(tiny_onnx_model_dir, decoder, monkeypatch):
    """The prompt enters whole in pieces, its last `query_window` tokens as their own piece with attention:
    what the policy is handed equals those queries' rows of the one-call prompt's attention."""
    _, seen = run(tiny_onnx_model_dir, monkeypatch, query_window=8)
    assert seen[0] is not None and all(update is None for update in seen[1:])  # the prompt's append only
    window = seen[0]  # (L, Hkv, G, 8, C + 80): the empty cache's C reserved slots, then the 80 prompt tokens
    spec = decoder.spec
    out = decoder.run(np.array([PROMPT]), np.arange(len(PROMPT))[None], *empty_past(spec), last_only=False, attention=True)
    expected = out.chunk_attention[:, 0, :, -8:, :]  # (L, Hq, 8, 80)
    group = spec.query_heads_per_kv_head
    capacity = window.shape[-1] - len(PROMPT)
    assert window.shape[:4] == (spec.num_layers, spec.num_kv_heads, group, 8) and not window[..., :capacity].any()
    np.testing.assert_allclose(window[..., capacity:].reshape(expected.shape), expected, atol=1e-5)


def empty_past(spec):
    shape = (spec.num_layers, 1, spec.num_kv_heads, 0, spec.head_dim)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32), np.zeros((1, 0), bool)


def test_the_answer_does_not_depend_on_how_the_prompt_is_cut_into_pieces(tiny_onnx_model_dir, monkeypatch):
    """With other piece sizes the prompt is computed in other pieces; the query piece and the answer stay."""
    alone, seen = run(tiny_onnx_model_dir, monkeypatch, query_window=8)
    paced, paced_seen = run(tiny_onnx_model_dir, monkeypatch, query_window=8, prefill_chunk=40)
    assert paced.output_ids == alone.output_ids
    np.testing.assert_allclose(paced_seen[0], seen[0], atol=1e-5)


def test_a_step_budget_never_cuts_the_query_window(tiny_onnx_model_dir, monkeypatch):
    """Steps of 32 prompt tokens end 16 tokens into a 100-token prompt's 20-token query window: the window
    waits for the next step and enters as one piece, so the policy reads all 20 queries (cut, it read the
    last 4, and the question's picks were the chat template's)."""
    prompt = [0] + [int(token) for token in rng.integers(3, 250, size=99)]
    _, seen = run(tiny_onnx_model_dir, monkeypatch, query_window=20, prefill_chunk=32, prompt=prompt)
    assert seen[0] is not None and seen[0].shape[3] == 20


def test_no_query_window_when_the_prompt_fits_or_is_off(tiny_onnx_model_dir, monkeypatch):
    _, seen = run(tiny_onnx_model_dir, monkeypatch, query_window=0)
    assert all(update is None for update in seen)
    _, seen = run(tiny_onnx_model_dir, monkeypatch, query_window=8, budget=200)  # nothing is evicted: nothing to pick
    assert all(update is None for update in seen)


def test_the_question_picks_its_share_of_the_long_range_slots():
    """Per head, the candidates the window attends to most get the bonus; the sinks and the window are
    never candidates; an old pick is taken back before the new ones are made."""
    num_layers, num_kv_heads, group, window_queries = 1, 2, 1, 2
    held_positions = np.array([[[0, 1, 2, 3]] * num_kv_heads])  # (1, 2, 4): 2 sinks, 2 long-range tokens
    held_score = np.array([[[0.0, 0.0, QUERY_BONUS + 1.0, 2.0]] * num_kv_heads], np.float32)  # position 2: an old pick
    new_positions = np.arange(4, 12)  # 8 new tokens: positions 4..11; the window is the last 2 (10, 11)
    leaving_positions = np.broadcast_to(np.arange(4, 10), (num_layers, num_kv_heads, 6))
    leaving_score = np.zeros((num_layers, num_kv_heads, 6), np.float32)
    attention = np.full((num_layers, num_kv_heads, group, window_queries, 4 + 8), 0.01, np.float32)
    attention[0, 0, 0, :, 4 + 4] = 1.0  # head 0 looks at position 8 (leaving)
    attention[0, 1, 0, :, 3] = 1.0  # head 1 at the held position 3
    attention[0, :, 0, :, 0] = 5.0  # a sink: never a candidate, and its attention spills onto no neighbour
    attention[0, :, 0, :, 4 + 7] = 9.0  # the window: never a candidate
    held, leaving = query.pick(held_score, held_positions, leaving_score, leaving_positions, new_positions, attention,
                               candidates_from=2, candidates_to=10, slots=1, spans=None)
    assert held[0, 0, 2] == pytest.approx(1.0) and held[0, 1, 2] == pytest.approx(1.0)  # the old pick taken back
    assert (leaving[0, 0] >= QUERY_BONUS).tolist() == [False, False, False, False, True, False]  # position 8 alone
    assert held[0, 1, 3] == pytest.approx(QUERY_BONUS + 2.0) and not (leaving[0, 1] >= QUERY_BONUS).any()
    assert held[0, 0, 3] == pytest.approx(2.0) and held[0, 0, 0] == 0.0 and held[0, 1, 0] == 0.0


def test_a_pick_is_pooled_over_its_span():
    """With spans, a token takes the largest attention of its span: a sentence is picked whole."""
    from kvpop.policies.kvpop.text_spans import TextSpans

    spans = TextSpans.of_prompt([0, 0, 1, 0, 0, 0, 1, 0], np.array([False, True]), "sentence")  # [0..2] [3..6] [7]
    received = np.zeros((1, 1, 8), np.float32)
    received[0, 0, 4] = 1.0
    pooled = query.pool_over_spans(query.question_value(received), spans)[0, 0]
    assert (pooled[3:7] == pooled[4]).all() and pooled[4] > 0 and not pooled[:3].any() and pooled[7] == 0


def test_attention_counts_relative_to_its_surroundings():
    """Attention falls with distance: a token that stands out from its neighbours outranks one that only
    sits in a region where every token gets much."""
    received = np.full((1, 1, 1000), 0.01, np.float32)
    received[0, 0, :100] = 0.5  # the first paragraph: much attention everywhere
    received[0, 0, 700] = 0.2  # a needle: less than the first paragraph's tokens, far above its own surroundings
    pooled = query.question_value(received)[0, 0]
    assert pooled[700] > pooled[:100].max()


def test_retrieval_heads_pick_once_for_every_cache():
    """With retrieval heads, what those heads attend to (each as a share of its largest value) picks the
    same positions in every cache; the other heads' attention counts for nothing."""
    num_layers, num_kv_heads = 2, 2
    positions = np.broadcast_to(np.arange(10), (num_layers, num_kv_heads, 10))
    received = np.full((num_layers, num_kv_heads, 10), 0.01, np.float32)
    received[1, 0, 6] = 0.3  # a retrieval head looks at position 6 ...
    received[0, 1, 6] = 3.0  # ... and so does the other one, on a larger scale
    received[0, 0, 2] = 50.0  # a head that is not listened to looks at position 2
    heads = np.array([[1, 0], [0, 1]])
    pooled = query.question_value(query.by_position(received, positions, 10), heads)
    assert (pooled == pooled[:1, :1]).all()  # one value a position, in every cache
    assert pooled[0, 0].argmax() == 6 and pooled[0, 0, 6] == pytest.approx(2.0)  # 1 + 1: each head's share of its largest


def test_retrieval_heads_ship_beside_the_scorer(tiny_onnx_model_dir, tmp_path):
    """retrieval_heads.json beside the exported scorers reaches the policy ("auto" listens to them) and turns the
    question's pick on by default (query.WINDOW, sentence spans); without it the default is off, "auto" picks per
    head and asking for "retrieval" is an error."""
    import json
    import shutil

    from kvpop.policies import make_policy
    from kvpop.policies.kvpop.runtime import LearnedScorer
    from kvpop.policies.kvpop.scorer_spec import RETRIEVAL_HEADS_FILE

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_onnx_model_dir, model_dir)
    (model_dir / RETRIEVAL_HEADS_FILE).unlink(missing_ok=True)
    without = {"mlstm": LearnedScorer.load(model_dir, "mlstm")}
    default = make_policy("kvpop", None, {"kvpop": without}, scorer="mlstm")
    assert (default.query_window, default.span_pooling) == (0, without["mlstm"].span_pooling)
    assert make_policy("kvpop", None, {"kvpop": without}, scorer="mlstm", query_window=4).query_heads == "head"
    with pytest.raises(ValueError, match="retrieval"):
        make_policy("kvpop", None, {"kvpop": without}, scorer="mlstm", query_window=4, query_heads="retrieval")
    (model_dir / RETRIEVAL_HEADS_FILE).write_text(json.dumps({"heads": [[1, 0], [0, 1]]}))
    scorer = LearnedScorer.load(model_dir, "mlstm")
    assert scorer.retrieval_heads.tolist() == [[1, 0], [0, 1]]
    assert make_policy("kvpop", None, {"kvpop": {"mlstm": scorer}}, scorer="mlstm", query_window=4).query_heads == "retrieval"
    default = make_policy("kvpop", None, {"kvpop": {"mlstm": scorer}}, scorer="mlstm")
    sentences = query.SPAN_POOLING if scorer.shared_ranking else ""  # spans need one model-wide ranking
    assert (default.query_window, default.span_pooling, default.query_heads) == (query.WINDOW, sentences, "retrieval")
    assert make_policy("kvpop", None, {"kvpop": {"mlstm": scorer}}, scorer="mlstm", query_window=0).query_window == 0  # off on request
    (model_dir / RETRIEVAL_HEADS_FILE).write_text(json.dumps({"heads": [[99, 0]]}))
    with pytest.raises(ValueError, match="outside"):
        LearnedScorer.load(model_dir, "mlstm")
