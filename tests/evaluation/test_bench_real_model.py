"""The real model's benchmarks on the tiny exported model: the decode step's weights/KV split, the English
prompts of exact length, the service benchmark's ratios, and the GPU check's plan and its refusal
without a GPU. Their figures mean something only on SmolLM2; here they must run and add up."""

from __future__ import annotations

import json
import math

import pytest

from kvpop_eval import docs_results
from kvpop_eval.bench import gpu_check, real_service, step_split
from kvpop_eval.bench.english_prompts import english_prompts


def test_step_split_times_full_and_kvpop_caches_and_splits_each_step(tiny_onnx_model_dir, tmp_path):
    assert step_split.main(["--model", str(tiny_onnx_model_dir), "--batches", "1", "2", "--contexts", "64", "128",
                            "--rounds", "1", "--threads", "1", "--bandwidth-mb", "16", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_split.json").read_text())
    assert report["bandwidth"]["read_bytes_per_s"] > 0 and report["weight_bytes"] > 0
    assert len(report["rows"]) == 2 * 2 * 2 and len(report["ratios"]) == 4
    for row in report["rows"]:
        slots = row["context"] if row["cache"] == "full" else math.ceil(0.12 * row["context"])
        assert row["slots"] == slots and row["kv_bytes"] == row["batch"] * slots * report["kv_bytes_per_token"]
        assert row["median_s"] > 0 and row["predicted_gpu_fp16_s"] == pytest.approx(row["predicted_gpu_fp32_s"] / 2)
    assert (tmp_path / "step_split.png").exists() and "prediction" in (tmp_path / "step_split.md").read_text()
    table = docs_results.render_table("step-split", _published(tmp_path, "step-split", report))
    assert table.count("\n| 2 | 128 |") == 2 and "not a measurement" in table and "make bench-step-split" in table


def test_step_split_fit_recovers_a_known_line():
    rows = [{"batch": batch, "slots": slots, "median_s": 0.05 + 2e-7 * batch * slots} for batch in (1, 8) for slots in (100, 1000)]
    fixed, per_slot = step_split.fit(rows)
    assert fixed == pytest.approx(0.05) and per_slot == pytest.approx(2e-7)


def test_english_prompts_have_exactly_the_asked_length_and_repeat(tiny_hf_model_dir):
    prompts = english_prompts(tiny_hf_model_dir, 3, 120, seed=5)
    assert [len(prompt) for prompt in prompts] == [120, 120, 120]
    assert english_prompts(tiny_hf_model_dir, 3, 120, seed=5) == prompts
    assert english_prompts(tiny_hf_model_dir, 1, 120, seed=6)[0] != prompts[0]


def test_ratios_pair_repetitions_and_invert_latencies():
    cell = lambda rps, itl: {"requests_per_s": rps, "output_tokens_per_s": 10 * rps, "ttft_p50_ms": 100.0,  # noqa: E731
                             "itl_p50_ms": itl, "itl_p90_ms": itl}
    cells = {"memory": {"full": [cell(1.0, 300.0), cell(2.0, 200.0)], "kvpop": [cell(2.0, 100.0), cell(3.0, 100.0)]}}
    ratio = real_service.ratios(cells, ["full", "kvpop"])["memory"]["full"]
    assert ratio["rps"] == pytest.approx(1.75) and ratio["rps_range"] == [1.5, 2.0]
    assert ratio["itl_p50_shorter"] == pytest.approx(2.5) and ratio["ttft_p50_shorter"] == pytest.approx(1.0)


def _published(directory, name: str, result: dict):
    """A docs/results folder holding `result` as `name` (what `make publish-results` writes)."""
    published = directory / "published"
    published.mkdir(exist_ok=True)
    (published / f"{name}.json").write_text(json.dumps(result))
    return published


def test_the_service_table_shows_each_system_and_kvpops_ratios(tmp_path):
    cell = {"requests_per_s": 0.2, "output_tokens_per_s": 40.0, "ttft_p50_ms": 900.0, "itl_p50_ms": 100.0, "itl_p90_ms": 120.0}
    chosen = [real_service.workloads(8)["prefill"]]
    cells = {"prefill": {"full": [cell], "kvpop": [{**cell, "requests_per_s": 0.25, "output_tokens_per_s": 50.0, "itl_p50_ms": 40.0}]}}
    report = {"kind": "real-service", "machine": "x86_64, 2 CPUs", "load_average": [1.0], "load_average_end": [1.5],
              "model": "m", "repetitions": 1, "once": [], "systems": ["full", "kvpop"],
              "workloads": [vars(w) for w in chosen], "cells": cells, "ratios": real_service.ratios(cells, ["full", "kvpop"])}
    table = docs_results.render_table("service-smollm2", _published(tmp_path, "service-smollm2", report))
    assert "| full | 0.200 | 40.0 | 900 | 100.0 / 120.0 | 1.25x, 1.25x, 2.50x shorter |" in table
    assert "make bench-service-real" in table


def test_the_memory_workload_pool_holds_four_full_caches(tiny_onnx_model_dir):
    from kvpop.model_spec import ModelSpec

    spec = ModelSpec.load(tiny_onnx_model_dir)
    memory = real_service.workloads(memory_users=8)["memory"]
    needed = 4 * (memory.prompt_tokens + memory.output_tokens) * spec.kv_bytes_per_token
    assert needed <= real_service.pool_mb(spec, memory) * 2**20 < needed + 2**20


def test_gpu_check_prints_its_plan_and_refuses_to_run_without_a_gpu(tmp_path, capsys, monkeypatch):
    assert gpu_check.main(["--plan", "--out-dir", str(tmp_path)]) == 0
    plan = capsys.readouterr().out
    assert "export float16" in plan and "CUDA provider" in plan and "single_gpu" in plan
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever the machine has
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 2
    assert "no GPU" in capsys.readouterr().err and not (tmp_path / "gpu_check.json").exists()


def test_the_memory_workload_queues_full_caches_and_admits_every_kvpop_cache_undegraded(tiny_onnx_model_dir):
    """SmolLM2's geometry, the memory workload's pool (4 full caches of 2,304 tokens): full-cache users beyond
    four queue; kvpop users queue only while three prompts are held whole, and all eight then run at the
    budget they asked for (the pool is never a reason to shrink a cache that fits once prompts are in)."""
    from kvpop.cache.manager import CacheManager
    from kvpop.cache.reservations import KVReservations
    from kvpop.engine.config import EngineConfig
    from kvpop.engine.scheduler import Scheduler
    from kvpop.model_spec import ModelSpec
    from kvpop.policies import load_policy_assets
    from kvpop.request import CacheConfig, GenerationRequest, SamplingParams
    from kvpop.engine.admission import Pending

    spec = ModelSpec("LlamaForCausalLM", num_layers=30, num_attention_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
                     dtype="float32", max_position_embeddings=8192)
    memory = real_service.workloads(memory_users=8)["memory"]
    config = EngineConfig(prefill_chunk=256, min_bounded_chunk=64, whole_prompt_tokens=4096, min_kv_budget=64, max_queue_size=64)
    for cache, first_wave in ((CacheConfig(policy="full"), 4), (CacheConfig(policy="kvpop", compression=0.88, options=dict(scorer="mlstm")), 3)):
        manager = CacheManager(spec, policy_assets=load_policy_assets(tiny_onnx_model_dir),
                               reservations=KVReservations(real_service.pool_mb(spec, memory) * 2**20, spec))
        scheduler = Scheduler(config, has_mixed_step=True, manager=manager)
        admission = scheduler.waiting

        def read(index: int) -> Pending:  # as Engine.read: the manager's plan (policy, budget, the prefill's hold)
            return scheduler.read(GenerationRequest(f"u{index}", [5] * memory.prompt_tokens,
                                                    SamplingParams(max_tokens=memory.output_tokens), cache))

        requests = [read(index) for index in range(memory.clients)]
        admitted = [request if admission.reserve(request) else None for request in requests]
        assert sum(a is not None for a in admitted) == first_wave and all(a.plan.degraded_from is None for a in admitted if a)
        if cache.policy == "kvpop":
            for request, admission_now in zip(requests, admitted):
                if admission_now is not None:
                    manager.prefill_done(request.request_id)  # their first tokens: the prompts are no longer held
            for request in requests[first_wave:]:  # each, once the one before it has its first token
                assert admission.reserve(request) and request.plan.degraded_from is None
                manager.prefill_done(request.request_id)
