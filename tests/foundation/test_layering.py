"""docs/ARCHITECTURE.md's layering, enforced: import-linter's contracts (.importlinter: the house's
layers and the capture plane's, hooks stdlib-only, gpulens.capture.analysis free of aiohttp and kopf),
and no import circle among first-party modules (TYPE_CHECKING imports included). Both checks are
shown to catch a planted fault (an import against the layers, a circle), so neither can pass by
finding nothing.

grimp (and so import-linter) finds a package by walking its one folder; in a checkout the planes sit
beside gpulens/ (pyproject.toml maps them), so every check here reads the sources as they install,
staged by tests/package_tree.py."""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests import package_tree
from tests.conftest import REPO, VENV_BIN

PACKAGES = ("gpulens",)


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


PY_ONLY = shutil.ignore_patterns("__pycache__", "*.json", "*.yml", "*.yaml", "*.md", "*.c", "*.txt", "*.html", "*.so")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The sources as they install (gpulens/capture, gpulens/exporter, ...), Python files only."""
    return package_tree.stage(tmp_path_factory.mktemp("installed") / "src", ignore=PY_ONLY)


@contextlib.contextmanager
def graph_of(src, *names, **kwargs):
    """grimp's graph of `names` as found under `src`: `gpulens` is hidden from sys.modules meanwhile,
    since grimp asks importlib where a package lives and this process imported the checkout's."""
    saved = {n: sys.modules.pop(n) for n in ("gpulens",) if n in sys.modules}
    sys.path.insert(0, str(src))
    try:
        yield grimp.build_graph(*names, cache_dir=None, **kwargs)
    finally:
        sys.path.remove(str(src))
        sys.modules.update(saved)


def lint_imports(cwd, src) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(VENV_BIN / "lint-imports"), "--config", str(REPO / ".importlinter"), "--no-cache"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_staged_tree_holds_every_module_of_the_checkout(installed):
    """A folder the mapping missed would leave its modules out of every check below."""
    staged = {p.relative_to(installed).as_posix() for p in installed.rglob("*.py")}
    expected = {f"{name.replace('.', '/')}/{p.relative_to(REPO / folder).as_posix()}"
                for name, folder in package_tree.package_dirs().items() for p in (REPO / folder).rglob("*.py")
                if "__pycache__" not in p.parts}
    assert staged == expected and any(s.startswith("gpulens/capture/agent/") for s in staged)


def test_import_linter_contracts_are_kept(installed):
    done = lint_imports(installed.parent, installed)
    assert done.returncode == 0 and "0 broken" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    contracts = open(REPO / ".importlinter").read().count("[importlinter:contract:")
    assert f"{contracts} kept" in done.stdout  # every contract in the file was checked


def test_a_planted_import_against_the_capture_layers_breaks_the_contract(tmp_path):
    """The wire room (the bottom layer) made to import the coordinator, in a copy of the sources that
    lint-imports finds first on its path: only `capture-layers` breaks, and it names the import."""
    src = package_tree.stage(tmp_path / "src", ignore=PY_ONLY)
    labels = src / "gpulens" / "capture" / "wire" / "labels.py"
    labels.write_text(labels.read_text() + "\nfrom gpulens.capture.coordinator import events  # planted\n")
    done = lint_imports(tmp_path, src)
    out = done.stdout
    assert done.returncode != 0 and "1 broken" in out, out[-3000:] + done.stderr[-2000:]
    assert "gpulens.capture.wire.labels -> gpulens.capture.coordinator.events" in out, out[-3000:]
    broken = [line for line in out.splitlines() if line.endswith("BROKEN")]
    assert len(broken) == 1 and "capture plane" in out.split("BROKEN")[0].rsplit("KEPT", 1)[-1], out[-3000:]


def test_no_import_circles(installed):
    with graph_of(installed, *PACKAGES) as graph:
        found = circles(graph, set(graph.modules))
    assert found == [], found


def test_hooks_import_only_the_standard_library(installed):
    with graph_of(installed, "gpulens", include_external_packages=True) as graph:
        pass
    hooks = {m for m in graph.modules if m == "gpulens.hooks" or m.startswith("gpulens.hooks.")}
    imported = set().union(*(graph.find_modules_directly_imported_by(m) for m in hooks))
    external = {m for m in imported if not m.startswith("gpulens.hooks")}
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


def site_imports(folder: Path) -> dict[str, set[str]]:
    """The top-level module names each trainer-side file of `folder` imports, at any depth (a lazy import
    inside a function runs in the trainer as surely as one at the top)."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[path.name] = names
    return found


def not_stdlib(folder: Path) -> dict[str, list[str]]:
    """Per file, what it imports that is neither the standard library nor a sibling in `folder`."""
    own = {p.stem for p in folder.glob("*.py")}
    allowed = set(sys.stdlib_module_names) | own | {"__future__"}
    return {f: sorted(n - allowed) for f, n in site_imports(folder).items() if n - allowed}


def test_the_trainer_side_hook_files_import_only_the_standard_library():
    """What trainer images import is hooks/site/ (sitecustomize and its `_gpulens_*` siblings, put on the
    trainer's PYTHONPATH), not gpulens.hooks: the contract above cannot see those files (a folder of
    top-level modules, no package), so they are read here, every import at every depth (issue 43)."""
    site = REPO / "hooks" / "site"
    assert {"sitecustomize.py", "_gpulens_hook.py", "_gpulens_steps.py"} <= set(site_imports(site))
    assert not_stdlib(site) == {}


def test_a_planted_third_party_import_in_the_trainer_side_files_is_found(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(REPO / "hooks" / "site", site, ignore=shutil.ignore_patterns("__pycache__"))
    steps = site / "_gpulens_steps.py"
    steps.write_text(steps.read_text() + "\n\ndef _planted():\n    import numpy.linalg  # planted\n")
    hook = site / "_gpulens_hook.py"
    hook.write_text(hook.read_text() + "\nfrom gpulens.capture import wire  # planted\n")
    assert not_stdlib(site) == {"_gpulens_steps.py": ["numpy"], "_gpulens_hook.py": ["gpulens"]}
