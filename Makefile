# Two commands on a fresh machine: `make serve` and `make test`. Everything else is set up on the way.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
MODEL  ?= models/tiny-qwen3
DTYPE  ?= float32
PYTEST_ARGS ?=
BENCH_ARGS  ?=

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to import beside the CPU torch
# (and transformers then cannot import any model class); text models need none of them.
CUDA_ONLY := torchvision torchaudio torchcodec

.PHONY: serve test lint unit bench install model clean help trainers

help:
	@echo "make serve   - install (first time), create the tiny default model, serve it on $(HOST):$(PORT)"
	@echo "make test    - install (first time), create the tiny model, run lint and the whole test suite"
	@echo "make lint    - ruff + mypy"
	@echo "make unit    - the fast tests only (no engine)"
	@echo "make trainers - the venv of SkyRL's clients (TRAINERS_VENV=$(TRAINERS_VENV)) for tests/test_trainers.py"
	@echo "make bench   - benchmark tito vs the engine in-process vs vLLM's own server (BENCH_ARGS=...), into results/"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-cpu: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[cpu]'
	-$(BIN)/pip uninstall -y -q $(CUDA_ONLY)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed-cpu
	$(BIN)/pip install -q -e '.[cpu,test,dynamo,grpc]'
	# Dynamo's frontend and vLLM sidecar, for the sidecar tests: --no-deps (see the `dynamo` extra in pyproject.toml).
	$(BIN)/pip install -q --no-deps ai-dynamo==1.6.1
	-$(BIN)/pip uninstall -y -q $(CUDA_ONLY)
	touch $@

# SkyRL 0.4's clients, for tests/test_trainers.py: SkyRL needs Python >= 3.12 (its pydantic models refuse 3.11), so
# they get a venv of their own. No CPU torch wheel exists for 3.12 here, so pip takes PyPI's (CUDA) build: ~5 GB,
# 3 to 19 minutes (measured; the network and the disk dominate), once per machine: the venv lives outside the checkout
# so every clone (CI's too) reuses it. The tests skip SkyRL's checks when this venv is missing.
TRAINERS_VENV   ?= $(HOME)/.cache/tito/venv-trainers
TRAINERS_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
export TITO_TRAINERS_VENV := $(abspath $(TRAINERS_VENV))

$(TRAINERS_VENV)/.installed:
	mkdir -p $(dir $(TRAINERS_VENV))
	$(TRAINERS_PYTHON) -m venv $(TRAINERS_VENV)
	$(TRAINERS_VENV)/bin/pip install -q torch==2.13.0 skyrl==0.4.0 loguru aiohttp orjson pybase64 requests
	touch $@

trainers: $(TRAINERS_VENV)/.installed

install: $(VENV)/.installed-cpu

$(MODEL)/config.json: | $(VENV)/.installed-cpu
	$(BIN)/tito make-tiny-model $(MODEL)

model: $(MODEL)/config.json

serve: $(VENV)/.installed-cpu $(MODEL)/config.json
	$(BIN)/tito serve --model $(MODEL) --host $(HOST) --port $(PORT) --dtype $(DTYPE)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check app routers tests scripts
	$(BIN)/mypy app routers

unit: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "not engine" $(PYTEST_ARGS)

test: $(VENV)/.installed-test $(TRAINERS_VENV)/.installed $(MODEL)/config.json lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Each system starts fresh every round, one at a time; on an otherwise idle machine (numbers from a busy one mean
# nothing). Tables on stdout (serving, then weight updates against vLLM's own reload), results/bench*.json, bench.png.
bench: $(VENV)/.installed-test $(MODEL)/config.json
	$(BIN)/python scripts/bench.py --model $(MODEL) --out results $(BENCH_ARGS)
	$(BIN)/python scripts/bench_weights.py --json results/bench_weights.json

clean:
	rm -rf $(VENV) models results .pytest_cache .mypy_cache .ruff_cache
