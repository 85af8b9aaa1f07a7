// The expert cache policy: which (layer, expert) entries stay resident under a byte budget.
//
// Pure bookkeeping, no I/O: mf_cache_route takes one layer's routed set, counts hits, admits the
// misses and picks victims; the streamer then carries out the loads and evictions the lists
// describe. The trace replay calls the same code (mf_cache_* API), so a policy measured on real
// routing traces is the policy that runs.
// - LRU: the least recently routed entry goes first. Routing cycles through the layers, so under
//   a budget smaller than one token's working set LRU always evicts the entry needed next.
// - LAYER (default): the entry that buys the fewest expected hits per byte and per layer step it
//   occupies goes first; its value comes from the reuse model (mf_reuse.c), which each token's
//   routing teaches.
// - NONE: only the running layer's experts are kept.
// The running layer's routed entries are pinned until the next route. mf_cache_prefetch admits
// predicted entries of the next layer: it evicts like a route, but never a pinned entry, and it
// teaches the model nothing (only real routing is evidence). Warm start admits into the free room
// only (mf_cache_admit_free) and ranks the resident set (mf_cache_hot_set). One thread at a time.
// The model, its derivation and what was measured: docs/streamer.md, "Cache policy".
#include "mf_internal.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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
    const size_t n   = (size_t) n_layer * (size_t) n_expert;
    const size_t tab = (size_t) MF_CELLS;
    c->n_layer       = n_layer;
    c->n_expert      = n_expert;
    c->budget        = budget_bytes;
    c->policy        = policy;
    c->pinned_layer  = -1;
    c->model_age     = -1;
    c->recent_decay  = exp2f(-1.0f / MF_RECENT_HALF_LIFE);
    c->entry_bytes   = calloc((size_t) n_layer, sizeof *c->entry_bytes);
    c->resident      = calloc(n, sizeof *c->resident);
    c->last_use      = calloc(n, sizeof *c->last_use);
    c->pinned        = calloc((size_t) n_expert, sizeof *c->pinned);
    c->visits        = calloc((size_t) n_layer, sizeof *c->visits);
    c->last_visit    = calloc(n, sizeof *c->last_visit);
    c->uses          = calloc(n, sizeof *c->uses);
    c->obs           = calloc(tab, sizeof *c->obs);
    c->obs_hit       = calloc(tab, sizeof *c->obs_hit);
    c->h3            = calloc(tab, sizeof *c->h3);
    c->recent        = calloc(n, sizeof *c->recent);
    c->rates         = calloc((size_t) n_layer, sizeof *c->rates);
    c->res_list      = calloc(n, sizeof *c->res_list);
    c->res_pos       = calloc(n, sizeof *c->res_pos);
    c->score         = calloc(n, sizeof *c->score);
    c->load          = calloc((size_t) n_expert, sizeof *c->load);
    c->evict         = calloc(n, sizeof *c->evict);
    c->tok           = calloc((size_t) n_expert, sizeof *c->tok);
    if (!c->entry_bytes || !c->resident || !c->last_use || !c->pinned || !c->visits || !c->last_visit || !c->uses ||
        !c->obs || !c->obs_hit || !c->h3 || !c->recent || !c->rates || !c->res_list || !c->res_pos ||
        !c->score || !c->load || !c->evict || !c->tok) {
        mf_cache_free(c);
        return -ENOMEM;
    }
    // the affinity model is the LAYER policy's alone (n_layer * n_expert^2 counts)
    if (policy == MF_POLICY_LAYER && mf_affinity_init(&c->affinity, n_layer, n_expert) != 0) {
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
    free(c->pinned);
    free(c->visits);
    free(c->last_visit);
    free(c->uses);
    free(c->obs);
    free(c->obs_hit);
    free(c->h3);
    free(c->recent);
    free(c->rates);
    free(c->res_list);
    free(c->res_pos);
    free(c->score);
    free(c->load);
    free(c->evict);
    free(c->tok);
    mf_affinity_free(&c->affinity);
    free(c);
}

// ---------------------------------------------------------------- resident set

static void res_add(mf_cache * c, size_t i) {
    c->resident[i]          = 1;
    c->res_pos[i]           = c->n_res;
    c->res_list[c->n_res]   = (int32_t) i;
    // admitted entries belong to the running layer's routed set: pinned, never a victim this route
    c->score[c->n_res]      = FLT_MAX;
    c->n_res++;
}

static void res_remove(mf_cache * c, size_t i) {
    const int32_t pos  = c->res_pos[i];
    const int32_t last = --c->n_res;
    // swap the last one into the hole (its score moves along, so a running victim scan stays valid)
    c->res_list[pos]                          = c->res_list[last];
    c->score[pos]                             = c->score[last];
    c->res_pos[(size_t) c->res_list[pos]]     = pos;
    c->resident[i]                            = 0;
}

// the unpinned resident entry to evict next, or -1 when there is none
static int64_t pick_victim(const mf_cache * c) {
    if (c->policy == MF_POLICY_LAYER) {
        int32_t  best_pos   = -1;
        float    best_score = FLT_MAX;
        uint64_t best_clock = UINT64_MAX;
        for (int32_t p = 0; p < c->n_res; p++) {
            // equal values (same state, distance and size): the least recently used goes first
            const uint64_t clock = c->last_use[c->res_list[p]];
            if (c->score[p] < best_score || (c->score[p] == best_score && best_score < FLT_MAX && clock < best_clock)) {
                best_score = c->score[p];
                best_clock = clock;
                best_pos   = p;
            }
        }
        return best_pos < 0 ? -1 : (int64_t) c->res_list[best_pos];
    }
    int64_t  best       = -1;
    uint64_t best_clock = UINT64_MAX;
    for (int32_t l = 0; l < c->n_layer; l++) {
        for (int32_t e = 0; e < c->n_expert; e++) {
            const size_t i = (size_t) l * (size_t) c->n_expert + (size_t) e;
            if (!c->resident[i] || (l == c->pinned_layer && c->pinned[e])) {
                continue;
            }
            if (c->last_use[i] < best_clock) {
                best_clock = c->last_use[i];
                best       = (int64_t) i;
            }
        }
    }
    return best;
}

static void evict_entry(mf_cache * c, size_t i) {
    const int32_t l = (int32_t) (i / (size_t) c->n_expert);
    res_remove(c, i);
    c->used -= c->entry_bytes[l];
    c->evict[c->n_evict++] = (int32_t) i;
    c->evictions++;
}

int mf_cache_route(mf_cache * c, int32_t layer, const uint8_t * want, const int32_t * tokens, int32_t n_tokens,
                   int32_t k_tok) {
    if (layer < 0 || layer >= c->n_layer || n_tokens < 0 || (tokens && k_tok <= 0) || (!tokens && n_tokens > 1)) {
        return -EINVAL;
    }
    if (tokens) {
        for (size_t j = 0; j < (size_t) n_tokens * (size_t) k_tok; j++) {
            if (tokens[j] < 0 || tokens[j] >= c->n_expert || !want[tokens[j]]) {
                return -EINVAL;  // every token's expert is one of the routed set's
            }
        }
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

    // pin this layer's routed set (the previous layer's pins are released)
    c->pinned_layer = layer;
    for (int32_t e = 0; e < c->n_expert; e++) {
        c->pinned[e] = want[e] != 0;
    }

    // the evidence is each token's own routing, one visit per token: a micro-batch's union is no
    // token's (it would teach the model that most experts are routed at every visit)
    if (c->policy == MF_POLICY_LAYER) {
        if (!tokens && n_tokens == 1) {
            mf_reuse_learn_token(c, layer, want);
        }
        for (int32_t t = 0; tokens && t < n_tokens; t++) {
            memset(c->tok, 0, (size_t) c->n_expert);
            for (int32_t j = 0; j < k_tok; j++) {
                c->tok[tokens[(size_t) t * (size_t) k_tok + (size_t) j]] = 1;
            }
            mf_reuse_learn_token(c, layer, c->tok);
        }
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

    bool scored = false;
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
            if (c->policy == MF_POLICY_LAYER && !scored) {
                // the scores only change between routes: one pass serves every victim of this one
                mf_reuse_score(c, layer);
                scored = true;
            }
            const int64_t v = pick_victim(c);
            if (v < 0) {
                return -ENOSPC;  // cannot happen: the routed set fits the budget (checked above)
            }
            evict_entry(c, (size_t) v);
        }
        res_add(c, i);
        c->used += bytes;
        c->load[c->n_load++] = e;
        c->misses++;
    }
    return c->n_load;
}

int32_t mf_cache_prefetch(mf_cache * c, int32_t layer, const uint8_t * want) {
    c->n_load  = 0;
    c->n_evict = 0;
    if (layer < 0 || layer >= c->n_layer || layer == c->pinned_layer) {
        return 0;
    }
    const size_t   row   = (size_t) layer * (size_t) c->n_expert;
    const uint64_t bytes = c->entry_bytes[layer];
    // scored only when something must go (with most experts cached, nothing does, and scoring
    // every resident entry per layer was most of a cached token's cache time)
    bool scored = false;
    for (int32_t e = 0; e < c->n_expert; e++) {
        const size_t i = row + (size_t) e;
        if (!want[e] || c->resident[i]) {
            continue;
        }
        while (c->used + bytes > c->budget) {
            if (c->policy == MF_POLICY_LAYER && !scored) {
                mf_reuse_score(c, c->pinned_layer >= 0 ? c->pinned_layer : layer);
                // this call's admissions stay out of reach, as if they had entered after scoring
                for (int32_t j = 0; j < c->n_load; j++) {
                    c->score[c->res_pos[row + (size_t) c->load[j]]] = FLT_MAX;
                }
                scored = true;
            }
            const int64_t v = pick_victim(c);
            // never the running layer's routed entries (pinned) nor this call's admissions
            // (score FLT_MAX in LAYER; the newest clock in LRU, so only chosen when nothing else is)
            if (v < 0 || (c->policy != MF_POLICY_LAYER && c->last_use[v] == c->clock + 1)) {
                return c->n_load;
            }
            evict_entry(c, (size_t) v);
        }
        res_add(c, i);
        // one tick newer than the running route: an LRU victim only when nothing else is left
        c->last_use[i] = c->clock + 1;
        c->used += bytes;
        c->load[c->n_load++] = e;
    }
    return c->n_load;
}

bool mf_cache_layer_resident(const mf_cache * c, int32_t layer) {
    if (layer < 0 || layer >= c->n_layer) {
        return false;
    }
    return memchr(c->resident + (size_t) layer * (size_t) c->n_expert, 0, (size_t) c->n_expert) == NULL;
}

bool mf_cache_is_resident(const mf_cache * c, int32_t layer, int32_t e) {
    return layer >= 0 && layer < c->n_layer && e >= 0 && e < c->n_expert &&
           c->resident[(size_t) layer * (size_t) c->n_expert + (size_t) e];
}

void mf_cache_counts(const mf_cache * c, uint64_t * hits, uint64_t * misses, uint64_t * evictions) {
    *hits      = c->hits;
    *misses    = c->misses;
    *evictions = c->evictions;
}

void mf_cache_forget(mf_cache * c, int32_t layer, int32_t expert) {
    const size_t i = (size_t) layer * (size_t) c->n_expert + (size_t) expert;
    if (c->resident[i]) {
        res_remove(c, i);
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

int32_t mf_cache_set_budget(mf_cache * c, uint64_t budget_bytes) {
    c->n_load  = 0;
    c->n_evict = 0;
    c->budget  = budget_bytes;
    // between routes nothing runs, so nothing is pinned; distances count from the layer routed
    // last, as the next route's would
    const int32_t cur = c->pinned_layer >= 0 ? c->pinned_layer : 0;
    c->pinned_layer   = -1;
    if (c->used > budget_bytes && c->policy == MF_POLICY_LAYER) {
        mf_reuse_score(c, cur);
    }
    while (c->used > budget_bytes) {
        const int64_t v = pick_victim(c);
        if (v < 0) {
            break;
        }
        evict_entry(c, (size_t) v);
    }
    return c->n_evict;
}

int32_t mf_cache_admit_free(mf_cache * c, int32_t layer, const uint8_t * want, const uint32_t * uses) {
    c->n_load  = 0;
    c->n_evict = 0;
    if (layer < 0 || layer >= c->n_layer) {
        return 0;
    }
    const size_t   row   = (size_t) layer * (size_t) c->n_expert;
    const uint64_t bytes = c->entry_bytes[layer];
    for (int32_t e = 0; e < c->n_expert; e++) {
        const size_t i = row + (size_t) e;
        if (!want[e] || c->resident[i]) {
            continue;
        }
        if (c->used + bytes > c->budget) {
            break;
        }
        res_add(c, i);
        c->used += bytes;
        c->load[c->n_load++] = e;
        // as recent as the last route, as frequent as it was: the policy keeps a restored entry
        // as it kept it before the restart (visit 0 means "never", so a layer not yet routed
        // counts as visited once)
        c->last_use[i] = c->clock;
        if (uses && uses[e] > 0) {
            if (c->visits[layer] == 0) {
                c->visits[layer] = 1;
            }
            c->uses[i]       = uses[e] > c->uses[i] ? uses[e] : c->uses[i];
            c->last_visit[i] = c->visits[layer];
        }
    }
    return c->n_load;
}

typedef struct hot_key {
    uint32_t uses;
    uint64_t last_use;
    int32_t  id;
} hot_key;

static int hotter_first(const void * pa, const void * pb) {
    const hot_key * a = pa;
    const hot_key * b = pb;
    if (a->uses != b->uses) {
        return a->uses > b->uses ? -1 : 1;
    }
    if (a->last_use != b->last_use) {
        return a->last_use > b->last_use ? -1 : 1;
    }
    return a->id < b->id ? -1 : a->id > b->id;
}

int32_t mf_cache_hot_set(const mf_cache * c, int32_t * out, uint32_t * uses, int32_t max) {
    if (c->n_res == 0) {
        return 0;
    }
    hot_key * keys = malloc((size_t) c->n_res * sizeof *keys);
    if (!keys) {
        return -ENOMEM;
    }
    for (int32_t p = 0; p < c->n_res; p++) {
        const int32_t i = c->res_list[p];
        keys[p]         = (hot_key){ .uses = c->uses[i], .last_use = c->last_use[i], .id = i };
    }
    qsort(keys, (size_t) c->n_res, sizeof *keys, hotter_first);
    for (int32_t p = 0; p < c->n_res && p < max; p++) {
        out[p] = keys[p].id;
        if (uses) {
            uses[p] = keys[p].uses;
        }
    }
    free(keys);
    return c->n_res;
}

int32_t mf_cache_rate_class(const mf_cache * c, int32_t layer, int32_t e) {
    if (layer < 0 || layer >= c->n_layer || e < 0 || e >= c->n_expert) {
        return -EINVAL;
    }
    return mf_reuse_rate_class(c, layer, e);
}

int32_t mf_cache_loads(const mf_cache * c, int32_t * out, int32_t max) {
    for (int32_t i = 0; i < c->n_load && i < max; i++) {
        out[i] = c->load[i];
    }
    return c->n_load;
}
