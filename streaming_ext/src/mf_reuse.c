// The LAYER policy's reuse model: the value of keeping each resident entry, learned online.
//
// Its chances come from the hazard h(age, frequency class, lift class) of a route at the entry's
// layer's next visit, estimated from every expert of every route, and beyond that the entry's own
// recent routing rate, drawn towards its layer's mean by empirical Bayes and lifted by the
// layer's recent routing (mf_affinity.c). Evidence is halved every MF_WINDOW visits, so the model
// follows drift. mf_reuse_learn_token takes one token's routing of a layer as a visit;
// mf_reuse_score gives every resident entry its keep value per byte (mf_cache.c picks the
// lowest). State lives in mf_cache; one thread at a time (the cache's).
// The model, its derivation and what was measured: docs/streamer.md, "Cache policy".
#include "mf_internal.h"

#include <float.h>

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
// on distance.
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
// h of a route at that visit and p at every later one (docs/streamer.md): the better of holding it
// for the next visit, h / d, and until its next use, 1 / (d + L * (1 - h) / p)
static float keep_value(float h, float p, int32_t d, int32_t L) {
    const float next = h / (float) d;
    // p = 0 (an expert the router never picks, on a layer whose experts differ a lot): no later use
    const float use = p > 0.0f ? 1.0f / ((float) d + (float) L * (1.0f - h) / p) : 0.0f;
    return next > use ? next : use;
}

// scores every resident entry (keep value per byte); pinned ones can't be victims
void mf_reuse_score(mf_cache * c, int32_t cur) {
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

// one token's routing of `layer` as evidence (LAYER): a visit of the layer
void mf_reuse_learn_token(mf_cache * c, int32_t layer, const uint8_t * want) {
    int32_t k = 0;
    for (int32_t e = 0; e < c->n_expert; e++) {
        k += want[e] != 0;
    }
    // a token routes k experts; the largest k seen is the prior's numerator
    if (k > c->k_seen) {
        c->k_seen = k;
    }
    learn(c, layer, want);
    // the hazards follow the model once per layer cycle: fresh enough, and cheap per route
    if (c->model_age < 0 || ++c->model_age >= c->n_layer) {
        refresh_model(c);
    }
}

int32_t mf_reuse_rate_class(const mf_cache * c, int32_t layer, int32_t e) {
    const float norm = c->rates[layer].norm;
    if (norm <= 0.0f) {
        return MF_RATE_UNKNOWN;
    }
    const float rate = c->recent[(size_t) layer * (size_t) c->n_expert + (size_t) e] / norm;
    const float u    = prior_rate(c);
    return rate < 0.5f * u  ? MF_RATE_RARE :
           rate < u         ? MF_RATE_BELOW :
           rate < 2.0f * u  ? MF_RATE_ABOVE :
                              MF_RATE_FREQUENT;
}
