"""The serving layer without Triton: request parsing, the engine's KV-pool admission, streaming detokenization."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
from kvpop.model_spec import ModelSpec
from kvpop.cache.manager import CacheManager
from kvpop.cache.reservations import KVReservations
from kvpop.engine.admission import AdmissionPolicy, Pending, WaitingQueue
from kvpop.serving.kvpop_engine.config import ServiceConfig
from kvpop.serving.kvpop_engine.parse import InvalidRequestError, parse_parameters, parse_request

SPEC = ModelSpec("LlamaForCausalLM", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=320, dtype="float32", max_position_embeddings=4096)  # 512 bytes per slot


def request(policy="full", budget=None, prompt=40, max_tokens=2000, request_id="r"):
    return GenerationRequest(request_id, list(range(3, 3 + prompt)), SamplingParams(max_tokens=max_tokens),
                             CacheConfig(policy, budget=budget))


class Pool:
    """The scheduler's admission over a cache manager whose KV pool holds `slots` slots per head."""

    def __init__(self, slots: int, floor: int = 64, queue: int = 2) -> None:
        self.floor = floor
        self.manager = CacheManager(SPEC, reservations=KVReservations(slots * SPEC.kv_bytes_per_token, SPEC))
        self.admission = WaitingQueue(self.manager, AdmissionPolicy(floor, queue))

    def read(self, request: GenerationRequest, whole_prompt: bool = False) -> Pending:
        """The request as the scheduler reads it: the manager's plan (`whole_prompt`: its prefill holds its prompt)."""
        return Pending(request, self.manager.plan(request, self.floor, lambda policy, budget, prompt: whole_prompt))

    def try_admit(self, request: GenerationRequest, whole_prompt: bool = False) -> Pending | None:
        admitted = self.read(request, whole_prompt)
        return admitted if self.admission.reserve(admitted) else None

    def fits_when_idle(self, request: GenerationRequest) -> bool:
        try:
            self.admission.check_fits(self.read(request))
        except ValueError:
            return False
        return True


def test_admission_reserves_the_padded_batch_pool():
    pool = Pool(slots=1024)
    assert pool.try_admit(request("streaming", 256, request_id="a")).plan.storage_slots == 256
    assert pool.try_admit(request("streaming", 256, request_id="b")).plan.storage_slots == 256
    assert pool.manager.reserved_bytes == 2 * 256 * 512
    # A third sequence of 320 slots pads every row to 320 (3 x 320 = 960 <= 1024) ...
    assert pool.try_admit(request("h2o", 320, request_id="c")).plan.storage_slots == 320
    # ... and a fourth of 64 would need 4 x 320 slots: it may not be degraded below 64, so it waits.
    assert pool.try_admit(request("tova", 64, request_id="d")) is None
    pool.manager.release("c")
    assert pool.try_admit(request("tova", 64, request_id="d")).plan.storage_slots == 64


def test_full_cache_needs_prompt_plus_max_tokens_and_is_never_degraded():
    pool = Pool(slots=256)
    assert pool.read(request("full", prompt=100, max_tokens=100)).plan.storage_slots == 256  # 200 rounded up to blocks
    assert pool.try_admit(request("full", prompt=100, max_tokens=100, request_id="a")) is not None
    assert pool.try_admit(request("full", prompt=10, max_tokens=10, request_id="b")) is None
    assert not pool.fits_when_idle(request("full", prompt=300, max_tokens=10))


def test_a_bounded_request_fits_when_idle_at_the_floor():
    pool = Pool(slots=256, floor=128)
    assert pool.fits_when_idle(request("kvpop", 1024, prompt=900))  # degraded to 128 slots, alone
    assert not Pool(slots=64, floor=128).fits_when_idle(request("kvpop", 1024, prompt=900))
    assert Pool(slots=64, floor=128).fits_when_idle(request("kvpop", 64, prompt=900))  # asks for less than the floor


def test_a_tight_pool_degrades_bounded_requests_down_to_the_floor():
    pool = Pool(slots=2048, floor=256)
    pool.try_admit(request("streaming", 1024, request_id="holder"))
    degraded = pool.try_admit(request("kvpop", 1500, request_id="big"))
    assert degraded.plan.degraded_from == 1500 and degraded.plan.budget == 1024
    assert pool.try_admit(request("kvpop", 1500, request_id="another")) is None  # would fall below the floor


def test_admission_respects_what_the_engine_really_holds():
    pool = Pool(slots=1024)
    pool.manager.reservations.in_use_bytes = 1000 * SPEC.kv_bytes_per_token  # finished rows not repacked away yet
    assert pool.try_admit(request("streaming", 256)) is None
    pool.manager.reservations.in_use_bytes = 900 * SPEC.kv_bytes_per_token
    assert pool.try_admit(request("streaming", 256, request_id="a")).plan.storage_slots == 64  # degraded to fit beside them
    pool.manager.observe_in_use()  # the manager itself holds nothing
    assert pool.try_admit(request("streaming", 256, request_id="b")).plan.storage_slots == 256


def test_a_whole_prompt_prefill_is_reserved_until_its_first_token():
    pool = Pool(slots=2048)
    alone = pool.try_admit(request("kvpop", 128, prompt=900, request_id="a"), whole_prompt=True)
    assert alone.plan.storage_slots == 128 and pool.manager.reserved_bytes == (128 + 900) * 512  # alone: admitted, its prompt counted
    # A second long prompt prefilling at the same time would not fit beside it, at any budget: it waits.
    assert pool.try_admit(request("kvpop", 128, prompt=900, request_id="b"), whole_prompt=True) is None
    pool.manager.prefill_done("a")  # a's first token: only its budget is held now
    assert pool.manager.reserved_bytes == 128 * 512
    assert pool.try_admit(request("kvpop", 128, prompt=900, request_id="b"), whole_prompt=True).plan.storage_slots == 128
    pool.manager.release("b")  # finished or failed before its first token: the prompt's reservation goes too
    assert pool.manager.reserved_bytes == 128 * 512


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_model_dir):
    return AutoTokenizer.from_pretrained(tiny_hf_model_dir)


def inputs(**tensors):
    return lambda name: None if name not in tensors else np.asarray(tensors[name])


CONFIG = ServiceConfig(max_prompt_tokens=64, max_output_tokens=32, default_max_tokens=16, default_kv_budget=128)


def parse(tokenizer, parameters=None, **tensors):
    return parse_request("id", inputs(**tensors), parameters or {}, tokenizer, 320, CONFIG)


def test_parse_builds_the_engine_request(tokenizer):
    parsed = parse(tokenizer, text_input=np.array([b"Let a = 7."], dtype=object), max_tokens=np.array([5]),
                   eviction_policy=np.array([b"kvpop"], dtype=object), temperature=np.array([0.5], np.float32),
                   seed=np.array([7]), stream=np.array([True]))
    generation = parsed.generation
    assert generation.prompt_ids == tokenizer("Let a = 7.").input_ids
    assert generation.sampling.max_tokens == 5 and generation.sampling.temperature == 0.5
    assert generation.sampling.seed == 7 and parsed.stream
    assert generation.cache.policy == "kvpop" and generation.cache.budget == 128  # the configured default


def test_request_parameters_are_accepted_like_inputs(tokenizer):
    parameters = parse_parameters('{"max_tokens": 3, "eviction_policy": "h2o", "kv_budget": 64, "stop": ["\\n"]}')
    parsed = parse(tokenizer, parameters, input_ids=np.array([5, 6, 7]))
    assert parsed.generation.sampling.max_tokens == 3 and parsed.generation.sampling.stop == ("\n",)
    assert parsed.generation.cache.policy == "h2o" and parsed.generation.cache.budget == 64


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"input_ids": np.array([1.5, 2.0])}, "INT32 or INT64"),
        ({"input_ids": np.arange(3, 100)}, "at most 64"),
        ({"text_input": np.array([b"ok"], dtype=object), "top_k": np.array([2.5])}, "integer"),
        ({"text_input": np.array([b"ok"], dtype=object), "seed": np.array([1, 2])}, "exactly one value"),
        ({"text_input": np.array([b"ok"], dtype=object), "stop": np.array([b"\xff"], dtype=object)}, "UTF-8"),
        ({"text_input": np.array([b"ok"], dtype=object), "stop": np.array([b"x" * 300], dtype=object)}, "stop takes"),
        ({"text_input": np.array([b"ok"], dtype=object), "stop": np.array([b"x"] * 17, dtype=object)}, "stop takes"),
    ],
)
def test_parse_rejects_malformed_inputs(tokenizer, tensors, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse(tokenizer, **tensors)


@pytest.mark.parametrize("parameters, message", [
    ({"max_tokens": 2**32 + 3}, "max_tokens is out of range for INT32"),  # once wrapped around to 3
    ({"max_tokens": 2**63}, "max_tokens is out of range for INT32"),
    ({"kv_budget": 2**32 + 100}, "kv_budget is out of range for INT32"),  # once a budget of 100
    ({"kv_budget": 2**32 - 1}, "kv_budget is out of range for INT32"),
    ({"max_tokens": True}, "max_tokens must be a number"),  # once taken as 1
    ({"temperature": True}, "temperature must be a number"),
    ({"kv_budget": -5, "eviction_policy": "streaming"}, "kv_budget must be >= 1"),
    ({"kv_budget": -5}, "kv_budget must be >= 1"),
    ({"max_tokens": "2147483648"}, "max_tokens is out of range for INT32"),  # a number sent as a string
    ({"max_tokens": "eight"}, "parameter max_tokens"),
])
def test_parameters_are_checked_against_their_wire_type(tokenizer, parameters, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse(tokenizer, parameters, input_ids=np.array([5, 6, 7]))


def test_numbers_sent_as_strings_are_numbers(tokenizer):
    parsed = parse(tokenizer, {"max_tokens": "8", "temperature": "0.5"}, input_ids=np.array([5, 6, 7]))
    assert parsed.generation.sampling.max_tokens == 8 and parsed.generation.sampling.temperature == 0.5


def test_kv_budget_zero_means_not_sent_on_every_path(tokenizer):
    for parameters, tensors in (({"kv_budget": 0}, {}), ({}, {"kv_budget": np.array([0], np.int32)})):
        parsed = parse(tokenizer, {"eviction_policy": "streaming", **parameters}, input_ids=np.array([5, 6, 7]), **tensors)
        assert parsed.generation.cache.budget == CONFIG.default_kv_budget


@pytest.mark.parametrize("parameters, tensors, message", [
    ('{"text_input": "\\ud800 hi"}', {}, "text_input is not valid UTF-8"),
    ('{"eviction_policy": "kv\\udfffpop"}', {"input_ids": np.array([5])}, "eviction_policy is not valid UTF-8"),
    ('{"session_id": "\\ud800"}', {"input_ids": np.array([5])}, "session_id is not valid UTF-8"),
    ('{"stop": ["a", "\\ud800"]}', {"input_ids": np.array([5])}, "stop.1 is not valid UTF-8"),
    ("", {"messages": np.array(['[{"role": "user", "content": "\\ud800"}]'.encode()], dtype=object)},
     "messages.0.content is not valid UTF-8"),
    ("", {"input_ids": np.array([5]), "sampling_parameters": np.array(['{"stop": "\\udc00"}'.encode()], dtype=object)},
     "sampling_parameters.stop is not valid UTF-8"),
])
def test_a_lone_surrogate_anywhere_is_a_client_error(tokenizer, parameters, tensors, message):
    """JSON escapes a lone surrogate ("\\ud800"), which is no UTF-8 text: refused before the tokenizer sees it."""
    with pytest.raises(InvalidRequestError, match=message):
        parse(tokenizer, parse_parameters(parameters), **tensors)


def test_parameters_must_be_json():
    with pytest.raises(InvalidRequestError, match="JSON"):
        parse_parameters("{not json")


def test_the_serving_runtime_imports_no_torch():
    """The GPU image ships onnxruntime-gpu, not torch: serving code must not import it."""
    import subprocess
    import sys

    code = ("import sys, kvpop.serving.kvpop_engine.model, kvpop.serving.kvpop_engine.worker, kvpop.serving.kvpop_engine.metrics, kvpop.policies.kvpop.runtime; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_error_tags_keep_their_kind_through_a_message():
    from kvpop.serving.contract import ErrorKind
    from kvpop.serving.errors import kind_of, tagged
    from kvpop_client.errors import status_from_message

    for kind in ErrorKind:
        message = tagged(kind, "max_tokens must be in [1, 64]")
        assert kind_of(message) is kind and tagged(kind, message) == message
        assert status_from_message(f"[StatusCode.UNKNOWN] {message}") == kind.grpc_status
    assert kind_of("something untagged") is ErrorKind.INTERNAL


def test_front_end_splits_a_batch_and_types_its_parameters():
    from kvpop.serving.kvpop_service.frontend import engine_prompts

    dtypes = {"text_input": np.dtype(object), "temperature": np.dtype(np.float32), "kv_budget": np.dtype(np.int32),
              "eviction_policy": np.dtype(object), "stop": np.dtype(object)}
    text = np.array([[b"a"], [b"b"]], dtype=object)
    prompts, forwarded = engine_prompts({"text_input": text},
                                        {"temperature": 1.5, "kv_budget": 64, "eviction_policy": "h2o",
                                         "stop": ["\n"], "confidence_threshold": 0.9}, dtypes)
    assert [prompt["text_input"].tolist() for prompt in prompts] == [[[b"a"]], [[b"b"]]]
    assert prompts[1]["temperature"].dtype == np.float32 and prompts[1]["temperature"][0, 0] == 1.5
    assert prompts[0]["kv_budget"].tolist() == [[64]] and prompts[0]["eviction_policy"].tolist() == [[b"h2o"]]
    assert prompts[0]["stop"].tolist() == [[b"\n"]]
    assert forwarded == {"confidence_threshold": 0.9}  # unknown: passed on, ignored by the engine


@pytest.mark.parametrize("inputs, parameters, message", [
    ({"text_input": np.array([[b"a"]], dtype=object)}, {"stream": True}, "kvpop_engine"),
    ({"text_input": np.array([[b"a"]], dtype=object)}, {"kv_budget": 1.5}, "integer"),
    ({"text_input": np.array([[b"a"]], dtype=object)}, {"kv_budget": 2**40}, "out of range"),
    ({"text_input": np.array([[b"a"]], dtype=object)}, {"temperature": [1]}, "string, number or boolean"),
    ({"text_input": np.array([[b"a"], [b"b"]], dtype=object), "max_tokens": np.array([[1], [2], [3]], np.int32)}, {},
     "disagree"),
    ({}, {}, "send text_input"),
])
def test_front_end_refuses_what_it_cannot_forward(inputs, parameters, message):
    from kvpop.serving.kvpop_service.frontend import engine_prompts

    dtypes = {"kv_budget": np.dtype(np.int32), "temperature": np.dtype(np.float32)}
    with pytest.raises(InvalidRequestError, match=message):
        engine_prompts(inputs, parameters, dtypes)


def test_batched_answers_are_padded_to_the_longest():
    from kvpop.serving.kvpop_service.forwarder import PAD_TOKEN_ID, merge_answers

    merged = merge_answers([{"output_ids": np.array([[1, 2, 3]]), "num_output_tokens": np.array([[3]])},
                            {"output_ids": np.array([[4]]), "num_output_tokens": np.array([[1]])}])
    assert merged["output_ids"].tolist() == [[1, 2, 3], [4, PAD_TOKEN_ID, PAD_TOKEN_ID]]
    assert merged["num_output_tokens"].tolist() == [[3], [1]]


# The TensorRT-LLM / vLLM style inputs that benchmark tools send (docs/API.md, benchmark tools).
def test_a_non_empty_text_input_wins_over_input_ids_and_a_blank_one_gives_way(tokenizer):
    ids = np.array([5, 6, 7, 8])
    parsed = parse(tokenizer, text_input=np.array([b"Let a = 7."], dtype=object), input_ids=ids)
    assert parsed.generation.prompt_ids == tokenizer("Let a = 7.").input_ids
    parsed = parse(tokenizer, text_input=np.array([b" \x00"], dtype=object), input_ids=ids)
    assert parsed.generation.prompt_ids == [5, 6, 7, 8]


def test_zero_and_blank_optional_inputs_mean_not_sent(tokenizer):
    blank = np.array([b" "], dtype=object)
    parsed = parse(tokenizer, input_ids=np.array([0, 0, 0]), max_tokens=np.array([0], np.int32),
                   top_p=np.array([0.0], np.float32), kv_budget=np.array([0], np.int32),
                   compression_ratio=np.array([0.0], np.float32), eviction_policy=blank, session_id=blank,
                   messages=blank, sampling_parameters=blank, stop=blank, min_length=np.array([0], np.int32),
                   beam_width=np.array([0], np.int32), repetition_penalty=np.array([0.0], np.float32),
                   exclude_input_in_output=np.array([True]))
    assert parsed.generation.sampling.max_tokens == CONFIG.default_max_tokens
    assert parsed.generation.session_id is None and parsed.generation.sampling.stop == ()
    assert not parsed.echo_prompt


def test_min_length_equal_to_max_tokens_ignores_eos_and_sampling_parameters_merge(tokenizer):
    text = np.array([b"Let a = 7."], dtype=object)
    parsed = parse(tokenizer, text_input=text, max_tokens=np.array([6], np.int32), min_length=np.array([6], np.int32))
    assert parsed.generation.sampling.ignore_eos and parsed.generation.sampling.max_tokens == 6
    sampling = np.array([b'{"max_tokens": 5, "min_tokens": 5, "temperature": 0.5, "n": 1}'], dtype=object)
    parsed = parse(tokenizer, text_input=text, sampling_parameters=sampling)
    assert parsed.generation.sampling.max_tokens == 5 and parsed.generation.sampling.ignore_eos
    assert parsed.generation.sampling.temperature == 0.5
    parsed = parse(tokenizer, text_input=text, exclude_input_in_output=np.array([False]))
    assert parsed.echo_prompt


@pytest.mark.parametrize("tensors, message", [
    ({"beam_width": np.array([4], np.int32)}, "beam_width"),
    ({"repetition_penalty": np.array([1.2], np.float32)}, "repetition_penalty"),
    ({"presence_penalty": np.array([0.1], np.float32)}, "presence_penalty"),
    ({"frequency_penalty": np.array([-0.1], np.float32)}, "frequency_penalty"),
    ({"min_length": np.array([2], np.int32), "max_tokens": np.array([6], np.int32)}, "min_length"),
    ({"min_tokens": np.array([9], np.int32), "max_tokens": np.array([6], np.int32)}, "larger than max_tokens"),
    ({"sampling_parameters": np.array([b'{"best_of": 3}'], dtype=object)}, "best_of"),
    ({"sampling_parameters": np.array([b'{"logprobs": 3}'], dtype=object)}, "unsupported keys"),
    ({"sampling_parameters": np.array([b"[1]"], dtype=object)}, "JSON object"),
    ({"exclude_input_in_output": np.array([False]), "stream": np.array([True])}, "complete answers only"),
])
def test_unsupported_tool_settings_are_refused(tokenizer, tensors, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse(tokenizer, text_input=np.array([b"Let a = 7."], dtype=object), **tensors)


def test_query_aware_kvpop_is_a_service_parameter():
    """kvpop_query_window / kvpop_span_pooling reach every kvpop request's cache (and only kvpop's); bad
    values fail at load with the parameter's name."""
    from kvpop.policies import policy_defaults
    from kvpop.serving.kvpop_engine.parse import request_cache_config

    def parameters(**values):
        return {"parameters": {key: {"string_value": value} for key, value in values.items()}}

    config = ServiceConfig.from_model_config(parameters(kvpop_query_window="32", kvpop_span_pooling="sentence_contrast"))
    learned = {"kvpop": {"mlstm": object()}}  # a model that ships the learned mLSTM scorer (auto picks it)
    kvpop = request_cache_config("kvpop", None, 0.88, config, policy_defaults(config.policy_settings, learned)).options
    assert (kvpop.scorer, kvpop.query_window, kvpop.span_pooling) == ("mlstm", 32, "sentence_contrast")
    stand_in = request_cache_config("kvpop", None, 0.88, config).options  # no learned scorer: the stand-in ranks no spans
    assert (stand_in.scorer, stand_in.query_window, stand_in.span_pooling) == ("accumulated_attention", 32, None)
    streaming = request_cache_config("streaming", 64, None, config).options
    assert not hasattr(streaming, "query_window") and not hasattr(streaming, "span_pooling")
    default = request_cache_config("kvpop", 64, None, ServiceConfig(), policy_defaults(ServiceConfig().policy_settings, learned)).options
    assert (default.query_window, default.span_pooling) == (None, None)  # auto: the policy's default (the scorer's model)
    for bad in ({"kvpop_query_window": "-1"}, {"kvpop_query_window": "half"}, {"kvpop_span_pooling": "paragraph"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServiceConfig.from_model_config(parameters(**bad))
