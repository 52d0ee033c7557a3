# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PIP := $(BIN)/pip install --quiet --disable-pip-version-check

.PHONY: venv test lint typecheck demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck

# basedpyright (its config in pyproject.toml) reads the package as installed: through links
# named as the import names, since it cannot follow the editable install's import hook
TYPECHECK := build/typecheck/sft_runtime

typecheck: venv
	mkdir -p $(TYPECHECK)
	for p in runtime events states traces; do ln -sfn ../../../$$p $(TYPECHECK)/$$p; done
	ln -sf ../../../sft_runtime/__init__.py ../../../sft_runtime/sft_v2.py $(TYPECHECK)/
	$(BIN)/basedpyright

# Two files at a time, each whole on one pytest worker (its module fixtures built once), in
# the order tests/support/timing.py gives them (the longest first); a machine with more cores
# may give more (TEST_WORKERS=4), and TEST_WORKERS=0 runs one file at a time
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: venv
	$(BIN)/sft-runtime demo

bench: venv
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
