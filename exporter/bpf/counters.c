/*
 * gpulens driver counters (bcc). Every probe only updates a per-process entry of a bounded hash
 * map; user space reads the maps when Prometheus scrapes. No per-event ring buffer: launches can
 * run at 10^5/s and the probe itself is the cost.
 *
 * Processes are keyed by (tgid, start time of the thread-group leader) so a recycled pid never
 * adds to a dead process's counters. Blocking calls pair an entry and a return probe through
 * `inflight`, keyed by thread (pid_tgid); nested blocking calls are timed once (outermost).
 *
 * Compile-time parameters: MAX_PROCS, MAX_INFLIGHT, EMPTY_PROBES (benchmarks: every handler
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

static __always_inline int handle_entry(struct pt_regs *ctx, u64 kind) {
#ifndef EMPTY_PROBES
    struct proc_stats *s;
    switch (kind) {
    case K_LAUNCH:
        s = current_stats();
        if (s)
            __sync_fetch_and_add(&s->launches, 1);
        break;
    case K_GRAPH:
        s = current_stats();
        if (s)
            __sync_fetch_and_add(&s->graph_launches, 1);
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
int on_graph_launch(struct pt_regs *ctx) { return handle_entry(ctx, K_GRAPH); }
int on_block_enter(struct pt_regs *ctx) { return handle_entry(ctx, K_BLOCK); }
int on_h2d(struct pt_regs *ctx) { return handle_entry(ctx, K_H2D); }
int on_h2d_u32(struct pt_regs *ctx) { return handle_entry(ctx, K_H2D_U32); }
int on_d2h(struct pt_regs *ctx) { return handle_entry(ctx, K_D2H); }
int on_d2h_u32(struct pt_regs *ctx) { return handle_entry(ctx, K_D2H_U32); }
int on_d2h_sync_enter(struct pt_regs *ctx) { return handle_entry(ctx, K_D2H_SYNC); }
int on_d2h_u32_sync_enter(struct pt_regs *ctx) { return handle_entry(ctx, K_D2H_U32_SYNC); }

int on_block_return(struct pt_regs *ctx) {
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
