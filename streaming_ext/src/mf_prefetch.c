// Prefetch: reading layer il + 1's predicted experts behind layer il's own reads, and the gate
// that decides whether a layer's predictions are worth reading.
//
// The routing callback (mf_callback.c) scores the last prediction against each route
// (mf_prefetch_score), then predicts the next layer (mf_predict.c, mf_history.c, or a predictor
// set with mf_streamer_set_predictor) and queues the admitted reads to the lanes as prefetches
// (mf_prefetch_next). A wrong guess costs a read and a frame, never a wrong result. Decode thread
// only. See docs/streamer.md, "Prefetch".
#include "mf_internal.h"

#include <math.h>
#include <string.h>

// The prefetch gate. A prefetched expert that its layer then routes was read early (its wait
// hidden behind compute); one it does not route was read for nothing (its bytes added to the
// token, its frame taken from the cache). With the disk the bound, reading pays only while more
// of the guesses read are routed than not. So every prediction is scored, read or not: of the
// experts it names that are not resident, how many the layer routes, each token's guesses against
// that token's own routing (a prompt's union routes most experts: against it even random guesses
// would look right). The counts are kept per layer and per rate class of the guessed expert
// (mf_reuse_rate_class: a guess of an expert its layer rarely routes is wrong far more often than
// one of a frequent expert, and the class is known before the guess is read), decayed with a
// half-life of MF_GATE_HALF_LIFE of the layer's routes. A guess whose cell's recent guesses were
// routed less than half the time is not read, until they are again. A cell with too few scored
// guesses is judged by its class over all layers, then by everything (a prompt visits each layer
// once: its first guesses would otherwise all be read unjudged); with no evidence anywhere it is
// open. The model's router guessing a replayed trace's routing (2% routed) closes every class
// after the first scored layer; guessing its own routing, it stays open.
#define MF_GATE_HALF_LIFE 16.0f
#define MF_GATE_EVIDENCE  8.0f  // decayed guesses before the gate judges
// A layer whose every class is closed is still predicted, to see its guesses turn right again,
// but a prediction costs its router matmul on the decode thread while the compute threads wait:
// it streams the next layer's router weights (n_expert x n_embd F32, 1 MiB a layer on
// Qwen3-30B-A3B) from memory. So a closed layer is predicted on one visit in MF_GATE_SAMPLE; its
// counts decay per scored visit, so it reopens after MF_GATE_SAMPLE times as many visits as an
// every-visit gate would take. A build with -DMF_GATE_SAMPLE=1 predicts every visit
// (docs/streamer.md, "Prefetch").
#ifndef MF_GATE_SAMPLE
#    define MF_GATE_SAMPLE 8
#endif

static bool judged_open(float guessed, float routed) {
    return 2.0f * routed >= guessed;
}

// which rate classes of `layer` are open: each judged by its own cell, else by its class over all
// layers, else by every guess (open with no evidence); one pass over the counts per prediction.
// Returns whether any is.
static bool gate_classes(const mf_streamer * s, int32_t layer, bool open[MF_RATE_CLASSES]) {
    float class_guessed[MF_RATE_CLASSES] = { 0 }, class_routed[MF_RATE_CLASSES] = { 0 };
    float guessed = 0.0f, routed = 0.0f;
    for (int32_t l = 0; l < s->n_layers; l++) {
        for (int32_t c = 0; c < MF_RATE_CLASSES; c++) {
            const size_t i = (size_t) l * MF_RATE_CLASSES + (size_t) c;
            class_guessed[c] += s->pf_guessed[i];
            class_routed[c] += s->pf_routed[i];
            guessed += s->pf_guessed[i];
            routed += s->pf_routed[i];
        }
    }
    bool any = false;
    for (int32_t c = 0; c < MF_RATE_CLASSES; c++) {
        const size_t cell = (size_t) layer * MF_RATE_CLASSES + (size_t) c;
        if (s->pf_guessed[cell] >= MF_GATE_EVIDENCE) {
            open[c] = judged_open(s->pf_guessed[cell], s->pf_routed[cell]);
        } else if (class_guessed[c] >= MF_GATE_EVIDENCE) {
            open[c] = judged_open(class_guessed[c], class_routed[c]);
        } else {
            open[c] = guessed < MF_GATE_EVIDENCE || judged_open(guessed, routed);
        }
        any = any || open[c];
    }
    return any;
}

static bool routes(const int32_t * ids, int64_t k, int32_t e) {
    for (int64_t i = 0; i < k; i++) {
        if (ids[i] == e) {
            return true;
        }
    }
    return false;
}

// layer il routes (its tokens' ids in route_ids, k a row): score the prediction made for it
void mf_prefetch_score(mf_streamer * s, int32_t il, int64_t rows, int64_t k) {
    if (s->pf_cand_layer != il) {
        return;
    }
    int32_t guessed[MF_RATE_CLASSES] = { 0 }, routed[MF_RATE_CLASSES] = { 0 };
    if (s->pf_rows_n > 0) {
        for (int64_t r = 0; r < s->pf_rows_n && r < rows; r++) {
            for (int64_t m = 0; m < s->pf_k; m++) {
                const int32_t e = s->pf_rows[r * s->pf_k + m];
                if (e >= 0 && s->pf_cand[e]) {
                    guessed[s->pf_class[e]]++;
                    routed[s->pf_class[e]] += routes(s->route_ids + r * k, k, e);
                }
            }
        }
    } else {  // a predictor of the union (the trace oracle): against the union
        for (int32_t e = 0; e < s->n_expert; e++) {
            if (s->pf_cand[e]) {
                guessed[s->pf_class[e]]++;
                routed[s->pf_class[e]] += s->want[e] != 0;
            }
        }
    }
    const float decay = exp2f(-1.0f / MF_GATE_HALF_LIFE);
    for (int32_t c = 0; c < MF_RATE_CLASSES; c++) {
        const size_t i  = (size_t) il * MF_RATE_CLASSES + (size_t) c;
        s->pf_guessed[i] = s->pf_guessed[i] * decay + (float) guessed[c];
        s->pf_routed[i]  = s->pf_routed[i] * decay + (float) routed[c];
    }
    s->pf_cand_layer = -1;
}

// reads layer il + 1's predicted experts behind layer il's own reads (see mf_predict.c); a route
// that cannot be predicted or admitted, or whose layer's gate is closed, is not prefetched
void mf_prefetch_next(mf_streamer * s, int32_t il, const struct ggml_tensor * ids) {
    // with the next layer all cached (a budget that holds the model) the prediction's router
    // matmul would be the whole of a cached token's cache time, for nothing
    if (mf_cache_layer_resident(s->cache, il + 1)) {
        return;
    }
    if (il + 1 >= s->n_layers || s->layers[il + 1].n_xt == 0) {
        return;
    }
    s->pf_rows_n     = 0;
    s->pf_cand_layer = -1;
    // the counts it judges by change only when a route is scored, before this call
    bool       classes_open[MF_RATE_CLASSES];
    const bool open = gate_classes(s, il + 1, classes_open);
    if (!open && s->pf_closed_visits[il + 1]++ % MF_GATE_SAMPLE != 0) {
        return;
    }
    int32_t n;
    ADD(s->st.predictions, 1);
    if (s->predictor) {
        memset(s->want_next, 0, (size_t) s->n_expert);
        n = s->predictor(s->predictor_data, il + 1, s->want_next);
    } else if (s->cfg.prefetch == MF_PREFETCH_HISTORY) {
        n = mf_history_predict(s, il, ids, s->want_next);
    } else {
        n = mf_predict_next(s, il, ids, s->want_next);
    }
    if (n <= 0) {
        return;
    }
    // every non-resident guess is scored; only those whose cell is open are read
    int32_t fresh = 0, read = 0;
    for (int32_t e = 0; e < s->n_expert; e++) {
        s->pf_cand[e] = s->want_next[e] && !mf_cache_is_resident(s->cache, il + 1, e);
        if (s->pf_cand[e]) {
            const int32_t cls = mf_reuse_rate_class(s->cache, il + 1, e);
            s->pf_class[e]    = (uint8_t) cls;
            s->want_next[e]   = classes_open[cls];
            fresh++;
            read += s->want_next[e];
        }
    }
    s->pf_cand_layer = fresh > 0 ? il + 1 : -1;
    if (read == 0 || mf_cache_prefetch(s->cache, il + 1, s->want_next) < 0) {
        return;
    }
    if (s->cache->n_load == 0 && s->cache->n_evict == 0) {
        return;
    }
    // a prefetch that cannot be queued is not an error: the lanes forgot what they did not queue
    (void) mf_lanes_queue_route(s, il + 1, false);
    memset(s->pf_mark, 0, (size_t) s->n_expert);
    for (int32_t i = 0; i < s->cache->n_load; i++) {
        s->pf_mark[s->cache->load[i]] = 1;
    }
    s->pf_layer = il + 1;
    ADD(s->st.prefetched, s->cache->n_load);
}

void mf_streamer_set_predictor(mf_streamer * s, mf_predictor fn, void * user_data) {
    s->predictor      = fn;
    s->predictor_data = fn ? user_data : NULL;
}
