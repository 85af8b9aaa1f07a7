# moeflash — set-up, build, run, test. Every target sets up what it needs; a second run with
# nothing changed does no rebuild (stamps).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# CPU code generation for the llama.cpp build: native | portable | armv8.2 | armv8.6 (vendor/llama.cpp/cmake-args.sh)
MOEFLASH_CPU ?= native
export MOEFLASH_CPU
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
DEMO_MODEL := server/training/trained/demo-qwen3moe.gguf
PYTEST_ARGS ?=

LLAMA_SRC := vendor/llama.cpp/llama-cpp-python/vendor/llama.cpp
LLAMA_STAMP := $(VENV)/.moeflash-llama-stamp
# recursive (=): only evaluated once the venv exists
SITE = $(shell $(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
EXT_SRC := $(wildcard streaming_ext/src/*.c)
EXT_HDR := $(wildcard streaming_ext/include/*.h)
EXT_CFLAGS := -std=c11 -O2 -g -fPIC -fvisibility=hidden -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes \
	-D_GNU_SOURCE -Istreaming_ext/include -I$(LLAMA_SRC)/ggml/include -I$(LLAMA_SRC)/ggml/src -I$(LLAMA_SRC)/include
# links against the llama.cpp libraries in directory $(1)
LLAMA_LINK = -L$(1) -Wl,-rpath,$(1) -lllama -lggml -lggml-base -lggml-cpu -lpthread -lm
EXT_LDFLAGS = -shared $(call LLAMA_LINK,$(SITE)/llama_cpp/lib)
CTEST_CFLAGS := -std=c11 -O1 -g -Wall -Wextra -Werror -Wshadow -D_GNU_SOURCE -Istreaming_ext/include \
	-I$(LLAMA_SRC)/ggml/include -I$(LLAMA_SRC)/include
EXT_LIB := streaming_ext/lib/libmoeflash_stream.so
EXT_ASAN_LIB := streaming_ext/lib/libmoeflash_stream_asan.so
EXT_DECLARED := streaming_ext/_declared.py
CTEST_BIN := tests/c/build/test_ready_hook
CTEST_FRAMES := tests/c/build/test_frames
CTEST_IDENTITY := tests/c/build/test_stream_identity
CTEST_REPACK := tests/c/build/test_repack_slices
CTEST_BATCH := tests/c/build/test_batch_invariance

# aarch64 (the phones): llama.cpp (Debian's cross gcc), streaming_ext and the C tests (clang,
# Termux's compiler; test_frames with gcc, whose UBSan runtime the cross toolchain has)
# cross-built for each variant, run under qemu-user by tests/build/test_aarch64.py: armv8.2
# (dot product) and armv8.6 (int8 matrix multiply too, which ggml's repacked kernels choose at
# compile time)
ARM_VARIANTS := armv8.2 armv8.6
ARM_MARCH_armv8.2 := armv8.2-a+dotprod+fp16
ARM_MARCH_armv8.6 := armv8.6-a+dotprod+fp16+i8mm
ARM_GCC := aarch64-linux-gnu-gcc
ARM_PROGRAMS := test_ready_hook test_frames test_stream_identity test_repack_slices test_batch_invariance \
	test_rpc_server
arm_llama = vendor/llama.cpp/build/aarch64-$(1)
arm_lib = $(abspath $(call arm_llama,$(1)))/bin
arm_stamp = $(call arm_llama,$(1))/.moeflash-stamp
arm_ext = streaming_ext/lib/aarch64-$(1)/libmoeflash_stream.so
arm_ctest = tests/c/build/aarch64-$(1)
arm_cc = clang --target=aarch64-linux-gnu -march=$(ARM_MARCH_$(1))

.PHONY: setup setup-dev chromium sshd corpus-packages train arm-toolchain arm llama ext serve serve-container require-api-key demo-model test codex-loop agent-sequences house lint bench-small bench bench-warm-start replay clean distclean

setup: $(VENV)/.deps-stamp llama ext $(VENV)/.install-stamp

setup-dev: setup $(VENV)/.dev-stamp $(VENV)/.instructor-stamp $(VENV)/.aider-stamp tests/js/node_modules/.package-lock.json \
	tests/agents/node_modules/.package-lock.json chromium sshd $(VENV)/.training-stamp corpus-packages

$(VPY):
	$(PYTHON) -m venv $(VENV)

# runtime dependencies (pinned in pyproject.toml)
$(VENV)/.deps-stamp: pyproject.toml | $(VPY)
	$(VPY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["dependencies"]))' > $(VENV)/requirements.txt
	$(VPY) -m pip install --quiet -r $(VENV)/requirements.txt setuptools==84.2.1 wheel==0.48.0
	touch $@

$(VENV)/.dev-stamp: pyproject.toml | $(VPY)
	$(VPY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]["dev"]))' > $(VENV)/requirements-dev.txt
	$(VPY) -m pip install --quiet -r $(VENV)/requirements-dev.txt
	touch $@

# instructor, for the client tests, in an environment of its own (its pins clash with the dev set's)
$(VENV)/.instructor-stamp: pyproject.toml | $(VPY)
	$(VPY) -m venv $(VENV)/instructor
	$(VPY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]["client-instructor"]))' > $(VENV)/requirements-instructor.txt
	$(VENV)/instructor/bin/python -m pip install --quiet -r $(VENV)/requirements-instructor.txt
	touch $@

# aider, for the agent tests (tests/agents), in an environment of its own: it pins every
# dependency exactly, and its pins clash with the dev set's
$(VENV)/.aider-stamp: pyproject.toml | $(VPY)
	$(VPY) -m venv $(VENV)/aider
	$(VPY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]["client-aider"]))' > $(VENV)/requirements-aider.txt
	$(VENV)/aider/bin/python -m pip install --quiet -r $(VENV)/requirements-aider.txt
	touch $@

# the coding-agent CLIs for the agent tests (tests/agents), as pinned and locked, with the Node.js
# 22 they need (the npm package `node`). `npm install`, not `npm ci`: the lock cannot list
# qwen-code's optional clipboard binaries for other platforms, which the registry does not serve,
# and `npm ci` refuses a lock without them; with the lock in sync, install leaves it unchanged.
tests/agents/node_modules/.package-lock.json: tests/agents/package.json tests/agents/package-lock.json
	npm install --prefix tests/agents --no-save --no-audit --no-fund --loglevel=error
	touch $@

# the openai npm SDK for the JavaScript client tests (tests/js), exactly as locked
tests/js/node_modules/.package-lock.json: tests/js/package.json tests/js/package-lock.json
	npm ci --prefix tests/js --no-audit --no-fund --loglevel=error

# Debian's chromium for the browser tests (Playwright drives it); installed when run as root
# the SSH tunnel to an RPC helper is tested through a real sshd on the loopback (tests/rpc)
sshd:
	@if [ ! -x /usr/sbin/sshd ] || ! command -v ssh > /dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
				openssh-server openssh-client; \
		else \
			echo "setup-dev: sshd is missing: 'sudo apt-get install openssh-server' for the tunnel test" >&2; \
		fi; \
	fi

chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
		else \
			echo "setup-dev: /usr/bin/chromium is missing: 'sudo apt-get install chromium' for the browser tests" >&2; \
		fi; \
	fi

# torch (the CPU wheel on the machines' disk: `+cpu` never resolves to PyPI's CUDA build) and
# tokenizers, for server/training and tests/training: a dev tool, not a runtime dependency
$(VENV)/.training-stamp: pyproject.toml | $(VPY)
	$(VPY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]["training"]))' > $(VENV)/requirements-training.txt
	$(VPY) -m pip install --quiet -r $(VENV)/requirements-training.txt
	touch $@

# Debian's packages the training corpus is built from (server/training/corpus.py); installed when run as root
CORPUS_PACKAGES := python3.11-doc wordnet-base dict-devil
corpus-packages:
	@if ! dpkg -s $(CORPUS_PACKAGES) > /dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(CORPUS_PACKAGES); \
		else \
			echo "corpus-packages: 'sudo apt-get install $(CORPUS_PACKAGES)' for the training corpus" >&2; \
			exit 1; \
		fi; \
	fi

# Trains the demo model, or resumes its run, in TRAIN_DIR (a directory of your choice, outside
# the checkout) on TRAIN_THREADS torch threads: hours, so start it with nohup (docs/training.md).
# TRAIN_ARGS: e.g. --reschedule-to N. Neither `make serve` nor the tests train.
TRAIN_DIR ?=
TRAIN_THREADS ?= 1
TRAIN_ARGS ?=
train: $(VENV)/.deps-stamp $(VENV)/.training-stamp corpus-packages
	@if [ -z "$(TRAIN_DIR)" ]; then echo "train: say where the run lives: make train TRAIN_DIR=DIR" >&2; exit 1; fi
	RAYON_NUM_THREADS=1 $(VPY) -m server.training.train --run-dir $(TRAIN_DIR) --threads $(TRAIN_THREADS) $(TRAIN_ARGS)

# the moeflash packages themselves, editable, with the `moeflash` console script
$(VENV)/.install-stamp: pyproject.toml $(VENV)/.deps-stamp
	$(VPY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# patched, pinned llama-cpp-python (its own stamp makes this a no-op when nothing changed)
llama: $(VENV)/.deps-stamp
	vendor/llama.cpp/build.sh $(VPY)

ext: $(EXT_LIB) $(EXT_DECLARED) $(EXT_ASAN_LIB) $(CTEST_BIN) $(CTEST_FRAMES) $(CTEST_IDENTITY) $(CTEST_REPACK) $(CTEST_BATCH)

# the counters and enums moeflash_stream.h declares, as Python (the typed record every figure reads)
$(EXT_DECLARED): $(EXT_LIB) streaming_ext/declarations.py
	$(VPY) streaming_ext/declarations.py $(EXT_LIB) $@

$(EXT_LIB): $(EXT_SRC) $(EXT_HDR) $(LLAMA_STAMP) Makefile
	@mkdir -p $(dir $@)
	$(CC) $(EXT_CFLAGS) $(EXT_SRC) -o $@ $(EXT_LDFLAGS)

# sanitizer build (ASan + UBSan), loaded by the test suite with libasan preloaded
$(EXT_ASAN_LIB): $(EXT_SRC) $(EXT_HDR) $(LLAMA_STAMP) Makefile
	@mkdir -p $(dir $@)
	$(CC) $(EXT_CFLAGS) -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined \
		$(EXT_SRC) -o $@ $(EXT_LDFLAGS)

# C test of the mul_mat_id ready-hook patch, against the installed libraries
$(CTEST_BIN): tests/c/test_ready_hook.c $(LLAMA_STAMP) Makefile
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) $< -o $@ $(call LLAMA_LINK,$(SITE)/llama_cpp/lib)

# C test of the repacked layouts in other buffer types (patch 0009)
$(CTEST_REPACK): tests/c/test_repack_slices.c $(LLAMA_STAMP) Makefile
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) $< -o $@ $(call LLAMA_LINK,$(SITE)/llama_cpp/lib)

# C test of batch-invariant float matmuls (patch 0011)
$(CTEST_BATCH): tests/c/test_batch_invariance.c $(LLAMA_STAMP) Makefile
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) $< -o $@ $(call LLAMA_LINK,$(SITE)/llama_cpp/lib)

# C byte-identity gate of the streamer (no Python): streamed against resident
$(CTEST_IDENTITY): tests/c/test_stream_identity.c $(EXT_LIB) Makefile
	@mkdir -p $(dir $@)
	$(CC) $(CTEST_CFLAGS) $< -o $@ -L$(dir $(EXT_LIB)) -Wl,-rpath,$(abspath $(dir $(EXT_LIB))) -lmoeflash_stream \
		$(call LLAMA_LINK,$(SITE)/llama_cpp/lib)

# C test of the expert frames (mf_frames.c), built with the sanitizers
$(CTEST_FRAMES): tests/c/test_frames.c streaming_ext/src/mf_frames.c $(EXT_HDR) streaming_ext/src/mf_internal.h $(LLAMA_STAMP) Makefile
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -fPIC -fvisibility=hidden -O2,$(EXT_CFLAGS)) -Istreaming_ext/src -O1 -fno-omit-frame-pointer \
		-fsanitize=address,undefined -fno-sanitize-recover=undefined tests/c/test_frames.c streaming_ext/src/mf_frames.c \
		-o $@ -lpthread

# Debian's aarch64 cross compilers, clang and qemu-user, installed when run as root
ARM_PACKAGES := gcc-aarch64-linux-gnu g++-aarch64-linux-gnu clang qemu-user
arm-toolchain:
	@if ! command -v aarch64-linux-gnu-g++ > /dev/null || ! command -v clang > /dev/null \
		|| ! command -v qemu-aarch64 > /dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(ARM_PACKAGES); \
		else \
			echo "arm: 'sudo apt-get install $(ARM_PACKAGES)' for the aarch64 tests" >&2; \
			exit 1; \
		fi; \
	fi

arm: arm-toolchain llama
	@$(MAKE) --no-print-directory $(foreach v,$(ARM_VARIANTS),$(call arm_ext,$(v)) \
		$(addprefix $(call arm_ctest,$(v))/,$(ARM_PROGRAMS)))

# the rules of one aarch64 variant ($(1)); test_frames: UBSan alone, ASan's shadow memory does not
# map under qemu-user
define ARM_VARIANT
$(call arm_stamp,$(1)): $(LLAMA_STAMP) vendor/llama.cpp/cross-build.sh vendor/llama.cpp/cmake-args.sh \
		vendor/llama.cpp/aarch64-linux-gnu.cmake
	MOEFLASH_CPU=$(1) vendor/llama.cpp/cross-build.sh $(call arm_llama,$(1))
	touch $$@

$(call arm_ext,$(1)): $(EXT_SRC) $(EXT_HDR) $(call arm_stamp,$(1)) Makefile
	@mkdir -p $$(dir $$@)
	$(call arm_cc,$(1)) $(EXT_CFLAGS) $(EXT_SRC) -o $$@ -shared $$(call LLAMA_LINK,$(call arm_lib,$(1)))

$(call arm_ctest,$(1))/test_ready_hook: tests/c/test_ready_hook.c $(call arm_stamp,$(1)) Makefile
	@mkdir -p $$(dir $$@)
	$(call arm_cc,$(1)) $(CTEST_CFLAGS) $$< -o $$@ $$(call LLAMA_LINK,$(call arm_lib,$(1)))

$(call arm_ctest,$(1))/test_repack_slices: tests/c/test_repack_slices.c $(call arm_stamp,$(1)) Makefile
	@mkdir -p $$(dir $$@)
	$(call arm_cc,$(1)) $(CTEST_CFLAGS) $$< -o $$@ $$(call LLAMA_LINK,$(call arm_lib,$(1)))

$(call arm_ctest,$(1))/test_batch_invariance: tests/c/test_batch_invariance.c $(call arm_stamp,$(1)) Makefile
	@mkdir -p $$(dir $$@)
	$(call arm_cc,$(1)) $(CTEST_CFLAGS) $$< -o $$@ $$(call LLAMA_LINK,$(call arm_lib,$(1)))

$(call arm_ctest,$(1))/test_rpc_server: tests/c/test_rpc_server.c $(call arm_stamp,$(1)) Makefile
	@mkdir -p $$(dir $$@)
	$(call arm_cc,$(1)) $(CTEST_CFLAGS) $$< -o $$@ -lggml-rpc $$(call LLAMA_LINK,$(call arm_lib,$(1)))

$(call arm_ctest,$(1))/test_stream_identity: tests/c/test_stream_identity.c $(call arm_ext,$(1)) Makefile
	@mkdir -p $$(dir $$@)
	$(call arm_cc,$(1)) $(CTEST_CFLAGS) $$< -o $$@ -L$$(dir $(call arm_ext,$(1))) \
		-Wl,-rpath,$$(abspath $$(dir $(call arm_ext,$(1)))) -lmoeflash_stream $$(call LLAMA_LINK,$(call arm_lib,$(1)))

$(call arm_ctest,$(1))/test_frames: tests/c/test_frames.c streaming_ext/src/mf_frames.c $(EXT_HDR) \
		streaming_ext/src/mf_internal.h $(call arm_stamp,$(1)) Makefile
	@mkdir -p $$(dir $$@)
	$(ARM_GCC) $$(filter-out -fPIC -fvisibility=hidden -O2,$(EXT_CFLAGS)) -Istreaming_ext/src -O1 \
		-fno-omit-frame-pointer -fsanitize=undefined -fno-sanitize-recover=undefined tests/c/test_frames.c \
		streaming_ext/src/mf_frames.c -o $$@ -lpthread
endef
$(foreach v,$(ARM_VARIANTS),$(eval $(call ARM_VARIANT,$(v))))

# the demo model is committed (trained here: docs/training.md); this checks it is the one committed
demo-model:
	cd $(dir $(DEMO_MODEL)) && sha256sum --quiet --check $(notdir $(DEMO_MODEL)).sha256

# Runs the server on MODEL (default: the committed demo model, a small qwen3moe trained here,
# served with its experts streamed, so the web page shows the streamer's telemetry)
serve: setup
	@if [ -z "$(MODEL)" ]; then $(MAKE) --no-print-directory demo-model; fi
	$(VENV)/bin/moeflash serve --model "$(if $(MODEL),$(MODEL),$(DEMO_MODEL))" --host $(HOST) --port $(PORT) \
		$(if $(MODEL),,--mode streaming)

# The container's entry point (Dockerfile CMD): it listens on the LAN, so an API key is required.
serve-container: require-api-key
	$(MAKE) --no-print-directory serve HOST=0.0.0.0

require-api-key:
	@if [ -z "$$MOEFLASH_API_KEY" ]; then \
		echo "serve-container: MOEFLASH_API_KEY is not set; the container serves on 0.0.0.0 and needs a key" >&2; \
		exit 1; \
	fi

test: setup-dev arm
	$(VPY) -m pytest $(PYTEST_ARGS)

# A smaller version of bench/reports/qwen30b-shape.*: a 3 GB model (generated once into models/),
# caps at 35% and 50% (one of its 8 layers' experts, the dense weights and the automatic margin
# need 29% of this file: at 25% the streamer refuses to start, "not enough memory"), every
# system and lever; a few minutes. Reports in bench/reports/small.*
bench-small: setup-dev
	$(VENV)/bin/moeflash bench suite --shape qwen30b-8l-shape --caps 0.35,0.5 --tokens 16 --mmap-tokens 3 \
		--out bench/reports/small

# The full report (an 18 GB model, about 40 minutes) and the trace replay. BENCH_SHAPE=qwen30b-q4km-shape
# runs the same on the real Q4_K_M file's expert layout (19 GB; bench/reports/qwen30b-q4km-shape.*).
# ROUTE_TRACE=FILE routes every system by a recorded trace (lossy, labelled in the report) and
# decodes the trace's whole decode; its systems are the prefetch's bounds and the serial lever
# (overlap off), not the other levers. E.g.
# BENCH_SHAPE=qwen30b-q4km-k6-shape ROUTE_TRACE=bench/route-traces/qwen.route.csv; the
# report is bench/reports/<shape>-<trace name>.*
BENCH_SHAPE ?= qwen30b-shape
ROUTE_TRACE ?=
BENCH_OUT = bench/reports/$(BENCH_SHAPE)$(if $(ROUTE_TRACE),-$(firstword $(subst ., ,$(notdir $(ROUTE_TRACE)))))
bench: setup-dev
	$(VENV)/bin/moeflash bench suite --shape $(BENCH_SHAPE) --caps 0.25,0.5 --mmap-tokens 6 \
		$(if $(ROUTE_TRACE),--route-trace $(ROUTE_TRACE) --no-levers,--tokens 32) --out $(BENCH_OUT)

# The first answer after a restart, warm-started and cold (~35 minutes): bench/reports/warm-start-<shape>.*
bench-warm-start: setup-dev
	$(VENV)/bin/moeflash bench warm-start --shape $(BENCH_SHAPE) --caps 0.25,0.5 --rounds 3 \
		--out bench/reports/warm-start-$(BENCH_SHAPE)

replay: setup-dev
	$(VENV)/bin/moeflash bench replay bench/route-traces/qwen.route.csv \
		bench/route-traces/gemma.route.csv bench/route-traces/trained.route.csv --out bench/reports/trace-replay

# The pinned Codex CLI against the demo model's shape, 50 runs in a row (~40 minutes; not in CI):
# every run must pass, and at least 3 must send a function_call_output without a call_id
codex-loop: setup-dev
	$(VPY) -m tests.agents.codex_loop --runs 50 --min-no-call-id 3

# Records the agents' follow-up requests again into tests/agents/sequences (tests/agents/record.py;
# Claude Code calls tools on seed 1's weights, qwen-code on none tried)
agent-sequences: setup-dev
	$(VPY) -m tests.agents.record --agents codex,opencode
	$(VPY) -m tests.agents.record --agents claude-code --seed 1

# What is written more than once and how big the parts are (tests/house.py)
house: $(VENV)/.deps-stamp
	$(VPY) -m tests.house

lint: setup-dev
	$(VENV)/bin/ruff check server streaming_ext tests
	$(VENV)/bin/ruff format --check server streaming_ext tests
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint Dockerfile

clean:
	rm -rf streaming_ext/lib streaming_ext/_declared.py tests/c/build .pytest_cache .mypy_cache .ruff_cache

distclean: clean
	rm -rf $(VENV) vendor/llama.cpp/llama-cpp-python vendor/llama.cpp/build vendor/llama.cpp/.cache models
