"""CUDA graph accounting in the BPF program, exact on the stand-in (real uprobes, real bcc).

N graphs of K kernels, each launched once per step for R steps, must give N*R graph launches and
N*K*R graph kernels, built by every route the stand-in offers (stream capture in its three entry
points, kernel nodes, capture into an existing graph, child graphs, clones), while the launches
made during capture are not counted as launches. What cannot be known is counted as unknown.
"""

from __future__ import annotations

import pytest

from gpulens.exporter.retprobe_gate import GateVerdict
from gpulens.exporter.service import Exporter

from .conftest import make_config, registration, requires_ebpf, scrape, value, wait_for

pytestmark = requires_ebpf

WAYS = ("capture", "capture_v1", "capture_ptsz", "nodes", "to_graph", "child", "clone")




def attached(exp: Exporter) -> None:
    wait_for(lambda: (exp.tick(), exp.probes.libraries)[1], what="library attached")


def run(exp, workloads, libcuda, reg, pod, *args):
    w = workloads(libcuda, *args)
    registration(reg, w.pid, pod)
    attached(exp)
    w.go()
    rep = w.report()
    # the process's series appear once it is settled (its registration record read at a tick)
    s = wait_for(lambda: (lambda s: s if value(s, "gpulens_graph_launches_total", pod=pod) is not None
                          or value(s, "gpulens_kernel_launches_total", pod=pod) is not None else None)(scrape(exp)),
                 what=f"series of pod {pod}")
    return w, rep, s


@pytest.mark.parametrize("multi_links", [True, False], ids=["multi-link", "perf-events"])
def test_n_graphs_of_k_kernels_replayed_r_times(libcuda, workloads, exporter_for, tmp_path, multi_links):
    n, k, r, plain = len(WAYS), 5, 40, 3
    reg = tmp_path / "registry"
    exp = exporter_for(make_config(tmp_path, libcuda, registry_dir=reg))
    if not multi_links:
        exp.probes.multi_links = False
    w, rep, s = run(exp, workloads, libcuda, reg, "graphs", "--steps", str(r), "--kernels", str(plain),
                    "--launch-api", "mix", "--graphs", str(n), "--graph-kernels", str(k), "--graph-build", "mix")
    assert rep["graph_kernels"] == n * k * r and rep["captured_launches"] > 0
    assert value(s, "gpulens_graph_launches_total", pod="graphs") == n * r
    assert value(s, "gpulens_graph_kernels_total", pod="graphs") == n * k * r
    assert value(s, "gpulens_graph_unknown_launches_total", pod="graphs") == 0
    # launches made while capturing were recorded into graphs, not run: only the plain ones count
    assert value(s, "gpulens_kernel_launches_total", pod="graphs") == plain * r == rep["launches"]
    assert exp.probes.read()[0].captured == rep["captured_launches"]
    w.finish()
    exp.tick()
    s = scrape(exp)
    assert value(s, "gpulens_graph_kernels_total", pod="graphs") == n * k * r         # kept after exit
    assert value(s, "gpulens_exporter_map_entries", map="graphs") == 0                  # and its graphs forgotten


@pytest.mark.parametrize("way", WAYS)
def test_every_way_of_building_a_graph_counts_its_kernels(libcuda, workloads, exporter_for, tmp_path, way):
    reg = tmp_path / "registry"
    exp = exporter_for(make_config(tmp_path, libcuda, registry_dir=reg))
    w, rep, s = run(exp, workloads, libcuda, reg, "one-way", "--steps", "3", "--kernels", "0", "--graphs", "2",
                    "--graph-kernels", "6", "--graph-build", way)
    assert value(s, "gpulens_graph_kernels_total", pod="one-way") == rep["graph_kernels"] == 2 * 6 * 3
    assert (value(s, "gpulens_kernel_launches_total", pod="one-way") or 0) == 0
    w.finish()


def test_conditional_graphs_count_as_unknown_never_guessed(libcuda, workloads, exporter_for, tmp_path):
    reg = tmp_path / "registry"
    exp = exporter_for(make_config(tmp_path, libcuda, registry_dir=reg))
    w, rep, s = run(exp, workloads, libcuda, reg, "cond", "--steps", "10", "--kernels", "2", "--graphs", "3",
                    "--graph-kernels", "4", "--graph-build", "mix", "--graph-conditional")
    assert value(s, "gpulens_graph_launches_total", pod="cond") == 30
    assert value(s, "gpulens_graph_unknown_launches_total", pod="cond") == rep["graph_unknown"] == 30
    assert value(s, "gpulens_graph_kernels_total", pod="cond") == 0
    assert value(s, "gpulens_kernel_launches_total", pod="cond") == 20
    w.finish()


def test_updated_executable_graphs_are_unknown(libcuda, workloads, exporter_for, tmp_path):
    reg = tmp_path / "registry"
    exp = exporter_for(make_config(tmp_path, libcuda, registry_dir=reg))
    w, rep, s = run(exp, workloads, libcuda, reg, "updated", "--steps", "10", "--kernels", "1", "--graphs", "2",
                    "--graph-kernels", "4", "--graph-update")
    assert value(s, "gpulens_graph_unknown_launches_total", pod="updated") == rep["graph_unknown"] == 20
    assert value(s, "gpulens_graph_kernels_total", pod="updated") == 0
    w.finish()


def test_graphs_built_before_the_exporter_attached_are_unknown(libcuda, workloads, exporter_for, tmp_path):
    reg = tmp_path / "registry"
    exp = exporter_for(make_config(tmp_path, libcuda, registry_dir=reg))
    w, rep, s = run(exp, workloads, libcuda, reg, "early", "--steps", "10", "--kernels", "2", "--graphs", "2",
                    "--graph-kernels", "4", "--graphs-early")
    assert value(s, "gpulens_graph_launches_total", pod="early") == 20
    assert value(s, "gpulens_graph_unknown_launches_total", pod="early") == 20
    assert value(s, "gpulens_graph_kernels_total", pod="early") == 0
    w.finish()


def test_without_return_probes_captures_still_do_not_count_and_graphs_are_unknown(libcuda, workloads,
                                                                                   exporter_for, tmp_path):
    reg = tmp_path / "registry"
    exp = exporter_for(make_config(tmp_path, libcuda, registry_dir=reg),
                       return_probe_gate=lambda _p: GateVerdict(False, "forced by the test", "t"))
    w, rep, s = run(exp, workloads, libcuda, reg, "noret", "--steps", "10", "--kernels", "3", "--graphs", "2",
                    "--graph-kernels", "5", "--graph-build", "capture")
    assert value(s, "gpulens_kernel_launches_total", pod="noret") == rep["launches"] == 30
    assert value(s, "gpulens_graph_unknown_launches_total", pod="noret") == 20
    assert value(s, "gpulens_graph_kernels_total", pod="noret") == 0
    w.finish()
