"""docs/ARCHITECTURE.md's layering, enforced: import-linter's contracts (.importlinter: exporter
and capture independent, hooks stdlib-only, capture.analysis free of aiohttp and kopf), and no
import circle among first-party modules (TYPE_CHECKING imports included). The circle check is
shown to catch a planted circle, so it cannot pass by finding nothing."""

from __future__ import annotations

import subprocess
import sys

import grimp

from tests.conftest import REPO, VENV_BIN

PACKAGES = ("gpulens", "capture", "exporter", "hooks")


def circles(graph, modules) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1; stack.append(child); on.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child) & modules))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        m = stack.pop(); on.discard(m); group.append(m)
                        if m == node:
                            break
                    if len(group) > 1:
                        out.append(sorted(group))
    return out


def test_import_linter_contracts_are_kept():
    done = subprocess.run([str(VENV_BIN / "lint-imports"), ".importlinter"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "0 broken" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    contracts = open(REPO / ".importlinter").read().count("[importlinter:contract:")
    assert f"{contracts} kept" in done.stdout  # every contract in the file was checked


def test_no_import_circles():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    found = circles(graph, set(graph.modules))
    assert found == [], found


def test_hooks_import_only_the_standard_library():
    graph = grimp.build_graph("hooks", include_external_packages=True, cache_dir=None)
    external = {m for m in graph.modules if not m.startswith("hooks")}
    assert external and external <= set(sys.stdlib_module_names), sorted(external - set(sys.stdlib_module_names))


def test_the_circle_check_finds_a_planted_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("planted", cache_dir=None)
    assert circles(graph, set(graph.modules)) == [["planted.a", "planted.b"]]
