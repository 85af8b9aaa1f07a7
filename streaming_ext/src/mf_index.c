// The GGUF index: tensor name -> (file, absolute offset, size), over every file of a split set.
// Every tensor's extent is checked against its file's size before use, so a truncated or foreign
// file is a clear error at load, never a fault later. Built by mf_streamer_new; afterwards only a
// tensor's dense_data changes (while the model loads).
#include "mf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"
#include "llama.h"

static int cmp_loc(const void * a, const void * b) {
    return strcmp(((const mf_loc *) a)->name, ((const mf_loc *) b)->name);
}

bool mf_is_expert_name(const char * name, int32_t * layer) {
    // blk.<il>.ffn_{gate,up,down,gate_up}_exps.weight
    int il = -1, n = 0;
    if (sscanf(name, "blk.%d.%n", &il, &n) != 1 || il < 0 || n <= 0) {
        return false;
    }
    const char * rest = name + n;
    static const char * const kinds[] = { "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                                          "ffn_gate_up_exps.weight" };
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        if (strcmp(rest, kinds[i]) == 0) {
            if (layer) {
                *layer = il;
            }
            return true;
        }
    }
    return false;
}

bool mf_streamed_expert(const mf_streamer * s, const char * name, int32_t * layer) {
    int32_t il = -1;
    if (!mf_is_expert_name(name, &il) || (s->cfg.layers > 0 && il >= s->cfg.layers)) {
        return false;
    }
    if (layer) {
        *layer = il;
    }
    return true;
}

static int open_file(mf_file * f, const char * path, bool direct, char * err, size_t err_size) {
    f->fd        = -1;
    f->fd_direct = -1;
    f->path      = strdup(path);
    if (!f->path) {
        return -ENOMEM;
    }
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        const int e = errno;
        snprintf(err, err_size, "cannot open %s: %s", path, strerror(e));
        return -e;
    }
    struct stat st;
    if (fstat(f->fd, &st) != 0) {
        const int e = errno;
        snprintf(err, err_size, "cannot stat %s: %s", path, strerror(e));
        return -e;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, err_size, "%s is not a regular file", path);
        return -EINVAL;
    }
    f->size = (uint64_t) st.st_size;
    if (direct) {
        // refused on some file systems (tmpfs, Android FUSE): buffered reads are the fallback
        f->fd_direct = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    }
    return 0;
}

static int add_file(mf_index * ix, const char * path, bool direct, int32_t split_no, int32_t n_split, int64_t * cap,
                    char * err, size_t err_size) {
    mf_file * f  = &ix->files[ix->n_files];
    int       rc = open_file(f, path, direct, err, err_size);
    ix->n_files++;
    if (rc != 0) {
        return rc;
    }
    struct gguf_init_params gp  = { .no_alloc = true, .ctx = NULL };
    struct gguf_context *   ctx = gguf_init_from_file(path, gp);
    if (!ctx) {
        snprintf(err, err_size, "%s is not a valid GGUF file (bad magic, version or header)", path);
        return -EINVAL;
    }
    if (n_split > 1) {
        const int64_t key = gguf_find_key(ctx, "split.no");
        if (key < 0 || gguf_get_kv_type(ctx, key) != GGUF_TYPE_UINT16 || gguf_get_val_u16(ctx, key) != split_no) {
            snprintf(err, err_size, "%s is not split %d of its set (split.no missing or different)", path,
                     (int) split_no + 1);
            gguf_free(ctx);
            return -EINVAL;
        }
    }
    const uint64_t data_off = gguf_get_data_offset(ctx);
    const int64_t  n        = gguf_get_n_tensors(ctx);
    if (ix->n_locs + n > *cap) {
        const int64_t new_cap = (ix->n_locs + n) * 2;
        mf_loc *      locs    = realloc(ix->locs, (size_t) new_cap * sizeof *locs);
        if (!locs) {
            gguf_free(ctx);
            return -ENOMEM;
        }
        ix->locs = locs;
        *cap     = new_cap;
    }
    for (int64_t i = 0; i < n; i++) {
        mf_loc * l = &ix->locs[ix->n_locs];
        l->offset  = data_off + gguf_get_tensor_offset(ctx, i);
        l->size    = gguf_get_tensor_size(ctx, i);
        l->file    = ix->n_files - 1;
        l->dense_data   = NULL;
        l->dense_layout = NULL;
        if (l->offset + l->size < l->offset || l->offset + l->size > f->size) {
            snprintf(err, err_size,
                     "%s is truncated or corrupt: tensor %s needs bytes %llu..%llu but the file has %llu", path,
                     gguf_get_tensor_name(ctx, i), (unsigned long long) l->offset,
                     (unsigned long long) (l->offset + l->size), (unsigned long long) f->size);
            gguf_free(ctx);
            return -EINVAL;
        }
        l->name = strdup(gguf_get_tensor_name(ctx, i));
        if (!l->name) {
            gguf_free(ctx);
            return -ENOMEM;
        }
        ix->n_locs++;
    }
    gguf_free(ctx);
    return 0;
}

int mf_index_open(mf_index * ix, const char * path, bool direct, char * err, size_t err_size) {
    memset(ix, 0, sizeof *ix);
    struct stat st;
    if (stat(path, &st) != 0) {
        const int e = errno;
        snprintf(err, err_size, "cannot open %s: %s", path, strerror(e));
        return -e;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, err_size, "%s is not a regular file", path);
        return -EINVAL;
    }
    struct gguf_init_params gp  = { .no_alloc = true, .ctx = NULL };
    struct gguf_context *   ctx = gguf_init_from_file(path, gp);
    if (!ctx) {
        if (access(path, R_OK) != 0) {
            const int e = errno;
            snprintf(err, err_size, "cannot read %s: %s", path, strerror(e));
            return -e;
        }
        snprintf(err, err_size, "%s is not a valid GGUF file (bad magic, version or header)", path);
        return -EINVAL;
    }
    int32_t       n_split = 1;
    const int64_t key     = gguf_find_key(ctx, "split.count");
    if (key >= 0 && gguf_get_kv_type(ctx, key) == GGUF_TYPE_UINT16) {
        n_split = gguf_get_val_u16(ctx, key);
    }
    gguf_free(ctx);
    if (n_split < 1 || n_split > MF_MAX_SPLITS) {
        snprintf(err, err_size, "%s: unsupported split.count %d", path, (int) n_split);
        return -EINVAL;
    }

    int64_t cap = 0;
    if (n_split == 1) {
        const int rc = add_file(ix, path, direct, 0, 1, &cap, err, err_size);
        if (rc == 0) {
            qsort(ix->locs, (size_t) ix->n_locs, sizeof *ix->locs, cmp_loc);
        }
        return rc;
    }
    char prefix[PATH_MAX];
    if (llama_split_prefix(prefix, sizeof prefix, path, 0, n_split) <= 0) {
        snprintf(err, err_size, "%s belongs to a set of %d splits but is not its first file (-00001-of-%05d.gguf)",
                 path, (int) n_split, (int) n_split);
        return -EINVAL;
    }
    for (int32_t i = 0; i < n_split; i++) {
        char split_path[PATH_MAX];
        llama_split_path(split_path, sizeof split_path, prefix, i, n_split);
        const int rc = add_file(ix, split_path, direct, i, n_split, &cap, err, err_size);
        if (rc != 0) {
            return rc;
        }
    }
    qsort(ix->locs, (size_t) ix->n_locs, sizeof *ix->locs, cmp_loc);
    return 0;
}

void mf_index_close(mf_index * ix) {
    for (int32_t i = 0; i < ix->n_files; i++) {
        if (ix->files[i].fd >= 0) {
            close(ix->files[i].fd);
        }
        if (ix->files[i].fd_direct >= 0) {
            close(ix->files[i].fd_direct);
        }
        free(ix->files[i].path);
    }
    for (int64_t i = 0; i < ix->n_locs; i++) {
        free(ix->locs[i].name);
    }
    free(ix->locs);
    memset(ix, 0, sizeof *ix);
}

mf_loc * mf_index_find(const mf_index * ix, const char * name) {
    mf_loc key = { .name = (char *) name };
    return bsearch(&key, ix->locs, (size_t) ix->n_locs, sizeof *ix->locs, cmp_loc);
}
