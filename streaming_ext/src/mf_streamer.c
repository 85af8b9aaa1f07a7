// The expert streamer's life cycle: create, configure (budget, buffer types), free, counters.
//
// mf_streamer_new indexes the GGUF, sizes the experts, starts the reader lanes (mf_lanes.c) and
// installs the ready hook (mf_callback.c); mf_streamer_check_loaded (mf_build.c) builds the rest
// once the model has loaded. The routing itself is mf_callback.c's, prefetch mf_prefetch.c's, the
// cache's warmth between requests (preload, drop, hot set, warm start) mf_warm.c's.
// Thread contract (moeflash_stream.h): one thread at a time per streamer, the loading thread then
// the decode thread; mf_streamer_get_stats from any thread, lock-free. Nothing here aborts: a
// failure returns -errno with a message in last_error. See docs/streamer.md.
#include "mf_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"

#define MF_BOUNCE_SIZE (8u << 20)  // the O_DIRECT chunk of dense reads at load (a multiple of any page size)

// ---------------------------------------------------------------- errors
int mf_streamer_take_error(mf_streamer * s, char * msg, size_t msg_size) {
    // a graph stopped by an error leaves prefetches in flight: their outcome belongs to this
    // request, not to the next one
    mf_lanes_wait_all(s);
    return mf_error_take(s, msg, msg_size);
}

const char * mf_streamer_last_error(const mf_streamer * s) {
    return s->last_error;
}

// ---------------------------------------------------------------- life cycle
static int fail_new(mf_streamer * s, int rc, char * last_error, size_t last_error_size) {
    if (last_error && last_error_size) {
        snprintf(last_error, last_error_size, "%s", s->last_error);
    }
    mf_streamer_free(s);
    return rc;
}

// sums the bytes of the file's expert tensors, in all and per layer: the largest layer's is the
// budget floor (a micro-batch may route to every expert of a layer). 0 or -ENOMEM
static int measure_experts(mf_streamer * s) {
    int32_t n_layers = 0;
    for (int64_t i = 0; i < s->ix.n_locs; i++) {
        int32_t l = -1;
        if (mf_streamed_expert(s, s->ix.locs[i].name, &l)) {
            n_layers = l + 1 > n_layers ? l + 1 : n_layers;
        }
    }
    uint64_t * per_layer = calloc((size_t) n_layers + 1, sizeof *per_layer);
    if (!per_layer) {
        return -ENOMEM;
    }
    for (int64_t i = 0; i < s->ix.n_locs; i++) {
        int32_t l = -1;
        if (mf_streamed_expert(s, s->ix.locs[i].name, &l)) {
            per_layer[l] += s->ix.locs[i].size;
            s->expert_bytes += s->ix.locs[i].size;
        }
    }
    for (int32_t l = 0; l < n_layers; l++) {
        s->layer_bytes_max = per_layer[l] > s->layer_bytes_max ? per_layer[l] : s->layer_bytes_max;
    }
    free(per_layer);
    return 0;
}

int mf_streamer_new(const mf_config * cfg, mf_streamer ** out, char * last_error, size_t last_error_size) {
    *out            = NULL;
    mf_streamer * s = calloc(1, sizeof *s);
    if (!s) {
        return -ENOMEM;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    pthread_cond_init(&s->done_cv, NULL);
    s->cfg        = *cfg;
    s->page_size  = mf_page_size();
    s->skip_layer = -1;
    if (!cfg->model_path || cfg->lanes < 1 || cfg->lanes > MF_MAX_LANES || cfg->reader < MF_READER_DIRECT ||
        cfg->reader > MF_READER_BUFFERED || cfg->policy < MF_POLICY_LRU || cfg->policy > MF_POLICY_NONE ||
        cfg->prefetch < MF_PREFETCH_OFF || cfg->prefetch > MF_PREFETCH_HISTORY || cfg->fault_errno < 0 ||
        cfg->layers < 0 || !(cfg->skip_below >= 0.0f && cfg->skip_below < 1.0f)) {
        snprintf(s->last_error, sizeof s->last_error,
                 "invalid streamer configuration (lanes 1..%d, reader, policy, prefetch, layers, skip_below 0..1, model path)",
                 MF_MAX_LANES);
        return fail_new(s, -EINVAL, last_error, last_error_size);
    }
    if (s->page_size == 0 || (s->page_size & (s->page_size - 1)) != 0 || MF_BOUNCE_SIZE % s->page_size != 0) {
        snprintf(s->last_error, sizeof s->last_error, "unsupported page size %zu", s->page_size);
        return fail_new(s, -EINVAL, last_error, last_error_size);
    }
    s->model_path     = strdup(cfg->model_path);
    s->cfg.model_path = s->model_path;
    if (!s->model_path) {
        return fail_new(s, -ENOMEM, last_error, last_error_size);
    }
    int rc = mf_index_open(&s->ix, s->model_path, cfg->reader == MF_READER_DIRECT, s->last_error, sizeof s->last_error);
    if (rc != 0) {
        return fail_new(s, rc, last_error, last_error_size);
    }
    if ((rc = measure_experts(s)) != 0) {
        return fail_new(s, rc, last_error, last_error_size);
    }
    if (s->expert_bytes == 0) {
        snprintf(s->last_error, sizeof s->last_error,
                 "%s has no expert tensors (blk.N.ffn_*_exps.weight): not a Mixture-of-Experts model", s->model_path);
        return fail_new(s, -EINVAL, last_error, last_error_size);
    }
    s->direct = cfg->reader == MF_READER_DIRECT;
    for (int32_t i = 0; i < s->ix.n_files; i++) {
        s->direct &= s->ix.files[i].fd_direct >= 0;
    }
    MF_SET(s->st.direct_io, s->direct);
    if (s->direct) {
        if (posix_memalign(&s->bounce, s->page_size, MF_BOUNCE_SIZE) == 0) {
            s->bounce_size = MF_BOUNCE_SIZE;
        } else {
            s->bounce = NULL;  // dense tensors are then read buffered
        }
    }
    mf_buft_init(s);
    if ((rc = mf_lanes_start(s, cfg->lanes)) != 0) {
        snprintf(s->last_error, sizeof s->last_error, "cannot start reader lane: %s", strerror(-rc));
        return fail_new(s, rc, last_error, last_error_size);
    }
    // always: the hook says where each slice is (its frame). A stateless dispatcher, safe to leave
    // installed, and shared by every streamer
    ggml_cpu_set_mul_mat_id_ready_hook(mf_callback_ready_hook, NULL);
    *out = s;
    return 0;
}

void mf_streamer_free(mf_streamer * s) {
    if (!s) {
        return;
    }
    mf_lanes_stop(s);
    mf_buft_free_xtensors(s);
    mf_build_free_layers(s);
    free(s->queue);
    free(s->want);
    free(s->share_rows);
    free(s->seq_bytes);
    mf_batch_free(&s->batch);
    free(s->route_ids);
    free(s->skip_mask);
    free(s->pf_rows);
    free(s->noted);
    free(s->pred_v);
    free(s->pred_scores);
    free(s->want_next);
    mf_history_free(s);
    free(s->pf_mark);
    free(s->pf_cand);
    free(s->pf_class);
    free(s->pf_guessed);
    free(s->pf_routed);
    free(s->pf_closed_visits);
    free(s->bounce);
    mf_cache_free(s->cache);
    mf_frames_free(&s->frames);
    mf_index_close(&s->ix);
    free(s->model_path);
    pthread_cond_destroy(&s->work_cv);
    pthread_cond_destroy(&s->done_cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int mf_streamer_set_budget(mf_streamer * s, uint64_t budget_bytes) {
    if (budget_bytes < s->layer_bytes_max) {
        snprintf(s->last_error, sizeof s->last_error,
                 "budget of %llu bytes is smaller than one layer's experts (%llu bytes), which a prompt can route to",
                 (unsigned long long) budget_bytes, (unsigned long long) s->layer_bytes_max);
        return -EINVAL;
    }
    if (!s->cache) {
        s->budget_bytes = budget_bytes;
        atomic_store_explicit(&s->st.budget_bytes, budget_bytes, memory_order_relaxed);
        return 0;
    }
    if (s->hold_all) {
        snprintf(s->last_error, sizeof s->last_error,
                 "a budget holding every expert keeps them in the tensors' own memory: it cannot move");
        return -EBUSY;
    }
    if (budget_bytes > s->budget_max) {
        snprintf(s->last_error, sizeof s->last_error,
                 "budget of %llu bytes is over the %llu bytes the expert memory was built for",
                 (unsigned long long) budget_bytes, (unsigned long long) s->budget_max);
        return -ERANGE;
    }
    // reads still in flight (a stopped graph's prefetches) land before their frames move
    mf_lanes_wait_all(s);
    mf_lanes_reap_failures(s);
    if (mf_cache_set_budget(s->cache, budget_bytes) > 0) {
        mf_lanes_apply_evictions(s);
        s->pf_layer = -1;
    }
    if (budget_bytes < s->budget_bytes) {
        mf_frames_trim(&s->frames);  // the free frames' pages go back to the kernel
    }
    s->budget_bytes = budget_bytes;
    atomic_store_explicit(&s->st.budget_bytes, budget_bytes, memory_order_relaxed);
    return 0;
}

ggml_backend_buffer_type_t mf_streamer_expert_buft(mf_streamer * s) {
    return &s->expert_buft;
}

ggml_backend_buffer_type_t mf_streamer_dense_buft(mf_streamer * s) {
    return &s->dense_buft;
}

ggml_backend_buffer_type_t mf_streamer_rows_buft(mf_streamer * s) {
    return &s->rows_buft;
}

// every counter, by the list that declares them (each is stored where it changes: mf_internal.h)
void mf_streamer_get_stats(const mf_streamer * s, mf_stats * out) {
#define MF_STATS_COPY(name, kind, unit, text) out->name = MF_GET(s->st.name);
    MF_STATS_FIELDS(MF_STATS_COPY)
#undef MF_STATS_COPY
}

uint64_t mf_streamer_layer_bytes(const mf_streamer * s) {
    return s->layer_bytes_max;
}

uint64_t mf_streamer_expert_bytes(const mf_streamer * s) {
    return s->expert_bytes;
}

uint64_t mf_streamer_tensor_bytes(const mf_streamer * s, const char * name) {
    const mf_loc * loc = name ? mf_index_find(&s->ix, name) : NULL;
    return loc ? loc->size : 0;
}

int mf_streamer_set_repack(mf_streamer * s, int32_t on) {
    if (s->n_xt > 0 || MF_GET(s->st.dense_bytes) > 0) {
        return -EBUSY;  // a model already took its layouts
    }
    s->repack = on != 0;
    return 0;
}

ggml_backend_buffer_type_t mf_cpu_buft(void) {
    return ggml_backend_cpu_buffer_type();
}

int mf_streamer_tensor_repacked(const mf_streamer * s, const char * name) {
    const mf_loc * loc = name ? mf_index_find(&s->ix, name) : NULL;
    if (!loc) {
        return -ENOENT;
    }
    for (int32_t j = 0; j < s->n_xt; j++) {
        if (s->xts[j]->loc == loc) {
            return s->xts[j]->layout != NULL;
        }
    }
    return loc->dense_data && loc->dense_layout;
}

int32_t mf_streamer_n_moe_layers(const mf_streamer * s) {
    int32_t n = 0;
    for (int32_t l = 0; l < s->n_layers; l++) {
        n += s->layers[l].n_xt > 0;
    }
    return n;
}

const char * mf_streamer_memory_note(const mf_streamer * s) {
    return s->memory_note;
}

int32_t mf_streamer_n_expert(const mf_streamer * s) {
    return s->n_expert;
}

int mf_streamer_begin_batch(mf_streamer * s, int64_t n_tokens, const int32_t * seq, const uint8_t * output,
                            int64_t n_ubatch, const int64_t * ends) {
    int rc = mf_batch_set(&s->batch, n_tokens, seq, output, n_ubatch, ends);
    int64_t n_seq = 0;
    for (int64_t i = 0; rc == 0 && i < n_tokens; i++) {
        n_seq = seq[i] + 1 > n_seq ? seq[i] + 1 : n_seq;
    }
    const int64_t had = s->cap_seq_bytes;
    if (rc == 0 && mf_grow((void **) &s->seq_bytes, &s->cap_seq_bytes, n_seq, sizeof *s->seq_bytes) != 0) {
        rc = -ENOMEM;
    }
    if (s->cap_seq_bytes > had) {
        memset(s->seq_bytes + had, 0, (size_t) (s->cap_seq_bytes - had) * sizeof *s->seq_bytes);
    }
    if (rc != 0) {
        mf_batch_set(&s->batch, 0, NULL, NULL, 0, NULL);  // its routes count as unmapped
    }
    return rc;
}

int32_t mf_streamer_take_seq_bytes(mf_streamer * s, double * by_seq, int32_t n_seq, double * unmapped) {
    int32_t used = 0;
    for (int64_t i = 0; i < s->cap_seq_bytes; i++) {
        used = s->seq_bytes[i] > 0.0 ? (int32_t) i + 1 : used;
    }
    for (int32_t i = 0; by_seq && i < n_seq; i++) {
        by_seq[i] = i < s->cap_seq_bytes ? s->seq_bytes[i] : 0.0;
    }
    if (unmapped) {
        *unmapped = s->unmapped_bytes;
    }
    if (s->cap_seq_bytes > 0) {
        memset(s->seq_bytes, 0, (size_t) s->cap_seq_bytes * sizeof *s->seq_bytes);
    }
    s->unmapped_bytes = 0.0;
    return used;
}
