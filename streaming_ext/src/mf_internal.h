// Internal structures of libmoeflash_stream, shared by its source files.
//
// Units, each calling only the ones listed after it (no circles):
//   mf_warm.c      between requests: preload, a cold cache, the hot set and warm start
//   mf_streamer.c  the API's life cycle: new/free, budget, buffer types, errors, counters
//   mf_build.c     after the load: layers, expert memory, cache, routing and prediction scratch
//   mf_callback.c  the graph's callbacks: the eval callback (routing) and the ready hook
//   mf_prefetch.c  the next layer's prefetch and its gate
//   mf_skip.c      dropping uncached low-weight experts (lossy, for measurement: skip_below)
//   mf_route.c     route traces: replayed and recorded routing (beside the streamer: calls none of it)
//   mf_batch.c     which token of a decode call each routed row is (the streamer and route traces)
//   mf_buft.c      the three buffer types; registers expert tensors while the model loads
//   mf_lanes.c     reader lanes and the memory of slices: carries out a route's loads and evictions
//   mf_repack.c    the CPU backend's repacked layouts: which weights, and writing them so
//   mf_predict.c   the next layer's experts, from its router
//   mf_history.c   the next layer's experts, from past routing
//   mf_cache.c     the cache policy's bookkeeping (mf_reuse.c: the LAYER policy's reuse model;
//                  mf_affinity.c: its routing affinity model)
//   mf_frames.c    the arena of frames that resident entries live in
//   mf_error.c     the streamer's error record
//   mf_index.c     the GGUF index
//   mf_io.c        the read loops and the clock
//   mf_layout.c    the layout of the structs shared with Python; mf_version.c: build facts
#pragma once

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include "ggml-backend-impl.h"
#include "ggml.h"
#include "moeflash_stream.h"

#define MF_MAX_SPLITS 256
#define MF_MAX_XT     4    // expert tensors per layer (gate, up, down; or gate_up, down)
#define MF_ERR_LEN    512

// The page size, a run-time fact: the alignment of O_DIRECT reads and the granularity of expert
// memory. The streamer reads it once (mf_streamer.page_size); code without a streamer at hand
// (the frames, tests/c/test_frames.c) asks here.
static inline size_t mf_page_size(void) {
    return (size_t) sysconf(_SC_PAGESIZE);
}

// x rounded down / up to a multiple of a (a power of two)
static inline uint64_t mf_align_down(uint64_t x, uint64_t a) {
    return x & ~(a - 1);
}
static inline uint64_t mf_align_up(uint64_t x, uint64_t a) {
    return (x + a - 1) & ~(a - 1);
}

// ---------------------------------------------------------------- GGUF index (mf_index.c)
typedef struct mf_file {
    char *   path;
    int      fd;         // buffered reads
    int      fd_direct;  // O_DIRECT, or -1 when the file system refuses it
    uint64_t size;       // at open; a read past it means the file changed
} mf_file;

typedef struct mf_loc {
    char *   name;
    int32_t  file;
    uint64_t offset;      // absolute offset of the tensor's data in its file
    uint64_t size;        // bytes
    void *   dense_data;  // where MF_DENSE read it, once it has (a second tensor of it shares that)
    const void * dense_layout;  // the layout it was read into there (NULL: the file's)
} mf_loc;

typedef struct mf_index {
    mf_file  files[MF_MAX_SPLITS];
    int32_t  n_files;
    mf_loc * locs;  // sorted by name
    int64_t  n_locs;
} mf_index;

int            mf_index_open(mf_index * ix, const char * path, bool direct, char * err, size_t err_size);
void           mf_index_close(mf_index * ix);
mf_loc *       mf_index_find(const mf_index * ix, const char * name);
bool           mf_is_expert_name(const char * name, int32_t * layer);
// an expert tensor of a layer this streamer streams (below cfg.layers when it is set)
bool           mf_streamed_expert(const mf_streamer * s, const char * name, int32_t * layer);

// ---------------------------------------------------------------- reads and time (mf_io.c)
uint64_t mf_now_ns(void);  // CLOCK_MONOTONIC, nanoseconds

// Reads exactly len bytes at off (retrying EINTR, continuing short reads). need <= len: reaching
// end of file after `need` bytes is fine (aligned reads may run past the last tensor).
// Returns 0, -errno on a read error, or -ENODATA when the file ended early (it changed size).
int mf_pread_full(int fd, void * buf, size_t len, uint64_t off, size_t need);

// Reads [off, off + len) of f into dst, which must be congruent to off modulo page and have room
// for the whole pages around the range: with direct (and f's O_DIRECT descriptor), those pages
// are read with O_DIRECT straight into place (buffered if refused at read time); without, the
// range is read buffered and its page-cache copy dropped. Returns as mf_pread_full.
int mf_read_in_place(const mf_file * f, bool direct, size_t page, char * dst, uint64_t off, size_t len);

// Reads [off, off + size) of f into dst (any alignment). With a bounce buffer (page-aligned,
// bounce_size a multiple of page) and an O_DIRECT descriptor: through the bounce buffer, chunk by
// chunk, so nothing enters the page cache; else (or when O_DIRECT is refused at read time)
// buffered, dropping the page-cache copy after. Returns as mf_pread_full.
int mf_read_whole(const mf_file * f, void * bounce, size_t bounce_size, size_t page, uint64_t off, uint64_t size,
                  void * dst);

// ---------------------------------------------------------------- expert memory (mf_frames.c)
// frames of one size, for the entries of every layer
typedef struct mf_frames {
    size_t               frame_bytes;  // a multiple of the page size
    char *               base;         // cap frames, read-write, MAP_NORESERVE
    size_t               size;
    int32_t              cap;
    int32_t *            warm;         // free frames whose pages are present (a stack)
    int32_t              n_warm;
    int32_t *            cold;         // free frames without pages (a stack: the lowest address on top at first)
    int32_t              n_cold;
    // the owner's counters (the streamer's mf_stats.expert_memory_bytes and frames_released):
    // bytes of frames with pages now, warm frames whose pages were given back
    atomic_uint_fast64_t * populated;
    atomic_uint_fast64_t * released;
} mf_frames;

// maps cap frames of frame_bytes, counting into *populated and *released (which must outlive the
// frames); 0 or -errno (nothing left mapped)
int     mf_frames_init(mf_frames * fr, size_t frame_bytes, int32_t cap, atomic_uint_fast64_t * populated,
                       atomic_uint_fast64_t * released);
// unmaps the frames (*populated back to 0); also after a failed init, or on a zeroed struct
void    mf_frames_free(mf_frames * fr);
// a free frame (warm first, else cold), -1 when none is left. Decode thread.
int32_t mf_frames_take(mf_frames * fr);
void    mf_frames_give(mf_frames * fr, int32_t id);  // decode thread, no read in flight
char *  mf_frames_addr(const mf_frames * fr, int32_t id);
void    mf_frames_trim(mf_frames * fr);  // gives every warm frame's pages back (a cold cache)

// ---------------------------------------------------------------- routing affinity (mf_affinity.c)
// weight, in observations, of the prior behind each estimate of the LAYER policy's models
#define MF_PRIOR_WEIGHT 2.0f
// lift classes, one per power of four: < 1/4, [1/4, 1), [1, 4), >= 4. Coarse on purpose: each
// class splits every (age, class) cell of the reuse model, whose observations are few early on
// (docs/streamer.md, "Affinity")
#define MF_LIFTS        4
#define MF_LIFT_NEUTRAL 2  // the class of lift 1 (no evidence either way)
// the window of the context lift: visits 2 to MF_WIN_H after a layer's visit (the next one is
// the lift's). Short: at the budgets where the policy matters the cache holds two to three
// tokens' working sets, so the reuses that decide evictions are a few tokens ahead
// (docs/streamer.md, "The window lift")
#define MF_WIN_H 4

// per layer: how the experts of one visit predict those of the next (see mf_affinity.c)
typedef struct mf_affinity {
    int32_t    n_layer;
    int32_t    n_expert;
    uint16_t * pair;     // [n_layer * n_expert * n_expert] visits routing e followed by one routing f
    uint16_t * src;      // [n_layer * n_expert] visits routing e followed by another visit
    uint16_t * marg;     // [n_layer * n_expert] visits routing f
    uint16_t * seen;     // [n_layer] visits counted
    uint8_t *  last;     // [n_layer * n_expert] the layer's last routed set
    uint8_t *  lift;     // [n_layer * n_expert] lift class of each entry at its layer's next visit
    float *    scratch;  // [n_expert]
    // the context window (visits 2..MF_WIN_H after a visit)
    uint32_t * count;    // [n_layer] visits so far (never halved: indexes the ring)
    uint8_t *  hist;     // [n_layer * MF_WIN_H * n_expert] the layer's last MF_WIN_H routed sets (ring)
    uint16_t * wpair;    // [n_layer * n_expert * n_expert] routes of f in the windows of visits routing e
    uint16_t * wsrc;     // [n_layer * n_expert] visits routing e whose window is complete
    uint16_t * wmarg;    // [n_layer * n_expert] routes of f in complete windows
    uint16_t * wseen;    // [n_layer] complete windows
    float *    ctx;      // [n_layer * n_expert] the context's sum per expert f (see window_route)
    float *    ctx_sum;  // [n_layer * 3] its normalizers: sinv, weights, noise
    float *    wlift;    // [n_layer * n_expert] the context's lift of each entry's rate in its window
    uint8_t *  win;      // [n_expert] scratch
    int32_t *  idx;      // [n_expert] scratch
} mf_affinity;

int  mf_affinity_init(mf_affinity * a, int32_t n_layer, int32_t n_expert);
void mf_affinity_free(mf_affinity * a);  // also after a failed init
// one route of `layer`: learns from the transition since its last visit and sets the lift classes
// for its next one. k_prior: the routed-set size (the prior of a marginal is k / n_expert); halve:
// forget half of the layer's evidence first
void mf_affinity_route(mf_affinity * a, int32_t layer, const uint8_t * want, int32_t k_prior, bool halve);

// ---------------------------------------------------------------- cache policy (mf_cache.c, mf_reuse.c)
// ages (visits since the last route) below MF_AGE_EXACT are told apart, older ones share one
// bucket per doubling (the reuse chance changes fast at first, slowly later), up to MF_AGE_CAP
#define MF_AGE_EXACT 16
#define MF_AGE_CAP 32
// one more bucket for entries never routed
#define MF_AGE_NEVER MF_AGE_CAP
#define MF_AGES (MF_AGE_CAP + 1)
// frequency classes: floor(log2(1 + uses)), the last one open-ended
#define MF_CLASSES 8
// half-life, in visits of the entry's layer, of the recent routing rate used beyond the next
// visit: long enough to average a few reuses of a frequent expert, short enough to follow what
// it does now (docs/streamer.md)
#define MF_RECENT_HALF_LIFE 16.0f
// the heaviest prior on the recent rates, in visits: a layer whose experts look alike gets this
// (far more than the n_eff of 23 visits a half-life of 16 gives: the mean then decides)
#define MF_RATE_PRIOR_MAX 1e6f
// cells of the reuse model: (age bucket, frequency class, lift class)
#define MF_CELLS (MF_AGES * MF_CLASSES * MF_LIFTS)
// memory of the reuse model, in visits of a layer (about that many tokens)
#define MF_WINDOW 256u

// per layer, for the recent routing rates of its entries (see mf_reuse.c)
typedef struct mf_rates {
    float norm;      // visits, decayed like the entries' route counts (count / norm: a rate)
    float norm2;     // the sum of the squared decay weights (norm^2 / norm2: effective visits)
    float mean;      // the rates' mean over the layer's experts
    float strength;  // weight, in visits, of the mean behind each entry's rate (empirical Bayes)
    float scale;     // an entry's rate is recent * scale + offset (from the four above)
    float offset;
} mf_rates;

struct mf_cache {
    int32_t    n_layer;
    int32_t    n_expert;
    int32_t    policy;
    int32_t    k_seen;        // largest routed-set size seen (the hazard prior is k / n_expert)
    uint64_t   budget;
    uint64_t   used;          // bytes of resident entries
    uint64_t * entry_bytes;   // [n_layer]
    uint8_t *  resident;      // [n_layer * n_expert]
    uint64_t * last_use;      // [n_layer * n_expert] route clock of the last use (LRU)
    uint64_t   clock;
    int32_t    pinned_layer;  // the running layer; its routed entries cannot be evicted
    uint8_t *  pinned;        // [n_expert]
    // LAYER policy: a reuse model learned online (see mf_reuse.c)
    uint32_t * visits;        // [n_layer] routes of the layer so far
    uint32_t * last_visit;    // [n_layer * n_expert] the layer's visit that last routed it, 0: never
    uint32_t * uses;          // [n_layer * n_expert] routes that picked it (halved every window)
    float *    obs;           // [MF_AGES * MF_CLASSES * MF_LIFTS] decayed count of (age, class, lift)
                              // observations
    float *    obs_hit;       // [MF_AGES * MF_CLASSES * MF_LIFTS] of them, how many were routed
    float      obs_total;
    mf_affinity affinity;     // lift classes of the entries at their layer's next visit
    float *    h3;            // [MF_CELLS] hazard by (age, class, lift), this cycle's
    int32_t    model_age;     // routes since the model was refreshed; -1: never
    float *    recent;        // [n_layer * n_expert] routes of the entry, decayed per visit of its layer
    mf_rates * rates;         // [n_layer] the layer's decayed visit counts and prior on the rates
    float      recent_decay;  // per visit: 2^(-1 / MF_RECENT_HALF_LIFE)
    int32_t *  res_list;      // resident entries, unordered (the victim scan walks only these)
    int32_t *  res_pos;       // [n_layer * n_expert] position in res_list
    int32_t    n_res;
    float *    score;         // [n_layer * n_expert] scratch: keep value per byte of res_list[i]
    uint8_t *  tok;           // [n_expert] scratch: one token's routed set
    // results of the last mf_cache_route: experts of `layer` to load, entries (l*n_expert+e) evicted
    int32_t *  load;
    int32_t    n_load;
    int32_t *  evict;
    int32_t    n_evict;
    uint64_t   hits;
    uint64_t   misses;
    uint64_t   evictions;
};

// mf_cache_prefetch (moeflash_stream.h) fills the same load / evict lists as mf_cache_route
// whether every expert of `layer` is resident (then there is nothing to predict or prefetch)
bool mf_cache_layer_resident(const mf_cache * c, int32_t layer);
// whether expert e of `layer` is resident
bool mf_cache_is_resident(const mf_cache * c, int32_t layer, int32_t e);
// forgets a resident entry whose read failed (it is not resident after all)
void mf_cache_forget(mf_cache * c, int32_t layer, int32_t expert);
// evicts every entry (the list is left in c->evict); returns how many
int32_t mf_cache_evict_all(mf_cache * c);
// moves the budget, evicting (in the policy's order) until the resident entries fit; between
// routes only. The evicted entries are left in c->evict; returns how many
int32_t mf_cache_set_budget(mf_cache * c, uint64_t budget_bytes);

// warm start (mf_streamer_restore): admits experts of `layer` into the budget's free room only,
// stopping at the first that does not fit; nothing is evicted, pinned or counted. Each ranks as
// used at the last route and, with uses (may be NULL) above 0, as routed that often by the
// layer's last visit. Fills the load list; returns how many it admitted
int32_t mf_cache_admit_free(mf_cache * c, int32_t layer, const uint8_t * want, const uint32_t * uses);
// the resident entries (l * n_expert + e), hottest first: most routed (the LAYER policy's decayed
// count of routes, into uses when not NULL), then most recently used, then file order; up to max
// into out. Returns how many are resident, or -ENOMEM
int32_t mf_cache_hot_set(const mf_cache * c, int32_t * out, uint32_t * uses, int32_t max);

// the reuse model (mf_reuse.c), LAYER policy only; the cache's thread
// one token's routing of `layer` (want: its routed set) as evidence: a visit of the layer
void mf_reuse_learn_token(mf_cache * c, int32_t layer, const uint8_t * want);
// scores every resident entry (c->score: keep value per byte, FLT_MAX for the pinned ones, which
// can't be victims), counting distances from layer cur
void mf_reuse_score(mf_cache * c, int32_t cur);
// an expert's enum mf_rate_class; the prefetch gate keeps its counts per class
#define MF_RATE_CLASSES (MF_RATE_UNKNOWN + 1)
int32_t mf_reuse_rate_class(const mf_cache * c, int32_t layer, int32_t e);

// ---------------------------------------------------------------- expert tensors (mf_buft.c)
enum mf_slice_state { MF_SLICE_ABSENT = 0, MF_SLICE_LOADING = 1, MF_SLICE_READY = 2, MF_SLICE_FAILED = 3 };

typedef struct mf_xtensor {
    struct mf_streamer * s;
    struct ggml_tensor * t;
    mf_loc *             loc;
    int32_t              layer;
    int32_t              n_expert;
    uint64_t             nb2;      // bytes of one expert's slice
    char *               reserve;  // the whole reservation: PROT_NONE unless the budget holds every expert
    size_t               reserve_size;
    char *               data;     // t->data: congruent to loc->offset modulo the page size
    const void *         layout;   // the repacked layout of its slices (mf_repack_layout), NULL: the file's
    atomic_int *         state;    // [n_expert] enum mf_slice_state
    // [n_expert] where each resident slice's bytes are (in its entry's frame; under hold_all at
    // data + e * nb2): what the ready hook hands the matmul. Set before the slice turns LOADING.
    char **              slot;
    int32_t *            pending;    // [n_expert] chunks of a LOADING slice not yet read (under s->mu)
    size_t               frame_off;  // this tensor's pages within its layer's frames
} mf_xtensor;

// the file offset of slice e's first byte
static inline uint64_t mf_slice_offset(const mf_xtensor * xt, int32_t e) {
    return xt->loc->offset + (uint64_t) e * xt->nb2;
}

// the page-aligned file range [*a0, *a1) an O_DIRECT read of slice e brings (its bytes and the
// neighbours' that share its first and last pages)
static inline void mf_slice_pages(const mf_xtensor * xt, int32_t e, size_t page, uint64_t * a0, uint64_t * a1) {
    const uint64_t f0 = mf_slice_offset(xt, e);
    *a0               = mf_align_down(f0, page);
    *a1               = mf_align_up(f0 + xt->nb2, page);
}

// a layer's norm-like vectors kept for the router's input: gemma4 has ten per layer (q/k norms,
// pre- and post- norms around attention, MLP and experts, the router input scale), and the one
// the router uses comes late in its file order
#define MF_MAX_NORMS 16

// a layer's router weights (dense, F32), for predicting its experts one layer ahead (mf_predict.c)
typedef struct mf_router {
    const struct ggml_tensor * gate;     // blk.N.ffn_gate_inp.weight [n_embd, n_expert]
    const struct ggml_tensor * bias;     // blk.N.ffn_gate_inp.bias, or NULL
    const struct ggml_tensor * probs_b;  // blk.N.exp_probs_b.bias (sigmoid selection bias), or NULL
    const struct ggml_tensor * norms[MF_MAX_NORMS];  // blk.N.*norm.weight, blk.N.ffn_gate_inp.scale
    int32_t                    n_norms;
    bool                       usable;
} mf_router;

typedef struct mf_layer {
    mf_xtensor * xt[MF_MAX_XT];  // in consumption order
    int32_t      n_xt;
    uint64_t     entry_bytes;    // one expert of this layer, all its tensors
    int32_t *    frame;          // [n_expert] frame of each resident entry, -1: none (not under hold_all)
    mf_router    router;
} mf_layer;

// ---------------------------------------------------------------- the streamer
// one read: a chunk of slice `expert` of xt, the file bytes [off, off + len) (mf_lanes.c)
typedef struct mf_job {
    mf_xtensor * xt;
    int32_t      expert;
    bool         demand;  // a read the running layer waits for (not a prefetch)
    uint64_t     off;
    uint64_t     len;
} mf_job;

// the storage of every counter of mf_stats, from the same list (MF_STATS_FIELDS) and under the same
// names: relaxed atomics, read without locks by mf_streamer_get_stats, which copies them all. A
// counter is stored where it changes (ADD, MF_SET), gauges and flags too, so that a counter added
// to the list needs no other edit to reach Python
typedef struct mf_counters {
#define MF_COUNTER_MEMBER(name, kind, unit, text) atomic_uint_fast64_t name;
    MF_STATS_FIELDS(MF_COUNTER_MEMBER)
#undef MF_COUNTER_MEMBER
} mf_counters;

#define ADD(counter, v)    atomic_fetch_add_explicit(&(counter), (uint64_t) (v), memory_order_relaxed)
#define MF_SET(counter, v) atomic_store_explicit(&(counter), (uint64_t) (v), memory_order_relaxed)
#define MF_GET(counter)    atomic_load_explicit(&(counter), memory_order_relaxed)

// ---------------------------------------------------------------- a decode call's tokens (mf_batch.c)
// makes *buf hold at least n items of item_size bytes (*cap items now); 0 or -ENOMEM (*buf kept)
int mf_grow(void ** buf, int64_t * cap, int64_t n, size_t item_size);

// Which token each row of a ffn_moe_topk node is. mf_batch_set names the next llama_decode call's
// tokens in the order llama.cpp computes them, cut into micro-batches; each topk node then says
// its layer and rows (mf_batch_node): a layer not above the last one seen begins the next
// micro-batch, and the model's last layer may compute only the micro-batch's output tokens.
typedef struct mf_batch {
    int32_t * seq;     // [n_tokens] each token's KV sequence
    uint8_t * output;  // [n_tokens] non-zero when its logits are asked for
    int64_t * ends;    // [n_ubatch] where each micro-batch ends
    int64_t * rows;    // [n_rows] the last node's rows' tokens
    int64_t   n_tokens, n_ubatch, n_rows;
    int64_t   cap_seq, cap_output, cap_ends, cap_rows;
    int64_t   ubatch;           // the last node's micro-batch (-1: none since mf_batch_set)
    int32_t   last_layer;       // the last node's layer
    int64_t   first, size, n_out;  // the last node's micro-batch: its first token, tokens, outputs
} mf_batch;
// 0, -EINVAL (ends that do not cut n_tokens, a negative sequence), -ENOMEM; n_tokens 0 forgets
int  mf_batch_set(mf_batch * b, int64_t n_tokens, const int32_t * seq, const uint8_t * output, int64_t n_ubatch,
                  const int64_t * ends);
// a node of layer il (of n_layer) with n_rows rows: 0, rows[0, n_rows) its tokens; -EINVAL (no
// rows) when the call announced no such micro-batch or the rows fit neither it nor its outputs
int  mf_batch_node(mf_batch * b, int32_t il, int32_t n_layer, int64_t n_rows);
void mf_batch_free(mf_batch * b);

struct mf_streamer {
    mf_config  cfg;
    char *     model_path;
    uint64_t   budget_bytes;  // expert budget (mf_streamer_set_budget); 0 until it is set
    uint64_t   budget_max;    // the budget the expert memory was built for (mf_streamer_check_loaded)
    size_t     page_size;     // sysconf(_SC_PAGESIZE)
    mf_index   ix;
    bool       direct;  // O_DIRECT reads in use
    bool       repack;  // weights in the CPU backend's repacked layouts (mf_streamer_set_repack)

    struct ggml_backend_buffer_type expert_buft;
    struct ggml_backend_buffer_type dense_buft;
    struct ggml_backend_buffer_type rows_buft;
    size_t                          dense_alignment;  // the cache line, at least the CPU backend's alignment

    // expert tensors, registered while the model loads (mf_buft.c)
    mf_xtensor ** xts;
    int32_t       n_xt;
    int32_t       cap_xt;
    mf_layer *    layers;    // [n_layers]
    int32_t       n_layers;  // layers slots (max layer index + 1 of expert tensors in the file)
    int32_t       n_expert;
    uint64_t      layer_bytes_max;
    uint64_t      entry_bytes_max;  // one expert of the largest layer, all its tensors
    uint64_t      expert_bytes;
    mf_cache *    cache;
    uint8_t *     want;  // [n_expert] scratch for routing
    // the expert bytes each route queues, shared among the KV sequences of the tokens routing
    // them (mf_streamer_begin_batch, mf_streamer_take_seq_bytes; mf_callback.c)
    mf_batch      batch;           // the decode call's tokens
    double *      seq_bytes;       // [cap_seq_bytes] by sequence since the last take
    int64_t       cap_seq_bytes;
    double        unmapped_bytes;  // of routes whose tokens were not announced
    int32_t *     share_rows;      // [n_expert] scratch: a route's rows routing each expert
    int32_t *     route_ids;      // the routed ids of a route's tokens, row after row (grown as needed)
    size_t        route_ids_cap;  // capacity of route_ids, in ids
    // skip_below (mf_skip.c, lossy): the slots the last route dropped, row after row, of layer
    // skip_layer (-1: none since), skip_rows rows of skip_k (capacity route_ids_cap)
    uint8_t *     skip_mask;
    int32_t       skip_layer;
    int64_t       skip_rows, skip_k;
    // the budget holds every expert (see mf_stats.hold_all); set before any expert is read. Every
    // expert resident under hold_all: st.routing_off, and the eval callback asks for no node
    bool          hold_all;

    // prediction of the next layer's experts (mf_predict.c)
    const struct ggml_tensor ** noted;  // dense router and norm tensors seen while loading
    int32_t                     n_noted;
    int32_t                     cap_noted;
    float *                     pred_v;       // [n_embd max] scratch
    float *                     pred_scores;  // [n_expert] scratch
    uint8_t *                   want_next;    // [n_expert] the prediction
    uint8_t *                   pf_mark;      // [n_expert] experts prefetched for layer pf_layer
    int32_t                     pf_layer;
    // the prefetch gate (mf_prefetch.c, mf_prefetch_next): per layer and rate class
    // (mf_reuse_rate_class), decayed counts of predicted experts that were not resident when
    // predicted, and of those the layer then routed
    float *                     pf_guessed;   // [n_layers * MF_RATE_CLASSES]
    float *                     pf_routed;    // [n_layers * MF_RATE_CLASSES]
    uint32_t *                  pf_closed_visits;  // [n_layers] visits while closed (MF_GATE_SAMPLE)
    uint8_t *                   pf_cand;      // [n_expert] the last prediction's non-resident experts
    uint8_t *                   pf_class;     // [n_expert] their rate classes when predicted
    int32_t                     pf_cand_layer;
    // the last prediction token by token, pf_k ids a row (-1: none), for pf_rows_n rows; 0 rows:
    // the predictor named only the batch's union (capacity route_ids_cap, grown with it)
    int32_t *                   pf_rows;
    int64_t                     pf_rows_n, pf_k;
    mf_predictor                predictor;       // NULL: predict from the routers
    void *                      predictor_data;
    // routing history (mf_history.c): per layer l, counts of (expert a at l, expert b at l + 1)
    // in one token, of a at l, and the last routed layer's ids
    float *   hist_pairs;  // [n_layers][n_expert][n_expert]
    float *   hist_seen;   // [n_layers][n_expert]
    int32_t * hist_prev;   // [hist_rows][hist_k]
    int64_t   hist_cap, hist_rows, hist_k;
    int32_t   hist_layer;

    mf_frames     frames;  // the memory of resident entries (not under hold_all)
    char          memory_note[200];

    // dense reads at load: an aligned bounce buffer for O_DIRECT
    void *        bounce;
    size_t        bounce_size;

    // reader lanes (mf_lanes.c): one queue (FIFO), one completion condition
    pthread_t       lanes[MF_MAX_LANES];
    int32_t         n_lanes_started;
    pthread_mutex_t mu;
    pthread_cond_t  work_cv;  // jobs queued or stop
    pthread_cond_t  done_cv;  // a job finished
    mf_job *        queue;
    size_t          queue_cap;
    size_t          q_head;
    size_t          q_len;
    size_t          outstanding;  // queued + in flight
    size_t          demand_left;  // demand reads queued + in flight (prefetches not counted)
    bool            stop;
    int32_t         n_waiting;    // compute threads blocked in the ready hook
    uint64_t        n_failed;     // slices marked FAILED since the last mf_lanes_reap_failures
    uint64_t        wait_start_ns;

    // first error since the last mf_streamer_take_error (under mu; mf_error.c)
    int  err_code;
    char err_msg[MF_ERR_LEN];
    char last_error[MF_ERR_LEN];  // of the last failed API call

    mf_counters          st;
    atomic_uint_fast64_t expert_bytes_read_total;  // for fault injection
};

// ---------------------------------------------------------------- the error record (mf_error.c)
// records the first error since the last mf_error_take (call with s->mu held)
void mf_error_record_locked(mf_streamer * s, int code, const char * msg);
// records an error (the first one is kept for mf_streamer_take_error), makes it the last_error
// and counts it. Any thread.
void mf_streamer_fail(mf_streamer * s, int code, const char * fmt, ...) __attribute__((format(printf, 3, 4)));
bool mf_error_pending(mf_streamer * s);  // an error is recorded and not yet taken
// takes the recorded error: returns its code (0: none) and copies its message into msg
int  mf_error_take(mf_streamer * s, char * msg, size_t msg_size);

// ---------------------------------------------------------------- buffer types (mf_buft.c)
void         mf_buft_init(mf_streamer * s);
bool         mf_buft_is_expert(ggml_backend_buffer_type_t buft);
// ---------------------------------------------------------------- repacked layouts (mf_repack.c)
// the layout llama.cpp gives a file tensor t resident (an expert tensor: `expert`) when its
// use_extra_bufts is on, as s->repack says; NULL: the file's
const void * mf_repack_layout(const mf_streamer * s, const struct ggml_tensor * t, bool expert);
// writes 2D weight t, read in the file's layout at t->data, in t->extra's layout; 0 or -errno
int          mf_repack_in_place(struct ggml_tensor * t);
// writes slice e of xt (read in the file's layout at xt->slot[e]) in xt->layout, through
// `scratch` (mf_repack_scratch_bytes(xt->t) bytes); 0 or -errno
int          mf_repack_slice(mf_xtensor * xt, int32_t e, void * scratch);
size_t       mf_repack_scratch_bytes(const struct ggml_tensor * t);  // a few of t's rows
mf_xtensor * mf_buffer_xtensor(ggml_backend_buffer_t buffer);  // the tensor of an expert buffer
// expert reservations as plain read-write memory asking for huge pages (hold_all); 0 or -errno
int          mf_buft_hold_all(mf_streamer * s);
void         mf_buft_free_xtensors(mf_streamer * s);  // the registered expert tensors' records

// ---------------------------------------------------------------- next-layer prediction (mf_predict.c)
int     mf_predict_note(mf_streamer * s, const struct ggml_tensor * t);  // while loading: 0 or -ENOMEM
void    mf_predict_resolve(mf_streamer * s);                             // once layers exist
// mf_predict_next, mf_history_predict: mark in want[] the experts layer il + 1 is predicted to
// route and return how many (0: no guess); each token's guesses go to pf_rows
int32_t mf_predict_next(mf_streamer * s, int32_t il, const struct ggml_tensor * topk, uint8_t * want);
// ---------------------------------------------------------------- routing history (mf_history.c)
int     mf_history_init(mf_streamer * s);  // once layers exist: 0 or -ENOMEM
void    mf_history_free(mf_streamer * s);
int     mf_history_learn(mf_streamer * s, int32_t il, const struct ggml_tensor * ids);  // 0 or -ENOMEM
int32_t mf_history_predict(mf_streamer * s, int32_t il, const struct ggml_tensor * ids, uint8_t * want);

// ---------------------------------------------------------------- lanes and slice memory (mf_lanes.c)
int      mf_lanes_start(mf_streamer * s, int32_t n);  // 0 or -errno (the lanes started stay counted)
void     mf_lanes_stop(mf_streamer * s);              // stop flag + broadcast + join
bool     mf_slice_live(const mf_xtensor * xt, int64_t e);  // LOADING or READY
uint64_t mf_lanes_wait_all(mf_streamer * s);          // every queued job done; returns ns waited
uint64_t mf_lanes_wait_demand(mf_streamer * s);       // the running layer's reads done; ns waited
void     mf_lanes_reap_failures(mf_streamer * s);     // forget entries whose reads failed (no job in flight)
void     mf_lanes_apply_evictions(mf_streamer * s);   // the cache's last evictions, on this thread
// the cache's last lists of layer il: evictions done here, loads given frames and queued to the
// lanes. On failure (-ENOMEM: no queue; -ENOSPC: no frame) the loads that were not queued are
// forgotten by the cache, so nothing looks resident that is not
int      mf_lanes_queue_route(mf_streamer * s, int32_t il, bool demand);

// ---------------------------------------------------------------- after the load (mf_build.c)
// frees the layers' records (their frame tables); mf_streamer_check_loaded builds them
void mf_build_free_layers(mf_streamer * s);

// ---------------------------------------------------------------- the graph's callbacks (mf_callback.c)
// hold_all: once every expert is READY, turns routing off (the eval callback asks for no node).
// Decode thread, no graph running or from the eval callback
void         mf_callback_stop_if_all_resident(mf_streamer * s);
// the mul_mat_id ready hook (ggml_cpu_set_mul_mat_id_ready_hook): where slice `expert` of src0
// is once READY, NULL to skip it. Every compute thread; stateless (src0's buffer names the streamer)
const void * mf_callback_ready_hook(const struct ggml_tensor * src0, int64_t expert, void * user_data);

// ---------------------------------------------------------------- dropping experts (mf_skip.c, lossy)
#define MF_TOPK_PREFIX         "ffn_moe_topk-"
#define MF_TOPK_PREFIX_LEN     13
#define MF_WEIGHTS_PREFIX      "ffn_moe_weights-"
#define MF_WEIGHTS_PREFIX_LEN  16
#define MF_WEIGHTS_SOFTMAX     "ffn_moe_weights_softmax-"
// the router's score of expert e for token row i1 of a ffn_moe_topk node (the sorted selection
// scores: the topk view's source's source), 0 when the graph does not hold them as F32
float mf_topk_score(const struct ggml_tensor * topk, int64_t i1, int32_t e);
// before layer il's route, with cfg.skip_below > 0: rewrites in `ids` each dropped slot to its
// row's first expert and marks it in skip_mask. Returns how many were dropped, or a negative
// errno (recorded) when the graph holds no scores to weigh them by. Decode thread
int64_t mf_skip_route(mf_streamer * s, int32_t il, struct ggml_tensor * ids);
// the layer's ffn_moe_weights-<il> node: zeroes the dropped slots' weights. Decode thread
void    mf_skip_weights(mf_streamer * s, int32_t il, struct ggml_tensor * weights);

// ---------------------------------------------------------------- prefetch and its gate (mf_prefetch.c)
// layer il routes (its tokens' ids in route_ids, k a row, rows rows): scores the prediction made
// for it. Decode thread
void mf_prefetch_score(mf_streamer * s, int32_t il, int64_t rows, int64_t k);
// predicts layer il + 1's experts from layer il's routing (ids) and, when its gate is open,
// queues their reads behind layer il's. Decode thread
void mf_prefetch_next(mf_streamer * s, int32_t il, const struct ggml_tensor * ids);
