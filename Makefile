# Two entry points a fresh machine needs (see README): `make demo` and `make test`.
# Each creates or reuses .venv and installs the project from this repository's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench bench-10m ui clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	# setuptools leaves a second copy of the package metadata in the checkout; with the checkout on
	# sys.path (python -m pytest) Airflow would see the provider and its plugin twice
	rm -rf airflow_keyset_provider.egg-info
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

bench-10m: $(STAMP)
	$(BIN)/python -m benchmarks --rows 10000000 $(BENCH_ARGS)

# The Keyset page's bundle (ui/ -> airflow_keyset_provider/plugins/static/ui/, committed): only
# needed after a change under ui/ (Node.js 20 and npm; tests/ui/test_ui_bundle.py says when).
ui:
	cd ui && npm ci --no-audit --no-fund && npm run build

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
