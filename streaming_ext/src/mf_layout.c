// The layout of the structs shared with Python (moeflash_stream.h), which streaming_ext/_lib.py
// compares with its ctypes declarations when it loads the library.
//
// Each struct's fields are listed once, below. The static assertions make each list complete:
// the struct's size must equal the sum of its listed fields' sizes, so a struct with padding, a
// field added to the struct but not to its list, or one listed twice fails the build; a listed
// field the struct lacks fails offsetof. Python then only has to match the lists.
#include "moeflash_stream.h"

#include <stddef.h>
#include <string.h>

#define CONFIG_FIELDS(X)                                                                                      \
    X(model_path) X(n_lanes) X(reader) X(overlap) X(policy) X(prefetch) X(fault_errno) X(fault_after_bytes) \
        X(skip_expert) X(reserved)

#define STATS_FIELDS(X)                                                                                         \
    X(routes) X(hits) X(misses) X(evictions) X(bytes_read) X(reads) X(flash_wait_ns) X(cache_ns) X(read_ns)   \
        X(dense_bytes) X(resident_bytes) X(violations) X(errors) X(direct_io) X(prefetched) X(prefetch_hits) \
            X(mapped_bytes) X(hold_all) X(routing_off) X(expert_memory_bytes) X(frames_released) X(budget_bytes) \
                X(restored)

#define ROUTE_RECORD_FIELDS(X) X(turn) X(phase) X(step) X(layer) X(slot) X(expert) X(weight)

typedef struct mf_field {
    const char * name;
    size_t       offset;
} mf_field;

#define CONFIG_ENTRY(f) { #f, offsetof(mf_config, f) },
#define STATS_ENTRY(f)  { #f, offsetof(mf_stats, f) },
#define RECORD_ENTRY(f) { #f, offsetof(mf_route_record, f) },
#define CONFIG_BYTES(f) +sizeof(((mf_config *) 0)->f)
#define STATS_BYTES(f)  +sizeof(((mf_stats *) 0)->f)
#define RECORD_BYTES(f) +sizeof(((mf_route_record *) 0)->f)

static const mf_field config_fields[] = { CONFIG_FIELDS(CONFIG_ENTRY) };
static const mf_field stats_fields[]  = { STATS_FIELDS(STATS_ENTRY) };
static const mf_field record_fields[] = { ROUTE_RECORD_FIELDS(RECORD_ENTRY) };

_Static_assert(sizeof(mf_config) == 0 CONFIG_FIELDS(CONFIG_BYTES),
               "mf_config has padding, or a field missing from CONFIG_FIELDS");
_Static_assert(sizeof(mf_stats) == 0 STATS_FIELDS(STATS_BYTES),
               "mf_stats has padding, or a field missing from STATS_FIELDS");
_Static_assert(sizeof(mf_route_record) == 0 ROUTE_RECORD_FIELDS(RECORD_BYTES),
               "mf_route_record has padding, or a field missing from ROUTE_RECORD_FIELDS");

#define N_OF(a) ((int32_t) (sizeof(a) / sizeof((a)[0])))

static int64_t offset_of(const mf_field * fields, int32_t n, const char * name) {
    for (int32_t i = 0; name && i < n; i++) {
        if (strcmp(fields[i].name, name) == 0) {
            return (int64_t) fields[i].offset;
        }
    }
    return -1;
}

size_t mf_config_size(void) {
    return sizeof(mf_config);
}

size_t mf_stats_size(void) {
    return sizeof(mf_stats);
}

int32_t mf_config_n_fields(void) {
    return N_OF(config_fields);
}

int32_t mf_stats_n_fields(void) {
    return N_OF(stats_fields);
}

int64_t mf_config_offset(const char * field) {
    return offset_of(config_fields, N_OF(config_fields), field);
}

int64_t mf_stats_offset(const char * field) {
    return offset_of(stats_fields, N_OF(stats_fields), field);
}

size_t mf_route_record_size(void) {
    return sizeof(mf_route_record);
}

int32_t mf_route_record_n_fields(void) {
    return N_OF(record_fields);
}

int64_t mf_route_record_offset(const char * field) {
    return offset_of(record_fields, N_OF(record_fields), field);
}
