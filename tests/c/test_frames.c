// Test of the expert frames (streaming_ext/src/mf_frames.c), built with ASan + UBSan and run by
// tests/streaming_ext/test_streamer.py.
//
// Checks, each printing one "ok NAME: ..." or "FAIL NAME: ..." line (exit status 0 only if all pass):
//   init      bad sizes and counts, or no counters, are refused with -EINVAL and leave nothing mapped
//   reuse     a frame given back is the next one taken, with its bytes intact
//   warm      takes use frames with pages before fresh ones: the memory held grows only when no
//             frame given back is left
//   exhaust   a take with every frame live answers -1; freed, the frames' counter of memory held is 0
//   stress    200000 random takes and gives: live frames are distinct, inside the arena and keep
//             the bytes written into them; the memory held is the live and warm frames exactly
//   trim      mf_frames_trim gives back every warm frame: the memory held is the live frames',
//             live frames keep their bytes, and a trimmed frame reads as zeros when taken again
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mf_internal.h"

static int failed;

static void verdict(int ok, const char * name, const char * what) {
    printf("%s %s: %s\n", ok ? "ok" : "FAIL", name, what);
    failed |= !ok;
}

// writes a pattern naming (id, serial) over the first and last word of a frame
static void stamp(const mf_frames * fr, int32_t id, uint64_t serial) {
    char *         p = mf_frames_addr(fr, id);
    const uint64_t v = ((uint64_t) id << 40) ^ serial;
    memcpy(p, &v, sizeof v);
    memcpy(p + fr->frame_bytes - sizeof v, &v, sizeof v);
}

static int stamped(const mf_frames * fr, int32_t id, uint64_t serial) {
    const char *   p = mf_frames_addr(fr, id);
    const uint64_t v = ((uint64_t) id << 40) ^ serial;
    uint64_t       a, b;
    memcpy(&a, p, sizeof a);
    memcpy(&b, p + fr->frame_bytes - sizeof b, sizeof b);
    return a == v && b == v;
}

static int zeros(const mf_frames * fr, int32_t id) {
    const char * p = mf_frames_addr(fr, id);
    for (size_t i = 0; i < fr->frame_bytes; i += mf_page_size()) {
        if (p[i] != 0 || p[i + mf_page_size() - 1] != 0) {
            return 0;
        }
    }
    return 1;
}

static void test_init(void) {
    mf_frames            fr;
    atomic_uint_fast64_t populated = 0, released = 0;
    const int            odd       = mf_frames_init(&fr, mf_page_size() + 1, 4, &populated, &released);
    const int            none      = mf_frames_init(&fr, mf_page_size(), 0, &populated, &released);
    const int            zero      = mf_frames_init(&fr, 0, 4, &populated, &released);
    const int            uncounted = mf_frames_init(&fr, mf_page_size(), 4, NULL, &released);
    verdict(odd == -EINVAL && none == -EINVAL && zero == -EINVAL && uncounted == -EINVAL && fr.base == NULL, "init",
            "a size not in whole pages, no frames, empty frames or no counters are refused");
}

static void test_reuse_warm_exhaust(void) {
    mf_frames            fr;
    atomic_uint_fast64_t populated = 0, released = 0;
    if (mf_frames_init(&fr, 3 * mf_page_size(), 4, &populated, &released) != 0) {
        verdict(0, "reuse", "mf_frames_init failed");
        return;
    }
    const int32_t a = mf_frames_take(&fr);
    stamp(&fr, a, 7);
    mf_frames_give(&fr, a);
    const int32_t b = mf_frames_take(&fr);
    verdict(b == a && stamped(&fr, b, 7), "reuse", "the frame given back comes back first, bytes intact");

    // b live; take two more (fresh), give both back, take two again: no fresh pages needed
    const int32_t c = mf_frames_take(&fr), d = mf_frames_take(&fr);
    const size_t  held = atomic_load(&populated);
    mf_frames_give(&fr, c);
    mf_frames_give(&fr, d);
    const int32_t e = mf_frames_take(&fr), f = mf_frames_take(&fr);
    const size_t  held_after = atomic_load(&populated);
    const int32_t g          = mf_frames_take(&fr);  // the fourth frame: fresh
    char          what[160];
    snprintf(what, sizeof what, "held %zu pages after three takes, %zu after reusing two, %zu after a fourth",
             held / mf_page_size(), held_after / mf_page_size(), atomic_load(&populated) / mf_page_size());
    verdict(held == 9 * mf_page_size() && held_after == held && ((e == d && f == c) || (e == c && f == d)) && g >= 0 &&
                g != a && g != c && g != d && atomic_load(&populated) == 12 * mf_page_size(),
            "warm", what);
    const int32_t fifth = mf_frames_take(&fr);
    mf_frames_free(&fr);
    verdict(fifth == -1 && atomic_load(&populated) == 0, "exhaust",
            "a fifth take of four frames answers -1; freed, the frames hold no memory");
}

static uint64_t rng_state = 88172645463325252ull;

static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_stress_trim(void) {
    enum { CAP = 96, OPS = 200000 };
    const size_t bytes = 5 * mf_page_size();
    mf_frames            fr;
    atomic_uint_fast64_t populated = 0, released = 0;
    if (mf_frames_init(&fr, bytes, CAP, &populated, &released) != 0) {
        verdict(0, "stress", "mf_frames_init failed");
        return;
    }
    int32_t  live[CAP];
    uint64_t serial[CAP];
    uint8_t  is_live[CAP] = { 0 };
    int32_t  n_live       = 0;
    int      ok           = 1;
    int      full         = 0;  // takes that found every frame live
    for (uint64_t op = 0; op < OPS && ok; op++) {
        // drift the live count up and down so frames go warm and come back
        const unsigned up   = (op / 7000) % 2 ? 40u : 60u;
        const int      take = n_live == 0 || rnd() % 100 < up;
        if (take) {
            const int32_t id = mf_frames_take(&fr);
            if (n_live == CAP) {
                ok &= id == -1;
                full++;
                continue;
            }
            if (id < 0 || id >= CAP || is_live[id]) {
                ok = 0;
                break;
            }
            is_live[id]      = 1;
            live[n_live]     = id;
            serial[n_live++] = op;
            stamp(&fr, id, op);
        } else {
            const int32_t k  = (int32_t) (rnd() % (uint64_t) n_live);
            const int32_t id = live[k];
            ok &= stamped(&fr, id, serial[k]);
            is_live[id] = 0;
            live[k]     = live[--n_live];
            serial[k]   = serial[n_live];
            mf_frames_give(&fr, id);
        }
        ok &= atomic_load(&populated) == (size_t) (n_live + fr.n_warm) * bytes;
        ok &= fr.n_warm + fr.n_cold + n_live == CAP;
    }
    for (int32_t k = 0; k < n_live && ok; k++) {
        ok &= stamped(&fr, live[k], serial[k]);
    }
    char what[160];
    snprintf(what, sizeof what, "%d ops, %d live at the end, %d takes with every frame live", OPS, n_live, full);
    verdict(ok && full > 0, "stress", what);

    // give back every other live frame so the trim has warm frames however the walk ended
    for (int32_t k = n_live - 1; k >= 0; k -= 2) {
        mf_frames_give(&fr, live[k]);
        live[k]   = live[--n_live];
        serial[k] = serial[n_live];
    }
    const int32_t warm = fr.n_warm;
    mf_frames_trim(&fr);
    int kept = 1;
    for (int32_t k = 0; k < n_live; k++) {
        kept &= stamped(&fr, live[k], serial[k]);
    }
    const int32_t again = mf_frames_take(&fr);
    const int     clean = again >= 0 && zeros(&fr, again);
    snprintf(what, sizeof what, "%d warm frames given back, %llu released", warm,
             (unsigned long long) atomic_load(&released));
    verdict(warm > 0 && fr.n_warm == 0 && atomic_load(&released) == (uint64_t) warm && kept && clean &&
                atomic_load(&populated) == (size_t) (n_live + 1) * bytes,
            "trim", what);
    mf_frames_free(&fr);
}

int main(void) {
    test_init();
    test_reuse_warm_exhaust();
    test_stress_trim();
    return failed;
}
