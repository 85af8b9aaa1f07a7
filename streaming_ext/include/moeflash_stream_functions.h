// The functions of libmoeflash_stream, each declared once: MF_FUNCTION(return type, name, (parameters)).
//
// An X-include: it has no include guard and expects MF_FUNCTION to be defined by its includer.
// moeflash_stream.h defines it as the prototype (`MF_API ret name params;`), so the compiler
// checks every definition against this line; mf_layout.c defines it as a table row, which the
// library reports (mf_api_function_*) and streaming_ext/declarations.py turns into the ctypes
// signatures at `make ext`. A function added here is callable from Python after `make ext`; its
// parameter types must be ones declarations.py maps to ctypes (it says so, naming the type).
// Conventions and the types used are moeflash_stream.h's. Include moeflash_stream.h, not this.
#ifndef MF_FUNCTION
#error "include moeflash_stream.h; this list needs MF_FUNCTION defined by its includer"
#endif

// Version of this library ("0.1.0"). Thread-safe; static strings, never freed.
MF_FUNCTION(const char *, mf_version, (void))

// Version and commit of the ggml it is linked against. Thread-safe; static strings.
MF_FUNCTION(const char *, mf_ggml_version, (void))
MF_FUNCTION(const char *, mf_ggml_commit, (void))

// Non-zero when the llama.cpp build this library is linked against carries moeflash's patches
// (the mul_mat_id ready hook resolves to the patched ggml-cpu). Thread-safe.
MF_FUNCTION(int, mf_patched_build, (void))

// ---------------------------------------------------------------------------------------------
// The streamer. Thread contract of the calls below: one thread at a time per streamer (the thread
// that loads the model, then the one that decodes), except where a call says otherwise.

// Creates a streamer for cfg->model_path: indexes the GGUF (all splits), checks sizes and
// offsets, and starts the reader lanes. Returns 0, or -errno with *out == NULL and a message in
// last_error (which may be NULL). Call before loading the model.
MF_FUNCTION(int, mf_streamer_new, (const mf_config * cfg, mf_streamer ** out, char * last_error, size_t last_error_size))

// Sets the expert budget (bytes, at least mf_streamer_layer_bytes). Required before
// mf_streamer_check_loaded (before or after the model loads), which builds the expert memory for
// it. Afterwards it moves the budget, down to the floor or back up to the budget the memory was
// built for: a smaller one evicts (in the policy's order) until the resident experts fit and gives
// the free frames' pages back to the kernel. Decode thread, between llama_decode calls. Returns 0,
// -EINVAL below the floor, -ERANGE above the built-for budget, -EBUSY when the budget holds every
// expert (they live in the tensors' own memory: mf_stats.hold_all).
MF_FUNCTION(int, mf_streamer_set_budget, (mf_streamer * s, uint64_t budget_bytes))

// Stops the lanes and frees the streamer. NULL is a no-op. Call after the llama model (whose
// buffers belong to the streamer's buffer types) has been freed.
MF_FUNCTION(void, mf_streamer_free, (mf_streamer * s))

// The buffer types to pass in tensor_buft_overrides: experts (`_exps.weight`), tensors a token
// reads one row of (the token embeddings, when the output matrix is a tensor of its own: mapped
// from the file, never read whole) and the rest (read into memory at load).
MF_FUNCTION(ggml_backend_buffer_type_t, mf_streamer_expert_buft, (mf_streamer * s))
MF_FUNCTION(ggml_backend_buffer_type_t, mf_streamer_rows_buft, (mf_streamer * s))
MF_FUNCTION(ggml_backend_buffer_type_t, mf_streamer_dense_buft, (mf_streamer * s))

// Before the model loads: whether its weights take the CPU backend's repacked layouts where
// llama.cpp has them (on: non-zero), as llama.cpp's use_extra_bufts gives a resident model; the
// loader sets both from one setting (server/loading/context.py). Off by default. Returns 0, or
// -EBUSY once a model has loaded into the streamer's buffer types.
MF_FUNCTION(int, mf_streamer_set_repack, (mf_streamer * s, int32_t on))

// llama.cpp's CPU buffer type: a tensor overridden to it gets the one llama.cpp picks among the
// CPU's by the tensor's use (a repacked layout, or the file mapped). For the token embeddings of a
// model without an output matrix whose second copy, the output, is repacked: llama.cpp then keeps
// the copy read by row mapped and the output repacked, as in its resident load. Thread-safe.
MF_FUNCTION(ggml_backend_buffer_type_t, mf_cpu_buft, (void))

// After the model has loaded: checks that every expert tensor of the file is in the expert buffer
// type, then builds the layers, the expert memory and the cache for the budget set. Returns 0,
// else -errno with a message (-EINVAL when no budget was set).
MF_FUNCTION(int, mf_streamer_check_loaded, (mf_streamer * s))

// The ggml_backend_sched_eval_callback to install as cb_eval, with the streamer as user data.
// Thread contract: called on the llama_decode thread only.
MF_FUNCTION(bool, mf_streamer_eval_cb, (struct ggml_tensor * t, bool ask, void * user_data))

// Copies the counters. Thread-safe, lock-free.
MF_FUNCTION(void, mf_streamer_get_stats, (const mf_streamer * s, mf_stats * out))
// The tokens of the next llama_decode call in the order llama.cpp computes them: token i of KV
// sequence seq[i], output[i] != 0 when its logits are asked for, micro-batch u ending before token
// ends[u] (as mf_route_trace_begin_batch takes them). Each route then shares the expert bytes it
// reads among the sequences (mf_streamer_take_seq_bytes). 0, -EINVAL, -ENOMEM (the call's routes
// then count as unmapped). Decode thread, between calls.
MF_FUNCTION(int, mf_streamer_begin_batch,
            (mf_streamer * s, int64_t n_tokens, const int32_t * seq, const uint8_t * output, int64_t n_ubatch,
             const int64_t * ends))
// The expert bytes routes read since the last call, by KV sequence: an expert read on demand, or
// read ahead and routed, split evenly among the tokens of its micro-batch that route it; one read
// ahead and not routed among all of them. by_seq[i] (i < n_seq) gets sequence i's; *unmapped (may
// be NULL) those of routes whose tokens were not announced. Zeroes them; returns 1 + the highest
// sequence that had bytes (0: none). Decode thread, between calls.
MF_FUNCTION(int32_t, mf_streamer_take_seq_bytes, (mf_streamer * s, double * by_seq, int32_t n_seq, double * unmapped))

// Waits for reads still in flight (prefetches of a graph that stopped), then takes the first error
// recorded since the last call: returns its -errno (0 if none) and copies its message.
// Thread contract: between llama_decode calls, on the decode thread.
MF_FUNCTION(int, mf_streamer_take_error, (mf_streamer * s, char * msg, size_t msg_size))

// Predict with fn (an mf_predictor) from now on (NULL: the routers again). user_data must outlive
// the streamer or the next call.
MF_FUNCTION(void, mf_streamer_set_predictor, (mf_streamer * s, mf_predictor fn, void * user_data))

// The message of the last failure of a call on this streamer. Valid until the next call.
MF_FUNCTION(const char *, mf_streamer_last_error, (const mf_streamer * s))

// Reads every expert before the first token (a budget holding them all is required): the model
// then runs like a resident one. Returns 0 or -errno (message in last_error). Decode thread only.
MF_FUNCTION(int, mf_streamer_preload, (mf_streamer * s))

// Evicts every expert entry and gives the free frames' pages back (tests and benchmarks: a cold
// cache). Decode thread only.
MF_FUNCTION(void, mf_streamer_drop_cache, (mf_streamer * s))

// Warm start: the caller saves the hot set and, after a restart, reads it back with
// mf_streamer_restore, a chunk at a time between requests (server/lifecycle/hot_set.py).
// The resident experts, hottest first (most routed, then most recently used), as
// layer * n_expert + expert, and (uses, when not NULL) how often each was routed (the LAYER
// policy's count, halved every 256 visits of its layer; 0 under LRU): up to max of them. Returns
// how many are resident, or -ENOMEM. Decode thread, between llama_decode calls.
MF_FUNCTION(int32_t, mf_streamer_hot_set, (mf_streamer * s, int32_t * out, uint32_t * uses, int32_t max))
// Reads the experts of `layer` with want[e] != 0 (want has n_expert bytes) into the budget's free
// room, evicting nothing, and waits for the reads. The cache then holds each as used at the last
// route and, with uses[e] > 0 (uses may be NULL), as routed that often, so that it keeps them as
// it kept them before. Returns how many it read (0: resident already, or no room left), or
// -errno with a message in last_error: -EINVAL (not a streamed layer, or before
// mf_streamer_check_loaded), or the error of a failed read, taken here so that it fails no
// request (its entries are forgotten and read again when routed). Decode thread, between
// llama_decode calls.
MF_FUNCTION(int32_t, mf_streamer_restore, (mf_streamer * s, int32_t layer, const uint8_t * want, const uint32_t * uses))

// The bytes of a weight (its name in the file, ggml type and shape) that llama.cpp keeps in the CPU
// backend's repacked layout on this CPU, and the streamer too: its size when it has one, else 0
// (also for a type ggml does not know). What a resident model holds in anonymous memory beside
// its mapped file. Thread-safe.
MF_FUNCTION(uint64_t, mf_repacked_bytes, (const char * name, int32_t type, int64_t ne0, int64_t ne1, int64_t ne2))

// Bytes of the largest layer's experts (all of them): the budget floor.
MF_FUNCTION(uint64_t, mf_streamer_layer_bytes, (const mf_streamer * s))
// Bytes of all expert tensors, and number of MoE layers / experts per layer.
MF_FUNCTION(uint64_t, mf_streamer_expert_bytes, (const mf_streamer * s))
MF_FUNCTION(int32_t, mf_streamer_n_moe_layers, (const mf_streamer * s))
MF_FUNCTION(int32_t, mf_streamer_n_expert, (const mf_streamer * s))
// Bytes of the named tensor in the file, 0 when the file has no such tensor.
MF_FUNCTION(uint64_t, mf_streamer_tensor_bytes, (const mf_streamer * s, const char * name))
// 1 when the model's tensor `name` is held in a repacked layout (mf_repacked_bytes), 0 when in the
// file's, -ENOENT when the file has no such tensor. Valid once the model has loaded.
MF_FUNCTION(int, mf_streamer_tensor_repacked, (const mf_streamer * s, const char * name))
// Where resident experts live: frames (how many, their size, the memory they may take), or the
// tensors themselves when the budget holds every expert. Valid once the model has loaded.
MF_FUNCTION(const char *, mf_streamer_memory_note, (const mf_streamer * s))

// ---------------------------------------------------------------------------------------------
// Layout of the structs shared with Python (mf_config, mf_stats, mf_route_record), checked by
// streaming_ext/_lib.py when it loads the library. Neither struct has padding: every byte belongs
// to a listed field. Thread-safe; constant answers.

MF_FUNCTION(size_t, mf_config_size, (void))
MF_FUNCTION(size_t, mf_stats_size, (void))
MF_FUNCTION(size_t, mf_route_record_size, (void))
// Number of fields, and the byte offset of the named one (-1 when the struct has no such field).
MF_FUNCTION(int32_t, mf_config_n_fields, (void))
MF_FUNCTION(int32_t, mf_stats_n_fields, (void))
MF_FUNCTION(int32_t, mf_route_record_n_fields, (void))
MF_FUNCTION(int64_t, mf_config_offset, (const char * field))
MF_FUNCTION(int64_t, mf_stats_offset, (const char * field))
MF_FUNCTION(int64_t, mf_route_record_offset, (const char * field))

// The declarations as data, for streaming_ext/declarations.py (at `make ext`) and _lib.py (at
// load: a library whose declarations differ from the generated module's is refused). NULL past
// the end or for an unknown enum. Thread-safe; static strings.
// The i-th field of MF_CONFIG_FIELDS (0 <= i < mf_config_n_fields()): its name, C type
// ("int32_t"), kind ("PATH", "INT", "BOOL", "FLOAT", "POLICY", ...), default and description.
MF_FUNCTION(const char *, mf_config_field_name, (int32_t i))
MF_FUNCTION(const char *, mf_config_field_type, (int32_t i))
MF_FUNCTION(const char *, mf_config_field_kind, (int32_t i))
MF_FUNCTION(double, mf_config_field_default, (int32_t i))
MF_FUNCTION(const char *, mf_config_field_text, (int32_t i))
// The i-th counter of MF_STATS_FIELDS (0 <= i < mf_stats_n_fields()): its name, kind
// ("COUNTER", "GAUGE"), unit ("COUNT", "BYTES", "NS", "FLAG") and description.
MF_FUNCTION(const char *, mf_stats_field_name, (int32_t i))
MF_FUNCTION(const char *, mf_stats_field_kind, (int32_t i))
MF_FUNCTION(const char *, mf_stats_field_unit, (int32_t i))
MF_FUNCTION(const char *, mf_stats_field_text, (int32_t i))
// The i-th field of MF_ROUTE_RECORD_FIELDS (0 <= i < mf_route_record_n_fields()): its name, C
// type and description.
MF_FUNCTION(const char *, mf_route_record_field_name, (int32_t i))
MF_FUNCTION(const char *, mf_route_record_field_type, (int32_t i))
MF_FUNCTION(const char *, mf_route_record_field_text, (int32_t i))
// The i-th member of an enum ("policy", "prefetch", "reader", "rate_class"): name, value, description.
MF_FUNCTION(const char *, mf_enum_member_name, (const char * enum_name, int32_t i))
MF_FUNCTION(int32_t, mf_enum_member_value, (const char * enum_name, int32_t i))
MF_FUNCTION(const char *, mf_enum_member_text, (const char * enum_name, int32_t i))
// The i-th function of this list (0 <= i < mf_api_n_functions()): its name, return type and
// parameter list, as written here ("(const mf_streamer * s, mf_stats * out)").
MF_FUNCTION(int32_t, mf_api_n_functions, (void))
MF_FUNCTION(const char *, mf_api_function_name, (int32_t i))
MF_FUNCTION(const char *, mf_api_function_returns, (int32_t i))
MF_FUNCTION(const char *, mf_api_function_params, (int32_t i))

// ---------------------------------------------------------------------------------------------
// The cache policy on its own, for trace replay (the same code the streamer runs). A cache is
// used by one thread at a time.

// entry_bytes[l] = bytes of one expert of layer l (0 for a layer without experts).
MF_FUNCTION(int, mf_cache_new,
            (int32_t n_layer, int32_t n_expert, const uint64_t * entry_bytes, uint64_t budget_bytes, int32_t policy,
             mf_cache ** out))
MF_FUNCTION(void, mf_cache_free, (mf_cache * c))

// One layer's routing: want[e] != 0 for each routed expert (for a micro-batch, the union of its
// tokens'). Marks hits, admits misses (evicting per the policy), pins the layer until the next
// call. The policy learns from each token's own routing, one visit of the layer per token:
// tokens holds n_tokens rows of k expert ids (each one of want's); NULL with n_tokens 1 when want
// is one token's routing; NULL with n_tokens 0 for no evidence (a preload). Returns the number of
// misses (>= 0), -ENOSPC when the routed set alone exceeds the budget, -EINVAL for ids outside
// want or arguments that do not fit together.
MF_FUNCTION(int, mf_cache_route,
            (mf_cache * c, int32_t layer, const uint8_t * want, const int32_t * tokens, int32_t n_tokens, int32_t k))

// Admits predicted experts of `layer` ahead of its routing, as the streamer's prefetch does: like
// mf_cache_route, but nothing is pinned, counted or learned, and it stops rather than evict the
// running layer's routed entries or its own admissions. Returns the number of entries to load.
MF_FUNCTION(int32_t, mf_cache_prefetch, (mf_cache * c, int32_t layer, const uint8_t * want))
// The experts (of the layer) that the last mf_cache_route or mf_cache_prefetch admitted, to be
// read: up to max of them into out; returns how many there are.
MF_FUNCTION(int32_t, mf_cache_loads, (const mf_cache * c, int32_t * out, int32_t max))
// An expert's enum mf_rate_class now; -EINVAL for a layer or expert out of range.
MF_FUNCTION(int32_t, mf_cache_rate_class, (const mf_cache * c, int32_t layer, int32_t e))

// Counters of a stand-alone cache: hits, misses, evictions.
MF_FUNCTION(void, mf_cache_counts, (const mf_cache * c, uint64_t * hits, uint64_t * misses, uint64_t * evictions))

// ---------------------------------------------------------------------------------------------
// Route traces (mf_route.c): make every MoE layer route each token as a recorded trace did, and
// record the routing a model runs. Install mf_route_trace_eval_cb as cb_eval with the trace as
// user data, chained to the streamer's callback for a streamed model. Replayed output differs from
// the model's own (benchmarks and tests only); a streamed and a resident model replaying the same
// trace must give the same bytes. One thread at a time (the llama_decode thread).

// A trace for a model of n_layer layers, n_expert experts, k used per token. 0 or -errno.
MF_FUNCTION(int, mf_route_trace_new, (int32_t n_layer, int32_t n_expert, int32_t k, mf_route_trace ** out))
MF_FUNCTION(void, mf_route_trace_free, (mf_route_trace * rt))
// Routing to replay for phase 0 (prompt) or 1 (decode): ids[n_steps][n_layer][k], copied; a
// layer whose first id is -1 routes as the model does. -EINVAL, -ERANGE (an id out of range).
MF_FUNCTION(int, mf_route_trace_set_replay, (mf_route_trace * rt, int32_t phase, int64_t n_steps, const int32_t * ids))
// Non-zero: record every route from now on (after replacement, so a replayed run records the trace).
MF_FUNCTION(void, mf_route_trace_set_recording, (mf_route_trace * rt, int32_t on))
// The callback to run after this one on every node (the streamer's), or NULL.
MF_FUNCTION(void, mf_route_trace_chain,
            (mf_route_trace * rt, ggml_backend_sched_eval_callback next, void * next_user_data))
// Only layers below n are routed here (0: all): the others run on an RPC helper, and the trace
// leaves their nodes, whose data is not in this process, alone.
MF_FUNCTION(void, mf_route_trace_keep_layers, (mf_route_trace * rt, int32_t n))
// The tokens of the next llama_decode call in the order llama.cpp computes them, copied: token i
// of KV sequence seq[i], output[i] != 0 when its logits are asked for, micro-batch u ending before
// token ends[u] (n_ubatch of them, the last at n_tokens), and step step[i] of phase phase[i] (0
// prompt, 1 decode) of request turn[i]. 0, -EINVAL, -ENOMEM; a node of a call or micro-batch not
// announced stops its graph with an error.
MF_FUNCTION(int, mf_route_trace_begin_batch,
            (mf_route_trace * rt, int64_t n_tokens, const int32_t * seq, const uint8_t * output, int64_t n_ubatch,
             const int64_t * ends, const int32_t * turn, const int32_t * phase, const int32_t * step))
MF_FUNCTION(bool, mf_route_trace_eval_cb, (struct ggml_tensor * t, bool ask, void * user_data))
// Records not yet taken; moves up to max of them, oldest first, into out. Returns how many.
MF_FUNCTION(int64_t, mf_route_trace_n_recorded, (const mf_route_trace * rt))
MF_FUNCTION(int64_t, mf_route_trace_take_recorded, (mf_route_trace * rt, mf_route_record * out, int64_t max))
// The error that stopped a graph (a node the trace does not fit): -errno (0 if none) and its message.
MF_FUNCTION(int, mf_route_trace_take_error, (mf_route_trace * rt, char * msg, size_t msg_size))
// An mf_predictor (user_data: the trace) that knows the future: the experts the replayed trace
// routes at layer il for the tokens of the last ffn_moe_topk node it saw, the prefetch's upper
// bound. 0 when nothing is replayed. The last layer computes only the output tokens, which the
// node before it does not tell apart: it predicts the whole micro-batch there.
MF_FUNCTION(int32_t, mf_route_trace_predict, (void * user_data, int32_t il, uint8_t * want))
// Makes mf_route_trace_predict an emulated predictor that is right on about 1 - share of the
// routed slots: each token's slot is replaced, with probability share, by an expert that token
// does not route at that layer, drawn from a generator seeded with seed (the same run, the same
// guesses). share 0 is the oracle. -EINVAL unless 0 <= share < 1.
MF_FUNCTION(int, mf_route_trace_set_predict_error, (mf_route_trace * rt, float share, uint64_t seed))
