// moeflash_stream — the expert streamer's C library (libmoeflash_stream.so).
//
// An MoE model is loaded by llama.cpp with two buffer types of this library (selected through
// llama_model_params.tensor_buft_overrides): expert tensors live in reserved, inaccessible address
// ranges that are filled on demand; every other tensor is read once into anonymous memory. The
// context's eval callback (mf_streamer_eval_cb) sees each layer's routed expert ids and makes those
// (layer, expert) slices resident from flash, into a cache bounded by a byte budget.
//
// Conventions: prefix mf_; functions that can fail return 0 or -errno and
// leave a message for mf_streamer_last_error(); no global mutable state (everything hangs off the
// mf_streamer handle); an I/O error never aborts: it is recorded, the graph is stopped, and the
// caller (Python) raises it for that request.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MF_API __attribute__((visibility("default")))
#else
#define MF_API
#endif

// Version of this library ("0.1.0"). Thread-safe; static strings, never freed.
MF_API const char * mf_version(void);

// Version and commit of the ggml it is linked against. Thread-safe; static strings.
MF_API const char * mf_ggml_version(void);
MF_API const char * mf_ggml_commit(void);

// Non-zero when the llama.cpp build this library is linked against carries moeflash's patches
// (the mul_mat_id ready hook resolves to the patched ggml-cpu). Thread-safe.
MF_API int mf_patched_build(void);

// ---------------------------------------------------------------------------------------------
// The streamer

typedef struct mf_streamer mf_streamer;

// The enums shared with Python, each member listed once: X(name, value, description).
// streaming_ext/declarations.py turns these lists (read back through mf_enum_*) into Python enums
// at build time; the server's settings name the members in lower case.
#define MF_POLICY_MEMBERS(X)                                                                             \
    X(LRU, 0, "least recently used (layer, expert) entry first")                                       \
    X(LAYER, 1,                                                                                         \
      "evict the fewest expected hits per byte and layer step held, from the layer cycle and a reuse " \
      "model learned online (the default)")                                                             \
    X(NONE, 2, "no cache: only the running layer's experts are kept")

#define MF_PREFETCH_MEMBERS(X)                                                                  \
    X(OFF, 0, "no read-ahead")                                                                  \
    X(ROUTER, 1, "the next layer's router on this layer's input (the default)")                 \
    X(HISTORY, 2, "which experts followed this layer's in past tokens (routing alone)")

#define MF_READER_MEMBERS(X)                                                                       \
    X(DIRECT, 0, "O_DIRECT (page-aligned reads straight into place); buffered if refused")        \
    X(BUFFERED, 1, "plain pread through the page cache")

// An expert's class by its recent routes per visit of its layer (decayed with the cache policy's
// half-life) over a uniform router's k / n_expert, unknown before the layer is routed or under a
// policy that does not learn: the prefetch gate judges guesses per class (UNKNOWN stays last:
// the library sizes its counts by MF_RATE_UNKNOWN + 1).
#define MF_RATE_CLASS_MEMBERS(X)                                              \
    X(RARE, 0, "< 0.5x")                                                      \
    X(BELOW, 1, "0.5-1x")                                                     \
    X(ABOVE, 2, "1-2x")                                                       \
    X(FREQUENT, 3, ">= 2x")                                                   \
    X(UNKNOWN, 4, "unknown")

#define MF_POLICY_MEMBER(name, value, text)     MF_POLICY_##name = value,
#define MF_PREFETCH_MEMBER(name, value, text)   MF_PREFETCH_##name = value,
#define MF_READER_MEMBER(name, value, text)     MF_READER_##name = value,
#define MF_RATE_CLASS_MEMBER(name, value, text) MF_RATE_##name = value,
enum mf_policy { MF_POLICY_MEMBERS(MF_POLICY_MEMBER) };
enum mf_prefetch { MF_PREFETCH_MEMBERS(MF_PREFETCH_MEMBER) };
enum mf_reader { MF_READER_MEMBERS(MF_READER_MEMBER) };
enum mf_rate_class { MF_RATE_CLASS_MEMBERS(MF_RATE_CLASS_MEMBER) };
#undef MF_POLICY_MEMBER
#undef MF_PREFETCH_MEMBER
#undef MF_READER_MEMBER
#undef MF_RATE_CLASS_MEMBER

// The streamer's options. Every field is read; the expert budget is not one of them: it is set
// with mf_streamer_set_budget once its floor (mf_streamer_layer_bytes) and the memory the model
// and its context take are known.
typedef struct mf_config {
    const char * model_path;         // the GGUF, or the first file of a split set (-00001-of-0000N.gguf)
    int32_t      n_lanes;            // reader threads, 1..MF_MAX_LANES
    int32_t      reader;             // enum mf_reader
    int32_t      overlap;            // non-zero: reads overlap compute through the mul_mat_id ready hook
    int32_t      policy;             // enum mf_policy
    int32_t      prefetch;           // enum mf_prefetch: read the next layer's predicted experts ahead of its routing
    // fault injection for tests: after fault_after_bytes expert bytes have been read, reads fail
    // with fault_errno (0 = off)
    int32_t      fault_errno;
    uint64_t     fault_after_bytes;
    // negative control for tests: when > 0, expert (skip_expert - 1) is never read but still
    // marked ready, leaving its slices with whatever their memory held; a byte-identity gate must
    // then fail
    int32_t      skip_expert;
    // LOSSY, for measurement only (never a default): a routed expert that is neither resident nor
    // being read, whose routing weight renormalised over its token's k experts is below this, is
    // dropped from that token (its slot computes the token's first expert at weight 0; the weights
    // the layer normalises are the kept ones). 0 = off, lossless. See mf_skip.c
    float        skip_below;
} mf_config;

#define MF_MAX_LANES 16

// The streamer's counters, each declared once here: X(name, kind, unit, description). This list
// is struct mf_stats, its layout check (mf_layout.c), the Python record and every figure built on
// it (API timings, /metrics, `moeflash generate --json`, the benchmarks): a counter added here
// shows up in all of them after `make ext`. Every counter is a uint64_t.
// kind: COUNTER (cumulative since the streamer was made: a span's value is a difference) or
// GAUGE (the value now: a span's value is the one at its end).
// unit: COUNT, BYTES, NS (nanoseconds) or FLAG (0 or 1).
#define MF_STATS_FIELDS(X)                                                                                     \
    X(routes, COUNTER, COUNT, "ffn_moe_topk callbacks handled (one per MoE layer per micro-batch)")          \
    X(hits, COUNTER, COUNT, "routed (layer, expert) entries found resident, read ahead or cached")          \
    X(misses, COUNTER, COUNT, "routed entries that had to be read")                                          \
    X(evictions, COUNTER, COUNT, "entries evicted")                                                          \
    X(bytes_read, COUNTER, BYTES, "expert bytes read from storage (payload, not alignment padding)")       \
    X(reads, COUNTER, COUNT, "slice reads issued")                                                           \
    X(flash_wait_ns, COUNTER, NS, "time the computation waited for expert reads")                          \
    X(cache_ns, COUNTER, NS, "time spent in cache bookkeeping on the decode path")                         \
    X(read_ns, COUNTER, NS, "time lanes spent inside read calls (summed over lanes)")                     \
    X(dense_bytes, GAUGE, BYTES, "non-expert bytes read at load into anonymous memory")                    \
    X(resident_bytes, GAUGE, BYTES, "expert bytes resident now")                                            \
    X(violations, COUNTER, COUNT, "expert matmuls that found a routed slice absent (must stay 0)")         \
    X(errors, COUNTER, COUNT, "failures recorded: failed reads, refused uses, calls that failed")          \
    X(direct_io, GAUGE, FLAG, "1 when O_DIRECT is in use, 0 when reads are buffered")                      \
    X(prefetched, COUNTER, COUNT, "entries read ahead of their layer's routing (predicted)")               \
    X(prefetch_hits, COUNTER, COUNT, "read-ahead entries routed by the layer they were read for")          \
    X(mapped_bytes, GAUGE, BYTES, "bytes of tensors mapped from the file (row buffer type), not read")     \
    X(hold_all, GAUGE, FLAG,                                                                                 \
      "1 when the budget holds every expert (fixed at mf_streamer_check_loaded): nothing is evicted, "      \
      "slices are read into the tensors' own memory (transparent huge pages) and no frames are used")      \
    X(routing_off, GAUGE, FLAG,                                                                              \
      "1 while routing is not watched: every expert is resident under hold_all, so the callback asks for " \
      "no routing node and routes, hits and misses stop counting (until mf_streamer_drop_cache)")          \
    X(expert_memory_bytes, GAUGE, BYTES,                                                                     \
      "expert memory with pages: frames of resident entries and free frames kept for the next loads")      \
    X(frames_released, COUNTER, COUNT,                                                                       \
      "free frames whose pages went back to the kernel (mf_streamer_drop_cache, a budget moved down)")     \
    X(budget_bytes, GAUGE, BYTES, "the expert budget now (mf_streamer_set_budget; it follows memory pressure)") \
    X(restored, COUNTER, COUNT, "entries read back by mf_streamer_restore (warm start)")                  \
    X(skipped, COUNTER, COUNT, "routed entries dropped by skip_below (lossy; 0 unless set)")                 \
    X(predictions, COUNTER, COUNT, "next-layer predictions (one a layer visit; fewer behind a closed gate)")

// Read with mf_streamer_get_stats (no lock on the hot path).
typedef struct mf_stats {
#define MF_STATS_MEMBER(name, kind, unit, text) uint64_t name;
    MF_STATS_FIELDS(MF_STATS_MEMBER)
#undef MF_STATS_MEMBER
} mf_stats;

// Thread contract of the calls below: one thread at a time per streamer (the thread that loads
// the model, then the one that decodes), except where a call says otherwise.

// Creates a streamer for cfg->model_path: indexes the GGUF (all splits), checks sizes and
// offsets, and starts the reader lanes. Returns 0, or -errno with *out == NULL and a message in
// last_error (which may be NULL). Call before loading the model.
MF_API int mf_streamer_new(const mf_config * cfg, mf_streamer ** out, char * last_error, size_t last_error_size);

// Sets the expert budget (bytes, at least mf_streamer_layer_bytes). Required before
// mf_streamer_check_loaded (before or after the model loads), which builds the expert memory for
// it. Afterwards it moves the budget, down to the floor or back up to the budget the memory was
// built for: a smaller one evicts (in the policy's order) until the resident experts fit and gives
// the free frames' pages back to the kernel. Decode thread, between llama_decode calls. Returns 0,
// -EINVAL below the floor, -ERANGE above the built-for budget, -EBUSY when the budget holds every
// expert (they live in the tensors' own memory: mf_stats.hold_all).
MF_API int mf_streamer_set_budget(mf_streamer * s, uint64_t budget_bytes);

// Stops the lanes and frees the streamer. NULL is a no-op. Call after the llama model (whose
// buffers belong to the streamer's buffer types) has been freed.
MF_API void mf_streamer_free(mf_streamer * s);

// The buffer types to pass in tensor_buft_overrides: experts (`_exps.weight`), tensors a token
// reads one row of (the token embeddings, when the output matrix is a tensor of its own: mapped
// from the file, never read whole) and the rest (read into memory at load).
MF_API ggml_backend_buffer_type_t mf_streamer_expert_buft(mf_streamer * s);
MF_API ggml_backend_buffer_type_t mf_streamer_rows_buft(mf_streamer * s);
MF_API ggml_backend_buffer_type_t mf_streamer_dense_buft(mf_streamer * s);

// After the model has loaded: checks that every expert tensor of the file is in the expert buffer
// type, then builds the layers, the expert memory and the cache for the budget set. Returns 0,
// else -errno with a message (-EINVAL when no budget was set).
MF_API int mf_streamer_check_loaded(mf_streamer * s);

// The ggml_backend_sched_eval_callback to install as cb_eval, with the streamer as user data.
// Thread contract: called on the llama_decode thread only.
MF_API bool mf_streamer_eval_cb(struct ggml_tensor * t, bool ask, void * user_data);

// Copies the counters. Thread-safe, lock-free.
MF_API void mf_streamer_get_stats(const mf_streamer * s, mf_stats * out);

// Waits for reads still in flight (prefetches of a graph that stopped), then takes the first error
// recorded since the last call: returns its -errno (0 if none) and copies its message.
// Thread contract: between llama_decode calls, on the decode thread.
MF_API int mf_streamer_take_error(mf_streamer * s, char * msg, size_t msg_size);

// A source of next-layer predictions in place of the model's routers (mf_predict.c): fills
// want[n_expert], zeroed by the caller, with the experts layer il is expected to route for the
// tokens whose layer il - 1 just routed; returns how many it set (0: no prediction). Called on
// the decode thread from the routing callback, when prefetch is on.
typedef int32_t (*mf_predictor)(void * user_data, int32_t il, uint8_t * want);
// Predict with fn from now on (NULL: the routers again). user_data must outlive the streamer or
// the next call.
MF_API void mf_streamer_set_predictor(mf_streamer * s, mf_predictor fn, void * user_data);

// The message of the last failure of a call on this streamer. Valid until the next call.
MF_API const char * mf_streamer_last_error(const mf_streamer * s);

// Reads every expert before the first token (a budget holding them all is required): the model
// then runs like a resident one. Returns 0 or -errno (message in last_error). Decode thread only.
MF_API int mf_streamer_preload(mf_streamer * s);

// Evicts every expert entry and gives the free frames' pages back (tests and benchmarks: a cold
// cache). Decode thread only.
MF_API void mf_streamer_drop_cache(mf_streamer * s);

// Warm start: the caller saves the hot set and, after a restart, reads it back with
// mf_streamer_restore, a chunk at a time between requests (server/loading/hot_set.py).
// The resident experts, hottest first (most routed, then most recently used), as
// layer * n_expert + expert, and (uses, when not NULL) how often each was routed (the LAYER
// policy's count, halved every 256 visits of its layer; 0 under LRU): up to max of them. Returns
// how many are resident, or -ENOMEM. Decode thread, between llama_decode calls.
MF_API int32_t mf_streamer_hot_set(mf_streamer * s, int32_t * out, uint32_t * uses, int32_t max);
// Reads the experts of `layer` with want[e] != 0 (want has n_expert bytes) into the budget's free
// room, evicting nothing, and waits for the reads. The cache then holds each as used at the last
// route and, with uses[e] > 0 (uses may be NULL), as routed that often, so that it keeps them as
// it kept them before. Returns how many it read (0: resident already, or no room left), or
// -errno with a message in last_error: -EINVAL (not a streamed layer, or before
// mf_streamer_check_loaded), or the error of a failed read, taken here so that it fails no
// request (its entries are forgotten and read again when routed). Decode thread, between
// llama_decode calls.
MF_API int32_t mf_streamer_restore(mf_streamer * s, int32_t layer, const uint8_t * want, const uint32_t * uses);

// Bytes of the largest layer's experts (all of them): the budget floor.
MF_API uint64_t mf_streamer_layer_bytes(const mf_streamer * s);
// Bytes of all expert tensors, and number of MoE layers / experts per layer.
MF_API uint64_t mf_streamer_expert_bytes(const mf_streamer * s);
MF_API int32_t  mf_streamer_n_moe_layers(const mf_streamer * s);
MF_API int32_t  mf_streamer_n_expert(const mf_streamer * s);
// Bytes of the named tensor in the file, 0 when the file has no such tensor.
MF_API uint64_t mf_streamer_tensor_bytes(const mf_streamer * s, const char * name);
// Where resident experts live: frames (how many, their size, the memory they may take), or the
// tensors themselves when the budget holds every expert. Valid once the model has loaded.
MF_API const char * mf_streamer_memory_note(const mf_streamer * s);

// ---------------------------------------------------------------------------------------------
// Layout of the structs shared with Python (mf_config, mf_stats, mf_route_record), checked by
// streaming_ext/_lib.py when it loads the library. Neither struct has padding: every byte belongs
// to a listed field. Thread-safe; constant answers.

MF_API size_t  mf_config_size(void);
MF_API size_t  mf_stats_size(void);
MF_API size_t  mf_route_record_size(void);
// Number of fields, and the byte offset of the named one (-1 when the struct has no such field).
MF_API int32_t mf_config_n_fields(void);
MF_API int32_t mf_stats_n_fields(void);
MF_API int32_t mf_route_record_n_fields(void);
MF_API int64_t mf_config_offset(const char * field);
MF_API int64_t mf_stats_offset(const char * field);
MF_API int64_t mf_route_record_offset(const char * field);

// The declarations above as data, for streaming_ext/declarations.py: the i-th counter of
// MF_STATS_FIELDS (0 <= i < mf_stats_n_fields()) as its name, kind ("COUNTER", "GAUGE"), unit
// ("COUNT", "BYTES", "NS", "FLAG") and description; the i-th member of an enum ("policy",
// "prefetch", "reader") as its name, value and description. NULL past the end or for an unknown
// enum. Thread-safe; static strings.
MF_API const char * mf_stats_field_name(int32_t i);
MF_API const char * mf_stats_field_kind(int32_t i);
MF_API const char * mf_stats_field_unit(int32_t i);
MF_API const char * mf_stats_field_text(int32_t i);
MF_API const char * mf_enum_member_name(const char * enum_name, int32_t i);
MF_API int32_t      mf_enum_member_value(const char * enum_name, int32_t i);
MF_API const char * mf_enum_member_text(const char * enum_name, int32_t i);

// ---------------------------------------------------------------------------------------------
// The cache policy on its own, for trace replay (the same code the streamer runs). A cache is
// used by one thread at a time.

typedef struct mf_cache mf_cache;

// entry_bytes[l] = bytes of one expert of layer l (0 for a layer without experts).
MF_API int  mf_cache_new(int32_t n_layer, int32_t n_expert, const uint64_t * entry_bytes, uint64_t budget_bytes,
                         int32_t policy, mf_cache ** out);
MF_API void mf_cache_free(mf_cache * c);

// One layer's routing: want[e] != 0 for each routed expert (for a micro-batch, the union of its
// tokens'). Marks hits, admits misses (evicting per the policy), pins the layer until the next
// call. The policy learns from each token's own routing, one visit of the layer per token:
// tokens holds n_tokens rows of k expert ids (each one of want's); NULL with n_tokens 1 when want
// is one token's routing; NULL with n_tokens 0 for no evidence (a preload). Returns the number of
// misses (>= 0), -ENOSPC when the routed set alone exceeds the budget, -EINVAL for ids outside
// want or arguments that do not fit together.
MF_API int mf_cache_route(mf_cache * c, int32_t layer, const uint8_t * want, const int32_t * tokens, int32_t n_tokens,
                          int32_t k);

// Admits predicted experts of `layer` ahead of its routing, as the streamer's prefetch does: like
// mf_cache_route, but nothing is pinned, counted or learned, and it stops rather than evict the
// running layer's routed entries or its own admissions. Returns the number of entries to load.
MF_API int32_t mf_cache_prefetch(mf_cache * c, int32_t layer, const uint8_t * want);
// The experts (of the layer) that the last mf_cache_route or mf_cache_prefetch admitted, to be
// read: up to max of them into out; returns how many there are.
MF_API int32_t mf_cache_loads(const mf_cache * c, int32_t * out, int32_t max);
// An expert's enum mf_rate_class now; -EINVAL for a layer or expert out of range.
MF_API int32_t mf_cache_rate_class(const mf_cache * c, int32_t layer, int32_t e);

// Counters of a stand-alone cache: hits, misses, evictions.
MF_API void mf_cache_counts(const mf_cache * c, uint64_t * hits, uint64_t * misses, uint64_t * evictions);

// ---------------------------------------------------------------------------------------------
// Route traces (mf_route.c): make every MoE layer route each token as a recorded trace did, and
// record the routing a model runs. Install mf_route_trace_eval_cb as cb_eval with the trace as
// user data, chained to the streamer's callback for a streamed model. Replayed output differs from
// the model's own (benchmarks and tests only); a streamed and a resident model replaying the same
// trace must give the same bytes. One thread at a time (the llama_decode thread).

typedef struct mf_route_trace mf_route_trace;

// One routed expert, as recorded: slot is its rank among the token's k, weight the router's
// score of it (0 where the graph does not expose the scores).
typedef struct mf_route_record {
    int32_t turn;    // counts mf_route_trace_begin_phase(0) calls from 0
    int32_t phase;   // 0 prompt, 1 decode
    int32_t step;    // token index within the phase
    int32_t layer;
    int32_t slot;
    int32_t expert;
    float   weight;
} mf_route_record;

// A trace for a model of n_layer layers, n_expert experts, k used per token. 0 or -errno.
MF_API int  mf_route_trace_new(int32_t n_layer, int32_t n_expert, int32_t k, mf_route_trace ** out);
MF_API void mf_route_trace_free(mf_route_trace * rt);
// Routing to replay for phase 0 (prompt) or 1 (decode): ids[n_steps][n_layer][k], copied; a
// layer whose first id is -1 routes as the model does. -EINVAL, -ERANGE (an id out of range).
MF_API int  mf_route_trace_set_replay(mf_route_trace * rt, int32_t phase, int64_t n_steps, const int32_t * ids);
// Non-zero: record every route from now on (after replacement, so a replayed run records the trace).
MF_API void mf_route_trace_set_recording(mf_route_trace * rt, int32_t on);
// The callback to run after this one on every node (the streamer's), or NULL.
MF_API void mf_route_trace_chain(mf_route_trace * rt, ggml_backend_sched_eval_callback next, void * next_user_data);
// The tokens decoded from now on belong to `phase` (0 prompt, 1 decode), from step 0 on.
MF_API void mf_route_trace_begin_phase(mf_route_trace * rt, int32_t phase);
// The next llama_decode call holds n_tokens tokens (the steps after the previous call's).
MF_API void mf_route_trace_begin_batch(mf_route_trace * rt, int64_t n_tokens);
MF_API bool mf_route_trace_eval_cb(struct ggml_tensor * t, bool ask, void * user_data);
// Records not yet taken; moves up to max of them, oldest first, into out. Returns how many.
MF_API int64_t mf_route_trace_n_recorded(const mf_route_trace * rt);
MF_API int64_t mf_route_trace_take_recorded(mf_route_trace * rt, mf_route_record * out, int64_t max);
// The error that stopped a graph (a node the trace does not fit): -errno (0 if none) and its message.
MF_API int mf_route_trace_take_error(mf_route_trace * rt, char * msg, size_t msg_size);
// An mf_predictor (user_data: the trace) that knows the future: the experts the replayed trace
// routes at layer il for the tokens of the last ffn_moe_topk node it saw, the prefetch's upper
// bound. 0 when nothing is replayed. The last layer of a prompt computes only the batch's last
// tokens, which it cannot know: it predicts the whole batch there.
MF_API int32_t mf_route_trace_predict(void * user_data, int32_t il, uint8_t * want);
// Makes mf_route_trace_predict an emulated predictor that is right on about 1 - share of the
// routed slots: each token's slot is replaced, with probability share, by an expert that token
// does not route at that layer, drawn from a generator seeded with seed (the same run, the same
// guesses). share 0 is the oracle. -EINVAL unless 0 <= share < 1.
MF_API int     mf_route_trace_set_predict_error(mf_route_trace * rt, float share, uint64_t seed);

#ifdef __cplusplus
}
#endif
