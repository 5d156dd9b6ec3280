# Two entry points (see README): `make demo` and `make test`. Both set everything up first:
# a virtual environment at .venv (or the active one), ahakv-local in it, and the patched engine.

PYTHON ?= python3
VENV   := $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ahakv-installed

.PHONY: setup demo test bench lint
# a bare `make` sets up everything, the engine too (it stopped at the package: the stamp, the first target)
.DEFAULT_GOAL := setup

# a .venv whose interpreter no longer runs (its Python removed, the checkout moved) is made again: the stamp and
# `test -x` said it was there
$(STAMP): pyproject.toml
	@test -n "$(VIRTUAL_ENV)" || $(PY) -c '' 2>/dev/null || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'   # dev = every extra (build, serve, eval) + the test tools
	@touch $@

setup: $(STAMP)
	@$(PY) -c 'import ahakv_local' 2>/dev/null || { rm -f $(STAMP); $(MAKE) --no-print-directory $(STAMP); }
	$(VENV)/bin/ahakv-local build --rpc   # RPC is a superset: the tests of the workers run too

demo: setup
	$(VENV)/bin/ahakv-local generate -f /usr/share/common-licenses/GPL-3 -n 128 --budget 256 --stats

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) benchmarks/report.py

lint: $(STAMP)
	$(VENV)/bin/ruff check ahakv_local tests benchmarks examples
