// Dropping uncached low-weight experts: LOSSY, for measurement only (mf_config.skip_below).
//
// Before layer il's route, a token's routed expert is dropped when it is neither resident nor
// being read and its weight renormalised over the token's k experts is below skip_below; the
// token's first expert (the highest weight, never dropped) takes the slot, so nothing is read
// for it, and on the layer's ffn_moe_weights-<il> node (the gathered router probabilities,
// before llama.cpp normalises them) the slot's weight becomes 0. The layer then normalises over
// the kept experts: the token is computed as if routed to them alone. Gating that applies a
// softmax to the gathered weights (ffn_moe_weights_softmax) would turn the 0 back into a share,
// so such a graph is refused. The output differs from the resident model's by design: it is
// gated by the perplexity it costs (server/training/measure.py), not by byte identity.
#include "mf_internal.h"

#include <errno.h>
#include <string.h>

float mf_topk_score(const struct ggml_tensor * topk, int64_t i1, int32_t e) {
    const struct ggml_tensor * argsort = topk->view_src ? topk->view_src : topk->src[0];
    const struct ggml_tensor * scores  = argsort ? argsort->src[0] : NULL;
    if (!scores || scores->type != GGML_TYPE_F32 || !scores->data || e < 0 || e >= scores->ne[0] ||
        i1 >= scores->ne[1]) {
        return 0.0f;
    }
    return *(const float *) ((const char *) scores->data + i1 * scores->nb[1] + e * scores->nb[0]);
}

int64_t mf_skip_route(mf_streamer * s, int32_t il, struct ggml_tensor * ids) {
    const int64_t k = ids->ne[0], rows = ids->ne[1];
    s->skip_layer   = -1;
    memset(s->skip_mask, 0, (size_t) (k * rows));
    int64_t dropped = 0;
    for (int64_t i1 = 0; i1 < rows; i1++) {
        int32_t * row = (int32_t *) ((char *) ids->data + i1 * ids->nb[1]);
        float     sum = 0.0f, top = -1.0f;
        int64_t   first = 0;
        for (int64_t j = 0; j < k; j++) {
            const float p = mf_topk_score(ids, i1, row[j * ids->nb[0] / (int64_t) sizeof *row]);
            sum += p;
            if (p > top) {
                top   = p;
                first = j;
            }
        }
        if (!(sum > 0.0f)) {
            mf_streamer_fail(s, -ENOTSUP, "skip_below: layer %d's routing node holds no router probabilities",
                             (int) il);
            return -ENOTSUP;
        }
        const int32_t keep = row[first * ids->nb[0] / (int64_t) sizeof *row];
        for (int64_t j = 0; j < k; j++) {
            int32_t *     slot = &row[j * ids->nb[0] / (int64_t) sizeof *row];
            const int32_t e    = *slot;
            if (j == first || e < 0 || e >= s->n_expert || mf_cache_is_resident(s->cache, il, e) ||
                mf_topk_score(ids, i1, e) / sum >= s->cfg.skip_below) {
                continue;
            }
            *slot                      = keep;
            s->skip_mask[i1 * k + j] = 1;
            dropped++;
        }
    }
    if (dropped > 0) {
        s->skip_layer = il;
        s->skip_rows  = rows;
        s->skip_k     = k;
    }
    return dropped;
}

void mf_skip_weights(mf_streamer * s, int32_t il, struct ggml_tensor * weights) {
    if (il != s->skip_layer || weights->type != GGML_TYPE_F32) {
        return;
    }
    // [1, k, rows]: slot j of row i1 at j * nb[1] + i1 * nb[2]
    for (int64_t i1 = 0; i1 < s->skip_rows && i1 < weights->ne[2]; i1++) {
        for (int64_t j = 0; j < s->skip_k && j < weights->ne[1]; j++) {
            if (s->skip_mask[i1 * s->skip_k + j]) {
                *(float *) ((char *) weights->data + j * weights->nb[1] + i1 * weights->nb[2]) = 0.0f;
            }
        }
    }
    s->skip_layer = -1;
}
