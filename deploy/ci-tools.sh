#!/usr/bin/env bash
# Installs the tools the deployment checks use (kubectl for kustomize). Best effort: tests skip without them.
set -u
if ! command -v kubectl >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl) >/dev/null 2>&1 || true
    fi
fi
command -v kubectl >/dev/null 2>&1 && echo "kubectl: $(kubectl version --client 2>/dev/null | head -n1)"
exit 0
