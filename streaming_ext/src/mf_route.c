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

// one token of the decode call being computed (mf_route_trace_begin_batch)
typedef struct route_token {
    int32_t turn, seq, phase, step;
    bool    output;
} route_token;

struct mf_route_trace {
    int32_t n_layer, n_expert, k;
    int32_t local_layers;  // layers routed here; 0: all (mf_route_trace_keep_layers)
    int32_t * replay[2];   // per phase: [n_steps][n_layer][k] expert ids (-1: the model's own), or NULL
    int64_t   n_steps[2];
    route_token * tokens;  // the decode call's tokens in computed order (mf_route_trace_begin_batch)
    int64_t *        ends;    // the end of each micro-batch in tokens
    int64_t          n_tokens, n_ubatch, cap_tokens, cap_ubatch;
    int64_t          ubatch;      // the micro-batch being computed (-1: none yet)
    int32_t          last_layer;  // the layer of the last topk node seen
    bool             outputs;     // the last topk node held the micro-batch's output tokens only
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
    rt->ubatch = -1;
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
    free(rt->ends);
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

// makes *buf hold at least n items of item_size bytes (*cap items now); 0 or -ENOMEM (*buf kept)
static int reserve(void ** buf, int64_t * cap, int64_t n, size_t item_size) {
    if (n <= *cap) {
        return 0;
    }
    const int64_t want  = n > 2 * *cap ? n : 2 * *cap;
    void *        grown = realloc(*buf, (size_t) want * item_size);
    if (!grown) {
        return -ENOMEM;
    }
    *buf = grown;
    *cap = want;
    return 0;
}

int mf_route_trace_begin_batch(mf_route_trace * rt, int64_t n_tokens, const int32_t * turn, const int32_t * seq,
                               const int32_t * phase, const int32_t * step, const uint8_t * output, int64_t n_ubatch,
                               const int64_t * ends) {
    rt->n_tokens = rt->n_ubatch = 0;
    rt->ubatch = -1;
    if (n_tokens < 0 || n_ubatch < 0 || (n_tokens > 0 && (!turn || !seq || !phase || !step || !output || !ends))) {
        return -EINVAL;
    }
    for (int64_t u = 0; u < n_ubatch; u++) {
        if (ends[u] <= (u ? ends[u - 1] : 0) || ends[u] > n_tokens || (u == n_ubatch - 1 && ends[u] != n_tokens)) {
            return -EINVAL;
        }
    }
    for (int64_t i = 0; i < n_tokens; i++) {
        if (phase[i] < 0 || phase[i] > 1 || step[i] < 0) {
            return -EINVAL;
        }
    }
    if (reserve((void **) &rt->tokens, &rt->cap_tokens, n_tokens, sizeof *rt->tokens) != 0 ||
        reserve((void **) &rt->ends, &rt->cap_ubatch, n_ubatch, sizeof *rt->ends) != 0) {
        return -ENOMEM;
    }
    for (int64_t i = 0; i < n_tokens; i++) {
        rt->tokens[i] = (route_token) {
            .turn = turn[i], .seq = seq[i], .phase = phase[i], .step = step[i], .output = output[i] != 0,
        };
    }
    if (n_ubatch > 0) {
        memcpy(rt->ends, ends, (size_t) n_ubatch * sizeof *ends);
    }
    rt->n_tokens = n_tokens;
    rt->n_ubatch = n_ubatch;
    return 0;
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

static int record(mf_route_trace * rt, const route_token * token, int32_t layer, int32_t slot, int32_t expert,
                  float weight) {
    if (reserve((void **) &rt->rec, &rt->cap_rec, rt->n_rec + 1 < 4096 ? 4096 : rt->n_rec + 1, sizeof *rt->rec) != 0) {
        return -ENOMEM;
    }
    rt->rec[rt->n_rec++] = (mf_route_record) {
        .turn = token->turn, .seq = token->seq, .phase = token->phase, .step = token->step,
        .layer = layer, .slot = slot, .expert = expert, .weight = weight,
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
    if (rt->ubatch < 0 || il <= rt->last_layer) {
        rt->ubatch++;  // the first layer of the next micro-batch
    }
    rt->last_layer = (int32_t) il;
    if (rt->ubatch >= rt->n_ubatch) {
        return fail(rt, -EINVAL, "layer %ld routes a micro-batch the route trace was not told of (%lld announced)",
                    il, (long long) rt->n_ubatch);
    }
    const int64_t first = rt->ubatch ? rt->ends[rt->ubatch - 1] : 0;
    const int64_t size  = rt->ends[rt->ubatch] - first;
    int64_t       n_out = 0;
    for (int64_t i = first; i < first + size; i++) {
        n_out += rt->tokens[i].output != 0;
    }
    if (n_tokens != size && (il != rt->n_layer - 1 || n_tokens != n_out)) {
        return fail(rt, -EINVAL,
                    "layer %ld computes %lld rows of a micro-batch of %lld tokens (%lld outputs): llama.cpp "
                    "cut the batch otherwise than the route trace was told",
                    il, (long long) n_tokens, (long long) size, (long long) n_out);
    }
    rt->outputs = n_tokens != size;
    int64_t i1 = 0;
    for (int64_t i = first; i < first + size; i++) {
        const route_token * token = &rt->tokens[i];
        if (rt->outputs && !token->output) {
            continue;
        }
        int32_t *       row   = (int32_t *) ((char *) ids->data + i1 * ids->nb[1]);
        const int32_t * table = rt->replay[token->phase];
        if (table) {
            const int64_t   step = token->step % rt->n_steps[token->phase];
            const int32_t * want = table + ((size_t) step * (size_t) rt->n_layer + (size_t) il) * (size_t) rt->k;
            if (want[0] >= 0) {
                memcpy(row, want, (size_t) rt->k * sizeof *row);
            }
        }
        for (int32_t slot = 0; rt->recording && slot < rt->k; slot++) {
            if (record(rt, token, (int32_t) il, slot, row[slot], mf_topk_score(ids, i1, row[slot])) != 0) {
                return fail(rt, -ENOMEM, "no memory to record the routing of layer %ld", il);
            }
        }
        i1++;
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
    if (il < 0 || il >= rt->n_layer || rt->ubatch < 0 || rt->ubatch >= rt->n_ubatch) {
        return 0;
    }
    const int64_t first = rt->ubatch ? rt->ends[rt->ubatch - 1] : 0;
    int32_t       n     = 0;
    for (int64_t i = first; i < rt->ends[rt->ubatch]; i++) {
        const route_token * token = &rt->tokens[i];
        const int32_t *        table = rt->replay[token->phase];
        if (!table || (rt->outputs && !token->output)) {
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
