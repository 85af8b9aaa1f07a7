// Physical pages of expert slices, recycled from evicted slices to loaded ones.
//
// DESIGN
// Without this, an eviction returns a slice's pages (MADV_DONTNEED) and the next read faults
// fresh ones in: the kernel allocates, zeroes and charges every 4 KiB page, then frees it again at
// the next eviction. That work doubles the time a lane spends per read (measured with one reader:
// 1.45 ms per MB instead of 0.73; four readers: 1.1 GB/s instead of 1.38 GB/s) and takes CPU
// from the matmuls. userfaultfd's UFFDIO_MOVE (Linux 6.8+) moves present pages between anonymous
// ranges without copying, zeroing or splitting mappings: an eviction parks its pages in a pool,
// a load takes them back into place and the read overwrites them.
// - Every expert reservation and the pool are registered (MISSING mode, SIGBUS feature), so a
//   touch of a page nobody loaded raises SIGBUS: a missed load still faults, as with PROT_NONE.
// - A move needs a hole at the destination and a page at the source. Pages shared by two
//   neighbouring slices (at most one at each end of a slice) may already be present: the move or
//   zero-fill stops there (EEXIST), skips that page and goes on. Releasing two neighbours, the
//   shared page leaves with the first, so the second's range starts with a hole: that move stops
//   there (ENOENT), skips the hole and goes on as well. When the pool runs dry, the rest gets
//   fresh zeroed pages (UFFDIO_COPY from a range that reads as zeros; counted in pages_zeroed).
// - Anything unexpected (no userfaultfd, no UFFD_FEATURE_MOVE, a failed move) falls back to the
//   plain path: releases drop pages, loads fill holes with fresh pages. No error is fatal.
// Physical order. A read into pages that are contiguous in physical memory is one segment per run
// of them, and on virtual disks segments cost: O_DIRECT reads of 216 pages (one expert's gate,
// qwen30b-shape, 400 random reads per case into buffers built with mremap, /tmp/iocpu/runs.c, not
// kept) ran at 2.1-2.2 GB/s in 1 to 8 physical runs, 1.95 in 27 and 1.1 in 216. Fresh pages come
// from the allocator in runs of 10 to 20 pages. The pool used to be a ring of pages handed out
// oldest first: a load of 217 pages after a release of 216 (an edge page kept for a live
// neighbour) took a page of the next release, and every such mismatch left a break that later
// loads inherited: after 30 tokens under a 1000 MiB budget the slices' pages were in 121 runs per
// 216 pages on average (/tmp/contig.py, not kept: PFNs from /proc/self/pagemap), nearly as
// scattered as pages get. So now:
// - The pool keeps each release whole in a slot of its own, and a load takes the shortest parked
//   run that covers a hole (lists by length, a bitmap to find one): a release of the same size
//   comes back whole and in order.
// - A slice's edge pages (shared with its neighbours, runs of their own anyway) are parked and
//   filled one by one, apart from the pages between them, which then have the same size from one
//   load of a tensor's slices to the next: the loads fit.
// - mincore() tells a load which pages are present before it asks the pool, so it asks for the
//   holes exactly, and no slot's last page stays behind as a stray run.
// Measured (/tmp/contig.py, qwen30b-shape, 1000 MiB, 30 tokens): 10 to 12 runs per 216 pages
// instead of 121, the runs of fresh pages kept. Decode under a 25% cap, alternated with the ring
// (/tmp/ab_plan.py, not kept): the same at the default settings (medians 1.81 and 1.82 tok/s over
// 6 rounds), and with the cache off, where every route recycles, 1.28-1.34 against 0.86-0.89
// tok/s. Fresh pages from transparent huge pages (2 MiB in one run)
// made it 3.4, but on this project's virtual machines a huge page's first touch costs the host a
// fault per page (the guest reports free 2 MiB blocks back to it): the time to the first token of
// qwen30b-shape under a 25% cap went from 6.0 to 13.4 s, so fresh pages stay small.
// The pool's slots lie in a MAP_NORESERVE range and its lists are guarded by its own mutex: moves
// are short (tens of microseconds per slice) next to the reads they precede.
#include "mf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

// UFFDIO_MOVE arrived in Linux 6.8; older kernel headers lack it (the ABI is fixed)
#ifndef UFFDIO_MOVE
#    define UFFD_FEATURE_MOVE (1 << 10)
#    define UFFDIO_MOVE_MODE_DONTWAKE ((__u64) 1 << 0)
#    define _UFFDIO_MOVE      (0x05)
#    define UFFDIO_MOVE       _IOWR(UFFDIO, _UFFDIO_MOVE, struct uffdio_move)

struct uffdio_move {
    __u64 dst;
    __u64 src;
    __u64 len;
    __u64 mode;
    __s64 move;
};
#endif
// moves that keep failing with EAGAIN (pages busy) before the fallback takes over
#define MF_MOVE_TRIES 8
#ifndef UFFD_USER_MODE_ONLY
#    define UFFD_USER_MODE_ONLY 1
#endif

int mf_pages_open(mf_pages * pg, bool want, char * why, size_t why_size) {
    memset(pg, 0, sizeof *pg);
    pg->uffd = -1;
    pthread_mutex_init(&pg->mu, NULL);
    if (!want) {
        snprintf(why, why_size, "page moves turned off");
        return 0;
    }
    // user-mode-only faults suffice (nothing here is touched by the kernel before it is present)
    int fd = (int) syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
    if (fd < 0) {
        snprintf(why, why_size, "userfaultfd unavailable: %s", strerror(errno));
        return 0;
    }
    struct uffdio_api api = { .api = UFFD_API, .features = UFFD_FEATURE_MOVE | UFFD_FEATURE_SIGBUS };
    if (ioctl(fd, UFFDIO_API, &api) != 0 || !(api.features & UFFD_FEATURE_MOVE)) {
        snprintf(why, why_size, "userfaultfd lacks UFFDIO_MOVE (Linux 6.8+)");
        close(fd);
        return 0;
    }
    // the source of fresh pages: never written, so it reads as zeros without using memory
    pg->zero_src = mmap(NULL, MF_PAGES_ZERO_SRC, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (pg->zero_src == MAP_FAILED) {
        pg->zero_src = NULL;
        snprintf(why, why_size, "no address space for the page mover: %s", strerror(errno));
        close(fd);
        return 0;
    }
    pg->uffd = fd;
    snprintf(why, why_size, "pages move between slices (userfaultfd)");
    return 0;
}

bool mf_pages_moving(const mf_pages * pg) {
    return pg->uffd >= 0;
}

int mf_pages_register(mf_pages * pg, void * addr, size_t len) {
    if (pg->uffd < 0) {
        return 0;
    }
    struct uffdio_register reg = {
        .range = { .start = (uintptr_t) addr, .len = len },
        .mode  = UFFDIO_REGISTER_MODE_MISSING,
    };
    return ioctl(pg->uffd, UFFDIO_REGISTER, &reg) == 0 ? 0 : -errno;
}

// ---------------------------------------------------------------- the pool's slot lists
static void list_push(mf_pages * pg, int32_t i) {
    const uint32_t l = pg->slots[i].len;
    pg->slots[i].next = pg->lists[l];
    pg->lists[l]      = i;
    if (l > 0) {
        pg->nonempty[l / 64] |= (uint64_t) 1 << (l % 64);
    }
}

static int32_t list_pop(mf_pages * pg, uint32_t l) {
    const int32_t i = pg->lists[l];
    if (i >= 0) {
        pg->lists[l] = pg->slots[i].next;
        if (l > 0 && pg->lists[l] < 0) {
            pg->nonempty[l / 64] &= ~((uint64_t) 1 << (l % 64));
        }
    }
    return i;
}

// the shortest parked run of at least n pages, else the longest one; 0 when the pool is empty
static uint32_t list_fit(const mf_pages * pg, size_t n) {
    const size_t words = pg->slot_pages / 64 + 1;
    size_t       l     = n < pg->slot_pages ? n : pg->slot_pages;
    for (size_t w = l / 64; w < words; w++) {
        uint64_t bits = pg->nonempty[w] & (w == l / 64 ? ~(uint64_t) 0 << (l % 64) : ~(uint64_t) 0);
        if (bits) {
            return (uint32_t) (w * 64 + (size_t) __builtin_ctzll(bits));
        }
    }
    for (size_t w = l / 64 + 1; w-- > 0;) {
        uint64_t bits = pg->nonempty[w];
        if (bits) {
            return (uint32_t) (w * 64 + 63 - (size_t) __builtin_clzll(bits));
        }
    }
    return 0;
}

static char * slot_page(const mf_pages * pg, int32_t i, uint32_t page) {
    return pg->pool + ((size_t) i * pg->slot_pages + page) * MF_PAGE;
}

static void free_pool_lists(mf_pages * pg) {
    free(pg->slots);
    free(pg->lists);
    free(pg->nonempty);
    free(pg->incore);
    pg->slots    = NULL;
    pg->lists    = NULL;
    pg->nonempty = NULL;
    pg->incore   = NULL;
}

// every slot free, nothing parked
static void reset_slots(mf_pages * pg) {
    for (size_t l = 0; l <= pg->slot_pages; l++) {
        pg->lists[l] = -1;
    }
    memset(pg->nonempty, 0, (pg->slot_pages / 64 + 1) * sizeof *pg->nonempty);
    for (int32_t i = pg->n_slots; i-- > 0;) {
        pg->slots[i].off = pg->slots[i].len = 0;
        list_push(pg, i);
    }
    pg->pool_n = 0;
}

int mf_pages_pool(mf_pages * pg, size_t bytes, size_t slot_bytes) {
    if (pg->uffd < 0 || pg->pool) {
        return 0;
    }
    // one release per slot, so a slot holds the largest slice's span; four times the slots the
    // bytes need, as short runs (a slice's edge pages, a partly taken release) hold a slot each
    // (address space only: MAP_NORESERVE, and a slot uses memory only for the pages it holds)
    const size_t slot_pages = (slot_bytes + MF_PAGE - 1) / MF_PAGE + 1;
    const size_t n_slots    = 4 * ((bytes / MF_PAGE + slot_pages - 1) / slot_pages) + 16;
    if (slot_pages > UINT32_MAX || n_slots > INT32_MAX) {
        return -EINVAL;
    }
    const size_t len = n_slots * slot_pages * MF_PAGE;
    pg->slot_pages   = slot_pages;
    pg->n_slots      = (int32_t) n_slots;
    pg->slots        = calloc(n_slots, sizeof *pg->slots);
    pg->lists        = calloc(slot_pages + 1, sizeof *pg->lists);
    pg->nonempty     = calloc(slot_pages / 64 + 1, sizeof *pg->nonempty);
    pg->incore       = calloc(slot_pages, 1);
    void * p         = MAP_FAILED;
    int    rc        = -ENOMEM;
    if (pg->slots && pg->lists && pg->nonempty && pg->incore) {
        p  = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        rc = p == MAP_FAILED ? -errno : mf_pages_register(pg, p, len);
    }
    if (rc != 0) {
        if (p != MAP_FAILED) {
            munmap(p, len);
        }
        free_pool_lists(pg);
        return rc;
    }
    pg->pool = p;
    reset_slots(pg);
    return 0;
}

// fills holes of [a, b) with fresh zeroed pages, skipping pages already present. UFFDIO_COPY
// (from a never-touched source that reads as zeros) installs new pages into empty page-table
// slots. Not UFFDIO_ZEROPAGE: the read would then break each shared zero page copy-on-write, and
// every such break flushes the TLB of all CPUs (an IPI per page: measured, a 46-token prompt took
// twice as long).
static int zero_fill(mf_pages * pg, char * a, char * b) {
    while (a < b) {
        size_t len = (size_t) (b - a);
        len        = len < MF_PAGES_ZERO_SRC ? len : MF_PAGES_ZERO_SRC;
        struct uffdio_copy cp = { .dst  = (uintptr_t) a,
                                  .src  = (uintptr_t) pg->zero_src,
                                  .len  = len,
                                  .mode = UFFDIO_COPY_MODE_DONTWAKE };
        if (ioctl(pg->uffd, UFFDIO_COPY, &cp) == 0) {
            atomic_fetch_add_explicit(&pg->zeroed, len / MF_PAGE, memory_order_relaxed);
            a += len;
            continue;
        }
        const int err = errno;
        if (cp.copy > 0) {
            atomic_fetch_add_explicit(&pg->zeroed, (size_t) cp.copy / MF_PAGE, memory_order_relaxed);
            a += cp.copy;
        }
        if (err == EEXIST) {
            a += MF_PAGE;  // a page shared with a live neighbour
        } else if (err != EAGAIN) {
            return -err;
        }
    }
    return 0;
}

static int move(mf_pages * pg, char * dst, char * src, size_t len, size_t * moved) {
    struct uffdio_move m = { .dst = (uintptr_t) dst, .src = (uintptr_t) src, .len = len,
                             .mode = UFFDIO_MOVE_MODE_DONTWAKE };
    const int rc = ioctl(pg->uffd, UFFDIO_MOVE, &m) == 0 ? 0 : -errno;
    *moved = rc == 0 ? len : (m.move > 0 ? (size_t) m.move : 0);
    return rc;
}

// fills the hole run [a, b) from the pool, under pg->mu; returns where it stopped (b, or the start
// of what fresh pages fill)
static char * fill_run(mf_pages * pg, char * a, char * b) {
    for (int again = 0; a < b && pg->pool_n > 0;) {
        // the shortest parked run that covers the hole: one release of the same size if any, so
        // its pages come back together and in order (see the top of the file)
        const size_t   n   = (size_t) (b - a) / MF_PAGE;
        const uint32_t fit = list_fit(pg, n);
        const int32_t  i   = fit ? list_pop(pg, fit) : -1;
        if (i < 0) {
            break;  // (pool_n and the lists agree; this only keeps a slip from doing harm)
        }
        mf_pool_slot * sl = &pg->slots[i];
        const size_t   k  = n < sl->len ? n : sl->len;
        size_t         done;
        const int      rc = move(pg, a, slot_page(pg, i, sl->off), k * MF_PAGE, &done);
        sl->off += (uint32_t) (done / MF_PAGE);
        sl->len -= (uint32_t) (done / MF_PAGE);
        sl->off = sl->len ? sl->off : 0;
        list_push(pg, i);
        pg->pool_n -= done / MF_PAGE;
        pg->moved += done / MF_PAGE;
        a += done;
        if (rc == -EEXIST) {
            a += MF_PAGE;  // a neighbour's load brought the shared page in since mincore looked
        } else if (rc != 0 && (rc != -EAGAIN || ++again > MF_MOVE_TRIES)) {
            break;  // fresh pages for what is left
        }
    }
    return a;
}

// ranges a fill leaves to fresh pages: the two edge pages and one stretch between them per chunk
#define MF_FILL_REST 3

typedef struct {
    char * a[MF_FILL_REST];
    char * b[MF_FILL_REST];
    int    n;
} fill_rest;

// notes [a, b) for fresh pages; when full, widens the last range to b (the zero fill skips pages
// that are present)
static void rest_add(fill_rest * r, char * a, char * b) {
    if (a >= b) {
        return;
    }
    if (r->n < MF_FILL_REST) {
        r->a[r->n]   = a;
        r->b[r->n++] = b;
    } else {
        r->b[MF_FILL_REST - 1] = b;
    }
}

// the hole run [lo, hi) of a fill: its edge pages alone (from lone parked pages: taking one from a
// longer run would spoil that run's fit), the pages between in one go
static void fill_holes(mf_pages * pg, char * lo, char * hi, bool edge_lo, bool edge_hi, fill_rest * rest) {
    if (lo < hi && edge_lo) {
        char * const p = lo;
        lo += MF_PAGE;
        rest_add(rest, pg->lists[1] >= 0 ? fill_run(pg, p, lo) : p, lo);
    }
    char * const mid = lo < hi && edge_hi ? hi - MF_PAGE : hi;
    if (lo < mid) {
        rest_add(rest, fill_run(pg, lo, mid), mid);
    }
    if (mid < hi) {
        rest_add(rest, pg->lists[1] >= 0 ? fill_run(pg, mid, hi) : mid, hi);
    }
}

int mf_pages_fill(mf_pages * pg, char * a, char * b, unsigned edges) {
    if (pg->uffd < 0) {
        return 0;
    }
    fill_rest    rest  = { .n = 0 };
    char * const first = a;
    pthread_mutex_lock(&pg->mu);
    while (a < b) {
        // which pages are present (shared with a live neighbour): the pool is asked for exactly
        // the holes, so that no slot's last page stays behind as a stray one-page run
        size_t n = (size_t) (b - a) / MF_PAGE;
        n        = n < pg->slot_pages ? n : pg->slot_pages;
        if (!pg->incore || mincore(a, n * MF_PAGE, pg->incore) != 0) {
            rest_add(&rest, a, b);  // no pool yet, or no answer: fresh pages for the rest
            break;
        }
        for (size_t h = 0; h < n;) {
            size_t e = h;
            while (e < n && !(pg->incore[e] & 1)) {
                e++;
            }
            char * lo = a + h * MF_PAGE;
            char * hi = a + e * MF_PAGE;
            fill_holes(pg, lo, hi, lo == first && (edges & MF_EDGE_FIRST), hi == b && (edges & MF_EDGE_LAST), &rest);
            h = e + 1;  // past the present page
        }
        a += n * MF_PAGE;
    }
    pthread_mutex_unlock(&pg->mu);
    // allocating and zeroing pages outside the lock: other lanes' moves need not wait for it
    for (int i = 0; i < rest.n; i++) {
        const int rc = zero_fill(pg, rest.a[i], rest.b[i]);
        if (rc != 0) {
            return rc;
        }
    }
    return 0;
}

// parks the pages of [a, b) in free slots, one release per slot, their order kept; returns where
// it stopped (b, or the start of what is to be released: the pool full, or a failed move)
static char * park(mf_pages * pg, char * a, char * b) {
    int rc    = 0;
    int again = 0;
    while (a < b && rc == 0) {
        const int32_t i = list_pop(pg, 0);
        if (i < 0) {
            break;
        }
        mf_pool_slot * sl = &pg->slots[i];
        while (a < b && sl->len < pg->slot_pages) {
            size_t n = (size_t) (b - a) / MF_PAGE;
            n        = n < pg->slot_pages - sl->len ? n : pg->slot_pages - sl->len;
            size_t done;
            rc = move(pg, slot_page(pg, i, sl->len), a, n * MF_PAGE, &done);
            sl->len += (uint32_t) (done / MF_PAGE);
            pg->pool_n += done / MF_PAGE;
            a += done;
            if (rc == -ENOENT) {
                // a hole, skipped: most often the first page, shared with the slice before, whose
                // release in the same route took it (this slice was already absent then). Giving
                // up here dropped the whole slice instead: releasing a layer's neighbouring experts
                // together, as a long prompt's routes do, then pooled one page in eight, and loads
                // zero-filled the rest (qwen30b-q4km-shape, a 512-token prompt: 13.5 GB)
                a += MF_PAGE;
                rc = 0;
            } else if (rc == -EAGAIN && ++again <= MF_MOVE_TRIES) {
                rc = 0;
            } else if (rc != 0) {
                break;  // anything else: release the rest
            }
        }
        list_push(pg, i);
    }
    return a;
}

void mf_pages_drop(mf_pages * pg, char * a, char * b, unsigned edges) {
    char * lo = a;  // [lo, hi): what is left to release to the kernel
    char * hi = b;
    if (lo < hi && pg->uffd >= 0 && pg->pool) {
        pthread_mutex_lock(&pg->mu);
        // edge pages alone, so that the run between them parks whole and fits the next load of
        // the same size; they go to the loads' edges
        if ((edges & MF_EDGE_FIRST) && park(pg, lo, lo + MF_PAGE) == lo + MF_PAGE) {
            lo += MF_PAGE;
        }
        if ((edges & MF_EDGE_LAST) && lo < hi && park(pg, hi - MF_PAGE, hi) == hi) {
            hi -= MF_PAGE;
        }
        lo = park(pg, lo, hi);
        pthread_mutex_unlock(&pg->mu);
    }
    if (lo < hi) {
        // errors here are not fatal: the pages keep correct bytes, only memory is lost
        madvise(lo, (size_t) (hi - lo), MADV_DONTNEED);
    }
}

void mf_pages_trim_to(mf_pages * pg, size_t keep_pages) {
    if (pg->uffd < 0 || !pg->pool) {
        return;
    }
    pthread_mutex_lock(&pg->mu);
    while (pg->pool_n > keep_pages) {
        // the shortest runs first: they are the ones a load would have to piece together
        const int32_t  i  = list_pop(pg, list_fit(pg, 1));
        mf_pool_slot * sl = &pg->slots[i];
        size_t         n  = pg->pool_n - keep_pages;
        n                 = n < sl->len ? n : sl->len;
        madvise(slot_page(pg, i, sl->off), n * MF_PAGE, MADV_DONTNEED);
        sl->off += (uint32_t) n;
        sl->len -= (uint32_t) n;
        sl->off  = sl->len ? sl->off : 0;
        list_push(pg, i);
        pg->pool_n -= n;
    }
    pthread_mutex_unlock(&pg->mu);
}

void mf_pages_trim(mf_pages * pg) {
    if (pg->uffd < 0) {
        return;
    }
    pthread_mutex_lock(&pg->mu);
    if (pg->pool) {
        // holes cost nothing to drop
        madvise(pg->pool, (size_t) pg->n_slots * pg->slot_pages * MF_PAGE, MADV_DONTNEED);
        reset_slots(pg);
    }
    pthread_mutex_unlock(&pg->mu);
}

// closes userfaultfd (which unregisters every range) and unmaps the pool and the zero source
static void release_mover(mf_pages * pg) {
    if (pg->uffd >= 0) {
        close(pg->uffd);  // from now on a page nobody loaded reads as zeros
        pg->uffd = -1;
    }
    if (pg->pool) {
        munmap(pg->pool, (size_t) pg->n_slots * pg->slot_pages * MF_PAGE);
    }
    free_pool_lists(pg);
    if (pg->zero_src) {
        munmap(pg->zero_src, MF_PAGES_ZERO_SRC);
    }
    pg->pool       = NULL;
    pg->zero_src   = NULL;
    pg->slot_pages = 0;
    pg->n_slots    = 0;
    pg->pool_n     = 0;
}

void mf_pages_stop(mf_pages * pg, const char * why, char * note, size_t note_size) {
    pthread_mutex_lock(&pg->mu);
    release_mover(pg);
    pthread_mutex_unlock(&pg->mu);
    snprintf(note, note_size, "%s", why);
}

void mf_pages_close(mf_pages * pg) {
    release_mover(pg);
    pthread_mutex_destroy(&pg->mu);
    memset(pg, 0, sizeof *pg);
    pg->uffd = -1;
}
