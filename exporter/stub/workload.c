/*
 * cuda-workload: a training-loop stand-in that drives a CUDA driver library through the driver
 * API, loaded with dlopen the way libcudart loads libcuda.so.1. It counts what it calls and
 * times how long it is blocked, so tests can compare the exporter's numbers with its own.
 *
 * One step = host work, H2D batch copy, K kernel launches, G graph launches (G distinct graphs of
 * --graph-kernels kernels each, built before the loop by --graph-build), optional synchronous
 * D2H copies, and every S steps a "loss.item()" (4-byte D2H async copy + stream sync).
 * Incident presets (DESIGN.md): host_sync (a full-tensor synchronous D2H copy every step),
 * input_starvation (host work per step multiplied by --throttle), noisy_neighbor (be the other
 * team's batch job: long kernels, one sync per step). --control FILE is re-read every 100 ms so a
 * running workload can switch incidents (keys: kernels kernel_us h2d_bytes d2h_sync_bytes host_us
 * sync_every incident stop).
 *
 * Output: "ready <pid>" (with --wait-stdin) and one JSON report line on stdout at the end.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *H;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    H hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef CUresult (*fn_init)(unsigned);
typedef CUresult (*fn_devget)(int *, int);
typedef CUresult (*fn_ctxcreate)(H *, unsigned, int);
typedef CUresult (*fn_modload)(H *, const void *);
typedef CUresult (*fn_getfunc)(H *, H, const char *);
typedef CUresult (*fn_streamcreate)(H *, unsigned);
typedef CUresult (*fn_launch)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, H, void **, void **);
typedef CUresult (*fn_launch_coop)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, H, void **);
typedef CUresult (*fn_launch_ex)(const CUlaunchConfig *, H, void **, void **);
typedef CUresult (*fn_h)(H);
typedef CUresult (*fn_v)(void);
typedef CUresult (*fn_hh)(H, H);
typedef CUresult (*fn_evcreate)(H *, unsigned);
typedef CUresult (*fn_alloc)(CUdeviceptr *, size_t);
typedef CUresult (*fn_h2d)(CUdeviceptr, const void *, size_t);
typedef CUresult (*fn_h2d_legacy)(unsigned, const void *, unsigned);
typedef CUresult (*fn_h2d_async)(CUdeviceptr, const void *, size_t, H);
typedef CUresult (*fn_d2h)(void *, CUdeviceptr, size_t);
typedef CUresult (*fn_d2h_legacy)(void *, unsigned, unsigned);
typedef CUresult (*fn_d2h_async)(void *, CUdeviceptr, size_t, H);
typedef CUresult (*fn_begincap)(H, int);
typedef CUresult (*fn_endcap)(H, H *);
typedef CUresult (*fn_inst)(H *, H, unsigned long long);
typedef CUresult (*fn_inst_params)(H *, H, void *);
typedef CUresult (*fn_inst_legacy)(H *, H, H *, char *, size_t);
typedef CUresult (*fn_begincap_v1)(H);
typedef CUresult (*fn_cap_to_graph)(H, H, const H *, const void *, size_t, int);
typedef CUresult (*fn_graph_create)(H *, unsigned);
typedef CUresult (*fn_add_kernel)(H *, H, const H *, size_t, const void *);
typedef CUresult (*fn_add_child)(H *, H, const H *, size_t, H);
typedef CUresult (*fn_cond)(unsigned long long *, H, H, unsigned, unsigned);
typedef CUresult (*fn_clone)(H *, H);
typedef CUresult (*fn_exec_update)(H, H, void *);
typedef struct {
    H func;
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void **kernelParams;
    void **extra;
} KernelNodeParams;

static struct {
    fn_init cuInit; fn_devget cuDeviceGet; fn_ctxcreate cuCtxCreate_v2; fn_modload cuModuleLoadData;
    fn_getfunc cuModuleGetFunction; fn_streamcreate cuStreamCreate;
    fn_launch cuLaunchKernel, cuLaunchKernel_ptsz; fn_launch_ex cuLaunchKernelEx, cuLaunchKernelEx_ptsz;
    fn_launch_coop cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz;
    fn_v cuCtxSynchronize; fn_h cuStreamSynchronize, cuStreamSynchronize_ptsz, cuEventSynchronize;
    fn_evcreate cuEventCreate; fn_hh cuEventRecord;
    fn_alloc cuMemAlloc_v2;
    fn_h2d cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds; fn_h2d_legacy cuMemcpyHtoD;
    fn_h2d_async cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz;
    fn_d2h cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds; fn_d2h_legacy cuMemcpyDtoH;
    fn_d2h_async cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz;
    fn_begincap cuStreamBeginCapture_v2; fn_endcap cuStreamEndCapture; fn_inst cuGraphInstantiateWithFlags;
    fn_hh cuGraphLaunch, cuGraphLaunch_ptsz;
    fn_begincap_v1 cuStreamBeginCapture; fn_begincap cuStreamBeginCapture_v2_ptsz; fn_endcap cuStreamEndCapture_ptsz;
    fn_cap_to_graph cuStreamBeginCaptureToGraph; fn_graph_create cuGraphCreate;
    fn_add_kernel cuGraphAddKernelNode, cuGraphAddKernelNode_v2; fn_add_child cuGraphAddChildGraphNode;
    fn_cond cuGraphConditionalHandleCreate; fn_clone cuGraphClone;
    fn_inst_params cuGraphInstantiateWithParams; fn_inst_legacy cuGraphInstantiate_v2;
    fn_exec_update cuGraphExecUpdate_v2;
} D;

static struct {
    const char *lib; int device; long steps; double duration; long kernels; long kernel_us;
    const char *launch_api; long graphs; long graph_kernels; const char *graph_build; int graph_conditional;
    int graphs_early; int graph_update;
    long h2d_bytes; const char *h2d_api; long d2h_sync_bytes; const char *d2h_api; long d2h_async_bytes;
    long sync_every; const char *sync_api; long host_us; int host_sleep; const char *incident;
    long throttle; const char *control; int wait_stdin; int unload; const char *report;
} O = { "libcuda.so.1", 0, 100, 0, 100, 0, "plain", 0, 4, "capture", 0, 0, 0, 0, "async", 0, "sync", 0, 1, "stream",
        0, 0, "none", 6, NULL, 0, 0, NULL };

static struct {
    long steps, launches, captured_launches, graph_launches, graph_kernels, graph_unknown, h2d_calls, d2h_calls,
        sync_calls;
    unsigned long long h2d_bytes, d2h_bytes;
    double sync_seconds;
} R;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what, int code) {
    fprintf(stderr, "cuda-workload: %s failed (%d)\n", what, code);
    exit(2);
}
#define CHECK(call, what) do { CUresult _r = (call); if (_r) die(what, _r); } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) { fprintf(stderr, "cuda-workload: missing symbol %s\n", name); exit(2); }
    return p;
}

static void load(void *lib) {
#define L(name) D.name = sym(lib, #name)
    L(cuInit); L(cuDeviceGet); L(cuCtxCreate_v2); L(cuModuleLoadData); L(cuModuleGetFunction);
    L(cuStreamCreate); L(cuLaunchKernel); L(cuLaunchKernel_ptsz); L(cuLaunchKernelEx);
    L(cuLaunchKernelEx_ptsz); L(cuLaunchCooperativeKernel); L(cuLaunchCooperativeKernel_ptsz);
    L(cuCtxSynchronize); L(cuStreamSynchronize); L(cuStreamSynchronize_ptsz); L(cuEventSynchronize);
    L(cuEventCreate); L(cuEventRecord); L(cuMemAlloc_v2); L(cuMemcpyHtoD_v2); L(cuMemcpyHtoD_v2_ptds);
    L(cuMemcpyHtoD); L(cuMemcpyHtoDAsync_v2); L(cuMemcpyHtoDAsync_v2_ptsz); L(cuMemcpyDtoH_v2);
    L(cuMemcpyDtoH_v2_ptds); L(cuMemcpyDtoH); L(cuMemcpyDtoHAsync_v2); L(cuMemcpyDtoHAsync_v2_ptsz);
    L(cuStreamBeginCapture_v2); L(cuStreamEndCapture); L(cuGraphInstantiateWithFlags); L(cuGraphLaunch);
    L(cuGraphLaunch_ptsz); L(cuStreamBeginCapture); L(cuStreamBeginCapture_v2_ptsz); L(cuStreamEndCapture_ptsz);
    L(cuStreamBeginCaptureToGraph); L(cuGraphCreate); L(cuGraphAddKernelNode); L(cuGraphAddKernelNode_v2);
    L(cuGraphAddChildGraphNode); L(cuGraphConditionalHandleCreate); L(cuGraphClone);
    L(cuGraphInstantiateWithParams); L(cuGraphInstantiate_v2); L(cuGraphExecUpdate_v2);
#undef L
}

static H kernel, stream, event, module, ctx_handle;
#define MAX_GRAPHS 256
static H graph_execs[MAX_GRAPHS];
static int graph_unknown_of[MAX_GRAPHS];
static CUdeviceptr dbuf;
static char *hbuf;
static size_t hbuf_size;

static void ensure_host_buffer(size_t n) {
    if (n <= hbuf_size) return;
    hbuf = realloc(hbuf, n);
    if (!hbuf) die("malloc", 2);
    hbuf_size = n;
}

static const char *pick(const char *api, const char *const *names, int n, long i) {
    if (strcmp(api, "mix") == 0) return names[i % n];
    return api;
}

static void do_launch(long i) {
    static const char *const apis[] = { "plain", "ptsz", "ex", "ex_ptsz", "coop", "coop_ptsz" };
    const char *api = pick(O.launch_api, apis, 6, i);
    CUlaunchConfig cfg = { 1, 1, 1, 128, 1, 1, 0, stream, NULL, 0 };
    if (!strcmp(api, "plain")) CHECK(D.cuLaunchKernel(kernel, 1, 1, 1, 128, 1, 1, 0, stream, NULL, NULL), "cuLaunchKernel");
    else if (!strcmp(api, "ptsz")) CHECK(D.cuLaunchKernel_ptsz(kernel, 1, 1, 1, 128, 1, 1, 0, stream, NULL, NULL), "cuLaunchKernel_ptsz");
    else if (!strcmp(api, "ex")) CHECK(D.cuLaunchKernelEx(&cfg, kernel, NULL, NULL), "cuLaunchKernelEx");
    else if (!strcmp(api, "ex_ptsz")) CHECK(D.cuLaunchKernelEx_ptsz(&cfg, kernel, NULL, NULL), "cuLaunchKernelEx_ptsz");
    else if (!strcmp(api, "coop")) CHECK(D.cuLaunchCooperativeKernel(kernel, 1, 1, 1, 128, 1, 1, 0, stream, NULL), "cuLaunchCooperativeKernel");
    else if (!strcmp(api, "coop_ptsz")) CHECK(D.cuLaunchCooperativeKernel_ptsz(kernel, 1, 1, 1, 128, 1, 1, 0, stream, NULL), "cuLaunchCooperativeKernel_ptsz");
    else die("unknown --launch-api", 1);
    R.launches++;
}

/* Build graph number i with `k` kernels, the way --graph-build says (mix: by i). Launches made
 * while capturing are recorded into the graph: they do not run, and are not counted as launches. */
static H build_graph(long i, long k, long *launch_i) {
    static const char *const ways[] = { "capture", "capture_v1", "capture_ptsz", "nodes", "to_graph", "child", "clone" };
    const char *how = pick(O.graph_build, ways, 7, i);
    H g = NULL, tmp = NULL, node;
    KernelNodeParams p = { kernel, 1, 1, 1, 128, 1, 1, 0, NULL, NULL };
    long before = R.launches;
    if (!strcmp(how, "capture") || !strcmp(how, "capture_v1") || !strcmp(how, "capture_ptsz")) {
        if (!strcmp(how, "capture")) CHECK(D.cuStreamBeginCapture_v2(stream, 0), "cuStreamBeginCapture_v2");
        else if (!strcmp(how, "capture_v1")) CHECK(D.cuStreamBeginCapture(stream), "cuStreamBeginCapture");
        else CHECK(D.cuStreamBeginCapture_v2_ptsz(stream, 0), "cuStreamBeginCapture_v2_ptsz");
        for (long j = 0; j < k; j++) do_launch((*launch_i)++);
        CHECK((!strcmp(how, "capture_ptsz") ? D.cuStreamEndCapture_ptsz : D.cuStreamEndCapture)(stream, &g), "cuStreamEndCapture");
    } else if (!strcmp(how, "nodes")) {
        CHECK(D.cuGraphCreate(&g, 0), "cuGraphCreate");
        for (long j = 0; j < k; j++)
            CHECK((j & 1 ? D.cuGraphAddKernelNode_v2 : D.cuGraphAddKernelNode)(&node, g, NULL, 0, &p), "cuGraphAddKernelNode");
    } else if (!strcmp(how, "to_graph")) {           /* one kernel node, the rest captured into it */
        CHECK(D.cuGraphCreate(&g, 0), "cuGraphCreate");
        if (k > 0) CHECK(D.cuGraphAddKernelNode(&node, g, NULL, 0, &p), "cuGraphAddKernelNode");
        CHECK(D.cuStreamBeginCaptureToGraph(stream, g, NULL, NULL, 0, 0), "cuStreamBeginCaptureToGraph");
        for (long j = 1; j < k; j++) do_launch((*launch_i)++);
        CHECK(D.cuStreamEndCapture(stream, &tmp), "cuStreamEndCapture");
    } else if (!strcmp(how, "child")) {              /* k-1 kernels in a child graph, plus one node */
        CHECK(D.cuGraphCreate(&tmp, 0), "cuGraphCreate");
        for (long j = 1; j < k; j++) CHECK(D.cuGraphAddKernelNode(&node, tmp, NULL, 0, &p), "cuGraphAddKernelNode");
        CHECK(D.cuGraphCreate(&g, 0), "cuGraphCreate");
        CHECK(D.cuGraphAddChildGraphNode(&node, g, NULL, 0, tmp), "cuGraphAddChildGraphNode");
        if (k > 0) CHECK(D.cuGraphAddKernelNode(&node, g, NULL, 0, &p), "cuGraphAddKernelNode");
    } else if (!strcmp(how, "clone")) {
        CHECK(D.cuStreamBeginCapture_v2(stream, 0), "cuStreamBeginCapture_v2");
        for (long j = 0; j < k; j++) do_launch((*launch_i)++);
        CHECK(D.cuStreamEndCapture(stream, &tmp), "cuStreamEndCapture");
        CHECK(D.cuGraphClone(&g, tmp), "cuGraphClone");
    } else die("unknown --graph-build", 1);
    R.captured_launches += R.launches - before;
    R.launches = before;
    if (O.graph_conditional) {
        unsigned long long h;
        CHECK(D.cuGraphConditionalHandleCreate(&h, g, ctx_handle, 1, 0), "cuGraphConditionalHandleCreate");
    }
    return g;
}

static H instantiate(long i, H g) {
    H e;
    switch (i % 3) {
    case 0: CHECK(D.cuGraphInstantiateWithFlags(&e, g, 0), "cuGraphInstantiateWithFlags"); break;
    case 1: CHECK(D.cuGraphInstantiateWithParams(&e, g, NULL), "cuGraphInstantiateWithParams"); break;
    default: CHECK(D.cuGraphInstantiate_v2(&e, g, NULL, NULL, 0), "cuGraphInstantiate_v2"); break;
    }
    return e;
}

static void do_h2d(size_t n, long i) {
    static const char *const apis[] = { "async", "async_ptsz", "sync", "sync_ptds", "legacy" };
    const char *api = pick(O.h2d_api, apis, 5, i);
    ensure_host_buffer(n);
    if (!strcmp(api, "async")) CHECK(D.cuMemcpyHtoDAsync_v2(dbuf, hbuf, n, stream), "cuMemcpyHtoDAsync_v2");
    else if (!strcmp(api, "async_ptsz")) CHECK(D.cuMemcpyHtoDAsync_v2_ptsz(dbuf, hbuf, n, stream), "cuMemcpyHtoDAsync_v2_ptsz");
    else if (!strcmp(api, "sync")) CHECK(D.cuMemcpyHtoD_v2(dbuf, hbuf, n), "cuMemcpyHtoD_v2");
    else if (!strcmp(api, "sync_ptds")) CHECK(D.cuMemcpyHtoD_v2_ptds(dbuf, hbuf, n), "cuMemcpyHtoD_v2_ptds");
    else if (!strcmp(api, "legacy")) CHECK(D.cuMemcpyHtoD((unsigned)dbuf, hbuf, (unsigned)n), "cuMemcpyHtoD");
    else die("unknown --h2d-api", 1);
    R.h2d_calls++;
    R.h2d_bytes += n;
}

/* Synchronous device-to-host copies block the host: timed as back-pressure. */
static void do_d2h_sync(size_t n, long i) {
    static const char *const apis[] = { "sync", "sync_ptds", "legacy" };
    const char *api = pick(O.d2h_api, apis, 3, i);
    ensure_host_buffer(n);
    double t0 = now_s();
    if (!strcmp(api, "sync")) CHECK(D.cuMemcpyDtoH_v2(hbuf, dbuf, n), "cuMemcpyDtoH_v2");
    else if (!strcmp(api, "sync_ptds")) CHECK(D.cuMemcpyDtoH_v2_ptds(hbuf, dbuf, n), "cuMemcpyDtoH_v2_ptds");
    else if (!strcmp(api, "legacy")) CHECK(D.cuMemcpyDtoH(hbuf, (unsigned)dbuf, (unsigned)n), "cuMemcpyDtoH");
    else die("unknown --d2h-api", 1);
    R.sync_seconds += now_s() - t0;
    R.sync_calls++;
    R.d2h_calls++;
    R.d2h_bytes += n;
}

static void do_d2h_async(size_t n, int ptsz) {
    ensure_host_buffer(n);
    if (ptsz) CHECK(D.cuMemcpyDtoHAsync_v2_ptsz(hbuf, dbuf, n, stream), "cuMemcpyDtoHAsync_v2_ptsz");
    else CHECK(D.cuMemcpyDtoHAsync_v2(hbuf, dbuf, n, stream), "cuMemcpyDtoHAsync_v2");
    R.d2h_calls++;
    R.d2h_bytes += n;
}

static void do_sync(long i) {
    static const char *const apis[] = { "stream", "stream_ptsz", "ctx", "event" };
    const char *api = pick(O.sync_api, apis, 4, i);
    if (!strcmp(api, "event")) CHECK(D.cuEventRecord(event, stream), "cuEventRecord");
    double t0 = now_s();
    if (!strcmp(api, "stream")) CHECK(D.cuStreamSynchronize(stream), "cuStreamSynchronize");
    else if (!strcmp(api, "stream_ptsz")) CHECK(D.cuStreamSynchronize_ptsz(stream), "cuStreamSynchronize_ptsz");
    else if (!strcmp(api, "ctx")) CHECK(D.cuCtxSynchronize(), "cuCtxSynchronize");
    else if (!strcmp(api, "event")) CHECK(D.cuEventSynchronize(event), "cuEventSynchronize");
    else die("unknown --sync-api", 1);
    R.sync_seconds += now_s() - t0;
    R.sync_calls++;
}

static void host_work(long us) {
    if (us <= 0) return;
    if (O.host_sleep) {
        struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
        nanosleep(&ts, NULL);
        return;
    }
    double end = now_s() + (double)us / 1e6;
    volatile unsigned long x = 0;
    while (now_s() < end) x++;
}

/* Knobs that --control can change while running. */
static struct { long kernels, kernel_us, h2d_bytes, d2h_sync_bytes, host_us, sync_every; int stop; char incident[64]; } K;

static void apply_incident(void) {
    /* presets are applied on top of the baseline knobs (host_sync adds a copy, starvation slows the feed) */
    if (!strcmp(K.incident, "host_sync") && K.d2h_sync_bytes == 0) K.d2h_sync_bytes = 16L << 20;
}

static long effective_host_us(void) {
    return !strcmp(K.incident, "input_starvation") ? K.host_us * O.throttle : K.host_us;
}

static H function_for(long us) {
    char name[64];
    H f;
    snprintf(name, sizeof name, "gpulens_stub_kernel_%ldus", us);
    CHECK(D.cuModuleGetFunction(&f, module, name), "cuModuleGetFunction");
    return f;
}

static void read_control(void) {
    static struct timespec last_mtime;
    static off_t last_size = -1;
    static double last_check;
    struct stat st;
    if (!O.control) return;
    double t = now_s();
    if (t - last_check < 0.1) return;
    last_check = t;
    if (stat(O.control, &st) != 0) return;
    if (st.st_mtim.tv_sec == last_mtime.tv_sec && st.st_mtim.tv_nsec == last_mtime.tv_nsec && st.st_size == last_size) return;
    FILE *f = fopen(O.control, "r");
    if (!f) return;
    last_mtime = st.st_mtim;
    last_size = st.st_size;
    char line[256], key[64], val[64];
    long old_kernel_us = K.kernel_us;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, " %63[a-z0-9_] = %63s", key, val) != 2) continue;
        long v = strtol(val, NULL, 10);
        if (!strcmp(key, "kernels")) K.kernels = v;
        else if (!strcmp(key, "kernel_us")) K.kernel_us = v;
        else if (!strcmp(key, "h2d_bytes")) K.h2d_bytes = v;
        else if (!strcmp(key, "d2h_sync_bytes")) K.d2h_sync_bytes = v;
        else if (!strcmp(key, "host_us")) K.host_us = v;
        else if (!strcmp(key, "sync_every")) K.sync_every = v;
        else if (!strcmp(key, "stop")) K.stop = v != 0;
        else if (!strcmp(key, "incident")) {
            snprintf(K.incident, sizeof K.incident, "%s", val);
            if (strcmp(val, "host_sync") != 0) K.d2h_sync_bytes = O.d2h_sync_bytes;
            apply_incident();
        }
    }
    fclose(f);
    if (K.kernel_us != old_kernel_us) kernel = function_for(K.kernel_us);
}

static void wait_line(void) {
    char buf[64];
    if (!fgets(buf, sizeof buf, stdin)) { /* EOF is as good as a line */ }
}

static void usage(void) {
    fprintf(stderr,
        "usage: cuda-workload [--lib PATH] [--device N] [--steps N | --duration S] [--kernels K]\n"
        "  [--kernel-us D] [--launch-api plain|ptsz|ex|ex_ptsz|coop|coop_ptsz|mix] [--graphs G]\n"
        "  [--graph-kernels N] [--graph-build capture|capture_v1|capture_ptsz|nodes|to_graph|child|clone|mix]\n"
        "  [--graph-conditional] [--graphs-early] [--graph-update] [--h2d-bytes B] [--h2d-api async|async_ptsz|sync|sync_ptds|legacy|mix]\n"
        "  [--d2h-sync-bytes B] [--d2h-api sync|sync_ptds|legacy|mix] [--d2h-async-bytes B]\n"
        "  [--sync-every S] [--sync-api stream|stream_ptsz|ctx|event|mix] [--host-us H]\n"
        "  [--host-work spin|sleep] [--incident none|host_sync|input_starvation|noisy_neighbor]\n"
        "  [--throttle F] [--control FILE] [--wait-stdin] [--unload] [--report FILE] [--queue-depth N]\n");
    exit(1);
}

int main(int argc, char **argv) {
    static struct option opts[] = {
        {"lib", 1, 0, 'l'}, {"device", 1, 0, 'd'}, {"steps", 1, 0, 's'}, {"duration", 1, 0, 'T'},
        {"kernels", 1, 0, 'k'}, {"kernel-us", 1, 0, 'K'}, {"launch-api", 1, 0, 'a'}, {"graphs", 1, 0, 'g'},
        {"graph-kernels", 1, 0, 'G'}, {"graph-build", 1, 0, 'j'}, {"graph-conditional", 0, 0, 'J'},
        {"graphs-early", 0, 0, 'y'}, {"graph-update", 0, 0, 'u'},
        {"h2d-bytes", 1, 0, 'b'}, {"h2d-api", 1, 0, 'B'},
        {"d2h-sync-bytes", 1, 0, 'c'}, {"d2h-api", 1, 0, 'C'}, {"d2h-async-bytes", 1, 0, 'A'},
        {"sync-every", 1, 0, 'e'}, {"sync-api", 1, 0, 'E'}, {"host-us", 1, 0, 'h'}, {"host-work", 1, 0, 'w'},
        {"incident", 1, 0, 'i'}, {"throttle", 1, 0, 't'}, {"control", 1, 0, 'f'}, {"wait-stdin", 0, 0, 'W'},
        {"unload", 0, 0, 'U'}, {"report", 1, 0, 'r'}, {"queue-depth", 1, 0, 'q'}, {"help", 0, 0, '?'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'l': O.lib = optarg; break;
        case 'd': O.device = atoi(optarg); break;
        case 's': O.steps = atol(optarg); break;
        case 'T': O.duration = atof(optarg); O.steps = 0; break;
        case 'k': O.kernels = atol(optarg); break;
        case 'K': O.kernel_us = atol(optarg); break;
        case 'a': O.launch_api = optarg; break;
        case 'g': O.graphs = atol(optarg); break;
        case 'G': O.graph_kernels = atol(optarg); break;
        case 'j': O.graph_build = optarg; break;
        case 'J': O.graph_conditional = 1; break;
        case 'y': O.graphs_early = 1; break;
        case 'u': O.graph_update = 1; break;
        case 'b': O.h2d_bytes = atol(optarg); break;
        case 'B': O.h2d_api = optarg; break;
        case 'c': O.d2h_sync_bytes = atol(optarg); break;
        case 'C': O.d2h_api = optarg; break;
        case 'A': O.d2h_async_bytes = atol(optarg); break;
        case 'e': O.sync_every = atol(optarg); break;
        case 'E': O.sync_api = optarg; break;
        case 'h': O.host_us = atol(optarg); break;
        case 'w': O.host_sleep = !strcmp(optarg, "sleep"); break;
        case 'i': O.incident = optarg; break;
        case 't': O.throttle = atol(optarg); break;
        case 'f': O.control = optarg; break;
        case 'W': O.wait_stdin = 1; break;
        case 'U': O.unload = 1; break;
        case 'r': O.report = optarg; break;
        case 'q': setenv("GPULENS_STUB_QUEUE_DEPTH", optarg, 1); break;
        default: usage();
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    K.kernels = O.kernels; K.kernel_us = O.kernel_us; K.h2d_bytes = O.h2d_bytes;
    K.d2h_sync_bytes = O.d2h_sync_bytes; K.host_us = O.host_us; K.sync_every = O.sync_every;
    snprintf(K.incident, sizeof K.incident, "%s", O.incident);
    if (!strcmp(K.incident, "noisy_neighbor") && K.sync_every == 0) K.sync_every = 1;
    apply_incident();

    void *lib = dlopen(O.lib, RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "cuda-workload: dlopen %s: %s\n", O.lib, dlerror()); return 2; }
    load(lib);
    int dev;
    static const char image[] = "stub module";
    CHECK(D.cuInit(0), "cuInit");
    CHECK(D.cuDeviceGet(&dev, O.device), "cuDeviceGet");
    CHECK(D.cuCtxCreate_v2(&ctx_handle, 0, dev), "cuCtxCreate_v2");
    CHECK(D.cuModuleLoadData(&module, image), "cuModuleLoadData");
    kernel = function_for(K.kernel_us);
    CHECK(D.cuStreamCreate(&stream, 0), "cuStreamCreate");
    CHECK(D.cuEventCreate(&event, 0), "cuEventCreate");
    CHECK(D.cuMemAlloc_v2(&dbuf, 1 << 20), "cuMemAlloc_v2");
    long launch_i = 0, h2d_i = 0, d2h_i = 0, sync_i = 0;
    if (O.graphs > MAX_GRAPHS) die("--graphs above 256", 1);
    /* --graphs-early: graphs built before "ready", i.e. before a test's exporter attaches */
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && O.wait_stdin) {
            printf("ready %d\n", (int)getpid());
            wait_line();
        }
        if (pass != (O.graphs_early ? 0 : 1)) continue;
        for (long i = 0; i < O.graphs; i++) {
            H g = build_graph(i, O.graph_kernels, &launch_i);
            graph_execs[i] = instantiate(i, g);
            graph_unknown_of[i] = O.graph_conditional;
            if (O.graph_update) {               /* same topology, new parameters: an exec graph update */
                CHECK(D.cuGraphExecUpdate_v2(graph_execs[i], g, NULL), "cuGraphExecUpdate_v2");
                graph_unknown_of[i] = 1;
            }
        }
    }
    double t0 = now_s();
    for (long step = 0; !K.stop; step++) {
        if (O.steps > 0 && step >= O.steps) break;
        if (O.steps == 0 && now_s() - t0 >= O.duration) break;
        read_control();
        host_work(effective_host_us());
        if (K.h2d_bytes > 0) do_h2d((size_t)K.h2d_bytes, h2d_i++);
        long half = K.kernels / 2;
        for (long i = 0; i < half; i++) do_launch(launch_i++);
        if (K.d2h_sync_bytes > 0) do_d2h_sync((size_t)K.d2h_sync_bytes, d2h_i++);   /* "logging" copy mid-step */
        for (long i = half; i < K.kernels; i++) do_launch(launch_i++);
        for (long i = 0; i < O.graphs; i++) {
            CHECK((i & 1 ? D.cuGraphLaunch_ptsz : D.cuGraphLaunch)(graph_execs[i], stream), "cuGraphLaunch");
            R.graph_launches++;
            if (graph_unknown_of[i]) R.graph_unknown++;
            else R.graph_kernels += O.graph_kernels;
        }
        if (O.d2h_async_bytes > 0) do_d2h_async((size_t)O.d2h_async_bytes, (int)(step & 1));
        if (K.sync_every > 0 && (step + 1) % K.sync_every == 0) {
            do_d2h_async(4, 0);        /* loss.item(): cudaMemcpyAsync + cudaStreamSynchronize */
            do_sync(sync_i++);
        }
        R.steps++;
    }
    double wall = now_s() - t0;
    if (O.unload) {
        dlclose(lib);
        printf("unloaded\n");
    }
    char report[1024];
    snprintf(report, sizeof report,
        "{\"pid\": %d, \"steps\": %ld, \"launches\": %ld, \"captured_launches\": %ld, \"graph_launches\": %ld, "
        "\"graph_kernels\": %ld, \"graph_unknown\": %ld, \"h2d_calls\": %ld, "
        "\"h2d_bytes\": %llu, \"d2h_calls\": %ld, \"d2h_bytes\": %llu, \"sync_calls\": %ld, "
        "\"sync_seconds\": %.6f, \"wall_seconds\": %.6f}",
        (int)getpid(), R.steps, R.launches, R.captured_launches, R.graph_launches, R.graph_kernels, R.graph_unknown,
        R.h2d_calls, R.h2d_bytes, R.d2h_calls,
        R.d2h_bytes, R.sync_calls, R.sync_seconds, wall);
    printf("%s\n", report);
    if (O.report) {
        FILE *f = fopen(O.report, "w");
        if (f) { fprintf(f, "%s\n", report); fclose(f); }
    }
    if (O.wait_stdin) wait_line();
    return 0;
}
