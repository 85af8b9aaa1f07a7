// Version and build checks of libmoeflash_stream.
#include "moeflash_stream.h"

#include <stddef.h>

#include "ggml-cpu.h"
#include "ggml.h"

const char * mf_version(void) {
    return "0.1.0";
}

const char * mf_ggml_version(void) {
    return ggml_version();
}

const char * mf_ggml_commit(void) {
    return ggml_commit();
}

int mf_patched_build(void) {
    // a reference the dynamic linker must resolve: against an unpatched ggml-cpu this library
    // does not load at all (the volatile keeps the compiler from folding the test away)
    void (*volatile hook_setter)(ggml_cpu_mul_mat_id_ready_t, void *) = ggml_cpu_set_mul_mat_id_ready_hook;
    return hook_setter != NULL;
}
