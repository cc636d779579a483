"""Which rank holds the others up: a hang read from every rank's Flight Recorder dump (issue 45).

Input: one dump per rank as the trainer hook writes it (hooks/site/_gpulens_flight.py, schema
`flight_recorder`): per process group, the ring of its last collectives with `collective_seq_id`,
op (`profiling_name`), sizes, `retired` (completed) and the calling Python frames, and the group's
`pg_status` (last enqueued and completed sequence ids). Per process group it finds:

- the frontier: the highest sequence id any rank entered;
- the ranks waiting there (entered it, not completed) and the ranks that never entered it: those
  hold the others up;
- the sequence ids at which ranks called different collectives (op or sizes), earliest first: a
  desync hangs the same way and is named as such.

torch ships an analyzer (`torch.distributed.flight_recorder.fr_trace`), but with torch 2.13 it
raises `KeyError: ('0', 0)` on a gloo job's default group (its `pg_config` is keyed by the group's
empty description, its entries name the group `'0'`), and by its own docstring it checks neither
the collectives' states nor who never entered; this reads the entries and states directly.
Each rank's stacks, read from outside its process by the agent (capture/agent/stacks.py, schema
`python_stacks`), say where it is *now*: the frame of the thread holding the GIL, else of the
main thread. They name a rank the dumps cannot: one whose thread holds the GIL writes no dump
(no thread of the hook can run in it), yet its stack is read.
Pure: dumps and stacks in, a dict out (summary JSON and the report render it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Call", "calls_of", "evidence_report", "hang_report", "where_now"]


@dataclass(frozen=True)
class Call:
    """One collective one rank entered."""

    rank: int
    group: str
    seq: int
    op: str
    input_sizes: list
    output_sizes: list
    completed: bool
    frame: str | None        # the caller's innermost frame outside torch: "file:line (function)"

    def signature(self) -> tuple:
        return self.op, repr(self.input_sizes), repr(self.output_sizes)


def _frame(frames: list | None) -> str | None:
    """The innermost frame of the program itself (not torch's own wrappers)."""
    own = [f for f in frames or [] if isinstance(f, dict) and "/torch/" not in str(f.get("filename", ""))]
    if not own:
        return None
    f = own[0]           # torch lists the innermost frame first
    return f"{f.get('filename')}:{f.get('line')} ({f.get('name')})"


def calls_of(rank: int, dump: dict) -> list[Call]:
    """The collectives (not point-to-point) in one rank's dump, by group and sequence id."""
    out = []
    for e in dump.get("entries") or []:
        if not isinstance(e, dict) or e.get("is_p2p") or e.get("collective_seq_id") is None:
            continue
        group = e.get("process_group")
        group = str(group[0] if isinstance(group, list) and group else e.get("pg_id", group))
        completed = bool(e.get("retired")) or e.get("state") == "completed"
        out.append(Call(rank, group, int(e["collective_seq_id"]), str(e.get("profiling_name") or "?"),
                        e.get("input_sizes") or [], e.get("output_sizes") or [], completed, _frame(e.get("frames"))))
    return sorted(out, key=lambda c: (c.group, c.seq))


def _status(dump: dict, group: str) -> tuple[int | None, int | None]:
    """(last entered, last completed) sequence ids from the group's pg_status, where torch gives them."""
    st = (dump.get("pg_status") or {}).get(group) or {}
    def num(key):
        try:
            value = int(st.get(key))
        except (TypeError, ValueError):
            return None
        return value if value >= 0 else None
    return num("last_enqueued_collective"), num("last_completed_collective")


def where_now(stacks: dict | None) -> str | None:
    """Where a process is now, from its `python_stacks` document: the innermost frame of the
    thread holding the GIL (it is the one running Python), else of the main thread, else of the
    first thread with a frame; "file:line (function)", with "holding the GIL" when it does."""
    threads = [t for t in (stacks or {}).get("threads") or [] if isinstance(t, dict) and t.get("frames")]
    pick = (next((t for t in threads if t.get("owns_gil")), None)
            or next((t for t in threads if t.get("name") == "MainThread"), None)
            or (threads[0] if threads else None))
    if pick is None:
        return None
    f = pick["frames"][0]        # py-spy lists the innermost frame first
    return (f"{f.get('filename')}:{f.get('line')} ({f.get('name')})"
            + (", holding the GIL" if pick.get("owns_gil") else ""))


def hang_report(dumps: dict[int, dict], world_size: int | None = None, where: dict[int, str] | None = None,
                stacks: dict[int, dict] | None = None) -> dict:
    """The hang, per process group, and one verdict line. `dumps`: rank -> dump (ranks without one
    are listed as such); `world_size`: the job's, when known (else the dumps'); `where`: rank ->
    "pod <name> on node <name>", for the verdict; `stacks`: rank -> its `python_stacks` document."""
    now = {r: w for r, w in ((r, where_now(doc)) for r, doc in (stacks or {}).items()) if w}
    world = world_size or max((int(d.get("world_size") or 0) for d in dumps.values()), default=0) or len(dumps)
    missing_dumps = sorted(set(range(world)) - set(dumps))
    calls = {r: calls_of(r, d) for r, d in dumps.items()}
    groups = sorted({c.group for cs in calls.values() for c in cs})
    out_groups = []
    for g in groups:
        per_rank = {}
        for r, d in sorted(dumps.items()):
            mine = [c for c in calls[r] if c.group == g]
            entered, completed = _status(d, g)
            entered = max([c.seq for c in mine] + ([entered] if entered is not None else []), default=None)
            done = [c.seq for c in mine if c.completed]
            completed = max(done + ([completed] if completed is not None else []), default=None)
            last = max(mine, key=lambda c: c.seq, default=None)
            per_rank[r] = {"last_entered": entered, "last_completed": completed,
                           "op": last.op if last else None, "frame": last.frame if last else None,
                           "now_at": now.get(r)}
        frontier = max((v["last_entered"] for v in per_rank.values() if v["last_entered"] is not None), default=None)
        waiting = sorted(r for r, v in per_rank.items() if frontier is not None and v["last_entered"] == frontier
                         and (v["last_completed"] is None or v["last_completed"] < frontier))
        behind = sorted(r for r, v in per_rank.items() if frontier is not None
                        and (v["last_entered"] is None or v["last_entered"] < frontier))
        mismatches = _mismatches([c for cs in calls.values() for c in cs if c.group == g])
        op = next((per_rank[r]["op"] for r in waiting), None)
        out_groups.append({"group": g, "frontier_seq": frontier, "op": op, "waiting": waiting, "behind": behind,
                           "mismatches": mismatches, "ranks": {str(r): v for r, v in per_rank.items()}})
    return {"ranks_with_dumps": sorted(dumps), "ranks_without_dumps": missing_dumps, "groups": out_groups,
            "ranks_with_stacks": sorted(now), "now_at": {str(r): w for r, w in sorted(now.items())},
            **_finding(out_groups, missing_dumps, where or {}, now)}


def evidence_report(evidence: list[dict], world_size: int | None = None, where: dict[int, str] | None = None) -> dict:
    """`hang_report` over the agent's per-rank `hang_evidence` documents (one per archived target),
    with what each rank's missing half was missing for (`missing`: rank -> {"dump": reason, ...})."""
    dumps, stacks, missing = {}, {}, {}
    for doc in evidence:
        r = int(doc["rank"])
        fr, st = doc.get("flight_recorder") or {}, doc.get("stacks") or {}
        if fr.get("dump") is not None:
            dumps[r] = fr["dump"]
        else:
            missing.setdefault(str(r), {})["dump"] = f"{fr.get('reason')}: {fr.get('detail') or ''}".strip()
        if st.get("doc") is not None:
            stacks[r] = st["doc"]
        else:
            missing.setdefault(str(r), {})["stacks"] = f"{st.get('reason')}: {st.get('detail') or ''}".strip()
    report = hang_report(dumps, world_size=world_size, where=where, stacks=stacks)
    report["missing"] = missing
    return report


def _mismatches(calls: list[Call]) -> list[dict]:
    by_seq: dict[int, dict[int, Call]] = {}
    for c in calls:
        by_seq.setdefault(c.seq, {})[c.rank] = c
    out = []
    for seq in sorted(by_seq):
        ranks = by_seq[seq]
        if len({c.signature() for c in ranks.values()}) > 1:
            out.append({"seq": seq, "calls": {str(r): {"op": c.op, "input_sizes": c.input_sizes,
                                                       "output_sizes": c.output_sizes}
                                              for r, c in sorted(ranks.items())}})
    return out


def _finding(groups: list[dict], missing_dumps: list[int], where: dict[int, str], now: dict[int, str]) -> dict:
    """`verdict`: the one line; `finding`: the same in fields (kind, the suspect ranks, the group,
    collective and sequence id, each suspect's last collective frame and where it is now)."""
    line, kind, ranks, g = _verdict(groups, missing_dumps, where, now)
    finding: dict = {"kind": kind, "ranks": ranks, "group": None, "op": None, "seq": None, "ops": None, "frames": {},
                     "now_at": {str(r): now[r] for r in ranks if r in now}}
    if g is not None:
        finding.update(group=g["group"], op=g["op"], seq=g["frontier_seq"],
                       frames={str(r): g["ranks"][str(r)]["frame"] for r in ranks if str(r) in g["ranks"]})
        if kind == "desync":
            m = g["mismatches"][0]
            finding.update(seq=m["seq"], op=None, ops={r: c["op"] for r, c in m["calls"].items()})
    return {"verdict": line, "finding": finding}


def _verdict(groups: list[dict], missing_dumps: list[int], where: dict[int, str], now: dict[int, str]
             ) -> tuple[str, str, list[int], dict | None]:
    def at(r: int) -> str:
        return f"rank {r}" + (f" ({where[r]})" if r in where else "")

    def is_now(ranks: list[int]) -> str:
        seen = [f"rank {r} is now at {now[r]}" for r in ranks if r in now]
        return f"; {'; '.join(seen)}" if seen else ""
    for g in groups:
        if g["mismatches"]:
            m = g["mismatches"][0]
            ops = "; ".join(f"rank {r} calls {c['op']} {c['input_sizes']}" for r, c in m["calls"].items())
            return (f"process group {g['group']}: the ranks disagree at collective_seq_id {m['seq']}: {ops}",
                    "desync", sorted(int(r) for r in m["calls"]), g)
    for g in groups:
        if g["waiting"] and g["behind"]:
            lagging = ", ".join(at(r) for r in g["behind"])
            frames = "; ".join(f"rank {r} last at {g['ranks'][str(r)]['frame'] or 'an unknown frame'} "
                               f"(collective_seq_id {g['ranks'][str(r)]['last_entered']})" for r in g["behind"])
            return (f"{lagging} never entered {g['op']} collective_seq_id {g['frontier_seq']} of process group "
                    f"{g['group']}, which ranks {g['waiting']} wait in; {frames}{is_now(g['behind'])}",
                    "never_entered", list(g["behind"]), g)
    if missing_dumps:
        waited = next((g for g in groups if g["waiting"]), None)
        if waited is not None and any(r in now for r in missing_dumps):
            # a rank that wrote no dump while the others wait: the likeliest holder, and its stack says where
            return (f"{', '.join(at(r) for r in missing_dumps)} wrote no Flight Recorder dump while ranks "
                    f"{waited['waiting']} wait in {waited['op']} collective_seq_id {waited['frontier_seq']} of process "
                    f"group {waited['group']}{is_now(missing_dumps)}", "no_dump", list(missing_dumps), waited)
        return (f"no Flight Recorder dump from ranks {missing_dumps}: the rank that holds the others up may be among "
                f"them{is_now(missing_dumps)}", "no_dump", list(missing_dumps), None)
    for g in groups:
        if g["waiting"]:
            return (f"every rank entered {g['op']} collective_seq_id {g['frontier_seq']} of process group {g['group']} "
                    f"and none completed it: the collective itself is stuck (network or device), not a rank",
                    "stuck_collective", [], g)
    return "no collective is pending on any rank: not a collective hang", "no_pending_collective", [], None
