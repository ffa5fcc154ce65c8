# HybridFlow Lab: `make demo` and `make test` work on a fresh clone with only python3 installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
export HF_HUB_OFFLINE := 1
export RAY_DEDUP_LOGS := 0

.PHONY: demo test test-fast lint browser dashboard bench-dispatch bench-e2e bench-trl clean lock

$(VENV)/.runtime: requirements/runtime.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements/runtime.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements/test.txt
	$(PY) -m pip install --quiet -r requirements/test.txt
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

test: $(VENV)/.browser
	$(BIN)/ruff check .
	$(BIN)/pytest -q --durations=15
	$(BIN)/pytest -q --nbval-lax notebooks tutorials

test-fast: $(VENV)/.test
	$(BIN)/pytest -q -m "not slow"

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
bench-trl: requirements/trl-baseline.txt
	test -x .venv-trl/bin/python || $(PYTHON) -m venv .venv-trl
	.venv-trl/bin/pip install --quiet -r requirements/trl-baseline.txt
	.venv-trl/bin/python benchmarks/trl_grpo.py

# Re-resolve the pins in a scratch venv (needs the package registries).
lock:
	rm -rf /tmp/hybridflow-lock && $(PYTHON) -m venv /tmp/hybridflow-lock
	/tmp/hybridflow-lock/bin/pip install --quiet torch==2.13.0 "ray>=2.60,<3" numpy pandas pyarrow pyyaml \
		"transformers>=5.16,<6" tokenizers safetensors "deepspeed>=0.19,<0.20" tqdm wandb ipywidgets anywidget \
		plotly panel
	@echo "compare with requirements/runtime.txt:"; /tmp/hybridflow-lock/bin/pip freeze | sed 's/+cpu//'

clean:
	rm -rf $(VENV) .venv-trl .pytest_cache .ruff_cache
