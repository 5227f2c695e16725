#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 from its sdist into a venv, for benchmarks/bench_decode.py and
# benchmarks/llamacpp_ref.py only (the `bench` extra; cfr-atlas itself never imports it).
#
# CMAKE_ARGS are chosen from /proc/cpuinfo instead of GGML_NATIVE, because machines differ
# between sessions and llama.cpp's AMX kernels crash on CPUs that report amx_int8:
#   AVX-512 (with or without AMX): AVX2 + AVX-512 (+VNNI, BF16), every AMX path off;
#   otherwise:                     AVX2 + FMA + F16C, plus AVX_VNNI when the CPU has avx_vnni.
# Usage: benchmarks/install_llama_cpp.sh [PYTHON]   (default /work/main/.venv/bin/python)
# Env:   JOBS (default 2) build jobs, run under nice.
set -euo pipefail

PYTHON="${1:-/work/main/.venv/bin/python}"
VERSION="0.3.36"
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo || true)"

has() { [[ " $FLAGS " == *" $1 "* ]]; }

ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if has avx512f || has amx_int8; then
    ARGS="$ARGS -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    ARGS="$ARGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
elif has avx_vnni; then
    ARGS="$ARGS -DGGML_AVX_VNNI=ON"
fi

echo "llama-cpp-python $VERSION with CMAKE_ARGS=\"$ARGS\"" >&2
CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-2}" FORCE_CMAKE=1 \
    nice -n 10 "$PYTHON" -m pip install --no-binary llama-cpp-python --no-cache-dir \
    "llama-cpp-python==$VERSION"
"$PYTHON" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
