/*
 * libcuda stand-in: exports the CUDA driver API symbols that gpulens probes, with the real
 * prototypes (cuda.h, 64-bit), so uprobes attach to it exactly as they would to the real
 * libcuda.so.1. Nothing runs on a GPU; instead a small timing model makes calls block the way a
 * driver does, which is what the back-pressure probes measure:
 *
 *   - every device has one timeline (shared between processes through an mmap'd file when
 *     GPULENS_STUB_STATE_DIR is set, so two processes on "GPU 0" contend for it); kernels and
 *     copies run on it in submission order, each for its duration;
 *   - a launch returns at once unless the process already has GPULENS_STUB_QUEUE_DEPTH (64)
 *     operations in flight, in which case it waits inside the launch call (as a full push buffer
 *     does; a real driver queues more, 64 keeps a periodic sync's wait short and visible);
 *   - cuCtxSynchronize / cuStreamSynchronize / cuEventSynchronize and the synchronous memcpys
 *     sleep until the work they wait for has finished on the timeline.
 *
 * Kernel durations come from the function name ("..._50us", "..._800ns") or GPULENS_STUB_KERNEL_NS.
 * Streams are modelled as one queue per process. CUDA graphs: stream capture (launches into a
 * capturing stream are recorded, not run; a graph launch there becomes a child graph), the graph
 * API (create, kernel and child-graph nodes, clone, conditional handles), instantiate, update and
 * launch; a graph launch runs its recorded kernels' time.
 * With GPULENS_STUB_STATE_DIR, each process with a context publishes "<dir>/gpu<N>/<pidns>.<pid>"
 * (memory in use, busy time) so the exporter's stub NVML view can count processes per GPU. The pid is
 * the process's own (in a container: its container's numbering), so it comes with the inode of its
 * PID namespace: the view finds the node's pid from the two, as NVML reports node pids.
 *
 * Other environment: GPULENS_STUB_DEVICES (1), GPULENS_STUB_LAUNCH_NS (host cost of a launch, 0),
 * GPULENS_STUB_PCIE_GBPS (copy bandwidth, 12), GPULENS_STUB_TOTAL_MEM (bytes, 80 GiB).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default"), noinline))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;   /* CUdeviceptr_v2 */
typedef unsigned int CUdeviceptr_v1;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;
typedef unsigned long long CUgraphConditionalHandle;
typedef struct {                          /* CUDA_KERNEL_NODE_PARAMS (v1/v2 start alike) */
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void **kernelParams;
    void **extra;
} CUDA_KERNEL_NODE_PARAMS;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
};

#define MAX_QUEUE 65536
#define STUB_MAGIC 0x67706c656e735354ULL /* "gplensST" */

struct stub_device_shared {
    uint64_t magic;
    _Atomic uint64_t busy_until_ns;
};

struct CUfunc_st { uint64_t duration_ns; char name[64]; };
struct CUgraph_st;
struct CUstream_st { int capturing; uint64_t capture_ns; unsigned capture_kernels; struct CUgraph_st *into; };
struct CUevent_st { uint64_t done_ns; };
struct CUgraph_st { uint64_t ns; unsigned kernels; int conditional; };
struct CUgraphExec_st { uint64_t ns; unsigned kernels; };
struct CUgraphNode_st { int unused; };
struct CUmod_st { int unused; };
struct CUctx_st { int device; };

struct allocation { CUdeviceptr ptr; size_t size; };

static struct {
    pthread_mutex_t lock;
    int initialized;
    int device_count;
    int device;                         /* -1 until a context exists */
    struct CUctx_st ctx;
    struct stub_device_shared private_dev;
    struct stub_device_shared *dev;
    uint64_t last_done_ns;
    uint64_t *pending;                  /* ring of completion times of queued work */
    unsigned head, count, depth;
    uint64_t busy_ns;
    uint64_t mem_bytes, total_mem;
    uint64_t launch_ns, kernel_ns;
    double bytes_per_ns;
    CUdeviceptr next_ptr;
    struct allocation *allocs;
    size_t nallocs, cap_allocs;
    char state_dir[4000];
    char proc_path[4160];
    int proc_fd;
    unsigned long long pidns;           /* inode of /proc/self/ns/pid; 0 when unreadable */
    struct CUmod_st module;
} S = { .lock = PTHREAD_MUTEX_INITIALIZER, .device = -1, .proc_fd = -1 };

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t) {
    struct timespec ts = { .tv_sec = (time_t)(t / 1000000000ull), .tv_nsec = (long)(t % 1000000000ull) };
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

static void spin_for(uint64_t ns) {
    if (!ns) return;
    uint64_t end = mono_ns() + ns;
    while (mono_ns() < end) {}
}

static uint64_t env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end = NULL;
    unsigned long long x = strtoull(v, &end, 10);
    return (end && *end == 0) ? (uint64_t)x : dflt;
}

/* The device timeline: private, or shared with every process of this state dir. */
static struct stub_device_shared *open_timeline(int device) {
    if (!S.state_dir[0]) return &S.private_dev;
    char path[4200];
    snprintf(path, sizeof path, "%s/gpu%d.timeline", S.state_dir, device);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return &S.private_dev;
    if (ftruncate(fd, 4096) != 0) { close(fd); return &S.private_dev; }
    void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return &S.private_dev;
    struct stub_device_shared *d = p;
    d->magic = STUB_MAGIC;
    return d;
}

/* "<state>/gpu<N>/<pidns>.<pid>": what the stub NVML view reads (pid, its namespace, memory, busy time). */
static void publish_locked(void) {
    if (S.proc_fd < 0) return;
    char buf[200];
    int n = snprintf(buf, sizeof buf, "pid=%d pidns=%llu device=%d mem=%llu busy_ns=%llu", (int)getpid(),
                     S.pidns, S.device, (unsigned long long)S.mem_bytes, (unsigned long long)S.busy_ns);
    memset(buf + n, ' ', sizeof buf - 1 - (size_t)n);
    buf[sizeof buf - 1] = '\n';
    if (pwrite(S.proc_fd, buf, sizeof buf, 0) < 0) { /* best effort */ }
}

static void unpublish(void) {
    if (S.proc_fd >= 0) { close(S.proc_fd); S.proc_fd = -1; unlink(S.proc_path); }
}

__attribute__((destructor)) static void stub_fini(void) { unpublish(); }

static void open_proc_file_locked(void) {
    if (!S.state_dir[0] || S.proc_fd >= 0) return;
    char dir[4120];
    snprintf(dir, sizeof dir, "%s/gpu%d", S.state_dir, S.device);
    mkdir(dir, 0755);
    struct stat ns;
    S.pidns = stat("/proc/self/ns/pid", &ns) == 0 ? (unsigned long long)ns.st_ino : 0;
    /* two containers on a node may both have a pid 7: the namespace keeps their files apart */
    snprintf(S.proc_path, sizeof S.proc_path, "%s/%llu.%d", dir, S.pidns, (int)getpid());
    S.proc_fd = open(S.proc_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    publish_locked();
}

/* Put `ns` of work on the device timeline; returns when it will be done. Waits (unlocked) while
 * the process already has `depth` operations in flight. */
static uint64_t enqueue(uint64_t ns) {
    pthread_mutex_lock(&S.lock);
    for (;;) {
        uint64_t now = mono_ns();
        while (S.count && S.pending[S.head] <= now) { S.head = (S.head + 1) % MAX_QUEUE; S.count--; }
        if (S.count < S.depth) break;
        uint64_t oldest = S.pending[S.head];
        pthread_mutex_unlock(&S.lock);
        sleep_until(oldest);
        pthread_mutex_lock(&S.lock);
    }
    uint64_t now = mono_ns(), start, end, busy = atomic_load(&S.dev->busy_until_ns);
    do {
        start = busy > now ? busy : now;
        end = start + ns;
    } while (!atomic_compare_exchange_weak(&S.dev->busy_until_ns, &busy, end));
    S.pending[(S.head + S.count) % MAX_QUEUE] = end;
    S.count++;
    S.last_done_ns = end;
    S.busy_ns += ns;
    pthread_mutex_unlock(&S.lock);
    return end;
}

static uint64_t last_done(void) {
    pthread_mutex_lock(&S.lock);
    uint64_t t = S.last_done_ns;
    publish_locked();
    pthread_mutex_unlock(&S.lock);
    return t;
}

static uint64_t copy_ns(size_t bytes) { return (uint64_t)((double)bytes / S.bytes_per_ns); }

static int is_heap_stream(CUstream s) { return (uintptr_t)s > 0x10; }

static CUresult launch(CUfunction f, CUstream s) {
    if (!S.initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (S.device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t ns = f->duration_ns ? f->duration_ns : S.kernel_ns;
    if (is_heap_stream(s) && s->capturing) {
        s->capture_ns += ns;
        s->capture_kernels++;
        return CUDA_SUCCESS;
    }
    spin_for(S.launch_ns);
    enqueue(ns);
    return CUDA_SUCCESS;
}

static CUresult ready(void) {
    if (!S.initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (S.device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

static CUresult copy_sync(size_t bytes) {
    CUresult r = ready();
    if (r) return r;
    sleep_until(enqueue(copy_ns(bytes)));
    pthread_mutex_lock(&S.lock);
    publish_locked();
    pthread_mutex_unlock(&S.lock);
    return CUDA_SUCCESS;
}

static CUresult copy_async(size_t bytes) {
    CUresult r = ready();
    if (r) return r;
    enqueue(copy_ns(bytes));
    return CUDA_SUCCESS;
}

static CUresult wait_all(void) {
    CUresult r = ready();
    if (r) return r;
    sleep_until(last_done());
    return CUDA_SUCCESS;
}

/* ---- initialisation, devices, contexts ---- */

EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&S.lock);
    if (!S.initialized) {
        const char *dir = getenv("GPULENS_STUB_STATE_DIR");
        if (dir && *dir) snprintf(S.state_dir, sizeof S.state_dir, "%s", dir);
        S.device_count = (int)env_u64("GPULENS_STUB_DEVICES", 1);
        S.depth = (unsigned)env_u64("GPULENS_STUB_QUEUE_DEPTH", 64);
        if (S.depth < 1) S.depth = 1;
        if (S.depth > MAX_QUEUE) S.depth = MAX_QUEUE;
        S.launch_ns = env_u64("GPULENS_STUB_LAUNCH_NS", 0);
        S.kernel_ns = env_u64("GPULENS_STUB_KERNEL_NS", 0);
        uint64_t gbps = env_u64("GPULENS_STUB_PCIE_GBPS", 12);
        S.bytes_per_ns = gbps ? (double)gbps : 12.0;
        S.total_mem = env_u64("GPULENS_STUB_TOTAL_MEM", 80ull << 30);
        S.pending = calloc(MAX_QUEUE, sizeof *S.pending);
        S.next_ptr = 0x7f0000000000ull;
        S.initialized = S.pending != NULL;
    }
    pthread_mutex_unlock(&S.lock);
    return S.initialized ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 12040;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    if (!S.initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = S.device_count;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!S.initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= S.device_count) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    if (!S.initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= S.device_count) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "gpulens stub GPU %d", dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (!S.initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= S.device_count) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = S.total_mem;
    return CUDA_SUCCESS;
}

static CUresult make_context(CUcontext *pctx, CUdevice dev) {
    if (!S.initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= S.device_count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&S.lock);
    if (S.device >= 0 && S.device != dev) {   /* one device per process in this model */
        pthread_mutex_unlock(&S.lock);
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if (S.device < 0) {
        S.device = dev;
        S.ctx.device = dev;
        S.dev = open_timeline(dev);
        open_proc_file_locked();
    }
    pthread_mutex_unlock(&S.lock);
    *pctx = &S.ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return make_context(pctx, dev);
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) { return make_context(pctx, dev); }

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) { return ctx == NULL || ctx == &S.ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }

EXPORT CUresult cuCtxGetDevice(CUdevice *dev) {
    CUresult r = ready();
    if (r) return r;
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    *dev = S.device;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (ctx != &S.ctx) return CUDA_ERROR_INVALID_CONTEXT;
    wait_all();
    pthread_mutex_lock(&S.lock);
    unpublish();
    S.device = -1;
    pthread_mutex_unlock(&S.lock);
    return CUDA_SUCCESS;
}

/* ---- modules and functions ---- */

EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    if (!module || !fname) return CUDA_ERROR_INVALID_VALUE;
    *module = &S.module;
    return ready();
}

EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    *module = &S.module;
    return ready();
}

/* Duration from the name: "gemm_50us" runs 50 µs, "relu_800ns" 800 ns. */
static uint64_t duration_from_name(const char *name) {
    const char *us = strrchr(name, '_');
    if (!us) return 0;
    char *end = NULL;
    unsigned long long v = strtoull(us + 1, &end, 10);
    if (!end || end == us + 1) return 0;
    if (strcmp(end, "us") == 0) return v * 1000ull;
    if (strcmp(end, "ns") == 0) return v;
    if (strcmp(end, "ms") == 0) return v * 1000000ull;
    return 0;
}

EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    if (!hfunc || !hmod || !name) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = ready();
    if (r) return r;
    struct CUfunc_st *f = calloc(1, sizeof *f);
    if (!f) return CUDA_ERROR_OUT_OF_MEMORY;
    snprintf(f->name, sizeof f->name, "%s", name);
    f->duration_ns = duration_from_name(name);
    *hfunc = f;
    return CUDA_SUCCESS;
}

/* ---- streams, events, graphs ---- */

EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags) {
    (void)flags;
    if (!phStream) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = ready();
    if (r) return r;
    *phStream = calloc(1, sizeof(struct CUstream_st));
    return *phStream ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    if (!is_heap_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    free(s);
    return CUDA_SUCCESS;
}

static CUresult begin_capture(CUstream s, CUgraph into) {
    if (!is_heap_stream(s)) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;  /* legacy stream */
    s->capturing = 1;
    s->capture_ns = 0;
    s->capture_kernels = 0;
    s->into = into;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamBeginCapture(CUstream s) { return begin_capture(s, NULL); }
EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream s) { return begin_capture(s, NULL); }
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode) { (void)mode; return begin_capture(s, NULL); }
EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, int mode) { (void)mode; return begin_capture(s, NULL); }
EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps, const void *edges,
                                            size_t ndeps, int mode) {
    (void)deps; (void)edges; (void)ndeps; (void)mode;
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    return begin_capture(s, g);
}

EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode *deps, const void *edges,
                                                 size_t ndeps, int mode) {
    (void)deps; (void)edges; (void)ndeps; (void)mode;
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    return begin_capture(s, g);
}

static CUresult end_capture(CUstream s, CUgraph *phGraph) {
    if (!is_heap_stream(s) || !s->capturing || !phGraph) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *g = s->into ? s->into : calloc(1, sizeof *g);
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    g->ns += s->capture_ns;
    g->kernels += s->capture_kernels;
    s->capturing = 0;
    s->into = NULL;
    *phGraph = g;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *phGraph) { return end_capture(s, phGraph); }
EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *phGraph) { return end_capture(s, phGraph); }

EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    if (!phGraph || flags) return CUDA_ERROR_INVALID_VALUE;
    *phGraph = calloc(1, sizeof(struct CUgraph_st));
    return *phGraph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static struct CUgraphNode_st the_node;

static CUresult add_kernel_node(CUgraphNode *ph, CUgraph g, const CUDA_KERNEL_NODE_PARAMS *p) {
    if (!ph || !g || !p || !p->func) return CUDA_ERROR_INVALID_VALUE;
    g->kernels++;
    g->ns += p->func->duration_ns ? p->func->duration_ns : S.kernel_ns;
    *ph = &the_node;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t n,
                                     const CUDA_KERNEL_NODE_PARAMS *p) { (void)deps; (void)n; return add_kernel_node(ph, g, p); }
EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t n,
                                        const CUDA_KERNEL_NODE_PARAMS *p) { (void)deps; (void)n; return add_kernel_node(ph, g, p); }

EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t n, CUgraph child) {
    (void)deps; (void)n;
    if (!ph || !g || !child) return CUDA_ERROR_INVALID_VALUE;
    g->kernels += child->kernels;
    g->ns += child->ns;
    g->conditional |= child->conditional;
    *ph = &the_node;
    return CUDA_SUCCESS;
}

/* A conditional node runs its body 0..n times, decided on the device: the stand-in runs it never. */
EXPORT CUresult cuGraphConditionalHandleCreate(CUgraphConditionalHandle *h, CUgraph g, CUcontext ctx,
                                               unsigned int dflt, unsigned int flags) {
    (void)ctx; (void)dflt; (void)flags;
    if (!h || !g) return CUDA_ERROR_INVALID_VALUE;
    g->conditional = 1;
    *h = 1;
    return CUDA_SUCCESS;
}

/* A node of any type (CUgraphNodeParams): the stand-in does not model it; it exists to be probed. */
static CUresult add_generic_node(CUgraphNode *ph, CUgraph g, const void *params) {
    if (!ph || !g || !params) return CUDA_ERROR_INVALID_VALUE;
    g->conditional = 1;
    *ph = &the_node;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t n, const void *params) {
    (void)deps; (void)n;
    return add_generic_node(ph, g, params);
}
EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, const void *edges, size_t n,
                                  const void *params) {
    (void)deps; (void)edges; (void)n;
    return add_generic_node(ph, g, params);
}

EXPORT CUresult cuGraphClone(CUgraph *phClone, CUgraph g) {
    if (!phClone || !g) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *c = malloc(sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    *c = *g;
    *phClone = c;
    return CUDA_SUCCESS;
}

static CUresult instantiate(CUgraphExec *phExec, CUgraph g) {
    if (!phExec || !g) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->ns = g->ns;
    e->kernels = g->kernels;
    *phExec = e;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phExec, CUgraph g, unsigned long long flags) {
    (void)flags;
    return instantiate(phExec, g);
}
EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phExec, CUgraph g, void *params) {
    (void)params;
    return instantiate(phExec, g);
}
EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phExec, CUgraph g, CUgraphNode *err, char *log, size_t n) {
    (void)err; (void)log; (void)n;
    return instantiate(phExec, g);
}
EXPORT CUresult cuGraphInstantiate(CUgraphExec *phExec, CUgraph g, CUgraphNode *err, char *log, size_t n) {
    (void)err; (void)log; (void)n;
    return instantiate(phExec, g);
}
EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phExec, CUgraph g, void *params) {
    (void)params;
    return instantiate(phExec, g);
}

static CUresult exec_update(CUgraphExec e, CUgraph g) {
    if (!e || !g) return CUDA_ERROR_INVALID_VALUE;
    e->ns = g->ns;
    e->kernels = g->kernels;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec e, CUgraph g, void *result) { (void)result; return exec_update(e, g); }
EXPORT CUresult cuGraphExecUpdate(CUgraphExec e, CUgraph g, CUgraphNode *err, void *result) {
    (void)err; (void)result;
    return exec_update(e, g);
}

EXPORT CUresult cuGraphDestroy(CUgraph g) { free(g); return CUDA_SUCCESS; }
EXPORT CUresult cuGraphExecDestroy(CUgraphExec e) { free(e); return CUDA_SUCCESS; }

static CUresult graph_launch(CUgraphExec e, CUstream s) {
    CUresult r = ready();
    if (r) return r;
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (is_heap_stream(s) && s->capturing) {     /* a child graph of the graph being captured */
        s->capture_ns += e->ns;
        s->capture_kernels += e->kernels;
        return CUDA_SUCCESS;
    }
    spin_for(S.launch_ns);
    enqueue(e->ns);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream s) { return graph_launch(e, s); }
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s) { return graph_launch(e, s); }

EXPORT CUresult cuEventCreate(CUevent *ph, unsigned int flags) {
    (void)flags;
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = ready();
    if (r) return r;
    *ph = calloc(1, sizeof(struct CUevent_st));
    return *ph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuEventRecord(CUevent e, CUstream s) {
    (void)s;
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = ready();
    if (r) return r;
    pthread_mutex_lock(&S.lock);
    e->done_ns = S.last_done_ns;
    pthread_mutex_unlock(&S.lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(CUevent e) { free(e); return CUDA_SUCCESS; }

/* ---- launches (entry-probed: demand) ---- */

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                               unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                               CUstream s, void **params, void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)params; (void)extra;
    return launch(f, s);
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                    unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                    CUstream s, void **params, void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)params; (void)extra;
    return launch(f, s);
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra) {
    (void)params; (void)extra;
    if (!cfg) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, cfg->hStream);
}

EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra) {
    (void)params; (void)extra;
    if (!cfg) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, cfg->hStream);
}

EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                          unsigned int bx, unsigned int by, unsigned int bz,
                                          unsigned int shmem, CUstream s, void **params) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)params;
    return launch(f, s);
}

EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                               unsigned int bx, unsigned int by, unsigned int bz,
                                               unsigned int shmem, CUstream s, void **params) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)params;
    return launch(f, s);
}

/* ---- blocking calls (entry+return probed: back-pressure) ---- */

EXPORT CUresult cuCtxSynchronize(void) { return wait_all(); }
EXPORT CUresult cuStreamSynchronize(CUstream s) { (void)s; return wait_all(); }
EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { (void)s; return wait_all(); }

EXPORT CUresult cuEventSynchronize(CUevent e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = ready();
    if (r) return r;
    sleep_until(e->done_ns);
    return CUDA_SUCCESS;
}

/* ---- memory ---- */

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    CUresult r = ready();
    if (r) return r;
    if (!dptr || !bytes) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&S.lock);
    if (S.mem_bytes + bytes > S.total_mem) { pthread_mutex_unlock(&S.lock); return CUDA_ERROR_OUT_OF_MEMORY; }
    if (S.nallocs == S.cap_allocs) {
        size_t cap = S.cap_allocs ? S.cap_allocs * 2 : 64;
        struct allocation *a = realloc(S.allocs, cap * sizeof *a);
        if (!a) { pthread_mutex_unlock(&S.lock); return CUDA_ERROR_OUT_OF_MEMORY; }
        S.allocs = a;
        S.cap_allocs = cap;
    }
    *dptr = S.next_ptr;
    S.allocs[S.nallocs++] = (struct allocation){ S.next_ptr, bytes };
    S.next_ptr += (bytes + 511) & ~511ull;
    S.mem_bytes += bytes;
    publish_locked();
    pthread_mutex_unlock(&S.lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult r = ready();
    if (r) return r;
    pthread_mutex_lock(&S.lock);
    for (size_t i = 0; i < S.nallocs; i++) {
        if (S.allocs[i].ptr == dptr) {
            S.mem_bytes -= S.allocs[i].size;
            S.allocs[i] = S.allocs[--S.nallocs];
            publish_locked();
            pthread_mutex_unlock(&S.lock);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&S.lock);
    return CUDA_ERROR_INVALID_VALUE;
}

/* ---- copies (ByteCount is argument 3 in every form: transfers) ---- */

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { (void)dst; (void)src; return copy_sync(n); }
EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) { (void)dst; (void)src; return copy_sync(n); }
EXPORT CUresult cuMemcpyHtoD(CUdeviceptr_v1 dst, const void *src, unsigned int n) { (void)dst; (void)src; return copy_sync(n); }
EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; return copy_sync(n); }
EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) { (void)dst; (void)src; return copy_sync(n); }
EXPORT CUresult cuMemcpyDtoH(void *dst, CUdeviceptr_v1 src, unsigned int n) { (void)dst; (void)src; return copy_sync(n); }

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) { (void)dst; (void)src; (void)s; return copy_async(n); }
EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s) { (void)dst; (void)src; (void)s; return copy_async(n); }
EXPORT CUresult cuMemcpyHtoDAsync(CUdeviceptr_v1 dst, const void *src, unsigned int n, CUstream s) { (void)dst; (void)src; (void)s; return copy_async(n); }
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) { (void)dst; (void)src; (void)s; return copy_async(n); }
EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s) { (void)dst; (void)src; (void)s; return copy_async(n); }
EXPORT CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr_v1 src, unsigned int n, CUstream s) { (void)dst; (void)src; (void)s; return copy_async(n); }
