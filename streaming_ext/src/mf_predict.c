// Predicting the next layer's experts, to read them while this layer computes.
//
// The router of layer l+1 reads the residual stream after layer l, which each layer changes only
// by a small update, so applying layer l+1's router to layer l's MoE input already picks most of
// l+1's experts. When layer l routes, its MoE input is still alive in the graph: the streamer
// scores layer l+1's experts right away and queues their reads behind layer l's, so the disk
// stays busy through layer l's matmuls and layer l+1's attention. A wrong guess costs a read and
// some cache space, never a wrong result: the routing that follows decides.
// How: from the ffn_moe_topk-<l> node, a short walk over its sources finds the router matmul
// (src0 = blk.l.ffn_gate_inp.weight) and its input x. Where x is the usual
// mul(rms_norm(ffn_inp), norm weight), layer l+1's scores use the raw residual ffn_inp normed with
// layer l+1's weight of the same name; gemma4's scale(rms_norm(attn_out)) node is applied as it
// is. Then the router bias, and the selection bias after a sigmoid where the model has one
// (exp_probs_b). Without the usual pattern, x itself stands in. Weights must be F32 and dense;
// anything unexpected means no prediction for that layer. Decode thread only (mf_predict_note:
// the loading thread). See docs/streamer.md, "Prefetch".
#include "mf_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// "blk.<n>.<suffix>": the layer number and the suffix, or -1
static int32_t blk_suffix(const char * name, const char ** suffix) {
    if (strncmp(name, "blk.", 4) != 0) {
        return -1;
    }
    char *     end;
    const long l = strtol(name + 4, &end, 10);
    if (end == name + 4 || *end != '.' || l < 0 || l > 100000) {
        return -1;
    }
    *suffix = end + 1;
    return (int32_t) l;
}

static bool is_f32_vector(const struct ggml_tensor * t, int64_t n) {
    return t && t->type == GGML_TYPE_F32 && t->ne[0] == n && ggml_nelements(t) == n && t->data;
}

int mf_predict_note(mf_streamer * s, const struct ggml_tensor * t) {
    const char *  suffix;
    const int32_t l = blk_suffix(t->name, &suffix);
    if (l < 0 || t->type != GGML_TYPE_F32) {
        return 0;
    }
    const size_t n = strlen(suffix);
    const bool   wanted = strcmp(suffix, "ffn_gate_inp.weight") == 0 || strcmp(suffix, "ffn_gate_inp.bias") == 0 ||
                        strcmp(suffix, "exp_probs_b.bias") == 0 || strcmp(suffix, "ffn_gate_inp.scale") == 0 ||
                        (n > 11 && strcmp(suffix + n - 11, "norm.weight") == 0);
    if (!wanted) {
        return 0;
    }
    if (s->n_noted == s->cap_noted) {
        const int32_t                cap = s->cap_noted ? 2 * s->cap_noted : 256;
        const struct ggml_tensor ** a   = realloc(s->noted, (size_t) cap * sizeof *a);
        if (!a) {
            return -ENOMEM;
        }
        s->noted     = a;
        s->cap_noted = cap;
    }
    s->noted[s->n_noted++] = t;
    return 0;
}

void mf_predict_resolve(mf_streamer * s) {
    for (int32_t i = 0; i < s->n_noted; i++) {
        const struct ggml_tensor * t = s->noted[i];
        const char *               suffix;
        const int32_t              l = blk_suffix(t->name, &suffix);
        if (l < 0 || l >= s->n_layers) {
            continue;
        }
        mf_router * r = &s->layers[l].router;
        if (strcmp(suffix, "ffn_gate_inp.weight") == 0) {
            r->gate = t;
        } else if (strcmp(suffix, "ffn_gate_inp.bias") == 0) {
            r->bias = t;
        } else if (strcmp(suffix, "exp_probs_b.bias") == 0) {
            r->probs_b = t;
        } else if (r->n_norms < MF_MAX_NORMS) {
            r->norms[r->n_norms++] = t;
        }
    }
    for (int32_t l = 0; l < s->n_layers; l++) {
        mf_router *                r = &s->layers[l].router;
        const struct ggml_tensor * g = r->gate;
        // usable: W is F32 [n_embd, n_expert] with rows of n_embd floats
        r->usable = g && g->type == GGML_TYPE_F32 && g->ne[1] == s->n_expert && g->nb[0] == sizeof(float) &&
                    g->data && (!r->bias || is_f32_vector(r->bias, s->n_expert)) &&
                    (!r->probs_b || is_f32_vector(r->probs_b, s->n_expert));
    }
}

// nodes visited looking for the router matmul: it is a few sources above the topk node
#define MF_ROUTER_WALK 64

// the router matmul of layer `il` among the sources of its topk node (breadth-first, bounded)
static const struct ggml_tensor * find_router_mm(const struct ggml_tensor * topk, const struct ggml_tensor * gate) {
    const struct ggml_tensor * seen[MF_ROUTER_WALK];
    int32_t                    head = 0, n = 0;
    seen[n++]                       = topk;
    while (head < n) {
        const struct ggml_tensor * t = seen[head++];
        if (t->op == GGML_OP_MUL_MAT && t->src[0] == gate) {
            return t;
        }
        for (int32_t j = 0; j < GGML_MAX_SRC && t->src[j]; j++) {
            if (n < (int32_t) (sizeof seen / sizeof seen[0])) {
                seen[n++] = t->src[j];
            }
        }
    }
    return NULL;
}

static const struct ggml_tensor * norm_like(const mf_router * r, const char * suffix) {
    for (int32_t i = 0; i < r->n_norms; i++) {
        const char * sfx;
        if (blk_suffix(r->norms[i]->name, &sfx) >= 0 && strcmp(sfx, suffix) == 0) {
            return r->norms[i];
        }
    }
    return NULL;
}

// The dot product is the whole cost of a prediction (n_expert x n_embd per scored token). Four
// vector accumulators of eight floats (GCC/Clang vector types: SSE or NEON pairs, or one AVX
// register): the compiler may not reorder one float sum, and one accumulator would wait on each
// add's latency; four keep the multipliers busy. The SIMD level is a run-time choice: on x86-64
// a copy for AVX2 is picked at load time where the CPU has it (the build's baseline is SSE2).
typedef float mf_v8 __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx2", "default")))
#endif
static float dot(const float * a, const float * b, int64_t n) {
    mf_v8   s0 = { 0 }, s1 = { 0 }, s2 = { 0 }, s3 = { 0 };
    int64_t i  = 0;
    for (; i + 32 <= n; i += 32) {
        mf_v8 x0, x1, x2, x3, y0, y1, y2, y3;
        // memcpy: unaligned loads without breaking aliasing rules
        memcpy(&x0, a + i, sizeof x0);
        memcpy(&x1, a + i + 8, sizeof x1);
        memcpy(&x2, a + i + 16, sizeof x2);
        memcpy(&x3, a + i + 24, sizeof x3);
        memcpy(&y0, b + i, sizeof y0);
        memcpy(&y1, b + i + 8, sizeof y1);
        memcpy(&y2, b + i + 16, sizeof y2);
        memcpy(&y3, b + i + 24, sizeof y3);
        s0 += x0 * y0;
        s1 += x1 * y1;
        s2 += x2 * y2;
        s3 += x3 * y3;
    }
    const mf_v8 sum = (s0 + s1) + (s2 + s3);
    float       acc = ((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7]));
    for (; i < n; i++) {
        acc += a[i] * b[i];
    }
    return acc;
}

static bool is_f32_rows(const struct ggml_tensor * t, int64_t n_embd) {
    return t && t->data && t->type == GGML_TYPE_F32 && t->ne[0] == n_embd && t->nb[0] == sizeof(float) &&
           t->ne[2] == 1 && t->ne[3] == 1;
}

int32_t mf_predict_next(mf_streamer * s, int32_t il, const struct ggml_tensor * topk, uint8_t * want) {
    if (il + 1 >= s->n_layers || !s->layers[il].router.usable || !s->layers[il + 1].router.usable ||
        s->layers[il + 1].n_xt == 0) {
        return 0;
    }
    const mf_router *          cur  = &s->layers[il].router;
    const mf_router *          next = &s->layers[il + 1].router;
    const int64_t              n_embd = next->gate->ne[0];
    const int64_t              k      = topk->ne[0];
    const struct ggml_tensor * mm     = find_router_mm(topk, cur->gate);
    if (!mm || k <= 0 || k > s->n_expert || !is_f32_rows(mm->src[1], n_embd)) {
        return 0;
    }
    const struct ggml_tensor * x = mm->src[1];
    // the usual pre-MoE norm: x = rms_norm(ffn_inp) * w(l); then layer l+1 sees ffn_inp through
    // w(l+1). gemma4: x = scale(rms_norm(attn_out), s, b) * w(l), with the scale node kept
    const struct ggml_tensor * raw = NULL, *w_next = NULL;
    float                      eps = 1e-6f, mul = 1.0f, add = 0.0f;
    if (x->op == GGML_OP_MUL && x->src[0] && x->src[1]) {
        const struct ggml_tensor * normed = x->src[0];
        if (normed->op == GGML_OP_SCALE && normed->src[0]) {
            float sb[2];
            memcpy(sb, normed->op_params, sizeof sb);
            mul    = sb[0];
            add    = sb[1];
            normed = normed->src[0];
        }
        const char * sfx;
        if (normed->op == GGML_OP_RMS_NORM && blk_suffix(x->src[1]->name, &sfx) == il) {
            w_next = norm_like(next, sfx);
            raw    = normed->src[0];
            memcpy(&eps, normed->op_params, sizeof eps);
        }
        if (!raw || !is_f32_vector(w_next, n_embd) || !is_f32_rows(raw, n_embd) || raw->ne[1] != x->ne[1]) {
            raw = NULL;
        }
    }
    float * v      = s->pred_v;
    float * scores = s->pred_scores;
    memset(want, 0, (size_t) s->n_expert);
    // every token of the batch is scored, prompts included: a prompt's reads are the biggest to
    // hide, and scoring costs n_expert x n_embd per token, under 1% of the layer's own expert
    // matmuls (k x 3 x n_embd x n_ff_exp). Scoring stops once every expert is wanted: the rest of
    // the batch cannot add one (with few experts that comes after a few tokens)
    int32_t n = 0;
    int64_t j = 0;
    for (; j < x->ne[1] && j < topk->ne[1] && n < s->n_expert; j++) {
        if (raw) {
            const float * r  = (const float *) ((const char *) raw->data + j * raw->nb[1]);
            const float * w  = w_next->data;
            double        ss = 0.0;
            for (int64_t i = 0; i < n_embd; i++) {
                ss += (double) r[i] * r[i];
            }
            const float scale = 1.0f / sqrtf((float) (ss / (double) n_embd) + eps);
            for (int64_t i = 0; i < n_embd; i++) {
                v[i] = (r[i] * scale * mul + add) * w[i];
            }
        } else {
            memcpy(v, (const char *) x->data + j * x->nb[1], (size_t) n_embd * sizeof(float));
        }
        for (int32_t e = 0; e < s->n_expert; e++) {
            const float * g   = (const float *) ((const char *) next->gate->data + (size_t) e * next->gate->nb[1]);
            float         acc = dot(g, v, n_embd);
            if (next->bias) {
                acc += ((const float *) next->bias->data)[e];
            }
            if (next->probs_b) {
                acc = 1.0f / (1.0f + expf(-acc)) + ((const float *) next->probs_b->data)[e];
            }
            scores[e] = acc;
        }
        // top k by repeated selection (k is small)
        for (int64_t m = 0; m < k; m++) {
            int32_t best = -1;
            for (int32_t e = 0; e < s->n_expert; e++) {
                if (scores[e] > -INFINITY && (best < 0 || scores[e] > scores[best])) {
                    best = e;
                }
            }
            s->pf_rows[j * k + m] = best;
            if (best < 0) {
                continue;
            }
            n += !want[best];
            want[best]   = 1;
            scores[best] = -INFINITY;
        }
    }
    s->pf_rows_n = j;
    s->pf_k      = k;
    return n;
}
