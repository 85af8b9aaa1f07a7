// The expert streamer: life cycle, the routing callback, prefetch, the ready hook, counters.
//
// The decode thread (the one calling llama_decode) runs mf_streamer_eval_cb: on each
// ffn_moe_topk-<il> node it reads the routed ids, asks the cache (mf_cache.c) what to load and
// evict, and hands that to the reader lanes (mf_lanes.c). It then predicts layer il + 1's experts
// (mf_predict.c) and queues their reads behind layer il's, so the disk keeps reading while layer
// il computes. Without overlap the decode thread waits for layer il's own reads before returning;
// with overlap it returns at once and the compute threads wait per slice in the ready hook, so the
// matmuls of ready experts run while the rest are read. A route first waits for every job of the
// previous one, so no read is in flight while the cache changes.
// The ready hook, installed always, tells each expert matmul where a slice is (its frame): the
// tensors' own reservations stay PROT_NONE, so a read other than through the hook faults, and the
// hook refuses a slice nobody loaded. When the budget holds every expert (hold_all), slices are
// read into the tensors themselves, and once all are READY the callback stops asking for the
// routing nodes (each asked node splits the graph in two).
// Nothing here aborts: a failure is recorded (mf_error.c), the next callback returns false, which
// stops the graph, and mf_streamer_take_error hands the error to Python. Failed entries are
// forgotten by the cache and read again on their next use. See docs/streamer.md.
#include "mf_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"

#define MF_BOUNCE_SIZE (8u << 20)  // the O_DIRECT chunk of dense reads at load (a multiple of any page size)

// ---------------------------------------------------------------- errors
int mf_streamer_take_error(mf_streamer * s, char * msg, size_t msg_size) {
    // a graph stopped by an error leaves prefetches in flight: their outcome belongs to this
    // request, not to the next one
    mf_lanes_wait_all(s);
    return mf_error_take(s, msg, msg_size);
}

const char * mf_streamer_last_error(const mf_streamer * s) {
    return s->last_error;
}

// ---------------------------------------------------------------- routing
// The prefetch gate. A prefetched expert that its layer then routes was read early (its wait
// hidden behind compute); one it does not route was read for nothing (its bytes added to the
// token, its frame taken from the cache). With the disk the bound, reading pays only while more
// of a layer's guesses are routed than not. So every prediction is scored, read or not: of the
// experts it names that are not resident, how many the layer routes, each token's guesses against
// that token's own routing (a prompt's union routes most experts: against it even random guesses
// would look right). A layer whose recent guesses (counts decayed with a half-life of
// MF_GATE_HALF_LIFE of its routes) were routed less than half the time is predicted but not read,
// until they are again. A layer with too few scored guesses of its own is judged by all layers'
// (a prompt visits each layer once: its first guesses would otherwise all be read unjudged); with
// none anywhere it is open. The model's router guessing a replayed trace's routing (2% routed) is
// closed after the first scored layer; guessing its own routing, it stays open.
#define MF_GATE_HALF_LIFE 16.0f
#define MF_GATE_EVIDENCE  8.0f  // decayed guesses before the gate judges

static bool gate_open(const mf_streamer * s, int32_t layer) {
    float guessed = s->pf_guessed[layer], routed = s->pf_routed[layer];
    if (guessed < MF_GATE_EVIDENCE) {
        guessed = routed = 0.0f;
        for (int32_t l = 0; l < s->n_layers; l++) {
            guessed += s->pf_guessed[l];
            routed += s->pf_routed[l];
        }
    }
    return guessed < MF_GATE_EVIDENCE || 2.0f * routed >= guessed;
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
static void score_prediction(mf_streamer * s, int32_t il, int64_t rows, int64_t k) {
    if (s->pf_cand_layer != il) {
        return;
    }
    int32_t guessed = 0, routed = 0;
    if (s->pf_rows_n > 0) {
        for (int64_t r = 0; r < s->pf_rows_n && r < rows; r++) {
            for (int64_t m = 0; m < s->pf_k; m++) {
                const int32_t e    = s->pf_rows[r * s->pf_k + m];
                const bool    cand = e >= 0 && s->pf_cand[e];
                guessed += cand;
                routed += cand && routes(s->route_ids + r * k, k, e);
            }
        }
    } else {  // a predictor of the union (the trace oracle): against the union
        for (int32_t e = 0; e < s->n_expert; e++) {
            guessed += s->pf_cand[e];
            routed += s->pf_cand[e] && s->want[e];
        }
    }
    const float decay = exp2f(-1.0f / MF_GATE_HALF_LIFE);
    s->pf_guessed[il] = s->pf_guessed[il] * decay + (float) guessed;
    s->pf_routed[il]  = s->pf_routed[il] * decay + (float) routed;
    s->pf_cand_layer  = -1;
}

// reads layer il + 1's predicted experts behind layer il's own reads (see mf_predict.c); a route
// that cannot be predicted or admitted, or whose layer's gate is closed, is not prefetched
static void prefetch_next(mf_streamer * s, int32_t il, const struct ggml_tensor * ids) {
    // with the next layer all cached (a budget that holds the model) the prediction's router
    // matmul would be the whole of a cached token's cache time, for nothing
    if (mf_cache_layer_resident(s->cache, il + 1)) {
        return;
    }
    if (il + 1 >= s->n_layers || s->layers[il + 1].n_xt == 0) {
        return;
    }
    int32_t n;
    s->pf_rows_n = 0;
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
    int32_t fresh = 0;
    for (int32_t e = 0; e < s->n_expert; e++) {
        s->pf_cand[e] = s->want_next[e] && !mf_cache_is_resident(s->cache, il + 1, e);
        fresh += s->pf_cand[e];
    }
    s->pf_cand_layer = fresh > 0 ? il + 1 : -1;
    if (fresh == 0 || !gate_open(s, il + 1) || mf_cache_prefetch(s->cache, il + 1, s->want_next) < 0) {
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

// hold_all: once every expert is READY, routing has nothing left to decide (no read, no eviction)
static void stop_routing_if_all_resident(mf_streamer * s) {
    if (!s->hold_all || atomic_load_explicit(&s->routing_off, memory_order_relaxed) ||
        atomic_load_explicit(&s->st.resident_bytes, memory_order_relaxed) < s->expert_bytes) {
        return;
    }
    mf_lanes_wait_all(s);
    mf_lanes_reap_failures(s);
    for (int32_t j = 0; j < s->n_xt; j++) {
        for (int32_t e = 0; e < s->xts[j]->n_expert; e++) {
            if (atomic_load_explicit(&s->xts[j]->state[e], memory_order_acquire) != MF_SLICE_READY) {
                return;  // a read failed or is pending: keep routing
            }
        }
    }
    atomic_store_explicit(&s->routing_off, true, memory_order_relaxed);
}

// one ffn_moe_topk-<il> node: makes the routed experts of layer il resident (queued), prefetches
// layer il + 1's predicted ones and, without overlap, waits for layer il's reads. Returns false to
// stop the graph (an error is recorded)
static bool route_layer(mf_streamer * s, int32_t il, const struct ggml_tensor * ids) {
    if (mf_error_pending(s)) {
        return false;  // stop the graph: the request fails with the recorded error
    }
    if (il < 0 || il >= s->n_layers || s->layers[il].n_xt == 0) {
        return true;  // a layer whose experts are not streamed
    }
    if (!s->cache) {
        mf_streamer_fail(s, -EINVAL, "streamer used before mf_streamer_check_loaded");
        return false;
    }
    const uint64_t t0     = mf_now_ns();
    uint64_t       waited = mf_lanes_wait_all(s);  // the previous layer's reads (normally long done)
    mf_lanes_reap_failures(s);
    stop_routing_if_all_resident(s);  // from the next node on; this route still counts its hits

    // each token's ids, row after row (the cache learns from them), and their union in want
    const size_t n_ids = (size_t) ids->ne[0] * (size_t) ids->ne[1];
    if (n_ids > s->route_ids_cap) {
        int32_t * grown = realloc(s->route_ids, n_ids * sizeof *grown);
        if (grown) {
            s->route_ids = grown;
        }
        int32_t * rows = grown ? realloc(s->pf_rows, n_ids * sizeof *rows) : NULL;
        if (!rows) {
            mf_streamer_fail(s, -ENOMEM, "no memory for the routing of %zu ids at layer %d", n_ids, (int) il);
            return false;
        }
        s->pf_rows       = rows;
        s->route_ids_cap = n_ids;
    }
    memset(s->want, 0, (size_t) s->n_expert);
    for (int64_t i1 = 0; i1 < ids->ne[1]; i1++) {
        for (int64_t i0 = 0; i0 < ids->ne[0]; i0++) {
            // a strided view: row i1 starts at data + i1*nb[1]
            const int32_t e = *(const int32_t *) ((const char *) ids->data + i1 * ids->nb[1] + i0 * ids->nb[0]);
            if (e < 0 || e >= s->n_expert) {
                mf_streamer_fail(s, -EINVAL, "layer %d routed to expert %d of %d", (int) il, (int) e, (int) s->n_expert);
                return false;
            }
            s->route_ids[i1 * ids->ne[0] + i0] = e;
            s->want[e]                         = 1;
        }
    }
    if (s->cfg.prefetch == MF_PREFETCH_HISTORY && mf_history_learn(s, il, ids) != 0) {
        mf_streamer_fail(s, -ENOMEM, "no memory to learn the routing of layer %d", (int) il);
        return false;
    }
    const int rc = mf_cache_route(s->cache, il, s->want, s->route_ids, (int32_t) ids->ne[1], (int32_t) ids->ne[0]);
    if (rc < 0) {
        mf_streamer_fail(s, rc, "layer %d: the routed experts do not fit the budget of %llu bytes", (int) il,
                         (unsigned long long) s->budget_bytes);
        return false;
    }
    const int qrc = mf_lanes_queue_route(s, il, true);
    if (qrc != 0) {
        mf_streamer_fail(s, qrc, "cannot queue the reads of layer %d: %s", (int) il, strerror(-qrc));
        return false;
    }
    score_prediction(s, il, ids->ne[1], ids->ne[0]);
    int32_t k = 0, prefetch_hits = 0;
    for (int32_t e = 0; e < s->n_expert; e++) {
        k += s->want[e];
        prefetch_hits += s->pf_layer == il && s->want[e] && s->pf_mark[e];
    }
    s->pf_layer = -1;
    ADD(s->st.routes, 1);
    ADD(s->st.hits, k - s->cache->n_load);
    ADD(s->st.misses, s->cache->n_load);
    ADD(s->st.prefetch_hits, prefetch_hits);
    if (s->cfg.prefetch) {
        prefetch_next(s, il, ids);
    }

    const uint64_t t1 = mf_now_ns();
    ADD(s->st.cache_ns, t1 - t0 - (waited > t1 - t0 ? t1 - t0 : waited));
    if (!s->cfg.overlap) {
        ADD(s->st.flash_wait_ns, waited + mf_lanes_wait_demand(s));
        return !mf_error_pending(s);
    }
    ADD(s->st.flash_wait_ns, waited);
    return true;
}

// ask-phase check of an expert matmul: every routed slice must be live (never computes on a hole)
static void check_expert_matmul(mf_streamer * s, const struct ggml_tensor * node) {
    const struct ggml_tensor * w   = node->src[0];
    const struct ggml_tensor * ids = node->src[2];
    if (!w || !ids || !w->buffer || w->buffer->buft != &s->expert_buft) {
        return;
    }
    const mf_xtensor * xt = mf_buffer_xtensor(w->buffer);
    if (!xt) {
        return;
    }
    for (int64_t i1 = 0; i1 < ids->ne[1]; i1++) {
        for (int64_t i0 = 0; i0 < ids->ne[0]; i0++) {
            const int32_t e = *(const int32_t *) ((const char *) ids->data + i1 * ids->nb[1] + i0 * ids->nb[0]);
            if (e >= 0 && e < xt->n_expert && !mf_slice_live(xt, e)) {
                ADD(s->st.violations, 1);
                mf_streamer_fail(s, -EFAULT, "expert %d of %s is used but was never loaded", (int) e, w->name);
            }
        }
    }
}

bool mf_streamer_eval_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    mf_streamer * s = user_data;
    if (atomic_load_explicit(&s->routing_off, memory_order_relaxed)) {
        return !ask;  // ask for nothing (no split); go on if asked to
    }
    if (ask) {
        if (t->op == GGML_OP_MUL_MAT_ID) {
            check_expert_matmul(s, t);
            return false;
        }
        return strncmp(t->name, "ffn_moe_topk-", 13) == 0;
    }
    if (strncmp(t->name, "ffn_moe_topk-", 13) != 0) {
        return true;
    }
    return route_layer(s, (int32_t) strtol(t->name + 13, NULL, 10), t);
}

// ---------------------------------------------------------------- the ready hook
// Where slice `expert` of src0 is, once it is READY: called by every compute thread before each
// expert matmul reads a slice. Without overlap the route has waited for the layer's reads, so the
// fast path answers; with overlap the thread waits here while the rest are read. NULL: skip the
// slice (nobody loaded it, or its read failed: the computation has failed and says so)
static const void * ready_hook(const struct ggml_tensor * src0, int64_t expert, void * user_data) {
    (void) user_data;  // stateless dispatch: the tensor's buffer says which streamer owns it
    const char * const          natural = (const char *) src0->data + expert * (int64_t) src0->nb[2];
    const ggml_backend_buffer_t buffer  = src0->buffer;
    if (!buffer || !mf_buft_is_expert(buffer->buft)) {
        return natural;
    }
    mf_xtensor * xt = mf_buffer_xtensor(buffer);
    if (!xt || expert < 0 || expert >= xt->n_expert) {
        return natural;  // (ggml routes only to experts the tensor has)
    }
    int st = atomic_load_explicit(&xt->state[expert], memory_order_acquire);
    if (st == MF_SLICE_READY) {
        return xt->slot[expert];  // the fast path: one atomic load
    }
    mf_streamer * s = xt->s;
    if (st == MF_SLICE_ABSENT) {
        ADD(s->st.violations, 1);
        mf_streamer_fail(s, -EFAULT, "expert %d of %s is used but was never loaded", (int) expert, xt->loc->name);
        return NULL;  // skip it: never compute on a slice nobody loaded
    }
    // stall time is the time at least one compute thread waits
    pthread_mutex_lock(&s->mu);
    if (s->n_waiting++ == 0) {
        s->wait_start_ns = mf_now_ns();
    }
    while ((st = atomic_load_explicit(&xt->state[expert], memory_order_acquire)) == MF_SLICE_LOADING) {
        pthread_cond_wait(&s->done_cv, &s->mu);
    }
    if (--s->n_waiting == 0) {
        ADD(s->st.flash_wait_ns, mf_now_ns() - s->wait_start_ns);
    }
    pthread_mutex_unlock(&s->mu);
    return st == MF_SLICE_READY ? xt->slot[expert] : NULL;
}

// ---------------------------------------------------------------- after the model has loaded
static void free_layers(mf_streamer * s) {
    for (int32_t l = 0; s->layers && l < s->n_layers; l++) {
        free(s->layers[l].frame);
    }
    free(s->layers);
    s->layers = NULL;
}

// consumption order of a layer's expert matmuls in build_moe_ffn: gate_up or gate, up, down
static int kind_rank(const char * name) {
    if (strstr(name, ".ffn_gate_up_exps.")) {
        return 0;
    }
    if (strstr(name, ".ffn_gate_exps.")) {
        return 1;
    }
    if (strstr(name, ".ffn_up_exps.")) {
        return 2;
    }
    return 3;
}

// every expert tensor of the file was registered by the expert buffer type; *n_layers: the layer
// slots they need (max layer index + 1). 0, or -EINVAL with last_error
static int check_experts_streamed(mf_streamer * s, int32_t * n_layers) {
    *n_layers = 0;
    for (int64_t i = 0; i < s->ix.n_locs; i++) {
        int32_t l = -1;
        if (mf_is_expert_name(s->ix.locs[i].name, &l)) {
            *n_layers     = l + 1 > *n_layers ? l + 1 : *n_layers;
            bool streamed = false;
            for (int32_t j = 0; j < s->n_xt && !streamed; j++) {
                streamed = s->xts[j]->loc == &s->ix.locs[i];
            }
            if (!streamed) {
                snprintf(s->last_error, sizeof s->last_error,
                         "expert tensor %s was not placed in the streamer's buffer type (check tensor_buft_overrides)",
                         s->ix.locs[i].name);
                return -EINVAL;
            }
        }
    }
    return 0;
}

// sorts the registered expert tensors into n_layers layers, in consumption order, and sets
// n_expert, the entries' bytes and the largest entry's. 0, -ENOMEM, or -EINVAL with last_error
// for a layout the streamer does not handle
static int build_layers(mf_streamer * s, int32_t n_layers) {
    free_layers(s);
    s->layers   = calloc((size_t) n_layers, sizeof *s->layers);
    s->n_layers = n_layers;
    if (!s->layers) {
        return -ENOMEM;
    }
    s->n_expert = 0;
    for (int32_t j = 0; j < s->n_xt; j++) {
        mf_xtensor * xt = s->xts[j];
        mf_layer *   L  = &s->layers[xt->layer];
        if (L->n_xt == MF_MAX_XT || (s->n_expert && xt->n_expert != s->n_expert)) {
            snprintf(s->last_error, sizeof s->last_error, "unsupported expert layout at %s", xt->loc->name);
            return -EINVAL;
        }
        s->n_expert = xt->n_expert;
        // insertion in consumption order
        int32_t pos = L->n_xt++;
        while (pos > 0 && kind_rank(L->xt[pos - 1]->loc->name) > kind_rank(xt->loc->name)) {
            L->xt[pos] = L->xt[pos - 1];
            pos--;
        }
        L->xt[pos] = xt;
        L->entry_bytes += xt->nb2;
    }
    s->entry_bytes_max = 0;
    for (int32_t l = 0; l < n_layers; l++) {
        const uint64_t bytes = s->layers[l].entry_bytes;
        s->entry_bytes_max   = bytes > s->entry_bytes_max ? bytes : s->entry_bytes_max;
    }
    return 0;
}

// Frames for the entries (see mf_frames.c): each of a layer's tensors gets the most pages any of
// its slices spans, at its own offset in the frame, and every frame has the largest layer's span.
// The cache counts every entry at the largest entry's bytes (build_expert_memory), so it holds at
// most budget / entry_bytes_max entries: that many frames, plus two.
static int build_frames(mf_streamer * s) {
    size_t  frame = 0;
    int32_t total = 0;  // entries of the layers with experts
    for (int32_t l = 0; l < s->n_layers; l++) {
        mf_layer * L = &s->layers[l];
        if (L->n_xt == 0) {
            continue;
        }
        size_t off = 0;
        for (int32_t j = 0; j < L->n_xt; j++) {
            size_t span = 0;  // the most pages any of its slices spans when read whole
            for (int32_t e = 0; e < L->xt[j]->n_expert; e++) {
                uint64_t a0, a1;
                mf_slice_pages(L->xt[j], e, s->page_size, &a0, &a1);
                span = a1 - a0 > span ? (size_t) (a1 - a0) : span;
            }
            L->xt[j]->frame_off = off;
            off += span;
        }
        frame = off > frame ? off : frame;
        total += s->n_expert;
        L->frame = malloc((size_t) s->n_expert * sizeof *L->frame);
        if (!L->frame) {
            return -ENOMEM;
        }
        for (int32_t e = 0; e < s->n_expert; e++) {
            L->frame[e] = -1;
        }
    }
    const uint64_t fill = s->budget_bytes / s->entry_bytes_max + 2;
    const int32_t  cap  = fill < (uint64_t) total ? (int32_t) fill : total;
    const int      rc   = mf_frames_init(&s->frames, frame, cap);
    snprintf(s->memory_note, sizeof s->memory_note,
             "experts in %d frames of %zu bytes (the largest entry, %llu bytes, in whole pages): at most %zu MiB",
             (int) cap, frame, (unsigned long long) s->entry_bytes_max, ((size_t) cap * frame) >> 20);
    return rc;
}

// hold_all: the tensors' reservations become the slices' home (read-write, huge pages asked for),
// and each slice's slot is its own address. 0, or -errno with last_error
static int place_experts_in_tensors(mf_streamer * s) {
    const int rc = mf_buft_hold_all(s);
    if (rc != 0) {
        snprintf(s->last_error, sizeof s->last_error, "cannot make expert memory read-write: %s", strerror(-rc));
        return rc;
    }
    for (int32_t j = 0; j < s->n_xt; j++) {
        for (int32_t e = 0; e < s->xts[j]->n_expert; e++) {
            s->xts[j]->slot[e] = s->xts[j]->data + (size_t) e * s->xts[j]->nb2;
        }
    }
    snprintf(s->memory_note, sizeof s->memory_note,
             "the budget holds every expert: slices read into place (huge pages where the kernel has them)");
    return 0;
}

// Decides where resident experts live, before any expert is read: in the tensors themselves when
// the budget holds every expert (hold_all, nothing is ever evicted), else in frames. Fills
// entry_bytes[l], what the cache counts for an entry of layer l. 0, or -errno with last_error
static int build_expert_memory(mf_streamer * s, uint64_t * entry_bytes) {
    s->hold_all = s->budget_bytes >= s->expert_bytes;
    if (s->hold_all) {
        for (int32_t l = 0; l < s->n_layers; l++) {
            entry_bytes[l] = s->layers[l].entry_bytes;
        }
        return place_experts_in_tensors(s);
    }
    mf_frames_free(&s->frames);  // (a zeroed struct the first time)
    const int rc = build_frames(s);
    if (rc != 0) {
        snprintf(s->last_error, sizeof s->last_error, "cannot map the experts' frames: %s", strerror(-rc));
        return rc;
    }
    // every entry takes a frame of the largest entry's size: the cache counts it so
    for (int32_t l = 0; l < s->n_layers; l++) {
        entry_bytes[l] = s->layers[l].entry_bytes ? s->entry_bytes_max : 0;
    }
    return 0;
}

// the cache under the budget; 0, or -errno with last_error
static int build_cache(mf_streamer * s, const uint64_t * entry_bytes) {
    mf_cache_free(s->cache);
    s->cache     = NULL;
    const int rc = mf_cache_new(s->n_layers, s->n_expert, entry_bytes, s->budget_bytes, s->cfg.policy, &s->cache);
    if (rc != 0) {
        snprintf(s->last_error, sizeof s->last_error, "cannot create the expert cache: %s", strerror(-rc));
    }
    return rc;
}

// the routers of the layers (mf_predict.c) and the prediction's scratch; 0 or -ENOMEM
static int build_prediction(mf_streamer * s) {
    mf_predict_resolve(s);
    int64_t n_embd = 1;
    for (int32_t l = 0; l < s->n_layers; l++) {
        const struct ggml_tensor * g = s->layers[l].router.gate;
        n_embd                       = g && g->ne[0] > n_embd ? g->ne[0] : n_embd;
    }
    free(s->pred_v);
    free(s->pred_scores);
    free(s->want_next);
    free(s->pf_mark);
    s->pred_v      = calloc((size_t) n_embd, sizeof *s->pred_v);
    s->pred_scores = calloc((size_t) s->n_expert, sizeof *s->pred_scores);
    s->want_next   = calloc((size_t) s->n_expert, 1);
    s->pf_mark     = calloc((size_t) s->n_expert, 1);
    s->pf_layer    = -1;
    free(s->pf_cand);
    free(s->pf_guessed);
    free(s->pf_routed);
    s->pf_cand       = calloc((size_t) s->n_expert, 1);
    s->pf_guessed    = calloc((size_t) s->n_layers, sizeof *s->pf_guessed);
    s->pf_routed     = calloc((size_t) s->n_layers, sizeof *s->pf_routed);
    s->pf_cand_layer = -1;
    if (!s->pf_cand || !s->pf_guessed || !s->pf_routed) {
        return -ENOMEM;
    }
    if (s->cfg.prefetch == MF_PREFETCH_HISTORY && mf_history_init(s) != 0) {
        return -ENOMEM;
    }
    return s->pred_v && s->pred_scores && s->want_next && s->pf_mark ? 0 : -ENOMEM;
}

// a route's scratch and the lanes' queue, sized for the largest route (every expert of a layer,
// all its tensors) twice over; 0 or -ENOMEM
static int build_route_buffers(mf_streamer * s) {
    free(s->want);
    s->want = calloc((size_t) s->n_expert, 1);
    free(s->queue);
    s->queue_cap = (size_t) s->n_expert * MF_MAX_XT * 2;
    s->queue     = calloc(s->queue_cap, sizeof *s->queue);
    s->q_head    = 0;
    s->q_len     = 0;
    return s->want && s->queue ? 0 : -ENOMEM;
}

int mf_streamer_check_loaded(mf_streamer * s) {
    if (s->budget_bytes == 0) {
        snprintf(s->last_error, sizeof s->last_error, "no expert budget set (mf_streamer_set_budget)");
        return -EINVAL;
    }
    int32_t n_layers = 0;
    int     rc       = check_experts_streamed(s, &n_layers);
    if (rc == 0) {
        rc = build_layers(s, n_layers);
    }
    if (rc != 0) {
        return rc;
    }
    uint64_t * entry_bytes = calloc((size_t) n_layers, sizeof *entry_bytes);
    if (!entry_bytes) {
        return -ENOMEM;
    }
    s->budget_max = s->budget_bytes;
    rc            = build_expert_memory(s, entry_bytes);
    if (rc == 0) {
        rc = build_cache(s, entry_bytes);
    }
    free(entry_bytes);
    if (rc == 0) {
        rc = build_prediction(s);
    }
    if (rc == 0) {
        rc = build_route_buffers(s);
    }
    return rc;
}

// ---------------------------------------------------------------- life cycle
static int fail_new(mf_streamer * s, int rc, char * last_error, size_t last_error_size) {
    if (last_error && last_error_size) {
        snprintf(last_error, last_error_size, "%s", s->last_error);
    }
    mf_streamer_free(s);
    return rc;
}

// sums the bytes of the file's expert tensors, in all and per layer: the largest layer's is the
// budget floor (a micro-batch may route to every expert of a layer). 0 or -ENOMEM
static int measure_experts(mf_streamer * s) {
    int32_t n_layers = 0;
    for (int64_t i = 0; i < s->ix.n_locs; i++) {
        int32_t l = -1;
        if (mf_is_expert_name(s->ix.locs[i].name, &l)) {
            n_layers = l + 1 > n_layers ? l + 1 : n_layers;
        }
    }
    uint64_t * per_layer = calloc((size_t) n_layers + 1, sizeof *per_layer);
    if (!per_layer) {
        return -ENOMEM;
    }
    for (int64_t i = 0; i < s->ix.n_locs; i++) {
        int32_t l = -1;
        if (mf_is_expert_name(s->ix.locs[i].name, &l)) {
            per_layer[l] += s->ix.locs[i].size;
            s->expert_bytes += s->ix.locs[i].size;
        }
    }
    for (int32_t l = 0; l < n_layers; l++) {
        s->layer_bytes_max = per_layer[l] > s->layer_bytes_max ? per_layer[l] : s->layer_bytes_max;
    }
    free(per_layer);
    return 0;
}

int mf_streamer_new(const mf_config * cfg, mf_streamer ** out, char * last_error, size_t last_error_size) {
    *out            = NULL;
    mf_streamer * s = calloc(1, sizeof *s);
    if (!s) {
        return -ENOMEM;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    pthread_cond_init(&s->done_cv, NULL);
    s->cfg       = *cfg;
    s->page_size = mf_page_size();
    if (!cfg->model_path || cfg->n_lanes < 1 || cfg->n_lanes > MF_MAX_LANES || cfg->reader < MF_READER_DIRECT ||
        cfg->reader > MF_READER_BUFFERED || cfg->policy < MF_POLICY_LRU || cfg->policy > MF_POLICY_NONE ||
        cfg->prefetch < MF_PREFETCH_OFF || cfg->prefetch > MF_PREFETCH_HISTORY || cfg->fault_errno < 0) {
        snprintf(s->last_error, sizeof s->last_error,
                 "invalid streamer configuration (lanes 1..%d, reader, policy, prefetch, model path)", MF_MAX_LANES);
        return fail_new(s, -EINVAL, last_error, last_error_size);
    }
    if (s->page_size == 0 || (s->page_size & (s->page_size - 1)) != 0 || MF_BOUNCE_SIZE % s->page_size != 0) {
        snprintf(s->last_error, sizeof s->last_error, "unsupported page size %zu", s->page_size);
        return fail_new(s, -EINVAL, last_error, last_error_size);
    }
    s->model_path     = strdup(cfg->model_path);
    s->cfg.model_path = s->model_path;
    if (!s->model_path) {
        return fail_new(s, -ENOMEM, last_error, last_error_size);
    }
    int rc = mf_index_open(&s->ix, s->model_path, cfg->reader == MF_READER_DIRECT, s->last_error, sizeof s->last_error);
    if (rc != 0) {
        return fail_new(s, rc, last_error, last_error_size);
    }
    if ((rc = measure_experts(s)) != 0) {
        return fail_new(s, rc, last_error, last_error_size);
    }
    if (s->expert_bytes == 0) {
        snprintf(s->last_error, sizeof s->last_error,
                 "%s has no expert tensors (blk.N.ffn_*_exps.weight): not a Mixture-of-Experts model", s->model_path);
        return fail_new(s, -EINVAL, last_error, last_error_size);
    }
    s->direct = cfg->reader == MF_READER_DIRECT;
    for (int32_t i = 0; i < s->ix.n_files; i++) {
        s->direct &= s->ix.files[i].fd_direct >= 0;
    }
    if (s->direct) {
        if (posix_memalign(&s->bounce, s->page_size, MF_BOUNCE_SIZE) == 0) {
            s->bounce_size = MF_BOUNCE_SIZE;
        } else {
            s->bounce = NULL;  // dense tensors are then read buffered
        }
    }
    mf_buft_init(s);
    if ((rc = mf_lanes_start(s, cfg->n_lanes)) != 0) {
        snprintf(s->last_error, sizeof s->last_error, "cannot start reader lane: %s", strerror(-rc));
        return fail_new(s, rc, last_error, last_error_size);
    }
    // always: the hook says where each slice is (its frame). A stateless dispatcher, safe to leave
    // installed, and shared by every streamer
    ggml_cpu_set_mul_mat_id_ready_hook(ready_hook, NULL);
    *out = s;
    return 0;
}

void mf_streamer_free(mf_streamer * s) {
    if (!s) {
        return;
    }
    mf_lanes_stop(s);
    mf_buft_free_xtensors(s);
    free_layers(s);
    free(s->queue);
    free(s->want);
    free(s->route_ids);
    free(s->pf_rows);
    free(s->noted);
    free(s->pred_v);
    free(s->pred_scores);
    free(s->want_next);
    mf_history_free(s);
    free(s->pf_mark);
    free(s->pf_cand);
    free(s->pf_guessed);
    free(s->pf_routed);
    free(s->bounce);
    mf_cache_free(s->cache);
    mf_frames_free(&s->frames);
    mf_index_close(&s->ix);
    free(s->model_path);
    pthread_cond_destroy(&s->work_cv);
    pthread_cond_destroy(&s->done_cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int mf_streamer_set_budget(mf_streamer * s, uint64_t budget_bytes) {
    if (budget_bytes < s->layer_bytes_max) {
        snprintf(s->last_error, sizeof s->last_error,
                 "budget of %llu bytes is smaller than one layer's experts (%llu bytes), which a prompt can route to",
                 (unsigned long long) budget_bytes, (unsigned long long) s->layer_bytes_max);
        return -EINVAL;
    }
    if (!s->cache) {
        s->budget_bytes = budget_bytes;
        atomic_store_explicit(&s->st.budget_bytes, budget_bytes, memory_order_relaxed);
        return 0;
    }
    if (s->hold_all) {
        snprintf(s->last_error, sizeof s->last_error,
                 "a budget holding every expert keeps them in the tensors' own memory: it cannot move");
        return -EBUSY;
    }
    if (budget_bytes > s->budget_max) {
        snprintf(s->last_error, sizeof s->last_error,
                 "budget of %llu bytes is over the %llu bytes the expert memory was built for",
                 (unsigned long long) budget_bytes, (unsigned long long) s->budget_max);
        return -ERANGE;
    }
    // reads still in flight (a stopped graph's prefetches) land before their frames move
    mf_lanes_wait_all(s);
    mf_lanes_reap_failures(s);
    if (mf_cache_set_budget(s->cache, budget_bytes) > 0) {
        mf_lanes_apply_evictions(s);
        s->pf_layer = -1;
    }
    if (budget_bytes < s->budget_bytes) {
        mf_frames_trim(&s->frames);  // the free frames' pages go back to the kernel
    }
    s->budget_bytes = budget_bytes;
    atomic_store_explicit(&s->st.budget_bytes, budget_bytes, memory_order_relaxed);
    return 0;
}

ggml_backend_buffer_type_t mf_streamer_expert_buft(mf_streamer * s) {
    return &s->expert_buft;
}

ggml_backend_buffer_type_t mf_streamer_dense_buft(mf_streamer * s) {
    return &s->dense_buft;
}

ggml_backend_buffer_type_t mf_streamer_rows_buft(mf_streamer * s) {
    return &s->rows_buft;
}

void mf_streamer_get_stats(const mf_streamer * s, mf_stats * out) {
#define LOAD(c) atomic_load_explicit(&s->st.c, memory_order_relaxed)
    out->routes              = LOAD(routes);
    out->hits                = LOAD(hits);
    out->misses              = LOAD(misses);
    out->evictions           = LOAD(evictions);
    out->bytes_read          = LOAD(bytes_read);
    out->reads               = LOAD(reads);
    out->flash_wait_ns       = LOAD(flash_wait_ns);
    out->cache_ns            = LOAD(cache_ns);
    out->read_ns             = LOAD(read_ns);
    out->dense_bytes         = LOAD(dense_bytes);
    out->resident_bytes      = LOAD(resident_bytes);
    out->violations          = LOAD(violations);
    out->errors              = LOAD(errors);
    out->direct_io           = s->direct ? 1 : 0;
    out->prefetched          = LOAD(prefetched);
    out->prefetch_hits       = LOAD(prefetch_hits);
    out->mapped_bytes        = LOAD(mapped_bytes);
    out->hold_all            = s->hold_all ? 1 : 0;
    out->routing_off         = atomic_load_explicit(&s->routing_off, memory_order_relaxed) ? 1 : 0;
    out->expert_memory_bytes = atomic_load_explicit(&s->frames.populated, memory_order_relaxed);
    out->frames_released     = atomic_load_explicit(&s->frames.released, memory_order_relaxed);
    out->budget_bytes        = LOAD(budget_bytes);
    out->restored            = LOAD(restored);
#undef LOAD
}

int mf_streamer_preload(mf_streamer * s) {
    if (!s->cache) {
        snprintf(s->last_error, sizeof s->last_error, "preload before mf_streamer_check_loaded");
        return -EINVAL;
    }
    if (s->budget_bytes < s->expert_bytes) {
        snprintf(s->last_error, sizeof s->last_error,
                 "preload needs a budget holding every expert (%llu bytes), not %llu",
                 (unsigned long long) s->expert_bytes, (unsigned long long) s->budget_bytes);
        return -ENOSPC;
    }
    // every layer routes to all its experts once: the lanes read them at full depth
    for (int32_t l = 0; l < s->n_layers; l++) {
        if (s->layers[l].n_xt == 0) {
            continue;
        }
        mf_lanes_wait_all(s);
        memset(s->want, 1, (size_t) s->n_expert);
        int rc = mf_cache_route(s->cache, l, s->want, NULL, 0, 0);  // no token's routing: nothing to learn
        if (rc >= 0) {
            rc = mf_lanes_queue_route(s, l, true);
        }
        if (rc < 0) {
            snprintf(s->last_error, sizeof s->last_error, "preload of layer %d failed: %s", (int) l, strerror(-rc));
            return rc;
        }
    }
    mf_lanes_wait_all(s);
    mf_lanes_reap_failures(s);
    char msg[MF_ERR_LEN];
    const int rc = mf_streamer_take_error(s, msg, sizeof msg);
    if (rc != 0) {
        snprintf(s->last_error, sizeof s->last_error, "%s", msg);
        return rc;
    }
    stop_routing_if_all_resident(s);
    return 0;
}

void mf_streamer_drop_cache(mf_streamer * s) {
    if (!s->cache) {
        return;
    }
    atomic_store_explicit(&s->routing_off, false, memory_order_relaxed);  // reads are needed again
    mf_lanes_wait_all(s);
    mf_lanes_reap_failures(s);
    mf_cache_evict_all(s->cache);
    mf_lanes_apply_evictions(s);
    s->pf_layer = -1;
    mf_frames_trim(&s->frames);  // a cold cache holds no memory
}

int32_t mf_streamer_hot_set(mf_streamer * s, int32_t * out, uint32_t * uses, int32_t max) {
    if (!s->cache) {
        return 0;
    }
    const int32_t n = mf_cache_hot_set(s->cache, out, uses, max);
    if (n < 0) {
        snprintf(s->last_error, sizeof s->last_error, "no memory to rank the resident experts");
    }
    return n;
}

int32_t mf_streamer_restore(mf_streamer * s, int32_t layer, const uint8_t * want, const uint32_t * uses) {
    if (!s->cache || layer < 0 || layer >= s->n_layers || s->layers[layer].n_xt == 0) {
        snprintf(s->last_error, sizeof s->last_error, "layer %d has no streamed experts%s", (int) layer,
                 s->cache ? "" : " (the model is not loaded)");
        return -EINVAL;
    }
    if (atomic_load_explicit(&s->routing_off, memory_order_relaxed)) {
        return 0;  // every expert is resident
    }
    mf_lanes_wait_all(s);
    mf_lanes_reap_failures(s);
    if (mf_error_pending(s)) {
        return 0;  // an error of the last request, which it takes itself
    }
    const int32_t n = mf_cache_admit_free(s->cache, layer, want, uses);
    if (n == 0) {
        return 0;
    }
    int rc = mf_lanes_queue_route(s, layer, false);
    mf_lanes_wait_all(s);
    mf_lanes_reap_failures(s);
    char msg[MF_ERR_LEN];
    const int failed = mf_error_take(s, msg, sizeof msg);
    rc               = failed ? failed : rc;
    if (rc != 0) {
        snprintf(s->last_error, sizeof s->last_error, "reading back experts of layer %d: %.400s", (int) layer,
                 failed ? msg : strerror(-rc));
        return rc;
    }
    ADD(s->st.restored, n);
    stop_routing_if_all_resident(s);
    return n;
}

uint64_t mf_streamer_layer_bytes(const mf_streamer * s) {
    return s->layer_bytes_max;
}

uint64_t mf_streamer_expert_bytes(const mf_streamer * s) {
    return s->expert_bytes;
}

uint64_t mf_streamer_tensor_bytes(const mf_streamer * s, const char * name) {
    const mf_loc * loc = name ? mf_index_find(&s->ix, name) : NULL;
    return loc ? loc->size : 0;
}

int32_t mf_streamer_n_moe_layers(const mf_streamer * s) {
    int32_t n = 0;
    for (int32_t l = 0; l < s->n_layers; l++) {
        n += s->layers[l].n_xt > 0;
    }
    return n;
}

const char * mf_streamer_memory_note(const mf_streamer * s) {
    return s->memory_note;
}

int32_t mf_streamer_n_expert(const mf_streamer * s) {
    return s->n_expert;
}
