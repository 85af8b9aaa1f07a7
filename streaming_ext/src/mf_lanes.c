// Reader lanes and the memory of expert slices: how a route's loads and evictions are carried out.
//
// mf_lanes_queue_route turns the cache's decision (mf_cache.c) into memory and jobs on the decode
// thread: evicted entries turn ABSENT and give their frames back (mf_frames.c: bookkeeping, no
// system call), then each load takes a frame, its slices' addresses in it are noted (xt->slot,
// what the ready hook hands the matmul) and they turn LOADING, and the reads are queued. N lanes
// pop jobs from one FIFO (one mutex, work_cv), read unlocked, and mark each slice READY or FAILED
// under the mutex, broadcasting done_cv. No frame changes hands while a read into it is in flight:
// a route first waits for every job of the one before. Demand reads (the running layer's) are
// counted apart from prefetches so a layer waits only for its own. Lanes block all signals (the
// host process handles them) and stop by flag + broadcast + join. Everything but the lanes
// themselves runs on the decode thread.
#include "mf_internal.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool mf_slice_live(const mf_xtensor * xt, int64_t e) {
    const int st = atomic_load_explicit(&xt->state[e], memory_order_acquire);
    return st == MF_SLICE_LOADING || st == MF_SLICE_READY;
}

// the entry (layer L, expert e) is no longer resident: its slices turn ABSENT and its frame is free
static void drop_entry(mf_streamer * s, mf_layer * L, int32_t e) {
    for (int32_t j = 0; j < L->n_xt; j++) {
        atomic_store_explicit(&L->xt[j]->state[e], MF_SLICE_ABSENT, memory_order_release);
        if (!s->hold_all) {
            L->xt[j]->slot[e] = NULL;
        }
    }
    if (L->frame && L->frame[e] >= 0) {
        mf_frames_give(&s->frames, L->frame[e]);
        L->frame[e] = -1;
    }
}

// gives entry (L, e) a frame and notes where its slices lie in it; false when no frame is left
static bool place_entry(mf_streamer * s, mf_layer * L, int32_t e) {
    if (s->hold_all) {
        return true;  // slots are the tensors' own addresses (set at mf_streamer_check_loaded)
    }
    const int32_t id = mf_frames_take(&s->frames);
    if (id < 0) {
        return false;
    }
    L->frame[e]      = id;
    char * const frm = mf_frames_addr(&s->frames, id);
    for (int32_t j = 0; j < L->n_xt; j++) {
        mf_xtensor * xt = L->xt[j];
        // the slice's first byte sits at its file offset's place within a page, as in the tensor
        // itself: a page-aligned O_DIRECT read brings it in place
        const uint64_t f0 = xt->loc->offset + (uint64_t) e * xt->nb2;
        xt->slot[e]       = frm + xt->frame_off + (size_t) (f0 & (s->page_size - 1));
    }
    return true;
}

// ---------------------------------------------------------------- reader lanes
// one job: slice e of xt, into its slot
static int read_slice(mf_streamer * s, mf_xtensor * xt, int32_t e) {
    const size_t len = (size_t) xt->nb2;
    if (s->cfg.skip_expert > 0 && e == s->cfg.skip_expert - 1) {
        return 0;  // negative control: the slice keeps whatever its frame held (see mf_config.skip_expert)
    }
    if (s->cfg.fault_errno) {
        const uint64_t before = atomic_fetch_add(&s->expert_bytes_read_total, len);
        if (before + len > s->cfg.fault_after_bytes) {
            return -s->cfg.fault_errno;
        }
    }
    // the slot is congruent to the file offset modulo the page (place_entry, xbuf_init_tensor)
    return mf_read_in_place(&s->ix.files[xt->loc->file], s->direct, s->page_size, xt->slot[e],
                            xt->loc->offset + (uint64_t) e * xt->nb2, len);
}

// a reader lane: pops jobs, reads unlocked, marks the slices READY or FAILED under the mutex
static void * lane_main(void * arg) {
    mf_streamer * s = arg;
    sigset_t      all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);

    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && s->q_len == 0) {
            pthread_cond_wait(&s->work_cv, &s->mu);
        }
        if (s->stop) {
            break;
        }
        const mf_job job = s->queue[s->q_head];
        s->q_head        = (s->q_head + 1) % s->queue_cap;
        s->q_len--;
        pthread_mutex_unlock(&s->mu);

        const uint64_t t0 = mf_now_ns();
        const int      rc = read_slice(s, job.xt, job.expert);
        ADD(s->st.read_ns, mf_now_ns() - t0);
        ADD(s->st.reads, 1);

        pthread_mutex_lock(&s->mu);
        if (rc == 0) {
            ADD(s->st.bytes_read, job.xt->nb2);
            atomic_store_explicit(&job.xt->state[job.expert], MF_SLICE_READY, memory_order_release);
        } else {
            char msg[MF_ERR_LEN];
            snprintf(msg, sizeof msg, "reading expert %d of %s from %s failed: %s", (int) job.expert,
                     job.xt->loc->name, s->ix.files[job.xt->loc->file].path,
                     rc == -ENODATA ? "the file ended early (it changed size while open)" : strerror(-rc));
            mf_error_record_locked(s, rc, msg);
            ADD(s->st.errors, 1);
            atomic_store_explicit(&job.xt->state[job.expert], MF_SLICE_FAILED, memory_order_release);
            s->n_failed++;
        }
        s->outstanding--;
        s->demand_left -= job.demand ? 1 : 0;
        pthread_cond_broadcast(&s->done_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int mf_lanes_start(mf_streamer * s, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        const int rc = pthread_create(&s->lanes[i], NULL, lane_main, s);
        if (rc != 0) {
            return -rc;
        }
        s->n_lanes_started++;
    }
    return 0;
}

void mf_lanes_stop(mf_streamer * s) {
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    for (int32_t i = 0; i < s->n_lanes_started; i++) {
        pthread_join(s->lanes[i], NULL);
    }
    s->n_lanes_started = 0;
}

// waits until *count (a job counter under s->mu) drops to zero; returns the nanoseconds waited
static uint64_t wait_zero(mf_streamer * s, const size_t * count) {
    pthread_mutex_lock(&s->mu);
    uint64_t waited = 0;
    if (*count) {
        const uint64_t t0 = mf_now_ns();
        while (*count) {
            pthread_cond_wait(&s->done_cv, &s->mu);
        }
        waited = mf_now_ns() - t0;
    }
    pthread_mutex_unlock(&s->mu);
    return waited;
}

uint64_t mf_lanes_wait_all(mf_streamer * s) {
    return wait_zero(s, &s->outstanding);
}

uint64_t mf_lanes_wait_demand(mf_streamer * s) {
    return wait_zero(s, &s->demand_left);
}

// forgets entries whose reads failed so that their next use reads them again (decode thread,
// no read in flight); the scan runs only when a lane has marked a slice FAILED since the last one
void mf_lanes_reap_failures(mf_streamer * s) {
    pthread_mutex_lock(&s->mu);
    const bool any = s->n_failed != 0;
    s->n_failed    = 0;
    pthread_mutex_unlock(&s->mu);
    if (!any) {
        return;
    }
    for (int32_t l = 0; l < s->n_layers; l++) {
        mf_layer * L = &s->layers[l];
        for (int32_t e = 0; e < s->n_expert && L->n_xt; e++) {
            bool failed = false;
            for (int32_t j = 0; j < L->n_xt; j++) {
                failed |= atomic_load(&L->xt[j]->state[e]) == MF_SLICE_FAILED;
            }
            if (!failed) {
                continue;
            }
            drop_entry(s, L, e);
            if (s->cache->resident[(size_t) l * (size_t) s->n_expert + (size_t) e]) {
                atomic_fetch_sub(&s->st.resident_bytes, L->entry_bytes);
            }
            mf_cache_forget(s->cache, l, e);
        }
    }
}

// ---------------------------------------------------------------- queueing a route
// the cache's last evictions: bookkeeping only (no read is in flight, the computation is paused)
void mf_lanes_apply_evictions(mf_streamer * s) {
    for (int32_t i = 0; i < s->cache->n_evict; i++) {
        mf_layer * L = &s->layers[s->cache->evict[i] / s->n_expert];
        drop_entry(s, L, s->cache->evict[i] % s->n_expert);
        atomic_fetch_sub(&s->st.resident_bytes, L->entry_bytes);
    }
    ADD(s->st.evictions, s->cache->n_evict);
}

static void push_job_locked(mf_streamer * s, mf_xtensor * xt, int32_t e, bool demand) {
    s->queue[(s->q_head + s->q_len) % s->queue_cap] = (mf_job){ .xt = xt, .expert = e, .demand = demand };
    s->q_len++;
    s->outstanding++;
    s->demand_left += demand ? 1 : 0;
}

// makes room for `need` more jobs; lanes may be popping (called with mu held)
static int reserve_jobs_locked(mf_streamer * s, size_t need) {
    if (s->q_len + need <= s->queue_cap) {
        return 0;
    }
    const size_t cap = 2 * (s->q_len + need);
    mf_job *     q   = malloc(cap * sizeof *q);
    if (!q) {
        return -ENOMEM;
    }
    for (size_t i = 0; i < s->q_len; i++) {
        q[i] = s->queue[(s->q_head + i) % s->queue_cap];
    }
    free(s->queue);
    s->queue     = q;
    s->queue_cap = cap;
    s->q_head    = 0;
    return 0;
}

// Hands the cache's last evictions and loads (of layer il) to memory and the lanes: evictions free
// their frames first, so the loads can take them. `demand`: the running layer's reads (waited
// for), else a prefetch. The decode thread itself makes no system call here.
int mf_lanes_queue_route(mf_streamer * s, int32_t il, bool demand) {
    mf_cache * c = s->cache;
    if (c->n_evict == 0 && c->n_load == 0) {
        // all hits: waking the lanes for nothing costs two context switches per lane and layer,
        // taken from the compute threads on a small machine
        return 0;
    }
    mf_layer * L = &s->layers[il];
    pthread_mutex_lock(&s->mu);
    int rc = reserve_jobs_locked(s, (size_t) c->n_load * MF_MAX_XT);
    pthread_mutex_unlock(&s->mu);
    mf_lanes_apply_evictions(s);
    int32_t placed = 0;
    while (rc == 0 && placed < c->n_load && place_entry(s, L, c->load[placed])) {
        placed++;
    }
    if (placed < c->n_load) {
        // not queued: the cache must not count them resident
        for (int32_t i = placed; i < c->n_load; i++) {
            mf_cache_forget(c, il, c->load[i]);
        }
        rc = rc ? rc : -ENOSPC;
    }
    if (placed == 0) {
        return rc;
    }
    pthread_mutex_lock(&s->mu);
    for (int32_t j = 0; j < L->n_xt; j++) {
        for (int32_t i = 0; i < placed; i++) {
            atomic_store_explicit(&L->xt[j]->state[c->load[i]], MF_SLICE_LOADING, memory_order_release);
            push_job_locked(s, L->xt[j], c->load[i], demand);
        }
    }
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    ADD(s->st.resident_bytes, (uint64_t) placed * L->entry_bytes);
    return rc;
}
