#!/usr/bin/env bash
# Cross-build the patched llama.cpp's shared libraries (libllama, libggml*, libggml-rpc) for aarch64 Linux.
#
#   vendor/llama.cpp/cross-build.sh OUT_DIR
#
# The libraries land in OUT_DIR/bin. The patched tree comes from build.sh (`make llama`), so the
# phones run the very sources this machine tests; the options are cmake-args.sh's for
# MOEFLASH_CPU (armv8.2 unless set). Needs Debian's aarch64 cross compilers
# (aarch64-linux-gnu.cmake). Incremental: OUT_DIR keeps the CMake build.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: cross-build.sh OUT_DIR}
cpu=${MOEFLASH_CPU:-armv8.2}
src="$here/llama-cpp-python/vendor/llama.cpp"
# shellcheck source=cmake-args.sh
. "$here/cmake-args.sh"
cmake_args=$(llama_cmake_args "$cpu" 2>&1) || { echo "cross-build.sh: $cmake_args" >&2; exit 2; }
if [ "$cpu" = native ]; then
  echo "cross-build.sh: MOEFLASH_CPU=native means this machine's CPU; use armv8.2, armv8.6 or portable" >&2
  exit 2
fi
if [ ! -d "$src" ]; then
  echo "cross-build.sh: $src is missing: run 'make llama' first" >&2
  exit 1
fi
if ! command -v aarch64-linux-gnu-g++ > /dev/null; then
  echo "cross-build.sh: aarch64-linux-gnu-g++ is missing: apt-get install g++-aarch64-linux-gnu" >&2
  exit 1
fi

mkdir -p "$out"
echo "cross-building llama.cpp for aarch64 (MOEFLASH_CPU=$cpu) in $out"
# shellcheck disable=SC2086 # cmake_args is a list of options
cmake -S "$src" -B "$out" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$here/aarch64-linux-gnu.cmake" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF $cmake_args > "$out/configure.log" 2>&1 \
  || { cat "$out/configure.log" >&2; exit 1; }
cmake --build "$out" --target llama ggml-cpu ggml-rpc -j "$(nproc)"
