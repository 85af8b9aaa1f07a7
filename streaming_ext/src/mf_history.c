// Predicting the next layer's experts from past routing alone: which experts of layer l + 1
// followed which of layer l in the same token, counted over every token routed so far.
//
// The router predictor (mf_predict.c) needs the model's hidden state and scores the model's own
// routing; this one needs nothing but the ids, so it also predicts a routing the model did not
// choose (a replayed trace), and costs k x n_expert additions per token instead of a router
// matmul. For each token row of layer l it scores b by the sum over the row's experts a of
// P(b at l + 1 | a at l) and takes the k best scored above zero; unseen experts predict nothing.
// Counts are kept per (layer, a, b) as floats: n_layer x n_expert^2 x 4 bytes (3 MiB for 48
// layers of 128 experts). Decode thread only. See docs/streamer.md, "Prefetch".
#include "mf_internal.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int mf_history_init(mf_streamer * s) {
    free(s->hist_pairs);
    free(s->hist_seen);
    free(s->hist_prev);
    const size_t n = (size_t) s->n_expert;
    s->hist_pairs  = calloc((size_t) s->n_layers * n * n, sizeof *s->hist_pairs);
    s->hist_seen   = calloc((size_t) s->n_layers * n, sizeof *s->hist_seen);
    s->hist_prev   = NULL;
    s->hist_cap    = 0;
    s->hist_rows   = 0;
    s->hist_layer  = -1;
    return s->hist_pairs && s->hist_seen ? 0 : -ENOMEM;
}

void mf_history_free(mf_streamer * s) {
    free(s->hist_pairs);
    free(s->hist_seen);
    free(s->hist_prev);
    s->hist_pairs = NULL;
    s->hist_seen  = NULL;
    s->hist_prev  = NULL;
}

static int32_t id_at(const struct ggml_tensor * ids, int64_t row, int64_t slot) {
    return *(const int32_t *) ((const char *) ids->data + row * ids->nb[1] + slot * ids->nb[0]);
}

int mf_history_learn(mf_streamer * s, int32_t il, const struct ggml_tensor * ids) {
    const int64_t k = ids->ne[0], rows = ids->ne[1];
    const size_t  n = (size_t) s->n_expert;
    if (s->hist_layer == il - 1 && s->hist_rows > 0 && s->hist_k == k) {
        // a layer computing fewer rows than the one before (a prompt's last) holds its last tokens
        const int64_t m = rows < s->hist_rows ? rows : s->hist_rows;
        float *       pairs = s->hist_pairs + (size_t) (il - 1) * n * n;
        float *       seen  = s->hist_seen + (size_t) (il - 1) * n;
        for (int64_t r = 0; r < m; r++) {
            const int32_t * before = s->hist_prev + (s->hist_rows - m + r) * k;
            for (int64_t i = 0; i < k; i++) {
                seen[before[i]] += 1.0f;
                float * row = pairs + (size_t) before[i] * n;
                for (int64_t j = 0; j < k; j++) {
                    row[id_at(ids, rows - m + r, j)] += 1.0f;
                }
            }
        }
    }
    if (rows * k > s->hist_cap) {
        int32_t * p = realloc(s->hist_prev, (size_t) (rows * k) * sizeof *p);
        if (!p) {
            return -ENOMEM;
        }
        s->hist_prev = p;
        s->hist_cap  = rows * k;
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < k; i++) {
            s->hist_prev[r * k + i] = id_at(ids, r, i);
        }
    }
    s->hist_rows  = rows;
    s->hist_k     = k;
    s->hist_layer = il;
    return 0;
}

int32_t mf_history_predict(mf_streamer * s, int32_t il, const struct ggml_tensor * ids, uint8_t * want) {
    const int64_t k = ids->ne[0], rows = ids->ne[1];
    const size_t  n = (size_t) s->n_expert;
    if (il + 1 >= s->n_layers || !s->hist_pairs) {
        return 0;
    }
    const float * pairs  = s->hist_pairs + (size_t) il * n * n;
    const float * seen   = s->hist_seen + (size_t) il * n;
    float *       scores = s->pred_scores;
    memset(want, 0, n);
    int32_t total = 0;
    int64_t r     = 0;
    for (; r < rows && total < s->n_expert; r++) {
        memset(scores, 0, n * sizeof *scores);
        for (int64_t i = 0; i < k; i++) {
            const int32_t a = id_at(ids, r, i);
            if (seen[a] <= 0.0f) {
                continue;
            }
            const float   inv = 1.0f / seen[a];
            const float * row = pairs + (size_t) a * n;
            for (size_t b = 0; b < n; b++) {
                scores[b] += row[b] * inv;
            }
        }
        for (int64_t m = 0; m < k; m++) {
            int32_t best = -1;
            for (int32_t b = 0; b < s->n_expert; b++) {
                if (scores[b] > 0.0f && (best < 0 || scores[b] > scores[best])) {
                    best = b;
                }
            }
            s->pf_rows[r * k + m] = best;
            if (best < 0) {
                continue;
            }
            total += !want[best];
            want[best]   = 1;
            scores[best] = 0.0f;
        }
    }
    s->pf_rows_n = r;
    s->pf_k      = k;
    return total;
}
