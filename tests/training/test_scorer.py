"""The learned KVpop scorer: targets, network, traces, training, ONNX export, runtime, policy integration."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpop_train.scorer.network import Scorer, ScorerConfig, load_scorer, save_scorer  # noqa: E402
from kvpop_train.scorer.targets import attention_received, dense_attention_received  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: a second thread only contends with whatever else the machine runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CONFIGS = {
    kind: ScorerConfig(kind=kind, num_layers=2, num_kv_heads=2, head_dim=8, window=4) for kind in ("mlstm", "mlp")
}


def random_sequence(length: int, seed: int = 0, config: ScorerConfig = CONFIGS["mlstm"]):
    generator = torch.Generator().manual_seed(seed)
    shape = (config.num_layers, config.num_kv_heads, length, config.head_dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


# -- targets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 3, 10])
@pytest.mark.parametrize("block_size", [1, 7, 64])
@pytest.mark.parametrize("first_query", [0, 30, 50])  # 50: no query counts (the banded path)
def test_blockwise_targets_match_dense(window, block_size, first_query):
    generator = torch.Generator().manual_seed(window)
    query = 2 * torch.randn(6, 50, 8, generator=generator)  # 6 query heads share 2 KV heads
    key = 2 * torch.randn(2, 50, 8, generator=generator)
    blockwise = attention_received(query, key, window, block_size=block_size, first_query=first_query)
    dense = dense_attention_received(query, key, window, first_query=first_query)
    assert blockwise.future.shape == blockwise.window.shape == (2, 50 - window)
    torch.testing.assert_close(blockwise.future, dense.future, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(blockwise.window, dense.window, atol=1e-5, rtol=1e-5)


def test_targets_of_a_too_short_trace_are_empty():
    received = attention_received(torch.randn(4, 5, 8), torch.randn(2, 5, 8), window=5)
    assert received.future.shape == received.window.shape == (2, 0)


# -- traces: what the scorer sees is what the slot cache holds --------------------------------


def test_shaped_targets_span_forward_and_share_across_heads():
    from kvpop_train.scorer.targets import LOG_FLOOR, shape_target

    target = torch.full((2, 3, 8), -5.0)  # (L, Hkv, N)
    target[0, 1, 5] = 2.0  # one head reads token 5 later
    spanned = shape_target(target, span=3)
    assert spanned[0, 1].tolist() == [-5.0, -5.0, 2.0, 2.0, 2.0, 2.0, -5.0, -5.0]  # tokens 2-5 lead up to it
    assert torch.equal(spanned[1], target[1])  # other heads untouched
    assert shape_target(target, span=3)[0, 1, -1] > LOG_FLOOR  # the padding never wins
    layer = shape_target(target, scope="layer")
    assert (layer[0, :, 5] == 2.0).all() and torch.equal(layer[1], target[1])
    model = shape_target(target, scope="model")
    assert (model[:, :, 5] == 2.0).all() and (model[:, :, 4] == -5.0).all()
    assert torch.equal(shape_target(target), target)
    with pytest.raises(ValueError, match="scope"):
        shape_target(target, scope="group")



def test_value_weighted_target_discounts_attention_on_small_values():
    from kvpop_train.scorer.targets import LOG_FLOOR, value_weighted

    target = torch.log(torch.tensor([[[0.4, 0.4, 0.1]]]))  # (L=1, Hkv=1, N=3): tokens 0 and 1 equally attended
    value = torch.zeros(1, 1, 5, 4)  # (L, Hkv, S=5, D): S > N, the last tokens never leave the window
    value[0, 0, 0] = 0.01  # token 0 a sink-like value: attended, adds little
    value[0, 0, 1] = 1.0
    value[0, 0, 2] = 2.0
    weighted = value_weighted(target, value)
    assert weighted.shape == target.shape
    assert weighted[0, 0, 1] > weighted[0, 0, 0]  # same attention, larger contribution
    torch.testing.assert_close(weighted[0, 0, 2] - target[0, 0, 2], torch.log(torch.tensor(4.0)))  # |v| = 2 * 2
    floor = torch.full((1, 1, 1), LOG_FLOOR)
    assert value_weighted(floor, torch.zeros(1, 1, 1, 4))[0, 0, 0] == LOG_FLOOR  # never below the floor

def test_traces_record_cached_keys_and_model_attention(tiny_hf_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from export.decoder_step import SlotCacheDecoderStep
    from kvpop_train.scorer.traces import collect_traces

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model_dir)
    text = "Tokens leave the protected window and compete for long-range slots. " * 3
    (trace,) = collect_traces(model, tokenizer, [text], window=8, progress=False)
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    length = input_ids.shape[1]
    step = SlotCacheDecoderStep(model).eval()
    empty = torch.zeros(model.config.num_hidden_layers, 1, model.config.num_key_value_heads, 0, 16)
    with torch.no_grad():
        _, new_key, new_value, _, chunk_attention = step(
            input_ids, torch.arange(length)[None], empty, empty, torch.zeros(1, 0, dtype=torch.bool)
        )
    torch.testing.assert_close(trace.key.float(), new_key[:, 0], atol=2e-3, rtol=2e-3)  # fp16 storage
    torch.testing.assert_close(trace.value.float(), new_value[:, 0], atol=2e-3, rtol=2e-3)
    # Both from the model's own attention matrix (L, Hq, S, S) [query d, token t], window w = 8.
    probs = chunk_attention[:, 0]
    layers, query_heads = probs.shape[:2]
    query_position, token_position = torch.arange(length)[:, None], torch.arange(length)[None, :]
    future = query_position >= token_position + 8
    mean = (probs * future).sum(2)[..., : length - 8] / (length - 8 - torch.arange(length - 8))
    expected = mean.reshape(layers, 2, query_heads // 2, -1).amax(2).log()
    torch.testing.assert_close(trace.target, expected, atol=1e-4, rtol=1e-4)
    relative = probs * (query_position + 1)  # causal, so only d >= t is nonzero
    in_window = (relative * (query_position <= token_position + 8)).sum(2)[..., : length - 8]
    expected = in_window.reshape(layers, 2, query_heads // 2, -1).sum(2).log()
    torch.testing.assert_close(trace.window_attention, expected, atol=1e-4, rtol=1e-4)


def test_continuation_targets_take_the_max_over_runs(tiny_hf_model_dir):
    """A context with two continuations: only continuation queries count, and a context token's target
    is the max over both runs (per query head, then max over the group, log)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpop_train.scorer.targets import future_importance
    from kvpop_train.scorer.traces import TraceText, collect_traces

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_model_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model_dir)
    text = TraceText("Facts sit in a long context between filler words.", ("Which fact?", "The other one, please."))
    (trace,) = collect_traces(model, tokenizer, [text], window=4, progress=False)
    context = tokenizer(text.context, return_tensors="pt").input_ids.shape[1]
    means = []
    for run in text.runs():
        input_ids = tokenizer(run, return_tensors="pt").input_ids
        with torch.no_grad():
            probs = torch.stack(model(input_ids, output_attentions=True).attentions)[:, 0]  # (L, Hq, S, S)
        length = input_ids.shape[1]
        query, token = torch.arange(length)[:, None], torch.arange(length)[None, :]
        counted = (query >= token + 4) & (query >= context)  # (S, S) [query d, token t]
        mean = (probs * counted).sum(2) / counted.sum(0).clamp_min(1)  # (L, Hq, S)
        means.append(mean[..., : context - 4].reshape(mean.shape[0], 2, -1, context - 4))
    expected = future_importance(torch.stack(means).amax(0))
    assert trace.length == tokenizer(text.runs()[0], return_tensors="pt").input_ids.shape[1]
    torch.testing.assert_close(trace.target[..., : context - 4], expected, atol=1e-4, rtol=1e-4)


def test_context_reuse_gives_the_full_rerun_trace(tiny_hf_model_dir):
    """The context run once and each continuation on its cache (queries offset by the context) gives
    the trace of re-running the whole text per continuation: keys, values, targets, window attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpop_train.scorer.traces import TraceText, collect_traces

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model_dir)
    texts = [
        TraceText("Facts sit in a long context between filler words. " * 4, ("Which fact?", "The other one, please.")),
        TraceText("A context cut by max_tokens loses its end, not its continuation. " * 8, ("Still seen.",)),
        "A plain text without continuations runs once either way. " * 3,
    ]
    reused = collect_traces(model, tokenizer, texts, window=4, max_tokens=64, block_size=5, progress=False)
    rerun = collect_traces(model, tokenizer, texts, window=4, max_tokens=64, progress=False, reuse_context=False)
    assert len(reused) == len(rerun) == 3
    for fast, slow in zip(reused, rerun):
        assert fast.length == slow.length
        torch.testing.assert_close(fast.key, slow.key, atol=2e-3, rtol=2e-3)  # fp16 storage
        torch.testing.assert_close(fast.value, slow.value, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(fast.target, slow.target, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fast.window_attention, slow.window_attention, atol=1e-4, rtol=1e-4)


# -- network ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_network_shapes_and_chunk_invariance(kind):
    config = CONFIGS[kind]
    torch.manual_seed(0)  # an unseeded init once drew weights whose fp32 chunked sums differed by >1e-5
    scorer = Scorer(config)
    key, value = random_sequence(37)
    score, state = scorer(key, value, key, value, scorer.initial_state())
    assert score.shape == (2, 2, 37)
    assert tuple(tuple(s.shape) for s in state) == tuple(config.state_shapes().values())
    whole = scorer.score_sequence(key, value, chunk_size=64)
    assert whole.shape == (2, 2, 37 - config.window)
    for chunk_size in (1, 5):  # the runtime's decode steps and prefill chunks give the same scores
        chunked = scorer.score_sequence(key, value, chunk_size=chunk_size)
        torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)  # fp32: chunkwise vs stepwise rounding


def test_mlstm_matches_the_plain_recurrence():
    """The stabilised chunkwise form equals h_t = C_t q / max(|n_t . q|, 1), C_t = f C + i v k^T."""
    from kvpop_train.scorer.network import mlstm_chunk

    generator = torch.Generator().manual_seed(3)
    heads, steps, dim = 3, 9, 4
    query, key, value = (torch.randn(heads, steps, dim, generator=generator, dtype=torch.float64) for _ in range(3))
    log_input = 3 * torch.randn(heads, steps, generator=generator, dtype=torch.float64)
    log_forget = torch.nn.functional.logsigmoid(torch.randn(heads, steps, generator=generator, dtype=torch.float64))
    zeros = (torch.zeros(heads, dim, dim, dtype=torch.float64), torch.zeros(heads, dim, dtype=torch.float64),
             torch.zeros(heads, dtype=torch.float64))
    read, memory, normaliser, stabiliser = mlstm_chunk(query, key, value, log_input, log_forget, *zeros)
    plain_memory, plain_normaliser = zeros[0].clone(), zeros[1].clone()
    for t in range(steps):
        forget, gate = log_forget[:, t].exp(), log_input[:, t].exp()
        outer = key[:, t, :, None] * value[:, t, None, :]  # (H, M, M) v k^T, stored [key, value]
        plain_memory = forget[:, None, None] * plain_memory + gate[:, None, None] * outer
        plain_normaliser = forget[:, None] * plain_normaliser + gate[:, None] * key[:, t]
        numerator = torch.einsum("hkv,hk->hv", plain_memory, query[:, t])
        denominator = (plain_normaliser * query[:, t]).sum(-1).abs().clamp_min(1.0)
        torch.testing.assert_close(read[:, t], numerator / denominator[:, None])
    torch.testing.assert_close(memory * stabiliser.exp()[:, None, None], plain_memory)
    torch.testing.assert_close(normaliser * stabiliser.exp()[:, None], plain_normaliser)


def test_mlstm_step_is_the_chunk_form_for_one_token():
    """The decode graph's recurrent one-token step gives the chunk form's read and state, from a warm
    state whose stabiliser is far from zero (the relative scales must agree, not only the products)."""
    from kvpop_train.scorer.network import mlstm_chunk, mlstm_step

    generator = torch.Generator().manual_seed(4)
    heads, dim = 5, 4
    warm = [torch.randn(heads, 6, dim, generator=generator, dtype=torch.float64) for _ in range(3)]
    gates = 4 * torch.randn(heads, 6, generator=generator, dtype=torch.float64), -torch.rand(heads, 6, generator=generator, dtype=torch.float64)
    zeros = (torch.zeros(heads, dim, dim, dtype=torch.float64), torch.zeros(heads, dim, dtype=torch.float64),
             torch.zeros(heads, dtype=torch.float64))
    _, *state = mlstm_chunk(*warm, *gates, *zeros)
    query, key, value = (torch.randn(heads, 1, dim, generator=generator, dtype=torch.float64) for _ in range(3))
    log_input, log_forget = torch.tensor([[9.0], [-3.0], [0.0], [2.0], [-8.0]], dtype=torch.float64), -torch.rand(heads, 1, dtype=torch.float64)
    chunk = mlstm_chunk(query, key, value, log_input, log_forget, *state)
    step = mlstm_step(query[:, 0], key[:, 0], value[:, 0], log_input[:, 0], log_forget[:, 0], *state)
    torch.testing.assert_close(step[0], chunk[0][:, 0])
    for got, want in zip(step[1:], chunk[1:]):
        torch.testing.assert_close(got, want)


def test_decode_step_is_each_sequences_own_step():
    """The decode graph's module (standardisation and scales folded into its weights; B sequences in
    the token axis, each with its own state): each sequence gets exactly its forward's step."""
    from export.scorer_onnx import _DecodeStep

    config = CONFIGS["mlstm"]
    torch.manual_seed(1)
    scorer = Scorer(config).eval()
    with torch.no_grad():  # a standardisation as trained scorers have, so the folding is exercised
        scorer.feature_mean.normal_()
        scorer.feature_std.uniform_(0.5, 2.0)
    sequences = []
    for seed in range(3):
        key, value = random_sequence(7, seed)  # (L, Hkv, 7, D): a warm state from 6 tokens, then one step
        _, state = scorer(key[:, :, :6], value[:, :, :6], key[:, :, :6], value[:, :, :6], scorer.initial_state())
        sequences.append((key[:, :, 6:], value[:, :, 6:], key[:, :, 2:3], value[:, :, 2:3], state))
    with torch.no_grad():
        want = [scorer(*tokens, state) for *tokens, state in sequences]
        tokens = [torch.cat([sequence[i] for sequence in sequences], dim=2) for i in range(4)]  # (L, Hkv, B, D)
        states = [torch.stack([sequence[4][i] for sequence in sequences], dim=2) for i in range(3)]  # (L, Hkv, B, ...)
        score, *new_state = _DecodeStep(scorer)(*tokens, *states)
    torch.testing.assert_close(score, torch.cat([w[0] for w in want], dim=2), atol=1e-5, rtol=1e-5)
    for i, got in enumerate(new_state):
        torch.testing.assert_close(got, torch.stack([w[1][i] for w in want], dim=2), atol=1e-5, rtol=1e-5)


# -- training -----------------------------------------------------------------------------------


def test_training_runs_and_checkpoint_roundtrips(tmp_path):
    from kvpop_train.scorer.traces import Trace
    from kvpop_train.scorer.train import TrainConfig, TrainingSet, train_scorer

    def trace(seed):
        key, value = random_sequence(60, seed)
        target = key[..., :56, 0] + value[..., :56, 1]  # learnable from the token itself
        return Trace(key.half(), value.half(), target, window_attention=torch.zeros_like(target))

    config = TrainConfig(window=4, sinks=1, long_range_slots=(4, 8), steps=40,
                         minutes_per_kind=1.0, learning_rate=1e-2)
    training = TrainingSet.build([trace(seed) for seed in range(4)], config)
    scorer, report = train_scorer("mlstm", training, TrainingSet.build([trace(9)], config), config, progress=False)
    assert report["steps"] == 40
    assert report["validation_pair_accuracy"] > max(0.7, report["validation_pair_accuracy_initial"])
    save_scorer(scorer, tmp_path / "scorer.pt")
    key, value = random_sequence(20, seed=5)
    loaded = load_scorer(tmp_path / "scorer.pt")
    torch.testing.assert_close(loaded.score_sequence(key, value), scorer.score_sequence(key, value))


# -- ONNX export and runtime ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Both variants exported once (parity is checked by the export itself)."""
    from export.scorer_onnx import export_scorer

    directory = tmp_path_factory.mktemp("scorer")
    torch.manual_seed(0)
    scorers = {kind: Scorer(config).eval() for kind, config in CONFIGS.items()}
    reports = {kind: export_scorer(scorer, directory) for kind, scorer in scorers.items()}
    return directory, scorers, reports


def test_onnx_export_matches_torch(exported):
    _, _, reports = exported
    for report in reports.values():
        assert report.passed, report.max_abs_diff


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_runtime_state_roundtrip(exported, kind):
    from kvpop.policies.kvpop.runtime import ScorerRuntime, ScorerState

    directory, scorers, _ = exported
    runtime = ScorerRuntime(directory, kind)
    key, value = (x.numpy() for x in random_sequence(12, seed=1))
    leaving_key, leaving_value = (x.numpy() for x in random_sequence(12, seed=2))
    state = runtime.initial_state().recurrent
    at_once, final = runtime.step(state, key, value, leaving_key, leaving_value)
    # Split after 5 tokens, with the state saved and restored (copied) in between.
    first, middle = runtime.step(state, key[:, :, :5], value[:, :, :5], leaving_key[:, :, :5], leaving_value[:, :, :5])
    snapshot = ScorerState(middle, *(np.zeros((2, 2, 0, 8), np.float32) for _ in range(2))).copy()
    for array in middle.values():
        array[...] = np.nan  # the snapshot owns its arrays
    rest = (array[:, :, 5:] for array in (key, value, leaving_key, leaving_value))
    second, resumed = runtime.step(snapshot.recurrent, *rest)
    np.testing.assert_allclose(np.concatenate([first, second], axis=2), at_once, atol=1e-5)
    for name in final:
        np.testing.assert_allclose(resumed[name], final[name], atol=1e-5)
    with torch.no_grad():
        torch_scores, _ = scorers[kind](*(torch.from_numpy(x) for x in (key, value, leaving_key, leaving_value)),
                                        scorers[kind].initial_state())
    np.testing.assert_allclose(at_once, torch_scores.numpy(), atol=1e-4)


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_shared_ranking_scores_a_token_alike_in_every_cache(exported, kind, tmp_path):
    """A scorer trained on the model-wide target (shared_ranking) gives each token the mean of its
    L * Hkv scores, and through the kvpop policy every head's cache then keeps the same tokens."""
    import dataclasses

    from kvpop.cache import SlotCache
    from kvpop.model_spec import ModelSpec
    from kvpop.policies.kvpop import KVpopPolicy
    from kvpop.policies.kvpop.runtime import LearnedScorer, ScorerRuntime
    from export.scorer_onnx import export_scorer

    directory, scorers, _ = exported
    shared = Scorer(dataclasses.replace(CONFIGS[kind], shared_ranking=True)).eval()
    shared.load_state_dict(scorers[kind].state_dict())
    assert export_scorer(shared, tmp_path).passed
    plain, ranked = ScorerRuntime(directory, kind), ScorerRuntime(tmp_path, kind)
    assert ranked.spec.shared_ranking and not plain.spec.shared_ranking
    tokens = [x.numpy() for x in (*random_sequence(12, seed=1), *random_sequence(12, seed=2))]
    want, _ = plain.step(plain.initial_state().recurrent, *tokens)  # (L, Hkv, T)
    got, _ = ranked.step(ranked.initial_state().recurrent, *tokens)
    np.testing.assert_allclose(got, np.broadcast_to(want.mean(axis=(0, 1)), got.shape), atol=1e-5)

    spec = ModelSpec("LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                     vocab_size=16, dtype="float32", max_position_embeddings=4096)
    positions = {}
    for name, scorer_dir in (("plain", directory), ("shared", tmp_path)):
        scorer = LearnedScorer.load(scorer_dir, kind)
        cache = SlotCache(spec, KVpopPolicy(sinks=1, window=scorer.window, scorer=scorer), budget=12)
        key, value = random_sequence(60, seed=4)
        for begin, end in [(0, 20), *((t, t + 1) for t in range(20, 60))]:  # a prefill chunk, then decode steps
            tokens_in = end - begin
            cache.append(key[:, :, begin:end].numpy(), value[:, :, begin:end].numpy(),
                         np.zeros((2, 4, tokens_in, cache.capacity), np.float32),
                         np.zeros((2, 4, tokens_in, tokens_in), np.float32))
        positions[name] = np.sort(cache.position, axis=2).reshape(4, -1)  # (L * Hkv, slots)
    assert (positions["shared"] == positions["shared"][0]).all()  # one set of tokens in every cache
    assert not (positions["plain"] == positions["plain"][0]).all()  # (per-head rankings differ)


def test_runtime_decode_graph_matches_one_sequence_steps(exported):
    """The exported decode graph (scorer_mlstm.decode.onnx) for B sequences gives each sequence what
    its own call of the chunk graph gives, scores and states, from B different warm states."""
    from kvpop.policies.kvpop.runtime import ScorerRuntime

    directory, _, _ = exported
    runtime = ScorerRuntime(directory, "mlstm")
    assert runtime.decode_session is not None and runtime.spec.decode_onnx_file == "scorer_mlstm.decode.onnx"
    states = []
    for seed in range(4):
        key, value = (x.numpy() for x in random_sequence(9, seed=seed))
        _, state = runtime.step(runtime.initial_state().recurrent, key, value, value, key)
        states.append(state)
    rng = np.random.default_rng(0)
    tokens = tuple(rng.standard_normal((4, 2, 2, 8)).astype(np.float32) for _ in range(4))  # (B, L, Hkv, D)
    scores, new_states = runtime.step_decode_batch(states, tokens)
    assert scores.shape == (4, 2, 2)
    for row, state in enumerate(states):
        want, want_state = runtime.step(state, *(array[row, :, :, None] for array in tokens))
        np.testing.assert_allclose(scores[row], want[:, :, 0], atol=1e-5)
        for name in want_state:
            np.testing.assert_allclose(new_states[row][name], want_state[name], atol=1e-5, rtol=1e-5)


def test_runtime_decode_graph_reuses_its_outputs_only_for_the_same_states(exported):
    """Consecutive decode calls with the states the last call returned feed its outputs as they are;
    a state replaced in between (a copy, a new order, fewer sequences) is stacked anew: every call
    gives each sequence what its own single step gives."""
    from kvpop.policies.kvpop.runtime import ScorerRuntime

    directory, _, _ = exported
    runtime = ScorerRuntime(directory, "mlstm")
    rng = np.random.default_rng(1)
    states = [runtime.initial_state().recurrent for _ in range(3)]
    for call in range(5):
        if call == 2:  # one state replaced by an equal copy: must not be taken for the old output
            states[1] = {name: array.copy() for name, array in states[1].items()}
        if call == 3:  # another order, then fewer sequences
            states = states[::-1]
        if call == 4:
            states = states[:2]
        tokens = tuple(rng.standard_normal((len(states), 2, 2, 8)).astype(np.float32) for _ in range(4))
        want = [runtime.step(state, *(array[row, :, :, None] for array in tokens)) for row, state in enumerate(states)]
        scores, states = runtime.step_decode_batch(states, tokens)
        for row, (want_scores, want_state) in enumerate(want):
            np.testing.assert_allclose(scores[row], want_scores[:, :, 0], atol=1e-5)
            for name in want_state:
                np.testing.assert_allclose(states[row][name], want_state[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_kvpop_policy_with_learned_scorer_gives_training_scores(exported, kind):
    """Through the slot cache and kvpop policy (a prefill chunk, then decode steps), every token gets
    exactly the score the training code computes for it when it leaves the window."""
    from kvpop.cache import SlotCache
    from kvpop.model_spec import ModelSpec
    from kvpop.policies.kvpop import SCORE, KVpopPolicy
    from kvpop.policies.kvpop.runtime import LearnedScorer

    directory, scorers, _ = exported
    config = CONFIGS[kind]
    spec = ModelSpec("LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                     vocab_size=16, dtype="float32", max_position_embeddings=4096)
    scorer = LearnedScorer.load(directory, kind)
    cache = SlotCache(spec, KVpopPolicy(sinks=1, window=scorer.window, scorer=scorer), budget=16)
    key, value = random_sequence(40, seed=4)
    for begin, end in [(0, 11), *((t, t + 1) for t in range(11, 40))]:
        tokens = end - begin
        cache.append(key[:, :, begin:end].numpy(), value[:, :, begin:end].numpy(),
                     np.zeros((2, 4, tokens, cache.capacity), np.float32), np.zeros((2, 4, tokens, tokens), np.float32))
    with torch.no_grad():
        expected = scorers[kind].score_sequence(key, value).numpy()  # (L, Hkv, 40 - w)
    scored = (cache.position >= 1) & (cache.position < 40 - config.window)  # left the window, not a sink
    got = cache.statistics[SCORE][scored]
    want = np.take_along_axis(expected, np.where(scored, cache.position, 0), axis=2)[scored]
    assert scored.sum() >= 2 * 2 * 10
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_learned_scorer_with_attention_feature_sees_what_traces_record(tiny_hf_model_dir, tmp_path):
    """Decoding the tiny model through the slot cache (a prefill chunk, then single tokens): the
    attention statistic the learned scorer keeps is the trace's in-window attention, and every
    token's score is the one training computes from the trace."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from export.decoder_step import SlotCacheDecoderStep
    from kvpop.cache import SlotCache
    from kvpop.model_spec import ModelSpec
    from kvpop.policies.kvpop import SCORE, KVpopPolicy
    from kvpop.policies.kvpop.runtime import LearnedScorer
    from export.scorer_onnx import export_scorer
    from kvpop_train.scorer.traces import collect_traces

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model_dir)
    input_ids = tokenizer("KVpop keeps a fixed budget of key and value slots for every head. " * 2).input_ids
    (trace,) = collect_traces(model, tokenizer, [tokenizer.decode(input_ids)], window=8, progress=False)
    length = trace.length
    torch.manual_seed(0)
    scorer = Scorer(ScorerConfig(num_layers=2, num_kv_heads=2, head_dim=16, window=8, attention_feature=True))
    scorer.fit_standardisation(trace.key.float(), trace.value.float(), trace.window_attention)
    assert export_scorer(scorer, tmp_path).passed
    seen_attention = {}  # position -> (L, Hkv) statistic handed to the scorer as the token left

    class Spy(LearnedScorer):
        def score(self, cache, state, leaving):
            for index, position in enumerate(leaving.positions[0, 0]):  # every head holds them in one order
                seen_attention[int(position)] = leaving.statistics[self.ATTENTION][:, :, index]
            return super().score(cache, state, leaving)

    learned = Spy.load(tmp_path, "mlstm")

    spec = ModelSpec("LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=model.config.vocab_size, dtype="float32", max_position_embeddings=4096)
    cache = SlotCache(spec, KVpopPolicy(sinks=1, window=8, scorer=learned), budget=length)  # nothing evicted
    step, ids = SlotCacheDecoderStep(model).eval(), torch.tensor([input_ids[:length]])
    for begin, end in [(0, 13), *((t, t + 1) for t in range(13, length))]:
        past_key, past_value = (torch.from_numpy(array)[:, None] for array in (cache.key, cache.value))
        with torch.no_grad():
            _, key, value, attention, chunk_attention = step(
                ids[:, begin:end], torch.arange(begin, end)[None], past_key, past_value,
                torch.from_numpy(cache.slot_mask())[None],
            )
        cache.append(*(tensor[:, 0].numpy() for tensor in (key, value, attention, chunk_attention)))

    left = np.arange(1, length - 8)  # scored: left the window, not a sink (slot = position here)
    recorded = np.stack([seen_attention[position] for position in left], axis=2)
    np.testing.assert_allclose(np.log(recorded), trace.window_attention[:, :, left].numpy(), atol=1e-3)
    with torch.no_grad():
        expected = scorer.score_sequence(trace.key.float(), trace.value.float(), trace.window_attention)
    np.testing.assert_allclose(cache.statistics[SCORE][:, :, left], expected[:, :, left].numpy(), atol=2e-2)
