#!/usr/bin/env bash
# Cold and warm starts on one accelerator, end to end, with a phase table (docs/profiling.md, "Cold and warm starts").
#
#   bash benchmarks/cold_start.sh                                  # every case, in order
#   bash benchmarks/cold_start.sh --only gpt2-small-cold,gpt2-small-warm,sample-shared,sample-cold
#   bash benchmarks/cold_start.sh --only llama-1b-cold,moe-cold    # a second call (each call < 10 min)
#   bash benchmarks/cold_start.sh --table                          # the table of every case run so far
#
# Cases ("cold": the compilation cache emptied first; the corpus cache is kept):
#   gpt2-small-cold  eqgpt-train --model.preset gpt2-small --precision bf16 --batch-size 16 --steps 30
#   gpt2-small-warm  the same again, the cache as the cold run left it
#   sample-shared    eqgpt-sample --prompt "def " on that run, the cache as its training left it
#   sample-cold      the same with an empty cache
#   llama-1b-cold    llama-1b, 20 steps, the flags of docs/profiling_results.md ("llama-1b on one chip")
#   moe-cold         gpt2-small-moe --batch-size 16 --steps 40
# Each case appends a row to ROOT/results.tsv (ROOT: --root, default /tmp/eqgpt-start) and keeps its log
# in ROOT/logs; the table is printed from results.tsv, so runs split over several calls add up.
# EQGPT_TRAIN / EQGPT_SAMPLE name the commands (default: eqgpt-train, eqgpt-sample on PATH).
set -euo pipefail

ROOT=/tmp/eqgpt-start
ONLY=""
TABLE_ONLY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) ONLY="$2"; shift 2 ;;
    --root) ROOT="$2"; shift 2 ;;
    --table) TABLE_ONLY=1; shift ;;
    *) echo "cold_start.sh: unknown argument $1 (use --only CASES, --root DIR, --table)" >&2; exit 1 ;;
  esac
done
CASES="gpt2-small-cold gpt2-small-warm sample-shared sample-cold llama-1b-cold moe-cold"
for c in ${ONLY//,/ }; do
  [[ " $CASES " == *" $c "* ]] || { echo "cold_start.sh: --only $c: choose from: $CASES" >&2; exit 1; }
done
TRAIN=${EQGPT_TRAIN:-eqgpt-train}
SAMPLE=${EQGPT_SAMPLE:-eqgpt-sample}
CACHE="$ROOT/xla-cache"
mkdir -p "$ROOT/logs" "$ROOT/runs"

wanted() { [[ -z "$ONLY" || ",$ONLY," == *",$1,"* ]]; }

# run NAME CMD...: time CMD end to end, keep its log, append "name seconds compiled-line mfu" to results.tsv
run() {
  local name="$1"; shift
  local log="$ROOT/logs/$name.txt" start end
  echo "== $name: $*" | tee "$log"
  start=$(date +%s.%N)
  "$@" >>"$log" 2>&1 || { echo "$name failed (exit $?); see $log" | tee -a "$log"; tail -20 "$log"; return 1; }
  end=$(date +%s.%N)
  local seconds compiled mfu=""
  seconds=$(python3 -c "print(f'{$end - $start:.1f}')")
  compiled=$(grep -ao 'compiled in .*' "$log" | tail -1 || true)
  local run_dir
  run_dir=$(grep -ao 'run directory: .*' "$log" | tail -1 | cut -d' ' -f3- || true)
  if [[ -n "$run_dir" && -f "$run_dir/metrics.jsonl" ]]; then
    mfu=$(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if 'mfu' in l]; \
print(f\"{r[-1]['mfu']:.1%} at step {r[-1]['step']}\" if r else '')" "$run_dir/metrics.jsonl")
  fi
  local tokens_s
  tokens_s=$(grep -ao '[0-9]* x [0-9]* tokens in [0-9.]* s' "$log" | tail -1 || true)
  printf '%s\t%s\t%s\t%s\n' "$name" "$seconds" "${compiled:-${tokens_s:+sampled $tokens_s (compile included)}}" "$mfu" >>"$ROOT/results.tsv"
  echo "$name: ${seconds} s end to end; ${compiled:-$tokens_s} ${mfu:+; MFU $mfu}"
}

if [[ $TABLE_ONLY == 0 ]]; then
  GPT2=(--model.preset gpt2-small --precision bf16 --batch-size 16 --steps 30 --no-progress)
  if wanted gpt2-small-cold; then
    rm -rf "$CACHE" "$ROOT/runs/gpt2-small"
    run gpt2-small-cold "$TRAIN" "${GPT2[@]}" --compile-cache-dir "$CACHE" --out-dir "$ROOT/runs/gpt2-small"
  fi
  if wanted gpt2-small-warm; then
    rm -rf "$ROOT/runs/gpt2-small-warm"
    run gpt2-small-warm "$TRAIN" "${GPT2[@]}" --compile-cache-dir "$CACHE" --out-dir "$ROOT/runs/gpt2-small-warm"
  fi
  if wanted sample-shared; then
    JAX_COMPILATION_CACHE_DIR="$CACHE" run sample-shared "$SAMPLE" --run-dir "$ROOT/runs/gpt2-small" --prompt "def "
  fi
  if wanted sample-cold; then
    rm -rf "$ROOT/xla-cache-sample"
    JAX_COMPILATION_CACHE_DIR="$ROOT/xla-cache-sample" run sample-cold "$SAMPLE" --run-dir "$ROOT/runs/gpt2-small" \
      --prompt "def "
  fi
  if wanted llama-1b-cold; then
    rm -rf "$CACHE" "$ROOT/runs/llama-1b"
    run llama-1b-cold "$TRAIN" --model.preset llama-1b --precision bf16 --master-weights --optim.mu-dtype bf16 \
      --model.remat full --batch-size 5 --steps 20 --no-progress --compile-cache-dir "$CACHE" \
      --out-dir "$ROOT/runs/llama-1b"
  fi
  if wanted moe-cold; then
    rm -rf "$CACHE" "$ROOT/runs/moe"
    run moe-cold "$TRAIN" --model.preset gpt2-small-moe --precision bf16 --batch-size 16 --steps 40 --no-progress \
      --compile-cache-dir "$CACHE" --out-dir "$ROOT/runs/moe"
  fi
fi

echo
echo "Cold and warm starts ($(date -u +%Y-%m-%dT%H:%MZ); rows from $ROOT/results.tsv, newest last)"
printf '| %-16s | %10s | %-75s | %-16s |\n' case "seconds" "phases (the recipe's summary line, or the sampler's)" "MFU (last log)"
printf '| %-16s | %10s | %-75s | %-16s |\n' "---" "---:" "---" "---"
[[ -f "$ROOT/results.tsv" ]] && while IFS=$'\t' read -r name seconds phases mfu; do
  printf '| %-16s | %10s | %-75s | %-16s |\n' "$name" "$seconds" "$phases" "$mfu"
done <"$ROOT/results.tsv"
