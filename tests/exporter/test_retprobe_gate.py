"""The return-probe safety gate: a real seccomp self-test, and what the exporter does with its answer.

The self-test runs for real (bcc, as root, a child under a real seccomp filter). This kernel (6.18)
lets the uretprobe syscall through seccomp, so the gate says safe; the unsafe branch is reached
(a) by the same self-test with the filter killing on a syscall the probed call does make, so the
child really dies of SIGSYS, and (b) by handing the exporter an unsafe verdict, to check that no
return probe is placed, the reason is in source_info and back-pressure series are absent.
"""

from __future__ import annotations

import platform

import pytest

from gpulens.exporter.elfsyms import function_offsets
from gpulens.exporter.probes import DriverProbes
from gpulens.exporter.retprobe_gate import URETPROBE_SYSCALL, GateVerdict, self_test
from gpulens.exporter.service import Exporter
from gpulens.exporter.symbols import DRIVER_PROBES, entry_only

from .conftest import make_config, registration, requires_ebpf, scrape, value, wait_for

SYS_GETPID = {"x86_64": 39, "aarch64": 172}.get(platform.machine())


def test_entry_only_drops_blocking_calls_and_keeps_copy_bytes():
    kept = {p.symbol: p for p in entry_only(DRIVER_PROBES)}
    assert all(p.ret is None for p in kept.values())
    for sync in ("cuCtxSynchronize", "cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuEventSynchronize"):
        assert sync not in kept                           # an entry without its return: an open call for ever
    assert kept["cuMemcpyDtoH_v2"].entry == "on_d2h"      # bytes still counted
    assert kept["cuMemcpyDtoH"].entry == "on_d2h_u32"
    assert kept["cuLaunchKernel"].entry == "on_launch"


@pytest.fixture(scope="module")
def probes():
    p = DriverProbes(max_processes=64, max_inflight=64)
    yield p
    p.close()


@pytest.mark.skipif(URETPROBE_SYSCALL is None, reason="no uretprobe syscall on this architecture")
class TestSelfTest:
    pytestmark = requires_ebpf

    def test_this_kernel_is_safe_and_the_probe_really_fired(self, probes):
        before = probes.gate_hits()
        v = self_test(probes)
        assert v.safe, v.reason
        assert "self-test passed" in v.reason and str(URETPROBE_SYSCALL) in v.reason
        assert probes.gate_hits() == before + 1           # exactly the child's one probed return

    def test_a_child_killed_by_its_filter_means_unsafe(self, probes):
        v = self_test(probes, kill_syscall=SYS_GETPID)    # the probed call itself is denied: SIGSYS
        assert not v.safe
        assert "killed" in v.reason and "back-pressure unavailable" in v.reason

    def test_perf_event_fallback_gives_the_same_answer(self, probes):
        was = probes.multi_links
        probes.multi_links = False
        try:
            assert self_test(probes).safe
            assert not self_test(probes, kill_syscall=SYS_GETPID).safe
        finally:
            probes.multi_links = was


def ebpf(f):
    for mark in requires_ebpf:
        f = mark(f)
    return f


@ebpf
def test_real_gate_decision_is_reported_and_back_pressure_is_measured(libcuda, workloads, tmp_path,
                                                                      exporter_for):
    exp = exporter_for(make_config(tmp_path, libcuda), return_probe_gate=self_test)
    assert exp.gate is not None and exp.gate.safe, exp.gate
    w = workloads(libcuda, "--steps", "20", "--kernels", "5", "--sync-every", "1")
    wait_for(lambda: (exp.tick(), exp.probes.libraries)[1], what="library attached")
    w.go()
    rep = w.report()
    s = scrape(exp)
    assert value(s, "gpulens_exporter_source_info", source="return_probes", state="ok", reason=exp.gate.reason) == 1
    assert value(s, "gpulens_exporter_source_up", source="return_probes") == 1
    assert value(s, "gpulens_sync_calls_total", pod="cuda-workload") == rep["sync_calls"] == 20
    w.finish()


@ebpf
def test_forced_unsafe_attaches_entry_probes_only_and_back_pressure_is_absent(libcuda, workloads, tmp_path,
                                                                              exporter_for):
    why = "a return probe killed a process under a seccomp filter (forced by the test)"
    reg = tmp_path / "registry"
    exp = exporter_for(make_config(tmp_path, libcuda, registry_dir=reg),
                       return_probe_gate=lambda probes: GateVerdict(False, why, "test-kernel"))
    assert exp.probes.return_probes is False
    w = workloads(libcuda, "--steps", "30", "--kernels", "10", "--sync-every", "1", "--d2h-sync-bytes", "100",
                  "--d2h-api", "mix", "--sync-api", "mix")
    registration(reg, w.pid, "gated")
    wait_for(lambda: (exp.tick(), exp.probes.libraries)[1], what="library attached")
    att = exp.probes._attachments[next(iter(exp.probes.libraries))]
    assert len(att.links) <= 1                            # one entry link, no return link
    exported = function_offsets(str(libcuda), [p.symbol for p in DRIVER_PROBES])
    assert att.probes == sum(1 for p in entry_only(DRIVER_PROBES) if p.symbol in exported)
    w.go()
    rep = w.report()
    s = scrape(exp)
    assert value(s, "gpulens_exporter_source_info", source="return_probes", state="disabled", reason=why) == 1
    assert value(s, "gpulens_exporter_source_up", source="return_probes") == 0
    # demand still counted exactly; copies still counted (bytes at entry); back-pressure absent, not 0
    assert value(s, "gpulens_kernel_launches_total", pod="gated") == rep["launches"] == 300
    assert value(s, "gpulens_memcpy_bytes_total", pod="gated", direction="d2h") == rep["d2h_bytes"]
    assert not [n for (n, _ls) in s if n.startswith(("gpulens_sync_wait_seconds", "gpulens_sync_calls"))]
    assert value(s, "gpulens_exporter_map_entries", map="inflight") == 0      # nothing left open
    w.finish()


class _ProbesDouble:
    """Stands in for DriverProbes where only the gate's outcome is under test (no BPF)."""
    return_probes = True
    start_time_problem = None

    def close(self) -> None:
        pass


def test_a_gate_that_raises_counts_as_unsafe(tmp_path):
    def broken(_probes):
        raise RuntimeError("boom")
    exp = Exporter(make_config(tmp_path, None), probes_factory=_ProbesDouble, return_probe_gate=broken)
    exp.start()
    try:
        assert exp.probes.return_probes is False
        assert exp.health["return_probes"].view()[:2] == ("disabled", "self-test failed to run: boom")
    finally:
        exp.close()
