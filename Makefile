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

.PHONY: venv test test-fast bench replay calibrate fidelity demo serve models lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,plot]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(PY) -m talaria.bench $(ARGS)

replay: $(STAMP)
	$(VENV)/bin/talaria replay $(if $(TRACE),--trace $(TRACE)) --servers $(SERVERS) $(ARGS)

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
	$(VENV)/bin/ruff check talaria engine substrate router workloads tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
