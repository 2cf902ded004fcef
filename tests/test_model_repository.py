"""The committed Triton model repository: configs in sync, parameters validated at load time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpop.serving.kvpop_engine.config import ServiceConfig
from kvpop.serving.process.tritonserver import choose_model_config

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
SERVICE = REPOSITORY / "kvpop_engine"
INSTANCE_GROUP = re.compile(r"instance_group \[.*?\n\]", re.S)


def body(path: Path) -> str:
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    return "\n".join(lines)


def test_production_config_runs_one_instance_per_gpu_on_two_gpus():
    text = (SERVICE / "config.pbtxt").read_text()
    assert 'name: "kvpop_engine"' in text and 'backend: "python"' in text
    assert "decoupled: true" in text
    assert re.search(r"count: 1 kind: KIND_GPU gpus: \[ 0, 1 \]", text)
    assert "dynamic_batching" in text and "preferred_batch_size" in text and "max_queue_delay_microseconds" in text


@pytest.mark.parametrize("variant, group", [("cpu", "kind: KIND_CPU"), ("single_gpu", "gpus: [ 0 ]")])
def test_variants_differ_only_in_instance_group(variant, group):
    production = body(SERVICE / "config.pbtxt")
    other = body(SERVICE / "configs" / f"{variant}.pbtxt")
    assert group in INSTANCE_GROUP.search(other).group(0)
    assert INSTANCE_GROUP.sub("", production) == INSTANCE_GROUP.sub("", other)


def test_config_choice_by_gpu_count():
    assert choose_model_config(0) == "cpu"
    assert choose_model_config(1) == "single_gpu"
    assert choose_model_config(2) is None  # config.pbtxt


def parameters(**values):
    return {"parameters": {key: {"string_value": str(value)} for key, value in values.items()}}


def test_service_config_reads_parameters():
    config = ServiceConfig.from_model_config(parameters(default_policy="streaming", max_prompt_tokens=100))
    assert config.default_policy == "streaming" and config.max_prompt_tokens == 100


@pytest.mark.parametrize(
    "values, message",
    [
        ({"default_policy": "lru"}, "default_policy"),
        ({"max_prompt_tokens": "lots"}, "max_prompt_tokens must be int"),
        ({"max_output_tokens": 0}, "max_output_tokens must be > 0"),
        ({"max_promt_tokens": 5}, "unknown parameters"),
    ],
)
def test_service_config_rejects_bad_parameters(values, message):
    with pytest.raises(ValueError, match=message):
        ServiceConfig.from_model_config(parameters(**values))


def test_an_assembled_repository_holds_the_committed_models_and_the_export_only(tmp_path, tiny_onnx_model_dir):
    """What every test server, the cluster rehearsal and the benchmarks serve, built from a checkout
    after `make export`: none of that export's files (retrieval heads, scorers, a chat template) nor a
    run's leftovers may sit beside the tiny model."""
    import shutil

    from export.repository import assemble_model_repository, model_files

    checkout = tmp_path / "checkout"
    shutil.copytree(REPOSITORY, checkout, ignore=shutil.ignore_patterns("__pycache__"))
    version = checkout / "kvpop_engine" / "1"
    leftovers = ["retrieval_heads.json", "scorer_mlstm.onnx", "decoder_step.onnx.data", "tokenizer/chat_template.jinja",
                 "export_report.json"]
    for name in leftovers:
        (version / name).parent.mkdir(parents=True, exist_ok=True)
        (version / name).write_text("from the SmolLM2 export")
    (checkout / "kvpop_engine" / "sessions").mkdir()
    (checkout / "kvpop_engine" / "sessions" / "session.key").write_text("a run's state")

    built = assemble_model_repository(tmp_path / "built", tiny_onnx_model_dir, {"kv_pool_mb": "7"}, source=checkout)

    def files(root):
        return {path.relative_to(root) for path in root.rglob("*") if path.is_file() and "__pycache__" not in path.parts}

    export = {Path("kvpop_engine/1") / path for path in files(tiny_onnx_model_dir)}
    assert files(built) == set(model_files(checkout)) | export
    assert all((built / path).read_bytes() == (tiny_onnx_model_dir / path.relative_to("kvpop_engine/1")).read_bytes()
               for path in export)
    assert set(model_files(checkout)) == set(model_files(REPOSITORY))  # every committed model, nothing else
    assert 'key: "kv_pool_mb" value: { string_value: "7" }' in (built / "kvpop_engine" / "configs" / "cpu.pbtxt").read_text()
