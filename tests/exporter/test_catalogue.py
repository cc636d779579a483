"""The collector emits exactly the catalogue (exporter/metrics.yaml): names, types, labels, units."""

from __future__ import annotations

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from gpulens.exporter.catalogue import CATALOGUE_PATH, load_catalogue
from gpulens.exporter.collector import GpulensCollector, ScrapeData, SourceView, build_families
from gpulens.exporter.ledger import SeriesKey, Totals
from gpulens.exporter.probes import MapUsage


def full_data() -> ScrapeData:
    k = SeriesKey("0", "ns", "pod", "c", "job", "job/job")
    return ScrapeData(
        node="n1",
        sources=[SourceView("ebpf", True, "ok", "probing 1 driver library", 0),
                 SourceView("nvml", False, "disabled", "NVML library not found", 0)],
        workload_totals={k: Totals(launches=5, graph_launches=1, sync_calls=2, sync_seconds=0.5, h2d_bytes=10,
                                   d2h_bytes=20, h2d_calls=1, d2h_calls=2)},
        gpu_pods={"0": 1}, gpu_processes={"0": 1}, gpu_memory={k: 1e9}, gpu_util={k: 0.5},
        gpu_owner={"0": ("ns", "pod", "job", "job/job")},
        dcgm_gauges={(m, "0"): 1.0 for m in ("gpulens_dcgm_gpu_utilization_ratio", "gpulens_dcgm_sm_active_ratio",
                                             "gpulens_dcgm_memory_used_bytes", "gpulens_dcgm_power_watts",
                                             "gpulens_dcgm_temperature_celsius")},
        dcgm_pcie={("0", "tx"): 3.0, ("0", "rx"): 4.0},
        probes_attached=31, libraries_attached=1, attach_errors=0, tracked_processes=1,
        maps=[MapUsage("procs", 1, 16384, 0), MapUsage("inflight", 0, 65536, 0)])


def test_every_catalogue_metric_is_emitted_with_its_type_and_labels():
    cat = load_catalogue()
    registry = CollectorRegistry()
    collector = GpulensCollector(full_data, cat)
    registry.register(collector)
    list(collector.collect())                    # one scrape so scrape_duration is known
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for spec in cat.specs.values():
        base = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        assert base in families, spec.name
        fam = families[base]
        assert fam.type == spec.type, spec.name
        assert fam.samples, spec.name
        for sample in fam.samples:
            assert sample.name == spec.name, (sample.name, spec.name)
            assert set(sample.labels) == set(spec.labels), (spec.name, sample.labels)
    assert set(families) == {s.name.removesuffix("_total") if s.type == "counter" else s.name
                             for s in cat.specs.values()}


def test_catalogue_follows_prometheus_conventions():
    raw = yaml.safe_load(CATALOGUE_PATH.read_text())["metrics"]
    names = [m["name"] for m in raw]
    assert len(names) == len(set(names))
    for m in raw:
        assert m["name"].startswith("gpulens_")
        assert "pid" not in m.get("labels", [])
        if m["type"] == "counter":
            assert m["name"].endswith("_total")
        if m.get("unit"):
            assert m["name"].removesuffix("_total").endswith("_" + m["unit"]), m["name"]
        assert m["source"] in ("ebpf", "nvml", "dcgm", "self")


def test_openmetrics_exposition_carries_units():
    registry = CollectorRegistry()
    registry.register(GpulensCollector(full_data, load_catalogue()))
    text = generate_openmetrics(registry).decode()
    assert "# UNIT gpulens_sync_wait_seconds seconds" in text
    assert text.rstrip().endswith("# EOF")


def test_unknown_metric_or_wrong_label_count_fails_loudly():
    cat = load_catalogue()
    with pytest.raises(KeyError):
        cat.family("gpulens_not_in_catalogue")
    fam = cat.family("gpulens_gpu_pods")
    with pytest.raises(ValueError, match="label values"):
        fam.add(["n1"], 1)


def test_sources_off_emit_no_empty_families():
    data = ScrapeData(node="n1", sources=[SourceView("ebpf", False, "disabled", "x", 0)])
    names = {f.name for f in build_families(data, load_catalogue(), None)}
    assert "gpulens_kernel_launches" not in names and "gpulens_gpu_pods" not in names
    assert "gpulens_exporter_scrape_duration_seconds" not in names     # no previous scrape yet
    assert "gpulens_exporter_source_up" in names
