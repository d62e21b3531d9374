/*
 * The native run path: the guest call and the host functions every run uses, in C.
 *
 * Built by wasibox/backends/wasm/native/__init__.py against the Wasmtime C library that
 * wasmtime-py ships (linked by path; it has no SONAME). The C API's headers are not in the
 * wheel, so the few declarations used are written out below, copied from Wasmtime 50's
 * crates/c-api/include (wasmtime-py's _bindings.py declares the same signatures).
 *
 * What runs here, with the GIL released for the whole guest call:
 *   wasibox:sandbox/{runner,stdio,clock,process,entropy}, wasi:clocks/{monotonic,wall}-clock
 *   and wasi:random/random, plus the epoch-deadline callback (timeout and cancellation).
 * And the epoch ticker (Ticker), a thread that never takes the GIL.
 * Everything else (files, host functions, mediated HTTP) stays in Python, defined on the same
 * linker by wasibox/backends/wasm/host.py; ctypes takes the GIL when Wasmtime calls those.
 *
 * Every host function must behave exactly as its Python twin in host.py (same output, same
 * fuel, same faults), since tests compare the two paths run for run. The guest controls every
 * argument: lengths are checked against the run's limits before anything is allocated, and
 * output never grows past the run's output cap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <marshal.h>
#include <structmember.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

/* ---- the subset of Wasmtime's C API used here (Wasmtime 50) ------------------------------ */

typedef struct wasm_byte_vec_t {
    size_t size;
    char *data;
} wasm_byte_vec_t;
typedef wasm_byte_vec_t wasm_name_t;

typedef struct wasmtime_error wasmtime_error_t;
typedef struct wasmtime_context wasmtime_context_t;
typedef struct wasmtime_store wasmtime_store_t;
typedef struct wasmtime_component_linker wasmtime_component_linker_t;
typedef struct wasmtime_component_linker_instance wasmtime_component_linker_instance_t;
typedef struct wasmtime_component_func_type wasmtime_component_func_type_t;
typedef struct wasmtime_component_func wasmtime_component_func_t; /* opaque to us */

typedef uint8_t wasmtime_component_valkind_t;
enum {
    VAL_U8 = 2,
    VAL_U32 = 6,
    VAL_U64 = 8,
    VAL_STRING = 12,
    VAL_LIST = 13,
    VAL_RECORD = 14,
};

struct wasmtime_component_val;
typedef struct {
    size_t size;
    struct wasmtime_component_val *data;
} wasmtime_component_vallist_t;
struct wasmtime_component_valrecord_entry;
typedef struct {
    size_t size;
    struct wasmtime_component_valrecord_entry *data;
} wasmtime_component_valrecord_t;

typedef struct wasmtime_component_val {
    wasmtime_component_valkind_t kind;
    union {
        uint8_t u8;
        uint32_t u32;
        uint64_t u64;
        wasm_name_t string;
        wasmtime_component_vallist_t list;
        wasmtime_component_valrecord_t record;
        unsigned char size_of_the_union[24];
    } of;
} wasmtime_component_val_t;

typedef struct wasmtime_component_valrecord_entry {
    wasm_name_t name;
    wasmtime_component_val_t val;
} wasmtime_component_valrecord_entry_t;

_Static_assert(sizeof(wasmtime_component_val_t) == 32, "component val layout");
_Static_assert(sizeof(wasmtime_component_valrecord_entry_t) == 48, "record entry layout");

typedef wasmtime_error_t *(*wasmtime_component_func_callback_t)(
    void *env, wasmtime_context_t *context, const wasmtime_component_func_type_t *type,
    wasmtime_component_val_t *args, size_t nargs, wasmtime_component_val_t *results,
    size_t nresults);

typedef uint8_t wasmtime_update_deadline_kind_t;
#define WASMTIME_UPDATE_DEADLINE_CONTINUE 0

typedef struct wasm_engine_t wasm_engine_t;
extern void wasmtime_engine_increment_epoch(wasm_engine_t *engine);
extern void wasm_byte_vec_new(wasm_byte_vec_t *out, size_t size, const char *data);
extern void wasm_byte_vec_new_uninitialized(wasm_byte_vec_t *out, size_t size);
extern void wasm_byte_vec_delete(wasm_byte_vec_t *vec);
extern wasmtime_error_t *wasmtime_error_new(const char *message);
extern void wasmtime_error_delete(wasmtime_error_t *error);
extern void wasmtime_error_message(const wasmtime_error_t *error, wasm_name_t *message);
extern bool wasmtime_error_exit_status(const wasmtime_error_t *error, int *status);
extern wasmtime_error_t *wasmtime_context_set_fuel(wasmtime_context_t *context, uint64_t fuel);
extern wasmtime_error_t *wasmtime_context_get_fuel(const wasmtime_context_t *context,
                                                   uint64_t *fuel);
extern void wasmtime_context_set_epoch_deadline(wasmtime_context_t *context,
                                                uint64_t ticks_beyond_current);
extern void wasmtime_store_limiter(wasmtime_store_t *store, int64_t memory_size,
                                   int64_t table_elements, int64_t instances, int64_t tables,
                                   int64_t memories);
extern void wasmtime_store_epoch_deadline_callback(
    wasmtime_store_t *store,
    wasmtime_error_t *(*callback)(wasmtime_context_t *, void *, uint64_t *,
                                  wasmtime_update_deadline_kind_t *),
    void *data, void (*finalizer)(void *));
extern wasmtime_component_linker_instance_t *wasmtime_component_linker_root(
    wasmtime_component_linker_t *linker);
extern wasmtime_error_t *wasmtime_component_linker_instance_add_instance(
    wasmtime_component_linker_instance_t *instance, const char *name, size_t name_len,
    wasmtime_component_linker_instance_t **out);
extern wasmtime_error_t *wasmtime_component_linker_instance_add_func(
    wasmtime_component_linker_instance_t *instance, const char *name, size_t name_len,
    wasmtime_component_func_callback_t callback, void *data, void (*finalizer)(void *));
extern void wasmtime_component_linker_instance_delete(
    wasmtime_component_linker_instance_t *instance);
extern wasmtime_error_t *wasmtime_component_func_call(
    const wasmtime_component_func_t *func, wasmtime_context_t *context,
    const wasmtime_component_val_t *args, size_t nargs, wasmtime_component_val_t *results,
    size_t nresults);
extern wasmtime_error_t *wasmtime_component_func_post_return(
    const wasmtime_component_func_t *func, wasmtime_context_t *context);
extern void wasmtime_component_val_delete(wasmtime_component_val_t *value);
extern void wasmtime_component_valrecord_new_uninit(wasmtime_component_valrecord_t *out,
                                                    size_t size);
extern void wasmtime_component_vallist_new_uninit(wasmtime_component_vallist_t *out,
                                                  size_t size);

/* ---- per-run state ----------------------------------------------------------------------- */

/* Why a run stopped; the values are wasibox.Limit's, mapped back in run.py. */
enum limit { LIMIT_NONE = 0, LIMIT_OUTPUT, LIMIT_TIMEOUT, LIMIT_CANCELLED, LIMIT_MEMORY };
static const char *const LIMIT_NAMES[] = {"", "output", "timeout", "cancelled", "memory"};

#define VIRTUAL_EPOCH_NS (1704067200ULL * 1000000000ULL)
#define MAX_ENTROPY_CALL_BYTES (1u << 20)
#define MT_N 624
#define MT_M 397

typedef struct {
    PyObject_HEAD
    /* limits and policy, fixed when the run is made */
    uint64_t fuel_limit;
    uint64_t output_room;
    uint64_t memory_bytes;
    uint64_t timeout_ns;
    bool real_clock;
    bool seeded;
    /* the deadline on CLOCK_MONOTONIC; set by `call` */
    uint64_t deadline_ns;
    /* the store's fuel when a `call` given its store returned (0 if it could not be read) */
    uint64_t fuel_left;
    /* state the guest's calls change */
    /* Output: written by the guest thread (stdio.write) and by Wasmtime's WASI workers
     * (the guest's C-level writes, through `append`), so guarded by output_lock. */
    pthread_mutex_t output_lock;
    char *stdout_buf, *stderr_buf;
    size_t stdout_len, stderr_len, stdout_capacity, stderr_capacity;
    bool stdout_truncated, stderr_truncated;
    bool started;
    int limit;
    int exit_code; /* -1: none */
    const char *fault_type; /* static strings; NULL: none */
    const char *fault_message;
    uint64_t slept_ns;
    atomic_int cancelled;
    /* CPython's Mersenne Twister, for seeded entropy identical to random.Random(seed) */
    uint32_t mt[MT_N];
    int mti;
} Run;

static _Thread_local Run *current_run = NULL;

static uint64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* -- Mersenne Twister, as CPython's Modules/_randommodule.c -- */

static void mt_init_genrand(Run *run, uint32_t s) {
    run->mt[0] = s;
    for (int i = 1; i < MT_N; i++) {
        run->mt[i] = 1812433253U * (run->mt[i - 1] ^ (run->mt[i - 1] >> 30)) + (uint32_t)i;
    }
    run->mti = MT_N;
}

static void mt_init_by_array(Run *run, const uint32_t *key, size_t key_length) {
    size_t i = 1, j = 0, k;
    mt_init_genrand(run, 19650218U);
    for (k = (MT_N > key_length ? MT_N : key_length); k; k--) {
        run->mt[i] = (run->mt[i] ^ ((run->mt[i - 1] ^ (run->mt[i - 1] >> 30)) * 1664525U))
                     + key[j] + (uint32_t)j;
        i++;
        j++;
        if (i >= MT_N) {
            run->mt[0] = run->mt[MT_N - 1];
            i = 1;
        }
        if (j >= key_length) j = 0;
    }
    for (k = MT_N - 1; k; k--) {
        run->mt[i] = (run->mt[i] ^ ((run->mt[i - 1] ^ (run->mt[i - 1] >> 30)) * 1566083941U))
                     - (uint32_t)i;
        i++;
        if (i >= MT_N) {
            run->mt[0] = run->mt[MT_N - 1];
            i = 1;
        }
    }
    run->mt[0] = 0x80000000U;
}

/* The generator's state right after seeding with the last key seen. Seeding costs as much
 * as the rest of making a Run, and nearly every run of a process uses the same seed, so the
 * state is copied from here when the key matches. Only Run_new touches it, with the GIL
 * held. Owns `key` (a PyMem buffer of `key_length` words). */
static struct {
    uint32_t *key;
    size_t key_length;
    uint32_t mt[MT_N];
} seeded_state = {NULL, 0, {0}};

static void seed_generator(Run *run, uint32_t *key, size_t key_length) {
    if (seeded_state.key != NULL && seeded_state.key_length == key_length
        && memcmp(seeded_state.key, key, key_length * sizeof *key) == 0) {
        memcpy(run->mt, seeded_state.mt, sizeof run->mt);
        run->mti = MT_N;
        PyMem_Free(key);
        return;
    }
    mt_init_by_array(run, key, key_length);
    PyMem_Free(seeded_state.key);
    seeded_state.key = key;
    seeded_state.key_length = key_length;
    memcpy(seeded_state.mt, run->mt, sizeof run->mt);
}

static uint32_t mt_next(Run *run) {
    static const uint32_t mag01[2] = {0x0U, 0x9908b0dfU};
    uint32_t y;
    if (run->mti >= MT_N) {
        int kk;
        for (kk = 0; kk < MT_N - MT_M; kk++) {
            y = (run->mt[kk] & 0x80000000U) | (run->mt[kk + 1] & 0x7fffffffU);
            run->mt[kk] = run->mt[kk + MT_M] ^ (y >> 1) ^ mag01[y & 0x1U];
        }
        for (; kk < MT_N - 1; kk++) {
            y = (run->mt[kk] & 0x80000000U) | (run->mt[kk + 1] & 0x7fffffffU);
            run->mt[kk] = run->mt[kk + (MT_M - MT_N)] ^ (y >> 1) ^ mag01[y & 0x1U];
        }
        y = (run->mt[MT_N - 1] & 0x80000000U) | (run->mt[0] & 0x7fffffffU);
        run->mt[MT_N - 1] = run->mt[MT_M - 1] ^ (y >> 1) ^ mag01[y & 0x1U];
        run->mti = 0;
    }
    y = run->mt[run->mti++];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= (y >> 18);
    return y;
}

/* random.Random.randbytes(size): getrandbits(size * 8).to_bytes(size, "little"). */
static void mt_bytes(Run *run, unsigned char *out, size_t size) {
    size_t done = 0;
    while (done < size) {
        uint32_t word = mt_next(run);
        size_t take = size - done < 4 ? size - done : 4;
        if (take < 4) word >>= 32 - 8 * take; /* getrandbits keeps the high bits */
        for (size_t b = 0; b < take; b++) out[done + b] = (unsigned char)(word >> (8 * b));
        done += take;
    }
}

static int real_bytes(unsigned char *out, size_t size) {
    size_t done = 0;
    while (done < size) {
        ssize_t got = getrandom(out + done, size - done, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        done += (size_t)got;
    }
    return 0;
}

/* ---- stopping a run ---------------------------------------------------------------------- */

static wasmtime_error_t *stop(Run *run, int limit) {
    char message[64];
    if (run->limit == LIMIT_NONE) run->limit = limit;
    snprintf(message, sizeof message, "wasibox: %s limit exceeded", LIMIT_NAMES[limit]);
    return wasmtime_error_new(message);
}

static wasmtime_error_t *fault(Run *run, const char *type, const char *message,
                               const char *trap) {
    if (run->fault_type == NULL) {
        run->fault_type = type;
        run->fault_message = message;
    }
    return wasmtime_error_new(trap);
}

static wasmtime_error_t *host_failed(Run *run, const char *exception) {
    /* The Python path's _host wrapper reports any unexpected exception this way. */
    return fault(run, "HostError", exception, "wasibox: host function failed");
}

/* ---- time -------------------------------------------------------------------------------- */

static uint64_t fuel_used(Run *run, wasmtime_context_t *context) {
    uint64_t remaining = 0;
    wasmtime_error_t *error = wasmtime_context_get_fuel(context, &remaining);
    if (error != NULL) {
        wasmtime_error_delete(error);
        return run->fuel_limit;
    }
    return run->fuel_limit - remaining;
}

static uint64_t virtual_ns(Run *run, wasmtime_context_t *context) {
    return fuel_used(run, context) + run->slept_ns;
}

/* Sleep on the real clock in short slices, so a cancel is seen within one slice. */
static bool sleep_cancellable(Run *run, uint64_t ns) {
    uint64_t end = now_ns(CLOCK_MONOTONIC) + ns;
    for (;;) {
        if (atomic_load(&run->cancelled)) return true;
        uint64_t now = now_ns(CLOCK_MONOTONIC);
        if (now >= end) return false;
        uint64_t slice = end - now < 10000000ULL ? end - now : 10000000ULL;
        struct timespec ts = {(time_t)(slice / 1000000000ULL), (long)(slice % 1000000000ULL)};
        nanosleep(&ts, NULL);
    }
}

static wasmtime_error_t *wait_ns(Run *run, wasmtime_context_t *context, uint64_t ns) {
    if (run->real_clock) {
        uint64_t now = now_ns(CLOCK_MONOTONIC);
        uint64_t remaining = run->deadline_ns > now ? run->deadline_ns - now : 0;
        if (ns >= remaining) {
            sleep_cancellable(run, remaining);
            return stop(run, atomic_load(&run->cancelled) ? LIMIT_CANCELLED : LIMIT_TIMEOUT);
        }
        if (sleep_cancellable(run, ns)) return stop(run, LIMIT_CANCELLED);
        return NULL;
    }
    run->slept_ns = ns > UINT64_MAX - run->slept_ns ? UINT64_MAX : run->slept_ns + ns;
    if (virtual_ns(run, context) > run->timeout_ns) return stop(run, LIMIT_TIMEOUT);
    return NULL;
}

static bool would_block_past_deadline(Run *run, wasmtime_context_t *context, uint64_t ns) {
    if (run->real_clock) {
        uint64_t now = now_ns(CLOCK_MONOTONIC);
        return ns >= (run->deadline_ns > now ? run->deadline_ns - now : 0);
    }
    uint64_t now = virtual_ns(run, context);
    return ns > UINT64_MAX - now || now + ns > run->timeout_ns;
}

/* ---- the host functions ------------------------------------------------------------------ */

/* A host function's signature (wasmtime_component_func_callback_t). */
#define HOST_FUNC(name)                                                                   \
    static wasmtime_error_t *name(void *env, wasmtime_context_t *context,                 \
                                  const wasmtime_component_func_type_t *type,             \
                                  wasmtime_component_val_t *args, size_t nargs,           \
                                  wasmtime_component_val_t *results, size_t nresults)

/* Every host function starts here: no run, or a cancelled one, traps at once. */
#define ENTER(run)                                                                        \
    Run *run = current_run;                                                               \
    if (run == NULL) return wasmtime_error_new("wasibox: host function called outside a run"); \
    if (atomic_load(&run->cancelled)) return stop(run, LIMIT_CANCELLED);

#define EXPECT(count, kind0)                                                              \
    if (nargs != (count) || ((count) > 0 && args[0].kind != (kind0)))                     \
        return host_failed(run, "host function failed: TypeError");

HOST_FUNC(host_start) {
    ENTER(run)
    EXPECT(0, 0)
    if (run->started) return NULL;
    run->started = true;
    wasmtime_error_t *error = wasmtime_context_set_fuel(context, run->fuel_limit);
    if (error != NULL) {
        wasmtime_error_delete(error);
        return wasmtime_error_new("wasibox: could not reset the guest's fuel");
    }
    return NULL;
}

/* Grow a buffer to hold `needed` bytes, doubling, never past `limit` (the output cap). */
static bool reserve(char **buffer, size_t *capacity, size_t needed, size_t limit) {
    if (needed <= *capacity) return true;
    size_t grown = *capacity * 2 > needed ? *capacity * 2 : needed;
    if (grown > limit) grown = needed; /* needed never exceeds the cap: see callers */
    char *moved = realloc(*buffer, grown);
    if (moved == NULL) return false;
    *buffer = moved;
    *capacity = grown;
    return true;
}

/* Append to stdout or stderr under the shared output cap; false once it is exceeded.
 * `data` holds `size` bytes, or (with `latin1`) UTF-8 text of code points below 256 that
 * decodes to `size` bytes: only what fits under the cap is decoded. */
static bool append_output(Run *run, int fd, const unsigned char *data, size_t size,
                          bool latin1) {
    pthread_mutex_lock(&run->output_lock);
    bool stderr_ = fd == 2;
    char **buffer = stderr_ ? &run->stderr_buf : &run->stdout_buf;
    size_t *length = stderr_ ? &run->stderr_len : &run->stdout_len;
    size_t *capacity = stderr_ ? &run->stderr_capacity : &run->stdout_capacity;
    size_t keep = size <= run->output_room ? size : (size_t)run->output_room;
    bool fits = keep == size;
    /* The whole run's output is at most the cap, so this stream's buffer is too. */
    if (keep > 0 && !reserve(buffer, capacity, *length + keep, *length + run->output_room)) {
        keep = 0; /* the host is out of memory: keep nothing more, as past the cap */
        fits = false;
    }
    if (keep > 0) {
        unsigned char *out = (unsigned char *)*buffer + *length;
        if (latin1) {
            for (size_t i = 0, at = 0; at < keep; at++) {
                unsigned char lead = data[i];
                out[at] = lead < 0x80 ? lead : (unsigned char)(((lead & 0x1F) << 6)
                                                               | (data[i + 1] & 0x3F));
                i += lead < 0x80 ? 1 : 2;
            }
        } else {
            memcpy(out, data, keep);
        }
        *length += keep;
        run->output_room -= keep;
    }
    if (!fits) {
        if (stderr_) run->stderr_truncated = true;
        else run->stdout_truncated = true;
        if (run->limit == LIMIT_NONE) run->limit = LIMIT_OUTPUT;
    }
    pthread_mutex_unlock(&run->output_lock);
    return fits;
}

/* How many latin-1 bytes the UTF-8 `text` decodes to, or -1 if it has a code point >= 256
 * (where str.encode("latin-1") raises in the Python path, whatever fits under the cap).
 * Wasmtime has already checked that the text is valid UTF-8. */
static int64_t latin1_length(const unsigned char *text, size_t size) {
    int64_t count = 0;
    for (size_t i = 0; i < size; count++) {
        unsigned char lead = text[i];
        if (lead < 0x80) i += 1;
        else if ((lead == 0xC2 || lead == 0xC3) && i + 1 < size) i += 2;
        else return -1;
    }
    return count;
}

HOST_FUNC(host_write) {
    ENTER(run)
    if (nargs != 2 || args[0].kind != VAL_U8 || args[1].kind != VAL_STRING)
        return host_failed(run, "host function failed: TypeError");
    const unsigned char *text = (const unsigned char *)args[1].of.string.data;
    int64_t count = latin1_length(text, args[1].of.string.size);
    if (count < 0) return host_failed(run, "host function failed: UnicodeEncodeError");
    if (run->limit != LIMIT_NONE || !append_output(run, args[0].of.u8, text, (size_t)count, true))
        return stop(run, LIMIT_OUTPUT);
    return NULL;
}

HOST_FUNC(host_sleep) {
    ENTER(run)
    EXPECT(1, VAL_U64)
    return wait_ns(run, context, args[0].of.u64);
}

HOST_FUNC(host_exit) {
    ENTER(run)
    EXPECT(1, VAL_U8)
    char message[64];
    run->exit_code = args[0].of.u8;
    snprintf(message, sizeof message, "wasibox: the guest exited with status %d",
             run->exit_code);
    return wasmtime_error_new(message);
}

/* The checks of Run.random_bytes, then the bytes (seeded or real) into `out`. */
static wasmtime_error_t *entropy(Run *run, uint64_t size, unsigned char **out) {
    *out = NULL;
    if (size > run->memory_bytes) return stop(run, LIMIT_MEMORY);
    if (size > MAX_ENTROPY_CALL_BYTES)
        return fault(run, "OSError", "an entropy request is limited to 1048576 bytes",
                     "wasibox: oversized entropy request refused");
    unsigned char *bytes = malloc(size > 0 ? size : 1);
    if (bytes == NULL) return host_failed(run, "host function failed: MemoryError");
    if (run->seeded) mt_bytes(run, bytes, size);
    else if (real_bytes(bytes, size) != 0) {
        free(bytes);
        return host_failed(run, "host function failed: OSError");
    }
    *out = bytes;
    return NULL;
}

HOST_FUNC(host_entropy) {
    ENTER(run)
    EXPECT(1, VAL_U32)
    if (nresults != 1) return host_failed(run, "host function failed: TypeError");
    unsigned char *bytes;
    uint64_t size = args[0].of.u32;
    wasmtime_error_t *error = entropy(run, size, &bytes);
    if (error != NULL) return error;
    /* As a string of code points below 256: UTF-8, at most two bytes each. */
    size_t length = 0;
    for (uint64_t i = 0; i < size; i++) length += bytes[i] < 0x80 ? 1 : 2;
    results[0].kind = VAL_STRING;
    wasm_byte_vec_new_uninitialized(&results[0].of.string, length);
    unsigned char *text = (unsigned char *)results[0].of.string.data;
    size_t at = 0;
    for (uint64_t i = 0; i < size; i++) {
        if (bytes[i] < 0x80) {
            text[at++] = bytes[i];
        } else {
            text[at++] = (unsigned char)(0xC0 | (bytes[i] >> 6));
            text[at++] = (unsigned char)(0x80 | (bytes[i] & 0x3F));
        }
    }
    free(bytes);
    return NULL;
}

HOST_FUNC(host_random_bytes) {
    ENTER(run)
    EXPECT(1, VAL_U64)
    if (nresults != 1) return host_failed(run, "host function failed: TypeError");
    unsigned char *bytes;
    uint64_t size = args[0].of.u64;
    wasmtime_error_t *error = entropy(run, size, &bytes);
    if (error != NULL) return error;
    results[0].kind = VAL_LIST;
    wasmtime_component_vallist_new_uninit(&results[0].of.list, size);
    for (uint64_t i = 0; i < size; i++) {
        results[0].of.list.data[i].kind = VAL_U8;
        results[0].of.list.data[i].of.u8 = bytes[i];
    }
    free(bytes);
    return NULL;
}

HOST_FUNC(host_random_u64) {
    ENTER(run)
    EXPECT(0, 0)
    if (nresults != 1) return host_failed(run, "host function failed: TypeError");
    uint64_t value;
    if (run->seeded) {
        uint64_t low = mt_next(run);
        value = low | ((uint64_t)mt_next(run) << 32);
    } else if (real_bytes((unsigned char *)&value, sizeof value) != 0) {
        return host_failed(run, "host function failed: OSError");
    }
    results[0].kind = VAL_U64;
    results[0].of.u64 = value;
    return NULL;
}

static wasmtime_error_t *result_u64(Run *run, wasmtime_component_val_t *results,
                                    size_t nresults, uint64_t value) {
    if (nresults != 1) return host_failed(run, "host function failed: TypeError");
    results[0].kind = VAL_U64;
    results[0].of.u64 = value;
    return NULL;
}

HOST_FUNC(host_monotonic_now) {
    ENTER(run)
    uint64_t now = run->real_clock ? now_ns(CLOCK_MONOTONIC) : virtual_ns(run, context);
    return result_u64(run, results, nresults, now);
}

HOST_FUNC(host_resolution) {
    ENTER(run)
    return result_u64(run, results, nresults, 1);
}

static wasmtime_error_t *subscribe(Run *run, wasmtime_context_t *context, uint64_t ns) {
    /* A WASI pollable would block inside the host, where epochs never tick: refused. */
    if (would_block_past_deadline(run, context, ns)) return stop(run, LIMIT_TIMEOUT);
    run->fault_type = "BlockingIOError";
    run->fault_message = "the guest tried to wait through WASI poll, which wasibox does not "
                         "allow; use time.sleep";
    return wasmtime_error_new("wasibox: blocking WASI poll refused");
}

HOST_FUNC(host_subscribe_duration) {
    ENTER(run)
    EXPECT(1, VAL_U64)
    return subscribe(run, context, args[0].of.u64);
}

HOST_FUNC(host_subscribe_instant) {
    ENTER(run)
    EXPECT(1, VAL_U64)
    uint64_t now = run->real_clock ? now_ns(CLOCK_MONOTONIC) : virtual_ns(run, context);
    uint64_t when = args[0].of.u64;
    return subscribe(run, context, when > now ? when - now : 0);
}

static wasmtime_error_t *datetime(wasmtime_component_val_t *results, size_t nresults,
                                  Run *run, uint64_t ns) {
    if (nresults != 1) return host_failed(run, "host function failed: TypeError");
    wasmtime_component_valrecord_t record;
    wasmtime_component_valrecord_new_uninit(&record, 2);
    wasm_byte_vec_new(&record.data[0].name, 7, "seconds");
    record.data[0].val.kind = VAL_U64;
    record.data[0].val.of.u64 = ns / 1000000000ULL;
    wasm_byte_vec_new(&record.data[1].name, 11, "nanoseconds");
    record.data[1].val.kind = VAL_U32;
    record.data[1].val.of.u32 = (uint32_t)(ns % 1000000000ULL);
    results[0].kind = VAL_RECORD;
    results[0].of.record = record;
    return NULL;
}

HOST_FUNC(host_wall_now) {
    ENTER(run)
    uint64_t now = run->real_clock ? now_ns(CLOCK_REALTIME)
                                   : VIRTUAL_EPOCH_NS + virtual_ns(run, context);
    return datetime(results, nresults, run, now);
}

HOST_FUNC(host_wall_resolution) {
    ENTER(run)
    return datetime(results, nresults, run, 1);
}

/* Called by Wasmtime at every epoch tick while a run's guest code runs (the deadline is
 * always one tick ahead): decide there whether the run goes on. */
static wasmtime_error_t *on_epoch_deadline(wasmtime_context_t *context, void *data,
                                           uint64_t *delta,
                                           wasmtime_update_deadline_kind_t *kind) {
    Run *run = current_run;
    if (run != NULL) {
        if (atomic_load(&run->cancelled)) return stop(run, LIMIT_CANCELLED);
        if (now_ns(CLOCK_MONOTONIC) >= run->deadline_ns) return stop(run, LIMIT_TIMEOUT);
    }
    *delta = 1;
    *kind = WASMTIME_UPDATE_DEADLINE_CONTINUE;
    return NULL;
}

/* ---- the Run type ------------------------------------------------------------------------ */

static PyTypeObject RunType;

static PyObject *Run_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"fuel", "output_bytes", "memory_bytes", "timeout_ns", "real_clock",
                            "seed_words", NULL};
    unsigned long long fuel, output_bytes, memory_bytes, timeout_ns;
    int real_clock;
    PyObject *seed_words; /* None for real entropy, else bytes: |seed| as 32-bit LE words */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKKpO", names, &fuel, &output_bytes,
                                     &memory_bytes, &timeout_ns, &real_clock, &seed_words))
        return NULL;
    if (seed_words != Py_None && (!PyBytes_Check(seed_words) || PyBytes_GET_SIZE(seed_words) == 0
                                  || PyBytes_GET_SIZE(seed_words) % 4 != 0)) {
        PyErr_SetString(PyExc_ValueError, "seed_words must be None or whole 32-bit words");
        return NULL;
    }
    Run *run = (Run *)type->tp_alloc(type, 0);
    if (run == NULL) return NULL;
    run->fuel_limit = fuel;
    run->output_room = output_bytes;
    run->memory_bytes = memory_bytes;
    run->timeout_ns = timeout_ns;
    run->real_clock = real_clock != 0;
    run->exit_code = -1;
    pthread_mutex_init(&run->output_lock, NULL);
    run->deadline_ns = UINT64_MAX;
    run->fuel_left = fuel; /* no call yet: nothing used */
    atomic_init(&run->cancelled, 0);
    if (seed_words != Py_None) {
        size_t count = (size_t)PyBytes_GET_SIZE(seed_words) / 4;
        const unsigned char *raw = (const unsigned char *)PyBytes_AS_STRING(seed_words);
        uint32_t *key = PyMem_Malloc(count * sizeof *key);
        if (key == NULL) {
            Py_DECREF(run);
            return PyErr_NoMemory();
        }
        for (size_t i = 0; i < count; i++)
            key[i] = (uint32_t)raw[4 * i] | (uint32_t)raw[4 * i + 1] << 8
                     | (uint32_t)raw[4 * i + 2] << 16 | (uint32_t)raw[4 * i + 3] << 24;
        seed_generator(run, key, count);
        run->seeded = true;
    }
    return (PyObject *)run;
}

static void Run_dealloc(Run *run) {
    pthread_mutex_destroy(&run->output_lock);
    free(run->stdout_buf);
    free(run->stderr_buf);
    Py_TYPE(run)->tp_free((PyObject *)run);
}

/* fresh() -> Run: a new Run with this one's limits, clock and generator state, copied
 * rather than parsed and seeded again. Meant for a template that never runs (a plain run's,
 * made once per Sandbox: see backend.py), whose state is still the one it was made with. */
static PyObject *Run_fresh(Run *template, PyObject *unused) {
    Run *run = (Run *)RunType.tp_alloc(&RunType, 0);
    if (run == NULL) return NULL;
    run->fuel_limit = template->fuel_limit;
    run->output_room = template->output_room;
    run->memory_bytes = template->memory_bytes;
    run->timeout_ns = template->timeout_ns;
    run->real_clock = template->real_clock;
    run->exit_code = -1;
    pthread_mutex_init(&run->output_lock, NULL);
    run->deadline_ns = UINT64_MAX;
    run->fuel_left = template->fuel_limit;
    atomic_init(&run->cancelled, 0);
    if (template->seeded) {
        memcpy(run->mt, template->mt, sizeof run->mt);
        run->mti = template->mti;
        run->seeded = true;
    }
    return (PyObject *)run;
}

static PyObject *Run_interrupt(Run *run, PyObject *unused) {
    atomic_store(&run->cancelled, 1);
    Py_RETURN_NONE;
}

/* Output written by the guest's C code through WASI (not sys.stdout), under the same cap. */
static PyObject *Run_append(Run *run, PyObject *args) {
    int fd;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "iy*", &fd, &data)) return NULL;
    bool fits = append_output(run, fd, data.buf, (size_t)data.len, false);
    PyBuffer_Release(&data);
    return PyBool_FromLong(fits);
}

/* Everything the run produced, once: (stdout, stderr, stdout_truncated, stderr_truncated,
 * limit name or None, (fault type, message) or None, exit code or None). */
static PyObject *Run_outcome(Run *run, PyObject *unused) {
    PyObject *limit = run->limit == LIMIT_NONE ? Py_NewRef(Py_None)
                                               : PyUnicode_FromString(LIMIT_NAMES[run->limit]);
    PyObject *fault_ = run->fault_type == NULL
                           ? Py_NewRef(Py_None)
                           : Py_BuildValue("(ss)", run->fault_type, run->fault_message);
    PyObject *exit_code = run->exit_code < 0 ? Py_NewRef(Py_None)
                                             : PyLong_FromLong(run->exit_code);
    if (limit == NULL || fault_ == NULL || exit_code == NULL) {
        Py_XDECREF(limit);
        Py_XDECREF(fault_);
        Py_XDECREF(exit_code);
        return NULL;
    }
    pthread_mutex_lock(&run->output_lock); /* a WASI worker may still be writing */
    PyObject *outcome = Py_BuildValue(
        "(y#y#OONNN)", run->stdout_buf ? run->stdout_buf : "", (Py_ssize_t)run->stdout_len,
        run->stderr_buf ? run->stderr_buf : "", (Py_ssize_t)run->stderr_len,
        run->stdout_truncated ? Py_True : Py_False, run->stderr_truncated ? Py_True : Py_False,
        limit, fault_, exit_code);
    pthread_mutex_unlock(&run->output_lock);
    return outcome;
}

static PyMethodDef Run_methods[] = {
    {"fresh", (PyCFunction)Run_fresh, METH_NOARGS,
     "fresh() -> Run: a new run with this never-run template's limits and state."},
    {"interrupt", (PyCFunction)Run_interrupt, METH_NOARGS,
     "Cancel the run from any thread; the guest traps within a tick."},
    {"append", (PyCFunction)Run_append, METH_VARARGS,
     "append(fd, data) -> bool: keep what fits under the output cap."},
    {"outcome", (PyCFunction)Run_outcome, METH_NOARGS,
     "(stdout, stderr, stdout_truncated, stderr_truncated, limit, fault, exit_code)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Run_members[] = {
    {"fuel_left", T_ULONGLONG, offsetof(Run, fuel_left), READONLY,
     "The store's fuel when the last call given the store returned."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "wasibox_native.Run",
    .tp_basicsize = sizeof(Run),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One run's host state on the native path.",
    .tp_new = Run_new,
    .tp_dealloc = (destructor)Run_dealloc,
    .tp_methods = Run_methods,
    .tp_members = Run_members,
};

/* ---- the epoch ticker -------------------------------------------------------------------- */

/* Ticker(engine, engine_address, tick_s, idle_s): advances the engine's epoch every tick_s
 * while runs are active (between __enter__ and __exit__) and for idle_s after the last one
 * ended, on a thread of its own that never takes the GIL; the next run after that starts
 * another. wasibox/backends/wasm/engine.py's Ticker does the same in Python (the Python run
 * path's): its thread took the GIL at every tick, which a paced run found held, or its
 * caches cold, ~10% of the time of a warm run on a 2-core machine.
 *
 * The engine (the wasmtime-py object) is held until the ticker is gone, and the epoch is
 * advanced with the ticker's lock held, so that freeing the ticker (which stops the thread
 * first) can never free the engine under a tick. */
static void *address(PyObject *value);

typedef struct {
    PyObject_HEAD
    PyObject *engine;
    wasm_engine_t *pointer;
    uint64_t tick_ns, idle_ns;
    pthread_mutex_t lock;
    pthread_cond_t ended;
    long active;
    uint64_t last_exit_ns;
    bool running, closing;
    pid_t owner; /* the process whose thread `running` means: none runs in a forked child */
} Ticker;

static void *ticker_loop(void *argument) {
    Ticker *ticker = argument;
    struct timespec tick = {(time_t)(ticker->tick_ns / 1000000000u),
                            (long)(ticker->tick_ns % 1000000000u)};
    for (;;) {
        nanosleep(&tick, NULL);
        pthread_mutex_lock(&ticker->lock);
        bool stop = ticker->closing;
        if (!stop) {
            wasmtime_engine_increment_epoch(ticker->pointer);
            stop = ticker->active == 0
                   && now_ns(CLOCK_MONOTONIC) - ticker->last_exit_ns > ticker->idle_ns;
        }
        if (stop) {
            ticker->running = false;
            pthread_cond_broadcast(&ticker->ended);
            pthread_mutex_unlock(&ticker->lock);
            return NULL;
        }
        pthread_mutex_unlock(&ticker->lock);
    }
}

static PyObject *Ticker_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *engine, *engine_address;
    double tick_s, idle_s;
    static char *names[] = {"engine", "engine_address", "tick_s", "idle_s", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOdd", names, &engine, &engine_address,
                                     &tick_s, &idle_s))
        return NULL;
    if (!(tick_s > 0 && tick_s < 60 && idle_s >= 0 && idle_s < 3600)) {
        PyErr_SetString(PyExc_ValueError, "tick_s must be in (0, 60) and idle_s in [0, 3600)");
        return NULL;
    }
    wasm_engine_t *pointer = address(engine_address);
    if (pointer == NULL) return NULL;
    Ticker *ticker = (Ticker *)type->tp_alloc(type, 0);
    if (ticker == NULL) return NULL;
    ticker->engine = Py_NewRef(engine);
    ticker->pointer = pointer;
    ticker->tick_ns = (uint64_t)(tick_s * 1e9);
    ticker->idle_ns = (uint64_t)(idle_s * 1e9);
    pthread_mutex_init(&ticker->lock, NULL);
    pthread_cond_init(&ticker->ended, NULL);
    ticker->owner = getpid();
    return (PyObject *)ticker;
}

static void Ticker_dealloc(Ticker *ticker) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&ticker->lock);
    ticker->closing = true;
    while (ticker->running && ticker->owner == getpid())
        pthread_cond_wait(&ticker->ended, &ticker->lock);
    pthread_mutex_unlock(&ticker->lock);
    Py_END_ALLOW_THREADS
    pthread_mutex_destroy(&ticker->lock);
    pthread_cond_destroy(&ticker->ended);
    Py_XDECREF(ticker->engine);
    Py_TYPE(ticker)->tp_free((PyObject *)ticker);
}

static PyObject *Ticker_enter(Ticker *ticker, PyObject *unused) {
    int failed = 0;
    if (ticker->owner != getpid()) {
        /* A forked child: its parent's thread is not here, and may have held the lock when
         * the process forked (as CPython re-makes its own locks in a child). */
        pthread_mutex_init(&ticker->lock, NULL);
        pthread_cond_init(&ticker->ended, NULL);
        ticker->owner = getpid();
        ticker->running = false;
    }
    pthread_mutex_lock(&ticker->lock);
    ticker->active += 1;
    if (!ticker->running) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        failed = pthread_create(&thread, &attr, ticker_loop, ticker);
        pthread_attr_destroy(&attr);
        if (failed == 0) {
            ticker->running = true;
            pthread_setname_np(thread, "wasibox-epoch");
        } else {
            ticker->active -= 1;
        }
    }
    pthread_mutex_unlock(&ticker->lock);
    if (failed != 0) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_RuntimeError);
    }
    Py_RETURN_NONE;
}

static PyObject *Ticker_exit(Ticker *ticker, PyObject *args) {
    pthread_mutex_lock(&ticker->lock);
    ticker->active -= 1;
    ticker->last_exit_ns = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_unlock(&ticker->lock);
    Py_RETURN_FALSE;
}

static PyObject *Ticker_running(Ticker *ticker, void *unused) {
    pthread_mutex_lock(&ticker->lock);
    bool running = ticker->running && ticker->owner == getpid();
    pthread_mutex_unlock(&ticker->lock);
    return PyBool_FromLong(running);
}

static PyMethodDef Ticker_methods[] = {
    {"__enter__", (PyCFunction)Ticker_enter, METH_NOARGS, "Count a run in; tick if idle."},
    {"__exit__", (PyCFunction)Ticker_exit, METH_VARARGS, "Count a run out."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ticker_getset[] = {
    {"running", (getter)Ticker_running, NULL, "Whether a thread is ticking now.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TickerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_wasibox_native.Ticker",
    .tp_basicsize = sizeof(Ticker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The engine's epoch ticker, on a thread that never takes the GIL.",
    .tp_new = Ticker_new,
    .tp_dealloc = (destructor)Ticker_dealloc,
    .tp_methods = Ticker_methods,
    .tp_getset = Ticker_getset,
};

/* ---- module functions -------------------------------------------------------------------- */

static void *address(PyObject *value) {
    void *pointer = PyLong_AsVoidPtr(value);
    if (pointer == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "a null pointer");
    return pointer;
}

static PyObject *error_result(wasmtime_error_t *error) {
    wasm_name_t message;
    int status = 0;
    bool exited = wasmtime_error_exit_status(error, &status);
    wasmtime_error_message(error, &message);
    wasmtime_error_delete(error);
    PyObject *text = PyUnicode_DecodeUTF8(message.data, (Py_ssize_t)message.size, "replace");
    wasm_byte_vec_delete(&message);
    if (text == NULL) return NULL;
    if (exited) return Py_BuildValue("(ONi)", Py_None, text, status);
    return Py_BuildValue("(ONO)", Py_None, text, Py_None);
}

/* call(func, context, request, run[, store]) -> (reply str | None, error message | None,
 * exit | None). Given the store, the call is a run's: the store's memory cap, fuel and
 * epoch deadline (one tick ahead) are set from `run` first, and its fuel is read back into
 * `run.fuel_left` after, all with the GIL released (as wasmtime-py's setters would each
 * release and take it again). */
/* The guest's execute(request) on this thread, with the GIL released: (reply, error message,
 * exit status). With `store`, its memory cap, fuel and epoch deadline are set from `run`
 * first, and the fuel left is read back into it. */
static PyObject *call_execute(const wasmtime_component_func_t *func,
                              wasmtime_context_t *context, wasmtime_store_t *store,
                              const char *request, size_t request_size, Run *run) {
    wasmtime_component_val_t param, result;
    param.kind = VAL_STRING;
    param.of.string.size = request_size;
    param.of.string.data = (char *)request; /* borrowed for the call; Wasmtime copies it in */
    memset(&result, 0, sizeof result);
    Py_INCREF(run);
    wasmtime_error_t *error;
    Py_BEGIN_ALLOW_THREADS
    error = NULL;
    if (store != NULL) {
        wasmtime_store_limiter(store, run->memory_bytes > INT64_MAX ? INT64_MAX
                                                                    : (int64_t)run->memory_bytes,
                               -1, -1, -1, -1);
        error = wasmtime_context_set_fuel(context, run->fuel_limit);
        wasmtime_context_set_epoch_deadline(context, 1); /* on_epoch_deadline: every tick */
    }
    run->deadline_ns = now_ns(CLOCK_MONOTONIC) + run->timeout_ns;
    Run *outer = current_run;
    current_run = run;
    if (error != NULL) { /* the fuel could not be set: never enter the guest */ }
    else if (atomic_load(&run->cancelled)) error = stop(run, LIMIT_CANCELLED);
    else error = wasmtime_component_func_call(func, context, &param, 1, &result, 1);
    if (error == NULL) {
        error = wasmtime_component_func_post_return(func, context);
        if (error != NULL) wasmtime_component_val_delete(&result);
    }
    current_run = outer;
    if (store != NULL) {
        wasmtime_error_t *fuel_error = wasmtime_context_get_fuel(context, &run->fuel_left);
        if (fuel_error != NULL) {
            wasmtime_error_delete(fuel_error);
            run->fuel_left = 0; /* as the Python path counts an unreadable fuel: all used */
        }
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(run);
    if (error != NULL) return error_result(error);
    PyObject *reply = NULL;
    if (result.kind == VAL_STRING)
        reply = PyUnicode_DecodeUTF8(result.of.string.data, (Py_ssize_t)result.of.string.size,
                                     NULL);
    else
        PyErr_SetString(PyExc_TypeError, "the guest's execute returned no string");
    wasmtime_component_val_delete(&result);
    if (reply == NULL) return NULL;
    return Py_BuildValue("(NOO)", reply, Py_None, Py_None);
}

static PyObject *native_call(PyObject *module, PyObject *args) {
    PyObject *func_address, *context_address, *store_address = NULL;
    Py_buffer request;
    Run *run;
    if (!PyArg_ParseTuple(args, "OOy*O!|O", &func_address, &context_address, &request,
                          &RunType, &run, &store_address))
        return NULL;
    const wasmtime_component_func_t *func = address(func_address);
    wasmtime_context_t *context = func ? address(context_address) : NULL;
    wasmtime_store_t *store = NULL;
    if (context != NULL && store_address != NULL) store = address(store_address);
    PyObject *answer = NULL;
    if (context != NULL && (store_address == NULL || store != NULL))
        answer = call_execute(func, context, store, request.buf, (size_t)request.len, run);
    PyBuffer_Release(&request);
    return answer;
}

/* The plain reply of most runs, exactly as the guest runner writes it (no error, no value):
 * {"exit_code":N,"memory_error":B,"heap_top":N}, N without leading zeros, exit_code at most
 * 255 (3 digits), heap_top at most 20 digits and within 64 bits. The same language as
 * wasibox/_wire.py's _PLAIN_REPLY (which also takes heap_top past 64 bits; such a reply is
 * left to it here). Read in C while the reply is at hand: the regular expression, run cold
 * after the guest call, cost a paced run tens of microseconds. Returns false for anything
 * else, which the host then decodes in Python with every check. */
static bool digits(const char **at, const char *end, int max_digits, uint64_t *value) {
    const char *p = *at;
    if (p >= end || *p < '0' || *p > '9') return false;
    if (*p == '0') {
        *value = 0;
        *at = p + 1;
        return true;
    }
    uint64_t number = 0;
    int count = 0;
    while (p < end && *p >= '0' && *p <= '9') {
        if (++count > max_digits) return false;
        uint64_t digit = (uint64_t)(*p - '0');
        if (number > (UINT64_MAX - digit) / 10) return false;
        number = number * 10 + digit;
        p++;
    }
    *value = number;
    *at = p;
    return true;
}

static bool literal(const char **at, const char *end, const char *text) {
    size_t size = strlen(text);
    if ((size_t)(end - *at) < size || memcmp(*at, text, size) != 0) return false;
    *at += size;
    return true;
}

static bool plain_reply(const char *text, size_t size, uint64_t *exit_code, bool *memory_error,
                        uint64_t *heap_top) {
    const char *at = text, *end = text + size;
    if (!literal(&at, end, "{\"exit_code\":") || !digits(&at, end, 3, exit_code)
        || *exit_code > 255 || !literal(&at, end, ",\"memory_error\":"))
        return false;
    if (literal(&at, end, "true")) *memory_error = true;
    else if (literal(&at, end, "false")) *memory_error = false;
    else return false;
    return literal(&at, end, ",\"heap_top\":") && digits(&at, end, 20, heap_top)
           && literal(&at, end, "}") && at == end;
}

/* The size of the calling thread's native stack, measured once per thread (0 if unknown),
 * as wasibox/backends/wasm/stack.py's thread_stack_bytes measures it. */
static size_t thread_stack_bytes(void) {
    static _Thread_local bool measured = false;
    static _Thread_local size_t size = 0;
    if (!measured) {
        pthread_attr_t attr;
        if (pthread_getattr_np(pthread_self(), &attr) == 0) {
            if (pthread_attr_getstacksize(&attr, &size) != 0) size = 0;
            pthread_attr_destroy(&attr);
        }
        measured = true;
    }
    return size;
}

/* ---- a plain run, whole (wasibox/backends/wasm/backend.py's PlainRuns) ------------------- */

/* What a Sandbox's plain runs share, made once by PlainRuns (run_plain's `config`): */
enum {
    PLAIN_TEMPLATE,     /* the native.Run every run's state is a fresh() copy of */
    PLAIN_CURRENT,      /* run.py's thread-local `current` (adopt, run) */
    PLAIN_ADOPT,        /* PlainRuns._adopt(code, store, state, deadline) -> NativeRun */
    PLAIN_PARTIAL,      /* functools.partial */
    PLAIN_TICKER,       /* the runtime's Ticker */
    PLAIN_RESULT_TYPE,  /* wasibox.RunResult */
    PLAIN_FIELDS,       /* every RunResult field in order, the fixed ones with their values */
    PLAIN_FUEL,         /* limits.fuel (an int) */
    PLAIN_MEMORY_FLOOR, /* the guest's minimum memory, bytes (at most 2**64 - 1) */
    PLAIN_MEMORY_LIMIT, /* limits.memory_bytes (at most 2**64 - 1) */
    PLAIN_TIMEOUT_S,    /* limits.timeout_s (a float) */
    PLAIN_CONFIG_SIZE,
};

/* The names run_plain looks up and sets, and the RunResult fields it fills: interned once. */
static PyObject *name_addresses, *name_output, *name_run, *name_adopt;
enum {
    FIELD_OK, FIELD_EXIT_CODE, FIELD_STDOUT, FIELD_STDERR, FIELD_STDOUT_TRUNCATED,
    FIELD_STDERR_TRUNCATED, FIELD_FUEL_USED, FIELD_MEMORY_PEAK, FIELD_DURATION, FIELD_FILES,
    FIELD_FILES_REFUSED, FIELD_COUNT,
};
static const char *const FIELD_NAMES[FIELD_COUNT] = {
    "ok", "exit_code", "stdout", "stderr", "stdout_truncated", "stderr_truncated",
    "fuel_used", "memory_peak_bytes", "duration_s", "files", "files_refused",
};
static PyObject *field_names[FIELD_COUNT];

static bool plain_config(PyObject *config) {
    if (!PyTuple_Check(config) || PyTuple_GET_SIZE(config) != PLAIN_CONFIG_SIZE
        || !PyObject_TypeCheck(PyTuple_GET_ITEM(config, PLAIN_TEMPLATE), &RunType)
        || !PyObject_TypeCheck(PyTuple_GET_ITEM(config, PLAIN_TICKER), &TickerType)
        || !PyType_Check(PyTuple_GET_ITEM(config, PLAIN_RESULT_TYPE))
        || !PyDict_Check(PyTuple_GET_ITEM(config, PLAIN_FIELDS))) {
        PyErr_SetString(PyExc_TypeError, "run_plain: a config as PlainRuns makes it");
        return false;
    }
    return true;
}

/* The RunResult of a run that ended with the plain reply (no error, no value) and no fault,
 * limit or capability call: what wasibox._result.build_result makes of its Outcome (the
 * tests compare the two), made directly. Its fields are all clean already (the output is
 * decoded as build_result decodes it), so the frozen dataclass's __init__ and
 * __post_init__ would change nothing: the object gets its __dict__ whole. */
static PyObject *plain_result_of(PyObject *config, uint64_t exit_code, uint64_t heap_top,
                                 const char *out, size_t out_size, const char *err,
                                 size_t err_size, bool out_cut, bool err_cut,
                                 uint64_t fuel_left, double duration_s) {
    uint64_t floor = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(config, PLAIN_MEMORY_FLOOR));
    uint64_t limit = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(config, PLAIN_MEMORY_LIMIT));
    if (PyErr_Occurred()) return NULL;
    uint64_t peak = heap_top < limit ? heap_top : limit;
    if (peak < floor) peak = floor;
    PyObject *values[FIELD_COUNT] = {NULL};
    values[FIELD_OK] = PyBool_FromLong(exit_code == 0);
    values[FIELD_EXIT_CODE] = PyLong_FromUnsignedLongLong(exit_code);
    values[FIELD_STDOUT] = PyUnicode_DecodeUTF8(out, (Py_ssize_t)out_size, "replace");
    values[FIELD_STDERR] = PyUnicode_DecodeUTF8(err, (Py_ssize_t)err_size, "replace");
    values[FIELD_STDOUT_TRUNCATED] = PyBool_FromLong(out_cut);
    values[FIELD_STDERR_TRUNCATED] = PyBool_FromLong(err_cut);
    PyObject *left = PyLong_FromUnsignedLongLong(fuel_left);
    values[FIELD_FUEL_USED] = left == NULL ? NULL : PyNumber_Subtract(
        PyTuple_GET_ITEM(config, PLAIN_FUEL), left);
    Py_XDECREF(left);
    values[FIELD_MEMORY_PEAK] = PyLong_FromUnsignedLongLong(peak);
    values[FIELD_DURATION] = PyFloat_FromDouble(duration_s);
    values[FIELD_FILES] = PyList_New(0);
    values[FIELD_FILES_REFUSED] = PyList_New(0);
    PyObject *fields = PyDict_Copy(PyTuple_GET_ITEM(config, PLAIN_FIELDS));
    PyObject *result = NULL;
    bool made = fields != NULL;
    for (int i = 0; made && i < FIELD_COUNT; i++)
        made = values[i] != NULL && PyDict_SetItem(fields, field_names[i], values[i]) == 0;
    if (made) {
        PyTypeObject *type = (PyTypeObject *)PyTuple_GET_ITEM(config, PLAIN_RESULT_TYPE);
        PyObject *no_args = PyTuple_New(0);
        result = no_args == NULL ? NULL : PyBaseObject_Type.tp_new(type, no_args, NULL);
        Py_XDECREF(no_args);
        if (result != NULL && PyObject_GenericSetDict(result, fields, NULL) < 0)
            Py_CLEAR(result);
    }
    for (int i = 0; i < FIELD_COUNT; i++) Py_XDECREF(values[i]);
    Py_XDECREF(fields);
    return result;
}

/* plain_result(config, exit_code, heap_top, stdout, stderr, stdout_truncated,
 * stderr_truncated, fuel_left, duration_s) -> RunResult: run_plain's result, from given
 * values (for the tests that compare it with build_result). */
static PyObject *native_plain_result(PyObject *module, PyObject *args) {
    PyObject *config;
    unsigned long long exit_code, heap_top, fuel_left;
    Py_buffer out, err;
    int out_cut, err_cut;
    double duration_s;
    if (!PyArg_ParseTuple(args, "OKKy*y*ppKd", &config, &exit_code, &heap_top, &out, &err,
                          &out_cut, &err_cut, &fuel_left, &duration_s))
        return NULL;
    PyObject *result = NULL;
    if (plain_config(config))
        result = plain_result_of(config, exit_code, heap_top, out.buf, (size_t)out.len,
                                 err.buf, (size_t)err.len, out_cut, err_cut, fuel_left,
                                 duration_s);
    PyBuffer_Release(&out);
    PyBuffer_Release(&err);
    return result;
}

/* current.<name>, or None where it is unset. */
static PyObject *attribute_or_none(PyObject *object, PyObject *name) {
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        value = Py_NewRef(Py_None);
    }
    return value;
}

/*
 * run_plain(config, code, request, store, started, min_stack) -> RunResult | tuple | None
 *
 * One plain run (Sandbox.run(code) with nothing else set) in `store`, a pooled instance of
 * the native path, from its fresh C state to its RunResult: what PlainRuns did in Python
 * around the guest call (a copy of the state, the deadline, the Python Run made only if a
 * host function written in Python is called (`adopt`, in run.py's `current`), the ticker,
 * the output slot, reading the plain reply, the result). A paced warm run executed those
 * steps with the CPU's caches cold after its idle time, ~10 us a step. `started` is the
 * time.perf_counter() the run's duration counts from.
 *
 * Returns the RunResult when the guest gave the plain reply and nothing else happened (no
 * trap, limit, fault, or Python host function): most runs. Otherwise the tuple the caller
 * builds the Outcome from: (reply, trap message, exit status, stdout, stderr,
 * stdout_truncated, stderr_truncated, limit, fault, exit code, fuel left, the plain reply
 * as (exit_code, memory_error, heap_top) or None, the Python Run if one was made or None,
 * and the `adopt` that makes it). None, with the guest not entered, when this thread's
 * stack is smaller than min_stack bytes (or unknown): the caller calls again on a thread
 * with a large enough one (stack.py's call_with_stack, whose check this is).
 */
static PyObject *native_run_plain(PyObject *module, PyObject *args) {
    PyObject *config, *code, *store, *min_stack_object;
    Py_buffer request;
    double started;
    if (!PyArg_ParseTuple(args, "OOy*OdO", &config, &code, &request, &store, &started,
                          &min_stack_object))
        return NULL;
    PyObject *addresses = NULL, *slot = NULL, *adopt = NULL, *answer = NULL, *adopted = NULL;
    PyObject *result = NULL, *current = NULL;
    Run *run = NULL;
    size_t min_stack = PyLong_AsSize_t(min_stack_object);
    if ((min_stack == (size_t)-1 && PyErr_Occurred()) || !plain_config(config)) goto done;
    if (thread_stack_bytes() < min_stack) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    current = PyTuple_GET_ITEM(config, PLAIN_CURRENT);
    addresses = PyObject_GetAttr(store, name_addresses);
    if (addresses == NULL) goto done;
    if (!PyTuple_Check(addresses) || PyTuple_GET_SIZE(addresses) != 3) {
        PyErr_SetString(PyExc_TypeError, "run_plain: the store's instance is not bound");
        goto done;
    }
    const wasmtime_component_func_t *func = address(PyTuple_GET_ITEM(addresses, 0));
    wasmtime_context_t *context = func ? address(PyTuple_GET_ITEM(addresses, 1)) : NULL;
    wasmtime_store_t *store_pointer = context ? address(PyTuple_GET_ITEM(addresses, 2)) : NULL;
    if (store_pointer == NULL) goto done;
    slot = PyObject_GetAttr(store, name_output);
    if (slot == NULL) goto done;
    run = (Run *)Run_fresh((Run *)PyTuple_GET_ITEM(config, PLAIN_TEMPLATE), NULL);
    if (run == NULL) goto done;
    double timeout_s = PyFloat_AsDouble(PyTuple_GET_ITEM(config, PLAIN_TIMEOUT_S));
    if (timeout_s == -1.0 && PyErr_Occurred()) goto done;
    /* The deadline a Python Run gets, as time.monotonic() gives it (CLOCK_MONOTONIC). */
    double deadline = (double)now_ns(CLOCK_MONOTONIC) / 1e9 + timeout_s;
    adopt = PyObject_CallFunction(PyTuple_GET_ITEM(config, PLAIN_PARTIAL), "OOOOd",
                                  PyTuple_GET_ITEM(config, PLAIN_ADOPT), code, store,
                                  (PyObject *)run, deadline);
    if (adopt == NULL) goto done;
    /* The C state keeps the guest's C-level output under the cap too (run.py's c_output). */
    if (PyObject_SetAttr(slot, name_run, (PyObject *)run) < 0) goto done;
    if (PyObject_SetAttr(current, name_adopt, adopt) < 0) goto clear;
    Ticker *ticker = (Ticker *)PyTuple_GET_ITEM(config, PLAIN_TICKER);
    PyObject *entered = Ticker_enter(ticker, NULL);
    if (entered == NULL) goto clear;
    Py_DECREF(entered);
    answer = call_execute(func, context, store_pointer, request.buf, (size_t)request.len, run);
    Py_DECREF(Ticker_exit(ticker, NULL)); /* Py_False, never NULL */
clear:
    /* Whatever happened, the thread and the slot forget the run (saving a pending error). */
    {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *pending = PyErr_GetRaisedException();
#else
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
#endif
        adopted = attribute_or_none(current, name_run);
        if (adopted == NULL) PyErr_Clear();
        if (PyObject_SetAttr(current, name_run, Py_None) < 0
            || PyObject_SetAttr(current, name_adopt, Py_None) < 0
            || PyObject_SetAttr(slot, name_run, Py_None) < 0)
            PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
        if (pending != NULL) PyErr_SetRaisedException(pending);
#else
        PyErr_Restore(type, value, traceback);
#endif
    }
    if (answer == NULL) goto done;
    if (adopted == NULL) { /* unreadable: whether a Python run was made is unknown */
        PyErr_SetString(PyExc_RuntimeError, "run_plain: the thread's run could not be read");
        goto done;
    }
    PyObject *reply = PyTuple_GET_ITEM(answer, 0), *message = PyTuple_GET_ITEM(answer, 1);
    uint64_t exit_code = 0, heap_top = 0;
    bool memory_error = false, plain = false;
    Py_ssize_t size = 0;
    /* A plain reply is ASCII and short: nothing else is looked at (nor copied to UTF-8). */
    const char *text = reply != Py_None && PyUnicode_IS_ASCII(reply)
                               && PyUnicode_GET_LENGTH(reply) <= 96
                           ? PyUnicode_AsUTF8AndSize(reply, &size)
                           : NULL;
    if (PyErr_Occurred()) goto done;
    if (text != NULL) plain = plain_reply(text, (size_t)size, &exit_code, &memory_error, &heap_top);
    if (plain && adopted == Py_None && message == Py_None && run->limit == LIMIT_NONE
        && run->fault_type == NULL) {
        /* memory_error without an error changes nothing: the result is the plain one. */
        pthread_mutex_lock(&run->output_lock); /* a WASI worker may still be writing */
        result = plain_result_of(
            config, exit_code, heap_top, run->stdout_buf ? run->stdout_buf : "",
            run->stdout_len, run->stderr_buf ? run->stderr_buf : "", run->stderr_len,
            run->stdout_truncated, run->stderr_truncated, run->fuel_left,
            (double)now_ns(CLOCK_MONOTONIC) / 1e9 - started);
        pthread_mutex_unlock(&run->output_lock);
        goto done;
    }
    PyObject *outcome = Run_outcome(run, NULL);
    if (outcome == NULL) goto done;
    PyObject *plain_tuple = plain ? Py_BuildValue("(KOK)", (unsigned long long)exit_code,
                                                  memory_error ? Py_True : Py_False,
                                                  (unsigned long long)heap_top)
                                  : Py_NewRef(Py_None);
    if (plain_tuple != NULL)
        result = Py_BuildValue(
            "(OOOOOOOOOOKNOO)", reply, message, PyTuple_GET_ITEM(answer, 2),
            PyTuple_GET_ITEM(outcome, 0), PyTuple_GET_ITEM(outcome, 1),
            PyTuple_GET_ITEM(outcome, 2), PyTuple_GET_ITEM(outcome, 3),
            PyTuple_GET_ITEM(outcome, 4), PyTuple_GET_ITEM(outcome, 5),
            PyTuple_GET_ITEM(outcome, 6), (unsigned long long)run->fuel_left, plain_tuple,
            adopted, adopt);
    Py_DECREF(outcome);
done:
    PyBuffer_Release(&request);
    Py_XDECREF(addresses);
    Py_XDECREF(slot);
    Py_XDECREF(adopt);
    Py_XDECREF(answer);
    Py_XDECREF(adopted);
    Py_XDECREF((PyObject *)run);
    return result;
}

/* arm(store): route the store's epoch deadline to the C callback. */
static PyObject *native_arm(PyObject *module, PyObject *store_address) {
    wasmtime_store_t *store = address(store_address);
    if (store == NULL) return NULL;
    wasmtime_store_epoch_deadline_callback(store, on_epoch_deadline, NULL, NULL);
    Py_RETURN_NONE;
}

typedef struct {
    const char *name;
    wasmtime_component_func_callback_t callback;
} HostFunc;

typedef struct {
    const char *name; /* %s is WASI's version */
    HostFunc funcs[5];
} HostInstance;

static const HostInstance HOST_INSTANCES[] = {
    {"wasibox:sandbox/runner@0.1.0", {{"start", host_start}}},
    {"wasibox:sandbox/stdio@0.1.0", {{"write", host_write}}},
    {"wasibox:sandbox/clock@0.1.0", {{"sleep", host_sleep}}},
    {"wasibox:sandbox/process@0.1.0", {{"exit", host_exit}}},
    {"wasibox:sandbox/entropy@0.1.0", {{"random-bytes", host_entropy}}},
    {"wasi:clocks/monotonic-clock@%s",
     {{"now", host_monotonic_now},
      {"resolution", host_resolution},
      {"subscribe-duration", host_subscribe_duration},
      {"subscribe-instant", host_subscribe_instant}}},
    {"wasi:clocks/wall-clock@%s",
     {{"now", host_wall_now}, {"resolution", host_wall_resolution}}},
    {"wasi:random/random@%s",
     {{"get-random-bytes", host_random_bytes}, {"get-random-u64", host_random_u64}}},
};

static PyObject *define_failed(wasmtime_error_t *error) {
    wasm_name_t message;
    wasmtime_error_message(error, &message);
    wasmtime_error_delete(error);
    PyErr_Format(PyExc_RuntimeError, "could not define the native host functions: %.*s",
                 (int)message.size, message.data);
    wasm_byte_vec_delete(&message);
    return NULL;
}

/* define(linker, wasi_version): define the C host functions on a component linker. */
static PyObject *native_define(PyObject *module, PyObject *args) {
    PyObject *linker_address;
    const char *wasi_version;
    if (!PyArg_ParseTuple(args, "Os", &linker_address, &wasi_version)) return NULL;
    wasmtime_component_linker_t *linker = address(linker_address);
    if (linker == NULL) return NULL;
    wasmtime_component_linker_instance_t *root = wasmtime_component_linker_root(linker);
    wasmtime_error_t *error = NULL;
    size_t count = sizeof HOST_INSTANCES / sizeof HOST_INSTANCES[0];
    for (size_t i = 0; i < count && error == NULL; i++) {
        char name[128];
        snprintf(name, sizeof name, HOST_INSTANCES[i].name, wasi_version);
        wasmtime_component_linker_instance_t *instance = NULL;
        error = wasmtime_component_linker_instance_add_instance(root, name, strlen(name),
                                                                &instance);
        for (size_t f = 0; error == NULL && f < 5 && HOST_INSTANCES[i].funcs[f].name; f++) {
            const HostFunc *func = &HOST_INSTANCES[i].funcs[f];
            error = wasmtime_component_linker_instance_add_func(
                instance, func->name, strlen(func->name), func->callback, NULL, NULL);
        }
        if (instance != NULL) wasmtime_component_linker_instance_delete(instance);
    }
    wasmtime_component_linker_instance_delete(root);
    if (error != NULL) return define_failed(error);
    Py_RETURN_NONE;
}

/* ---- a batch's records, keyed (the twin of wasibox/_batch.py's _keyed) ------------------- */

/*
 * encode_keyed(records) -> bytes | None: the bytes wasibox._batch._keyed gives for the same
 * records, byte for byte, or None where this encoder does not decide (records that are not
 * exact dicts with the same exact-str keys in the same order, or whatever the Python encoder
 * would refuse): the caller then runs the Python encoder, which decides alike. The values
 * are hashed and compared only as exact strs and bytes, which runs no Python code; only a
 * collection that an allocation starts could (a finalizer), so the keys and values are held
 * once read.
 */

enum { KEYED_INT, KEYED_FLOAT, KEYED_SINGLETON, KEYED_REF, KEYED_PIECES };

typedef struct {
    int kind;
    int32_t *refs;      /* KEYED_REF: each record's reference index */
    PyObject **pieces;  /* KEYED_PIECES: each record's bytes, or NULL for an ASCII str */
} KeyedColumn;

static void put_count(char **at, uint32_t value) {
    unsigned char *out = (unsigned char *)*at;
    out[0] = value & 0xff;
    out[1] = (value >> 8) & 0xff;
    out[2] = (value >> 16) & 0xff;
    out[3] = (value >> 24) & 0xff;
    *at += 4;
}

/* The UTF-8 (surrogates passed) of a str: a new reference to bytes, or NULL with an error. */
static PyObject *utf8_of(PyObject *text) {
    return PyUnicode_AsEncodedString(text, "utf-8", "surrogatepass");
}

/* Whether ``value`` is an exact str the pieces may write straight from its ASCII data. */
static inline bool ascii_str(PyObject *value) {
    return PyUnicode_CheckExact(value) && PyUnicode_IS_ASCII(value);
}

/* Marshal version 2 of every value of a column (the Python encoder's fallback), each kept. */
static int marshal_column(PyObject **values, Py_ssize_t count, Py_ssize_t stride,
                          PyObject **pieces) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = values[i * stride];
        if (ascii_str(value)) continue;  /* written from its data: 'u', length, bytes */
        pieces[i] = PyMarshal_WriteObjectToString(value, 2);
        if (pieces[i] == NULL) return -1;
    }
    return 0;
}

/* Give ``text`` the next index in ``shared`` (and ``order``) unless it has one: _share's
 * step; 0, or -1 with an error. */
static int share_text(PyObject *text, PyObject *shared, PyObject *order) {
    int found = PyDict_Contains(shared, text);
    if (found) return found < 0 ? -1 : 0;
    PyObject *number = PyLong_FromSsize_t(PyList_GET_SIZE(order));
    if (number == NULL) return -1;
    int failed = PyDict_SetItem(shared, text, number) < 0 || PyList_Append(order, text) < 0;
    Py_DECREF(number);
    return failed ? -1 : 0;
}

static int32_t shared_index(PyObject *shared, PyObject *text, Py_ssize_t first) {
    PyObject *number = PyDict_GetItemWithError(shared, text);  /* present: shared above */
    return number == NULL ? -1 : (int32_t)(first + PyLong_AsSsize_t(number));
}

/* ``key``'s index in ``distinct`` (dict.fromkeys order), added as the next if absent; -1 with
 * an error. */
static Py_ssize_t distinct_index(PyObject *distinct, PyObject *key) {
    PyObject *number = PyDict_GetItemWithError(distinct, key);
    if (number != NULL) return PyLong_AsSsize_t(number);
    if (PyErr_Occurred()) return -1;
    Py_ssize_t index = PyDict_GET_SIZE(distinct);
    number = PyLong_FromSsize_t(index);
    if (number == NULL) return -1;
    int failed = PyDict_SetItem(distinct, key, number);
    Py_DECREF(number);
    return failed ? -1 : index;
}

/* A list of strs as a hashable key of equal lists: its strs' indices among the column's
 * strs, as bytes (not a tuple: bytes are not tracked by the collector, which 100,000 tuples
 * a batch kept busy). New reference, or NULL with an error. */
static PyObject *list_key(PyObject *list, PyObject *texts) {
    Py_ssize_t length = PyList_GET_SIZE(list);
    PyObject *key = PyBytes_FromStringAndSize(NULL, 4 * length);
    if (key == NULL) return NULL;
    char *at = PyBytes_AS_STRING(key);
    for (Py_ssize_t j = 0; j < length; j++) {
        Py_ssize_t index = distinct_index(texts, PyList_GET_ITEM(list, j));
        if (index < 0) {
            Py_DECREF(key);
            return NULL;
        }
        put_count(&at, (uint32_t)index);
    }
    return key;
}

/* Decide one column's encoding as _column_encoding does; 1 done, -1 an error. */
static int keyed_column(PyObject **values, Py_ssize_t count, Py_ssize_t stride,
                        Py_ssize_t first_shared, PyObject *shared, PyObject *order,
                        KeyedColumn *column) {
    bool all_str = true, all_list = true, all_int32 = true, all_float = true,
         all_singleton = true;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = values[i * stride];
        all_str = all_str && PyUnicode_CheckExact(value);
        all_list = all_list && PyList_CheckExact(value);
        all_float = all_float && PyFloat_CheckExact(value);
        all_singleton = all_singleton && (value == Py_None || PyBool_Check(value));
        if (all_int32) {
            int overflow = 0;
            long number = PyLong_CheckExact(value) ? PyLong_AsLongAndOverflow(value, &overflow)
                                                   : 0;
            all_int32 = PyLong_CheckExact(value) && !overflow
                        && number >= INT32_MIN && number <= INT32_MAX;
        }
    }
    if (all_int32 || all_float || all_singleton) {
        column->kind = all_int32 ? KEYED_INT : all_float ? KEYED_FLOAT : KEYED_SINGLETON;
        return 1;
    }
    column->kind = KEYED_PIECES;
    column->pieces = PyMem_Calloc((size_t)count, sizeof(PyObject *));
    if (column->pieces == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; all_list && i < count; i++) {
        PyObject *list = values[i * stride];
        for (Py_ssize_t j = 0; all_list && j < PyList_GET_SIZE(list); j++)
            all_list = PyUnicode_CheckExact(PyList_GET_ITEM(list, j));
    }
    if (all_str || all_list) {
        /* dict.fromkeys(column) as _column_encoding makes it (of lists' keys for lists):
         * each record's distinct index, and each distinct value's first record. */
        PyObject *distinct = PyDict_New(), *texts = all_list ? PyDict_New() : NULL;
        Py_ssize_t *indices = PyMem_Malloc((size_t)count * sizeof(Py_ssize_t));
        Py_ssize_t *firsts = PyMem_Malloc((size_t)count * sizeof(Py_ssize_t));
        PyObject **encoded = NULL;
        Py_ssize_t *to_shared = NULL, size = 0;
        int status = 0, sharing = 0;
        if (distinct == NULL || (all_list && texts == NULL)) status = -1;
        else if (indices == NULL || firsts == NULL) status = (PyErr_NoMemory(), -1);
        /* More distinct values than half the records, and they will never be shared: the
         * rest need not be counted (a column of unique strs stops at half of it). */
        for (Py_ssize_t i = 0; status == 0 && size * 2 <= count && i < count; i++) {
            PyObject *key = all_list ? list_key(values[i * stride], texts)
                                     : Py_NewRef(values[i * stride]);
            indices[i] = key == NULL ? -1 : distinct_index(distinct, key);
            Py_XDECREF(key);
            if (indices[i] < 0) status = -1;
            else if (indices[i] == size) firsts[size++] = i;
        }
        sharing = status == 0 && size * 2 <= count;
        if (sharing) {
            to_shared = PyMem_Malloc((size_t)size * sizeof(Py_ssize_t) + 1);
            encoded = PyMem_Calloc((size_t)size + 1, sizeof(PyObject *));
            if (to_shared == NULL || encoded == NULL) status = (PyErr_NoMemory(), -1);
        }
        /* Share the distinct strs (of the distinct lists) in order of first use, as _share. */
        for (Py_ssize_t d = 0; sharing && status == 0 && d < size; d++) {
            PyObject *value = values[firsts[d] * stride];
            if (all_str) {
                status = share_text(value, shared, order);
                to_shared[d] = status ? -1 : shared_index(shared, value, first_shared);
                if (to_shared[d] < 0) status = -1;
                continue;
            }
            /* Each distinct list once: '[', its length, its strs' references. */
            Py_ssize_t length = PyList_GET_SIZE(value);
            for (Py_ssize_t j = 0; status == 0 && j < length; j++)
                status = share_text(PyList_GET_ITEM(value, j), shared, order);
            encoded[d] = status ? NULL : PyBytes_FromStringAndSize(NULL, 5 + 5 * length);
            if (encoded[d] == NULL) {
                status = -1;
                break;
            }
            char *at = PyBytes_AS_STRING(encoded[d]);
            *at++ = '[';
            put_count(&at, (uint32_t)length);
            for (Py_ssize_t j = 0; status == 0 && j < length; j++) {
                int32_t index = shared_index(shared, PyList_GET_ITEM(value, j), first_shared);
                if (index < 0) status = -1;
                *at++ = 'r';
                put_count(&at, (uint32_t)index);
            }
        }
        if (sharing && status == 0) {
            if (all_str) {
                column->kind = KEYED_REF;
                column->refs = PyMem_Malloc((size_t)count * sizeof(int32_t));
                if (column->refs == NULL) status = (PyErr_NoMemory(), -1);
                for (Py_ssize_t i = 0; status == 0 && i < count; i++)
                    column->refs[i] = (int32_t)to_shared[indices[i]];
            } else {
                for (Py_ssize_t i = 0; i < count; i++)
                    column->pieces[i] = Py_NewRef(encoded[indices[i]]);
            }
        }
        if (encoded != NULL)
            for (Py_ssize_t d = 0; d < size; d++) Py_XDECREF(encoded[d]);
        PyMem_Free(encoded);
        PyMem_Free(to_shared);
        PyMem_Free(indices);
        PyMem_Free(firsts);
        Py_XDECREF(distinct);
        Py_XDECREF(texts);
        if (status < 0) return -1;
        if (sharing) {
            if (column->kind == KEYED_REF) {
                PyMem_Free(column->pieces);
                column->pieces = NULL;
            }
            return 1;
        }
    }
    return marshal_column(values, count, stride, column->pieces) < 0 ? -1 : 1;
}

/* The bytes of one piece of a record: its marshal, or 'u', length and data of an ASCII str. */
static Py_ssize_t piece_size(PyObject *piece, PyObject *value) {
    return piece != NULL ? PyBytes_GET_SIZE(piece) : 5 + PyUnicode_GET_LENGTH(value);
}

static Py_ssize_t head_text_size(PyObject *text) {
    if (PyUnicode_IS_ASCII(text)) return 5 + PyUnicode_GET_LENGTH(text);
    PyObject *utf8 = utf8_of(text);
    if (utf8 == NULL) return -1;
    Py_ssize_t size = 5 + PyBytes_GET_SIZE(utf8);
    Py_DECREF(utf8);
    return size;
}

static int put_head_text(char **at, PyObject *text, unsigned char code) {
    PyObject *utf8 = NULL;
    const char *data;
    Py_ssize_t size;
    if (PyUnicode_IS_ASCII(text)) {
        data = (const char *)PyUnicode_1BYTE_DATA(text);
        size = PyUnicode_GET_LENGTH(text);
    } else {
        utf8 = utf8_of(text);
        if (utf8 == NULL) return -1;
        data = PyBytes_AS_STRING(utf8);
        size = PyBytes_GET_SIZE(utf8);
    }
    *(*at)++ = (char)code;
    put_count(at, (uint32_t)size);
    memcpy(*at, data, (size_t)size);
    *at += size;
    Py_XDECREF(utf8);
    return 0;
}

static PyObject *native_encode_keyed(PyObject *module, PyObject *records) {
    if (!PyList_CheckExact(records) || PyList_GET_SIZE(records) == 0
        || PyList_GET_SIZE(records) > INT32_MAX)
        Py_RETURN_NONE;
    Py_ssize_t count = PyList_GET_SIZE(records);
    for (Py_ssize_t i = 0; i < count; i++)
        if (!PyDict_CheckExact(PyList_GET_ITEM(records, i))) Py_RETURN_NONE;
    PyObject *first = PyList_GET_ITEM(records, 0);
    Py_ssize_t width = PyDict_GET_SIZE(first);
    PyObject *result = NULL, *shared = NULL, *order = NULL;
    bool held = false;
    PyObject **keys = PyMem_Calloc((size_t)width + 1, sizeof(PyObject *));
    PyObject **values = PyMem_Calloc((size_t)(count * width) + 1, sizeof(PyObject *));
    KeyedColumn *columns = PyMem_Calloc((size_t)width + 1, sizeof(KeyedColumn));
    if (keys == NULL || values == NULL || columns == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Every record has the first one's keys, exact strs, in the same order. */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *record = PyList_GET_ITEM(records, i), *key, *value;
        Py_ssize_t position = 0, index = 0;
        if (PyDict_GET_SIZE(record) != width) goto undecided;
        while (PyDict_Next(record, &position, &key, &value)) {
            if (!PyUnicode_CheckExact(key)) goto undecided;
            if (i == 0) keys[index] = key;
            else if (key != keys[index] && PyUnicode_Compare(key, keys[index]) != 0)
                goto undecided;
            values[i * width + index++] = value;
        }
    }
    /* Held from here on: an allocation below may run the collector, and a finalizer it
     * runs may change the records; the bytes are then those of the values read above. */
    for (Py_ssize_t v = 0; v < count * width; v++) Py_INCREF(values[v]);
    for (Py_ssize_t k = 0; k < width; k++) Py_INCREF(keys[k]);
    held = true;
    shared = PyDict_New();
    order = PyList_New(0);
    if (shared == NULL || order == NULL) goto done;
    for (Py_ssize_t k = 0; k < width; k++) {
        if (keyed_column(values + k, count, width, width, shared, order, &columns[k]) < 0)
            goto done;
    }
    /* The size of it all, then one bytes written in place. */
    Py_ssize_t size = 5 + 5 + 5;  /* the outer tuple, the keys' tuple, the list */
    Py_ssize_t shared_count = PyList_GET_SIZE(order);
    for (Py_ssize_t k = 0; k < width; k++) {
        Py_ssize_t text = head_text_size(keys[k]);
        if (text < 0) goto done;
        size += text;
    }
    if (shared_count) size += 5;
    for (Py_ssize_t s = 0; s < shared_count; s++) {
        Py_ssize_t text = head_text_size(PyList_GET_ITEM(order, s));
        if (text < 0) goto done;
        size += text;
    }
    size += count * (2 + 5 * width);  /* '{', each key's reference, '0' */
    for (Py_ssize_t k = 0; k < width; k++) {
        KeyedColumn *column = &columns[k];
        switch (column->kind) {
        case KEYED_INT: case KEYED_REF: size += 5 * count; break;
        case KEYED_FLOAT: size += 9 * count; break;
        case KEYED_SINGLETON: size += count; break;
        default:
            for (Py_ssize_t i = 0; i < count; i++)
                size += piece_size(column->pieces[i], values[i * width + k]);
        }
    }
    result = PyBytes_FromStringAndSize(NULL, size);
    if (result == NULL) goto done;
    char *at = PyBytes_AS_STRING(result);
    *at++ = '(';
    put_count(&at, shared_count ? 3 : 2);
    *at++ = '(';
    put_count(&at, (uint32_t)width);
    for (Py_ssize_t k = 0; k < width; k++)
        if (put_head_text(&at, keys[k], 't' | 0x80) < 0) goto failed;
    if (shared_count) {
        *at++ = '(';
        put_count(&at, (uint32_t)shared_count);
        for (Py_ssize_t s = 0; s < shared_count; s++)
            if (put_head_text(&at, PyList_GET_ITEM(order, s), 'u' | 0x80) < 0) goto failed;
    }
    *at++ = '[';
    put_count(&at, (uint32_t)count);
    for (Py_ssize_t i = 0; i < count; i++) {
        *at++ = '{';
        for (Py_ssize_t k = 0; k < width; k++) {
            KeyedColumn *column = &columns[k];
            PyObject *value = values[i * width + k];
            *at++ = 'r';
            put_count(&at, (uint32_t)k);
            switch (column->kind) {
            case KEYED_INT:
                *at++ = 'i';
                put_count(&at, (uint32_t)(int32_t)PyLong_AsLong(value));
                break;
            case KEYED_FLOAT:
                *at++ = 'g';
                if (PyFloat_Pack8(PyFloat_AS_DOUBLE(value), at, 1) < 0) goto failed;
                at += 8;
                break;
            case KEYED_SINGLETON:
                *at++ = value == Py_None ? 'N' : value == Py_True ? 'T' : 'F';
                break;
            case KEYED_REF:
                *at++ = 'r';
                put_count(&at, (uint32_t)column->refs[i]);
                break;
            default:
                if (column->pieces[i] != NULL) {
                    memcpy(at, PyBytes_AS_STRING(column->pieces[i]),
                           (size_t)PyBytes_GET_SIZE(column->pieces[i]));
                    at += PyBytes_GET_SIZE(column->pieces[i]);
                } else {
                    *at++ = 'u';
                    put_count(&at, (uint32_t)PyUnicode_GET_LENGTH(value));
                    memcpy(at, PyUnicode_1BYTE_DATA(value), (size_t)PyUnicode_GET_LENGTH(value));
                    at += PyUnicode_GET_LENGTH(value);
                }
            }
        }
        *at++ = '0';
    }
    assert(at == PyBytes_AS_STRING(result) + size);
    goto done;
failed:
    Py_CLEAR(result);
    goto done;
undecided:
    result = Py_NewRef(Py_None);
done:
    if (columns != NULL) {
        for (Py_ssize_t k = 0; k < width; k++) {
            if (columns[k].pieces != NULL)
                for (Py_ssize_t i = 0; i < count; i++) Py_XDECREF(columns[k].pieces[i]);
            PyMem_Free(columns[k].pieces);
            PyMem_Free(columns[k].refs);
        }
    }
    PyMem_Free(columns);
    if (held) {
        for (Py_ssize_t v = 0; v < count * width; v++) Py_DECREF(values[v]);
        for (Py_ssize_t k = 0; k < width; k++) Py_DECREF(keys[k]);
    }
    PyMem_Free(values);
    PyMem_Free(keys);
    Py_XDECREF(shared);
    Py_XDECREF(order);
    if (result == NULL && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
        /* What marshal refuses (an object it cannot write, one nested too deep), the Python
         * encoder meets too, and raises with its own message. */
        PyErr_Clear();
        result = Py_NewRef(Py_None);
    }
    return result;
}

static PyMethodDef module_methods[] = {
    {"call", native_call, METH_VARARGS,
     "call(func, context, request, run): the guest's execute, with the GIL released."},
    {"run_plain", native_run_plain, METH_VARARGS,
     "run_plain(config, code, request, store, started, min_stack): a plain run, whole: its "
     "RunResult, or what the caller builds it from, or None if this thread's stack is too "
     "small."},
    {"plain_result", native_plain_result, METH_VARARGS,
     "plain_result(config, exit_code, heap_top, stdout, stderr, stdout_truncated, "
     "stderr_truncated, fuel_left, duration_s): run_plain's RunResult of given values."},
    {"arm", native_arm, METH_O, "arm(store): the epoch deadline callback, in C."},
    {"define", native_define, METH_VARARGS,
     "define(linker, wasi_version): the C host functions, on a component linker."},
    {"encode_keyed", native_encode_keyed, METH_O,
     "encode_keyed(records): wasibox._batch's keyed bytes of records, or None: undecided."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_wasibox_native",
    "The native run path of wasibox's Wasmtime backend.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__wasibox_native(void) {
    if (PyType_Ready(&RunType) < 0 || PyType_Ready(&TickerType) < 0) return NULL;
    if ((name_addresses = PyUnicode_InternFromString("addresses")) == NULL
        || (name_output = PyUnicode_InternFromString("output")) == NULL
        || (name_run = PyUnicode_InternFromString("run")) == NULL
        || (name_adopt = PyUnicode_InternFromString("adopt")) == NULL)
        return NULL;
    for (int i = 0; i < FIELD_COUNT; i++)
        if ((field_names[i] = PyUnicode_InternFromString(FIELD_NAMES[i])) == NULL) return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Run", (PyObject *)&RunType) < 0
        || PyModule_AddObjectRef(module, "Ticker", (PyObject *)&TickerType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
