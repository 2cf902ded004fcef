"""The export pipeline: load, check architecture, export ONNX, write tokenizer + spec, check parity.

Incremental: the report keeps the fingerprint of what the export was made from (export/fingerprint.py);
an export whose decoder step and scorers are both up to date is left alone, and one whose scorers
alone changed gets only its scorers again.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from export.fingerprint import Fingerprint, fingerprint
from kvpop.model_spec import ModelSpec
from kvpop.policies.kvpop.scorer_spec import RETRIEVAL_HEADS_FILE

TOKENIZER_DIRNAME = "tokenizer"
SCORER_DIRNAME = "scorer"  # where `make train-scorer` leaves the reference model's scorer_<kind>.pt
# A real model's directory is built at setup time and ignored by git, so its scorers (small, trained
# once) are committed here instead, in a folder named like the model's directory.
SHIPPED_SCORERS = Path(__file__).resolve().parent.parent / "scorers"
REPORT_FILENAME = "export_report.json"


class ExportError(RuntimeError):
    pass


class _Stages:
    """Numbered progress lines with elapsed time, so a long export shows where it is."""

    def __init__(self, total: int) -> None:
        self.total, self.index, self.start = total, 0, time.time()

    def __call__(self, message: str) -> None:
        self.index += 1
        print(f"[export {self.index}/{self.total} +{time.time() - self.start:5.1f}s] {message}", flush=True)

    def detail(self, message: str) -> None:
        """A step inside the current stage."""
        print(f"[export {self.index}/{self.total} +{time.time() - self.start:5.1f}s]   {message}", flush=True)


def decoder_outputs(output_dir: Path, spec: ModelSpec) -> list[Path]:
    """What an export of the decoder step writes (the scorers aside)."""
    from kvpop.decoder import mixed_step_path, variant_paths
    from kvpop.device_store import SLOT_WRITER_FILE

    decoder = output_dir / spec.decoder_file
    return [decoder, output_dir / (spec.decoder_file + ".data"), *variant_paths(decoder).values(), mixed_step_path(decoder),
            output_dir / SLOT_WRITER_FILE, output_dir / TOKENIZER_DIRNAME, output_dir / "model_spec.json"]


def _previous_report(output_dir: Path) -> dict:
    try:
        return json.loads((output_dir / REPORT_FILENAME).read_text())
    except (OSError, ValueError):
        return {}


def _decoder_up_to_date(report: dict, output_dir: Path, decoder: str) -> bool:
    previous = Fingerprint.from_dict(report.get("fingerprint"))
    if previous is None or previous.decoder != decoder or not report.get("parity", {}).get("passed"):
        return False
    return all(path.exists() for path in decoder_outputs(output_dir, ModelSpec.load(output_dir)))


def _scorers_up_to_date(report: dict, output_dir: Path, scorers: str) -> bool:
    previous = Fingerprint.from_dict(report.get("fingerprint"))
    exported = report.get("scorers")
    return (previous is not None and previous.scorers == scorers and exported is not None
            and all(result["passed"] and (output_dir / name).exists() for name, result in exported.items()))


def model_spec_from_config(config, architecture: str, tokenizer, dtype: str = "float32") -> ModelSpec:
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelSpec(
        architecture=architecture,
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        dtype=dtype,
        max_position_embeddings=config.max_position_embeddings,
        bos_token_id=config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id,
        eos_token_ids=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )


def scorer_dir_for(model_dir: Path) -> Path:
    """Where a model's trained scorers live: beside the model (`MODEL/scorer`, the reference model's),
    else the repository's `scorers/<model directory name>/` (a real model's, shipped in git)."""
    beside = Path(model_dir) / SCORER_DIRNAME
    return beside if beside.is_dir() else SHIPPED_SCORERS / Path(model_dir).resolve().name


def export_model(model_dir: Path, output_dir: Path, scorer_dir: Path | None = None, dtype: str = "float32",
                 force: bool = False) -> dict:
    """Export `model_dir` into `output_dir` (a Triton model version directory) and return the report.
    The scorers come from `scorer_dir` (default: scorer_dir_for(model_dir)). `dtype` float16 writes the
    decoder step's weights, KV cache and logits in half precision (GPU instances); parity is still
    checked against the float32 model, at PARITY_TOLERANCES[dtype]. What is up to date in `output_dir`
    (same fingerprint, every file there) is kept, unless `force`."""
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    scorer_dir = Path(scorer_dir or scorer_dir_for(model_dir))
    if not (model_dir / "config.json").exists():
        raise ExportError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    started = time.time()
    report = _previous_report(output_dir)
    current = fingerprint(model_dir, scorer_dir, dtype, Fingerprint.from_dict(report.get("fingerprint")))
    if not force and _decoder_up_to_date(report, output_dir, current.decoder):
        if _scorers_up_to_date(report, output_dir, current.scorers):
            print(f"[export] {output_dir} is up to date with {model_dir} ({dtype}; fingerprint "
                  f"{current.decoder[:12]}, checked in {time.time() - started:.1f} s): nothing to do "
                  "(python -m export --force exports again)", flush=True)
            report["fingerprint"] = current.as_dict()  # the files' times, so the next check hashes nothing
            (output_dir / REPORT_FILENAME).write_text(json.dumps(report, indent=2) + "\n")
            return report
        print(f"[export] the decoder step in {output_dir} is up to date: exporting the scorers only", flush=True)
        report["fingerprint"] = current.as_dict()
        return _add_scorers(report, scorer_dir, output_dir, _Stages(total=1))
    stage = _Stages(total=6)
    report = _export_decoder(model_dir, output_dir, dtype, stage)
    report["fingerprint"] = current.as_dict()
    report = _add_scorers(report, scorer_dir, output_dir, stage)
    print(f"[export] wrote {output_dir} in {time.time() - started:.0f} s", flush=True)
    return report


def _export_decoder(model_dir: Path, output_dir: Path, dtype: str, stage: _Stages) -> dict:
    """The decoder step, its variants, tokenizer and spec, with every parity check; -> the report."""
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from export.decoder_step import UnsupportedModelError, check_supported
    from export.onnx_export import export_decoder_step, export_mixed_step
    from export.parity import PARITY_TOLERANCES, check_parity
    from export.slot_writer import export_slot_writer
    from export.step_variants import check_mixed_step, check_variants, variant_paths, write_step_variants
    from kvpop.decoder import DecoderStep, mixed_step_path

    stage(f"reading {model_dir}")
    (output_dir / REPORT_FILENAME).unlink(missing_ok=True)  # until this export has passed its checks
    config = AutoConfig.from_pretrained(model_dir)
    try:
        architecture = check_supported(config)
    except UnsupportedModelError as error:
        raise ExportError(str(error)) from error
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if dtype not in PARITY_TOLERANCES:
        raise ExportError(f"dtype must be one of {sorted(PARITY_TOLERANCES)}, got {dtype!r}")
    spec = model_spec_from_config(config, architecture, tokenizer, dtype)
    sliding_window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if sliding_window:
        # The step attends to every valid slot: identical to the model while a cache holds at most
        # `sliding_window` tokens, which every budget <= sliding_window guarantees.
        print(f"[export] note: {architecture} declares sliding_window={sliding_window}; keep KV budgets "
              f"<= {sliding_window} (the full cache attends beyond it)", flush=True)

    stage(f"exporting {architecture} ({spec.num_layers} layers, {spec.num_kv_heads} KV heads) to ONNX")
    output_dir.mkdir(parents=True, exist_ok=True)
    decoder_path = output_dir / spec.decoder_file
    mixed_path = mixed_step_path(decoder_path)
    for stale in (decoder_path, output_dir / (spec.decoder_file + ".data"), *variant_paths(decoder_path).values(), mixed_path):
        stale.unlink(missing_ok=True)
    torch_dtype = getattr(torch, dtype)
    exported_lm = causal_lm if torch_dtype == torch.float32 else copy.deepcopy(causal_lm).to(torch_dtype)  # the reference stays fp32
    export_decoder_step(exported_lm, decoder_path, torch_dtype)
    stage.detail(f"decoder step: {decoder_path.name}, {output_dir.joinpath(spec.decoder_file + '.data').stat().st_size / 2**20:.1f} MB of weights")
    write_step_variants(decoder_path)  # last-position logits, with and without attention (the engine's)
    stage.detail("lean variants: last-position logits, with and without attention")
    export_mixed_step(exported_lm, mixed_path, weights_of=decoder_path, dtype=torch_dtype)  # a decode batch + prompt pieces in one call
    stage.detail(f"mixed decode + prompt step: {mixed_path.name}, sharing the decoder step's weights")
    del exported_lm
    export_slot_writer(output_dir, spec.dtype)  # keeps the batch's cache on the GPU between steps

    stage("writing tokenizer and model spec")
    tokenizer_dir = output_dir / TOKENIZER_DIRNAME
    shutil.rmtree(tokenizer_dir, ignore_errors=True)
    tokenizer.save_pretrained(tokenizer_dir)
    spec.save(output_dir)

    stage("checking parity: ONNX vs Hugging Face (prefill, and decode through a shuffled slot cache)")
    parity = check_parity(causal_lm, DecoderStep(output_dir), tolerance=PARITY_TOLERANCES[dtype])
    report = {
        "source_model": str(model_dir.resolve()),
        "architecture": architecture,
        "model_spec": json.loads((output_dir / "model_spec.json").read_text()),
        "parity": parity.as_dict(),
        "step_variants_max_abs_diff": check_variants(decoder_path),
        "mixed_step_max_abs_diff": check_mixed_step(decoder_path),
        "sliding_window": sliding_window,
        "torch": torch.__version__,
    }
    (output_dir / REPORT_FILENAME).write_text(json.dumps(report, indent=2) + "\n")
    stage(
        f"parity prefill {parity.prefill_max_abs_diff:.2e}, decode {parity.decode_max_abs_diff:.2e} absolute; "
        f"{parity.prefill_relative_diff:.1e}, {parity.decode_relative_diff:.1e} of the logit scale "
        f"{parity.logit_scale:.1f} (tolerance {parity.tolerance:.0e}); greedy token agrees at "
        f"{parity.top1_agreement:.0%} of positions"
    )
    same = 1e-5 if dtype == "float32" else PARITY_TOLERANCES[dtype]  # two graphs of one model, in its precision
    if report["step_variants_max_abs_diff"] > same:
        raise ExportError(f"the lean step variants differ from the exported step: {report['step_variants_max_abs_diff']:.2e}")
    if report["mixed_step_max_abs_diff"] > same * max(1.0, parity.logit_scale):
        raise ExportError(f"the mixed step differs from the exported step: {report['mixed_step_max_abs_diff']:.2e}")
    if not parity.passed:
        raise ExportError(f"parity check failed: {parity.as_dict()} (report in {output_dir / REPORT_FILENAME})")
    return report


def export_scorers_only(model_dir: Path, output_dir: Path, scorer_dir: Path | None = None) -> dict:
    """Re-export only the scorers into an existing export of `model_dir` (the decoder step is not
    touched: minutes saved after retraining a scorer). The export's report gains the scorers' parity."""
    output_dir = Path(output_dir)
    report_path = output_dir / REPORT_FILENAME
    if not report_path.exists():
        raise ExportError(f"{output_dir} holds no export (no {REPORT_FILENAME}): export the model first")
    report = json.loads(report_path.read_text())
    if Path(report["source_model"]).resolve() != Path(model_dir).resolve():
        raise ExportError(f"{output_dir} is an export of {report['source_model']}, not of {model_dir}")
    return _add_scorers(report, scorer_dir or scorer_dir_for(model_dir), output_dir, _Stages(total=1))


def _add_scorers(report: dict, scorer_dir: Path, output_dir: Path, stage) -> dict:
    report["scorers"] = export_learned_scorers(Path(scorer_dir), output_dir, stage)
    (output_dir / REPORT_FILENAME).write_text(json.dumps(report, indent=2) + "\n")
    failed = {name: result for name, result in report["scorers"].items() if not result["passed"]}
    if failed:
        raise ExportError(f"scorer parity failed: {failed}")
    return report


def export_learned_scorers(scorer_dir: Path, output_dir: Path, stage) -> dict[str, dict]:
    """The trained KVpop scorers beside the model (`make train-scorer`), as ONNX with parity checks."""
    from export.scorer_onnx import export_scorers

    for stale in (*output_dir.glob("scorer_*"), output_dir / RETRIEVAL_HEADS_FILE):
        stale.unlink(missing_ok=True)
    if not scorer_dir.is_dir():
        stage(f"no trained KVpop scorer in {scorer_dir}: the kvpop policy will use its attention-based scorer")
        return {}
    stage(f"exporting the KVpop scorers in {scorer_dir}")
    exports = export_scorers(scorer_dir, output_dir)
    if (scorer_dir / RETRIEVAL_HEADS_FILE).exists():  # the base model's retrieval heads (query-aware picks)
        shutil.copyfile(scorer_dir / RETRIEVAL_HEADS_FILE, output_dir / RETRIEVAL_HEADS_FILE)
    return {
        export.onnx_path.name: {"max_abs_diff": export.max_abs_diff, "passed": export.passed} for export in exports
    }
