// The patched RPC server (patch 0012) as an aarch64 helper runs it: ggml's CPU device served on
// 127.0.0.1:PORT within MEMORY bytes, answering HELLO with BUILD. Under qemu-user the test suite
// (tests/build/test_aarch64.py) reaches it from this machine's own build and checks what it
// answers; the server runs until killed.
//
//   test_rpc_server PORT MEMORY BUILD
#include <stdio.h>
#include <stdlib.h>

#include "ggml-backend.h"
#include "ggml-rpc.h"

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s PORT MEMORY BUILD\n", argv[0]);
        return 2;
    }
    char endpoint[64];
    snprintf(endpoint, sizeof endpoint, "127.0.0.1:%s", argv[1]);
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) {
        fprintf(stderr, "no CPU device\n");
        return 1;
    }
    ggml_backend_rpc_start_server_limited(endpoint, NULL, 1, 1, &cpu, strtoull(argv[2], NULL, 10), 0, argv[3]);
    return 1;  // only returns when it cannot listen or accept
}
