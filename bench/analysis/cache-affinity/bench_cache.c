// microbenchmark: per-route cost of mf_cache_route (LAYER policy). Routes come from a trace dump
// (layer followed by the routed experts, one route per line) or, without one, are synthetic:
// 48 layers x 128 experts, k = 8, a skewed per-layer popularity with some token-to-token reuse.
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "moeflash_stream.h"

static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
static uint64_t rng = 88172645463325252ull;
static uint64_t xr(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

int main(int argc, char ** argv) {
    const int L = 48, E = 128, K = 8, TOK = argc > 2 ? atoi(argv[2]) : 2000;
    const uint64_t budget = (uint64_t) (argc > 1 ? atoi(argv[1]) : 2000) << 20;
    const int policy = argc > 3 ? atoi(argv[3]) : MF_POLICY_LAYER;
    uint64_t bytes[48];
    for (int l = 0; l < L; l++) bytes[l] = 3059712;
    mf_cache * c;
    if (mf_cache_new(L, E, bytes, budget, policy, &c) != 0) return 1;
    uint8_t * want = malloc((size_t) TOK * L * E);
    uint8_t prev[48][128] = {{0}};
    for (int t = 0; t < TOK; t++) for (int l = 0; l < L; l++) {
        uint8_t * w = want + ((size_t) t * L + l) * E; memset(w, 0, E);
        int k = 0;
        while (k < K) {
            int e;
            uint64_t r = xr();
            if (r % 3 == 0) { e = (int) (xr() % E); if (!prev[l][e]) continue; }  // reuse
            else { double u = (double) (xr() % 1000000) / 1e6; e = (int) (E * u * u * u); }  // skewed
            if (!w[e]) { w[e] = 1; k++; }
        }
        memcpy(prev[l], w, E);
    }
    double dt = 0, worst = 0;
    for (int t = 0; t < TOK; t++) for (int l = 0; l < L; l++) {
        double t0 = now();
        mf_cache_route(c, l, want + ((size_t) t * L + l) * E);
        double d = now() - t0; dt += d; if (t > 10 && d > worst) worst = d;
    }
    uint64_t h, m, ev; mf_cache_counts(c, &h, &m, &ev);
    printf("policy %d budget %llu MiB: %.2f us per route (worst %.0f us), hit %.1f%%\n", policy, (unsigned long long) (budget >> 20), dt * 1e6 / ((double) TOK * L), worst * 1e6, 100.0 * h / (h + m));
    mf_cache_free(c); free(want);
    return 0;
}
