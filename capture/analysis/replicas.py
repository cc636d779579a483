"""Serving captures (issue 30): the affected replica against the healthy peer captured with it.

A capture of a serving revision names the pods an alert was about (`request.pods`) and takes
healthy peers of the same revision with it. Both are measured like any rank (evidence.py), in the
same wall-clock window, so the peer is the affected replica's comparison: what the job baseline is
for a training job. `compare` pairs each affected worker with the peer worker of the same local
position, lists per operator and kernel the time (and time per call, GPU kernels when the trace
has them) on both sides, and `as_baseline` hands the peer's evidence to the verdicts under the
affected ranks' numbers, so noisy_neighbor / host_sync / input_starvation are judged against the
peer. Pure over JSON already in summary.json.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compare", "as_baseline", "affected_evidence", "TOP_OPERATORS"]

TOP_OPERATORS = 15


def _by_pod(ranks: list[dict[str, Any]], evidence: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """pod -> its workers' evidence rows, in rank order (their local order)."""
    pod_of = {r["rank"]: r.get("pod") for r in ranks}
    out: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(evidence, key=lambda e: e["rank"]):
        pod = pod_of.get(row["rank"])
        if pod:
            out.setdefault(pod, []).append(row)
    return out


def _pairs(request: Any, ranks: list[dict[str, Any]], evidence: list[dict[str, Any]] | None):
    named = request.get("pods") if isinstance(request, dict) else None
    if not named or not evidence:
        return None
    by_pod = _by_pod(ranks, evidence)
    affected = [p for p in named if p in by_pod]
    peers = sorted(p for p in by_pod if p not in named)
    pairs = []
    if peers:
        peer = by_pod[peers[0]]
        for pod in affected:
            for i, row in enumerate(by_pod[pod]):
                if i < len(peer):
                    pairs.append((pod, row, peers[0], peer[i]))
    return list(named), affected, peers, pairs


def _per_call(us: float | None, calls: float | None) -> float | None:
    return round(us / calls, 3) if us is not None and calls else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(request: Any, ranks: list[dict[str, Any]], evidence: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The summary's `replicas` section; None for a capture that names no pods (training, or all replicas)."""
    found = _pairs(request, ranks, evidence)
    if found is None:
        return None
    named, affected, peers, pairs = found
    out: dict[str, Any] = {"affected_pods": named, "peer_pods": peers, "pairs": [], "operators": [], "why": ""}
    if not affected:
        out["why"] = f"no worker of {', '.join(named)} was analysed: nothing to compare"
        return out
    if not pairs:
        out["why"] = "no healthy peer was analysed with it: the verdicts fall back to the job's baseline, if any"
        return out
    rows = []
    for pod, a, peer_pod, p in pairs:
        out["pairs"].append({"rank": a["rank"], "pod": pod, "peer_rank": p["rank"], "peer_pod": peer_pod,
                             "unit": a["profile_unit"], "gpu": bool(a["gpu"] and p["gpu"]),
                             "kernel_us": a["kernel_us"], "peer_kernel_us": p["kernel_us"],
                             "kernel_ratio": _ratio(a["kernel_us"], p["kernel_us"]),
                             "host_blocking_us": a["host_blocking"]["total_us"],
                             "peer_host_blocking_us": p["host_blocking"]["total_us"]})
        if a["profile_unit"] != p["profile_unit"]:
            continue
        theirs = {(q["kind"], q["name"]): q for q in p["profile"]}
        for q in a["profile"]:
            o = theirs.get((q["kind"], q["name"]))
            us, peer_us = q["us"], (o["us"] if o else 0.0)
            rows.append({"rank": a["rank"], "kind": q["kind"], "name": q["name"], "unit": a["profile_unit"],
                         "us": us, "peer_us": peer_us, "delta_us": round((us or 0.0) - (peer_us or 0.0), 3),
                         "calls": q["calls"], "peer_calls": o["calls"] if o else 0.0,
                         "us_per_call": _per_call(us, q["calls"]),
                         "peer_us_per_call": _per_call(peer_us, o["calls"]) if o else None,
                         "per_call_ratio": _ratio(_per_call(us, q["calls"]),
                                                  _per_call(peer_us, o["calls"]) if o else None)})
    rows.sort(key=lambda r: -r["delta_us"])
    out["operators"] = rows[:TOP_OPERATORS]
    top = out["operators"][0] if out["operators"] else None
    gpu = all(x["gpu"] for x in out["pairs"])
    out["why"] = (f"{affected[0]} against healthy peer {peers[0]}, same window"
                  + ("" if gpu else "; CPU-only trace: no GPU kernel time to compare")
                  + (f"; largest difference: {top['kind']} {top['name']} +{top['delta_us'] / 1000:.2f} ms per "
                     f"{top['unit']}" if top and top["delta_us"] > 0 else "; nothing takes longer than on the peer"))
    return out


def affected_evidence(request: Any, ranks: list[dict[str, Any]], evidence: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evidence rows of the named pods' workers (what the verdicts judge)."""
    found = _pairs(request, ranks, evidence)
    if found is None or not found[3]:
        return evidence
    keep = {a["rank"] for _, a, _, _ in found[3]}
    return [e for e in evidence if e["rank"] in keep]


def as_baseline(request: Any, ranks: list[dict[str, Any]], evidence: list[dict[str, Any]] | None, capture_id: str,
                summary_uri: str) -> dict[str, Any] | None:
    """The peer's evidence under the affected ranks' numbers, shaped as `baselines.latest` returns a
    job baseline (`peer`: captured in the same window, which the CPU-only device checks need);
    None when there is no pair to compare."""
    found = _pairs(request, ranks, evidence)
    if found is None or not found[3]:
        return None
    peer_rows = [{**p, "rank": a["rank"]} for _, a, _, p in found[3]]
    return {"capture_id": f"{capture_id} (healthy peer {found[2][0]}, same capture)", "summary_uri": summary_uri,
            "evidence": peer_rows, "peer": True}
