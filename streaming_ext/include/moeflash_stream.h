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

// The streamer's options, each declared once: X(name, C type, kind, default, description). This
// list is struct mf_config, its layout check (mf_layout.c) and, through the library's report of it
// (mf_config_field_*), the ctypes struct and the Python StreamerConfig with these defaults
// (streaming_ext/declarations.py, at `make ext`): a field added here reaches Python with no edit.
// kind is what the value is to Python: PATH (the model's path, the one field that is not an
// option), INT, BOOL (0 or 1), FLOAT, or the enum it holds (POLICY, PREFETCH, READER). Every field
// is read. The order keeps the struct free of padding (mf_layout.c asserts it). The expert budget
// is not an option: it is set with mf_streamer_set_budget once its floor
// (mf_streamer_layer_bytes) and the memory the model and its context take are known.
// skip_expert is a negative control: the expert is never read but still marked ready, leaving its
// slices with whatever their memory held. skip_below is LOSSY: a routed expert that is neither
// resident nor being read, whose routing weight renormalised over its token's k experts is below
// it, is dropped from that token (its slot computes the token's first expert at weight 0; the
// weights the layer normalises are the kept ones; mf_skip.c).
#define MF_CONFIG_FIELDS(X)                                                                                     \
    X(model_path, const char *, PATH, 0, "the GGUF, or the first file of a split set (-00001-of-0000N.gguf)")   \
    X(lanes, int32_t, INT, 4, "reader threads, 1..MF_MAX_LANES")                                                \
    X(reader, int32_t, READER, MF_READER_DIRECT, "how expert slices are read (buffered where O_DIRECT is refused)") \
    X(overlap, int32_t, BOOL, 1,                                                                                 \
      "the matmuls of experts already read run while the rest are read (through the mul_mat_id ready hook)")   \
    X(policy, int32_t, POLICY, MF_POLICY_LAYER, "the expert cache's eviction policy")                          \
    X(prefetch, int32_t, PREFETCH, MF_PREFETCH_ROUTER,                                                          \
      "read the next layer's predicted experts ahead of its routing, predicted by this")                       \
    X(fault_errno, int32_t, INT, 0,                                                                              \
      "fault injection for tests: once fault_after_bytes expert bytes are read, reads fail with this (0: off)") \
    X(fault_after_bytes, uint64_t, INT, 0, "fault injection for tests: expert bytes read before reads fail")    \
    X(layers, int64_t, INT, 0,                                                                                   \
      "the layers whose experts are streamed: those below this index (the rest run on an RPC helper); 0: all") \
    X(skip_expert, int32_t, INT, 0,                                                                              \
      "negative control for tests: when > 0, expert (skip_expert - 1) is never read (a gate must then fail)")  \
    X(skip_below, float, FLOAT, 0,                                                                               \
      "LOSSY, for measurement only: drop a routed expert that would have to be read when its weight "          \
      "(renormalised over the token's k) is below this; 0 = off, lossless")

typedef struct mf_config {
#define MF_CONFIG_MEMBER(name, type, kind, value, text) type name;
    MF_CONFIG_FIELDS(MF_CONFIG_MEMBER)
#undef MF_CONFIG_MEMBER
} mf_config;

#define MF_MAX_LANES 16

// The streamer's counters, each declared once here: X(name, kind, unit, description). This list
// is struct mf_stats, its layout check (mf_layout.c), the Python record and every figure built on
// it (API timings, /metrics, `moeflash generate --json`, the benchmarks): a counter added here
// shows up in all of them after `make ext`. Every counter is a uint64_t. Inside the library it
// is also the streamer's storage of the counters (mf_internal.h's mf_counters) and
// mf_streamer_get_stats's copy: a counter added here reads what the code stores in it.
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
    X(predictions, COUNTER, COUNT, "next-layer predictions (one a layer visit; fewer behind a closed gate)") \
    X(repacked_bytes, GAUGE, BYTES,                                                                          \
      "weight bytes in the CPU backend's repacked layouts: dense ones read at load, and expert tensors")   \
    X(repack_ns, COUNTER, NS, "time lanes spent repacking slices they read (summed over lanes)")

// Read with mf_streamer_get_stats (no lock on the hot path).
typedef struct mf_stats {
#define MF_STATS_MEMBER(name, kind, unit, text) uint64_t name;
    MF_STATS_FIELDS(MF_STATS_MEMBER)
#undef MF_STATS_MEMBER
} mf_stats;

// A source of next-layer predictions in place of the model's routers (mf_predict.c): fills
// want[n_expert], zeroed by the caller, with the experts layer il is expected to route for the
// tokens whose layer il - 1 just routed; returns how many it set (0: no prediction). Called on
// the decode thread from the routing callback, when prefetch is on (mf_streamer_set_predictor).
typedef int32_t (*mf_predictor)(void * user_data, int32_t il, uint8_t * want);

// The cache policy on its own (mf_cache_*), for trace replay.
typedef struct mf_cache mf_cache;

// A route trace (mf_route_trace_*): replayed and recorded routing.
typedef struct mf_route_trace mf_route_trace;

// One routed expert, as recorded, each field declared once: X(name, C type, description). This
// list is struct mf_route_record, its layout check (mf_layout.c) and the Python record
// (streaming_ext/_declared.py's RouteRecord, generated at `make ext`).
#define MF_ROUTE_RECORD_FIELDS(X)                                                                     \
    X(turn, int32_t, "the request (streaming_ext.RouteTracer counts the prompts begun from 0)")        \
    X(seq, int32_t, "the KV sequence (slot) it decoded in")                                           \
    X(phase, int32_t, "0 prompt, 1 decode")                                                           \
    X(step, int32_t, "token index within the phase")                                                  \
    X(layer, int32_t, "the layer")                                                                    \
    X(slot, int32_t, "its rank among the token's k")                                                  \
    X(expert, int32_t, "the expert")                                                                  \
    X(weight, float, "the router's score of it (0 where the graph does not expose the scores)")

typedef struct mf_route_record {
#define MF_RECORD_MEMBER(name, type, text) type name;
    MF_ROUTE_RECORD_FIELDS(MF_RECORD_MEMBER)
#undef MF_RECORD_MEMBER
} mf_route_record;

// The functions, each declared once in moeflash_stream_functions.h (an X-include, which mf_layout.c
// reads again as the table the library reports to Python)
#define MF_FUNCTION(ret, name, params) MF_API ret name params;
#include "moeflash_stream_functions.h"
#undef MF_FUNCTION

#ifdef __cplusplus
}
#endif
