// Expert memory: frames of a fixed arena that loads read into and evictions hand back.
//
// DESIGN
// The mul_mat_id ready hook (patch 0002) returns where an expert's slice is, so a slice need not
// sit at its tensor's own address: every resident (layer, expert) entry gets a frame, one
// page-aligned range holding each of its tensors' slices in whole pages (as an O_DIRECT read
// brings them), in an arena mapped once. An eviction puts the frame back on a free list and a load
// reads into a free frame. No page table changes on the way, so no TLB shootdown.
// Why (session 11): the page pool this replaces (userfaultfd UFFDIO_MOVE of an evicted slice's
// pages to a loaded one, mf_pages.c until then) had to clear the page-table entries it moved, and
// every clear interrupts the other core (an IPI, which costs a virtual machine an exit: 20-30 us
// per 216-page move with the other core busy, /tmp/exp/mv.c, not kept, against 6-8 us idle).
// qwen30b-shape under a 25% budget moved 172 thousand pages per token; perf showed 14% of all
// samples sending those IPIs (native_write_msr, smp_call_function_many_cond), and the matmuls ran
// at 0.6 of their all-cached speed next to the reads. With the pages left in place (a test build
// that never released them, tokens 100 to 160 of one run, once every expert had pages), the same
// reads decoded 2.33 tok/s against 1.87.
// One size. Every frame has the bytes of the largest layer's entry in whole pages, so any free
// frame serves any entry, and the cache counts every entry at the largest entry's bytes (see
// setup_frames in mf_streamer.c). Why (session 12): frames of one size per entry size (Q4_K_M's
// experts come in two: Q6_K ffn_down on half the layers) kept memory exact, but a load of one
// size that found no free frame of its size made the other size give a frame's pages back
// (madvise, a TLB shootdown) and faulted fresh ones in: on about one load in two, as the sizes'
// live shares wander. Alternated A/B, 20-token prompt and 48 tokens (/tmp/exp/dec.sh, not kept),
// one size against the per-size frames with 64 of the budget's frames kept free (be21c58):
// gemma4-26b-shape under its 25% cap's budget 1.59-1.60 against 0.94-1.09 tok/s (6239 releases),
// qwen30b-q4km-shape 1.92-2.02 against 1.45-1.67 (524), both at 50% 2.00-2.38 against 1.77-1.93
// and 2.16-2.25 against 2.15-2.26 tok/s. The smaller entries' frames waste their tail (gemma4's
// Q5_0-down layers 17%), which the cache pays in entries it holds; the shootdowns cost more.
// Memory. A frame's pages are faulted in by its first read and kept while it is free ("warm": the
// next load needs no fresh zeroed pages). There are as many frames as the budget holds entries
// (plus two), so the memory held stays within the budget's entries in frames.
// Threads. Frames are taken and given back on the decode thread only (routing, prefetch, failure
// reaping, drop_cache), never while a read into them is in flight; lanes only read into them.
#include "mf_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int mf_frames_init(mf_frames * fr, size_t frame_bytes, int32_t cap) {
    memset(fr, 0, sizeof *fr);
    if (cap <= 0 || frame_bytes == 0 || frame_bytes % MF_PAGE != 0) {
        return -EINVAL;
    }
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
    atomic_fetch_add_explicit(&fr->populated, fr->frame_bytes, memory_order_relaxed);
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
        atomic_fetch_sub_explicit(&fr->populated, fr->frame_bytes, memory_order_relaxed);
        atomic_fetch_add_explicit(&fr->released, 1, memory_order_relaxed);
    }
}
