# dsec — the two commands a new machine needs: `make up` and `make test`.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup up down status demo test test-unit test-integration lint protos bench clean

## setup: install apt/pip dependencies, start dockerd, build base images (idempotent, fast when done)
setup:
	@bash scripts/setup.sh

## up: set up if needed, start the local cluster, run the demo through libdsec
up: setup
	@$(PY) -m dsecctl up
	@$(PY) -m dsecctl demo

## down: stop the local cluster
down:
	@$(PY) -m dsecctl down

status:
	@$(PY) -m dsecctl status

demo:
	@$(PY) -m dsecctl demo

## test: set up if needed, then run the whole suite (lint, types, unit, integration)
test: setup
	@$(PY) -m pytest -q -p no:cacheprovider --durations=30 tests

test-unit:
	@$(PY) -m pytest -q -p no:cacheprovider tests/unit

lint:
	@$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) -m mypy

## protos: regenerate dsec/ from protos/ (commit the result)
protos:
	@bash scripts/gen-protos.sh

## bench: run the benchmarks (they print tables with same-run baselines)
bench: setup
	@for b in bench/bench_*.py; do $(PY) $$b || exit 1; done
