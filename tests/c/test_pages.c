// Test of the page pool (streaming_ext/src/mf_pages.c), driven by tests/test_streaming_ext.py.
//
//   test_pages
//
// Streams slices of 216 pages at a 100-byte offset, so neighbours share their edge pages, through
// a cache of RESIDENT slices in random order (oldest evicted), the way the reader lanes do: a
// release gives up the slice's pages except those a live neighbour shares, a load fills the span.
// Checks:
//   integrity   every live slice still holds the bytes written after its load (no move ever took
//               a page from a live slice, a shared page kept both neighbours' bytes)
//   contiguity  after many generations of recycling the slices' pages are in hardly more physical
//               runs than fresh pages come in (an O_DIRECT read costs per run on virtual disks;
//               skipped without PFNs in /proc/self/pagemap, i.e. not root, or when fresh pages are
//               already scattered)
//   trim        trimming returns every pooled page; loads then work from fresh pages, also with
//               the pool emptied before each load
// Prints one "ok ...", "skip ..." or "FAIL ..." line per check; exit status 0 unless one fails.
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "mf_internal.h"

#define N_SLICES    600
#define RESIDENT    150
#define SLICE_PAGES 216
#define OFFSET      100
#define GENERATIONS 200  // loads per slot of the cache
// recycled slices may be in this many times the runs of fresh pages, plus MAX_RUNS_MORE (the ring
// pool of before reached 121 runs per 216 pages from 10-20 on qwen30b-shape; this one grows them
// by at most 7% here). Fresh pages already in more than MAX_FRESH_RUNS leave nothing to keep.
#define MAX_RUNS_GROWTH 1.1
#define MAX_RUNS_MORE   3
#define MAX_FRESH_RUNS  180

typedef struct {
    mf_pages pg;
    char *   base;
    size_t   len;
    char *   data;
    bool     live[N_SLICES];
    int      order[RESIDENT];  // live slices, oldest first (a ring)
    int      head, n;
    int      failures;
} world;

static size_t nb2(void) {
    return (size_t) SLICE_PAGES * MF_PAGE;
}

static char * page_down(char * p) {
    return (char *) ((uintptr_t) p & ~(uintptr_t) (MF_PAGE - 1));
}

static char * page_up(char * p) {
    return page_down(p + MF_PAGE - 1);
}

static char * slice(world * w, int e) {
    return w->data + (size_t) e * nb2();
}

static unsigned char stamp(int e, size_t at) {
    return (unsigned char) (e * 31 + (int) (at / MF_PAGE) * 7 + 1);
}

// the slice's own bytes: its first and last byte and one in every page it covers
static void write_slice(world * w, int e) {
    char * m = slice(w, e);
    for (size_t at = 0; at < nb2(); at += MF_PAGE) {
        m[at] = (char) stamp(e, at);
    }
    m[nb2() - 1] = (char) stamp(e, nb2());
}

static bool check_slice(world * w, int e) {
    const char * m = slice(w, e);
    for (size_t at = 0; at < nb2(); at += MF_PAGE) {
        if ((unsigned char) m[at] != stamp(e, at)) {
            return false;
        }
    }
    return (unsigned char) m[nb2() - 1] == stamp(e, nb2());
}

static void release(world * w, int e) {
    char *   p0    = page_down(slice(w, e));
    char *   p1    = page_up(slice(w, e) + nb2());
    unsigned edges = MF_EDGE_FIRST | MF_EDGE_LAST;
    if (e > 0 && w->live[e - 1]) {
        p0 += MF_PAGE;  // shared with the live slice before
        edges &= ~MF_EDGE_FIRST;
    }
    if (e + 1 < N_SLICES && w->live[e + 1]) {
        p1 -= MF_PAGE;  // and after
        edges &= ~MF_EDGE_LAST;
    }
    mf_pages_drop(&w->pg, p0, p1, edges);
}

static int load(world * w, int e) {
    const int rc = mf_pages_fill(&w->pg, page_down(slice(w, e)), page_up(slice(w, e) + nb2()),
                                 MF_EDGE_FIRST | MF_EDGE_LAST);
    if (rc == 0) {
        write_slice(w, e);
    }
    return rc;
}

// `starve`: the pool emptied before each load, so every page comes from the fresh-page paths
static int run(world * w, int loads, bool starve) {
    unsigned seed = 12345;
    for (int done = 0; done < loads;) {
        const int e = (int) (rand_r(&seed) % N_SLICES);
        if (w->live[e]) {
            continue;
        }
        if (w->n == RESIDENT) {
            const int v = w->order[w->head];
            w->head     = (w->head + 1) % RESIDENT;
            w->n--;
            w->live[v] = false;
            release(w, v);
        }
        if (starve) {
            mf_pages_trim(&w->pg);
        }
        const int rc = load(w, e);
        if (rc != 0) {
            printf("FAIL load: mf_pages_fill returned %d\n", rc);
            return rc;
        }
        w->live[e]                             = true;
        w->order[(w->head + w->n) % RESIDENT] = e;
        w->n++;
        done++;
        if (done % 64 == 0) {
            // as the streamer does once per route: keep a few slices' worth of pages pooled
            mf_pages_trim_to(&w->pg, 8 * (SLICE_PAGES + 1));
        }
    }
    return 0;
}

static void check_integrity(world * w, const char * when) {
    int bad = 0;
    for (int e = 0; e < N_SLICES; e++) {
        bad += w->live[e] && !check_slice(w, e);
    }
    if (bad) {
        printf("FAIL integrity %s: %d live slices lost bytes\n", when, bad);
        w->failures++;
    } else {
        printf("ok integrity %s\n", when);
    }
}

static uint64_t pfn(int pm, const char * p) {
    uint64_t e = 0;
    if (pread(pm, &e, sizeof e, (off_t) ((uintptr_t) p / MF_PAGE * sizeof e)) != (ssize_t) sizeof e) {
        return 0;
    }
    return (e >> 63) ? (e & ((UINT64_C(1) << 55) - 1)) : 0;
}

// mean physical runs per live slice (its edge pages included); 0 without page frame numbers
static double mean_runs(world * w) {
    const int pm = open("/proc/self/pagemap", O_RDONLY);
    if (pm < 0 || pfn(pm, slice(w, w->order[w->head])) == 0) {
        if (pm >= 0) {
            close(pm);
        }
        return 0;
    }
    long runs = 0, slices = 0;
    for (int e = 0; e < N_SLICES; e++) {
        if (!w->live[e]) {
            continue;
        }
        uint64_t prev = 0;
        for (char * p = page_down(slice(w, e)); p < page_up(slice(w, e) + nb2()); p += MF_PAGE) {
            const uint64_t f = pfn(pm, p);
            runs += f != prev + 1;
            prev = f;
        }
        slices++;
    }
    close(pm);
    return (double) runs / (double) slices;
}

int main(void) {
    static world w;
    char         why[160];
    mf_pages_open(&w.pg, true, why, sizeof why);
    if (!mf_pages_moving(&w.pg)) {
        printf("skip everything: %s\n", why);
        mf_pages_close(&w.pg);
        return 0;
    }
    w.len  = (size_t) N_SLICES * nb2() + 2 * MF_PAGE;
    w.base = mmap(NULL, w.len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (w.base == MAP_FAILED || mf_pages_register(&w.pg, w.base, w.len) != 0 ||
        mf_pages_pool(&w.pg, (size_t) (RESIDENT + 8) * nb2(), nb2() + MF_PAGE) != 0) {
        printf("FAIL setup: cannot map, register or pool: %s\n", why);
        return 1;
    }
    w.data = w.base + OFFSET;
    if (run(&w, RESIDENT, false) != 0) {
        return 1;
    }
    const double fresh = mean_runs(&w);  // every page fresh: as the allocator gives them
    if (run(&w, RESIDENT * GENERATIONS, false) != 0) {
        return 1;
    }
    check_integrity(&w, "after recycling");
    const double recycled = mean_runs(&w);
    if (fresh == 0) {
        printf("skip contiguity: no page frame numbers in /proc/self/pagemap (not root)\n");
    } else if (fresh > MAX_FRESH_RUNS) {
        printf("skip contiguity: fresh pages come in %.1f runs per slice here, nothing to keep\n", fresh);
    } else if (recycled > MAX_RUNS_GROWTH * fresh + MAX_RUNS_MORE) {
        printf("FAIL contiguity: %.1f physical runs per %d-page slice after %d generations, %.1f fresh\n", recycled,
               SLICE_PAGES + 1, GENERATIONS, fresh);
        w.failures++;
    } else {
        printf("ok contiguity: %.1f physical runs per %d-page slice after %d generations, %.1f fresh\n", recycled,
               SLICE_PAGES + 1, GENERATIONS, fresh);
    }

    mf_pages_trim(&w.pg);
    if (w.pg.pool_n != 0) {
        printf("FAIL trim: %zu pages still pooled\n", w.pg.pool_n);
        w.failures++;
    } else {
        printf("ok trim\n");
    }
    if (run(&w, RESIDENT, false) != 0) {
        return 1;
    }
    check_integrity(&w, "after trim");

    // with the pool empty: every page fresh, a live neighbour's edge page kept; a page left out
    // would fault (SIGBUS) when written
    if (run(&w, RESIDENT, true) != 0) {
        return 1;
    }
    check_integrity(&w, "with the pool starved");
    mf_pages_close(&w.pg);
    munmap(w.base, w.len);
    return w.failures ? 1 : 0;
}
