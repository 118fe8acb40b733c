#!/bin/bash
# Builds a kernel library from a folder of csrc sources ($1) into $2 for ISA $3 with compiler
# flags $4...; it carries the installed extension's sources digest, so use_kernels loads it:
#   build_library.sh old-csrc /tmp/old_avx2.so avx2 -mavx2 -mfma -mf16c
set -e
SRC=$1; OUT=$2; ISA=$3; shift 3
PY=${PY:-.venv/bin/python}
DIGEST=$($PY -c "import torch, triedec.model._kernels as k; print(k.sources_digest())")
INC=$($PY -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))")
TL=$($PY -c "import torch,os; print(os.path.dirname(torch.__file__)+'/lib')")
OBJ=$(mktemp -d)
objs=()
for s in tree_attention rms_norm rotary a8_linears f32_linears elementwise probes table; do
  g++ -O3 -g0 -ffp-contract=off -fno-fast-math -fopenmp -fPIC -std=c++17 "$@" \
    -DTRIEDEC_ISA="\"$ISA\"" -DTRIEDEC_SOURCES_DIGEST="\"$DIGEST\"" -D_GLIBCXX_USE_CXX11_ABI=1 \
    $INC -I$SRC -c $SRC/$s.cpp -o $OBJ/$s.o &
  objs+=($OBJ/$s.o)
done
wait
for o in "${objs[@]}"; do test -f $o || { echo "missing $o"; exit 1; }; done
g++ -shared -o $OUT "${objs[@]}" -L$TL -ltorch_cpu -lc10 -Wl,-rpath,$TL
rm -rf $OBJ
