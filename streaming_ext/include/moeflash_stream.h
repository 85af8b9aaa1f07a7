// moeflash_stream — the expert streamer's C library (libmoeflash_stream.so).
//
// Conventions (see ../shared/STYLE.md): every symbol is prefixed mf_; functions that can fail
// return 0 or -errno; there is no global mutable state: everything hangs off a handle.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MF_API __attribute__((visibility("default")))
#else
#define MF_API
#endif

// Version of this library ("0.1.0"). Thread-safe; static strings, never freed.
MF_API const char * mf_version(void);

// Version and commit of the ggml it is linked against. Thread-safe; static strings.
MF_API const char * mf_ggml_version(void);
MF_API const char * mf_ggml_commit(void);

// Non-zero when the llama.cpp build this library is linked against carries moeflash's patches
// (the mul_mat_id ready hook resolves to the patched ggml-cpu). Thread-safe.
MF_API int mf_patched_build(void);

#ifdef __cplusplus
}
#endif
