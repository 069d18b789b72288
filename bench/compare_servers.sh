#!/usr/bin/env bash
# The serving comparison of docs/BENCHMARKS.md: cbserve against `transformers serve --continuous-batching`
# and llama.cpp's server (llama-cpp-python) on the default model, CPU, the same random workload, at
# several concurrencies, one server at a time on this machine. Each concurrency draws its own prompts
# (--seed), so no run is served from a prefix cache that an earlier run filled.
#
#   bench/compare_servers.sh OUTDIR [SYSTEM ...]
#       SYSTEM: cbserve cbserve-bf16 cbserve-bf16-mixed cbserve-bi cbserve-bf16-bi cbserve-spec transformers transformers-bf16
#       llamacpp llama-server vllm (-bi: cbserve with --batch-invariant; -mixed: with
#       --max-mixed-prefill-tokens MIXED_CAP (default 256); -spec: with prompt lookup speculative decoding,
#       SPEC_CONFIG; llamacpp: llama-cpp-python's server, one sequence at a time; llama-server: llama.cpp's
#       own, continuous batching over LLAMA_NP slots (default 16), built as bench/llamacpp_lookup.py says;
#       vllm: vLLM's CPU build in bfloat16, bench/peers.sh vllm)
#
# Environment: CONCURRENCIES (default "1 8 16 32"), INPUT_LEN (128), OUTPUT_LEN (64), LLAMACPP_PYTHON
# (the python that has llama-cpp-python[server]; default .venv/bin/python), LLAMA_SERVER (the llama-server
# binary; default /tmp/llamacpp/build/bin/llama-server), TIMEOUT per run (900 s).
# At the end it prints the table (bench.summarize) and each run against this CPU's ceiling in its precision
# (bench.cpu_ceiling: the multiply-add peak and the memory bandwidth; also saved as OUTDIR/ceiling.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bench/compare_servers.sh OUTDIR [SYSTEM ...]}"; shift
SYSTEMS=("${@:-cbserve transformers llamacpp}")
# shellcheck disable=SC2206
SYSTEMS=(${SYSTEMS[@]})
PY=.venv/bin/python
CONCURRENCIES="${CONCURRENCIES:-1 8 16 32}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
TIMEOUT="${TIMEOUT:-900}"
PORT=8010
mkdir -p "$OUT"

start() {  # start SYSTEM in the background on $PORT; sets PID and EXTRA
    if curl -s -o /dev/null "http://127.0.0.1:$PORT/" 2>/dev/null; then
        echo "port $PORT is taken: stop what listens there first" >&2; exit 1
    fi
    EXTRA=(--ignore-eos)
    case "$1" in
        cbserve) .venv/bin/cbserve serve --port "$PORT" --dtype float32 --max-num-seqs 64 --log-level warning & ;;
        cbserve-bf16) .venv/bin/cbserve serve --port "$PORT" --dtype bfloat16 --max-num-seqs 64 --log-level warning & ;;
        cbserve-bf16-mixed) .venv/bin/cbserve serve --port "$PORT" --dtype bfloat16 --max-num-seqs 64 \
            --max-mixed-prefill-tokens "${MIXED_CAP:-256}" --log-level warning & ;;
        cbserve-bi|cbserve-bf16-bi)
            if [[ "$1" == cbserve-bf16-bi ]]; then DTYPE=bfloat16; else DTYPE=float32; fi
            .venv/bin/cbserve serve --port "$PORT" --dtype "$DTYPE" --batch-invariant --max-num-seqs 64 \
                --log-level warning & ;;
        cbserve-spec)
            .venv/bin/cbserve serve --port "$PORT" --dtype float32 --max-num-seqs 64 --log-level warning \
                --speculative-config "${SPEC_CONFIG:-{\"method\": \"ngram\", \"num_speculative_tokens\": 4\}}" & ;;
        transformers|transformers-bf16)
            if [[ "$1" == transformers-bf16 ]]; then DTYPE=bfloat16; else DTYPE=float32; fi
            DTYPE="$DTYPE" bench/peers.sh transformers "$PORT" &
            # transformers serve rejects ignore_eos; min_new_tokens gives the same fixed output length
            EXTRA=(--extra-body "{\"generation_config\": \"{\\\"min_new_tokens\\\": $OUTPUT_LEN, \\\"do_sample\\\": false}\"}") ;;
        vllm) DTYPE=bfloat16 bench/peers.sh vllm "$PORT" & ;;
        llamacpp)
            PYTHON="${LLAMACPP_PYTHON:-$PY}" bench/peers.sh llamacpp "$PORT" &
            EXTRA=(--extra-body '{"logit_bias": {"0": -100, "2": -100}}') ;;  # EOS ids never sampled
        llama-server)  # each slot holds ctx / np tokens: 512, past the workload's prompt and output
            NP="${LLAMA_NP:-16}"
            "${LLAMA_SERVER:-/tmp/llamacpp/build/bin/llama-server}" -m "$(bench/peers.sh gguf)" \
                --host 127.0.0.1 --port "$PORT" -t "$(nproc)" -tb "$(nproc)" -np "$NP" -c $((NP * 512)) \
                --cont-batching --log-disable > /dev/null 2>&1 & ;;
        *) echo "unknown system $1" >&2; exit 2 ;;
    esac
    PID=$!
    for _ in $(seq 1 600); do
        # NOTE: any HTTP answer means it is up (transformers serve answers /v1/models with a 500 here)
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/models" 2>/dev/null || true)
        if [[ "$code" != 000 && -n "$code" ]]; then return 0; fi
        sleep 1
    done
    echo "$1 did not start" >&2; exit 1
}

PID=""
# NOTE: `|| true`: under `set -e` a failing command in the EXIT trap (nothing left to kill) sets the exit status
trap 'if [[ -n "$PID" ]]; then pkill -TERM -P "$PID" 2>/dev/null || true; kill -TERM "$PID" 2>/dev/null || true; fi' EXIT
for system in "${SYSTEMS[@]}"; do
    start "$system"
    model=()
    if [[ "$system" == transformers* || "$system" == vllm ]]; then
        model=(--model "${HF_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cbserve/SmolLM2-135M-Instruct-from-gguf}")
    fi
    for c in $CONCURRENCIES; do
        n=$(( c * 2 > 8 ? c * 2 : 8 ))
        $PY -m bench --base-url "http://127.0.0.1:$PORT" "${model[@]}" --dataset random \
            --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --random-range-ratio 0.0 \
            --num-prompts "$n" --seed "$c" --max-concurrency "$c" --temperature 0 --timeout "$TIMEOUT" --disable-tqdm \
            --label "$system c=$c" --save-result "$OUT/$system-c$c.json" "${EXTRA[@]}"
    done
    kill -TERM "$PID" 2>/dev/null || true
    pkill -TERM -P "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=""
    sleep 2
done
$PY -m bench.summarize "$OUT"/*.json
# each run against the ceiling of the precision it served in (vLLM serves bfloat16)
shopt -s nullglob
F32=() BF16=()
for f in "$OUT"/*.json; do
    case "$(basename "$f")" in *bf16*|vllm*|transformers-bf16*) BF16+=("$f") ;; *) F32+=("$f") ;; esac
done
: > "$OUT/ceiling.txt"
if ((${#F32[@]})); then $PY -m bench.cpu_ceiling "${F32[@]}" | tee -a "$OUT/ceiling.txt"; fi
if ((${#BF16[@]})); then $PY -m bench.cpu_ceiling --dtype bfloat16 "${BF16[@]}" | tee -a "$OUT/ceiling.txt"; fi
