"""The recorded signals that decide which workload alert fires (alertrules/rules), as text.

For failure messages: when a test finds the wrong alert, or none, the message shows which signal
was off (demand against its baseline, the blocked share against its baseline, bytes by direction),
not only which alert came. Used by the e2e `up` tests and the cluster alert tests.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

#: label shown -> recorded series (alertrules/rules/gpulens-recording.rules.yml)
SIGNALS = {
    "demand/baseline": "namespace_pod:gpulens_launches_per_baseline:ratio_rate5m",
    "blocked share": "namespace_pod:gpulens_sync_wait_seconds:avg_rate5m",
    "blocked share baseline": "namespace_workload:gpulens_sync_wait_seconds:baseline_avg_rate5m",
    # what the share is made of: a share out of line with the step rate shows here as the wrong
    # number of workers, or as too many or too long blocking calls (seconds blocked / calls)
    "workers": "namespace_pod:gpulens_workers:count",
    "blocking calls/s (pod)": "namespace_pod:gpulens_sync_calls:rate5m",
    "blocked s/s (pod)": "namespace_pod:gpulens_sync_wait_seconds:rate5m",
    "bytes/s per worker": "namespace_pod_direction:gpulens_memcpy_bytes_per_worker:rate5m",
    "bytes/s baseline": "namespace_workload_direction:gpulens_memcpy_bytes_per_worker:baseline_rate5m",
}
_SHOWN_LABELS = ("pod", "direction", "gpulens_workload")


def describe(prometheus_url: str, namespace: str | None = None, window: str = "2m", step: str = "5s") -> str:
    """Each signal's series over the last `window`, a value every `step`, one line per series.
    The defaults suit the rules at `up`'s 1/30 time scale (a 5m `for:` lasts 10 s there). Never
    raises: a signal Prometheus cannot answer says so in its line (the message must not hide the
    failure it explains)."""
    selector = f'{{namespace="{namespace}"}}' if namespace else ""
    lines = []
    for name, expr in SIGNALS.items():
        query = urllib.parse.urlencode({"query": f"{expr}{selector}[{window}:{step}]"})
        try:
            with urllib.request.urlopen(f"{prometheus_url}/api/v1/query?{query}", timeout=5) as r:
                result = json.load(r)["data"]["result"]
        except Exception as e:  # noqa: BLE001 - reported in the text instead
            lines.append(f"{name}: unreadable ({e!r})")
            continue
        for series in result:
            labels = ",".join(f"{k}={v}" for k, v in sorted(series["metric"].items()) if k in _SHOWN_LABELS)
            lines.append(f"{name} {{{labels}}}: " + " ".join(f"{float(v):.3g}" for _, v in series["values"]))
    return "\n".join(lines) or "(no series for any signal)"
