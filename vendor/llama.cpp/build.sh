#!/usr/bin/env bash
# Build the patched, pinned llama-cpp-python into a virtual environment.
#
#   vendor/llama.cpp/build.sh PYTHON
#
# PYTHON is the venv's interpreter. Steps: download the pinned sdist with pip (hash-checked,
# cached in vendor/llama.cpp/.cache), extract it to vendor/llama.cpp/llama-cpp-python
# (git-ignored; streaming_ext compiles against its headers), apply patches/series in order, and
# pip-install the patched tree into PYTHON's environment. A stamp over the pin, the patches,
# this script and the CPU profile skips all of it when nothing changed.
#
# MOEFLASH_CPU selects the CPU code generation: native (the default), portable or armv8.2, as
# cmake-args.sh describes.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
py=${1:?usage: build.sh PYTHON}
cpu=${MOEFLASH_CPU:-native}
# shellcheck source=/dev/null
. "$here/pin.env"

# shellcheck source=cmake-args.sh
. "$here/cmake-args.sh"
cmake_args=$(llama_cmake_args "$cpu" 2>&1) || { echo "build.sh: $cmake_args" >&2; exit 2; }

src="$here/llama-cpp-python"
stamp_file="$($py -c 'import sys; print(sys.prefix)')/.moeflash-llama-stamp"
# the patch set, whatever the CPU: an RPC helper and its main server must run the same one
patchset=$(cd "$here" && { cat pin.env patches/series; while read -r p; do cat "patches/$p"; done < patches/series; } | sha256sum | cut -c1-16)
stamp=$(cd "$here" && { cat pin.env build.sh cmake-args.sh patches/series; while read -r p; do cat "patches/$p"; done < patches/series; echo "$cmake_args"; } | sha256sum | cut -d' ' -f1)

if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && [ -d "$src" ] \
   && "$py" -c 'import llama_cpp' 2>/dev/null; then
  echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (patched) is up to date"
  exit 0
fi

# ---- fetch the pinned sdist (pip checks the hash; size and hash are checked again here)
cache="$here/.cache"
sdist="$cache/$SDIST_NAME"
mkdir -p "$cache"
verify() {
  [ -f "$sdist" ] && [ "$(stat -c %s "$sdist")" = "$SDIST_SIZE" ] \
    && [ "$(sha256sum "$sdist" | cut -d' ' -f1)" = "$SDIST_SHA256" ]
}
if ! verify; then
  rm -f "$sdist"
  req="$cache/requirements.txt"
  echo "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION --hash=sha256:$SDIST_SHA256" > "$req"
  echo "downloading $SDIST_NAME (pinned, hash-checked)"
  "$py" -m pip download --quiet --no-deps --no-binary :all: --require-hashes -r "$req" -d "$cache"
  if ! verify; then
    echo "build.sh: $sdist does not match pin.env (size $SDIST_SIZE, sha256 $SDIST_SHA256)" >&2
    exit 1
  fi
fi

# ---- extract and patch into a fresh tree
tmp="$here/.extract"
rm -rf "$tmp" "$src"
mkdir -p "$tmp"
tar -xzf "$sdist" -C "$tmp"
mv "$tmp/${SDIST_NAME%.tar.gz}" "$src"
rm -rf "$tmp"
while read -r p; do
  if ! out=$(patch -p1 --forward --batch --dry-run -d "$src" < "$here/patches/$p" 2>&1); then
    echo "build.sh: patch $p no longer applies to $SDIST_NAME:" >&2
    echo "$out" >&2
    rm -rf "$src"
    exit 1
  fi
  patch -p1 --forward --batch --quiet -d "$src" < "$here/patches/$p"
  echo "applied $p"
done < "$here/patches/series"

# ---- build and install (incremental: the CMake build dir persists across patch changes)
echo "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (MOEFLASH_CPU=$cpu); this takes a few minutes"
rm -f "$stamp_file"
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$py" -m pip install --quiet \
  --force-reinstall --no-deps --config-settings=build-dir="$here/build/$cpu" "$src"
"$py" -c 'import llama_cpp; print("installed llama_cpp", llama_cpp.__version__)'
echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION+$patchset" > "${stamp_file%-stamp}-patchset"
echo "$stamp" > "$stamp_file"
