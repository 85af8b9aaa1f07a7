// The CPU backend's repacked layouts for the streamer's weights (docs/streamer.md, "Repacked
// layouts"): which weights get one (llama.cpp's rule), and writing them in it: a dense weight in
// place at load, an expert slice after its read. Called on the loading thread (buffer types) and
// the lanes (slices).
#include "mf_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"

// llama.cpp (use_extra_bufts on, server/loading/context.py) repacks a weight when the CPU backend
// has a layout for its type and shape on this CPU (ggml_cpu_repack_layout, patch 0009) and its use
// is a matrix product: MUL_MAT of a 2D weight, MUL_MAT_ID of a 3D expert tensor. Every weight of
// llama-arch.cpp's tensor table is used so but those read by row (GET_ROWS), named here. (A tied
// output matrix, the token embeddings' second copy, is a product: server/loading/streaming.py
// leaves those embeddings to llama.cpp when that copy has a layout.) A layout keeps the file's
// size and slice offsets: only the bytes within a slice move.
static const char * const row_read_tensors[] = { "token_embd.", "position_embd.", "token_types.",
                                                 "per_layer_token_embd." };

static const void * llama_layout(const struct ggml_tensor * t, bool expert) {
    for (size_t i = 0; i < sizeof row_read_tensors / sizeof *row_read_tensors; i++) {
        if (strncmp(t->name, row_read_tensors[i], strlen(row_read_tensors[i])) == 0) {
            return NULL;
        }
    }
    return ggml_n_dims(t) == (expert ? 3 : 2) ? ggml_cpu_repack_layout(t) : NULL;
}

const void * mf_repack_layout(const mf_streamer * s, const struct ggml_tensor * t, bool expert) {
    return s->repack ? llama_layout(t, expert) : NULL;
}

uint64_t mf_repacked_bytes(const char * name, int32_t type, int64_t ne0, int64_t ne1, int64_t ne2) {
    if (!name || type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type) type) <= 0 ||
        ggml_type_size((enum ggml_type) type) == 0 || ne0 <= 0 || ne1 <= 0 || ne2 <= 0 ||
        ne0 % ggml_blck_size((enum ggml_type) type) != 0) {
        return 0;
    }
    struct ggml_tensor t = { .type = (enum ggml_type) type, .ne = { ne0, ne1, ne2, 1 } };
    t.nb[0]              = ggml_type_size(t.type);
    t.nb[1]              = ggml_row_size(t.type, ne0);
    t.nb[2]              = t.nb[1] * (size_t) ne1;
    t.nb[3]              = t.nb[2] * (size_t) ne2;
    snprintf(t.name, sizeof t.name, "%s", name);
    int32_t layer = -1;
    return llama_layout(&t, mf_is_expert_name(name, &layer)) ? ggml_nbytes(&t) : 0;
}

// A layout keeps each group of interleaved rows (4, 8 or 16) at its bytes' place, so a weight read
// in the file's layout is repacked in place a few rows at a time through a small copy: no second
// copy of a tensor, however large, exists at load, and an expert's bytes cross memory once each
// way after its read (through a copy of the whole slice they would cross it twice more).
#define MF_REPACK_ROWS 64  // rows a step: a multiple of every layout's group

size_t mf_repack_scratch_bytes(const struct ggml_tensor * t) {
    return t->nb[1] * MF_REPACK_ROWS;
}

// the matrix of t's shape (its first slice) at data, in the file's layout, written in `layout`
// through `copy` (mf_repack_scratch_bytes(t) bytes)
static int repack_rows(const void * layout, const struct ggml_tensor * t, char * data, void * copy) {
    const size_t       row  = t->nb[1];
    struct ggml_tensor part = *t;
    part.ne[2] = part.ne[3] = 1;
    int rc                  = 0;
    for (int64_t r = 0; r < t->ne[1] && rc == 0; r += MF_REPACK_ROWS) {
        part.ne[1]      = t->ne[1] - r < MF_REPACK_ROWS ? t->ne[1] - r : MF_REPACK_ROWS;
        part.nb[2]      = row * (size_t) part.ne[1];
        part.nb[3]      = part.nb[2];
        char * const at = data + (size_t) r * row;
        memcpy(copy, at, part.nb[2]);
        rc = ggml_cpu_repack_slice(layout, &part, at, copy, part.nb[2]) == 0 ? 0 : -EINVAL;
    }
    return rc;
}

int mf_repack_slice(mf_xtensor * xt, int32_t e, void * scratch) {
    return repack_rows(xt->layout, xt->t, xt->slot[e], scratch);
}

int mf_repack_in_place(struct ggml_tensor * t) {
    void * copy = malloc(mf_repack_scratch_bytes(t));
    if (!copy) {
        return -ENOMEM;
    }
    const int rc = repack_rows(t->extra, t, t->data, copy);
    free(copy);
    return rc;
}
