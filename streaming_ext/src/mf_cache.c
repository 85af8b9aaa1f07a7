// The expert cache policy: which (layer, expert) entries stay resident under a byte budget.
//
// DESIGN
// Pure bookkeeping, no I/O: mf_cache_route() takes one layer's routed set, counts hits, admits
// the misses and picks victims; the streamer then performs the reads and page releases the
// lists describe. The same code answers the trace replay (mf_cache_* API), so a policy measured
// on real routing traces is the policy that runs.
//
// Policies
// - LRU: evict the least recently routed entry. Routing walks the layers in a cycle, so under a
//   budget smaller than one token's working set LRU always evicts the entry needed next (0% hits).
// - LAYER (default): evict the entry whose next use is expected furthest away. An entry of layer
//   l is next needed when the cycle reaches l again (distance d in layer steps) if the router picks
//   it then, else a whole cycle later, and so on: with p the entry's probability of being routed
//   when its layer runs, the expected distance is d + n_layer * (1 - p) / p. p is a decayed,
//   smoothed frequency (prior k / n_expert), so it adapts to what the model has routed lately
//   and knows nothing of the future. It approximates Belady's optimum for this cyclic access
//   pattern and keeps hitting below one token's working set.
// - NONE: keep only the running layer's experts.
// The running layer's routed entries are pinned until the next call.
#include "mf_internal.h"

#include <errno.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

// per-route decay of the frequency estimate: a half-life of 32 routes of the layer
#define MF_FREQ_DECAY 0.97857206f
// weight of the prior k/n_expert, in routes
#define MF_FREQ_PRIOR 4.0f

int mf_cache_new(int32_t n_layer, int32_t n_expert, const uint64_t * entry_bytes, uint64_t budget_bytes,
                 int32_t policy, mf_cache ** out) {
    *out = NULL;
    if (n_layer <= 0 || n_expert <= 0 || !entry_bytes || policy < MF_POLICY_LRU || policy > MF_POLICY_NONE) {
        return -EINVAL;
    }
    mf_cache * c = calloc(1, sizeof *c);
    if (!c) {
        return -ENOMEM;
    }
    const size_t n = (size_t) n_layer * (size_t) n_expert;
    c->n_layer      = n_layer;
    c->n_expert     = n_expert;
    c->budget       = budget_bytes;
    c->policy       = policy;
    c->pinned_layer = -1;
    c->entry_bytes  = calloc((size_t) n_layer, sizeof *c->entry_bytes);
    c->resident     = calloc(n, sizeof *c->resident);
    c->last_use     = calloc(n, sizeof *c->last_use);
    c->freq         = calloc(n, sizeof *c->freq);
    c->weight       = calloc((size_t) n_layer, sizeof *c->weight);
    c->pinned       = calloc((size_t) n_expert, sizeof *c->pinned);
    c->load         = calloc((size_t) n_expert, sizeof *c->load);
    c->evict        = calloc(n, sizeof *c->evict);
    if (!c->entry_bytes || !c->resident || !c->last_use || !c->freq || !c->weight || !c->pinned || !c->load ||
        !c->evict) {
        mf_cache_free(c);
        return -ENOMEM;
    }
    memcpy(c->entry_bytes, entry_bytes, (size_t) n_layer * sizeof *entry_bytes);
    *out = c;
    return 0;
}

void mf_cache_free(mf_cache * c) {
    if (!c) {
        return;
    }
    free(c->entry_bytes);
    free(c->resident);
    free(c->last_use);
    free(c->freq);
    free(c->weight);
    free(c->pinned);
    free(c->load);
    free(c->evict);
    free(c);
}

// expected layer steps until entry (l, e) is routed again, seen from layer `cur` (LAYER policy)
static float next_use(const mf_cache * c, int32_t l, int32_t e, int32_t cur) {
    const float prior = (float) c->k_seen / (float) c->n_expert;
    const float p     = (c->freq[(size_t) l * (size_t) c->n_expert + (size_t) e] + MF_FREQ_PRIOR * prior) /
                    (c->weight[l] + MF_FREQ_PRIOR);
    int32_t d = (l - cur + c->n_layer) % c->n_layer;
    if (d == 0) {
        d = c->n_layer;
    }
    if (p <= 0.0f) {
        return FLT_MAX;
    }
    return (float) d + (float) c->n_layer * (1.0f - p) / p;
}

// the unpinned resident entry to evict next, or -1 when there is none
static int64_t pick_victim(const mf_cache * c, int32_t cur) {
    int64_t  best       = -1;
    uint64_t best_clock = UINT64_MAX;
    float    best_dist  = -1.0f;
    for (int32_t l = 0; l < c->n_layer; l++) {
        for (int32_t e = 0; e < c->n_expert; e++) {
            const size_t i = (size_t) l * (size_t) c->n_expert + (size_t) e;
            if (!c->resident[i] || (l == c->pinned_layer && c->pinned[e])) {
                continue;
            }
            if (c->policy == MF_POLICY_LAYER) {
                const float dist = next_use(c, l, e, cur);
                if (dist > best_dist) {
                    best_dist = dist;
                    best      = (int64_t) i;
                }
            } else if (c->last_use[i] < best_clock) {
                best_clock = c->last_use[i];
                best       = (int64_t) i;
            }
        }
    }
    return best;
}

static void evict_entry(mf_cache * c, size_t i) {
    const int32_t l = (int32_t) (i / (size_t) c->n_expert);
    c->resident[i]  = 0;
    c->used -= c->entry_bytes[l];
    c->evict[c->n_evict++] = (int32_t) i;
    c->evictions++;
}

int mf_cache_route(mf_cache * c, int32_t layer, const uint8_t * want) {
    if (layer < 0 || layer >= c->n_layer) {
        return -EINVAL;
    }
    const size_t   row   = (size_t) layer * (size_t) c->n_expert;
    const uint64_t bytes = c->entry_bytes[layer];
    c->n_load            = 0;
    c->n_evict           = 0;
    c->clock++;

    int32_t k = 0;
    for (int32_t e = 0; e < c->n_expert; e++) {
        k += want[e] != 0;
    }
    if ((uint64_t) k * bytes > c->budget) {
        return -ENOSPC;
    }
    // a decode step routes k experts; remember the largest k seen as the prior's numerator
    if (k > c->k_seen) {
        c->k_seen = k;
    }

    // pin this layer's routed set (the previous layer's pins are released)
    c->pinned_layer = layer;
    for (int32_t e = 0; e < c->n_expert; e++) {
        c->pinned[e] = want[e] != 0;
    }

    // update the frequency estimate of this layer
    c->weight[layer] = c->weight[layer] * MF_FREQ_DECAY + 1.0f;
    for (int32_t e = 0; e < c->n_expert; e++) {
        c->freq[row + (size_t) e] = c->freq[row + (size_t) e] * MF_FREQ_DECAY + (want[e] ? 1.0f : 0.0f);
    }

    if (c->policy == MF_POLICY_NONE) {
        for (size_t i = 0; i < (size_t) c->n_layer * (size_t) c->n_expert; i++) {
            const int32_t l = (int32_t) (i / (size_t) c->n_expert);
            const int32_t e = (int32_t) (i % (size_t) c->n_expert);
            if (c->resident[i] && !(l == layer && want[e])) {
                evict_entry(c, i);
            }
        }
    }

    for (int32_t e = 0; e < c->n_expert; e++) {
        if (!want[e]) {
            continue;
        }
        const size_t i = row + (size_t) e;
        c->last_use[i] = c->clock;
        if (c->resident[i]) {
            c->hits++;
            continue;
        }
        while (c->used + bytes > c->budget) {
            const int64_t v = pick_victim(c, layer);
            if (v < 0) {
                return -ENOSPC;  // cannot happen: the routed set fits the budget (checked above)
            }
            evict_entry(c, (size_t) v);
        }
        c->resident[i] = 1;
        c->used += bytes;
        c->load[c->n_load++] = e;
        c->misses++;
    }
    return c->n_load;
}

void mf_cache_counts(const mf_cache * c, uint64_t * hits, uint64_t * misses, uint64_t * evictions) {
    *hits      = c->hits;
    *misses    = c->misses;
    *evictions = c->evictions;
}

void mf_cache_forget(mf_cache * c, int32_t layer, int32_t expert) {
    const size_t i = (size_t) layer * (size_t) c->n_expert + (size_t) expert;
    if (c->resident[i]) {
        c->resident[i] = 0;
        c->used -= c->entry_bytes[layer];
    }
}

int32_t mf_cache_evict_all(mf_cache * c) {
    c->n_load  = 0;
    c->n_evict = 0;
    for (size_t i = 0; i < (size_t) c->n_layer * (size_t) c->n_expert; i++) {
        if (c->resident[i]) {
            evict_entry(c, i);
        }
    }
    c->pinned_layer = -1;
    return c->n_evict;
}
