// Expert memory: frames of one arena that loads read into and evictions hand back.
//
// The ready hook returns where an expert's slice is, so a slice need not sit at its tensor's own
// address: every resident (layer, expert) entry gets a frame, one page-aligned range holding each
// of its tensors' slices in whole pages (as an O_DIRECT read brings them), in an arena mapped once.
// An eviction puts the frame on a free list and a load reads into a free frame: no page table
// changes on the way, so no TLB shootdown (the cost that made a page-moving design slow).
// All frames have one size (the streamer's: its largest entry's), so any free frame serves any entry.
// A frame's pages are faulted in by its first read and kept while it is free ("warm": the next
// load needs no fresh zeroed pages) until mf_frames_trim gives them back.
// Threads: frames are taken and given back on the decode thread only, never while a read into
// them is in flight; lanes only read into them. See docs/streamer.md, "Expert memory".
#include "mf_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int mf_frames_init(mf_frames * fr, size_t frame_bytes, int32_t cap, atomic_uint_fast64_t * populated,
                   atomic_uint_fast64_t * released) {
    memset(fr, 0, sizeof *fr);
    if (cap <= 0 || frame_bytes == 0 || frame_bytes % mf_page_size() != 0 || !populated || !released) {
        return -EINVAL;
    }
    fr->populated   = populated;
    fr->released    = released;
    fr->frame_bytes = frame_bytes;
    fr->cap         = cap;
    fr->size        = (size_t) cap * frame_bytes;
    // address space only (MAP_NORESERVE): a frame uses memory once a read has touched it
    void * p        = mmap(NULL, fr->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    fr->warm        = calloc((size_t) cap, sizeof *fr->warm);
    fr->cold        = calloc((size_t) cap, sizeof *fr->cold);
    if (p == MAP_FAILED || !fr->warm || !fr->cold) {
        const int rc = p == MAP_FAILED ? -errno : -ENOMEM;
        fr->base     = p == MAP_FAILED ? NULL : p;
        mf_frames_free(fr);
        return rc;
    }
    fr->base = p;
    // transparent huge pages where a 2 MiB range of the arena lies wholly in touched frames: the
    // expert matmuls read every routed slice from here, and 4 KiB pages cost them TLB misses that
    // every expert held in place (hold_all, huge pages) does not pay. A hint: errors are ignored
    (void) madvise(p, fr->size, MADV_HUGEPAGE);
    // popped from the top: frames are first used in address order
    for (int32_t i = 0; i < cap; i++) {
        fr->cold[i] = cap - 1 - i;
    }
    fr->n_cold = cap;
    return 0;
}

void mf_frames_free(mf_frames * fr) {
    if (fr->base) {
        munmap(fr->base, fr->size);
    }
    if (fr->populated) {
        atomic_store_explicit(fr->populated, 0, memory_order_relaxed);  // the pages went with the mapping
    }
    free(fr->warm);
    free(fr->cold);
    memset(fr, 0, sizeof *fr);
}

char * mf_frames_addr(const mf_frames * fr, int32_t id) {
    return fr->base + (size_t) id * fr->frame_bytes;
}

int32_t mf_frames_take(mf_frames * fr) {
    if (fr->n_warm > 0) {
        return fr->warm[--fr->n_warm];  // the most recently freed: its pages are likely in the CPU cache
    }
    if (fr->n_cold == 0) {
        return -1;
    }
    atomic_fetch_add_explicit(fr->populated, fr->frame_bytes, memory_order_relaxed);
    return fr->cold[--fr->n_cold];
}

void mf_frames_give(mf_frames * fr, int32_t id) {
    fr->warm[fr->n_warm++] = id;
}

void mf_frames_trim(mf_frames * fr) {
    while (fr->n_warm > 0) {
        const int32_t id = fr->warm[--fr->n_warm];
        // errors are not fatal: the frame keeps its pages, only the memory is not returned
        (void) madvise(mf_frames_addr(fr, id), fr->frame_bytes, MADV_DONTNEED);
        fr->cold[fr->n_cold++] = id;
        atomic_fetch_sub_explicit(fr->populated, fr->frame_bytes, memory_order_relaxed);
        atomic_fetch_add_explicit(fr->released, 1, memory_order_relaxed);
    }
}
