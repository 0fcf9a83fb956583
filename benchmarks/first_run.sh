#!/bin/bash
# The first run, as a new user types it: twelve everyday prompts through `edgeinfer run` with
# the default settings, each with its wall time, finish reason and the start of its output.
# Usage: benchmarks/first_run.sh [MODEL]   (uses the daemon EDGEINFER_HOST points at,
# starting one if none answers; set EDGEINFER_HOME for a fresh store)
model=${1:-qwen2.5-coder:0.5b}
cd "$(dirname "$0")/.."
prompts=("Why is the sky blue?" "What is the capital of France?" "Write a haiku about autumn."
         "How do I boil an egg?" "Explain what a computer virus is."
         "Give me three tips for better sleep." "What is 12 times 7?"
         "Translate 'good morning' into Spanish." "Who wrote Romeo and Juliet?"
         "Write a short email asking my boss for a day off."
         "At what temperature does water boil, in Celsius?" "Name the three primary colors.")
out=$(mktemp); err=$(mktemp)
for p in "${prompts[@]}"; do
  echo "=== $p"
  s=$(date +%s.%N)
  .venv/bin/edgeinfer run "$model" "$p" --verbose > "$out" 2> "$err"
  e=$(date +%s.%N)
  echo "wall: $(echo "$e - $s" | bc) s"
  grep "finish" "$err"
  head -c 600 "$out"; echo; echo "[... $(wc -c < "$out") chars]"
done
rm -f "$out" "$err"
