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
 * - Calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT when none is current on the
 *   calling thread; calls in a process forked after cuInit fail with CUDA_ERROR_NOT_INITIALIZED.
 * - Protocol violations the driver would not report (the results would be silently wrong) abort
 *   the process with a message naming them: a host buffer changed between an asynchronous copy
 *   from it being enqueued and the copy running; a copy that writes device memory while a read of
 *   the same bytes enqueued earlier on another stream has not run (or reads while such a write has
 *   not run); device memory freed, or host memory unregistered, while queued work still uses it.
 *
 * `granary_fake_cuda_stats` reports live objects and counters, for tests that check nothing
 * leaked. Blocking streams are treated like non-blocking ones (no implicit synchronisation with
 * the legacy stream): stricter than the driver, never looser. One context per device.
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

#define MAX_DEVICES 8
#define STREAM_LEGACY ((uintptr_t)1)
#define STREAM_PER_THREAD ((uintptr_t)2)

struct fake_ctx {
    int device;
    int retained;
};

enum op_kind { OP_HTOD, OP_DTOH, OP_RECORD, OP_WAIT };

struct op {
    enum op_kind kind;
    uint64_t seq; /* enqueue order, process-wide */
    struct op *next;
    CUdeviceptr device; /* HTOD: destination; DTOH: source */
    void *host;         /* HTOD: source; DTOH: destination */
    size_t bytes;
    uint64_t host_hash; /* HTOD: the source bytes' hash when enqueued */
    struct fake_event *event;
    uint64_t generation; /* RECORD: the record this completes; WAIT: the one waited for */
};

struct fake_stream {
    struct fake_stream *next; /* in `streams` */
    int live;                 /* a valid handle: created and not destroyed (or a default stream) */
    struct op *head, *tail;
    int destroyed; /* no new work; the thread frees the stream once the queue is empty */
    unsigned int seed;
    pthread_t thread;
};

struct fake_event {
    uint64_t recorded; /* generation of the latest record */
    uint64_t done;     /* generation of the latest record the stream has passed */
    int destroyed;     /* the handle is no longer valid */
    int refs;          /* the handle (until destroyed) + queued ops */
};

struct allocation {
    struct allocation *next;
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
/* Every stream with a thread: created ones, the default ones, destroyed ones still draining. */
static struct fake_stream *streams;
static struct fake_stream *legacy_stream;
static struct allocation *allocations;
static struct registration *registrations;
static struct granary_fake_cuda_stats stats;
static __thread CUcontext current;
static __thread struct fake_stream *per_thread_stream;

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
    uint64_t before; /* only ops enqueued before this sequence number */
    enum op_kind kind;
};

static int touches_device(const struct op *op, const void *arg) {
    const struct range *r = arg;
    return (op->kind == OP_HTOD || op->kind == OP_DTOH) && (r->before == 0 || op->seq < r->before) &&
           (r->kind == (enum op_kind)-1 || op->kind == r->kind) && overlaps(op->device, op->bytes, r->device, r->bytes);
}

struct host_range {
    uintptr_t start;
    size_t bytes;
};

static int reads_host(const struct op *op, const void *arg) {
    const struct host_range *r = arg;
    return op->kind == OP_HTOD && host_overlaps(op->host, op->bytes, r->start, r->bytes);
}

static void release_event(struct fake_event *event) {
    if (--event->refs == 0) {
        free(event);
    }
}

/* Runs the head op of `s`; with `lock` held (released while a copy waits its delay). */
static void run(struct fake_stream *s, struct op *op) {
    switch (op->kind) {
    case OP_WAIT:
        while (op->event->done < op->generation) {
            pthread_cond_wait(&progress, &lock);
        }
        break;
    case OP_RECORD:
        if (op->event->done < op->generation) {
            op->event->done = op->generation;
        }
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
        if (op->kind == OP_HTOD) {
            if (hash_bytes(op->host, op->bytes) != op->host_hash) {
                violation("the host source of an asynchronous copy changed before the copy ran", op);
            }
            memcpy(memory, op->host, op->bytes);
        } else {
            memcpy(op->host, memory, op->bytes);
        }
        break;
    }
    }
}

static void *stream_thread(void *arg) {
    struct fake_stream *s = arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (s->head == NULL && !s->destroyed) {
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
        stats.queued_ops--;
        if (op->event != NULL) {
            release_event(op->event);
        }
        free(op);
        pthread_cond_broadcast(&progress);
    }
    struct fake_stream **link = &streams;
    while (*link != s) {
        link = &(*link)->next;
    }
    *link = s->next;
    pthread_mutex_unlock(&lock);
    free(s);
    return NULL;
}

/* A stream and its thread; with `lock` held (the thread starts once it is released). */
static struct fake_stream *new_stream(void) {
    struct fake_stream *s = calloc(1, sizeof *s);
    if (s == NULL) {
        return NULL;
    }
    s->live = 1;
    s->seed = (unsigned)(uintptr_t)s ^ (unsigned)time(NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&s->thread, &attr, stream_thread, s);
    pthread_attr_destroy(&attr);
    if (failed) {
        free(s);
        return NULL;
    }
    s->next = streams;
    streams = s;
    return s;
}

/* The stream a handle names (0 and 1: the legacy stream; 2: this thread's default stream). */
static CUresult resolve(CUstream handle, struct fake_stream **out) {
    uintptr_t raw = (uintptr_t)handle;
    if (raw == 0 || raw == STREAM_LEGACY || raw == STREAM_PER_THREAD) {
        struct fake_stream **slot = raw == STREAM_PER_THREAD ? &per_thread_stream : &legacy_stream;
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

static CUresult enqueue(struct fake_stream *s, struct op op) {
    struct op *queued = malloc(sizeof *queued);
    if (queued == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
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
    return CUDA_SUCCESS;
}

static int event_live(CUevent event) {
    return event != NULL && !event->destroyed;
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
    CUresult r = usable();
    if (r == CUDA_SUCCESS && (ordinal < 0 || ordinal >= devices)) {
        r = CUDA_ERROR_INVALID_DEVICE;
    }
    if (r == CUDA_SUCCESS) {
        *device = ordinal;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable();
    if (r == CUDA_SUCCESS && (device < 0 || device >= devices)) {
        r = CUDA_ERROR_INVALID_DEVICE;
    }
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
    CUresult r = usable();
    if (r == CUDA_SUCCESS && (device < 0 || device >= devices)) {
        r = CUDA_ERROR_INVALID_DEVICE;
    }
    if (r == CUDA_SUCCESS) {
        *bytes = (size_t)memory_limit;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable();
    if (r == CUDA_SUCCESS && (device < 0 || device >= devices)) {
        r = CUDA_ERROR_INVALID_DEVICE;
    }
    if (r == CUDA_SUCCESS) {
        contexts[device].retained++;
        *ctx = &contexts[device];
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    pthread_mutex_lock(&lock);
    CUresult r = usable();
    if (r == CUDA_SUCCESS && (device < 0 || device >= devices || contexts[device].retained == 0)) {
        r = CUDA_ERROR_INVALID_DEVICE;
    }
    if (r == CUDA_SUCCESS) {
        contexts[device].retained--;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned *flags, int *active) {
    pthread_mutex_lock(&lock);
    CUresult r = usable();
    if (r == CUDA_SUCCESS && (device < 0 || device >= devices)) {
        r = CUDA_ERROR_INVALID_DEVICE;
    }
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
    if (r == CUDA_SUCCESS && ctx != NULL && (ctx < &contexts[0] || ctx >= &contexts[MAX_DEVICES] || ctx->retained == 0)) {
        r = CUDA_ERROR_INVALID_CONTEXT;
    }
    if (r == CUDA_SUCCESS) {
        current = ctx;
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
    struct allocation *a = NULL;
    if (r == CUDA_SUCCESS) {
        a = calloc(1, sizeof *a);
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
        struct range whole = {a->device, a->bytes, 0, (enum op_kind)-1};
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
        const struct op *op = queued_op(NULL, reads_host, &range);
        if (op != NULL) {
            violation("host memory unregistered while a copy queued on a stream still reads it", op);
        }
        *link = g->next;
        free(g);
        stats.registrations--;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr device, const void *host, size_t bytes, CUstream handle) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *s = NULL;
    if (r == CUDA_SUCCESS) {
        r = resolve(handle, &s);
    }
    if (r == CUDA_SUCCESS && (host == NULL || allocation_of(device, bytes) == NULL)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        struct op op = {.kind = OP_HTOD, .device = device, .host = (void *)host, .bytes = bytes};
        op.host_hash = hash_bytes(host, bytes);
        stats.async_copies++;
        if (!registered(host, bytes)) {
            stats.unpinned_async_copies++;
        }
        r = enqueue(s, op);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemcpyDtoHAsync_v2(void *host, CUdeviceptr device, size_t bytes, CUstream handle) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *s = NULL;
    if (r == CUDA_SUCCESS) {
        r = resolve(handle, &s);
    }
    if (r == CUDA_SUCCESS && (host == NULL || allocation_of(device, bytes) == NULL)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        struct op op = {.kind = OP_DTOH, .device = device, .host = host, .bytes = bytes};
        stats.async_copies++;
        if (!registered(host, bytes)) {
            stats.unpinned_async_copies++;
        }
        r = enqueue(s, op);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* Waits until `s` has run everything queued on it; with `lock` held. */
static void drain(struct fake_stream *s) {
    while (s->head != NULL) {
        pthread_cond_wait(&progress, &lock);
    }
}

/* Synchronous copies are ordered after the legacy stream's work, like the driver's. */
CUresult cuMemcpyDtoH_v2(void *host, CUdeviceptr device, size_t bytes) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *legacy = NULL;
    if (r == CUDA_SUCCESS) {
        r = resolve((CUstream)STREAM_LEGACY, &legacy);
    }
    if (r == CUDA_SUCCESS && (host == NULL || allocation_of(device, bytes) == NULL)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        drain(legacy);
        struct range range = {device, bytes, 0, OP_HTOD};
        const struct op *op = queued_op(NULL, touches_device, &range);
        if (op != NULL) {
            violation("a synchronous copy read device memory that an earlier copy on a stream has not written yet",
                      op);
        }
        struct allocation *a = allocation_of(device, bytes);
        memcpy(host, a->memory + (device - a->device), bytes);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr device, const void *host, size_t bytes) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *legacy = NULL;
    if (r == CUDA_SUCCESS) {
        r = resolve((CUstream)STREAM_LEGACY, &legacy);
    }
    if (r == CUDA_SUCCESS && (host == NULL || allocation_of(device, bytes) == NULL)) {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        drain(legacy);
        struct range range = {device, bytes, 0, (enum op_kind)-1};
        const struct op *op = queued_op(NULL, touches_device, &range);
        if (op != NULL) {
            violation("a synchronous copy wrote device memory that a copy queued on a stream still uses", op);
        }
        struct allocation *a = allocation_of(device, bytes);
        memcpy(a->memory + (device - a->device), host, bytes);
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
        /* As the driver does: queued work still runs, then the stream goes (its thread frees it). */
        s->live = 0;
        s->destroyed = 1;
        stats.streams--;
        pthread_cond_broadcast(&progress);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

static int queued_before(const struct op *op, const void *arg) {
    return op->seq < *(const uint64_t *)arg;
}

/* Waits for the work queued so far on every stream (work queued meanwhile is not waited for). */
CUresult cuCtxSynchronize(void) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    if (r == CUDA_SUCCESS) {
        uint64_t before = next_seq;
        while (queued_op(NULL, queued_before, &before) != NULL) {
            pthread_cond_wait(&progress, &lock);
        }
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
            e->refs = 1;
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
        event->destroyed = 1;
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
    if (r == CUDA_SUCCESS) {
        struct op op = {.kind = OP_RECORD, .event = event, .generation = ++event->recorded};
        r = enqueue(s, op);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuStreamWaitEvent(CUstream handle, CUevent event, unsigned flags) {
    pthread_mutex_lock(&lock);
    CUresult r = usable_with_context();
    struct fake_stream *s = NULL;
    if (r == CUDA_SUCCESS && (!event_live(event) || flags != 0)) {
        r = !event_live(event) ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_VALUE;
    }
    if (r == CUDA_SUCCESS) {
        r = resolve(handle, &s);
    }
    if (r == CUDA_SUCCESS && event->done < event->recorded) {
        struct op op = {.kind = OP_WAIT, .event = event, .generation = event->recorded};
        r = enqueue(s, op);
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
    if (r == CUDA_SUCCESS && event->done < event->recorded) {
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
        while (event->done < wanted) {
            pthread_cond_wait(&progress, &lock);
        }
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
