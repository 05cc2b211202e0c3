#!/usr/bin/env bash
# Capacity with prefix caching on vs off: the multi-turn and the shared-system-
# prompt workloads, each searched on our sarathi server twice, caching on and off, the two
# searches side by side in one sitting, each on its own core with its bench client beside
# it and one compute thread (as in bench_capacity.sh).
#
#   benchmarks/prefix_capacity.sh [OUT_DIR]      (default out/prefix_capacity)
#
# Settings (environment): SLOS=0.206,1.031 (those of the capacity runs) BUDGET=128
#   PARTS="multiturn shared"  N_MULTI=300 (6-turn conversations: 50)  N_SHARED=100
#   MAX_TRIALS=7 TRIAL_LIMIT=400 (seconds per trial)  SEARCH_LIMIT=2400 (per search)
# A conversation's turns wait for each other (closed loop), so the conversations must be
# many for the arrival rate, not their number, to set the load.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/prefix_capacity}
PY=${PY:-.venv/bin/python}
SLOS=${SLOS:-0.206,1.031} BUDGET=${BUDGET:-128} PARTS=${PARTS:-multiturn shared}
N_MULTI=${N_MULTI:-300} N_SHARED=${N_SHARED:-100} MAX_TRIALS=${MAX_TRIALS:-7}
TRIAL_LIMIT=${TRIAL_LIMIT:-400} SEARCH_LIMIT=${SEARCH_LIMIT:-2400}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT"

search() {  # part, caching (on|off), core, workload flags...
  local part=$1 caching=$2 core=$3; shift 3
  local name="$part-$caching" server_args=""
  [[ $caching == off ]] && server_args="--no-enable-prefix-caching"
  mkdir -p "$OUT/$name"
  timeout "$SEARCH_LIMIT" taskset -c "$core" "$PY" -m stallfree bench capacity \
    --policy sarathi --token-budget "$BUDGET" --tbt-slo "$SLOS" "--server-args=$server_args" \
    --seed 0 --precision 0.1 --max-trials "$MAX_TRIALS" --max-duration "$TRIAL_LIMIT" \
    --sched-delay-source ttft --disable-tqdm "$@" \
    --trial-detail-dir "$OUT/$name/trials" --log-dir "$OUT/$name/logs" \
    --result-file "$OUT/$name/capacity.json" > "$OUT/$name/search.log" 2>&1
}

for part in $PARTS; do
  case $part in
    multiturn) flags=(--dataset sharegpt --length-scale 0.125 --max-model-len 1024 --turns 6
                      --think-time 2 --num-prompts "$N_MULTI" --start-rate 0.5 --min-rate 0.005) ;;
    shared) flags=(--dataset random --random-input-len 32 --random-output-len 32
                   --shared-prefix-len 1024 --max-model-len 2048 --num-prompts "$N_SHARED"
                   --start-rate 1 --min-rate 0.02) ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
  search "$part" on 0 "${flags[@]}" & on_pid=$!
  search "$part" off 1 "${flags[@]}" & off_pid=$!
  wait "$on_pid" "$off_pid" || echo "a $part search failed: see $OUT/$part-*/search.log" >&2
  for caching in on off; do
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], json.dumps(r.get('systems', r), default=str)[:600])" \
      "$OUT/$part-$caching/capacity.json" "$part-$caching" || true
  done
done
