"""End-to-end: real tritonserver, real tritonclient HTTP and gRPC, against Hugging Face greedy generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.server
MODEL = "kvpop_service"


@pytest.fixture(scope="module")
def hf_model(tiny_hf_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_hf_model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_model_dir):
    return AutoTokenizer.from_pretrained(tiny_hf_model_dir)


def hf_greedy(hf_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        output = hf_model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=hf_model.config.eos_token_id, pad_token_id=hf_model.config.pad_token_id,
        )
    return output[0, len(prompt_ids):].tolist()


@pytest.fixture
def client(triton_server, request):
    """A tritonclient for the protocol the test is parametrized with; closed afterwards."""
    protocol = request.node.callspec.params["protocol"]
    module = httpclient if protocol == "http" else grpcclient
    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    client = module.InferenceServerClient(url)
    client.module = module
    yield client
    client.close()


def ids_inputs(module, prompt_ids, max_tokens):
    ids = module.InferInput("input_ids", [1, len(prompt_ids)], "INT32")
    ids.set_data_from_numpy(np.array([prompt_ids], dtype=np.int32))
    limit = module.InferInput("max_tokens", [1, 1], "INT32")
    limit.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    return [ids, limit]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_input_ids_match_hf_greedy(client, hf_model, protocol):
    module = client.module
    prompt_ids = [1, 17, 45, 99, 120, 7, 33]
    result = client.infer(MODEL, ids_inputs(module, prompt_ids, 12))
    output_ids = result.as_numpy("output_ids")[0].tolist()
    assert output_ids == hf_greedy(hf_model, prompt_ids, 12)
    assert result.as_numpy("num_output_tokens")[0, 0] == len(output_ids)
    assert result.as_numpy("num_input_tokens")[0, 0] == len(prompt_ids)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_text_input_returns_generated_text(client, hf_model, tokenizer, protocol):
    module = client.module
    prompt = "Let a = 7. Let b = a + 5. What is b?"
    text = module.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    limit = module.InferInput("max_tokens", [1, 1], "INT32")
    limit.set_data_from_numpy(np.array([[10]], dtype=np.int32))
    result = client.infer(MODEL, [text, limit])
    expected = hf_greedy(hf_model, tokenizer(prompt).input_ids, 10)
    assert result.as_numpy("output_ids")[0].tolist() == expected
    assert result.as_numpy("text_output")[0, 0].decode() == tokenizer.decode(expected, skip_special_tokens=True)


def test_server_metadata_lists_kvpop_service(triton_server):
    with httpclient.InferenceServerClient(triton_server.http_url) as client:
        assert client.is_model_ready(MODEL)
        metadata = client.get_model_metadata(MODEL)
    assert {tensor["name"] for tensor in metadata["inputs"]} >= {"text_input", "input_ids", "max_tokens"}
    assert {tensor["name"] for tensor in metadata["outputs"]} >= {"text_output", "output_ids"}
