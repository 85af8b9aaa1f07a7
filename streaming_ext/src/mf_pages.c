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
// The pool is a ring of pages in a MAP_NORESERVE range (oldest taken first, new ones appended),
// guarded by its own mutex: moves are short (tens of microseconds per slice) next to the reads
// they precede. A move proceeds in address order, so a partial one keeps the ring contiguous.
#include "mf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdio.h>
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

int mf_pages_pool(mf_pages * pg, size_t bytes) {
    if (pg->uffd < 0 || pg->pool) {
        return 0;
    }
    const size_t len = (bytes + MF_PAGE - 1) & ~(size_t) (MF_PAGE - 1);
    void *       p   = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        return -errno;
    }
    const int rc = mf_pages_register(pg, p, len);
    if (rc != 0) {
        munmap(p, len);
        return rc;
    }
    pg->pool     = p;
    pg->pool_cap = len / MF_PAGE;
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

int mf_pages_fill(mf_pages * pg, char * a, char * b) {
    if (pg->uffd < 0) {
        return 0;
    }
    pthread_mutex_lock(&pg->mu);
    while (a < b && pg->pool_n > 0) {
        // the oldest pooled pages first, up to the end of the ring
        size_t n     = (size_t) (b - a) / MF_PAGE;
        size_t avail = pg->pool_cap - pg->pool_lo;
        avail        = avail < pg->pool_n ? avail : pg->pool_n;
        n            = n < avail ? n : avail;
        size_t    done;
        const int rc = move(pg, a, pg->pool + pg->pool_lo * MF_PAGE, n * MF_PAGE, &done);
        // a move proceeds in address order, so even a partial one leaves the pool contiguous
        pg->pool_lo = (pg->pool_lo + done / MF_PAGE) % pg->pool_cap;
        pg->pool_n -= done / MF_PAGE;
        pg->moved += done / MF_PAGE;
        a += done;
        if (rc == -EEXIST) {
            a += MF_PAGE;  // a page shared with a live neighbour
        } else if (rc != 0 && rc != -EAGAIN) {
            break;  // zero-fill what is left
        }
    }
    pthread_mutex_unlock(&pg->mu);
    return zero_fill(pg, a, b);
}

void mf_pages_drop(mf_pages * pg, char * a, char * b) {
    if (b <= a) {
        return;
    }
    if (pg->uffd >= 0) {
        pthread_mutex_lock(&pg->mu);
        while (a < b && pg->pool_n < pg->pool_cap) {
            // appended behind the newest pooled page, up to the end of the ring
            const size_t hi   = (pg->pool_lo + pg->pool_n) % pg->pool_cap;
            size_t       n    = (size_t) (b - a) / MF_PAGE;
            size_t       room = hi >= pg->pool_lo ? pg->pool_cap - hi : pg->pool_lo - hi;
            n                 = n < room ? n : room;
            size_t    done;
            const int rc = move(pg, pg->pool + hi * MF_PAGE, a, n * MF_PAGE, &done);
            pg->pool_n += done / MF_PAGE;
            a += done;
            if (rc == -ENOENT) {
                // a hole, skipped: most often the first page, shared with the slice before, whose
                // release in the same route took it (this slice was already absent then). Giving
                // up here dropped the whole slice instead: releasing a layer's neighbouring experts
                // together, as a long prompt's routes do, then pooled one page in eight, and
                // loads zero-filled the rest (qwen30b-q4km-shape, a 512-token prompt: 13.5 GB)
                a += MF_PAGE;
            } else if (rc != 0 && rc != -EAGAIN) {
                break;  // anything else: drop the rest
            }
        }
        pthread_mutex_unlock(&pg->mu);
    }
    if (a < b) {
        // errors here are not fatal: the pages keep correct bytes, only memory is lost
        madvise(a, (size_t) (b - a), MADV_DONTNEED);
    }
}

void mf_pages_trim_to(mf_pages * pg, size_t keep_pages) {
    if (pg->uffd < 0) {
        return;
    }
    pthread_mutex_lock(&pg->mu);
    while (pg->pool_n > keep_pages) {
        // the oldest first, up to the end of the ring
        size_t n = pg->pool_n - keep_pages;
        n        = n < pg->pool_cap - pg->pool_lo ? n : pg->pool_cap - pg->pool_lo;
        madvise(pg->pool + pg->pool_lo * MF_PAGE, n * MF_PAGE, MADV_DONTNEED);
        pg->pool_lo = (pg->pool_lo + n) % pg->pool_cap;
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
        madvise(pg->pool, pg->pool_cap * MF_PAGE, MADV_DONTNEED);  // holes cost nothing to drop
    }
    pg->pool_lo = 0;
    pg->pool_n  = 0;
    pthread_mutex_unlock(&pg->mu);
}

// closes userfaultfd (which unregisters every range) and unmaps the pool and the zero source
static void release_mover(mf_pages * pg) {
    if (pg->uffd >= 0) {
        close(pg->uffd);  // from now on a page nobody loaded reads as zeros
        pg->uffd = -1;
    }
    if (pg->pool) {
        munmap(pg->pool, pg->pool_cap * MF_PAGE);
    }
    if (pg->zero_src) {
        munmap(pg->zero_src, MF_PAGES_ZERO_SRC);
    }
    pg->pool     = NULL;
    pg->zero_src = NULL;
    pg->pool_cap = pg->pool_lo = pg->pool_n = 0;
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
