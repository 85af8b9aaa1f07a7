// Which token of a llama_decode call each row of a ffn_moe_topk node is (mf_internal.h,
// mf_batch). llama.cpp computes a call in micro-batches (with a KV stream per sequence, cut by
// split_equal); the caller names the call's tokens in computed order and the micro-batches' ends
// (streaming_ext/batch.py, micro_batches), and each topk node then says its layer and rows.
#include "mf_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int mf_grow(void ** buf, int64_t * cap, int64_t n, size_t item_size) {
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

int mf_batch_set(mf_batch * b, int64_t n_tokens, const int32_t * seq, const uint8_t * output, int64_t n_ubatch,
                 const int64_t * ends) {
    b->n_tokens = b->n_ubatch = 0;
    b->ubatch = -1;
    if (n_tokens < 0 || n_ubatch < 0 || (n_tokens > 0 && (!seq || !output || !ends)) || (n_tokens == 0) != (n_ubatch == 0)) {
        return -EINVAL;
    }
    for (int64_t u = 0; u < n_ubatch; u++) {
        if (ends[u] <= (u ? ends[u - 1] : 0) || ends[u] > n_tokens || (u == n_ubatch - 1 && ends[u] != n_tokens)) {
            return -EINVAL;
        }
    }
    for (int64_t i = 0; i < n_tokens; i++) {
        if (seq[i] < 0) {
            return -EINVAL;
        }
    }
    if (mf_grow((void **) &b->seq, &b->cap_seq, n_tokens, sizeof *b->seq) != 0 ||
        mf_grow((void **) &b->output, &b->cap_output, n_tokens, sizeof *b->output) != 0 ||
        mf_grow((void **) &b->ends, &b->cap_ends, n_ubatch, sizeof *b->ends) != 0 ||
        mf_grow((void **) &b->rows, &b->cap_rows, n_tokens, sizeof *b->rows) != 0) {
        return -ENOMEM;
    }
    if (n_tokens > 0) {
        memcpy(b->seq, seq, (size_t) n_tokens * sizeof *seq);
        memcpy(b->output, output, (size_t) n_tokens * sizeof *output);
        memcpy(b->ends, ends, (size_t) n_ubatch * sizeof *ends);
    }
    b->n_tokens = n_tokens;
    b->n_ubatch = n_ubatch;
    return 0;
}

int mf_batch_node(mf_batch * b, int32_t il, int32_t n_layer, int64_t n_rows) {
    b->n_rows = 0;
    if (b->ubatch < 0 || il <= b->last_layer) {
        b->ubatch++;  // the first layer of the next micro-batch
    }
    b->last_layer = il;
    if (b->ubatch >= b->n_ubatch) {
        b->first = b->size = b->n_out = 0;
        return -EINVAL;
    }
    b->first = b->ubatch ? b->ends[b->ubatch - 1] : 0;
    b->size  = b->ends[b->ubatch] - b->first;
    b->n_out = 0;
    for (int64_t i = b->first; i < b->first + b->size; i++) {
        b->n_out += b->output[i] != 0;
    }
    const bool outputs = n_rows != b->size;
    if (outputs && (il != n_layer - 1 || n_rows != b->n_out)) {
        return -EINVAL;
    }
    for (int64_t i = b->first; i < b->first + b->size; i++) {
        if (!outputs || b->output[i]) {
            b->rows[b->n_rows++] = i;
        }
    }
    return 0;
}

void mf_batch_free(mf_batch * b) {
    free(b->seq);
    free(b->output);
    free(b->ends);
    free(b->rows);
    memset(b, 0, sizeof *b);
}
