// Test of patch 0010 (x86): Q4_K weights repacked as q4_K_8x8 run ggml's tiled K-quant kernel for
// 8 columns or more, and below that repack's gemv and gemm. Driven by tests/build/test_patches.py.
//
//   test_tiled_repacked
//
// Checks, each printing one "ok ..." or "FAIL ..." line (exit status 0 only if all pass):
//   0. Q4_K has a repacked layout (ggml_cpu_repack_layout, patch 0009)
//   1. MUL_MAT of 8, 16, 17 and 40 columns (the tiled kernel's narrow and wide paths), the weight
//      in repack's buffer (CPU_REPACK) against the file's layout in a plain CPU buffer: the same
//      bits, so the tiled kernel ran on the repacked layout (stock repack runs gemm: other bits)
//   2. MUL_MAT_ID with every used expert given 8 tokens or more: the same bits, through the ready
//      hook's pointer (patch 0002), as streamed experts are
//   3. the repacked weight's columns alone and in batches of 2 to 7 (gemv, gemm): a column's bits do
//      not depend on its batch below the tiled kernel
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#define N_IN     512  // two K-quant super-blocks
#define N_OUT    128
#define N_EXPERT 8
#define N_USED   2
#define MAX_COL  40

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

static int check(bool pass, const char * ok, const char * fail) {
    printf("%s %s\n", pass ? "ok" : "FAIL", pass ? ok : fail);
    return pass ? 0 : 1;
}

// the ready hook says where each expert's slice is (the streamer's path); counts its calls
static const void * ready(const struct ggml_tensor * t, int64_t expert, void * ud) {
    ++*(int *) ud;
    return (const char *) t->data + expert * t->nb[2];
}

// y = W x for n_col columns (MUL_MAT, n_expert 1) or MUL_MAT_ID over n_expert experts with route;
// W's bytes in a buffer of `buft`; out gets the result. 0 on success.
static int compute(ggml_backend_t backend, ggml_backend_buffer_type_t buft, const char * raw, int n_expert,
                   const float * xs, int n_col, const int32_t * route, float * out) {
    struct ggml_init_params ip    = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context *   ctx_w = ggml_init(ip);
    struct ggml_context *   ctx   = ggml_init(ip);
    struct ggml_tensor *    w     = n_expert == 1 ? ggml_new_tensor_2d(ctx_w, GGML_TYPE_Q4_K, N_IN, N_OUT)
                                                  : ggml_new_tensor_3d(ctx_w, GGML_TYPE_Q4_K, N_IN, N_OUT, n_expert);
    struct ggml_tensor *    x, *y;
    struct ggml_tensor *    ids = NULL;
    if (n_expert == 1) {
        x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, N_IN, n_col);
        y = ggml_mul_mat(ctx, w, x);
    } else {
        x   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, N_IN, 1, n_col);
        ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, N_USED, n_col);
        y   = ggml_mul_mat_id(ctx, w, x, ids);
    }
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_backend_buffer_t wb = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, buft);
    ggml_backend_buffer_t io = ggml_backend_alloc_ctx_tensors(ctx, backend);
    int                   rc = 1;
    if (wb && io) {
        ggml_backend_tensor_set(w, raw, 0, ggml_nbytes(w));  // CPU_REPACK repacks on upload
        ggml_backend_tensor_set(x, xs, 0, sizeof(float) * N_IN * (size_t) n_col);
        if (ids) {
            ggml_backend_tensor_set(ids, route, 0, sizeof(int32_t) * N_USED * (size_t) n_col);
        }
        if (ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS) {
            ggml_backend_tensor_get(y, out, 0, ggml_nbytes(y));
            rc = 0;
        }
    }
    ggml_backend_buffer_free(io);
    ggml_backend_buffer_free(wb);
    ggml_free(ctx);
    ggml_free(ctx_w);
    return rc;
}

int main(void) {
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, 2);
    const ggml_backend_buffer_type_t repack = repack_buft();
    const ggml_backend_buffer_type_t plain  = ggml_backend_cpu_buffer_type();
    const size_t                     n_w    = (size_t) N_IN * N_OUT * N_EXPERT;
    float *                          f      = malloc(sizeof(float) * n_w);
    float *                          xs     = malloc(sizeof(float) * N_IN * MAX_COL);
    char *                           raw    = malloc(ggml_row_size(GGML_TYPE_Q4_K, N_IN) * N_OUT * N_EXPERT);
    float *                          a      = malloc(sizeof(float) * N_OUT * N_USED * MAX_COL);
    float *                          b      = malloc(sizeof(float) * N_OUT * N_USED * MAX_COL);
    if (!backend || !repack || !f || !xs || !raw || !a || !b) {
        printf("FAIL no CPU backend, no CPU_REPACK buffer type or out of memory\n");
        return 1;
    }
    uint32_t seed = 12345;
    for (size_t i = 0; i < n_w; i++) {
        seed = seed * 1664525u + 1013904223u;
        f[i] = (float) ((int32_t) (seed >> 8) % 2001 - 1000) / 1000.0f;
    }
    ggml_quantize_chunk(GGML_TYPE_Q4_K, f, raw, 0, N_OUT * N_EXPERT, N_IN, NULL);
    for (int i = 0; i < N_IN * MAX_COL; i++) {
        xs[i] = (float) ((i * 37) % 101 - 50) / 50.0f;
    }
    int failed = 0;

    // without the patch x86 keeps Q4_K in the file's layout, and CPU_REPACK cannot take it
    struct ggml_init_params ip    = { ggml_tensor_overhead(), NULL, true };
    struct ggml_context *   probe = ggml_init(ip);
    const bool repacked = ggml_cpu_repack_layout(ggml_new_tensor_2d(probe, GGML_TYPE_Q4_K, N_IN, N_OUT)) != NULL;
    ggml_free(probe);
    if (check(repacked, "Q4_K has a repacked layout", "Q4_K has no repacked layout on this CPU")) {
        return 1;
    }

    // 1. MUL_MAT: repacked against the file's layout, 8 columns and more
    const int cols[] = { 8, 16, 17, MAX_COL };
    bool      same   = true;
    for (size_t c = 0; c < sizeof cols / sizeof cols[0]; c++) {
        if (compute(backend, repack, raw, 1, xs, cols[c], NULL, a) || compute(backend, plain, raw, 1, xs, cols[c], NULL, b)) {
            printf("FAIL a MUL_MAT did not compute\n");
            return 1;
        }
        same = same && memcmp(a, b, sizeof(float) * N_OUT * (size_t) cols[c]) == 0;
    }
    failed |= check(same, "MUL_MAT of 8 to 40 columns: the repacked layout computes the file layout's bits",
                    "MUL_MAT of 8 or more columns: the repacked layout computed other bits than the file's");

    // 2. MUL_MAT_ID: token t goes to experts t % 4 and 4 + t % 2 (10 tokens each, and 20), through
    // the ready hook
    int32_t route[MAX_COL * N_USED];
    for (int t = 0; t < MAX_COL; t++) {
        route[t * N_USED]     = t % 4;
        route[t * N_USED + 1] = 4 + t % 2;
    }
    int calls = 0;
    ggml_cpu_set_mul_mat_id_ready_hook(ready, &calls);
    const int rc = compute(backend, repack, raw, N_EXPERT, xs, MAX_COL, route, a) |
                   compute(backend, plain, raw, N_EXPERT, xs, MAX_COL, route, b);
    ggml_cpu_set_mul_mat_id_ready_hook(NULL, NULL);
    if (rc) {
        printf("FAIL a MUL_MAT_ID did not compute\n");
        return 1;
    }
    failed |= check(memcmp(a, b, sizeof(float) * N_OUT * N_USED * MAX_COL) == 0 && calls > 0,
                    "MUL_MAT_ID, experts of 10 and 20 tokens: the repacked layout computes the file layout's bits",
                    "MUL_MAT_ID, experts of 8 tokens or more: other bits than the file's layout (or no hook call)");

    // 3. below the tiled kernel, a repacked column's bits do not depend on its batch
    bool invariant = true;
    for (int n = 2; n < 8; n++) {
        if (compute(backend, repack, raw, 1, xs, n, NULL, a)) {
            printf("FAIL a MUL_MAT did not compute\n");
            return 1;
        }
        for (int col = 0; col < n; col++) {
            if (compute(backend, repack, raw, 1, xs + (size_t) col * N_IN, 1, NULL, b)) {
                printf("FAIL a MUL_MAT did not compute\n");
                return 1;
            }
            invariant = invariant && memcmp(a + (size_t) col * N_OUT, b, sizeof(float) * N_OUT) == 0;
        }
    }
    failed |= check(invariant, "repacked, 1 to 7 columns: a column's bits are the same alone and in a batch",
                    "repacked, 2 to 7 columns: a column's bits differ from the same column alone");

    free(b);
    free(a);
    free(raw);
    free(xs);
    free(f);
    ggml_backend_free(backend);
    return failed;
}
