"""Line pooling (kvpop.policies.kvpop.text_spans): lines of the prompt ranked by their mean learned score, or by how
far that mean stands out from the text around the line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpop.policies.kvpop.text_spans import CONTRAST_WIDTH, OWN_SHARE, TextSpans, line_break_table

torch = pytest.importorskip("torch")


def test_prompt_is_cut_after_line_breaks_and_at_the_longest_span():
    breaks = np.zeros(10, bool)
    breaks[7] = True  # token 7 ends a line
    spans = TextSpans.of_prompt([1, 7, 2, 2, 2, 2, 2, 7, 3], breaks, max_span=3)
    #   ids:  1 7 | 2 2 2 | 2 2 7 | 3
    assert spans.span.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert spans.prompt_length == 9 and spans.line_start.tolist() == [0, 2, 5, 8, 9]
    # empty lines, and a line cut twice: 7 | 7 | 2 2 2 | 2 2 2 | 2 7
    assert TextSpans.of_prompt([7, 7, 2, 2, 2, 2, 2, 2, 2, 7], breaks, max_span=3).span.tolist() == [0, 1, 2, 2, 2, 3, 3, 3, 4, 4]
    assert TextSpans.of_prompt([], breaks).line_start.tolist() == [0]


def test_a_line_is_ranked_by_the_mean_of_every_token_scored_so_far():
    spans = TextSpans.of_prompt([0, 0, 1, 0, 0, 1], np.array([False, True]))  # lines [0..2], [3..5]
    spans.add_scores(np.array([0, 1]), np.array([1.0, 3.0], np.float32))
    spans.add_scores(np.array([1, 2, 3, 9]), np.array([99.0, 5.0, -1.0, 7.0], np.float32))  # 1 again, 9 not in the prompt
    positions = np.array([[0, 1, 2, 3, 4, 9, -1]])
    current = np.array([[10, 10, 10, 10, 10, 10, 10]], np.float32)
    got = spans.priority(positions, current)
    mean = 3.0  # (1 + 3 + 5) / 3: a token is counted once, with its first score
    np.testing.assert_allclose(got[0, :3], [mean + OWN_SHARE * (own - mean) for own in (1, 3, 5)], rtol=1e-6)
    assert got[0, 3] == pytest.approx(-1.0)  # a line with one scored token is that token's score
    assert got[0, 4:].tolist() == [10, 10, 10]  # not scored yet, generated, empty slot: unchanged
    # Evicting tokens changes nothing: the sums are over every scored token, not the held ones.
    assert spans.priority(positions[:, :1], current[:, :1])[0, 0] == got[0, 0]
    spans.add_scores(np.array([4]), np.array([3.0], np.float32))  # new scores move the line's priority at once
    assert spans.priority(positions, current)[0, 3] == pytest.approx(1.0 + OWN_SHARE * (-1.0 - 1.0))


def test_line_contrast_ranks_a_line_by_how_far_it_stands_out_from_the_lines_around_it():
    spans = TextSpans.of_prompt([0, 1, 0, 1, 0, 1, 0, 1], np.array([False, True]), "line_contrast")
    assert spans.contrast_width == CONTRAST_WIDTH
    spans.contrast_width = 4  # two positions either side of a line
    spans.add_scores(np.arange(8), np.array([5, 5, 4, 4, 3, 3, 1, 1], np.float32))  # lines of 2: 5, 4, 3, 1
    mean, value = spans.line_values()
    prompt_mean = 26 / 8
    np.testing.assert_allclose(mean, [5, 4, 3, 1])
    # each line's mean, minus the mean of the lines next to it, plus the prompt's mean
    np.testing.assert_allclose(value, [5 - 4 + prompt_mean, 4 - 4 + prompt_mean, 3 - 2.5 + prompt_mean, 1 - 3 + prompt_mean])
    # the first line (a system prompt, in high-scoring text) leads a line standing out further on by less
    assert value[0] - value[2] < mean[0] - mean[2]
    got = spans.priority(np.array([4, 5]), np.zeros(2, np.float32))
    np.testing.assert_allclose(got, [value[2]] * 2, rtol=1e-6)
    # a line with nothing scored around it yet is ranked by its mean
    alone = TextSpans.of_prompt([0, 1, 0, 1], np.array([False, True]), "line_contrast")
    alone.add_scores(np.array([0, 1]), np.array([2.0, 4.0], np.float32))
    assert alone.line_values()[1][0] == pytest.approx(3.0)


def test_line_break_table_marks_the_tokens_holding_a_newline():
    class Tokenizer:
        pieces = ["a", "b\n", "\n\n", "c"]

        def __len__(self):
            return len(self.pieces)

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)

    assert line_break_table(Tokenizer(), 6).tolist() == [False, True, True, False, False, False]  # 4, 5: padding


@pytest.fixture(scope="module", params=["line", "line_contrast"])
def line_scorer_dir(tiny_hf_model_dir, tmp_path_factory, request):
    """The tiny model's trained mLSTM scorer as one shared ranking, pooled by line, exported."""
    from kvpop_train.scorer.network import Scorer, load_scorer
    from export.scorer_onnx import export_scorer

    trained = load_scorer(tiny_hf_model_dir / "scorer" / "scorer_mlstm.pt")
    pooled = Scorer(dataclasses.replace(trained.config, shared_ranking=True, span_pooling=request.param)).eval()
    pooled.load_state_dict(trained.state_dict())
    directory = tmp_path_factory.mktemp("line-scorer")
    assert export_scorer(pooled, directory).passed
    return directory


def test_span_pooling_needs_the_shared_ranking():
    from kvpop_train.scorer.network import ScorerConfig

    with pytest.raises(ValueError, match="span_pooling"):
        ScorerConfig(kind="mlstm", num_layers=2, num_kv_heads=2, head_dim=8, span_pooling="line")
    with pytest.raises(ValueError, match="span_pooling"):
        ScorerConfig(kind="mlstm", num_layers=2, num_kv_heads=2, head_dim=8, shared_ranking=True, span_pooling="paragraph")


def test_policy_keeps_whole_lines_and_ranks_them_by_their_mean(line_scorer_dir, decoder):
    """A prompt read in one append: the long-range slots hold the lines ranked highest (by mean score, or
    by contrast), whole, and at most one line in part (the one at the budget's edge, its best tokens)."""
    from kvpop.cache import SlotCache
    from kvpop.policies.kvpop import KVpopPolicy
    from kvpop.policies.kvpop.runtime import LearnedScorer

    scorer = LearnedScorer.load(line_scorer_dir, "mlstm")
    assert scorer.span_pooling in ("line", "line_contrast")
    spec = decoder.spec
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, spec.vocab_size, 120).tolist()
    breaks = np.zeros(spec.vocab_size, bool)
    breaks[2] = True
    for end in (9, 14, 30, 37, 52, 60, 75, 81, 99):  # lines of 5 to 22 tokens
        prompt[end] = 2
    kept: dict[str, np.ndarray] = {}
    for name, pooled in (("line", True), ("token", False)):
        policy = KVpopPolicy(sinks=2, window=scorer.window, scorer=scorer)
        cache = SlotCache(spec, policy, budget=40)
        if pooled:
            cache.prompt_state = TextSpans.of_prompt(prompt, breaks, scorer.span_pooling)
        out = decoder.run(np.array([prompt]), np.arange(len(prompt))[None], *decoder.empty_cache(), last_only=True, attention=False)
        cache.append(out.new_key[:, 0], out.new_value[:, 0], None, None)
        held = np.sort(cache.position, axis=2).reshape(-1, cache.capacity)
        assert (held == held[0]).all()  # one shared ranking: every cache the same tokens
        kept[name] = held[0]
        if pooled:
            spans = cache.prompt_state
            scored = np.flatnonzero(~np.isnan(spans.own))  # positions 2 .. 111 left the window
            assert scored.tolist() == list(range(2, len(prompt) - scorer.window))
            long_range = [p for p in held[0] if 2 <= p < len(prompt) - scorer.window]
            lines = spans.span[long_range]
            partial = [line for line in set(lines.tolist()) if not np.isin(scored[spans.span[scored] == line], long_range).all()]
            assert len(partial) <= 1
            _, ranked_by = spans.line_values()
            whole = sorted(set(lines.tolist()) - set(partial))
            dropped = sorted(set(spans.span[scored].tolist()) - set(lines.tolist()))
            assert min(ranked_by[whole]) >= max(ranked_by[dropped], default=-np.inf)
    assert not np.array_equal(kept["line"], kept["token"])  # pooling changes what is kept


def test_engine_pools_lines_alike_in_the_decode_batch_and_one_by_one(tiny_onnx_model_dir, line_scorer_dir, decoder, monkeypatch):
    """A decode step whose leaving token is in the prompt moves that token's line in the vectorised
    decode batch (kvpop.policies.kvpop.decode_batch) exactly as the one-sequence path (`observe`) does: the same
    answers with the batch path on and off, alone and beside other requests."""
    from transformers import AutoTokenizer

    from kvpop.engine import Engine, EngineConfig
    from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
    from kvpop.policies.kvpop import KVpopPolicy
    from kvpop.policies.kvpop.runtime import LearnedScorer

    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")
    scorers = {"mlstm": LearnedScorer.load(line_scorer_dir, "mlstm")}
    lines = [f"line {i}: the value of item {i} is {i * 37 % 101}.\n" for i in range(12)]
    prompts = [tokenizer.encode("".join(lines[i:] + lines[:i]), add_special_tokens=False) for i in range(3)]
    config = CacheConfig(policy="kvpop", budget=40, options=dict(sinks=2, scorer="mlstm"))
    batched_while_prompt_leaves = []
    decodes_in_batch = KVpopPolicy.decodes_in_batch

    def spy(self, cache):
        in_batch = decodes_in_batch(self, cache)
        if in_batch and cache.prompt_state is not None and cache.tokens_seen - self.window < cache.prompt_state.prompt_length:
            batched_while_prompt_leaves.append(cache.tokens_seen)
        return in_batch

    def run(batch: list[int]) -> dict[int, list[int]]:
        engine = Engine(decoder, EngineConfig(prefill_chunk=32), tokenizer=tokenizer, policy_assets={"kvpop": scorers})
        requests = [GenerationRequest(f"r{i}", prompts[i], SamplingParams(max_tokens=24, ignore_eos=True), config) for i in batch]
        return {int(result.request_id[1:]): result.output_ids for result in engine.generate(requests)}

    monkeypatch.setattr(KVpopPolicy, "decodes_in_batch", spy)
    together = run([0, 1, 2])
    assert batched_while_prompt_leaves  # the batch path pooled prompt tokens
    monkeypatch.setattr(KVpopPolicy, "decodes_in_batch", lambda self, cache: False)  # the one-sequence path only
    assert run([0, 1, 2]) == together
    for i in range(3):
        assert run([i])[i] == together[i]
        assert len(together[i]) == 24
