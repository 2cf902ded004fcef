# KVpop Serve entry points. Every target works from a fresh clone: setup runs first when needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.kvpop-setup

MODEL ?=
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
ADDRESS ?= 0.0.0.0
CONFIG ?= auto
PID_FILE := run/tritonserver.pid

.PHONY: help setup export serve serve-bg stop test test-unit test-e2e clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

setup: $(SETUP_STAMP)  ## create .venv with pinned dependencies and the tritonserver binary (idempotent)

$(SETUP_STAMP): requirements/runtime.txt requirements/constraints.txt pyproject.toml client/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/constraints.txt -r requirements/runtime.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps nvidia-pytriton==0.7.0
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e . -e ./client
	$(PY) -m kvpop.serving.launcher --prepare-only
	@touch $@

export: setup  ## export MODEL=<hf dir> (default: the shipped reference model) into model_repository/
	$(PY) -m export $(if $(MODEL),--model $(MODEL))

serve: setup  ## run tritonserver in the foreground (HTTP 8000, gRPC 8001, metrics 8002; Ctrl-C stops)
	$(PY) -m kvpop.serving.launcher --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --address $(ADDRESS) --model-config-name $(CONFIG)

serve-bg: setup  ## run tritonserver in the background (log in run/tritonserver.log); `make stop` stops it
	$(PY) -m kvpop.serving.launcher --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --address $(ADDRESS) --model-config-name $(CONFIG) \
		--pid-file $(PID_FILE) --log-file run/tritonserver.log

stop:  ## stop a server started with `make serve-bg`
	@if [ -f $(PID_FILE) ]; then \
		pid=$$(cat $(PID_FILE)); kill -INT $$pid 2>/dev/null && echo "stopping tritonserver $$pid"; \
		for i in $$(seq 1 30); do kill -0 $$pid 2>/dev/null || break; sleep 0.5; done; \
		kill -9 $$pid 2>/dev/null; rm -f $(PID_FILE); \
	else echo "no background server ($(PID_FILE) missing)"; fi

test: setup  ## unit tests and end-to-end tests against a real tritonserver (a few minutes)
	$(PY) -m pytest -q

test-unit: setup  ## unit tests only
	$(PY) -m pytest -q -m "not server"

test-e2e: setup  ## end-to-end tests only (real tritonserver, tritonclient HTTP and gRPC)
	$(PY) -m pytest -q -m server

clean:  ## remove exported artifacts and run files (keeps .venv)
	rm -rf run model_repository/kvpop_engine/1/{decoder_step.onnx,decoder_step.onnx.data,model_spec.json,export_report.json,tokenizer}
