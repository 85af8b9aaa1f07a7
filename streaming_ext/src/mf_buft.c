// The streamer's three ggml buffer types, all host buffers of the CPU device.
//
// MF_EXPERTS holds the expert tensors (blk.N.ffn_*_exps.weight), one buffer per tensor (max size
// 1 byte), each a MAP_NORESERVE reservation that stays PROT_NONE: resident slices live in frames
// (mf_frames.c) the ready hook points the matmuls at, so a touch of the tensor's own memory
// faults. Under a budget that holds every expert the reservation is the slices' home instead
// (mf_buft_hold_all). init_tensor registers the tensor and places its data pointer congruent to
// its file offset modulo the page, so a page-aligned O_DIRECT read lands in place (the edge bytes
// it also brings are the neighbouring slices' own, correct bytes: weights are immutable);
// set_tensor ignores the loader's pointer into its (unread) file mapping.
// MF_DENSE holds everything else in anonymous memory asking for huge pages, read once in
// set_tensor (O_DIRECT through a bounce buffer when possible), so it never depends on the page
// cache.
// MF_ROWS holds a tensor a token reads one row of (the token embeddings of a model whose output
// matrix is its own tensor): init_tensor maps the file read-only over its reservation,
// MADV_RANDOM, so a token costs one page read and the rest is left to the expert cache. Like any
// mapping of the file, it assumes the file is not rewritten in place while the model is loaded.
// With repacked layouts on (mf_streamer_set_repack), weights of both kinds take the layout
// llama.cpp gives their resident twin (mf_repack_layout), so that both run the same kernels.
// Callbacks run on the thread that loads the model (get_tensor: any thread between decodes).
// See docs/streamer.md, "Buffer types".
#include "mf_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ggml-cpu.h"
#include "gguf.h"

typedef struct mf_buf {
    mf_streamer * s;
    char *        reserve;  // expert and row buffers: the whole reservation; dense: the mapping
    size_t        reserve_size;
    char *        base;
    mf_xtensor *  xt;      // expert buffers: the one tensor placed in it
    bool          mapped;  // row buffers: the file is mapped over the reservation
} mf_buf;

static mf_streamer * buft_streamer(ggml_backend_buffer_type_t buft) {
    return buft->context;
}

// ---------------------------------------------------------------- shared buffer callbacks
static void * buf_get_base(ggml_backend_buffer_t buffer) {
    return ((mf_buf *) buffer->context)->base;
}

static void buf_free(ggml_backend_buffer_t buffer) {
    // the mf_xtensor (if any) belongs to the streamer, which never touches it after the model is freed
    mf_buf * b = buffer->context;
    munmap(b->reserve, b->reserve_size);
    free(b);
}

static bool buft_is_host(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return true;
}

// ---------------------------------------------------------------- experts
static const char * xbuft_name(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return "MF_EXPERTS";
}

bool mf_buft_is_expert(ggml_backend_buffer_type_t buft) {
    return buft && buft->iface.get_name == xbuft_name;
}

mf_xtensor * mf_buffer_xtensor(ggml_backend_buffer_t buffer) {
    return ((mf_buf *) buffer->context)->xt;
}

// adds xt to the streamer's expert tensors (mf_streamer_check_loaded sorts them into layers)
static int register_xtensor(mf_streamer * s, mf_xtensor * xt) {
    if (s->n_xt == s->cap_xt) {
        const int32_t cap = s->cap_xt ? 2 * s->cap_xt : 64;
        mf_xtensor ** a   = realloc(s->xts, (size_t) cap * sizeof *a);
        if (!a) {
            mf_streamer_fail(s, -ENOMEM, "out of memory registering %s", xt->loc->name);
            return -ENOMEM;
        }
        s->xts    = a;
        s->cap_xt = cap;
    }
    s->xts[s->n_xt++] = xt;
    return 0;
}

void mf_buft_free_xtensors(mf_streamer * s) {
    for (int32_t i = 0; i < s->n_xt; i++) {
        free(s->xts[i]->state);
        free(s->xts[i]->slot);
        free(s->xts[i]->pending);
        free(s->xts[i]);
    }
    free(s->xts);
    s->xts    = NULL;
    s->n_xt   = 0;
    s->cap_xt = 0;
}

static enum ggml_status xbuf_init_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t) {
    mf_buf *      b = buffer->context;
    mf_streamer * s = b->s;
    if (t->view_src) {
        return GGML_STATUS_SUCCESS;  // a view shares its source's memory
    }
    int32_t  layer = -1;
    mf_loc * loc   = mf_index_find(&s->ix, t->name);
    if (b->xt || !loc || !mf_streamed_expert(s, t->name, &layer) || t->ne[2] < 1 || loc->size != ggml_nbytes(t) ||
        (size_t) t->nb[2] * (size_t) t->ne[2] != ggml_nbytes(t) || (char *) t->data != b->base) {
        mf_streamer_fail(s, -EINVAL, "tensor %s cannot be streamed (not an expert tensor of %s, or shared buffer)",
                         t->name, s->model_path);
        return GGML_STATUS_FAILED;
    }
    // place the tensor so that data = file offset (mod page): see the top of this file
    const uintptr_t base  = (uintptr_t) b->base;
    const uintptr_t shift = (uintptr_t) (loc->offset - base) & (s->page_size - 1);
    t->data               = (void *) (base + shift);

    mf_xtensor * xt = calloc(1, sizeof *xt);
    atomic_int * st = calloc((size_t) t->ne[2], sizeof *st);
    char **      sl = calloc((size_t) t->ne[2], sizeof *sl);
    int32_t *    pn = calloc((size_t) t->ne[2], sizeof *pn);
    if (!xt || !st || !sl || !pn) {
        free(xt);
        free(st);
        free(sl);
        free(pn);
        mf_streamer_fail(s, -ENOMEM, "out of memory registering %s", t->name);
        return GGML_STATUS_ALLOC_FAILED;
    }
    xt->s            = s;
    xt->t            = t;
    xt->loc          = loc;
    xt->layer        = layer;
    xt->n_expert     = (int32_t) t->ne[2];
    xt->nb2          = t->nb[2];
    xt->reserve      = b->reserve;
    xt->reserve_size = b->reserve_size;
    xt->data         = t->data;
    xt->layout       = mf_repack_layout(s, t, true);
    t->extra         = (void *) xt->layout;  // repack's kernels run it (patch 0009)
    xt->state        = st;
    xt->slot         = sl;
    xt->pending      = pn;
    if (register_xtensor(s, xt) != 0) {
        free(st);
        free(sl);
        free(pn);
        free(xt);
        return GGML_STATUS_FAILED;
    }
    b->xt = xt;
    if (xt->layout) {
        ADD(s->st.repacked_bytes, ggml_nbytes(t));
    }
    return GGML_STATUS_SUCCESS;
}

static void xbuf_set_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t, const void * data, size_t offset,
                            size_t size) {
    // the loader hands a pointer into its file mapping: never touch it (that would read the file)
    (void) buffer;
    (void) t;
    (void) data;
    (void) offset;
    (void) size;
}

static void xbuf_get_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * t, void * data, size_t offset,
                            size_t size) {
    // served from the file: the tensor's memory may be inaccessible
    mf_buf * b  = buffer->context;
    mf_loc * lo = mf_index_find(&b->s->ix, t->name);
    int      rc = -ENOENT;
    if (lo && offset + size <= lo->size) {
        rc = mf_pread_full(b->s->ix.files[lo->file].fd, data, size, lo->offset + offset, size);
    }
    if (rc != 0) {
        memset(data, 0, size);
        mf_streamer_fail(b->s, rc, "reading %s back from %s failed: %s", t->name, b->s->model_path, strerror(-rc));
    }
}

static void xbuf_memset_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t, uint8_t value, size_t offset,
                               size_t size) {
    (void) value;
    (void) offset;
    (void) size;
    mf_buf * b = buffer->context;
    mf_streamer_fail(b->s, -EPERM, "memset of streamed expert tensor %s refused (weights are read-only)", t->name);
}

static void xbuf_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    // weights are never cleared; a reservation reads as inaccessible until filled
    (void) buffer;
    (void) value;
}

static const struct ggml_backend_buffer_i xbuf_iface = {
    .free_buffer   = buf_free,
    .get_base      = buf_get_base,
    .init_tensor   = xbuf_init_tensor,
    .memset_tensor = xbuf_memset_tensor,
    .set_tensor    = xbuf_set_tensor,
    .get_tensor    = xbuf_get_tensor,
    .set_tensor_2d = NULL,
    .get_tensor_2d = NULL,
    .cpy_tensor    = NULL,
    .clear         = xbuf_clear,
    .reset         = NULL,
};

static ggml_backend_buffer_t xbuft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    mf_streamer * s    = buft_streamer(buft);
    const size_t  page = s->page_size;
    // one page in front and the alloc-size padding behind keep page-aligned reads inside
    const size_t  reserve_size = (size_t) mf_align_up(size, page) + 2 * page;
    // PROT_NONE: slices live in frames (see the top of this file); mf_buft_hold_all opens it up
    void *        p = mmap(NULL, reserve_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    mf_buf *      b = calloc(1, sizeof *b);
    int           rc = p == MAP_FAILED || !b ? -ENOMEM : 0;
    if (rc != 0) {
        if (p != MAP_FAILED) {
            munmap(p, reserve_size);
        }
        free(b);
        mf_streamer_fail(s, rc, "cannot reserve %zu bytes of address space for experts: %s", reserve_size, strerror(-rc));
        return NULL;
    }
    b->s            = s;
    b->reserve      = p;
    b->reserve_size = reserve_size;
    b->base         = (char *) p + page;
    return ggml_backend_buffer_init(buft, xbuf_iface, b, size);
}

static size_t xbuft_alignment(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return GGUF_DEFAULT_ALIGNMENT;  // the real placement is chosen in init_tensor
}

static size_t xbuft_max_size(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return 1;  // one buffer per tensor
}

static size_t xbuft_alloc_size(ggml_backend_buffer_type_t buft, const struct ggml_tensor * t) {
    // room to shift the data pointer and read whole pages
    return ggml_nbytes(t) + 2 * buft_streamer(buft)->page_size;
}

int mf_buft_hold_all(mf_streamer * s) {
    for (int32_t j = 0; j < s->n_xt; j++) {
        mf_xtensor * xt = s->xts[j];
        // read-write from the start (not PROT_NONE per absent slice): mprotect per slice would cut
        // the reservation into one mapping per slice, and a huge page needs 2 MiB of one mapping
        if (mprotect(xt->reserve, xt->reserve_size, PROT_READ | PROT_WRITE) != 0) {
            return -errno;
        }
        // an optimisation only: where the kernel gives no huge pages the slices sit in 4 KiB ones
        (void) madvise(xt->reserve, xt->reserve_size, MADV_HUGEPAGE);
    }
    return 0;
}

// ---------------------------------------------------------------- dense
static const char * dbuft_name(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return "MF_DENSE";
}

static enum ggml_status dbuf_init_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t) {
    const mf_streamer * s   = ((mf_buf *) buffer->context)->s;
    const mf_loc *      loc = mf_index_find(&s->ix, t->name);
    if (!t->view_src && loc && loc->size == ggml_nbytes(t)) {
        t->extra = (void *) mf_repack_layout(s, t, false);  // a file weight: repack's kernels run it (patch 0009)
    }
    return GGML_STATUS_SUCCESS;
}

// reads file tensor loc into t->data, in t's layout
static int read_dense(mf_streamer * s, const mf_loc * loc, struct ggml_tensor * t) {
    int rc = mf_read_whole(&s->ix.files[loc->file], s->bounce, s->bounce_size, s->page_size, loc->offset, loc->size,
                           t->data);
    if (rc == 0 && t->extra) {
        rc = mf_repack_in_place(t);
        if (rc == 0) {
            ADD(s->st.repacked_bytes, loc->size);
        }
    }
    return rc;
}

static void dbuf_set_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t, const void * data, size_t offset,
                            size_t size) {
    mf_buf *   b   = buffer->context;
    mf_loc *   loc = mf_index_find(&b->s->ix, t->name);
    const bool whole_file_tensor = loc && offset == 0 && size == loc->size && size == ggml_nbytes(t);
    if (!whole_file_tensor) {
        if (t->extra) {
            mf_streamer_fail(b->s, -EINVAL, "partial write of repacked weight %s refused", t->name);
            return;
        }
        // not a file tensor (or a partial update): take the caller's bytes
        memcpy((char *) t->data + offset, data, size);
        return;
    }
    if (loc->dense_data && loc->dense_layout == t->extra) {
        // a second tensor of the same file bytes (gemma4's tied output matrix, which llama.cpp
        // allocates apart from the token embeddings): both are read-only weights, so this one uses
        // the first copy, and its own pages, never touched, cost nothing (no huge pages for them)
        const size_t    page = b->s->page_size;
        const uintptr_t lo   = (uintptr_t) mf_align_up((uintptr_t) t->data, page);
        const uintptr_t hi   = (uintptr_t) mf_align_down((uintptr_t) t->data + size, page);
        if (hi > lo) {
            (void) madvise((void *) lo, hi - lo, MADV_NOHUGEPAGE);
        }
        t->data = loc->dense_data;
        return;
    }
    // read it ourselves rather than from the loader's mapping: no page cache left behind
    const int rc = read_dense(b->s, loc, t);
    if (rc != 0) {
        mf_streamer_fail(b->s, rc, "reading %s from %s failed: %s", t->name, b->s->ix.files[loc->file].path,
                         strerror(-rc));
        memset(t->data, 0, size);
        return;
    }
    ADD(b->s->st.dense_bytes, loc->size);
    loc->dense_data   = t->data;
    loc->dense_layout = t->extra;
    // routers and norms, for predicting the next layer's experts (an optimisation: without
    // memory for the note, that layer is simply not predicted)
    (void) mf_predict_note(b->s, t);
}

// dense and row buffers hold a tensor's bytes at its data pointer
static void host_get_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * t, void * data, size_t offset,
                            size_t size) {
    (void) buffer;
    memcpy(data, (const char *) t->data + offset, size);
}

static void dbuf_memset_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t, uint8_t value, size_t offset,
                               size_t size) {
    (void) buffer;
    memset((char *) t->data + offset, value, size);
}

static void dbuf_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    memset(((mf_buf *) buffer->context)->base, value, buffer->size);
}

static const struct ggml_backend_buffer_i dbuf_iface = {
    .free_buffer   = buf_free,
    .get_base      = buf_get_base,
    .init_tensor   = dbuf_init_tensor,
    .memset_tensor = dbuf_memset_tensor,
    .set_tensor    = dbuf_set_tensor,
    .get_tensor    = host_get_tensor,
    .set_tensor_2d = NULL,
    .get_tensor_2d = NULL,
    .cpy_tensor    = NULL,
    .clear         = dbuf_clear,
    .reset         = NULL,
};

// a buffer over one anonymous mapping of reserve_size bytes, based at its start (dense and rows)
static ggml_backend_buffer_t anon_buffer(ggml_backend_buffer_type_t buft, const struct ggml_backend_buffer_i * iface,
                                         size_t size, size_t reserve_size, int prot, int flags, const char * what) {
    mf_streamer * s = buft_streamer(buft);
    void *        p = mmap(NULL, reserve_size, prot, MAP_PRIVATE | MAP_ANONYMOUS | flags, -1, 0);
    mf_buf *      b = calloc(1, sizeof *b);
    if (p == MAP_FAILED || !b) {
        if (p != MAP_FAILED) {
            munmap(p, reserve_size);
        }
        free(b);
        mf_streamer_fail(s, -ENOMEM, "cannot map %zu bytes for %s", reserve_size, what);
        return NULL;
    }
    b->s            = s;
    b->reserve      = p;
    b->reserve_size = reserve_size;
    b->base         = p;
    return ggml_backend_buffer_init(buft, *iface, b, size);
}

static ggml_backend_buffer_t dbuft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    const size_t          page         = buft_streamer(buft)->page_size;
    const size_t          reserve_size = size ? (size_t) mf_align_up(size, page) : page;
    ggml_backend_buffer_t buffer =
        anon_buffer(buft, &dbuf_iface, size, reserve_size, PROT_READ | PROT_WRITE, 0, "dense weights");
    if (buffer) {
        // every byte of it is read at load and used by every token: huge pages cost no memory and
        // spare the matmuls TLB misses (an optimisation only, so its failure is ignored)
        (void) madvise(((mf_buf *) buffer->context)->reserve, reserve_size, MADV_HUGEPAGE);
    }
    return buffer;
}

static size_t dbuft_alignment(ggml_backend_buffer_type_t buft) {
    return buft_streamer(buft)->dense_alignment;
}

// ---------------------------------------------------------------- rows
static const char * rbuft_name(ggml_backend_buffer_type_t buft) {
    (void) buft;
    return "MF_ROWS";
}

static enum ggml_status rbuf_init_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t) {
    mf_buf *      b = buffer->context;
    mf_streamer * s = b->s;
    if (t->view_src) {
        return GGML_STATUS_SUCCESS;
    }
    mf_loc * loc = mf_index_find(&s->ix, t->name);
    if (b->mapped || !loc || loc->size != ggml_nbytes(t) || (char *) t->data != b->base) {
        mf_streamer_fail(s, -EINVAL, "tensor %s cannot be mapped from %s (not a file tensor, or a shared buffer)",
                         t->name, s->model_path);
        return GGML_STATUS_FAILED;
    }
    // data congruent to the file offset modulo the page size, so that the file maps in place at base
    const uint64_t in_page = loc->offset & (s->page_size - 1);
    t->data                = b->base + in_page;
    const size_t len       = (size_t) mf_align_up(in_page + loc->size, s->page_size);
    void * p = mmap(b->base, len, PROT_READ, MAP_PRIVATE | MAP_FIXED, s->ix.files[loc->file].fd,
                    (off_t) (loc->offset - in_page));
    if (p == MAP_FAILED) {
        const int rc = -errno;
        mf_streamer_fail(s, rc, "cannot map %s from %s: %s", t->name, s->ix.files[loc->file].path, strerror(-rc));
        return GGML_STATUS_FAILED;
    }
    // one row per token: readahead around a fault (8 MiB on some disks) would read rows nobody asked for
    (void) madvise(p, len, MADV_RANDOM);
    b->mapped = true;
    ADD(s->st.mapped_bytes, loc->size);
    return GGML_STATUS_SUCCESS;
}

static void rbuf_memset_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t, uint8_t value, size_t offset,
                               size_t size) {
    (void) value;
    (void) offset;
    (void) size;
    mf_buf * b = buffer->context;
    mf_streamer_fail(b->s, -EPERM, "memset of file-mapped tensor %s refused (weights are read-only)", t->name);
}

static const struct ggml_backend_buffer_i rbuf_iface = {
    .free_buffer   = buf_free,
    .get_base      = buf_get_base,
    .init_tensor   = rbuf_init_tensor,
    .memset_tensor = rbuf_memset_tensor,
    // the file is the tensor: the loader's bytes are the same ones, and copying them would read it all
    .set_tensor    = xbuf_set_tensor,
    .get_tensor    = host_get_tensor,
    .set_tensor_2d = NULL,
    .get_tensor_2d = NULL,
    .cpy_tensor    = NULL,
    .clear         = xbuf_clear,
    .reset         = NULL,
};

static ggml_backend_buffer_t rbuft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    // address space only: init_tensor maps the file over it
    const size_t page         = buft_streamer(buft)->page_size;
    const size_t reserve_size = (size_t) mf_align_up(size, page) + page;
    return anon_buffer(buft, &rbuf_iface, size, reserve_size, PROT_NONE, MAP_NORESERVE, "a file-mapped tensor");
}

static size_t rbuft_alloc_size(ggml_backend_buffer_type_t buft, const struct ggml_tensor * t) {
    // room for the shift to the file offset's place in its page
    return ggml_nbytes(t) + buft_streamer(buft)->page_size;
}

// the alignment of dense tensors: the cache line (a run-time fact; the build's where the system
// does not say), and never less than the CPU backend asks for
static size_t dense_alignment(ggml_backend_dev_t cpu) {
    const long line  = sysconf(_SC_LEVEL1_DCACHE_LINESIZE);
    size_t     align = line > 0 ? (size_t) line : 0;
#ifdef __GCC_DESTRUCTIVE_SIZE
    align = align ? align : (size_t) __GCC_DESTRUCTIVE_SIZE;
#endif
    const size_t backend = cpu ? ggml_backend_buft_get_alignment(ggml_backend_dev_buffer_type(cpu)) : 0;
    return align > backend ? align : backend;
}

void mf_buft_init(mf_streamer * s) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    s->dense_alignment     = dense_alignment(cpu);
    s->expert_buft         = (struct ggml_backend_buffer_type){
                .iface   = {
                    .get_name       = xbuft_name,
                    .alloc_buffer   = xbuft_alloc,
                    .get_alignment  = xbuft_alignment,
                    .get_max_size   = xbuft_max_size,
                    .get_alloc_size = xbuft_alloc_size,
                    .is_host        = buft_is_host,
        },
                .device  = cpu,
                .context = s,
    };
    s->dense_buft = (struct ggml_backend_buffer_type){
        .iface   = {
            .get_name       = dbuft_name,
            .alloc_buffer   = dbuft_alloc,
            .get_alignment  = dbuft_alignment,
            .get_max_size   = NULL,
            .get_alloc_size = NULL,
            .is_host        = buft_is_host,
        },
        .device  = cpu,
        .context = s,
    };
    s->rows_buft = (struct ggml_backend_buffer_type){
        .iface   = {
            .get_name       = rbuft_name,
            .alloc_buffer   = rbuft_alloc,
            .get_alignment  = xbuft_alignment,
            .get_max_size   = xbuft_max_size,  // one buffer per tensor, as for experts
            .get_alloc_size = rbuft_alloc_size,
            .is_host        = buft_is_host,
        },
        .device  = cpu,
        .context = s,
    };
}
