"""Chat through the real server: the `messages` input on /infer, /generate and both streams, and
`kvpop-client chat`. The tiny model has no chat template, so the server renders the fallback."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from kvpop.serving.kvpop_engine.chat import render_chat

pytestmark = pytest.mark.server
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Let a = 7. What is a?"}]


@pytest.fixture(scope="module")
def rendered(tiny_onnx_model_dir):
    from transformers import AutoTokenizer

    return render_chat(CHAT, AutoTokenizer.from_pretrained(tiny_onnx_model_dir / "tokenizer"))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_chat_answers_as_the_rendered_prompt_does(kvpop_http, kvpop_grpc, rendered, protocol):
    client = kvpop_http if protocol == "http" else kvpop_grpc
    answer = client.chat(CHAT, max_tokens=8)
    assert answer.output_ids == client.generate(rendered, max_tokens=8).output_ids
    assert answer.num_input_tokens == client.generate(rendered, max_tokens=1).num_input_tokens


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_chat_streams(kvpop_http, kvpop_grpc, protocol):
    client = kvpop_http if protocol == "http" else kvpop_grpc
    chunks = list(client.stream_chat(CHAT, max_tokens=6))
    assert [token for chunk in chunks for token in chunk.token_ids] == client.chat(CHAT, max_tokens=6).output_ids
    assert chunks[-1].result is not None


def test_generate_endpoint_takes_messages_as_a_json_string(triton_server, kvpop_http):
    body = json.dumps({"messages": json.dumps(CHAT), "max_tokens": 8}).encode()
    url = f"http://{triton_server.http_url}/v2/models/kvpop_service/generate"
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
        answer = json.loads(response.read())
    assert answer["output_ids"] == kvpop_http.chat(CHAT, max_tokens=8).output_ids


def test_malformed_messages_are_an_invalid_request(kvpop_http):
    from kvpop_client import KVpopServerError

    with pytest.raises(KVpopServerError, match="role"):
        kvpop_http.chat([{"role": "robot", "content": "hi"}], max_tokens=4)


def test_cli_chat_streams_each_answer_and_keeps_the_history(triton_server, kvpop_http):
    turns = "Let a = 7. What is a?\nAnd b?\n"
    result = subprocess.run(
        [sys.executable, "-m", "kvpop_client.cli", "--url", triton_server.http_url, "chat", "--system", "Be brief.",
         "--max-tokens", "5"],
        input=turns, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    first = kvpop_http.chat(CHAT, max_tokens=5).text
    lines = result.stdout.splitlines()
    assert len(lines) >= 2 and result.stdout.startswith(first)
