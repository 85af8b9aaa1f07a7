// The read loop every byte of the streamer goes through (in the spirit of SQLite's seekAndRead):
// retry EINTR, continue short reads, keep errno before any other call, and tell a read error
// (-errno) from a file that ended early (-ENODATA: it shrank or was replaced while open).
#include "mf_internal.h"

#include <errno.h>
#include <unistd.h>

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
