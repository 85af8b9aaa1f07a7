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
// - LAYER (default): evict the entry that buys the fewest expected hits per byte and per unit of
//   time it occupies, with the chance of reuse learned online from the routing seen so far.
//   * Time is counted in layer steps. Routing cycles through the layers, so an entry of layer l
//     seen from the running layer is next looked at after d = (l - cur) mod n_layer steps (a full
//     cycle for the running layer), then every n_layer steps: one "visit" per token.
//   * Reuse model: an entry's state is its age (visits of its layer since the router last picked
//     it; "never" apart), a frequency class (log2 of 1 + its use count) and a lift class: how much
//     likelier than usual the layer's last routed set makes the expert at the layer's next visit
//     (mf_affinity.c learns, per layer, which experts follow which from one visit to the next).
//     Whenever a layer is routed, every expert of that layer is one observation of "state ->
//     routed or not", for resident and absent entries alike, so the hazard h(age, class, lift) =
//     P(routed at this visit | state) is estimated from n_expert observations per route (a sparse
//     cell leans on its (age, class) over all lift classes, that on its age bucket over all
//     classes, that on k / n_expert).
//     Real routers reuse an expert much more at age 1 than later, frequent experts more than rare
//     ones, and move between related experts from token to token; the table measures how much on
//     the running model instead of assuming it, and on routing without such structure it flattens
//     out, leaving the distance d to decide.
//   * Keep value: with S_j the chance the entry is still unused after j visits (from h, its age
//     growing each visit; the lift class speaks of the next visit only, later ones use h over all
//     lift classes), holding it until the J-th visit yields (1 - S_J) expected hits for
//     d + n_layer * (S_1 + ... + S_{J-1}) layer steps of occupancy; the value is the best such
//     rate over J (a Gittins-style index: an entry close to its use with a modest chance can be
//     worth more than a likely one a whole cycle away), divided by the entry's bytes. This is
//     Belady's rule made stochastic: far, unlikely entries go first. It keeps hitting below one
//     token's working set, where LRU evicts exactly what comes next. Equal values (same state,
//     distance and size) fall back to LRU order.
//   * Adaptivity: use counts and affinity counts are halved every MF_WINDOW visits of their layer
//     and the hazard observations once they exceed MF_WINDOW visits of every layer, so the model
//     follows drifting routing. The hazards are recomputed once per cycle (n_layer routes) and a
//     value-table row when a resident entry first needs it in the cycle; a victim search scores
//     the resident entries once per route (a resident list, not every entry).
//   * Measured (bench/reports/trace-replay.md): decode hit rate 0.83 (Qwen, 64.4%) / 0.86 (Gemma,
//     67.8%) of Belady's at 2000 MiB (age and frequency only: 0.80 / 0.85; frequency only: 0.76 /
//     0.82), higher than without the lift at 250 MiB to 6 GiB, not below LRU at 250 MiB to 8 GiB.
//   * What is left: given the next token's actual routing (an oracle), this index reaches 0.85 of
//     Belady on Qwen (66.5% at 2000 MiB), so even a perfect next-token predictor leaves most of
//     the gap, which is about reuse two and more tokens ahead. The affinity between layers within
//     a token was measured and left out: it is strong (it ranks the running token's later routes
//     well) but even the exact rest of the running token adds 0.1 points, as those entries a few
//     layers ahead are kept anyway.
// - NONE: keep only the running layer's experts.
// The running layer's routed entries are pinned until the next call.
// Prefetch (mf_cache_prefetch): the streamer may admit the next layer's predicted experts before
// that layer routes. Such admissions evict like a route does, but never a pinned entry, and they
// teach the reuse model nothing: only real routing is evidence.
#include "mf_internal.h"

#include <errno.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

// ages (visits since the last route) below MF_AGE_EXACT are told apart, older ones share one
// bucket per doubling (the reuse chance changes fast at first, slowly later), up to MF_AGE_CAP
#define MF_AGE_EXACT 16
#define MF_AGE_CAP 32
// one more bucket for entries never routed
#define MF_AGE_NEVER MF_AGE_CAP
#define MF_AGES (MF_AGE_CAP + 1)
// frequency classes: floor(log2(1 + uses)), the last one open-ended
#define MF_CLASSES 8
// visits looked ahead by the keep value: long enough to reach the slowly changing old-age buckets
#define MF_HORIZON 32
// cells of the reuse model: (age bucket, frequency class, lift class)
#define MF_CELLS (MF_AGES * MF_CLASSES * MF_LIFTS)
// memory of the reuse model, in visits of a layer (about that many tokens)
#define MF_WINDOW 256u

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
    c->keep_age      = -1;
    c->entry_bytes   = calloc((size_t) n_layer, sizeof *c->entry_bytes);
    c->resident      = calloc(n, sizeof *c->resident);
    c->last_use      = calloc(n, sizeof *c->last_use);
    c->pinned        = calloc((size_t) n_expert, sizeof *c->pinned);
    c->visits        = calloc((size_t) n_layer, sizeof *c->visits);
    c->last_visit    = calloc(n, sizeof *c->last_visit);
    c->uses          = calloc(n, sizeof *c->uses);
    c->obs           = calloc(tab, sizeof *c->obs);
    c->obs_hit       = calloc(tab, sizeof *c->obs_hit);
    c->keep          = calloc(tab * (size_t) n_layer, sizeof *c->keep);
    c->keep_cycle    = calloc(tab, sizeof *c->keep_cycle);
    c->h3            = calloc(tab, sizeof *c->h3);
    c->h2            = calloc((size_t) MF_AGES * MF_CLASSES, sizeof *c->h2);
    c->res_list      = calloc(n, sizeof *c->res_list);
    c->res_pos       = calloc(n, sizeof *c->res_pos);
    c->score         = calloc(n, sizeof *c->score);
    c->load          = calloc((size_t) n_expert, sizeof *c->load);
    c->evict         = calloc(n, sizeof *c->evict);
    if (!c->entry_bytes || !c->resident || !c->last_use || !c->pinned || !c->visits || !c->last_visit || !c->uses ||
        !c->obs || !c->obs_hit || !c->keep || !c->keep_cycle || !c->h3 || !c->h2 || !c->res_list || !c->res_pos ||
        !c->score || !c->load || !c->evict) {
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
    free(c->keep);
    free(c->keep_cycle);
    free(c->h3);
    free(c->h2);
    free(c->res_list);
    free(c->res_pos);
    free(c->score);
    free(c->load);
    free(c->evict);
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

// ---------------------------------------------------------------- LAYER: the reuse model

static int32_t bucket_of_age(uint32_t age) {
    if (age < MF_AGE_EXACT) {
        return (int32_t) age;
    }
    // 16..31 -> 16, 32..63 -> 17, ...
    const int32_t b = MF_AGE_EXACT + (31 - __builtin_clz(age)) - 4;
    return b < MF_AGE_CAP - 1 ? b : MF_AGE_CAP - 1;
}

// the youngest age of a bucket (what the bucket stands for when it ages further)
static uint32_t age_of_bucket(int32_t b) {
    return b < MF_AGE_EXACT ? (uint32_t) b : 1u << (b - MF_AGE_EXACT + 4);
}

// age bucket of entry i at the next visit of its layer
static int32_t age_bucket(const mf_cache * c, size_t i, uint32_t next_visit) {
    const uint32_t last = c->last_visit[i];
    return last == 0 ? MF_AGE_NEVER : bucket_of_age(next_visit - last);
}

static int32_t freq_class(uint32_t uses) {
    // floor(log2(1 + uses)): one class per doubling, so a handful of classes spans any run length
    const int32_t cl = 31 - __builtin_clz(uses + 1u);
    return cl < MF_CLASSES - 1 ? cl : MF_CLASSES - 1;
}

// the model cell of entry i at visit v of its layer
static int32_t cell_of(const mf_cache * c, size_t i, uint32_t v) {
    return (age_bucket(c, i, v) * MF_CLASSES + freq_class(c->uses[i])) * MF_LIFTS + c->affinity.lift[i];
}

// one route of `layer`: each of its experts is an observation of (age, class, lift) -> routed or not
static void learn(mf_cache * c, int32_t layer, const uint8_t * want) {
    const size_t   row = (size_t) layer * (size_t) c->n_expert;
    const uint32_t v   = ++c->visits[layer];
    for (int32_t e = 0; e < c->n_expert; e++) {
        const size_t  i    = row + (size_t) e;
        const int32_t cell = cell_of(c, i, v);
        c->obs[cell] += 1.0f;
        if (want[e]) {
            c->obs_hit[cell] += 1.0f;
            c->uses[i]++;
            c->last_visit[i] = v;
        }
    }
    c->obs_total += (float) c->n_expert;
    // forget slowly: halve the evidence once it spans a window, so the model can follow drift
    const bool halve = v % MF_WINDOW == 0;
    if (halve) {
        for (int32_t e = 0; e < c->n_expert; e++) {
            c->uses[row + (size_t) e] /= 2;
        }
    }
    // the lift classes for the layer's next visit (after the observations, which used this one's)
    mf_affinity_route(&c->affinity, layer, want, c->k_seen, halve);
    if (c->obs_total > (float) MF_WINDOW * (float) c->n_layer * (float) c->n_expert) {
        for (int32_t cell = 0; cell < MF_CELLS; cell++) {
            c->obs[cell] *= 0.5f;
            c->obs_hit[cell] *= 0.5f;
        }
        c->obs_total *= 0.5f;
    }
}

// P(routed at a visit | state) for every cell (h3[cell]) and for every (age, class) over all lift
// classes (h2[age * MF_CLASSES + class]). A state with few observations leans on a coarser one:
// a cell on its (age, class), that on its age bucket over all classes, that on k / n_expert
static void hazards(const mf_cache * c, float * h3, float * h2) {
    const float prior = (float) c->k_seen / (float) c->n_expert;
    for (int32_t age = 0; age < MF_AGES; age++) {
        float n = 0.0f, h = 0.0f;
        float n2[MF_CLASSES], hit2[MF_CLASSES];
        for (int32_t cl = 0; cl < MF_CLASSES; cl++) {
            n2[cl] = hit2[cl] = 0.0f;
            for (int32_t b = 0; b < MF_LIFTS; b++) {
                const int32_t cell = (age * MF_CLASSES + cl) * MF_LIFTS + b;
                n2[cl] += c->obs[cell];
                hit2[cl] += c->obs_hit[cell];
            }
            n += n2[cl];
            h += hit2[cl];
        }
        const float by_age = (h + MF_PRIOR_WEIGHT * prior) / (n + MF_PRIOR_WEIGHT);
        for (int32_t cl = 0; cl < MF_CLASSES; cl++) {
            const float by_class = (hit2[cl] + MF_PRIOR_WEIGHT * by_age) / (n2[cl] + MF_PRIOR_WEIGHT);
            h2[age * MF_CLASSES + cl] = by_class;
            for (int32_t b = 0; b < MF_LIFTS; b++) {
                const int32_t cell = (age * MF_CLASSES + cl) * MF_LIFTS + b;
                h3[cell]           = (c->obs_hit[cell] + MF_PRIOR_WEIGHT * by_class) / (c->obs[cell] + MF_PRIOR_WEIGHT);
            }
        }
    }
}

// out[d - 1] = max over horizons j of hits[j] / (d + L * held[j]) for d in dlo..dhi, the best j
// known to lie in jlo..jhi. Both hits and held grow with j, so once a longer horizon beats a
// shorter one at some d it beats it at every larger d: the (first) best j never decreases with d,
// and divide and conquer over d needs O((L + horizon) log L) ratios instead of L * horizon.
static void keep_fill(const float * hits, const float * held, int32_t L, float * out, int32_t dlo, int32_t dhi,
                      int32_t jlo, int32_t jhi) {
    if (dlo > dhi) {
        return;
    }
    const int32_t d      = dlo + (dhi - dlo) / 2;
    int32_t       best_j = jlo;
    float         best   = -1.0f;
    for (int32_t j = jlo; j <= jhi; j++) {
        const float rate = hits[j] / ((float) d + (float) L * held[j]);
        if (rate > best) {
            best   = rate;
            best_j = j;
        }
    }
    out[d - 1] = best;
    keep_fill(hits, held, L, out, dlo, d - 1, jlo, best_j);
    keep_fill(hits, held, L, out, d + 1, dhi, best_j, jhi);
}

// the model of the coming cycle: hazards now, keep-value rows on first use (keep_row)
static void refresh_model(mf_cache * c) {
    hazards(c, c->h3, c->h2);
    c->cycle++;
    c->keep_age = 0;
}

// keep[cell * n_layer + d - 1]: expected hits per layer step of holding an entry in that state
// (age, class, lift) whose layer comes next in d steps (see DESIGN). The lift class speaks of the
// next visit only: later visits use the (age, class) hazard over all lift classes. A row is filled
// when a resident entry first needs it in a cycle: the residents occupy a fraction of the
// MF_CELLS states, and filling them all each cycle would cost more than the victim searches.
static const float * keep_row(mf_cache * c, int32_t cell) {
    const int32_t L   = c->n_layer;
    float *       row = c->keep + (size_t) cell * (size_t) L;
    if (c->keep_cycle[cell] == c->cycle) {
        return row;
    }
    const int32_t age = cell / (MF_CLASSES * MF_LIFTS);
    const int32_t cl  = cell / MF_LIFTS % MF_CLASSES;
    float         hits[MF_HORIZON];
    float         held[MF_HORIZON];  // cycles held beyond the first visit: S_1 + ... + S_{J-1}
    const float   first = 1.0f - c->h3[cell];  // S_1
    float         s = first, t = 0.0f;
    hits[0] = 1.0f - s;
    held[0] = 0.0f;
    for (int32_t j = 1; j < MF_HORIZON; j++) {
        const int32_t a = age == MF_AGE_NEVER ? age : bucket_of_age(age_of_bucket(age) + (uint32_t) j);
        t += s;
        s *= 1.0f - c->h2[a * MF_CLASSES + cl];
        hits[j] = 1.0f - s;
        held[j] = t;
    }
    keep_fill(hits, held, L, row, 1, L, 0, MF_HORIZON - 1);
    c->keep_cycle[cell] = c->cycle;
    return row;
}

// scores every resident entry (keep value per byte); pinned ones can't be victims
static void score_residents(mf_cache * c, int32_t cur) {
    const int32_t L = c->n_layer;
    for (int32_t p = 0; p < c->n_res; p++) {
        const size_t  i = (size_t) c->res_list[p];
        const int32_t l = (int32_t) (i / (size_t) c->n_expert);
        const int32_t e = (int32_t) (i % (size_t) c->n_expert);
        if (l == c->pinned_layer && c->pinned[e]) {
            c->score[p] = FLT_MAX;
            continue;
        }
        int32_t d = l - cur;
        if (d <= 0) {
            d += L;
        }
        const int32_t cell  = cell_of(c, i, c->visits[l] + 1u);
        const float   bytes = c->entry_bytes[l] ? (float) c->entry_bytes[l] : 1.0f;
        c->score[p]         = keep_row(c, cell)[d - 1] / bytes;
    }
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

    if (c->policy == MF_POLICY_LAYER) {
        learn(c, layer, want);
        // the hazards (and so the value table) follow the model once per layer cycle: fresh
        // enough, and cheap per route
        if (c->keep_age < 0 || ++c->keep_age >= c->n_layer) {
            refresh_model(c);
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
                score_residents(c, layer);
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
                score_residents(c, c->pinned_layer >= 0 ? c->pinned_layer : layer);
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
