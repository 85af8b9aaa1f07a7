// Test of the expert frames (streaming_ext/src/mf_frames.c), built with ASan + UBSan and run by
// tests/test_streaming_ext.py.
//
// Checks, each printing one "ok NAME: ..." or "FAIL NAME: ..." line (exit status 0 only if all pass):
//   reuse     a frame given back is the next one taken of its class, with its bytes intact
//   limit     a class that needs a frame without pages first gives back the other classes' warm
//             frames, until the frames with pages fit the limit again (those read as zeros after)
//   exhaust   a class with no free frame left answers -1
//   stress    200000 random takes and gives over three classes: live frames are distinct, inside
//             their class's region and keep the bytes written into them; the memory held is the
//             live and warm frames exactly, and within the limit whenever warm frames were left to
//             give back
//   trim      mf_frames_trim gives back every warm frame: the memory held is the live frames'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mf_internal.h"

static int failed;

static void verdict(int ok, const char * name, const char * what) {
    printf("%s %s: %s\n", ok ? "ok" : "FAIL", name, what);
    failed |= !ok;
}

// writes a pattern naming (class, id, serial) over the first and last word of a frame
static void stamp(const mf_frames * fr, int32_t c, int32_t id, uint64_t serial) {
    char * p = mf_frames_addr(fr, c, id);
    const uint64_t v = ((uint64_t) c << 56) ^ ((uint64_t) id << 32) ^ serial;
    memcpy(p, &v, sizeof v);
    memcpy(p + fr->cls[c].frame_bytes - sizeof v, &v, sizeof v);
}

static int stamped(const mf_frames * fr, int32_t c, int32_t id, uint64_t serial) {
    const char * p = mf_frames_addr(fr, c, id);
    const uint64_t v = ((uint64_t) c << 56) ^ ((uint64_t) id << 32) ^ serial;
    uint64_t a, b;
    memcpy(&a, p, sizeof a);
    memcpy(&b, p + fr->cls[c].frame_bytes - sizeof b, sizeof b);
    return a == v && b == v;
}

static int zeros(const mf_frames * fr, int32_t c, int32_t id) {
    const char * p = mf_frames_addr(fr, c, id);
    for (size_t i = 0; i < fr->cls[c].frame_bytes; i += MF_PAGE) {
        if (p[i] != 0) {
            return 0;
        }
    }
    return 1;
}

static void test_reuse_and_limit(void) {
    const size_t  bytes[2] = { 3 * MF_PAGE, 5 * MF_PAGE };
    const int32_t cap[2]   = { 8, 8 };
    mf_frames     fr;
    // room for four small frames and one large one
    if (mf_frames_init(&fr, bytes, cap, 2, 17 * MF_PAGE) != 0) {
        verdict(0, "reuse", "mf_frames_init failed");
        return;
    }
    int32_t a = mf_frames_take(&fr, 0);
    stamp(&fr, 0, a, 7);
    mf_frames_give(&fr, 0, a);
    const int32_t b = mf_frames_take(&fr, 0);
    verdict(b == a && stamped(&fr, 0, b, 7), "reuse", "the frame given back comes back first, bytes intact");
    mf_frames_give(&fr, 0, b);

    // four small frames with pages (one warm, three more taken and given back): 12 pages held
    int32_t small[4];
    for (int i = 0; i < 4; i++) {
        small[i] = mf_frames_take(&fr, 0);
        stamp(&fr, 0, small[i], 100 + (uint64_t) i);
    }
    for (int i = 0; i < 4; i++) {
        mf_frames_give(&fr, 0, small[i]);
    }
    const size_t held = atomic_load(&fr.populated);
    const int32_t big = mf_frames_take(&fr, 1);  // 12 + 5 = 17 pages: fits
    const int32_t big2 = mf_frames_take(&fr, 1);  // 22 > 17: two small frames must go (12 - 6 + 10 = 16)
    char what[200];
    snprintf(what, sizeof what, "held %zu -> %zu pages, %llu warm frames given back", held / MF_PAGE,
             atomic_load(&fr.populated) / MF_PAGE, (unsigned long long) atomic_load(&fr.released));
    verdict(held == 12 * MF_PAGE && big >= 0 && big2 >= 0 && big != big2 && atomic_load(&fr.released) == 2 &&
                atomic_load(&fr.populated) == 16 * MF_PAGE,
            "limit", what);
    // the two given back (the most recently freed first) read as zeros; the others kept their bytes
    int given_back_zero = 1, kept = 1;
    for (int i = 0; i < 4; i++) {
        const int32_t id = mf_frames_take(&fr, 0);
        const int     i_of = id == small[3] ? 3 : id == small[2] ? 2 : id == small[1] ? 1 : 0;
        if (i_of >= 2) {
            given_back_zero &= zeros(&fr, 0, id);
        } else {
            kept &= stamped(&fr, 0, id, 100 + (uint64_t) i_of);
        }
    }
    verdict(given_back_zero && kept, "limit", "given-back frames read as zeros, the others keep their bytes");
    mf_frames_free(&fr);

    const size_t  one[1] = { MF_PAGE };
    const int32_t two[1] = { 2 };
    if (mf_frames_init(&fr, one, two, 1, MF_PAGE) != 0) {
        verdict(0, "exhaust", "mf_frames_init failed");
        return;
    }
    a                 = mf_frames_take(&fr, 0);
    const int32_t a2  = mf_frames_take(&fr, 0);
    const int32_t a3  = mf_frames_take(&fr, 0);
    verdict(a >= 0 && a2 >= 0 && a3 == -1, "exhaust", "a third take of two frames answers -1");
    mf_frames_free(&fr);
}

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_stress(void) {
    enum { N_CLS = 3, CAP = 64, OPS = 200000 };
    const size_t  bytes[N_CLS] = { 2 * MF_PAGE, 3 * MF_PAGE, 7 * MF_PAGE };
    const int32_t cap[N_CLS]   = { CAP, CAP, CAP };
    const size_t  limit        = 150 * MF_PAGE;
    mf_frames     fr;
    if (mf_frames_init(&fr, bytes, cap, N_CLS, limit) != 0) {
        verdict(0, "stress", "mf_frames_init failed");
        return;
    }
    int32_t  live[N_CLS][CAP];
    uint64_t serial[N_CLS][CAP];
    int32_t  n_live[N_CLS] = { 0 };
    uint8_t  is_live[N_CLS][CAP];
    memset(is_live, 0, sizeof is_live);
    int    ok        = 1;
    long   over      = 0;  // takes that left the memory above the limit with warm frames elsewhere
    size_t live_b    = 0;
    for (uint64_t op = 0; op < OPS && ok; op++) {
        const int32_t c = (int32_t) (rnd() % N_CLS);
        // drift the classes' shares: each class in turn is favoured for a while
        const int32_t fav = (int32_t) ((op / 5000) % N_CLS);
        const int take = n_live[c] == 0 || (n_live[c] < CAP && rnd() % 100 < (c == fav ? 60u : 45u));
        if (take) {
            const size_t  before = atomic_load(&fr.populated);
            const int32_t id     = mf_frames_take(&fr, c);
            if (id < 0 || id >= CAP || is_live[c][id]) {
                ok = 0;
                break;
            }
            is_live[c][id]          = 1;
            live[c][n_live[c]]      = id;
            serial[c][n_live[c]++]  = op;
            stamp(&fr, c, id, op);
            live_b += bytes[c];
            // a frame without pages was taken: past the limit only when no other class had a warm one
            const int32_t warm_left = fr.cls[(c + 1) % N_CLS].n_warm + fr.cls[(c + 2) % N_CLS].n_warm;
            if (atomic_load(&fr.populated) > before && atomic_load(&fr.populated) > limit && warm_left > 0) {
                over++;
            }
        } else {
            const int32_t k  = (int32_t) (rnd() % (uint64_t) n_live[c]);
            const int32_t id = live[c][k];
            ok &= stamped(&fr, c, id, serial[c][k]);
            is_live[c][id] = 0;
            live[c][k]     = live[c][--n_live[c]];
            serial[c][k]   = serial[c][n_live[c]];
            mf_frames_give(&fr, c, id);
            live_b -= bytes[c];
        }
        size_t warm_b = 0;
        for (int32_t o = 0; o < N_CLS; o++) {
            warm_b += (size_t) fr.cls[o].n_warm * bytes[o];
        }
        ok &= atomic_load(&fr.populated) == live_b + warm_b;
    }
    for (int32_t c = 0; c < N_CLS && ok; c++) {
        for (int32_t k = 0; k < n_live[c]; k++) {
            ok &= stamped(&fr, c, live[c][k], serial[c][k]);
        }
    }
    char what[200];
    snprintf(what, sizeof what, "%d ops, %llu warm frames given back, %ld takes above the limit with warm frames left",
             OPS, (unsigned long long) atomic_load(&fr.released), over);
    verdict(ok && over == 0 && atomic_load(&fr.released) > 0, "stress", what);

    mf_frames_trim(&fr);
    int none_warm = 1;
    for (int32_t c = 0; c < N_CLS; c++) {
        none_warm &= fr.cls[c].n_warm == 0;
    }
    verdict(none_warm && atomic_load(&fr.populated) == live_b, "trim", "only the live frames hold memory");
    mf_frames_free(&fr);
}

int main(void) {
    test_reuse_and_limit();
    test_stress();
    return failed;
}
