"""Small typed descriptions of panels, and their translation to grafana-foundation-sdk builders.

The dashboards are declared as data (rows of PanelSpec) so that tests can walk every query
without knowing Grafana's JSON model, and the SDK handles the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from grafana_foundation_sdk.builders import annotationslist, prometheus, table, timeseries
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm

__all__ = ["Query", "PanelSpec", "CapturesSpec", "Row", "DATASOURCE", "GRAFANA", "layout"]

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
GRAFANA = dm.DataSourceRef(type_val="grafana", uid="-- Grafana --")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"      # timeseries | table
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    threshold: float | None = None  # a dashed red line, e.g. the alert threshold
    stack: bool = False


@dataclass(frozen=True)
class CapturesSpec:
    """A list of capture annotations (tag query) whose texts link to the analysis reports."""

    title: str
    description: str
    tags: tuple[str, ...]
    width: int = 24
    height: int = 7


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[PanelSpec | CapturesSpec, ...]


def _targets(spec: PanelSpec):
    out = []
    for i, q in enumerate(spec.queries):
        t = prometheus.Dataquery().expr(q.expr).legend_format(q.legend or "__auto").ref_id(chr(ord("A") + i))
        out.append(t.instant() if q.instant else t.range())
    return out


def _timeseries(spec: PanelSpec):
    p = (timeseries.Panel().title(spec.title).description(spec.description).datasource(DATASOURCE)
         .unit(spec.unit).targets(_targets(spec)).line_width(1).fill_opacity(10 if not spec.stack else 60)
         .span_nulls(False)
         .legend(cb.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.TABLE)
                 .placement(common.LegendPlacement.BOTTOM).calcs(["lastNotNull", "max"]))
         .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)))
    if spec.stack:
        p = p.stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL))
    if spec.min is not None:
        p = p.min(spec.min)
    if spec.max is not None:
        p = p.max(spec.max)
    if spec.threshold is not None:
        p = (p.thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps([
                dm.Threshold(value=None, color="transparent"), dm.Threshold(value=spec.threshold, color="red")]))
             .thresholds_style(cb.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.DASHED)))
    return p


def _table(spec: PanelSpec):
    return (table.Panel().title(spec.title).description(spec.description).datasource(DATASOURCE)
            .unit(spec.unit).targets(_targets(spec)).show_header(True))


def _captures(spec: CapturesSpec):
    return (annotationslist.Panel().title(spec.title).description(spec.description)
            .only_from_this_dashboard(False).only_in_time_range(True).tags(list(spec.tags))
            .limit(50).show_user(False).show_time(True).show_tags(True)
            .navigate_to_panel(False).navigate_before("10m").navigate_after("10m"))


def layout(dashboard: db.Dashboard, rows: tuple[Row, ...]) -> db.Dashboard:
    """Place rows and panels on Grafana's 24-column grid with stable ids."""
    next_id, y = 1, 0
    for row in rows:
        dashboard = dashboard.with_row(db.Row(row.title).id(next_id).grid_pos(dm.GridPos(h=1, w=24, x=0, y=y)))
        next_id, y, x, row_h = next_id + 1, y + 1, 0, 0
        for spec in row.panels:
            if x + spec.width > 24:
                x, y = 0, y + row_h
                row_h = 0
            if isinstance(spec, CapturesSpec):
                panel = _captures(spec)
            else:
                panel = _table(spec) if spec.kind == "table" else _timeseries(spec)
            dashboard = dashboard.with_panel(
                panel.id(next_id).grid_pos(dm.GridPos(h=spec.height, w=spec.width, x=x, y=y)))
            next_id, x, row_h = next_id + 1, x + spec.width, max(row_h, spec.height)
        y += row_h
    return dashboard
