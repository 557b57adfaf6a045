# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both install everything they need, system packages included.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tspd-installed

.PHONY: setup sysdeps demo test lint typecheck unit clean

setup: sysdeps $(STAMP)

# Mooncake's CPU wheel needs Debian's libibverbs1 (no CUDA, no RDMA hardware);
# the SVG state diagrams (tspd diagrams, checked by the tests) need graphviz's `dot`.
sysdeps:
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
	  echo "installing libibverbs1 (needed by Mooncake)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1; \
	fi
	@if ! command -v dot >/dev/null; then \
	  echo "installing graphviz (needed by the SVG state diagrams)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends graphviz; \
	fi

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,docs,mooncake-cpu]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/tspd demo

lint: setup
	$(VENV)/bin/ruff check src tests fuzz examples docs
	$(VENV)/bin/ruff format --check src tests fuzz examples docs

typecheck: setup
	$(VENV)/bin/mypy src

unit: setup
	$(VENV)/bin/pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV)
