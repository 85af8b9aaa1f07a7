// Reader lanes and the memory of expert slices: how a route's loads and evictions are carried out.
//
// DESIGN
// mf_queue_route turns the cache's decision (mf_cache.c) into jobs: every slice state changes
// first (evicted ABSENT, loads LOADING) under page_mu, then release jobs are queued ahead of read
// jobs, so memory is given up before it is refilled. N lanes pop jobs from one FIFO (one mutex,
// work_cv), read unlocked, and mark each slice READY or FAILED under the mutex, broadcasting
// done_cv. A release keeps the pages a slice shares with a live neighbour, and gives up the rest
// (mf_pages.c: into the pool, or back to the kernel). Demand reads (the running layer's) are
// counted apart from prefetches so a layer waits only for its own. Lanes block all signals (the
// host process handles them) and stop by flag + broadcast + join.
#include "mf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static inline char * pg_down(char * p) {
    return (char *) ((uintptr_t) p & ~(uintptr_t) (MF_PAGE - 1));
}

static inline char * pg_up(char * p) {
    return (char *) (((uintptr_t) p + MF_PAGE - 1) & ~(uintptr_t) (MF_PAGE - 1));
}

// ---------------------------------------------------------------- slice memory
static void slice_span(const mf_xtensor * xt, int32_t e, char ** p0, char ** p1) {
    char * m0 = xt->data + (size_t) e * xt->nb2;
    *p0       = pg_down(m0);
    *p1       = pg_up(m0 + xt->nb2);
}

// which ends of page range [a, b) of slice e are edge pages, shared with the neighbouring slice
// (the pool keeps those apart from the pages in between, mf_pages.c)
static unsigned slice_edges(const mf_xtensor * xt, int32_t e, const char * a, const char * b) {
    const char * m0 = xt->data + (size_t) e * xt->nb2;
    char *       p0, *p1;
    slice_span(xt, e, &p0, &p1);
    return (a == p0 && m0 != p0 ? MF_EDGE_FIRST : 0u) | (b == p1 && m0 + xt->nb2 != p1 ? MF_EDGE_LAST : 0u);
}

// gives slice e pages to read into: recycled ones (mf_pages.c), or access to fault fresh ones in
static int slice_make_rw(mf_xtensor * xt, int32_t e) {
    char *p0, *p1;
    slice_span(xt, e, &p0, &p1);
    if (mf_pages_moving(&xt->s->pages)) {
        return mf_pages_fill(&xt->s->pages, p0, p1, slice_edges(xt, e, p0, p1));
    }
    if (xt->s->hold_all) {
        return 0;  // the whole reservation is read-write (mf_buft_hold_all)
    }
    return mprotect(p0, (size_t) (p1 - p0), PROT_READ | PROT_WRITE) == 0 ? 0 : -errno;
}

bool mf_slice_live(const mf_xtensor * xt, int64_t e) {
    const int st = atomic_load_explicit(&xt->state[e], memory_order_acquire);
    return st == MF_SLICE_LOADING || st == MF_SLICE_READY;
}

static void release_run(mf_streamer * s, char * a, char * b, unsigned edges) {
    if (!a || b <= a) {
        return;
    }
    mf_pages * pg = &s->pages;
    if (s->cfg.release_delay_us > 0) {
        usleep((useconds_t) s->cfg.release_delay_us);  // tests: between the decision and the drop
    }
    if (mf_pages_moving(pg)) {
        mf_pages_drop(pg, a, b, edges);  // into the pool for the next load
        return;
    }
    // errors here are not fatal: the pages stay readable with correct bytes, only memory is lost
    madvise(a, (size_t) (b - a), MADV_DONTNEED);
    if (!s->hold_all) {
        mprotect(a, (size_t) (b - a), PROT_NONE);
    }
}

// returns slice e's pages, keeping those shared with a live neighbour (nothing when e is live).
// Under page_mu, like every state change to LOADING: a neighbour seen absent here cannot start
// loading before its shared page is gone (its fill then brings the page back), and one seen live
// keeps the page.
static void slice_release_locked(mf_xtensor * xt, int32_t e);

static void slice_release(mf_xtensor * xt, int32_t e) {
    pthread_mutex_lock(&xt->s->page_mu);
    slice_release_locked(xt, e);
    pthread_mutex_unlock(&xt->s->page_mu);
}

static void slice_release_locked(mf_xtensor * xt, int32_t e) {
    if (mf_slice_live(xt, e)) {
        // evicted by a route, then admitted again by that route's prefetch before this release
        // ran: its pages are wanted (the queued read overwrites them)
        return;
    }
    char *p0, *p1;
    slice_span(xt, e, &p0, &p1);
    const int64_t nb2 = (int64_t) xt->nb2;
    char *        run = NULL;
    for (char * p = p0; p < p1; p += MF_PAGE) {
        // slices overlapping page [p, p + page)
        int64_t lo   = (int64_t) (p - xt->data);
        int64_t hi   = lo + MF_PAGE - 1;
        lo           = lo < 0 ? 0 : lo / nb2;
        hi           = hi < 0 ? -1 : hi / nb2;
        bool shared  = false;
        for (int64_t o = lo; o <= hi && o < xt->n_expert; o++) {
            if (o != e && mf_slice_live(xt, o)) {
                shared = true;
                break;
            }
        }
        if (shared) {
            if (run) {
                release_run(xt->s, run, p, slice_edges(xt, e, run, p));
                run = NULL;
            }
        } else if (!run) {
            run = p;
        }
    }
    if (run) {
        release_run(xt->s, run, p1, slice_edges(xt, e, run, p1));
    }
}

// ---------------------------------------------------------------- reader lanes
static int read_slice(mf_streamer * s, mf_xtensor * xt, int32_t e) {
    const mf_file * f   = &s->ix.files[xt->loc->file];
    const uint64_t  f0  = xt->loc->offset + (uint64_t) e * xt->nb2;
    const size_t    len = (size_t) xt->nb2;
    char *          m0  = xt->data + (size_t) e * xt->nb2;

    if (s->cfg.skip_expert > 0 && e == s->cfg.skip_expert - 1) {
        return 0;  // negative control: the slice stays zero-filled (see mf_config.skip_expert)
    }
    if (s->cfg.fault_errno) {
        const uint64_t before = atomic_fetch_add(&s->expert_bytes_read_total, len);
        if (before + len > s->cfg.fault_after_bytes) {
            return -s->cfg.fault_errno;
        }
    }
    if (s->direct && f->fd_direct >= 0) {
        // whole pages, straight into place: data is congruent to the file offset (mf_buft.c)
        const uint64_t a0 = f0 & ~(uint64_t) (MF_PAGE - 1);
        const uint64_t a1 = (f0 + len + MF_PAGE - 1) & ~(uint64_t) (MF_PAGE - 1);
        const int      rc = mf_pread_full(f->fd_direct, m0 - (f0 - a0), (size_t) (a1 - a0), a0, (size_t) (f0 + len - a0));
        if (rc != -EINVAL) {
            return rc;
        }
        // O_DIRECT refused at read time: buffered for this slice
    }
    const int rc = mf_pread_full(f->fd, m0, len, f0, len);
    if (rc == 0 && !s->direct) {
        // buffered mode: the slice now lives in the cache's memory; drop the page-cache copy
        posix_fadvise(f->fd, (off_t) f0, (off_t) len, POSIX_FADV_DONTNEED);
    }
    return rc;
}

void * mf_lane_main(void * arg) {
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

        if (job.release) {
            if (s->cfg.release_delay_us > 0) {
                usleep((useconds_t) s->cfg.release_delay_us);
            }
            slice_release(job.xt, job.expert);
            pthread_mutex_lock(&s->mu);
            s->outstanding--;
            pthread_cond_broadcast(&s->done_cv);
            continue;
        }
        const uint64_t t0 = mf_now_ns();
        int            rc = slice_make_rw(job.xt, job.expert);
        if (rc == 0) {
            rc = read_slice(s, job.xt, job.expert);
        }
        ADD(s->st_read_ns, mf_now_ns() - t0);
        ADD(s->st_reads, 1);

        pthread_mutex_lock(&s->mu);
        if (rc == 0) {
            ADD(s->st_bytes_read, job.xt->nb2);
            atomic_store_explicit(&job.xt->state[job.expert], MF_SLICE_READY, memory_order_release);
        } else {
            char msg[MF_ERR_LEN];
            snprintf(msg, sizeof msg, "reading expert %d of %s from %s failed: %s", (int) job.expert,
                     job.xt->loc->name, s->ix.files[job.xt->loc->file].path,
                     rc == -ENODATA ? "the file ended early (it changed size while open)" : strerror(-rc));
            mf_record_error_locked(s, rc, msg);
            ADD(s->st_errors, 1);
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

// every queued job (reads, prefetches and releases) has finished
uint64_t mf_wait_all(mf_streamer * s) {
    return wait_zero(s, &s->outstanding);
}

// the running layer's own reads have finished (prefetches may still be in flight)
uint64_t mf_wait_demand(mf_streamer * s) {
    return wait_zero(s, &s->demand_left);
}

// forgets entries whose reads failed so that their next use reads them again (decode thread,
// no read in flight); the scan runs only when a lane has marked a slice FAILED since the last one
void mf_reap_failures(mf_streamer * s) {
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
            for (int32_t j = 0; j < L->n_xt; j++) {
                atomic_store(&L->xt[j]->state[e], MF_SLICE_ABSENT);
            }
            for (int32_t j = 0; j < L->n_xt; j++) {
                slice_release(L->xt[j], e);
            }
            if (s->cache->resident[(size_t) l * (size_t) s->n_expert + (size_t) e]) {
                atomic_fetch_sub(&s->st_resident_bytes, L->entry_bytes);
            }
            mf_cache_forget(s->cache, l, e);
        }
    }
}

// ---------------------------------------------------------------- queueing a route
// the cache's evictions, done right here (drop_cache; the routing path queues them to the lanes)
void mf_evict_listed_now(mf_streamer * s) {
    for (int32_t i = 0; i < s->cache->n_evict; i++) {
        const int32_t l = s->cache->evict[i] / s->n_expert;
        const int32_t e = s->cache->evict[i] % s->n_expert;
        mf_layer *    L = &s->layers[l];
        for (int32_t j = 0; j < L->n_xt; j++) {
            atomic_store_explicit(&L->xt[j]->state[e], MF_SLICE_ABSENT, memory_order_release);
        }
        for (int32_t j = 0; j < L->n_xt; j++) {
            slice_release(L->xt[j], e);
        }
        atomic_fetch_sub(&s->st_resident_bytes, L->entry_bytes);
    }
    ADD(s->st_evictions, s->cache->n_evict);
}

static void push_job_locked(mf_streamer * s, mf_xtensor * xt, int32_t e, bool release, bool demand) {
    s->queue[(s->q_head + s->q_len) % s->queue_cap] =
        (mf_job){ .xt = xt, .expert = e, .release = release, .demand = demand && !release };
    s->q_len++;
    s->outstanding++;
    s->demand_left += demand && !release ? 1 : 0;
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

// Hands the cache's last evictions and loads (of layer il) to the lanes. Every state changes
// first (evicted slices ABSENT, loads LOADING), so a release never returns a page that a slice of
// this route shares; releases are queued ahead of the reads so memory is freed before it is
// refilled. `demand`: the running layer's reads (waited for), else a prefetch. The decode thread
// itself makes no system call here.
int mf_queue_route(mf_streamer * s, int32_t il, bool demand) {
    mf_cache * c = s->cache;
    if (c->n_evict == 0 && c->n_load == 0) {
        // all hits: waking the lanes for nothing costs two context switches per lane and layer,
        // taken from the compute threads on a small machine
        return 0;
    }
    const size_t need = (size_t) (c->n_evict + c->n_load) * MF_MAX_XT;
    pthread_mutex_lock(&s->mu);
    const int grown = reserve_jobs_locked(s, need);
    pthread_mutex_unlock(&s->mu);
    if (grown != 0) {
        return grown;  // nothing changed yet: the caller fails the route
    }
    // lanes may be releasing slices of an earlier route right now (a prefetch queues while the
    // running layer's jobs are in flight): state changes and release decisions take turns
    pthread_mutex_lock(&s->page_mu);
    for (int32_t i = 0; i < c->n_evict; i++) {
        mf_layer * L = &s->layers[c->evict[i] / s->n_expert];
        for (int32_t j = 0; j < L->n_xt; j++) {
            atomic_store_explicit(&L->xt[j]->state[c->evict[i] % s->n_expert], MF_SLICE_ABSENT, memory_order_release);
        }
        atomic_fetch_sub(&s->st_resident_bytes, L->entry_bytes);
    }
    mf_layer * L = &s->layers[il];
    for (int32_t j = 0; j < L->n_xt; j++) {
        for (int32_t i = 0; i < c->n_load; i++) {
            atomic_store_explicit(&L->xt[j]->state[c->load[i]], MF_SLICE_LOADING, memory_order_release);
        }
    }
    pthread_mutex_unlock(&s->page_mu);
    pthread_mutex_lock(&s->mu);
    for (int32_t i = 0; i < c->n_evict; i++) {
        mf_layer * E = &s->layers[c->evict[i] / s->n_expert];
        for (int32_t j = 0; j < E->n_xt; j++) {
            push_job_locked(s, E->xt[j], c->evict[i] % s->n_expert, true, demand);
        }
    }
    for (int32_t j = 0; j < L->n_xt; j++) {
        for (int32_t i = 0; i < c->n_load; i++) {
            push_job_locked(s, L->xt[j], c->load[i], false, demand);
        }
    }
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    ADD(s->st_evictions, c->n_evict);
    ADD(s->st_resident_bytes, (uint64_t) c->n_load * L->entry_bytes);
    return 0;
}
