#!/usr/bin/env bash
# AIPerf (PyPI `aiperf`) against `beam-serve --model $MODEL` (default beam-tiny-code, the shipped
# trained model): one streamed chat run and one streamed completions run. It starts the server,
# waits for it, runs both, stops the server, and keeps the summaries (not the per-request logs)
# under $OUT.
#
#   AIPERF=/path/to/venv/bin/aiperf [MODEL=beam-tiny-code] [TOKENIZER=DIR] benchmarks/server/run_aiperf.sh [OUT]
#
# AIPerf goes in its own virtualenv (`python -m venv V && V/bin/pip install aiperf`): it pins its
# own versions of transformers and friends, which the project's venv should not take on.
# The tokenizer is read from disk, never from a hub: the model's own asset directory
# (beam_jax/assets/$MODEL) where it has a tokenizer.json, else the shared beam_jax/assets/tokenizer
# (the presets with random weights, such as beam-tiny, have no directory of their own).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/server/results/$(date -u +%Y-%m-%dT%H%MZ)}
AIPERF=${AIPERF:-aiperf}
BEAM_SERVE=${BEAM_SERVE:-beam-serve}
PORT=${PORT:-8123}
MODEL=${MODEL:-beam-tiny-code}
if [ -z "${TOKENIZER:-}" ]; then
  TOKENIZER=beam_jax/assets/tokenizer
  [ -e "beam_jax/assets/$MODEL/tokenizer.json" ] && TOKENIZER=beam_jax/assets/$MODEL
fi
URL=http://127.0.0.1:$PORT
WORK=$(mktemp -d)
mkdir -p "$OUT"

"$BEAM_SERVE" --model "$MODEL" --port "$PORT" --log-level warning > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "$URL/health" > /dev/null && break
  kill -0 $SERVER || { cat "$WORK/server.log"; exit 1; }
  sleep 1
done

# The same load for both: 128-token synthetic prompts, 64 output tokens (ignore_eos), 8 concurrent
# clients, 48 requests after 4 warm-up requests. Token counts are the server's (usage), so the
# model's text need not tokenize back to 64 tokens. One AIPerf worker and one record
# processor: on a 2-core machine AIPerf's own processes take CPU from the server.
COMMON=(--model "$MODEL" --url "$URL" --streaming --tokenizer "$TOKENIZER"
        --prompt-input-tokens-mean 128 --prompt-input-tokens-stddev 0
        --prompt-output-tokens-mean 64 --prompt-output-tokens-stddev 0 --extra-inputs ignore_eos:true
        --concurrency 8 --request-count 48 --warmup-request-count 4 --use-server-token-count
        --random-seed 0 --no-auto-plot --ui none --workers-max 1 --record-processors 1)

run() {  # name, endpoint type
  local name=$1 kind=$2 rc=0
  echo "\$ aiperf profile --endpoint-type $kind ${COMMON[*]}" > "$OUT/$name-console.txt"
  "$AIPERF" profile --endpoint-type "$kind" "${COMMON[@]}" --output-artifact-dir "$WORK/$name" \
    >> "$WORK/$name.log" 2>&1 || rc=$?
  # The console summary AIPerf writes, or where it has none (a failed run) the end of its output.
  if [ -e "$WORK/$name/profile_export_console.txt" ]; then
    cat "$WORK/$name/profile_export_console.txt" >> "$OUT/$name-console.txt"
  else
    tail -n 15 "$WORK/$name.log" >> "$OUT/$name-console.txt"
  fi
  echo "exit status: $rc" >> "$OUT/$name-console.txt"
  for f in "$WORK/$name"/*aiperf*.json "$WORK/$name"/*aiperf*.csv; do
    [ -e "$f" ] && cp "$f" "$OUT/$name-$(basename "$f")"
  done
  # Why requests failed, counted (the per-request jsonl stays out of the repository).
  if [ -e "$WORK/$name/profile_export.jsonl" ]; then
    python3 - "$WORK/$name/profile_export.jsonl" > "$OUT/$name-errors.txt" <<'EOF'
import collections, json, sys
counts = collections.Counter()
for line in open(sys.argv[1]):
    record = json.loads(line)
    error = record.get("error")
    counts[(record["metadata"].get("benchmark_phase"), error["message"] if error else "ok")] += 1
for (phase, what), n in sorted(counts.items()):
    print(f"{n:4d}  {phase}: {what}")
EOF
  fi
}

# The server's own /metrics (TTFT and inter-token histograms, counters) after each run: the
# difference between two snapshots is that run's share, measured on the server.
metrics() { curl -s "$URL/metrics" | grep -vE '^#|_bucket' | sed "s/^/$1 /" >> "$OUT/server-metrics.txt"; }
: > "$OUT/server-metrics.txt"
{ echo "beam-serve --model $MODEL; AIPerf tokenizer $TOKENIZER"; date -u; uname -m; nproc; grep -m1 "model name" /proc/cpuinfo; uptime; } > "$OUT/machine.txt"
metrics before
run chat chat
metrics after-chat
run completions completions
metrics after-completions
uptime >> "$OUT/machine.txt"  # the load average: other work on the machine slows the server
tail -n 40 "$WORK/server.log" > "$OUT/server-log-tail.txt"  # warnings and errors only (--log-level)
python3 benchmarks/server/summarize.py "$OUT" > "$OUT/summary.md"
echo "results in $OUT; full logs in $WORK"
