# Two commands on a fresh machine: `make serve` and `make test`. Everything else is set up on the way.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
MODEL  ?= models/tiny-qwen3
DTYPE  ?= float32
PYTEST_ARGS ?=

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to import beside the CPU torch
# (and transformers then cannot import any model class); text models need none of them.
CUDA_ONLY := torchvision torchaudio torchcodec

.PHONY: serve test lint unit bench install model clean help

help:
	@echo "make serve   - install (first time), create the tiny default model, serve it on $(HOST):$(PORT)"
	@echo "make test    - install (first time), create the tiny model, run lint and the whole test suite"
	@echo "make lint    - ruff + mypy"
	@echo "make unit    - the fast tests only (no engine)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-cpu: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[cpu]'
	-$(BIN)/pip uninstall -y -q $(CUDA_ONLY)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed-cpu
	$(BIN)/pip install -q -e '.[cpu,test]'
	-$(BIN)/pip uninstall -y -q $(CUDA_ONLY)
	touch $@

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

test: $(VENV)/.installed-test $(MODEL)/config.json lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) models results .pytest_cache .mypy_cache .ruff_cache
