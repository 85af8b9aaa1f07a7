// Test of patch 0009's repacked layouts in other buffer types, driven by tests/build/test_patches.py.
//
//   test_repack_slices TYPE        (q4_0, q4_K or mxfp4)
//
// One MUL_MAT_ID (8 experts, 4 routed per token, 7 tokens: some experts get 4 or more tokens and
// run gemm, the others gemv) computed on the CPU backend with its experts:
//   1. in repack's own buffer (CPU_REPACK), which repacks them on upload -> the reference
//   2. in a plain CPU buffer, each expert's slice written by ggml_cpu_repack_slice and the tensor's
//      extra set to ggml_cpu_repack_layout -> the reference's bits (repack's kernels ran); the
//      slices are written without a log line (the streamer writes one per expert it reads, and
//      llama-cpp-python's log callback takes the GIL)
//   3. the same bytes without the layout in extra -> other values (the layout is what dispatches)
// and ggml_cpu_repack_slice refuses a slice of the wrong size and a layout of another tensor.
// Prints one "ok ..." or "FAIL ..." line per check; exit status 0 only if all pass.
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#define N_EXPERT 8
#define N_USED   4
#define N_TOKEN  7
#define N_OUT    64

typedef ggml_backend_buffer_type_t * (*extra_bufts_fn)(ggml_backend_dev_t);

static ggml_backend_buffer_type_t repack_buft(void) {
    ggml_backend_reg_t   reg = ggml_backend_cpu_reg();
    const extra_bufts_fn get = (extra_bufts_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * b = get ? get(ggml_backend_reg_dev_get(reg, 0)) : NULL; b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return NULL;
}

static void count_log(enum ggml_log_level level, const char * text, void * ud) {
    (void) level;
    (void) text;
    ++*(int *) ud;
}

static int check(bool pass, const char * ok, const char * fail) {
    printf("%s %s\n", pass ? "ok" : "FAIL", pass ? ok : fail);
    return pass ? 0 : 1;
}

int main(int argc, char ** argv) {
    const enum ggml_type type = argc == 2 && strcmp(argv[1], "q4_K") == 0    ? GGML_TYPE_Q4_K
                                : argc == 2 && strcmp(argv[1], "mxfp4") == 0 ? GGML_TYPE_MXFP4
                                : argc == 2 && strcmp(argv[1], "q4_0") == 0  ? GGML_TYPE_Q4_0
                                                                             : GGML_TYPE_COUNT;
    if (type == GGML_TYPE_COUNT) {
        fprintf(stderr, "usage: %s q4_0|q4_K|mxfp4\n", argv[0]);
        return 2;
    }
    const int64_t n_in = 256;  // a Q4_K super-block
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, 2);
    const ggml_backend_buffer_type_t repack = repack_buft();
    if (!backend || !repack) {
        printf("FAIL no CPU backend or no CPU_REPACK buffer type\n");
        return 1;
    }

    // the experts in a context of their own: the other tensors share one CPU buffer
    struct ggml_init_params ip = { 64 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context *   ctx_w = ggml_init(ip);
    struct ggml_context *   ctx   = ggml_init(ip);
    struct ggml_tensor *    w[3];
    for (int i = 0; i < 3; i++) {
        w[i] = ggml_new_tensor_3d(ctx_w, type, n_in, N_OUT, N_EXPERT);
    }
    struct ggml_tensor * x   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_in, 1, N_TOKEN);
    struct ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, N_USED, N_TOKEN);
    struct ggml_cgraph * gf  = ggml_new_graph(ctx);
    struct ggml_tensor * y[3];
    for (int i = 0; i < 3; i++) {
        y[i] = ggml_mul_mat_id(ctx, w[i], x, ids);
        ggml_build_forward_expand(gf, y[i]);
    }
    ggml_backend_buffer_t io = ggml_backend_alloc_ctx_tensors(ctx, backend);  // x, ids, the outputs
    const size_t          nbytes = ggml_nbytes(w[0]), slice = w[0]->nb[2];
    ggml_backend_buffer_t wb[3] = { ggml_backend_buft_alloc_buffer(repack, nbytes),
                                    ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), nbytes),
                                    ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), nbytes) };
    float *               f   = malloc(sizeof(float) * (size_t) (n_in * N_OUT * N_EXPERT));
    char *                raw = malloc(nbytes);
    if (!io || !wb[0] || !wb[1] || !wb[2] || !f || !raw) {
        printf("FAIL out of memory\n");
        return 1;
    }
    for (int i = 0; i < 3; i++) {
        ggml_backend_tensor_alloc(wb[i], w[i], ggml_backend_buffer_get_base(wb[i]));
    }
    uint32_t seed = 12345;
    for (int64_t i = 0; i < n_in * N_OUT * N_EXPERT; i++) {
        seed = seed * 1664525u + 1013904223u;
        f[i] = (float) ((int32_t) (seed >> 8) % 2001 - 1000) / 1000.0f;
    }
    ggml_quantize_chunk(type, f, raw, 0, N_OUT * N_EXPERT, n_in, NULL);
    float xs[N_TOKEN * 256];
    for (int i = 0; i < N_TOKEN * 256; i++) {
        xs[i] = (float) ((i * 37) % 101 - 50) / 50.0f;
    }
    ggml_backend_tensor_set(x, xs, 0, sizeof xs);
    // expert 2 gets every token (gemm, then gemv for the 7th); 5 gets 4 (gemm); the rest fewer (gemv)
    int32_t route[N_TOKEN][N_USED];
    for (int t = 0; t < N_TOKEN; t++) {
        const int32_t r[N_USED] = { 2, t < 4 ? 5 : 6, (t + 3) % 8 == 2 ? 7 : (t + 3) % 8, t % 2 ? 0 : 1 };
        memcpy(route[t], r, sizeof r);
    }
    ggml_backend_tensor_set(ids, route, 0, sizeof route);

    int          failed = 0;
    const void * layout = ggml_cpu_repack_layout(w[1]);
    if (!layout && !w[0]->extra) {
        // x86 builds keep Q4_K in the file's layout (patch 0010): llama.cpp never puts such a
        // tensor in CPU_REPACK, and there is nothing to compare
        printf("ok %s has no repacked layout on this CPU, in CPU_REPACK either\n", argv[1]);
        return 0;
    }
    ggml_backend_tensor_set(w[0], raw, 0, nbytes);  // CPU_REPACK repacks on upload
    failed |= check(layout != NULL && layout == w[0]->extra, "ggml_cpu_repack_layout names CPU_REPACK's layout",
                    "ggml_cpu_repack_layout is not the layout CPU_REPACK gave the same tensor");
    if (!layout) {
        return 1;
    }
    int rc = 0, logged = 0;
    ggml_log_set(count_log, &logged);
    for (int e = 0; e < N_EXPERT; e++) {
        rc |= ggml_cpu_repack_slice(layout, w[1], (char *) w[1]->data + e * slice, raw + e * slice, slice);
    }
    ggml_log_set(NULL, NULL);
    w[1]->extra = (void *) layout;
    memcpy(w[2]->data, w[1]->data, nbytes);  // the same repacked bytes, without the layout
    failed |= check(rc == 0 && logged == 0, "every slice repacked, without a log line",
                    "ggml_cpu_repack_slice failed or logged");
    failed |= check(ggml_cpu_repack_slice(layout, w[1], w[2]->data, raw, slice - 1) != 0 &&
                        ggml_cpu_repack_slice(NULL, w[1], w[2]->data, raw, slice) != 0,
                    "a wrong size or no layout is refused", "a wrong size or no layout was accepted");
    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
        printf("FAIL the graph did not compute\n");
        return 1;
    }
    const size_t out = ggml_nbytes(y[0]);
    float *      got[3];
    for (int i = 0; i < 3; i++) {
        got[i] = malloc(out);
        ggml_backend_tensor_get(y[i], got[i], 0, out);
    }
    failed |= check(memcmp(got[0], got[1], out) == 0, "slices repacked in a plain buffer compute CPU_REPACK's bits",
                    "slices repacked in a plain buffer computed other values than CPU_REPACK");
    failed |= check(memcmp(got[0], got[2], out) != 0, "without the layout in extra the plain kernel runs (values differ)",
                    "without the layout in extra the values are the same: the layout does not dispatch");

    for (int i = 0; i < 3; i++) {
        free(got[i]);
        ggml_backend_buffer_free(wb[i]);
    }
    free(raw);
    free(f);
    ggml_backend_buffer_free(io);
    ggml_free(ctx);
    ggml_free(ctx_w);
    ggml_backend_free(backend);
    return failed;
}
