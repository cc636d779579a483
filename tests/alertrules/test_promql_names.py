"""The metric-name extractor used to hold rules and dashboards to the exporter's catalogue."""

from __future__ import annotations

import pytest

from gpulens.alertrules import promql


@pytest.mark.parametrize("expr, names", [
    ('sum by (a, b) (rate(x_total{job="a:b", le=~"1|2"}[5m] offset 1h)) / on(a) group_left(c) y', {"x_total", "y"}),
    ('sum(rate({__name__="foo_total", pod="p"}[1m]))', {"foo_total"}),
    ("max without (gpu) (min_over_time(z[30m:1m]))", {"z"}),
    ("count(up == 1) > bool 3", {"up"}),
    ("sum by (namespace) (x) * 1e6 + 2", {"x"}),
    ('label_replace(a, "dst", "$1", "src", "(.*) sum(rate(q[1m]))")', {"a"}),
    ("time() - timestamp(sum)", {"sum"}),                       # a metric called `sum`
    ("topk(5, sum without (gpu) (rate(m[5m])))", {"m"}),
    ("ns:rec:rate5m / ignoring (direction) ns_dir:rec:rate5m offset 10m", {"ns:rec:rate5m", "ns_dir:rec:rate5m"}),
    ("sum (rate(a[5m])) by (pod)", {"a"}),
    ("1 + 2", set()),
])
def test_metric_names(expr, names):
    assert promql.metric_names(expr) == names


def test_an_unknown_metric_is_visible():
    used = promql.metric_names("rate(gpulens_kernel_launches_total[5m]) / gpulens_made_up_total")
    assert used - promql.catalogue_metrics() == {"gpulens_made_up_total"}


def test_catalogue_is_the_exporters():
    names = promql.catalogue_metrics()
    assert "gpulens_kernel_launches_total" in names and "gpulens_gpu_pods" in names
    assert all(n.startswith("gpulens_") for n in names)
