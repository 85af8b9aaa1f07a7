// Byte-identity gate of the streamer in C alone: no Python, so it runs wherever llama.cpp and
// streaming_ext are built, on x86_64 and under qemu-user on aarch64 (tests/build/test_aarch64.py).
//
//   test_stream_identity MODEL.gguf N_THREADS
//
// Greedy-decodes a fixed prompt with the model resident (the reference), then streamed under the
// budget floor (one layer's experts: every other layer's routing evicts) in three configurations
// of the levers, once with a budget moved down to the floor and back up mid-decode
// (mf_streamer_set_budget after the load), once warm-started (mf_streamer_restore fills two
// layers' budget before the first token and is called again between tokens, and
// mf_streamer_hot_set must then list exactly the resident experts), and once with the negative
// control (one expert never read). Each streamed run
// must give the reference's tokens and the same hash of every step's logits, with no violation
// and something evicted; the negative control must not. The model is loaded the way
// server/loading/streaming.py and resident.py load it (buffer-type overrides, load modes,
// use_extra_bufts on: repacked layouts both sides, the streamer's eval callback).
// Prints "tokens ...", "logits <hash>" for the reference, "page <bytes>" and "system <llama.cpp's
// CPU features>", then one "ok ..." or "FAIL ..." line per check; exit status 0 only if all pass.
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llama.h"
#include "moeflash_stream.h"

#define N_PROMPT 24
#define N_DECODE 16

typedef struct {
    llama_token tokens[N_DECODE];
    uint64_t    logits_hash;  // FNV-1a over the bytes of every step's logits row
    mf_stats    stats;        // of the streamer (zero for the resident run)
} outcome;

static uint64_t fnv1a(uint64_t h, const void * data, size_t n) {
    const unsigned char * p = data;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ p[i]) * 1099511628211ULL;
    }
    return h;
}

// a budget that moves down to the floor and back up mid-decode: its steps and what it checks
#define SHRINK_AT (N_DECODE / 3)
#define GROW_AT   (2 * N_DECODE / 3)

// moves the budget of s to `bytes` between two decode calls; 0, or -1 with a FAIL line when the
// move fails or a smaller budget leaves more resident than it or gives no memory back
static int move_budget(mf_streamer * s, uint64_t bytes) {
    mf_stats before, after;
    mf_streamer_get_stats(s, &before);
    if (mf_streamer_set_budget(s, bytes) != 0) {
        printf("FAIL moving the budget to %llu bytes: %s\n", (unsigned long long) bytes, mf_streamer_last_error(s));
        return -1;
    }
    mf_streamer_get_stats(s, &after);
    const bool down = bytes < before.budget_bytes;
    if (after.budget_bytes != bytes || after.resident_bytes > bytes ||
        (down && after.expert_memory_bytes >= before.expert_memory_bytes)) {
        printf("FAIL budget moved to %llu bytes: %llu resident, expert memory %llu -> %llu bytes\n",
               (unsigned long long) bytes, (unsigned long long) after.resident_bytes,
               (unsigned long long) before.expert_memory_bytes, (unsigned long long) after.expert_memory_bytes);
        return -1;
    }
    return 0;
}

// warm start: reads every expert of layer `layer` back, a few at a time, as routed RESTORED_USES
// times; the number read, or -1 with a FAIL line when a call fails or evicts
#define RESTORED_USES 9u
static int restore_layer(mf_streamer * s, int32_t layer) {
    const int32_t n_expert = mf_streamer_n_expert(s);
    uint8_t *     want     = calloc((size_t) n_expert, 1);
    uint32_t *    uses     = calloc((size_t) n_expert, sizeof *uses);
    int           total    = 0;
    mf_stats      before, after;
    mf_streamer_get_stats(s, &before);
    for (int32_t e0 = 0; want && uses && e0 < n_expert; e0 += 3) {
        memset(want, 0, (size_t) n_expert);
        for (int32_t e = e0; e < e0 + 3 && e < n_expert; e++) {
            want[e] = 1;
            uses[e] = RESTORED_USES;
        }
        const int32_t n = mf_streamer_restore(s, layer, want, uses);
        if (n < 0) {
            printf("FAIL mf_streamer_restore(layer %d): %s\n", (int) layer, mf_streamer_last_error(s));
            free(want);
            free(uses);
            return -1;
        }
        total += n;
    }
    free(want);
    free(uses);
    mf_streamer_get_stats(s, &after);
    if (after.evictions != before.evictions || after.resident_bytes > after.budget_bytes) {
        printf("FAIL restoring layer %d evicted %llu entries, %llu bytes resident\n", (int) layer,
               (unsigned long long) (after.evictions - before.evictions), (unsigned long long) after.resident_bytes);
        return -1;
    }
    return total;
}

// the hot set lists each resident expert once, and nothing else, hottest first; `restored`: every
// entry was just restored, as routed RESTORED_USES times (the LAYER policy). 0 or -1 with a FAIL line
static int check_hot_set(mf_streamer * s, bool restored) {
    const int32_t n_expert = mf_streamer_n_expert(s);
    const int32_t cap      = 4096 * n_expert;
    int32_t *     ids      = malloc((size_t) cap * sizeof *ids);
    uint32_t *    uses     = malloc((size_t) cap * sizeof *uses);
    uint8_t *     seen     = calloc((size_t) cap, 1);
    mf_stats      st;
    mf_streamer_get_stats(s, &st);
    const int32_t n     = ids && uses && seen ? mf_streamer_hot_set(s, ids, uses, cap) : -1;
    int           rc    = n > 0 ? 0 : -1;
    uint64_t      bytes = 0;
    for (int32_t i = 0; rc == 0 && i < n; i++) {
        if (ids[i] < 0 || ids[i] >= cap || seen[ids[i]] || (i > 0 && uses[i] > uses[i - 1])) {
            rc = -1;
            break;
        }
        seen[ids[i]] = 1;
        bytes += mf_streamer_layer_bytes(s) / (uint64_t) n_expert;
    }
    if (rc != 0 || bytes > st.resident_bytes + mf_streamer_layer_bytes(s) || st.resident_bytes == 0 ||
        (restored && uses[n - 1] != RESTORED_USES)) {
        printf("FAIL the hot set (%d entries, the last routed %u times) is not the %llu resident bytes\n", (int) n,
               n > 0 ? uses[n - 1] : 0u, (unsigned long long) st.resident_bytes);
        rc = -1;
    }
    free(ids);
    free(uses);
    free(seen);
    return rc;
}

// greedy decode on a fresh context; cb (may be NULL) is the context's eval callback. Streamed (s
// set), the budget is the floor, or with `moving` just under every expert, the floor from step
// SHRINK_AT and back up from GROW_AT, or with `restore` two layers' experts, filled by warm start
// before the first token and topped up between tokens. 0 or -1
static int decode(struct llama_model * model, int n_threads, ggml_backend_sched_eval_callback cb, mf_streamer * s,
                  bool moving, bool restore, outcome * out) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx                       = 256;
    cp.n_batch                     = 64;
    cp.n_threads                   = n_threads;
    cp.n_threads_batch             = n_threads;
    cp.cb_eval                     = cb;
    cp.cb_eval_user_data           = s;
    struct llama_context * ctx     = llama_init_from_model(model, cp);
    if (!ctx) {
        printf("FAIL cannot create a context\n");
        return -1;
    }
    if (s) {
        // the budget floor: one layer's experts, so every layer's routing evicts the last one's
        const uint64_t floor  = mf_streamer_layer_bytes(s);
        const uint64_t budget = moving ? mf_streamer_expert_bytes(s) - 1 : restore ? 2 * floor : floor;
        if (mf_streamer_set_budget(s, budget) != 0 || mf_streamer_check_loaded(s) != 0) {
            printf("FAIL streamer: %s\n", mf_streamer_last_error(s));
            llama_free(ctx);
            return -1;
        }
        const uint8_t none = 0;
        if (restore && mf_streamer_restore(s, -1, &none, NULL) != -EINVAL) {
            printf("FAIL mf_streamer_restore accepted layer -1\n");
            llama_free(ctx);
            return -1;
        }
        // layers from the last: the first token's routing then finds them resident, and the
        // first layers' routing evicts them
        for (int32_t l = 0; restore && l < mf_streamer_n_moe_layers(s); l++) {
            if (restore_layer(s, mf_streamer_n_moe_layers(s) - 1 - l) < 0) {
                llama_free(ctx);
                return -1;
            }
        }
        if (restore && check_hot_set(s, true) != 0) {
            llama_free(ctx);
            return -1;
        }
    }
    const int   n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_token prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) {
        prompt[i] = (llama_token) ((40 + 11 * i) % n_vocab);
    }
    uint64_t    h     = 1469598103934665603ULL;
    llama_batch batch = llama_batch_get_one(prompt, N_PROMPT);
    llama_token next  = 0;
    for (int step = 0; step < N_DECODE; step++) {
        if (s && moving && (step == SHRINK_AT || step == GROW_AT) &&
            move_budget(s, step == SHRINK_AT ? mf_streamer_layer_bytes(s) : mf_streamer_expert_bytes(s) - 1) != 0) {
            llama_free(ctx);
            return -1;
        }
        if (s && restore && step > 0 &&
            (restore_layer(s, step % mf_streamer_n_moe_layers(s)) < 0 || check_hot_set(s, false) != 0)) {
            llama_free(ctx);
            return -1;
        }
        if (llama_decode(ctx, batch) != 0) {
            char msg[512] = "";
            if (s) {
                (void) mf_streamer_take_error(s, msg, sizeof msg);
            }
            printf("FAIL llama_decode failed at step %d %s\n", step, msg);
            llama_free(ctx);
            return -1;
        }
        const float * row = llama_get_logits_ith(ctx, -1);
        h                 = fnv1a(h, row, sizeof(float) * (size_t) n_vocab);
        int best          = 0;
        for (int v = 1; v < n_vocab; v++) {
            best = row[v] > row[best] ? v : best;
        }
        out->tokens[step] = next = (llama_token) best;
        batch                    = llama_batch_get_one(&next, 1);
    }
    out->logits_hash = h;
    if (s) {
        char msg[512];
        if (mf_streamer_take_error(s, msg, sizeof msg) != 0) {
            printf("FAIL streamer error: %s\n", msg);
            llama_free(ctx);
            return -1;
        }
        mf_streamer_get_stats(s, &out->stats);
    }
    llama_free(ctx);
    return 0;
}

static int run_resident(const char * path, int n_threads, outcome * out) {
    struct llama_model_params mp = llama_model_default_params();
    mp.load_mode                 = LLAMA_LOAD_MODE_MMAP;
    mp.use_extra_bufts           = true;
    struct llama_model * model   = llama_model_load_from_file(path, mp);
    if (!model) {
        printf("FAIL cannot load %s resident\n", path);
        return -1;
    }
    const int rc = decode(model, n_threads, NULL, NULL, false, false, out);
    llama_model_free(model);
    return rc;
}

static int run_streamed(const char * path, int n_threads, const mf_config * cfg, bool moving, bool restore,
                        outcome * out) {
    char          err[512] = "";
    mf_streamer * s        = NULL;
    if (mf_streamer_new(cfg, &s, err, sizeof err) != 0) {
        printf("FAIL mf_streamer_new: %s\n", err);
        return -1;
    }
    // the overrides of server/loading/streaming.py: experts streamed, the embeddings mapped when
    // the output matrix is a tensor of its own, everything else read into memory
    struct llama_model_tensor_buft_override ov[4];
    int                                     n = 0;
    ov[n++] = (struct llama_model_tensor_buft_override) { "^blk\\.\\d+\\.ffn_(gate|up|down|gate_up)_exps\\.weight$",
                                                          mf_streamer_expert_buft(s) };
    if (mf_streamer_tensor_bytes(s, "output.weight") > 0) {
        ov[n++] = (struct llama_model_tensor_buft_override) { "^token_embd\\.weight$", mf_streamer_rows_buft(s) };
    }
    ov[n++] = (struct llama_model_tensor_buft_override) { ".*", mf_streamer_dense_buft(s) };
    ov[n]   = (struct llama_model_tensor_buft_override) { NULL, NULL };

    struct llama_model_params mp = llama_model_default_params();
    mp.load_mode                 = LLAMA_LOAD_MODE_MMAP_NO_PREFETCH;
    mp.use_extra_bufts           = true;
    mp.tensor_buft_overrides     = ov;
    if (mf_streamer_set_repack(s, 1) != 0) {
        printf("FAIL mf_streamer_set_repack\n");
        mf_streamer_free(s);
        return -1;
    }
    struct llama_model * model   = llama_model_load_from_file(path, mp);
    int                  rc      = -1;
    if (!model) {
        printf("FAIL cannot load %s streamed: %s\n", path, mf_streamer_last_error(s));
    } else {
        rc = decode(model, n_threads, mf_streamer_eval_cb, s, moving, restore, out);
        llama_model_free(model);
    }
    mf_streamer_free(s);
    return rc;
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf N_THREADS\n", argv[0]);
        return 2;
    }
    const char * path      = argv[1];
    const int    n_threads = atoi(argv[2]);
    llama_backend_init();

    outcome ref = { 0 };
    if (run_resident(path, n_threads, &ref) != 0) {
        return 1;
    }
    printf("tokens");
    for (int i = 0; i < N_DECODE; i++) {
        printf(" %d", ref.tokens[i]);
    }
    const long page = sysconf(_SC_PAGESIZE);
    printf("\nlogits %016llx\npage %ld\nsystem %s\n", (unsigned long long) ref.logits_hash, page,
           llama_print_system_info());

    const mf_config base = { .model_path = path,
                             .lanes      = 2,
                             .reader     = MF_READER_DIRECT,
                             .policy     = MF_POLICY_LAYER,
                             .prefetch   = MF_PREFETCH_ROUTER };
    const struct {
        const char * name;
        mf_config    cfg;
        bool         same;    // must equal the reference (false: the negative control)
        bool         moving;   // the budget moves down to the floor and back up mid-decode
        bool         restore;  // warm-started: experts read back before the first token
    } runs[] = {
        { "default levers (direct reads, layer policy, router prefetch)", base, true, false, false },
        { "default levers, the budget moved down to the floor and back up", base, true, true, false },
        { "default levers, warm-started", base, true, false, true },
        { "overlap, buffered reads, LRU, history prefetch",
          { .model_path = path,
            .lanes      = 3,
            .reader     = MF_READER_BUFFERED,
            .overlap    = 1,
            .policy     = MF_POLICY_LRU,
            .prefetch   = MF_PREFETCH_HISTORY },
          true, false, false },
        { "LRU, the budget moved down to the floor and back up",
          { .model_path = path, .lanes = 2, .policy = MF_POLICY_LRU, .prefetch = MF_PREFETCH_ROUTER },
          true, true, false },
        { "no cache, one lane, no prefetch",
          { .model_path = path, .lanes = 1, .policy = MF_POLICY_NONE, .prefetch = MF_PREFETCH_OFF },
          true, false, false },
        { "negative control: expert 0 never read",
          { .model_path  = path,
            .lanes       = 2,
            .policy      = MF_POLICY_LAYER,
            .prefetch    = MF_PREFETCH_ROUTER,
            .skip_expert = 1 },
          false, false, false },
    };
    int failed = 0;
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        outcome got = { 0 };
        if (run_streamed(path, n_threads, &runs[r].cfg, runs[r].moving, runs[r].restore, &got) != 0) {
            printf("FAIL %s: the run failed\n", runs[r].name);
            failed = 1;
            continue;
        }
        const bool same = memcmp(got.tokens, ref.tokens, sizeof ref.tokens) == 0 && got.logits_hash == ref.logits_hash;
        const mf_stats * st = &got.stats;
        if (runs[r].same && (!same || st->violations != 0 || st->evictions == 0 || st->misses == 0 ||
                             (runs[r].restore && st->restored == 0))) {
            printf("FAIL %s: tokens %s, logits %016llx, %llu violations, %llu evictions, %llu misses, %llu restored\n",
                   runs[r].name, memcmp(got.tokens, ref.tokens, sizeof ref.tokens) == 0 ? "equal" : "differ",
                   (unsigned long long) got.logits_hash, (unsigned long long) st->violations,
                   (unsigned long long) st->evictions, (unsigned long long) st->misses,
                   (unsigned long long) st->restored);
            failed = 1;
        } else if (!runs[r].same && same) {
            printf("FAIL %s: the output did not change, so the gate cannot see a missing read\n", runs[r].name);
            failed = 1;
        } else {
            printf("ok %s: %s (%llu hits, %llu misses, %llu evictions, %llu prefetched, %llu restored, %llu bytes "
                   "read)\n",
                   runs[r].name, runs[r].same ? "byte-identical" : "output differs",
                   (unsigned long long) st->hits, (unsigned long long) st->misses,
                   (unsigned long long) st->evictions, (unsigned long long) st->prefetched,
                   (unsigned long long) st->restored, (unsigned long long) st->bytes_read);
        }
    }
    llama_backend_free();
    return failed;
}
