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
// Classes. Layers whose entries span the same bytes share a class: one region and one free list.
// Most models have one; Q4_K_M's experts come in two sizes (Q6_K ffn_down on half the layers).
// Memory. A frame's pages are faulted in by its first read and kept while it is free ("warm": the
// next load needs no fresh zeroed pages). The bytes of frames with pages, live or warm, stay
// within `limit`, set by the caller just above the most the budget's entries can occupy: a class
// that needs a frame it has never used first gives back (MADV_DONTNEED) warm frames of the other
// classes, one TLB shootdown each, and its read then faults fresh pages in. The classes' shares
// shift all the time (an entry of one size evicted for one of the other), so with two or more
// classes the cache keeps some of the budget's frames free (free_frames in mf_streamer.c): a
// class finds a warm frame of its own, and these releases become rare.
// Threads. Frames are taken and given back on the decode thread only (routing, prefetch, failure
// reaping, drop_cache), never while a read into them is in flight; lanes only read into them.
#include "mf_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int mf_frames_init(mf_frames * fr, const size_t * frame_bytes, const int32_t * cap, int32_t n_cls, size_t limit) {
    memset(fr, 0, sizeof *fr);
    if (n_cls <= 0) {
        return -EINVAL;
    }
    fr->cls   = calloc((size_t) n_cls, sizeof *fr->cls);
    fr->n_cls = n_cls;
    fr->limit = limit;
    if (!fr->cls) {
        fr->n_cls = 0;
        return -ENOMEM;
    }
    for (int32_t c = 0; c < n_cls; c++) {
        mf_frame_class * k = &fr->cls[c];
        if (cap[c] <= 0 || frame_bytes[c] == 0 || frame_bytes[c] % MF_PAGE != 0) {
            mf_frames_free(fr);
            return -EINVAL;
        }
        k->frame_bytes = frame_bytes[c];
        k->cap         = cap[c];
        k->size        = (size_t) cap[c] * frame_bytes[c];
        // address space only (MAP_NORESERVE): a frame uses memory once a read has touched it
        void * p       = mmap(NULL, k->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        k->warm        = calloc((size_t) cap[c], sizeof *k->warm);
        k->cold        = calloc((size_t) cap[c], sizeof *k->cold);
        if (p == MAP_FAILED || !k->warm || !k->cold) {
            const int rc = p == MAP_FAILED ? -errno : -ENOMEM;
            k->base      = p == MAP_FAILED ? NULL : p;
            mf_frames_free(fr);
            return rc;
        }
        k->base = p;
        // popped from the top: frames are first used in address order
        for (int32_t i = 0; i < cap[c]; i++) {
            k->cold[i] = cap[c] - 1 - i;
        }
        k->n_cold = cap[c];
    }
    return 0;
}

void mf_frames_free(mf_frames * fr) {
    for (int32_t c = 0; c < fr->n_cls; c++) {
        mf_frame_class * k = &fr->cls[c];
        if (k->base) {
            munmap(k->base, k->size);
        }
        free(k->warm);
        free(k->cold);
    }
    free(fr->cls);
    memset(fr, 0, sizeof *fr);
}

char * mf_frames_addr(const mf_frames * fr, int32_t c, int32_t id) {
    return fr->cls[c].base + (size_t) id * fr->cls[c].frame_bytes;
}

// gives the pages of warm frame `id` of class c back to the kernel (it becomes cold)
static void release(mf_frames * fr, int32_t c, int32_t id) {
    mf_frame_class * k = &fr->cls[c];
    // errors are not fatal: the frame keeps its pages, only the memory is not returned
    (void) madvise(mf_frames_addr(fr, c, id), k->frame_bytes, MADV_DONTNEED);
    k->cold[k->n_cold++] = id;
    atomic_fetch_sub_explicit(&fr->populated, k->frame_bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&fr->released, 1, memory_order_relaxed);
}

// whether `bytes` more of frames with pages stay within the limit
static bool fits(const mf_frames * fr, size_t bytes) {
    return atomic_load_explicit(&fr->populated, memory_order_relaxed) + bytes <= fr->limit;
}

int32_t mf_frames_take(mf_frames * fr, int32_t c) {
    mf_frame_class * k = &fr->cls[c];
    if (k->n_warm > 0) {
        return k->warm[--k->n_warm];  // the most recently freed: its pages are likely in the CPU cache
    }
    if (k->n_cold == 0) {
        return -1;
    }
    // a frame without pages adds to the memory held: make room from the other classes' warm frames
    for (int32_t o = 0; o < fr->n_cls && !fits(fr, k->frame_bytes); o++) {
        mf_frame_class * other = &fr->cls[o];
        while (o != c && other->n_warm > 0 && !fits(fr, k->frame_bytes)) {
            release(fr, o, other->warm[--other->n_warm]);
        }
    }
    atomic_fetch_add_explicit(&fr->populated, k->frame_bytes, memory_order_relaxed);
    return k->cold[--k->n_cold];
}

void mf_frames_give(mf_frames * fr, int32_t c, int32_t id) {
    mf_frame_class * k = &fr->cls[c];
    k->warm[k->n_warm++] = id;
}

void mf_frames_trim(mf_frames * fr) {
    for (int32_t c = 0; c < fr->n_cls; c++) {
        mf_frame_class * k = &fr->cls[c];
        while (k->n_warm > 0) {
            release(fr, c, k->warm[--k->n_warm]);
        }
    }
}
