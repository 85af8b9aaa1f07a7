// After the model has loaded (mf_streamer_check_loaded): the layers, the expert memory, the cache
// and the scratch of routing and prediction.
//
// Every expert tensor registered while loading (mf_buft.c) is sorted into its layer in the order
// the matmuls consume it; then the budget decides where resident experts live: in the tensors
// themselves when it holds every expert (hold_all), else in frames of the largest entry's size
// (mf_frames.c), which the cache (mf_cache.c) counts every entry at. Called again, it rebuilds
// everything for the budget set then. The loading thread, before the first llama_decode; nothing
// is read here. Failures return -errno with a message in last_error.
#include "mf_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void mf_build_free_layers(mf_streamer * s) {
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
        if (mf_streamed_expert(s, s->ix.locs[i].name, &l)) {
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
    mf_build_free_layers(s);
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
    const int      rc   = mf_frames_init(&s->frames, frame, cap, &s->st.expert_memory_bytes, &s->st.frames_released);
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
    MF_SET(s->st.hold_all, s->hold_all);
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
    free(s->pf_class);
    free(s->pf_guessed);
    free(s->pf_routed);
    free(s->pf_closed_visits);
    const size_t cells  = (size_t) s->n_layers * MF_RATE_CLASSES;
    s->pf_cand          = calloc((size_t) s->n_expert, 1);
    s->pf_class         = calloc((size_t) s->n_expert, 1);
    s->pf_guessed       = calloc(cells, sizeof *s->pf_guessed);
    s->pf_routed        = calloc(cells, sizeof *s->pf_routed);
    s->pf_closed_visits = calloc((size_t) s->n_layers, sizeof *s->pf_closed_visits);
    s->pf_cand_layer    = -1;
    if (!s->pf_cand || !s->pf_class || !s->pf_guessed || !s->pf_routed || !s->pf_closed_visits) {
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
    free(s->share_rows);
    s->share_rows = calloc((size_t) s->n_expert, sizeof *s->share_rows);
    free(s->queue);
    // a slice is at most n_lanes + 1 chunks (mf_lanes.c); the queue grows if one is more
    s->queue_cap = (size_t) s->n_expert * MF_MAX_XT * (size_t) (s->cfg.lanes + 1) * 2;
    s->queue     = calloc(s->queue_cap, sizeof *s->queue);
    s->q_head    = 0;
    s->q_len     = 0;
    return s->want && s->share_rows && s->queue ? 0 : -ENOMEM;
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
