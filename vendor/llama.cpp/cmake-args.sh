# shellcheck shell=bash
# The CMake options of every llama.cpp build here, sourced by build.sh (the Python package, for
# this machine) and cross-build.sh (the libraries alone, for aarch64).
#
#   llama_cmake_args CPU   prints the options for MOEFLASH_CPU=CPU; exit status 2 for an unknown CPU
#
# CPU:
#   native    -march=native: fastest on the machine that builds it; on x86-64 without AMX, whose
#             buffer type segfaults in ggml_backend_amx_mul_mat on Sapphire Rapids Xeons
#             (llama.cpp issue 20824, open) and holds a layout the streamer does not read
#   portable  baseline ISA of the target (x86-64: SSE only; aarch64: armv8-a); for Docker images
#             and wheels run elsewhere
#   armv8.2   aarch64 phones with dot-product instructions (armv8.2-a+dotprod+fp16), e.g. Termux
#   armv8.6   aarch64 phones with int8 matrix multiply too (armv8.6-a+dotprod+fp16+i8mm): ggml's
#             repacked kernels use i8mm, a compile-time choice
llama_cmake_args() {
  local cpu
  case "$1" in
    native)
      cpu="-DGGML_NATIVE=ON"
      if [ "$(uname -m)" = x86_64 ]; then  # quoted for shlex, as scikit-build-core splits CMAKE_ARGS
        local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        cpu="$cpu '-DCMAKE_C_FLAGS=$no_amx' '-DCMAKE_CXX_FLAGS=$no_amx'"
      fi ;;
    portable) cpu="-DGGML_NATIVE=OFF" ;;
    armv8.2)  cpu="-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16" ;;
    armv8.6)  cpu="-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.6-a+dotprod+fp16+i8mm" ;;
    *) echo "MOEFLASH_CPU must be native, portable, armv8.2 or armv8.6 (got '$1')" >&2; return 2 ;;
  esac
  # only the shared libraries llama-cpp-python loads: no tests, tools, examples or mtmd; the RPC
  # backend (TCP only) for `moeflash worker` and `--rpc`
  echo "$cpu -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=ON -DGGML_RPC=ON -DGGML_RPC_RDMA=OFF"
}
