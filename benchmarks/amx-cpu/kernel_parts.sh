#!/usr/bin/env bash
# Builds kernel_parts.cpp against a copy of csrc/ whose AMX header can skip its tile work
# (-DSKIP_TILES) or its float steps (-DSKIP_STEPS), and runs each variant (results.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd); work=$(mktemp -d)
torch=$("$root/.venv/bin/python" -c "import torch, os; print(os.path.dirname(torch.__file__))")
cp -r "$root/src/triedec/model/csrc" "$work/csrc"
python3 - "$work/csrc/x86/amx/a8_linears.h" <<'PY'
import sys
p = sys.argv[1]; s = open(p).read()
s = s.replace("  const auto issue = [&](int64_t g, auto slot) {",
              "  const auto issue = [&](int64_t g, auto slot) {\n#ifdef SKIP_TILES\n    return;\n#endif")
for call in ("    finish(g, sums[g % 3], y);", "      finish(g + 1, sums[(g + 1) % 3], y);"):
    s = s.replace(call, "#ifndef SKIP_STEPS\n" + call + "\n#endif")
open(p, "w").write(s)
PY
cp "$here/kernel_parts.cpp" "$work/kernel_parts.cpp"
for variant in "" "-DSKIP_TILES" "-DSKIP_STEPS" "-DSKIP_TILES -DSKIP_STEPS"; do
  # shellcheck disable=SC2086
  g++ -O3 -g0 -ffp-contract=off -fno-fast-math -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni \
      -mavx2 -mfma -mf16c -mamx-tile -mamx-int8 $variant -I"$work/csrc" -I"$torch/include" \
      -I"$torch/include/torch/csrc/api/include" "$work/kernel_parts.cpp" -o "$work/parts" \
      -L"$torch/lib" -ltorch_cpu -lc10 -Wl,-rpath,"$torch/lib"
  echo "[${variant:-as built}]"; "$work/parts"
done
rm -rf "$work"
