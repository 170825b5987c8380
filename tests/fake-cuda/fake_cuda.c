/*
 * A strict stand-in for the CUDA driver (libcuda.so.1), so that the engine's GPU path runs and is
 * checked on machines without a GPU (CI). It is not an emulator of a GPU: it implements the part
 * of the driver API the engine, its tests and the Python bindings' tests call, with the driver's
 * documented semantics where they matter to a caller, and it is stricter than the driver where
 * the driver would let a bug pass silently:
 *
 * - Every stream is a queue run by a thread of its own, and each copy on it waits a random
 *   FAKE_CUDA_DELAY_US/2..FAKE_CUDA_DELAY_US microseconds (default 500) before it runs, so work
 *   that is not ordered by events really does run out of order.
 * - Device memory is host memory the caller cannot address: a device pointer is the address of
 *   an inaccessible (PROT_NONE) reservation, so host code that reads a device pointer crashes, as
 *   on a real GPU. New allocations are filled with 0xA5, freed ones are unmapped.
 * - Contexts: one primary context per device (FAKE_CUDA_DEVICES, default 1), current per thread.
 *   Calls that need one fail with CUDA_ERROR_INVALID_CONTEXT when none is current; streams,
 *   events and allocations belong to the context current when they were made; as with the
 *   driver, copies may go on any context's stream and a stream may wait on any context's event,
 *   but an event records only on a stream of its own context (else CUDA_ERROR_INVALID_HANDLE).
 *   Calls in a process forked after cuInit fail with CUDA_ERROR_NOT_INITIALIZED.
 * - FAKE_CUDA_FAIL=NAME:N makes the Nth call of driver function NAME fail (with
 *   CUDA_ERROR_INVALID_VALUE), to test error paths.
 * - Copies between the host and pageable (unregistered) memory behave as the driver's do: a
 *   host-to-device copy takes the bytes when it is called; a device-to-host copy returns once it
 *   has run. Only page-locked memory gives truly asynchronous copies.
 * - Protocol violations the driver would not report (the results would be silently wrong) abort
 *   the process with a message naming them: page-locked host memory changed between an
 *   asynchronous copy from it being enqueued and the copy running; a copy that writes device
 *   memory while a read of the same bytes enqueued earlier on another stream has not run (or
 *   reads while such a write has not run); device memory freed, or host memory unregistered,
 *   while queued work still uses it.
 *
 * `granary_fake_cuda_stats` reports live objects and counters, for tests that check nothing
 * leaked. Blocking streams are treated like non-blocking ones (no implicit synchronisation with
 * the legacy stream): stricter than the driver, never looser.
 *
 * Build: cc -shared -fPIC -pthread -O1 -o libcuda.so.1 fake_cuda.c (`make fake-cuda`).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_event *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
};

enum { CU_POINTER_ATTRIBUTE_CONTEXT = 1, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9 };

#define MAX_DEVICES 8
#define STREAM_LEGACY ((uintptr_t)1)
#define STREAM_PER_THREAD ((uintptr_t)2)

struct fake_ctx {
    int device;
    int retained;
    struct fake_stream *legacy; /* its legacy default stream, made on first use */
};

enum op_kind { OP_HTOD, OP_DTOH, OP_RECORD, OP_WAIT };

struct op {
    enum op_kind kind;
    uint64_t seq; /* enqueue order, process-wide */
    struct op *next;
    CUdeviceptr device; /* HTOD: destination; DTOH: source */
    void *host;         /* HTOD: source; DTOH: destination */
    size_t bytes;
    unsigned char *staged; /* HTOD from pageable memory: the bytes, taken when enqueued */
    uint64_t host_hash;    /* HTOD from page-locked memory: the source's hash when enqueued */
    struct fake_event *event;
    uint64_t generation; /* RECORD: the record this completes; WAIT: the one waited for */
};

/* Never freed once made (a destroyed stream's thread drains its queue, unlinks it and exits),
 * so a caller waiting on one never reads freed memory. */
struct fake_stream {
    struct fake_stream *next; /* in `streams` while its thread runs */
    struct fake_ctx *ctx;
    int live; /* a valid handle: created and not destroyed (or a default stream) */
    struct op *head, *tail;
    uint64_t executed; /* seq of the last op run */
    unsigned int seed;
};

struct fake_event {
    struct fake_event *next_live; /* in `events` until destroyed */
    struct fake_ctx *ctx;
    uint64_t recorded;   /* generation of the latest record (0: never recorded) */
    unsigned char *done; /* done[g - 1]: record g has been passed by its stream */
    size_t capacity;
    int refs; /* the handle (until destroyed) + queued ops */
};

struct allocation {
    struct allocation *next;
    struct fake_ctx *ctx;
    CUdeviceptr device; /* the PROT_NONE reservation's address */
    size_t bytes;
    size_t reserved;
    unsigned char *memory;
};

struct registration {
    struct registration *next;
    uintptr_t start;
    size_t bytes;
};

struct granary_fake_cuda_stats {
    uint64_t allocations;
    uint64_t allocated_bytes;
    uint64_t registrations;
    uint64_t streams;
    uint64_t events;
    uint64_t queued_ops;
    uint64_t async_copies;
    uint64_t unpinned_async_copies;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t progress = PTHREAD_COND_INITIALIZER;
static pid_t init_pid;
static int devices = 1;
static uint64_t memory_limit = 8ull << 30;
static unsigned delay_us = 500;
static uint64_t next_seq = 1;
static struct fake_ctx contexts[MAX_DEVICES];
static struct fake_stream *streams;
static struct fake_event *events;
static struct allocation *allocations;
static struct registration *registrations;
static struct granary_fake_cuda_stats stats;
static __thread CUcontext current;
static __thread struct fake_stream *per_thread_streams[MAX_DEVICES];

/* A fork while a stream thread holds the lock must not leave the child's copy locked: the child
 * gets CUDA_ERROR_NOT_INITIALIZED from every call, and must be able to make them. */
static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&lock); }
static void after_fork_child(void) {
    pthread_mutex_unlock(&lock);
    pthread_cond_init(&progress, NULL);
}
__attribute__((constructor)) static void install_fork_handlers(void) {
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

static void violation(const char *what, const struct op *op) {
    if (op != NULL) {
        fprintf(stderr, "fake CUDA: %s (op %llu: %zu bytes, device 0x%llx, host %p)\n", what,
                (unsigned long long)op->seq, op->bytes, op->device, op->host);
    } else {
        fprintf(stderr, "fake CUDA: %s\n", what);
    }
    abort();
}

static uint64_t hash_bytes(const void *data, size_t bytes) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < bytes; i++) {
        h = (h ^ p[i]) * 1099511628211ull;
    }
    return h;
}

static unsigned env_unsigned(const char *name, unsigned fallback) {
    const char *value = getenv(name);
    return value != NULL && *value != '\0' ? (unsigned)strtoul(value, NULL, 10) : fallback;
}

/* Whether this call of `name` is the one FAKE_CUDA_FAIL says to fail; with `lock` held. */
static int injected_failure(const char *name) {
    static uint64_t calls;
    const char *spec = getenv("FAKE_CUDA_FAIL");
    const char *colon = spec == NULL ? NULL : strchr(spec, ':');
    if (colon == NULL || strlen(name) != (size_t)(colon - spec) || strncmp(spec, name, (size_t)(colon - spec)) != 0) {
        return 0;
    }
    return ++calls == strtoull(colon + 1, NULL, 10);
}

/* 0 when the process may call the driver; the error otherwise. Call with `lock` held. */
static CUresult usable(void) {
    if (init_pid == 0 || init_pid != getpid()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    return CUDA_SUCCESS;
}

static CUresult usable_with_context(void) {
    CUresult r = usable();
    if (r == CUDA_SUCCESS && (current == NULL || current->retained == 0)) {
        r = CUDA_ERROR_INVALID_CONTEXT;
    }
    return r;
}

static struct allocation *allocation_of(CUdeviceptr device, size_t bytes) {
    for (struct allocation *a = allocations; a != NULL; a = a->next) {
        if (device >= a->device && device - a->device <= a->bytes && bytes <= a->bytes - (device - a->device)) {
            return a;
        }
    }
    return NULL;
}

static int overlaps(CUdeviceptr a, size_t a_bytes, CUdeviceptr b, size_t b_bytes) {
    return a < b + b_bytes && b < a + a_bytes;
}

static int host_overlaps(const void *a, size_t a_bytes, uintptr_t b, size_t b_bytes) {
    uintptr_t start = (uintptr_t)a;
    return start < b + b_bytes && b < start + a_bytes;
}

static int registered(const void *host, size_t bytes) {
    uintptr_t start = (uintptr_t)host;
    for (struct registration *r = registrations; r != NULL; r = r->next) {
        if (start >= r->start && start + bytes <= r->start + r->bytes) {
            return 1;
        }
    }
    return 0;
}

/* A queued (or running) op, on any stream but `except`, for which `match` holds; with `lock`
 * held. An op stays at the head of its queue until it has run. */
static const struct op *queued_op(const struct fake_stream *except,
                                  int (*match)(const struct op *, const void *), const void *arg) {
    for (const struct fake_stream *s = streams; s != NULL; s = s->next) {
        if (s == except) {
            continue;
        }
        for (const struct op *op = s->head; op != NULL; op = op->next) {
            if (match(op, arg)) {
                return op;
            }
        }
    }
    return NULL;
}

struct range {
    CUdeviceptr device;
    size_t bytes;
    uint64_t before; /* only ops enqueued before this sequence number (0: any) */
    int kind;        /* only ops of this kind (-1: copies of either direction) */
};

static int touches_device(const struct op *op, const void *arg) {
    const struct range *r = arg;
    return (op->kind == OP_HTOD || op->kind == OP_DTOH) && (r->before == 0 || op->seq < r->before) &&
           (r->kind == -1 || (int)op->kind == r->kind) && overlaps(op->device, op->bytes, r->device, r->bytes);
}

struct host_range {
    uintptr_t start;
    size_t bytes;
};

/* A copy that will still read or write the host range (a staged copy has read it already). */
static int uses_host(const struct op *op, const void *arg) {
    const struct host_range *r = arg;
    return ((op->kind == OP_HTOD && op->staged == NULL) || op->kind == OP_DTOH) &&
           host_overlaps(op->host, op->bytes, r->start, r->bytes);
}

static int event_live(CUevent event) {
    for (struct fake_event *e = events; e != NULL; e = e->next_live) {
        if (e == event) {
            return 1;
        }
    }
    return 0;
}

static int generation_done(const struct fake_event *e, uint64_t g) {
    return g == 0 || (g <= e->capacity && e->done[g - 1]);
}

static void release_event(struct fake_event *event) {
    if (--event->refs == 0) {
        free(event->done);
        free(event);
    }
}

/* Runs the head op of `s`; with `lock` held (released while a copy waits its delay). */
static void run(struct fake_stream *s, struct op *op) {
    switch (op->kind) {
    case OP_WAIT:
        while (!generation_done(op->event, op->generation)) {
            pthread_cond_wait(&progress, &lock);
        }
        break;
    case OP_RECORD:
        /* `done` was sized when the record was enqueued. */
        op->event->done[op->generation - 1] = 1;
        break;
    case OP_HTOD:
    case OP_DTOH: {
        unsigned wait = delay_us == 0 ? 0 : delay_us / 2 + (unsigned)rand_r(&s->seed) % (delay_us - delay_us / 2);
        if (wait > 0) {
            pthread_mutex_unlock(&lock);
            usleep(wait);
            pthread_mutex_lock(&lock);
        }
        struct allocation *a = allocation_of(op->device, op->bytes);
        if (a == NULL) {
            violation("device memory freed while a copy on a stream still used it", op);
        }
        /* Another stream's earlier work on the same bytes must have run: a write over bytes an
         * earlier read has not read yet, or a read of bytes an earlier write has not written. */
        struct range r = {op->device, op->bytes, op->seq, op->kind == OP_HTOD ? OP_DTOH : OP_HTOD};
        if (queued_op(s, touches_device, &r) != NULL) {
            violation(op->kind == OP_HTOD
                          ? "a copy to device memory ran before an earlier read of it on another stream (no event orders them)"
                          : "a copy from device memory ran before an earlier write to it on another stream (no event orders them)",
                      op);
        }
        unsigned char *memory = a->memory + (op->device - a->device);
        if (op->kind == OP_DTOH) {
            memcpy(op->host, memory, op->bytes);
        } else if (op->staged != NULL) {
            memcpy(memory, op->staged, op->bytes);
        } else {
            if (hash_bytes(op->host, op->bytes) != op->host_hash) {
                violation("page-locked host memory changed before the asynchronous copy from it ran", op);
            }
            memcpy(memory, op->host, op->bytes);
        }
        break;
    }
    }
}

static void *stream_thread(void *arg) {
    struct fake_stream *s = arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (s->head == NULL && s->live) {
            pthread_cond_wait(&progress, &lock);
        }
        if (s->head == NULL) {
            break;
        }
        struct op *op = s->head;
        run(s, op);
        s->head = op->next;
        if (s->head == NULL) {
            s->tail = NULL;
        }
        s->executed = op->seq;
        stats.queued_ops--;
        if (op->event != NULL) {
            release_event(op->event);
        }
        free(op->staged);
        free(op);
        pthread_cond_broadcast(&progress);
    }
    struct fake_stream **link = &streams;
    while (*link != s) {
        link = &(*link)->next;
    }
    *link = s->next;
    pthread_mutex_unlock(&lock);
    return NULL;
}

/* A stream of the current context and its thread; with `lock` held (the thread starts once it
 * is released). */
static struct fake_stream *new_stream(void) {
    struct fake_stream *s = calloc(1, sizeof *s);
    if (s == NULL) {
        return NULL;
    }
    s->live = 1;
    s->ctx = current;
    s->seed = (unsigned)(uintptr_t)s ^ (unsigned)time(NULL);
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&thread, &attr, stream_thread, s);
    pthread_attr_destroy(&attr);
    if (failed) {
        free(s);
        return NULL;
    }
    s->next = streams;
    streams = s;
    return s;
}

/* The stream a handle names (0 and 1: the current context's legacy stream; 2: this thread's
 * default stream in it); with `lock` held and a context current. */
static CUresult resolve(CUstream handle, struct fake_stream **out) {
    uintptr_t raw = (uintptr_t)handle;
    if (raw == 0 || raw == STREAM_LEGACY || raw == STREAM_PER_THREAD) {
        struct fake_stream **slot =
            raw == STREAM_PER_THREAD ? &per_thread_streams[current->device] : &current->legacy;
        if (*slot == NULL && (*slot = new_stream()) == NULL) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        *out = *slot;
        return CUDA_SUCCESS;
    }
    for (struct fake_stream *s = streams; s != NULL; s = s->next) {
        if (s == handle && s->live) {
            *out = s;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_HANDLE;
}

/* Queues `op` on `s` and returns its sequence number (0 when out of memory). */
static uint64_t enqueue(struct fake_stream *s, struct op op) {
    struct op *queued = malloc(sizeof *queued);
    if (queued == NULL) {
        free(op.staged);
        return 0;
    }
    *queued = op;
    queued->seq = next_seq++;
    queued->next = NULL;
    if (queued->event != NULL) {
        queued->event->refs++;
    }
    if (s->tail == NULL) {
        s->head = queued;
    } else {
        s->tail->next = queued;
    }
    s->tail = queued;
    stats.queued_ops++;
    pthread_cond_broadcast(&progress);
    return queued->seq;
}

/* Waits until `s` has run its ops up to `seq`; with `lock` held. */
static void wait_for_op(struct fake_stream *s, uint64_t seq) {
    while (s->executed < seq) {
        pthread_cond_wait(&progress, &lock);
    }
}

/* Waits until `s` has run everything queued on it so far; with `lock` held. */
static void drain(struct fake_stream *s) {
    if (s->tail != NULL) {
        wait_for_op(s, s->tail->seq);
    }
}

/* ---- initialisation, devices, contexts ---- */

CUresult cuInit(unsigned flags) {
    if (flags != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&lock);
    CUresult r = CUDA_SUCCESS;
    if (init_pid == 0) {
        init_pid = getpid();
        devices = (int)env_unsigned("FAKE_CUDA_DEVICES", 1);
        devices = devices > MAX_DEVICES ? MAX_DEVICES : devices;
        delay_us = env_unsigned("FAKE_CUDA_DELAY_US", 500);
        memory_limit = (uint64_t)env_unsigned("FAKE_CUDA_MEMORY_MIB", 8192) << 20;
        for (int i = 0; i < MAX_DEVICES; i++) {
            contexts[i].device = i;
        }
    } else if (init_pid != getpid()) {
        r = CUDA_ERROR_NOT_INITIALIZED; /* as the driver does in a child forked after cuInit */
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDriverGetVersion(int *version) {
    if (version == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *version = 12080;
    return CUDA_SUCCESS;
}

static CUresult usable_device(CUdevice device) {
    CUresult r = usable();
    if (r == CUDA_SUCCESS && (device < 0 || device >= devices)) {
        r = CUDA_ERROR_INVALID_DEVICE;
    }
    return r;
}

CUresult cuDeviceGetCount(int *count) {
    pthread_mutex_lock(&lock);
    CUresult r = usable();
    if (r == CUDA_SUCCESS) {
        *count = devices;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_device(ordinal);
    if (r == CUDA_SUCCESS) {
        *device = ordinal;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_device(device);
    if (r == CUDA_SUCCESS && (name == NULL || len <= 0)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        snprintf(name, (size_t)len, "granary fake CUDA device %d (host memory)", device);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_device(device);
    if (r == CUDA_SUCCESS) {
        *bytes = (size_t)memory_limit;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_device(device);
    if (r == CUDA_SUCCESS) {
        contexts[device].retained++;
        *ctx = &contexts[device];
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_device(device);
    if (r == CUDA_SUCCESS && contexts[device].retained == 0) {
        r = CUDA_ERROR_INVALID_CONTEXT;
    }
    if (r == CUDA_SUCCESS) {
        contexts[device].retained--;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned *flags, int *active) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_device(device);
    if (r == CUDA_SUCCESS && (flags == NULL || active == NULL)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        *flags = 0;
        *active = contexts[device].retained > 0;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    pthread_mutex_lock(&lock);
    CUresult r = usable();
    if (r == CUDA_SUCCESS) {
        *ctx = current;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    pthread_mutex_lock(&lock);
    CUresult r = usable();
    if (r == CUDA_SUCCESS && ctx != NULL &&
        (ctx < &contexts[0] || ctx >= &contexts[MAX_DEVICES] || ctx->retained == 0)) {
        r = CUDA_ERROR_INVALID_CONTEXT;
    }
    if (r == CUDA_SUCCESS) {
        current = ctx;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static int queued_before(const struct op *op, const void *arg) {
    return op->seq < *(const uint64_t *)arg;
}

/* Waits for the work queued so far on the current context's streams (work queued meanwhile is
 * not waited for). */
CUresult cuCtxSynchronize(void) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS) {
        uint64_t before = next_seq;
        for (int again = 1; again;) {
            again = 0;
            for (struct fake_stream *s = streams; s != NULL && !again; s = s->next) {
                if (s->ctx == current) {
                    for (struct op *op = s->head; op != NULL && !again; op = op->next) {
                        again = queued_before(op, &before);
                    }
                }
            }
            if (again) {
                pthread_cond_wait(&progress, &lock);
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* ---- memory ---- */

CUresult cuMemAlloc_v2(CUdeviceptr *device, size_t bytes) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS && (device == NULL || bytes == 0)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS && stats.allocated_bytes + bytes > memory_limit) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (r == CUDA_SUCCESS) {
        struct allocation *a = calloc(1, sizeof *a);
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        size_t reserved = (bytes + page - 1) / page * page;
        void *reservation = a == NULL ? MAP_FAILED
                                      : mmap(NULL, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        unsigned char *memory = reservation == MAP_FAILED ? NULL : malloc(bytes);
        if (memory == NULL) {
            if (reservation != MAP_FAILED) {
                munmap(reservation, reserved);
            }
            free(a);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            memset(memory, 0xA5, bytes);
            a->ctx = current;
            a->device = (CUdeviceptr)(uintptr_t)reservation;
            a->bytes = bytes;
            a->reserved = reserved;
            a->memory = memory;
            a->next = allocations;
            allocations = a;
            stats.allocations++;
            stats.allocated_bytes += bytes;
            *device = a->device;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemFree_v2(CUdeviceptr device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct allocation **link = &allocations;
    while (r == CUDA_SUCCESS && *link != NULL && (*link)->device != device) {
        link = &(*link)->next;
    }
    if (r == CUDA_SUCCESS && *link == NULL) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        struct allocation *a = *link;
        struct range whole = {a->device, a->bytes, 0, -1};
        const struct op *op = queued_op(NULL, touches_device, &whole);
        if (op != NULL) {
            violation("device memory freed while a copy queued on a stream still uses it", op);
        }
        *link = a->next;
        munmap((void *)(uintptr_t)a->device, a->reserved);
        free(a->memory);
        stats.allocations--;
        stats.allocated_bytes -= a->bytes;
        free(a);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable();
    struct allocation *a = r == CUDA_SUCCESS ? allocation_of(device, 1) : NULL;
    if (r == CUDA_SUCCESS && (a == NULL || data == NULL)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS && attribute == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) {
        *(int *)data = a->ctx->device;
    } else if (r == CUDA_SUCCESS && attribute == CU_POINTER_ATTRIBUTE_CONTEXT) {
        *(CUcontext *)data = a->ctx;
    } else if (r == CUDA_SUCCESS) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemHostRegister_v2(void *host, size_t bytes, unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS && (host == NULL || bytes == 0)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    for (struct registration *g = registrations; r == CUDA_SUCCESS && g != NULL; g = g->next) {
        if (host_overlaps(host, bytes, g->start, g->bytes)) {
            r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
        }
    }
    if (r == CUDA_SUCCESS) {
        struct registration *g = malloc(sizeof *g);
        if (g == NULL) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            g->start = (uintptr_t)host;
            g->bytes = bytes;
            g->next = registrations;
            registrations = g;
            stats.registrations++;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemHostUnregister(void *host) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct registration **link = &registrations;
    while (r == CUDA_SUCCESS && *link != NULL && (*link)->start != (uintptr_t)host) {
        link = &(*link)->next;
    }
    if (r == CUDA_SUCCESS && *link == NULL) {
        r = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    }
    if (r == CUDA_SUCCESS) {
        struct registration *g = *link;
        struct host_range range = {g->start, g->bytes};
        const struct op *op = queued_op(NULL, uses_host, &range);
        if (op != NULL) {
            violation("host memory unregistered while a copy queued on a stream still uses it", op);
        }
        *link = g->next;
        free(g);
        stats.registrations--;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* Checks a copy's arguments and resolves its stream; with `lock` held. */
static CUresult copy_args(CUdeviceptr device, const void *host, size_t bytes, CUstream handle, struct fake_stream **s) {
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS) {
        r = resolve(handle, s);
    }
    if (r == CUDA_SUCCESS && (host == NULL || allocation_of(device, bytes) == NULL)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    return r;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr device, const void *host, size_t bytes, CUstream handle) {
    pthread_mutex_lock(&lock);
    struct fake_stream *s = NULL;
    CUresult r = copy_args(device, host, bytes, handle, &s);
    if (r == CUDA_SUCCESS && injected_failure("cuMemcpyHtoDAsync_v2")) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        struct op op = {.kind = OP_HTOD, .device = device, .host = (void *)host, .bytes = bytes};
        stats.async_copies++;
        if (registered(host, bytes)) {
            op.host_hash = hash_bytes(host, bytes);
        } else {
            /* The driver stages pageable memory before it returns. */
            stats.unpinned_async_copies++;
            op.staged = malloc(bytes > 0 ? bytes : 1);
            if (op.staged != NULL) {
                memcpy(op.staged, host, bytes);
            }
        }
        if ((!registered(host, bytes) && op.staged == NULL) || enqueue(s, op) == 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemcpyDtoHAsync_v2(void *host, CUdeviceptr device, size_t bytes, CUstream handle) {
    pthread_mutex_lock(&lock);
    struct fake_stream *s = NULL;
    CUresult r = copy_args(device, host, bytes, handle, &s);
    if (r == CUDA_SUCCESS) {
        struct op op = {.kind = OP_DTOH, .device = device, .host = host, .bytes = bytes};
        stats.async_copies++;
        uint64_t seq = enqueue(s, op);
        if (seq == 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (!registered(host, bytes)) {
            /* Into pageable memory the driver returns once the copy has run. */
            stats.unpinned_async_copies++;
            wait_for_op(s, seq);
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* Synchronous copies run after the legacy stream's work, like the driver's. */
CUresult cuMemcpyDtoH_v2(void *host, CUdeviceptr device, size_t bytes) {
    pthread_mutex_lock(&lock);
    struct fake_stream *legacy = NULL;
    CUresult r = copy_args(device, host, bytes, (CUstream)STREAM_LEGACY, &legacy);
    if (r == CUDA_SUCCESS) {
        drain(legacy);
        struct allocation *a = allocation_of(device, bytes);
        if (a == NULL) {
            violation("device memory freed while a synchronous copy from it waited for the legacy stream", NULL);
        }
        struct range range = {device, bytes, 0, OP_HTOD};
        const struct op *op = queued_op(NULL, touches_device, &range);
        if (op != NULL) {
            violation("a synchronous copy read device memory that an earlier copy on a stream has not written yet",
                      op);
        }
        memcpy(host, a->memory + (device - a->device), bytes);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* ---- streams and events ---- */

CUresult cuStreamCreate(CUstream *out, unsigned flags) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS && (out == NULL || flags > 1)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        struct fake_stream *s = new_stream();
        if (s == NULL) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            stats.streams++;
            *out = s;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuStreamDestroy_v2(CUstream handle) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *s = NULL;
    if (r == CUDA_SUCCESS && ((uintptr_t)handle <= STREAM_PER_THREAD || resolve(handle, &s) != CUDA_SUCCESS)) {
        r = CUDA_ERROR_INVALID_HANDLE;
    }
    if (r == CUDA_SUCCESS) {
        /* As the driver does: queued work still runs, then the stream goes. */
        s->live = 0;
        stats.streams--;
        pthread_cond_broadcast(&progress);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuStreamSynchronize(CUstream handle) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *s = NULL;
    if (r == CUDA_SUCCESS) {
        r = resolve(handle, &s);
    }
    if (r == CUDA_SUCCESS) {
        drain(s);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuEventCreate(CUevent *out, unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS && out == NULL) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        struct fake_event *e = calloc(1, sizeof *e);
        if (e == NULL) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            e->ctx = current;
            e->refs = 1;
            e->next_live = events;
            events = e;
            stats.events++;
            *out = e;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuEventDestroy_v2(CUevent event) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS && !event_live(event)) {
        r = CUDA_ERROR_INVALID_HANDLE;
    }
    if (r == CUDA_SUCCESS) {
        struct fake_event **link = &events;
        while (*link != event) {
            link = &(*link)->next_live;
        }
        *link = event->next_live;
        stats.events--;
        release_event(event); /* queued records and waits keep it until they have run */
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuEventRecord(CUevent event, CUstream handle) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *s = NULL;
    if (r == CUDA_SUCCESS && !event_live(event)) {
        r = CUDA_ERROR_INVALID_HANDLE;
    }
    if (r == CUDA_SUCCESS) {
        r = resolve(handle, &s);
    }
    if (r == CUDA_SUCCESS && event->ctx != s->ctx) {
        r = CUDA_ERROR_INVALID_HANDLE; /* an event records on streams of its own context */
    }
    if (r == CUDA_SUCCESS && event->recorded == event->capacity) {
        size_t capacity = event->capacity == 0 ? 4 : 2 * event->capacity;
        unsigned char *done = realloc(event->done, capacity);
        if (done == NULL) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            memset(done + event->capacity, 0, capacity - event->capacity);
            event->done = done;
            event->capacity = capacity;
        }
    }
    if (r == CUDA_SUCCESS) {
        struct op op = {.kind = OP_RECORD, .event = event, .generation = event->recorded + 1};
        if (enqueue(s, op) == 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            event->recorded++;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuStreamWaitEvent(CUstream handle, CUevent event, unsigned flags) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *s = NULL;
    if (r == CUDA_SUCCESS && !event_live(event)) {
        r = CUDA_ERROR_INVALID_HANDLE;
    }
    if (r == CUDA_SUCCESS && flags != 0) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        r = resolve(handle, &s); /* the event may be of another context */
    }
    if (r == CUDA_SUCCESS && !generation_done(event, event->recorded)) {
        struct op op = {.kind = OP_WAIT, .event = event, .generation = event->recorded};
        if (enqueue(s, op) == 0) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuEventQuery(CUevent event) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS && !event_live(event)) {
        r = CUDA_ERROR_INVALID_HANDLE;
    }
    if (r == CUDA_SUCCESS && !generation_done(event, event->recorded)) {
        r = CUDA_ERROR_NOT_READY;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuEventSynchronize(CUevent event) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS && !event_live(event)) {
        r = CUDA_ERROR_INVALID_HANDLE;
    }
    if (r == CUDA_SUCCESS) {
        uint64_t wanted = event->recorded;
        event->refs++; /* destroyed by another thread meanwhile, it stays readable here */
        while (!generation_done(event, wanted)) {
            pthread_cond_wait(&progress, &lock);
        }
        release_event(event);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* ---- errors ---- */

static const char *error_text(CUresult r, int name) {
    switch (r) {
    case CUDA_SUCCESS: return name ? "CUDA_SUCCESS" : "no error";
    case CUDA_ERROR_INVALID_VALUE: return name ? "CUDA_ERROR_INVALID_VALUE" : "invalid argument";
    case CUDA_ERROR_OUT_OF_MEMORY: return name ? "CUDA_ERROR_OUT_OF_MEMORY" : "out of memory";
    case CUDA_ERROR_NOT_INITIALIZED: return name ? "CUDA_ERROR_NOT_INITIALIZED" : "initialization error";
    case CUDA_ERROR_INVALID_DEVICE: return name ? "CUDA_ERROR_INVALID_DEVICE" : "invalid device ordinal";
    case CUDA_ERROR_INVALID_CONTEXT: return name ? "CUDA_ERROR_INVALID_CONTEXT" : "invalid device context";
    case CUDA_ERROR_INVALID_HANDLE: return name ? "CUDA_ERROR_INVALID_HANDLE" : "invalid resource handle";
    case CUDA_ERROR_NOT_READY: return name ? "CUDA_ERROR_NOT_READY" : "device not ready";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        return name ? "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED" : "part or all of the requested memory range is already mapped";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
        return name ? "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED" : "pointer does not correspond to a registered memory region";
    default: return NULL;
    }
}

CUresult cuGetErrorString(CUresult r, const char **text) {
    *text = error_text(r, 0);
    return *text == NULL ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult r, const char **text) {
    *text = error_text(r, 1);
    return *text == NULL ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* ---- for tests ---- */

int granary_fake_cuda_stats(struct granary_fake_cuda_stats *out) {
    pthread_mutex_lock(&lock);
    *out = stats;
    pthread_mutex_unlock(&lock);
    return 0;
}
