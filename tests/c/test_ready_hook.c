// Test of patch 0002 (ggml-cpu mul_mat_id ready hook), driven by tests/build/test_patches.py.
//
//   test_ready_hook MODEL.gguf N_THREADS [repack]
//
// Decodes a fixed prompt five times on a fresh context each time:
//   1. no hook                        -> reference logits
//   2. a hook that records and allows -> every routed (layer, expert) of every MUL_MAT_ID was
//      announced before use, nothing unrouted was, and the logits equal the reference
//   3. a hook that refuses everything -> the logits differ (the hook sits on the consumption path)
//   4. a hook that hands out a copy of each slice, elsewhere -> the logits equal the reference
//   5. a hook that hands out the copy of the next expert's slice -> the logits differ (the matmul
//      reads the slice where the hook says it is, not at the tensor's own address)
// Run with GGML_CPU_TILED_MM_FORCE=1 on a K-quant model, the same holds for the tiled matmul.
// With `repack` (patch 0009) the experts are repacked (CPU_REPACK) and the same holds for repack's
// MUL_MAT_ID, whose experts with 4 tokens or more run gemm: a sixth check says every hooked slice
// was repacked and some expert took 4 tokens or more.
// Without the patch this file does not link (ggml_cpu_set_mul_mat_id_ready_hook is missing).
// Prints one "ok ..." or "FAIL ..." line per check; exit status 0 only if all pass.
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml.h"
#include "llama.h"

#define MAX_LAYERS  256
#define MAX_EXPERTS 512
#define MAX_KINDS   4  // gate, up, down, gate_up
#define N_PROMPT    12

enum hook_mode { HOOK_ALLOW, HOOK_REFUSE, HOOK_COPY, HOOK_WRONG_COPY };

typedef struct {
    // routed experts per layer, from the ffn_moe_topk-<il> nodes (written on the decode thread)
    uint8_t        routed[MAX_LAYERS][MAX_EXPERTS];
    // experts announced by the hook per layer (written concurrently by compute threads)
    atomic_uint    announced[MAX_LAYERS][MAX_EXPERTS];
    uint16_t       tokens[MAX_LAYERS][MAX_EXPERTS];  // tokens routed to each, this run
    atomic_long    calls;
    atomic_long    repacked;  // hook calls for a slice of a CPU_REPACK tensor
    atomic_long    unrouted;  // hook calls for an expert the router did not pick
    enum hook_mode mode;
    // copies of slices, made on first use (under mu): [layer][kind][expert]
    pthread_mutex_t mu;
    void *          copies[MAX_LAYERS][MAX_KINDS][MAX_EXPERTS];
} probe;

static int kind_of(const char * name) {
    return strstr(name, "ffn_gate_up_exps") ? 3 : strstr(name, "ffn_gate_exps") ? 0 : strstr(name, "ffn_up_exps") ? 1 : 2;
}

// a copy of slice `expert` of src0 in memory of its own (freed by free_copies)
static const void * copy_of(probe * p, const struct ggml_tensor * src0, int il, int64_t expert) {
    const int kind = kind_of(src0->name);
    pthread_mutex_lock(&p->mu);
    void * c = p->copies[il][kind][expert];
    if (!c && (c = malloc(src0->nb[2])) != NULL) {
        memcpy(c, (const char *) src0->data + expert * (int64_t) src0->nb[2], src0->nb[2]);
        p->copies[il][kind][expert] = c;
    }
    pthread_mutex_unlock(&p->mu);
    return c;
}

static void free_copies(probe * p) {
    for (int il = 0; il < MAX_LAYERS; il++) {
        for (int k = 0; k < MAX_KINDS; k++) {
            for (int e = 0; e < MAX_EXPERTS; e++) {
                free(p->copies[il][k][e]);
                p->copies[il][k][e] = NULL;
            }
        }
    }
}

// clears the counters for the next run (the copies stay)
static void reset(probe * p, enum hook_mode mode) {
    memset(p->routed, 0, sizeof p->routed);
    memset(p->tokens, 0, sizeof p->tokens);
    for (int il = 0; il < MAX_LAYERS; il++) {
        for (int e = 0; e < MAX_EXPERTS; e++) {
            atomic_store(&p->announced[il][e], 0);
        }
    }
    atomic_store(&p->calls, 0);
    atomic_store(&p->repacked, 0);
    atomic_store(&p->unrouted, 0);
    p->mode = mode;
}

static int layer_of(const char * name) {
    int il = -1;
    if (sscanf(name, "blk.%d.", &il) != 1 || il < 0 || il >= MAX_LAYERS) {
        return -1;
    }
    return il;
}

static bool on_eval(struct ggml_tensor * t, bool ask, void * ud) {
    probe * p = ud;
    if (ask) {
        return strncmp(t->name, "ffn_moe_topk-", 13) == 0;
    }
    const int il = atoi(t->name + 13);
    if (il < 0 || il >= MAX_LAYERS) {
        return false;
    }
    // the ids are a strided view: row i1 starts at data + i1*nb[1]
    for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
        for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
            const int32_t e = *(const int32_t *) ((const char *) t->data + i1 * t->nb[1] + i0 * t->nb[0]);
            if (e >= 0 && e < MAX_EXPERTS) {
                p->routed[il][e] = 1;
                p->tokens[il][e]++;
            }
        }
    }
    return true;
}

static const void * on_ready(const struct ggml_tensor * src0, int64_t expert, void * ud) {
    probe *   p  = ud;
    const int il = layer_of(src0->name);
    atomic_fetch_add(&p->calls, 1);
    if (src0->buffer && strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(src0->buffer)), "CPU_REPACK") == 0) {
        atomic_fetch_add(&p->repacked, 1);
    }
    if (il < 0 || expert < 0 || expert >= MAX_EXPERTS || !p->routed[il][expert]) {
        atomic_fetch_add(&p->unrouted, 1);
        return NULL;
    }
    atomic_fetch_add(&p->announced[il][expert], 1);
    switch (p->mode) {
        case HOOK_ALLOW:
            return (const char *) src0->data + expert * (int64_t) src0->nb[2];
        case HOOK_REFUSE:
            return NULL;
        case HOOK_COPY:
            return copy_of(p, src0, il, expert);
        case HOOK_WRONG_COPY:
            return copy_of(p, src0, il, (expert + 1) % src0->ne[2]);
    }
    return NULL;
}

// decodes the prompt on a fresh context; copies the last row of logits into out (n_vocab floats)
static int run(struct llama_model * model, int n_threads, probe * p, bool hook, float * out, int n_vocab) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx             = 256;
    cp.n_batch           = 64;
    cp.n_threads         = n_threads;
    cp.n_threads_batch   = n_threads;
    cp.cb_eval           = on_eval;
    cp.cb_eval_user_data = p;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "FAIL cannot create a context\n");
        return -1;
    }
    llama_token prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) {
        prompt[i] = (llama_token) (32 + 7 * i) % n_vocab;
    }
    ggml_cpu_set_mul_mat_id_ready_hook(hook ? on_ready : NULL, p);
    const int rc = llama_decode(ctx, llama_batch_get_one(prompt, N_PROMPT));
    ggml_cpu_set_mul_mat_id_ready_hook(NULL, NULL);
    if (rc != 0) {
        fprintf(stderr, "FAIL llama_decode returned %d\n", rc);
        llama_free(ctx);
        return -1;
    }
    memcpy(out, llama_get_logits_ith(ctx, -1), sizeof(float) * (size_t) n_vocab);
    llama_free(ctx);
    return 0;
}

// runs the prompt in `mode` and checks its logits against the reference: equal if `same`, else not.
// Prints "ok <ok>" or "FAIL <fail>"; returns -1 if the run failed, 1 if the check did, else 0
static int expect(struct llama_model * model, int n_threads, probe * p, enum hook_mode mode, const float * ref,
                  float * got, int n_vocab, bool same, const char * ok, const char * fail) {
    reset(p, mode);
    if (run(model, n_threads, p, true, got, n_vocab) != 0) {
        return -1;
    }
    if ((memcmp(ref, got, sizeof(float) * (size_t) n_vocab) == 0) != same) {
        printf("FAIL %s\n", fail);
        return 1;
    }
    printf("ok %s\n", ok);
    return 0;
}

int main(int argc, char ** argv) {
    const bool repack = argc == 4 && strcmp(argv[3], "repack") == 0;
    if (argc != 3 && !repack) {
        fprintf(stderr, "usage: %s MODEL.gguf N_THREADS [repack]\n", argv[0]);
        return 2;
    }
    const int n_threads = atoi(argv[2]);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts           = repack;
    mp.load_mode                 = LLAMA_LOAD_MODE_MMAP;
    struct llama_model * model   = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "FAIL cannot load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_layer = llama_model_n_layer(model);
    float *   ref     = malloc(sizeof(float) * (size_t) n_vocab);
    float *   got     = malloc(sizeof(float) * (size_t) n_vocab);
    probe *   p       = calloc(1, sizeof *p);
    int       failed  = 0;
    if (!ref || !got || !p) {
        fprintf(stderr, "FAIL out of memory\n");
        return 1;
    }
    pthread_mutex_init(&p->mu, NULL);

    if (run(model, n_threads, p, false, ref, n_vocab) != 0) {
        return 1;
    }
    if (atomic_load(&p->calls) != 0) {
        printf("FAIL the unset hook was called %ld times\n", atomic_load(&p->calls));
        failed = 1;
    }

    reset(p, HOOK_ALLOW);
    if (run(model, n_threads, p, true, got, n_vocab) != 0) {
        return 1;
    }
    long missing = 0, routed = 0;
    for (int il = 0; il < n_layer && il < MAX_LAYERS; il++) {
        for (int e = 0; e < MAX_EXPERTS; e++) {
            if (p->routed[il][e]) {
                routed++;
                missing += atomic_load(&p->announced[il][e]) == 0;
            }
        }
    }
    if (routed == 0 || atomic_load(&p->calls) == 0 || missing != 0 || atomic_load(&p->unrouted) != 0) {
        printf("FAIL hook: %ld calls, %ld routed (layer, expert) pairs, %ld never announced, %ld unrouted\n",
               atomic_load(&p->calls), routed, missing, atomic_load(&p->unrouted));
        failed = 1;
    } else {
        printf("ok hook announced all %ld routed (layer, expert) pairs in %ld calls, none unrouted\n", routed,
               atomic_load(&p->calls));
    }
    if (repack) {
        long gemm = 0;
        for (int il = 0; il < n_layer && il < MAX_LAYERS; il++) {
            for (int e = 0; e < MAX_EXPERTS; e++) {
                gemm += p->tokens[il][e] >= 4;
            }
        }
        if (atomic_load(&p->calls) == 0 || atomic_load(&p->repacked) != atomic_load(&p->calls) || gemm == 0) {
            printf("FAIL repack: %ld of %ld hooked slices repacked, %ld (layer, expert) pairs with 4+ tokens\n",
                   atomic_load(&p->repacked), atomic_load(&p->calls), gemm);
            failed = 1;
        } else {
            printf("ok all %ld hooked slices repacked; %ld (layer, expert) pairs took 4+ tokens (gemm)\n",
                   atomic_load(&p->calls), gemm);
        }
    }
    if (memcmp(ref, got, sizeof(float) * (size_t) n_vocab) != 0) {
        printf("FAIL an allowing hook changed the logits\n");
        failed = 1;
    } else {
        printf("ok an allowing hook leaves the logits bit-identical\n");
    }

    const struct {
        enum hook_mode mode;
        bool           same;
        const char *   ok;
        const char *   fail;
    } checks[] = {
        { HOOK_REFUSE, false, "a refusing hook skips the experts (logits differ)",
          "a refusing hook did not change the logits: it is not on the expert path" },
        { HOOK_COPY, true, "slices handed out from copies elsewhere leave the logits bit-identical",
          "slices handed out from copies elsewhere changed the logits" },
        { HOOK_WRONG_COPY, false, "the matmul reads the slice the hook hands out (the next expert's copy: logits differ)",
          "the next expert's copy handed out did not change the logits: the matmul reads elsewhere" },
    };
    for (size_t c = 0; c < sizeof checks / sizeof checks[0]; c++) {
        const int rc = expect(model, n_threads, p, checks[c].mode, ref, got, n_vocab, checks[c].same, checks[c].ok,
                              checks[c].fail);
        if (rc < 0) {
            return 1;
        }
        failed |= rc;
    }

    free_copies(p);
    pthread_mutex_destroy(&p->mu);
    free(p);
    free(got);
    free(ref);
    llama_model_free(model);
    llama_backend_free();
    return failed;
}
