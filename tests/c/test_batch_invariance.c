// Test of patch 0011: a matmul's column does not depend on how many columns its batch has,
// driven by tests/build/test_patches.py (and tests/build/test_aarch64.py under qemu).
//
//   test_batch_invariance
//
// For each weight type a model's matmuls use (F32 and F16: routers, some outputs; Q8_0, Q4_0,
// Q5_0, IQ4_NL, Q4_K, Q6_K), one MUL_MAT on the CPU backend with 1 to 8 columns of the same
// inputs: every column's values must be the bits the same column gets alone. Without the patch
// ggml computes one column with vec_dot and several with llamafile's tinyBLAS, which sum F32, F16
// and IQ4_NL rows (on ARM Q8_0 and Q4_0 too) in another order. The K-quants are checked up to 7
// columns: from 8 on, x86 runs ggml's tiled K-quant kernel, which sums in another order again
// (docs/memory.md says what that moves).
// Prints one "ok TYPE" or "FAIL TYPE ..." line per type; exit status 0 only if all pass.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#define N_IN    256  // a K-quant super-block
#define N_OUT   64
#define MAX_COL 8

static int matmul(ggml_backend_t backend, enum ggml_type type, const void * w_bytes, const float * x_values,
                  int n_col, float * out) {
    struct ggml_init_params ip  = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context *   ctx = ggml_init(ip);
    struct ggml_tensor *    w   = ggml_new_tensor_2d(ctx, type, N_IN, N_OUT);
    struct ggml_tensor *    x   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, N_IN, n_col);
    struct ggml_tensor *    y   = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph *    gf  = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    int                   rc  = 1;
    if (buf) {
        ggml_backend_tensor_set(w, w_bytes, 0, ggml_nbytes(w));
        ggml_backend_tensor_set(x, x_values, 0, sizeof(float) * N_IN * (size_t) n_col);
        if (ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS) {
            ggml_backend_tensor_get(y, out, 0, ggml_nbytes(y));
            rc = 0;
        }
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return rc;
}

int main(void) {
    ggml_backend_t backend = ggml_backend_cpu_init();
    float *        f       = malloc(sizeof(float) * N_IN * N_OUT);
    float *        x       = malloc(sizeof(float) * N_IN * MAX_COL);
    char *         raw     = malloc(ggml_row_size(GGML_TYPE_F32, N_IN) * N_OUT);
    if (!backend || !f || !x || !raw) {
        printf("FAIL no CPU backend or out of memory\n");
        return 1;
    }
    ggml_backend_cpu_set_n_threads(backend, 2);
    uint32_t seed = 7;
    for (int i = 0; i < N_IN * N_OUT; i++) {
        seed = seed * 1664525u + 1013904223u;
        f[i] = (float) ((int32_t) (seed >> 8) % 2001 - 1000) / 1000.0f;
    }
    for (int i = 0; i < N_IN * MAX_COL; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float) ((int32_t) (seed >> 8) % 2001 - 1000) / 731.0f;
    }
    const enum ggml_type types[]   = { GGML_TYPE_F32,  GGML_TYPE_F16,    GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                       GGML_TYPE_Q5_0, GGML_TYPE_IQ4_NL, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K };
    const int            max_col[] = { MAX_COL, MAX_COL, MAX_COL, MAX_COL, MAX_COL, MAX_COL, MAX_COL - 1, MAX_COL - 1 };
    int failed = 0;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const enum ggml_type type = types[t];
        if (type == GGML_TYPE_F32) {
            memcpy(raw, f, sizeof(float) * N_IN * N_OUT);
        } else {
            ggml_quantize_chunk(type, f, raw, 0, N_OUT, N_IN, NULL);
        }
        float alone[MAX_COL][N_OUT], batch[MAX_COL * N_OUT];
        int   bad_n = 0, bad_col = -1;
        for (int c = 0; c < MAX_COL && !bad_n; c++) {
            if (matmul(backend, type, raw, x + c * N_IN, 1, alone[c])) {
                bad_n = -1;
            }
        }
        for (int n = 2; n <= max_col[t] && !bad_n; n++) {
            if (matmul(backend, type, raw, x, n, batch)) {
                bad_n = -1;
                break;
            }
            for (int c = 0; c < n; c++) {
                if (memcmp(alone[c], batch + c * N_OUT, sizeof alone[c]) != 0) {
                    bad_n   = n;
                    bad_col = c;
                    break;
                }
            }
        }
        if (bad_n < 0) {
            printf("FAIL %s: the graph did not compute\n", ggml_type_name(type));
        } else if (bad_n) {
            printf("FAIL %s: column %d of a %d-column batch differs from the column alone\n", ggml_type_name(type),
                   bad_col, bad_n);
        } else {
            printf("ok %s, 1 to %d columns\n", ggml_type_name(type), max_col[t]);
        }
        failed |= bad_n != 0;
    }
    free(raw);
    free(x);
    free(f);
    ggml_backend_free(backend);
    return failed;
}
