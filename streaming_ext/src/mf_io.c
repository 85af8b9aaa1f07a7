// The read loops every byte of the streamer goes through, and its clock.
//
// mf_pread_full is the loop in the spirit of SQLite's seekAndRead: retry EINTR, continue short
// reads, keep errno before any other call, and tell a read error (-errno) from a file that ended
// early (-ENODATA: it shrank or was replaced while open). The two readers above it choose between
// O_DIRECT, whose reads must cover whole pages at page-aligned addresses, and buffered reads,
// whose page-cache copy is dropped once the bytes live in the streamer's memory. Every function
// here is thread-safe (no state but the caller's).
#include "mf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

uint64_t mf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

int mf_pread_full(int fd, void * buf, size_t len, uint64_t off, size_t need) {
    char * p    = buf;
    size_t done = 0;
    while (done < len) {
        const ssize_t n = pread(fd, p + done, len - done, (off_t) (off + done));
        if (n < 0) {
            const int err = errno;
            if (err == EINTR) {
                continue;
            }
            return -err;
        }
        if (n == 0) {
            // end of file: fine once the bytes that matter are in (an aligned read may run past it)
            return done >= need ? 0 : -ENODATA;
        }
        done += (size_t) n;
    }
    return 0;
}

int mf_read_in_place(const mf_file * f, bool direct, size_t page, char * dst, uint64_t off, size_t len) {
    if (direct && f->fd_direct >= 0) {
        // whole pages, straight into place: dst is congruent to off modulo the page
        const uint64_t a0 = mf_align_down(off, page);
        const uint64_t a1 = mf_align_up(off + len, page);
        const int      rc =
            mf_pread_full(f->fd_direct, dst - (off - a0), (size_t) (a1 - a0), a0, (size_t) (off + len - a0));
        if (rc != -EINVAL) {
            return rc;
        }
        // O_DIRECT refused at read time: buffered for this range
    }
    const int rc = mf_pread_full(f->fd, dst, len, off, len);
    if (rc == 0 && !direct) {
        // buffered mode: the bytes now live in the streamer's memory; drop the page-cache copy
        posix_fadvise(f->fd, (off_t) off, (off_t) len, POSIX_FADV_DONTNEED);
    }
    return rc;
}

int mf_read_whole(const mf_file * f, void * bounce, size_t bounce_size, size_t page, uint64_t off, uint64_t size,
                  void * dst) {
    int rc;
    if (bounce && f->fd_direct >= 0) {
        // O_DIRECT through the bounce buffer, chunk by chunk: nothing enters the page cache
        uint64_t done = 0;
        rc            = 0;
        while (done < size && rc == 0) {
            const uint64_t at    = off + done;
            const uint64_t a0    = mf_align_down(at, page);
            const uint64_t want  = size - done;
            uint64_t       chunk = bounce_size - (at - a0);
            if (chunk > want) {
                chunk = want;
            }
            const uint64_t a1 = mf_align_up(at + chunk, page);
            rc                = mf_pread_full(f->fd_direct, bounce, (size_t) (a1 - a0), a0, (size_t) (at + chunk - a0));
            if (rc == 0) {
                memcpy((char *) dst + done, (char *) bounce + (at - a0), (size_t) chunk);
                done += chunk;
            }
        }
        if (rc != -EINVAL) {
            return rc;
        }
        // O_DIRECT refused at read time: fall through to a buffered read
    }
    rc = mf_pread_full(f->fd, dst, (size_t) size, off, (size_t) size);
    if (rc == 0) {
        // the bytes now live in anonymous memory; do not keep a second copy in the page cache
        posix_fadvise(f->fd, (off_t) off, (off_t) size, POSIX_FADV_DONTNEED);
    }
    return rc;
}
