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
//   * Beyond the next visit: the entry's own recent routing rate p (routes per visit of its layer,
//     a count decayed with a half-life of MF_RECENT_HALF_LIFE visits, drawn towards the layer's
//     mean rate as far as the spread of the layer's rates is noise: empirical Bayes, see
//     rates_prior), the same at every later visit. Not the pooled hazard of its
//     (age, class) cell growing older: that one falls with age mostly because the cell mixes
//     entries of different rates (the rarely routed ones are the ones that get old), while one
//     entry's own chance falls much less; a frequently routed expert that missed a few tokens
//     was ranked like a rare one. Measured at 2000 MiB (decode hits, Qwen / Gemma): 64.4 -> 64.9
//     / 67.8 -> 68.5; half-lives of 8 / 32 / 64 visits: 64.8 / 64.7 / 64.3 and 68.0 / 68.5 / 68.5
//     (with a fixed prior of MF_PRIOR_WEIGHT visits at k / n_expert); the mean of two half-lives
//     (4 and 64, 8 and 64, 8 and 32, 16 and 128 visits): within 0.2 points; the entry's
//     whole-history rate (no decay) gave nothing in an offline model (62.7 vs 62.7 without the
//     lift), the trace's future rate (an oracle) 65.1: a short memory tracks what an expert does
//     now. The fixed prior of 2 visits cost up to 4 points on synthetic uniform routing (every
//     expert alike: the rates' spread is all noise, and ranking on it beat ranking on distance);
//     the empirical-Bayes prior is back at the earlier policy's hit rates there (within 0.9
//     points either way, 200 tokens, 3 shapes, 3 seeds) and above them on drifting Zipf routing.
//   * The context of that rate: p is multiplied by the entry's window lift (mf_affinity.c): how
//     much likelier than usual the layer's recent routed sets (each visit back weighing half as
//     much) make the expert's routes at visits 2 to MF_WIN_H after the layer's last one, an
//     affinity learned online like the next-visit lift, its noise taken out by empirical Bayes as
//     for p. Why: the misses left against Belady are mostly reuses 2 to 8 tokens ahead (see
//     "What is left"), and the near-term rate is what decides them: in an offline replica of
//     this policy (Python, not kept; 64.9% on Qwen at 2000 MiB as the C code) the actual routes
//     of the visits 2..4 ahead given as p (an oracle) reached 69.3% (2..8: 69.9%, 2..32: 68.4%),
//     the actual next visit given as h 67.6%, both 76.9% (0.97 of Belady: the keep value is not
//     what limits the policy, its predictions are). Within a cell of (p, age) the window lift
//     still ranks the entries' reuse 2 to 8 visits ahead (AUC 0.63 to 0.65, Qwen and Gemma),
//     the routed-set-to-next-visit lift less (0.58). Measured (decode hits, old -> new, the C
//     library replayed on the traces): Qwen 64.94 -> 65.47 at 2000 MiB, 46.6 -> 46.8 at 1000,
//     83.2 -> 83.8 at 4000; Gemma 68.53 -> 68.67; never below the old policy at 250 MiB to
//     8 GiB (bench/reports/trace-replay.md).
//     Synthetic uniform and drifting Zipf routing (48 x 128, k = 8, 300 tokens, seeds 1 to 3,
//     250 MiB to 12 GiB): within 0.13 points of the old policy on uniform routing, up to +0.6
//     on Zipf at 250 to 2000 MiB, at most 0.07 below it at 8 and 12 GiB. Without the
//     empirical-Bayes shrinkage the lift's noise cost 0.2 to 0.5 points on uniform routing at 4
//     to 12 GiB. The window (with the last 4 sets recomputed at each visit): visits 2..3 / 2..4
//     / 2..6 / 2..8 after: 65.46 / 65.48 / 65.29 / 65.27 on Qwen at 2000 MiB (68.73 / 68.72 /
//     68.65 / 68.54 on Gemma); short because the cache, at the budgets where the policy
//     matters, holds two to three tokens' working sets. The context: the last 2, 4 or 8 sets
//     recomputed at each visit instead of the decayed sum: within 0.03. Cost: about 2 us more
//     per route (a C microbenchmark, not kept, replaying the Qwen trace ten times through
//     mf_cache_route, best of 5 runs on 2 shared cores, niced: 10.2 -> 12.2 us per route at
//     2000 MiB, 9.8 -> 11.4 at 8000; medians 12.6 -> 15.5 and 11.8 -> 12.0).
//   * Keep value: with S_1 = 1 - h the chance the entry is unused at its next visit and
//     S_j = S_1 (1 - p)^(j-1) after j visits, holding it until the J-th visit yields (1 - S_J)
//     expected hits for d + n_layer * (S_1 + ... + S_{J-1}) layer steps of occupancy; the value is
//     the best such rate over J (a Gittins-style index: an entry close to its use with a modest
//     chance can be worth more than a likely one a whole cycle away), divided by the entry's
//     bytes. With the chance flat after the first visit the rate is a linear-fractional function
//     of (1 - p)^(J-1), so the best J is the first visit or none (p: the context-lifted rate):
//     the value is the larger of h / d and 1 / (d + n_layer * S_1 / p), one over the expected
//     steps to the next use. Two ratios per entry, no table. (Capping J at 4 to 512 visits
//     measured the same within 0.15 points.) This is Belady's rule made stochastic: far, unlikely
//     entries go first. It keeps hitting below one token's working set, where LRU evicts exactly
//     what comes next. Equal values (same state, distance and size) fall back to LRU order.
//   * Adaptivity: use counts and affinity counts are halved every MF_WINDOW visits of their layer
//     and the hazard observations once they exceed MF_WINDOW visits of every layer, so the model
//     follows drifting routing. The hazards are recomputed once per cycle (n_layer routes); a
//     victim search scores the resident entries once per route (a resident list, not every entry).
//   * Memory: 37 bytes per (layer, expert) entry here (the recent rate is 4 of them) plus the
//     affinity model's 4 * n_expert + 22 (next-visit and window affinity), 24 bytes per layer for
//     the rate prior, and three MF_CELLS float tables (12 KiB): 3.4 MiB at 48 layers x 128
//     experts, 3.1 MiB of it affinity (the window affinity 1.6 MiB).
//   * Measured (bench/reports/trace-replay.md): decode hit rate 65.5% (Qwen) / 68.7% (Gemma) at
//     2000 MiB, 0.82 / 0.85 of Belady's 79.4% / 80.7% under the same byte budget (without the
//     window lift: 64.9% / 68.5%; with the (age, class) hazard aged along the horizon instead of
//     the recent rate as well: 64.4% / 67.8%; that and no lift: 0.80 / 0.85 of the count-based
//     Belady described next; frequency only: 0.76 / 0.82 of it), not below LRU at 250 MiB to
//     8 GiB (by 0.4 / 0.1 points at least, both at 8 GiB). Before commit e0d8a6b the replay's
//     Belady counted every expert at the largest layer's size (78.1% / 78.9%), and this comment
//     quoted 0.84 / 0.87 of that.
//   * Tried and left out (2000 MiB, Qwen / Gemma decode hits, recent rate in place): the recent
//     rate's class (per power of two of p / (k / n_expert)) in place of the use-count class in
//     the hazard cell: 64.8 / 68.1; scaling a layer's next-visit hazards so they sum to k (the
//     router picks exactly k): 65.0 / 68.4; counting every hit within the horizon instead of the
//     first (occupancy for the whole horizon): 64.9 / 68.4. In an offline model without the lift:
//     a per-entry correction of the pooled hazard (observed / predicted routes): +0.2 to +0.4;
//     a decayed-count class as a further cell dimension: +0.6 / -0.1.
//     With the window lift in place (offline replica unless said): the lift through learned
//     correction classes (observed / expected routes in the window per class of the lift, one
//     class per power of two or per quarter power; in C and offline): 64.9 to 65.3 / 68.4 to
//     68.6, the corrections came out near 1 (a pooled calibration is dominated by entries no
//     cache holds); a Poisson regression of the window's routes on log p, log lift, a shorter-
//     memory rate (half-life 4), the age and the next-visit lift, fitted on the trace itself (an
//     in-sample upper bound of any such combination): 65.1 to 65.5, no better than the product;
//     a logistic regression of the next visit's route on the cell's features plus the continuous
//     next-visit lift, p and the window lift, also fitted in-sample, in place of h: 65.5; the
//     window lift as a class of the next-visit hazard cell: 65.0 / 68.5 alone, 65.4 / 68.8 with
//     the product; the two-phase value (the lifted rate within the window, p after it; the best
//     J is then the first visit, the window's end or none): 65.3 / 68.7; the adjacent layer's
//     (l - 1) sets of the same tokens added to the context: +0.06 / -0.04; a "topic" lift from
//     co-occurrence within one visit's set (how often f is routed together with the context's
//     experts, itself left out) in place of the window lift: -0.6 / -0.6, times it: -0.9 / -0.8
//     (experts routed together do not announce each other's later routes); the router's rank of
//     each routed expert (slot 0 = most probable) as a further hazard dimension: 64.9 / 68.5 (it
//     predicts the next visit's reuse, but the cells already do); the router's weight of each
//     routed expert in its recent rate (a route counting k x weight, mixed half and half with 1
//     or alone, capped at 1 or not; the traces carry the weights, session 7's replay, not kept):
//     65.28 to 65.46 / 68.22 to 68.59, never above the plain count; hazard tables per layer (drawn
//     towards the pooled one with 2 to 50 observations): -0.5 to 0.0; half-lives of p of 8 / 32
//     visits with the lift: 65.1 / 65.5 and 68.2 / 68.9.
//   * What is left: the features above (own rates, age, frequency, next-visit and window
//     affinity of the layer's recent sets), however combined, stop at about 65.5% on Qwen at
//     2000 MiB (0.82 of Belady); the oracles say the rest is in the next two to four tokens'
//     routing, which these signals predict weakly (the fitted Poisson regression's deviance is
//     3% below that of p alone). Given the next token's actual routing (an oracle), the earlier
//     index reached 0.84 of Belady on Qwen (66.5% at 2000 MiB), so even a perfect next-token
//     predictor leaves most of the gap, which is about reuse two and more tokens ahead. Where
//     the misses are (an offline model without the lift, Qwen, 2000 MiB): none for entries
//     reused by the next token, as for Belady; 12% to 67% of the reuses 2 to 8 tokens later,
//     which Belady nearly all hits (4000 of the 5800 misses more than Belady's); the rest at 9
//     or more tokens. The affinity between layers within a token was measured and left out: it
//     is strong (it ranks the running token's later routes well) but even the exact rest of the
//     running token adds 0.1 points, as those entries a few layers ahead are kept anyway.
//     A whole-token match was measured and left out too (session 11, /tmp/exp/auc.py, not kept):
//     the past tokens whose routing over all layers overlaps the running token's most (the best
//     one shares a median 61% / 58% of its routed entries on Qwen / Gemma) vote for the
//     routes their own successors took 2 to 4 tokens later. Within cells of (p, age) that vote
//     ranks the entries' reuse 2 to 4 tokens ahead with an AUC of 0.62 to 0.64 (Qwen), as the
//     window lift already does: the same context, seen through the whole token instead of one
//     layer's recent sets.
//     By quarters of the decode (32 tokens each; session 12, /tmp/exp/warm.py, not kept: the C
//     policy and the replay's Belady at 2000 MiB): Qwen 0.76 / 0.86 / 0.84 / 0.83 of Belady,
//     Gemma 0.84 / 0.85 / 0.86 / 0.86, LRU on Qwen 0.69 / 0.73 / 0.69 / 0.74. The first
//     quarter, when the policy has seen the prompt's routing and little of the decode's, costs
//     Qwen most of its gap to 0.85.
// - NONE: keep only the running layer's experts.
// The running layer's routed entries are pinned until the next call.
// Prefetch (mf_cache_prefetch): the streamer may admit the next layer's predicted experts before
// that layer routes. Such admissions evict like a route does, but never a pinned entry, and they
// teach the reuse model nothing: only real routing is evidence.
#include "mf_internal.h"

#include <errno.h>
#include <float.h>
#include <math.h>
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
// half-life, in visits of the entry's layer, of the recent routing rate used beyond the next
// visit: long enough to average a few reuses of a frequent expert, short enough to follow what
// it does now (8 to 32 measured within 0.3 points, see DESIGN)
#define MF_RECENT_HALF_LIFE 16.0f
// the heaviest prior on the recent rates, in visits: a layer whose experts look alike gets this
// (far more than the n_eff of 23 visits a half-life of 16 gives: the mean then decides)
#define MF_RATE_PRIOR_MAX 1e6f
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
    if (!c->entry_bytes || !c->resident || !c->last_use || !c->pinned || !c->visits || !c->last_visit || !c->uses ||
        !c->obs || !c->obs_hit || !c->h3 || !c->recent || !c->rates || !c->res_list || !c->res_pos ||
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
    free(c->h3);
    free(c->recent);
    free(c->rates);
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

// the chance of a route at any visit before there is evidence: k / n_expert
static float prior_rate(const mf_cache * c) {
    return (float) (c->k_seen > 0 ? c->k_seen : 1) / (float) c->n_expert;
}

// How far to trust each entry's own recent rate, per layer (empirical Bayes): the rates of a
// layer's experts spread by how differently the router uses them plus sampling noise, the noise
// of a decayed count being rate * (1 - rate) / n_eff with n_eff = norm^2 / norm2 visits (Kish's
// effective sample size). What is left of the spread once the noise is taken out is the true
// spread V; a Beta prior with that mean m and variance V weighs m(1 - m) / V - 1 visits. A
// skewed layer gets a light prior (its experts' rates say much), a layer routing uniformly a
// prior so heavy that every expert gets the mean: there, ranking on noise would lose to ranking
// on distance (synthetic uniform routing: up to 4 points below, see DESIGN).
static void rates_prior(mf_cache * c, int32_t layer) {
    mf_rates *     rt  = &c->rates[layer];
    const float *  r   = c->recent + (size_t) layer * (size_t) c->n_expert;
    const float    E   = (float) c->n_expert;
    float          sum = 0.0f, sum2 = 0.0f;
    for (int32_t e = 0; e < c->n_expert; e++) {
        sum += r[e];
        sum2 += r[e] * r[e];
    }
    const float m     = sum / (E * rt->norm);
    const float v_obs = sum2 / (E * rt->norm * rt->norm) - m * m;
    const float noise = rt->norm2 / (rt->norm * rt->norm);  // 1 / n_eff
    rt->mean          = m > 0.0f ? m : prior_rate(c);
    // V = (v_obs - noise * m (1 - m)) / (1 - noise): the noise term uses the layer's mean, and the
    // per-expert noise sums to m (1 - m) - V over the experts
    const float v     = noise < 1.0f ? (v_obs - noise * m * (1.0f - m)) / (1.0f - noise) : 0.0f;
    rt->strength      = v > 0.0f ? rt->mean * (1.0f - rt->mean) / v - 1.0f : MF_RATE_PRIOR_MAX;
    if (!(rt->strength >= 0.0f)) {
        rt->strength = 0.0f;
    }
    if (rt->strength > MF_RATE_PRIOR_MAX) {
        rt->strength = MF_RATE_PRIOR_MAX;
    }
    // an entry's rate: (recent / norm * n_eff + strength * mean) / (n_eff + strength), i.e.
    // recent * scale + offset, two numbers per layer instead of three divisions per scored entry
    const float neff = 1.0f / noise;
    rt->scale        = neff / rt->norm / (neff + rt->strength);
    rt->offset       = rt->strength * rt->mean / (neff + rt->strength);
}

// one route of `layer`: each of its experts is an observation of (age, class, lift) -> routed or not
static void learn(mf_cache * c, int32_t layer, const uint8_t * want) {
    const size_t   row = (size_t) layer * (size_t) c->n_expert;
    const uint32_t v   = ++c->visits[layer];
    const float    g   = c->recent_decay;
    mf_rates *     rt  = &c->rates[layer];
    // recent[i] / rt->norm: the share of the layer's recent visits that routed i
    rt->norm  = rt->norm * g + 1.0f;
    rt->norm2 = rt->norm2 * g * g + 1.0f;
    for (int32_t e = 0; e < c->n_expert; e++) {
        const size_t  i    = row + (size_t) e;
        const int32_t cell = cell_of(c, i, v);
        c->recent[i]       = c->recent[i] * g + (want[e] ? 1.0f : 0.0f);
        c->obs[cell] += 1.0f;
        if (want[e]) {
            c->obs_hit[cell] += 1.0f;
            c->uses[i]++;
            c->last_visit[i] = v;
        }
    }
    c->obs_total += (float) c->n_expert;
    rates_prior(c, layer);
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

// P(routed at a visit | state) for every cell (h3[cell]). A state with few observations leans on
// a coarser one: a cell on its (age, class) over all lift classes, that on its age bucket over all
// classes, that on k / n_expert
static void hazards(const mf_cache * c, float * h3) {
    const float prior = prior_rate(c);
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
            for (int32_t b = 0; b < MF_LIFTS; b++) {
                const int32_t cell = (age * MF_CLASSES + cl) * MF_LIFTS + b;
                h3[cell]           = (c->obs_hit[cell] + MF_PRIOR_WEIGHT * by_class) / (c->obs[cell] + MF_PRIOR_WEIGHT);
            }
        }
    }
}

// the model of the coming cycle
static void refresh_model(mf_cache * c) {
    hazards(c, c->h3);
    c->model_age = 0;
}

// the recent routing rate of entry i (of layer l) beyond its next visit: its decayed count over
// n_eff visits, drawn towards the layer's mean by the prior's weight (rates_prior)
static float recent_rate(const mf_cache * c, size_t i, int32_t l, float prior) {
    const mf_rates * rt = &c->rates[l];
    if (!(rt->norm > 0.0f)) {
        return prior;  // the layer was never routed
    }
    const float rate = c->recent[i] * rt->scale + rt->offset;
    return rate < 1.0f ? rate : 1.0f;
}

// expected hits per layer step of holding an entry whose layer comes next in d steps, with chance
// h of a route at that visit and p at every later one (see DESIGN): the better of holding it
// for the next visit, h / d, and until its next use, 1 / (d + L * (1 - h) / p)
static float keep_value(float h, float p, int32_t d, int32_t L) {
    const float next = h / (float) d;
    // p = 0 (an expert the router never picks, on a layer whose experts differ a lot): no later use
    const float use = p > 0.0f ? 1.0f / ((float) d + (float) L * (1.0f - h) / p) : 0.0f;
    return next > use ? next : use;
}

// scores every resident entry (keep value per byte); pinned ones can't be victims
static void score_residents(mf_cache * c, int32_t cur) {
    const int32_t L     = c->n_layer;
    const float   prior = prior_rate(c);
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
        // the recent rate, lifted by what the layer's recent routing says of the coming visits
        float         rate  = recent_rate(c, i, l, prior) * c->affinity.wlift[i];
        rate                = rate < 1.0f ? rate : 1.0f;
        c->score[p]         = keep_value(c->h3[cell], rate, d, L) / bytes;
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
        // the hazards follow the model once per layer cycle: fresh enough, and cheap per route
        if (c->model_age < 0 || ++c->model_age >= c->n_layer) {
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
