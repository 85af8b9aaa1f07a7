// The layout of the structs shared with Python (moeflash_stream.h), which streaming_ext/_lib.py
// compares with its ctypes structs when it loads the library, and the header's declarations as
// data (streaming_ext/declarations.py generates the Python side from them at `make ext`).
//
// Each struct's fields are listed once, in moeflash_stream.h (MF_CONFIG_FIELDS, MF_STATS_FIELDS,
// MF_ROUTE_RECORD_FIELDS). The static assertions make each
// list complete: the struct's size must equal the sum of its listed fields' sizes, so a struct
// with padding, a field added to the struct but not to its list, or one listed twice fails the
// build; a listed field the struct lacks fails offsetof. Python then only has to match the lists.
#include "moeflash_stream.h"

#include <stddef.h>
#include <string.h>

typedef struct mf_field {
    const char * name;
    size_t       offset;
} mf_field;

#define CONFIG_ENTRY(f, type, kind, value, text) { #f, offsetof(mf_config, f) },
#define STATS_ENTRY(f, kind, unit, text) { #f, offsetof(mf_stats, f) },
#define RECORD_ENTRY(f, type, text) { #f, offsetof(mf_route_record, f) },
#define CONFIG_BYTES(f, type, kind, value, text) +sizeof(((mf_config *) 0)->f)
#define STATS_BYTES(f, kind, unit, text) +sizeof(((mf_stats *) 0)->f)
#define RECORD_BYTES(f, type, text) +sizeof(((mf_route_record *) 0)->f)

static const mf_field config_fields[] = { MF_CONFIG_FIELDS(CONFIG_ENTRY) };
static const mf_field stats_fields[]  = { MF_STATS_FIELDS(STATS_ENTRY) };
static const mf_field record_fields[] = { MF_ROUTE_RECORD_FIELDS(RECORD_ENTRY) };

_Static_assert(sizeof(mf_config) == 0 MF_CONFIG_FIELDS(CONFIG_BYTES),
               "mf_config has padding, or a field missing from MF_CONFIG_FIELDS");
_Static_assert(sizeof(mf_stats) == 0 MF_STATS_FIELDS(STATS_BYTES),
               "mf_stats has padding, or a field missing from MF_STATS_FIELDS");
_Static_assert(sizeof(mf_route_record) == 0 MF_ROUTE_RECORD_FIELDS(RECORD_BYTES),
               "mf_route_record has padding, or a field missing from MF_ROUTE_RECORD_FIELDS");

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

// ---------------------------------------------------------------------------------------------
// The declarations as data (streaming_ext/declarations.py reads them at build time and _lib.py
// checks them at load). Each table's getters answer its i-th row's column, or `none` past its end

#define ROW_GETTER(ret, fn, table, column, none)                   \
    ret fn(int32_t i) {                                            \
        return i >= 0 && i < N_OF(table) ? table[i].column : none; \
    }

typedef struct mf_config_info {
    const char * name;
    const char * type;
    const char * kind;
    double       value;
    const char * text;
} mf_config_info;

#define CONFIG_INFO(f, type, kind, value, text) { #f, #type, #kind, (double) (value), text },
static const mf_config_info config_info[] = { MF_CONFIG_FIELDS(CONFIG_INFO) };

ROW_GETTER(const char *, mf_config_field_name, config_info, name, NULL)
ROW_GETTER(const char *, mf_config_field_type, config_info, type, NULL)
ROW_GETTER(const char *, mf_config_field_kind, config_info, kind, NULL)
ROW_GETTER(double, mf_config_field_default, config_info, value, 0.0)
ROW_GETTER(const char *, mf_config_field_text, config_info, text, NULL)

typedef struct mf_stat_info {
    const char * name;
    const char * kind;
    const char * unit;
    const char * text;
} mf_stat_info;

#define STATS_INFO(f, kind, unit, text) { #f, #kind, #unit, text },
static const mf_stat_info stats_info[] = { MF_STATS_FIELDS(STATS_INFO) };

ROW_GETTER(const char *, mf_stats_field_name, stats_info, name, NULL)
ROW_GETTER(const char *, mf_stats_field_kind, stats_info, kind, NULL)
ROW_GETTER(const char *, mf_stats_field_unit, stats_info, unit, NULL)
ROW_GETTER(const char *, mf_stats_field_text, stats_info, text, NULL)

typedef struct mf_record_info {
    const char * name;
    const char * type;
    const char * text;
} mf_record_info;

#define RECORD_INFO(f, type, text) { #f, #type, text },
static const mf_record_info record_info[] = { MF_ROUTE_RECORD_FIELDS(RECORD_INFO) };

ROW_GETTER(const char *, mf_route_record_field_name, record_info, name, NULL)
ROW_GETTER(const char *, mf_route_record_field_type, record_info, type, NULL)
ROW_GETTER(const char *, mf_route_record_field_text, record_info, text, NULL)

typedef struct mf_enum_info {
    const char * name;
    int32_t      value;
    const char * text;
} mf_enum_info;

#define ENUM_INFO(name, value, text) { #name, value, text },
static const mf_enum_info policy_members[]     = { MF_POLICY_MEMBERS(ENUM_INFO) };
static const mf_enum_info prefetch_members[]   = { MF_PREFETCH_MEMBERS(ENUM_INFO) };
static const mf_enum_info reader_members[]     = { MF_READER_MEMBERS(ENUM_INFO) };
static const mf_enum_info rate_class_members[] = { MF_RATE_CLASS_MEMBERS(ENUM_INFO) };

static const mf_enum_info * enum_member(const char * enum_name, int32_t i) {
    static const struct {
        const char *         name;
        const mf_enum_info * members;
        int32_t              n;
    } enums[] = {
        { "policy",     policy_members,     N_OF(policy_members)     },
        { "prefetch",   prefetch_members,   N_OF(prefetch_members)   },
        { "reader",     reader_members,     N_OF(reader_members)     },
        { "rate_class", rate_class_members, N_OF(rate_class_members) },
    };
    for (int32_t e = 0; enum_name && e < N_OF(enums); e++) {
        if (strcmp(enums[e].name, enum_name) == 0) {
            return i >= 0 && i < enums[e].n ? &enums[e].members[i] : NULL;
        }
    }
    return NULL;
}

const char * mf_enum_member_name(const char * enum_name, int32_t i) {
    const mf_enum_info * m = enum_member(enum_name, i);
    return m ? m->name : NULL;
}

int32_t mf_enum_member_value(const char * enum_name, int32_t i) {
    const mf_enum_info * m = enum_member(enum_name, i);
    return m ? m->value : -1;
}

const char * mf_enum_member_text(const char * enum_name, int32_t i) {
    const mf_enum_info * m = enum_member(enum_name, i);
    return m ? m->text : NULL;
}

// The functions, one row each from the list moeflash_stream.h declares them by: the parameters as
// written there (a parenthesised list), which declarations.py maps to ctypes
typedef struct mf_function_info {
    const char * name;
    const char * returns;
    const char * params;
} mf_function_info;

#define MF_FUNCTION(ret, name, params) { #name, #ret, #params },
static const mf_function_info functions[] = {
#include "moeflash_stream_functions.h"
};
#undef MF_FUNCTION

int32_t mf_api_n_functions(void) {
    return N_OF(functions);
}

ROW_GETTER(const char *, mf_api_function_name, functions, name, NULL)
ROW_GETTER(const char *, mf_api_function_returns, functions, returns, NULL)
ROW_GETTER(const char *, mf_api_function_params, functions, params, NULL)
