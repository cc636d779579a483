"""CPU operator breakdown: the ATen ops that took the most (inclusive) CPU time, per rank.

Inclusive time: a parent op's duration contains its children's, so the column ranks hot spots but
does not add up to wall time.
"""

from __future__ import annotations

from .base import Analysis, num

TOP_OPS = 15


def applies(contents):
    return None if contents.cpu_op_ranks else "no cpu_op events in the analysed traces"


def run(ta, contents):
    t = ta.t
    names = t.symbol_table.get_sym_table()
    cpu_op = t.symbol_table.get_sym_id_map()["cpu_op"]
    top = []
    for rank in contents.cpu_op_ranks:
        df = t.get_trace(rank)
        ops = df[df["cat"] == cpu_op].groupby("name")["dur"].agg(["count", "sum", "mean"])
        for name_id, r in ops.sort_values("sum", ascending=False).head(TOP_OPS).iterrows():
            top.append({"rank": int(rank), "name": names[int(name_id)], "count": int(r["count"]),
                        "total_us": num(r["sum"]), "mean_us": num(r["mean"])})
    return {"time": "inclusive", "top_ops": top}


ANALYSIS = Analysis("cpu_op_breakdown", "CPU operator breakdown", applies, run)
