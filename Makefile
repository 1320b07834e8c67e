# Two entry points a fresh machine needs (see README): `make demo` and `make test`.
# Each creates or reuses .venv and installs the project from this repository's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The pip extras installed into .venv. `test` needs no system library; CI (.ci/run) passes
# EXTRAS=test,mysql-native once pkg-config and libmariadb-dev are installed, so the tests of
# mysql+mysqldb:// (mysqlclient, built from source) run there. One stamp per set of extras.
EXTRAS ?= test
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: demo test lint docs dist bench bench-10m bench-100m ui clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
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

# The HTML docs and the API reference (Sphinx + myst-parser; docs/conf.py); any warning fails.
docs: $(STAMP)
	rm -rf docs/_build
	$(BIN)/python -m sphinx -b html -W --keep-going -q docs docs/_build/html

# The sdist and the wheel, checked as PyPI would (twine), with the files a release must carry.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	rm -rf airflow_keyset_provider.egg-info
	$(BIN)/twine check --strict dist/*
	$(BIN)/python -m zipfile -l dist/*.whl > dist/wheel-contents.txt
	for f in airflow_keyset_provider/py.typed airflow_keyset_provider/plugins/static/ui/keyset-ui.js licenses/LICENSE; do \
	  grep -q "$$f" dist/wheel-contents.txt || { echo "the wheel lacks $$f"; exit 1; }; done
	rm dist/wheel-contents.txt

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

bench-10m: $(STAMP)
	$(BIN)/python -m benchmarks --rows 10000000 $(BENCH_ARGS)

# The Keyset page's bundle (ui/ -> airflow_keyset_provider/plugins/static/ui/, committed): only
# needed after a change under ui/ (Node.js 20 and npm; tests/ui/test_ui_bundle.py says when).
ui:
	cd ui && npm ci --no-audit --no-fund && npm run build

# Issue #22, on demand only (never in CI): builds kbench_scale_100000000.big once (~21 GB on disk
# with indexes, ~7 min here; reused afterwards), then one round of 4,096 ranges over 16 pull tasks.
bench-100m: $(STAMP)
	df -h /
	$(BIN)/python -m benchmarks.scale build --rows 100000000
	$(BIN)/python -m benchmarks.scale round --rows 100000000 $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache dist docs/_build
