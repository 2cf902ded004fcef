"""Warm prefixes against a real server of its own, configured with a text prefix and a chat system
prompt (`warm_prefixes`): a request that starts with one reports the prefix's tokens as reused and,
with the full cache, gives the tokens a cold prefill of the same prompt gives; the prefix metrics
count the lookups, hits and reused tokens."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytestmark = pytest.mark.server
PREFIX_TEXT = "You are a careful assistant. Answer briefly."
SYSTEM = [{"role": "system", "content": "You are KVpop, a careful assistant."}]
REPLY = 12


@pytest.fixture(scope="module")
def warm_server(tmp_path_factory, tiny_onnx_model_dir):
    from kvpop.serving.process.tritonserver import TritonServer, free_port
    from kvpop_client import KVpopClient

    from e2e.conftest import TEST_ENGINE_PARAMETERS
    from export.repository import assemble_model_repository

    prefixes = json.dumps([PREFIX_TEXT, SYSTEM])
    assert "\\" not in prefixes  # quotes are escaped for config.pbtxt below; backslashes would need more
    parameters = {**TEST_ENGINE_PARAMETERS, "warm_prefixes": prefixes.replace('"', '\\"')}
    root = assemble_model_repository(tmp_path_factory.mktemp("prefixes"), tiny_onnx_model_dir, parameters)
    server = TritonServer(model_repository=root, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          address="127.0.0.1", model_config_name="cpu", log_file=root / "triton.log",
                          state_dir=tmp_path_factory.mktemp("prefixes-state"))
    with server, KVpopClient(server.grpc_url, "grpc") as client:

        def metric(name: str) -> float:
            samples = KVpopClient.metrics(server.metrics_url)
            return sum(value for key, value in samples.items() if re.match(rf"{name}(\{{|$)", key))

        yield client, metric


def tail(seed: int) -> list[int]:
    return np.random.default_rng(700 + seed).integers(3, 250, 20).tolist()


def test_a_warm_prefix_is_reused_and_gives_the_cold_tokens(warm_server, tiny_onnx_model_dir):
    from transformers import AutoTokenizer

    from kvpop.engine import Engine, EngineConfig
    from kvpop.request import GenerationRequest, SamplingParams
    from kvpop.serving.kvpop_engine.chat import render_chat

    client, metric = warm_server
    tokenizer = AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer")
    prefix = tokenizer(PREFIX_TEXT).input_ids
    names = ("kvpop_prefix_lookups_total", "kvpop_prefix_hits_total", "kvpop_prefix_tokens_reused_total")
    before = [metric(name) for name in names]
    prompts = [prefix + tail(i) for i in range(2)]
    results = [client.generate(prompt, max_tokens=REPLY, ignore_eos=True) for prompt in prompts]

    cold = Engine.from_model_dir(tiny_onnx_model_dir, EngineConfig(prefill_chunk=256))  # the server's prefill_chunk_tokens
    sampling = SamplingParams(max_tokens=REPLY, ignore_eos=True)
    expected = cold.generate([GenerationRequest(f"c{i}", prompt, sampling) for i, prompt in enumerate(prompts)])
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]
    for result in results:
        assert result.tokens_reused >= len(prefix) and result.tokens_computed == result.num_input_tokens - result.tokens_reused

    missed = client.generate(tail(9), max_tokens=2, ignore_eos=True)
    assert missed.tokens_reused == 0 and missed.tokens_computed == missed.num_input_tokens

    header = tokenizer(render_chat(SYSTEM, tokenizer, add_generation_prompt=False)).input_ids
    chat = client.chat([*SYSTEM, {"role": "user", "content": "What is 2 + 3?"}], max_tokens=2, ignore_eos=True)
    assert chat.tokens_reused == len(header)

    after = [metric(name) for name in names]
    assert [a - b for a, b in zip(after, before)] == [4, 3, 2 * len(prefix) + len(header)]
    assert 0 < metric("kvpop_prefix_hit_ratio") < 1
