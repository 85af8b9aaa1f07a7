// Routing affinity between visits of a layer, for the LAYER cache policy (mf_reuse.c).
//
// A router's choices move between related experts from one token to the next. For each layer
// this learns, online, two affinities and turns them into lifts (how much likelier than usual an
// expert is routed, given what the layer routed lately):
// - next visit: how often expert f is routed at the visit right after one that routed e. The
//   layer's last routed set gives each expert a lift P(f | last set) / P(f), the first factor the
//   mean of P(f | e) over the set's experts (each estimate drawn towards the marginal when it
//   rests on few visits). The cache uses it as a class (one per power of four) of its reuse
//   model, next to age and frequency, so a lift that predicts nothing on some model simply
//   makes its classes' hazards equal.
// - window: the same for visits 2 to MF_WIN_H after a visit, applied to the layer's recent sets
//   (each visit back weighing half as much), as a factor on the entry's recent routing rate: the
//   reuses a few tokens ahead are most of what the policy still misses against Belady. Its noise
//   is taken out per layer by empirical Bayes (window_route), so on routing without such
//   structure it is about 1.
// Memory: 4 * n_layer * n_expert^2 bytes (3 MiB at 48 x 128) plus 18 + MF_WIN_H bytes per
// (layer, expert). Counts are updated through the list of routed experts, not every expert.
// One thread at a time (the cache's). See docs/streamer.md, "Affinity".
#include "mf_internal.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int mf_affinity_init(mf_affinity * a, int32_t n_layer, int32_t n_expert) {
    const size_t n = (size_t) n_layer * (size_t) n_expert;
    memset(a, 0, sizeof *a);
    a->n_layer = n_layer;
    a->n_expert = n_expert;
    a->pair     = calloc(n * (size_t) n_expert, sizeof *a->pair);
    a->src      = calloc(n, sizeof *a->src);
    a->marg     = calloc(n, sizeof *a->marg);
    a->seen     = calloc((size_t) n_layer, sizeof *a->seen);
    a->last     = calloc(n, sizeof *a->last);
    a->lift     = malloc(n * sizeof *a->lift);
    a->scratch  = calloc((size_t) n_expert, sizeof *a->scratch);
    a->count    = calloc((size_t) n_layer, sizeof *a->count);
    a->hist     = calloc(n * MF_WIN_H, sizeof *a->hist);
    a->wpair    = calloc(n * (size_t) n_expert, sizeof *a->wpair);
    a->wsrc     = calloc(n, sizeof *a->wsrc);
    a->wmarg    = calloc(n, sizeof *a->wmarg);
    a->wseen    = calloc((size_t) n_layer, sizeof *a->wseen);
    a->ctx      = calloc(n, sizeof *a->ctx);
    a->ctx_sum  = calloc((size_t) n_layer * 3, sizeof *a->ctx_sum);
    a->wlift    = malloc(n * sizeof *a->wlift);
    a->win      = calloc((size_t) n_expert, sizeof *a->win);
    a->idx      = calloc((size_t) n_expert, sizeof *a->idx);
    if (!a->pair || !a->src || !a->marg || !a->seen || !a->last || !a->lift || !a->scratch || !a->count ||
        !a->hist || !a->wpair || !a->wsrc || !a->wmarg || !a->wseen || !a->ctx || !a->ctx_sum || !a->wlift || !a->win ||
        !a->idx) {
        mf_affinity_free(a);
        return -ENOMEM;
    }
    // no evidence yet: every expert is as likely as at any visit (lift 1)
    memset(a->lift, MF_LIFT_NEUTRAL, n * sizeof *a->lift);
    for (size_t i = 0; i < n; i++) {
        a->wlift[i] = 1.0f;
    }
    return 0;
}

void mf_affinity_free(mf_affinity * a) {
    free(a->pair);
    free(a->src);
    free(a->marg);
    free(a->seen);
    free(a->last);
    free(a->lift);
    free(a->scratch);
    free(a->count);
    free(a->hist);
    free(a->wpair);
    free(a->wsrc);
    free(a->wmarg);
    free(a->wseen);
    free(a->ctx);
    free(a->ctx_sum);
    free(a->wlift);
    free(a->win);
    free(a->idx);
    memset(a, 0, sizeof *a);
}

// lift class: floor(log4(lift)) + MF_LIFT_NEUTRAL, clamped; class MF_LIFT_NEUTRAL is [1, 4)
static uint8_t lift_class(float lift) {
    if (!(lift > 0.0f)) {
        return 0;
    }
    int exp;
    frexpf(lift, &exp);  // lift = m * 2^exp with m in [0.5, 1): floor(log2(lift)) = exp - 1
    const int log2_floor = exp - 1;
    // floor(log2 / 2), rounding down for negative values as well
    const int log4_floor = log2_floor >= 0 ? log2_floor / 2 : -((1 - log2_floor) / 2);
    const int cls        = log4_floor + MF_LIFT_NEUTRAL;
    return (uint8_t) (cls < 0 ? 0 : cls >= MF_LIFTS ? MF_LIFTS - 1 : cls);
}

// forget at the cache model's pace: counts stay below 2 windows, well inside uint16_t
static void halve_counts(uint16_t * pair, uint16_t * src, uint16_t * marg, uint16_t * seen, int32_t E) {
    for (size_t i = 0; i < (size_t) E * (size_t) E; i++) {
        pair[i] /= 2;
    }
    for (int32_t e = 0; e < E; e++) {
        src[e] /= 2;
        marg[e] /= 2;
    }
    *seen /= 2;
}

// the experts set in `in` (E flags or counts), listed in idx; returns how many
static int32_t list_set(const uint8_t * in, int32_t E, int32_t * idx) {
    int32_t m = 0;
    for (int32_t f = 0; f < E; f++) {
        if (in[f]) {
            idx[m++] = f;
        }
    }
    return m;
}

// the context window: learns from the window that is complete with this visit and sets, for every
// expert, how much likelier than usual the layer's recent sets make its routes in the window that
// follows the next visit
static void window_route(mf_affinity * a, int32_t layer, const uint8_t * want, int32_t k, bool halve) {
    const int32_t  E     = a->n_expert;
    const size_t   row   = (size_t) layer * (size_t) E;
    uint16_t *     wpair = a->wpair + row * (size_t) E;
    uint16_t *     wsrc  = a->wsrc + row;
    uint16_t *     wmarg = a->wmarg + row;
    uint8_t *      hist  = a->hist + row * MF_WIN_H;
    const uint32_t v     = a->count[layer]++;
    if (halve) {
        halve_counts(wpair, wsrc, wmarg, &a->wseen[layer], E);
    }
    // the ring holds visits v - MF_WIN_H .. v - 1; this visit takes the oldest one's slot
    uint8_t * slot = hist + (size_t) (v % MF_WIN_H) * (size_t) E;
    if (v >= MF_WIN_H) {
        // the visit in the slot (u = v - MF_WIN_H) has its window complete: routes at u+2 .. v
        uint8_t * win = a->win;
        for (int32_t f = 0; f < E; f++) {
            win[f] = want[f] != 0;
        }
        for (uint32_t u = v - MF_WIN_H + 2; u < v; u++) {
            const uint8_t * s = hist + (size_t) (u % MF_WIN_H) * (size_t) E;
            for (int32_t f = 0; f < E; f++) {
                win[f] += s[f];
            }
        }
        // a window routes at most (MF_WIN_H - 1) * k experts: the counts are updated through that list
        int32_t * idx = a->idx;
        const int32_t m = list_set(win, E, idx);
        for (int32_t j = 0; j < m; j++) {
            wmarg[idx[j]] += win[idx[j]];
        }
        a->wseen[layer]++;
        for (int32_t e = 0; e < E; e++) {
            if (!slot[e]) {
                continue;
            }
            wsrc[e]++;
            uint16_t * to = wpair + (size_t) e * (size_t) E;
            for (int32_t j = 0; j < m; j++) {
                to[idx[j]] += win[idx[j]];
            }
        }
    }
    for (int32_t e = 0; e < E; e++) {
        slot[e] = want[e] != 0;
    }
    // routes per visit of f in the window, given the context (the layer's routed sets so far, the
    // one `lag` visits back weighing 2^-lag): the weighted mean over their experts e of
    //   (wpair[e][f] / n + w * r(f)) / (wsrc[e] + w),
    // without it: r(f) = (wmarg[f] / n + w * k / E) / (wseen + w); n = MF_WIN_H - 1 visits per window.
    // The sums decay by half per visit, so an older set's terms keep the counts of their time:
    // one set's work per route instead of one per lag (recomputing the last few sets at every
    // visit measured the same: docs/streamer.md).
    const float w    = MF_PRIOR_WEIGHT;
    const float n    = (float) (MF_WIN_H - 1);
    float *     acc  = a->ctx + row;
    float *     sums = a->ctx_sum + (size_t) layer * 3;
    float       sinv = sums[0] * 0.5f, wsum = sums[1] * 0.5f, noise = sums[2] * 0.25f;
    for (int32_t f = 0; f < E; f++) {
        acc[f] *= 0.5f;
    }
    for (int32_t e = 0; e < E; e++) {
        if (!want[e]) {
            continue;
        }
        const float      inv = 1.0f / ((float) wsrc[e] + w);
        const uint16_t * to  = wpair + (size_t) e * (size_t) E;
        sinv += inv;
        wsum += 1.0f;
        noise += inv * inv * (float) wsrc[e];
        for (int32_t f = 0; f < E; f++) {
            acc[f] += (float) to[f] * inv;
        }
    }
    sums[0] = sinv;
    sums[1] = wsum;
    sums[2] = noise;
    float * lift = a->wlift + row;
    if (!(wsum > 0.0f)) {
        for (int32_t f = 0; f < E; f++) {
            lift[f] = 1.0f;
        }
        return;
    }
    const float prior = (float) (k > 0 ? k : 1) / (float) E;
    const float seen  = (float) a->wseen[layer];
    float *     var   = a->scratch;
    // Empirical Bayes, as for the recent rates: were f independent of the context, the counts
    // wpair[e][f] would share out f's routes in all windows in proportion to wsrc[e], about
    // Poisson with mean wsrc[e] * n * re(f) (re: f's routes per window visit, from the counts
    // alone), so the lift's sampling variance is noise * re(f) / (n * wsum^2 * r(f)^2) with
    // noise = sum over the context of weight^2 * wsrc[e] / (wsrc[e] + w)^2. The lifts' spread
    // over the experts less that noise is the true spread V; each lift is drawn towards 1 by
    // V / (V + its noise). On routing without structure (every expert alike) V is about 0 and the
    // lifts about 1 (ranking on their noise costs hits). re(f), not the marginal r(f): with r(f)
    // the noise of experts a layer never routes, whose lifts are exact, swamps the spread.
    // (the divisions hoisted: this loop runs per route)
    const float inv_seen = 1.0f / (seen + w);
    const float inv_wsum = 1.0f / wsum;
    const float per_seen = seen > 0.0f ? 1.0f / (n * seen) : 0.0f;
    const float var_k    = noise / (n * wsum * wsum);
    float       spread = 0.0f, noise_sum = 0.0f;
    for (int32_t f = 0; f < E; f++) {
        const float r  = ((float) wmarg[f] / n + w * prior) * inv_seen;
        const float ir = 1.0f / r;
        lift[f]        = (acc[f] / n + w * r * sinv) * inv_wsum * ir;
        // given the routes of f in all windows (the counts wpair[.][f] share them out)
        var[f]         = var_k * (float) wmarg[f] * per_seen * ir * ir;
        spread += (lift[f] - 1.0f) * (lift[f] - 1.0f);
        noise_sum += var[f];
    }
    const float V = (spread - noise_sum) / (float) E;
    for (int32_t f = 0; f < E; f++) {
        lift[f] = V > 0.0f ? 1.0f + (lift[f] - 1.0f) * V / (V + var[f]) : 1.0f;
    }
}

void mf_affinity_route(mf_affinity * a, int32_t layer, const uint8_t * want, int32_t k_prior, bool halve) {
    const int32_t E    = a->n_expert;
    const size_t  row  = (size_t) layer * (size_t) E;
    uint16_t *    pair = a->pair + row * (size_t) E;
    uint16_t *    src  = a->src + row;
    uint16_t *    marg = a->marg + row;
    uint8_t *     last = a->last + row;

    if (halve) {
        halve_counts(pair, src, marg, &a->seen[layer], E);
    }
    // the transition from the layer's previous visit to this one
    if (a->seen[layer] > 0) {
        // through the list of this visit's experts (k of n_expert)
        int32_t * idx = a->idx;
        const int32_t m = list_set(want, E, idx);
        for (int32_t e = 0; e < E; e++) {
            if (!last[e]) {
                continue;
            }
            src[e]++;
            uint16_t * to = pair + (size_t) e * (size_t) E;
            for (int32_t j = 0; j < m; j++) {
                to[idx[j]]++;
            }
        }
    }
    a->seen[layer]++;
    window_route(a, layer, want, k_prior, halve);
    int32_t k = 0;
    for (int32_t e = 0; e < E; e++) {
        last[e] = want[e] != 0;
        marg[e] += last[e];
        k += last[e];
    }
    if (k == 0) {
        memset(a->lift + row, MF_LIFT_NEUTRAL, (size_t) E);
        return;
    }

    // lift of every expert for the next visit, given this visit's set S:
    //   P(f | S) = mean over e in S of (pair[e][f] + w * P(f)) / (src[e] + w)
    //   P(f)     = (marg[f] + w * k / E) / (seen + w)
    // with w = MF_PRIOR_WEIGHT observations of the prior behind each estimate
    const float w    = MF_PRIOR_WEIGHT;
    float *     acc  = a->scratch;
    float       sinv = 0.0f;  // sum over e in S of 1 / (src[e] + w)
    memset(acc, 0, (size_t) E * sizeof *acc);
    for (int32_t e = 0; e < E; e++) {
        if (!last[e]) {
            continue;
        }
        const float      inv = 1.0f / ((float) src[e] + w);
        const uint16_t * to  = pair + (size_t) e * (size_t) E;
        sinv += inv;
        for (int32_t f = 0; f < E; f++) {
            acc[f] += (float) to[f] * inv;
        }
    }
    const float prior = (float) (k_prior > 0 ? k_prior : k) / (float) E;
    const float seen  = (float) a->seen[layer];
    for (int32_t f = 0; f < E; f++) {
        const float pm = ((float) marg[f] + w * prior) / (seen + w);
        const float pc = (acc[f] + w * pm * sinv) / (float) k;
        a->lift[row + (size_t) f] = lift_class(pc / pm);
    }
}
