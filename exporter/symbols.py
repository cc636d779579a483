"""Which CUDA driver symbols are probed, and with which BPF handler.

The driver library (libcuda) is the one choke point shared by the runtime, cuBLAS/cuDNN and
Triton launches (reference: ebpf-gpu-signals.md §0, §1.4). Launches get entry-only probes (they
can run at 10^5/s); blocking calls get an entry+return pair; copies read `ByteCount`, which is
argument 3 of every HtoD/DtoH form (64-bit `size_t`, or 32-bit in the legacy unversioned forms).
Only symbols the library really exports are attached; aliases (two names, one address) are
attached once so nothing is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProbeSpec", "DRIVER_PROBES", "probe_names", "KIND_OF_ENTRY", "entry_only"]

#: entry handler -> probe kind, the attach cookie read by `on_entry` and `on_return` (K_* in bpf/counters.c)
KIND_OF_ENTRY = {"on_launch": 0, "on_graph_launch": 1, "on_block_enter": 2, "on_h2d": 3, "on_h2d_u32": 4,
                 "on_d2h": 5, "on_d2h_u32": 6, "on_d2h_sync_enter": 7, "on_d2h_u32_sync_enter": 8,
                 "on_launch_ex": 9, "on_capture_begin": 10, "on_capture_end": 11, "on_graph_create": 12,
                 "on_add_kernel": 13, "on_instantiate": 14, "on_exec_destroy": 15, "on_graph_destroy": 16,
                 "on_graph_unknown": 17, "on_add_child": 18, "on_exec_update": 19, "on_graph_clone": 20,
                 "on_capture_to_graph": 21, "on_capture_end_noret": 22}


@dataclass(frozen=True)
class ProbeSpec:
    symbol: str
    entry: str               # BPF function run at entry (per-probe attachment; its kind otherwise)
    ret: str | None = None   # BPF function run at return (blocking calls only)

    @property
    def kind(self) -> int:
        return KIND_OF_ENTRY[self.entry]


_LAUNCH = ["cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz"]
_LAUNCH_EX = ["cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"]      # the stream is in the CUlaunchConfig
_GRAPH = ["cuGraphLaunch", "cuGraphLaunch_ptsz"]
_SYNC = ["cuCtxSynchronize", "cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuEventSynchronize"]

# CUDA graphs: where kernels come from (capture, nodes), which executable graph runs them.
_GRAPH_BUILD = (
    *(ProbeSpec(s, "on_capture_begin") for s in ("cuStreamBeginCapture", "cuStreamBeginCapture_ptsz",
                                                 "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz")),
    *(ProbeSpec(s, "on_capture_to_graph") for s in ("cuStreamBeginCaptureToGraph", "cuStreamBeginCaptureToGraph_ptsz")),
    *(ProbeSpec(s, "on_capture_end", "on_graph_return") for s in ("cuStreamEndCapture", "cuStreamEndCapture_ptsz")),
    ProbeSpec("cuGraphCreate", "on_graph_create", "on_graph_return"),
    *(ProbeSpec(s, "on_add_kernel") for s in ("cuGraphAddKernelNode", "cuGraphAddKernelNode_v2")),
    ProbeSpec("cuGraphAddChildGraphNode", "on_add_child"),
    *(ProbeSpec(s, "on_graph_unknown") for s in ("cuGraphAddNode", "cuGraphAddNode_v2",
                                                 "cuGraphConditionalHandleCreate")),
    ProbeSpec("cuGraphClone", "on_graph_clone", "on_graph_return"),
    *(ProbeSpec(s, "on_instantiate", "on_graph_return") for s in (
        "cuGraphInstantiate", "cuGraphInstantiate_v2", "cuGraphInstantiateWithFlags",
        "cuGraphInstantiateWithParams", "cuGraphInstantiateWithParams_ptsz")),
    *(ProbeSpec(s, "on_exec_update") for s in ("cuGraphExecUpdate", "cuGraphExecUpdate_v2")),
    ProbeSpec("cuGraphExecDestroy", "on_exec_destroy"),
    ProbeSpec("cuGraphDestroy", "on_graph_destroy"),
)

DRIVER_PROBES: tuple[ProbeSpec, ...] = (
    *(ProbeSpec(s, "on_launch") for s in _LAUNCH),
    *(ProbeSpec(s, "on_launch_ex") for s in _LAUNCH_EX),
    *(ProbeSpec(s, "on_graph_launch") for s in _GRAPH),
    *_GRAPH_BUILD,
    *(ProbeSpec(s, "on_block_enter", "on_block_return") for s in _SYNC),
    ProbeSpec("cuMemcpyHtoD_v2", "on_h2d"),
    ProbeSpec("cuMemcpyHtoD_v2_ptds", "on_h2d"),
    ProbeSpec("cuMemcpyHtoDAsync_v2", "on_h2d"),
    ProbeSpec("cuMemcpyHtoDAsync_v2_ptsz", "on_h2d"),
    ProbeSpec("cuMemcpyHtoD", "on_h2d_u32"),
    ProbeSpec("cuMemcpyHtoDAsync", "on_h2d_u32"),
    ProbeSpec("cuMemcpyDtoHAsync_v2", "on_d2h"),
    ProbeSpec("cuMemcpyDtoHAsync_v2_ptsz", "on_d2h"),
    ProbeSpec("cuMemcpyDtoHAsync", "on_d2h_u32"),
    # Synchronous device-to-host copies block the host: bytes and blocked time.
    ProbeSpec("cuMemcpyDtoH_v2", "on_d2h_sync_enter", "on_block_return"),
    ProbeSpec("cuMemcpyDtoH_v2_ptds", "on_d2h_sync_enter", "on_block_return"),
    ProbeSpec("cuMemcpyDtoH", "on_d2h_u32_sync_enter", "on_block_return"),
)


def probe_names() -> list[str]:
    return [p.symbol for p in DRIVER_PROBES]


#: what a probe becomes without return probes: synchronous copies keep their byte count, a
#: capture still ends (so launches after it count again)
_WITHOUT_RETURN = {"on_d2h_sync_enter": "on_d2h", "on_d2h_u32_sync_enter": "on_d2h_u32",
                   "on_capture_end": "on_capture_end_noret"}
#: graph bookkeeping that is useless when no graph handle can be learnt (they come back through
#: out-pointers, read at return): every graph launch is then "unknown"
_GRAPH_STRUCTURE = {"on_add_kernel", "on_add_child", "on_graph_unknown", "on_exec_update", "on_exec_destroy",
                    "on_graph_destroy"}


def entry_only(probes: tuple[ProbeSpec, ...]) -> tuple[ProbeSpec, ...]:
    """The probes to place where return probes are unsafe (retprobe_gate.py): blocking calls are
    left alone entirely (an entry without its return would leave an open call for ever), the
    synchronous copies still count bytes at entry, launches under capture are still not counted
    as run, and graph launches count as launches of unknown size."""
    out = []
    for p in probes:
        if p.ret is None:
            if p.entry not in _GRAPH_STRUCTURE:
                out.append(p)
        elif p.entry in _WITHOUT_RETURN:
            out.append(ProbeSpec(p.symbol, _WITHOUT_RETURN[p.entry]))
    return tuple(out)
