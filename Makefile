# Thin wrappers. Every target sets itself up first (creates .venv, installs kvlab) — see scripts/setup.sh.
PY      := .venv/bin/python
SMOKE   ?= 0
MODEL   ?=
DEVICE  ?= auto
TIMEOUT ?= 1800

.PHONY: setup run test lab bench lint clean-notebooks clean

setup:
	@bash scripts/setup.sh

## run: execute every notebook headless (papermill) -> build/notebooks/*.ipynb, *.html, timings.csv
run: setup
	$(PY) scripts/run_notebooks.py --smoke $(SMOKE) --device $(DEVICE) --timeout $(TIMEOUT) $(if $(MODEL),--model $(MODEL))

## test: the test suite, exactly what CI runs
test: setup
	$(PY) -m pytest -q

lab: setup
	.venv/bin/jupyter lab notebooks/

bench: setup
	$(PY) scripts/bench_block_manager.py

lint: setup
	.venv/bin/ruff check kvlab scripts tests

## strip outputs from the committed notebooks
clean-notebooks: setup
	$(PY) scripts/run_notebooks.py --strip

clean:
	rm -rf build .pytest_cache
