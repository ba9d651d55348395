# Two commands on a fresh machine: `make serve` and `make test`. Everything else is set up on the way.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
TINY_MODEL := models/tiny-qwen3
MODEL  ?= $(TINY_MODEL)
# The tiny model is float32; any other model is served in its checkpoint's dtype (auto) unless DTYPE says otherwise.
IS_TINY = $(filter $(abspath $(MODEL)),$(abspath $(TINY_MODEL)))
DTYPE  ?= $(if $(IS_TINY),float32,auto)
PYTEST_ARGS ?=
BENCH_ARGS  ?=
# make bench SHAPE=...: a random model of that shape (tito make-tiny-model --shape), written at models/<shape>
SHAPES := qwen3-0.6b qwen3-1.7b qwen3-4b
SHAPE  ?=

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to import beside the CPU torch
# (and transformers then cannot import any model class); text models need none of them.
CUDA_ONLY := torchvision torchaudio torchcodec

.PHONY: serve dynamo test lint unit bench install model model-check clean help trainers trainers-bg areal areal-bg \
	prime-rl prime-rl-bg seed-run

help:
	@echo "make serve   - install (first time), create the tiny default model, serve it on $(HOST):$(PORT)"
	@echo "               (HOST, PORT, DTYPE; MODEL=DIR serves an existing model directory instead, in its own dtype;"
	@echo "               SERVE_ARGS=... more flags for tito serve)"
	@echo "make dynamo  - tito under Dynamo on this machine: Dynamo's frontend on $(PORT), tito and its sidecar"
	@echo "               (scripts/dynamo_local.sh; installs the dynamo and grpc extras first)"
	@echo "make test    - install (first time), create the tiny model, run lint and the whole test suite"
	@echo "make lint    - ruff + mypy + the generated reference pages + the docs (mkdocs build --strict)"
	@echo "make unit    - the fast tests only (no engine)"
	@echo "make install - the venv with tito and vLLM's CPU build ($(VENV))"
	@echo "make model   - write the tiny default model at $(TINY_MODEL)"
	@echo "make trainers - the venv of SkyRL's clients (TRAINERS_VENV=$(TRAINERS_VENV)) for tests/test_trainers.py"
	@echo "make areal   - the venv of AReaL's clients (AREAL_VENV=$(AREAL_VENV)) for tests/test_areal.py"
	@echo "make bench   - python -m benchmarks serving (tito vs the engine in-process vs vLLM's own server, BENCH_ARGS=...),"
	@echo "               then python -m benchmarks weights (updates vs vLLM's reload; takes no BENCH_ARGS), into results/"
	@echo "               BASE=<commit or checkout>: the working tree against it in the same run (A/B, rounds alternated)"
	@echo "               SHAPE=qwen3-0.6b|qwen3-1.7b|qwen3-4b: instead, that random model (models/<shape>): tito and"
	@echo "               vLLM's server at their defaults under vLLM's own client, and a full weight update"
	@echo "make bench-updates - weight updates at SHAPE (default qwen3-0.6b) with streams running: full, staged delta,"
	@echo "               broadcast, vLLM's reload (UPDATES_ARGS=...; python -m benchmarks updates --help); every"
	@echo "               benchmark: python -m benchmarks (the list), python -m benchmarks NAME --help"
	@echo "make seed-run - Prime-RL's orchestrator, unchanged, finding tito through Dynamo: 3 steps at Qwen3-0.6B's shape"
	@echo "               (OUT=dir, MODEL=dir, SEED_ARGS=...; scripts/seed_run.py --help)"
	@echo "make prime-rl - the venv of Prime-RL's orchestrator (PRIME_RL_VENV=$(PRIME_RL_VENV)), for seed-run and the tests,"
	@echo "               and verifiers' harness environment pinned to it (nothing is resolved at run time)"
	@echo "make fresh-check - a clean clone and an empty HOME (every cache empty), then FRESH_TARGETS (default seed-run;"
	@echo "               \"seed-run test\" for both) from there, timed: what a new user's machine does"
	@echo "make clean   - remove the venv, models/, results/, site/ and the caches"

# Installs go through uv (scripts/uv_pip.py: the sources and constraints pip is configured with): from nothing, the
# test venv takes ~75 s instead of pip's ~250 s. UV_PIP <venv python> install|uninstall ...
UV_VERSION ?= 0.13.9
UV_PIP := $(BIN)/python scripts/uv_pip.py

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(BIN)/uv: | $(BIN)/python
	$(BIN)/pip install -q uv==$(UV_VERSION)

$(VENV)/.installed-cpu: pyproject.toml | $(BIN)/uv
	$(UV_PIP) $(BIN)/python install -e '.[cpu]'
	-$(UV_PIP) $(BIN)/python uninstall $(CUDA_ONLY)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed-cpu
	$(UV_PIP) $(BIN)/python install -e '.[cpu,test,dynamo,grpc]'
	# Dynamo's frontend and vLLM sidecar, for the sidecar tests: --no-deps (see the `dynamo` extra in pyproject.toml).
	$(UV_PIP) $(BIN)/python install --no-deps ai-dynamo==1.6.1
	-$(UV_PIP) $(BIN)/python uninstall $(CUDA_ONLY)
	touch $@

# A trainer's own clients in a venv of their own, outside the checkout so every clone (CI's too) reuses it. $(1): the
# target (`make $(1)`, and `make $(1)-bg`); $(2): the prefix of its variables (_VENV, _PYTHON, _REQS: the pinned list,
# installed with --no-deps; _IMPORTS: what the build imports at the end, so that a missing pin fails the build, not the
# tests, and so that the bytecode of what the clients import is written then, instead of compiling the whole venv:
# ~75 CPU-seconds less for SkyRL's; _NAME: for messages; _NEEDS: a shell test of what the machine must have, which
# says what is missing and fails; _PREPARE: what set-up does after the venv, every time (it must be quick when done);
# _READY: a shell test that it is done). The stamp carries the list's hash: a new list rebuilds the venv (--clear), a
# fresh clone of the same list does not. `make test` starts the build first, in the background (`$(1)-bg`), beside the
# main venv's install, lint and the suite; the test module waits for it. TITO_$(2)_BUILD: the build's log; .pid its
# process, .rc its exit status once it ends, or "skip: <what is missing>" when the machine lacks a prerequisite (the
# tests then skip, saying it).
define client_venv
$(2)_STAMP := $$($(2)_VENV)/.installed-$$(firstword $$(shell sha256sum $$($(2)_REQS)))
export TITO_$(2)_VENV := $$(abspath $$($(2)_VENV))
$(2)_BUILD := $$(TITO_$(2)_VENV).build.log
export TITO_$(2)_BUILD := $$($(2)_BUILD)
$(2)_READY ?= true

$$($(2)_STAMP): | $(BIN)/uv
	@$$($(2)_NEEDS)
	mkdir -p $$(dir $$($(2)_VENV))
	$$($(2)_PYTHON) -m venv --clear $$($(2)_VENV)
	$$(UV_PIP) $$($(2)_VENV)/bin/python install --no-compile-bytecode --no-deps -r $$($(2)_REQS)
	PYTHONDONTWRITEBYTECODE= $$($(2)_VENV)/bin/python -c "import $$($(2)_IMPORTS)"
	touch $$($(2)_VENV)/.installed $$@

$(1): $$($(2)_STAMP)
	$$($(2)_PREPARE)

$(1)-bg: | $(BIN)/uv
	@rm -f $$($(2)_BUILD).rc; \
	if [ -f $$($(2)_STAMP) ] && $$($(2)_READY) 2>/dev/null; then rm -f $$($(2)_BUILD) $$($(2)_BUILD).pid; \
	elif ! why=$$$$( $$($(2)_NEEDS) 2>&1 ); then mkdir -p $$(dir $$($(2)_VENV)); echo "$$$$why" > $$($(2)_BUILD); \
	  echo "skip: $$$$why" > $$($(2)_BUILD).rc; echo "not building $$($(2)_NAME)'s venv (its tests skip): $$$$why"; else \
	  mkdir -p $$(dir $$($(2)_VENV)); \
	  ( $$(MAKE) --no-print-directory $(1); echo $$$$? > $$($(2)_BUILD).rc ) > $$($(2)_BUILD) 2>&1 & \
	  echo $$$$! > $$($(2)_BUILD).pid; echo "building $$($(2)_NAME)'s venv in the background: $$($(2)_BUILD)"; fi
endef

# A client venv's Python: `$(call needs_python,VAR,what it is for)` fails saying what to install when it is missing.
needs_python = command -v $($(1)) >/dev/null || { echo "$(2) needs Python 3.12 ($($(1)) not found: install it, e.g.\
 pyenv install 3.12, or set $(1)=/path/to/python3.12)" >&2; exit 1; }

# SkyRL 0.4's clients, for tests/test_trainers.py: SkyRL needs Python >= 3.12 (its pydantic models refuse 3.11). No
# CPU torch wheel exists for 3.12 here, so torch is PyPI's CUDA build, whose libtorch_cuda.so (loaded by `import torch`
# even on a CPU) links most CUDA libraries: the pinned list leaves out only what nothing loads (triton, cusolver, cupti,
# nvtx, cuda-bindings: ~1 GB of 5.3).
TRAINERS_VENV    ?= $(HOME)/.cache/tito/venv-trainers
TRAINERS_PYTHON  ?= $(firstword $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.12*/bin/python3.12) python3.12)
TRAINERS_REQS    := tests/trainer_clients/skyrl-requirements.txt
TRAINERS_IMPORTS := torch, skyrl.backends.skyrl_train.inference_servers.remote_inference_client, skyrl.backends.skyrl_train.weight_sync.control_plane
TRAINERS_NAME    := SkyRL
TRAINERS_NEEDS    = $(call needs_python,TRAINERS_PYTHON,SkyRL's client (tests/test_trainers.py))
$(eval $(call client_venv,trainers,TRAINERS))

# AReaL 1.0.4's RemotevLLMEngine, for tests/test_areal.py (AReaL's requirements list ~90 packages, ray, litellm and
# CUDA torch among them). Python 3.11, so torch is the CPU wheel; the pinned list is what its import really needs.
AREAL_VENV    ?= $(HOME)/.cache/tito/venv-areal
AREAL_PYTHON  ?= $(PYTHON)
AREAL_REQS    := tests/trainer_clients/areal-requirements.txt
AREAL_IMPORTS := torch, areal.engine.vllm_remote, areal.engine.core.distributed
AREAL_NAME    := AReaL
AREAL_NEEDS    = command -v $(AREAL_PYTHON) >/dev/null || { echo "AReaL's client needs $(AREAL_PYTHON)" >&2; exit 1; }
$(eval $(call client_venv,areal,AREAL))

# Prime-RL's orchestrator, env-server and launcher from its source snapshot, and tito's stand-in trainer, for
# `make seed-run` and tests/test_sidecar_fleet.py (its Prime-RL run): Prime-RL needs Python 3.12 (~=3.12), so torch is
# PyPI's CUDA build, as for SkyRL's venv. The imports: Prime-RL's modules run with the stand-ins first on the path.
PRIME_RL_SRC      ?= $(abspath ../shared/thirdparty/prime-rl)
export TITO_PRIME_RL_SRC := $(PRIME_RL_SRC)
PRIME_RL_VENV     ?= $(HOME)/.cache/tito/venv-prime-rl
PRIME_RL_PYTHON   ?= $(TRAINERS_PYTHON)
PRIME_RL_REQS     := tests/trainer_clients/prime-rl-requirements.txt
PRIME_RL_IMPORTS  := sys; sys.path[:0] = ['scripts/prime_run/standins', '$(PRIME_RL_SRC)/src', '$(PRIME_RL_SRC)/packages/prime-rl-configs/src']; import sitecustomize, prime_rl.orchestrator.orchestrator, prime_rl.entrypoints.env_server, prime_rl.entrypoints.rl, prime_rl.trainer.rl.data, prime_rl.transports.weights.filesystem
PRIME_RL_NAME     := Prime-RL
PRIME_RL_NEEDS     = $(call needs_python,PRIME_RL_PYTHON,Prime-RL's orchestrator) && { test -d $(PRIME_RL_SRC)/src/prime_rl ||\
  { echo "Prime-RL's orchestrator needs Prime-RL's source at $(PRIME_RL_SRC) (set PRIME_RL_SRC)" >&2; exit 1; }; }
# verifiers' harness program (run by the env-server through uv) in an environment pinned to the venv's versions and
# built now, so that a run resolves and installs nothing (scripts/prime_run/harness_env.py).
PRIME_RL_HARNESS   = $(PRIME_RL_VENV)/bin/python scripts/prime_run/harness_env.py
PRIME_RL_PREPARE   = $(PRIME_RL_HARNESS) prepare $(PRIME_RL_REQS)
PRIME_RL_READY     = $(PRIME_RL_HARNESS) check $(PRIME_RL_REQS)
$(eval $(call client_venv,prime-rl,PRIME_RL))

install: $(VENV)/.installed-cpu

$(TINY_MODEL)/config.json: | $(VENV)/.installed-cpu
	$(BIN)/tito make-tiny-model $(TINY_MODEL)

model: $(TINY_MODEL)/config.json

$(SHAPES:%=models/%/config.json): models/%/config.json: | $(VENV)/.installed-cpu
	$(BIN)/tito make-tiny-model models/$* --shape $*

# The model to serve: the tiny one is written at its own path only; any other MODEL must already be a model directory
# (a typo must not serve random weights).
MODEL_READY := $(if $(IS_TINY),$(TINY_MODEL)/config.json,model-check)

model-check:
	@test -f '$(MODEL)/config.json' || { echo "make: MODEL=$(MODEL) is not a model directory (no config.json in it);" \
	  "give a Hugging Face model directory, or leave MODEL unset for the tiny model ($(TINY_MODEL))" >&2; exit 2; }

# The embedded tiny model starts eagerly (compiling it buys nothing and costs seconds); any other MODEL gets tito's
# defaults, torch.compile as vLLM. SERVE_ARGS=... adds flags.
serve: $(MODEL_READY) $(VENV)/.installed-cpu
	$(BIN)/tito serve --model $(MODEL) --host $(HOST) --port $(PORT) --dtype $(DTYPE) \
	  $(if $(IS_TINY),--enforce-eager) $(SERVE_ARGS)

$(VENV)/.installed-dynamo: pyproject.toml $(VENV)/.installed-cpu
	$(UV_PIP) $(BIN)/python install -e '.[cpu,dynamo,grpc]'
	# --no-deps: see the `dynamo` extra in pyproject.toml.
	$(UV_PIP) $(BIN)/python install --no-deps ai-dynamo==1.6.1
	-$(UV_PIP) $(BIN)/python uninstall $(CUDA_ONLY)
	touch $@

dynamo: $(MODEL_READY) $(VENV)/.installed-dynamo
	MODEL=$(MODEL) HTTP_PORT=$(PORT) VENV=$(VENV) bash scripts/dynamo_local.sh $(if $(IS_TINY),--enforce-eager) \
	  --dtype $(DTYPE) $(SERVE_ARGS)

# The docs: the generated reference pages must be current, and the site must build with every link and anchor found
# (offline: no web fonts, no plugin that fetches), into site/.
lint: $(VENV)/.installed-test
	$(BIN)/ruff check app routers tito tests scripts benchmarks
	$(BIN)/mypy app routers tito benchmarks
	$(BIN)/python scripts/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

unit: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "not engine" $(PYTEST_ARGS)

# Lint runs beside the suite, not before it (~2 minutes of one core from a clean clone, mostly mypy without its
# cache; the suite leaves a quarter of two cores idle): its report is printed after the suite's, and fails the run.
test: trainers-bg areal-bg prime-rl-bg $(VENV)/.installed-test $(MODEL_READY)
	@echo "make lint: running beside the tests (log: .lint.log)"
	@( $(MAKE) --no-print-directory lint > .lint.log 2>&1; echo $$? > .lint.rc ) & \
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; wait; \
	echo "---- make lint (.lint.log) ----"; cat .lint.log; \
	if [ "$$(cat .lint.rc)" != 0 ]; then echo "make test: lint failed (above)"; exit 1; fi; exit $$rc

# Each system starts fresh every round, one at a time; on an otherwise idle machine (numbers from a busy one mean
# nothing). Tables on stdout (serving, then weight updates against vLLM's own reload), results/bench*.json, bench.png.
# BASE=<commit or checkout>: also that tree's tito, its server started from its own tree, in the same rounds.
# SHAPE=: streamed /v1/completions under vLLM's own benchmark client (vllm.benchmarks.serve), tito and vLLM's server,
# each at its defaults (both compile), rounds alternated; then a full update on tito (benchmarks/serving_vllm.py).
# BENCH_ARGS=--cases c16,c64,c16-long adds the 64-concurrent and 1,024/256 cases; --systems tito,eager,vllm adds tito
# with --enforce-eager.
ifneq ($(SHAPE),)
ifeq ($(filter $(SHAPE),$(SHAPES)),)
$(error SHAPE=$(SHAPE): one of $(SHAPES))
endif
bench: $(VENV)/.installed-test models/$(SHAPE)/config.json
	$(BIN)/python -m benchmarks serving --vllm-bench --defaults --update --systems tito,vllm \
	  --model models/$(SHAPE) --out results --start-timeout 900 $(BENCH_ARGS)
else
bench: $(VENV)/.installed-test $(MODEL_READY)
	$(BIN)/python -m benchmarks serving --model $(MODEL) --out results $(if $(BASE),--base $(BASE)) $(BENCH_ARGS)
	$(BIN)/python -m benchmarks weights --json results/bench_weights.json
endif

# make bench-updates SHAPE=qwen3-0.6b (the default; also qwen3-1.7b, qwen3-4b): weight updates at that shape with
# streaming clients running (python -m benchmarks updates): tito's full update from disk, staged delta commit and gloo
# broadcast against vLLM's own reload of the same files; seconds, GB/s against the file read speed, the pause a stream
# saw, peak memory. UPDATES_ARGS=... more flags (--soak 20: the soak instead; --kinds full; --systems tito).
UPDATES_SHAPE := $(or $(SHAPE),qwen3-0.6b)
UPDATES_ARGS  ?=
.PHONY: bench-updates
bench-updates: $(VENV)/.installed-test models/$(UPDATES_SHAPE)/config.json
	mkdir -p results
	$(BIN)/python -m benchmarks updates --model $(abspath models/$(UPDATES_SHAPE)) \
	  --json results/bench-updates-$(UPDATES_SHAPE).json $(UPDATES_ARGS)

# The seed's run: Prime-RL's orchestrator, unchanged, finding tito through Dynamo, 3 steps at Qwen3-0.6B's shape
# (scripts/seed_run.py; docs/guides/prime-rl-orchestrator.md). OUT=dir keeps the output (default: a temporary one);
# MODEL=dir another model (only when given: the seed's run defaults to Qwen3-0.6B's shape, not to MODEL's default, the
# tiny model); SEED_ARGS=... more flags (--route http: straight at tito, no Dynamo).
SEED_ARGS ?=
seed-run: $(VENV)/.installed-dynamo prime-rl
	$(BIN)/python scripts/seed_run.py $(if $(OUT),--out $(OUT)) \
	  $(if $(filter command line environment,$(origin MODEL)),--model $(MODEL)) $(SEED_ARGS)

# What a new user's machine does: a clean clone of HEAD, an empty HOME (uv's, pip's and every client venv's caches
# empty), then FRESH_TARGETS from there, each timed (scripts/fresh_check.sh). FRESH_DIR=dir, FRESH_KEEP=1 keeps it.
FRESH_TARGETS ?= seed-run
.PHONY: fresh-check
fresh-check:
	bash scripts/fresh_check.sh $(FRESH_TARGETS)

clean:
	rm -rf $(VENV) models results site .pytest_cache .mypy_cache .ruff_cache .lint.log .lint.rc
