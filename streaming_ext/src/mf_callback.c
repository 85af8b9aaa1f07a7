// The two callbacks ggml makes while a graph runs: the eval callback (routing) and the ready hook.
//
// The decode thread (the one calling llama_decode) runs mf_streamer_eval_cb: on each
// ffn_moe_topk-<il> node it reads the routed ids, asks the cache (mf_cache.c) what to load and
// evict, and hands that to the reader lanes (mf_lanes.c). It then predicts layer il + 1's experts
// (mf_prefetch.c) and queues their reads behind layer il's, so the disk keeps reading while layer
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
// Thread contract: mf_streamer_eval_cb on the decode thread only; the ready hook on every compute
// thread (it waits under s->mu).
#include "mf_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

// hold_all: once every expert is READY, routing has nothing left to decide (no read, no eviction)
void mf_callback_stop_if_all_resident(mf_streamer * s) {
    if (!s->hold_all || MF_GET(s->st.routing_off) ||
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
    MF_SET(s->st.routing_off, 1);
}

// layer il's reads for this node's rows (route_ids, k a row), shared among the KV sequences of the
// decode call (mf_streamer_begin_batch): an expert read on demand, or read ahead and routed, splits
// its bytes evenly among the rows routing it; one read ahead and not routed (a wrong guess, read
// for these tokens) among all the rows. Rows the call did not announce count as unmapped. Call
// after the demand reads are queued, before the next layer's prefetch replaces pf_mark.
static void share_reads(mf_streamer * s, int32_t il, int64_t rows, int64_t k) {
    const mf_cache * c      = s->cache;
    const bool       ahead  = s->pf_layer == il;
    const double     bytes  = (double) c->entry_bytes[il];
    const bool       mapped = s->batch.n_tokens > 0 && mf_batch_node(&s->batch, il, s->n_layers, rows) == 0;
    memset(s->share_rows, 0, (size_t) s->n_expert * sizeof *s->share_rows);
    for (int64_t i = 0; i < rows * k; i++) {
        s->share_rows[s->route_ids[i]]++;
    }
    double guessed = 0.0, read = bytes * c->n_load;  // of wrong guesses; of everything read
    for (int32_t e = 0; ahead && e < s->n_expert; e++) {
        guessed += s->pf_mark[e] && !s->share_rows[e] ? bytes : 0.0;
        read += s->pf_mark[e] && s->share_rows[e] ? bytes : 0.0;
    }
    if (read == 0.0 && guessed == 0.0) {
        return;
    }
    if (!mapped || rows == 0) {
        s->unmapped_bytes += read + guessed;
        return;
    }
    // the loads of this route, marked by a negative count (restored below)
    for (int32_t j = 0; j < c->n_load; j++) {
        s->share_rows[c->load[j]] = -s->share_rows[c->load[j]];
    }
    for (int64_t r = 0; r < rows; r++) {
        double * mine = &s->seq_bytes[s->batch.seq[s->batch.rows[r]]];
        *mine += guessed / (double) rows;
        for (int64_t slot = 0; slot < k; slot++) {
            const int32_t e = s->route_ids[r * k + slot];
            const int32_t n = s->share_rows[e];
            if (n < 0 || (ahead && s->pf_mark[e])) {
                *mine += bytes / (double) (n < 0 ? -n : n);
            }
        }
    }
    for (int32_t j = 0; j < c->n_load; j++) {
        s->share_rows[c->load[j]] = -s->share_rows[c->load[j]];
    }
}

// one ffn_moe_topk-<il> node: makes the routed experts of layer il resident (queued), prefetches
// layer il + 1's predicted ones and, without overlap, waits for layer il's reads. Returns false to
// stop the graph (an error is recorded)
static bool route_layer(mf_streamer * s, int32_t il, struct ggml_tensor * ids) {
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
    mf_callback_stop_if_all_resident(s);  // from the next node on; this route still counts its hits

    // each token's ids, row after row (the cache learns from them), and their union in want
    const size_t n_ids = (size_t) ids->ne[0] * (size_t) ids->ne[1];
    if (n_ids > s->route_ids_cap) {
        int32_t * grown = realloc(s->route_ids, n_ids * sizeof *grown);
        if (grown) {
            s->route_ids = grown;
        }
        int32_t * rows = grown ? realloc(s->pf_rows, n_ids * sizeof *rows) : NULL;
        if (rows) {
            s->pf_rows = rows;
        }
        uint8_t * mask = rows ? realloc(s->skip_mask, n_ids) : NULL;
        if (!mask) {
            mf_streamer_fail(s, -ENOMEM, "no memory for the routing of %zu ids at layer %d", n_ids, (int) il);
            return false;
        }
        s->skip_mask     = mask;
        s->route_ids_cap = n_ids;
    }
    if (s->cfg.skip_below > 0.0f) {
        const int64_t dropped = mf_skip_route(s, il, ids);  // lossy: see mf_skip.c
        if (dropped < 0) {
            return false;
        }
        ADD(s->st.skipped, (uint64_t) dropped);
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
    share_reads(s, il, ids->ne[1], ids->ne[0]);
    mf_prefetch_score(s, il, ids->ne[1], ids->ne[0]);
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
        mf_prefetch_next(s, il, ids);
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
    mf_streamer * s        = user_data;
    const bool    skipping = s->cfg.skip_below > 0.0f;  // lossy (mf_skip.c): watch the weights too
    if (MF_GET(s->st.routing_off)) {
        return !ask;  // ask for nothing (no split); go on if asked to
    }
    if (ask) {
        if (t->op == GGML_OP_MUL_MAT_ID) {
            check_expert_matmul(s, t);
            return false;
        }
        // a layer on an RPC helper: its nodes' data is not here, and nothing of it is streamed
        const char * dash = strrchr(t->name, '-');
        if (s->cfg.layers > 0 && dash && strtol(dash + 1, NULL, 10) >= s->cfg.layers) {
            return false;
        }
        return strncmp(t->name, MF_TOPK_PREFIX, MF_TOPK_PREFIX_LEN) == 0 ||
               (skipping && (strncmp(t->name, MF_WEIGHTS_PREFIX, MF_WEIGHTS_PREFIX_LEN) == 0 ||
                             strncmp(t->name, MF_WEIGHTS_SOFTMAX, strlen(MF_WEIGHTS_SOFTMAX)) == 0));
    }
    if (skipping && strncmp(t->name, MF_WEIGHTS_PREFIX, MF_WEIGHTS_PREFIX_LEN) == 0) {
        mf_skip_weights(s, (int32_t) strtol(t->name + MF_WEIGHTS_PREFIX_LEN, NULL, 10), t);
        return true;
    }
    if (skipping && strncmp(t->name, MF_WEIGHTS_SOFTMAX, strlen(MF_WEIGHTS_SOFTMAX)) == 0) {
        mf_streamer_fail(s, -ENOTSUP, "skip_below: %s re-normalises the weights by a softmax", t->name);
        return false;
    }
    if (strncmp(t->name, MF_TOPK_PREFIX, MF_TOPK_PREFIX_LEN) != 0) {
        return true;
    }
    return route_layer(s, (int32_t) strtol(t->name + MF_TOPK_PREFIX_LEN, NULL, 10), t);
}

// ---------------------------------------------------------------- the ready hook
// Where slice `expert` of src0 is, once it is READY: called by every compute thread before each
// expert matmul reads a slice. Without overlap the route has waited for the layer's reads, so the
// fast path answers; with overlap the thread waits here while the rest are read. NULL: skip the
// slice (nobody loaded it, or its read failed: the computation has failed and says so)
const void * mf_callback_ready_hook(const struct ggml_tensor * src0, int64_t expert, void * user_data) {
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

