// The cache's warmth between requests: preload (every expert read before the first token), a cold
// cache (mf_streamer_drop_cache), and warm start: the hot set a server saves, read back after a
// restart (mf_streamer_restore, server/lifecycle/hot_set.py).
//
// Each first waits for reads still in flight and forgets failed entries, so the cache changes
// with no read in flight; restore admits into the budget's free room only (mf_cache_admit_free),
// evicting nothing, and takes a failed read's error itself so that it fails no request. Decode
// thread, between llama_decode calls. See docs/streamer.md, "Warm start".
#include "mf_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

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
    mf_callback_stop_if_all_resident(s);
    return 0;
}

void mf_streamer_drop_cache(mf_streamer * s) {
    if (!s->cache) {
        return;
    }
    MF_SET(s->st.routing_off, 0);  // reads are needed again
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
    if (MF_GET(s->st.routing_off)) {
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
    mf_callback_stop_if_all_resident(s);
    return n;
}
