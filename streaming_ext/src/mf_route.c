// Route traces: replaying recorded routing into a model, and recording the routing it runs.
//
// mf_route_trace_eval_cb runs on every ffn_moe_topk-<il> node, after the node is computed and
// before anything reads it (the expert weights are gathered from it, the expert matmuls route by
// it). Replaying, it overwrites each token's selected-expert ids with the trace's ids for that
// token's phase, step and layer; recording, it appends the ids the layer now routes by. It then
// hands the node to the chained callback (the streamer's, for a streamed model), so a streamed and
// a resident model compute with the same routing.
// Which token a node's row is: mf_route_trace_begin_batch gives each token of the next
// llama_decode call (its request, KV sequence, phase and step) in the order llama.cpp computes
// them, cut into its micro-batches; a node of a layer not above the last one seen starts the next
// micro-batch. The last layer may compute fewer rows than its micro-batch has (only the tokens
// whose logits are asked for): they are the micro-batch's output tokens, in order. A
// phase longer than the trace's wraps around to the trace's first step.
// Nothing aborts: a node that does not match the trace or the announced micro-batches records an
// error and stops the graph.
#include "mf_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// a token of the decode call being computed, beside its sequence in `batch` (mf_route_trace_begin_batch)
typedef struct route_token {
    int32_t turn, phase, step;
} route_token;

struct mf_route_trace {
    int32_t n_layer, n_expert, k;
    int32_t local_layers;  // layers routed here; 0: all (mf_route_trace_keep_layers)
    int32_t * replay[2];   // per phase: [n_steps][n_layer][k] expert ids (-1: the model's own), or NULL
    int64_t   n_steps[2];
    mf_batch      batch;   // the decode call's tokens and micro-batches
    route_token * tokens;  // [batch.n_tokens]
    int64_t       cap_tokens;
    float     predict_error;          // share of predicted slots replaced (mf_route_trace_set_predict_error)
    uint64_t  rng;                    // splitmix64 state of those replacements
    bool      recording;
    mf_route_record * rec;
    int64_t           head, n_rec, cap_rec;  // records [head, n_rec) not yet taken
    ggml_backend_sched_eval_callback next;
    void *                           next_user_data;
    int  err_code;
    char err_msg[MF_ERR_LEN];
};

int mf_route_trace_new(int32_t n_layer, int32_t n_expert, int32_t k, mf_route_trace ** out) {
    *out = NULL;
    if (n_layer <= 0 || n_expert <= 0 || k <= 0 || k > n_expert) {
        return -EINVAL;
    }
    mf_route_trace * rt = calloc(1, sizeof *rt);
    if (!rt) {
        return -ENOMEM;
    }
    rt->n_layer = n_layer;
    rt->n_expert = n_expert;
    rt->k = k;
    *out = rt;
    return 0;
}

void mf_route_trace_free(mf_route_trace * rt) {
    if (!rt) {
        return;
    }
    free(rt->replay[0]);
    free(rt->replay[1]);
    free(rt->rec);
    free(rt->tokens);
    mf_batch_free(&rt->batch);
    free(rt);
}

int mf_route_trace_set_replay(mf_route_trace * rt, int32_t phase, int64_t n_steps, const int32_t * ids) {
    if (phase < 0 || phase > 1 || n_steps <= 0 || !ids) {
        return -EINVAL;
    }
    const size_t n = (size_t) n_steps * (size_t) rt->n_layer * (size_t) rt->k;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < -1 || ids[i] >= rt->n_expert) {
            return -ERANGE;
        }
    }
    int32_t * copy = malloc(n * sizeof *copy);
    if (!copy) {
        return -ENOMEM;
    }
    memcpy(copy, ids, n * sizeof *copy);
    free(rt->replay[phase]);
    rt->replay[phase] = copy;
    rt->n_steps[phase] = n_steps;
    return 0;
}

void mf_route_trace_set_recording(mf_route_trace * rt, int32_t on) {
    rt->recording = on != 0;
}

void mf_route_trace_chain(mf_route_trace * rt, ggml_backend_sched_eval_callback next, void * next_user_data) {
    rt->next = next;
    rt->next_user_data = next_user_data;
}

int mf_route_trace_begin_batch(mf_route_trace * rt, int64_t n_tokens, const int32_t * seq, const uint8_t * output,
                               int64_t n_ubatch, const int64_t * ends, const int32_t * turn, const int32_t * phase,
                               const int32_t * step) {
    mf_batch_set(&rt->batch, 0, NULL, NULL, 0, NULL);  // nothing announced until this call is whole
    if (n_tokens < 0 || (n_tokens > 0 && (!turn || !phase || !step))) {
        return -EINVAL;
    }
    for (int64_t i = 0; i < n_tokens; i++) {
        if (phase[i] < 0 || phase[i] > 1 || step[i] < 0) {
            return -EINVAL;
        }
    }
    if (mf_grow((void **) &rt->tokens, &rt->cap_tokens, n_tokens, sizeof *rt->tokens) != 0) {
        return -ENOMEM;
    }
    for (int64_t i = 0; i < n_tokens; i++) {
        rt->tokens[i] = (route_token) { .turn = turn[i], .phase = phase[i], .step = step[i] };
    }
    return mf_batch_set(&rt->batch, n_tokens, seq, output, n_ubatch, ends);
}

int64_t mf_route_trace_n_recorded(const mf_route_trace * rt) {
    return rt->n_rec - rt->head;
}

int64_t mf_route_trace_take_recorded(mf_route_trace * rt, mf_route_record * out, int64_t max) {
    const int64_t left = rt->n_rec - rt->head;
    const int64_t n    = left < max ? left : max;
    if (n <= 0) {
        return 0;
    }
    memcpy(out, rt->rec + rt->head, (size_t) n * sizeof *out);
    rt->head += n;
    if (rt->head == rt->n_rec) {
        rt->head = rt->n_rec = 0;  // all taken: record from the start again
    }
    return n;
}

int mf_route_trace_take_error(mf_route_trace * rt, char * msg, size_t msg_size) {
    const int code = rt->err_code;
    if (msg && msg_size) {
        snprintf(msg, msg_size, "%s", code ? rt->err_msg : "");
    }
    rt->err_code = 0;
    rt->err_msg[0] = '\0';
    return code;
}

__attribute__((format(printf, 3, 4))) static bool fail(mf_route_trace * rt, int code, const char * fmt, ...) {
    if (rt->err_code == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(rt->err_msg, sizeof rt->err_msg, fmt, ap);
        va_end(ap);
        rt->err_code = code;
    }
    return false;  // stops the graph
}

static int record(mf_route_trace * rt, int64_t token, int32_t layer, int32_t slot, int32_t expert, float weight) {
    if (mf_grow((void **) &rt->rec, &rt->cap_rec, rt->n_rec + 1 < 4096 ? 4096 : rt->n_rec + 1, sizeof *rt->rec) != 0) {
        return -ENOMEM;
    }
    rt->rec[rt->n_rec++] = (mf_route_record) {
        .turn = rt->tokens[token].turn, .seq = rt->batch.seq[token], .phase = rt->tokens[token].phase,
        .step = rt->tokens[token].step, .layer = layer, .slot = slot, .expert = expert, .weight = weight,
    };
    return 0;
}

// one ffn_moe_topk-<il> node, computed: replace and/or record its ids. False stops the graph
static bool route_node(mf_route_trace * rt, struct ggml_tensor * ids) {
    char *        end = NULL;
    const long    il  = strtol(ids->name + MF_TOPK_PREFIX_LEN, &end, 10);
    const int64_t n_tokens = ids->ne[1];
    if (end == ids->name + MF_TOPK_PREFIX_LEN || il < 0 || il >= rt->n_layer) {
        return fail(rt, -EINVAL, "%s: the route trace has %d layers", ids->name, (int) rt->n_layer);
    }
    if (ids->type != GGML_TYPE_I32 || ids->ne[0] != rt->k || ids->ne[2] != 1 || ids->ne[3] != 1) {
        return fail(rt, -EINVAL, "layer %ld selects %lld experts per token, the route trace %d", il,
                    (long long) ids->ne[0], (int) rt->k);
    }
    const mf_batch * b = &rt->batch;
    if (mf_batch_node(&rt->batch, (int32_t) il, rt->n_layer, n_tokens) != 0) {
        return fail(rt, -EINVAL,
                    "layer %ld computes %lld rows where the route trace was told of a micro-batch of %lld tokens (%lld "
                    "outputs; %lld micro-batches announced): llama.cpp cut the batch otherwise",
                    il, (long long) n_tokens, (long long) b->size, (long long) b->n_out, (long long) b->n_ubatch);
    }
    for (int64_t i1 = 0; i1 < n_tokens; i1++) {
        const route_token * token = &rt->tokens[b->rows[i1]];
        int32_t *           row   = (int32_t *) ((char *) ids->data + i1 * ids->nb[1]);
        const int32_t *     table = rt->replay[token->phase];
        if (table) {
            const int64_t   step = token->step % rt->n_steps[token->phase];
            const int32_t * want = table + ((size_t) step * (size_t) rt->n_layer + (size_t) il) * (size_t) rt->k;
            if (want[0] >= 0) {
                memcpy(row, want, (size_t) rt->k * sizeof *row);
            }
        }
        for (int32_t slot = 0; rt->recording && slot < rt->k; slot++) {
            if (record(rt, b->rows[i1], (int32_t) il, slot, row[slot], mf_topk_score(ids, i1, row[slot])) != 0) {
                return fail(rt, -ENOMEM, "no memory to record the routing of layer %ld", il);
            }
        }
    }
    return true;
}

int mf_route_trace_set_predict_error(mf_route_trace * rt, float share, uint64_t seed) {
    if (!(share >= 0.0f && share < 1.0f)) {
        return -EINVAL;
    }
    rt->predict_error = share;
    rt->rng           = seed;
    return 0;
}

// splitmix64: a generator of the trace's own (no global state), good enough to pick experts
static uint64_t next_random(mf_route_trace * rt) {
    uint64_t z = (rt->rng += 0x9E3779B97F4A7C15ull);
    z          = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z          = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static bool in_row(const int32_t * ids, int32_t k, int32_t e) {
    for (int32_t i = 0; i < k; i++) {
        if (ids[i] == e) {
            return true;
        }
    }
    return false;
}

// the guess for one routed slot: the trace's expert, or with probability predict_error another
// expert the token does not route there (k < n_expert; with k == n_expert every guess is right)
static int32_t guess(mf_route_trace * rt, const int32_t * ids, int32_t slot) {
    if (rt->predict_error <= 0.0f || rt->k >= rt->n_expert ||
        (double) (next_random(rt) >> 11) * 0x1.0p-53 >= (double) rt->predict_error) {
        return ids[slot];
    }
    // uniform over the n_expert - k experts the token does not route at this layer
    int32_t pick = (int32_t) (next_random(rt) % (uint64_t) (rt->n_expert - rt->k));
    for (int32_t e = 0; e < rt->n_expert; e++) {
        if (!in_row(ids, rt->k, e) && pick-- == 0) {
            return e;
        }
    }
    return ids[slot];  // unreachable: the row holds k distinct experts
}

int32_t mf_route_trace_predict(void * user_data, int32_t il, uint8_t * want) {
    mf_route_trace * rt = user_data;
    const mf_batch * b  = &rt->batch;
    if (il < 0 || il >= rt->n_layer) {
        return 0;
    }
    int32_t n = 0;
    for (int64_t i = 0; i < b->n_rows; i++) {
        const route_token * token = &rt->tokens[b->rows[i]];
        const int32_t *     table = rt->replay[token->phase];
        if (!table) {
            continue;
        }
        const int64_t   step = token->step % rt->n_steps[token->phase];
        const int32_t * ids  = table + ((size_t) step * (size_t) rt->n_layer + (size_t) il) * (size_t) rt->k;
        for (int32_t slot = 0; ids[0] >= 0 && slot < rt->k; slot++) {
            const int32_t e = guess(rt, ids, slot);
            n += !want[e];
            want[e] = 1;
        }
    }
    return n;
}

void mf_route_trace_keep_layers(mf_route_trace * rt, int32_t n) {
    rt->local_layers = n > 0 ? n : 0;
}

bool mf_route_trace_eval_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    mf_route_trace * rt   = user_data;
    const bool       topk = strncmp(t->name, MF_TOPK_PREFIX, MF_TOPK_PREFIX_LEN) == 0 &&
                      (rt->local_layers == 0 || strtol(t->name + MF_TOPK_PREFIX_LEN, NULL, 10) < rt->local_layers);
    if (ask) {
        // the chained callback is asked about every node (it checks expert matmuls at ask time)
        const bool next_wants = rt->next && rt->next(t, true, rt->next_user_data);
        return topk || next_wants;
    }
    if (rt->err_code != 0) {
        return false;
    }
    if (topk && !route_node(rt, t)) {
        return false;
    }
    return rt->next ? rt->next(t, false, rt->next_user_data) : true;
}
