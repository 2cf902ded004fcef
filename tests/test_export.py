"""Export of the decoder step: parity with Hugging Face, dynamic shapes, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import GPT2Config

from export.pipeline import ExportError, export_model
from kvpop.decoder import DecoderStep
from kvpop.model_spec import ModelSpec


def test_export_report_shows_parity(tiny_onnx_model_dir):
    report = json.loads((tiny_onnx_model_dir / "export_report.json").read_text())
    assert report["parity"]["passed"]
    assert report["parity"]["prefill_max_abs_diff"] <= 1e-4
    assert report["parity"]["decode_max_abs_diff"] <= 1e-4


def test_mixed_step_equals_the_step_on_each_segment_and_shares_its_weights(tiny_onnx_model_dir):
    """The mixed decode + prompt step gives the step's outputs for each segment (either may be empty),
    and its weights are the step's external-data file (no second copy on disk)."""
    import onnx

    from export.step_variants import check_mixed_step
    from kvpop.decoder import mixed_step_path

    report = json.loads((tiny_onnx_model_dir / "export_report.json").read_text())
    assert report["mixed_step_max_abs_diff"] <= 1e-5
    spec = ModelSpec.load(tiny_onnx_model_dir)
    decoder_path = tiny_onnx_model_dir / spec.decoder_file
    assert check_mixed_step(decoder_path, seed=3) <= 1e-5
    mixed = onnx.load(str(mixed_step_path(decoder_path)), load_external_data=False)
    locations = {entry.value for initializer in mixed.graph.initializer for entry in initializer.external_data if entry.key == "location"}
    assert locations == {spec.decoder_file + ".data"}
    inline = sum(len(initializer.raw_data) for initializer in mixed.graph.initializer)
    assert inline < 4096  # a few small constants; every weight matrix is the step's
    assert not (tiny_onnx_model_dir / (mixed_step_path(decoder_path).name + ".data")).exists()


def test_every_step_graph_takes_the_cache_one_layer_per_input(tiny_onnx_model_dir, tmp_path):
    """Each layer reads its own cache input where attention needs it: no graph slices or splits a
    whole-cache tensor (onnxruntime would copy the whole cache on every step), and a directory holding
    an older export, whose cache was one input for all layers, is told to export again."""
    import onnx

    from export.step_variants import variant_paths
    from kvpop.decoder import mixed_step_path, step_input_names

    spec = ModelSpec.load(tiny_onnx_model_dir)
    decoder_path = tiny_onnx_model_dir / spec.decoder_file
    graphs = {"step": (decoder_path, [""]), "mixed": (mixed_step_path(decoder_path), ["decode_", "prompt_"]),
              **{name: (path, [""]) for name, path in variant_paths(decoder_path).items()}}
    for name, (path, prefixes) in graphs.items():
        graph = onnx.load(str(path), load_external_data=False).graph
        inputs = [graph_input.name for graph_input in graph.input]
        assert inputs == [input_name for prefix in prefixes for input_name in step_input_names(spec.num_layers, prefix)], name
        caches = {input_name for input_name in inputs if "past_" in input_name}
        readers = {node.op_type for node in graph.node if caches & set(node.input)}
        assert readers and not readers & {"Split", "Slice", "Gather", "Concat"}, (name, readers)

    older = tmp_path / "older"
    older.mkdir()
    for file in tiny_onnx_model_dir.iterdir():
        if file.is_file():
            (older / file.name).write_bytes(file.read_bytes())
    for path in [older / decoder_path.name, older / mixed_step_path(decoder_path).name, *(older / path.name for path in variant_paths(decoder_path).values())]:
        model = onnx.load(str(path), load_external_data=False)
        first_layer = model.graph.input[2].name  # "past_key.0" ("decode_past_key.0" in the mixed step)
        model.graph.input[2].name = first_layer.removesuffix(".0")
        for node in model.graph.node:
            node.input[:] = [first_layer.removesuffix(".0") if name == first_layer else name for name in node.input]
        onnx.save(model, str(path))
    with pytest.raises(RuntimeError, match="make export"):
        DecoderStep(older)


def test_a_layer_adds_no_shape_arithmetic_to_the_step(tmp_path):
    """The step's shapes (batch, new tokens, slots) are read once from its inputs, not per layer: a
    layer adds its projections, attention and MLP, and no Shape node. (Traced per layer, onnxruntime ran
    hundreds of tiny shape nodes a step on a 30-layer model, a sizeable share of a CPU decode step.)"""
    import collections

    import onnx
    from transformers import AutoModelForCausalLM

    from export.onnx_export import export_decoder_step, export_mixed_step
    from export.tiny_model import build_tiny_model

    counts = {}
    for layers in (1, 3):
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / f"hf{layers}", num_layers=layers)).eval()
        step = export_decoder_step(model, tmp_path / f"onnx{layers}" / "decoder_step.onnx")
        mixed = export_mixed_step(model, tmp_path / f"onnx{layers}" / "decoder_step.mixed.onnx", weights_of=step)
        counts[layers] = {path.name: collections.Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)
                          for path in (step, mixed)}
    for name, fewer in counts[1].items():
        assert counts[3][name]["Shape"] == fewer["Shape"], name


def test_model_spec_describes_the_model(tiny_onnx_model_dir, tiny_hf_model_dir):
    spec = ModelSpec.load(tiny_onnx_model_dir)
    config = json.loads((tiny_hf_model_dir / "config.json").read_text())
    assert spec.num_layers == config["num_hidden_layers"]
    assert spec.num_kv_heads == config["num_key_value_heads"] < spec.num_attention_heads
    assert spec.vocab_size == config["vocab_size"]
    assert spec.kv_bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4


def test_step_shapes_are_dynamic_and_empty_cache_works(tiny_onnx_model_dir):
    step = DecoderStep(tiny_onnx_model_dir)
    spec = step.spec
    for batch, tokens, slots in [(1, 5, 0), (3, 1, 7), (2, 4, 2)]:
        key, value, mask = step.empty_cache(batch, slots)
        mask[:] = True
        ids = np.ones((batch, tokens), np.int64)
        positions = np.arange(slots, slots + tokens)[None].repeat(batch, 0)
        out = step.run(ids, positions, key, value, mask)
        assert out.logits.shape == (batch, tokens, spec.vocab_size)
        assert out.new_key.shape == (spec.num_layers, batch, spec.num_kv_heads, tokens, spec.head_dim)
        assert out.attention.shape == (spec.num_layers, batch, spec.num_attention_heads, tokens, slots)
        # Attention rows over cached slots plus the causal new tokens sum to one.
        total = out.attention.sum(-1) + out.chunk_attention.sum(-1)
        np.testing.assert_allclose(total, 1.0, atol=1e-5)


def test_masked_slots_are_ignored(tiny_onnx_model_dir):
    """Garbage in a slot marked empty must not change the result."""
    step = DecoderStep(tiny_onnx_model_dir)
    key, value, mask = step.empty_cache(1, 4)
    ids, positions = np.array([[5, 6]]), np.array([[0, 1]])
    clean = step.run(ids, positions, key, value, mask)
    key[:] = 100.0
    value[:] = -50.0
    noisy = step.run(ids, positions, key, value, mask)
    np.testing.assert_allclose(clean.logits, noisy.logits, atol=1e-5)
    assert np.all(noisy.attention == 0)


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_other_llama_family_architectures_export_with_parity(tmp_path, architecture):
    from export.tiny_model import build_tiny_model

    report = export_model(build_tiny_model(tmp_path / "hf", architecture), tmp_path / "onnx")
    assert report["architecture"] == architecture and report["parity"]["passed"]


def test_unsupported_architecture_is_named(tmp_path):
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ExportError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        export_model(tmp_path, tmp_path / "out")


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ExportError, match="config.json"):
        export_model(tmp_path, tmp_path / "out")


def test_parity_is_relative_to_the_logit_scale_and_checks_the_greedy_token(tiny_onnx_model_dir):
    from export.parity import ParityReport, _top1_check

    parity = json.loads((tiny_onnx_model_dir / "export_report.json").read_text())["parity"]
    assert parity["top1_agreement"] == 1.0 and parity["top1_disagreements_beyond_ties"] == 0
    assert parity["prefill_relative_diff"] == pytest.approx(parity["prefill_max_abs_diff"] / parity["logit_scale"])
    # A 30-layer model with logits in the tens: 1.4e-4 absolute is 7e-6 of its scale and passes.
    assert ParityReport(1.4e-4, 6e-5, 24, 12, logit_scale=20.0).passed
    assert not ParityReport(1e-2, 0.0, 24, 12, logit_scale=20.0).passed
    reference = np.array([[0.0, 5.0, 4.99999], [3.0, 0.0, 1.0]])
    exported = np.array([[0.0, 4.99998, 5.0], [0.0, 3.0, 1.0]])  # a tie flips; a clear winner is lost
    assert _top1_check(reference, exported, error=1e-5) == (0, 1)


def test_a_float16_export_keeps_parity_and_serves_the_same_greedy_tokens(tiny_hf_model_dir, tiny_onnx_model_dir, tmp_path):
    """`--dtype float16` (GPU instances): weights, KV cache and logits in half precision, parity checked
    against the float32 model at its own tolerance; the engine runs every policy on it (the learned
    scorer reads float16 keys), with half the KV bytes, and on the tiny model the same greedy tokens."""
    from export.parity import PARITY_TOLERANCES
    from kvpop.engine import Engine, EngineConfig
    from kvpop.request import CacheConfig, GenerationRequest, SamplingParams

    report = export_model(tiny_hf_model_dir, tmp_path / "fp16", dtype="float16")
    assert report["parity"]["passed"] and report["parity"]["tolerance"] == PARITY_TOLERANCES["float16"]
    assert report["parity"]["top1_agreement"] == 1.0
    assert ModelSpec.load(tmp_path / "fp16").dtype == "float16"
    assert DecoderStep(tmp_path / "fp16", threads=1).empty_cache(slots=2)[0].dtype == np.float16
    half, single = Engine.from_model_dir(tmp_path / "fp16", EngineConfig(prefill_chunk=16)), Engine.from_model_dir(tiny_onnx_model_dir, EngineConfig(prefill_chunk=16))
    prompt = list(range(3, 60))
    for config in (CacheConfig(policy="full"), CacheConfig(policy="kvpop", budget=24, options=dict(sinks=2, scorer="mlstm")),
                   CacheConfig(policy="h2o", budget=24, options=dict(window=4))):
        runs = [engine.generate([GenerationRequest(f"{tag}-{config.policy}", prompt, SamplingParams(max_tokens=12, ignore_eos=True), config)])[0]
                for tag, engine in (("half", half), ("single", single))]
        assert runs[0].output_ids == runs[1].output_ids, config.policy
        assert runs[0].peak_kv_bytes * 2 == runs[1].peak_kv_bytes


def test_the_retrieval_heads_travel_with_the_scorers(tmp_path):
    """retrieval_heads.json beside the trained scorers is copied into the model repository; a stale one
    is removed when the scorers no longer have it."""
    from export.pipeline import export_learned_scorers
    from kvpop.policies.kvpop.scorer_spec import RETRIEVAL_HEADS_FILE

    scorer_dir, output_dir = tmp_path / "scorers", tmp_path / "out"
    scorer_dir.mkdir()
    output_dir.mkdir()
    (scorer_dir / RETRIEVAL_HEADS_FILE).write_text(json.dumps({"heads": [[1, 0]]}))
    export_learned_scorers(scorer_dir, output_dir, print)
    assert json.loads((output_dir / RETRIEVAL_HEADS_FILE).read_text())["heads"] == [[1, 0]]
    (scorer_dir / RETRIEVAL_HEADS_FILE).unlink()
    export_learned_scorers(scorer_dir, output_dir, print)
    assert not (output_dir / RETRIEVAL_HEADS_FILE).exists()


def test_an_export_with_nothing_changed_does_nothing_and_a_changed_scorer_redoes_only_the_scorers(
        tiny_hf_model_dir, tiny_onnx_model_dir, tmp_path, capsys):
    """`make export` twice: the second finds the same fingerprint (model files, export code, dtype,
    scorers) and every file in place, and writes nothing; new scorers are exported alone."""
    import shutil

    output = tmp_path / "export"
    shutil.copytree(tiny_onnx_model_dir, output)  # an export of the tiny model, as `make export` left it

    def times() -> dict[str, int]:
        return {path.name: path.stat().st_mtime_ns for path in output.iterdir() if path.is_file()}

    before = times()
    report = export_model(tiny_hf_model_dir, output)
    assert "is up to date" in capsys.readouterr().out
    exported = {name: stamp for name, stamp in before.items() if name != "export_report.json"}
    assert report["parity"]["passed"] and {name: times()[name] for name in exported} == exported

    scorers = tmp_path / "scorers"
    shutil.copytree(tiny_hf_model_dir / "scorer", scorers)
    (scorers / "notes.txt").write_text("retrained")  # any change to the scorers' folder
    export_model(tiny_hf_model_dir, output, scorer_dir=scorers)
    assert "exporting the scorers only" in capsys.readouterr().out
    after = times()
    assert {name: after[name] for name in before if name.startswith("decoder_step")} == {
        name: before[name] for name in before if name.startswith("decoder_step")}
    assert all(after[name] > before[name] for name in before if name.startswith("scorer_"))
    export_model(tiny_hf_model_dir, output, scorer_dir=scorers)
    assert "is up to date" in capsys.readouterr().out


def test_the_fingerprint_follows_the_model_files_and_the_dtype(tmp_path):
    from export.fingerprint import fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "MODEL_CARD.md").write_text("not an input")
    first = fingerprint(model, tmp_path / "no-scorers", "float32")
    assert first.scorers == "" and fingerprint(model, tmp_path / "no-scorers", "float32", first).decoder == first.decoder
    assert fingerprint(model, tmp_path / "no-scorers", "float16", first).decoder != first.decoder
    (model / "MODEL_CARD.md").write_text("edited")
    assert fingerprint(model, tmp_path / "no-scorers", "float32", first).decoder == first.decoder
    (model / "model.safetensors").write_bytes(b"other weights")
    assert fingerprint(model, tmp_path / "no-scorers", "float32", first).decoder != first.decoder
