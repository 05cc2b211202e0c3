#!/usr/bin/env bash
# One GGUF file served three ways, one server at a time, measured by the same client
# (`stallfree bench serve`, random 256-token prompts, 64 output tokens, every one generated):
#   ours-q    stallfree, its weights kept quantized (--quantization auto)
#   ours-f32  stallfree, its weights dequantized to float32 (--quantization none)
#   llama     llama.cpp's llama-server on the same file (benchmarks/peers.md: building it)
# and per system: one request at a time (12 requests), 32 at once, 32 at 2 req/s.
#
#   LLAMA_SERVER=/path/to/llama-server benchmarks/served_quantized.sh [OUT_DIR]
#
# Settings (environment): GGUF (default: the default model's file), REPEATS=2,
# SYSTEMS="ours-q ours-f32 llama", THREADS=2. Results: OUT_DIR/summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/served_quantized}
PY=${PY:-.venv/bin/python}
REPEATS=${REPEATS:-2} SYSTEMS=${SYSTEMS:-"ours-q ours-f32 llama"} THREADS=${THREADS:-2}
GGUF=${GGUF:-$($PY -c 'from stallfree.model.loader import default_model_path as p; print(p())')}
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
port=$($PY -c 'from stallfree.bench.systems import free_port; print(free_port())')
url="http://127.0.0.1:$port"
up() { for _ in $(seq 1 300); do curl -sf "$url/health" >/dev/null && return 0; sleep 1; done; return 1; }
run() {  # label args...
  local label=$1; shift
  timeout 900 "$PY" -m stallfree bench serve --base-url "$url" --dataset random \
    --random-input-len 256 --random-output-len 64 --disable-tqdm ${EXTRA[@]+"${EXTRA[@]}"} \
    --no-detail --label "$label" --result-file "$OUT/$label.json" "$@" > "$OUT/$label.txt" 2>&1
  "$PY" - "$OUT/$label.json" "$label" >> "$OUT/summary.md" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
f = lambda key, fmt: "n/a" if r.get(key) is None else format(r[key], fmt)
print(f"| {sys.argv[2]} | {f('output_throughput', '.1f')} | {f('median_ttft_ms', '.0f')} | "
      f"{f('median_itl_ms', '.1f')} | {f('p99_itl_ms', '.1f')} |")
EOF
}
echo "CPU flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_int8|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')" > "$OUT/summary.md"
echo "| run | output tok/s | median TTFT ms | median ITL ms | P99 ITL ms |" >> "$OUT/summary.md"
echo "|---|---:|---:|---:|---:|" >> "$OUT/summary.md"
for sys in $SYSTEMS; do
  EXTRA=()
  case $sys in
    ours-q|ours-f32)
      q=$([ "$sys" = ours-q ] && echo auto || echo none)
      OMP_NUM_THREADS=$THREADS setsid "$PY" -m stallfree serve --model "$GGUF" --host 127.0.0.1 \
        --port "$port" --dtype float32 --quantization "$q" > "$OUT/$sys.log" 2>&1 &
      ;;
    llama)
      EXTRA=(--ban-token-ids 0,2)  # it takes no ignore_eos: full-length outputs by banning EOS
      setsid "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}" -m "$GGUF" \
        --host 127.0.0.1 --port "$port" -c 16384 -np 32 --kv-unified -t "$THREADS" \
        > "$OUT/$sys.log" 2>&1 &
      ;;
  esac
  pid=$!
  if ! up; then echo "$sys did not start (see $OUT/$sys.log)" >&2; kill "$pid"; continue; fi
  run "$sys-warm" --num-prompts 4 > /dev/null
  for r in $(seq 1 "$REPEATS"); do
    run "$sys-single-r$r" --num-prompts 12 --max-concurrency 1
    run "$sys-all-r$r" --num-prompts 32
    run "$sys-rate2-r$r" --num-prompts 32 --request-rate 2
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true; sleep 2
done
grep -v -- "-warm" "$OUT/summary.md" > "$OUT/summary.tmp" && mv "$OUT/summary.tmp" "$OUT/summary.md"
cat "$OUT/summary.md"
