/*
 * gpulens driver counters (bcc). Every probe only updates a per-process entry of a bounded hash
 * map; user space reads the maps when Prometheus scrapes. No per-event ring buffer: launches can
 * run at 10^5/s and the probe itself is the cost.
 *
 * Processes are keyed by (tgid, start time of the thread-group leader) so a recycled pid never
 * adds to a dead process's counters. Blocking calls pair an entry and a return probe through
 * `inflight`, keyed by thread (pid_tgid); nested blocking calls are timed once (outermost).
 *
 * CUDA graphs (see "graphs" below): launches into a stream that is being captured are recorded
 * into the graph being built, not counted as launched; instantiation carries a graph's kernel count
 * to its executable graph; each graph launch adds that count to graph_kernels, or counts as
 * graph_unknown when the count is not known (never a guess).
 *
 * Compile-time parameters: MAX_PROCS, MAX_INFLIGHT, MAX_GRAPHS, STACK_ARG9_OFF (where the 9th
 * argument, a launch's stream, lies above the stack pointer at entry), EMPTY_PROBES (benchmarks: every handler
 * returns at once, to price the uprobe itself), and TASK_GROUP_LEADER_OFF /
 * TASK_START_BOOTTIME_OFF: byte offsets in task_struct taken from the running kernel's BTF
 * (exporter/btf.py), because installed kernel headers may belong to another kernel. Without them
 * start times read as 0 and pid reuse cannot be told apart.
 */
#include <uapi/linux/ptrace.h>

struct proc_key {
    u32 tgid;
    u32 pad;
    u64 start_ns;           /* group leader's start_boottime: /proc/<pid>/stat field 22 in ns */
};

struct proc_stats {
    u64 launches;
    u64 graph_launches;
    u64 graph_kernels;      /* kernels run through graph launches whose kernel count is known */
    u64 graph_unknown;      /* graph launches whose graph's kernel count is unknown */
    u64 captured;           /* launches recorded into a graph under capture (did not run then) */
    u64 sync_calls;
    u64 sync_ns;
    u64 h2d_bytes;
    u64 d2h_bytes;
    u64 h2d_calls;
    u64 d2h_calls;
    u64 cgroup_id;
    char comm[16];
};

struct inflight_call {
    u64 start_ns;           /* bpf_ktime_get_ns() at the outermost entry */
    u64 thread_start_ns;    /* guards against a recycled thread id */
    u32 depth;
    u32 pad;
    struct proc_key proc;
};

BPF_HASH(procs, struct proc_key, struct proc_stats, MAX_PROCS);
BPF_HASH(inflight, u64, struct inflight_call, MAX_INFLIGHT);
/* 0: procs full (events dropped), 1: inflight full (a blocking call went untimed) */
BPF_ARRAY(failures, u64, 2);
/* graphs: a per-process handle (stream under capture, CUgraph, CUgraphExec) -> kernel count */
struct gkey {
    u32 tgid;
    u32 pad;
    u64 handle;
};

struct gcount {
    u64 kernels;
    u64 target;             /* captures into an existing graph (cuStreamBeginCaptureToGraph): it */
    u32 unknown;            /* something in it is not counted (conditional node, generic node, ...) */
    u32 pad;
};

/* a call whose result is written through an out-pointer, read back at its return */
struct pending_out {
    u64 out;                /* user pointer the driver writes the new handle to */
    u64 src;                /* the stream (end of capture) or graph (instantiate, clone) it came from */
    u32 kind;
    u32 tgid;
};

BPF_HASH(captures, struct gkey, struct gcount, 4096);
BPF_HASH(graphs, struct gkey, struct gcount, MAX_GRAPHS);
BPF_HASH(execs, struct gkey, struct gcount, MAX_GRAPHS);
BPF_HASH(pending, u64, struct pending_out, 4096);
/* 0: graphs or execs full (counts then unknown) */
BPF_ARRAY(graph_failures, u64, 1);

/* Returns seen by the safety gate's self-test probe (exporter/retprobe_gate.py). */
BPF_ARRAY(gate_hits, u64, 1);

static __always_inline void count_failure(int index) {
    u64 *v = failures.lookup(&index);
    if (v)
        __sync_fetch_and_add(v, 1);
}

static __always_inline u64 task_start(void *task) {
    u64 start = 0;
#ifdef TASK_START_BOOTTIME_OFF
    if (task)
        bpf_probe_read_kernel(&start, sizeof(start), task + TASK_START_BOOTTIME_OFF);
#endif
    return start;
}

static __always_inline void current_proc(struct proc_key *key) {
    void *leader = NULL;
#ifdef TASK_GROUP_LEADER_OFF
    void *task = (void *)bpf_get_current_task();
    bpf_probe_read_kernel(&leader, sizeof(leader), task + TASK_GROUP_LEADER_OFF);
#endif
    key->tgid = bpf_get_current_pid_tgid() >> 32;
    key->pad = 0;
    key->start_ns = task_start(leader);
}

static __always_inline struct proc_stats *stats_for(struct proc_key *key) {
    struct proc_stats *s = procs.lookup(key);
    if (s)
        return s;
    struct proc_stats zero = {};
    zero.cgroup_id = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&zero.comm, sizeof(zero.comm));
    procs.insert(key, &zero);
    s = procs.lookup(key);
    if (!s)
        count_failure(0);
    return s;
}

static __always_inline struct proc_stats *current_stats(void) {
    struct proc_key key = {};
    current_proc(&key);
    return stats_for(&key);
}

static __always_inline void add_copy(u64 bytes, int d2h) {
    struct proc_stats *s = current_stats();
    if (!s)
        return;
    if (d2h) {
        __sync_fetch_and_add(&s->d2h_bytes, bytes);
        __sync_fetch_and_add(&s->d2h_calls, 1);
    } else {
        __sync_fetch_and_add(&s->h2d_bytes, bytes);
        __sync_fetch_and_add(&s->h2d_calls, 1);
    }
}

static __always_inline void block_enter(void) {
    u64 id = bpf_get_current_pid_tgid();
    u64 tstart = task_start((void *)bpf_get_current_task());
    struct inflight_call *f = inflight.lookup(&id);
    if (f && f->thread_start_ns == tstart) {
        f->depth += 1;
        return;
    }
    struct inflight_call call = {};
    call.start_ns = bpf_ktime_get_ns();
    call.thread_start_ns = tstart;
    call.depth = 1;
    current_proc(&call.proc);
    if (inflight.update(&id, &call) != 0)
        count_failure(1);
}

/* Probe kinds; the attach cookie of a multi-uprobe link carries one (exporter/symbols.py). */
#define K_LAUNCH 0
#define K_GRAPH 1
#define K_BLOCK 2
#define K_H2D 3
#define K_H2D_U32 4
#define K_D2H 5
#define K_D2H_U32 6
#define K_D2H_SYNC 7
#define K_D2H_U32_SYNC 8
#define K_LAUNCH_EX 9           /* cuLaunchKernelEx: the stream is in the config struct */
#define K_CAPTURE_BEGIN 10      /* cuStreamBeginCapture*(stream, ...) */
#define K_CAPTURE_END 11        /* cuStreamEndCapture(stream, CUgraph *out): return probe too */
#define K_GRAPH_CREATE 12       /* cuGraphCreate(CUgraph *out, flags): return probe */
#define K_ADD_KERNEL 13         /* cuGraphAddKernelNode*(node *, graph, ...) */
#define K_INSTANTIATE 14        /* cuGraphInstantiate*(CUgraphExec *out, graph, ...): return probe */
#define K_EXEC_DESTROY 15
#define K_GRAPH_DESTROY 16
#define K_GRAPH_UNKNOWN 17      /* cuGraphAddNode*, cuGraphConditionalHandleCreate (graph = arg 2) */
#define K_ADD_CHILD 18          /* cuGraphAddChildGraphNode(node *, graph, deps, n, child) */
#define K_EXEC_UPDATE 19        /* cuGraphExecUpdate*(exec, graph, ...): the exec's count is unknown */
#define K_GRAPH_CLONE 20        /* cuGraphClone(CUgraph *out, original): return probe */
#define K_CAPTURE_TO_GRAPH 21   /* cuStreamBeginCaptureToGraph(stream, graph, ...) */
#define K_CAPTURE_END_NORET 22  /* cuStreamEndCapture without return probes: the capture just ends */

#ifndef STACK_ARG9_OFF
#define STACK_ARG9_OFF 24       /* x86-64: return address, then arguments 7, 8, 9 */
#endif

static __always_inline void graph_failure(void) {
    int zero = 0;
    u64 *v = graph_failures.lookup(&zero);
    if (v)
        __sync_fetch_and_add(v, 1);
}

static __always_inline void gkey_of(struct gkey *k, u64 handle) {
    k->tgid = bpf_get_current_pid_tgid() >> 32;
    k->pad = 0;
    k->handle = handle;
}

/* The per-thread default stream (CU_STREAM_PER_THREAD) is one stream per thread. */
static __always_inline u64 stream_handle(u64 stream) {
    if (stream == 2)
        return (1ULL << 63) | (u32)bpf_get_current_pid_tgid();
    return stream;
}

/* A kernel launch (or, with `graph` set, a graph launch) into `stream`: recorded into the graph
 * being captured there, if any. Returns 1 when it was. */
static __always_inline int into_capture(u64 stream, u64 kernels, u32 unknown) {
    struct gkey k = {};
    gkey_of(&k, stream_handle(stream));
    struct gcount *c = captures.lookup(&k);
    if (!c)
        return 0;
    __sync_fetch_and_add(&c->kernels, kernels);
    if (unknown)
        c->unknown = 1;
    return 1;
}

static __always_inline void count_launch(u64 stream) {
    struct proc_stats *s = current_stats();
    if (!s)
        return;
    if (into_capture(stream, 1, 0))
        __sync_fetch_and_add(&s->captured, 1);
    else
        __sync_fetch_and_add(&s->launches, 1);
}

static __always_inline void graph_launch(u64 exec, u64 stream) {
    struct gkey k = {};
    gkey_of(&k, exec);
    struct gcount *e = execs.lookup(&k);
    u64 kernels = e ? e->kernels : 0;
    u32 unknown = e ? e->unknown : 1;
    if (into_capture(stream, kernels, unknown))     /* a child graph of the graph being captured */
        return;
    struct proc_stats *s = current_stats();
    if (!s)
        return;
    __sync_fetch_and_add(&s->graph_launches, 1);
    if (unknown)
        __sync_fetch_and_add(&s->graph_unknown, 1);
    else
        __sync_fetch_and_add(&s->graph_kernels, kernels);
}

static __always_inline void capture_begin(u64 stream, u64 target) {
    struct gkey k = {};
    gkey_of(&k, stream_handle(stream));
    struct gcount c = {};
    c.target = target;
    captures.update(&k, &c);
}

/* Add `kernels` (unknown if set) to graph `graph`; a graph never seen is unknown from then on. */
static __always_inline void graph_add(u64 graph, u64 kernels, u32 unknown) {
    struct gkey k = {};
    gkey_of(&k, graph);
    struct gcount *g = graphs.lookup(&k);
    if (g) {
        __sync_fetch_and_add(&g->kernels, kernels);
        if (unknown)
            g->unknown = 1;
        return;
    }
    struct gcount fresh = {};
    fresh.unknown = 1;                  /* made before the probes were there */
    if (graphs.update(&k, &fresh) != 0)
        graph_failure();
}

static __always_inline void stash(u32 kind, u64 out, u64 src) {
    u64 id = bpf_get_current_pid_tgid();
    struct pending_out p = {};
    p.out = out;
    p.src = src;
    p.kind = kind;
    p.tgid = id >> 32;
    pending.update(&id, &p);
}

static __always_inline void del_handle(void *map_is_graphs, u64 handle) {
    struct gkey k = {};
    gkey_of(&k, handle);
    if (map_is_graphs)
        graphs.delete(&k);
    else
        execs.delete(&k);
}

static __always_inline int handle_entry(struct pt_regs *ctx, u64 kind) {
#ifndef EMPTY_PROBES
    struct proc_stats *s;
    u64 stream = 0;
    struct gkey gk = {};
    struct gcount *gc;
    switch (kind) {
    case K_LAUNCH:
        bpf_probe_read_user(&stream, sizeof(stream), (void *)(PT_REGS_SP(ctx) + STACK_ARG9_OFF));
        count_launch(stream);
        break;
    case K_LAUNCH_EX:
        /* CUlaunchConfig: seven unsigned ints, then the CUstream at offset 32 */
        bpf_probe_read_user(&stream, sizeof(stream), (void *)(PT_REGS_PARM1(ctx) + 32));
        count_launch(stream);
        break;
    case K_GRAPH:
        graph_launch((u64)PT_REGS_PARM1(ctx), (u64)PT_REGS_PARM2(ctx));
        break;
    case K_CAPTURE_BEGIN:
        capture_begin((u64)PT_REGS_PARM1(ctx), 0);
        break;
    case K_CAPTURE_TO_GRAPH:
        capture_begin((u64)PT_REGS_PARM1(ctx), (u64)PT_REGS_PARM2(ctx));
        break;
    case K_CAPTURE_END:
        stash(K_CAPTURE_END, (u64)PT_REGS_PARM2(ctx), stream_handle((u64)PT_REGS_PARM1(ctx)));
        break;
    case K_CAPTURE_END_NORET:
        gkey_of(&gk, stream_handle((u64)PT_REGS_PARM1(ctx)));
        captures.delete(&gk);
        break;
    case K_GRAPH_CREATE:
        stash(K_GRAPH_CREATE, (u64)PT_REGS_PARM1(ctx), 0);
        break;
    case K_INSTANTIATE:
        stash(K_INSTANTIATE, (u64)PT_REGS_PARM1(ctx), (u64)PT_REGS_PARM2(ctx));
        break;
    case K_GRAPH_CLONE:
        stash(K_GRAPH_CLONE, (u64)PT_REGS_PARM1(ctx), (u64)PT_REGS_PARM2(ctx));
        break;
    case K_ADD_KERNEL:
        graph_add((u64)PT_REGS_PARM2(ctx), 1, 0);
        break;
    case K_GRAPH_UNKNOWN:
        graph_add((u64)PT_REGS_PARM2(ctx), 0, 1);
        break;
    case K_ADD_CHILD:
        gkey_of(&gk, (u64)PT_REGS_PARM5(ctx));
        gc = graphs.lookup(&gk);
        if (gc)
            graph_add((u64)PT_REGS_PARM2(ctx), gc->kernels, gc->unknown);
        else
            graph_add((u64)PT_REGS_PARM2(ctx), 0, 1);
        break;
    case K_EXEC_UPDATE:
        gkey_of(&gk, (u64)PT_REGS_PARM1(ctx));
        gc = execs.lookup(&gk);
        if (gc)
            gc->unknown = 1;
        break;
    case K_EXEC_DESTROY:
        del_handle(NULL, (u64)PT_REGS_PARM1(ctx));
        break;
    case K_GRAPH_DESTROY:
        del_handle((void *)1, (u64)PT_REGS_PARM1(ctx));
        break;
    case K_BLOCK:
        block_enter();
        break;
    case K_H2D:
        add_copy((u64)PT_REGS_PARM3(ctx), 0);
        break;
    case K_H2D_U32:
        add_copy((u64)(u32)PT_REGS_PARM3(ctx), 0);
        break;
    case K_D2H:
        add_copy((u64)PT_REGS_PARM3(ctx), 1);
        break;
    case K_D2H_U32:
        add_copy((u64)(u32)PT_REGS_PARM3(ctx), 1);
        break;
    case K_D2H_SYNC:
        add_copy((u64)PT_REGS_PARM3(ctx), 1);
        block_enter();
        break;
    case K_D2H_U32_SYNC:
        add_copy((u64)(u32)PT_REGS_PARM3(ctx), 1);
        block_enter();
        break;
    }
#endif
    return 0;
}

/* Multi-uprobe links (kernel >= 6.6): one program for every entry probe, kind in the cookie. */
int on_entry(struct pt_regs *ctx) {
    return handle_entry(ctx, bpf_get_attach_cookie(ctx));
}

/* Per-probe perf attachments (older kernels): one program per kind. */
int on_launch(struct pt_regs *ctx) { return handle_entry(ctx, K_LAUNCH); }
int on_launch_ex(struct pt_regs *ctx) { return handle_entry(ctx, K_LAUNCH_EX); }
int on_capture_begin(struct pt_regs *ctx) { return handle_entry(ctx, K_CAPTURE_BEGIN); }
int on_capture_to_graph(struct pt_regs *ctx) { return handle_entry(ctx, K_CAPTURE_TO_GRAPH); }
int on_capture_end(struct pt_regs *ctx) { return handle_entry(ctx, K_CAPTURE_END); }
int on_capture_end_noret(struct pt_regs *ctx) { return handle_entry(ctx, K_CAPTURE_END_NORET); }
int on_graph_create(struct pt_regs *ctx) { return handle_entry(ctx, K_GRAPH_CREATE); }
int on_add_kernel(struct pt_regs *ctx) { return handle_entry(ctx, K_ADD_KERNEL); }
int on_instantiate(struct pt_regs *ctx) { return handle_entry(ctx, K_INSTANTIATE); }
int on_exec_destroy(struct pt_regs *ctx) { return handle_entry(ctx, K_EXEC_DESTROY); }
int on_graph_destroy(struct pt_regs *ctx) { return handle_entry(ctx, K_GRAPH_DESTROY); }
int on_graph_unknown(struct pt_regs *ctx) { return handle_entry(ctx, K_GRAPH_UNKNOWN); }
int on_add_child(struct pt_regs *ctx) { return handle_entry(ctx, K_ADD_CHILD); }
int on_exec_update(struct pt_regs *ctx) { return handle_entry(ctx, K_EXEC_UPDATE); }
int on_graph_clone(struct pt_regs *ctx) { return handle_entry(ctx, K_GRAPH_CLONE); }
int on_graph_launch(struct pt_regs *ctx) { return handle_entry(ctx, K_GRAPH); }
int on_block_enter(struct pt_regs *ctx) { return handle_entry(ctx, K_BLOCK); }
int on_h2d(struct pt_regs *ctx) { return handle_entry(ctx, K_H2D); }
int on_h2d_u32(struct pt_regs *ctx) { return handle_entry(ctx, K_H2D_U32); }
int on_d2h(struct pt_regs *ctx) { return handle_entry(ctx, K_D2H); }
int on_d2h_u32(struct pt_regs *ctx) { return handle_entry(ctx, K_D2H_U32); }
int on_d2h_sync_enter(struct pt_regs *ctx) { return handle_entry(ctx, K_D2H_SYNC); }
int on_d2h_u32_sync_enter(struct pt_regs *ctx) { return handle_entry(ctx, K_D2H_U32_SYNC); }

/* Return of a call with an out-pointer: the new handle gets its kernel count. Without return
 * probes (safety gate) none of this runs: captures still end at entry (below), graphs stay
 * unknown. */
static __always_inline int graph_return(struct pt_regs *ctx) {
#ifndef EMPTY_PROBES
    u64 id = bpf_get_current_pid_tgid();
    struct pending_out *p = pending.lookup(&id);
    if (!p)
        return 0;
    struct pending_out call = *p;
    pending.delete(&id);
    int ok = PT_REGS_RC(ctx) == 0;
    u64 handle = 0;
    if (ok && bpf_probe_read_user(&handle, sizeof(handle), (void *)call.out) != 0)
        ok = 0;
    struct gkey k = {};
    struct gcount made = {};
    struct gcount *src;
    switch (call.kind) {
    case K_CAPTURE_END:
        gkey_of(&k, call.src);
        src = captures.lookup(&k);
        if (src) {
            made = *src;
            captures.delete(&k);
        } else {
            made.unknown = 1;           /* capture began before the probes were there */
        }
        if (!ok)
            return 0;
        if (made.target) {              /* captured into an existing graph: add to it */
            graph_add(made.target, made.kernels, made.unknown);
            return 0;
        }
        made.target = 0;
        gkey_of(&k, handle);
        if (graphs.update(&k, &made) != 0)
            graph_failure();
        return 0;
    case K_GRAPH_CREATE:
        if (!ok)
            return 0;
        gkey_of(&k, handle);
        if (graphs.update(&k, &made) != 0)
            graph_failure();
        return 0;
    case K_INSTANTIATE:
    case K_GRAPH_CLONE:
        if (!ok)
            return 0;
        gkey_of(&k, call.src);
        src = graphs.lookup(&k);
        if (src)
            made = *src;
        else
            made.unknown = 1;
        gkey_of(&k, handle);
        if (call.kind == K_INSTANTIATE) {
            if (execs.update(&k, &made) != 0)
                graph_failure();
        } else if (graphs.update(&k, &made) != 0) {
            graph_failure();
        }
        return 0;
    }
#endif
    return 0;
}

int on_graph_return(struct pt_regs *ctx) { return graph_return(ctx); }

static __always_inline int block_return(struct pt_regs *ctx);

/* Multi-uprobe return link: the kind in the cookie (0 for blocking calls). */
int on_return(struct pt_regs *ctx) {
    u64 kind = bpf_get_attach_cookie(ctx);
    if (kind == K_CAPTURE_END || kind == K_GRAPH_CREATE || kind == K_INSTANTIATE || kind == K_GRAPH_CLONE)
        return graph_return(ctx);
    return block_return(ctx);
}

int on_block_return(struct pt_regs *ctx) { return block_return(ctx); }

static __always_inline int block_return(struct pt_regs *ctx) {
#ifndef EMPTY_PROBES
    u64 id = bpf_get_current_pid_tgid();
    struct inflight_call *f = inflight.lookup(&id);
    if (!f)
        return 0;
    if (f->depth > 1) {
        f->depth -= 1;
        return 0;
    }
    u64 elapsed = bpf_ktime_get_ns() - f->start_ns;
    struct proc_key key = f->proc;
    inflight.delete(&id);
    struct proc_stats *s = stats_for(&key);
    if (s) {
        __sync_fetch_and_add(&s->sync_calls, 1);
        __sync_fetch_and_add(&s->sync_ns, elapsed);
    }
#endif
    return 0;
}

/* The return-probe safety gate's probe: counts that a return probe fired in the self-test child.
 * Two names because bcc caches a loaded program by name with its attach type (multi link, perf). */
static __always_inline int gate_hit(void) {
    int zero = 0;
    u64 *v = gate_hits.lookup(&zero);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
int on_gate_return(struct pt_regs *ctx) { return gate_hit(); }
int on_gate_return_perf(struct pt_regs *ctx) { return gate_hit(); }
