#!/usr/bin/env bash
# Served A/B of two commits, interleaved: the same workload as bench/compare_servers.sh, each commit's own
# server from its own checkout, alternating BEFORE and AFTER inside every round so that both see the same
# minutes of this machine. For refactors that must not change speed (docs/BENCHMARKS.md records the result).
#
#   bench/ab_commits.sh BEFORE AFTER OUTDIR
#
# Environment: ROUNDS (default 2), DTYPES ("float32 bfloat16"), CONCURRENCIES ("1 16"), INPUT_LEN (128),
# OUTPUT_LEN (64). Results: OUTDIR/rR-DTYPE-SIDE-cC.json and the table of bench.summarize per round.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE="${1:?usage: bench/ab_commits.sh BEFORE AFTER OUTDIR}"
AFTER="${2:?usage: bench/ab_commits.sh BEFORE AFTER OUTDIR}"
OUT="${3:?usage: bench/ab_commits.sh BEFORE AFTER OUTDIR}"
ROUNDS="${ROUNDS:-2}"
DTYPES="${DTYPES:-float32 bfloat16}"
CONCURRENCIES="${CONCURRENCIES:-1 16}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
PY="$PWD/.venv/bin/python"
PORT=8011
mkdir -p "$OUT"
TREES=$(mktemp -d)

checkout() {  # checkout SIDE COMMIT: a detached worktree of COMMIT at $TREES/SIDE
    git worktree add --detach -q "$TREES/$1" "$2"
}

start() {  # start SIDE DTYPE: that checkout's server on $PORT; sets PID
    local tree="$TREES/$1" module=cli.main
    [[ -f "$tree/cli/main.py" ]] || module=server.cli  # NOTE: before the CLI left server/
    (cd "$tree" && exec "$PY" -m "$module" serve --port "$PORT" --dtype "$2" --max-num-seqs 64 --log-level warning) &
    PID=$!
    for _ in $(seq 1 600); do
        if curl -s -o /dev/null "http://127.0.0.1:$PORT/v1/models" 2>/dev/null; then return 0; fi
        sleep 1
    done
    echo "$1 ($2) did not start" >&2
    exit 1
}

stop() {
    kill -TERM "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=""
}

PID=""
trap 'if [[ -n "$PID" ]]; then kill -TERM "$PID" 2>/dev/null || true; fi; git worktree remove --force "$TREES/before" 2>/dev/null || true; git worktree remove --force "$TREES/after" 2>/dev/null || true' EXIT
checkout before "$BEFORE"
checkout after "$AFTER"
for round in $(seq 1 "$ROUNDS"); do
    sides="before after"
    (( round % 2 == 0 )) && sides="after before"
    for dtype in $DTYPES; do
        for side in $sides; do
            start "$side" "$dtype"
            for c in $CONCURRENCIES; do
                n=$(( c * 2 > 8 ? c * 2 : 8 ))
                "$PY" -m bench --base-url "http://127.0.0.1:$PORT" --dataset random \
                    --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --random-range-ratio 0.0 \
                    --num-prompts "$n" --seed "$((c + 100 * round))" --max-concurrency "$c" --temperature 0 \
                    --disable-tqdm --ignore-eos --label "$dtype $side c=$c" \
                    --save-result "$OUT/r$round-$dtype-$side-c$c.json" > /dev/null
            done
            stop
        done
    done
    "$PY" -m bench.summarize "$OUT"/r"$round"-*.json | tee "$OUT/round$round.md"
done
