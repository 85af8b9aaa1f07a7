// Reader lanes and the memory of expert slices: how a route's loads and evictions are carried out.
//
// mf_lanes_queue_route turns the cache's decision (mf_cache.c) into memory and jobs on the decode
// thread: evicted entries turn ABSENT and give their frames back (mf_frames.c: bookkeeping, no
// system call), then each load takes a frame, its slices' addresses in it are noted (xt->slot,
// what the ready hook hands the matmul) and they turn LOADING, and the reads are queued. N lanes
// pop jobs from one FIFO (one mutex, work_cv), read unlocked, and mark each slice READY or FAILED
// under the mutex, broadcasting done_cv; the lane that reads a slice's last chunk repacks it first
// when its tensor has a repacked layout (unlocked: the read stays in flight until then). The
// running layer's slices are read in chunks, one job each, so that the lanes read them one at a
// time in the order the matmuls need them (see chunk_bytes). No frame changes hands while a read into it is in flight: a route first waits
// for every job of the one before. Demand reads (the running layer's) are
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
        const uint64_t f0 = mf_slice_offset(xt, e);
        xt->slot[e]       = frm + xt->frame_off + (size_t) (f0 & (s->page_size - 1));
    }
    return true;
}

// ---------------------------------------------------------------- reader lanes
// a lane's own buffer: a page-aligned copy of a few rows of a slice being repacked, or the bounce
// buffer of a read that must not write whole pages in place (below)
typedef struct lane_buf {
    void * p;
    size_t cap;  // a multiple of the page
} lane_buf;

static int lane_buf_reserve(lane_buf * b, size_t need, size_t page) {
    if (b->cap >= need) {
        return 0;
    }
    free(b->p);
    b->cap = 0;
    if (posix_memalign(&b->p, page, mf_align_up(need, page)) != 0) {
        b->p = NULL;
        return -ENOMEM;
    }
    b->cap = mf_align_up(need, page);
    return 0;
}

// one job: a chunk of slice e of xt, into its slot
static int read_chunk(mf_streamer * s, const mf_job * job, lane_buf * buf) {
    mf_xtensor * xt = job->xt;
    if (s->cfg.skip_expert > 0 && job->expert == s->cfg.skip_expert - 1) {
        return 0;  // negative control: the slice keeps whatever its frame held (see mf_config.skip_expert)
    }
    if (s->cfg.fault_errno) {
        const uint64_t before = atomic_fetch_add(&s->expert_bytes_read_total, job->len);
        if (before + job->len > s->cfg.fault_after_bytes) {
            return -s->cfg.fault_errno;
        }
    }
    // the slot is congruent to the file offset modulo the page (place_entry, xbuf_init_tensor), and
    // a chunk's bounds inside the slice are page-aligned: chunks never share a page
    const uint64_t f0  = mf_slice_offset(xt, job->expert);
    char * const   dst = xt->slot[job->expert] + (job->off - f0);
    const mf_file * f  = &s->ix.files[xt->loc->file];
    if (s->hold_all && xt->layout) {
        // the slices lie side by side in the tensor: the edge pages of a read in place would
        // overwrite a neighbour's repacked bytes with the file's. Through the lane's buffer instead
        const int rc = lane_buf_reserve(buf, 2 * s->page_size, s->page_size);
        return rc ? rc : mf_read_whole(f, s->direct ? buf->p : NULL, buf->cap, s->page_size, job->off, job->len, dst);
    }
    return mf_read_in_place(f, s->direct, s->page_size, dst, job->off, (size_t) job->len);
}

// the job's slice failed (`what`: "reading" or "repacking"): recorded, and marked FAILED at once,
// though other chunks may still be in flight: the matmul must not wait for them to skip it, and
// the entry is forgotten only once no read is in flight (call with s->mu held)
static void lane_failed_locked(mf_streamer * s, const mf_job * job, const char * what, int rc) {
    char msg[MF_ERR_LEN];
    snprintf(msg, sizeof msg, "%s expert %d of %s from %s failed: %s", what, (int) job->expert, job->xt->loc->name,
             s->ix.files[job->xt->loc->file].path,
             rc == -ENODATA ? "the file ended early (it changed size while open)" : strerror(-rc));
    mf_error_record_locked(s, rc, msg);
    ADD(s->st.errors, 1);
    atomic_store_explicit(&job->xt->state[job->expert], MF_SLICE_FAILED, memory_order_release);
    s->n_failed++;
}

// a reader lane: pops jobs, reads unlocked, marks the slices READY or FAILED under the mutex
static void * lane_main(void * arg) {
    mf_streamer * s = arg;
    sigset_t      all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);

    lane_buf buf = { 0 };
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
        int            rc = read_chunk(s, &job, &buf);
        ADD(s->st.read_ns, mf_now_ns() - t0);

        pthread_mutex_lock(&s->mu);
        atomic_int * const state = &job.xt->state[job.expert];
        if (rc == 0) {
            ADD(s->st.bytes_read, job.len);
        } else {
            lane_failed_locked(s, &job, "reading", rc);
        }
        const bool slice_done = --job.xt->pending[job.expert] == 0;
        if (slice_done && job.xt->layout && atomic_load_explicit(state, memory_order_relaxed) == MF_SLICE_LOADING) {
            pthread_mutex_unlock(&s->mu);
            const uint64_t t1 = mf_now_ns();
            rc = lane_buf_reserve(&buf, mf_repack_scratch_bytes(job.xt->t), s->page_size);
            rc = rc ? rc : mf_repack_slice(job.xt, job.expert, buf.p);
            ADD(s->st.repack_ns, mf_now_ns() - t1);
            pthread_mutex_lock(&s->mu);
            if (rc != 0) {
                lane_failed_locked(s, &job, "repacking", rc);
            }
        }
        if (slice_done) {
            ADD(s->st.reads, 1);
            if (atomic_load_explicit(state, memory_order_relaxed) == MF_SLICE_LOADING) {
                atomic_store_explicit(state, MF_SLICE_READY, memory_order_release);
            }
        }
        s->outstanding--;
        s->demand_left -= job.demand ? 1 : 0;
        // waiters wait for a slice to turn READY or FAILED, or for one of the two counts to reach zero
        if (slice_done || rc != 0 || s->outstanding == 0 || (job.demand && s->demand_left == 0)) {
            pthread_cond_broadcast(&s->done_cv);
        }
    }
    pthread_mutex_unlock(&s->mu);
    free(buf.p);
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

// The bytes of one read of a slice of xt. The running layer waits for its reads (`demand`), and
// a slice's chunks lie in the queue together: with chunks of a slice's n_lanes-th part the lanes
// read one slice at a time in queue order (the matmuls' order), and the first slice the layer
// needs arrives after its own bytes' read time, where whole slices read side by side would all
// arrive at the end. A chunk is at least MF_READ_CHUNK_MIN: a read's fixed costs (a system call,
// the device's latency per request) must stay small beside its bytes. A prefetch is read whole:
// its layer does not wait for it yet, and fewer, larger reads keep the disk's rate. A build with
// -DMF_READ_CHUNK_MIN=1073741824 (above any slice) reads every slice whole (docs/streamer.md,
// "Threads and the route").
#ifndef MF_READ_CHUNK_MIN
#    define MF_READ_CHUNK_MIN (256 << 10)
#endif

static uint64_t chunk_bytes(const mf_streamer * s, const mf_xtensor * xt, bool demand) {
    const uint64_t whole = mf_align_up(xt->nb2, s->page_size) + s->page_size;  // the widest span
    const uint64_t lanes = (uint64_t) s->cfg.lanes;
    const uint64_t share = mf_align_up((xt->nb2 + lanes - 1) / lanes, s->page_size);
    const uint64_t least = mf_align_up((uint64_t) MF_READ_CHUNK_MIN, s->page_size);
    return !demand ? whole : share > least ? share : least;
}

// the most jobs one slice of xt takes (its bytes, plus the page its start is not aligned to)
static size_t max_chunks(const mf_streamer * s, const mf_xtensor * xt, bool demand) {
    const uint64_t c = chunk_bytes(s, xt, demand);
    return (size_t) ((xt->nb2 + s->page_size + c - 1) / c);
}

// queues slice e of xt, chunk by chunk (bounds page-aligned in the file but for the slice's own)
static void push_slice_locked(mf_streamer * s, mf_xtensor * xt, int32_t e, bool demand) {
    const uint64_t f0 = mf_slice_offset(xt, e);
    const uint64_t f1 = f0 + xt->nb2;
    const uint64_t c  = chunk_bytes(s, xt, demand);
    int32_t        n  = 0;
    for (uint64_t a = mf_align_down(f0, s->page_size); a < f1; a += c) {
        const uint64_t lo = a > f0 ? a : f0;
        const uint64_t hi = a + c < f1 ? a + c : f1;
        s->queue[(s->q_head + s->q_len) % s->queue_cap] =
            (mf_job){ .xt = xt, .expert = e, .demand = demand, .off = lo, .len = hi - lo };
        s->q_len++;
        s->outstanding++;
        s->demand_left += demand ? 1 : 0;
        n++;
    }
    xt->pending[e] = n;
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
    mf_layer * L    = &s->layers[il];
    size_t     jobs = 0;
    for (int32_t j = 0; j < L->n_xt; j++) {
        jobs += (size_t) c->n_load * max_chunks(s, L->xt[j], demand);
    }
    pthread_mutex_lock(&s->mu);
    int rc = reserve_jobs_locked(s, jobs);
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
            push_slice_locked(s, L->xt[j], c->load[i], demand);
        }
    }
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    ADD(s->st.resident_bytes, (uint64_t) placed * L->entry_bytes);
    return rc;
}
